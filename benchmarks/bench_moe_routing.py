"""MoE routing statistics: their cost in step time on the MoE tiny model (issue 25: at most 2 %).

Two Trainers of the same run (``model=native_moe``, ``model.moe.balance=none``, same seed, data and batch) take
turns step by step: one with ``model.moe.routing_stats=true`` (the router hooks count every training forward, and
every step is a logged step: ``RoutingMonitor.log_fields`` reduces the counts and builds the figures, the worst
case, ``training.log_every=1``), one with ``routing_stats=false`` (no monitor at all). Each timed call is one
step (``trainer.step()``, + ``log_fields`` for the first); the ratio is with / without, per repeat, of the process's CPU
time (``time.process_time``: what the step itself cost, robust to other processes on a shared machine) and of the
wall time. Beside it, the hooks' and ``log_fields``' own wall time, timed inside them, as a share of the step.

    python benchmarks/bench_moe_routing.py        # ~2 min on 2 idle cores
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import _common as C


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--per", type=int, default=3)
    args = ap.parse_args(argv)
    C.header("bench_moe_routing", [sys.argv[0], *(argv if argv is not None else sys.argv[1:])])
    total = args.warmup + args.repeats * args.per

    def trainer(stats: bool):
        return C.build_trainer([
            "model=native_moe", "model.moe.balance=none", f"model.moe.routing_stats={str(stats).lower()}",
            f"data.seq_len={args.seq_len}", f"data.batch_size={args.batch_size}", f"training.steps={total}",
            "training.log_every=1",
        ])

    on, off = trainer(True), trainer(False)
    assert on.step.routing is not None and off.step.routing is None
    fields, inside = {}, [0.0]
    routed, log_fields = on.step.routing._routed, on.step.routing.log_fields

    def timed_routed(*a):  # the hooks' own time (the router hooks call it; it is looked up on every call)
        t0 = time.perf_counter()
        routed(*a)
        inside[0] += time.perf_counter() - t0

    on.step.routing.detach()  # the same hooks again, now timed (no padding hooks on CPU)
    on.step.routing.handles, _ = on.step.backend.attach_router_hooks(timed_routed)

    def with_stats() -> None:
        on.step()
        t0 = time.perf_counter()
        fields.update(log_fields())  # what every logged step adds
        inside[0] += time.perf_counter() - t0

    steps = {"stats": (with_stats, []), "no_stats": (off.step, [])}
    shares = []
    for step in range(args.warmup + args.repeats * args.per):
        for name in (("stats", "no_stats") if step % 2 == 0 else ("no_stats", "stats")):
            fn, out = steps[name]
            inside[0] = 0.0
            w0, c0 = time.perf_counter(), time.process_time()
            fn()
            wall, cpu = time.perf_counter() - w0, time.process_time() - c0
            if step >= args.warmup:
                out.append((wall, cpu))
                if name == "stats":
                    shares.append(inside[0] / wall)

    def medians(name: str, i: int) -> list[float]:
        v = [x[i] for x in steps[name][1]]
        return [statistics.median(v[r * args.per:(r + 1) * args.per]) for r in range(args.repeats)]

    print(f"model=native_moe/tiny (8 experts, top-2, 4 MoE layers), batch {args.batch_size}x{args.seq_len}, "
          f"balance=none, every step logged; {args.repeats} repeats of {args.per} steps after {args.warmup} warm-up; "
          f"load average {C.loadavg()}")
    out = {}
    for i, what in ((1, "CPU time"), (0, "wall time")):
        a, b = medians("stats", i), medians("no_stats", i)
        ratios = [x / y for x, y in zip(a, b)]
        lo, med, hi = C.mmm(ratios)
        out[what] = med
        print(f"{what}: step without statistics {C.fmt_mmm(b)} s, with {C.fmt_mmm(a)} s; with / without "
              f"{med:.4f} [{lo:.4f}-{hi:.4f}] ({(med - 1) * 100:+.2f} %)")
    share = statistics.median(shares)
    print(f"hooks + log_fields timed inside: median {share * 100:.3f} % of the step's wall time "
          f"(max {max(shares) * 100:.3f} %)")
    print(f"last step's figures: max_load {fields['moe_max_load']:.3f} cv {fields['moe_cv']:.3f} "
          f"empty {fields['moe_empty_frac']:.3f} entropy {fields['moe_entropy']:.3f}")
    print(f"OVERHEAD routing statistics: CPU time with / without {out['CPU time']:.4f} ({(out['CPU time'] - 1) * 100:+.2f} %), "
          f"wall {out['wall time']:.4f}; their own time {share * 100:.3f} % of the step")
    on.close()
    off.close()
    return {**out, "share": share}


if __name__ == "__main__":
    main()
