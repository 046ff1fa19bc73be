"""(6) Cost growth: bare-loop step time as seq_len doubles (256 … 2048) and as width grows; log-log slopes.

Bare torchtitan training step (forward, cross-entropy, backward, clip, AdamW; fp32), batch 1,
built exactly as ``model=native`` builds it. Width: dim 128 → 256 → 512 with head_dim 32,
n_heads = dim/32, n_kv_heads = n_heads/2, FFN 3×dim, 4 layers, at seq_len 256; once with the
real Qwen3 vocabulary (151,936: the lm_head dominates these small widths) and once with a
4,096-token vocabulary (the transformer body). The fitted exponent is the least-squares slope
of log(step time) against log(seq_len) or log(dim); the same slope of torchtitan's FLOPs/token
× tokens is printed next to it.

    python benchmarks/bench_scaling.py             # --quick (default)
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import numpy as np

import _common as C


def slope(xs, ys) -> float:
    return float(np.polyfit(np.log(xs), np.log(ys), 1)[0])


def time_point(flavor, seq_len: int, reps: int) -> tuple[float, float, list[float]]:
    import torch

    bare = C.BareLoop("native", "tiny", seq_len, flavor_obj=flavor)
    g = torch.Generator().manual_seed(0)
    inputs = torch.randint(0, flavor.vocab_size, (1, seq_len), generator=g)
    labels = torch.randint(0, flavor.vocab_size, (1, seq_len), generator=g)
    bare.step(inputs, labels)  # warm-up
    times = [C.time_call(bare.step, inputs, labels) for _ in range(reps)]
    return C.mmm(times)[1], bare.flops_per_token * seq_len, times


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--full", action="store_true")
    ap.add_argument("--seq-lens", default="256,512,1024,2048")
    ap.add_argument("--dims", default="128,256,512")
    args = ap.parse_args(argv)
    reps = 5 if args.full else 2
    C.header("bench_scaling", [sys.argv[0], *(argv if argv is not None else sys.argv[1:])])
    from qwen3_research.models import get_flavor

    tiny = get_flavor("native", "tiny")
    seqs = [int(x) for x in args.seq_lens.split(",")]
    ts, fs = [], []
    print(f"seq_len growth: native/tiny, batch 1, {reps} timed steps per point (median; min-max)")
    for L in seqs:
        med, flops, times = time_point(tiny, L, reps)
        ts.append(med)
        fs.append(flops)
        print(f"  seq_len {L:5d}: step {med:.4f} s ({min(times):.4f}-{max(times):.4f}), "
              f"{L / med:.0f} tokens/s, {flops / med / 1e9:.1f} GFLOP/s")
    print(f"EXPONENT seq_len: time ~ seq_len^{slope(seqs, ts):.3f} (FLOPs ~ seq_len^{slope(seqs, fs):.3f})")
    dims = [int(x) for x in args.dims.split(",")]
    for vocab in (tiny.vocab_size, 4096):
        ts, fs = [], []
        print(f"width growth: 4 layers, seq_len 256, batch 1, vocab {vocab}")
        for d in dims:
            f = dataclasses.replace(tiny, dim=d, n_heads=d // 32, n_kv_heads=max(1, d // 64), head_dim=32,
                                    hidden_dim=3 * d, vocab_size=vocab)
            med, flops, times = time_point(f, 256, reps)
            ts.append(med)
            fs.append(flops)
            print(f"  dim {d:4d}: step {med:.4f} s ({min(times):.4f}-{max(times):.4f}), "
                  f"{flops / med / 1e9:.1f} GFLOP/s")
        print(f"EXPONENT width (vocab {vocab}): time ~ dim^{slope(dims, ts):.3f} (FLOPs ~ dim^{slope(dims, fs):.3f})")


if __name__ == "__main__":
    main()
