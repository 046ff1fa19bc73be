"""The host memory allocator of a CPU run: every process of the command allocates without churn.

Why: PyTorch's CPU allocator asks ``posix_memalign`` for every tensor and frees it when the tensor dies, with no
cache of its own (pytorch c10/core/impl/alloc_cpu.cpp). glibc serves blocks above its mmap threshold (dynamic, at
most 32 MiB on 64-bit: ``man 3 mallopt``, M_MMAP_THRESHOLD) with ``mmap`` and gives them back with ``munmap``, so
the 152 k-vocabulary logits and their gradients (hundreds of MB) were mapped, zeroed by the kernel page by page,
and unmapped on every step: almost half of the default run's CPU time was system time (issue 24). PyTorch's
tuning guide recommends another allocator for this reason ("Switch Memory allocator",
https://pytorch.org/tutorials/recipes/recipes/tuning_guide.html).

What this module does, chosen with ``QWEN3_CPU_ALLOCATOR`` (the off switch, read before anything is imported):

- ``auto`` (default): on a CPU run, mimalloc (Microsoft's allocator, MIT, from the pinned PyPI wheel
  ``cmeel-mimalloc``: ``<site-packages>/cmeel.prefix/lib/libmimalloc.so.3``) preloaded into the command's process:
  ``ensure`` re-executes the command once, before torch is imported, with the library in ``LD_PRELOAD`` (same
  PID, same argv). A library preloaded after glibc has served allocations would be unsafe, hence the re-exec
  and never a ``dlopen`` at run time. Without the wheel (or when the re-exec did not load it): ``mallopt``.
  On cuda/neuron runs (``device=`` on the command line, or a host with a Neuron or NVIDIA driver:
  ``devices.device_kind(argv=...)``) nothing changes.
- ``mimalloc``: the preload on every device; ``mallopt``: glibc with its thresholds raised (below); ``system``:
  glibc as it comes (the off switch).

Every worker gets the same allocator: a forked one is a copy of this process (mimalloc, or glibc's malloc state
after ``mallopt``); a spawned one (cuda/neuron, or CPU after a Trainer was built here) is a fresh interpreter that
inherits the environment, so ``LD_PRELOAD`` (mimalloc) or the ``MALLOC_*_`` variables (glibc's tunables, read once
at process start) are exported for it: ``mallopt`` in a parent does not reach an exec'd child (measured: NOTES of
issue 24). ``status()`` is what a process observes of its own allocator; every rank records it in summary.json
(``device_facts[*].cpu_allocator``).

Standard library only, and the torch-free ``devices`` package (which kind a command runs on, and whether that kind
wants the CPU allocator: ``DeviceSpec.runs_on_host``): ``ensure`` runs before numpy or torch is imported.
"""

from __future__ import annotations

import ctypes
import os
import sys

from qwen3_research import devices

ENV = "QWEN3_CPU_ALLOCATOR"
CHOICES = ("auto", "mimalloc", "mallopt", "system")
REEXEC_MARK = "QWEN3_CPU_ALLOCATOR_REEXEC"  # set on the re-exec'd process: a second re-exec never happens
LIBRARY = os.path.join("cmeel.prefix", "lib", "libmimalloc.so.3")  # where the cmeel-mimalloc wheel puts it

# glibc's malloc.h: M_TRIM_THRESHOLD -1, M_TOP_PAD -2, M_MMAP_THRESHOLD -3. mallopt takes an int, so 2**31 - 1 is
# the largest threshold; setting any of them also turns glibc's dynamic threshold off (man 3 mallopt).
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
MALLOPT = {_M_MMAP_THRESHOLD: 2**31 - 1, _M_TRIM_THRESHOLD: 2**31 - 1, _M_TOP_PAD: 64 << 20}
# The same settings as glibc tunables for exec'd children (the trailing underscore is part of the name:
# https://sourceware.org/glibc/manual/latest/html_node/Memory-Allocation-Tunables.html).
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(2**31 - 1), "MALLOC_TRIM_THRESHOLD_": str(2**31 - 1),
              "MALLOC_TOP_PAD_": str(64 << 20)}


def refusal() -> str | None:
    """Why ``QWEN3_CPU_ALLOCATOR`` is not a value a run accepts (one line), or None. The run's command, the doctor and
    the planner all check it: a value the planner accepted was refused by the run it planned."""
    value = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if value in CHOICES:
        return None
    return (f"{ENV}={os.environ[ENV]!r} is not one of {', '.join(CHOICES)} (auto: mimalloc on CPU runs; system: "
            "glibc as it comes)")


def choice() -> str:
    """``QWEN3_CPU_ALLOCATOR`` (default auto); a value outside CHOICES is a config error, one line, exit 2."""
    why = refusal()
    if why is not None:
        print(f"config error: {why}", file=sys.stderr, flush=True)
        sys.exit(2)
    return os.environ.get(ENV, "auto").strip().lower() or "auto"


def mimalloc_library() -> str | None:
    """The cmeel-mimalloc wheel's library in an import path (site-packages), or None when it is not installed."""
    for entry in sys.path:
        path = os.path.join(entry or ".", LIBRARY)
        if os.path.isfile(path):
            return os.path.abspath(path)
    return None


def _mapped(name: str) -> str | None:
    """The path of a shared library mapped into this process whose file name contains ``name``."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.rstrip("\n").split(maxsplit=5)[-1]
                if name in os.path.basename(path):
                    return path
    except OSError:
        pass
    return None


def mimalloc_loaded() -> bool:
    return _mapped("libmimalloc") is not None


def _wants_cpu_allocator(kind: str) -> bool:
    """Whether a command on ``kind`` gets mimalloc under auto (its spec says so; an unknown kind: no)."""
    spec = devices.find(kind)
    return spec is not None and spec.runs_on_host  # the kind computes on the host's CPU


def _reexec_argv(module: str) -> list[str]:
    """This command again: ``sys.orig_argv`` when it ran as ``python ... -m module``, else (a process forked from a
    warm interpreter, whose orig_argv is its parent's) the interpreter's flags, ``-m module`` and ``sys.argv[1:]``."""
    orig = list(getattr(sys, "orig_argv", []))
    for i, a in enumerate(orig[:-1]):
        if a == "-m" and orig[i + 1] == module:
            return [sys.executable, *orig[1:i], "-m", module, *sys.argv[1:]]
    import subprocess

    return [sys.executable, *subprocess._args_from_interpreter_flags(), "-m", module, *sys.argv[1:]]


def _without_mimalloc(preload: str) -> str:
    return " ".join(p for p in preload.replace(":", " ").split() if "libmimalloc" not in os.path.basename(p))


def ensure(module: str, argv: list[str] | None = None) -> None:
    """At the very top of an entry point (before numpy/torch): make this process and its future workers use the
    chosen allocator. May replace this process with the same command (``os.execve``: same PID, ``-m module`` and
    the same arguments); returns otherwise."""
    argv = sys.argv[1:] if argv is None else argv
    _ensure(choice(), argv, lambda: _reexec_argv(module))


def ensure_script(argv: list[str] | None = None) -> None:
    """``ensure`` for a script run as ``python path/to/script.py`` (the benchmarks)."""
    argv = sys.argv[1:] if argv is None else argv
    _ensure(choice(), argv, lambda: [sys.executable, *getattr(sys, "orig_argv", [sys.executable, *sys.argv])[1:]])


def _ensure(want: str, argv: list[str], command) -> None:
    loaded = mimalloc_loaded()
    if want in ("system", "mallopt"):
        if loaded and not os.environ.get(REEXEC_MARK):  # e.g. forked from a process that had it: start without it
            env = {**os.environ, REEXEC_MARK: "1", "LD_PRELOAD": _without_mimalloc(os.environ.get("LD_PRELOAD", ""))}
            if not env["LD_PRELOAD"]:
                del env["LD_PRELOAD"]
            _exec(command(), env)
        os.environ.pop(REEXEC_MARK, None)
        if want == "mallopt":
            _raise_glibc_thresholds()
        return
    if loaded:  # preloaded already (re-exec'd, or inherited): spawned workers must get it too
        lib = _mapped("libmimalloc")
        preload = os.environ.get("LD_PRELOAD", "")
        if lib and lib not in preload.replace(":", " ").split():
            os.environ["LD_PRELOAD"] = f"{lib} {preload}".strip() if preload else lib
        os.environ.pop(REEXEC_MARK, None)
        return
    if want == "auto" and not _wants_cpu_allocator(devices.device_kind(argv=argv)):
        return
    lib = mimalloc_library()
    if lib is None or os.environ.get(REEXEC_MARK):  # no wheel, or the preload did not take: glibc, tuned
        if want == "mimalloc":
            why = "the preload did not load it" if lib else "cmeel-mimalloc is not installed (requirements.lock)"
            print(f"warning: {ENV}=mimalloc but {why}; glibc with raised thresholds instead", file=sys.stderr,
                  flush=True)
        os.environ.pop(REEXEC_MARK, None)
        _raise_glibc_thresholds()
        return
    preload = os.environ.get("LD_PRELOAD", "")
    _exec(command(), {**os.environ, REEXEC_MARK: "1", "LD_PRELOAD": f"{lib} {preload}".strip()})


def _exec(args: list[str], env: dict) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, args, env)


def _libc():
    return ctypes.CDLL("libc.so.6", use_errno=True)


def _raise_glibc_thresholds() -> bool:
    """glibc keeps large freed blocks in its heap instead of unmapping them: mallopt here (this process and the
    workers it forks) and the same settings in the environment (workers it spawns). False where glibc refused."""
    try:
        libc = _libc()
        ok = all(libc.mallopt(param, value) == 1 for param, value in MALLOPT.items())
    except (OSError, AttributeError):  # not glibc
        return False
    if ok:
        os.environ.update(MALLOC_ENV)
    return ok


class _MallInfo2(ctypes.Structure):  # glibc >= 2.33, malloc.h
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def _glibc_maps_large_blocks() -> bool | None:
    """Whether glibc serves a 64 MiB request with mmap (its default) in this process: asked of glibc itself
    (``mallinfo2().hblks``, the number of mmapped chunks, around one malloc). None where it cannot be asked."""
    try:
        libc = _libc()
        info = libc.mallinfo2
    except (OSError, AttributeError):
        return None
    info.restype = _MallInfo2
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    before = info().hblks
    p = libc.malloc(64 << 20)
    after = info().hblks
    libc.free(p)
    return after > before


def status() -> str:
    """What this process's allocator is, observed from inside it (summary.json ``device_facts[*].cpu_allocator``)."""
    if mimalloc_loaded():
        version = ""
        try:
            mi_version = ctypes.CDLL(None).mi_version
            v = int(mi_version())
            version = f" {v // 10000}.{v // 100 % 100}.{v % 100}"
        except (OSError, AttributeError):
            pass
        return f"mimalloc{version} (LD_PRELOAD)"
    maps = _glibc_maps_large_blocks()
    if maps is None:
        return "unknown (not glibc)"
    return "glibc default (large blocks mmapped)" if maps else "glibc, thresholds raised (large blocks from the heap)"


def started_by_spawn() -> bool:
    """Whether this process is a fresh interpreter started by multiprocessing's spawn (a worker spawned by the
    launcher), which inherited only the environment; else it is the command's process or forked from it."""
    try:
        with open("/proc/self/cmdline", "rb") as f:
            return b"spawn_main" in f.read()
    except OSError:
        return False
