"""``DeviceSpec``: what the package asks of a device kind, as data and small functions (no torch at import).

A spec module (``cpu.py``, ``cuda.py``, ``neuron.py``) builds one ``DeviceSpec`` and ``registry.register``s it.
Fields that touch the device (``synchronize``, ``memory``, ``capacity``, ``peak``, ``autocast`` ...) are functions
that import torch when called; the rest is plain data a launching parent reads before torch is imported.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any, Callable, Mapping, NamedTuple


class Check(NamedTuple):
    """One doctor row: what was checked, what was found, ok | info | MISSING, and the fix when MISSING."""

    item: str
    value: str
    status: str = "ok"  # ok | info | MISSING
    fix: str = ""


def _nothing(*args, **kwargs) -> None:
    return None


def _no_rows(*args, **kwargs) -> list[Check]:
    return []


def _lnc_not_applicable(ctx) -> Check:
    return Check("LNC / logical cores", f"{'LNC=' + str(ctx.lnc) + ' exported' if ctx.lnc else 'n/a'} "
                 f"(no NeuronCores: device is {ctx.kind})", "info")


class DeviceSpec(NamedTuple):
    """One device kind (``device.type``). Every ``Callable`` takes what its docstring line says; the runtime ``Device``
    (``devices.runtime``) passes itself where a field takes ``dev``.

    Immutable, built with keywords. A ``NamedTuple`` rather than a frozen dataclass: the CPU allocator asks the
    registry for the device kind before its re-exec (``allocator.py``), so this class is built in every command's
    first process, where ``dataclasses`` (with ``inspect``) and a 60-field generated ``__init__`` cost ~15 ms of a
    config error's ~0.45 s (``benchmarks/bench_startup.py``)."""

    kind: str  # the device.type value and torch's device type
    # -- launching -----------------------------------------------------------------------------------------
    dist_backend: str  # torch.distributed backend: gloo | nccl | neuron
    start_method: str  # how a worker group starts: fork (nothing device-side to inherit) | spawn (runtimes not fork-safe)
    auto_order: int  # device.type=auto picks the present kind with the lowest order
    present: Callable[[], bool]  # torch-free: this host has the kind (auto picks it)
    available: Callable[[], bool]  # torch-checked: a run on this kind can start here (may import its runtime)
    visible: Callable[[], bool]  # torch-checked without importing or starting the kind's runtime (a launching parent)
    unavailable_reason: Callable[[], str]  # why ``available`` is False, and the fix (one line)
    local_devices: Callable[[int | None], int]  # devices of this host at an LNC (nproc_per_node=-1)
    refused_before_torch: bool = False  # ``present()`` is exact: validation refuses device.type=<kind> without torch
    refusal_prefix: str = ""  # what a refused device.type=<kind> says before ``unavailable_reason``
    prepare_launch: Callable[[int], None] = _nothing  # (world_size) before any worker or runtime starts
    # -- what auto settings become -------------------------------------------------------------------------
    default_precision: str = "none"  # training.mixed_precision=auto: bf16 | none
    default_loss: str = "full"  # training.loss=auto: chunked | full
    compile_backend: str = "inductor"  # torch.compile backend unless compile.backend says otherwise
    compile_default: Callable[..., tuple[bool, str]] | None = None  # (is_moe, mixed_precision, kernel_entries) ->
    # (compile.enable=auto on?, reason); None: off, not measured compiled
    compile_cache_facts: Callable[[bool], list[str]] = lambda probe: []  # cache-key parts (torch, driver, compiler)
    # -- facts ---------------------------------------------------------------------------------------------
    runs_on_host: bool = False  # its memory is the host's RAM (shared by the ranks on a host), the CPU itself
    planning_table: dict[str, tuple[float, float]] | None = None  # name -> (GiB, dense bf16 FLOP/s): planned without one
    kernels_by_shape: bool = False  # a plan for it traces its kernels by their documented output shapes
    flex_attention: bool = False  # FlexAttention trains here (forward and backward kernels)
    logical_cores: bool = False  # LNC (NEURON_LOGICAL_NC_CONFIG) applies to it
    torch_profiler: bool = True  # torch.profiler traces it (neuron: the runtime's own capture instead)
    profiler_activities: tuple[str, ...] = ("CPU",)  # torch.profiler.ProfilerActivity names
    memory_snapshot: str | None = None  # how ``profiling.memory_snapshot`` records: allocator | profiler | None
    profiler_environment: Callable[..., dict[str, str]] | None = None  # (ProfilingConfig, run_dir) -> runtime's env
    allocator: str = ""  # what allocates its tensors (reports; the CPU allocator choice is ``allocator.py``'s)
    cpu_allocator_auto: bool = False  # QWEN3_CPU_ALLOCATOR=auto preloads mimalloc for runs on this kind
    gloo_sum_reduction: bool = False  # FSDP2 must sum (gloo has no PREMUL_SUM): set_force_sum_reduction_for_comms
    rng_state_key: str | None = None  # the checkpoint's RNG key for the device generator (None: no device generator)
    peaks: Mapping[str, float] = MappingProxyType({})  # reference dense peak FLOP/s per rank by dtype key
    peak_source: str = ""  # where ``peaks`` come from
    measured_peak: Callable[[str], float] | None = None  # (dtype key) -> a measured peak where ``peaks`` has none
    # -- runtime (the Device passes itself as ``dev``) ------------------------------------------------------
    torch_device: Callable[[int], Any] = _nothing  # (local_rank) -> torch.device; sets the current device
    synchronize: Callable[[Any], None] = _nothing  # (dev)
    reset_peak_memory: Callable[[Any], str] = lambda dev: "never"  # (dev) -> how the peak was reset
    capacity_bytes: Callable[[Any], int] = lambda dev: 0  # (dev) -> bytes one rank may use
    memory_bytes: Callable[[Any], tuple[int, int]] = lambda dev: (0, 0)  # (dev) -> (current, peak) bytes
    peak_flops: Callable[[Any, str, Any], float] = lambda dev, key, dtype: 0.0  # (dev, bf16|fp32|tf32, dtype)
    peak_dtype: Callable[[Any], str] = lambda dtype: "fp32"  # (torch dtype of an fp32 run) -> fp32 | tf32
    observed_peak: Callable[[Any, float], float] | None = None  # (dtype, reached FLOP/s) -> raised peak (cpu)
    # -- the doctor (``doctor.DoctorContext`` in, rows out) --------------------------------------------------------
    device_rows: Callable[..., list[Check]] = _no_rows  # the "device" row (MISSING: not usable here) and notes
    lnc_row: Callable[..., Check] = _lnc_not_applicable  # the "LNC / logical cores" row
    doctor_rows: Callable[..., list[Check]] = _no_rows  # what else the host needs (neuron: neuron_host's checks)
    memory_row: Callable[..., Check | None] = lambda ctx: None  # the "memory per rank" row (None: none to show)
    verify_overrides: Callable[[int | None], list[str]] = lambda lnc: ["data.seq_len=32", "data.batch_size=2"]
    doctor_one_process: bool = False  # ``doctor --run`` runs each check as one process (one core each)

    def reference_peak(self, dtype: str) -> float:
        """The kind's reference dense peak FLOP/s per rank for ``dtype`` (bf16 | fp32 | tf32); KeyError if none."""
        if dtype not in self.peaks and self.measured_peak is not None:
            return self.measured_peak(dtype)
        if dtype not in self.peaks:
            raise KeyError(f"device {self.kind} has no reference {dtype} peak (it has {sorted(self.peaks) or 'none'})")
        return self.peaks[dtype]

