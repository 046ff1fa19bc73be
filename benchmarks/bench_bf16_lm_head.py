"""bf16 on a CPU without AVX-512: the lm_head's input gradient with a column-major weight copy vs without (loss.py).

ATen's own bf16 GEMM (oneDNN's needs AVX-512) is ~25x slower for ``grad (N x V) @ weight (V x D)`` with a row-major
weight than with a column-major one; the vocabulary (V = 151,936) is the long reduction. Both losses carry the
copy where ``devices.slow_16bit_nn_gemm`` says so: the chunked loss's hidden-state gradient and the full loss's
lm_head forward (``loss.column_major_lm_head``). This script times one forward + backward of each loss, under
bf16 autocast as a one-process run computes it, with the copy and without it (the device answer forced off), the
two taking turns; it prints this process's CPU time (the clock a shared machine disturbs least) and wall time,
and the largest difference of the loss and of the hidden-state gradient between the two.

    python benchmarks/bench_bf16_lm_head.py            # tiny's lm_head (D=128), 64 tokens, 3 repeats
    python benchmarks/bench_bf16_lm_head.py --dim 1024 # 0.6B's
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

import _common as C
import torch

from qwen3_research import devices, loss

VOCAB = 151936


def _cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        return next(ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("Model name"))
    except (OSError, StopIteration):
        return "unknown"


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    C.header("bench_bf16_lm_head", [sys.argv[0], *(argv if argv is not None else sys.argv[1:])])
    print(f"CPU: {_cpu_name()} ({devices.cpu_isa()}); slow_16bit_nn_gemm(cpu) = {devices.slow_16bit_nn_gemm('cpu')}; "
          f"lm_head {VOCAB} x {args.dim}, {args.tokens} tokens, bf16 autocast")
    torch.manual_seed(0)
    hidden = torch.randn(args.tokens, args.dim)
    labels = torch.randint(0, VOCAB, (args.tokens,))
    head = torch.nn.Linear(args.dim, VOCAB, bias=False)

    def run(kind: str, copy: bool):
        h = hidden.clone().requires_grad_()
        lin = torch.nn.Linear(args.dim, VOCAB, bias=False)
        lin.weight = head.weight
        if kind == "full":
            loss.column_major_lm_head(lin, copy)
        head.weight.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16):
            if kind == "full":
                value = torch.nn.functional.cross_entropy(lin(h).float(), labels)
            else:
                value = loss.chunked_cross_entropy(h[None], head.weight, labels[None], 1024, copy)
        value.backward()
        return value.detach(), h.grad

    out = {}
    for kind in ("chunked", "full"):
        cpu = {True: [], False: []}
        wall = {True: [], False: []}
        results = {}
        for r in range(args.repeats):
            for copy in ((True, False) if r % 2 == 0 else (False, True)):
                w0, c0 = time.perf_counter(), time.process_time()
                results[copy] = run(kind, copy)
                cpu[copy].append(time.process_time() - c0)
                wall[copy].append(time.perf_counter() - w0)
        dl = (results[True][0] - results[False][0]).abs().item()
        dg = (results[True][1] - results[False][1]).abs().max().item()
        ratio = statistics.median(cpu[False]) / statistics.median(cpu[True])
        print(f"  {kind:7s} loss fwd+bwd: column-major copy cpu {C.fmt_mmm(cpu[True])} s (wall "
              f"{C.fmt_mmm(wall[True])}), row-major cpu {C.fmt_mmm(cpu[False])} s (wall {C.fmt_mmm(wall[False])}); "
              f"SPEED-UP (cpu, medians) {ratio:.1f}x; |loss diff| {dl:.1e}, max |grad diff| {dg:.1e}")
        out[kind] = ratio
    return out


if __name__ == "__main__":
    main()
