"""Everything Slurm: the job this process runs in, the cluster's answers, and the checks before
``hydra/launcher=slurm`` submits anything (issue 16).

- The job: every ``SLURM_*`` variable the package reads is read here (``job_id``, ``node_rank``,
  ``restart_count``, ``job_nodelist``); the launcher, the rendezvous and the run-dir lock ask these.
- The cluster: ``scontrol`` for a job's node names and addresses, and for the partitions.
- The preflight: sbatch would refuse a partition that does not exist or more nodes than a partition has,
  but through submitit that arrives as a multi-line traceback after Hydra has created the sweep dir.
  Here it is one line naming the key, exit status 2, before any job or directory exists.

Imports only ``errors`` (and ``compose`` for the preflight), so any layer may ask it.
"""

from __future__ import annotations

import os
import shutil
import subprocess

from qwen3_research.errors import ConfigError

SLURM_TIMEOUT_S = 60  # no hang: a Slurm controller that does not answer fails after this


# -- the job this process runs in --------------------------------------------------------------------
def job_id() -> str | None:
    """``SLURM_JOB_ID``: set in every process of a Slurm job (None outside one, or when empty)."""
    return os.environ.get("SLURM_JOB_ID") or None


def node_rank() -> int:
    """``SLURM_NODEID``: this node's index in the job (0 outside a job)."""
    return int(os.environ.get("SLURM_NODEID", "0"))


def restart_count() -> int:
    """``SLURM_RESTART_COUNT``: how many times the job was requeued (preemption, scontrol requeue); 0 first."""
    return int(os.environ.get("SLURM_RESTART_COUNT") or 0)


def job_nodelist() -> str | None:
    """``SLURM_JOB_NODELIST`` as set (compressed, e.g. ``n[1-2]``), None when unset: the job's nodes."""
    return os.environ.get("SLURM_JOB_NODELIST")


# -- the cluster -------------------------------------------------------------------------------------
def node_names(nodelist: str) -> list[str]:
    """A compressed node list expanded by Slurm itself (``scontrol show hostnames``)."""
    return subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True,
                          check=True, timeout=SLURM_TIMEOUT_S).stdout.split()


def node_addr(name: str) -> str:
    """The address Slurm reaches node ``name`` at (``NodeAddr``; the name itself when Slurm has none)."""
    out = subprocess.run(["scontrol", "show", "node", "-o", name], capture_output=True, text=True,
                         timeout=SLURM_TIMEOUT_S).stdout
    fields = dict(kv.split("=", 1) for kv in out.split() if "=" in kv)
    return fields.get("NodeAddr") or name


def head_node_endpoint(port: int) -> str:
    """``address:port`` of this job's first node, where a multi-node job meets. A Slurm node name need not
    resolve (``n1`` gave ``gai error: -2 - Name or service not known``): the address comes from
    ``scontrol show node``. Port 0 (not configured): 29500 + job id mod 1000, so two jobs sharing a node do
    not collide."""
    first = node_names(job_nodelist())[0]
    return f"{node_addr(first)}:{port or 29500 + int(job_id() or 0) % 1000}"


def uses_slurm(overrides: list[str]) -> bool:
    return any(o.replace(" ", "") in ("hydra/launcher=slurm", "+hydra/launcher=slurm") for o in overrides)


def partitions() -> dict[str, dict]:
    """name -> scontrol's fields (TotalNodes, Default, State, ...)."""
    if shutil.which("scontrol") is None:
        raise ConfigError("hydra/launcher=slurm needs Slurm's client commands (scontrol, sbatch) on PATH; run on a "
                          "login node of the cluster, or choose another hydra/launcher")
    try:
        out = subprocess.run(["scontrol", "show", "partition", "-o"], capture_output=True, text=True,
                             timeout=SLURM_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise ConfigError(f"hydra/launcher=slurm: the Slurm controller did not answer within {SLURM_TIMEOUT_S} s "
                          "(scontrol show partition); check `sinfo`") from None
    if out.returncode != 0:
        first = (out.stderr.strip().splitlines() or ["no output"])[0]
        raise ConfigError(f"hydra/launcher=slurm: scontrol show partition failed ({first}); check `sinfo`")
    parts = {}
    for line in out.stdout.splitlines():
        fields = dict(kv.split("=", 1) for kv in line.split() if "=" in kv)
        if "PartitionName" in fields:
            parts[fields["PartitionName"]] = fields
    return parts


def check_request(partition: str | None, nnodes: int) -> None:
    """The partition exists (or a default one does) and has at least ``nnodes`` nodes."""
    parts = partitions()
    if partition:
        if partition not in parts:
            raise ConfigError(f"hydra.launcher.partition={partition}: no such Slurm partition; "
                              f"available: {', '.join(sorted(parts)) or 'none'}")
        name = partition
    else:
        name = next((n for n, f in parts.items() if f.get("Default") == "YES"), None)
        if name is None:
            raise ConfigError("hydra.launcher.partition is not set and Slurm has no default partition; "
                              f"set hydra.launcher.partition to one of: {', '.join(sorted(parts)) or 'none'}")
    total = int(parts[name].get("TotalNodes", "0") or 0)
    if nnodes > total:
        raise ConfigError(f"parallelism.nnodes={nnodes} but Slurm partition {name} has {total} nodes; set "
                          f"parallelism.nnodes<={total} or hydra.launcher.partition to a larger partition")


def preflight(overrides: list[str]) -> None:
    """Raise ConfigError when a ``hydra/launcher=slurm`` request cannot be met. Swept values are not checked."""
    if not uses_slurm(overrides):
        return
    from qwen3_research.compose import compose, is_sweep_value

    fixed = [o for o in overrides if not is_sweep_value(o.partition("=")[2])]
    try:
        cfg = compose(fixed, return_hydra_config=True)
        partition = cfg.hydra.launcher.get("partition")
        nnodes = int(cfg.parallelism.nnodes)
    except Exception:  # noqa: BLE001 - a bad override is reported by Hydra itself, in each point
        return
    swept_nodes = any(o.split("=", 1)[0].lstrip("+~") == "parallelism.nnodes" for o in overrides if o not in fixed)
    check_request(partition, 1 if swept_nodes else nnodes)
