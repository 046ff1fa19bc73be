"""A real two-node Slurm cluster on this host for the tests (issue 16), opt in with ``@pytest.mark.slurm``.

``slurm_cluster`` (session scope) writes a ``slurm.conf`` for nodes ``n1`` and ``n2`` on this
host in a temporary directory (state, spool, pid and log files there too), generates a munge
key for the test, starts ``munged``, ``slurmctld`` and two ``slurmd -N n1|n2`` and waits until
``sinfo`` shows both nodes idle. At the end it stops exactly the processes it started, by pid.
Clients reach it through ``SLURM_CONF`` (``cluster.env()``); munge runs on its own socket
(``AuthInfo=socket=...``), so a system munged, if any, is neither used nor touched.

Needs Debian's ``slurmctld slurmd slurm-client munge`` (Slurm 22.05; ``.ci/run`` installs them)
and root (slurmd runs jobs as the submitting user). Without them the tests skip with the reason.

Run by hand (to experiment): ``python -m tests.slurm_cluster`` starts one and prints its
``SLURM_CONF``; Ctrl-C stops it.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

DAEMONS = ("munged", "mungekey", "slurmctld", "slurmd", "sinfo", "sbatch", "scontrol", "srun")
NODES = ("n1", "n2")
PARTITION = "debug"
START_TIMEOUT_S = 60


def _sbin(name: str) -> str | None:
    return shutil.which(name) or next((p for p in (f"/usr/sbin/{name}", f"/sbin/{name}") if os.path.exists(p)), None)


def missing_reason() -> str | None:
    """Why a cluster cannot start here, or None."""
    absent = [d for d in DAEMONS if _sbin(d) is None]
    if absent:
        return (f"Slurm/munge not installed ({', '.join(absent)} missing): "
                "apt-get install -y slurmctld slurmd slurm-client munge")
    if os.geteuid() != 0:
        return "the test Slurm cluster needs root (slurmd and munged run as the current user, root)"
    return None


def _free_port_pair() -> int:
    """The first of two consecutive free TCP ports, 17001 when free (slurmd of n1 and n2)."""
    for base in [17001, *range(17101, 17999, 7)]:
        if all(_port_free(base + i) for i in range(2)):
            return base
    raise RuntimeError("no two consecutive free ports for slurmd")


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class SlurmCluster:
    def __init__(self, root: Path):
        self.root = Path(root)
        self.host = socket.gethostname()
        self.conf = self.root / "slurm.conf"
        self.procs: dict[str, int] = {}  # name -> pid of the daemon we started
        self.partition = PARTITION
        self.nodes = NODES

    # -- configuration -------------------------------------------------------------------
    def env(self, base: dict | None = None) -> dict:
        env = dict(os.environ if base is None else base)
        env["SLURM_CONF"] = str(self.conf)
        return env

    def _write_conf(self) -> None:
        r = self.root
        for d in ("state", "spool/n1", "spool/n2", "log", "munge"):
            (r / d).mkdir(parents=True, exist_ok=True)
        os.chmod(r / "munge", 0o700)
        node_port = _free_port_pair()
        cpus = os.cpu_count() or 1
        mem_mb = max(1024, (os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")) // 2**20 // 4)
        self.conf.write_text(f"""\
# Test cluster written by tests/slurm_cluster.py: two nodes (two slurmd) on this host.
ClusterName=qwen3test
SlurmctldHost={self.host}(127.0.0.1)
SlurmctldPort={_free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={r}/munge/munge.socket,cred_expire=20
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool/%n
SlurmctldPidFile={r}/slurmctld.pid
SlurmdPidFile={r}/slurmd.%n.pid
SlurmctldLogFile={r}/log/slurmctld.log
SlurmdLogFile={r}/log/slurmd.%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SwitchType=switch/none
MpiDefault=none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
SlurmdTimeout=60
KillWait=30
# A loaded CI host may take longer than the default 60 s to reap a signalled step; Slurm would then drain the node
# ("Kill task failed") and a requeued job would wait for it forever.
UnkillableStepTimeout=300
MinJobAge=600
# A requeued job may start again after cred_expire (AuthInfo above; default 120 s).
JobRequeue=1
NodeName=n[1-2] NodeHostname={self.host} NodeAddr=127.0.0.1 Port={node_port}-{node_port + 1} CPUs={cpus} RealMemory={mem_mb} State=UNKNOWN
PartitionName={PARTITION} Nodes=n[1-2] Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
""")

    # -- processes -----------------------------------------------------------------------
    def _spawn(self, name: str, cmd: list[str]) -> None:
        log = open(self.root / "log" / f"{name}.out", "wb")
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env(), start_new_session=True)
        self.procs[name] = proc.pid
        self._popen = getattr(self, "_popen", {})
        self._popen[name] = proc

    def _check_alive(self) -> None:
        for name, proc in getattr(self, "_popen", {}).items():
            if proc.poll() is not None:
                log = (self.root / "log" / f"{name}.out").read_text(errors="replace")[-1500:]
                raise RuntimeError(f"{name} exited with {proc.returncode}: {log}")

    def start(self) -> "SlurmCluster":
        self._write_conf()
        r = self.root
        key = r / "munge" / "munge.key"
        subprocess.run([_sbin("mungekey"), "--create", f"--keyfile={key}", "--force"], check=True,
                       capture_output=True)
        os.chmod(key, 0o400)
        self._spawn("munged", [_sbin("munged"), "--foreground", "--force", f"--key-file={key}",
                               f"--socket={r}/munge/munge.socket", f"--pid-file={r}/munge/munged.pid",
                               f"--log-file={r}/log/munged.log", f"--seed-file={r}/munge/munged.seed"])
        self._wait(lambda: (r / "munge" / "munge.socket").exists(), "munged socket")
        self._spawn("slurmctld", [_sbin("slurmctld"), "-D", "-i", "-f", str(self.conf)])
        for n in NODES:
            self._spawn(f"slurmd-{n}", [_sbin("slurmd"), "-D", "-N", n, "-f", str(self.conf)])
        self._wait(self._all_idle, "sinfo showing n1 and n2 idle")
        return self

    def _all_idle(self) -> bool:
        out = subprocess.run([_sbin("sinfo"), "-h", "-N", "-o", "%N %t"], env=self.env(), capture_output=True,
                             text=True, timeout=30)
        states = dict(line.split() for line in out.stdout.splitlines() if line.strip())
        return all(states.get(n) == "idle" for n in NODES)

    def _wait(self, ready, what: str) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            self._check_alive()
            if ready():
                return
            time.sleep(0.5)
        raise RuntimeError(f"timed out after {START_TIMEOUT_S}s waiting for {what}; logs in {self.root / 'log'}")

    def stop(self) -> None:
        """Stop the daemons we started (slurmd first, munged last), by pid; SIGKILL after 20 s."""
        order = [n for n in (*(f"slurmd-{n}" for n in NODES), "slurmctld", "munged") if n in self.procs]
        for name in order:
            proc = self._popen[name]
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        self.procs.clear()

    # -- helpers for tests ---------------------------------------------------------------
    def run(self, cmd: list[str], **kw) -> subprocess.CompletedProcess:
        return subprocess.run(cmd, env=self.env(kw.pop("env", None)), capture_output=True, text=True,
                              timeout=kw.pop("timeout", 60), **kw)

    def wait_job_done(self, job_id: str, timeout: float = 120) -> dict:
        """The job's fields once it has left the running states (the launcher returns as soon as the
        result is written, a moment before the job ends)."""
        deadline = time.monotonic() + timeout
        while True:
            info = self.job_times(job_id)
            if info["JobState"] not in ("RUNNING", "COMPLETING", "PENDING", "CONFIGURING") or time.monotonic() > deadline:
                return info
            time.sleep(0.5)

    def diagnosis(self, job_id: str, sweep: Path | None = None) -> str:
        """What a stuck job's failure message needs: the job, the nodes' states and reasons, the controller's last
        lines, and each attempt's submitit logs."""
        parts = [self.run(["scontrol", "show", "job", str(job_id)]).stdout, self.run(["sinfo", "-R", "-N", "-l"]).stdout]
        ctl = self.root / "log" / "slurmctld.log"
        if ctl.exists():
            parts.append("slurmctld.log (last 40 lines):\n" + "\n".join(ctl.read_text(errors="replace").splitlines()[-40:]))
        if sweep is not None:
            for log in sorted((sweep / ".submitit").glob(f"{job_id}/*.err")):
                parts.append(f"{log.name} (last 30 lines):\n" + "\n".join(log.read_text(errors="replace").splitlines()[-30:]))
        return "\n\n".join(parts)

    def job_times(self, job_id: str) -> dict:
        """StartTime, EndTime, JobState and ExitCode of a job from ``scontrol show job`` (kept MinJobAge=600 s)."""
        out = self.run(["scontrol", "show", "job", "-o", str(job_id)]).stdout
        fields = dict(kv.split("=", 1) for kv in out.split() if "=" in kv)
        return {k: fields.get(k) for k in ("JobId", "JobName", "JobState", "StartTime", "EndTime", "ExitCode",
                                            "Restarts", "NodeList")}


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    reason = missing_reason()
    if reason:
        print(f"SKIP slurm tests: {reason}")
        pytest.skip(reason)
    # A short path: munge's socket path must fit in sun_path (108 bytes).
    root = Path(tempfile.mkdtemp(prefix="slurm-", dir="/tmp"))
    cluster = SlurmCluster(root)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    import sys

    c = SlurmCluster(Path(tempfile.mkdtemp(prefix="slurm-", dir="/tmp")))
    try:
        c.start()
        print(f"export SLURM_CONF={c.conf}  # pids {c.procs}", flush=True)
        if "--detach" in sys.argv:
            (c.root / "pids").write_text(" ".join(map(str, c.procs.values())))
            os._exit(0)
        signal.pause()
    except KeyboardInterrupt:
        pass
    finally:
        if "--detach" not in sys.argv:
            c.stop()
