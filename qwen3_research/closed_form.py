"""The memory plan's closed form: bytes per rank by formula, a cross-check of the trace (``planner``) and the
screen ``plan --fit`` applies before tracing (``fit``); with parallelism.pp > 1, of the largest pipeline rank."""

from __future__ import annotations

from qwen3_research import lora_params, models, parallel
from qwen3_research.resolve import ResolvedRun


def estimate(run: ResolvedRun) -> dict:
    """Bytes per rank by formula (fp32 weights, AdamW; with LoRA, gradients and AdamW state for the adapters only):
    a cross-check of the trace, not the prediction."""
    rc, degrees, precision = run.rc, run.degrees, run.precision
    f = models.architecture(rc.model)
    if f is None:  # a backend without a closed form (model=hf)
        return {}
    d, hd, h, kv, v = f.dim, f.head_dim, f.n_heads, f.n_kv_heads, f.vocab_size
    attn = d * (h + 2 * kv) * hd + h * hd * d + 2 * hd + 2 * d
    ffn = (f.num_experts * 3 * d * f.hidden_dim + d * f.num_experts) if f.num_experts else 3 * d * f.hidden_dim
    layer = attn + ffn
    shard = degrees.dp_shard * degrees.tp
    # LoRA (model.lora.enable): the base is frozen, so only the adapters have gradients and AdamW state; every
    # parameter, frozen or not, keeps its float32 bytes.
    lora = lora_params.count_for(f, rc.model)
    total = lora.total if lora else lora_params.base_params(f)
    trainable = lora.adapters if lora else total
    params = 4 * total / shard
    grads = 4 * trainable / shard
    tokens = rc.data.batch_size * rc.data.seq_len
    tp, sp = degrees.tp, degrees.sequence_parallel
    f_act = (f.top_k * f.hidden_dim * 4 + 3 * f.num_experts + 2 * d * f.top_k) if f.num_experts else 4 * f.hidden_dim
    # per token and layer, fp32: norms' inputs/outputs and residuals (D), q/k/v and their norm and rope
    # outputs, attention output and its log-sum-exp, the FFN's w1/w3/silu/product (or the routed experts').
    # FSDP2's bf16 parameter copies (the run's PrecisionPlan), so bf16 activations too; autocast (one process, or a
    # layout without FSDP2 units) keeps float32 activations at the block boundaries.
    bf16_params = precision.param_dtype == "bfloat16"
    s_a = 2 if bf16_params else 4
    per_token_layer = s_a * ((5 * d) / (tp if sp else 1) + (3 * h * hd + 3 * kv * hd + h) / tp + f_act / tp)
    ac = rc.parallelism.activation_checkpoint
    layers_act = tokens * per_token_layer * f.n_layers
    if ac == "full":
        layers_act = tokens * s_a * d / (tp if sp else 1) * f.n_layers + tokens * per_token_layer
    elif ac == "selective":
        layers_act *= 0.6
    mp = 2 if precision.compute_dtype == "bfloat16" else 4
    if rc.training.loss == "chunked":
        logits = 3 * min(rc.training.loss_chunk_tokens, tokens) * v / tp * 4 + tokens * 4 * d
    else:  # logits, their fp32 log-softmax kept for backward, and the gradient (full vocabulary: no loss parallel)
        logits = tokens * v * (mp + 4 + 4)
    # FSDP: one block gathered and the next prefetched, plus the root unit (embeddings, norm, lm_head), which stays
    # gathered from its forward to its backward; bf16 copies under bf16 (fp32 shards), whose backward also casts a
    # block's gradients into an fp32 reduce-scatter input (torch's _fsdp_collectives.foreach_reduce).
    s_p = 2 if bf16_params else 4
    root = v * d * (1 if f.tie_embeddings else 2) + d
    # (a frozen block has no gradient to cast: LoRA's adapters are too small to count there)
    grad_cast = 4 * layer if bf16_params and not lora else 0
    gathered = (s_p * (2 * layer + root) + grad_cast) / tp if degrees.dp_shard > 1 else 0
    out = {"params": params, "grads": grads, "optimizer": 2 * grads, "activations": layers_act,
           "logits and loss": logits, "fsdp gathered": gathered}
    if lora:
        out["lora adapters"] = 4 * lora.adapters / shard  # in params above; the only bytes with grads and state
    # Peak: at the start of backward (activations and logits alive) or at the optimizer step (grads and
    # the AdamW state, created at the first step), whichever is larger.
    out["peak"] = params + max(layers_act + logits + gathered, 3 * grads)
    if degrees.pipelined:
        out = _largest_stage(run, f, layer, lora, out, per_token=layers_act / tokens / f.n_layers, s_p=s_p, mp=mp)
    return {k: int(val) for k, val in out.items()}


def _largest_stage(run, f, layer: float, lora, whole: dict, *, per_token: float, s_p: int, mp: int) -> dict:
    """The closed form of a pipelined run's largest rank: an edge rank (the embedding, or the norm and lm_head, each
    weighed as one layer by torchtitan's split; a V schedule's rank 0 holds both) with its share of the layers. Its
    first stage holds 1F1B's min(micro-batches, pp) micro-batches of activations at once (GPipe: every one), its
    last stage one micro-batch's logits (GPipe: every one's). FSDP keeps a pipelined stage gathered from forward to
    backward (torchtitan: no resharding after forward under pp) and its gradients unsharded until the last
    micro-batch's backward (torch's stage: no reduction before ``perform_reduce_grad``)."""
    rc, d = run.rc, run.degrees
    v, dim = f.vocab_size, f.dim
    units = f.n_layers + parallel.PP_EDGE_LAYERS
    per_rank = -(-units // d.pp)
    v_shape = parallel.PP_SCHEDULES.get(d.pp_schedule) == "v"
    edges = 2 if v_shape else 1
    layers = max(0, min(f.n_layers, per_rank - edges))
    stage_total = layers * layer + edges * (v * dim) + dim
    trainable = lora.adapters / d.pp if lora else stage_total
    shard = d.dp_shard * d.tp
    params, grads = 4 * stage_total / shard, 4 * trainable / shard
    n_mb = d.pp_microbatches
    tokens_mb = rc.data.batch_size * rc.data.seq_len / n_mb
    held = n_mb if d.pp_schedule == "GPipe" else min(n_mb, d.pp)
    first = tokens_mb * held * per_token * layers
    last_held = n_mb if d.pp_schedule == "GPipe" else 1
    if rc.training.loss == "chunked":
        logits = 3 * min(rc.training.loss_chunk_tokens, tokens_mb) * v / d.tp * 4 + tokens_mb * 4 * dim
    else:
        logits = tokens_mb * v * (mp + 4 + 4)
    last = tokens_mb * last_held * per_token * layers + logits * last_held
    gathered = s_p * stage_total / d.tp + 4 * trainable / d.tp
    out = {**whole, "params": params, "grads": grads, "optimizer": 2 * grads, "activations": max(first, last),
           "logits and loss": logits * last_held, "fsdp gathered": gathered}
    out["peak"] = params + max(max(first, last) + gathered, 3 * grads)
    return out
