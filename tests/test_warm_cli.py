"""The suite's warm CLI (tests/warm_cli.py) must be indistinguishable from a cold `python -m qwen3_research`."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests import warm_cli
from tests.conftest import FAST, ROOT, cli_env, read_metrics, run_cli


def _cold(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "qwen3_research", *args], cwd=ROOT, env=cli_env(),
                          capture_output=True, text=True, timeout=300)


def _warm(args: list[str]) -> subprocess.CompletedProcess:
    proc = warm_cli.run("qwen3_research", args, cwd=ROOT, env=cli_env(), base_env=cli_env(), timeout=300)
    assert proc is not None, "warm_cli refused a run with the default environment"
    return proc


def _steady(text: str) -> list[str]:
    """The lines of a run's output without the figures that are timings."""
    out = []
    for ln in text.splitlines():
        ln = re.sub(r"^\[\d{4}-\d\d-\d\d [\d:,]+\]", "", ln)  # the logging time stamp
        words = [w for w in ln.split() if not w.startswith(("tokens_per_s=", "mfu=", "step_time_s=", "first_step_s=",
                                                              "steady_step_s=", "build_s=", "mem_peak_gib="))]
        out.append(" ".join(words))
    return out


def test_server_is_warm_and_fork_clean():
    srv = warm_cli.server(cli_env())
    if srv is None:  # QWEN3_TESTS_COLD_CLI=1: nothing warm to check
        return
    assert srv.usable and srv.missing == [], srv.missing


def test_warm_run_equals_a_cold_run(tmp_path):
    args = [*FAST, "parallelism.dp_shard=2", "parallelism.nproc_per_node=2"]
    cold = _cold([*args, f"hydra.run.dir={tmp_path / 'cold'}"])
    warm = _warm([*args, f"hydra.run.dir={tmp_path / 'warm'}"])
    assert cold.returncode == warm.returncode == 0, (cold.stderr[-2000:], warm.stderr[-2000:])
    losses = {k: [(r["step"], r["loss"]) for r in read_metrics(tmp_path / k) if "loss" in r] for k in ("cold", "warm")}
    assert len(losses["cold"]) == 3 and losses["warm"] == losses["cold"]  # 2 forked ranks, bit-identical
    assert sorted(_steady(warm.stdout)) == sorted(_steady(cold.stdout))  # two ranks interleave their lines


def test_warm_config_error_equals_a_cold_one(tmp_path):
    args = [*FAST, "model.flavr=tiny", f"hydra.run.dir={tmp_path / 'r'}"]
    cold, warm = _cold(args), _warm(args)
    assert cold.returncode == warm.returncode == 2
    assert warm.stderr == cold.stderr and warm.stdout == cold.stdout
    assert not (tmp_path / "r").exists()


def test_a_childs_exit_leaves_the_servers_temporary_directories_alone():
    """W&B's media directory, made and registered for removal at exit when wandb is imported (in the server), was
    removed by the first child's exit, and a later sweep's W&B table failed with FileNotFoundError. Each child has
    its own now, as a cold process does."""
    outs = [warm_cli.run("tests.wandb_media_probe", [], cwd=ROOT, env=cli_env(), base_env=cli_env(), timeout=120)
            for _ in range(3)]
    assert all(p is not None and p.returncode == 0 for p in outs), [p and p.stderr[-2000:] for p in outs]
    lines = [p.stdout.strip() for p in outs]
    print(lines)
    assert all(ln.endswith("exists=True") for ln in lines) and len(set(lines)) == 3, lines


# -- no process outlives its test (issue 33) ---------------------------------------------------------------------


def _still_there(pids) -> list[int]:
    """The pids that name a live process (a zombie is dead: it waits only for its parent to read its status)."""
    alive = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.NoSuchProcess:
            pass
    return alive


def _gone_within(pids, seconds: float) -> list[int]:
    deadline = time.monotonic() + seconds
    while _still_there(pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return _still_there(pids)


def _kill(pids) -> None:
    for pid in _still_there(pids):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _wait_for(path: Path, seconds: float, proc: subprocess.Popen | None = None) -> dict:
    deadline = time.monotonic() + seconds
    while not path.exists():
        assert time.monotonic() < deadline, f"{path.name} not written within {seconds:.0f} s"
        assert proc is None or proc.poll() is None, proc.communicate()[0][-3000:]
        time.sleep(0.1)
    return json.loads(path.read_text())


def test_a_timed_out_run_leaves_no_process(tmp_path):
    """A run that times out takes its whole process group with it: the timeout killed only the process the test
    started, and the forked ranks (stuck, so deaf to SIGTERM) and the resource tracker stayed for good."""
    warm_cli.server(cli_env())  # started (and its imports done) outside the run's 10 s
    marker = tmp_path / "pids.json"
    with pytest.raises(subprocess.TimeoutExpired):
        run_cli([str(marker)], module="tests.orphan_probe", timeout=10)
    pids = _wait_for(marker, 0)
    try:
        assert _gone_within(pids.values(), 5) == [], pids
    finally:
        _kill(pids.values())


@pytest.mark.slow
def test_a_killed_pytest_leaves_no_process(tmp_path):
    """SIGKILL to a pytest process in the middle of a warm run: within 5 s neither its server, nor the run, nor
    the run's rank or resource tracker is left. Before, the server left its loop and the rest ran on (a hung
    4-rank run: for good). ~20-30 s, most of it the server's imports."""
    marker = tmp_path / "pids.json"
    (tmp_path / "test_inner.py").write_text(
        "from pathlib import Path\n"
        "from tests.conftest import run_cli\n\n"
        "def test_runs_until_killed():\n"
        f"    run_cli([{str(marker)!r}], module='tests.orphan_probe', cwd=Path({str(ROOT)!r}), timeout=600)\n")
    env = {k: v for k, v in cli_env(PYTHONPATH=str(ROOT)).items() if k != warm_cli.COLD_ENV}  # the warm path
    inner = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_inner.py"],
                             cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             start_new_session=True)
    pids = {}
    try:
        pids = _wait_for(marker, 50, inner)
        pids["server"] = psutil.Process(pids["run"]).ppid()
        assert psutil.Process(pids["server"]).ppid() == inner.pid, pids  # the run came from the warm server
        os.kill(inner.pid, signal.SIGKILL)
        inner.wait()
        assert _gone_within(pids.values(), 5) == [], pids
    finally:
        if inner.poll() is None:
            os.killpg(inner.pid, signal.SIGKILL)
        inner.communicate()
        _kill(pids.values())
