"""The memory plan's core: trace one real training step per rank role on fake tensors, the closed-form
cross-check, and the verdict (``make_plan`` -> ``Plan``; ``render`` is its table).

``python -m qwen3_research.plan`` (``qwen3_research.plan``) is the command; its help (that module's docstring)
says what is traced and how. A sweep plans its points here before the first one starts
(``qwen3_research.launch.sweep.plan_points``).
"""

from __future__ import annotations

import contextlib
import functools
import multiprocessing
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode, is_fake, unset_fake_temporarily
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._sharding_prop import ShardingPropagator
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils._pytree import tree_leaves
from torch.utils._python_dispatch import TorchDispatchMode

from qwen3_research import compiling, lora_params, models, parallel, tables, titan
from qwen3_research import devices
from qwen3_research.kernels.registry import planning_for
from qwen3_research.memory import tracked
from qwen3_research.closed_form import estimate
from qwen3_research.resolve import ResolvedRun, resolve_run
from qwen3_research.step import Placement, build_step

TIGHT_FRACTION = 0.85  # above this share of the capacity: "tight" (allocator fragmentation, runtime buffers)
GIB = 1024**3


@dataclass
class RankPlan:
    rank: int
    traced: dict  # category -> bytes at the traced peak (MemTracker's categories)
    peak: int  # traced peak live tensor bytes
    estimate: dict = field(default_factory=dict)  # closed form: category -> bytes, and "peak"
    even_shards: bool = False  # every sharded parameter dimension divides evenly over its mesh axis
    kernel_lines: list[str] = field(default_factory=list)  # the kernel plan's cost lines of this rank
    kernel_saved: int = 0  # bytes the kernels keep for backward (KernelSpec.cost), in the traced peak
    param_shards: int | None = None  # this rank's own (sharded) parameter bytes; traced params − this = gathered
    params_max: int | None = None  # the largest parameter bytes over the step (shards + FSDP's gathered copies)
    stages: list[int] | None = None  # parallelism.pp > 1: this rank's pipeline stage indices


@dataclass
class Plan:
    ranks: list[RankPlan]
    capacity_gib: float
    capacity_source: str
    world_size: int
    layout: str
    tokens_per_step: int
    flops_per_step: float
    trace_s: float
    mirrored: list[int] = field(default_factory=list)  # ranks not traced: same shapes as rank 0 (see make_plan)
    planned_for: str | None = None  # the device a plan made on another host is for (device=neuron or cuda here)
    compile_line: str = ""  # compile on/off for the planned run and what compile does to the peak (measured factor)
    predicted_step_s: float | None = None  # cuda: FLOPs per step / (dense bf16 peak x the measured MFU)
    step_line: str = ""
    kernel_lines: list[str] = field(default_factory=list)  # the kernel plan's cost lines (KernelSpec.cost)
    lora_line: str = ""  # model.lora: the adapters (trainable) and the frozen base, by the closed form's count
    mirror_of: dict = field(default_factory=dict)  # mirrored rank -> the traced rank whose shapes it has

    @property
    def peak(self) -> int:
        return max(r.peak for r in self.ranks)

    @property
    def peak_gib(self) -> float:
        return self.peak / GIB

    @property
    def verdict(self) -> str:
        frac = self.peak_gib / self.capacity_gib
        if frac > 1.0:
            return "does not fit"
        return "tight" if frac > TIGHT_FRACTION else "fits with headroom"

    @property
    def fits(self) -> bool:
        return self.verdict != "does not fit"

    def as_dict(self) -> dict:
        """What a run records (W&B config, summary.json) and a sweep compares."""
        out = {"predicted_peak_gib": round(self.peak_gib, 4), "capacity_gib": round(self.capacity_gib, 2),
               "verdict": self.verdict, "per_rank_peak_gib": {r: round(b / GIB, 4) for r, b in self.per_rank_peak().items()}}
        if self.per_stage_peak():
            out["per_stage_peak_gib"] = {s: round(b / GIB, 4) for s, b in self.per_stage_peak().items()}
        return out

    def per_rank_peak(self) -> dict[int, int]:
        """Peak bytes of every traced rank and the ranks mirrored from them (a mirrored rank has its source's)."""
        traced = {r.rank: r.peak for r in self.ranks}
        out = dict(traced)
        for rank in self.mirrored:
            out[rank] = traced[self.mirror_of.get(rank, self.ranks[0].rank)]
        return dict(sorted(out.items()))

    def per_stage_peak(self) -> dict[int, int]:
        """A pipelined plan's peak per pipeline stage (the largest of the traced ranks holding it); {} without pp."""
        out: dict[int, int] = {}
        for r in self.ranks:
            for stage in r.stages or ():
                out[stage] = max(out.get(stage, 0), r.peak)
        return dict(sorted(out.items()))


# -- the trace ---------------------------------------------------------------------------------
def _optimizer_state_as_after_one_step(step) -> None:
    """Create the optimizer's state (AdamW's two moments per parameter) as the first step does.

    Every step after the first runs its forward and backward with that state alive, so a run's peak is
    in a steady step, not the first (for ``tiny`` the moments are 16 % of the peak). On fake tensors the
    values do not matter: zero gradients and one untracked optimizer step give the state its real shapes,
    dtypes and placements; the traced step is then a steady one.
    """
    for p in step.backend.model.parameters():
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    # One parameter at a time (foreach off) for this untracked step: its state is the same, and a foreach op over
    # DTensors is sharding-propagated uncached under the fake mode (torch caches it only outside tracing), ~4.5 s an
    # op for trn2_lora's 392 adapters, so this step took 2 minutes of that plan's 6. The traced step keeps foreach.
    groups = step.optimizer.param_groups
    foreach = [g.get("foreach") for g in groups]
    for g in groups:
        g["foreach"] = False
    try:
        step.optimizer.step()
    finally:
        for g, f in zip(groups, foreach):
            g["foreach"] = f
    step.optimizer.zero_grad(set_to_none=True)


def trace_placement(run, rank: int, world: int) -> Placement:
    """Where the planner builds ``run``'s step: fake CPU tensors (torchtitan prepared for the CPU), ``rank`` of
    ``world`` on the fake process group ``trace_rank`` started, torchtitan's mesh built on it here, on the host
    (a mesh reads its rank map with ``tolist`` and ``nonzero``, which fake tensors do not have), and a gather that
    gives every slot this rank's object (the fake group has no other rank)."""
    cpu = "cpu"  # the fake tensors' dispatch path, whatever device the run is planned for
    devices.prepare_torchtitan(cpu)
    device = devices.Device(cpu, 0, run.rc.device.lnc, gpu_peak_table=titan.gpu_peak_flops)
    parallel_dims = parallel.build_parallel_dims(run.degrees, cpu, single_process_mesh=run.model["is_moe"])
    return Placement(device, rank, world, parallel_dims, functools.partial(_every_slot_mine, world=world), trace=True)


def _every_slot_mine(obj, *, world: int) -> list:
    return [obj] * world


class _HostWork(TorchDispatchMode):
    """What a real run does on the host, done so under the plan's fake mode too (entered inside it).

    An operator none of whose tensors is fake and that moves nothing to another device runs as it would in a run:
    - the meta-device model build: fake *meta* parameters cannot be moved by ``to_empty`` when two modules share
      one (tied embeddings), plain meta ones can (``to_empty`` under the fake mode then makes them fake CPU
      tensors); a factory on the meta device (``torch.device("meta")``) stays plain meta;
    - a device mesh that FSDP concatenates over tensor parallel (``DeviceMesh._concatenate``) reads its rank map
      with ``nonzero`` and ``tolist``: host work on a host tensor;
    - the data's token rows (``torch.from_numpy``): sliced on the host, as in a run.
    Everything else (the model's parameters, activations, gradients, optimizer state) is fake.
    """

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _on_the_host(args, kwargs):
            with unset_fake_temporarily():
                return func(*args, **kwargs)
        return func(*args, **kwargs)


def _on_the_host(args, kwargs) -> bool:
    tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    if any(is_fake(t) for t in tensors):
        return False
    target = kwargs.get("device")
    kinds = {t.device.type for t in tensors} | ({torch.device(target).type} if target is not None else set())
    if not tensors:  # a factory: only on the meta device
        return kinds == {"meta"}
    return len(kinds) == 1


@contextlib.contextmanager
def _sharding_propagation_in_its_own_fake_mode():
    """DTensor's sharding propagation runs each operator on global-shape fake tensors to learn the output's shape,
    in ``detect_fake_mode() or FakeTensorMode()``: in a real run a fresh mode that MemTracker ignores, under the
    plan the plan's own mode, whose global-shape temporaries MemTracker would count as this rank's memory (the
    optimizer's foreach ops over every parameter: 8x the parameter bytes of the real peak at tp=2). It gets a
    fresh mode here too: the plan's one patch (tests/test_stack.py ALLOWED_PLANNER_PATCH)."""
    original = ShardingPropagator._propagate_tensor_meta_non_cached

    def in_a_fresh_mode(*args, **kwargs):
        with unset_fake_temporarily():
            return original(*args, **kwargs)

    ShardingPropagator._propagate_tensor_meta_non_cached = in_a_fresh_mode
    try:
        yield
    finally:
        ShardingPropagator._propagate_tensor_meta_non_cached = original


def trace_rank(run, rank: int, world: int) -> RankPlan:
    """One training step of the run's own step (``step.build_step``, ``Step.__call__``) as ``rank`` of ``world``,
    on fake tensors; live tensor bytes. ``run``: the resolved run (``resolve.ResolvedRun``), as it is: the trace
    placement (``trace_placement``) says fake CPU tensors, nothing loaded, compiled or written."""
    if dist.is_initialized():
        dist.destroy_process_group()
    if world > 1:
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        where = trace_placement(run, rank, world)
        with tempfile.TemporaryDirectory(prefix="qwen3_plan_") as run_dir, \
                _sharding_propagation_in_its_own_fake_mode(), FakeTensorMode(allow_non_fake_inputs=True), _HostWork(), \
                contextlib.redirect_stdout(sys.stderr):
            step = build_step(run, where, run_dir=run_dir)
            _optimizer_state_as_after_one_step(step)
            with titan.balanced_expert_exchange():  # after the step's build imported torchtitan for its device
                _, cats, peak, most = tracked(step, step.backend.model, step.optimizer)
            even = world > 1 and step.degrees.ep == 1 and evenly_sharded(step.backend.model)
            kp = step.kernel_plan
            lines = [ln.strip() for ln in getattr(kp, "text", "").splitlines()
                     if ln.startswith("    ") and not ln.strip().startswith("layers.")]
            kernel_saved = sum(getattr(kp, "saved_bytes", {}).values())
            shards = parallel.state_bytes(step.backend.model)["params"]
            stages = list(step.pipeline.stages) if step.pipeline is not None else None
        return RankPlan(rank, cats, peak, even_shards=even, kernel_lines=lines, kernel_saved=int(kernel_saved),
                        param_shards=int(shards), params_max=most["params"], stages=stages)
    finally:
        if dist.is_initialized():  # also the one-rank group of a single MoE process
            dist.destroy_process_group()


def evenly_sharded(model) -> bool:
    """True when every parameter's sharded dimensions divide evenly over their mesh axes.

    Then every rank holds local parameters, gradients and optimizer state of the same shapes, gets a
    batch of the same shape (data parallel) or the same slice sizes (tensor parallel), and runs the
    same operators: its live bytes are rank 0's at every point of the step. An uneven dimension gives
    the last rank smaller shards (torch's Shard: ceil-sized leading shards), so both are traced.
    """
    for p in model.parameters():
        if not isinstance(p, DTensor):
            continue
        for axis, placement in enumerate(p.placements):
            if isinstance(placement, Shard) and p.shape[placement.dim] % p.device_mesh.size(axis):
                return False
    return True


# -- the whole plan ----------------------------------------------------------------------------
def capacity(rc, kind: str, nproc_per_node: int = 1) -> tuple[float, str]:
    """GiB one rank of device ``kind`` (the resolved kind) may use, and where the figure came from. Ranks of a kind
    that runs on the host (CPU) share it: its RAM (or the cgroup's limit) divided among the ``nproc_per_node`` ranks
    on it."""
    if rc.device.memory_gib is not None:
        return float(rc.device.memory_gib), "device.memory_gib"
    dtype = devices.resolve_device_type(kind)
    if devices.get(dtype).runs_on_host:
        total, source = devices.host_memory()
        n = max(1, nproc_per_node)
        return total / n / 1024**3, f"detected ({dtype}): {total / 1024**3:.1f} GiB {source}" + (f" / {n} ranks" if n > 1 else "")
    return devices.Device(dtype, 0, rc.device.lnc).memory().capacity_gib, f"detected ({dtype})"


def make_plan(resolved: dict | ResolvedRun, trace_all: bool = False) -> Plan:
    """Resolve like a run (``resolve.resolve_run``, planned for the run's device: a Trainium run checked as
    a run would be, except that TorchNeuron is not required; ``resolved`` may be that resolution already), then
    trace rank 0 and the largest rank (only rank 0 when every shard is even, unless ``trace_all``)."""
    run = resolved if isinstance(resolved, ResolvedRun) else resolve_run(resolved, plan=True)
    rc, degrees = run.rc, run.degrees
    planned = run.config["device"]["type"]
    spec = devices.get(run.device_type)  # the resolved kind: the planned one when this host lacks it
    gpu_peak = None
    if run.planned_elsewhere and spec.planning_table is not None:  # a GPU this host lacks: its table entry or the keys
        cap, gpu_peak, name = devices.planned_gpu(rc.device)
        source = f"device.gpu={name}" if rc.device.memory_gib is None else "device.memory_gib"
    else:
        cap, source = capacity(rc, run.device_type, run.nproc_per_node)
        if spec.planning_table is not None:  # a GPU here: its own entry of torchtitan's peak table
            gpu_peak = _gpu_peak_here(run.device_type)
    t0 = time.perf_counter()
    world = degrees.world_size
    ranks = []
    est = estimate(run)
    mirrored, mirror_of = [], {}
    for first, last in rank_roles(degrees):
        for rank in sorted({first, last}):
            lead = next((r for r in ranks if r.rank == first), None)
            if rank != first and lead.even_shards and not trace_all:
                mirrored.append(rank)  # same shapes as its group's first rank (evenly_sharded): not traced again
                mirror_of[rank] = first
                continue
            # A tensor-parallel trace after another one gets the earlier trace's meshes back from torch's DTensor
            # machinery (meshes compare by layout; not found in a cache that can be cleared here): its own process
            fresh = bool(ranks) and degrees.tp > 1
            rp = (_trace_in_a_fresh_process if fresh else trace_role)(run, rank, world, spec.kernels_by_shape)
            if rp.kernel_saved:
                rp.estimate = {**est, "kernel saved": rp.kernel_saved, "peak": est["peak"] + rp.kernel_saved}
            else:
                rp.estimate = est
            ranks.append(rp)
    flops = models.flops_per_token(rc.model, rc.data.seq_len) * run.tokens_per_step
    plan = Plan(ranks, cap, source, world, degrees.describe(), run.tokens_per_step, flops, time.perf_counter() - t0, mirrored,
                planned_for=planned if run.planned_elsewhere else None, kernel_lines=ranks[0].kernel_lines,
                mirror_of=mirror_of)
    _compile_and_step_time(plan, run, gpu_peak)
    f = models.architecture(rc.model)
    lora = lora_params.count_for(f, rc.model) if f is not None else None
    if lora:
        plan.lora_line = (f"LoRA: {lora.adapters:,} adapter parameters train ({100 * lora.adapters / lora.total:.2f} %: "
                          f"{', '.join(lora.projections)} in each of {f.n_layers} layers); {lora.frozen:,} frozen "
                          "(float32 bytes, no gradients, no AdamW state)")
    return plan


def rank_roles(degrees) -> list[tuple[int, int]]:
    """(first, last) rank of each group of ranks that hold the same model part: the whole world, or with
    parallelism.pp > 1 each pipeline rank's group (torchtitan's mesh puts pp outermost: ranks
    ``[s * world / pp, (s + 1) * world / pp)`` hold pipeline rank ``s``'s stages). A group's first rank is traced,
    its last too unless the first's shards are even."""
    group = degrees.world_size // degrees.pp
    return [(s * group, (s + 1) * group - 1) for s in range(degrees.pp)]


def trace_role(run, rank: int, world: int, kernels_by_shape: bool) -> RankPlan:
    if kernels_by_shape:  # kernels checked for, and NKI ones traced by shape as, the planned device
        with planning_for(run.device_type, run.lnc):
            return trace_rank(run, rank, world)
    return trace_rank(run, rank, world)


def _trace_in_a_fresh_process(run, rank: int, world: int, kernels_by_shape: bool) -> RankPlan:
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(trace_role, run, rank, world, kernels_by_shape).result()


def _gpu_peak_here(kind: str) -> float | None:
    name = devices.device_name(kind)  # None where no device of the kind is available here
    return titan.gpu_peak_flops(name) if name is not None else None


def _compile_and_step_time(plan: Plan, run, gpu_peak: float | None) -> None:
    """What compile does to the plan (the trace is the eager step; a compiled run's peak was measured lower) and,
    on a GPU, a predicted step time at the MFU measured on an H200 (compiling.MEASURED_MFU)."""
    d = run.compile
    on = bool(d and d.enable)
    compiled = plan.peak_gib * compiling.COMPILED_PEAK_FACTOR
    plan.compile_line = (f"compile: {'on' if on else 'off'} ({d.reason if d else 'compile.enable'}); the trace is the "
                         f"eager step: compiled, the peak would be ~{compiled:.2f} GiB (x{compiling.COMPILED_PEAK_FACTOR:.2f}, "
                         f"{compiling.COMPILED_PEAK_SOURCE})")
    if gpu_peak and run.precision.compute_dtype != "bfloat16":
        plan.step_line = ("predicted step time: only for training.mixed_precision=bf16 (the measured MFU it scales is "
                          "bf16's)")
    elif gpu_peak:
        mfu = compiling.MEASURED_MFU[on]
        plan.predicted_step_s = plan.flops_per_step / max(1, run.world_size) / (gpu_peak * mfu)
        plan.step_line = (f"predicted step time: {plan.predicted_step_s:.3g} s ({plan.flops_per_step:.3e} FLOPs over "
                          f"{run.world_size} GPU(s) at {gpu_peak / 1e12:.0f} TFLOP/s dense bf16 x {100 * mfu:.0f} % MFU; "
                          f"{compiling.MEASURED_MFU_SOURCE}: other models, sizes and GPUs differ)")


def render(plan: Plan) -> str:
    def g(x):
        return f"{x / GIB:.3f}"

    lines = [f"plan: {plan.layout}; {plan.tokens_per_step} tokens/step, {plan.flops_per_step:.3e} FLOPs/step "
             f"(forward+backward); traced in {plan.trace_s:.1f} s"]
    traced = {r.rank: r for r in plan.ranks}
    if plan.mirrored and not plan.per_stage_peak():
        lines.append(f"rank {', '.join(map(str, plan.mirrored))} not traced: every sharded parameter dimension divides "
                     "evenly, so every rank holds rank 0's shapes and bytes (--trace-all-roles traces it)")
    elif plan.mirrored:
        lines.append(f"rank {', '.join(map(str, plan.mirrored))} not traced: every sharded parameter dimension divides "
                     "evenly, so every rank holds the shapes and bytes of the first rank of its pipeline stage(s) "
                     "(--trace-all-roles traces it)")
    # one column per rank role: traced, or (mirrored) its source's trace under the rank's own number
    cols = [(f"traced r{r.rank}" + (f" (stage {','.join(map(str, r.stages))})" if r.stages else ""), r)
            for r in plan.ranks]
    for m in plan.mirrored:
        src = plan.mirror_of.get(m, plan.ranks[0].rank)
        cols.append((f"r{m} = r{src}", traced[src]))
    est = plan.ranks[0].estimate
    body = []
    for key in ("params", "grads", "optimizer", "activations", "backward temps", "buffers"):
        body.append([key, *(g(r.traced.get(key, 0)) for _, r in cols), g(est[key]) if key in est else "-"])
        if key == "params" and any(r.param_shards is not None and (r.params_max or 0) > r.param_shards
                                   for _, r in cols):  # FSDP's gathered copies (bf16 under mixed_precision=bf16)
            body.append(["most gathered", *(g((r.params_max or 0) - (r.param_shards or 0)) for _, r in cols), "-"])
    for key in ("lora adapters", "logits and loss", "fsdp gathered", "kernel saved"):
        if key in est:  # a closed-form term the traced rows already hold
            body.append([key, *([""] * (len(cols) - 1)), "(in the above)", g(est[key])])
    body.append(["peak (live tensors)", *(g(r.peak) for _, r in cols), g(est["peak"]) if est else "-"])
    lines.append(tables.render(["GiB per rank", *(name for name, _ in cols), "closed form"], body,
                               align=["left"] + ["right"] * (len(cols) + 1)))
    if plan.per_stage_peak():
        stages = plan.per_stage_peak()
        worst = max(stages, key=stages.get)
        lines.append("pipeline stages, each traced as torch's schedule runs it on its rank (qwen3_research.pipeline_trace: "
                     "the micro-batches it holds at once, its receive buffers, its gradients unreduced until the last "
                     "micro-batch): peak " + ", ".join(f"stage {st} {b / GIB:.3f} GiB" for st, b in stages.items())
                     + f"; the plan's per-rank figure is the largest stage's (stage {worst})")
    if plan.kernel_lines:
        lines.append("kernel terms (rank 0; the trace counts the tensors they keep for backward while those live):")
        lines += [f"  {ln}" for ln in plan.kernel_lines]
    if plan.planned_for and devices.get(plan.planned_for).kernels_by_shape:
        lines.append(f"planned for device={plan.planned_for}, which this host does not have: traced on fake CPU tensors, "
                     "NKI kernels by their documented output shapes; nothing ran on a Neuron device")
    elif plan.planned_for:
        lines.append(f"planned for device={plan.planned_for} ({plan.capacity_source}), which this host does not have: "
                     "traced on fake CPU tensors; nothing ran on a GPU")
    if plan.lora_line:
        lines.append(plan.lora_line)
    if plan.compile_line:
        lines.append(plan.compile_line)
    if plan.step_line:
        lines.append(plan.step_line)
    lines.append(f"capacity per rank: {plan.capacity_gib:.2f} GiB ({plan.capacity_source}); "
                 f"verdict: {plan.verdict} (predicted peak {plan.peak_gib:.2f} GiB, "
                 f"{100 * plan.peak_gib / plan.capacity_gib:.0f} % of capacity)")
    if not plan.fits:
        worst = max(plan.ranks, key=lambda r: r.peak)
        terms = sorted(worst.traced.items(), key=lambda kv: -kv[1])
        lines.append(f"does not fit: rank {worst.rank} needs {plan.peak_gib:.2f} GiB > {plan.capacity_gib:.2f} GiB; "
                     "largest terms: " + ", ".join(f"{k} {v / GIB:.2f} GiB" for k, v in terms if v >= 0.005 * GIB))
    return "\n".join(lines)
