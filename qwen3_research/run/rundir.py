"""A run directory has one owner and one history.

- ``check_run_dir``: before anything is written, once per run (``resolve.at_run_dir``: in ``__main__`` before
  Hydra creates the directory, or in ``launch.elastic.run`` when the run was not checked there), refuse a directory that is a file, is locked by a live process, already
  holds a run that the command does not resume (``checkpoint.resume``) or discard
  (``checkpoint.overwrite=true``), or would be resumed under another data layout; a finished run asked
  to resume is ``AlreadyComplete`` (exit 0, nothing written); with ``checkpoint.export_hf`` a run is finished
  once its export is (a run stopped during it exports on resume).
- ``RunDirLock``: one process writes a run directory at a time (a ``filelock.FileLock`` on ``.qwen3_research.lock``:
  an ``flock``, released by the kernel when its holder dies, so a stale lock of a dead pid is detected and taken over).
  Only the process that writes the run files takes it: the launcher, rank 0 under torchrun, the first
  Slurm node.
- the W&B run id lives in ``wandb_run.json`` so a resumed run continues the same W&B run.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import sys
import time
import uuid
from pathlib import Path

import filelock

from qwen3_research import models, slurm
from qwen3_research.data import _sha256, data_layout, tokenizer_path
from qwen3_research.errors import AlreadyComplete, ConfigError, log_call  # noqa: F401  (AlreadyComplete re-exported)
from qwen3_research.run import checkpoint
from qwen3_research.run.checkpoint import (find_checkpoint, list_checkpoints, owner_conflict, preflight, read_meta,
                                           refuse_layout_change)

LOCK_NAME = ".qwen3_research.lock"
WANDB_STATE_FILE = "wandb_run.json"
SUMMARY = "summary.json"


_SAID: set[str] = set()


def run_files(run_dir: Path) -> list[str]:
    """What an earlier run left in ``run_dir`` (Hydra's own ``.hydra/`` and log, and the lock, do not count)."""
    if not run_dir.is_dir():
        return []
    return sorted(p.name for p in run_dir.iterdir()
                  if p.name not in (".hydra", LOCK_NAME) and not (p.name.endswith(".log") and p.is_file()))


def checkpoint_root(rc, run_dir: Path) -> Path:
    return checkpoint.checkpoint_root(rc.checkpoint, run_dir)


def read_summary(run_dir: Path) -> dict | None:
    try:
        return json.loads((run_dir / SUMMARY).read_text())
    except (OSError, ValueError):
        return None


# -- the checks -------------------------------------------------------------------------------


def _refuse_long_names(run_dir: Path) -> None:
    """A component longer than its file system takes (NAME_MAX, 255 bytes on ext4/xfs): one line, where ``stat``
    raised "File name too long" with a 28-line traceback (issue 40 weak case)."""
    probe, limit = run_dir, 255
    while probe != probe.parent:
        try:
            if probe.exists():
                limit = os.pathconf(probe, "PC_NAME_MAX")
                break
        except (OSError, ValueError):  # ENAMETOOLONG on the long component itself
            pass
        probe = probe.parent
    for part in run_dir.parts:
        if len(os.fsencode(part)) > limit:
            raise ConfigError(f"hydra.run.dir: the component {part[:40]}... is {len(os.fsencode(part))} bytes, more "
                              f"than the file system takes in one name ({limit}); choose a shorter hydra.run.dir")


def check_run_dir(rc, run_dir: Path, *, dp: int | None = None, batch_size: int | None = None) -> Path | None:
    """Raise ConfigError (exit 2) or AlreadyComplete (exit 0); writes nothing. Returns the checkpoint a resume
    continues from (None: a fresh start). ``checkpoint.preflight`` (the resume target's model, the ``init_from``
    config) runs here, once: the caller does not run it again (``resolve.at_run_dir``)."""
    log_call("check_run_dir")
    run_dir = Path(run_dir)
    _refuse_long_names(run_dir)
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"hydra.run.dir={run_dir}: is a file, not a directory; choose another hydra.run.dir")
    holder = lock_holder(run_dir)
    if holder is not None:
        raise ConfigError(
            f"hydra.run.dir={run_dir} is in use by pid {holder.get('pid', '?')} on {holder.get('host', '?')} "
            f"({LOCK_NAME}); wait for that run to end, or choose another hydra.run.dir"
        )
    ck = rc.checkpoint
    root = checkpoint_root(rc, run_dir)
    why = owner_conflict(root, run_dir, resuming=bool(ck.resume))
    if why is not None:
        raise ConfigError(why)
    if not ck.resume:
        existing = run_files(run_dir)
        if not root.is_relative_to(run_dir):
            existing += [str(p) for p in list_checkpoints(root)][-1:]
        if existing and not ck.overwrite:
            raise ConfigError(
                f"hydra.run.dir={run_dir} already holds a run ({', '.join(existing[:4])}); continue it with "
                "checkpoint.resume=auto, choose another hydra.run.dir, or discard it with checkpoint.overwrite=true"
            )
        if rc.model.init_from:
            preflight(rc, run_dir)
        return None
    found = find_checkpoint(ck.resume, root, warn=True)
    if found is not None or rc.model.init_from:  # another model first: that is the error, whatever the step
        preflight(rc, run_dir)
    summary = read_summary(run_dir)
    steps = rc.training.steps
    if found is None:
        if summary and summary.get("status") == "ok":
            raise ConfigError(
                f"checkpoint.resume={ck.resume}: {run_dir} holds a finished run ({summary.get('steps')} steps) but no "
                f"checkpoint under {root} to continue from; choose another hydra.run.dir"
            )
        return None
    meta = read_meta(found)
    step = int(meta.get("step", 0))
    if step > steps:
        raise ConfigError(
            f"training.steps={steps} is below step {step} of the checkpoint {found}; set training.steps={step} "
            "(nothing to do) or more to continue"
        )
    if step == steps:
        # A run with checkpoint.export_hf is complete once its export is: the summary (status ok, this step) is
        # written after it. Stopped during the export (a SIGTERM, a kill), the resume redoes the export from the
        # last checkpoint instead of calling the run complete without one.
        if not rc.checkpoint.export_hf or (summary or {}).get("status") == "ok" and summary.get("steps") == step:
            raise AlreadyComplete(f"already complete: {found} is at training.steps={steps}; nothing to do "
                                  "(raise training.steps to train further)")
        line = (f"resume: {found} is at training.steps={steps}, but the run's HF export (checkpoint.export_hf) did "
                f"not finish; exporting it now to {run_dir / 'hf'}")
        if line not in _SAID:  # checked before Hydra and again in launch.elastic.run: said once
            _SAID.add(line)
            print(line, flush=True)
    if dp is not None and batch_size is not None:
        sha = _sha256(tokenizer_path(models.tokenizer_spec(rc)))
        refuse_layout_change(meta.get("data_layout"), data_layout(rc, dp, batch_size, sha), found,
                             rc.checkpoint.allow_data_change)


def discard_earlier_run(rc, run_dir: Path) -> None:
    """checkpoint.overwrite=true on a directory that holds a run: remove that run's files (under the lock)."""
    root = checkpoint_root(rc, run_dir)
    why = owner_conflict(root, run_dir, resuming=False)  # checked before; again here, where files are deleted
    if why is not None:
        raise ConfigError(why)
    gone = run_files(run_dir)
    for name in gone:
        p = run_dir / name
        shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
    for p in list_checkpoints(root):
        shutil.rmtree(p)
        gone.append(str(p))
    if gone:
        print(f"checkpoint.overwrite=true: removed the earlier run's {', '.join(gone[:6])} from {run_dir}",
              file=sys.stderr, flush=True)


# -- the lock ---------------------------------------------------------------------------------


def _lock_info() -> dict:
    return {"pid": os.getpid(), "host": socket.gethostname(), "slurm_job_id": slurm.job_id()}


def _pid_alive(pid) -> bool:
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, ValueError, TypeError):
        return True
    return True


_PROBE_TRIES, _PROBE_WAIT_S = 3, 0.02  # a probe's contention counts once it outlasts 3 tries 20 ms apart


def lock_holder(run_dir: Path) -> dict | None:
    """The holder's {pid, host} while a live process holds the lock, else None (no lock, or a stale one).

    filelock has no shared lock: the probe takes the lock itself, non-blocking, on a descriptor of its own
    (``filelock.lock_descriptor``, the primitive ``FileLock`` uses) and lets it go at once. Two probes at the same
    moment would see each other (a probe holds it for microseconds), so contention counts as a holder only when it
    lasts over ``_PROBE_TRIES`` tries; an owner holds it for its whole run. The probe creates no file."""
    path = Path(run_dir) / LOCK_NAME
    for attempt in range(_PROBE_TRIES):
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            return None
        try:
            if filelock.lock_descriptor(fd, blocking=False):
                filelock.unlock_descriptor(fd)
                return None
        finally:
            os.close(fd)
        if attempt + 1 < _PROBE_TRIES:
            time.sleep(_PROBE_WAIT_S)
    try:
        return json.loads(path.read_text() or "{}")
    except (OSError, ValueError):
        return {}


class RunDirLock:
    """Exclusive ownership of a run directory for this process's lifetime (or until ``release``): a ``FileLock``
    taken without waiting (another owner: a ConfigError naming it), the holder's {pid, host} written into the lock
    file once held (``on_acquired``), the file removed on release so a finished run leaves no lock behind."""

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / LOCK_NAME
        self._held: tuple[int, int] | None = None  # (st_dev, st_ino) of the file this process holds
        # thread_local=False: the process owns the directory, whichever thread releases it
        self._lock = filelock.FileLock(self.path, blocking=False, thread_local=False, on_acquired=self._claim)

    def _claim(self, fd: int) -> None:
        """Inside the acquisition, on the locked descriptor: note a stale holder's record, write ours."""
        old = os.pread(fd, 4096, 0)
        if old.strip():
            try:
                prev = json.loads(old)
                print(f"note: took over a stale lock of pid {prev.get('pid')} on {prev.get('host')} "
                      f"(not running) in {self.path.parent}", file=sys.stderr, flush=True)
            except ValueError:
                pass
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(_lock_info()).encode(), 0)
        st = os.fstat(fd)
        self._held = (st.st_dev, st.st_ino)

    def acquire(self) -> "RunDirLock":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(_PROBE_TRIES):
            try:
                self._lock.acquire()
                return self
            except filelock.Timeout:
                holder = lock_holder(self.path.parent)
                if holder is None:  # the holder released (and removed) it between filelock's open and lock: again
                    continue
                raise ConfigError(
                    f"hydra.run.dir={self.path.parent} is in use by pid {holder.get('pid', '?')} on "
                    f"{holder.get('host', '?')} ({LOCK_NAME}); wait for that run to end, or choose another hydra.run.dir"
                ) from None
        raise ConfigError(f"hydra.run.dir={self.path.parent}: its lock ({LOCK_NAME}) changed hands {_PROBE_TRIES} "
                          "times while this run tried to take it; run again, or choose another hydra.run.dir")

    def release(self) -> None:
        if self._held is None:
            return
        try:  # removed while still held, and only the file this process holds (not a later owner's)
            st = os.stat(self.path)
            if (st.st_dev, st.st_ino) == self._held:
                self.path.unlink()
        except OSError:
            pass
        self._held = None
        self._lock.release()

    def __enter__(self):
        return self.acquire()

    def __exit__(self, *exc):
        self.release()


# -- the W&B run -----------------------------------------------------------------------------


def wandb_state(run_dir: Path) -> dict:
    """This run directory's W&B run: {"id": made once, reused by every resume; "logged_through": the last
    step a W&B segment delivered (its run.finish() returned)}."""
    path = Path(run_dir) / WANDB_STATE_FILE
    try:
        state = json.loads(path.read_text())
        if state.get("id"):
            return state
    except (OSError, ValueError):
        pass
    state = {"id": uuid.uuid4().hex[:16], "logged_through": 0}
    write_wandb_state(run_dir, state)
    return state


def write_wandb_state(run_dir: Path, state: dict) -> None:
    path = Path(run_dir) / WANDB_STATE_FILE
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(state) + "\n")
    os.replace(tmp, path)
