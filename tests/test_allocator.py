"""The CPU allocator (issue 24, qwen3_research/allocator.py): what every process of a run allocates with, as the
worker processes themselves observe it (summary.json ``device_facts[*].cpu_allocator``, computed in each rank:
mimalloc mapped into the process, or glibc asked whether a 64 MiB malloc is mmapped), and the off switch.

Worker processes start two ways (launch._start_method): forked from the command (a CPU run), or spawned as fresh
interpreters (cuda/neuron, and CPU after the command built a Trainer: a sweep that planned its points). A spawned
worker inherits only the environment, so mallopt in the parent does not reach it; the sweep runs below spawn
theirs (each rank records ``spawned``).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from qwen3_research import allocator
from tests.conftest import FAST, ROOT, assert_ok, cli_env, run_cli

TWO_RANKS = FAST + ["parallelism=fsdp", "training.steps=1"]
MIMALLOC = "mimalloc 3.4.3 (LD_PRELOAD)"
TUNED = "glibc, thresholds raised (large blocks from the heap)"
DEFAULT = "glibc default (large blocks mmapped)"

needs_wheel = pytest.mark.skipif(allocator.mimalloc_library() is None,
                                 reason="cmeel-mimalloc (requirements.lock) is not installed in this environment")


def _facts(summary_path: Path) -> list[dict]:
    facts = json.loads(summary_path.read_text())["device_facts"]
    print([(f["rank"], f["cpu_allocator"], "spawned" if f["spawned"] else "forked") for f in facts])
    return facts


def _sweep_point_summary(sweep_dir: Path) -> Path:
    (found,) = sweep_dir.glob("0_*/summary.json")
    return found


def test_choice_and_the_command_run_again(monkeypatch):
    monkeypatch.setenv(allocator.ENV, "System")
    assert allocator.choice() == "system"
    monkeypatch.setenv(allocator.ENV, "jemalloc")
    with pytest.raises(SystemExit) as e:
        allocator.choice()
    assert e.value.code == 2
    # A process forked from a warm interpreter has its parent's orig_argv: the command is rebuilt from sys.argv.
    monkeypatch.setattr(sys, "orig_argv", [sys.executable, "-X", "utf8", "-m", "tests.warm_cli", "sock"])
    monkeypatch.setattr(sys, "argv", ["qwen3_research", "training.steps=2"])
    assert allocator._reexec_argv("qwen3_research")[-3:] == ["-m", "qwen3_research", "training.steps=2"]
    monkeypatch.setattr(sys, "orig_argv", [sys.executable, "-X", "utf8", "-m", "qwen3_research", "a=1"])
    monkeypatch.setattr(sys, "argv", ["/x/qwen3_research/__main__.py", "a=1"])
    assert allocator._reexec_argv("qwen3_research") == [sys.executable, "-X", "utf8", "-m", "qwen3_research", "a=1"]
    assert allocator._device_kind_from_argv(["device=cuda", "device.type=cpu"]) == "cpu"


@pytest.mark.slow
@needs_wheel
def test_workers_of_a_cold_command_run_mimalloc(tmp_path):
    """A plain `python -m qwen3_research` (not the warm test server, which starts with mimalloc already): the command
    re-executes itself with mimalloc preloaded; both forked ranks run with it."""
    env = cli_env()
    env.pop(allocator.ENV, None)
    proc = subprocess.run([sys.executable, "-m", "qwen3_research", *TWO_RANKS, f"hydra.run.dir={tmp_path / 'run'}"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert_ok(proc)
    facts = _facts(tmp_path / "run" / "summary.json")
    assert [f["cpu_allocator"] for f in facts] == [MIMALLOC, MIMALLOC] and not any(f["spawned"] for f in facts)


@pytest.mark.slow
def test_mallopt_reaches_spawned_workers(tmp_path):
    """glibc with raised thresholds (the fallback without the wheel): exported to the environment, so spawned ranks
    start with it too (mallopt alone would reach forked ones only). mimalloc reaches them the same way (LD_PRELOAD
    in the environment they inherit)."""
    proc = run_cli(["-m", *TWO_RANKS, f"hydra.sweep.dir={tmp_path}"], env=cli_env(**{allocator.ENV: "mallopt"}))
    assert_ok(proc)
    facts = _facts(_sweep_point_summary(tmp_path))
    assert [f["cpu_allocator"] for f in facts] == [TUNED, TUNED] and all(f["spawned"] for f in facts)


@pytest.mark.slow
def test_off_switch(tmp_path):
    """QWEN3_CPU_ALLOCATOR=system: glibc as it comes in the forked ranks of a plain 2-rank run, even when the process
    that starts it had mimalloc (the warm test server does): the command re-executes without it."""
    proc = run_cli(TWO_RANKS, run_dir=tmp_path / "run", env=cli_env(**{allocator.ENV: "system"}))
    assert_ok(proc)
    facts = _facts(tmp_path / "run" / "summary.json")
    assert [f["cpu_allocator"] for f in facts] == [DEFAULT, DEFAULT] and not any(f["spawned"] for f in facts)
