"""Plan vs measurement: predicted per-rank peak live tensor bytes against the real run's own peak.

For each configuration, ``python -m qwen3_research.plan`` traces one steady step (AdamW's state
already alive) on fake tensors (no run), and a real run of the same config (``training.steps=2
training.track_memory=true``) measures its second step with PyTorch's MemTracker in every rank and writes ``peak_live_bytes_per_rank`` to
summary.json. The table shows both per rank and their ratio (acceptance: within 15 %). When every
shard is even the plan traces rank 0 only and gives the largest rank rank 0's bytes; that rank's
own measurement is still in the table, which checks the claim.

Measured on 2 cores (torch 2.14.1, torchtitan 0.3.0): dense configs, MoE single and tp2 match to the
byte; MoE fsdp2 (chunked loss) predicts 12 % low (0.46 vs 0.52 GiB). Its measured peak is in the last backward step,
where gloo's reduce-scatter (CPU) copies its input -- the token embedding's unsharded fp32 gradient,
78 MB -- on its worker thread; the fake process group returns the output without that copy. It is an
allocation of the CPU backend, not of this code (NCCL or Neuron collectives do not make it), so the
plan does not model it.

    python benchmarks/bench_plan.py            # all configurations, the pipelined ones too (about 9 minutes on 2 busy cores)
    python benchmarks/bench_plan.py --quick    # the first two
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# model=native_moe's own flavor is tiny_moe (its preset); COMMON's tiny applies to the dense configs only: with
# model.flavor=tiny the "moe" configs trained the dense tiny under the MoE preset, which model.require_moe now refuses
COMMON = ["training.eval_every=0", "logging.wandb.mode=disabled", "logging.print_config=false",
          "logging.progress_bar=false", "device=cpu"]
CONFIGS = [
    ("dense single s128 full-loss AC none", ["model=native", "model.flavor=tiny", "data.seq_len=128", "data.batch_size=4"]),
    ("moe fsdp2 s128 chunked AC none", ["model=native_moe", "parallelism=fsdp", "data.seq_len=128", "data.batch_size=2",
                                        "training.loss=chunked", "training.loss_chunk_tokens=64"]),
    ("dense single s2048 chunked AC full", ["model=native", "model.flavor=tiny", "data.seq_len=2048", "data.batch_size=2",
                                            "parallelism.activation_checkpoint=full", "training.loss=chunked"]),
    ("dense fsdp2 s512 full-loss AC none", ["model=native", "model.flavor=tiny", "parallelism=fsdp", "data.seq_len=512", "data.batch_size=2"]),
    ("dense tp2 s256 chunked AC none", ["model=native", "model.flavor=tiny", "parallelism=tp2", "data.seq_len=256", "data.batch_size=2",
                                        "training.loss=chunked", "training.loss_chunk_tokens=128"]),
    ("moe single s256 full-loss AC full", ["model=native_moe", "data.seq_len=256", "data.batch_size=2",
                                           "parallelism.activation_checkpoint=full"]),
    ("dense single s1024 full-loss AC none", ["model=native", "model.flavor=tiny", "data.seq_len=1024", "data.batch_size=1"]),
]
# Pipelined (issue 42): the untied small flavor (pp refuses tied embeddings), 2 or 4 ranks, each stage measured in
# its own rank's second step; the plan traces the first rank of every stage group
PP_COMMON = COMMON + ["model.flavor=tiny_untied", "data.seq_len=32",
                                                                       "data.batch_size=4"]
PP_CONFIGS = [
    ("pp2 1F1B", ["parallelism=pp2"]),  # 2 micro-batches of 2: stage 0 holds both at once
    ("pp2 Interleaved1F1B", ["parallelism=pp2", "parallelism.pp_schedule=Interleaved1F1B"]),  # 2 stages per rank
    ("fsdp2xpp2 GPipe", ["parallelism=pp2", "parallelism.nproc_per_node=4", "parallelism.pp_schedule=GPipe",
                         "data.batch_size=2"]),  # dp_shard=-1: 2
    # tp after the first traced rank is traced in a fresh process (planner._trace_in_a_fresh_process); measured
    # 0.2263 / 0.2639 GiB on stages 0 / 1 against 0.2263 / 0.2639 predicted (not in the CI test: a 4-rank run)
    ("tp2xpp2 1F1B", ["parallelism=pp2", "parallelism.nproc_per_node=4", "parallelism.tp=2"]),
]
GIB = 1024**3


def env() -> dict:
    e = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "TORCHELASTIC_", "HYDRA_"))}
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE"):
        e.pop(k, None)
    e["PYTHONPATH"] = str(ROOT) + os.pathsep + e.get("PYTHONPATH", "")
    return e


def predict(overrides: list[str], common: list[str] = COMMON) -> tuple[dict[int, int], list[int]]:
    """Per-rank predicted peak bytes (rank 0 and the largest rank), from the plan CLI's JSON line, and the
    ranks not traced (their shapes are rank 0's: the plan gives them rank 0's bytes)."""
    out = subprocess.run([sys.executable, "-m", "qwen3_research.plan", "--json", *common, *overrides], cwd=ROOT,
                         env=env(), capture_output=True, text=True, timeout=900)
    if out.returncode not in (0, 4):
        raise RuntimeError(f"plan failed ({out.returncode}): {out.stderr[-2000:]}")
    data = json.loads(next(ln for ln in out.stdout.splitlines() if ln.startswith("{")))
    return {int(k): v for k, v in data["per_rank_peak_bytes"].items()}, [int(r) for r in data.get("mirrored_ranks", [])]


def measure(overrides: list[str], run_dir: Path, common: list[str] = COMMON) -> list[int]:
    out = subprocess.run([sys.executable, "-m", "qwen3_research", *common, *overrides, "training.steps=2",
                          "training.track_memory=true", f"hydra.run.dir={run_dir}"], cwd=ROOT, env=env(),
                         capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        raise RuntimeError(f"run failed ({out.returncode}): {out.stderr[-2000:]}")
    return json.loads((run_dir / "summary.json").read_text())["peak_live_bytes_per_rank"]


def compare(overrides: list[str], common: list[str] = COMMON) -> list[tuple[int, int, int, bool]]:
    """[(rank, predicted bytes, measured bytes, traced)] for rank 0 and the largest rank (traced False: the
    plan gave it rank 0's bytes by symmetry, which its measurement checks)."""
    predicted, mirrored = predict(overrides, common)
    with tempfile.TemporaryDirectory(prefix="qwen3_bench_plan_") as d:
        measured = measure(overrides, Path(d) / "run", common)
    return [(r, p, measured[r], r not in mirrored) for r, p in sorted(predicted.items())]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    configs = [(n, o, COMMON) for n, o in (CONFIGS[:2] if args.quick else CONFIGS)]
    configs += [] if args.quick else [(n, o, PP_COMMON) for n, o in PP_CONFIGS]
    print("| config | rank | predicted GiB | measured GiB | predicted / measured |")
    print("|---|---|---|---|---|")
    worst = 0.0
    failed = 0
    for name, overrides, common in configs:
        try:
            rows = compare(overrides, common)
        except RuntimeError as e:  # report the config and go on with the others
            failed += 1
            last = [ln for ln in str(e).splitlines() if ln.strip()][-1:]
            print(f"| {name} | - | - | - | failed: {last[0][:200] if last else e} |", flush=True)
            continue
        for rank, p, m, traced in rows:
            worst = max(worst, abs(p / m - 1))
            label = str(rank) if traced else f"{rank} (shapes of r0, not traced)"
            print(f"| {name} | {label} | {p / GIB:.4f} | {m / GIB:.4f} | {p / m:.3f} |", flush=True)
    print(f"largest deviation {100 * worst:.1f} % (acceptance: <= 15 %)")
    return 0 if worst <= 0.15 and not failed else 1


if __name__ == "__main__":
    sys.exit(main())
