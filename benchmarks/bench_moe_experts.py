"""MoE routed-expert computation, forward + backward: our override vs torchtitan vs transformers.

    python benchmarks/bench_moe_experts.py [--experts 64 --top-k 8 --tokens 1024 --dim 256 --hidden 128 --repeats 7]

Same weights, inputs and routing for every variant; each times dispatch (sort by expert) +
expert SwiGLU MLPs + combine, forward and backward:

* ``torchtitan``: torchtitan 0.3.0 ``RoutedExperts`` as built (``GroupedExperts`` casts to bf16,
  ``torch._grouped_mm``)
* ``moe_fast fp32`` / ``moe_fast bf16``: the same ``RoutedExperts`` with ``kernels=moe_fast``
  installed on its ``GroupedExperts`` (options.dtype input / bfloat16)
* ``transformers grouped_mm``: transformers' ``Qwen3MoeExperts`` run by its ``grouped_mm``
  experts implementation (fp32)

Prints min / median / max ms per variant and the ratios (variant time / override fp32 time),
min-median-max over repeats (ratio of the i-th sorted times).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from qwen3_research import devices  # noqa: E402

devices.prepare_torchtitan("cpu")


def build(args):
    from torchtitan.models.common.moe import GroupedExperts, RoutedExperts
    from torchtitan.models.common.token_dispatcher import LocalTokenDispatcher

    E, D, Fh = args.experts, args.dim, args.hidden
    g = torch.Generator().manual_seed(0)
    w1 = torch.randn(E, Fh, D, generator=g) * D**-0.5
    w3 = torch.randn(E, Fh, D, generator=g) * D**-0.5
    w2 = torch.randn(E, D, Fh, generator=g) * Fh**-0.5

    def titan():
        m = RoutedExperts.Config(
            inner_experts=GroupedExperts.Config(dim=D, hidden_dim=Fh, num_experts=E),
            token_dispatcher=LocalTokenDispatcher.Config(num_experts=E, top_k=args.top_k),
        ).build()
        with torch.no_grad():
            m.inner_experts.w1_EFD.copy_(w1)
            m.inner_experts.w2_EDF.copy_(w2)
            m.inner_experts.w3_EFD.copy_(w3)
        return m

    from qwen3_research.kernels.moe import install_experts, moe_fast

    base = titan()
    fast32 = titan()
    install_experts("moe_fast", moe_fast, {"pad_limit": 2.0})(fast32.inner_experts, {})
    fast16 = titan()
    install_experts("moe_fast", moe_fast, {"pad_limit": 2.0})(fast16.inner_experts, {"dtype": "bfloat16"})

    from transformers import Qwen3MoeConfig
    from transformers.integrations.moe import grouped_mm_experts_forward
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    hf_cfg = Qwen3MoeConfig(hidden_size=D, moe_intermediate_size=Fh, num_experts=E, num_experts_per_tok=args.top_k)
    hf = Qwen3MoeExperts(hf_cfg)
    with torch.no_grad():
        hf.gate_up_proj.copy_(torch.cat([w1, w3], dim=1))
        hf.down_proj.copy_(w2)

    T = args.tokens
    x = torch.randn(T, D, generator=g)
    logits = torch.randn(T, E, generator=g)
    scores, ids = torch.softmax(logits, -1).topk(args.top_k, dim=-1)
    counts = torch.bincount(ids.flatten(), minlength=E)

    def run_titan(m):
        def f():
            xi = x.clone().requires_grad_(True)
            out = m(xi.view(1, T, D), scores.view(1, T, -1), ids.view(1, T, -1), counts)
            out.backward(gy.view(1, T, D))
            return out.view(T, D), xi.grad
        return f

    def run_hf():
        xi = x.clone().requires_grad_(True)
        out = grouped_mm_experts_forward(hf, xi, ids, scores)
        out.backward(gy)
        return out, xi.grad

    gy = torch.randn(T, D, generator=g)
    variants = {
        "moe_fast fp32": run_titan(fast32),
        "moe_fast bf16": run_titan(fast16),
        "torchtitan (bf16 grouped_mm)": run_titan(base),
        "transformers grouped_mm fp32": run_hf,
    }
    return variants, counts


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=0)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    variants, counts = build(args)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; E={args.experts} top-{args.top_k} "
          f"T={args.tokens} rows={int(counts.sum())} D={args.dim} F={args.hidden}; "
          f"rows/expert min/mean/max = {int(counts.min())}/{counts.float().mean():.0f}/{int(counts.max())}")

    outs = {name: f() for name, f in variants.items()}  # warm-up + agreement check
    ref_y, ref_g = outs["moe_fast fp32"]
    for name, (y, gx) in outs.items():
        print(f"  {name:<30} max|y - y(moe_fast fp32)| = {(y - ref_y).abs().max():.2e}  "
              f"max|dx - dx(moe_fast fp32)| = {(gx - ref_g).abs().max():.2e}")
    times = {name: [] for name in variants}
    for _ in range(args.repeats):  # interleaved, so load changes hit every variant alike
        for name, f in variants.items():
            t0 = time.perf_counter()
            f()
            times[name].append((time.perf_counter() - t0) * 1e3)
    base = sorted(times["moe_fast fp32"])
    print(f"\n{'variant':<30} {'min ms':>8} {'median':>8} {'max':>8}   ratio vs moe_fast fp32 (min / median / max)")
    for name, ts in times.items():
        s = sorted(ts)
        r = [a / b for a, b in zip(s, base)]
        print(f"{name:<30} {s[0]:>8.1f} {statistics.median(s):>8.1f} {s[-1]:>8.1f}   "
              f"{r[0]:.2f} / {statistics.median(r):.2f} / {r[-1]:.2f}")


if __name__ == "__main__":
    main()
