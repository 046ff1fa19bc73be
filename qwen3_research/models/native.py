"""torchtitan's native Qwen3 and Qwen3-MoE: config from a flavor, meta build, seeded init.

torchtitan is reached through ``qwen3_research.titan``; import this module only after
``device.prepare_torchtitan`` (torchtitan reads the device at import).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from qwen3_research import titan
from qwen3_research.config import ModelConfig
from qwen3_research.models.base import ModelBackend
from qwen3_research.models.flavors import Flavor, get_flavor

# Full-model init before sharding (layout-independent weights) up to this size; larger
# models are initialized after sharding, as torchtitan does, to fit device memory.
FULL_INIT_MAX_PARAMS = 2_000_000_000


class NativeQwen3(ModelBackend):
    """torchtitan Qwen3 (dense or MoE) built from ``model.flavor``."""

    def __init__(self, cfg: ModelConfig, device: torch.device, seq_len: int, seed: int, tt_parallelism=None):
        self.flavor = get_flavor(cfg.backend, cfg.flavor)
        if seq_len > self.flavor.max_seq_len:
            from qwen3_research.config import ConfigError

            raise ConfigError(
                f"data.seq_len={seq_len} exceeds model.flavor={cfg.flavor}'s RoPE length {self.flavor.max_seq_len}"
            )
        if cfg.attention == "flex" and device.type != "cuda":
            from qwen3_research.config import ConfigError

            raise ConfigError(
                f"model.attention=flex needs device cuda (FlexAttention has no {device.type} training kernels: no "
                f"backward on CPU); this run's device is {device.type}: use model.attention=sdpa"
            )
        self.flex = cfg.attention == "flex"
        self._masks: dict = {}
        self.model_config = titan.qwen3_model_config(self.flavor, cfg.attention, device.type)
        if tt_parallelism is not None:
            titan.apply_parallelism_plans(self.model_config, tt_parallelism)
        self.device = device
        self.seed = seed
        with torch.device("meta"):
            self.model = titan.build_model(self.model_config)
        self.num_params, self.flops_per_token = titan.nparams_and_flops(self.model_config, self.model, seq_len)
        self.is_moe = self.flavor.num_experts > 0
        self._initialized = False
        if self.num_params <= FULL_INIT_MAX_PARAMS:
            self.init_weights()

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

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        if not self.flex:
            return self.model(inputs)
        key = tuple(inputs.shape)
        if key not in self._masks:  # one BlockMask per batch shape (causal: it does not depend on the tokens)
            self._masks[key] = titan.flex_attention_masks(self.model, *key, inputs.device)
        return self.model(inputs, attention_masks=self._masks[key])

    def parallelize(self, parallel_dims, tt) -> None:
        """Shard with torchtitan's Qwen3 plan; ``tt`` holds torchtitan's config objects."""
        from qwen3_research.parallel import keep_embeddings_tied_through_tp

        keep_embeddings_tied_through_tp(self.model)
        titan.parallelize_qwen3(self.model, parallel_dims, tt)
        if not self._initialized:
            self.init_weights()

    def finalize_single(self, tt) -> None:
        if not self._initialized:
            self.init_weights()
        super().finalize_single(tt)

    def register_optimizer_hooks(self, optimizer: torch.optim.Optimizer, parallel_dims) -> None:
        if self.is_moe:
            titan.register_moe_load_balancing_hook(optimizer, self.model, parallel_dims)


    # -- chunked loss (qwen3_research.loss): hidden states and the lm_head weight, apart --------------
    def hidden_states(self, inputs: torch.Tensor) -> torch.Tensor:
        """(B, L, dim) after the final norm: torchtitan's own ``_skip_lm_head`` switch for chunked losses."""
        inner = getattr(self.model, "_orig_mod", self.model)  # under torch.compile
        inner._skip_lm_head = True
        try:
            return self.model(inputs)
        finally:
            inner._skip_lm_head = False

    def lm_head_weight(self) -> torch.Tensor:
        """The lm_head weight as the step sees it (FSDP keeps the norm+lm_head unit gathered after forward)."""
        return getattr(self.model, "_orig_mod", self.model).lm_head.weight
