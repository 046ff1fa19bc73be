"""The Slurm launcher's checks before ``hydra/launcher=slurm`` submits anything (issue 16).

sbatch would refuse a partition that does not exist or more nodes than a partition has, but through
submitit that arrives as a multi-line traceback after Hydra has created the sweep dir. Here it is one
line naming the key, exit status 2, before any job or directory exists. The launcher itself is Hydra's
submitit plugin, configured by ``conf/hydra/launcher/slurm.yaml``; what a job reads of Slurm at run time
is ``qwen3_research.slurm``.
"""

from __future__ import annotations

import shutil
import subprocess

from qwen3_research import overrides
from qwen3_research.compose import compose
from qwen3_research.errors import ConfigError
from qwen3_research.slurm import SLURM_TIMEOUT_S


def uses_slurm(texts: list[str]) -> bool:
    return any(o.key == "hydra/launcher" and o.prefix in ("", "+") and (o.value or "").strip() == "slurm"
               for o in overrides.parse(texts))


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
        fields = dict(kv.split("=", 1) for kv in line.split() if "=" in kv)  # why: scontrol's Key=Value, not overrides
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


def preflight(texts: list[str]) -> None:
    """Raise ConfigError when a ``hydra/launcher=slurm`` request cannot be met. Swept values are not checked."""
    if not uses_slurm(texts):
        return
    parsed = overrides.parse(texts)
    fixed = [o.text for o in parsed if not o.sweep]
    try:
        cfg = compose(fixed, return_hydra_config=True)
        partition = cfg.hydra.launcher.get("partition")
        nnodes = int(cfg.parallelism.nnodes)
    except Exception:  # noqa: BLE001 - a bad override is reported by Hydra itself, in each point
        return
    swept_nodes = any(o.key == "parallelism.nnodes" for o in parsed if o.sweep)
    check_request(partition, 1 if swept_nodes else nnodes)
