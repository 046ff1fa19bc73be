"""Multi-node for real (issue 16): jobs, a sweep and a requeue through a two-node Slurm cluster on this
host (tests/slurm_cluster.py), plain two-node torchrun on loopback, and bad multi-node input.

Every run is the tiny model, 32-token sequences, a handful of steps on CPU/gloo. The reference is
one process with the same global batch: 2 nodes × 1 rank × data.batch_size=2 = 1 process × 4.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT, assert_ok, cli_env, read_metrics, run_cli, train_losses

pytestmark = [pytest.mark.slow]

STEPS = 5
BASE = [f"training.steps={STEPS}", "data.seq_len=32", "training.eval_every=0", "logging.print_config=false",
        "logging.progress_bar=false"]
TOL = 1e-4  # dense fp32 on gloo: the layouts of tests/test_parallel.py match within this
TWO_NODES = ["parallelism=fsdp", "parallelism.nnodes=2", "parallelism.nproc_per_node=1", "data.batch_size=2"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _submit(cluster, args: list[str], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    """`python -m qwen3_research -m hydra/launcher=slurm ...` against the test cluster."""
    cmd = [sys.executable, "-m", "qwen3_research", "-m", "hydra/launcher=slurm", *args]
    return subprocess.run(cmd, cwd=cwd, env=cluster.env(cli_env()), capture_output=True, text=True, timeout=timeout)


def _point_dirs(sweep_dir: Path) -> list[Path]:
    return sorted(p for p in sweep_dir.iterdir() if p.is_dir() and not p.name.startswith("."))


def _job_ids(sweep_dir: Path) -> list[str]:
    return sorted(p.name for p in (sweep_dir / ".submitit").iterdir() if p.is_dir())


def _wandb_runs(run_dir: Path) -> list[str]:
    return sorted(p.name for p in run_dir.glob("wandb/offline-run-*"))


def _max_diff(ref: list[float], got: list[float]) -> float:
    assert len(ref) == len(got), (ref, got)
    return max(abs(a - b) for a, b in zip(ref, got))


@pytest.fixture(scope="module")
def single_4(tmp_path_factory) -> Path:
    """The reference: one process, data.batch_size=4, 5 steps."""
    run_dir = tmp_path_factory.mktemp("single_4")
    proc = run_cli(["data.batch_size=4", "logging.wandb.mode=disabled", *BASE], run_dir=run_dir, timeout=300)
    assert_ok(proc)
    return run_dir


# ---------------------------------------------------------------------------------------------
# Point 2 / acceptance a: one job on two Slurm nodes
# ---------------------------------------------------------------------------------------------
# One job on two Slurm nodes, one run equal to one process: test_requeued_job_resumes_into_the_same_run (its
# job runs on n1 and n2, is requeued mid-run, and still ends as one run equal to an uninterrupted process).


# ---------------------------------------------------------------------------------------------
# Point 3 / acceptance b: a 2-point sweep, each point its own Slurm job, in parallel
# ---------------------------------------------------------------------------------------------
def _epoch(slurm_time: str) -> float:
    return time.mktime(time.strptime(slurm_time, "%Y-%m-%dT%H:%M:%S"))


@pytest.mark.slurm
def test_sweep_points_run_as_parallel_slurm_jobs(slurm_cluster, tmp_path):
    sweep = tmp_path / "sweep"
    proc = _submit(slurm_cluster, ["training.seed=1,2", "data.batch_size=2", *BASE, "logging.wandb.mode=disabled",
                                   f"hydra.sweep.dir={sweep}"], cwd=tmp_path)
    assert_ok(proc)
    points = _point_dirs(sweep)
    assert len(points) == 2, points
    statuses = [json.loads((p / "summary.json").read_text())["status"] for p in points]
    assert statuses == ["ok", "ok"]
    assert (sweep / "comparison.md").exists() and json.loads((sweep / "sweep.json").read_text())["failed"] == 0
    assert "2 ok; report:" in proc.stdout + proc.stderr  # the tally names only statuses that occurred
    jobs = sorted({m.group(1) for m in re.finditer(r"(\d+_\d+)", " ".join(_job_ids(sweep)))}) or _job_ids(sweep)
    infos = [slurm_cluster.wait_job_done(j) for j in jobs]
    for i in infos:
        print(f"job {i['JobId']} ({i['NodeList']}): {i['StartTime']} .. {i['EndTime']} {i['JobState']}")
    assert len(infos) == 2 and all(i["JobState"] == "COMPLETED" for i in infos), infos
    (s0, e0), (s1, e1) = [(_epoch(i["StartTime"]), _epoch(i["EndTime"])) for i in infos]
    overlap = min(e0, e1) - max(s0, s1)
    print(f"overlap of the two jobs: {overlap:.0f} s (> 0 means they ran at the same time)")
    assert overlap > 0


# ---------------------------------------------------------------------------------------------
# Point 4 / acceptance c: requeue mid-run -> SIGTERM -> checkpoint -> restart resumes the same run
# ---------------------------------------------------------------------------------------------
REQUEUE_STEPS = 12  # requeued after step 2: the rest (10 steps of ~1 s on two loaded cores) leaves time for the signal


@pytest.mark.slurm
def test_requeued_job_resumes_into_the_same_run(slurm_cluster, tmp_path):
    """One job on two Slurm nodes (a rank on each), requeued mid-run: SIGTERM -> checkpoint -> exit 143 -> Slurm
    restarts it -> resume.

    Expected: the restarted job completes on n[1-2] (Restarts=1); one run directory (one summary.json, one
    metrics.jsonl) with steps 1..12 once each and a rank per node; the losses equal an uninterrupted single process
    at the same global batch within 1e-4; one W&B run id; node 1 met node 0 at its address.
    """
    args = [f"training.steps={REQUEUE_STEPS}", "data.seq_len=32", "training.eval_every=0",
            "logging.print_config=false", "logging.progress_bar=false"]
    ref_dir = tmp_path / "uninterrupted"
    ref = run_cli([*args, "data.batch_size=4", "logging.wandb.mode=disabled"], run_dir=ref_dir, timeout=300)
    assert_ok(ref)

    sweep = tmp_path / "sweep"
    cmd = [sys.executable, "-m", "qwen3_research", "-m", "hydra/launcher=slurm", *TWO_NODES, *args,
           "logging.wandb.mode=offline", f"hydra.sweep.dir={sweep}"]
    submit = subprocess.Popen(cmd, cwd=tmp_path, env=slurm_cluster.env(cli_env()), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 240
        steps_before = 0
        while time.monotonic() < deadline and submit.poll() is None:
            runs = [p for p in sweep.glob("0_*/metrics.jsonl")] if sweep.exists() else []
            if runs and (steps_before := len(runs[0].read_text().splitlines())) >= 2:
                break
            time.sleep(0.2)
        assert submit.poll() is None, "the job ended before it could be requeued"
        (job,) = _job_ids(sweep)
        if steps_before < 2:  # requeued before its first checkpoint, the test would prove nothing of a resume
            pytest.fail(f"the job logged {steps_before} steps in 240 s:\n{slurm_cluster.diagnosis(job, sweep)}")
        rq = slurm_cluster.run(["scontrol", "requeue", job])
        print(f"scontrol requeue {job} after {steps_before} logged steps: rc {rq.returncode} {rq.stderr.strip()}")
        assert rq.returncode == 0
        try:
            out, _ = submit.communicate(timeout=420)
        except subprocess.TimeoutExpired:
            submit.kill()
            pytest.fail(f"the requeued job did not finish in 420 s:\n{slurm_cluster.diagnosis(job, sweep)}")
    finally:
        submit.kill()
    assert submit.returncode == 0, out[-4000:]
    (run_dir,) = _point_dirs(sweep)
    info = slurm_cluster.wait_job_done(job)
    print(f"job after requeue: {info}")
    assert int(info["Restarts"]) == 1 and info["JobState"] == "COMPLETED" and info["NodeList"] == "n[1-2]", info
    assert len(list(run_dir.rglob("summary.json"))) == 1 and len(list(run_dir.rglob("metrics.jsonl"))) == 1
    assert [r["rank"] for r in read_metrics(run_dir)[0]["mem_per_rank"]] == [0, 1]  # one rank on each node
    # Node 1 joined at node 0's *address* (NodeAddr), not the node name n1.
    node1_log = "".join((sweep / ".submitit" / job / f"{job}_1_log.{ext}").read_text() for ext in ("out", "err"))
    assert "Name or service not known" not in node1_log
    assert (sweep / "comparison.md").exists()
    first_attempt = (sweep / ".submitit" / job / f"{job}_0_log.err").read_text()
    m = re.search(r"interrupted by SIGTERM after step (\d+); checkpoint saved to (\S+);", first_attempt)
    assert m, first_attempt[-3000:]
    print(f"first attempt: {m.group(0)} (exit status 143 = 128+SIGTERM)")
    assert 1 <= int(m.group(1)) < REQUEUE_STEPS
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "ok"
    steps = [r["step"] for r in read_metrics(run_dir) if "loss" in r]
    print(f"metrics.jsonl steps: {steps}")
    assert steps == list(range(1, REQUEUE_STEPS + 1)), "each step must be logged exactly once"
    diff = _max_diff(train_losses(ref_dir), train_losses(run_dir))
    print(f"requeued vs uninterrupted, {REQUEUE_STEPS} steps: largest loss difference {diff:.3e} (tol {TOL:g})")
    assert diff <= TOL
    runs = _wandb_runs(run_dir)
    ids = sorted({r.rsplit("-", 1)[-1] for r in runs})
    print(f"W&B offline runs: {runs} -> run ids {ids}")
    assert len(ids) == 1, f"a requeued job must continue the same W&B run, got {ids}"


# ---------------------------------------------------------------------------------------------
# Point 5 / acceptance d: plain multi-node, two torchrun commands on loopback
# ---------------------------------------------------------------------------------------------
def test_two_torchrun_nodes_give_one_run(single_4, tmp_path):
    port = _free_port()
    run_dir = tmp_path / "run"
    procs = []
    for node_rank in (0, 1):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank", str(node_rank),
               "--nproc_per_node", "1", "--rdzv-endpoint", f"127.0.0.1:{port}", "-m", "qwen3_research",
               *TWO_NODES, *BASE, "logging.wandb.mode=offline", f"hydra.run.dir={run_dir}"]
        procs.append(subprocess.Popen(cmd, cwd=tmp_path, env=cli_env(), stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=300)[0])
    finally:
        for p in procs:
            p.kill()
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-4000:]
    assert len(list(tmp_path.rglob("summary.json"))) == 1 and len(list(tmp_path.rglob("metrics.jsonl"))) == 1
    runs = _wandb_runs(run_dir)
    assert len(runs) == 1, runs
    assert [r["rank"] for r in read_metrics(run_dir)[0]["mem_per_rank"]] == [0, 1]
    diff = _max_diff(train_losses(single_4), train_losses(run_dir))
    print(f"torchrun --nnodes 2 (node_rank 0 and 1 on loopback) vs one process: largest loss difference "
          f"{diff:.3e} (tol {TOL:g}); one run dir, W&B runs {runs}")
    assert diff <= TOL


# ---------------------------------------------------------------------------------------------
# Point 6 / acceptance d: bad multi-node input, one line each, bounded in time
# ---------------------------------------------------------------------------------------------
def _stderr_lines(proc) -> list[str]:
    return [ln for ln in proc.stderr.splitlines() if ln.strip()]


def test_two_nodes_without_slurm_or_endpoint_is_one_config_error(tmp_path):
    """Stops in the parent before any worker: exit 2 within the subprocess timeout of 120 s."""
    proc = run_cli([*TWO_NODES, *BASE, "logging.wandb.mode=disabled"], run_dir=tmp_path / "run", timeout=120,
                   env=cli_env())
    lines = _stderr_lines(proc)
    print(proc.returncode, lines)
    assert proc.returncode == 2 and len(lines) == 1
    assert lines[0].startswith("config error: parallelism.nnodes=2 needs parallelism.rdzv_endpoint=<head node>:<port>")
    assert not (tmp_path / "run").exists()


RDZV_TIMEOUT_S = 15


def test_unreachable_rendezvous_fails_after_the_stated_timeout(tmp_path):
    """A node whose partner never comes: one line after parallelism.rdzv_timeout_s (15 s here), exit 1.

    The subprocess limit (180 s) is what 'no hang' means; the command returns once the rendezvous times out.
    """
    port = _free_port()
    proc = run_cli([*TWO_NODES, *BASE, "logging.wandb.mode=disabled", f"parallelism.rdzv_endpoint={socket.gethostname()}:{port}",
                    f"parallelism.rdzv_timeout_s={RDZV_TIMEOUT_S}"], run_dir=tmp_path / "run", timeout=180)
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    print(proc.returncode, errors)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert len(errors) == 1 and errors[0].startswith(f"error: the 2 nodes did not meet at {socket.gethostname()}:{port} "
                                                     f"within parallelism.rdzv_timeout_s={RDZV_TIMEOUT_S}"), errors
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "failed" and "did not meet" in summary["reason"]


@pytest.mark.slurm
@pytest.mark.parametrize("override,expected", [
    ("hydra.launcher.partition=nope",
     "config error: hydra.launcher.partition=nope: no such Slurm partition; available: debug"),
    ("parallelism.nnodes=3",
     "config error: parallelism.nnodes=3 but Slurm partition debug has 2 nodes; set parallelism.nnodes<=2 "
     "or hydra.launcher.partition to a larger partition"),
])
def test_bad_slurm_request_is_one_line_before_submission(slurm_cluster, tmp_path, override, expected):
    """Refused before sbatch (no job, no sweep dir) within the subprocess timeout of 120 s, exit 2."""
    sweep = tmp_path / "sweep"
    proc = _submit(slurm_cluster, ["parallelism=fsdp", "parallelism.nnodes=2", "parallelism.nproc_per_node=1", *BASE,
                                   override, f"hydra.sweep.dir={sweep}"], cwd=tmp_path, timeout=120)
    lines = _stderr_lines(proc)
    print(proc.returncode, lines)
    assert proc.returncode == 2 and lines == [expected]
    assert not sweep.exists()
