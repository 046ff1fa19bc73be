"""One start-up resolution: a composed config -> a frozen, fully resolved run description (``ResolvedRun``).

Every entry point asks ``resolve_run`` before it starts anything -- the CLI's preflight (``__main__``), the
launcher (``launch.elastic.run``; each rank under torchrun), the planner (``planner.make_plan``), the doctor,
``verify_kernels`` -- and the Trainer receives its result (worker processes get it with the run dir), so all of
them refuse the same configurations with the same one line, in the same order:

1. the config: ``config.validate``, after the auto settings are resolved (``training.mixed_precision=auto``:
   bf16 on neuron, none elsewhere; ``training.loss=auto``: chunked on cpu, full on cuda and neuron;
   ``checkpoint.resume=auto`` for a Slurm job started again after requeue; ``model.moe.balance=auto``: aux_loss
   with ``checkpoint.export_hf=true`` where the backend's default is the expert bias, which HF cannot hold);
2. the model backend's own rules (``models.check``) and facts (``models.describe``: heads, experts);
3. the device: its type, the LNC, ``parallelism.nproc_per_node=-1`` (every device of the host);
4. the parallel degrees (``parallel.validate_degrees``; under torchrun against the world it started) and the
   per-rank batch size (``data.global_batch_tokens``);
5. what the installed torchtitan cannot run (``models.check_run``: ``titan.check_supported`` for the native
   backends);
6. ``compile.enable=auto``: on where it was measured faster (``compiling.decide``: cuda, dense, bf16), with its
   reason and the keyed compile cache (warm or cold), recorded in ``compile`` and printed by the launcher;
7. the kernel plan: what each entry needs of this host (``kernels.kernel_support``: device, LNC, environment,
   packages; recorded), and the targets matched on the run's model built on the meta device (``kernels.resolve``:
   module types, two entries on one module, the requirements above and dtypes, the sequence-length multiple, each
   kernel's own shape checks; refused as a worker would refuse them), so a bad kernel target fails before any
   worker starts. An entry that matches nothing is a warning, as in a run.

Each process resolves once (tests/test_resolve.py::test_one_cli_run_resolves_and_composes_once_per_process): the
CLI before Hydra starts (``resolve_before_hydra``), handing the description to Hydra's task and the
launcher (``launch.elastic.run(resolved=...)``), whose worker processes receive it (a sweep point: the resolution its
plan made, ``launch.sweep.plan_points``, handed back to the sweep's process; tests/test_resolve.py::
test_a_sweep_resolves_each_point_once_per_process); ``at_run_dir`` then checks the run
dir once (``rundir.check_run_dir``, ``checkpoint.preflight`` inside it) and records what a resume or ``init_from``
loads. The auto settings are filled in one place (``auto_settings``, from ``DEVICE_DEFAULTS``: what each device kind
decides); ``config.to_run_config`` and ``config.validate`` are pure. ``training.mixed_precision`` becomes a
``PrecisionPlan`` here (``precision_plan``; ARCHITECTURE.md, "The precision walk"), which the Trainer applies and checks.

Nothing mutates the composed config afterwards. The resolved values live in the description: ``config`` (the
plain dict the workers get and summary.json and W&B record) and ``rc`` (the same, typed) carry
``data.batch_size`` and ``training.mixed_precision`` as resolved; ``parallelism.nproc_per_node`` stays as
configured there (a torchrun rank resolves -1 to the world it was started with) and is resolved in
``nproc_per_node`` and ``degrees``. The resolution changes nothing in the process environment itself; a caller
that starts the run hands it ``device.prepare_launch`` (the LNC, the NeuronCores a one-process run reserves), which
it calls once the device facts are resolved, before any check that may import the device's runtime.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from omegaconf import DictConfig, OmegaConf

from qwen3_research import compiling
from qwen3_research import devices
from qwen3_research import lora, models, slurm
from qwen3_research.compose import CONF_DIR
from qwen3_research.config import (CPU_RANKS_PER_CORE, RunConfig, keys_read_by, resolve_batch_size, to_run_config,
                                   validate)
from qwen3_research.errors import ConfigError, check_writable, log_call
from qwen3_research.models import registry
from qwen3_research.parallel import PP_SCHEDULES, check_pipeline_batch, has_fsdp_units, validate_degrees


@dataclass(frozen=True)
class PrecisionPlan:
    """How ``training.mixed_precision`` is carried out, decided once at resolution (``precision_plan``).

    - ``float32``: float32 parameters, reduction and master weights, no autocast (``training.mixed_precision=none``);
    - ``fsdp2_bf16_params`` (bf16 where the layout has FSDP2 units, ``parallel.has_fsdp_units``): FSDP2's
      ``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)`` as torchtitan and AWS's Trainium recipes,
      float32 master weights, no autocast on top (torchtitan's ``maybe_enable_amp`` does the same);
    - ``autocast_bf16`` (bf16 on one process, or a layout without FSDP2 units): autocast to bfloat16 over float32
      parameters.

    The Trainer applies it (``parallel.torchtitan_training_configs`` takes ``setting``; ``autocast`` is the step's
    autocast) and then ``check``s the built model against it."""

    mode: str  # float32 | fsdp2_bf16_params | autocast_bf16
    param_dtype: str  # the parameters forward and backward compute with (FSDP2's gathered copies where sharded)
    reduce_dtype: str  # the gradients' reduction over the data-parallel ranks
    master_dtype: str  # the parameters the optimizer updates
    autocast: bool  # the step runs under autocast to bfloat16
    reason: str  # why this mode (the setting, and the layout)
    # The lm_head's 16-bit GEMMs multiply by a column-major copy of its weight: the run's device says a 16-bit GEMM
    # with a row-major (V x D) right operand is slow there (DeviceSpec.slow_16bit_nn_gemm: ATen's bf16 GEMM on a CPU
    # without AVX-512, RESULTS.md row 23). Both losses read it (loss.chunked_cross_entropy, loss.column_major_lm_head).
    lm_head_column_major: bool = False

    @property
    def setting(self) -> str:
        """``training.mixed_precision`` as resolved: bf16 or none."""
        return "none" if self.mode == "float32" else "bf16"

    @property
    def compute_dtype(self) -> str:
        """The dtype the matmuls run in (the device's peak FLOPs are read for it)."""
        return "float32" if self.mode == "float32" else "bfloat16"

    def summary(self) -> dict:
        """summary.json's and metrics' ``precision``: the mode, the FSDP2 policy's dtypes where it has one, the master
        dtype."""
        if self.mode == "fsdp2_bf16_params":
            return {"mode": self.mode, "param_dtype": self.param_dtype, "reduce_dtype": self.reduce_dtype,
                    "master_dtype": self.master_dtype}
        return {"mode": self.mode, "master_dtype": self.master_dtype}

    def check(self, fsdp_policy: tuple[str, str] | None, master_dtype: str) -> None:
        """Raise when the built model does not carry out this plan: ``fsdp_policy`` is (param_dtype, reduce_dtype)
        of its FSDP2 units (``parallel.fsdp_precision``; None: it has none), ``master_dtype`` its parameters' dtype."""
        expected = (self.param_dtype, self.reduce_dtype) if self.mode != "autocast_bf16" else None
        problems = []
        if self.mode == "fsdp2_bf16_params" and fsdp_policy is None:
            problems.append("the model has no FSDP2 units")
        elif fsdp_policy is not None and fsdp_policy != expected:
            problems.append(f"its FSDP2 units gather {fsdp_policy[0]} and reduce in {fsdp_policy[1]}"
                            + ("" if expected else " (autocast expected no FSDP2 units)"))
        if master_dtype != self.master_dtype:
            problems.append(f"its parameters are {master_dtype}")
        if problems:
            raise RuntimeError(f"the built model does not match the precision plan {self.summary()} ({self.reason}): "
                               f"{'; '.join(problems)}")


def precision_plan(mixed_precision: str, degrees, *, torchtitan: bool, device_kind: str | None = None) -> PrecisionPlan:
    """``training.mixed_precision`` (resolved: bf16 or none) in the run's layout -> its ``PrecisionPlan``.
    ``device_kind``: the device the run uses (a plan: the one it is planned for), whose spec says whether the lm_head
    takes a column-major weight copy in 16 bits (None: it does not)."""
    if mixed_precision != "bf16":
        return PrecisionPlan("float32", "float32", "float32", "float32", autocast=False,
                             reason=f"training.mixed_precision={mixed_precision}")
    column_major = device_kind is not None and devices.slow_16bit_nn_gemm(device_kind)
    if has_fsdp_units(degrees, torchtitan=torchtitan):
        return PrecisionPlan("fsdp2_bf16_params", "bfloat16", "float32", "float32", autocast=False,
                             reason=f"training.mixed_precision=bf16 with FSDP2 units ({degrees.describe()})",
                             lm_head_column_major=column_major)
    where = "one process" if not degrees.sharded else f"{degrees.describe()}: no FSDP2 units"
    return PrecisionPlan("autocast_bf16", "float32", "float32", "float32", autocast=True,
                         reason=f"training.mixed_precision=bf16 on {where}: autocast over float32 parameters",
                         lm_head_column_major=column_major)


@dataclass
class RunInfo:
    """What the launcher knows about this run beyond its config."""

    run_dir: str
    wandb_group: str | None = None
    wandb_name: str | None = None
    swept: dict = field(default_factory=dict)  # sweep point: overridden key -> value
    prediction: dict = field(default_factory=dict)  # sweep point: its plan (qwen3_research.plan), in W&B config + summary


@dataclass(frozen=True)
class ResolvedRun:
    """A run as it will start: the config with every auto setting resolved, and what start-up derived from it.

    Read-only: ``config`` and ``rc`` are shared with whoever holds the description (the launcher, an in-process
    worker, the planner's trace); nothing writes into them (tests/test_plan.py checks the planner and the Trainer).
    """

    config: dict  # the resolved config as a plain dict: what workers build from, summary.json and W&B record
    rc: RunConfig  # ``config`` typed (validated)
    device_type: str  # cpu | cuda | neuron: the device the run uses (a plan: the device it is planned for)
    lnc: int | None  # the logical NeuronCore config (None off neuron unless set)
    nproc_per_node: int  # parallelism.nproc_per_node with -1 (auto) resolved
    degrees: Any  # parallel.Degrees: world size, dp_replicate, dp_shard, tp, ep, sequence_parallel
    model: dict  # models.describe: n_heads, n_kv_heads, num_experts, is_moe
    kernel_support: tuple[str, ...] = ()  # kernels.kernel_support: what an entry needs that this host lacks
    # Entry label -> module FQNs on the model built on the meta device (kernels.resolve); None when the entries are
    # resolved by the Trainer in this process instead (the model is built next here, on an accelerator), {} when the
    # run has no kernel entries.
    kernel_targets: dict[str, tuple[str, ...]] | None = field(default_factory=dict)
    kernel_warnings: tuple[str, ...] = ()  # entries that match no module (a run's workers warn about them)
    planned_elsewhere: bool = False  # a plan for a device this host does not have (device=neuron or cuda here)
    # compile.enable resolved (compiling.decide): on/off, its reason, the keyed compile cache and whether it was warm
    compile: Any = None
    precision: PrecisionPlan | None = None  # training.mixed_precision as carried out (precision_plan)
    # Tokens per optimizer step over every data-parallel rank: batch_size x dp x grad_accum x seq_len (what
    # data.global_batch_tokens asks for when set); throughput, metrics' token count, summary.json, the plan read it
    tokens_per_step: int = 0
    # The run dir's facts (``at_run_dir``, once the directory is known and checked): None until then.
    run_dir: str | None = None  # the run directory, absolute, checked (check_run_dir) in this process
    checkpoint_root: str | None = None  # where checkpoints are written and looked for
    resume_from: str | None = None  # the checkpoint a resume loads (None: a fresh start)
    init_from: str | None = None  # the Hugging Face weights the model starts from (model.init_from), checked

    @property
    def batch_size(self) -> int:
        """Sequences per data-parallel rank per micro-batch (``data.global_batch_tokens`` resolved)."""
        return self.rc.data.batch_size

    @property
    def mixed_precision(self) -> str:
        return self.rc.training.mixed_precision

    @property
    def device_kind(self) -> str:
        """cpu | cuda | neuron: the device the run uses (``device.type=auto`` resolved); read this, never
        ``rc.device.type``, after resolution."""
        return self.device_type

    @property
    def world_size(self) -> int:
        return self.degrees.world_size


def resolve_run(cfg: DictConfig | dict | RunConfig, *, plan: bool = False, kernels: bool = True,
                builds_here: bool | None = None, prepare: Callable[[str, int | None, int], None] | None = None
                ) -> ResolvedRun:
    """Resolve and check a composed config (a Hydra DictConfig, its plain dict, or a RunConfig) as the run
    would start; every failure is one ConfigError line.

    - ``plan``: a plan of the run made on this host (the planner): a device this host does not have
      (``device=neuron`` without TorchNeuron) is checked as planned -- the config as on CPU, the kernels for
      the planned device and LNC (``kernels.registry.planning_for``), ``device.memory_gib`` required, no
      torchtitan device check (it needs the device).
    - ``kernels``: resolve the kernel entries too (the doctor asks for them separately, ``kernel_targets``).
    - ``builds_here``: this process builds the run's model next, on the run's device (``verify_kernels``);
      None: when the run is one process here or a torchrun rank (the CLI and the launcher). The meta-device
      check then runs only on CPU: torchtitan reads the device it is for once, when it is first imported.
    - ``prepare(device_type, lnc, world_size)``: what starting the run changes in this process's environment
      (``device.prepare_launch``), called once those are resolved and before the torchtitan and kernel checks,
      which may import the device's runtime (TorchNeuron reads the LNC once).
    """
    log_call("resolve_run")
    config = _resolved_dict(cfg)
    planned = config.get("device", {}).get("type", "auto")
    planned_spec = devices.find(planned)
    elsewhere = plan and planned_elsewhere(planned)
    # A plan for Trainium or a GPU on a host without one: checked as a run would be, on CPU.
    checked = {**config, "device": {**config["device"], "type": "cpu"}} if elsewhere else config
    rc = validate(to_run_config(checked))
    check_device_settings(rc)
    if elsewhere and planned_spec.planning_table is None and rc.device.memory_gib is None:
        raise ConfigError("device=neuron is not on this host: planning it needs device.memory_gib (GiB per rank, "
                          "e.g. device.memory_gib=24 for a trn2 rank at LNC=2)")
    if elsewhere and planned_spec.planning_table is not None:
        devices.planned_gpu(rc.device)  # a known device.gpu, or device.memory_gib + device.peak_tflops (ConfigError)
    models.check(rc.model)  # the model backend's own rules (its spec)
    refuse_unread_keys(rc)
    facts = models.describe(rc.model)
    if rc.model.require_moe and not facts.get("is_moe"):
        source = (f"model.init_from={rc.model.init_from} (its config.json is dense)" if rc.model.init_from
                  else f"model.flavor={rc.model.flavor} (a dense flavor)")
        moe = ", ".join(models.moe_flavors())
        raise ConfigError(f"model=native_moe with {source}: the preset trains a mixture of experts; use a MoE flavor "
                          f"({moe}) or a MoE checkpoint, or model=native for a dense model")

    kind = planned if elsewhere else devices.device_kind(rc.device.type)
    if rc.model.attention == "flex" and not devices.get(kind).flex_attention:  # before Hydra makes the run dir
        # (the native model's constructor keeps the same guard for a model built without a resolution)
        raise ConfigError(f"model.attention=flex needs device cuda (FlexAttention has no {kind} training kernels: no "
                          f"backward on {kind.upper()}); this run's device is {kind}: use model.attention=sdpa")
    lnc = devices.resolve_lnc(rc.device.lnc, kind)
    p = rc.parallelism
    if elsewhere:  # the host's own count stands in for the planned host's (nothing to ask here)
        nproc = devices.host_nproc_per_node(None, p.nnodes) if p.nproc_per_node == -1 else p.nproc_per_node
    else:
        nproc = devices.resolve_nproc_per_node(p.nproc_per_node, kind, lnc)
    if devices.get(kind).runs_on_host and not plan and not p.oversubscribe and _torchrun_world_size() is None:
        _check_cpu_ranks(nproc, devices.cpu_cores())
    degrees = validate_degrees(dataclasses.replace(p, nproc_per_node=nproc), seq_len=rc.data.seq_len,
                               world_size=_torchrun_world_size(), **facts)
    batch_size = resolve_batch_size(rc, degrees.dp)
    check_pipeline_batch(degrees, batch_size)
    config = {**config, "data": {**config["data"], "batch_size": batch_size}}
    rc = dataclasses.replace(rc, data=dataclasses.replace(rc.data, batch_size=batch_size))
    spec = models.check(rc.model)
    tp_blocker = None if degrees.tp == 1 else ("a MoE model" if facts.get("is_moe") else
                                               None if spec.compiles_under_tp else f"model={spec.name}")
    decision = compiling.decide(rc, kind, is_moe=bool(facts.get("is_moe")), probe=not elsewhere and not plan,
                                tp_blocker=tp_blocker)
    decision = _compile_with_pipeline(rc, degrees, decision)
    check_pipeline_run(rc, degrees)
    config = {**config, "compile": {**config["compile"], "enable": decision.enable}}
    rc = dataclasses.replace(rc, compile=dataclasses.replace(rc.compile, enable=decision.enable))
    if prepare is not None:
        prepare(kind, lnc, degrees.world_size)
    lora.check_run(rc, degrees, spec, is_moe=bool(facts.get("is_moe")))  # what LoRA adapters cannot run with (one line, before any worker)
    if not elsewhere:
        models.check_run(rc)  # the backend's run checks (native: what the installed torchtitan cannot run)

    precision = precision_plan(rc.training.mixed_precision, degrees, torchtitan=spec.torchtitan, device_kind=kind)
    support, targets, caught = (), {}, ()
    if kernels and rc.kernels.entries:
        if not elsewhere:  # the packages a kernel imports are the planned host's business
            support = tuple(kernel_support_here(rc, kind, lnc))
        if builds_here is None:
            builds_here = _torchrun_world_size() is not None or degrees.world_size == 1
        if builds_here and not devices.get(kind).runs_on_host:
            targets = None  # the Trainer (or verify_kernels) resolves them on the model it builds next, here
        else:
            planning = plan and (devices.get(kind).kernels_by_shape or elsewhere)
            targets, caught = kernel_targets(rc, kind, lnc, dtype=precision.compute_dtype, planning=planning)
    return ResolvedRun(config=config, rc=to_run_config(config) if elsewhere else rc, device_type=kind, lnc=lnc,
                       nproc_per_node=nproc, degrees=degrees, model=dict(facts), kernel_support=support,
                       kernel_targets=targets, kernel_warnings=caught, planned_elsewhere=elsewhere, compile=decision,
                       precision=precision,
                       tokens_per_step=batch_size * degrees.dp * rc.training.grad_accum * rc.data.seq_len)


def check_pipeline_run(rc: RunConfig, degrees) -> None:
    """What a pipelined run (parallelism.pp > 1) does not do yet, one line each before any worker starts."""
    if not degrees.pipelined:
        return
    pp = f"parallelism.pp={degrees.pp}"
    if rc.data.document_masking:
        raise ConfigError(f"data.document_masking=true with {pp}: the per-document positions and masks are not passed "
                          "between pipeline stages yet; use data.document_masking=false or parallelism.pp=1")
    if rc.model.lora.enable:
        raise ConfigError(f"model.lora.enable=true with {pp}: LoRA adapters are not split into pipeline stages yet; "
                          "use parallelism.pp=1")
    if rc.training.eval_every and PP_SCHEDULES[degrees.pp_schedule] == "v":
        raise ConfigError(f"training.eval_every={rc.training.eval_every} with parallelism.pp_schedule={degrees.pp_schedule}: "
                          "torch's forward-only run of a V schedule fails (its local stage-to-stage hand-over expects "
                          "a backward); set training.eval_every=0 or use another parallelism.pp_schedule")
    if rc.checkpoint.export_hf:
        raise ConfigError(f"checkpoint.export_hf=true with {pp}: the run's own export needs the whole model on a rank; "
                          "set checkpoint.export_hf=false and export a saved checkpoint (DCP, any layout) with "
                          "python -m qwen3_research.export <checkpoint> <out_dir>")
    if rc.model.moe.balance == "aux_loss":
        raise ConfigError(f"model.moe.balance=aux_loss with {pp}: the auxiliary loss lives on every stage and the "
                          "schedule backpropagates only the last stage's loss; use model.moe.balance=bias (or auto)")


def _compile_with_pipeline(rc: RunConfig, degrees, decision: compiling.CompileDecision) -> compiling.CompileDecision:
    """compile.enable with parallelism.pp > 1: the per-block compile works on the whole model, not on stages yet."""
    if not degrees.pipelined or not decision.enable:
        return decision
    if rc.compile.enable is True:
        raise ConfigError(f"compile.enable=true with parallelism.pp={degrees.pp}: the stages are not compiled yet; use "
                          "compile.enable=false (or auto)")
    return dataclasses.replace(decision, enable=False, reason="auto: off with parallelism.pp > 1 (stages are not compiled yet)")


def planned_elsewhere(device_type: str) -> bool:
    """A plan for ``device.type=device_type`` is made for a device this host lacks (Trainium, a GPU): on CPU, as
    planned (``resolve_run(plan=True)``); the host's own kind needs nothing of the sort."""
    spec = devices.find(device_type)
    return bool(spec and not spec.runs_on_host and not spec.available())


def at_run_dir(run: ResolvedRun, run_dir: str | Path, *, owner: bool) -> ResolvedRun:
    """``run`` at ``run_dir``, checked once: the owner of the run dir (the launcher, rank 0 under torchrun) runs
    ``rundir.check_run_dir`` (one owner, resume rules, the data layout, and ``checkpoint.preflight``: the resume
    target's model and the ``init_from`` config); any other process only ``checkpoint.preflight``. Raises
    ConfigError, or ``rundir.AlreadyComplete`` for a finished run asked to resume. Returns the description with
    ``run_dir``, ``checkpoint_root``, ``resume_from`` and ``init_from`` filled in; writes nothing."""
    # deferred: start-up (the run dir's checks read checkpoints: torch; a config error exits before them)
    from qwen3_research.run import checkpoint, rundir

    run_dir = Path(os.path.abspath(str(run_dir)))
    rc = run.rc
    if owner:
        found = rundir.check_run_dir(rc, run_dir, dp=run.degrees.dp, batch_size=run.batch_size)
    else:
        found = checkpoint.find_checkpoint(rc.checkpoint.resume, checkpoint.checkpoint_root(rc.checkpoint, run_dir)) \
            if rc.checkpoint.resume else None
        if rc.checkpoint.resume or rc.model.init_from:
            checkpoint.preflight(rc, run_dir)
    return dataclasses.replace(run, run_dir=str(run_dir),
                               checkpoint_root=str(checkpoint.checkpoint_root(rc.checkpoint, run_dir)),
                               resume_from=str(found) if found is not None else None,
                               init_from=rc.model.init_from or None)


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ and "LOCAL_RANK" in os.environ


def resolve_before_hydra(cfg: DictConfig, run_dir: str | None) -> ResolvedRun:
    """The CLI's one resolution, before Hydra creates anything (``__main__.preflight``): ``resolve_run`` (with the
    LNC into the environment workers inherit), a tokenizer other than the packaged one loaded once, then the run
    dir (``resolve.at_run_dir``: one owner, resume rules, the checkpoint a resume loads) and whether it and the
    checkpoint dir can be written. ``run_dir``: ``hydra.run.dir`` as composed (None: only Hydra's run can resolve
    it, and ``run`` checks it). Raises ``AlreadyComplete`` for a finished run asked to resume (the CLI says why and
    exits 0), a ConfigError for a refusal."""
    run = resolve_run(cfg, prepare=devices.prepare_launch)  # under torchrun also against the world size it started
    spec = models.tokenizer_spec(run.rc)
    if spec != "qwen3":  # the packaged one is hash-checked; any other file must load as a tokenizer, now
        from qwen3_research.data import Tokenizer, tokenizer_path  # deferred: start-up (data loads torch)

        Tokenizer(tokenizer_path(spec))
    if run.rc.data.source == "chat":  # every record rendered (and cached) now: a bad one is refused before any worker
        from qwen3_research import chat_windows  # deferred: start-up (torch; transformers renders the template)

        chat_windows.prepare(run.rc.data, spec)
    if run_dir is None or (under_torchrun() and os.environ.get("RANK", "0") != "0"):
        return run  # under torchrun, rank 0 checks (and later locks) the run dir it shares with the others
    run = at_run_dir(run, run_dir, owner=True)
    check_writable(f"hydra.run.dir={run.run_dir}", Path(run.run_dir))  # Hydra's first write there was a traceback
    if run.rc.checkpoint.enable or run.rc.checkpoint.resume:
        check_writable(f"checkpoint.dir={run.checkpoint_root}", Path(run.checkpoint_root))
    return run


def refuse_unread_keys(rc: RunConfig) -> None:
    """A key set for an option the run did not choose is one ConfigError naming the option that reads it: the
    schema's ``read_by`` metadata (``config.keys_read_by``) against the config and the backend registry, before any
    worker starts. Such keys were accepted and ignored (issue 40): data.files without data=files trained on the
    embedded corpus, model.path with model=native a random model, model.flavor with model=hf the path's model."""
    model = registry.canonical(rc.model)
    spec = registry.spec(model)
    for key, value, (kind, *wanted) in keys_read_by(rc):
        shown = f"{key}={str(value).lower() if isinstance(value, bool) else repr(value)}"
        if kind == "backend":
            if getattr(spec, wanted[0]):
                continue
            readers = [o for o, b in registry.options().items() if getattr(registry.get(b), wanted[0])]
            raise ConfigError(f"{shown} is read only by model={'|'.join(readers)}; this run's model={spec.name} "
                              f"ignores it: use model={readers[0]}, or drop {key}")
        if kind == "balance":
            modes = registry.balance_modes(model)
            if set(wanted) & set(modes):
                continue
            flavors = [f for f in spec.flavors if set(wanted) & set(
                registry.balance_modes(dataclasses.replace(model, flavor=f, init_from=None)))]
            fix = f"a flavor that does (model.flavor={'|'.join(flavors)})" if flavors else "another model"
            raise ConfigError(f"{shown} is read only by a mixture-of-experts model that balances with "
                              f"{' or '.join(wanted)}; this run's model={spec.name} model.flavor={model.flavor} "
                              f"(model.moe.balance: {'|'.join(modes)}) ignores it: use {fix}, or drop {key}")
        current = rc
        for part in kind.split("."):
            current = getattr(current, part)
        if current in wanted:
            continue
        group = kind.split(".")[0]
        options = [f"{group}={v}" for v in wanted if Path(CONF_DIR, group, f"{v}.yaml").is_file()]
        readers = "|".join(options) or f"{kind}={'|'.join(wanted)}"
        raise ConfigError(f"{shown} is read only by {readers} ({kind}={'|'.join(wanted)}); this run's {kind}={current} "
                          f"ignores it: add {options[0] if options else f'{kind}={wanted[0]}'}, or drop {key}")


def kernel_support_here(rc: RunConfig, device_type: str, lnc: int | None) -> list[str]:
    """``kernels.kernel_support`` for the run's entries on its device: what each needs that this host lacks."""
    # deferred: start-up (kernels load torch; a config error up to the degrees exits without it)
    from qwen3_research.kernels import kernel_support

    return kernel_support(rc.kernels.entries, device_type, lnc, option=rc.kernels.option)


def kernel_targets(rc: RunConfig, device_type: str, lnc: int | None, *, dtype: str, planning: bool = False
                   ) -> tuple[dict[str, tuple[str, ...]], tuple[str, ...]]:
    """The kernel entries resolved as a worker resolves them once its model is built (``kernels.resolve``: device
    type, LNC, packages, the model's module types and shapes; each failure a ConfigError), on the model built on
    the meta device: no tensor memory, no device, in the run's compute dtype ``dtype`` (its ``PrecisionPlan``'s).
    Returns (entry label -> module FQNs, the no-match warnings).

    torchtitan is pinned to CPU for the build (it reads its device once, at import): call it where this process
    builds no model for an accelerator afterwards (``resolve_run`` decides). The warnings are returned, not
    printed: a run's workers print them when they resolve the entries on their own model; whoever builds no model
    afterwards shows them with ``warn_kernel_matches``."""
    from types import SimpleNamespace

    import torch

    # deferred: start-up (kernels load torch; a config error up to the degrees exits without it)
    from qwen3_research.kernels import KernelMatchWarning, resolve as resolve_kernels
    from qwen3_research.kernels.registry import planning_for  # deferred: start-up (as above)

    devices.prepare_torchtitan("cpu")  # the module structure only: nothing is placed on the run's device
    meta = torch.device("meta")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", KernelMatchWarning)
        backend = models.build(rc.model, meta, seq_len=rc.data.seq_len, seed=rc.training.seed, load_init_from=False)
        device = SimpleNamespace(type=device_type, lnc=lnc or devices.LNC_DEFAULT_NEURON, torch_device=meta)
        if planning:  # checked for, and shaped as, the planned device (the planner traces the same way)
            with planning_for(device_type, lnc):
                plan = resolve_kernels(backend.model, rc, device, dtype=dtype)
        else:
            plan = resolve_kernels(backend.model, rc, device, dtype=dtype)
    matches = tuple(str(w.message) for w in caught if issubclass(w.category, KernelMatchWarning))
    for w in caught:  # anything else the build warned about is shown as it would have been
        if not issubclass(w.category, KernelMatchWarning):
            warnings.showwarning(w.message, w.category, w.filename, w.lineno)
    return {label: tuple(fqns) for label, fqns in plan.items()}, matches


def warn_kernel_matches(messages) -> None:
    """Show the no-match warnings of a resolution (``kernel_warnings``) where no worker will resolve the entries
    again (the validate-only hook, the doctor)."""
    # deferred: start-up (kernels load torch; a config error up to the degrees exits without it)
    from qwen3_research.kernels import KernelMatchWarning

    for msg in messages:
        warnings.warn(msg, KernelMatchWarning, stacklevel=2)


def _resolved_dict(cfg: DictConfig | dict | RunConfig) -> dict:
    """The config as a plain dict with every interpolation and auto setting resolved (no ``hydra`` node)."""
    from omegaconf.errors import OmegaConfBaseException

    if isinstance(cfg, RunConfig):
        cfg = OmegaConf.to_container(OmegaConf.structured(cfg))
    elif isinstance(cfg, DictConfig):
        try:  # as to_run_config words it: an interpolation loop or a missing key is one line
            cfg = OmegaConf.to_container(cfg, resolve=True)
        except OmegaConfBaseException:
            to_run_config(cfg)  # raises the ConfigError
            raise
    else:
        cfg = copy.deepcopy(cfg)  # the caller's dict is never written
    cfg = {k: v for k, v in cfg.items() if k != "hydra"}
    return _resume_when_requeued(auto_settings(_balance_for_export(_loss_for_backend(cfg))))


# -- what depends on the device kind: its spec (qwen3_research/devices/<kind>.py) ---------------------------------


def device_spec(device_type: str) -> tuple[str, devices.DeviceSpec | None]:
    """(the device kind a run with ``device.type=device_type`` uses, its spec), without importing torch
    (``devices.device_kind``: auto is the first registered kind this host has). An unknown type has no spec:
    ``check_device_settings`` names it."""
    kind = devices.device_kind(device_type)
    return kind, devices.find(kind)


def auto_settings(resolved: dict) -> dict:
    """``resolved`` (a plain config dict) with ``training.mixed_precision=auto`` and ``training.loss=auto``
    replaced by the values this run uses, from its device kind's spec (``default_precision``, ``default_loss``): the one place an auto
    setting of the training section is filled in. Called before anything reads the config (a plan traces on CPU
    and must keep the Trainium value), so summary.json and W&B record the resolved values. A config option writes
    only its own section, so device=neuron cannot set these itself
    (tests/test_config.py::test_group_options_extend_their_schema)."""
    training = resolved.get("training", {})
    if not isinstance(training, dict):
        return resolved
    _, spec = device_spec((resolved.get("device") or {}).get("type", "auto"))
    if spec is None:  # an unknown device.type: check_device_settings refuses it, naming it
        return resolved
    changed = {}
    if training.get("mixed_precision", "auto") == "auto":  # absent: the default
        changed["mixed_precision"] = spec.default_precision
    if training.get("loss", "auto") == "auto":
        changed["loss"] = spec.default_loss
    return {**resolved, "training": {**training, **changed}} if changed else resolved


def check_device_settings(rc: RunConfig) -> RunConfig:
    """What the run's device kind refuses (its spec): an unknown kind, a device this host cannot run
    (``refused_before_torch``), pinned-memory checkpoint staging without an accelerator (``pinned_staging``), and a
    profiling capture the device does not have. One ConfigError line each."""
    requested = rc.device.type
    if requested != devices.AUTO and requested not in devices.kinds():
        raise ConfigError(f"device.type={requested!r} is not one of {sorted({devices.AUTO, *devices.kinds()})}")
    kind, spec = device_spec(requested)
    if requested != devices.AUTO and spec.refused_before_torch and not spec.present():
        raise ConfigError(spec.unavailable_reason())
    if rc.checkpoint.async_mode == "async_with_pinned_mem" and not spec.pinned_staging:
        raise ConfigError(f"checkpoint.async_mode=async_with_pinned_mem stages into pinned memory on an accelerator's "
                          f"copy stream, which device {kind} has none of (torch's non-blocking copy asserts one); use "
                          "checkpoint.async_mode=async (a thread writes the host copy while training goes on)")
    p = rc.profiling
    if p.neuron_device_profile is not None and spec.torch_profiler:
        raise ConfigError(f"profiling.neuron_device_profile={p.neuron_device_profile!r} is a Neuron runtime capture "
                          f"(NEURON_RT_INSPECT_DEVICE_PROFILE) and device.type={requested} is not neuron; leave it unset "
                          "(profiling.steps gives a torch profiler trace on cpu and cuda)")
    if p.memory_snapshot and spec.memory_snapshot is None:
        raise ConfigError("profiling.memory_snapshot=true has no Neuron equivalent (the snapshot is PyTorch's CUDA/CPU "
                          "allocator record); on neuron set profiling.steps=[a,b]: the Neuron runtime profile shows "
                          "device memory")
    return rc


def _balance_for_export(cfg: dict) -> dict:
    """``model.moe.balance=auto`` with ``checkpoint.export_hf=true``: the auxiliary loss where the backend's own
    default is the expert bias. Hugging Face's Qwen3-MoE has no expert bias: torchtitan adds it to the router's
    scores only to choose the experts (the gate weights stay unbiased), so no change of the router weights carries
    it and the exported model would route differently (``models.check_run`` refuses balance=bias there)."""
    model, ck = cfg.get("model") or {}, cfg.get("checkpoint") or {}
    moe = model.get("moe") or {}
    if not ck.get("export_hf") or moe.get("balance", "auto") != "auto" or not model.get("backend"):
        return cfg
    try:
        modes = registry.balance_modes(model)
    except ConfigError:
        return cfg  # an unknown backend: validation names it
    if modes[:1] != ("bias",):  # the model's own (native: a dense flavor has none)
        return cfg
    return {**cfg, "model": {**model, "moe": {**moe, "balance": "aux_loss"}}}


def _loss_for_backend(cfg: dict) -> dict:
    """``training.loss``: the chunked loss (auto's choice on cpu) only for a backend that has one
    (``BackendSpec.chunked_loss``); auto is then the full loss, and chunked asked for is a config error."""
    training, model = cfg.get("training") or {}, cfg.get("model") or {}
    loss = training.get("loss", "auto")
    if loss not in ("auto", "chunked") or not model.get("backend"):
        return cfg
    try:
        spec = registry.get(model["backend"], model.get("module"))
    except ConfigError:
        return cfg  # an unknown backend: validation names it
    if spec.chunked_loss:  # both torchtitan APIs (0.2.x through titan/v02's model seam): the same choice
        return cfg
    if loss == "chunked":
        raise ConfigError(f"training.loss=chunked: model.backend={model['backend']!r} has no hidden_states and "
                          "lm_head_weight (BackendSpec.chunked_loss); use training.loss=full (or auto)")
    return {**cfg, "training": {**training, "loss": "full"}}


def _resume_when_requeued(resolved: dict) -> dict:
    """A Slurm job started again after preemption/requeue (SLURM_RESTART_COUNT > 0) resumes from its run dir's
    latest checkpoint: ``checkpoint.resume=auto`` unless the config names one."""
    ck = resolved.get("checkpoint") or {}
    if slurm.restart_count() > 0 and not ck.get("resume"):
        return {**resolved, "checkpoint": {**ck, "resume": "auto"}}
    return resolved


def _check_cpu_ranks(nproc: int, cores: int) -> None:
    """A CPU run starts at most ``CPU_RANKS_PER_CORE`` ranks per core of this host unless told to
    (``parallelism.oversubscribe=true``); a plan is not refused (it may be for a larger host)."""
    if nproc > CPU_RANKS_PER_CORE * cores:
        raise ConfigError(
            f"parallelism.nproc_per_node={nproc} starts {nproc} CPU ranks on the {cores} core(s) this process may use, "
            f"more than {CPU_RANKS_PER_CORE} per core (each rank is a whole process with its own torch); use at most "
            f"{CPU_RANKS_PER_CORE * cores}, or start them anyway with parallelism.oversubscribe=true")


def _torchrun_world_size() -> int | None:
    """The world torchrun started (each rank resolves against it), None outside torchrun."""
    if os.environ.get("TORCHELASTIC_RUN_ID") and "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    return None
