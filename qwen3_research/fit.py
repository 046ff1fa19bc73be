"""What WILL fit: search the knobs a user would turn for configurations that fit device memory, ranked by predicted
step cost (``python -m qwen3_research.plan --fit``; ``sweep.plan=fit`` runs an infeasible point with its best one).

Knobs (a key the user set on the command line, or a key a sweep varies, is frozen):

- the micro-batch ``data.batch_size`` with ``training.grad_accum`` rescaled so the global batch (sequences per
  optimizer step) stays the same; with ``data.global_batch_tokens`` only ``training.grad_accum`` changes;
- activation checkpointing, only stronger than configured (none < selective < full);
- ``training.loss=chunked``; ``training.mixed_precision=bf16`` (FSDP2 bf16 parameters where the layout shards: it
  changes numerics, the line says so);
- the tensor-parallel degree among those the world allows (``tp`` divides the world, the query and KV heads and
  the sequence), with sequence parallel on (it only saves memory); only where ``parallelism.dp_shard=-1`` lets FSDP
  take the remaining ranks;
- the pipeline-parallel degree ``parallelism.pp`` (its auto micro-batches, pp, dividing the micro-batch), only for
  an untied model (torchtitan's split refuses tied embeddings) where ``parallelism.dp_shard=-1`` lets data parallel
  take the remaining ranks: each rank then holds its stages' parameters, gradients and AdamW state, at the cost of
  the pipeline's bubble (below), so it is proposed only where the variants without it do not fit or cost more;
- LoRA (``model.lora.enable=true``, the ``model.lora`` settings as configured): the base frozen, gradients and AdamW
  state for the adapters only. It trains something else (adapters, not the model), so a LoRA variant ranks after
  every full-training one: it is printed when fewer than ``k`` of those fit, and its line says so.

Search: every candidate's cost comes from a closed form (instant); its memory from the planner's closed form
(``closed_form.estimate``) as a screen, then the real trace (``planner.make_plan``, the same code path as a plan
without ``--fit``) of the cheapest candidates that pass the screen, until ``k`` fit. Traces are reused: a
candidate is traced once, and a candidate that needs at least as much memory as one traced not to fit (same tp,
at least its micro-batch, weaker or equal checkpointing, loss and precision) is not traced at all. Every printed
suggestion was traced and fits.

Cost per rank per optimizer step: compute = training FLOPs (torchtitan's per-token formula, ``models.flops_per_
token``; with LoRA the frozen weights' gradient matmuls, a third of the parameter FLOPs, are not done) with
activation-checkpointing recomputation (full: one more forward of every block, +1/3 of the block
FLOPs; selective: about half of that), over the device's dense peak in the dtype (bf16 or fp32); communication =
bytes sent per rank (ring collectives, (n-1)/n): FSDP all-gathers every unit in forward and again in backward and
reduce-scatters float32 gradients (LoRA: the adapters' only) once per micro-batch; tensor parallel moves each block's activations four times
per micro-batch (all-gather + reduce-scatter, forward and backward; the full loss also all-gathers the logits).
A pipeline adds its 1F1B bubble to the compute time ((micro-batches + pp - 1) / micro-batches) and each micro-batch's
hidden states and their gradients to the bytes sent, and divides the FSDP traffic by pp (a rank gathers only its
stages). Ranked by compute time, then communication bytes: no measured interconnect figure is in this repository to add
them (a first-order model, not a simulator).
"""

from __future__ import annotations

import copy
import itertools
import sys
import time
from dataclasses import dataclass, field


from qwen3_research import devices
from qwen3_research import lora_params
from qwen3_research import models
from qwen3_research import overrides
from qwen3_research import parallel
from qwen3_research.closed_form import estimate
from qwen3_research.planner import GIB, capacity, make_plan
from qwen3_research.resolve import ResolvedRun, resolve_run

AC_LEVELS = ("none", "selective", "full")
KNOB_KEYS = ("data.batch_size", "training.grad_accum", "parallelism.activation_checkpoint", "training.loss",
             "training.mixed_precision", "parallelism.tp", "parallelism.sequence_parallel", "model.lora.enable",
             "parallelism.pp")
SCREEN = 1.25  # a candidate whose closed-form peak exceeds the capacity by more than this is not traced
MAX_TRACES = 10  # at most this many traces before the search stops (the ranking is closed form)


@dataclass
class Candidate:
    changes: dict  # dotted key -> new value (only what differs from the configuration)
    config: dict  # the resolved config with the changes
    tp: int
    sp: bool
    batch: int
    ac: str
    chunked: bool
    bf16: bool
    lora: bool = False  # model.lora.enable in this variant
    pp: int = 1  # parallelism.pp in this variant (its micro-batches: pp, the auto setting)
    compute_s: float = 0.0  # per optimizer step, at the device's dense peak
    comm_bytes: float = 0.0  # sent per rank per optimizer step
    estimate_gib: float = 0.0  # the planner's closed form (the screen)
    plan: object = None  # planner.Plan once traced

    def overrides(self) -> list[str]:
        return [f"{k}={_fmt(v)}" for k, v in self.changes.items()]

    def cost_key(self) -> tuple:
        """A variant that turns LoRA on after every other (it trains adapters, not the model); then compute time,
        then bytes sent; on a tie the variant that changes fewer keys, then the larger micro-batch."""
        return (int("model.lora.enable" in self.changes), round(self.compute_s, 6), round(self.comm_bytes),
                len(self.changes), -self.batch)


@dataclass
class FitResult:
    fits: list[Candidate]
    considered: int
    traced: int
    wall_s: float
    capacity_gib: float
    original: object = None  # the plan of the configuration as given (planner.Plan), None when not traced
    dominant: str = ""  # nothing fits: what dominates the smallest configuration's memory
    smallest: Candidate | None = None
    notes: list[str] = field(default_factory=list)


def _fmt(v) -> str:
    return str(v).lower() if isinstance(v, bool) else str(v)


def _set(config: dict, dotted: str, value) -> None:
    node = config
    *path, last = dotted.split(".")
    for key in path:
        node = node[key]
    node[last] = value


def replace_overrides(args: list[str], changes: dict) -> list[str]:
    """``args`` (a command line's overrides) with ``changes`` applied: a key given there is replaced in place, a new
    one appended (Hydra refuses the same key twice)."""
    out, done = [], set()
    for o in overrides.parse(args):
        if o.key in changes and o.value is not None:
            out.append(f"{o.key}={_fmt(changes[o.key])}")
            done.add(o.key)
        else:
            out.append(o.text)
    return out + [f"{k}={_fmt(v)}" for k, v in changes.items() if k not in done]


def explicit_keys(args: list[str]) -> set[str]:
    """The knob keys a command line sets itself (frozen in the search)."""
    return {o.key for o in overrides.parse(args) if o.value is not None} & set(KNOB_KEYS)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def pipeline_degrees(run, frozen: set[str] = frozenset()) -> list[int]:
    """The parallelism.pp values a variant may take: the configured one, and where the user left it free, the
    layout lets data parallel take the remaining ranks (dp_shard=-1) and the model can be pipelined (untied
    embeddings: torchtitan's split refuses a tied one), every divisor of the world up to the stage units (layers
    plus the embedding and the lm_head). A degree the installed torchtitan or the rest of the run cannot take is
    refused by the run's own resolution (``search``), as every other variant."""
    rc, d = run.rc, run.degrees
    f = models.architecture(rc.model)
    if ("parallelism.pp" in frozen or rc.parallelism.dp_shard != -1 or rc.parallelism.dp_replicate != 1 or f is None
            or f.tie_embeddings):
        return [d.pp]
    units = f.n_layers + parallel.PP_EDGE_LAYERS
    return [x for x in _divisors(d.world_size) if x <= units]


def candidates(run, frozen: set[str] = frozenset()) -> list[Candidate]:
    """Every legal variant of ``run`` (a ``resolve.ResolvedRun``) over the knobs not in ``frozen``."""
    rc, d, config = run.rc, run.degrees, run.config
    p, t = rc.parallelism, rc.training
    world, heads, kv = d.world_size, run.model["n_heads"], run.model["n_kv_heads"]
    global_seqs = rc.data.batch_size * d.dp * t.grad_accum
    tps = [d.tp]
    if "parallelism.tp" not in frozen and p.dp_shard == -1 and p.dp_replicate == 1 and d.ep == 1:
        tps = [x for x in _divisors(world) if heads % x == 0 and kv % x == 0 and rc.data.seq_len % x == 0]
    pps = pipeline_degrees(run, frozen)
    acs = [a for a in AC_LEVELS if AC_LEVELS.index(a) >= AC_LEVELS.index(p.activation_checkpoint)]
    if "parallelism.activation_checkpoint" in frozen:
        acs = [p.activation_checkpoint]
    losses = [t.loss] if "training.loss" in frozen or t.loss == "chunked" else [t.loss, "chunked"]
    precisions = [t.mixed_precision] if "training.mixed_precision" in frozen or t.mixed_precision == "bf16" \
        else [t.mixed_precision, "bf16"]
    gbt = rc.data.global_batch_tokens is not None
    lora_on = lora_params.lora_settings(rc.model) is not None
    loras = [lora_on]
    if not lora_on and "model.lora.enable" not in frozen and "lora" in config.get("model", {}):
        loras = [False, True]
    out = []
    for tp, pp in itertools.product(tps, pps):
        if world % (tp * pp):
            continue
        dp = world // (tp * pp) if (tp, pp) != (d.tp, d.pp) else d.dp
        if global_seqs % dp:
            continue
        per_rank = global_seqs // dp  # sequences per rank per optimizer step
        batches = [b for b in _divisors(per_rank) if b <= max(rc.data.batch_size, 1)]
        if {"data.batch_size", "training.grad_accum"} & frozen:
            batches = [rc.data.batch_size] if per_rank % rc.data.batch_size == 0 else []
        if pp > 1 and pp != d.pp:  # a new pipeline's auto micro-batches (pp) must divide the micro-batch
            batches = [b for b in batches if b % pp == 0]
        sp = d.sequence_parallel if tp == d.tp else tp > 1
        if "parallelism.sequence_parallel" in frozen:
            sp = d.sequence_parallel if tp > 1 else False
        for b, ac, loss, mp, lora in itertools.product(batches, acs, losses, precisions, loras):
            changes = {}
            if tp != d.tp:
                changes["parallelism.tp"] = tp
            if pp != d.pp:
                changes["parallelism.pp"] = pp
            if sp != d.sequence_parallel:
                changes["parallelism.sequence_parallel"] = sp
            accum = per_rank // b
            if b != rc.data.batch_size and not gbt:
                changes["data.batch_size"] = b
            if accum != t.grad_accum:
                changes["training.grad_accum"] = accum
            if ac != p.activation_checkpoint:
                changes["parallelism.activation_checkpoint"] = ac
            if loss != t.loss:
                changes["training.loss"] = loss
            if mp != t.mixed_precision:
                changes["training.mixed_precision"] = mp
            if lora != lora_on:
                changes["model.lora.enable"] = lora
            variant = copy.deepcopy(config)
            for k, v in changes.items():
                _set(variant, k, v)
            out.append(Candidate(changes, variant, tp, sp, b, ac, loss == "chunked", mp == "bf16", lora, pp))
    return out


def _peak(device_type: str, bf16: bool) -> float:
    """The device's dense peak FLOP/s per rank in bf16 (``bf16``) or fp32: its spec's reference peak
    (``devices.reference_peak``: an LNC=2 rank of Trainium2; an H100/H200 SXM, 989 bf16 / 67 fp32; a CPU its own
    matmul rates, measured once and cached -- without bf16 units (AVX2-only) bf16 is emulated and ~100x slower,
    with AVX512-BF16 or AMX it is the faster one, GUIDE §7)."""
    return devices.reference_peak(device_type, "bf16" if bf16 else "fp32")


def cost(c: Candidate, run) -> None:
    """Fill ``compute_s`` and ``comm_bytes`` of ``c`` (see the module docstring)."""
    rc, world = run.rc, run.degrees.world_size
    f = models.architecture(rc.model)
    seq = rc.data.seq_len
    per_token = models.flops_per_token(rc.model, seq)
    global_tokens = run.tokens_per_step
    recompute = 0.0
    lora = lora_params.count_for(f, c.config["model"]) if f is not None and c.lora else None
    if f is not None:
        d, v = f.dim, f.vocab_size
        layer = d * (f.n_heads + 2 * f.n_kv_heads) * f.head_dim + f.n_heads * f.head_dim * d + \
            (f.num_experts * 3 * d * f.hidden_dim if f.num_experts else 3 * d * f.hidden_dim)
        blocks = f.n_layers * layer
        block_share = blocks / (blocks + v * d)
        recompute = {"none": 0.0, "selective": 1 / 6, "full": 1 / 3}[c.ac] * block_share
    if lora:  # no weight-gradient matmul for a frozen weight: 4 of the 6 FLOPs per parameter and token, plus the adapters'
        per_token = per_token - 2 * (blocks + v * d) + 6 * lora.adapters
    flops = per_token * global_tokens * (1 + recompute) / world
    peak = _peak(run.device_type, c.bf16)  # the resolved kind: the planned one when this host lacks it
    # A pipeline's bubble: each rank idles (pp - 1) of (micro-batches + pp - 1) slots of a 1F1B step (micro-batches:
    # pp, the auto setting, so (2 pp - 1) / pp of the compute time; looped schedules shrink it, this ranks them
    # as 1F1B); a variant with pp therefore ranks after one without that fits
    n_mb = run.degrees.pp_microbatches if c.pp == run.degrees.pp else c.pp
    bubble = (n_mb + c.pp - 1) / n_mb if c.pp > 1 else 1.0
    c.compute_s = flops / peak * bubble
    if f is None:
        return
    dp = world // (c.tp * c.pp)
    accum = global_tokens // (seq * c.batch * dp)
    total_params = (f.n_layers * layer + v * d * (1 if f.tie_embeddings else 2)) / c.pp  # one rank's stages
    s_p = 2 if c.bf16 else 4
    reduced = lora.adapters / c.pp if lora else total_params  # float32 gradients reduce-scattered
    fsdp = accum * (2 * s_p * total_params + 4 * reduced) / c.tp * (dp - 1) / dp if dp > 1 else 0.0
    if c.pp > 1:  # each micro-batch's hidden states forward and their gradients back, between neighbouring stages
        fsdp += accum * 2 * c.batch * seq * d * (2 if c.bf16 else 4)
    tp = 0.0
    if c.tp > 1:
        s_a = 2 if c.bf16 else 4
        act = c.batch * seq * d * s_a * (c.tp - 1) / c.tp
        tp = accum * f.n_layers * 8 * act * (1.25 if c.ac == "full" else 1.0)
        if not c.chunked:
            tp += accum * c.batch * seq * v * 4 * (c.tp - 1) / c.tp
    c.comm_bytes = fsdp + tp


def _memory_order(c: Candidate) -> tuple:
    return (-int(c.lora), c.batch, -AC_LEVELS.index(c.ac), -int(c.chunked), -int(c.bf16))


def _needs_at_least(c: Candidate, failed: Candidate) -> bool:
    """``c`` needs at least the memory of ``failed`` (same tp and SP, every knob at most as saving)."""
    return (c.tp == failed.tp and c.sp == failed.sp and c.pp == failed.pp and c.batch >= failed.batch
            and AC_LEVELS.index(c.ac) <= AC_LEVELS.index(failed.ac) and c.chunked <= failed.chunked
            and c.bf16 <= failed.bf16 and c.lora <= failed.lora)


def search(config: dict | ResolvedRun, *, frozen: set[str] = frozenset(), k: int = 3, echo=None) -> FitResult:
    """The fitting variants of ``config`` (a composed, resolved config dict, or its ``resolve_run`` for a plan),
    cheapest first (at most ``k``)."""
    echo = echo or (lambda msg: print(msg, file=sys.stderr, flush=True))
    t0 = time.perf_counter()
    run = config if isinstance(config, ResolvedRun) else resolve_run(config, plan=True)
    cap = capacity(run.rc, run.device_type, run.nproc_per_node)[0]
    cands = candidates(run, frozen)
    for c in cands:
        cost(c, run)
        try:
            r = resolve_run(c.config, plan=True, kernels=False)
        except Exception as e:  # noqa: BLE001 - a variant the rules refuse is not a candidate
            c.estimate_gib = float("inf")
            c.changes["_refused"] = str(e).splitlines()[0] if str(e) else type(e).__name__
            continue
        est = estimate(r)
        c.estimate_gib = est.get("peak", 0) / GIB if est else 0.0
    cands = [c for c in cands if "_refused" not in c.changes]
    cands.sort(key=Candidate.cost_key)
    fits, failed, traced = [], [], 0
    for c in cands:
        if len(fits) >= k or traced >= MAX_TRACES:
            break
        if c.estimate_gib > SCREEN * cap or any(_needs_at_least(c, f) for f in failed):
            continue
        t1 = time.perf_counter()
        c.plan = make_plan(c.config)
        traced += 1
        echo(f"fit: traced {' '.join(c.overrides()) or '(as configured)'}: {c.plan.peak_gib:.2f} GiB "
             f"({c.plan.verdict}, {time.perf_counter() - t1:.0f} s)")
        (fits if c.plan.fits else failed).append(c)
    result = FitResult(fits, len(cands), traced, 0.0, cap)
    if not fits:
        result.smallest, result.dominant = _smallest(cands, run, cap, echo)
    result.wall_s = time.perf_counter() - t0
    return result


def _smallest(cands: list[Candidate], run, cap: float, echo) -> tuple[Candidate | None, str]:
    """The candidate that needs the least memory and what dominates it: the exact state bytes (float32 parameters,
    gradients and AdamW state over the ranks that shard them) when they alone exceed the capacity, else its trace's
    largest term."""
    if not cands:
        return None, "no legal variant of this configuration (the world allows no other layout)"
    best = min(cands, key=lambda c: (-c.tp * c.pp, -c.pp, _memory_order(c)))
    r = resolve_run(best.config, plan=True, kernels=False)
    est = estimate(r)
    state = sum(est.get(k, 0) for k in ("params", "grads", "optimizer")) / GIB if est else 0.0
    if state > cap:
        return best, (f"float32 parameters + gradients + AdamW state alone are {state:.1f} GiB per rank "
                      f"(params {est['params'] / GIB:.1f}, grads {est['grads'] / GIB:.1f}, optimizer "
                      f"{est['optimizer'] / GIB:.1f} GiB over {r.degrees.dp_shard * r.degrees.tp} shards"
                      f"{f' of the largest of {r.degrees.pp} pipeline ranks' if r.degrees.pipelined else ''}) > "
                      f"{cap:.2f} GiB: shard over more ranks (parallelism.nproc_per_node / nnodes, dp_shard)")
    best.plan = best.plan or make_plan(best.config)
    worst = max(best.plan.ranks, key=lambda rp: rp.peak)
    term, size = max(worst.traced.items(), key=lambda kv: kv[1])
    echo(f"fit: traced the smallest variant: {best.plan.peak_gib:.2f} GiB")
    return best, (f"{term} dominates: {size / GIB:.2f} GiB of {best.plan.peak_gib:.2f} GiB per rank in the smallest "
                  f"variant ({' '.join(best.overrides())}) > {cap:.2f} GiB")


def render(result: FitResult, args: list[str]) -> str:
    if not result.fits:
        return (f"fit: nothing fits in {result.capacity_gib:.2f} GiB per rank ({result.considered} variants considered, "
                f"{result.traced} traced, {result.wall_s:.0f} s): {result.dominant}")
    lines = [f"fit: {len(result.fits)} fitting variants of {result.considered} ({result.traced} traced, "
             f"{result.wall_s:.0f} s), cheapest predicted step first (compute at the device peak, then bytes sent "
             "per rank); each line is the whole command line to run:"]
    for i, c in enumerate(result.fits, 1):
        note = " (bf16 changes numerics)" if c.bf16 and "training.mixed_precision" in c.changes else ""
        if c.changes.get("model.lora.enable"):
            note += " (LoRA: trains adapters on a frozen base, not the whole model)"
        lines.append(f"  {i}. {c.plan.peak_gib:.2f} GiB per rank ({c.plan.verdict}), compute {c.compute_s:.3g} s, "
                     f"comm {c.comm_bytes / 1024**3:.1f} GiB/step{note}")
        lines.append("     " + " ".join(replace_overrides(args, c.changes)))
    return "\n".join(lines)
