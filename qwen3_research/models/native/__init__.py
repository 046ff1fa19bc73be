"""``model=native``: torchtitan's Qwen3 (dense) from a named flavor (``models.flavors.DENSE``) or from
``model.init_from``'s config.json, whose safetensors it then loads shard by shard.

This module is the backend's spec and what validation needs (no torch import); the model itself is
``models.native_model.NativeQwen3``, imported by ``build``. ``native_spec`` makes the spec of a native
variant: ``models.native_moe`` is the MoE one.
"""

from __future__ import annotations

import functools
from typing import Mapping

from qwen3_research import titan
from qwen3_research.config import ConfigError, ModelConfig, RunConfig
from qwen3_research.models.flavors import DEFAULT_FLAVOR, DENSE, Flavor
from qwen3_research.models import registry
from qwen3_research.models.registry import FROM_CHECKPOINT, BackendSpec


def resolve_flavor(cfg: ModelConfig, spec: BackendSpec | None = None) -> tuple[str, Flavor]:
    """(name, architecture) of a native model (``spec``: its variant, by default the configured one). With
    ``model.init_from`` the architecture is the checkpoint's config.json; ``model.flavor`` then defaults to it
    (``from_hf``/``auto``), and a named flavor must agree with it field by field (ConfigError naming the fields)."""
    from qwen3_research.hf_interop import config as hf_config

    spec = spec or registry.spec(cfg)
    flavors = spec.flavors
    if cfg.init_from:
        arch = Flavor(**hf_config.architecture_fields(cfg.init_from, spec))
        if cfg.flavor in FROM_CHECKPOINT:
            return "from_hf", arch
        if cfg.flavor not in flavors:
            raise ConfigError(f"model.flavor={cfg.flavor!r} is not a {spec.name} flavor; leave it unset to take "
                              f"model.init_from's architecture, or choose one of {list(flavors)}")
        hf_config.check_named_flavor(cfg.flavor, flavors[cfg.flavor], arch, f"model.init_from={cfg.init_from!r}", spec)
        return cfg.flavor, arch
    if cfg.flavor == "from_hf":
        raise ConfigError(f"model.flavor=from_hf needs model.init_from=<HF directory>; or name a flavor ({list(flavors)})")
    name = DEFAULT_FLAVOR if cfg.flavor in FROM_CHECKPOINT else cfg.flavor
    return name, flavors[name]


def describe(cfg: ModelConfig, spec) -> dict:
    _, f = resolve_flavor(cfg, spec)
    return {"n_heads": f.n_heads, "n_kv_heads": f.n_kv_heads, "num_experts": f.num_experts, "is_moe": f.num_experts > 0}


def flops_per_token(cfg: ModelConfig, seq_len: int, spec) -> float:
    """torchtitan's formula (6 × active matmul params + attention), from the architecture alone; the built
    model's figure (``titan.nparams_and_flops``) counts the same parameters."""
    f = resolve_flavor(cfg, spec)[1]
    d, hd = f.dim, f.head_dim
    attn = d * (f.n_heads + 2 * f.n_kv_heads) * hd + f.n_heads * hd * d
    ffn = (f.top_k * 3 * d * f.hidden_dim + d * f.num_experts) if f.num_experts else 3 * d * f.hidden_dim
    matmul = f.n_layers * (attn + ffn) + f.vocab_size * d
    return 6 * matmul + 12 * f.n_layers * f.n_heads * hd * seq_len


def check_run(rc: RunConfig, spec) -> None:
    """What the installed torchtitan cannot run for this model (its 0.2.x API's limits), before any worker."""
    titan.check_supported(rc, moe=spec.moe)


def build(cfg: ModelConfig, device, *, seq_len: int, seed: int, tt_parallelism=None, tokenizer=None,
          load_init_from: bool = True, spec):
    from qwen3_research.models.native_model import NativeQwen3

    name, flavor = resolve_flavor(cfg, spec)
    if tokenizer is not None and tokenizer.vocab_size > flavor.vocab_size:
        raise ConfigError(
            f"data.tokenizer has {tokenizer.vocab_size} tokens but model.flavor={name} has "
            f"{flavor.vocab_size} embedding rows; use the Qwen3 tokenizer or a larger vocabulary"
        )
    # With init_from the weights are read after sharding, each rank its own part (NativeQwen3.materialize).
    return NativeQwen3(cfg, device, seq_len, seed, tt_parallelism, flavor=flavor, flavor_name=name,
                       init_from=cfg.init_from if load_init_from else None)


def native_spec(name: str, flavors: Mapping[str, Flavor], *, moe: bool, hf_model_type: str) -> BackendSpec:
    """The spec of a native variant: torchtitan's Qwen3 with ``flavors``, reading/writing ``hf_model_type``."""
    def bind(fn):  # each function is told which variant it serves (``spec``, bound once it exists)
        return functools.wraps(fn)(lambda *a, **kw: fn(*a, **kw, spec=spec))

    spec = BackendSpec(
        name=name, describe=bind(describe), build=bind(build), flavors=flavors, takes_init_from=True, moe=moe,
        torchtitan=True, hf_model_type=hf_model_type, check_run=bind(check_run), tokenizer_dir=lambda cfg: cfg.init_from,
        flops_per_token=bind(flops_per_token), architecture=lambda cfg: resolve_flavor(cfg, spec)[1],
        balance_modes=("bias", "aux_loss", "none") if moe else ("none",), document_masking=True,
    )
    return spec


BACKEND = native_spec("native", DENSE, moe=False, hf_model_type="qwen3")
