"""The Slurm job this process runs in, and the cluster's answers about its nodes.

Every ``SLURM_*`` variable the package reads is read here (``job_id``, ``node_rank``, ``restart_count``,
``job_nodelist``); the launcher, the rendezvous and the run-dir lock ask these. ``scontrol`` gives a job's
node names and addresses. The checks before ``hydra/launcher=slurm`` submits anything are the launch
layer's (``qwen3_research.launch.slurm``).

Imports nothing of the package, so any layer may ask it.
"""

from __future__ import annotations

import os
import subprocess


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
    fields = dict(kv.split("=", 1) for kv in out.split() if "=" in kv)  # why: scontrol's Key=Value, not overrides
    return fields.get("NodeAddr") or name


def head_node_endpoint(port: int) -> str:
    """``address:port`` of this job's first node, where a multi-node job meets. A Slurm node name need not
    resolve (``n1`` gave ``gai error: -2 - Name or service not known``): the address comes from
    ``scontrol show node``. Port 0 (not configured): 29500 + job id mod 1000, so two jobs sharing a node do
    not collide."""
    first = node_names(job_nodelist())[0]
    return f"{node_addr(first)}:{port or 29500 + int(job_id() or 0) % 1000}"
