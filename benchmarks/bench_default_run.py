"""The issue-24 default run before and after: `python -m qwen3_research training.steps=12 logging.wandb.mode=disabled`
(tiny, 4 x 128 tokens, 152k vocabulary), as separate commands taking turns, round after round:

- before: glibc's allocator as it comes and the full loss (``QWEN3_CPU_ALLOCATOR=system training.loss=full``), what
  main ran at c5f155f;
- after: the defaults now (``QWEN3_CPU_ALLOCATOR=auto``: mimalloc preloaded where the pinned wheel is installed,
  else glibc's thresholds raised; ``training.loss=auto``: chunked on CPU);
- after, full loss: the allocator of ``after`` with ``training.loss=full``, so chunked vs full is measured with the
  same allocator on this machine.

Per run: the steady step (median of steps 3..12's ``step_time_s`` in metrics.jsonl), the wall time, user and system
CPU seconds and the peak RSS of the command (``os.wait4``'s rusage: the process and the re-exec'd image, one PID),
the final loss. Printed: each run, then per variant the median over rounds, and the ratios before / after.

Usage: python benchmarks/bench_default_run.py [--rounds 5] [--steps 12]. Standard library only (each run is its own
command, so each gets the allocator a user's command gets).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VARIANTS = {
    "before": ({"QWEN3_CPU_ALLOCATOR": "system"}, ["training.loss=full"]),
    "after": ({"QWEN3_CPU_ALLOCATOR": "auto"}, []),
    "after, full loss": ({"QWEN3_CPU_ALLOCATOR": "auto"}, ["training.loss=full"]),
}


def run_once(name: str, steps: int, work: Path) -> dict:
    env_extra, overrides = VARIANTS[name]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "QWEN3_CPU_ALLOCATOR", "MALLOC_"))}
    env.update(env_extra)
    env.pop("LD_PRELOAD", None)
    run_dir = Path(tempfile.mkdtemp(prefix="run_", dir=work))
    cmd = [sys.executable, "-m", "qwen3_research", f"training.steps={steps}", "logging.wandb.mode=disabled",
           "logging.progress_bar=false", *overrides, f"hydra.run.dir={run_dir}"]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{name}: exit {status}\n{out[-3000:]}")
    rows = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    steps_s = [r["step_time_s"] for r in rows if r.get("step_time_s") is not None and r["step"] >= 3]
    summary = json.loads((run_dir / "summary.json").read_text())
    facts = (summary.get("device_facts") or [{}])[0]
    return {"variant": name, "steady_step_s": statistics.median(steps_s), "wall_s": wall, "user_s": usage.ru_utime,
            "system_s": usage.ru_stime, "max_rss_gib": usage.ru_maxrss / 1024**2, "final_loss": rows[-1]["loss"],
            "allocator": facts.get("cpu_allocator", "?"), "loss": summary.get("loss", overrides or "auto")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=12)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="qwen3_bench_default_"))
    print(f"bench_default_run: {args.rounds} rounds of {', '.join(VARIANTS)} (taking turns), training.steps={args.steps}",
          flush=True)
    runs = []
    for r in range(args.rounds):
        order = list(VARIANTS) if r % 2 == 0 else list(reversed(VARIANTS))  # alternate who goes first
        for name in order:
            x = run_once(name, args.steps, work)
            runs.append(x)
            print(f"round {r + 1} {name:17} steady step {x['steady_step_s']:.3f} s  wall {x['wall_s']:.1f} s  user "
                  f"{x['user_s']:.1f} s  system {x['system_s']:.1f} s ({100 * x['system_s'] / (x['user_s'] + x['system_s']):.0f} % of CPU)  "
                  f"peak RSS {x['max_rss_gib']:.2f} GiB  final loss {x['final_loss']:.6f}  [{x['allocator']}]", flush=True)

    def med(name: str, key: str) -> float:
        return statistics.median(x[key] for x in runs if x["variant"] == name)

    print("\nmedian over rounds:")
    print(f"{'variant':17} {'steady step s':>14} {'wall s':>8} {'user s':>8} {'system s':>9} {'system share':>13} "
          f"{'peak RSS GiB':>13}")
    for name in VARIANTS:
        share = med(name, "system_s") / (med(name, "user_s") + med(name, "system_s"))
        print(f"{name:17} {med(name, 'steady_step_s'):14.3f} {med(name, 'wall_s'):8.1f} {med(name, 'user_s'):8.1f} "
              f"{med(name, 'system_s'):9.1f} {100 * share:12.0f} % {med(name, 'max_rss_gib'):13.2f}")
    b, a, f = (med(n, "steady_step_s") for n in VARIANTS)
    print(f"\nsteady step before / after: {b / a:.2f}x (median of {args.rounds} alternating runs each)")
    print(f"steady step full / chunked loss, same allocator: {f / a:.2f}x; peak RSS full / chunked: "
          f"{med('after, full loss', 'max_rss_gib') / med('after', 'max_rss_gib'):.2f}x")
    print(f"allocator alone (full loss, glibc as it comes / after's allocator): {b / f:.2f}x")
    losses = {name: sorted({round(x['final_loss'], 4) for x in runs if x['variant'] == name}) for name in VARIANTS}
    print(f"final losses (rounded to 4 places) per variant: {losses}")


if __name__ == "__main__":
    main()
