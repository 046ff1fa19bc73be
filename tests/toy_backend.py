"""A toy model backend, added the way any backend is added (tests/test_backends.py): this one module, which
defines ``BACKEND``, and one YAML option that names it (``model.module``). Nothing in qwen3_research changes.

The model is a bigram language model: a token embedding and a linear head to the vocabulary. It runs in one
process (no sharding plan: ``parallelize`` is the interface's default, which refuses).
"""

from __future__ import annotations

from qwen3_research.models.base import ModelBackend
from qwen3_research.models.registry import BackendSpec

DIM = 16  # embedding width


def describe(cfg) -> dict:
    """What degree validation needs: one "head" (nothing to split for tensor parallel), no experts."""
    return {"n_heads": 1, "n_kv_heads": 1, "num_experts": 0, "is_moe": False}


class Bigram(ModelBackend):
    def __init__(self, device, seed: int, vocab: int):
        import torch  # only the build imports torch: the spec above validates without it

        torch.manual_seed(seed)
        self.model = torch.nn.Sequential(torch.nn.Embedding(vocab, DIM), torch.nn.Linear(DIM, vocab, bias=False))
        self.model.to(device)
        self.num_params = sum(p.numel() for p in self.model.parameters())
        self.flops_per_token = 6 * DIM * vocab  # forward + backward of the head's matmul (the embedding is a lookup)
        self.n_heads = self.n_kv_heads = 1

    def forward(self, inputs):
        return self.model(inputs)

    def finalize_single(self, tt) -> None:
        """Two layers: no activation checkpointing to apply."""


def build(cfg, device, *, seq_len: int, seed: int, tt_parallelism=None, tokenizer=None, load_init_from: bool = True):
    return Bigram(device, seed, tokenizer.vocab_size)


# ``flavors``: the names model.flavor may take; a backend that names its architectures declares them, so a flavor is
# read (issue 40: a model.flavor no backend option reads is refused). The toy has one architecture.
# chunked_loss=False: forward gives the logits only
BACKEND = BackendSpec(name="toy", describe=describe, build=build, chunked_loss=False, flavors={"bigram": DIM})
