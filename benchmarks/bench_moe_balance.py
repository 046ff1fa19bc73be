"""MoE load balancing: the same 30-step MoE tiny run under each ``model.moe.balance`` (none, aux_loss, bias),
and the load ratio (max/mean tokens per expert, worst MoE layer) it ends with.

Each mode is one run of the real Trainer (``train()``: same seed, data, optimizer); its routing figures are the
ones metrics.jsonl records (qwen3_research.routing). "Final" is the mean over the last 5 logged steps of
``moe_max_load`` (one step's 1,024 routed rows per layer are a small sample); the last step's value is printed
beside it, and the max/mean averaged over the layers (the worst layer saturates at E/K = 4 once one layer collapses).

Found (benchmarks/results/moe_balance*.txt, 4x64 tokens): the tiny model's random routers collapse within 4-10
steps at lr 3e-3 (and by ~step 20 at 3e-4) in every mode. Qwen3's auxiliary loss, computed as transformers does,
pools the routing of all layers before the product; here the layers collapse onto different experts, so the pooled
load looks nearly balanced (aux 2.05-2.10, balanced = K = 2) and the loss has little to push against. The expert
bias moves by its coefficient per step (0.03 over 30 steps at 1e-3) while a collapsed router's scores differ by ~0.5.
At lr 3e-4 with the default coefficients both end more balanced than none (worst layer none 3.975, aux_loss 3.772,
bias 2.303): bias clearly, aux_loss barely (mean over layers 3.123 vs 3.148). Default command: lr 3e-4.

    python benchmarks/bench_moe_balance.py                       # ~5 min on 2 idle cores
    python benchmarks/bench_moe_balance.py --aux-coef 0.01 --bias-coef 0.01 --modes aux_loss,bias
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import _common as C

MODES = ("none", "aux_loss", "bias")


def run(mode: str, args) -> dict:
    run_dir = tempfile.mkdtemp(prefix=f"qwen3_balance_{mode}_")
    trainer = C.build_trainer([
        "model=native_moe", f"model.moe.balance={mode}", f"model.moe.aux_loss_coef={args.aux_coef}",
        f"model.moe.bias_coef={args.bias_coef}", f"data.seq_len={args.seq_len}", f"data.batch_size={args.batch_size}",
        f"training.steps={args.steps}", "training.log_every=1", f"optimizer.lr={args.lr}", *args.extra,
    ], run_dir=run_dir)
    t0 = time.perf_counter()
    with C.quiet_stdout():
        trainer.train()
    trainer.close()
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "moe_max_load" in r]
    tail = rows[-5:]
    layer_mean = [sum(x["max_load"] for x in r["moe_per_layer"]) / len(r["moe_per_layer"]) for r in tail]
    return {"mode": mode, "final": sum(r["moe_max_load"] for r in tail) / len(tail),
            "layer_mean": sum(layer_mean) / len(tail), "last": rows[-1]["moe_max_load"],
            "first": rows[0]["moe_max_load"], "cv": sum(r["moe_cv"] for r in tail) / len(tail),
            "empty": sum(r["moe_empty_frac"] for r in tail) / len(tail), "loss": rows[-1]["loss"],
            "aux": rows[-1].get("aux_loss"), "s": time.perf_counter() - t0}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=4)  # with --seq-len 64: 512 routed rows per layer per step
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--aux-coef", type=float, default=0.001)
    ap.add_argument("--bias-coef", type=float, default=0.001)
    ap.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of none,aux_loss,bias")
    ap.add_argument("extra", nargs="*", help="more overrides, e.g. kernels=moe_fast")
    args = ap.parse_args(argv)
    C.header("bench_moe_balance", [sys.argv[0], *(argv if argv is not None else sys.argv[1:])])
    print(f"model=native_moe/tiny (8 experts, top-2, 4 MoE layers), batch {args.batch_size}x{args.seq_len}, "
          f"{args.steps} steps, lr {args.lr}, aux_loss coef {args.aux_coef}, bias coef {args.bias_coef}, {args.extra}")
    results = {}
    for mode in args.modes.split(","):
        r = results[mode] = run(mode, args)
        aux = f" aux_loss {r['aux']:.4f}" if r["aux"] is not None else ""
        print(f"balance={mode:8s} final load ratio (max/mean, worst layer, mean of last 5 steps) {r['final']:.3f} "
              f"(last step {r['last']:.3f}, step 1 {r['first']:.3f}); mean over layers {r['layer_mean']:.3f}; cv {r['cv']:.3f}; empty experts "
              f"{r['empty']:.3f}; loss {r['loss']:.4f}{aux}; {r['s']:.0f} s", flush=True)
    if "none" not in results:
        return results
    none = results["none"]["final"]
    others = [m for m in ("aux_loss", "bias") if m in results]
    verdict = all(results[m]["final"] < none for m in others)
    print(f"BALANCE final load ratio none {none:.3f}" + "".join(f" / {m} {results[m]['final']:.3f}" for m in others)
          + f": {' and '.join(others)} end more balanced than none: {verdict}")
    return results


if __name__ == "__main__":
    main()
