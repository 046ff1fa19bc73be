"""Sweeps over pipeline parallel (issue 42, deliver 3 and acceptance e): parallelism.pp × parallelism.pp_schedule with
the report and heatmap of any two-key sweep. A pp=1 point runs no schedule, so the pp=1 points of a sweep's other
schedules are one run: it runs once and they are reported as its duplicates (launch/repeats.py), never as numbers
that differ."""

from __future__ import annotations

import csv
import json
import time
from pathlib import Path

import pytest

from tests.conftest import FAST, read_metrics, run_cli

QUICK = [a for a in FAST if not a.startswith(("training.steps", "data.batch_size"))]

PP1 = "has no effect at parallelism.pp=1"


def _jobs(pps, schedules, *rest) -> list[list[str]]:
    return [[f"parallelism.pp={pp}", f"parallelism.pp_schedule={s}", *rest] for pp in pps for s in schedules]


def test_the_pp1_points_of_other_schedules_repeat_the_first_and_nothing_else_does():
    """Expected: of pp {1,2} × 3 schedules, points 1 and 2 (pp=1) repeat point 0; no pp=2 point repeats another
    (each runs its own schedule); a sweep that varies no pipeline key composes nothing."""
    from qwen3_research.compose import compose_resolved
    from qwen3_research.launch.repeats import describe, find_repeats

    composed = []

    def compose(job):
        composed.append(job)
        return compose_resolved(["model.flavor=tiny_untied", *job])

    jobs = _jobs([1, 2], ["1F1B", "GPipe", "DualPipeV"])
    got = find_repeats(jobs, compose)
    assert got == {1: {"same_as": 0, "keys": {"parallelism.pp_schedule": PP1}},
                   2: {"same_as": 0, "keys": {"parallelism.pp_schedule": PP1}}}, got
    assert len(composed) == 2  # one point of each group (pp=1, pp=2)
    assert describe(got[1]) == f"the same run as point 0 (parallelism.pp_schedule {PP1})"
    # the micro-batches too; the pp=1 points of another seed are their own group
    jobs = [[*j, f"training.seed={seed}"] for seed in (1, 2) for j in _jobs([1], ["1F1B", "GPipe"])]
    jobs = [[*j, f"parallelism.pp_microbatches={m}"] for j in jobs for m in (2, 4)]
    got = find_repeats(jobs, compose)
    assert {n: r["same_as"] for n, r in got.items()} == {1: 0, 2: 0, 3: 0, 5: 4, 6: 4, 7: 4}, got
    assert set(got[3]["keys"]) == {"parallelism.pp_schedule", "parallelism.pp_microbatches"}

    def refuse(job):
        raise AssertionError("composed a point of a sweep that varies no pipeline key")

    assert find_repeats([["parallelism.tp=1"], ["parallelism.tp=2"]], refuse) == {}


def test_a_duplicate_in_the_report_names_its_point_and_counts_apart(tmp_path):
    """Expected: the table says which point's run a duplicate is, with no steps or loss; the grid marks it with that
    point (same_as 0); the summary line counts 2 of 2 points run, and 1 duplicate apart."""
    from qwen3_research.report import best_point_line, report, sweep_points

    sweep = tmp_path / "sweep"
    for num, pp, schedule in ((0, 1, "1F1B"), (1, 1, "GPipe"), (2, 2, "1F1B"), (3, 2, "GPipe")):
        d = sweep / f"{num}_parallelism.pp={pp},parallelism.pp_schedule={schedule}"
        (d / ".hydra").mkdir(parents=True)
        (d / ".hydra" / "overrides.yaml").write_text(f"- parallelism.pp={pp}\n- parallelism.pp_schedule={schedule}\n")
        if num == 1:
            summary = {"status": "duplicate", "reason": f"the same run as point 0 (parallelism.pp_schedule {PP1})",
                       "same_as": 0}
        else:
            summary = {"status": "ok", "steps": 2}
            rows = [{"step": s, "loss": 5.0 - s, "tokens_per_s": 100.0 * (num + 1), "first_step": s == 1,
                     "mem_per_rank": [{"rank": r, "peak_gib": 1.0} for r in (0, 1)]} for s in (1, 2)]
            (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (d / "summary.json").write_text(json.dumps(summary))
    lines = []
    runs = report([sweep], sweep, echo=lines.append)
    with open(sweep / "comparison.csv") as fh:
        row = list(csv.DictReader(fh))[1]
    assert row["status"] == f"duplicate: the same run as point 0 (parallelism.pp_schedule {PP1})"
    assert row["steps"] == row["final_loss"] == ""
    assert "3 ok, 1 duplicate" in lines[-1]
    points = sweep_points(runs, [sweep])
    assert [(p["x"], p["y"], p["status"], p["same_as"]) for p in points] == [
        ("1", "1F1B", "ok", None), ("1", "GPipe", "duplicate", 0), ("2", "1F1B", "ok", None), ("2", "GPipe", "ok", None)]
    line = best_point_line(runs, points)
    assert line.endswith("; 3 of 3 points ran to the end; 1 duplicate point not run (the same run as another point)"), line
    assert (sweep / "heatmap.png").is_file()


def test_the_sweep_plan_lists_a_duplicate_and_a_refused_point_in_one_line_each(tmp_path, monkeypatch):
    """The plan before the first point (in process; the planner stubbed: this is about the listing). Expected: pp=1
    1F1B resolves (its plan line is the planner's), pp=1 DualPipeV is listed as point 0's run and not resolved, pp=2
    1F1B resolves, pp=2 DualPipeV with 2 micro-batches is refused in one config-error line (it needs 4)."""
    from omegaconf import OmegaConf

    from qwen3_research import planner
    from qwen3_research.compose import compose_resolved
    from qwen3_research.errors import ConfigError
    from qwen3_research.launch import sweep
    from qwen3_research.launch.repeats import find_repeats

    base = ["model.flavor=tiny_untied", "parallelism.nproc_per_node=2", "parallelism.pp_microbatches=2",
            "training.eval_every=0"]
    jobs = _jobs([1, 2], ["1F1B", "DualPipeV"], *base)
    planned = []

    def stub(run, **kwargs):
        planned.append(run.degrees.pp)
        raise ConfigError("stub planner")

    monkeypatch.setattr(planner, "make_plan", stub)
    monkeypatch.setattr(sweep, "sweep_jobs", lambda config: jobs)
    config = OmegaConf.create({"hydra": {"job": {"config_name": "config"}, "runtime": {"config_sources": []},
                                         "sweeper": {"params": None}}, "sweep": {"plan": True}})
    echoed = []
    sweep.plan_points(config, tmp_path, echo=echoed.append, repeated=find_repeats(jobs, compose_resolved))
    print("\n".join(echoed))
    tails = [line.split(f"{base[-1]}: ", 1)[1] for line in echoed[1:]]
    assert tails == ["no plan: stub planner", f"not run: the same run as point 0 (parallelism.pp_schedule {PP1})",
                     "no plan: stub planner", "config error: parallelism.pp_microbatches=2: pp_schedule=DualPipeV needs "
                     "at least 4 (one per stage); set parallelism.pp_microbatches=4 or 0 (auto)"], echoed
    assert planned == [1, 2]


# -- acceptance e: the named sweep, shrunk to 3 runs of 2 steps -----------------------------------------------------
TOL = 1e-5  # fp32: step 1 is the same weights on the same 4 sequences; FSDP(2) and pp(2) differ in summation order


@pytest.mark.feature("pipeline parallel (parallelism.pp)")
@pytest.mark.slow
def test_pp_by_schedule_sweep_and_its_report(tmp_path):
    """sweeps/pp_schedules.yaml with pp {1,2} × {1F1B, GPipe, DualPipeV}, 2 micro-batches, 2 steps of 4 × 32 tokens.
    Expected: 6 points: pp=1 runs once (2-way FSDP), its GPipe and DualPipeV points are its duplicates (not run);
    pp=2 1F1B and GPipe run and give pp=1's step-1 loss and gradient norm within 1e-5; pp=2 DualPipeV is refused
    (it needs 4 micro-batches) in one config-error line before its workers start, and the sweep exits 3. Without the
    plan (sweep.plan=false: its listing is tested above, in process)."""
    sweep = tmp_path / "sweep"
    t0 = time.perf_counter()
    proc = run_cli(["--config-dir", "sweeps", "--config-name", "pp_schedules", *QUICK, "training.steps=2",
                    "data.global_batch_tokens=128", "parallelism.pp=1,2", "parallelism.pp_schedule=1F1B,GPipe,DualPipeV",
                    "parallelism.pp_microbatches=2", "sweep.plan=false", f"hydra.sweep.dir={sweep}"], timeout=900)
    wall = time.perf_counter() - t0
    print(proc.stdout)
    assert proc.returncode == 3, proc.stdout[-3000:] + proc.stderr[-3000:]
    runs = sorted((d for d in sweep.iterdir() if (d / ".hydra").is_dir()), key=lambda d: int(d.name.split("_")[0]))
    assert len(runs) == 6
    with open(sweep / "comparison.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert [(r["parallelism.pp"], r["parallelism.pp_schedule"]) for r in rows] == [
        (pp, s) for pp in ("1", "2") for s in ("1F1B", "GPipe", "DualPipeV")]
    same = f"duplicate: the same run as point 0 (parallelism.pp_schedule {PP1})"
    refusal = "parallelism.pp_microbatches=2: pp_schedule=DualPipeV needs at least 4"
    assert [r["status"] for r in rows[:5]] == ["ok", same, same, "ok", "ok"], rows
    assert rows[5]["status"].startswith(f"failed: {refusal}"), rows[5]
    # refused before any worker: one line on stderr, no metrics, no traceback; the plan listed it and the duplicates
    assert [ln for ln in proc.stderr.splitlines() if refusal in ln] == [f"sweep point 5 refused: config error: {refusal} "
                                                                         "(one per stage); set parallelism.pp_microbatches"
                                                                         "=4 or 0 (auto)"], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and not (runs[5] / "metrics.jsonl").exists()
    assert not (sweep / "plan.json").exists()  # duplicates are found without a plan (sweep.plan=false saves a trace)
    for dup in runs[1:3]:
        assert json.loads((dup / "summary.json").read_text())["same_as"] == 0 and not (dup / "metrics.jsonl").exists()
    # a correct pipeline on the same data: pp=1's step-1 loss and gradient norm
    first = {n: read_metrics(runs[n])[0] for n in (0, 3, 4)}
    for n in (3, 4):
        loss = abs(first[n]["loss"] - first[0]["loss"])
        norm = abs(first[n]["grad_norm"] - first[0]["grad_norm"]) / first[0]["grad_norm"]
        print(f"{runs[n].name}: step-1 loss {first[n]['loss']:.7f} vs pp=1 {first[0]['loss']:.7f} (difference "
              f"{loss:.1e}), grad norm relative difference {norm:.1e}")
        assert loss <= TOL and norm <= TOL, runs[n].name
    assert [first[n]["tokens"] for n in (0, 3, 4)] == [128] * 3  # the same global batch in both layouts
    # the grid: pp across, the schedule up, a duplicate pointing at point 0, the refused point failed
    with open(sweep / "sweep_points.csv") as fh:
        grid = list(csv.DictReader(fh))
    assert {(g["key_x"], g["key_y"]) for g in grid} == {("parallelism.pp", "parallelism.pp_schedule")}
    assert [(g["x"], g["y"], g["status"], g["same_as"]) for g in grid] == [
        ("1", "1F1B", "ok", ""), ("1", "GPipe", "duplicate", "0"), ("1", "DualPipeV", "duplicate", "0"),
        ("2", "1F1B", "ok", ""), ("2", "GPipe", "ok", ""), ("2", "DualPipeV", "failed", "")]
    assert all(float(g["tokens_per_s"]) > 0 for g in grid if g["status"] == "ok")
    import matplotlib.image as mpimg

    img = mpimg.imread(sweep / "heatmap.png")
    assert img.shape[1] > 2 * img.shape[0] and img.std() > 0.05  # three panels side by side, not blank
    assert json.loads((sweep / "sweep.json").read_text()) | {"wall_s": 0, "points_wall_s": 0} == {
        "wall_s": 0, "points_wall_s": 0, "points": 6, "failed": 1, "skipped": 0, "duplicates": 2}
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("sweep summary: best point by tokens/s that fit: parallelism.pp=") and last.endswith(
        "; 3 of 4 points ran to the end (1 failed); 2 duplicate points not run (the same run as another point)"), last
    print(f"sweep wall {wall:.1f} s")
