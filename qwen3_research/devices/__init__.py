"""Devices as specs: one module per device kind, registered as model backends and kernels are.

Each kind (``device.type``) is a frozen ``DeviceSpec`` (``spec.py``) that its module builds and ``register``s: what
differs between kinds -- its distributed backend and worker start method, what ``training.mixed_precision`` /
``training.loss`` / ``compile.enable`` = auto become there, its compile backend, reference peak FLOP/s per dtype,
profiler activities and memory snapshot, whether it runs on the host or can be planned without the hardware, its LNC
default where it has logical cores, its presence (``present()``, torch-free; ``available()``, torch-checked) and the
doctor's rows for it. What torch abstracts for every device type (synchronize, memory counters, the generator's
state, the device name, the allocator's history) is asked of ``torch.get_device_module(type)`` by ``runtime.py``;
a kind whose module lacks it brings its own (the CPU's peak RSS: ``cpu.HostMemory``). The rest of the package asks
the spec (``devices.get(kind).dist_backend``) or ``devices`` (``rng_state``, ``record_memory_history``,
``device_name``), never compares a device string and never calls ``torch.cuda`` / ``torch.neuron``: outside this
package (and ``titan/`` for strings) either fails tests/test_stack.py.

**A new device is one module and one YAML file**: ``qwen3_research/devices/<kind>.py`` that builds its
``DeviceSpec`` and calls ``registry.register`` (``registry.discover`` imports it: nothing lists it), and
``conf/device/<kind>.yaml`` (``type: <kind>``). A kind kept outside the package is a module named in
``QWEN3_RESEARCH_DEVICE_MODULES`` (comma-separated, importable; ``registry.discover`` imports it in every process,
before the launcher or the CPU allocator asks for a kind) and a YAML on a Hydra search path
(``hydra.searchpath=[file://DIR]`` with ``DIR/device/<kind>.yaml``): tests/toy_device.py and
tests/conf/device/toy.yaml, a CPU-backed kind trained, checkpointed and resumed through the CLI in tests/test_device.py.

- ``device_kind(requested="auto", argv=None)``: the kind a run uses, asked without importing torch (the CPU
  allocator before anything loads, the config's auto settings); ``argv``'s ``device=`` / ``device.type=`` wins.
- ``get(kind)`` (a ConfigError naming the known kinds when none registers it), ``find(kind)`` (None then),
  ``kinds()`` (auto order): the registry.
- ``resolve_device_type(requested)``: the torch-checked kind (auto: the first ``available`` kind; an explicit
  kind that is not available here is a ConfigError with its fix).
- ``reference_peak(kind, "bf16" | "fp32" | "tf32")``: the kind's reference dense peak per rank (torchtitan's GPU
  table and NVIDIA's datasheets in ``cuda.py``, AWS's Trainium figures in ``neuron.py``, measured on ``cpu``).
- ``lnc.py`` (LNC, NeuronCore counts, the cores a process reserves), ``host.py`` (RAM, cgroups, cores, the cache
  folder), ``peaks.py`` (measured matmul peaks, the CPU's cached), ``neuron_host.py`` (a Trainium host's checks).
- ``runtime.py``: the torch-using half (``Device``, which carries its ``.spec``; ``prepare_torchtitan``;
  ``after_sharding``), imported by whoever builds on a device; its names are also reachable here, loaded on first
  use, so importing this package loads no torch.
"""

from __future__ import annotations

import os

from qwen3_research import overrides
from qwen3_research.devices import cpu, cuda, neuron  # each registers its spec
from qwen3_research.devices.cpu import cpu_isa
from qwen3_research.devices.cuda import GPU_FP32_BY_BF16_PEAK, PLANNED_GPUS, planned_gpu, tf32_enabled
from qwen3_research.devices.cuda import unavailable_reason as cuda_unavailable_reason
from qwen3_research.devices.host import (CGROUP_MEMORY_LIMITS, cache_dir, cache_path, cgroup_memory_files, cpu_cores,
                                         host_memory)
from qwen3_research.devices.lnc import (LNC_DEFAULT_NEURON, LNC_ENV, NUM_CORES_ENV, VISIBLE_CORES_ENV, export_lnc,
                                        neuron_logical_core_count, prepare_neuron_cores, resolve_lnc)
from qwen3_research.devices.neuron import NEURON_INSTALL, TRN2_CORE_PEAK, neuron_environment
from qwen3_research.devices.neuron import available as neuron_available
from qwen3_research.devices.peaks import cached_cpu_peak, measure_matmul_peak, raise_cpu_peak
from qwen3_research.devices.registry import AUTO, REGISTRY, find, get, kinds, register
from qwen3_research.devices.spec import Check, DeviceSpec
from qwen3_research.errors import ConfigError

DEVICE_KEYS = ("device", "device.type")  # the command-line keys that choose the device


def device_kind(requested: str = AUTO, argv: list[str] | None = None) -> str:
    """The device kind a run with ``device.type=requested`` uses, without importing torch: ``argv``'s last
    ``device=X`` / ``device.type=X`` when given, else ``requested``; auto is the first registered kind (auto order:
    neuron, cuda, cpu) whose ``present()`` says this host has it (TorchNeuron installed; the NVIDIA driver lists a
    GPU that CUDA_VISIBLE_DEVICES does not hide). Any other value is returned as given (the config's checks name it)."""
    for a in argv or ():
        # why the text alone: this runs before the allocator's re-exec, where Hydra's parser (~0.3 s) is not loaded
        prefix, key, value = overrides.split_text(a)
        if value is not None and prefix != "~" and key in DEVICE_KEYS:
            requested = value.strip()
    if requested != AUTO:
        return requested
    return next(k for k in kinds() if get(k).present())


def slow_16bit_nn_gemm(kind: str) -> bool:
    """A 16-bit GEMM on this device kind (or torch device type) is slow with a row-major, long-reduction right
    operand (``DeviceSpec.slow_16bit_nn_gemm``; False for a name no kind registers)."""
    spec = find(kind)
    return spec is not None and spec.slow_16bit_nn_gemm()


def resolve_device_type(requested: str, *, check: bool = True) -> str:
    """The torch-checked kind. auto: the first kind (auto order) available here. ``check``: an explicit kind must be
    available (``spec.available()``, which may import its runtime), else a ConfigError with its fix; without it, the
    choice is made without importing or starting any device runtime (``spec.visible()``: a launching parent)."""
    if requested == AUTO:
        return next(k for k in kinds() if (get(k).available() if check else get(k).visible()))
    spec = get(requested)
    if check and not spec.available():
        raise ConfigError(spec.unavailable_reason())
    return requested


def reference_peak(kind: str, dtype: str) -> float:
    """The reference dense peak FLOP/s of one rank of ``kind`` for matmuls in ``dtype`` (bf16 | fp32 | tf32): a GPU
    is the H100 SXM of torchtitan's table, a Trainium rank one at LNC=2, a CPU this host's measured rate."""
    return get(kind).reference_peak(dtype)


def resolve_nproc_per_node(requested: int, device_type: str, lnc: int | None) -> int:
    """``-1`` (auto, the default) = every device of this host (``spec.local_devices``: the logical NeuronCores at
    the LNC on neuron, the visible GPUs on cuda, 1 on cpu). Under torchrun, the processes torchrun started."""
    if requested != -1:
        return requested
    if "TORCHELASTIC_RUN_ID" in os.environ and "LOCAL_WORLD_SIZE" in os.environ:
        return int(os.environ["LOCAL_WORLD_SIZE"])
    return get(device_type).local_devices(lnc)


def host_nproc_per_node(world_size: int | None = None, nnodes: int = 1) -> int:
    """``nproc_per_node=-1`` where the run's device is not known: the launcher's world size if given,
    else every device of this host (its default device type, LNC from the environment)."""
    if world_size is not None:
        return max(1, world_size // max(1, nnodes))
    kind = resolve_device_type(AUTO, check=False)
    return resolve_nproc_per_node(-1, kind, resolve_lnc(None, kind))


def prepare_launch(device_type: str, lnc: int | None, world_size: int) -> None:
    """Before any worker (or runtime) starts, with the run's resolved values (``resolve.ResolvedRun``): export
    the LNC into the environment workers inherit, and what the kind needs (neuron: a single-process run takes one
    NeuronCore, ``lnc.prepare_neuron_cores``)."""
    export_lnc(lnc)
    get(device_type).prepare_launch(world_size)


RUNTIME_NAMES = ("Device", "MemoryStats", "prepare_torchtitan", "after_sharding", "device_module", "device_name",
                 "rng_state", "set_rng_state", "record_memory_history", "dump_memory_snapshot")


def __getattr__(name: str):
    """The torch-using names (``runtime.py``), loaded on first use so that importing this package loads no torch."""
    if name in RUNTIME_NAMES:
        from qwen3_research.devices import runtime  # deferred: start-up (runtime imports torch; this package must not)

        return getattr(runtime, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
