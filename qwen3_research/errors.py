"""Exception types shared across the package: the bottom of the import stack (standard library only).

Every module that raises or catches one of these imports it from here, so no module has to
import a higher one (trainer, launch, export) just to name an exception. Two helpers say why a write
fails (``write_failure``: a checkpoint or an export, the same way for both) or would fail
(``check_writable``: a run dir, a checkpoint dir, an export's out_dir, before any work).
"""

import errno
import os
import shutil


CALL_LOG_ENV = "QWEN3_RESEARCH_CALL_LOG"


def log_call(name: str) -> None:
    """Test hook: with ``QWEN3_RESEARCH_CALL_LOG=<file>`` set, append ``<pid> <role> <name>`` to that file (role:
    ``rank<N>`` in a worker, else ``main``), so a test counts how often one process composes, resolves and checks
    (tests/test_resolve.py: once each per process). Nothing is written without the variable."""
    path = os.environ.get(CALL_LOG_ENV)
    if not path:
        return
    role = f"rank{os.environ['RANK']}" if "RANK" in os.environ else "main"
    with open(path, "a") as f:  # one short line per write: appends from several processes stay whole lines
        f.write(f"{os.getpid()} {role} {name}\n")


class AlreadyComplete(Exception):
    """A resume of a run that has nothing left to train: say so, exit 0, write nothing (``run.rundir`` raises it)."""


class ConfigError(ValueError):
    """A configuration problem the user must fix; printed as one line, exit status 2."""


class TrainingError(RuntimeError):
    """The run cannot go on (non-finite loss under nan_policy=stop, …); the message says why. Exit 1."""


class ExportError(RuntimeError):
    """A Hugging Face export failed its checks; the last good export is left in place. Exit 1."""


class WorkerGroupError(RuntimeError):
    """A rank of a worker group failed; the message names the rank and its error. Exit 1."""


def root_cause(e: BaseException) -> BaseException:
    """The exception behind ``e``: the first rank's failure inside torch's CheckpointException (DCP wraps every
    rank's error, a KeyboardInterrupt too), then the innermost cause of an exception chain."""
    seen = set()
    while id(e) not in seen:
        seen.add(id(e))
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict) and failures:  # torch.distributed.checkpoint.api.CheckpointException
            first = next(iter(failures.values()))
            e = first[0] if isinstance(first, tuple) else first
        elif e.__cause__ is not None:
            e = e.__cause__
        elif isinstance(e, OSError) or e.__context__ is None:
            return e
        else:
            e = e.__context__
    return e


# Low-space threshold: torch's zip writer reports a full disk as an opaque position mismatch, not ENOSPC.
LOW_SPACE = 64 * 2**20


def write_failure(e: BaseException, where, what: str) -> tuple[str, str]:
    """(why, fix) for a failed write of ``what`` (e.g. "checkpoint.dir", "out_dir") under ``where``: out of
    space, the file-size limit (``ulimit -f``: the kernel sends SIGXFSZ, which Python ignores, so the write
    fails with EFBIG), a read-only file system or no permission; else the error's first line."""
    cause = root_cause(e)
    code = getattr(cause, "errno", None)
    try:
        free = shutil.disk_usage(where).free
    except OSError:
        free = None
    if code in (errno.ENOSPC, errno.EDQUOT) or (code is None and free is not None and free < LOW_SPACE):
        room = f": {free / 2**20:.1f} MiB free" if free is not None else ""
        return f"No space left on device{room}", f"free space or point {what} elsewhere"
    if code == errno.EFBIG:
        import resource

        limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        shown = "unlimited" if limit == resource.RLIM_INFINITY else f"{limit} bytes, ulimit -f {limit // 1024}"
        return (f"a file would exceed this process's file-size limit ({shown})",
                f"raise the limit (ulimit -f unlimited) or point {what} at a file system without one")
    if code == errno.EROFS:
        return f"read-only file system ({os.fspath(where)})", f"point {what} at a writable file system"
    if code in (errno.EACCES, errno.EPERM):
        return f"permission denied ({getattr(cause, 'filename', None) or os.fspath(where)})", \
            f"make it writable or point {what} elsewhere"
    lines = [ln.strip() for ln in str(cause).splitlines() if ln.strip()]
    why = f"{type(cause).__name__}: {lines[0] if lines else ''}"[:300]
    if isinstance(cause, OSError):
        return why, f"check {os.fspath(where)} or point {what} elsewhere"
    return why, "this is not a storage problem (a bug: please report it with this line)"


def check_writable(what: str, path) -> None:
    """ConfigError unless ``path`` (or, while it does not exist, the directory it would be created in) takes new
    files; ``what`` names the key or argument (``hydra.run.dir=…``, ``out_dir …``)."""
    from pathlib import Path

    probe = Path(path)
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if probe.is_dir() and os.access(probe, os.W_OK | os.X_OK):
        return
    try:
        read_only = bool(os.statvfs(probe).f_flag & os.ST_RDONLY)
    except OSError:
        read_only = False
    why = "is on a read-only file system" if read_only else "is not a writable directory for this user"
    raise ConfigError(f"{what}: {probe} {why}; choose another on a writable file system")
