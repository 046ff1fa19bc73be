"""Everything device-specific: neuron / cuda / cpu facts and the CPU workarounds for torchtitan.

The rest of the code asks a ``Device`` questions (``dist_backend``, ``memory()``,
``peak_flops``, ``synchronize()``) and never branches on the device type itself.
Neuron modules (``torch_neuronx``) are imported only on the neuron path.
"""

from __future__ import annotations

import json
import os
import platform
import resource
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from qwen3_research.config import ConfigError

# Dense bf16 peak per device, from vendor datasheets (same figures torchtitan uses for MFU).
GPU_PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 125e12}
# One Trainium2 NeuronCore: 79 bf16 TFLOP/s; a logical core groups LNC physical ones.
TRN2_CORE_PEAK_BF16 = 79e12


def neuron_available() -> bool:
    try:
        import torch_neuronx  # noqa: F401  (registers the "neuron" device)
    except ImportError:
        return False
    return hasattr(torch, "neuron")


def resolve_device_type(requested: str) -> str:
    """auto -> neuron if TorchNeuron imports, else cuda if available, else cpu."""
    if requested == "auto":
        if neuron_available():
            return "neuron"
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "neuron" and not neuron_available():
        raise ConfigError(
            "device.type=neuron needs TorchNeuron (torch_neuronx from AWS's Neuron package index) "
            "and a Trainium host; it is not importable here. Use device=cpu or device=cuda, or see "
            "README 'Trainium hosts'"
        )
    if requested == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device.type=cuda but torch.cuda.is_available() is False; use device=cpu or device=auto")
    return requested


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
    """Facts and actions for one process's device."""

    def __init__(self, device_type: str, local_rank: int = 0, lnc: int | None = None):
        self.type = device_type
        self.local_rank = local_rank
        if device_type == "cuda":
            torch.cuda.set_device(local_rank)
            self.torch_device = torch.device("cuda", local_rank)
        elif device_type == "neuron":
            self.torch_device = torch.device("neuron", local_rank)
        else:
            self.torch_device = torch.device("cpu")
        self.lnc = lnc or int(os.environ.get("NEURON_LOGICAL_NC_CONFIG", "2"))
        self._peak: dict[str, float] = {}
        # CPU peak memory comes from ru_maxrss, a whole-process figure; remember where it stood so
        # a second run in the same process (a multirun point) does not inherit the first's peak.
        self._maxrss_at_start = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        self._sampled_peak = 0

    # -- distributed ------------------------------------------------------------------
    @property
    def dist_backend(self) -> str:
        return {"cuda": "nccl", "neuron": "neuron", "cpu": "gloo"}[self.type]

    # -- precision --------------------------------------------------------------------
    def autocast(self, mixed_precision: str):
        if mixed_precision == "bf16":
            return torch.autocast(device_type=self.type, dtype=torch.bfloat16)
        import contextlib

        return contextlib.nullcontext()

    # -- timing and memory ------------------------------------------------------------
    def synchronize(self) -> None:
        if self.type == "cuda":
            torch.cuda.synchronize(self.torch_device)
        elif self.type == "neuron":
            torch.neuron.synchronize()

    def reset_peak_memory(self) -> None:
        if self.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.torch_device)
        elif self.type == "neuron":
            torch.neuron.reset_peak_memory_stats()

    def memory(self) -> MemoryStats:
        """HBM on cuda/neuron; resident process memory (current, peak) and host RAM on cpu."""
        gib = 1024**3
        if self.type == "cuda":
            props = torch.cuda.get_device_properties(self.torch_device)
            return MemoryStats(
                torch.cuda.memory_allocated(self.torch_device) / gib,
                torch.cuda.max_memory_allocated(self.torch_device) / gib,
                props.total_memory / gib,
            )
        if self.type == "neuron":
            torch.neuron.synchronize()
            stats = torch.neuron.memory_stats()
            capacity = stats.get("total_bytes", 0) or 24 * gib * self.lnc  # trn2: 24 GiB HBM per physical core
            return MemoryStats(
                torch.neuron.memory_allocated() / gib, torch.neuron.max_memory_allocated() / gib, capacity / gib
            )
        import psutil

        rss = psutil.Process().memory_info().rss
        self._sampled_peak = max(self._sampled_peak, rss)
        maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
        # A new process-wide peak was set during this run: it is this run's. Otherwise this run
        # stayed below an earlier one's peak and the best we know is the largest sampled RSS.
        peak = maxrss if maxrss > self._maxrss_at_start else self._sampled_peak
        return MemoryStats(rss / gib, max(peak, rss) / gib, psutil.virtual_memory().total / gib)

    # -- peak FLOP/s for MFU -----------------------------------------------------------
    def peak_flops(self, dtype: torch.dtype = torch.float32) -> float:
        key = str(dtype)
        if key not in self._peak:
            self._peak[key] = self._lookup_peak(dtype)
        return self._peak[key]

    def _lookup_peak(self, dtype: torch.dtype) -> float:
        if self.type == "cuda":
            name = torch.cuda.get_device_name(self.torch_device)
            for key, value in GPU_PEAK_BF16.items():
                if key in name:
                    return value if dtype != torch.float32 else value / 2  # tf32 tensor cores
            return measure_matmul_peak(self.torch_device, dtype)
        if self.type == "neuron":
            return TRN2_CORE_PEAK_BF16 * self.lnc
        return cached_cpu_peak(dtype)


def _cache_dir() -> Path:
    root = os.environ.get("QWEN3_RESEARCH_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "qwen3_research"
    )
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path


def measure_matmul_peak(device: torch.device, dtype: torch.dtype, n: int = 1024, seconds: float = 0.4) -> float:
    """Best observed square-matmul FLOP/s: the practical peak of this device and thread count."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    best = 0.0
    deadline = time.perf_counter() + seconds
    a @ b  # warm-up
    # At least one timed product: a slow dtype (bf16 on a CPU without bf16 units takes longer
    # than ``seconds`` per product) would otherwise report, and cache, a peak of 0.
    while best == 0.0 or time.perf_counter() < deadline:
        t0 = time.perf_counter()
        a @ b
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = max(best, 2 * n**3 / (time.perf_counter() - t0))
    return best


def cached_cpu_peak(dtype: torch.dtype) -> float:
    """Measured CPU matmul peak, cached per (cpu, threads, dtype) so runs agree on MFU."""
    threads = torch.get_num_threads()
    key = f"{platform.processor() or platform.machine()}|{os.cpu_count()}|{threads}|{dtype}|torch{torch.__version__}"
    path = _cache_dir() / "cpu_peak.json"
    try:
        table = json.loads(path.read_text())
    except (OSError, ValueError):
        table = {}
    if key not in table:
        table[key] = measure_matmul_peak(torch.device("cpu"), dtype)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(table, indent=1))
        os.replace(tmp, path)
    return float(table[key])


def after_sharding(device: Device, model: torch.nn.Module) -> None:
    """CPU/gloo workaround: gloo has no ReduceOp.PREMUL_SUM, which FSDP2 uses to average."""
    if device.type != "cpu":
        return
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)
