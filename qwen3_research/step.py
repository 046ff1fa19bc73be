"""One training step assembled from its parts: ``build_step(run, where) -> Step``.

The parts are the model backend (built, kernel overrides installed, sharded, compiled), the optimizer and its
schedule, the data, the loss and the precision; ``Step.__call__`` states the step's one order: per micro-batch
forward, loss and backward, then gradient clipping, the optimizer update and the schedule. ``where`` (a
``Placement``) says where it is built: the device, this process's rank in its world, the device mesh and how to
gather one object from every rank. A run takes the real one (``place(run)``: the process group torchrun started);
the memory planner (``qwen3_research.planner``) injects a trace placement (fake CPU tensors, a fake process group)
and builds the very same parts, with nothing in the run's config rewritten.

The Trainer (``qwen3_research.trainer``) is the loop over a ``Step``: checkpointer, sinks, profiler, signals.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.distributed.tensor import Replicate, Shard

from qwen3_research import compiling, lora, models, parallel, startup, titan
from qwen3_research import devices
from qwen3_research.chat_windows import ChatDataset
from qwen3_research.data import IGNORE_INDEX, PackedDataset, Tokenizer, data_layout, tokenizer_path
from qwen3_research.errors import ConfigError, TrainingError
from qwen3_research.kernels import apply_overrides
from qwen3_research.loss import column_major_lm_head, lm_loss
from qwen3_research.memory import gather_objects
from qwen3_research.optim import build_optimizer
from qwen3_research.parallel import Degrees
from qwen3_research.pipeline import Pipeline
from qwen3_research.resolve import ResolvedRun
from qwen3_research.routing import RoutingMonitor
from qwen3_research.run.train_state import TrainState


def dist_env() -> tuple[int, int, int]:
    """(RANK, LOCAL_RANK, WORLD_SIZE) as torchrun (or our worker group) set them; (0, 0, 1) alone."""
    return int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


@dataclass(frozen=True)
class Placement:
    """Where a step is built and runs.

    ``device``: the ``device.Device`` its tensors live on; ``rank`` of ``world_size``; ``parallel_dims``:
    torchtitan's ParallelDims with its mesh built (None: one process without a mesh); ``gather(obj)``: every
    rank's ``obj`` in rank order; ``trace``: the planner's fake-tensor trace, where nothing is loaded or compiled
    (no weights from ``model.init_from``, no ``compile``) and no tensor value is read on the host.
    """

    device: devices.Device
    rank: int
    world_size: int
    parallel_dims: object
    gather: Callable[[object], list] = field(repr=False)
    trace: bool = False


def place(run: ResolvedRun) -> Placement:
    """This process's placement for ``run``: its device (torchtitan prepared for it before its first import), the
    process group (started here in a worker group), torchtitan's mesh, ``all_gather_object`` as the gather."""
    cfg = run.rc
    rank, local_rank, world_size = dist_env()
    device_type = devices.resolve_device_type(run.device_kind)  # the resolved kind, torch-checked where it runs
    devices.prepare_torchtitan(device_type)
    device = devices.Device(device_type, local_rank, cfg.device.lnc, gpu_peak_table=titan.gpu_peak_flops)
    device.reset_peak_memory()  # this run's peak, not an earlier run's in this process
    if world_size > 1 and not torch.distributed.is_initialized():
        torch.distributed.init_process_group(backend=device.dist_backend)
    # The degrees were checked at resolution (each torchrun rank resolves against the world it started in)
    if world_size != run.world_size:
        raise ConfigError(f"the run was resolved for {run.world_size} processes ({run.degrees.describe()}) but "
                          f"{world_size} started; resolve it where it starts (resolve.resolve_run)")
    parallel_dims = parallel.build_parallel_dims(run.degrees, device_type, single_process_mesh=run.model["is_moe"])
    return Placement(device, rank, world_size, parallel_dims, functools.partial(gather_objects, world_size=world_size))


def compute_dtype(run: ResolvedRun) -> torch.dtype:
    """The dtype the step computes in (the device's peak FLOPs are this dtype's): the run's precision plan's."""
    return getattr(torch, run.precision.compute_dtype)


@dataclass(eq=False, kw_only=True)
class Step:
    """The parts of one training step (built by ``build_step``) and its one order (``__call__``).

    Keyword-only: a field added later cannot shift the others' values."""

    run: ResolvedRun
    where: Placement
    tokenizer: Tokenizer
    data: PackedDataset
    data_layout: dict
    dp_rank: int
    dp_size: int
    eval_every: int  # training.eval_every, 0 when the data holds no held-out documents
    backend: object  # models.base.ModelBackend
    kernel_plan: object  # kernels.apply_overrides' plan ({} without kernel entries)
    loss_scale: float  # backward sees loss x this; gradients are then summed over dp ranks
    routing: RoutingMonitor | None  # MoE: routing statistics and the auxiliary loss (None: dense, or nothing asked)
    precision: dict  # run.precision.summary(): how training.mixed_precision is carried out
    autocast: str  # "bf16" | "none"
    compiled: str  # what compile.enable compiled ("none": eager)
    cross_entropy: Callable | None  # the compiled full loss, None: eager
    optimizer: torch.optim.Optimizer
    scheduler: object
    state: TrainState  # what a checkpoint holds
    state_bytes: dict | None = None  # params + grads + optimizer state of this rank, after the first update
    loss_tokens: int | None = None  # label tokens in the loss in the last step, over every data-parallel rank
    # Called before the optimizer changes the weights (the Trainer's: an asynchronous checkpoint's staging done)
    before_update: Callable[[], None] | None = None
    pipeline: Pipeline | None = None  # parallelism.pp > 1: the schedule that runs this rank's stages

    @property
    def cfg(self):
        return self.run.rc

    @property
    def degrees(self) -> Degrees:
        return self.run.degrees

    @property
    def torch_device(self) -> torch.device:
        return self.where.device.torch_device

    # -- the step --------------------------------------------------------------------------------
    def __call__(self) -> tuple[float, float] | None:
        """Optimizer step ``state.step + 1``; afterwards ``state.step`` counts it. Per micro-batch: forward, the
        loss, backward; then clip the gradients, apply the update (unless training.nan_policy skips it), advance
        the schedule. Returns (the loss: the mean over every label token of the global batch, gradient norm); in a
        trace (fake tensors: no value to read, reduce or check) None, the update applied.

        The gradient is that of the global batch's token mean, however its tokens fall into micro-batches and
        ranks: each micro-batch's mean loss is weighted by its share of the step's label tokens (one scalar
        all-reduce counts them first). A mean of per-micro-batch means weighted short micro-batches up: with chat
        data, where the tokens in the loss vary from window to window, a run with training.grad_accum=2 or two
        data-parallel ranks trained on another gradient than one process on the same batch (torchtitan's trainer
        and transformers' num_items_in_batch normalise the same way)."""
        batches = list(self.micro_batches(self.state.step))
        if self.where.trace:
            for batch in batches:
                self.forward_backward(batch, None)
            del batches
            self.clip_gradients()  # a 0-dim tensor a trace never holds through the update (the plan's bytes unchanged)
            self.optimizer_step()
            self.state.step += 1
            return None
        counts = [label_tokens(b) for b in batches]
        n_step = int(self.all_reduce_sum(torch.tensor([float(sum(counts))], device=self.torch_device))[0])
        total = torch.zeros(2, device=self.torch_device)  # the label tokens' summed loss, their count
        for batch, n in zip(batches, counts):
            total[0] += self.forward_backward(batch, (n, n_step))
            total[1] += n
        grad_norm = self.clip_gradients()
        if self.pipeline is not None:
            total = self.pipeline.sum_over_stages(total)
        total = self.all_reduce_sum(total)  # one collective for both
        loss_value = float(total[0] / total[1]) if total[1] > 0 else float("nan")
        grad_value = float(grad_norm)
        self.loss_tokens = int(round(float(total[1])))
        if not self.skips_update(loss_value, grad_value):
            self.optimizer_step()
        self.state.step += 1
        return loss_value, grad_value

    def micro_batches(self, step: int):
        """This data-parallel rank's training.grad_accum micro-batches of optimizer step ``step`` (0-based)."""
        t = self.cfg.training
        for micro in range(t.grad_accum):
            yield self.data.train_batch(step, micro, t.grad_accum, self.dp_rank, self.dp_size, t.seed)

    def loss(self, inputs: torch.Tensor, labels: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """The language-model loss; ``positions``: per-document positions (data.document_masking), else None."""
        device = self.where.device
        if self.cfg.training.loss == "chunked":  # lm_head + loss a chunk of tokens at a time (qwen3_research.loss)
            with device.autocast(self.autocast):
                return lm_loss(self.backend, inputs, labels, self.cfg.training.loss_chunk_tokens, positions,
                               self.run.precision.lm_head_column_major)
        with device.autocast(self.autocast):
            logits = self.backend.forward(inputs) if positions is None else self.backend.forward(inputs, positions=positions)
        if hasattr(logits, "full_tensor"):  # a DTensor (tensor parallel without loss parallel)
            logits = logits.full_tensor()
        if self.cross_entropy is not None:  # compiled (compile.enable): the float32 upcast fused into the loss
            return self.cross_entropy(logits, labels)
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())

    def forward_backward(self, batch, tokens: tuple[int, int] | None) -> torch.Tensor:
        """One micro-batch of the step being trained: forward, the configured loss, backward. ``tokens``: (this
        micro-batch's label tokens, the step's over every micro-batch and data-parallel rank): its mean loss counts
        by its share of them (``__call__``); None (a trace): 1 / training.grad_accum. Returns the micro-batch's
        summed token loss, detached (not reduced over ranks)."""
        t = self.cfg.training
        inputs = batch.inputs.to(self.torch_device)
        labels = batch.labels.to(self.torch_device)
        if self.pipeline is not None:  # the schedule runs forward, loss and backward of every micro-batch
            self.pipeline.n_step = tokens[1] if tokens is not None else t.grad_accum * label_tokens(batch)
            self.pipeline.scale = self.dp_size * self.loss_scale
            with self.where.device.autocast(self.autocast):
                return self.pipeline.run(inputs, labels, train=True)
        positions = None if batch.positions is None else batch.positions.to(self.torch_device)
        mean = self.loss(inputs, labels, positions)
        if tokens is None:
            share, n = 1.0 / t.grad_accum, 1
        else:
            n, n_step = tokens
            share = n / n_step if n_step else 0.0
        # The gradients are summed over the data-parallel ranks where the model is sharded (loss_scale = 1/dp), and
        # each rank's share is already of the whole step: dp x loss_scale undoes the 1/dp. A micro-batch with no
        # label token has a NaN mean (0/0): it contributes nothing, and its backward still runs (FSDP's collectives).
        objective = (mean * share if n else mean.nan_to_num(0.0) * 0.0) * (self.dp_size * self.loss_scale)
        # balance=aux_loss: coef × the routers' auxiliary loss joins the gradient, not the reported LM loss
        aux = self.routing.aux_term() if self.routing is not None else None
        if aux is not None:
            objective = objective + aux / t.grad_accum * self.loss_scale
        objective.backward()
        return (mean.detach() * n) if n else torch.zeros((), device=mean.device)

    def clip_gradients(self) -> torch.Tensor:
        """Clip the gradients to optimizer.grad_clip (0: no clipping); their total norm before clipping."""
        max_norm = self.cfg.optimizer.grad_clip if self.cfg.optimizer.grad_clip > 0 else float("inf")
        params = [p for p in self.backend.model.parameters() if p.grad is not None]
        # pipelined: the norm of every stage's gradients (torchtitan sums the squares over the pp mesh)
        pp_mesh = self.where.parallel_dims.get_mesh("pp") if self.pipeline is not None else None
        norm = titan.clip_grad_norm_(params, max_norm, ep_enabled=self.degrees.ep > 1, pp_mesh=pp_mesh)
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm

    def optimizer_step(self) -> None:
        """Apply the update, free the gradients, advance the learning-rate schedule."""
        if self.before_update is not None:
            self.before_update()
        self.optimizer.step()
        if self.state_bytes is None:  # params + grads + optimizer state held by this rank (local shards)
            self.state_bytes = parallel.state_bytes(self.backend.model, self.optimizer)
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()

    def skips_update(self, loss: float, grad_norm: float) -> bool:
        """training.nan_policy for a non-finite loss or gradient norm: stop (TrainingError), or skip this step's
        update (True; the gradients are dropped and the step is recorded in ``state.skipped_steps``)."""
        if torch.isfinite(torch.tensor([loss, grad_norm])).all():
            return False
        self.optimizer.zero_grad(set_to_none=True)
        step = self.state.step + 1
        if self.cfg.training.nan_policy == "stop":
            raise TrainingError(
                f"step {step}: non-finite loss={loss} or grad_norm={grad_norm}; stopped "
                "(training.nan_policy=stop). Lower optimizer.lr or set training.nan_policy=skip"
            )
        self.state.skipped_steps.append(step)
        return True

    def all_reduce_sum(self, value: torch.Tensor) -> torch.Tensor:
        if self.dp_size > 1:
            group = self.where.parallel_dims.get_mesh("batch").get_group()
            torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.SUM, group=group)
        return value

    @torch.no_grad()
    def evaluate(self, should_stop: Callable[[], int] | None = None) -> float | None:
        """The mean loss over the label tokens of training.eval_batches held-out batches on every data-parallel rank.
        ``should_stop`` (the loop's ``StopOnSignal.requested``: the same answer on every rank) is asked before each
        batch after the first: a stop signal abandons the evaluation (None), where Ctrl-C used to wait for all of
        it (issue 40 weak case)."""
        t = self.cfg.training
        batches = self.data.val_batches(t.eval_batches, self.dp_rank, self.dp_size)
        if not batches:
            return float("nan")
        model = self.backend.model
        model.eval()
        total = torch.zeros(2, device=self.torch_device)  # the label tokens' summed loss, their count
        try:
            for i, b in enumerate(batches):
                if i and should_stop is not None and should_stop():
                    return None
                positions = None if b.positions is None else b.positions.to(self.torch_device)
                n = label_tokens(b)
                if self.pipeline is not None:  # forward only, through the schedule
                    with self.where.device.autocast(self.autocast):
                        total[0] += self.pipeline.run(b.inputs.to(self.torch_device), b.labels.to(self.torch_device),
                                                      train=False)
                    total[1] += n
                elif n:
                    total[0] += self.loss(b.inputs.to(self.torch_device), b.labels.to(self.torch_device), positions) * n
                    total[1] += n
                else:  # nothing to score; the forward still runs (FSDP's collectives), its 0/0 mean is dropped
                    self.loss(b.inputs.to(self.torch_device), b.labels.to(self.torch_device), positions)
        finally:
            model.train()
            parallel.reshard(model)  # a forward without backward leaves FSDP's root unit gathered
        if self.pipeline is not None:
            total = self.pipeline.sum_over_stages(total)
        total = self.all_reduce_sum(total)  # the mean over every held-out label token, as the training loss
        return float(total[0] / total[1]) if total[1] > 0 else float("nan")


def label_tokens(batch) -> int:
    """The tokens of a batch that are in the loss (labels the data did not set to IGNORE_INDEX)."""
    return int((batch.labels != IGNORE_INDEX).sum())


def build_step(run: ResolvedRun, where: Placement, *, run_dir: str | Path) -> Step:
    """The step of ``run`` placed at ``where``: data, model (built seeded, kernel overrides, sharded, compiled),
    loss, precision, optimizer and schedule, and the ``TrainState`` a checkpoint holds. ``run_dir``: where
    torchtitan's config objects point (a trace passes a temporary directory). Nothing here writes into the run's
    config."""
    startup.note_trainer_built()
    cfg, degrees = run.rc, run.degrees
    is_main = where.rank == 0
    dp_rank, dp_size = dp_coordinates(degrees, where.parallel_dims)

    # Data.
    tokenizer = Tokenizer(tokenizer_path(models.tokenizer_spec(cfg)))
    data = (ChatDataset if cfg.data.source == "chat" else PackedDataset)(cfg.data, tokenizer)
    eval_every = check_data_fits(cfg, data, dp_size, is_main=is_main)
    layout = data_layout(cfg, dp_size, cfg.data.batch_size, tokenizer.sha256, data)

    # Model: build (seeded), kernel overrides, shard, compile.
    tt = parallel.torchtitan_training_configs(
        degrees,
        activation_checkpoint=cfg.parallelism.activation_checkpoint,
        compile_cfg=cfg.compile,
        mixed_precision=run.precision.setting,
        run_dir=str(run_dir),
    )
    backend = models.build(
        cfg.model, where.device.torch_device, seq_len=cfg.data.seq_len, seed=cfg.training.seed,
        tt_parallelism=tt.parallelism, tokenizer=tokenizer, load_init_from=not where.trace,
    )
    # The plan traces on fake tensors, and PEFT moves each new adapter to its base's device with Module.to, which
    # cannot swap a fake Parameter (torch 2.14: "Cannot swap t1 because it has weakref"): a plan's adapters are
    # made as real CPU tensors (rank x (in + out) per projection: 175 MB for 8B at rank 16), sharded and traced
    # like the rest from there
    with unset_fake_temporarily() if where.trace else contextlib.nullcontext():
        adapters = lora.apply_lora(backend, cfg.model.lora) if cfg.model.lora.enable else None
    if adapters is not None and is_main and not where.trace:
        print(f"lora: rank {cfg.model.lora.rank} on {adapters['modules']} modules ({','.join(adapters['targets'])})"
              + (f"; {','.join(adapters['unmatched'])} match nothing here (MoE experts are frozen)"
                 if adapters["unmatched"] else "") + f"; {lora.count_line(adapters['trainable'], adapters['total'])}",
              flush=True)
    kernel_plan = apply_overrides(backend.model, cfg, where.device, dtype=run.precision.compute_dtype) \
        if cfg.kernels.entries else {}
    loss_scale, pipeline = 1.0, None
    if degrees.pipelined:  # torchtitan's pipeline_llm: this rank's stages, each sharded as below, and the schedule
        pipeline = Pipeline(group=where.parallel_dims.get_mesh("pp").get_group(), microbatches=degrees.pp_microbatches,
                            chunk_tokens=cfg.training.loss_chunk_tokens if cfg.training.loss == "chunked" else None,
                            column_major=run.precision.lm_head_column_major, trace=where.trace,
                            boundary=stage_boundary(run, where.parallel_dims) if where.trace else None)
        pipeline.schedule, pipeline.stages, pipeline.has_first, pipeline.has_last = backend.pipeline(
            where.parallel_dims, tt, loss_fn=pipeline.loss, local_batch_size=cfg.data.batch_size,
            microbatches=degrees.pp_microbatches)
        if pipeline.has_last and pipeline.chunk_tokens is not None:  # the last stage returns hidden states
            last = backend.model.stage_parts[pipeline.stages.index(max(pipeline.stages))]
            last._skip_lm_head = True
            pipeline.lm_head = lambda: last.lm_head.weight
        devices.after_sharding(where.device, backend.model)
        loss_scale = parallel.sum_gradients_over_dp(backend.model, degrees)
    elif degrees.sharded:
        backend.parallelize(where.parallel_dims, tt)
        devices.after_sharding(where.device, backend.model)
        loss_scale = parallel.sum_gradients_over_dp(backend.model, degrees)
    else:
        backend.finalize_single(tt)
    if adapters is not None:  # sharding re-creates parameters trainable: the base is frozen again
        lora.freeze_base(backend.model)
        if not where.trace:  # after the weights exist (materialized, sharded): seeded by name
            lora.init_adapters(backend.model, cfg.training.seed)
    if pipeline is None or pipeline.has_last:  # the lm_head (pipelined: the last stage's part holds it)
        head = backend.lm_head_module() if pipeline is None else \
            backend.model.stage_parts[pipeline.stages.index(max(pipeline.stages))].lm_head
        column_major_lm_head(head, run.precision.lm_head_column_major)  # decided at resolution (the run's kind)
    routing = RoutingMonitor.attach(backend, cfg.model.moe, where.device.torch_device)
    # The precision plan decided at resolution (run.precision); the built model must carry it out
    run.precision.check(parallel.fsdp_precision(backend.model), str(next(iter(backend.model.parameters())).dtype).removeprefix("torch."))
    precision, autocast = run.precision.summary(), "bf16" if run.precision.autocast else "none"
    # compile.enable as resolved (run.compile: its reason, the shared cache): each block and the loss, in place
    compiled, cross_entropy = "none", None
    if cfg.compile.enable and not where.trace:
        compiling.export_cache_env(run.compile)  # the launcher set it already; a torchrun rank sets it here
        compiled = compiling.apply(backend.model, run.compile, fullgraph=cfg.compile.fullgraph, is_moe=run.model["is_moe"])
        if cfg.training.loss == "full":  # the chunked loss is its own autograd function: left eager
            cross_entropy = compiling.compiled_cross_entropy(run.compile)
            compiled += " + loss"

    optimizer, scheduler = build_optimizer(backend.model, cfg.optimizer, cfg.training.steps)
    backend.register_optimizer_hooks(optimizer, where.parallel_dims)
    state = TrainState(backend.model, optimizer, scheduler, rank=where.rank, device_type=where.device.type,
                       save_frozen=adapters is None)  # LoRA: the checkpoint holds the adapters, not the base
    return Step(
        run=run, where=where,
        tokenizer=tokenizer, data=data, data_layout=layout, dp_rank=dp_rank, dp_size=dp_size, eval_every=eval_every,
        backend=backend, kernel_plan=kernel_plan, loss_scale=loss_scale, routing=routing,
        precision=precision, autocast=autocast, compiled=compiled, cross_entropy=cross_entropy,
        optimizer=optimizer, scheduler=scheduler, state=state, pipeline=pipeline,
    )


def stage_boundary(run: ResolvedRun, parallel_dims) -> tuple:
    """What one pipeline stage hands the next per micro-batch (``pipeline_trace.replay``'s ``boundary``): a block's
    output, the hidden states of data.batch_size / pp_microbatches sequences in the FSDP2 parameters' dtype the
    blocks compute in; under tensor parallel a DTensor on the tp mesh, sharded over the sequence with sequence
    parallel (the block's last projection returns Shard(1)), else replicated. (local shape, dtype, None or (tp
    mesh, placements, global shape))."""
    d, f = run.degrees, models.architecture(run.rc.model)
    full = (run.rc.data.batch_size // d.pp_microbatches, run.rc.data.seq_len, f.dim)
    dtype = torch.bfloat16 if run.precision.param_dtype == "bfloat16" else torch.float32
    if d.tp == 1:
        return full, dtype, None
    local = (full[0], full[1] // d.tp, full[2]) if d.sequence_parallel else full
    return local, dtype, (parallel_dims.get_mesh("tp"), (Shard(1) if d.sequence_parallel else Replicate(),), full)


def dp_coordinates(degrees: Degrees, parallel_dims) -> tuple[int, int]:
    """(this rank's data-parallel rank, the data-parallel size)."""
    if not degrees.sharded or degrees.dp == 1:
        return 0, 1
    mesh = parallel_dims.get_mesh("batch")
    return mesh.get_local_rank(), mesh.size()


def check_data_fits(cfg, data: PackedDataset, dp_size: int, *, is_main: bool) -> int:
    """A global batch larger than the data is refused; no held-out documents turns evaluation off. Returns the
    evaluation interval (training.eval_every, or 0)."""
    t, d = cfg.training, cfg.data
    per_step = d.batch_size * dp_size * t.grad_accum
    if per_step > len(data.train):
        raise ConfigError(
            f"data.batch_size={d.batch_size} × dp {dp_size} × training.grad_accum={t.grad_accum} = {per_step} "
            f"sequences per step, but the data holds only {len(data.train)} training sequences of "
            f"data.seq_len+1={d.seq_len + 1} tokens; lower data.batch_size (or data.seq_len), or add data"
        )
    if cfg.optimizer.warmup_steps > t.steps and is_main:
        print(f"warning: optimizer.warmup_steps={cfg.optimizer.warmup_steps} > training.steps={t.steps}: the "
              "learning rate never reaches optimizer.lr in this run", file=sys.stderr, flush=True)
    if t.eval_every and len(data.val) == 0:
        if is_main:
            print(f"warning: no held-out documents (data.val_fraction={d.val_fraction}, {data.num_documents} "
                  "documents); evaluation is off for this run (training.eval_every ignored)", file=sys.stderr, flush=True)
        return 0
    return t.eval_every
