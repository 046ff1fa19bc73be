"""Shared helpers: run the real CLI in a subprocess, read metrics.jsonl and offline W&B runs."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

# Under pytest-xdist, N workers share the machine's cores: each worker's runs (and torch in it) get cores // N
# threads, as torchrun gives its workers OMP_NUM_THREADS=1. Oversubscribed OpenMP threads spin against each other:
# on 2 cores with -n 2, tests/test_train.py + tests/test_reliability.py took 192 s with 2 threads per run and 146 s
# with 1. Set before anything imports torch (it reads the variable once); every run inherits it (cli_env), the
# warm server included. A value already in the environment wins.
_XDIST_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _XDIST_WORKERS > 1 and "OMP_NUM_THREADS" not in os.environ:
    os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // _XDIST_WORKERS))

import pytest  # noqa: E402

from tests import warm_cli  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent

# Small and quick: 32-token sequences, 2 per rank, 3 steps, no eval.
FAST = [
    "training.steps=3",
    "data.seq_len=32",
    "data.batch_size=2",
    "training.eval_every=0",
    "logging.print_config=false",
    "logging.wandb.mode=disabled",
]


def cli_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "TORCHELASTIC_", "HYDRA_"))}
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE"):
        env.pop(k, None)
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


HOOKS = ROOT / "tests" / "hooks"


def hooks_env(**hooks: str) -> dict:
    """Environment entries for a CLI run with the test hooks of tests/hooks/qwen3_test_hooks.py: that folder on
    PYTHONPATH (its sitecustomize.py wraps parts of qwen3_research from outside) and ``hooks``, the variables that
    ask for them. For ``cli_env(**hooks_env(...))``."""
    path = os.pathsep.join(p for p in (str(HOOKS), os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": path, **hooks}


def fault_env(spec: str) -> dict:
    """Environment entries for a CLI run with a fault (QWEN3_TEST_FAULT=WHAT@N[:rankR], tests/hooks): raise, nan,
    kill or oom in step N's forward-backward, term (SIGTERM to the launcher) as step N's evaluation starts."""
    from tests.hooks.qwen3_test_hooks import FAULT_ENV, check_fault

    return hooks_env(**{FAULT_ENV: check_fault(spec)})


@pytest.fixture
def fault_hook(monkeypatch):
    """``install(spec)``: the fault of tests/hooks (as QWEN3_TEST_FAULT=spec asks in a CLI run) wrapped around this
    process's ``Step``, undone after the test."""
    def install(spec: str) -> None:
        from qwen3_research.step import Step
        from tests.hooks.qwen3_test_hooks import check_fault, fault_methods

        for name, method in fault_methods(Step, check_fault(spec)).items():
            monkeypatch.setattr(Step, name, method)

    return install


SIGINT_AT_IMPORT = '''
import os, signal, sys

class SigintAtImport:
    """Ctrl-C while the tool imports one of its modules (inside its main(), after the process started)."""

    def find_spec(self, name, path=None, target=None):
        if name == os.environ["TRIGGER"] and not os.path.exists(os.environ["MARKER"]):
            open(os.environ["MARKER"], "w").write(name)
            os.kill(os.getpid(), signal.SIGINT)
        return None

sys.meta_path.insert(0, SigintAtImport())
'''


def sigint_at_import(tmp_path: Path, trigger: str, marker: Path) -> dict:
    """Environment for a command that gets Ctrl-C once, when it first imports the module ``trigger`` (a
    sitecustomize hook on PYTHONPATH; ``marker`` is written when it fires): a Ctrl-C while importing, at a
    chosen import rather than a timer."""
    hook = tmp_path / "hook"
    hook.mkdir(exist_ok=True)
    (hook / "sitecustomize.py").write_text(SIGINT_AT_IMPORT)
    return {"PYTHONPATH": str(hook), "TRIGGER": trigger, "MARKER": str(marker)}


def run_cli(args: list[str], *, run_dir: Path | None = None, timeout: float = 300, module: str = "qwen3_research",
            env: dict | None = None, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """`python -m <module> *args` in its own process: forked from this pytest process's warm server when the
    environment allows (tests/warm_cli.py: the imports are done once, everything else is a fresh process), else
    a plain subprocess. QWEN3_TESTS_COLD_CLI=1 makes every run a plain subprocess."""
    if run_dir is not None:
        args = [*args, f"hydra.run.dir={run_dir}"]
    env = env or cli_env()
    warm = warm_cli.run(module, args, cwd=cwd, env=env, base_env=cli_env(), timeout=timeout)
    if warm is not None:
        return warm
    return run_in_own_group([sys.executable, "-m", module, *args], cwd=cwd, env=env, timeout=timeout)


def run_in_own_group(cmd: list[str], *, cwd: Path, env: dict, timeout: float) -> subprocess.CompletedProcess:
    """subprocess.run(cmd, capture_output=True, text=True, timeout=timeout), except that the process leads its own
    process group and a timeout (or an interrupt) SIGKILLs the whole group: subprocess.run kills only the process
    it started, and a multi-rank run's ranks and resource tracker outlived a timed-out test for good."""
    with subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          process_group=0) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except BaseException as e:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            out, err = proc.communicate()
            if isinstance(e, subprocess.TimeoutExpired):
                raise subprocess.TimeoutExpired(cmd, timeout, out, err) from None
            raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def read_metrics(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def train_losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(run_dir) if "loss" in r]


def wandb_records(run_dir: Path) -> list[dict]:
    """All records of the offline W&B run under run_dir, through W&B's own reader."""
    files = sorted(Path(run_dir).glob("wandb/offline-run-*/run-*.wandb"))
    assert len(files) == 1, f"expected one offline W&B run under {run_dir}, found {files}"
    out = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(files[0])],
                         capture_output=True, text=True, timeout=120)
    if out.returncode != 0:  # older entry point: the wandb script next to python
        out = subprocess.run([str(Path(sys.executable).parent / "wandb"), "leet", "inspect", "--json", str(files[0])],
                             capture_output=True, text=True, timeout=120, check=True)
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def assert_ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, f"exit {proc.returncode}\nSTDOUT:\n{proc.stdout[-4000:]}\nSTDERR:\n{proc.stderr[-4000:]}"


FILE_SECONDS = Path(__file__).with_name("file_seconds.json")  # tests/file_costs.py writes it from a --durations=0 log


def pytest_collection_modifyitems(config, items):
    """The longest test files first (longest-processing-time-first scheduling). With ``--dist loadfile`` a file
    runs whole on one worker, and pytest-xdist hands files out in collection order (README's command passes
    --no-loadscope-reorder; xdist's own reorder puts the files with the most tests first, which sent the 16-minute
    pairwise matrix, one test, last: one worker ran it alone for its last 12 minutes). Within a file the order stays
    the definition order."""
    seconds = json.loads(FILE_SECONDS.read_text()) if FILE_SECONDS.exists() else {}
    files = {item.nodeid.split("::")[0]: None for item in items}
    rank = {f: i for i, f in enumerate(sorted(files, key=lambda f: -seconds.get(f, 0.0)))}
    items.sort(key=lambda item: rank[item.nodeid.split("::")[0]])


def pytest_runtest_logreport(report):
    """QWEN3_TEST_TIMES=FILE: each phase's seconds appended as it ends (``--durations`` prints only when the whole
    run ends), in ``--durations=0``'s line format, for tests/file_costs.py."""
    path = os.environ.get("QWEN3_TEST_TIMES")
    # Under xdist the controller gets each worker's reports again (each carries its worker's ``node``): only the
    # process that ran the test writes.
    if path and not hasattr(report, "node"):
        with open(path, "a") as f:
            f.write(f"{report.duration:.2f}s {report.when} {report.nodeid}\n")


# Modules (by name) with a failed test: their directories stay for the post-mortem.
_FAILED_MODULES: set[str] = set()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.failed:
        _FAILED_MODULES.add(item.module.__name__)
    return report


@pytest.fixture(scope="module", autouse=True)
def _module_directories_go_with_the_module(request, tmp_path_factory):
    """The directories a module's fixtures make with tmp_path_factory (module-scoped run directories, checkpoints)
    are removed when the module ends, unless one of its tests failed; pytest itself keeps them to the end of the
    session, and at ~0.5-1 GB per run directory the suite then needed ~14 GB of disk (CI ran out of it). Set up
    first among the module's fixtures (autouse), torn down last. Under pytest-xdist each worker has its own base
    directory and --dist loadfile keeps a module on one worker, so nothing another module uses is removed."""
    base = tmp_path_factory.getbasetemp()
    before = set(base.iterdir())
    yield
    if request.module.__name__ not in _FAILED_MODULES:
        for path in set(base.iterdir()) - before:
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def root() -> Path:
    return ROOT


def wandb_history(run_dir: Path) -> tuple[set[str], list[int]]:
    """Every offline W&B segment under run_dir (a resumed run adds one per start), through W&B's own reader:
    the run ids their run records name, and the train/step of every history row, in file order."""
    ids, steps = set(), []
    for f in sorted(Path(run_dir).glob("wandb/offline-run-*/run-*.wandb")):
        out = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(f)],
                             capture_output=True, text=True, timeout=120, check=True)
        for line in out.stdout.splitlines():
            if not line.startswith("{"):
                continue
            rec = json.loads(line)
            if rec["type"] == "run":
                ids.add(rec["run"]["run_id"])
            elif rec["type"] == "history":
                steps.append(int(rec["history"]["item"]["train/step"]))
    return ids, steps
from tests.slurm_cluster import slurm_cluster  # noqa: E402,F401 - the two-node Slurm cluster fixture (issue 16)
