"""Start a run: one process in place, or a worker group through PyTorch's elastic launcher.

The parent resolves the run once (``resolve.resolve_run``); workers receive that description
(``ResolvedRun``) and the run directory, so every rank agrees on both.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time
import traceback
import uuid
from contextlib import contextmanager, suppress
from dataclasses import asdict
from pathlib import Path

from omegaconf import DictConfig

from qwen3_research import compiling
from qwen3_research import devices
from qwen3_research import models, overrides, slurm, startup
from qwen3_research.compose import compose
from qwen3_research.config import RunConfig
from qwen3_research.parallel import rendezvous
from qwen3_research.run.checkpoint import find_checkpoint
from qwen3_research.data import Tokenizer, tokenizer_path
from qwen3_research.errors import ConfigError, ExportError, TrainingError, WorkerGroupError, check_writable
from qwen3_research.resolve import (ResolvedRun, RunInfo, at_run_dir, resolve_before_hydra,  # noqa: F401  (re-exported)
                                    resolve_run, under_torchrun)
from qwen3_research.run.rundir import AlreadyComplete, RunDirLock, discard_earlier_run, read_summary
from qwen3_research.signals import Interrupted, Terminated, signal_number
from qwen3_research.startup import quiet_libraries
from qwen3_research.trainer import Trainer


def _writes_run_files() -> bool:
    """summary.json comes from rank 0 under torchrun, and from the first node of a Slurm job."""
    return (not under_torchrun() or os.environ.get("RANK", "0") == "0") and slurm.node_rank() == 0


def torchrun_overrides(texts: list[str], run_dir: str | None = None, timeout_s: float = 300.0) -> list[str]:
    """Extra Hydra overrides that give every torchrun rank the same run dir (call before Hydra).

    Every rank composes on its own under torchrun, and ``${now:}`` would give each its own
    directory. Rank 0 publishes its ``hydra.run.dir`` (``run_dir``: the one its preflight composed and checked;
    composed here when None) in the torchrun agent's TCPStore (MASTER_ADDR:MASTER_PORT, reachable from every
    node); the other ranks wait for it. Ranks other than 0 also write no ``.hydra/`` copy and no log file there.
    """
    import torch.distributed as dist
    from datetime import timedelta

    rank = int(os.environ.get("RANK", "0"))
    quiet = [] if rank == 0 else ["hydra.output_subdir=null", "hydra/job_logging=none", "hydra/hydra_logging=none"]
    if overrides.sets(texts, "hydra.run.dir"):
        return quiet
    store = dist.TCPStore(os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ["MASTER_PORT"]),
                          is_master=False, timeout=timedelta(seconds=timeout_s))
    key = f"qwen3_research/run_dir/{os.environ.get('TORCHELASTIC_RUN_ID')}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    if rank == 0:
        if run_dir is None:
            run_dir = str(compose(texts, return_hydra_config=True).hydra.run.dir)
        run_dir = os.path.abspath(run_dir)
        store.set(key, run_dir)
    else:
        run_dir = store.get(key).decode()  # blocks until rank 0 has set it
    return [f"hydra.run.dir={json.dumps(run_dir)}"] + quiet


def _limit_threads(local_world_size: int) -> None:
    """N CPU workers on one host share its cores (torchrun sets OMP_NUM_THREADS=1 for the same reason)."""
    import torch

    if local_world_size > 1:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world_size))


def worker(run: ResolvedRun, info: dict) -> dict:
    """One rank's whole life: build the Trainer, train, tear down. Importable for spawn."""
    _wait_until_every_rank_is_forked()
    quiet_libraries()  # a spawned rank starts with Python's defaults
    _limit_threads(int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    trainer = Trainer(run, RunInfo(**info))
    try:
        return trainer.train()
    finally:
        trainer.close()


def _recorded_worker(run: ResolvedRun, info: dict) -> dict:
    from torch.distributed.elastic.multiprocessing.errors import record

    try:
        # SIGINT was held since the spawn (_sigint_held_for_workers); a Ctrl-C that came while this process
        # imported torch is delivered here, where it raises KeyboardInterrupt instead of a traceback.
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
        return record(worker)(run, info)
    except (KeyboardInterrupt, Terminated) as e:  # a signal before the training loop: exit quietly, 128 + signal
        # The agent passes the launcher's signal on as well: a second one must not interrupt the exit.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        sys.exit(128 + signal_number(e))


@contextmanager
def _sigint_held_for_workers():
    """Start the workers with SIGINT blocked, and put this process's signal handlers back afterwards.

    A Ctrl-C reaches every process of the foreground group; a worker that gets it while ``spawn`` is
    still unpickling (importing torch, seconds) would print a KeyboardInterrupt traceback per rank before
    any of our code runs. A blocked signal stays pending and the mask is inherited across fork and exec
    (CPython's resource tracker starts the same way), so the worker receives it once
    ``_recorded_worker`` unblocks it. This thread blocks SIGINT while it spawns; a helper thread that does
    not block it receives SIGINT for this process, and Python runs the handler (the elastic agent's, which
    stops the workers) in the main thread as usual. Elastic leaves its handlers installed when it returns:
    they are restored, so a Ctrl-C while the summary is written is a KeyboardInterrupt, not a traceback.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()  # now: starting it later would unblock SIGINT in this thread
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    done = threading.Event()
    threading.Thread(target=done.wait, name="sigint-receiver", daemon=True).start()
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        done.set()


# The gate of the launch in progress when the ranks are forked (None otherwise): a forked rank inherits it.
_FORK_GATE = None
FORK_GATE_TIMEOUT_S = 300.0


@contextmanager
def _ranks_start_after_the_last_fork(start_method: str, nproc: int):
    """Forked ranks touch the network only once the agent has forked all of them.

    The agent's TCPStore server thread (``pt_tcpstore_uv``) resolves the address of every connection it accepts
    (glibc's getnameinfo, under the resolver's process-wide lock). A rank forked while that thread held the lock
    (serving a sibling forked just before, which had already connected) inherited it locked, and hung for good
    in its first getaddrinfo (connecting to MASTER_ADDR, a host name), its siblings in gloo's rendezvous waiting
    for it: 1 in ~50 four-rank runs on 2 busy cores (tests/test_parallel.py::test_fsdp_tp_four_ranks_from_one_command,
    issue 33; a py-spy dump showed the rank in __resolv_context_get -> __lll_lock_wait_private). With every rank
    waiting at a barrier first, no rank connects while the agent forks, so the agent's server thread has nothing
    to resolve then. Spawned ranks start from a fresh process and need no gate."""
    global _FORK_GATE
    if start_method != "fork" or nproc < 2:
        yield
        return
    import multiprocessing

    _FORK_GATE = multiprocessing.get_context("fork").Barrier(nproc)
    try:
        yield
    finally:
        _FORK_GATE = None


def _wait_until_every_rank_is_forked() -> None:
    if _FORK_GATE is None:
        return
    from threading import BrokenBarrierError

    try:
        _FORK_GATE.wait(FORK_GATE_TIMEOUT_S)
    except BrokenBarrierError:
        raise RuntimeError(f"the other local ranks were not all started within {FORK_GATE_TIMEOUT_S:.0f} s") from None


@contextmanager
def _no_worker_left_behind(grace_s: float = 30.0):
    """No worker outlives the launch. A signal that reaches the agent while it is still inside ``start_processes``
    (the workers forked, the process context not yet stored) leaves the agent nothing to close: the workers ran on
    as orphans, waiting for a store that had gone (seen as a Ctrl-C at start-up that returned 130 while the
    workers held the terminal's pipes for minutes). Any worker still alive afterwards gets the signal the agent
    got (SIGTERM otherwise; a worker that holds SIGINT until its start-up ends receives it then), then SIGKILL
    after ``grace_s`` as torch's own ``MultiprocessContext.close`` does."""
    import multiprocessing

    from torch.distributed.elastic.multiprocessing.api import SignalException

    sig = signal.SIGTERM
    before = set(multiprocessing.active_children())  # not this launch's (a process forked from a parent has its list)
    try:
        yield
    except SignalException as e:
        sig = signal.Signals(int(e.sigval))
        raise
    finally:
        left = [p for p in multiprocessing.active_children() if p not in before]  # joins the finished ones
        for proc in left:
            with suppress(ProcessLookupError):
                os.kill(proc.pid, sig)
        deadline = time.monotonic() + grace_s
        for proc in left:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join()


# torch's own loggers of the worker group: on a rank failure they printed the failed rank's whole traceback
# (40-100 lines, each prefixed "E1206 … api.py:836]") before our one line, which names the cause.
_ELASTIC_LOGGERS = ("torch.distributed.elastic", "torch.multiprocessing")


@contextmanager
def _elastic_logs_off_console():
    """torch elastic's agent logs silenced while the group runs: every way it ends is reported by ``_elastic`` in
    one line (a failed rank, a signal, a rendezvous timeout); the failed rank's traceback goes to the run's log file."""
    loggers = [logging.getLogger(name) for name in _ELASTIC_LOGGERS]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL + 1)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def finite_json(summary: dict) -> dict:
    """NaN/inf are not JSON: such a value becomes null and its key is listed under ``non_finite``."""
    import math

    out, bad = {}, []
    for k, v in summary.items():
        if isinstance(v, float) and not math.isfinite(v):
            out[k] = None
            bad.append(f"{k}={v}")
        else:
            out[k] = v
    if bad:
        out["non_finite"] = bad
    return out


def _multirun() -> bool:
    try:
        from hydra.core.hydra_config import HydraConfig

        return HydraConfig.get().mode.name == "MULTIRUN"
    except Exception:  # noqa: BLE001 - not under Hydra (tests call run() directly)
        return False


def _write_summary(run_dir: Path, summary: dict) -> None:
    tmp = run_dir / "summary.json.tmp"
    tmp.write_text(json.dumps(finite_json(summary), indent=1, default=str, allow_nan=False))
    os.replace(tmp, run_dir / "summary.json")


def _start_method(device_kind: str) -> str:
    """How the worker processes start: ``fork`` on CPU, ``spawn`` on cuda and neuron.

    A forked worker starts from this process, which has already imported torch and this
    package: a 2-rank CPU run takes 18 s instead of 25 s and a third less CPU time, with the same losses.
    This process runs no tensor work before the launch (it validates and composes), so no thread pool is
    inherited half-used; multiprocessing flushes stdout/stderr before the fork. On cuda and neuron the
    device runtimes are not fork-safe once anything has touched them, so the workers start fresh
    (torchrun's default).

    The workers are spawned on CPU too when this process has built a Trainer before (a sweep that planned
    its points, or ran some of them in-process): autograd may have started its threads, and torch refuses
    autograd in a child forked after that.
    """
    if startup.trainer_built():
        return "spawn"
    return devices.get(device_kind).start_method  # cpu: fork; an accelerator's runtime: spawn


def _elastic(run: ResolvedRun, info: RunInfo) -> dict:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import RendezvousError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    rc = run.rc
    p = rc.parallelism
    backend, endpoint, rdzv_configs = rendezvous(p)
    config = LaunchConfig(
        min_nodes=p.nnodes,
        max_nodes=p.nnodes,
        nproc_per_node=run.nproc_per_node,
        run_id=slurm.job_id() or uuid.uuid4().hex[:12],
        rdzv_backend=backend,
        rdzv_endpoint=endpoint,
        rdzv_configs=rdzv_configs,
        max_restarts=0,
        monitor_interval=0.1,
        start_method=_start_method(run.device_type),
    )
    try:
        with _sigint_held_for_workers(), _no_worker_left_behind(), _elastic_logs_off_console(), \
                _ranks_start_after_the_last_fork(config.start_method, run.nproc_per_node):
            results = elastic_launch(config, _recorded_worker)(run, asdict(info))
    except ChildFailedError as e:
        rank, failure = root_failure(e.failures)
        message = failure.message if isinstance(failure.message, str) else json.dumps(failure.message)
        if isinstance(failure.message, dict):
            message = failure.message.get("message", message)
            stack = (failure.message.get("extraInfo") or {}).get("py_callstack")
            if stack:  # the run's log file (Hydra's <run dir>/<job>.log) keeps it; the console gets one line
                logging.getLogger(__name__).info("rank %s failed:\n%s", rank, stack)
        raise WorkerGroupError(f"rank {rank} failed (exit code {failure.exitcode}): {message}") from None
    except SignalException as e:
        # The agent got SIGTERM/SIGINT (Slurm preemption, requeue, scancel): it passed the signal on to
        # the workers, which finish the step and save together; report it like a single process does.
        raise _interrupted(int(e.sigval), rc, info) from None
    except (RendezvousError, RuntimeError, TimeoutError) as e:
        if p.nnodes == 1 or not _is_rendezvous_failure(e):
            raise
        first = (str(e).strip().splitlines() or [""])[0]
        first = type(e).__name__ if first in ("", type(e).__name__) else f"{type(e).__name__}: {first}"
        raise WorkerGroupError(
            f"the {p.nnodes} nodes did not meet at {endpoint} within parallelism.rdzv_timeout_s={p.rdzv_timeout_s} "
            f"({first}); start the same command on every node with parallelism.rdzv_endpoint="
            "<first node's address>:<port> reachable from all of them, or use hydra/launcher=slurm") from None
    return results.get(0) or next(iter(results.values()))


# A rank that lost its peer in a collective (gloo's TCP pair, NCCL, the store) fails as a consequence of another.
_PEER_LOSS = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "gloo/transport",
              "DistNetworkError", "NCCL communicator was aborted")


def root_failure(failures: dict) -> tuple[int, object]:
    """The failure that caused the others: torch's ``ChildFailedError.get_first_failure`` takes the earliest error
    file, but their timestamps are whole seconds, so a rank that raised and the peer that lost it in a collective
    often tie, and the lower rank (the peer) won. Among the failures within a second of the earliest, one that is not
    a lost peer is preferred, then the earliest, then the lowest rank. The agent reports only the first process its
    poll found dead; the error files the other ranks of this node wrote (torch's log layout: ``<attempt>/<local
    rank>/error.json``) are read too, so a raising rank that exited after its peer lost it is still found."""

    failures = {**failures, **_siblings_error_files(failures)}

    def peer_loss(f) -> bool:
        msg = f.message if isinstance(f.message, str) else json.dumps(f.message)
        return any(s in msg for s in _PEER_LOSS)

    first = min(f.timestamp for f in failures.values())
    near = [r for r, f in failures.items() if f.timestamp <= first + 1]
    rank = min(near, key=lambda r: (peer_loss(failures[r]), failures[r].timestamp, r))
    return rank, failures[rank]


def _siblings_error_files(failures: dict) -> dict:
    """Failures the agent did not report, from the error files beside a reported one's (global rank -> failure);
    a rank that wrote one raised under ``record``, which exits 1."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    out = {}
    for rank, f in failures.items():
        error_file = getattr(f, "error_file", None)
        if not error_file or error_file == os.devnull:
            continue
        for d in Path(error_file).parent.parent.iterdir():
            g = rank - f.local_rank + int(d.name) if d.name.isdigit() else None
            if g is None or g in failures or g in out or not (d / "error.json").is_file():
                continue
            with suppress(Exception):  # a file being written, or not torch's format: not evidence
                out[g] = ProcessFailure(int(d.name), pid=0, exitcode=1, error_file=str(d / "error.json"))
    return out


def _interrupted(signum: int, rc: RunConfig, info: RunInfo) -> Interrupted:
    """Interrupted with the step and checkpoint the worker group saved on the signal (the newest one)."""
    root = Path(os.path.expanduser(rc.checkpoint.dir))
    found = find_checkpoint("auto", root if root.is_absolute() else Path(info.run_dir) / root)
    step = int(found.name.rsplit("-", 1)[-1]) if found is not None else 0
    return Interrupted(signum, step, str(found) if found is not None else None)


def _is_rendezvous_failure(e: BaseException) -> bool:
    from torch.distributed.elastic.rendezvous import RendezvousError

    text = f"{type(e).__name__} {e}".lower()
    return isinstance(e, (RendezvousError, TimeoutError)) or any(
        w in text for w in ("rendezvous", "timed out", "timeout", "connect", "store"))




def run(cfg: DictConfig | None, run_dir: str, *, resolved: ResolvedRun | None = None, wandb_group: str | None = None,
        wandb_name: str | None = None, swept: dict | None = None, prediction: dict | None = None) -> dict:
    """Start the workers, write ``summary.json``; raise on failure (after recording it).

    ``resolved``: the run as the entry point resolved it (``resolve.resolve_run``, and ``resolve.at_run_dir`` when
    its ``run_dir`` is this one): nothing is resolved or checked again. Without it, ``cfg`` is resolved here."""
    t0 = time.perf_counter()
    run_path = Path(run_dir)
    run_path.mkdir(parents=True, exist_ok=True)
    lock, refused = None, False
    try:
        if resolved is None:  # every start-up check, once (the workers get the description)
            resolved = resolve_run(cfg, prepare=devices.prepare_launch)  # and the LNC into the environment workers inherit
        owner = _writes_run_files()  # one owner per run dir: this process (rank 0 / first node) holds the lock
        refused = owner  # until this process owns the run dir, a refusal writes nothing there
        if resolved.run_dir != os.path.abspath(run_path):  # not checked at this run dir yet
            try:
                resolved = at_run_dir(resolved, run_path, owner=owner)
            except AlreadyComplete as done:  # a sweep point that finished before: report it, write nothing
                print(str(done), flush=True)
                return read_summary(run_path) or {"status": "ok"}
        rc = resolved.rc
        if owner:
            lock = RunDirLock(run_path).acquire()
            refused = False
            if rc.checkpoint.overwrite and not rc.checkpoint.resume:
                discard_earlier_run(rc, run_path)
        if _writes_run_files() and resolved.compile is not None:
            print(resolved.compile.describe(), flush=True)  # decided once at resolution, with its reason
        compiling.export_cache_env(resolved.compile)  # before any worker starts: every rank and sweep point shares it
        info = RunInfo(run_dir=str(run_path), wandb_group=wandb_group or rc.logging.wandb.group,
                       wandb_name=wandb_name or rc.logging.wandb.name, swept=swept or {},
                       prediction=prediction or {})
        spec = devices.get(resolved.device_type)
        if spec.profiler_environment is not None:  # the runtime reads its profiler variables when it starts: before any worker
            os.environ.update(spec.profiler_environment(rc.profiling, run_path))
        if under_torchrun() or resolved.world_size == 1:
            summary = worker(resolved, asdict(info))
        else:
            summary = _elastic(resolved, info)
        summary = {**summary, "wall_s": time.perf_counter() - t0, **({"prediction": prediction} if prediction else {})}
        if _writes_run_files():
            _write_summary(run_path, summary)
        return summary
    except BaseException as e:
        clean = (ConfigError, WorkerGroupError, TrainingError, ExportError, Interrupted)
        signum = signal_number(e)
        reason = str(e) if isinstance(e, clean) else f"{type(e).__name__}: {e}"
        if signum and not isinstance(e, Interrupted):
            reason = (f"interrupted by {signal.Signals(signum).name} outside the training loop (start-up or the "
                      "final save)")
        # A config error on a resume, or in a run dir this process does not own, keeps the earlier summary.
        # A single run's config error writes no summary (README: exit 2 writes nothing); a sweep point records
        # it for the sweep report.
        keep_existing = isinstance(e, ConfigError) and ((run_path / "summary.json").exists() or refused or not _multirun())
        if _writes_run_files() and not keep_existing:
            _write_summary(run_path, {"status": "interrupted" if signum else "failed",
                                      "reason": reason.splitlines()[0] if reason else type(e).__name__,
                                      **({"step": e.step} if isinstance(e, Interrupted) else {}),
                                      "wall_s": time.perf_counter() - t0, **({"prediction": prediction} if prediction else {})})
        if not isinstance(e, clean) and not signum:
            traceback.print_exc(file=sys.stderr)
        raise
    finally:
        if lock is not None:
            lock.release()
