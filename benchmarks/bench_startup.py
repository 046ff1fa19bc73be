"""(7) Start-up: time from the command to the first step, split into imports, config, build, first step.

Two measurements, each repeated:
  A. the real command ``python -m qwen3_research training.steps=1 …`` in a subprocess: wall time
     seen by the caller, and from its summary.json the Trainer's build_s and first_step_s;
  B. an instrumented child doing what the command does, with a clock between phases:
     interpreter start → imports (qwen3_research entry, torch, torchtitan model code) →
     config (Hydra compose + validation) → build (Trainer: data, model, optimizer, sinks) →
     first step (Trainer.train() for one step) → exit.

    python benchmarks/bench_startup.py             # --quick (default): 2 repeats
    python benchmarks/bench_startup.py --config-errors-only   # C only: how fast a config error exits
    python benchmarks/bench_startup.py --config-errors-only --against 6284d96 --runs 15   # C, before/after

C. three config errors (an unknown key, an unknown option, impossible degrees), median of 5 each: the time a
   bad command takes to say so. ``--against REV``: the same commands in a checkout of REV too (a temporary git
   worktree, this interpreter and venv), taking turns run by run (the order alternating), wall and CPU time
   (user + system of the command's processes) side by side, and the ratio after/before.

The first line says whether the commands write bytecode: with ``PYTHONDONTWRITEBYTECODE=1`` (set on some CI
machines) every command compiles the package's sources again, and the figures include that.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
OVERRIDES = ["model=native", "model.flavor=tiny", "data.seq_len=128", "data.batch_size=4", "training.steps=1",
             "training.eval_every=0", "logging.wandb.mode=disabled", "logging.progress_bar=false"]

CHILD = r"""
import time, os, sys, json
t_start = float(os.environ["BENCH_T0"])
t_interp = time.time()
t0 = time.perf_counter()
sys.path.insert(0, os.environ["BENCH_HERE"])
import qwen3_research.__main__  # the entry module (Hydra, config schemas)
from qwen3_research.launch.elastic import worker  # launcher + trainer module
import torch
from qwen3_research import devices
devices.prepare_torchtitan("cpu")
import torchtitan.models.qwen3  # what the Trainer imports while building
t_imports = time.perf_counter()
import _common as C
resolved = C.compose(json.loads(os.environ["BENCH_OVERRIDES"]))
from qwen3_research.resolve import resolve_run
run = resolve_run(resolved)
t_config = time.perf_counter()
from qwen3_research.trainer import RunInfo, Trainer
import tempfile
trainer = Trainer(run, RunInfo(run_dir=tempfile.mkdtemp(prefix="startup_")))
t_build = time.perf_counter()
summary = trainer.train()
trainer.close()
t_first = time.perf_counter()
print("BENCH " + json.dumps({"interpreter": t_interp - t_start, "imports": t_imports - t0, "config": t_config - t_imports,
      "build": t_build - t_config, "first_step": t_first - t_build, "trainer_first_step_s": summary["first_step_s"]}))
"""


def run_cli() -> dict:
    run_dir = tempfile.mkdtemp(prefix="startup_cli_")
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "qwen3_research", *OVERRIDES, f"hydra.run.dir={run_dir}"], cwd=ROOT,
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    s = json.loads((Path(run_dir) / "summary.json").read_text())
    return {"wall": wall, "build_s": s["build_s"], "first_step_s": s["first_step_s"], "run_wall_s": s["wall_s"]}


def run_child() -> dict:
    env = dict(os.environ, BENCH_T0=repr(time.time()), BENCH_HERE=str(HERE), BENCH_OVERRIDES=json.dumps(OVERRIDES[:-2]))
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", CHILD], cwd=ROOT, env=env, check=True, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("BENCH "))
    return {"wall": wall, **json.loads(line[6:])}


CONFIG_ERRORS = [["training.stepz=1"], ["model=nope"], ["parallelism.tp=3", "parallelism.nproc_per_node=2"]]


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def run_config_error(overrides: list[str], root: Path = ROOT) -> tuple[float, int, str, float]:
    """One bad command run in ``root`` (its package and conf/ come first on sys.path): wall seconds, exit status,
    its last stderr line (the one-line error), CPU seconds of its processes."""
    c0, t0 = _children_cpu(), time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "qwen3_research", *overrides], cwd=root, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    return wall, out.returncode, (out.stderr.strip().splitlines() or [""])[-1][:110], _children_cpu() - c0


def compare_config_errors(rev: str, runs: int) -> None:
    """C before/after: each config error in a worktree of ``rev`` and in this checkout, taking turns."""
    with tempfile.TemporaryDirectory(prefix="bench_startup_") as tmp:
        before = Path(tmp) / "before"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "--quiet", str(before), rev], check=True)
        try:
            sha = subprocess.run(["git", "-C", str(before), "rev-parse", "--short", "HEAD"], capture_output=True,
                                 text=True, check=True).stdout.strip()
            here = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                                  text=True).stdout.strip()
            print(f"C'. before = {rev} ({sha}), after = this checkout ({here}{', modified' if _dirty() else ''}): "
                  f"median of {runs} runs each, taking turns")
            trees = {"before": before, "after": ROOT}
            for overrides in CONFIG_ERRORS:
                got = {k: [] for k in trees}
                for i in range(runs):
                    for k in (("before", "after") if i % 2 else ("after", "before")):
                        got[k].append(run_config_error(overrides, trees[k]))
                med = {k: (statistics.median(r[0] for r in v), statistics.median(r[3] for r in v)) for k, v in got.items()}
                codes = {k: sorted({r[1] for r in v}) for k, v in got.items()}
                (bw, bc), (aw, ac) = med["before"], med["after"]
                print(f"  {' '.join(overrides)}: wall {bw:.3f} -> {aw:.3f} s ({aw / bw:.3f}x), CPU {bc:.3f} -> {ac:.3f} s "
                      f"({ac / bc:.3f}x); exit before {codes['before']}, after {codes['after']}")
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(before)], check=False)


def _dirty() -> bool:
    return bool(subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True).stdout.strip())


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--config-errors-only", action="store_true",
                    help="only C: how long a config error takes to exit (median of 5 per command)")
    ap.add_argument("--against", metavar="REV",
                    help="also run C in a worktree of this git revision, taking turns with this checkout")
    ap.add_argument("--runs", type=int, default=15, help="runs per command and tree with --against (default 15)")
    args = ap.parse_args(argv)
    print(f"# bench_startup: load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}; bytecode "
          + ("NOT written (PYTHONDONTWRITEBYTECODE): every command compiles the package's sources"
             if os.environ.get("PYTHONDONTWRITEBYTECODE") else "cached (.pyc)"))
    print(f"# command: python {' '.join([sys.argv[0], *(argv if argv is not None else sys.argv[1:])])}")
    print("C. a config error: median wall of 5 runs per command (exit status, last stderr line)")
    for overrides in CONFIG_ERRORS:
        runs = sorted(run_config_error(overrides) for _ in range(5))
        wall, rc, line, _ = runs[2]
        print(f"  {' '.join(overrides)}: {wall:.2f} s (min {runs[0][0]:.2f}, max {runs[-1][0]:.2f}), exit {rc}: {line}")
    if args.against:
        compare_config_errors(args.against, args.runs)
    if args.config_errors_only:
        return
    print(f"A. python -m qwen3_research {' '.join(OVERRIDES)}")
    for i in range(args.repeats):
        r = run_cli()
        print(f"  repeat {i}: command wall {r['wall']:.2f} s = before launch.elastic.run (interpreter, imports, Hydra compose "
              f"+ preflight) {r['wall'] - r['run_wall_s']:.2f} s + launch.elastic.run {r['run_wall_s']:.2f} s "
              f"[Trainer build {r['build_s']:.2f} s, first step {r['first_step_s']:.2f} s, rest (validate, sinks, "
              f"summary) {r['run_wall_s'] - r['build_s'] - r['first_step_s']:.2f} s]")
    print("B. instrumented child (same overrides), phases in seconds")
    for i in range(args.repeats):
        r = run_child()
        print(f"  repeat {i}: interpreter start {r['interpreter']:.2f}, imports {r['imports']:.2f}, config {r['config']:.2f}, "
              f"build {r['build']:.2f}, first step {r['first_step']:.2f} (Trainer's own first_step_s "
              f"{r['trainer_first_step_s']:.2f}); total wall {r['wall']:.2f}")


if __name__ == "__main__":
    main()
