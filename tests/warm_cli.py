"""A warm start for the CLI runs of the test suite: a server that has imported the heavy libraries forks one
child per `python -m <module> ...` invocation.

Why: a cold `python -m qwen3_research` spends ~6–7 s of a 3-step CPU run importing torch, torchtitan,
transformers, datasets, hydra and W&B (measured with cProfile: 6.8 s of 10.3 s), and the suite starts about
three hundred of them. Each test still gets its own process with the real entry point, argv, working directory,
environment, stdout/stderr and exit status; only the third-party imports were already done before the fork,
exactly as they are when the launcher forks its CPU workers (launch.elastic._start_method). Nothing of this package
(qwen3_research) nor of torchtitan is imported before the fork, so their module state is fresh in every child.

What is not warm (run_cli falls back to a plain subprocess):
- QWEN3_TESTS_COLD_CLI=1 in the environment: every run is cold (use it to rule the server out);
- an environment that differs from the server's in a variable that may be read at import time (anything but
  QWEN3_*, WANDB_*, NEURON_*, SLURM_*: e.g. OMP_NUM_THREADS, TRITON_INTERPRET, PYTHONPATH);
- tests that start their process with subprocess.Popen themselves (signal delivery, Ctrl-C during imports).

Protocol (one Unix socket per pytest process): the client sends one JSON line {module, args, cwd, env, stdout,
stderr}; the server forks, answers the child's pid, and when the child exits its wait status. stdout and stderr
go to files the client names and reads afterwards.

No process outlives its test: each run leads its own process group, which the server SIGKILLs when the client
hangs up before the run ended (run_cli's timeout, or pytest killed), and all of them when it stops (SIGTERM,
SIGINT, or its parent gone: PR_SET_PDEATHSIG, and getppid() polled). A timed-out multi-rank run used to leave its
forked ranks (stuck, so deaf to SIGTERM) and multiprocessing's resource tracker (which ignores SIGTERM) for good.

Fork safety: when the server forks, its only other thread is the jemalloc background thread that pyarrow starts at
import (datasets imports pyarrow), which jemalloc's fork handlers deal with (a forked run has no such thread, and no
run was seen stuck in it). The 4-rank runs that hung now and then (issue 33:
test_fsdp_tp_four_ranks_from_one_command, 1 in ~50 runs on 2 busy cores) were not the server's doing: a rank that
the run's elastic agent forked while the agent's TCPStore server thread held glibc's resolver lock (it resolves each
connection it accepts) hung in its first getaddrinfo; a cold run forks its ranks the same way. The launcher now
forks all ranks before any of them connects (qwen3_research.launch.elastic._ranks_start_after_the_last_fork).
"""

from __future__ import annotations

import atexit
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COLD_ENV = "QWEN3_TESTS_COLD_CLI"
# Read only at run time by the code under test, never at import time of a preloaded library.
RUNTIME_ENV_PREFIXES = ("QWEN3_", "WANDB_", "NEURON_", "SLURM_")
FORK_CLEAN = "not fork-clean, every run is cold"
PARENT_DIED = signal.SIGUSR1  # the server's parent-death signal (PR_SET_PDEATHSIG)
STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT, PARENT_DIED}
# Third-party only, and never torchtitan: qwen3_research pins torch._utils._get_available_device_type before its
# first torchtitan import (device.prepare_torchtitan), because torchtitan reads the device type at import time.
# The torch and other modules torchtitan pulls in are here instead (torchtitan's own import is then ~0.4 s).
PRELOAD = [
    "torch", "torch.distributed", "torch.distributed.checkpoint", "torch.distributed.checkpoint.state_dict",
    "torch.distributed.fsdp", "torch.distributed.tensor", "torch.distributed.tensor.parallel",
    "torch.distributed.tensor.experimental", "torch.distributed.pipelining",
    "torch.distributed._composable.replicate_with_fsdp", "torch.distributed.elastic.multiprocessing",
    "torch.distributed.launcher.api", "torch._dynamo", "torch._inductor.compile_fx",
    "torch._functorch.partitioners", "torch.nn.attention.flex_attention", "torch.nn.attention.varlen",
    "torch.distributed._tools.mem_tracker", "torch._subclasses.fake_tensor", "torch.utils.tensorboard",
    "numpy", "safetensors.torch", "tokenizers", "datasets", "datasets.distributed", "torchdata", "tyro",
    "tensorboard", "absl", "docstring_parser", "spmd_types.checker", "transformers",
    "transformers.models.qwen3.modeling_qwen3", "transformers.models.qwen3_moe.modeling_qwen3_moe",
    "hydra", "hydra.main", "hydra._internal.utils", "hydra.core.utils", "omegaconf", "wandb",
    "matplotlib", "matplotlib.pyplot",
]


# -- server ------------------------------------------------------------------------------------------------------


def _fork() -> int:
    with warnings.catch_warnings():  # Python 3.12's "multi-threaded, use of fork()" note, in the server only
        warnings.simplefilter("ignore", DeprecationWarning)
        return os.fork()


def _in_a_forked_child(fn) -> int:
    """fn()'s small int result, computed in a throwaway child so that nothing it touches stays in this process."""
    pid = _fork()
    if pid == 0:
        try:
            os._exit(int(fn()))
        except BaseException:
            os._exit(255)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def _preload() -> list[str]:
    """Import PRELOAD; what could not be imported, and why.

    torchtitan.tools.utils asks torch.cuda.is_available() at import time, and with torch's CUDA build that call
    marks every later fork as unable to use CUDA ("Cannot re-initialize CUDA in forked subprocess"), which the
    CLI's forked CPU workers then trip over (a cold CLI process never imports torchtitan before its fork). So the
    answer is computed once in a throwaway child and stands in for the call while the libraries are imported; a
    probe fork afterwards checks that the server is still fork-clean, and if not the client runs everything cold.
    """
    import importlib

    import torch

    available = bool(_in_a_forked_child(torch.cuda.is_available))
    real, torch.cuda.is_available = torch.cuda.is_available, lambda: available
    missing = []
    try:
        for name in PRELOAD:
            try:
                importlib.import_module(name)
            except Exception as e:  # an optional library: the child imports it (or fails) as a cold run would
                missing.append(f"{name} ({type(e).__name__})")
    finally:
        torch.cuda.is_available = real
    if _in_a_forked_child(getattr(torch._C, "_cuda_isInBadFork", lambda: False)):
        missing.append(f"{FORK_CLEAN}: a preloaded library initialised CUDA")
    ours = sorted(m for m in sys.modules if m.split(".")[0] in ("qwen3_research", "torchtitan"))
    if ours:  # their module state must be a cold process's: stop being warm rather than differ
        missing.append(f"{FORK_CLEAN}: {ours[0]} was imported")
    return missing


def _leave_the_servers_resources_alone() -> None:
    """The exit of a child must not clean up what the server made before the fork.

    A child ends with the interpreter's atexit functions (below), the ones the server's imports registered too. W&B
    makes its media directory at import (``wandb.sdk.data_types._private.MEDIA_TMP``, a
    ``tempfile.TemporaryDirectory``) and registers its ``cleanup`` with atexit: the first child to exit removed the
    server's directory, and every later child that logged media (a sweep's W&B table) failed with FileNotFoundError.
    A cold process makes and removes its own: so does a child now (the object keeps its identity, which W&B's
    modules imported by name, and gets a directory of its own). Inherited ``weakref.finalize`` callbacks (another
    way a TemporaryDirectory cleans up) are detached: they belong to the server's objects."""
    import tempfile
    import weakref

    for f in list(getattr(weakref.finalize, "_registry", {})):
        f.detach()
    private = sys.modules.get("wandb.sdk.data_types._private")
    if private is not None and hasattr(private, "MEDIA_TMP"):
        private.MEDIA_TMP.name = tempfile.mkdtemp("wandb-media")


def _child(req: dict, fds: list[int], mask: set) -> None:
    """Become `python -m req.module *req.args`; never returns."""
    os.setpgid(0, 0)  # the run and whatever it starts (ranks, resource tracker) form one group: see serve
    for fd in fds:
        os.close(fd)
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    for fd, path in ((1, req["stdout"]), (2, req["stderr"])):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(f, fd)
        os.close(f)
    os.close(null)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for sig in (signal.SIGTERM, PARENT_DIED):
        signal.signal(sig, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    if "numpy" in sys.modules:  # a cold process seeds numpy's global generator from the OS; so does each child
        sys.modules["numpy"].random.seed()
    _leave_the_servers_resources_alone()
    sys.argv = [req["module"], *req["args"]]  # runpy replaces argv[0] with the module's file, as `-m` does
    sys.path[0] = req["cwd"]  # `python -m` puts the working directory first
    added = [p for p in _path_entries(req["env"]) if p not in sys.path]
    sys.path[1:1] = added  # then PYTHONPATH's entries (the client allowed only ones that shadow nothing loaded)
    if added:
        import importlib

        importlib.invalidate_caches()
        if any(os.path.isfile(os.path.join(p, "sitecustomize.py")) for p in added):
            import sitecustomize  # noqa: F401  (a cold interpreter imports it as it starts: site; the server had none)
    import runpy

    code, by_sigint = 0, False
    try:
        runpy.run_module(req["module"], run_name="__main__", alter_sys=True)
    except SystemExit as e:  # as the interpreter reads it: None is 0, an int is the status, else print it, 1
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException as e:  # an uncaught exception: the interpreter's traceback and status
        sys.excepthook(type(e), e, e.__traceback__)
        code, by_sigint = 1, isinstance(e, KeyboardInterrupt)
    # The interpreter's shutdown up to its module teardown (Py_FinalizeEx: non-daemon threads, atexit, flush); the
    # teardown of the ~4000 preloaded modules (2.5 s a run) changes nothing a test can see, so it is skipped.
    threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    if by_sigint:  # like CPython: end by SIGINT's default action, so the parent sees the signal
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code)


def _die_with_parent(sig: int) -> None:
    """Ask the kernel for `sig` when the parent dies (prctl PR_SET_PDEATHSIG; Linux only, else polling alone)."""
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, sig, 0, 0, 0)  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):
        pass


def _end_runs(runs: dict[int, socket.socket]) -> None:
    """SIGKILL every unfinished run's process group, then reap the runs. A run's pid cannot be reused while the
    server has not reaped it, so its group is still its own; its ranks and resource tracker are in it."""
    for pid in runs:
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    deadline = time.monotonic() + 5
    for pid in list(runs):
        while time.monotonic() < deadline:
            try:
                if os.waitpid(pid, os.WNOHANG)[0]:
                    break
            except ChildProcessError:
                break
            time.sleep(0.01)


def serve(sock_path: str) -> None:
    """Answer run requests until the pytest process that started the server is gone or signals it to stop.

    Each run leads its own process group (set on both sides of the fork, so it holds before the pid is answered).
    The server SIGKILLs a run's whole group when the client gives up on it (its connection closes: a timeout,
    or pytest killed) and every unfinished run's group when it stops: on SIGTERM or SIGINT, and when its parent
    dies, told by PR_SET_PDEATHSIG (also during the imports) and seen by polling getppid(). It then ends with
    os._exit: the preloaded libraries' atexit functions are not run (nothing of theirs outlives the server), and
    the socket's directory, the client's, goes with it."""
    parent = os.getppid()
    runs: dict[int, socket.socket] = {}  # unfinished run's pid -> the connection its exit status goes to

    def stop(*_) -> None:
        _end_runs(runs)
        media = getattr(sys.modules.get("wandb.sdk.data_types._private"), "MEDIA_TMP", None)
        if media is not None:  # W&B's directory made at import, which its atexit function would remove
            shutil.rmtree(media.name, ignore_errors=True)
        if os.getppid() != parent:  # the client cannot remove its directory any more
            shutil.rmtree(os.path.dirname(sock_path), ignore_errors=True)
        os._exit(0)

    def parent_died(*_) -> None:  # also sent when the thread that started the server ends: stop only if it is gone
        if os.getppid() != parent:
            stop()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    signal.signal(PARENT_DIED, parent_died)
    _die_with_parent(PARENT_DIED)
    parent_died()  # before the prctl
    missing = _preload()
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(sock_path)
    srv.listen(8)
    print(json.dumps({"ready": True, "missing": missing}), flush=True)
    while os.getppid() == parent:
        conns = {c.fileno(): pid for pid, c in runs.items()}
        readable, _, _ = select.select([srv, *conns], [], [], 0.05)
        for fd in readable:
            if fd is srv or fd not in conns:
                continue
            pid = conns[fd]  # a client sends nothing after its request: this is its end, before the run's
            try:
                gone = not runs[pid].recv(1, socket.MSG_DONTWAIT)
            except BlockingIOError:
                gone = False
            except OSError:
                gone = True
            if gone:
                try:
                    os.killpg(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        if srv in readable:
            conn, _ = srv.accept()
            buf = b""
            while not buf.endswith(b"\n"):
                chunk = conn.recv(65536)
                if not chunk:
                    break
                buf += chunk
            req = json.loads(buf)
            sys.stdout.flush()
            sys.stderr.flush()
            held = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)  # stop() must know every run it kills
            pid = _fork()
            if pid == 0:
                _child(req, [srv.fileno(), conn.fileno(), *(c.fileno() for c in runs.values())], held)
            runs[pid] = conn
            try:
                os.setpgid(pid, pid)
            except OSError:  # the child has done it, or already exited
                pass
            signal.pthread_sigmask(signal.SIG_SETMASK, held)
            conn.sendall(f"{pid}\n".encode())
        while runs:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = runs.pop(pid, None)
            if conn is not None:
                code = os.waitstatus_to_exitcode(status)
                try:
                    conn.sendall(f"{code}\n".encode())
                except OSError:
                    pass
                conn.close()
    stop()


# -- client ------------------------------------------------------------------------------------------------------


class _Server:
    def __init__(self, env: dict):
        self.env = dict(env)
        self.dir = tempfile.mkdtemp(prefix="warm-cli-")
        self.sock = os.path.join(self.dir, "s")
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.warm_cli", self.sock], cwd=ROOT,
                                     env={**self.env, **_allocator_preload(self.env)},
                                     stdout=subprocess.PIPE, stderr=None, text=True)
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"warm CLI server exited with {self.proc.wait()} before it was ready")
        self.missing = json.loads(line)["missing"]
        self.usable = not any(m.startswith(FORK_CLEAN) for m in self.missing)
        if not self.usable:
            print(f"warm_cli: {self.missing}", file=sys.stderr)
        atexit.register(self.close)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        shutil.rmtree(self.dir, ignore_errors=True)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def run(self, module: str, args: list[str], *, cwd: Path, env: dict, timeout: float
            ) -> subprocess.CompletedProcess:
        with tempfile.TemporaryDirectory(prefix="warm-run-") as d:
            out, err = os.path.join(d, "stdout"), os.path.join(d, "stderr")

            def output(path: str) -> str:
                return Path(path).read_text(errors="replace")

            req = {"module": module, "args": list(args), "cwd": str(cwd), "env": env, "stdout": out, "stderr": err}
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.connect(self.sock)
                s.sendall((json.dumps(req) + "\n").encode())
                f = s.makefile("r")
                f.readline()  # the run's pid
                s.settimeout(timeout)
                try:
                    line = f.readline()
                except (socket.timeout, TimeoutError):
                    line = None
                if not line:  # timed out (or the server died): the server kills the run's group when we hang up
                    try:
                        s.shutdown(socket.SHUT_WR)
                        s.settimeout(30)
                        s.recv(64)  # its exit status, once the server has reaped it
                    except OSError:  # socket.timeout included
                        pass
                    raise subprocess.TimeoutExpired([module, *args], timeout, output(out), output(err))
                code = int(line)
            return subprocess.CompletedProcess([sys.executable, "-m", module, *args], code, output(out), output(err))


def _allocator_preload(env: dict) -> dict:
    """The server starts with the allocator a CPU run of the CLI preloads (qwen3_research.allocator: mimalloc, from
    the pinned wheel), so its forked runs have it already and do not re-execute themselves (which would make every
    run cold); a run whose QWEN3_CPU_ALLOCATOR asks for glibc re-executes without it, as a cold run would start."""
    from qwen3_research import allocator

    lib = allocator.mimalloc_library()
    if lib is None or env.get(allocator.ENV, "auto") not in ("auto", "mimalloc"):
        return {}
    return {"LD_PRELOAD": " ".join(p for p in (lib, env.get("LD_PRELOAD", "")) if p)}


_server: _Server | None = None
_lock = threading.Lock()


def _path_entries(env: dict) -> list[str]:
    return [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]


def _shadows_nothing_preloaded(entries: list[str]) -> bool:
    """PYTHONPATH entries whose top-level modules the server has not imported (a test double of torch_neuronx, the
    repository root): a child puts them on sys.path as a cold interpreter would, and imports them itself. An entry
    holding a module the server preloaded (or that this process has, as a stand-in for what it pulls in) runs cold."""
    loaded = {m.split(".")[0] for m in sys.modules} | {m.split(".")[0] for m in PRELOAD}
    for entry in entries:
        if not os.path.isdir(entry):
            return False
        names = {Path(n).stem for n in os.listdir(entry) if n.endswith(".py") or os.path.isdir(os.path.join(entry, n))}
        if Path(entry).resolve() != ROOT and names & loaded:
            return False
    return True


def _differs_only_at_run_time(env: dict, base: dict) -> bool:
    """PATH is read when a program is looked up, never by an import; PYTHONPATH only as _shadows_nothing_preloaded
    allows."""
    keys = {k for k in env.keys() | base.keys() if env.get(k) != base.get(k)}
    if "PYTHONPATH" in keys:
        old, new = _path_entries(base), _path_entries(env)
        if not set(old) <= set(new) or not _shadows_nothing_preloaded([p for p in new if p not in old]):
            return False
    return all(k.startswith(RUNTIME_ENV_PREFIXES) or k in ("PATH", "PYTHONPATH") for k in keys)


def server(base_env: dict) -> _Server | None:
    """This pytest process's server (started on first use), or None when runs must be cold."""
    global _server
    if os.environ.get(COLD_ENV) == "1":
        return None
    with _lock:
        if _server is None or not _server.alive():
            _server = _Server(base_env)
        return _server


def run(module: str, args: list[str], *, cwd: Path, env: dict, base_env: dict, timeout: float
        ) -> subprocess.CompletedProcess | None:
    """The run's result through the warm server, or None when this run must be cold (see the module doc)."""
    if os.environ.get(COLD_ENV) == "1" or not _differs_only_at_run_time(env, base_env):
        return None
    srv = server(base_env)
    return srv.run(module, args, cwd=cwd, env=env, timeout=timeout) if srv.usable else None


if __name__ == "__main__":
    serve(sys.argv[1])
