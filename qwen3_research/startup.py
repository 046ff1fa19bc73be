"""What a command's process sets up for itself: Ctrl-C while it imports, what libraries may print, and
whether it has built a Trainer (which decides how it may start worker processes).

Every entry point (``python -m qwen3_research``, ``.export``) and every worker rank calls these; the
rest of the package never touches signal dispositions for start-up, ``warnings`` or the root logger.
Standard library only: it runs before anything heavy is imported.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import warnings

from qwen3_research.signals import Terminated, raise_terminated

# Messages libraries print on every run that tell the user nothing they can act on (message regex).
NOISE = (
    # torch.distributed.checkpoint, on every save/load in one process (no process group): that is our intent.
    r"torch\.distributed is disabled, unavailable or uninitialized, assuming the intent is to",
    # torchtitan's MoE router asks autocast for a float32 gate (torchtitan/models/common/moe.py, TokenChoiceTopKRouter:
    # "Compute gate in float32"); CPU autocast takes only 16-bit dtypes, warns and leaves the gate in its input's
    # dtype, which an fp32 run computes in anyway. It printed on every MoE run on CPU (issue 40 weak case).
    r"In CPU autocast, but the target dtype is not supported",
)


# Library loggers whose warnings are known noise, each rank's (their records stay in no file either: ERROR and up only).
QUIET_LOGGERS = (
    # "While redistributing from (_NormPartial(2.0), _NormPartial(2.0)) to (Replicate(), Replicate()), 2 sequential
    # all_reduce operations will be performed. This is suboptimal ...": 538 characters from every rank of every
    # tensor-parallel run (issue 40 weak case). It is the gradient norm's scalar, reduced over the dp and tp mesh
    # dimensions one after the other: two all-reduces of one number.
    "torch.distributed.tensor._redistribute",
    # "No CUDA runtime is found, using CUDA_HOME='/usr/local'": Inductor's C++ build on a CPU host (torch's CUDA
    # wheel) asks for CUDA at every compiled run's first step (issue 40 weak case); build errors are ERROR records.
    "torch.utils.cpp_extension",
)


def exit_at_once_while_importing(after: str, *, numpy_first: bool = True) -> None:
    """Until the command installs its own handlers, Ctrl-C or SIGTERM ends the process at once: exit 128+signal
    and one line, ``interrupted by SIGINT <after>``.

    Nothing has been written yet at this point, so there is nothing to clean up; a KeyboardInterrupt
    instead could land inside a library's import and be swallowed there. ``numpy_first``: numpy is imported
    here, under this handler (``import_numpy_before_torch``), for a command whose next imports load torch; the
    run's command (``__main__``) passes False and imports it once its config is valid, so that a config error
    never loads numpy (~50 ms of its ~0.45 s).
    """
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, _exit_at_once(after))
    if numpy_first:
        import_numpy_before_torch()


def _exit_at_once(after: str):
    def _exit(signum, frame):
        sep = "" if after.startswith(";") else " "  # run_tool's "; <what stopped>", as its own line reads
        print(f"interrupted by {signal.Signals(signum).name}{sep}{after}", file=sys.stderr, flush=True)
        os._exit(128 + signum)

    return _exit


def import_numpy_before_torch(after: str | None = None) -> None:
    """Import numpy from Python before anything imports torch. torch's C start-up imports numpy and clears any
    error raised inside that import, a KeyboardInterrupt included (torch/csrc/utils/tensor_numpy.cpp,
    ``is_numpy_available``: ``PyErr_Clear`` after ``_import_array`` fails): the Ctrl-C was lost and numpy left
    half-imported, so the run either went on as if nothing happened or failed later with "module 'numpy' has no
    attribute 'matrix'" and a traceback. Imported first, numpy is complete before torch asks for it.

    ``after``: while it imports, Ctrl-C or SIGTERM ends the process at once with that line (as
    ``exit_at_once_while_importing``), and the handlers in place before are put back afterwards."""
    if "numpy" in sys.modules:
        return
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)} if after is not None else {}
    try:
        for s in before:
            signal.signal(s, _exit_at_once(after))
        import numpy  # noqa: F401  (see above)
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)


def run_tool(main, stopped: str) -> int:
    """A command other than the run (``plan``, ``doctor``, ``verify_kernels``, ``compare``): Ctrl-C or SIGTERM at
    any moment ends it as the run does, with one line ``interrupted by SIGINT; <stopped>`` and exit 128+signal,
    never a traceback (it was 22-53 lines). While it imports, the process exits at once
    (``exit_at_once_while_importing``); inside ``main`` the signal unwinds it, so its ``finally`` blocks (temporary
    directories) run."""
    exit_at_once_while_importing(f"; {stopped}")
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, raise_terminated)
    try:
        return main()
    except (KeyboardInterrupt, Terminated) as e:
        signum = signal.SIGTERM if isinstance(e, Terminated) else signal.SIGINT
        for s in (signal.SIGINT, signal.SIGTERM):  # a second Ctrl-C while this line is printed
            signal.signal(s, signal.SIG_IGN)
        print(f"interrupted by {signal.Signals(signum).name}; {stopped}", file=sys.stderr, flush=True)
        return 128 + signum


def _one_line_warning(message, category, filename, lineno, line=None) -> str:
    first = str(message).strip().splitlines()[0] if str(message).strip() else category.__name__
    return f"warning: {first}\n"


class _LibraryInfoOffConsole(logging.Filter):
    """Below WARNING, only Hydra's own lines (a sweep's "Launching …", "#1 : …") reach the console."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or record.name == "hydra" or record.name.startswith("hydra.")


def quiet_libraries() -> None:
    """Warnings print as one ``warning: …`` line (not two, with a source line), known noise not at all;
    library loggers' INFO records stay off the console: torchtitan logs to the root logger, which Hydra's
    job logging sends to the console ("[root][INFO] - Total parameter count …" on every run). A file
    handler (Hydra's ``<run dir>/<job>.log``) still receives them. Call after Hydra configured logging."""
    warnings.formatwarning = _one_line_warning
    for pattern in NOISE:
        warnings.filterwarnings("ignore", message=pattern)
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler):
            if not any(isinstance(f, _LibraryInfoOffConsole) for f in handler.filters):
                handler.addFilter(_LibraryInfoOffConsole())


# Set once a Trainer is built in this process (a single-process run, a sweep point run in-process, a plan's
# fake-tensor trace): autograd may have started its threads here, and then a forked child cannot use autograd
# (torch refuses: https://github.com/pytorch/pytorch/wiki/Autograd-and-Fork). The launcher spawns worker groups
# from such a process instead of forking them.
_trainer_built = False


def note_trainer_built() -> None:
    global _trainer_built
    _trainer_built = True


def trainer_built() -> bool:
    """Whether this process has built a Trainer (then its children are spawned, not forked)."""
    return _trainer_built
