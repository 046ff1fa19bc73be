"""The small interface every model backend provides to the Trainer."""

from __future__ import annotations

from typing import TYPE_CHECKING

from qwen3_research import titan
from qwen3_research.errors import ExportError

if TYPE_CHECKING:  # annotations only: a backend's spec module may subclass this without importing torch
    import torch
    import torch.nn as nn


class ModelBackend:
    """A built model plus what the Trainer needs to know about it.

    Attributes: ``model`` (the nn.Module), ``num_params``, ``flops_per_token`` (forward +
    backward, torchtitan's formula), ``n_heads``, ``n_kv_heads``, ``num_experts`` (0 = dense).
    """

    model: nn.Module
    num_params: int
    flops_per_token: int
    n_heads: int
    n_kv_heads: int
    num_experts: int = 0
    balance = None  # MoE: the load balancing it trains with (qwen3_research.routing.Balance); None: dense

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:  # (B, L) -> (B, L, V) logits
        """A backend whose spec declares ``document_masking`` also takes ``positions=`` (B, L): per-document
        positions (0 at every document start) that restart attention and RoPE there."""
        raise NotImplementedError

    def attach_router_hooks(self, fn) -> tuple[list, list]:
        """MoE: call ``fn(layer, router module, probs (.., E), ids (.., K))`` after each router forward
        (qwen3_research.routing); (hook handles, [(experts, top_k)] per MoE layer). Dense: nothing."""
        return [], []

    def parallelize(self, parallel_dims, tt) -> None:
        raise NotImplementedError

    def lm_head_module(self) -> torch.nn.Module | None:
        """The output projection (an ``nn.Linear`` over the vocabulary); None: a backend that does not expose one
        (the full loss then takes no column-major weight copy, ``loss.column_major_lm_head``)."""
        return None

    def finalize_single(self, tt) -> None:
        """Single-process path (no sharding): activation checkpointing if asked."""
        titan.apply_activation_checkpointing(self.model, tt)

    def register_optimizer_hooks(self, optimizer: torch.optim.Optimizer, parallel_dims) -> None:
        """Optional: hooks a backend needs on the optimizer (MoE load balancing)."""

    def export_hf(self, out_dir, *, tokenizer_json, eos_id, inputs, reference_logits, compute_dtype,
                  max_shard_size="5GB") -> dict | None:
        """Optional: this model -> a verified Hugging Face directory ``out_dir`` (collective under a sharded model;
        rank 0's report, None on the other ranks). ``reference_logits``: the trained model's on ``inputs``, computed
        in ``compute_dtype`` (``run/export_hf.py``); ``tokenizer_json``/``eos_id``: the run's tokenizer, copied."""
        raise ExportError(f"{type(self).__name__} has no Hugging Face export; use checkpoint.export_hf=false")
