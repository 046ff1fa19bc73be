"""Checks of ``model.init_from`` in the launching process, before any worker starts (no weights read); the
native backend's spec exposes them as ``check_init_from`` (``run/checkpoint.preflight`` asks the spec).

config.json -> architecture (and an explicit model.flavor agrees: ``resolve_flavor``, by the caller), every
safetensors header parses and covers its file, the index names only present files, every tensor the model
needs is stored with its shape, and the tokenizer fits the embedding. Each failure is one ConfigError line (exit 2).
"""

from __future__ import annotations

from qwen3_research import models
from qwen3_research.config import RunConfig
from qwen3_research.errors import ConfigError
from qwen3_research.models.flavors import Flavor
from qwen3_research.models.native import hf_config


def check(rc: RunConfig, flavor: Flavor) -> None:
    """``rc.model.init_from`` against ``flavor``, the architecture its config.json describes."""
    m = rc.model
    hf_config.check_weights(m.init_from, flavor)
    if rc.data.seq_len > flavor.max_seq_len:
        raise ConfigError(f"data.seq_len={rc.data.seq_len} exceeds model.init_from's "
                          f"max_position_embeddings {flavor.max_seq_len}")
    # the native spec imports this module and is read by the config checks, which exit before torch loads
    # deferred: start-up (the tokenizer module loads torch)
    from qwen3_research.data import Tokenizer, tokenizer_path

    tok = Tokenizer(tokenizer_path(models.tokenizer_spec(rc)))
    hf_config.check_tokenizer_fits(tok.vocab_size, flavor, f"model.init_from={m.init_from!r}")
