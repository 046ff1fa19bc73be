"""Parallelism (issue 3): options, validation, Slurm launcher, and real multi-process gloo runs.

Multi-process tests start the real CLI (torch elastic or torchrun) on CPU with gloo and
compare the losses of 5 steps with one process over the same global batch: one process
with data.batch_size=2B sees the same samples as dp=2 ranks with data.batch_size=B.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from qwen3_research import models
from qwen3_research.compose import CONF_DIR
from qwen3_research.config import ConfigError, ParallelismConfig, RunConfig, register_configs
from qwen3_research.parallel import validate_degrees
from tests.test_allocator import expected_in_workers
from tests.conftest import ROOT, assert_ok, cli_env, fault_env, read_metrics, run_cli, train_losses

register_configs()

STEPS = 5
BASE = [f"training.steps={STEPS}", "data.seq_len=32", "training.eval_every=0", "logging.print_config=false",
        "logging.wandb.mode=disabled", "logging.progress_bar=false"]
DENSE_TOL = 1e-4
MOE_TOL = 1e-2  # experts run in bf16 (torchtitan's GroupedExperts)
# Relative grad-norm tolerance: tight enough to catch a wrong gradient scale on one parameter
# group (halved expert gradients with ep=2 moved the MoE grad norm by 5e-3; bf16 noise: 1.4e-3).
GRAD_TOL = {DENSE_TOL: 1e-4, MOE_TOL: 3e-3}


def compose_run(overrides: list[str], hydra: bool = False):
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return compose(config_name="config", overrides=overrides, return_hydra_config=hydra)


def degrees_for(overrides: list[str], world_size: int | None = None):
    cfg = compose_run(overrides)
    rc = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(RunConfig), cfg))
    return validate_degrees(rc.parallelism, seq_len=rc.data.seq_len, world_size=world_size, **models.describe(rc.model))


# ---------------------------------------------------------------------------------------------
# Options
# ---------------------------------------------------------------------------------------------
EXPECTED = {  # option -> (extra overrides, world, dp_replicate, dp_shard, tp, sp, ep)
    "single": ([], 1, 1, 1, 1, False, 1),
    "fsdp": ([], 2, 1, 2, 1, False, 1),
    "tp2": ([], 2, 1, 1, 2, True, 1),
    "fsdp_tp": ([], 4, 1, 2, 2, True, 1),
    "hsdp": ([], 4, 2, 2, 1, False, 1),
    "ep2": (["model=native_moe"], 2, 1, 2, 1, False, 2),
    "pp2": (["model.flavor=tiny_untied"], 2, 1, 1, 1, False, 1),  # and pp=2 (tests/test_pipeline.py)
    "trn2": (["model.flavor=0.6B"], 64, 1, 64, 1, False, 1),
    "trn2_tp": (["model.flavor=0.6B"], 64, 1, 16, 4, True, 1),
}


def test_every_parallelism_option_resolves_to_its_degrees():
    shipped = sorted(p.stem for p in (Path(CONF_DIR) / "parallelism").glob("*.yaml"))
    assert shipped == sorted(EXPECTED), shipped
    for name, (extra, world, rep, shard, tp, sp, ep) in EXPECTED.items():
        text = (Path(CONF_DIR) / "parallelism" / f"{name}.yaml").read_text().splitlines()
        assert text[0].startswith("# ") and text[1:4] == ["defaults:", "  - /parallelism_schema@_here_", "  - _self_"], name
        d = degrees_for([f"parallelism={name}", *extra])
        got = (d.world_size, d.dp_replicate, d.dp_shard, d.tp, d.sequence_parallel, d.ep)
        assert got == (world, rep, shard, tp, sp, ep), f"{name}: {got}"
        print(f"{name:8s} {d.describe()}")


# ---------------------------------------------------------------------------------------------
# Validation: one line naming the keys and a valid alternative (acceptance e)
# ---------------------------------------------------------------------------------------------
INVALID = [
    # (overrides, launcher world size, expected message fragments)
    (["parallelism=fsdp", "parallelism.dp_shard=3"], None,
     ["parallelism.dp_replicate×dp_shard×tp=1×3×1=3 must equal nproc_per_node×nnodes=2", "parallelism.dp_shard=-1"]),
    (["parallelism=fsdp", "parallelism.nproc_per_node=3", "parallelism.tp=2"], None,
     ["parallelism.dp_replicate×tp=1×2=2 does not divide the world size nproc_per_node×nnodes=3",
      "nproc_per_node to a multiple of 2"]),
    (["parallelism=hsdp", "parallelism.nproc_per_node=2", "parallelism.dp_replicate=4"], None,
     ["parallelism.dp_replicate×tp=4×1=4 does not divide the world size"]),
    (["parallelism=tp2", "parallelism.nproc_per_node=4", "parallelism.tp=4"], None,  # tiny: 4 heads, 2 kv heads
     ["parallelism.tp=4 must divide the model's n_heads=4 and n_kv_heads=2", "use parallelism.tp in [1, 2]"]),
    (["parallelism=trn2_tp", "model.flavor=0.6B", "parallelism.tp=32", "parallelism.sequence_parallel=false"], None,
     ["parallelism.tp=32 must divide the model's n_heads=16 and n_kv_heads=8", "[1, 2, 4, 8]"]),
    (["parallelism=fsdp", "parallelism.sequence_parallel=true"], None,
     ["parallelism.sequence_parallel=true needs parallelism.tp > 1", "parallelism.sequence_parallel=false"]),
    (["parallelism=tp2", "data.seq_len=33"], None,
     ["needs data.seq_len divisible by parallelism.tp=2, got data.seq_len=33", "data.seq_len=34"]),
    (["parallelism=ep2"], None, ["parallelism.ep=2 needs a MoE model", "model=native_moe", "parallelism.ep=1"]),
    (["parallelism=ep2", "model=native_moe", "parallelism.nproc_per_node=3", "parallelism.ep=3"], None,
     ["parallelism.ep=3 must divide the model's number of experts 8", "use parallelism.ep in [1]"]),
    (["parallelism=ep2", "model=native_moe", "parallelism.nproc_per_node=2", "parallelism.ep=4"], None,
     ["parallelism.ep=4 must divide dp_shard×tp=2×1=2"]),
    (["parallelism=fsdp"], 4,
     ["parallelism.nproc_per_node×nnodes=2×1=2 but the launcher started 4 processes", "parallelism.nproc_per_node=4"]),
    (["parallelism=fsdp", "parallelism.nnodes=2"], None,
     ["parallelism.nnodes=2 needs parallelism.rdzv_endpoint=<head node>:<port>", "hydra/launcher=slurm"]),
]


@pytest.mark.parametrize("overrides,world,fragments", INVALID, ids=[" ".join(o) for o, _, _ in INVALID])
def test_invalid_degrees_fail_with_one_line(overrides, world, fragments, monkeypatch):
    monkeypatch.delenv("SLURM_JOB_NODELIST", raising=False)
    with pytest.raises(ConfigError) as e:
        degrees_for(overrides, world_size=world)
    msg = str(e.value)
    print(msg)
    assert "\n" not in msg
    for f in fragments:
        assert f in msg, f"{f!r} not in {msg!r}"


def test_invalid_degrees_stop_the_cli_before_any_worker(tmp_path):
    """Exit status 2, one line on stderr, no run dir and no worker started."""
    run_dir = tmp_path / "run"
    t0 = time.perf_counter()
    proc = run_cli(["parallelism=fsdp_tp", "parallelism.tp=4", *BASE], run_dir=run_dir, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert lines == ["config error: parallelism.tp=4 must divide the model's n_heads=4 and n_kv_heads=2; "
                     "use parallelism.tp in [1, 2]"], lines
    assert not run_dir.exists()
    assert "elastic" not in proc.stderr.lower() and "rank" not in proc.stdout
    print(f"{lines[0]}  ({time.perf_counter() - t0:.1f}s)")


@pytest.mark.slow
def test_torchrun_world_size_must_match(tmp_path):
    """torchrun starts 2 processes but parallelism=hsdp asks for 4: every rank stops before Hydra starts."""
    proc = run_cli(["--nproc_per_node", "2", "-m", "qwen3_research", "parallelism=hsdp", *BASE],
                   module="torch.distributed.run", cwd=tmp_path, timeout=180)
    msg = ("config error: parallelism.nproc_per_node×nnodes=4×1=4 but the launcher started 2 processes; "
           "set parallelism.nproc_per_node=2")
    print(msg in proc.stderr, proc.returncode)
    assert proc.returncode != 0 and msg in proc.stderr, proc.stderr[-3000:]
    assert not (tmp_path / "outputs").exists()


# ---------------------------------------------------------------------------------------------
# Slurm (hydra-submitit-launcher)
# ---------------------------------------------------------------------------------------------
def test_slurm_launcher_composes_one_task_per_node():
    cfg = compose_run(["hydra/launcher=slurm", "parallelism=trn2", "parallelism.nnodes=4",
                       "hydra.launcher.partition=trn2", "model.flavor=0.6B"], hydra=True)
    launcher = OmegaConf.to_container(cfg.hydra.launcher, resolve=True)
    assert launcher["_target_"] == "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher"
    assert launcher["nodes"] == 4 and launcher["tasks_per_node"] == 1 and launcher["partition"] == "trn2"
    from hydra.utils import get_class

    assert get_class(launcher["_target_"]).__name__ == "SlurmLauncher"
    d = degrees_for(["parallelism=trn2", "parallelism.nnodes=4", "model.flavor=0.6B",
                     "parallelism.rdzv_endpoint=head:29500"])
    assert (d.world_size, d.dp_shard) == (256, 256)
    doc = (ROOT / "docs" / "PARALLELISM.md").read_text()
    assert "hydra/launcher=slurm" in doc and "## Multi-node (Slurm)" in doc
    print({k: launcher[k] for k in ("nodes", "tasks_per_node", "partition", "timeout_min")})


# ---------------------------------------------------------------------------------------------
# Multi-process parity on CPU/gloo (acceptance a, b, c)
# ---------------------------------------------------------------------------------------------
def _max_diff(ref: list[float], got: list[float]) -> float:
    assert len(ref) == len(got) == STEPS, (ref, got)
    return max(abs(a - b) for a, b in zip(ref, got))


def _check_parity(name: str, ref_dir: Path, got_dir: Path, tol: float) -> None:
    """Losses within ``tol``; gradient norms too (relative), since Adam and clipping hide a wrong grad scale."""
    ref, got = train_losses(ref_dir), train_losses(got_dir)
    diff = _max_diff(ref, got)
    gref = [r["grad_norm"] for r in read_metrics(ref_dir) if "grad_norm" in r]
    ggot = [r["grad_norm"] for r in read_metrics(got_dir) if "grad_norm" in r]
    gdiff = max(abs(a - b) / a for a, b in zip(gref, ggot))
    print(f"{name}: largest loss difference over {STEPS} steps vs one process = {diff:.3e} (tol {tol:g}); "
          f"largest relative grad-norm difference = {gdiff:.3e}")
    print(f"  single: {[round(x, 6) for x in ref]}\n  {name}: {[round(x, 6) for x in got]}")
    assert diff <= tol
    assert len(gref) == len(ggot) == STEPS and gdiff <= GRAD_TOL[tol]


def _one_run_dir(cwd: Path) -> Path:
    dirs = [p for p in (cwd / "outputs").rglob("*") if p.is_dir() and (p / "summary.json").exists()]
    everything = sorted(str(p.relative_to(cwd)) for p in (cwd / "outputs").rglob("*"))
    assert len(dirs) == 1, everything
    leaves = [p for p in (cwd / "outputs" / "runs").glob("*/*")]
    assert leaves == dirs, everything
    return dirs[0]


def _run_ok(args, run_dir=None, **kw):
    t0 = time.perf_counter()
    proc = run_cli(args, run_dir=run_dir, timeout=400, **kw)
    assert_ok(proc)
    print(f"  ({' '.join(a for a in args if not a.startswith(('logging.', 'training.eval')))}: {time.perf_counter() - t0:.0f}s)")
    return proc


@pytest.fixture(scope="module")
def dense_single(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("dense_single")
    _run_ok(["data.batch_size=4", *BASE], run_dir=run_dir)
    return run_dir


@pytest.fixture(scope="module")
def moe_single(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("moe_single")
    _run_ok(["model=native_moe", "data.batch_size=4", *BASE], run_dir=run_dir)
    return run_dir


def _state_bytes(run_dir: Path) -> list[int]:
    rows = read_metrics(run_dir)[-1]["mem_per_rank"]
    return [r["state_bytes"] for r in sorted(rows, key=lambda r: r["rank"])]


@pytest.mark.feature("FSDP (parallelism.dp_shard)")
@pytest.mark.slow
def test_torchrun_fsdp_parity_memory_and_one_run_dir(dense_single, tmp_path):
    """`torchrun --nproc_per_node 2 -m qwen3_research parallelism=fsdp training.steps=5` (acceptance a, b, c)."""
    args = ["--nproc_per_node", "2", "-m", "qwen3_research", "parallelism=fsdp", "data.batch_size=2", *BASE]
    _run_ok(args, module="torch.distributed.run", cwd=tmp_path)
    run_dir = _one_run_dir(tmp_path)
    assert not (tmp_path / "multirun").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["outputs"]
    _check_parity("fsdp (torchrun, 2 ranks)", dense_single, run_dir, DENSE_TOL)
    # Only rank 0 writes metrics; memory comes from both ranks.
    assert [r["rank"] for r in read_metrics(run_dir)[0]["mem_per_rank"]] == [0, 1]
    (single,) = _state_bytes(dense_single)
    per_rank = _state_bytes(run_dir)
    ratios = [b / single for b in per_rank]
    print(f"params+grads+optimizer bytes: single {single:,}; dp_shard=2 per rank {per_rank} -> "
          f"{[round(r, 4) for r in ratios]} of single (limit 0.55)")
    assert all(r <= 0.55 for r in ratios)
    # Each torchrun worker is its own `python -m qwen3_research`: it set up the CPU allocator itself (issue 24),
    # as it reports from inside (tests/test_allocator.py::expected_in_workers).
    facts = json.loads((run_dir / "summary.json").read_text())["device_facts"]
    print("workers' allocator:", [(f["rank"], f["cpu_allocator"]) for f in facts])
    assert [f["cpu_allocator"] for f in facts] == [expected_in_workers()] * 2


@pytest.mark.feature("tensor parallel + sequence parallel")
@pytest.mark.slow
def test_tp2_sequence_parallel_parity(dense_single, tmp_path):
    proc = _run_ok(["parallelism=tp2", "data.batch_size=4", *BASE], run_dir=tmp_path / "run")
    _check_parity("tp2+sp", dense_single, tmp_path / "run", DENSE_TOL)
    # issue 40: torch's 538-character "While redistributing from (_NormPartial ..." warning from every rank
    # (startup.QUIET_LOGGERS)
    assert "While redistributing" not in proc.stdout + proc.stderr


@pytest.mark.slow
def test_fsdp_tp_four_ranks_from_one_command(dense_single, tmp_path):
    """`python -m qwen3_research parallelism=fsdp_tp parallelism.nproc_per_node=4 training.steps=5` (a, c)."""
    proc = _run_ok(["parallelism=fsdp_tp", "parallelism.nproc_per_node=4", "data.batch_size=2", *BASE], cwd=tmp_path)
    run_dir = _one_run_dir(tmp_path)
    assert "world=4 dp_replicate=1 dp_shard=2 tp=2+sp" in proc.stdout
    assert len(read_metrics(run_dir)[0]["mem_per_rank"]) == 4
    _check_parity("dp_shard=2 x tp=2+sp (4 ranks)", dense_single, run_dir, DENSE_TOL)


@pytest.mark.feature("MoE (model=native_moe) on CPU")
@pytest.mark.feature("expert parallel (parallelism.ep)")
@pytest.mark.feature("MoE balance: expert bias")
@pytest.mark.slow
def test_moe_dp2_ep2_parity(moe_single, tmp_path):
    """Parity with one process, and the expert bias (model.moe.balance auto = bias, coefficient 1e-3) moves in both:
    after step s its largest |value| is in (0, 2e-3·s] (each step adds ±1e-3 per expert, then centres), the same in
    both runs. Parity alone cannot see a bias that never moves: both runs would route alike without it."""
    _run_ok(["model=native_moe", "parallelism=ep2", "data.batch_size=2", *BASE], run_dir=tmp_path / "run")
    _check_parity("moe dp2 x ep2", moe_single, tmp_path / "run", MOE_TOL)
    single, ep2 = ([r.get("moe_expert_bias") for r in read_metrics(d) if "loss" in r] for d in (moe_single, tmp_path / "run"))
    print(f"  largest |expert bias| per step: single {single}; ep2 {ep2}")
    assert len(ep2) == STEPS and all(b is not None and 0 < b <= 2e-3 * s for s, b in enumerate(ep2, 1)), ep2
    assert max(abs(a - b) for a, b in zip(single, ep2)) <= 1e-6


@pytest.mark.slow
def test_moe_tp2_parity(moe_single, tmp_path):
    _run_ok(["model=native_moe", "parallelism=tp2", "data.batch_size=4", *BASE], run_dir=tmp_path / "run")
    _check_parity("moe tp2+sp", moe_single, tmp_path / "run", MOE_TOL)


# ---------------------------------------------------------------------------------------------
# A failing rank stops the group (acceptance d)
# ---------------------------------------------------------------------------------------------
def _processes_tagged(tag: str) -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter():
        try:
            if p.environ().get("QWEN3_TEST_TAG") == tag:
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    return found


@pytest.mark.slow
def test_failing_rank_stops_the_group(tmp_path):
    """A fault (tests/hooks: raise@2:rank1): rank 1 raises at the start of step 2 while rank 0 waits in a collective."""
    import json

    tag = uuid.uuid4().hex
    cmd = [sys.executable, "-m", "qwen3_research", "parallelism=fsdp", "data.batch_size=2",
           *BASE, f"hydra.run.dir={tmp_path / 'run'}"]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=cli_env(QWEN3_TEST_TAG=tag, **fault_env("raise@2:rank1")),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out, t_step1 = [], None
    try:
        for line in proc.stdout:  # rank 0's "step 1/5" line: the group is up; rank 1 fails next
            out.append(line)
            if t_step1 is None and line.startswith("step     1/"):
                t_step1 = time.perf_counter()
        rc = proc.wait(timeout=120)
    finally:
        proc.kill()
    t_exit = time.perf_counter()
    text = "".join(out)
    errors = [ln for ln in out if ln.startswith("error:")]
    assert t_step1 is not None, text[-3000:]
    print(f"exit {rc}: {t_exit - t_step1:.1f}s after step 1 (the failure), {t_exit - t0:.1f}s in all "
          f"(startup of 2 workers on 2 shared cores included): {errors}")
    assert rc == 1
    assert t_exit - t_step1 < 60
    assert errors == ["error: rank 1 failed (exit code 1): RuntimeError: injected failure at step 2 on rank 1 "
                      "(QWEN3_TEST_FAULT=raise@2:rank1)\n"]
    time.sleep(1.0)
    left = _processes_tagged(tag)
    assert not left, [(p.pid, p.cmdline()[:3]) for p in left]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "failed" and "rank 1 failed" in summary["reason"]
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [1]


def test_the_reported_failure_is_the_cause_not_the_peer_that_lost_it():
    """Error files carry whole-second timestamps: rank 1's injected error and rank 0's lost gloo peer tie, and
    torch's get_first_failure took rank 0's "Connection reset by peer" (seen as a flaky test_failing_rank_stops_the_
    group). The cause wins the tie; a failure a second or more earlier still wins."""
    from types import SimpleNamespace as F

    from qwen3_research.launch.elastic import root_failure

    reset = "RuntimeError: [../gloo/transport/tcp/pair.cc:545] Read error [127.0.0.1]:30894: Connection reset by peer."
    tie = {0: F(message=reset, timestamp=100), 1: F(message="RuntimeError: injected failure", timestamp=100)}
    assert root_failure(tie)[0] == 1
    assert root_failure({0: F(message=reset, timestamp=100), 1: F(message={"message": "boom"}, timestamp=101)})[0] == 1
    assert root_failure({0: F(message="ValueError: x", timestamp=100), 1: F(message="OSError: y", timestamp=105)})[0] == 0
    assert root_failure({0: F(message=reset, timestamp=100), 1: F(message=reset, timestamp=100)})[0] == 0


def test_the_cause_is_found_in_a_sibling_error_file_the_agent_did_not_report(tmp_path):
    """The agent reports only the first dead process its poll finds: rank 0 (lost its peer) may be the one, while
    rank 1's error file (the injected failure) lies beside it in torch's <attempt>/<local rank>/error.json layout."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from qwen3_research.launch.elastic import root_failure

    def error_file(local_rank: int, message: str) -> str:
        (tmp_path / str(local_rank)).mkdir()
        path = tmp_path / str(local_rank) / "error.json"
        path.write_text(json.dumps({"message": {"message": message, "extraInfo": {"timestamp": "100"}}}))
        return str(path)

    reported = ProcessFailure(0, pid=1, exitcode=1, error_file=error_file(0, "RuntimeError: gloo Connection reset by peer"))
    error_file(1, "RuntimeError: injected failure at step 2 on rank 1")
    rank, failure = root_failure({4: reported})  # node 2 of 2-rank nodes: global ranks 4 and 5
    assert rank == 5 and "injected failure" in json.dumps(failure.message)
