"""``model=hf``: a Hugging Face Transformers causal LM (AutoModelForCausalLM) from ``model.path``, a local
directory or a Hub id; its architecture, tokenizer and weights are the directory's.

This package is the backend: its spec and what validation needs (here: config.json read as JSON, no torch
import), the model (``model.HFCausalLM``, imported by ``build``) and its export (``export``: gathered to rank 0,
transformers' ``save_pretrained``, verified by reloading).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from qwen3_research.config import ConfigError, ModelConfig
from qwen3_research.models.hf.source import check_source
from qwen3_research.models.registry import BackendSpec


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
    check_source(path)
    return {}  # a Hub id: resolved when the model is loaded


def describe(cfg: ModelConfig) -> dict:
    """Heads and experts from config.json (a Hub id: unknown until the model is loaded)."""
    hc = _hf_config(cfg.path)
    n_experts = hc.get("num_experts") or hc.get("num_local_experts") or 0
    return {
        "n_heads": hc.get("num_attention_heads"),
        "n_kv_heads": hc.get("num_key_value_heads") or hc.get("num_attention_heads"),
        "num_experts": n_experts,
        "is_moe": bool(n_experts),
    }


def build(cfg: ModelConfig, device, *, seq_len: int, seed: int, tt_parallelism=None, tokenizer=None,
          load_init_from: bool = True):
    # deferred: start-up (this spec is read by the config checks, which exit before torch loads; the model loads it)
    from qwen3_research.models.hf.model import HFCausalLM

    return HFCausalLM(cfg, device, seq_len=seq_len, seed=seed)


def smoke_overrides(tmp: Path) -> list[str]:
    """doctor --run: a random 2-layer Qwen3 checkpoint written under ``tmp`` for the tiny run."""
    # deferred: start-up (doctor imports this spec before torch loads; writing the checkpoint loads transformers)
    from qwen3_research.models.hf.model import write_tiny_checkpoint

    return [f"model.path={write_tiny_checkpoint(tmp / 'hf_tiny')}"]


BACKEND = BackendSpec(
    name="hf", describe=describe, build=build, takes_path=True, tokenizer_dir=lambda cfg: cfg.path,
    smoke_overrides=smoke_overrides, balance_modes=("none", "aux_loss"), document_masking=True,
    compiles_under_tp=False,
)
