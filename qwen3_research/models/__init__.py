"""Model backends behind one small interface (``models.base.ModelBackend``).

``describe`` answers what validation needs (head counts, experts) without importing torch.
"""

from __future__ import annotations

import json
import os

from qwen3_research.config import ConfigError, ModelConfig, RunConfig
from qwen3_research.models.flavors import FROM_CHECKPOINT, Flavor, default_flavor, flavors_for, get_flavor

__all__ = ["flavors_for", "get_flavor", "resolve_flavor", "describe", "build", "tokenizer_spec"]


def resolve_flavor(cfg: ModelConfig) -> tuple[str, Flavor]:
    """(name, architecture) of a native model. With ``model.init_from`` the architecture is the
    checkpoint's config.json; ``model.flavor`` then defaults to it (``from_hf``/``auto``), and a named
    flavor must agree with it field by field (ConfigError naming the fields)."""
    from qwen3_research.hf_interop import config as hf_config

    if cfg.init_from:
        arch = Flavor(**hf_config.architecture_fields(cfg.init_from, cfg.backend))
        if cfg.flavor in FROM_CHECKPOINT:
            return "from_hf", arch
        if cfg.flavor not in flavors_for(cfg.backend):
            raise ConfigError(f"model.flavor={cfg.flavor!r} is not a {cfg.backend} flavor; leave it unset to take "
                              f"model.init_from's architecture, or choose one of {flavors_for(cfg.backend)}")
        hf_config.check_named_flavor(cfg.flavor, get_flavor(cfg.backend, cfg.flavor), arch,
                                     f"model.init_from={cfg.init_from!r}", cfg.backend)
        return cfg.flavor, arch
    if cfg.flavor == "from_hf":
        raise ConfigError("model.flavor=from_hf needs model.init_from=<HF directory>; or name a flavor "
                          f"({flavors_for(cfg.backend)})")
    name = default_flavor(None) if cfg.flavor in FROM_CHECKPOINT else cfg.flavor
    return name, get_flavor(cfg.backend, name)


def _hf_config(path: str) -> dict:
    cfg_file = os.path.join(os.path.expanduser(path), "config.json")
    if os.path.isdir(os.path.expanduser(path)):
        if not os.path.isfile(cfg_file):
            raise ConfigError(f"model.path={path!r} has no config.json; point it at a Hugging Face model directory")
        try:
            with open(cfg_file, encoding="utf-8") as fh:
                return json.load(fh)
        except (OSError, ValueError) as e:
            raise ConfigError(f"model.path={path!r}: config.json is unreadable ({e})") from None
    return {}  # a Hub id: resolved when the model is loaded


def describe(cfg: ModelConfig) -> dict:
    """n_heads, n_kv_heads, num_experts, is_moe for degree validation."""
    if cfg.backend == "hf":
        hc = _hf_config(cfg.path)
        n_experts = hc.get("num_experts") or hc.get("num_local_experts") or 0
        return {
            "n_heads": hc.get("num_attention_heads"),
            "n_kv_heads": hc.get("num_key_value_heads") or hc.get("num_attention_heads"),
            "num_experts": n_experts,
            "is_moe": bool(n_experts),
        }
    _, f = resolve_flavor(cfg)
    return {"n_heads": f.n_heads, "n_kv_heads": f.n_kv_heads, "num_experts": f.num_experts, "is_moe": f.num_experts > 0}


def tokenizer_spec(cfg: RunConfig) -> str:
    """An HF directory (model=hf's path, a native model's init_from) brings its own tokenizer when it has one."""
    own = cfg.model.path if cfg.model.backend == "hf" else cfg.model.init_from
    if cfg.data.tokenizer == "qwen3" and own:
        if os.path.isfile(os.path.join(os.path.expanduser(own), "tokenizer.json")):
            return own
    return cfg.data.tokenizer


def build(cfg: ModelConfig, device, *, seq_len: int, seed: int, tt_parallelism=None, tokenizer=None,
          load_init_from: bool = True):
    if cfg.backend == "hf":
        from qwen3_research.models.hf import HFCausalLM

        return HFCausalLM(cfg, device, seq_len=seq_len, seed=seed)
    from qwen3_research.models.native import NativeQwen3

    name, flavor = resolve_flavor(cfg)
    if tokenizer is not None and tokenizer.vocab_size > flavor.vocab_size:
        raise ConfigError(
            f"data.tokenizer has {tokenizer.vocab_size} tokens but model.flavor={name} has "
            f"{flavor.vocab_size} embedding rows; use the Qwen3 tokenizer or a larger vocabulary"
        )
    # With init_from the weights are read after sharding, each rank its own part (NativeQwen3.materialize).
    return NativeQwen3(cfg, device, seq_len, seed, tt_parallelism, flavor=flavor, flavor_name=name,
                       init_from=cfg.init_from if load_init_from else None)
