"""Everything device-specific: neuron / cuda / cpu facts and the CPU workarounds for torchtitan.

The rest of the code asks a ``Device`` questions (``dist_backend``, ``memory()``,
``peak_flops``, ``synchronize()``) and never branches on the device type itself.
Neuron modules (``torch_neuronx``) are imported only on the neuron path.
"""

from __future__ import annotations

import functools
import json
import os
import platform
import resource
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from qwen3_research.config import ConfigError

# -- peak FLOP/s per rank ------------------------------------------------------------------
# GPUs: the dense bf16 peak comes from torchtitan's own table (``titan.gpu_peak_flops``, which
# tells H100 SXM / PCIe / NVL apart; the Trainer hands it to ``Device``: device sits below titan). Plain fp32 matmuls do not run on the tensor cores unless
# TF32 is enabled (torch.backends.cuda.matmul.allow_tf32 / torch.set_float32_matmul_precision),
# so an fp32 run is measured against the fp32 (CUDA-core) peak, keyed by the bf16 peak the table
# returned. NVIDIA datasheets (dense, no sparsity): A100 19.5, H100 SXM / H200 67, H100 PCIe 51,
# H100 NVL 60, L40S 91.6, RTX A6000 38.7 TFLOP/s fp32. Dense TF32 is half the dense bf16 figure.
GPU_FP32_BY_BF16_PEAK = {312e12: 19.5e12, 989e12: 67e12, 756e12: 51e12, 835e12: 60e12, 362e12: 91.6e12,
                         154.85e12: 38.7e12}
# Trainium2, per physical NeuronCore-v3. bf16: AWS's torchtitan changes for Qwen3 report 157e12 per
# LNC=2 rank (parmoham-aws/test-repo-parmoham, docs/torchtitan/qwen3/TorchTitan.diff, get_peak_flops),
# i.e. 78.5e12 per physical core; the architecture page gives 79 BF16 TFLOPS per core
# (https://awsdocs-neuron.readthedocs-hosted.com/en/latest/about-neuron/arch/neuron-hardware/neuron-core-v3.html).
# fp32: 181 FP32 TFLOPS per 8-core chip (.../arch/neuron-hardware/trainium2.html) = 22.625e12 per core.
TRN2_CORE_PEAK = {"bf16": 157e12 / 2, "fp32": 181e12 / 8}

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


# -- logical NeuronCores (LNC) ---------------------------------------------------------------
# The Neuron runtime reads the LNC only from this variable, once, when it starts
# (torch_neuronx/csrc/core/utils/PlatformUtils.cpp: GetLogicalNeuronCores, in
# parmoham-aws/test-repo-parmoham); trn2/trn3 default to 2 there.
LNC_ENV = "NEURON_LOGICAL_NC_CONFIG"
LNC_DEFAULT_NEURON = 2


def resolve_lnc(configured: int | None, device_type: str, env=None) -> int | None:
    """The LNC this run uses: ``device.lnc`` or ``NEURON_LOGICAL_NC_CONFIG``; both set and different
    is a ConfigError. None off neuron when neither is set (nothing to export)."""
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
    if lnc is None and device_type == "neuron":
        lnc = LNC_DEFAULT_NEURON
    return lnc


def export_lnc(lnc: int | None) -> None:
    """Put the LNC in this process's environment, which every worker inherits (before any runtime starts)."""
    if lnc is not None:
        os.environ[LNC_ENV] = str(lnc)


def requested_device_kind(requested: str) -> str:
    """The device type a run would use, without importing TorchNeuron (safe in the launching parent)."""
    import importlib.util

    if requested != "auto":
        return requested
    if importlib.util.find_spec("torch_neuronx") is not None:
        return "neuron"
    return "cuda" if torch.cuda.is_available() else "cpu"


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


def resolve_nproc_per_node(requested: int, device_type: str, lnc: int | None) -> int:
    """``-1`` (auto, the default) = every device of this host: the logical NeuronCores at the LNC on
    neuron, the visible GPUs on cuda, 1 on cpu. Under torchrun, the processes torchrun started."""
    if requested != -1:
        return requested
    if "TORCHELASTIC_RUN_ID" in os.environ and "LOCAL_WORLD_SIZE" in os.environ:
        return int(os.environ["LOCAL_WORLD_SIZE"])
    if device_type == "neuron":
        return neuron_logical_core_count(lnc or LNC_DEFAULT_NEURON)
    if device_type == "cuda":
        return max(1, torch.cuda.device_count())
    return 1


# The memory controller's limit as a container sees its own cgroup (v2, then v1); "max" or a v1 value near 2**63
# (page-rounded) means none.
CGROUP_MEMORY_LIMITS = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")


def cgroup_memory_files() -> list[str]:
    """Where this process's memory limits may be: its own cgroup and (v2) every ancestor, from /proc/self/cgroup
    (a Slurm job step's cgroup, a systemd scope), then the container's root files."""
    out: list[str] = []
    try:
        entries = open("/proc/self/cgroup").read().splitlines()
    except OSError:
        entries = []
    for entry in entries:
        parts = entry.split(":", 2)
        if len(parts) != 3:
            continue
        controllers, path = parts[1], parts[2].strip("/")
        if controllers == "":  # v2: a limit on any ancestor applies too
            names = path.split("/") if path else []
            out += [f"/sys/fs/cgroup/{'/'.join(names[:i])}/memory.max".replace("//", "/") for i in range(len(names), 0, -1)]
        elif "memory" in controllers.split(","):
            out.append(f"/sys/fs/cgroup/memory/{path}/memory.limit_in_bytes".replace("//", "/"))
    return out + [p for p in CGROUP_MEMORY_LIMITS if p not in out]


def host_memory() -> tuple[int, str]:
    """Bytes of RAM this host's processes may use together, and where the figure came from: the lowest cgroup
    memory limit below the host's RAM (a container, a Slurm job with memory cgroups), else the RAM.
    The planner once credited every CPU rank with the whole host RAM, whatever the container allowed."""
    import psutil

    total, source = int(psutil.virtual_memory().total), "host RAM"
    for path in cgroup_memory_files():
        try:
            text = open(path).read().strip()
        except OSError:
            continue
        if text.isdigit() and 0 < int(text) < total:
            total, source = int(text), f"cgroup limit {path}"
    return total, source


def cpu_cores() -> int:
    """The cores this process may run on (its affinity: a container's or taskset's share, not the host's)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def host_nproc_per_node(world_size: int | None = None, nnodes: int = 1) -> int:
    """``nproc_per_node=-1`` where the run's device is not known: the launcher's world size if given,
    else every device of this host (its default device type, LNC from the environment)."""
    if world_size is not None:
        return max(1, world_size // max(1, nnodes))
    kind = requested_device_kind("auto")
    return resolve_nproc_per_node(-1, kind, resolve_lnc(None, kind))


def prepare_launch(device_type: str, lnc: int | None, world_size: int) -> None:
    """Before any worker (or runtime) starts, with the run's resolved values (``resolve.ResolvedRun``): export
    the LNC into the environment workers inherit, and on neuron give a single-process run one NeuronCore
    (``prepare_neuron_cores``)."""
    export_lnc(lnc)
    if device_type == "neuron":
        prepare_neuron_cores(world_size)


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


# -- test hook: stop once start-up validation has passed --------------------------------------------
# QWEN3_VALIDATE_ONLY=1 makes `python -m qwen3_research`, `verify_kernels` and the doctor's --run checks stop
# right before the first thing that needs the device (a worker, a Device, a model on it), exit 0, and print
# VALIDATE_ONLY_LINE. Used by tests/test_docs_commands.py to prove every documented Trainium command passes
# the project's own start-up validation on a simulated trn2 host; not a user option.
VALIDATE_ONLY_ENV = "QWEN3_VALIDATE_ONLY"
VALIDATE_ONLY_LINE = f"{VALIDATE_ONLY_ENV}=1 (test hook): start-up validation passed; stopping before the device is used"


def validate_only() -> bool:
    return os.environ.get(VALIDATE_ONLY_ENV) == "1"


def neuron_available() -> bool:
    try:
        import torch_neuronx  # noqa: F401  (registers the "neuron" device)
    except ImportError:
        return False
    return hasattr(torch, "neuron")


def cuda_unavailable_reason(env=None) -> str:
    """Why ``torch.cuda.is_available()`` is False here, and the fix: a CPU-only torch, a CUDA_VISIBLE_DEVICES
    that hides every GPU, or no GPU the driver can see."""
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
        raise ConfigError(f"device.type=cuda but torch.cuda.is_available() is False: {cuda_unavailable_reason()}")
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


def tf32_enabled() -> bool:
    """Whether fp32 matmuls on cuda may use TF32 tensor cores (off in PyTorch by default; this
    project never turns it on, so an fp32 run's MFU is over the fp32 peak unless the user does)."""
    return bool(torch.backends.cuda.matmul.allow_tf32) or torch.get_float32_matmul_precision() != "highest"


def _torch_device(device_type: str, index: int) -> torch.device:
    """The torch.device of a rank ("neuron" exists once torch_neuronx has registered it)."""
    return torch.device(device_type, index)


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


class Device:
    """Facts and actions for one process's device."""

    def __init__(self, device_type: str, local_rank: int = 0, lnc: int | None = None, *, gpu_peak_table=None):
        """``gpu_peak_table``: CUDA device name -> dense bf16 peak FLOP/s (``titan.gpu_peak_flops``, torchtitan's
        table); without it a GPU's bf16 peak is measured (``measure_matmul_peak``)."""
        self.type = device_type
        self._gpu_peak_table = gpu_peak_table
        self.local_rank = local_rank
        if device_type == "cuda":
            torch.cuda.set_device(local_rank)
            self.torch_device = torch.device("cuda", local_rank)
        elif device_type == "neuron":
            self.torch_device = _torch_device("neuron", local_rank)
        else:
            self.torch_device = torch.device("cpu")
        # Off neuron the LNC only matters to kernel requirement checks; keep the trn2 default there.
        self.lnc = resolve_lnc(lnc, device_type) or LNC_DEFAULT_NEURON
        self._peak: dict[str, float] = {}
        self._capacity: int | None = None
        # CPU peak memory: VmHWM, reset per run through /proc/self/clear_refs (Linux >= 4.0). Where
        # that is refused, ru_maxrss, a whole-process figure: remember where it stood so a second run
        # in the same process (a multirun point) does not inherit the first's peak.
        self._hwm_resettable = False
        self._maxrss_at_start = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        self._sampled_peak = 0
        self.peak_reset = "never"  # how this run's peak was last reset: cuda | neuron | VmHWM | ru_maxrss baseline

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
            torch.neuron.synchronize(self.local_rank)

    def reset_peak_memory(self) -> None:
        """Start this run's peak-memory counter (call at the start of every run: the device
        counters are process-wide, and a sweep runs several points in one process)."""
        if self.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.torch_device)
            self.peak_reset = "cuda"
        elif self.type == "neuron":
            # torch_neuronx/memory.py: reset_peak_memory_stats(device: int | torch.device | None)
            torch.neuron.reset_peak_memory_stats(self.local_rank)
            self.peak_reset = "neuron"
        else:
            try:
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")  # reset the peak RSS (VmHWM) to the current RSS
                self._hwm_resettable = _read_vm_hwm() is not None
            except OSError:
                self._hwm_resettable = False
            self._maxrss_at_start = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
            self._sampled_peak = 0
            self.peak_reset = "VmHWM" if self._hwm_resettable else "ru_maxrss baseline"

    def capacity_bytes(self) -> int:
        """Memory one rank can use: HBM of this rank's (logical) core / GPU; on cpu the host RAM (or its cgroup
        limit) divided among the ranks on this host."""
        if self._capacity is None:
            if self.type == "cuda":
                self._capacity = int(torch.cuda.get_device_properties(self.torch_device).total_memory)
            elif self.type == "neuron":
                # torch_neuronx/__init__.py: get_device_properties(device).total_memory, bytes of the
                # logical core's HBM (~24 GiB at LNC=2 on trn2: 96 GiB per 8-core chip). The index is
                # the rank's PyTorch device index (= local rank; NeuronDevice.cpp get_vnc_id).
                self._capacity = int(torch.neuron.get_device_properties(self.local_rank).total_memory)
            else:  # the host's memory (its cgroup limit) is shared by the ranks on it
                self._capacity = host_memory()[0] // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
        return self._capacity

    def memory(self) -> MemoryStats:
        """HBM on cuda/neuron; resident process memory (current, peak) and host RAM on cpu."""
        gib = 1024**3
        if self.type == "cuda":
            return MemoryStats(
                torch.cuda.memory_allocated(self.torch_device) / gib,
                torch.cuda.max_memory_allocated(self.torch_device) / gib,
                self.capacity_bytes() / gib,
            )
        if self.type == "neuron":
            self.synchronize()  # the counters change only once queued work has run
            return MemoryStats(
                torch.neuron.memory_allocated(self.local_rank) / gib,
                torch.neuron.max_memory_allocated(self.local_rank) / gib,
                self.capacity_bytes() / gib,
            )
        import psutil

        rss = psutil.Process().memory_info().rss
        self._sampled_peak = max(self._sampled_peak, rss)
        hwm = _read_vm_hwm() if self._hwm_resettable else None
        if hwm is not None:
            peak = hwm
        else:
            maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
            # A new process-wide peak was set during this run: it is this run's. Otherwise this run
            # stayed below an earlier one's peak and the best we know is the largest sampled RSS.
            peak = maxrss if maxrss > self._maxrss_at_start else self._sampled_peak
        return MemoryStats(rss / gib, max(peak, rss) / gib, self.capacity_bytes() / gib)

    # -- peak FLOP/s for MFU -----------------------------------------------------------
    def peak_flops(self, dtype: torch.dtype = torch.float32) -> float:
        """Dense peak FLOP/s of one rank for matmuls in ``dtype`` (the dtype the run computes in)."""
        key = self.peak_dtype(dtype)
        if key not in self._peak:
            self._peak[key] = self._lookup_peak(dtype, key)
        return self._peak[key]

    def observed_flops(self, dtype: torch.dtype, flops_per_s: float) -> float:
        """The peak for ``dtype`` after a run reached ``flops_per_s`` on one rank. On CPU the peak is the best
        matmul rate observed here (``cached_cpu_peak``); a measurement taken while other processes shared the cores
        is too low, and a run that beats it proves so: the peak is measured again and raised to at least what
        the run reached (and cached), so an MFU never exceeds 1. Other devices keep their table's peak."""
        peak = self.peak_flops(dtype)
        if self.type != "cpu" or flops_per_s <= peak:
            return peak
        self._peak[self.peak_dtype(dtype)] = raise_cpu_peak(dtype, flops_per_s)
        return self._peak[self.peak_dtype(dtype)]

    def peak_dtype(self, dtype: torch.dtype) -> str:
        """Which peak an MFU over ``dtype`` uses: bf16, fp32, or tf32 (fp32 with TF32 enabled on cuda)."""
        if dtype in (torch.bfloat16, torch.float16):
            return "bf16"
        if self.type == "cuda" and tf32_enabled():
            return "tf32"
        return "fp32"

    def _lookup_peak(self, dtype: torch.dtype, key: str) -> float:
        if self.type == "cuda":
            if self._gpu_peak_table is not None:
                bf16 = self._gpu_peak_table(torch.cuda.get_device_name(self.torch_device))
            else:
                bf16 = measure_matmul_peak(self.torch_device, torch.bfloat16)
            if key == "bf16":
                return bf16
            if key == "tf32":
                return bf16 / 2
            return GPU_FP32_BY_BF16_PEAK.get(bf16) or measure_matmul_peak(self.torch_device, torch.float32)
        if self.type == "neuron":
            return TRN2_CORE_PEAK["bf16" if key == "bf16" else "fp32"] * self.lnc
        return cached_cpu_peak(dtype)

    def facts(self, dtype: torch.dtype = torch.float32) -> dict:
        """What this rank runs on, as the run reports it (summary.json ``device_facts``)."""
        return {
            "rank": int(os.environ.get("RANK", 0)), "device": str(self.torch_device), "lnc": self.lnc,
            LNC_ENV: os.environ.get(LNC_ENV), "capacity_gib": round(self.capacity_bytes() / 1024**3, 3),
            "peak_flops": self.peak_flops(dtype), "peak_dtype": self.peak_dtype(dtype), "peak_reset": self.peak_reset,
        }


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


def _cpu_peak_table(dtype: torch.dtype) -> tuple[Path, dict, str]:
    threads = torch.get_num_threads()
    key = f"{platform.processor() or platform.machine()}|{os.cpu_count()}|{threads}|{dtype}|torch{torch.__version__}"
    path = _cache_dir() / "cpu_peak.json"
    try:
        table = json.loads(path.read_text())
    except (OSError, ValueError):
        table = {}
    return path, table, key


def _write_cpu_peak_table(path: Path, table: dict) -> None:
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(table, indent=1))
    os.replace(tmp, path)


def cached_cpu_peak(dtype: torch.dtype) -> float:
    """Measured CPU matmul peak, cached per (cpu, threads, dtype) so runs agree on MFU."""
    path, table, key = _cpu_peak_table(dtype)
    if key not in table:
        table[key] = measure_matmul_peak(torch.device("cpu"), dtype)
        _write_cpu_peak_table(path, table)
    return float(table[key])


def raise_cpu_peak(dtype: torch.dtype, reached: float) -> float:
    """The cached CPU peak raised to a rate a run ``reached`` (see ``Device.observed_flops``); returns it. No new
    measurement here: it runs inside a run's step loop, where its matmuls' buffers became the step's memory peak
    (a batch-1 sweep point reported 2.04 GiB, its step 1.19) and its seconds the step's time."""
    path, table, key = _cpu_peak_table(dtype)
    table[key] = max(float(table.get(key, 0.0)), reached)
    _write_cpu_peak_table(path, table)
    return float(table[key])


def after_sharding(device: Device, model: torch.nn.Module) -> None:
    """CPU/gloo workaround: gloo has no ReduceOp.PREMUL_SUM, which FSDP2 uses to average."""
    if device.type != "cpu":
        return
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)
