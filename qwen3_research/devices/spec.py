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
    """One device kind (``device.type``): what differs between kinds, as values and small functions. What torch
    abstracts for every device type (synchronize, memory counters, the generator's state, the device name, the
    allocator's history) is not here: ``devices.runtime`` asks ``torch.get_device_module`` for it (as torchtitan's
    ``device_module``), for the torch device type ``torch_type`` names. A kind's own state (the CPU's peak-RSS
    bookkeeping) is the object its ``memory`` builds; the runtime ``Device`` passes itself where a field takes ``dev``.

    Immutable, built with keywords. A ``NamedTuple`` rather than a frozen dataclass: the CPU allocator asks the
    registry for the device kind before its re-exec (``allocator.py``), so this class is built in every command's
    first process, where ``dataclasses`` (with ``inspect``) and a generated ``__init__`` cost ~15 ms of a config
    error's ~0.45 s (``benchmarks/bench_startup.py``)."""

    kind: str  # the device.type value
    # -- launching -----------------------------------------------------------------------------------------
    dist_backend: str  # torch.distributed backend: gloo | nccl | neuron
    start_method: str  # how a worker group starts: fork (nothing device-side to inherit) | spawn (runtimes not fork-safe)
    auto_order: int  # device.type=auto picks the present kind with the lowest order
    present: Callable[[], bool]  # torch-free: this host has the kind (auto picks it)
    available: Callable[[], bool]  # torch-checked: a run on this kind can start here (may import its runtime)
    visible: Callable[[], bool]  # torch-checked without importing or starting the kind's runtime (a launching parent)
    unavailable_reason: Callable[[], str]  # why ``available`` is False, and the fix (one line: a refusal's message)
    local_devices: Callable[[int | None], int]  # devices of this host at an LNC (nproc_per_node=-1)
    torch_type: str = ""  # torch's device type and ``torch.<type>`` module ("": the kind; a toy kind backed by cpu)
    refused_before_torch: bool = False  # ``present()`` is exact: validation refuses device.type=<kind> without torch
    prepare_launch: Callable[[int], None] = _nothing  # (world_size) before any worker or runtime starts
    default_lnc: int | None = None  # kinds with logical cores (LNC, NEURON_LOGICAL_NC_CONFIG): the LNC when unset
    # -- what auto settings become -------------------------------------------------------------------------
    default_precision: str = "none"  # training.mixed_precision=auto: bf16 | none
    default_loss: str = "full"  # training.loss=auto: chunked | full
    compile_backend: str = "inductor"  # torch.compile backend unless compile.backend says otherwise
    compile_default: Callable[..., tuple[bool, str]] | None = None  # (is_moe, mixed_precision, kernel_entries) ->
    # (compile.enable=auto on?, reason); None: off, not measured compiled
    compile_cache_facts: Callable[[bool], list[str]] = lambda probe: []  # cache-key parts (torch, driver, compiler)
    # -- facts ---------------------------------------------------------------------------------------------
    runs_on_host: bool = False  # its memory is the host's RAM and its compute the CPU (the CPU allocator applies)
    planning_table: dict[str, tuple[float, float]] | None = None  # name -> (GiB, dense bf16 FLOP/s): planned without one
    kernels_by_shape: bool = False  # a plan for it traces its kernels by their documented output shapes
    flex_attention: bool = False  # FlexAttention trains here (forward and backward kernels)
    # torch's pinned-memory checkpoint staging runs here (checkpoint.async_mode=async_with_pinned_mem): its
    # non-blocking copy asserts an accelerator (torch/distributed/checkpoint/staging.py), so CPU has none
    pinned_staging: bool = False
    profiler_activities: tuple[str, ...] = ("CPU",)  # torch.profiler.ProfilerActivity names; (): no torch.profiler
    # Environment set (unless already set) before torch.profiler first starts in a rank: Kineto reads its log level then
    profiler_log_env: Mapping[str, str] = MappingProxyType({})
    memory_snapshot: str | None = None  # how ``profiling.memory_snapshot`` records: allocator | profiler | None
    profiler_environment: Callable[..., dict[str, str]] | None = None  # (ProfilingConfig, run_dir) -> runtime's env
    peaks: Mapping[str, float] = MappingProxyType({})  # reference dense peak FLOP/s per rank by dtype key
    # -- runtime (the Device passes itself as ``dev``) ------------------------------------------------------
    torch_device: Callable[[str, int], Any] | None = None  # (torch_type, local_rank) -> torch.device; None: indexed
    memory: Callable[[Any], Any] | None = None  # (dev) -> the kind's own memory counters (``runtime.TorchMemory``'s
    # reset / current_and_peak / capacity); None: torch's device module's counters
    peak_flops: Callable[[Any, str, Any], float] = lambda dev, key, dtype: 0.0  # (dev, bf16|fp32|tf32, dtype)
    peak_dtype: Callable[[Any], str] = lambda dtype: "fp32"  # (torch dtype of an fp32 run) -> fp32 | tf32
    # () -> a 16-bit GEMM whose right operand is a row-major (V x D) matrix with V ~ 152k rows to reduce over takes a
    # slow kernel here, and a column-major copy of it does not (the chunked loss's hidden-state gradient: loss.py)
    slow_16bit_nn_gemm: Callable[[], bool] = lambda: False
    observed_peak: Callable[[Any, float], float] | None = None  # (dtype, reached FLOP/s) -> raised peak (cpu)
    # -- the doctor (``doctor.DoctorContext`` in, rows out) --------------------------------------------------------
    device_rows: Callable[..., list[Check]] = _no_rows  # the "device" row (MISSING: not usable here) and notes
    lnc_row: Callable[..., Check] = _lnc_not_applicable  # the "LNC / logical cores" row
    doctor_rows: Callable[..., list[Check]] = _no_rows  # what else the host needs (neuron: neuron_host's checks)
    memory_row: Callable[..., Check | None] = lambda ctx: None  # the "memory per rank" row (None: none to show)
    verify_overrides: Callable[[int | None], list[str]] = lambda lnc: ["data.seq_len=32", "data.batch_size=2"]
    doctor_one_process: bool = False  # ``doctor --run`` runs each check as one process (one core each)

    @property
    def torch_profiler(self) -> bool:
        """torch.profiler traces it (neuron: no activities, the runtime's own capture instead)."""
        return bool(self.profiler_activities)

    @property
    def logical_cores(self) -> bool:
        """LNC (NEURON_LOGICAL_NC_CONFIG) applies to it."""
        return self.default_lnc is not None

    @property
    def device_type(self) -> str:
        """torch's device type (``torch.device(...).type``, ``torch.get_device_module``'s key)."""
        return self.torch_type or self.kind

    def reference_peak(self, dtype: str) -> float:
        """The kind's reference dense peak FLOP/s per rank for ``dtype`` (bf16 | fp32 | tf32); KeyError if none."""
        if dtype not in self.peaks:
            raise KeyError(f"device {self.kind} has no reference {dtype} peak (it has {sorted(self.peaks) or 'none'})")
        return self.peaks[dtype]
