"""The torchtitan 0.2.x API: upstream 0.2.2 and AWS's torchtitan-neuron fork built on it (0.2.2+neuron.1):
models built from a ``Qwen3ModelArgs`` dataclass and parallelized from a ``JobConfig``
(github.com/pytorch/torchtitan tag v0.2.2: torchtitan/models/qwen3/__init__.py, infra/parallelize.py).

One of the two API modules behind the facade (``qwen3_research.titan``), which imports this one only where
0.2.x is installed (feature detection, ``common.legacy``); ``v03.py`` has the same names for 0.3.x.
Dropping 0.2.x is deleting this file, ``v02_seams.py`` (what the 0.2.x model gets that 0.3.x has) and its one
line in the facade. Every torchtitan import is inside a function: torchtitan reads the device type at import
(``device.prepare_torchtitan`` comes first).
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

from qwen3_research.errors import ConfigError
from qwen3_research.titan import v02_seams as seams
from qwen3_research.titan.common import needs


def check_supported(rc, *, moe: bool) -> None:
    """Refuse at start-up, in one line, what the installed torchtitan cannot run (launch calls this).

    What upstream 0.2.2 lacks and the seams ``build_model`` installs give (``v02_seams.install``): the hidden
    states without the lm_head (training.loss=chunked), MoE on CPU (the router's ``torch.histc`` has no CPU kernel
    for integer counts), TP on CPU (DTensor has no sharding rule for the CPU flash attention), attention masks
    (document masking, FlexAttention). What is left: 0.2.x's TP plan always shards the sequence
    (docs/PARALLELISM.md). Kernel overrides run on both APIs (``prepare_kernel_targets``, ``expert_weights``);
    what a kernel needs of the device and packages is ``kernels.registry.kernel_support``. ``moe``: the model
    is a Qwen3-MoE (the backend's spec says so).
    """
    p = rc.parallelism
    if p.pp > 1:
        raise ConfigError(f"parallelism.pp={p.pp} {needs()}: 0.2.x registers Qwen3 without pipelining (its ModelSpec's "
                          "pipelining_fn is None: 'qwen3 does not support pipelining'); set parallelism.pp=1")
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

    The child (``CosSinRoPE`` of ``v02_seams.rope_module_class``, the 0.3.x module's interface: ``cache``, ``config.dim``,
    ``_reshape_cache``, ``forward(query, key, positions)``) computes 0.2.x's own ``apply_rotary_emb``
    on the model's ``rope_cache``; the attention's forward (``v02_seams.attention_forward``, installed by
    ``build_model``) calls it when present. No parameter or buffer is added: state dicts, FSDP and TP
    plans are unchanged. A no-op without ``rope`` and when already done.
    """
    if not rope:
        return
    from torchtitan.models.qwen3.model.model import Attention

    for module in list(model.modules()):
        if isinstance(module, Attention) and not hasattr(module, "rope"):
            if getattr(type(module), "forward", None) is not seams.attention_forward:
                module.__class__ = seams.attention_class(type(module))
            module.rope = seams.rope_module_class()(module.head_dim, model)


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


def separate_qkv(model_config) -> int:
    """0.2.x builds q, k and v as three Linears already (``attention.wq``/``wk``/``wv``): nothing to change."""
    return 0


def apply_parallelism_plans(model_config, tt_parallelism) -> None:
    """0.2.x has no plans on the config: ``parallelize_qwen3`` applies them from the JobConfig."""


def build_model(model_config):
    """The nn.Module (call under ``torch.device("meta")``)."""
    from torchtitan.models.qwen3 import Qwen3Model

    model = Qwen3Model(model_config)
    seams.install(model)
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


def pipeline_qwen3(model, parallel_dims, tt, **kwargs):
    """0.2.x has no Qwen3 pipelining (``check_supported`` refuses parallelism.pp > 1 before any worker starts)."""
    raise ConfigError(f"parallelism.pp {needs()}: 0.2.x registers Qwen3 without pipelining; set parallelism.pp=1")


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
    """Qwen3ModelArgs for an architecture read from a Hugging Face config.json (``models.native.hf_config``):
    ``qwen3_model_config``, then what a checkpoint may change and the builders fix; on 0.2.x the same two
    fields live on Qwen3ModelArgs / MoEArgs. The RoPE table has ``seq_len`` rows."""
    args = qwen3_model_config(dataclasses.replace(arch, torchtitan_name=None, max_seq_len=seq_len), attention,
                              device_type)
    args.norm_eps = arch.rms_norm_eps
    if args.moe_enabled:
        args.moe_args.route_norm = arch.norm_topk_prob
    return args
