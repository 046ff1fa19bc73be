"""device=cpu: the host's CPU, gloo, and the workarounds torchtitan needs there."""

from __future__ import annotations

import functools
import os
import resource
from collections.abc import Mapping
from types import MappingProxyType

from qwen3_research.devices import host, peaks
from qwen3_research.devices.registry import register
from qwen3_research.devices.spec import Check, DeviceSpec


def _read_vm_hwm() -> int | None:
    """This process's peak resident set (VmHWM, bytes); resettable through /proc/self/clear_refs."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _torch_device(device_type: str, local_rank: int):
    import torch

    return torch.device(device_type)  # one CPU device, whatever the rank


class HostMemory:
    """The process's resident memory as a device's memory (``DeviceSpec.memory``): current RSS and this run's peak.
    The peak is VmHWM, reset per run through /proc/self/clear_refs (Linux >= 4.0); where that is refused, ru_maxrss,
    a whole-process figure, remembered where it stood so a second run in the same process (a multirun point) does
    not inherit the first's peak."""

    def __init__(self, dev=None):
        self.hwm_resettable = False
        self.maxrss_at_start = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        self.sampled_peak = 0

    def reset(self) -> str:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # reset the peak RSS (VmHWM) to the current RSS
            self.hwm_resettable = _read_vm_hwm() is not None
        except OSError:
            self.hwm_resettable = False
        self.maxrss_at_start = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        self.sampled_peak = 0
        return "VmHWM" if self.hwm_resettable else "ru_maxrss baseline"

    def capacity(self) -> int:
        """The host's memory (its cgroup limit), shared by the ranks on it."""
        return host.host_memory()[0] // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))

    def current_and_peak(self) -> tuple[int, int]:
        import psutil

        rss = psutil.Process().memory_info().rss
        self.sampled_peak = max(self.sampled_peak, rss)
        hwm = _read_vm_hwm() if self.hwm_resettable else None
        if hwm is not None:
            peak = hwm
        else:
            maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
            # A new process-wide peak was set during this run: it is this run's. Otherwise this run
            # stayed below an earlier one's peak and the best we know is the largest sampled RSS.
            peak = maxrss if maxrss > self.maxrss_at_start else self.sampled_peak
        return rss, max(peak, rss)


def _peak_flops(dev, key: str, dtype) -> float:
    return peaks.cached_cpu_peak(dtype)


class MeasuredPeaks(Mapping):
    """A CPU has no datasheet peak here: its reference peaks (``DeviceSpec.peaks``) are its own matmul rate, measured
    on first use and cached (``peaks.cached_cpu_peak``). Without bf16 units (AVX2-only) bf16 is emulated and ~100x
    slower; with AVX512-BF16 or AMX it is the faster one (GUIDE §7)."""

    KEYS = ("bf16", "fp32", "tf32")

    def __getitem__(self, key: str) -> float:
        if key not in self.KEYS:
            raise KeyError(key)
        return peaks.cached_cpu_peak(peaks.torch_dtype(key))

    def __iter__(self):
        return iter(self.KEYS)

    def __len__(self) -> int:
        return len(self.KEYS)


@functools.lru_cache(maxsize=None)
def cpu_isa() -> str:
    """The CPU's matrix/vector level a speed measurement holds for: avx512bf16 (bf16 units: AVX512-BF16 or AMX),
    avx512 or avx2 (GUIDE §7: bf16 is 10-100x slower than fp32 without bf16 units, faster with them). torch answers
    first: ``torch.cpu.get_capabilities()`` for the bf16 units and ``torch.backends.cpu.get_cpu_capability()`` for
    the vector ISA ATen dispatches to; /proc/cpuinfo's flags only where torch does not answer (another CPU
    architecture, an older torch)."""
    import torch

    caps = getattr(torch.cpu, "get_capabilities", None)
    # torch's names (avx512_f) and the kernel's (avx512f) of the one flag where they differ
    flags = {k for k, v in caps().items() if v is True} if caps else _cpuinfo_flags()
    if flags & {"avx512_bf16", "amx_bf16"}:
        return "avx512bf16"
    capability = torch.backends.cpu.get_cpu_capability()  # AVX512 | AVX2 | DEFAULT | VSX | ZVECTOR | SVE256 ...
    if capability in ("AVX512", "AVX2"):
        return capability.lower()
    return "avx512" if flags & {"avx512_f", "avx512f"} else "avx2"


def _cpuinfo_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return set(next((ln for ln in f if ln.startswith("flags")), "").partition(":")[2].split())
    except OSError:
        return set()


def cpu_id() -> str:
    """The CPU's model name and a hash of its feature flags: EPYCs of one name differ in AVX-512 / AVX512-BF16
    (GUIDE §7), and inductor's C++ kernels are built for the host's vector ISA."""
    import hashlib  # here, not at the top: 5 ms of every start (the allocator's re-exec pays it twice)
    import platform

    name, flags = platform.machine(), ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and name == platform.machine():
                    name = value.strip()
                elif key.strip() == "flags" and not flags:
                    flags = value.strip()
                if flags and name != platform.machine():
                    break
    except OSError:
        pass
    return f"{name}-isa{hashlib.sha256(flags.encode()).hexdigest()[:6]}"


def _compile_default(is_moe: bool, mixed_precision: str, kernel_entries) -> tuple[bool, str]:
    return False, "auto: cpu, a 20-30 s first compile outweighs short runs; compile.enable=true for long ones"


def _device_rows(ctx) -> list[Check]:
    return [Check("device", f"device.type={ctx.requested} -> cpu ({os.cpu_count()} cores)")]


def _memory_row(ctx) -> Check:
    total, source = host.host_memory()
    n = ctx.ranks_here  # the ranks on this host share it
    return Check("memory per rank", f"{total / n / 1024**3:.1f} GiB ({total / 1024**3:.1f} GiB {source}"
                 + (f" / {n} ranks" if n > 1 else "") + ", cpu)", "info")


SPEC = register(DeviceSpec(
    kind="cpu",
    dist_backend="gloo",
    # a forked worker shares the parent's pages and starts in milliseconds; nothing device-side to inherit
    start_method="fork",
    auto_order=100,  # the fallback: always present
    present=lambda: True,
    available=lambda: True,
    visible=lambda: True,
    unavailable_reason=lambda: "",
    local_devices=lambda lnc: 1,
    default_precision="none",
    # chunked: measured faster than the full loss on CPU with the same losses (benchmarks/RESULTS.md)
    default_loss="chunked",
    compile_backend="inductor",
    compile_default=_compile_default,
    compile_cache_facts=lambda probe: [cpu_id()],
    runs_on_host=True,  # also: QWEN3_CPU_ALLOCATOR=auto preloads mimalloc for its runs (allocator.py)
    profiler_activities=("CPU",),
    # Kineto's own lines on every CPU profile: "USDT: ... profiler_start/profiler_stop" and, with torch's CUDA wheel,
    # "ERROR: ... gpuGetDeviceCount failed with code 35" (issue 40 weak case). 6 is above its every level (4 and 5
    # still print USDT); the trace file and the run's own "profile written" line are what a CPU profile gives.
    profiler_log_env=MappingProxyType({"KINETO_LOG_LEVEL": "6"}),
    # the CPU allocator keeps no history: the torch profiler records every allocation (profile_memory=True)
    memory_snapshot="profiler",
    peaks=MeasuredPeaks(),
    torch_device=_torch_device,
    memory=HostMemory,
    peak_flops=_peak_flops,
    # ATen's own bf16 GEMM runs where oneDNN's needs AVX-512: for (64 x 152k) @ (152k x 64), 5.1 s with a row-major
    # right operand against 0.19 s with a column-major one (AVX2 EPYC, torch 2.14; benchmarks/RESULTS.md row 23)
    slow_16bit_nn_gemm=lambda: cpu_isa() == "avx2",
    observed_peak=peaks.raise_cpu_peak,
    device_rows=_device_rows,
    memory_row=_memory_row,
))
