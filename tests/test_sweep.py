"""Sweeps end to end: one W&B group per sweep, a report whose numbers are the runs' own, failures isolated."""

from __future__ import annotations

import csv
import json
import os
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
    for png in ("loss.png", "throughput_memory.png", "heatmap.png"):
        _assert_png_has_content(sweep_dir / png)
    w, h = _png_size(sweep_dir / "heatmap.png")
    assert w > 2 * h, (w, h)  # three panels side by side: tokens/s, MFU, peak memory
    assert "| run |" in (sweep_dir / "comparison.md").read_text()
    # The sweep group's summary table: a W&B run of its own (job_type sweep_report) in the points' group, whose
    # rows are the report's numbers, beside the plan's predictions.
    report_run = next(r for r in wandb_records(sweep_dir) if r["type"] == "run")["run"]
    assert report_run["run_group"] in groups and report_run["job_type"] == "sweep_report"
    item = next(r["history"]["item"] for r in wandb_records(sweep_dir) if r["type"] == "history")
    assert item["sweep/points._type"] == "table-file" and item["sweep/points.nrows"] == 4, item
    table = json.loads(next(sweep_dir.glob(f"wandb/offline-run-*/files/{item['sweep/points.path']}")).read_text())
    got = [dict(zip(table["columns"], row)) for row in table["data"]]
    assert [({g["key_x"]: g["x"], g["key_y"]: g["y"]}, g["status"]) for g in got] == [
        ({"parallelism.tp": r["parallelism.tp"], "data.seq_len": r["data.seq_len"]}, "ok") for r in rows]
    for g, r in zip(got, rows):
        assert g["tokens_per_s"] == pytest.approx(float(r["tokens_per_s"]), rel=1e-9)
        assert g["predicted_peak_gib"] == pytest.approx(float(r["predicted_peak_gib"]), rel=1e-9)
    assert item["sweep/heatmap._type"] == "image-file" and item["sweep/heatmap.width"] > 2 * item["sweep/heatmap.height"]
    # The sweep's last stdout line: the best point by tokens/s among those that fit.
    best = max(rows, key=lambda r: float(r["tokens_per_s"]))
    last = proc.stdout.strip().splitlines()[-1]
    print(last)
    assert last.startswith(f"sweep summary: best point by tokens/s that fit: parallelism.tp={best['parallelism.tp']} "
                           f"data.seq_len={best['data.seq_len']}: {float(best['tokens_per_s']):.1f} tokens/s"), last
    assert last.endswith("; 4 of 4 points ran to the end"), last
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


# -- the sweep at a glance (issue 25 point 5): synthetic sweep dirs, in process -------------------------------

def _fake_point(sweep: Path, num: int, tp: int, seq: int, status: str, tps: float | None = None, peak: float = 0.0,
                predicted: float | None = None) -> None:
    """A point directory as a sweep leaves it: Hydra's overrides, summary.json, metrics.jsonl (ok points)."""
    d = sweep / f"{num}_parallelism.tp={tp},data.seq_len={seq}"
    (d / ".hydra").mkdir(parents=True)
    (d / ".hydra" / "overrides.yaml").write_text(f"- parallelism.tp={tp}\n- data.seq_len={seq}\n")
    summary = {"status": status, **({"prediction": {"predicted_peak_gib": predicted}} if predicted is not None else {})}
    if status == "ok":
        summary["steps"] = 3
        rows = [{"step": s, "loss": 5.0 - s, "tokens_per_s": tps * (0.5 if s == 1 else 1.0), "mfu": tps / 1e6,
                 "first_step": s == 1, "mem_per_rank": [{"rank": r, "peak_gib": peak - 0.01 * r} for r in (0, 1)]}
                for s in (1, 2, 3)]
        (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    else:
        summary["reason"] = "predicted 9.00 GiB > 1.00 GiB per rank" if status == "skipped" else "rank 1 failed: out of memory"
    (d / "summary.json").write_text(json.dumps(summary))


def _fake_sweep(tmp_path: Path) -> Path:
    """tp {1,2} × seq_len {64,128,256}: three ok points, one skipped by the plan, one failed, one planned but never
    started (the sweep was stopped before it)."""
    sweep = tmp_path / "sweep"
    _fake_point(sweep, 0, 1, 64, "ok", tps=900.0, peak=1.10, predicted=0.40)
    _fake_point(sweep, 1, 1, 128, "ok", tps=1500.0, peak=1.30, predicted=0.60)
    _fake_point(sweep, 2, 1, 256, "skipped", predicted=9.0)
    _fake_point(sweep, 3, 2, 64, "ok", tps=700.0, peak=1.00, predicted=0.30)
    _fake_point(sweep, 4, 2, 128, "failed", predicted=0.5)
    plan = {json.dumps([f"parallelism.tp={tp}", f"data.seq_len={seq}"]): {
        "num": n, "overrides": [f"parallelism.tp={tp}", f"data.seq_len={seq}"], "predicted_peak_gib": 0.1 * (n + 1)}
        for n, (tp, seq) in enumerate([(1, 64), (1, 128), (1, 256), (2, 64), (2, 128), (2, 256)])}
    (sweep / "plan.json").write_text(json.dumps(plan))
    return sweep


def test_sweep_points_heatmap_and_best_point_of_a_synthetic_sweep(tmp_path):
    from qwen3_research.report import best_point_line, find_runs, report, sweep_points

    sweep = _fake_sweep(tmp_path)
    runs = report([sweep], sweep, echo=lambda *_: None)
    points = {(p["x"], p["y"]): p for p in sweep_points(runs, [sweep])}
    assert {k: p["status"] for k, p in points.items()} == {
        ("1", "64"): "ok", ("1", "128"): "ok", ("1", "256"): "skipped", ("2", "64"): "ok", ("2", "128"): "failed",
        ("2", "256"): "not run"}
    ok = points["1", "128"]
    # the steady steps' median (step 1 left out), the largest rank's peak, each rank's, the point's own prediction
    assert (ok["tokens_per_s"], ok["mfu"], ok["peak_mem_gib"]) == (1500.0, 1500.0 / 1e6, 1.30)
    assert ok["peak_mem_gib_per_rank"] == "1.300 1.290" and ok["predicted_peak_gib"] == 0.60
    assert points["2", "256"]["predicted_peak_gib"] == pytest.approx(0.6)  # not run: the plan's figure
    assert points["1", "256"]["tokens_per_s"] is None and points["1", "256"]["predicted_peak_gib"] == 9.0
    with open(sweep / "sweep_points.csv") as fh:
        assert len(list(csv.DictReader(fh))) == 6
    _assert_png_has_content(sweep / "heatmap.png")
    line = best_point_line(find_runs([sweep]), list(points.values()))
    print(line)
    assert line == ("sweep summary: best point by tokens/s that fit: parallelism.tp=1 data.seq_len=128: 1500.0 tokens/s, "
                    "MFU 0.0015, peak 1.300 GiB per rank (plan 0.600 GiB); 3 of 6 points ran to the end "
                    "(1 failed, 1 not run, 1 skipped)")


def test_the_heatmap_shows_each_point_where_it_belongs(tmp_path):
    """Pixels, not just a file: the best point's cell is the brightest of the tokens/s panel (viridis: yellow), the
    hatched cells hold no colour."""
    import matplotlib.image as mpimg
    import numpy as np

    from qwen3_research.report import plot_heatmap

    points = [{"key_x": "tp", "x": str(x), "key_y": "seq", "y": str(y), "status": "ok", "tokens_per_s": float(v),
               "mfu": v / 1e6, "peak_mem_gib": 1.0, "predicted_peak_gib": 0.5}
              for x, y, v in [(1, 64, 100), (1, 128, 1000), (2, 64, 500)]]
    points.append({"key_x": "tp", "x": "2", "key_y": "seq", "y": "128", "status": "skipped", "tokens_per_s": None,
                   "mfu": None, "peak_mem_gib": None, "predicted_peak_gib": 9.0})
    img = mpimg.imread(plot_heatmap(points, tmp_path / "h.png"))[..., :3]
    h, w, _ = img.shape
    panel = img[:, : w // 3]  # tokens/s: yellow where the largest value is (red and green high, blue low)
    yellow = (panel[..., 0] > 0.8) & (panel[..., 1] > 0.8) & (panel[..., 2] < 0.35)
    rows, cols = np.nonzero(yellow)
    assert yellow.sum() > 500, "no bright cell"
    # tp=1 (left column), seq_len=128 (upper row, origin lower): the upper-left quadrant of the panel's axes
    assert np.median(cols) < np.median(np.nonzero(panel.std(axis=2) > 0.2)[1]) and np.median(rows) < h / 2


def test_the_sweep_plan_runs_in_a_forked_child_and_leaves_this_process_fork_clean(monkeypatch):
    """A plan traces Trainers; in the sweep's own process that would make every later CPU worker group spawn instead
    of fork (~7 s of imports per rank and point: the tp_seq sweep took 104 s with the plan here, 66 s without).
    The child's result and its exceptions come back; this process has built no Trainer."""
    from qwen3_research import startup
    from qwen3_research.errors import ConfigError
    from qwen3_research.launch.sweep import in_a_forked_child

    monkeypatch.setattr(startup, "_trainer_built", False)

    def plan():
        startup.note_trainer_built()
        return {"pid": os.getpid(), "peak": [1.5, 2.0]}

    out = in_a_forked_child(plan)
    assert out["pid"] != os.getpid() and out["peak"] == [1.5, 2.0]
    assert not startup.trainer_built()

    def refused():
        raise ConfigError("sweep.plan: no")

    with pytest.raises(ConfigError, match="sweep.plan: no"):
        in_a_forked_child(refused)


# -- two writers of one sweep directory (issue 40, item 4) -----------------------------------------------------------

_HOLD = ("import sys, time; from pathlib import Path; from qwen3_research.run.rundir import RunDirLock; "
         "RunDirLock(Path(sys.argv[1])).acquire(); print('held', flush=True); time.sleep(600)")


def _hold_lock(directory: Path):
    """A live process holding ``directory``'s run-dir lock, as a running sweep (or run) holds it."""
    import subprocess
    import sys

    from tests.conftest import ROOT, cli_env

    holder = subprocess.Popen([sys.executable, "-c", _HOLD, str(directory)], cwd=ROOT, env=cli_env(),
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    return holder


def _earlier_attempt(point: Path) -> dict:
    """A point directory as an earlier (failed) attempt leaves it: a checkpoint, metrics, a summary."""
    (point / ".hydra").mkdir(parents=True)
    (point / "checkpoints" / "step-00000001").mkdir(parents=True)
    (point / "checkpoints" / "step-00000001" / "meta.json").write_text('{"step": 1}')
    (point / "metrics.jsonl").write_text('{"step": 1, "loss": 12.0}\n')
    (point / "summary.json").write_text('{"status": "failed"}')
    return _tree(point)


def _tree(d: Path) -> dict:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()
            and p.name != ".qwen3_research.lock"}


def test_a_sweep_into_a_sweep_dir_a_live_sweep_holds_is_refused_and_moves_nothing(tmp_path):
    """A second sweep into a sweep dir whose lock a live process holds (the first sweep): exit 2, one line naming
    the holder, before any point starts; the first sweep's point keeps its files, no .previous_attempts. Was: the
    second sweep moved the first's live lock and checkpoints into .previous_attempts and trained in its point dir
    (fails on the old code: exit 0, the files moved)."""
    sweep = tmp_path / "sweep"
    point = sweep / "0_training.seed=1"
    before = _earlier_attempt(point)
    holder = _hold_lock(sweep)
    try:
        proc = run_cli(["-m", "training.seed=1,2", *QUICK, "training.steps=2", "sweep.plan=false",
                        f"hydra.sweep.dir={sweep}"], timeout=600)
    finally:
        holder.kill()
        holder.wait()
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    print(f"\nexit {proc.returncode}: {lines[-1] if lines else ''}")
    assert proc.returncode == 2 and len(lines) == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert lines[0].startswith(f"config error: hydra.sweep.dir={sweep} is in use by another sweep (pid {holder.pid} ")
    assert not (sweep / ".previous_attempts").exists() and _tree(point) == before
    assert sorted(p.name for p in sweep.iterdir()) == [".qwen3_research.lock", "0_training.seed=1"]


def test_a_point_dir_a_live_run_holds_is_refused_and_a_dead_owners_attempt_is_moved(tmp_path):
    """prepare_point on a point directory whose lock a live process holds: ConfigError naming the pid, nothing moved
    (was: moved into .previous_attempts, lock included); once that process is gone, its attempt (and its stale lock)
    is moved aside as before."""
    from qwen3_research.compose import compose
    from qwen3_research.errors import ConfigError
    from qwen3_research.launch.sweep import prepare_point

    sweep = tmp_path / "sweep"
    point = sweep / "0_training.seed=1"
    before = _earlier_attempt(point)
    cfg = compose(["sweep.plan=false"])
    holder = _hold_lock(point)
    try:
        with pytest.raises(ConfigError) as e:
            prepare_point(cfg, str(point), ["training.seed=1"], str(sweep))
        # A multi-node Slurm job's other node joins node 0's live run: it neither refuses nor moves anything (CI at
        # 7965eb9: node 2 refused node 0's lock with exit 2, and node 0 waited for it until the requeue)
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("SLURM_NODEID", "1")
            prepare_point(cfg, str(point), ["training.seed=1"], str(sweep))
        assert not (sweep / ".previous_attempts").exists() and _tree(point) == before
    finally:
        holder.kill()
        holder.wait()
    print(f"\n{e.value}")
    assert str(e.value).startswith(f"sweep point {point.name}: {point} is in use by pid {holder.pid} ")
    assert not (sweep / ".previous_attempts").exists() and _tree(point) == before
    prepare_point(cfg, str(point), ["training.seed=1"], str(sweep))  # the owner is gone: moved aside
    moved = sweep / ".previous_attempts" / point.name / "1"
    assert sorted(p.name for p in point.iterdir()) == [".hydra"]
    assert {k: v for k, v in _tree(moved).items()} == {k: v for k, v in before.items() if not k.startswith(".hydra")}
