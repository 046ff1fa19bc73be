"""Checks of ``model.init_from`` in the launching process, before any worker starts (no weights read).

config.json -> architecture (and an explicit model.flavor agrees), every safetensors header parses
and covers its file, the index names only present files, every tensor the model needs is stored with
its shape, and the tokenizer fits the embedding. Each failure is one ConfigError line (exit 2).
"""

from __future__ import annotations

from qwen3_research.config import RunConfig
from qwen3_research.hf_interop import config as hf_config


def check_init_from(rc: RunConfig) -> None:
    from qwen3_research import models

    m = rc.model
    flavor = models.architecture(m)
    hf_config.check_weights(m.init_from, flavor)
    if rc.data.seq_len > flavor.max_seq_len:
        raise hf_config.ConfigError(f"data.seq_len={rc.data.seq_len} exceeds model.init_from's "
                                    f"max_position_embeddings {flavor.max_seq_len}")
    from qwen3_research.data import Tokenizer, tokenizer_path

    tok = Tokenizer(tokenizer_path(models.tokenizer_spec(rc)))
    hf_config.check_tokenizer_fits(tok.vocab_size, flavor, f"model.init_from={m.init_from!r}")
