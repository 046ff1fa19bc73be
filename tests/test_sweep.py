"""Sweeps end to end: one W&B group per sweep, a report whose numbers are the runs' own, failures isolated."""

from __future__ import annotations

import csv
import json
import struct
import time
from pathlib import Path

import pytest

from tests.conftest import FAST, read_metrics, run_cli, wandb_records

QUICK = [a for a in FAST if not a.startswith(("training.steps", "logging.wandb"))]


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    return struct.unpack(">II", data[16:24])


def _assert_png_has_content(path: Path) -> None:
    import matplotlib.image as mpimg

    w, h = _png_size(path)
    assert w >= 400 and h >= 300
    img = mpimg.imread(path)
    assert img.std() > 0.05, f"{path} looks blank"


def _runs(sweep_dir: Path) -> list[Path]:
    return sorted((d for d in sweep_dir.iterdir() if (d / ".hydra").is_dir()), key=lambda d: int(d.name.split("_")[0]))


def _check_table_matches_runs(sweep_dir: Path, runs: list[Path]) -> list[dict]:
    with open(sweep_dir / "comparison.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == len(runs)
    for row, run in zip(rows, runs):
        assert row["run"] == run.name
        if row["status"] != "ok":
            assert not (run / "metrics.jsonl").exists() or not [r for r in read_metrics(run) if "loss" in r]
            continue
        metrics = [r for r in read_metrics(run) if "loss" in r]
        assert float(row["final_loss"]) == pytest.approx(metrics[-1]["loss"], rel=1e-12)
        evals = [r["eval_loss"] for r in read_metrics(run) if "eval_loss" in r]
        if evals:
            assert float(row["best_eval_loss"]) == pytest.approx(min(evals), rel=1e-12)
        peaks = [float(x) for x in row["peak_mem_gib_per_rank"].split()]
        ranks = {m["rank"] for r in metrics for m in r["mem_per_rank"]}
        assert len(peaks) == len(ranks)
    return rows


@pytest.mark.slow
def test_tp_seq_sweep_end_to_end(tmp_path):
    sweep_dir = tmp_path / "sweep"
    t0 = time.perf_counter()
    proc = run_cli(["--config-dir", "sweeps", "--config-name", "tp_seq", f"hydra.sweep.dir={sweep_dir}",
                    "training.steps=2", "training.eval_every=1"], timeout=900)
    wall = time.perf_counter() - t0
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    runs = _runs(sweep_dir)
    assert len(runs) == 4
    # The plan composed each point from the sweep file (2 processes per point), not from conf/config.yaml alone.
    plan = json.loads((sweep_dir / "plan.json").read_text())
    assert len(plan) == 4 and not [e["error"] for e in plan.values() if "error" in e], plan
    assert [len(e["per_rank_peak_gib"]) for e in plan.values()] == [2, 2, 2, 2], plan
    # 4 offline W&B runs, one group, distinct names, the swept keys as top-level config fields.
    groups, names = set(), set()
    for run in runs:
        rec = next(r for r in wandb_records(run) if r["type"] == "run")["run"]
        groups.add(rec["run_group"])
        names.add(rec["display_name"])
        cfg = rec["config"]["update"]
        assert {"tp", "seq_len"} <= set(cfg) and cfg["swept_keys"] == ["data.seq_len", "parallelism.tp"]
        assert cfg["tp"] == cfg["parallelism"]["tp"] and cfg["seq_len"] == cfg["data"]["seq_len"]
    assert len(groups) == 1 and len(names) == 4, (groups, names)
    rows = _check_table_matches_runs(sweep_dir, runs)
    assert [(r["parallelism.tp"], r["data.seq_len"]) for r in rows] == [("1", "64"), ("1", "128"), ("2", "64"), ("2", "128")]
    assert all(r["status"] == "ok" for r in rows)
    # Same token budget per point: 512 tokens per step whatever tp and seq_len.
    for run in runs:
        assert json.loads((run / "summary.json").read_text())["status"] == "ok"
        first = read_metrics(run)[0]
        assert first["tokens"] == 512
    for png in ("loss.png", "throughput_memory.png"):
        _assert_png_has_content(sweep_dir / png)
    assert "| run |" in (sweep_dir / "comparison.md").read_text()
    # Printed, not asserted: wall-clock ratios fail on a loaded machine (and the sweep's plan, which traces every
    # point before the first starts, is part of the wall).
    points = sum(json.loads((r / "summary.json").read_text())["wall_s"] for r in runs)
    print(f"sweep wall {wall:.1f} s, sum of points {points:.1f} s, ratio {wall / points:.3f}")


def test_sweep_with_an_impossible_point(tmp_path):
    sweep_dir = tmp_path / "sweep"
    proc = run_cli(["-m", *QUICK, "training.steps=2", "parallelism.tp=1,3", f"hydra.sweep.dir={sweep_dir}",
                    "logging.wandb.mode=disabled"], timeout=600)
    assert proc.returncode == 3, proc.stderr[-3000:]
    runs = _runs(sweep_dir)
    rows = _check_table_matches_runs(sweep_dir, runs)
    assert rows[0]["status"] == "ok"
    assert rows[1]["status"].startswith(
        "failed: parallelism.dp_replicate×tp=1×3=3 does not divide the world size nproc_per_node×nnodes=1")
    assert "1 ok, 1 failed" in proc.stdout
    assert json.loads((sweep_dir / "sweep.json").read_text())["failed"] == 1


def test_compare_cli_on_run_dirs(tmp_path):
    for name, lr in (("a", "1e-3"), ("b", "3e-3")):
        assert run_cli(QUICK + ["training.steps=2", f"optimizer.lr={lr}", "logging.wandb.mode=disabled"],
                       run_dir=tmp_path / name, timeout=300).returncode == 0
    out = tmp_path / "report"
    proc = run_cli([str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(out)], module="qwen3_research.compare")
    assert proc.returncode == 0, proc.stderr
    assert "optimizer.lr" in proc.stdout.splitlines()[0]
    rows = _check_table_matches_runs(out, [tmp_path / "a", tmp_path / "b"])
    assert [r["optimizer.lr"] for r in rows] == ["1e-3", "3e-3"]
    _assert_png_has_content(out / "loss.png")


def test_compare_cli_rejects_missing_dir(tmp_path):
    proc = run_cli([str(tmp_path / "nope")], module="qwen3_research.compare")
    assert proc.returncode == 2 and "not a directory" in proc.stderr


@pytest.mark.slow
def test_optuna_search_runs_trials(tmp_path):
    sweep_dir = tmp_path / "optuna"
    proc = run_cli(["--config-dir", "sweeps", "--config-name", "lr_optuna", *QUICK, "training.steps=2",
                    "training.eval_every=2", "hydra.sweeper.n_trials=2", f"hydra.sweep.dir={sweep_dir}",
                    "logging.wandb.mode=disabled"], timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    best = (sweep_dir / "optimization_results.yaml").read_text()
    assert "best_params" in best and "optimizer.lr" in best
    assert len(_runs(sweep_dir)) == 2


# -- a signal stops the whole sweep (issue 21, point 3) ------------------------------------------------

SIGNAL_STEPS = 6


@pytest.fixture(scope="module")
def seed1_losses(tmp_path_factory) -> list[float]:
    """The uninterrupted losses of the sweep's first point (training.seed=1)."""
    run = tmp_path_factory.mktemp("seed1") / "run"
    proc = run_cli(QUICK + [f"training.steps={SIGNAL_STEPS}", "training.seed=1", "logging.wandb.mode=disabled"], run_dir=run)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return [r["loss"] for r in read_metrics(run) if "loss" in r]


@pytest.mark.slow
@pytest.mark.parametrize("signame, layout", [("SIGINT", []), ("SIGTERM", ["parallelism=fsdp"])], ids=["SIGINT-1rank", "SIGTERM-2ranks"])
def test_a_signal_stops_the_sweep_and_the_same_command_resumes_it(signame, layout, tmp_path, seed1_losses):
    """The first signal ends the current point as a run ends (it saves, `interrupted` at its step), starts no
    further point and exits 128+signal; the report marks the point interrupted, never with a final loss. The
    same command resumes: the interrupted point continues from its checkpoint, the other one runs."""
    import os
    import signal
    import subprocess
    import sys

    from tests.conftest import ROOT, cli_env, wandb_history

    signum = getattr(signal, signame)
    sweep = tmp_path / "sweep"
    cmd = [sys.executable, "-m", "qwen3_research", "-m", "training.seed=1,2", *QUICK, *layout,
           f"training.steps={SIGNAL_STEPS}", "logging.wandb.mode=offline", "sweep.plan=false", f"hydra.sweep.dir={sweep}"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def logged() -> int:
        files = list(sweep.glob("0_*/metrics.jsonl"))
        return len(files[0].read_text().splitlines()) if files else 0

    deadline = time.time() + 240
    while time.time() < deadline and logged() < 2 and proc.poll() is None:
        time.sleep(0.2)
    proc.send_signal(signum)
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 128 + signum, err[-3000:]
    last = [ln for ln in err.splitlines() if ln.strip()][-1]
    print(last)
    assert last.startswith(f"sweep interrupted by {signame} in point 0_") and "no further point started" in last
    points = sorted(d.name for d in sweep.iterdir() if (d / ".hydra").is_dir())
    assert len(points) == 1, points  # the second point never started
    point = sweep / points[0]
    summary = json.loads((point / "summary.json").read_text())
    stopped = summary["step"]
    assert summary["status"] == "interrupted" and 2 <= stopped < SIGNAL_STEPS, summary
    assert (point / "checkpoints" / f"step-{stopped:08d}").is_dir()
    with open(sweep / "comparison.csv") as fh:
        row = next(csv.DictReader(fh))
    print(row)
    assert row["status"] == "interrupted" and row["steps"] == f"{stopped}/{SIGNAL_STEPS}" and row["final_loss"] == ""

    again = subprocess.run(cmd, cwd=ROOT, env=cli_env(), capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"sweep point {point.name}: resuming the interrupted attempt from {point}/checkpoints/step-{stopped:08d}" in again.stdout
    with open(sweep / "comparison.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert [r["status"] for r in rows] == ["ok", "ok"] and [r["steps"] for r in rows] == [f"{SIGNAL_STEPS}/{SIGNAL_STEPS}"] * 2
    assert [r["step"] for r in read_metrics(point)] == list(range(1, SIGNAL_STEPS + 1))
    ids, wb_steps = wandb_history(point)
    assert len(ids) == 1 and wb_steps == list(range(1, SIGNAL_STEPS + 1))
    if not layout:  # one rank: the resumed point's losses are the uninterrupted run's (2 ranks: test_combinations)
        assert [r["loss"] for r in read_metrics(point)] == seed1_losses
