"""The torch-using half of the devices package: one process's ``Device`` (its spec's facts and actions), what torch's
device module does for any kind (``device_module``: memory counters, generator state, device name, the allocator's
history; one path for cuda and neuron, as torchtitan's ``device_module``), the torchtitan device pin, and the gloo
workaround after sharding. Imported by whoever builds on a device (the Trainer, the planner, the checkpoint's RNG
state, the profiler); ``devices`` itself stays torch-free."""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import torch

from qwen3_research.devices.lnc import LNC_ENV, resolve_lnc
from qwen3_research.devices.registry import get


def device_module(kind: str):
    """``torch.<type>`` of a device kind (``torch.cuda``; ``torch.neuron`` once torch_neuronx registered it;
    ``torch.cpu``): what ``torch.get_device_module(type)`` returns, as torchtitan's ``device_module``. Looked up by
    name: ``get_device_module`` first parses a device string (refused for a type whose backend has not registered
    yet) and caches its answer."""
    return getattr(torch, get(kind).device_type)


class TorchMemory:
    """A device's memory counters through its torch module (cuda, neuron: ``memory_allocated`` and the rest);
    a kind whose module has none (cpu) builds its own (``DeviceSpec.memory``)."""

    def __init__(self, dev: "Device"):
        self.module, self.index, self.kind = device_module(dev.type), dev.local_rank, dev.type

    def reset(self) -> str:
        self.module.reset_peak_memory_stats(self.index)
        return self.kind  # what reset the peak: cuda | neuron

    def current_and_peak(self) -> tuple[int, int]:
        self.module.synchronize(self.index)  # neuron's counters change only once queued work has run
        return self.module.memory_allocated(self.index), self.module.max_memory_allocated(self.index)

    def capacity(self) -> int:
        # neuron: bytes of the logical core's HBM (~24 GiB at LNC=2 on trn2); the index is the rank's device index
        return int(self.module.get_device_properties(self.index).total_memory)


def rng_state(kind: str) -> list[int] | None:
    """The device generator's state, where the kind's torch module has one of its own (cuda, neuron; a CPU-backed
    kind's generator is torch's, which the checkpoint holds anyway); None otherwise or before it is initialised."""
    module = device_module(kind)
    if not hasattr(module, "get_rng_state") or not module.is_available():
        return None
    if hasattr(module, "is_initialized") and not module.is_initialized():
        return None  # asking would start a runtime this process has not used
    return module.get_rng_state().tolist()


def set_rng_state(kind: str, state: list[int]) -> None:
    """Restore what ``rng_state`` saved (a state from another device type is the caller's to keep away)."""
    module = device_module(kind)
    if hasattr(module, "set_rng_state") and module.is_available():
        module.set_rng_state(torch.tensor(state, dtype=torch.uint8))


def record_memory_history(kind: str, enabled: bool) -> None:
    """Start (or stop) the device allocator's history (``torch.<type>.memory._record_memory_history``), for
    kinds whose spec says ``memory_snapshot="allocator"``."""
    memory = device_module(kind).memory
    if enabled:
        memory._record_memory_history(max_entries=100_000)
    else:
        memory._record_memory_history(enabled=None)


def dump_memory_snapshot(kind: str, path) -> None:
    """Write the allocator's history (``torch.<type>.memory._dump_snapshot``: a .pickle for pytorch.org/memory_viz)."""
    device_module(kind).memory._dump_snapshot(str(path))


def device_name(kind: str, index: int = 0) -> str | None:
    """Device ``index``'s name as its torch module reports it (``get_device_name``: the key of torchtitan's GPU peak
    table), None where the module has none or no device of the kind is available here."""
    module = device_module(kind)
    if not hasattr(module, "get_device_name") or not module.is_available():
        return None
    return module.get_device_name(index)


def prepare_torchtitan(device_type: str) -> None:
    """Make torchtitan see the device we chose. Call before the first torchtitan import.

    torchtitan computes ``device_type = _get_available_device_type() or "cuda"`` at import
    time, so a CPU-only host would be treated as CUDA. Pinning the answer keeps its mesh
    and MoE buffers on our device.
    """
    import torch._utils as tu

    torch_type = get(device_type).device_type  # a kind backed by another's device (tests' toy: cpu) pins that one
    tu._get_available_device_type = lambda: torch_type  # type: ignore[assignment]


def _indexed(device_type: str, local_rank: int):
    """A rank's torch.device when its spec builds none: the type at the rank's index (neuron: ``torch.device("neuron",
    local_rank)``, a type once torch_neuronx has registered it)."""
    return torch.device(device_type, local_rank)


@dataclass
class MemoryStats:
    current_gib: float
    peak_gib: float
    capacity_gib: float

    @property
    def peak_pct(self) -> float:
        return 100.0 * self.peak_gib / self.capacity_gib if self.capacity_gib else 0.0


class Device:
    """Facts and actions for one process's device: its ``spec`` (``devices.get(type)``) applied to this rank."""

    def __init__(self, device_type: str, local_rank: int = 0, lnc: int | None = None, *, gpu_peak_table=None):
        """``gpu_peak_table``: CUDA device name -> dense bf16 peak FLOP/s (``titan.gpu_peak_flops``, torchtitan's
        table); without it a GPU's bf16 peak is measured (``peaks.measure_matmul_peak``)."""
        self.type = device_type
        self.spec = get(device_type)
        self._gpu_peak_table = gpu_peak_table
        self.local_rank = local_rank
        self.torch_device = (self.spec.torch_device or _indexed)(self.spec.device_type, local_rank)
        # None on a kind without logical cores unless device.lnc / NEURON_LOGICAL_NC_CONFIG says one
        self.lnc = resolve_lnc(lnc, device_type)
        self._peak: dict[str, float] = {}
        self._capacity: int | None = None
        self._memory = (self.spec.memory or TorchMemory)(self)  # the counters, and what a kind keeps between calls
        self.peak_reset = "never"  # how this run's peak was last reset: cuda | neuron | VmHWM | ru_maxrss baseline

    def name(self) -> str:
        """This rank's device name (``torch.<type>.get_device_name``)."""
        return device_module(self.type).get_device_name(self.local_rank)

    # -- distributed ------------------------------------------------------------------
    @property
    def dist_backend(self) -> str:
        return self.spec.dist_backend

    # -- precision --------------------------------------------------------------------
    def autocast(self, mixed_precision: str):
        if mixed_precision == "bf16":
            return torch.autocast(device_type=self.spec.device_type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    # -- timing and memory ------------------------------------------------------------
    def synchronize(self) -> None:
        device_module(self.type).synchronize(self.local_rank)  # torch.cpu's is a no-op

    def reset_peak_memory(self) -> None:
        """Start this run's peak-memory counter (call at the start of every run: the device
        counters are process-wide, and a sweep runs several points in one process)."""
        self.peak_reset = self._memory.reset()

    def capacity_bytes(self) -> int:
        """Memory one rank can use: HBM of this rank's (logical) core / GPU; on cpu the host RAM (or its cgroup
        limit) divided among the ranks on this host."""
        if self._capacity is None:
            self._capacity = self._memory.capacity()
        return self._capacity

    def memory(self) -> MemoryStats:
        """HBM on cuda/neuron; resident process memory (current, peak) and host RAM on cpu."""
        gib = 1024**3
        current, peak = self._memory.current_and_peak()
        return MemoryStats(current / gib, peak / gib, self.capacity_bytes() / gib)

    # -- peak FLOP/s for MFU -----------------------------------------------------------
    def peak_flops(self, dtype: torch.dtype = torch.float32) -> float:
        """Dense peak FLOP/s of one rank for matmuls in ``dtype`` (the dtype the run computes in)."""
        key = self.peak_dtype(dtype)
        if key not in self._peak:
            self._peak[key] = self.spec.peak_flops(self, key, dtype)
        return self._peak[key]

    def observed_flops(self, dtype: torch.dtype, flops_per_s: float) -> float:
        """The peak for ``dtype`` after a run reached ``flops_per_s`` on one rank. On CPU the peak is the best
        matmul rate observed here (``peaks.cached_cpu_peak``); a measurement taken while other processes shared the
        cores is too low, and a run that beats it proves so: the peak is raised to at least what the run reached
        (and cached), so an MFU never exceeds 1. Other devices keep their table's peak (``spec.observed_peak``)."""
        peak = self.peak_flops(dtype)
        if self.spec.observed_peak is None or flops_per_s <= peak:
            return peak
        self._peak[self.peak_dtype(dtype)] = self.spec.observed_peak(dtype, flops_per_s)
        return self._peak[self.peak_dtype(dtype)]

    def peak_dtype(self, dtype: torch.dtype) -> str:
        """Which peak an MFU over ``dtype`` uses: bf16, fp32, or tf32 (fp32 with TF32 enabled on cuda)."""
        if dtype in (torch.bfloat16, torch.float16):
            return "bf16"
        return self.spec.peak_dtype(dtype)

    def facts(self, dtype: torch.dtype = torch.float32) -> dict:
        """What this rank runs on, as the run reports it (summary.json ``device_facts``)."""
        return {
            "rank": int(os.environ.get("RANK", 0)), "device": str(self.torch_device), "lnc": self.lnc,
            LNC_ENV: os.environ.get(LNC_ENV), "capacity_gib": round(self.capacity_bytes() / 1024**3, 3),
            "peak_flops": self.peak_flops(dtype), "peak_dtype": self.peak_dtype(dtype), "peak_reset": self.peak_reset,
        }


def after_sharding(device: Device, model: torch.nn.Module) -> None:
    """gloo workaround: gloo has no ReduceOp.PREMUL_SUM, which FSDP2 uses to average (a backend's fact, not a kind's)."""
    if device.dist_backend != "gloo":
        return
    from torch.distributed.fsdp import FSDPModule

    # a pipelined model's stages are FSDP units at their roots, outside its module tree (models/native StageParts)
    for part in getattr(model, "stage_parts", None) or [model]:
        for module in part.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)
