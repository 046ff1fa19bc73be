"""The torch-using half of the devices package: one process's ``Device`` (its spec's facts and actions), the
torchtitan device pin, and the CPU/gloo workaround after sharding. Imported by whoever builds on a device (the
Trainer, the planner); ``devices`` itself stays torch-free."""

from __future__ import annotations

import contextlib
import os
import resource
from dataclasses import dataclass

import torch

from qwen3_research.devices.lnc import LNC_DEFAULT_NEURON, LNC_ENV, resolve_lnc
from qwen3_research.devices.registry import get


def prepare_torchtitan(device_type: str) -> None:
    """Make torchtitan see the device we chose. Call before the first torchtitan import.

    torchtitan computes ``device_type = _get_available_device_type() or "cuda"`` at import
    time, so a CPU-only host would be treated as CUDA. Pinning the answer keeps its mesh
    and MoE buffers on our device.
    """
    import torch._utils as tu

    tu._get_available_device_type = lambda: device_type  # type: ignore[assignment]


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
        self.torch_device = self.spec.torch_device(local_rank)
        # Off neuron the LNC only matters to kernel requirement checks; keep the trn2 default there.
        self.lnc = resolve_lnc(lnc, device_type) or LNC_DEFAULT_NEURON
        self._peak: dict[str, float] = {}
        self._capacity: int | None = None
        # what the cpu spec's peak-memory tracking keeps between calls (VmHWM, or ru_maxrss and sampled RSS)
        self._hwm_resettable = False
        self._maxrss_at_start = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        self._sampled_peak = 0
        self.peak_reset = "never"  # how this run's peak was last reset: cuda | neuron | VmHWM | ru_maxrss baseline

    # -- distributed ------------------------------------------------------------------
    @property
    def dist_backend(self) -> str:
        return self.spec.dist_backend

    # -- precision --------------------------------------------------------------------
    def autocast(self, mixed_precision: str):
        if mixed_precision == "bf16":
            return torch.autocast(device_type=self.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    # -- timing and memory ------------------------------------------------------------
    def synchronize(self) -> None:
        self.spec.synchronize(self)

    def reset_peak_memory(self) -> None:
        """Start this run's peak-memory counter (call at the start of every run: the device
        counters are process-wide, and a sweep runs several points in one process)."""
        self.peak_reset = self.spec.reset_peak_memory(self)

    def capacity_bytes(self) -> int:
        """Memory one rank can use: HBM of this rank's (logical) core / GPU; on cpu the host RAM (or its cgroup
        limit) divided among the ranks on this host."""
        if self._capacity is None:
            self._capacity = self.spec.capacity_bytes(self)
        return self._capacity

    def memory(self) -> MemoryStats:
        """HBM on cuda/neuron; resident process memory (current, peak) and host RAM on cpu."""
        gib = 1024**3
        current, peak = self.spec.memory_bytes(self)
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
    """CPU/gloo workaround: gloo has no ReduceOp.PREMUL_SUM, which FSDP2 uses to average."""
    if not get(device.type).gloo_sum_reduction:
        return
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)
