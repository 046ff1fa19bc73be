"""The CPU allocator (issue 24, qwen3_research/allocator.py): what every process of a run allocates with, as the
worker processes themselves observe it (summary.json ``device_facts[*].cpu_allocator``, computed in each rank:
mimalloc mapped into the process, or glibc asked whether a 64 MiB malloc is mmapped), and the off switch.

Worker processes start two ways (launch._start_method): forked from the command (a CPU run), or spawned as fresh
interpreters (cuda/neuron, and CPU after the command built a Trainer: a sweep that planned its points). A spawned
worker inherits only the environment, so mallopt in the parent does not reach it; the sweep runs below spawn
theirs (each rank records ``spawned``).
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from qwen3_research import allocator
from tests.conftest import ROOT, cli_env

MIMALLOC = "mimalloc 3.4.3 (LD_PRELOAD)"
TUNED = "glibc, thresholds raised (large blocks from the heap)"
DEFAULT = "glibc default (large blocks mmapped)"

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
    assert allocator.devices.device_kind(argv=["device=cuda", "device.type=cpu"]) == "cpu"


def test_the_fallback_reaches_processes_the_command_execs():
    """glibc with raised thresholds (the fallback without the wheel): mallopt reaches this process and forked workers,
    the exported MALLOC_*_ variables a fresh interpreter (a spawned worker) -- asked of the child itself."""
    code = ("import subprocess, sys; from qwen3_research import allocator; print(allocator._raise_glibc_thresholds());"
            "print(subprocess.run([sys.executable, '-c', 'from qwen3_research import allocator; "
            "print(allocator.status())'], capture_output=True, text=True).stdout.strip())")
    env = cli_env()
    env.pop("LD_PRELOAD", None)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    print(out.stdout, out.stderr[-2000:])
    assert out.stdout.split("\n")[:2] == ["True", TUNED]


def expected_in_workers() -> str:
    """What a CPU run's worker reports by default: mimalloc where the pinned wheel is installed, else the fallback.
    The 2-rank runs that check it (a worker reads its own allocator, summary.json device_facts[*].cpu_allocator):
    tests/test_parallel.py::test_torchrun_fsdp_parity_memory_and_one_run_dir (each torchrun worker a fresh
    ``python -m qwen3_research``: the re-exec path) and, off, tests/test_device.py::
    test_lnc_reaches_every_worker_environment (QWEN3_CPU_ALLOCATOR=system, forked from a process that may have it)."""
    return MIMALLOC if allocator.mimalloc_library() is not None else TUNED
