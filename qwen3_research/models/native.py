"""torchtitan's native Qwen3 and Qwen3-MoE: config from a flavor, meta build, seeded init.

Import only after ``device.prepare_torchtitan`` (torchtitan reads the device at import).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn

from qwen3_research.config import ModelConfig
from qwen3_research.models.base import ModelBackend
from qwen3_research.models.flavors import Flavor, get_flavor

# Full-model init before sharding (layout-independent weights) up to this size; larger
# models are initialized after sharding, as torchtitan does, to fit device memory.
FULL_INIT_MAX_PARAMS = 2_000_000_000


def build_qwen3_config(flavor: Flavor, attention: str, device_type: str):
    """torchtitan's Qwen3Model.Config for a flavor, with the attention backend the device can run."""
    from torchtitan.models import qwen3 as tq
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear
    from torchtitan.models.common.attention import ScaledDotProductAttention

    if flavor.torchtitan_name is not None:
        cfg = tq.qwen3_configs[flavor.torchtitan_name](attn_backend="flex")
    else:
        # Same building blocks torchtitan's own flavors use (pinned torchtitan==0.3.0).
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


class NativeQwen3(ModelBackend):
    """torchtitan Qwen3 (dense or MoE) built from ``model.flavor``."""

    def __init__(self, cfg: ModelConfig, device: torch.device, seq_len: int, seed: int, tt_parallelism=None):
        self.flavor = get_flavor(cfg.backend, cfg.flavor)
        if seq_len > self.flavor.max_seq_len:
            from qwen3_research.config import ConfigError

            raise ConfigError(
                f"data.seq_len={seq_len} exceeds model.flavor={cfg.flavor}'s RoPE length {self.flavor.max_seq_len}"
            )
        self.model_config = build_qwen3_config(self.flavor, cfg.attention, device.type)
        if tt_parallelism is not None:
            # Fills the TP/SP/EP sharding plans on the config before the modules are built.
            self.model_config.update_from_config(config=_ParallelismHolder(tt_parallelism))
        self.device = device
        self.seed = seed
        with torch.device("meta"):
            self.model = self.model_config.build()
        self.num_params, self.flops_per_token = self.model_config.get_nparams_and_flops(self.model, seq_len)
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
            self.model.init_states(buffer_device=self.device)
        self._initialized = True

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.model(inputs)

    def parallelize(self, parallel_dims, tt) -> None:
        """Shard with torchtitan's Qwen3 plan; ``tt`` holds torchtitan's config objects."""
        from torchtitan.models.qwen3 import parallelize_qwen3

        from qwen3_research.parallel import keep_embeddings_tied_through_tp

        keep_embeddings_tied_through_tp(self.model)
        parallelize_qwen3(
            self.model, parallel_dims=parallel_dims, training=tt.training, parallelism=tt.parallelism,
            compile_config=tt.compile, ac_config=tt.activation_checkpoint, dump_folder=tt.dump_folder,
        )
        if not self._initialized:
            self.init_weights()

    def finalize_single(self, tt) -> None:
        if not self._initialized:
            self.init_weights()
        super().finalize_single(tt)

    def register_optimizer_hooks(self, optimizer: torch.optim.Optimizer, parallel_dims) -> None:
        if self.is_moe:
            from torchtitan.components.optimizer import register_moe_load_balancing_hook

            register_moe_load_balancing_hook(optimizer, [self.model], parallel_dims)


@dataclasses.dataclass
class _ParallelismHolder:
    parallelism: object

