"""The torchtitan 0.3.x API (upstream 0.3.0): models built from nested ``Config`` objects
(``torchtitan.models.common``: CosSinRoPE, Embedding, Linear, ...), parallelized from ``ParallelismConfig``,
``TrainingConfig`` and the activation-checkpoint configs.

One of the two API modules behind the facade (``qwen3_research.titan``), which imports exactly one of them
(feature detection, ``common.legacy``); ``v02.py`` has the same names for 0.2.x. Every torchtitan import is
inside a function: torchtitan reads the device type at import (``device.prepare_torchtitan`` comes first).
"""

from __future__ import annotations

import dataclasses
import functools
from types import SimpleNamespace


def check_supported(rc, *, moe: bool) -> None:
    """Nothing this project runs is out of reach of 0.3.x (the 0.2.x limits are ``v02.check_supported``)."""


# -- what the kernel overrides replace ---------------------------------------------------------
# torchtitan's expert module ``GroupedExperts`` (w1_EFD/w2_EDF/w3_EFD at layers.N.moe.routed_experts.inner_experts)
# and RoPE module ``CosSinRoPE`` (layers.N.attention.rope): both exist as modules here.
def expert_weights(module):
    """(w1 [E, F, D], w2 [E, D, F], w3 [E, F, D]) of torchtitan's GroupedExperts."""
    return module.w1_EFD, module.w2_EDF, module.w3_EFD


def prepare_kernel_targets(model, rope: bool) -> None:
    """Every module a kernel replaces exists already on 0.3.x."""


def unpadded_experts_forward(base):
    """The expert computation on groups already padded (``common.align_token_groups``): 0.3.x's own forward."""
    return base.forward


# -- model ------------------------------------------------------------------------------------
def qwen3_model_config(flavor, attention: str, device_type: str):
    """torchtitan's Qwen3 model config for a flavor, with the attention backend the device can run.

    A ``Qwen3Model.Config`` of torchtitan's own building blocks.
    """
    from torchtitan.models import qwen3 as tq
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear
    from torchtitan.models.common.attention import ScaledDotProductAttention

    if flavor.torchtitan_name is not None:
        cfg = tq.qwen3_configs[flavor.torchtitan_name](attn_backend="flex")
    else:
        # Same building blocks torchtitan's own flavors use (torchtitan 0.3.0).
        rope = CosSinRoPE.Config(dim=flavor.head_dim, max_seq_len=flavor.max_seq_len, theta=flavor.rope_theta)
        common = dict(
            n_layers=flavor.n_layers, dim=flavor.dim, n_heads=flavor.n_heads, n_kv_heads=flavor.n_kv_heads,
            head_dim=flavor.head_dim, attn_backend="flex", rope=rope, fuse_qkv=True,
        )
        if flavor.num_experts:
            layers = tq._build_qwen3_moe_layers(
                **common, moe_hidden_dim=flavor.hidden_dim, num_experts=flavor.num_experts,
                top_k=flavor.top_k, moe_comm_backend="standard",
            )
        else:
            layers = tq._build_qwen3_layers(**common, hidden_dim=flavor.hidden_dim)
        emb_init = tq._EMBEDDING_SKIP_INIT if flavor.tie_embeddings else tq._EMBEDDING_INIT
        cfg = tq.Qwen3Model.Config(
            vocab_size=flavor.vocab_size,
            dim=flavor.dim,
            norm=tq._qwen3_norm(flavor.dim),
            enable_weight_tying=flavor.tie_embeddings,
            tok_embeddings=Embedding.Config(num_embeddings=flavor.vocab_size, embedding_dim=flavor.dim, param_init=emb_init),
            lm_head=Linear.Config(in_features=flavor.dim, out_features=flavor.vocab_size, param_init=tq._LINEAR_INIT),
            layers=layers,
        )
    if attention == "sdpa" or device_type != "cuda":
        # FlexAttention has no CPU backward and varlen needs CUDA: plain causal SDPA.
        for layer in cfg.layers:
            layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return cfg


def separate_qkv(model_config) -> int:
    """Build q, k and v as three Linears (torchtitan's stock ``QKVLinear``: ``wq``/``wk``/``wv``) instead of the fused
    ``wqkv`` (``FusedQKVLinear``), before the build: LoRA needs one adapter per projection, as Hugging Face's
    q_proj/k_proj/v_proj have (qwen3_research/lora.py). Same weights (torchtitan draws the fused init from the
    three stock ones, models/common/config_utils.py) and the same HF keys; TP shards each colwise
    (decoder_sharding.set_qkv_linear_sharding). Returns how many layers changed."""
    from torchtitan.models import qwen3 as tq
    from torchtitan.models.common import Linear
    from torchtitan.models.common.attention import FusedQKVLinear, QKVLinear

    changed = 0
    for layer in model_config.layers:
        qkv = layer.attention.qkv_linear
        if not isinstance(qkv, FusedQKVLinear.Config):
            continue
        dim, hd = qkv.wqkv.in_features, qkv.head_dim
        layer.attention.qkv_linear = QKVLinear.Config(
            head_dim=hd,
            wq=Linear.Config(in_features=dim, out_features=qkv.n_heads * hd, param_init=tq._LINEAR_INIT),
            wkv=Linear.Config(in_features=dim, out_features=qkv.n_kv_heads * hd, param_init=tq._LINEAR_INIT),
        )
        changed += 1
    return changed


def apply_parallelism_plans(model_config, tt_parallelism) -> None:
    """Fill the TP/SP/EP sharding plans on the config before the modules are built."""
    model_config.update_from_config(config=_ParallelismHolder(tt_parallelism))


@dataclasses.dataclass
class _ParallelismHolder:
    parallelism: object


def build_model(model_config):
    """The nn.Module (call under ``torch.device("meta")``)."""
    return model_config.build()


def nparams_and_flops(model_config, model, seq_len: int) -> tuple[int, int]:
    """(parameters, training FLOPs per token): torchtitan's own formula (models/utils.py)."""
    return model_config.get_nparams_and_flops(model, seq_len)


def init_weights(model, buffer_device) -> None:
    model.init_states(buffer_device=buffer_device)


def parallelize_qwen3(model, parallel_dims, tt) -> None:
    """Shard with torchtitan's Qwen3 plan (FSDP, TP/SP, EP, activation checkpointing)."""
    from torchtitan.models.qwen3 import parallelize_qwen3 as tt_parallelize

    # Before torchtitan's Module.parallelize: under TP/EP it stores each sharded module's bound ``forward`` on
    # the instance, so a class swapped in afterwards (on the first masked step) is never called and
    # torchtitan's SDPA raised "does not support attention_masks" (data.document_masking with tp or ep).
    _masked_sdpa(model)
    tt_parallelize(
        model, parallel_dims=parallel_dims, training=tt.training, parallelism=tt.parallelism,
        compile_config=tt.compile, ac_config=tt.activation_checkpoint, dump_folder=tt.dump_folder,
    )


def pipeline_qwen3(model, parallel_dims, tt, *, device, model_config, loss_fn, local_batch_size: int,
                   microbatches: int):
    """Split ``model`` into this rank's pipeline stages and shard each with torchtitan's Qwen3 plan: torchtitan's own
    ``pipeline_llm`` (each stage a deep copy of the whole model with the other stages' modules deleted, so parameter
    names stay the whole model's) and the torch schedule it builds. ``loss_fn(output, labels) -> scalar`` runs on
    the last stage once per micro-batch; the schedule backpropagates each as it is (no scaling). Returns
    (schedule, model parts, stage indices of the parts, has the first stage, has the last stage)."""
    from torchtitan.distributed.pipeline_parallel import pipeline_llm
    from torchtitan.models.qwen3 import parallelize_qwen3 as tt_parallelize

    def parallelize_part(part, **kwargs):
        _masked_sdpa(part)  # as parallelize_qwen3 does for the whole model
        out = tt_parallelize(part, **kwargs)
        return part if out is None else out

    parallelism = dataclasses.replace(tt.parallelism, pipeline_parallel_microbatch_size=local_batch_size // microbatches)
    training = dataclasses.replace(tt.training, local_batch_size=local_batch_size)
    schedule, parts, has_first, has_last = pipeline_llm(
        model, parallel_dims=parallel_dims, training=training, parallelism=parallelism,
        compile_config=tt.compile, ac_config=tt.activation_checkpoint, dump_folder=tt.dump_folder, device=device,
        model_config=model_config, parallelize_fn=parallelize_part,
        loss_fn=lambda *args, **kwargs: (loss_fn(*args, **kwargs), None),  # torchtitan's (loss, aux) contract
    )
    stages = getattr(schedule, "_stages", None) or [schedule._stage]  # torch keeps them private
    return schedule, parts, [s.stage_index for s in stages], has_first, has_last


def register_moe_load_balancing_hook(optimizer, model, parallel_dims) -> None:
    from torchtitan.components.optimizer import register_moe_load_balancing_hook as hook

    hook(optimizer, [model], parallel_dims)


# -- MoE routing (qwen3_research.routing) --------------------------------------------------------
def set_moe_load_balance(model_config, coeff) -> None:
    """The expert-bias coefficient of every MoE layer (``MoE.Config.load_balance_coeff``, torchtitan
    models/common/moe.py), before the build. None: no ``expert_bias_E`` buffer, and
    ``register_moe_load_balancing_hook`` registers nothing (torchtitan components/optimizer/optimizer.py)."""
    for layer in model_config.layers:
        if getattr(layer, "moe", None) is not None:
            layer.moe.load_balance_coeff = coeff


def attach_router_hooks(model, fn) -> tuple[list, list]:
    """Call ``fn(layer, router, probs, ids)`` after every MoE router forward, MoE layers numbered 0.. in order:
    ``probs`` (.., E) the softmax over experts (torchtitan's ``scores_BLE``, float32, unbiased, in the graph),
    ``ids`` (.., K) the experts each token was sent to (the expert bias included). (hook handles, [(E, K)])."""
    handles, shapes = [], []
    for i, block in enumerate(b for b in model.layers.values() if _moe_of(b) is not None):
        router = _moe_of(block).router

        def hook(mod, args, out, i=i):
            _scores_BLK, ids_BLK, scores_BLE = out  # TokenChoiceTopKRouter.forward's return
            fn(i, mod, scores_BLE, ids_BLK)

        handles.append(router.register_forward_hook(hook))
        shapes.append((int(router.num_experts), int(router.top_k)))
    return handles, shapes


def _moe_of(block):
    """A transformer block's MoE module (through an activation-checkpoint wrapper), or None."""
    inner = getattr(block, "_checkpoint_wrapped_module", block)
    return inner.moe if getattr(inner, "moe_enabled", False) else None


# -- document masking (data.document_masking) -------------------------------------------------------
def document_attention_masks(model, positions, flex: bool):
    """The attention masks of packed documents whose ``positions`` (B, L) restart at 0 at every document.

    flex (CUDA): torchtitan's own block-causal BlockMask from the positions (``Decoder.get_attention_masks``,
    models/common/decoder.py). sdpa: a boolean (B, 1, L, L) mask, same document and causal, which the SDPA
    modules take after ``_masked_sdpa`` (torchtitan's ``ScaledDotProductAttention`` refuses masks: it only
    does ``is_causal``). B·L² bytes: 64 MiB at 4 × 4096."""
    import torch

    inner = getattr(model, "_orig_mod", model)  # torch.compile's wrapper
    if flex:
        return inner.get_attention_masks(positions=positions)
    _masked_sdpa(inner)
    doc = torch.cumsum(positions == 0, dim=1)
    L = positions.shape[1]
    causal = torch.ones(L, L, dtype=torch.bool, device=positions.device).tril()
    return ((doc[:, :, None] == doc[:, None, :]) & causal)[:, None]


def _masked_sdpa(model) -> None:
    """Every ScaledDotProductAttention of ``model`` takes a boolean mask (once; no parameter changes)."""
    from torchtitan.models.common.attention import ScaledDotProductAttention

    for module in model.modules():
        if type(module) is ScaledDotProductAttention:
            module.__class__ = _MaskedSDPA()


@functools.lru_cache(maxsize=None)
def _MaskedSDPA():
    import torch.nn.functional as F
    from torch.distributed.tensor import DTensor, Replicate
    from torchtitan.models.common.attention import ScaledDotProductAttention

    def forward(self, q_BLNH, k_BLNH, v_BLNH, *, attention_masks=None, scale=None, enable_gqa=False,
                is_causal=True, **kwargs):
        if attention_masks is None:
            return ScaledDotProductAttention.forward(self, q_BLNH, k_BLNH, v_BLNH, scale=scale, enable_gqa=enable_gqa,
                                                     is_causal=is_causal, **kwargs)
        mask = attention_masks
        if isinstance(q_BLNH, DTensor) and not isinstance(mask, DTensor):  # heads sharded: the mask is whole
            mask = DTensor.from_local(mask, q_BLNH.device_mesh, [Replicate()] * q_BLNH.device_mesh.ndim)
        q, k, v = (t.transpose(1, 2) for t in (q_BLNH, k_BLNH, v_BLNH))
        # torch's own kernel choice: flash takes no mask, efficient attention and math do
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa)
        return out.transpose(1, 2)

    return type("ScaledDotProductAttention", (ScaledDotProductAttention,), {"forward": forward, "__module__": __name__})


def state_dict_adapter(model_config):
    """torchtitan's Qwen3 HF<->native key mapping (``from_hf`` / ``to_hf`` on on-disk HF keys)."""
    from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter

    return Qwen3StateDictAdapter(model_config, None)


# -- distributed -------------------------------------------------------------------------------
def parallelism_config(d):
    """torchtitan's ParallelismConfig for our degrees (the partial_dtensor backend: DTensor on model axes)."""
    from torchtitan.config import ParallelismConfig as TTParallelism

    return TTParallelism(
        data_parallel_replicate_degree=d.dp_replicate,
        data_parallel_shard_degree=d.dp_shard,
        tensor_parallel_degree=d.tp,
        enable_sequence_parallel=d.sequence_parallel,
        expert_parallel_degree=d.ep,
        pipeline_parallel_degree=d.pp,
        pipeline_parallel_schedule=d.pp_schedule,
        pipeline_parallel_layers_per_stage=d.pp_layers_per_stage or None,
        spmd_backend="partial_dtensor",
    )


def parallel_dims(d):
    """torchtitan's ParallelDims for our degrees (mesh not built yet)."""
    # torchtitan builds size-1 mesh axes on the "fake" c10d backend, which torch registers
    # only when this (test-namespace) module is imported.
    import torch.testing._internal.distributed.fake_pg  # noqa: F401
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as tt_dist

    # The model code (MoE token dispatch) reads this global, whose default is spmd_types.
    tt_dist.set_spmd_backend("partial_dtensor")
    return ParallelDims(
        dp_replicate=d.dp_replicate, dp_shard=d.dp_shard, cp=1, tp=d.tp, pp=d.pp, ep=d.ep,
        world_size=d.world_size, spmd_backend="partial_dtensor",
    )


def training_configs(d, *, activation_checkpoint: str, compile_backend: str, mixed_precision: str, run_dir: str):
    """The torchtitan config objects ``parallelize_qwen3`` reads."""
    from torchtitan.config import CompileConfig, TrainingConfig
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC

    ac = {"none": None, "full": FullAC.Config(), "selective": SelectiveAC.Config()}[activation_checkpoint]
    param_dtype = "bfloat16" if mixed_precision == "bf16" else "float32"
    return SimpleNamespace(
        parallelism=parallelism_config(d),
        training=TrainingConfig(mixed_precision_param=param_dtype),
        # Compile is applied by the Trainer around the whole model, not per block here.
        compile=CompileConfig(enable=False, backend=compile_backend),
        activation_checkpoint=ac,
        dump_folder=run_dir,
    )


def apply_activation_checkpointing(model, tt) -> None:
    """Single-process path: torchtitan's AC wrapper without any sharding."""
    if tt.activation_checkpoint is None:
        return
    tt.activation_checkpoint.build(dump_folder=tt.dump_folder).apply(model)


def no_parallel(**kwargs):
    """torchtitan's NoParallel TP style (a module kept whole, inputs/outputs as DTensors)."""
    from torchtitan.distributed.tensor_parallel import NoParallel

    return NoParallel(**kwargs)


def mark_expert_counts_varying(counts) -> None:
    """Under torchtitan's spmd_types backend, tell its type checker the per-expert counts vary over dp/cp.

    A no-op on the partial_dtensor backend (the one this project uses) and where spmd_types is absent.
    """
    try:
        import spmd_types as spmd
        from torchtitan.distributed.spmd_types import spmd_mesh_size
        from torchtitan.distributed.utils import get_spmd_backend
    except ImportError:
        return
    if get_spmd_backend() == "spmd_types" and spmd.is_type_checking() and spmd_mesh_size("ep") == 1:
        for axis in ("dp", "cp"):
            spmd.mutate_type(counts, axis, src=spmd.P, dst=spmd.V)


# -- HF architecture ---------------------------------------------------------------------------
def qwen3_config_for_architecture(arch, attention: str, device_type: str, seq_len: int):
    """Qwen3Model.Config for an architecture read from a Hugging Face config.json (``models.native.hf_config``).

    torchtitan's own building blocks (``qwen3_model_config``), then what its builders fix and a
    checkpoint may change: every RMSNorm's eps (``rms_norm_eps``) and the router's top-k
    renormalisation (``norm_topk_prob`` -> ``route_norm``). The RoPE table has ``seq_len`` rows.
    """
    arch_at_len = dataclasses.replace(arch, torchtitan_name=None, max_seq_len=seq_len)
    from torchtitan.models.common.nn_modules import RMSNorm

    cfg = qwen3_model_config(arch_at_len, attention, device_type)
    seen: set[int] = set()

    def visit(node) -> None:
        if id(node) in seen:
            return
        seen.add(id(node))
        if isinstance(node, (list, tuple)):
            for item in node:
                visit(item)
            return
        if not dataclasses.is_dataclass(node) or isinstance(node, type):
            return
        if isinstance(node, RMSNorm.Config):
            node.eps = arch.rms_norm_eps
        if hasattr(node, "route_norm"):
            node.route_norm = arch.norm_topk_prob
        for f in dataclasses.fields(node):
            visit(getattr(node, f.name, None))

    visit(cfg)
    return cfg
