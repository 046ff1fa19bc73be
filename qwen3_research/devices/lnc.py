"""Logical NeuronCores (LNC), the cores a host has at an LNC, and the NeuronCores a process reserves.

Standard library only; nothing here starts a Neuron runtime (the count is asked in a child process).
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys

from qwen3_research.devices.registry import REGISTRY
from qwen3_research.errors import ConfigError

# -- logical NeuronCores (LNC) ---------------------------------------------------------------
# The Neuron runtime reads the LNC only from this variable, once, when it starts
# (torch_neuronx/csrc/core/utils/PlatformUtils.cpp: GetLogicalNeuronCores, in
# parmoham-aws/test-repo-parmoham); trn2/trn3 default to 2 there.
LNC_ENV = "NEURON_LOGICAL_NC_CONFIG"
LNC_DEFAULT_NEURON = 2


def resolve_lnc(configured: int | None, device_type: str, env=None) -> int | None:
    """The LNC this run uses: ``device.lnc`` or ``NEURON_LOGICAL_NC_CONFIG``; both set and different
    is a ConfigError. None on a kind without logical cores when neither is set (nothing to export)."""
    env = os.environ if env is None else env
    raw = env.get(LNC_ENV, "").strip()
    from_env = None
    if raw:
        if raw not in ("1", "2"):
            raise ConfigError(f"{LNC_ENV}={raw!r} in the environment is not 1 or 2; unset it or set it to 1 or 2")
        from_env = int(raw)
    if configured is not None and configured not in (1, 2):
        raise ConfigError(f"device.lnc must be 1 or 2 (logical NeuronCore config), got {configured}")
    if configured is not None and from_env is not None and configured != from_env:
        raise ConfigError(
            f"device.lnc={configured} conflicts with {LNC_ENV}={raw} in the environment (the Neuron runtime "
            f"reads only the variable); unset {LNC_ENV} or pass device.lnc={from_env}"
        )
    lnc = configured if configured is not None else from_env
    spec = REGISTRY.get(device_type)
    if lnc is None and spec is not None:
        lnc = spec.default_lnc
    return lnc


def export_lnc(lnc: int | None) -> None:
    """Put the LNC in this process's environment, which every worker inherits (before any runtime starts)."""
    if lnc is not None:
        os.environ[LNC_ENV] = str(lnc)


@functools.lru_cache(maxsize=None)
def neuron_logical_core_count(lnc: int) -> int:
    """Logical NeuronCores this host has at ``lnc``: ``torch_neuronx.device_count()`` (the runtime's
    visible-VNC count, torch_neuronx/csrc/core/NeuronDevice.cpp) asked in a child process, so the
    launching parent never starts a Neuron runtime itself."""
    code = "import torch_neuronx; print(torch_neuronx.device_count())"
    proc = subprocess.run([sys.executable, "-c", code], env={**_env_without_our_core_limits(), LNC_ENV: str(lnc)},
                          capture_output=True, text=True, timeout=600)
    try:
        count = int(proc.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        count = 0
    if proc.returncode != 0 or count < 1:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise ConfigError(
            f"parallelism.nproc_per_node=-1 (auto) could not count the logical NeuronCores at LNC={lnc} "
            f"({tail}); set parallelism.nproc_per_node=N"
        )
    return count


# -- NeuronCores a process reserves ----------------------------------------------------------------
# By default the Neuron runtime initialises every NeuronCore of the host and reserves them for the process
# that started it; a reserved core cannot be used by another process until that one ends (Neuron Runtime
# configuration guide, "NeuronCore allocation":
# https://awsdocs-neuron.readthedocs-hosted.com/en/v2.33.0/neuron-runtime/guides/configuration-guide.html).
# NEURON_RT_NUM_CORES (how many cores the process needs; 0 = all) and NEURON_RT_VISIBLE_CORES (which ones)
# limit that (https://awsdocs-neuron.readthedocs-hosted.com/en/latest/neuron-runtime/api/nrt-env-var-reference.html);
# with LNC=2 the runtime counts logical cores. AWS's single-core smoke test of its Qwen3 recipe sets
# NEURON_RT_NUM_CORES=1 (parmoham-aws/test-repo-parmoham, docs/torchtitan/qwen3/TorchTitan_Neuron_Tutorial_Qwen3_on_AWS_Trainium.md).
# A worker group needs neither: torch_neuronx's process group sets NEURON_RT_VISIBLE_CORES=LOCAL_RANK in each
# rank, but only when it is unset (torch_neuronx/distributed/backend.py, _set_rt_visible_cores, same repository),
# so a value inherited from the launcher would give every rank the same cores.
VISIBLE_CORES_ENV = "NEURON_RT_VISIBLE_CORES"
NUM_CORES_ENV = "NEURON_RT_NUM_CORES"
_set_by_us: dict[str, str] = {}  # what prepare_neuron_cores put in os.environ (a sweep's later points undo it)


def prepare_neuron_cores(world_size: int, env=None) -> str:
    """A single-process neuron run takes one core: ``NEURON_RT_NUM_CORES=1`` unless the user chose cores
    (either variable set). A multi-process run must not inherit ``NEURON_RT_VISIBLE_CORES``: one this
    module set for an earlier single-process run (a sweep) is removed, one from the user is a ConfigError.
    Returns what the run's processes will see, for messages."""
    ours = _set_by_us if env is None else {}  # a copy (the doctor's question) records nothing
    env = os.environ if env is None else env
    for var, value in list(_set_by_us.items()):
        if env.get(var) == value:
            env.pop(var)
        ours.pop(var, None)
    if world_size == 1:
        if not env.get(VISIBLE_CORES_ENV) and not env.get(NUM_CORES_ENV):
            env[NUM_CORES_ENV] = ours[NUM_CORES_ENV] = "1"
            return f"{NUM_CORES_ENV}=1 (set for this single-process run)"
        return ", ".join(f"{v}={env[v]}" for v in (VISIBLE_CORES_ENV, NUM_CORES_ENV) if env.get(v)) + " (from the environment)"
    if env.get(VISIBLE_CORES_ENV):
        raise ConfigError(
            f"{VISIBLE_CORES_ENV}={env[VISIBLE_CORES_ENV]} in the environment would give each of the {world_size} "
            f"ranks the same NeuronCores (torch_neuronx sets it to the local rank only when it is unset); unset "
            f"{VISIBLE_CORES_ENV}, or set parallelism.nproc_per_node=1 for a single-process run on those cores"
        )
    return f"{VISIBLE_CORES_ENV}=<local rank> per rank (set by torch_neuronx's process group)"


def _env_without_our_core_limits() -> dict:
    """os.environ minus what prepare_neuron_cores set (a core count must see every core)."""
    return {k: v for k, v in os.environ.items() if _set_by_us.get(k) != v}
