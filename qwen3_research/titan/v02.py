"""The torchtitan 0.2.x API: upstream 0.2.2 and AWS's torchtitan-neuron fork built on it (0.2.2+neuron.1):
models built from a ``Qwen3ModelArgs`` dataclass and parallelized from a ``JobConfig``
(github.com/pytorch/torchtitan tag v0.2.2: torchtitan/models/qwen3/__init__.py, infra/parallelize.py).

One of the two API modules behind the facade (``qwen3_research.titan``), which imports this one only where
0.2.x is installed (feature detection, ``common.legacy``); ``v03.py`` has the same names for 0.3.x.
Dropping 0.2.x is deleting this file and its one line in the facade. Every torchtitan import is inside a
function: torchtitan reads the device type at import (``device.prepare_torchtitan`` comes first).
"""

from __future__ import annotations

import dataclasses
import functools
from types import SimpleNamespace

from qwen3_research.titan.common import needs


def check_supported(rc, *, moe: bool) -> None:
    """Refuse at start-up, in one line, what the installed torchtitan cannot run (launch calls this).

    What upstream 0.2.2 lacks and the seams ``build_model`` installs give (``_install_seams``): the hidden
    states without the lm_head (training.loss=chunked), MoE on CPU (the router's ``torch.histc`` has no CPU kernel
    for integer counts), TP on CPU (DTensor has no sharding rule for the CPU flash attention), attention masks
    (document masking, FlexAttention). What is left: 0.2.x's TP plan always shards the sequence
    (docs/PARALLELISM.md). Kernel overrides run on both APIs (``prepare_kernel_targets``, ``expert_weights``);
    what a kernel needs of the device and packages is ``kernels.registry.kernel_support``. ``moe``: the model
    is a Qwen3-MoE (the backend's spec says so).
    """
    from qwen3_research.errors import ConfigError

    p = rc.parallelism
    if p.tp > 1 and not p.sequence_parallel:
        raise ConfigError(
            f"parallelism.tp={p.tp} with parallelism.sequence_parallel=false {needs()}: 0.2.x always shards "
            "the sequence with TP; set parallelism.sequence_parallel=true"
        )


# -- what the kernel overrides replace -----------------------------------------------------------
# The overrides (qwen3_research/kernels) replace torchtitan's expert module and RoPE module. 0.3.x has
# both (``GroupedExperts`` with w1_EFD/w2_EDF/w3_EFD at layers.N.moe.routed_experts.inner_experts;
# ``CosSinRoPE`` at layers.N.attention.rope). 0.2.x (upstream v0.2.2, AWS's torchtitan-neuron
# 0.2.2+neuron.1) has the same ``GroupedExperts`` math with weights named w1/w2/w3 at
# layers.N.moe.experts (torchtitan/models/moe/moe.py), but no RoPE module: Attention.forward calls
# the module-level ``apply_rotary_emb(xq, xk, rope_cache, positions)`` (torchtitan/models/qwen3/model/
# model.py) on the model's ``rope_cache`` buffer [max_seq_len, 2 × head_dim] (cos | sin, the layout of
# 0.3.x's CosSinRoPE cache). ``prepare_kernel_targets`` gives 0.2.x that module.
def expert_weights(module):
    """(w1 [E, F, D], w2 [E, D, F], w3 [E, F, D]) of torchtitan's GroupedExperts (0.2.x names them w1/w2/w3)."""
    return module.w1, module.w2, module.w3


def prepare_kernel_targets(model, rope: bool) -> None:
    """On 0.2.x with ``rope``: give every attention a ``rope`` child module that RoPE kernels replace.

    The child (``CosSinRoPE`` below, the 0.3.x module's interface: ``cache``, ``config.dim``,
    ``_reshape_cache``, ``forward(query, key, positions)``) computes 0.2.x's own ``apply_rotary_emb``
    on the model's ``rope_cache``; the attention's forward (``_attention_forward_02``, installed by
    ``build_model``) calls it when present. No parameter or buffer is added: state dicts, FSDP and TP
    plans are unchanged. A no-op without ``rope`` and when already done.
    """
    if not rope:
        return
    from torchtitan.models.qwen3.model.model import Attention

    for module in list(model.modules()):
        if isinstance(module, Attention) and not hasattr(module, "rope"):
            if getattr(type(module), "forward", None) is not _attention_forward_02:
                module.__class__ = _seam_attention_class(type(module))
            module.rope = _rope_seam_class()(module.head_dim, model)


@functools.lru_cache(maxsize=None)
def _rope_seam_class():
    import weakref

    import torch.nn as nn
    from torchtitan.models.qwen3.model.model import apply_rotary_emb, reshape_for_broadcast

    class CosSinRoPE(nn.Module):
        """0.2.x's RoPE as a module with 0.3.x's CosSinRoPE interface (the kernels' target type)."""

        def __init__(self, head_dim: int, model):
            super().__init__()
            self.config = SimpleNamespace(dim=head_dim)
            # The model's rope_cache buffer, read at each call (it is replaced when the weights are
            # materialized); a weak reference, so the model is not registered as a child of its own module.
            object.__setattr__(self, "_model", weakref.ref(model))

        @property
        def cache(self):
            return self._model().rope_cache

        def _reshape_cache(self, query, positions=None):
            return reshape_for_broadcast(self.cache, query, positions)  # [1|B, L, 1, 2 × head_dim]

        def forward(self, query, key, positions=None):
            return apply_rotary_emb(query, key, self.cache, positions)

    return CosSinRoPE


# -- the seams of the 0.2.x model (``build_model`` installs them) ------------------------------------
# Each one swaps the class of a built module for a subclass whose forward mirrors 0.2.2's line for line
# except where said; no parameter, buffer or child is added, so state dicts, checkpoints, FSDP units and TP
# plans are those of 0.2.2's own model. tests/test_tt022.py pins the hash of every torchtitan function a
# seam mirrors (``MIRRORED``): a fork update that changes one fails there, loudly.
MIRRORED = {
    # (torchtitan module, qualified name): what mirrors it here
    ("torchtitan.models.qwen3.model.model", "Qwen3Model.forward"): "_model_forward_02",
    ("torchtitan.models.qwen3.model.model", "Attention.forward"): "_attention_forward_02",
    ("torchtitan.models.moe.moe", "TokenChoiceTopKRouter.forward"): "_router_forward_02",
    ("torchtitan.models.moe.moe", "TokenReorderer.forward"): "_reorderer_forward_02",
    ("torchtitan.models.moe.kernels", "generate_permute_indices"): "_permute_indices_on_cpu",
    ("torchtitan.models.moe.utils", "_permute"): "_permute_on_cpu",  # reads generate_permute_indices from its module
}


def _install_seams(model) -> None:
    """The 0.2.x model with what 0.3.x gives and 0.2.2 lacks (idempotent):

    - the model: ``_skip_lm_head`` (hidden states after the final norm, for training.loss=chunked), ``lm_head``
      (its ``output`` module), ``get_attention_masks(positions=)`` (a block-causal BlockMask);
    - every attention: a mask (boolean SDPA mask or BlockMask: data.document_masking, model.attention=flex) and
      tensor parallel on CPU (attention per head on the local shards);
    - every MoE router and reorderer: expert counts by ``scatter_add`` (0.2.2's ``torch.histc`` has no CPU kernel
      for integer ids), the same int64 counts on every device; CPU token permutation (``_permute_indices_on_cpu``).
    """
    from torchtitan.models.moe.moe import TokenChoiceTopKRouter, TokenReorderer
    from torchtitan.models.qwen3.model.model import Attention

    if getattr(type(model), "forward", None) is not _model_forward_02:
        model.__class__ = _seam_model_class(type(model))
    moe = False
    for module in model.modules():
        if isinstance(module, Attention) and getattr(type(module), "forward", None) is not _attention_forward_02:
            module.__class__ = _seam_attention_class(type(module))
        elif isinstance(module, TokenChoiceTopKRouter) and type(module).forward is not _router_forward_02:
            module.__class__ = _seam_class(type(module), _router_forward_02)
            moe = True
        elif isinstance(module, TokenReorderer) and type(module).forward is not _reorderer_forward_02:
            module.__class__ = _seam_class(type(module), _reorderer_forward_02)
    if moe:
        _permute_on_cpu()


@functools.lru_cache(maxsize=None)
def _seam_class(base, forward):
    return type(base.__name__, (base,), {"forward": forward, "__module__": __name__})


@functools.lru_cache(maxsize=None)
def _seam_model_class(base):
    return type(base.__name__, (base,), {
        "forward": _model_forward_02, "get_attention_masks": _block_causal_masks, "_skip_lm_head": False,
        "lm_head": property(lambda self: self.output, doc="0.3.x's name of the output projection"),
        "__module__": __name__,
    })


def _model_forward_02(self, tokens, attention_masks=None, positions=None):
    """0.2.2's ``Qwen3Model.forward`` (torchtitan/models/qwen3/model/model.py at v0.2.2), returning the hidden
    states after the final norm when ``_skip_lm_head`` is set (0.3.x's switch, models/common/decoder.py)."""
    h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
    for layer in self.layers.values():
        h = layer(h, self.rope_cache, attention_masks, positions)
    h = self.norm(h) if self.norm is not None else h
    if self._skip_lm_head:
        return h
    return self.output(h) if self.output is not None else h


def _block_causal_masks(self, positions):
    """The block-causal BlockMask of packed documents whose ``positions`` (B, L) restart at 0 at each
    document (all of 0..L-1: causal), as 0.3.x's ``Decoder.get_attention_masks(positions=)`` builds it; 0.2.2's
    own takes the tokens and an EOS id instead."""
    import torch
    from torch.nn.attention.flex_attention import create_block_mask

    doc = torch.cumsum(positions == 0, dim=1)

    def mask_mod(b, h, q, kv):
        return (q >= kv) & (doc[b, q] == doc[b, kv])

    B, L = positions.shape
    return create_block_mask(mask_mod, B, None, L, L, device=positions.device)


@functools.lru_cache(maxsize=None)
def _seam_attention_class(base):
    return _seam_class(base, _attention_forward_02)


def _attention_forward_02(self, x, rope_cache, attention_masks, positions=None):
    """0.2.2's ``Attention.forward`` (torchtitan/models/qwen3/model/model.py at v0.2.2) for the SDPA modules
    this adapter always builds (``qwen3_model_config``: attn_type="sdpa"), with two changes: RoPE through the
    ``rope`` child when a RoPE kernel added one (``prepare_kernel_targets``), and the attention itself through
    ``_attend`` (0.2.2's SDPA asserts ``attention_masks is None``). AWS's Qwen3 changes for Trainium leave this
    file alone (docs/torchtitan/qwen3/TorchTitan.diff in parmoham-aws/test-repo-parmoham touches only the SAC
    save list and the peak-FLOPs table)."""
    from torchtitan.models.qwen3.model.model import apply_rotary_emb

    bs, seqlen, _ = x.shape
    xq, xk, xv = self.wq(x), self.wk(x), self.wv(x)
    # -1: TP may have sharded the heads
    xq = xq.view(bs, seqlen, -1, self.head_dim)
    xk = xk.view(bs, seqlen, -1, self.head_dim)
    xv = xv.view(bs, seqlen, -1, self.head_dim)
    if self.q_norm:
        xq = self.q_norm(xq)
    if self.k_norm:
        xk = self.k_norm(xk)
    rope = self._modules.get("rope")
    if rope is not None:
        xq, xk = rope(xq, xk, positions)  # the model's rope_cache, as torchtitan passes it
    else:
        xq, xk = apply_rotary_emb(xq, xk, rope_cache, positions)
    xq, xk, xv = xq.transpose(1, 2), xk.transpose(1, 2), xv.transpose(1, 2)
    if self.attn_type != "sdpa":
        raise RuntimeError(f"the 0.2.x attention seam supports attn_type='sdpa' only (got {self.attn_type})")
    output = _attend(self, xq, xk, xv, attention_masks)
    output = output.transpose(1, 2).contiguous().view(bs, seqlen, -1)
    return self.wo(output)


def _attend(self, q, k, v, masks):
    """Attention of (B, heads, L, head_dim) q/k/v: causal SDPA (0.2.2's own module) without a mask; SDPA with a
    boolean (B, 1, L, L) mask (data.document_masking); FlexAttention with a BlockMask (model.attention=flex).
    Under tensor parallel q/k/v are DTensors sharded on the heads: attention is per head, so it runs on the local
    shards (DTensor has no sharding rule for the CPU flash-attention op 0.2.2's SDPA reaches) and the result
    is the same sharded DTensor again."""
    import torch.nn.functional as F
    from torch.distributed.tensor import DTensor
    from torch.nn.attention.flex_attention import BlockMask

    dt = q if isinstance(q, DTensor) else None
    if dt is not None:
        q, k, v = (t.to_local() for t in (q, k, v))
        if isinstance(masks, DTensor):
            masks = masks.to_local()
    if masks is None:
        out = self.inner_attention(q, k, v, scale=self.scaling, enable_gqa=self.enable_gqa)
    elif isinstance(masks, BlockMask):
        out = _flex_attention(q.device.type)(q, k, v, block_mask=masks, scale=self.scaling, enable_gqa=self.enable_gqa)
    else:
        # torch's own kernel choice: flash takes no mask, efficient attention and math do (as v03._MaskedSDPA)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=masks, scale=self.scaling, enable_gqa=self.enable_gqa)
    if dt is not None:
        out = DTensor.from_local(out, dt.device_mesh, dt.placements, run_check=False)
    return out


def _flex_attention(device_type: str):
    """torchtitan's compiled FlexAttention on CUDA (0.2.2's ``FlexAttentionWrapper``); torch's eager one
    elsewhere (a CPU forward for the tests: FlexAttention has no CPU backward, and a run refuses flex off CUDA)."""
    if device_type == "cuda":
        from torchtitan.models.attention import FlexAttentionWrapper

        return FlexAttentionWrapper._compiled_flex_attn
    from torch.nn.attention.flex_attention import flex_attention

    return flex_attention


def expert_counts(ids, num_experts: int):
    """Tokens per expert (int64, [num_experts]) of the routed expert ids: a scatter-add, which has a kernel on
    every device, a static shape (one compiled graph) and exact integer counts; 0.2.2's ``torch.histc`` has no CPU
    kernel for integer ids."""
    import torch

    flat = ids.reshape(-1)
    return torch.zeros(num_experts, dtype=torch.int64, device=ids.device).scatter_add_(0, flat, torch.ones_like(flat))


def _router_forward_02(self, x, expert_bias=None):
    """0.2.2's ``TokenChoiceTopKRouter.forward`` (torchtitan/models/moe/moe.py at v0.2.2) with the counts from
    ``expert_counts`` instead of ``torch.histc``; every other line is torchtitan's."""
    import torch
    import torch.nn.functional as F

    scores = self.gate(x)
    # By default, sigmoid or softmax is performed in float32 to avoid loss explosion
    if self.score_func == "sigmoid":
        scores = torch.sigmoid(scores.to(torch.float32))
    elif self.score_func == "softmax":
        scores = F.softmax(scores.to(torch.float32), dim=1)
    else:
        raise NotImplementedError(f"Unknown score function {self.score_func}")
    scores_for_choice = scores if expert_bias is None else scores + expert_bias
    if self.num_expert_groups is not None:
        scores_for_choice = self._get_node_limited_routing_scores(scores_for_choice)
    _, selected_experts_indices = torch.topk(scores_for_choice, k=self.top_k, dim=-1, sorted=False)
    # the expert bias only routes: the gating value comes from the original scores
    top_scores = scores.gather(dim=1, index=selected_experts_indices)
    if self._debug_force_load_balance:
        selected_experts_indices, top_scores = self._debug_force_load_balance_routing(scores)
    if self.route_norm:
        denominator = top_scores.sum(dim=-1, keepdim=True) + 1e-20
        top_scores = top_scores / denominator
    top_scores = top_scores * self.route_scale
    return top_scores, selected_experts_indices, expert_counts(selected_experts_indices, self.num_experts)


def _reorderer_forward_02(self, top_scores, selected_experts_indices):
    """0.2.2's ``TokenReorderer.forward`` (torchtitan/models/moe/moe.py at v0.2.2) with ``expert_counts``."""
    import torch

    num_tokens_per_expert = expert_counts(selected_experts_indices, self.num_experts)
    token_indices_experts_sorted = torch.argsort(selected_experts_indices.view(-1), stable=True)
    top_scores_experts_sorted = top_scores.view(-1)[token_indices_experts_sorted]
    return top_scores_experts_sorted, token_indices_experts_sorted, num_tokens_per_expert


@functools.lru_cache(maxsize=None)
def _permute_on_cpu() -> None:
    """0.2.2 pads the experts' token groups (``models/moe/utils.py`` ``_permute``, called by ``GroupedExperts`` and
    by EP's token dispatch) with ``generate_permute_indices(..., use_cpu=False)``: a Triton kernel, which cannot
    take CPU tensors. Its own CPU implementation (``use_cpu=True``, the path AWS's GPT-OSS diff takes on Neuron)
    for CPU tensors; other devices unchanged. Installed once per process on the module ``_permute`` reads."""
    from torchtitan.models.moe import utils

    utils.generate_permute_indices = functools.partial(_permute_indices_on_cpu, utils.generate_permute_indices)


def _permute_indices_on_cpu(tt_generate, tokens_per_expert_group, *args, use_cpu: bool = False, **kwargs):
    return tt_generate(tokens_per_expert_group, *args, use_cpu=use_cpu or tokens_per_expert_group.device.type == "cpu",
                       **kwargs)


def unpadded_experts_forward(base):
    """The expert computation on groups already padded (``common.align_token_groups``): 0.2.x's own forward
    would pad again with its Triton index kernel, so its grouped-mm path, called directly."""
    from torchtitan.models.moe.moe import _run_experts_grouped_mm

    def experts(self, x, counts):
        w1, w2, w3 = (w.to_local() if hasattr(w, "to_local") else w for w in expert_weights(self))
        return _run_experts_grouped_mm(w1, w2, w3, x, counts)

    return experts


# -- model ------------------------------------------------------------------------------------
def qwen3_model_config(flavor, attention: str, device_type: str):
    """torchtitan's Qwen3 model config for a flavor: ``Qwen3ModelArgs`` (the same fields torchtitan's
    ``qwen3_args`` set)."""
    from torchtitan.models.moe import MoEArgs
    from torchtitan.models.qwen3 import Qwen3ModelArgs

    # attn_type="sdpa" always: the attention seam (``_attend``) runs FlexAttention when the forward is given a
    # BlockMask (model.attention=flex), SDPA otherwise; the modules and their state are the same.
    moe = {}
    if flavor.num_experts:
        # Qwen3-MoE routing, as 0.2.2's own "30B-A3B" flavor: softmax scores, renormalized top-k.
        moe = dict(moe_enabled=True, moe_inter_dim=flavor.hidden_dim, moe_args=MoEArgs(
            num_experts=flavor.num_experts, num_shared_experts=0, top_k=flavor.top_k, score_func="softmax",
            route_norm=True, route_scale=1.0, score_before_experts=False,
        ))
    return Qwen3ModelArgs(
        vocab_size=flavor.vocab_size, max_seq_len=flavor.max_seq_len, head_dim=flavor.head_dim, dim=flavor.dim,
        n_layers=flavor.n_layers, n_heads=flavor.n_heads, n_kv_heads=flavor.n_kv_heads, qk_norm=True,
        hidden_dim=flavor.hidden_dim, rope_theta=flavor.rope_theta, enable_weight_tying=flavor.tie_embeddings,
        attn_type="sdpa", **moe,
    )


def apply_parallelism_plans(model_config, tt_parallelism) -> None:
    """0.2.x has no plans on the config: ``parallelize_qwen3`` applies them from the JobConfig."""


def build_model(model_config):
    """The nn.Module (call under ``torch.device("meta")``)."""
    from torchtitan.models.qwen3 import Qwen3Model

    model = Qwen3Model(model_config)
    _install_seams(model)
    return model


def nparams_and_flops(args, model, seq_len: int) -> tuple[int, int]:
    """0.3.0's formula (torchtitan/models/utils.py ``get_moe_model_nparams_and_flops``) on a 0.2.x model.

    0.2.2's own version subtracts a tied embedding from the parameter count although
    ``named_parameters`` lists it once already, and leaves the lm_head matmul out of the FLOPs
    (tiny: 787,840 params instead of 20,235,648); 0.3.0 corrected both, so both versions report the same.
    """
    embedding = router = experts = dense = 0
    for name, p in model.named_parameters():
        n = p.numel()
        if "embedding" in name:
            embedding += n
            dense += n
        elif "moe.router" in name:
            router += n
        elif "moe.experts" in name:
            experts += n
        else:
            dense += n  # no shared experts in Qwen3-MoE
    active = router + (experts * args.moe_args.top_k // args.moe_args.num_experts if args.moe_enabled else 0)
    matmul = dense + active if args.enable_weight_tying else dense - embedding + active
    flops = 6 * matmul + 6 * args.n_layers * args.n_heads * 2 * args.head_dim * seq_len
    return dense + router + experts, flops


def init_weights(model, buffer_device) -> None:
    """0.2.2's init, except on fake tensors (the memory planner's trace, ``planner.trace_rank``): 0.2.2's
    ``trunc_normal_`` (torchtitan/models/utils.py) reads a value there, and a fake tensor has none to fill; the
    plan needs the tensors' shapes only, and the RoPE cache buffer is already of its shape."""
    from torch._subclasses.fake_tensor import is_fake

    p = next(model.parameters(), None)
    if p is not None and is_fake(p.to_local() if hasattr(p, "to_local") else p):
        return
    model.init_weights(buffer_device=buffer_device)


def parallelize_qwen3(model, parallel_dims, tt) -> None:
    """Shard with torchtitan's Qwen3 plan (FSDP, TP/SP, EP, activation checkpointing) from the JobConfig."""
    from torchtitan.models.qwen3 import parallelize_qwen3 as tt_parallelize

    _parallelize_qwen3_tied(tt_parallelize, model, parallel_dims, tt.job_config)


def _parallelize_qwen3_tied(tt_parallelize, model, parallel_dims, job_config) -> None:
    """0.2.x's ``parallelize_qwen3``, keeping tied embeddings tied (the two fixes 0.3.0 made).

    0.2.2 shards ``tok_embeddings`` and ``[norm, output]`` as two FSDP units, which FSDP2 refuses for
    one shared weight ("Parameter 'output.weight' is shared with a parameter already managed by
    another FSDP group", measured with 2 ranks); 0.3.0 (torchtitan/distributed/fsdp.py) puts the three
    modules in one unit. Its TP step also distributes the two modules' weights one by one, untying
    them; both are Shard(0) over the vocabulary on the tp mesh, so the output takes the embedding's.
    Both fixes patch the module-level helpers ``parallelize_qwen3`` calls, for the call only.
    """
    import contextlib

    from torchtitan.models.qwen3.infra import parallelize as pq

    tied = getattr(model, "enable_weight_tying", False)
    if not tied:
        tt_parallelize(model, parallel_dims, job_config)
        return
    tp_orig, fsdp_orig = pq.apply_non_moe_tp, pq.apply_fsdp

    def tp_and_retie(model, *args, **kwargs):
        tp_orig(model, *args, **kwargs)
        model.output.weight = model.tok_embeddings.weight

    def fsdp_tied(model, dp_mesh, param_dtype, reduce_dtype, pp_enabled, cpu_offload=False,
                  reshard_after_forward_policy="default", **kwargs):
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        extra = {"offload_policy": CPUOffloadPolicy()} if cpu_offload else {}
        ends = {"tok_embeddings": model.tok_embeddings, "norm": model.norm, "output": model.output}
        fully_shard(list(ends.values()), mesh=dp_mesh, mp_policy=MixedPrecisionPolicy(param_dtype, reduce_dtype),
                    reshard_after_forward=reshard_after_forward_policy == "always", **extra)
        for name in ends:  # hidden from 0.2.2's own wrapping of the ends (None is what it checks for)
            setattr(model, name, None)
        try:
            fsdp_orig(model, dp_mesh, param_dtype, reduce_dtype, pp_enabled, cpu_offload,
                      reshard_after_forward_policy, **kwargs)
        finally:
            for name, module in ends.items():
                setattr(model, name, module)

    with contextlib.ExitStack() as stack:
        stack.callback(setattr, pq, "apply_non_moe_tp", tp_orig)
        stack.callback(setattr, pq, "apply_fsdp", fsdp_orig)
        pq.apply_non_moe_tp, pq.apply_fsdp = tp_and_retie, fsdp_tied
        tt_parallelize(model, parallel_dims, job_config)


def register_moe_load_balancing_hook(optimizer, model, parallel_dims) -> None:
    """torchtitan 0.2.x keeps this hook inside ``build_optimizers_with_moe_load_balancing`` (its own
    optimizer container). The same update, on our optimizer: before each step, move every MoE layer's
    ``expert_bias`` by ``load_balance_coeff * sign(mean - tokens)`` (centred) from the token counts
    summed over the loss mesh (v0.2.2 torchtitan/components/optimizer.py ``_update_expert_bias``)."""
    import torch
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl
    from torch.distributed.tensor import DTensor, Replicate

    blocks = [b for b in model.get_submodule("layers").values() if getattr(b, "moe_enabled", False)]
    if not blocks or blocks[0].moe.load_balance_coeff is None:
        return

    def update_expert_bias(*_args, **_kwargs) -> None:
        counts = []
        for block in blocks:
            c = block.moe.tokens_per_expert
            if getattr(block, "checkpoint_impl", None) is CheckpointImpl.NO_REENTRANT:
                c = c // 2  # full AC counts every token twice (torchtitan's own correction)
            counts.append(c)
        by_layer = torch.vstack(counts)
        loss_mesh = parallel_dims.get_optional_mesh("loss") if parallel_dims is not None else None
        if loss_mesh is not None:
            if isinstance(by_layer, DTensor):
                by_layer = by_layer.redistribute(placements=[Replicate()] * by_layer.device_mesh.ndim)
            else:
                torch.distributed.all_reduce(by_layer, group=loss_mesh.get_group(), op=torch.distributed.ReduceOp.SUM)
        with torch.no_grad():
            for i, block in enumerate(blocks):
                moe = block.moe
                tokens = by_layer[i].float()
                delta = moe.load_balance_coeff * torch.sign(tokens.mean() - tokens)
                moe.expert_bias.add_(delta - delta.mean())
                moe.tokens_per_expert.zero_()

    optimizer.register_step_pre_hook(update_expert_bias)


# -- MoE routing (qwen3_research.routing) --------------------------------------------------------
def set_moe_load_balance(args, coeff) -> None:
    """The expert-bias coefficient (``MoEArgs.load_balance_coeff``, v0.2.2 torchtitan/models/moe/moe.py), before
    the build. None: no ``expert_bias`` buffer, and ``register_moe_load_balancing_hook`` registers nothing."""
    if getattr(args, "moe_enabled", False):
        args.moe_args.load_balance_coeff = coeff


def attach_router_hooks(model, fn) -> tuple[list, list]:
    """Call ``fn(layer, router, probs, ids)`` after every MoE router forward (as ``v03.attach_router_hooks``).
    0.2.x's router returns (top scores, expert ids, counts), not the scores over all experts: ``probs`` is the
    softmax of its gate's output in float32, as the router computes it (v0.2.2 TokenChoiceTopKRouter.forward)."""
    import torch

    handles, shapes = [], []
    blocks = [b for b in model.get_submodule("layers").values()
              if getattr(getattr(b, "_checkpoint_wrapped_module", b), "moe_enabled", False)]
    for i, block in enumerate(blocks):
        router = getattr(block, "_checkpoint_wrapped_module", block).moe.router
        logits = {}

        def gate_hook(mod, args, out, logits=logits):
            logits["last"] = out

        def router_hook(mod, args, out, i=i, logits=logits):
            fn(i, mod, torch.softmax(logits.pop("last").float(), dim=-1), out[1])

        handles += [router.gate.register_forward_hook(gate_hook), router.register_forward_hook(router_hook)]
        shapes.append((int(router.num_experts), int(router.top_k)))
    return handles, shapes


def document_attention_masks(model, positions, flex: bool):
    """The attention masks of packed documents whose ``positions`` (B, L) restart at 0 at every document, as
    ``v03.document_attention_masks``: flex (CUDA) a block-causal BlockMask (the model seam's
    ``get_attention_masks``); sdpa a boolean (B, 1, L, L) mask, same document and causal, which the attention
    seam (``_attend``) gives to SDPA. B·L² bytes: 64 MiB at 4 × 4096."""
    import torch

    inner = getattr(model, "_orig_mod", model)  # torch.compile's wrapper
    if flex:
        return inner.get_attention_masks(positions=positions)
    doc = torch.cumsum(positions == 0, dim=1)
    L = positions.shape[1]
    causal = torch.ones(L, L, dtype=torch.bool, device=positions.device).tril()
    return ((doc[:, :, None] == doc[:, None, :]) & causal)[:, None]


def state_dict_adapter(model_config):
    """torchtitan's Qwen3 HF<->native key mapping (``from_hf`` / ``to_hf`` on on-disk HF keys): under model/
    in 0.2.x (same class, same from_hf/to_hf on ModelArgs)."""
    from torchtitan.models.qwen3.model.state_dict_adapter import Qwen3StateDictAdapter

    return Qwen3StateDictAdapter(model_config, None)


# -- distributed -------------------------------------------------------------------------------
def parallel_dims(d):
    """torchtitan's ParallelDims for our degrees (mesh not built yet). 0.2.x has one DTensor backend (what
    partial_dtensor is in 0.3.x); experts are not tensor-parallel (etp=1: EP borrows the dp_shard×tp ranks,
    as with 0.3.x)."""
    # torchtitan builds size-1 mesh axes on the "fake" c10d backend, which torch registers
    # only when this (test-namespace) module is imported.
    import torch.testing._internal.distributed.fake_pg  # noqa: F401
    from torchtitan.distributed import ParallelDims

    return ParallelDims(
        dp_replicate=d.dp_replicate, dp_shard=d.dp_shard, cp=1, tp=d.tp, pp=1, ep=d.ep, etp=1,
        world_size=d.world_size,
    )


def training_configs(d, *, activation_checkpoint: str, compile_backend: str, mixed_precision: str, run_dir: str):
    """The torchtitan config objects ``parallelize_qwen3`` reads: on 0.2.x one JobConfig carries degrees, AC,
    compile and precision."""
    from torchtitan.config import JobConfig

    job = JobConfig()
    job.job.dump_folder = run_dir
    p = job.parallelism
    p.data_parallel_replicate_degree, p.data_parallel_shard_degree = d.dp_replicate, d.dp_shard
    p.tensor_parallel_degree, p.expert_parallel_degree, p.expert_tensor_parallel_degree = d.tp, d.ep, 1
    p.disable_loss_parallel = True  # the Trainer's loss takes whole-vocabulary logits, as with 0.3.x
    # parallelize_qwen3 asserts seq_len % (tp·2·cp) == 0 even without SP; our degrees were validated
    # against the real seq_len already, so give it a multiple that always passes.
    job.training.seq_len = 2 * max(d.tp, 1)
    job.training.mixed_precision_param = "bfloat16" if mixed_precision == "bf16" else "float32"
    job.compile.enable, job.compile.backend = False, compile_backend  # the Trainer compiles the whole model
    ac = job.activation_checkpoint
    ac.mode = activation_checkpoint
    # 0.3.x's SelectiveAC is per-op: the same policy is 0.2.x's selective_ac_option="op".
    ac.selective_ac_option = "op"
    return SimpleNamespace(
        job_config=job, parallelism=None, training=job.training,  # model=hf reads training.mixed_precision_*
        activation_checkpoint=ac if activation_checkpoint != "none" else None, dump_folder=run_dir,
    )


def apply_activation_checkpointing(model, tt) -> None:
    """Single-process path: torchtitan's AC wrapper without any sharding."""
    if tt.activation_checkpoint is None:
        return
    from torchtitan.distributed.activation_checkpoint import apply_ac
    from torchtitan.models.qwen3.infra.parallelize import _op_sac_save_list

    apply_ac(model, tt.activation_checkpoint, op_sac_save_list=_op_sac_save_list, base_folder=tt.dump_folder)


def no_parallel(**kwargs):
    """torchtitan's NoParallel TP style (a module kept whole, inputs/outputs as DTensors); 0.2.x keeps it in
    the package root."""
    from torchtitan.distributed import NoParallel

    return NoParallel(**kwargs)


def mark_expert_counts_varying(counts) -> None:
    """0.2.x has no spmd_types backend: nothing to tell a type checker."""


def qwen3_config_for_architecture(arch, attention: str, device_type: str, seq_len: int):
    """Qwen3ModelArgs for an architecture read from a Hugging Face config.json (``hf_interop.config``):
    ``qwen3_model_config``, then what a checkpoint may change and the builders fix; on 0.2.x the same two
    fields live on Qwen3ModelArgs / MoEArgs. The RoPE table has ``seq_len`` rows."""
    args = qwen3_model_config(dataclasses.replace(arch, torchtitan_name=None, max_seq_len=seq_len), attention,
                              device_type)
    args.norm_eps = arch.rms_norm_eps
    if args.moe_enabled:
        args.moe_args.route_norm = arch.norm_topk_prob
    return args
