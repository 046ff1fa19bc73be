"""Each active kernel against its float32 reference, forward and backward, on random inputs of the
run's shapes. Used by ``python -m qwen3_research.verify_kernels`` and ``kernels.verify=true``.
Each kernel module holds its own check (``KernelSpec.verify``: ``moe.verify_moe``, ``rope.verify_rope``)
on the helpers here; this module runs them over a plan and prints the table.

Error measure per tensor: max |kernel - reference| (abs) and abs / max |reference| (rel).
Backward covers every differentiable input (MoE: x, w1, w2, w3; RoPE: x) under one random
upstream gradient; the worst tensor is reported. A kernel passes when fwd and bwd rel <= its
``KernelSpec.tolerance`` for the dtype the check computed in (defaults: 1e-5 float32, 2e-2 bfloat16), which is
the run's compute dtype (its precision plan's, ``resolve.PrecisionPlan.compute_dtype``) unless the
kernel fixes its own (``options.dtype``, the NKI MoE kernels' bfloat16).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qwen3_research.errors import ConfigError
from qwen3_research.kernels.registry import KERNELS, entry_labels


@dataclass
class Check:
    kernel: str
    entry: str
    module: str
    shapes: str
    fwd_abs: float
    fwd_rel: float
    bwd_abs: float
    bwd_rel: float
    tol: float

    @property
    def ok(self) -> bool:
        return self.fwd_rel <= self.tol and self.bwd_rel <= self.tol


def _err(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    out, ref = out.detach().double().cpu(), ref.detach().double().cpu()
    diff = (out - ref).abs().max().item() if ref.numel() else 0.0
    scale = ref.abs().max().item() if ref.numel() else 0.0
    return diff, diff / scale if scale > 0 else diff


def _worst(pairs) -> tuple[float, float]:
    errs = [_err(a, b) for a, b in pairs]
    return max(e[0] for e in errs), max(e[1] for e in errs)


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def random_routing(tokens: int, num_experts: int, top_k: int, gen: torch.Generator) -> torch.Tensor:
    """Per-expert row counts of ``tokens`` tokens each routed to ``top_k`` distinct experts."""
    scores = torch.rand(tokens, num_experts, generator=gen)
    ids = scores.topk(min(top_k, num_experts), dim=-1).indices
    return torch.bincount(ids.flatten(), minlength=num_experts)


def run_shapes(model, cfg, dtype: str) -> dict:
    """Shapes of this run per rank: tokens per micro-batch, heads, experts' top-k."""
    top_k = next((m.top_k for m in model.modules() if type(m).__name__ == "TokenChoiceTopKRouter"), 1)
    n_heads = next((m.n_heads for m in model.modules() if hasattr(m, "n_heads") and hasattr(m, "rope")), 1)
    return {
        "batch": cfg.data.batch_size, "seq_len": cfg.data.seq_len, "tokens": cfg.data.batch_size * cfg.data.seq_len,
        "top_k": top_k, "n_heads": n_heads, "seed": cfg.training.seed,
        # the compute dtype the run resolves to: each kernel is checked in it, against its own tolerance for it
        "dtype": getattr(torch, dtype),
    }


def verify_plan(model, plan: dict, cfg, device, *, dtype: str, raise_on_fail: bool = False, printer=print
                ) -> list[Check]:
    """One check per kernel entry (on its first matched module: all share shapes), in ``dtype`` (the run's compute
    dtype: ``resolve.PrecisionPlan.compute_dtype``). Prints a table."""
    shapes = run_shapes(model, cfg, dtype)
    mods = dict(model.named_modules())
    checks: list[Check] = []
    for label, entry in entry_labels(cfg.kernels.entries):
        fqns = plan.get(label) or []
        spec = KERNELS[entry.name]
        if not fqns or spec.verify is None:
            continue
        for shp, fa, fr, ba, br, dtype in spec.verify(mods[fqns[0]], shapes, device, dict(entry.options or {})):
            tol = spec.tolerance.get(dtype, 0.0)  # the spec's own tolerance; none stated for this dtype -> FAIL
            checks.append(Check(entry.name, label, fqns[0], shp, fa, fr, ba, br, tol))
    printer(format_checks(checks, dtype))
    failed = [c for c in checks if not c.ok]
    if failed and raise_on_fail:
        c = failed[0]
        raise ConfigError(
            f"kernels.verify=true: kernel {c.kernel} fails its check against the float32 reference on {c.shapes} "
            f"(fwd rel {c.fwd_rel:.2e}, "
            f"bwd rel {c.bwd_rel:.2e} > tol {c.tol:.0e}); use kernels=none or report the kernel"
        )
    return checks


def format_checks(checks: list[Check], dtype: str = "float32") -> str:
    head = f"{'kernel':<12} {'shapes':<34} {'fwd max abs':>11} {'fwd rel':>9} {'bwd max abs':>11} {'bwd rel':>9} {'tol':>7}  result"
    tols = ", ".join(dict.fromkeys(f"{c.kernel} {c.shapes.rsplit(' ', 1)[-1]} rel <= {c.tol:.0e}" for c in checks))
    lines = [f"kernel verification against float32 references (forward and backward) in the run's compute dtype, "
             f"{dtype}; tolerance used: {tols or 'none'}", head]
    for c in checks:
        lines.append(
            f"{c.kernel:<12} {c.shapes:<34} {c.fwd_abs:>11.3e} {c.fwd_rel:>9.2e} {c.bwd_abs:>11.3e} {c.bwd_rel:>9.2e} "
            f"{c.tol:>7.0e}  {'PASS' if c.ok else 'FAIL'}"
        )
    if not checks:
        lines.append("(no active kernel)")
    return "\n".join(lines)
