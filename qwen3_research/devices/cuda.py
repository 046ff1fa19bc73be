"""device=cuda: NVIDIA GPUs, NCCL, torchtitan's peak table, the caching allocator's memory history."""

from __future__ import annotations

import os
import shutil
import subprocess

from qwen3_research.devices import peaks
from qwen3_research.devices.registry import register
from qwen3_research.devices.spec import Check, DeviceSpec
from qwen3_research.errors import ConfigError

# -- peak FLOP/s per rank ------------------------------------------------------------------
# GPUs: the dense bf16 peak comes from torchtitan's own table (``titan.gpu_peak_flops``, which tells H100 SXM / PCIe /
# NVL apart; the Trainer hands it to ``Device``). Plain fp32 matmuls do not run on the tensor cores unless
# TF32 is enabled (torch.backends.cuda.matmul.allow_tf32 / torch.set_float32_matmul_precision),
# so an fp32 run is measured against the fp32 (CUDA-core) peak, keyed by the bf16 peak the table
# returned. NVIDIA datasheets (dense, no sparsity): A100 19.5, H100 SXM / H200 67, H100 PCIe 51,
# H100 NVL 60, L40S 91.6, RTX A6000 38.7 TFLOP/s fp32. Dense TF32 is half the dense bf16 figure.
GPU_FP32_BY_BF16_PEAK = {312e12: 19.5e12, 989e12: 67e12, 756e12: 51e12, 835e12: 60e12, 362e12: 91.6e12,
                         154.85e12: 38.7e12}

# GPUs a plan can be made for without having one (device=cuda device.gpu=NAME on a CPU-only host): memory per GPU in
# GiB (nvidia-smi's total, approximately; device.memory_gib overrides it) and the dense bf16 peak. The peaks are
# torchtitan's table (torchtitan.tools.utils.get_peak_flops, which has no L4 and falls back to A100's 312e12 for it:
# L4 is NVIDIA's datasheet, 242 TFLOP/s with sparsity, half dense).
PLANNED_GPUS = {
    "H200": (140.4, 989e12),
    "H100 SXM": (79.6, 989e12),
    "H100 PCIe": (79.6, 756e12),
    "H100 NVL": (93.6, 835e12),
    "A100": (79.2, 312e12),  # the 80 GB card; device.memory_gib=39.4 for the 40 GB one
    "L40S": (44.5, 362e12),
    "L4": (22.0, 121e12),
}
# The reference GPU (fit's ranking, devices.reference_peak("cuda", ...)): H100 SXM / H200, torchtitan's 989e12 bf16.
REFERENCE_GPU = "H100 SXM"
_REF_BF16 = PLANNED_GPUS[REFERENCE_GPU][1]
REFERENCE_PEAKS = {"bf16": _REF_BF16, "tf32": _REF_BF16 / 2, "fp32": GPU_FP32_BY_BF16_PEAK[_REF_BF16]}


def present() -> bool:
    """Without torch: the NVIDIA driver lists a GPU and CUDA_VISIBLE_DEVICES does not hide them all."""
    try:
        return bool(os.listdir("/proc/driver/nvidia/gpus")) and os.environ.get("CUDA_VISIBLE_DEVICES", "0") not in ("", "-1")
    except OSError:
        return False


def available() -> bool:
    import torch

    return torch.cuda.is_available()


def unavailable_reason(env=None) -> str:
    """Why ``torch.cuda.is_available()`` is False here, and the fix: a CPU-only torch, a CUDA_VISIBLE_DEVICES
    that hides every GPU, or no GPU the driver can see."""
    import torch

    env = os.environ if env is None else env
    if torch.version.cuda is None:
        return "this torch is a CPU-only build: install a CUDA build of torch on a GPU host, or use device=cpu"
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        first = visible.split(",")[0].strip()
        if not (first.isdigit() or first.startswith(("GPU-", "MIG-"))):  # CUDA stops at the first invalid entry
            return (f"CUDA_VISIBLE_DEVICES={visible!r} names no GPU (it takes GPU indices or GPU-/MIG- UUIDs, "
                    "e.g. 0,1): unset it or fix it, or use device=cpu")
        return (f"CUDA_VISIBLE_DEVICES={visible!r} selects no GPU the CUDA driver finds: check `nvidia-smi -L`, "
                "unset it, or use device=cpu")
    return "the CUDA driver finds no GPU on this host: check `nvidia-smi`, or use device=cpu"


def _local_devices(lnc) -> int:
    import torch

    return max(1, torch.cuda.device_count())


def tf32_enabled() -> bool:
    """Whether fp32 matmuls on cuda may use TF32 tensor cores (off in PyTorch by default; this
    project never turns it on, so an fp32 run's MFU is over the fp32 peak unless the user does)."""
    import torch

    return bool(torch.backends.cuda.matmul.allow_tf32) or torch.get_float32_matmul_precision() != "highest"


def _torch_device(device_type: str, local_rank: int):
    import torch

    torch.cuda.set_device(local_rank)  # later unindexed calls (NCCL's, the caching allocator's) use this GPU
    return torch.device(device_type, local_rank)


def _peak_flops(dev, key: str, dtype) -> float:
    import torch

    if dev._gpu_peak_table is not None:
        bf16 = dev._gpu_peak_table(dev.name())
    else:
        bf16 = peaks.measure_matmul_peak(dev.torch_device, torch.bfloat16)
    if key == "bf16":
        return bf16
    if key == "tf32":
        return bf16 / 2
    return GPU_FP32_BY_BF16_PEAK.get(bf16) or peaks.measure_matmul_peak(dev.torch_device, torch.float32)


def gpu_name_and_driver() -> tuple[str, str]:
    """GPU 0's name and the driver version, from nvidia-smi (no CUDA context in the launching parent); torch's
    name and 'unknown' where nvidia-smi is missing."""
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader", "-i", "0"],
                                 capture_output=True, text=True, timeout=30).stdout.strip().splitlines()
            if out and "," in out[0]:
                name, driver = (s.strip() for s in out[0].split(",", 1))
                return name, driver
        except (OSError, subprocess.SubprocessError):
            pass
    import torch

    return (torch.cuda.get_device_name(0) if torch.cuda.is_available() else "unknown-gpu"), "unknown"


def _compile_cache_facts(probe: bool) -> list[str]:
    if not probe:
        return []
    import torch

    name, driver = gpu_name_and_driver()
    return [name, f"driver{driver}", f"cuda{torch.version.cuda}"]


def _compile_default(is_moe: bool, mixed_precision: str, kernel_entries) -> tuple[bool, str]:
    """Measured (compiling.py's docstring, GUIDE §9): one H200, dense bf16, 1.67x faster compiled."""
    if not is_moe and mixed_precision == "bf16" and not kernel_entries:
        return True, "auto: cuda, dense, bf16 measured 1.67x faster compiled on one H200"
    why = "an MoE model" if is_moe else "kernel entries" if kernel_entries else f"training.mixed_precision={mixed_precision}"
    return False, f"auto: cuda with {why} has not been measured compiled"


def _device_rows(ctx) -> list[Check]:
    import torch

    if not torch.cuda.is_available():
        return [Check("device", f"{ctx.requested} -> cuda: torch.cuda.is_available() is False", "MISSING",
                      unavailable_reason())]
    return [Check("device", f"device.type={ctx.requested} -> cuda: {torch.cuda.get_device_name(0)}")]


def _memory_row(ctx) -> Check:
    import torch

    cap = torch.cuda.get_device_properties(0).total_memory
    return Check("memory per rank", f"{cap / 1024**3:.1f} GiB HBM (torch.cuda.get_device_properties)")


def planned_gpu(dev) -> tuple[float, float, str]:
    """(capacity GiB, dense bf16 peak FLOP/s, what they come from) of a GPU planned on a host without one
    (``device.gpu``, ``device.memory_gib``, ``device.peak_tflops`` of a DeviceConfig); a ConfigError naming the
    keys when neither a known name nor both numbers are given."""
    known = {k.lower().replace(" ", ""): k for k in PLANNED_GPUS}
    name = known.get((dev.gpu or "").lower().replace(" ", "").replace("-", ""))
    if dev.gpu and name is None:
        raise ConfigError(f"device.gpu={dev.gpu!r} is not in the planning table ({', '.join(PLANNED_GPUS)}); give "
                          "device.memory_gib and device.peak_tflops (dense bf16 TFLOP/s) instead")
    if name is None and (dev.memory_gib is None or dev.peak_tflops is None):
        raise ConfigError("device=cuda is not on this host: planning it needs device.gpu (one of "
                          f"{', '.join(PLANNED_GPUS)}) or device.memory_gib and device.peak_tflops")
    if dev.peak_tflops is not None and not dev.peak_tflops > 0:
        raise ConfigError(f"device.peak_tflops must be > 0, got {dev.peak_tflops}")
    mem, peak = PLANNED_GPUS[name] if name else (None, None)
    mem = dev.memory_gib if dev.memory_gib is not None else mem
    peak = dev.peak_tflops * 1e12 if dev.peak_tflops is not None else peak
    return float(mem), float(peak), (name or "device.memory_gib/device.peak_tflops")


SPEC = register(DeviceSpec(
    kind="cuda",
    dist_backend="nccl",
    start_method="spawn",  # the CUDA runtime is not fork-safe once anything has touched it (torchrun's default)
    auto_order=20,
    present=present,
    available=available,
    visible=available,  # torch.cuda.is_available() creates no CUDA context
    unavailable_reason=lambda: "device.type=cuda but torch.cuda.is_available() is False: " + unavailable_reason(),
    local_devices=_local_devices,
    default_precision="none",
    default_loss="full",  # the chunked loss has not been measured faster on a GPU (README, "Config reference")
    compile_backend="inductor",
    compile_default=_compile_default,
    compile_cache_facts=_compile_cache_facts,
    planning_table=PLANNED_GPUS,
    flex_attention=True,  # FlexAttention's training kernels (backward) exist on cuda only
    pinned_staging=True,  # torchtitan's async_with_pinned_mem: pinned host buffers filled on a CUDA copy stream
    profiler_activities=("CPU", "CUDA"),
    memory_snapshot="allocator",  # torch.cuda.memory._record_memory_history / _dump_snapshot
    # torchtitan's table (titan.gpu_peak_flops) for bf16; NVIDIA datasheets for fp32; TF32 half bf16
    peaks=REFERENCE_PEAKS,
    torch_device=_torch_device,
    peak_flops=_peak_flops,
    peak_dtype=lambda dtype: "tf32" if tf32_enabled() else "fp32",
    device_rows=_device_rows,
    memory_row=_memory_row,
))
