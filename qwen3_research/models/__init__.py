"""Model backends behind one small interface (``models.base.ModelBackend``).

``describe`` answers what validation needs (head counts, experts) without importing torch.
"""

from __future__ import annotations

import json
import os

from qwen3_research.config import ConfigError, ModelConfig, RunConfig
from qwen3_research.models.flavors import flavors_for, get_flavor

__all__ = ["flavors_for", "get_flavor", "describe", "build", "tokenizer_spec"]


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
    f = get_flavor(cfg.backend, cfg.flavor)
    return {"n_heads": f.n_heads, "n_kv_heads": f.n_kv_heads, "num_experts": f.num_experts, "is_moe": f.num_experts > 0}


def tokenizer_spec(cfg: RunConfig) -> str:
    """The HF backend brings its own tokenizer when its directory has one."""
    if cfg.model.backend == "hf" and cfg.data.tokenizer == "qwen3" and cfg.model.path:
        if os.path.isfile(os.path.join(os.path.expanduser(cfg.model.path), "tokenizer.json")):
            return cfg.model.path
    return cfg.data.tokenizer


def build(cfg: ModelConfig, device, *, seq_len: int, seed: int, tt_parallelism=None, tokenizer=None):
    if cfg.backend == "hf":
        from qwen3_research.models.hf import HFCausalLM

        return HFCausalLM(cfg, device, seq_len=seq_len, seed=seed)
    from qwen3_research.models.native import NativeQwen3

    backend = NativeQwen3(cfg, device, seq_len, seed, tt_parallelism)
    if tokenizer is not None and tokenizer.vocab_size > backend.flavor.vocab_size:
        raise ConfigError(
            f"data.tokenizer has {tokenizer.vocab_size} tokens but model.flavor={cfg.flavor} has "
            f"{backend.flavor.vocab_size} embedding rows; use the Qwen3 tokenizer or a larger vocabulary"
        )
    if cfg.init_from:
        from qwen3_research.checkpoint import load_hf_into_native

        load_hf_into_native(backend, cfg.init_from)
    return backend
