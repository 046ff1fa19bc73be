"""Mixture-of-experts routing: which load balancing a run uses (``model.moe.balance``), Qwen3's auxiliary
load-balancing loss, and the routing statistics of every logged step.

Everything is computed from what each router already produced in the forward pass (the softmax over experts and
the chosen experts), through the backend's ``attach_router_hooks``; nothing is recomputed and nothing reads a
value on the host until a logged step, when one all-reduce over every rank brings the counts together.

Balancing (``Balance``):

- ``aux_loss``: Qwen3's auxiliary loss as transformers computes it (``load_balancing_loss_func``,
  transformers/models/qwen3_moe/modeling_qwen3_moe.py, 5.16): per forward, over every MoE layer's rows pooled,
  ``E · Σ_e f_e · P_e`` with ``f_e`` the fraction of top-k choices (of the unbiased softmax) that went to expert
  e and ``P_e`` the mean router probability of e; ``coef · aux`` is added to the language-model loss. Balanced:
  ``K`` (top-k); every token on the same K experts: ``E``.
- ``bias``: torchtitan's auxiliary-loss-free balancing (https://arxiv.org/abs/2408.15664): a per-expert bias
  added to the scores that pick the experts (not to the weights), moved by ``bias_coef · sign(mean - tokens)``
  before every optimizer step (``titan.register_moe_load_balancing_hook``).
- ``none``: neither.

Statistics, per MoE layer over the steps since the previous logged step (tokens as routed, the bias included):
tokens per expert, ``max_load`` (max / mean tokens per expert: 1 balanced, E/K when every token goes to the same
K experts), ``cv`` (standard deviation / mean), ``empty_frac`` (experts that got no token), ``entropy`` (the
router's mean per-token entropy over ln E: 1 uniform, 0 one-hot) and, where an expert module pads (TorchNeuron's
group alignment, the NKI kernel's blocks), ``padded_rows``. Aggregated over layers: the worst ``max_load`` and
the mean of the others; padded rows summed. With ``bias``, ``moe_expert_bias``: the largest |expert bias| over
layers after the step (0 at the start; it grows by ``bias_coef`` per step while the load stays uneven), the one
figure that shows the balancing acts (the routing figures above look the same with the bias frozen).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
from torch.distributed.tensor import DTensor

from qwen3_research import titan
from qwen3_research.errors import ConfigError

HF_DEFAULT_AUX_COEF = 0.001  # transformers' Qwen3MoeConfig.router_aux_loss_coef default
PER_LAYER = ("max_load", "cv", "empty_frac", "entropy")


@dataclass(frozen=True)
class Balance:
    """The load balancing a MoE run uses (``resolve_balance``)."""

    mode: str  # none | aux_loss | bias
    aux_loss_coef: float
    bias_coef: float
    why: str  # where the choice came from, for the summary

    def describe(self) -> str:
        coef = {"aux_loss": f" coef={self.aux_loss_coef:g}", "bias": f" coef={self.bias_coef:g}"}.get(self.mode, "")
        return f"{self.mode}{coef} ({self.why})"


def resolve_balance(moe_cfg, *, checkpoint: Optional[dict], modes: tuple, what: str = "the checkpoint") -> Balance:
    """``model.moe`` resolved for a backend that can run ``modes`` (the first: its default without a checkpoint).

    ``balance=auto`` follows a Qwen3-MoE checkpoint (``checkpoint``: its config.json as a dict, or None): it
    carries ``router_aux_loss_coef``, the auxiliary loss it was trained with, so a positive coefficient means
    ``aux_loss`` with that coefficient; without one (or without a checkpoint) the backend's default.
    ``aux_loss_coef`` null: the checkpoint's coefficient, else transformers' default 0.001."""
    ckpt_coef = (checkpoint or {}).get("router_aux_loss_coef")
    mode, why = moe_cfg.balance, "model.moe.balance"
    if mode == "auto":
        if ckpt_coef and "aux_loss" in modes:
            mode, why = "aux_loss", f"auto: {what}'s router_aux_loss_coef"
        else:
            mode, why = modes[0], "auto: the backend's default"
    if moe_cfg.aux_loss_coef is not None:
        coef = float(moe_cfg.aux_loss_coef)
    else:
        coef = float(ckpt_coef) if ckpt_coef is not None else HF_DEFAULT_AUX_COEF
    return Balance(mode=mode, aux_loss_coef=coef, bias_coef=float(moe_cfg.bias_coef), why=why)


def aux_loss(probs: list, num_experts: int, top_k: int) -> torch.Tensor:
    """transformers' ``load_balancing_loss_func`` without an attention mask, from each MoE layer's router
    probabilities (softmax over experts, rows = tokens): counts and probabilities pooled over all layers and
    rows, then ``E · Σ_e (counts_e / rows) · (probs_e / rows)``. Gradients flow through the probabilities."""
    counts = torch.zeros(num_experts, dtype=torch.float32, device=probs[0].device)
    psum = torch.zeros(num_experts, dtype=torch.float32, device=probs[0].device)
    rows = 0
    for p in probs:
        p = p.reshape(-1, num_experts)
        chosen = torch.topk(p, top_k, dim=-1).indices.reshape(-1)
        counts = counts + torch.zeros_like(counts).scatter_add_(0, chosen, torch.ones_like(chosen, dtype=counts.dtype))
        psum = psum + p.float().sum(0)
        rows += p.shape[0]
    return num_experts * torch.sum((counts / rows) * (psum / rows))


def _local(t: torch.Tensor) -> tuple[torch.Tensor, float]:
    """(this rank's part, the share of it this rank counts): a DTensor replicated over some mesh axes is seen
    by every rank of those axes, so each counts 1/that many (the sum over all ranks then counts it once)."""
    if not isinstance(t, DTensor):  # not hasattr(t, "to_local"): under torch.compile (per block, the router hook
        return t, 1.0                # inside the graph) dynamo answered it False for a DTensor, whose ids then met
                                     # a plain tensor in scatter_add_ (tp2 MoE compiled: a fake-tensor error)
    replicas = 1
    for dim, placement in enumerate(t.placements):
        if not placement.is_shard():
            replicas *= t.device_mesh.size(dim)
    return t.to_local(), 1.0 / replicas


def _in_recomputation() -> bool:
    """Activation checkpointing runs a block's forward again inside the backward pass (its forward hooks fire a
    second time there): the graph task id is -1 only outside a backward. A private torch API (stable in 2.14);
    torchtitan's own counter divides by 2 instead (components/optimizer/optimizer.py)."""
    return torch._C._current_graph_task_id() != -1


class RoutingMonitor:
    """Routing statistics (``model.moe.routing_stats``) and the auxiliary loss (``balance=aux_loss``) of a model
    backend's MoE layers, from forward hooks on its routers (``ModelBackend.attach_router_hooks``).

    Per training forward (not evaluation, not activation-checkpoint recomputation), on the device: a
    scatter-add of the chosen experts and the routers' entropy into one buffer per layer. ``log_fields`` (every
    rank, at a logged step) all-reduces that buffer once and turns it into the record's fields.
    """

    def __init__(self, backend, balance: Balance, *, stats: bool, device):
        self.balance = balance
        self.stats = stats
        self._probs: list = []
        self.handles, self.shapes = backend.attach_router_hooks(self._routed)
        if not self.shapes:
            return
        self.num_experts, self.top_k = self.shapes[0]
        if any(s != self.shapes[0] for s in self.shapes):
            raise ValueError(f"MoE layers with different expert counts or top-k: {sorted(set(self.shapes))}")
        n, E = len(self.shapes), self.num_experts
        # per layer: tokens per expert [E] | sum of router entropies | rows | padded rows; then sum aux | forwards
        self.acc = torch.zeros(n * (E + 3) + 2, dtype=torch.float32, device=device)
        self.padding = [m for m in backend.model.modules() if callable(getattr(m, "padded_rows", None))]
        self.model = backend.model  # its expert bias is read at each logged step (a buffer a later move may replace)
        if stats:
            for i, module in enumerate(self.padding):
                self.handles.append(module.register_forward_pre_hook(self._padded(i % n)))

    @classmethod
    def attach(cls, backend, cfg, device) -> Optional["RoutingMonitor"]:
        """The monitor of a MoE backend (its ``balance``), or None (a dense model; nothing asked)."""
        balance = getattr(backend, "balance", None)
        if balance is None or (balance.mode != "aux_loss" and not cfg.routing_stats):
            return None
        monitor = cls(backend, balance, stats=cfg.routing_stats, device=device)
        if not monitor.shapes:
            if balance.mode == "aux_loss":
                raise ConfigError("model.moe.balance=aux_loss: the model has no MoE router to balance; use "
                                  "model.moe.balance=none (or auto)")
            return None
        return monitor

    def _row(self, layer: int) -> torch.Tensor:
        E = self.num_experts
        return self.acc[layer * (E + 3):(layer + 1) * (E + 3)]

    @torch.no_grad()
    def _count(self, layer: int, probs: torch.Tensor, ids: torch.Tensor) -> None:
        E = self.num_experts
        probs, share = _local(probs)
        ids, _ = _local(ids)
        row = self._row(layer)
        ids = ids.reshape(-1).to(torch.int64)
        # static shapes (no bincount): the same graph every step, under torch.compile too
        row[:E].scatter_add_(0, ids, torch.full(ids.shape, share, dtype=row.dtype, device=row.device))
        p = probs.reshape(-1, E).float()
        row[E] += -(p * p.clamp_min(1e-30).log()).sum() * share
        row[E + 1] += p.shape[0] * share

    def _routed(self, layer: int, module, probs: torch.Tensor, ids: torch.Tensor) -> None:
        if not module.training or _in_recomputation():
            return
        if self.stats:
            self._count(layer, probs, ids)
        if self.balance.mode == "aux_loss" and torch.is_grad_enabled():
            # tensor parallel: every rank computes the loss over all tokens (a differentiable all-gather)
            self._probs.append(probs.full_tensor() if hasattr(probs, "full_tensor") else probs)

    def _padded(self, layer: int):
        def hook(module, args) -> None:
            if module.training and not _in_recomputation():
                with torch.no_grad():
                    self._row(layer)[self.num_experts + 2] += module.padded_rows(*args[:2])
        return hook

    def aux_term(self) -> Optional[torch.Tensor]:
        """``coef · aux_loss`` of the forward just run (to add to its loss), or None (not aux_loss, no forward)."""
        if not self._probs:
            return None
        aux = aux_loss(self._probs, self.num_experts, self.top_k)
        self._probs.clear()
        with torch.no_grad():
            self.acc[-2] += aux.detach()
            self.acc[-1] += 1
        return self.balance.aux_loss_coef * aux

    def log_fields(self) -> dict:
        """The routing fields of a logged step (collective: every rank calls it), then a fresh interval."""
        buf = self.acc.clone()
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            torch.distributed.all_reduce(buf)
        self.acc.zero_()
        values = buf.double().cpu()
        out: dict = {}
        if values[-1] > 0:
            out["aux_loss"] = float(values[-2] / values[-1])
        E, n = self.num_experts, len(self.shapes)
        rows = []
        for layer in range(n):
            r = values[layer * (E + 3):(layer + 1) * (E + 3)]
            counts, entropy, tokens, padded = r[:E], float(r[E]), float(r[E + 1]), float(r[E + 2])
            if tokens <= 0:
                continue
            mean = float(counts.mean())
            row = {"layer": layer, "tokens": [int(round(float(c))) for c in counts],
                   "max_load": float(counts.max()) / mean, "cv": float(counts.std(unbiased=False)) / mean,
                   "empty_frac": float((counts < 0.5).double().mean()), "entropy": entropy / tokens / math.log(E)}
            if self.padding:
                row["padded_rows"] = int(round(padded))
            rows.append(row)
        if self.stats and rows:
            out["moe_max_load"] = max(r["max_load"] for r in rows)
            for key in PER_LAYER[1:]:
                out[f"moe_{key}"] = sum(r[key] for r in rows) / len(rows)
            if self.padding:
                out["moe_padded_rows"] = sum(r["padded_rows"] for r in rows)
            out["moe_per_layer"] = rows
        # balance=bias only: no other mode builds the buffer (titan.native_only_buffer names it on both APIs);
        # the same on every rank, each updates it from the all-reduced counts
        biases = [b for name, b in self.model.named_buffers() if titan.native_only_buffer(name)]
        if self.stats and biases:
            out["moe_expert_bias"] = max(float(_local(b)[0].detach().abs().max()) for b in biases)
        return out

    def summary(self) -> dict:
        return {"moe_balance": self.balance.describe(), "moe_layers": len(self.shapes)}

    def detach(self) -> None:
        """Remove every hook (benchmarks/bench_moe_routing.py times the step without them)."""
        for h in self.handles:
            h.remove()
        self.handles = []
