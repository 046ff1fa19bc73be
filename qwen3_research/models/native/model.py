"""The nn side of ``model=native`` (``models.native``): torchtitan's Qwen3 and Qwen3-MoE built from a flavor,
meta build, seeded init, sharding with torchtitan's plan, and its Hugging Face load (``hf_load``) and export
(``hf_export``).

torchtitan is reached through ``qwen3_research.titan``; build only after ``device.prepare_torchtitan``
(torchtitan reads the device at import).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from qwen3_research import devices, routing, titan
from qwen3_research.config import ConfigError, ModelConfig
from qwen3_research.models import registry
from qwen3_research.models.base import ModelBackend
from qwen3_research.models.flavors import FLAVORS, Flavor
from qwen3_research.models.native import hf_export
from qwen3_research.models.native.hf_config import read_hf_config
from qwen3_research.models.native.hf_load import load_hf_weights
from qwen3_research.parallel import keep_embeddings_tied_through_tp

# Full-model init before sharding (layout-independent weights) up to this size; larger
# models are initialized after sharding, as torchtitan does, to fit device memory.
FULL_INIT_MAX_PARAMS = 2_000_000_000


def norms_in_input_dtype(model: nn.Module) -> int:
    """Every ``nn.RMSNorm`` of ``model`` takes its weight in its input's dtype (cast in its forward; the float32
    parameter and its gradient stay as they are). Under bf16 autocast the q/k norms get bf16 inputs over float32
    weights, and ``torch.rms_norm`` then warns "Mismatch dtype between input and weight ... Cannot dispatch to fused
    implementation" on every step and runs its unfused float32 path (measured on one H200, GUIDE §9). The modules
    keep their class names (kernel targets match ``type:RMSNorm`` through the class's bases). Returns how many."""
    count = 0
    for module in model.modules():
        if isinstance(module, nn.RMSNorm) and not getattr(type(module), "_weight_in_input_dtype", False):
            module.__class__ = _input_dtype_norm_class(type(module))
            count += 1
    return count


_NORM_CLASSES: dict = {}


def _input_dtype_norm_class(base: type) -> type:
    if base not in _NORM_CLASSES:
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            w = self.weight
            if w is not None and w.dtype != x.dtype:
                w = w.to(x.dtype)
            return torch.nn.functional.rms_norm(x, self.normalized_shape, w, self.eps)

        _NORM_CLASSES[base] = type(base.__name__, (base,), {"forward": forward, "_weight_in_input_dtype": True,
                                                            "__module__": base.__module__})
    return _NORM_CLASSES[base]


class StageParts(nn.Module):
    """This rank's pipeline stages seen as one model under the whole model's names.

    torchtitan's split (``pipeline_llm``) makes each stage a deep copy of the whole model with the other stages'
    modules deleted (None, or left out of ``layers``), so the parts' children never collide: here they are
    children again (the same module objects), and ``named_parameters``, DCP's state dicts, the optimizer and
    the clipping see the parameters by the names one process has. Never called: the schedule runs the parts.
    The parts themselves (each an FSDP unit at its root) are ``stage_parts``, outside the module tree."""

    def __init__(self, parts: list[nn.Module]):
        super().__init__()
        self.__dict__["stage_parts"] = list(parts)
        layers: dict[str, nn.Module] = {}
        for part in parts:
            for name, child in part.named_children():
                if name == "layers":
                    layers.update(child.items() if hasattr(child, "items") else enumerate(child))
                elif child is not None:
                    self.add_module(name, child)
        self.layers = nn.ModuleDict({str(k): layers[k] for k in sorted(layers, key=int)})

    def forward(self, *args, **kwargs):
        raise RuntimeError("a pipelined model runs through its schedule (Step), not forward()")


class NativeQwen3(ModelBackend):
    """torchtitan Qwen3 (dense or MoE) built from ``model.flavor``, or from ``model.init_from``'s config.json.

    With ``init_from`` the model stays on the meta device until it is sharded (or, single process,
    until ``finalize_single``); ``materialize`` then allocates each rank's shards and reads only those
    from the safetensors (``hf_load``). No rank ever holds the full model.
    """

    def __init__(self, cfg: ModelConfig, device: torch.device, seq_len: int, seed: int, tt_parallelism=None, *,
                 flavor: Flavor | None = None, flavor_name: str | None = None, init_from: str | None = None):
        cfg = registry.canonical(cfg)  # an old model=native_moe config: today's flavor name
        if flavor is None:
            flavor = FLAVORS[cfg.flavor]
        self.flavor = flavor
        self.flavor_name = flavor_name or cfg.flavor
        if seq_len > self.flavor.max_seq_len:
            what = (f"model.init_from's max_position_embeddings" if cfg.init_from
                    else f"model.flavor={self.flavor_name}'s RoPE length")
            raise ConfigError(f"data.seq_len={seq_len} exceeds {what} {self.flavor.max_seq_len}")
        spec = devices.find(device.type)
        if cfg.attention == "flex" and not (spec is not None and spec.flex_attention):
            raise ConfigError(
                f"model.attention=flex needs device cuda (FlexAttention has no {device.type} training kernels: no "
                f"backward on {device.type.upper()}); this run's device is {device.type}: use model.attention=sdpa"
            )
        self.flex = cfg.attention == "flex"
        self._masks: dict = {}
        if cfg.init_from:
            # The checkpoint's architecture; the RoPE table has data.seq_len rows, not max_position_embeddings.
            self.model_config = titan.qwen3_config_for_architecture(self.flavor, cfg.attention, device.type, seq_len)
        else:
            self.model_config = titan.qwen3_model_config(self.flavor, cfg.attention, device.type)
        self.is_moe = self.flavor.num_experts > 0
        if self.is_moe:  # the expert bias exists only with balance=bias (torchtitan builds it from the config)
            checkpoint = read_hf_config(cfg.init_from) if cfg.init_from else None
            self.balance = routing.resolve_balance(cfg.moe, checkpoint=checkpoint, what="model.init_from",
                                                   modes=registry.balance_modes(cfg))
            titan.set_moe_load_balance(self.model_config, self.balance.bias_coef if self.balance.mode == "bias" else None)
        if cfg.lora.enable:  # one LoRA adapter per projection, as HF's q_proj/k_proj/v_proj (qwen3_research/lora.py)
            titan.separate_qkv(self.model_config)
        if tt_parallelism is not None:
            titan.apply_parallelism_plans(self.model_config, tt_parallelism)
        self.device = device
        self.seed = seed
        self.init_from = init_from
        with torch.device("meta"):
            self.model = titan.build_model(self.model_config)
        norms_in_input_dtype(self.model)
        # TorchNeuron's grouped matmul takes token groups in multiples of 128 only: the experts pad on
        # neuron (a kernel override on the experts replaces this forward).
        titan.align_token_groups(self.model, device.type)
        self.num_params, self.flops_per_token = titan.nparams_and_flops(self.model_config, self.model, seq_len)
        self._initialized = False
        if self.num_params <= FULL_INIT_MAX_PARAMS and not init_from:
            self.init_weights()

    def materialize(self) -> None:
        """Allocate (on this rank: its shards) and fill the weights: seeded init, then init_from's safetensors."""
        if self._initialized:
            return
        self.init_weights()
        if self.init_from:
            load_hf_weights(self.model, self.model_config, self.init_from)

    @property
    def n_heads(self) -> int:
        return self.flavor.n_heads

    @property
    def n_kv_heads(self) -> int:
        return self.flavor.n_kv_heads

    @property
    def num_experts(self) -> int:
        return self.flavor.num_experts

    def init_weights(self) -> None:
        """Seeded init of the (full or sharded) model; same seed -> same full weights."""
        self.model.to_empty(device=self.device)
        with torch.no_grad():
            torch.manual_seed(self.seed)
            titan.init_weights(self.model, self.device)
        self._initialized = True

    def forward(self, inputs: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        if positions is not None:  # data.document_masking: per-document RoPE positions and attention
            return self.model(inputs, positions=positions,
                              attention_masks=titan.document_attention_masks(self.model, positions, self.flex))
        if not self.flex:
            return self.model(inputs)
        key = tuple(inputs.shape)
        if key not in self._masks:  # one BlockMask per batch shape (causal: it does not depend on the tokens)
            self._masks[key] = titan.flex_attention_masks(self.model, *key, inputs.device)
        return self.model(inputs, attention_masks=self._masks[key])

    def parallelize(self, parallel_dims, tt) -> None:
        """Shard with torchtitan's Qwen3 plan; ``tt`` holds torchtitan's config objects."""
        keep_embeddings_tied_through_tp(self.model)
        titan.parallelize_qwen3(self.model, parallel_dims, tt)
        self.materialize()

    def pipeline(self, parallel_dims, tt, *, loss_fn, local_batch_size: int, microbatches: int):
        """Split into this rank's pipeline stages (torchtitan's ``pipeline_llm``), each sharded with torchtitan's
        Qwen3 plan; ``self.model`` becomes their ``StageParts``. Returns (schedule, stage indices, has the first
        stage, has the last stage). A model initialized whole (up to FULL_INIT_MAX_PARAMS) keeps its seeded
        weights in every stage; a larger one is initialized per stage."""
        schedule, parts, stage_ids, has_first, has_last = titan.pipeline_qwen3(
            self.model, parallel_dims, tt, device=self.device, model_config=self.model_config, loss_fn=loss_fn,
            local_batch_size=local_batch_size, microbatches=microbatches)
        self.model = StageParts(parts)
        if not self._initialized:  # each stage's share of the seeded init (torchtitan's trainer does the same)
            with torch.no_grad():
                torch.manual_seed(self.seed)
                for part in parts:
                    part.to_empty(device=self.device)
                    titan.init_weights(part, self.device)
            self._initialized = True
            if self.init_from:
                load_hf_weights(self.model, self.model_config, self.init_from)
        return schedule, stage_ids, has_first, has_last

    def finalize_single(self, tt) -> None:
        self.materialize()
        super().finalize_single(tt)

    def register_optimizer_hooks(self, optimizer: torch.optim.Optimizer, parallel_dims) -> None:
        if self.is_moe:  # registers nothing unless balance=bias (no coefficient on the layers otherwise)
            titan.register_moe_load_balancing_hook(optimizer, self.model, parallel_dims)

    def attach_router_hooks(self, fn) -> tuple[list, list]:
        return titan.attach_router_hooks(getattr(self.model, "_orig_mod", self.model), fn)

    def export_hf(self, out_dir, *, tokenizer_json, eos_id, inputs, reference_logits, compute_dtype,
                  max_shard_size="5GB") -> dict | None:
        """This model (any parallel layout) -> a verified Hugging Face directory, written without gathering."""
        return hf_export.export_native(self, out_dir, tokenizer_json=tokenizer_json, eos_id=eos_id, inputs=inputs,
                                       reference_logits=reference_logits, compute_dtype=compute_dtype,
                                       max_shard_size=max_shard_size)

    # -- chunked loss (qwen3_research.loss): hidden states and the lm_head weight, apart --------------
    def hidden_states(self, inputs: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """(B, L, dim) after the final norm: torchtitan's own ``_skip_lm_head`` switch for chunked losses."""
        inner = getattr(self.model, "_orig_mod", self.model)  # under torch.compile
        inner._skip_lm_head = True
        try:
            return self.forward(inputs, positions)
        finally:
            inner._skip_lm_head = False

    def lm_head_module(self) -> torch.nn.Module:
        return getattr(self.model, "_orig_mod", self.model).lm_head

    def lm_head_weight(self) -> torch.Tensor:
        """The lm_head weight as the step sees it (FSDP keeps the norm+lm_head unit gathered after forward)."""
        return self.lm_head_module().weight
