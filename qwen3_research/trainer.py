"""The training recipe: build everything from one resolved run (``resolve.ResolvedRun``), then loop.

Runs in every rank. Only rank 0 writes console lines, metrics.jsonl and the W&B run;
memory is gathered from every rank.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from qwen3_research import device as devices
from qwen3_research import compiling, parallel, startup, titan
from qwen3_research.errors import ConfigError, TrainingError  # noqa: F401  (re-exported for callers)
from qwen3_research.resolve import ResolvedRun


@dataclass
class RunInfo:
    """What the launcher knows about this run beyond its config."""

    run_dir: str
    wandb_group: str | None = None
    wandb_name: str | None = None
    swept: dict = field(default_factory=dict)  # sweep point: overridden key -> value
    prediction: dict = field(default_factory=dict)  # sweep point: its plan (qwen3_research.plan), in W&B config + summary


def dist_env() -> tuple[int, int, int]:
    return int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


class Trainer:
    """Build everything from one resolved run (``__init__``), then loop (``train``).

    One step (``train_step``) is ``forward_backward`` per micro-batch, ``clip_gradients``, the NaN policy and
    ``optimizer_step``; the planner (``qwen3_research.plan``) traces the same methods on fake tensors. What a
    checkpoint holds is ``self.state`` (``TrainState``). The run's degrees, batch size, model facts and precision
    are the description's (``run``, resolved before any worker started); nothing here writes into its config.
    """

    def __init__(self, run: ResolvedRun, info: RunInfo):
        startup.note_trainer_built()
        self.run = run
        self.cfg = cfg = run.rc
        self.info = info
        self.run_dir = Path(info.run_dir)
        self.rank, local_rank, self.world_size = dist_env()
        self.is_main = self.rank == 0
        t_start = time.perf_counter()

        # Device first: torchtitan must see it before its first import.
        device_type = devices.resolve_device_type(cfg.device.type)
        devices.prepare_torchtitan(device_type)
        self.device = devices.Device(device_type, local_rank, cfg.device.lnc, gpu_peak_table=titan.gpu_peak_flops)
        self.device.reset_peak_memory()  # this run's peak, not an earlier run's in this process
        if self.world_size > 1 and not torch.distributed.is_initialized():
            torch.distributed.init_process_group(backend=self.device.dist_backend)
        # After the process group (on neuron it starts the runtime on this rank's core): every rank's
        # device, LNC and environment as the worker sees them, for summary.json.
        from qwen3_research import allocator

        self.device_facts = self._gather({**self.device.facts(self._compute_dtype()), "cpu_allocator": allocator.status(),
                                          "spawned": allocator.started_by_spawn()})  # as this rank observes them

        from qwen3_research import models
        from qwen3_research.data import PackedDataset, Tokenizer, tokenizer_path

        # The degrees were checked at resolution (each torchrun rank resolves against the world it started in)
        if self.world_size != run.world_size:
            raise ConfigError(f"the run was resolved for {run.world_size} processes ({run.degrees.describe()}) but "
                              f"{self.world_size} started; resolve it where it starts (resolve.resolve_run)")
        self.degrees = run.degrees
        self.parallel_dims = parallel.build_parallel_dims(self.degrees, device_type, single_process_mesh=run.model["is_moe"])
        self.dp_rank, self.dp_size = self._dp_coordinates()

        # Data.
        self.tokenizer = Tokenizer(tokenizer_path(models.tokenizer_spec(cfg)))
        self.data = PackedDataset(cfg.data, self.tokenizer)
        self._check_data_fits()
        from qwen3_research.data import data_layout

        self.data_layout = data_layout(cfg, self.dp_size, cfg.data.batch_size, self.tokenizer.sha256, self.data)

        # Model: build (seeded), kernel overrides, shard, compile.
        tt = parallel.torchtitan_training_configs(
            self.degrees,
            activation_checkpoint=cfg.parallelism.activation_checkpoint,
            compile_cfg=cfg.compile,
            mixed_precision=run.precision.setting,
            run_dir=str(self.run_dir),
        )
        self.backend = models.build(
            cfg.model, self.device.torch_device, seq_len=cfg.data.seq_len, seed=cfg.training.seed,
            tt_parallelism=tt.parallelism, tokenizer=self.tokenizer,
        )
        self.kernel_plan = self._apply_kernels()
        self.loss_scale = 1.0  # backward sees loss × this; gradients are then summed over dp ranks
        if self.degrees.sharded:
            self.backend.parallelize(self.parallel_dims, tt)
            devices.after_sharding(self.device, self.backend.model)
            self.loss_scale = parallel.sum_gradients_over_dp(self.backend.model, self.degrees)
        else:
            self.backend.finalize_single(tt)
        from qwen3_research.routing import RoutingMonitor

        # MoE: routing statistics and the auxiliary loss, from hooks on the routers (None: dense, or nothing asked)
        self.routing = RoutingMonitor.attach(self.backend, cfg.model.moe, self.device.torch_device)
        # The precision plan decided at resolution (run.precision); the built model must carry it out
        master = str(next(iter(self.backend.model.parameters())).dtype).removeprefix("torch.")
        run.precision.check(parallel.fsdp_precision(self.backend.model), master)
        self.precision = run.precision.summary()
        self.autocast = "bf16" if run.precision.autocast else "none"
        # compile.enable as resolved (run.compile: its reason, the shared cache): each block and the loss, in place
        self.compiled, self._cross_entropy = "none", None
        if cfg.compile.enable:
            compiling.export_cache_env(run.compile)  # the launcher set it already; a torchrun rank sets it here
            self.compiled = compiling.apply(self.backend.model, run.compile, fullgraph=cfg.compile.fullgraph,
                                            is_moe=run.model["is_moe"])
            if cfg.training.loss == "full":  # the chunked loss is its own autograd function: left eager
                self._cross_entropy = compiling.compiled_cross_entropy(run.compile)
                self.compiled += " + loss"

        from qwen3_research.optim import build_optimizer

        self.optimizer, self.scheduler = build_optimizer(self.backend.model, cfg.optimizer, cfg.training.steps)
        self.backend.register_optimizer_hooks(self.optimizer, self.parallel_dims)
        from qwen3_research.run.checkpoint import Checkpointer
        from qwen3_research.run.sinks import build_sinks
        from qwen3_research.run.train_state import TrainState

        self.state = TrainState(self.backend.model, self.optimizer, self.scheduler, rank=self.rank)
        self.state_bytes: dict | None = None  # params + grads + optimizer state of this rank, after the first update
        self.checkpointer = Checkpointer(
            self.state, cfg.checkpoint, run_dir=self.run_dir, total_steps=cfg.training.steps, layout=self.degrees.describe(),
            data_layout=self.data_layout, config=dataclasses.asdict(cfg), rank=self.rank, world_size=self.world_size,
        )
        self.sinks = build_sinks(cfg, self.run_dir, is_main=self.is_main, wandb_group=info.wandb_group,
                                 wandb_name=info.wandb_name, swept=info.swept)
        from qwen3_research.profiling import Profiler

        self.profiler = Profiler(cfg.profiling, device_type=device_type, rank=self.rank, run_dir=self.run_dir,
                                 total_steps=cfg.training.steps)
        self.resolved_config = run.config  # W&B's config and summary.json: the values used (data.batch_size resolved)
        self.build_s = time.perf_counter() - t_start

    # -- construction helpers ----------------------------------------------------------------
    def _compute_dtype(self) -> torch.dtype:
        return getattr(torch, self.run.precision.compute_dtype)

    def _gather(self, row: dict) -> list[dict]:
        if self.world_size == 1:
            return [row]
        rows = [None] * self.world_size
        torch.distributed.all_gather_object(rows, row)
        return rows

    def _check_data_fits(self) -> None:
        """A global batch larger than the data is refused; no held-out documents turns evaluation off."""
        t, d = self.cfg.training, self.cfg.data
        per_step = d.batch_size * self.dp_size * t.grad_accum
        if per_step > len(self.data.train):
            raise ConfigError(
                f"data.batch_size={d.batch_size} × dp {self.dp_size} × training.grad_accum={t.grad_accum} = {per_step} "
                f"sequences per step, but the data holds only {len(self.data.train)} training sequences of "
                f"data.seq_len+1={d.seq_len + 1} tokens; lower data.batch_size (or data.seq_len), or add data"
            )
        if self.cfg.optimizer.warmup_steps > t.steps and self.is_main:
            print(f"warning: optimizer.warmup_steps={self.cfg.optimizer.warmup_steps} > training.steps={t.steps}: the "
                  "learning rate never reaches optimizer.lr in this run", file=sys.stderr, flush=True)
        self.eval_every = t.eval_every
        if t.eval_every and len(self.data.val) == 0:
            self.eval_every = 0
            if self.is_main:
                print(f"warning: no held-out documents (data.val_fraction={d.val_fraction}, {self.data.num_documents} "
                      "documents); evaluation is off for this run (training.eval_every ignored)", file=sys.stderr, flush=True)

    def _dp_coordinates(self) -> tuple[int, int]:
        if not self.degrees.sharded or self.degrees.dp == 1:
            return 0, 1
        mesh = self.parallel_dims.get_mesh("batch")
        return mesh.get_local_rank(), mesh.size()

    def _apply_kernels(self):
        if not self.cfg.kernels.entries:
            return {}
        from qwen3_research.kernels import apply_overrides

        return apply_overrides(self.backend.model, self.cfg, self.device)

    # -- the loop --------------------------------------------------------------------------
    def _loss(self, inputs: torch.Tensor, labels: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """The language-model loss; ``positions``: per-document positions (data.document_masking), else None."""
        if self.cfg.training.loss == "chunked":  # lm_head + loss a chunk of tokens at a time (qwen3_research.loss)
            from qwen3_research.loss import lm_loss

            with self.device.autocast(self.autocast):
                return lm_loss(self.backend, inputs, labels, self.cfg.training.loss_chunk_tokens, positions)
        with self.device.autocast(self.autocast):
            logits = self.backend.forward(inputs) if positions is None else self.backend.forward(inputs, positions=positions)
        if hasattr(logits, "full_tensor"):  # a DTensor (tensor parallel without loss parallel)
            logits = logits.full_tensor()
        if self._cross_entropy is not None:  # compiled (compile.enable): the float32 upcast fused into the loss
            return self._cross_entropy(logits, labels)
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())

    def _all_reduce_mean(self, value: torch.Tensor) -> torch.Tensor:
        if self.dp_size > 1:
            group = self.parallel_dims.get_mesh("batch").get_group()
            torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.SUM, group=group)
            value = value / self.dp_size
        return value

    def micro_batches(self, step: int):
        """This data-parallel rank's training.grad_accum micro-batches of optimizer step ``step`` (0-based)."""
        t = self.cfg.training
        for micro in range(t.grad_accum):
            yield self.data.train_batch(step, micro, t.grad_accum, self.dp_rank, self.dp_size, t.seed)

    def forward_backward(self, batch) -> torch.Tensor:
        """One micro-batch of the step being trained: forward, the configured loss ÷ training.grad_accum, backward.
        Returns that loss, detached (not reduced over ranks)."""
        t = self.cfg.training
        inputs = batch.inputs.to(self.device.torch_device)
        labels = batch.labels.to(self.device.torch_device)
        positions = None if batch.positions is None else batch.positions.to(self.device.torch_device)
        loss = self._loss(inputs, labels, positions) / t.grad_accum
        loss = _inject_fault(t.fault, self.state.step + 1, self.rank, loss)
        # balance=aux_loss: coef × the routers' auxiliary loss joins the gradient, not the reported LM loss
        aux = self.routing.aux_term() if self.routing is not None else None
        ((loss if aux is None else loss + aux / t.grad_accum) * self.loss_scale).backward()
        return loss.detach()

    def clip_gradients(self) -> torch.Tensor:
        """Clip the gradients to optimizer.grad_clip (0: no clipping); their total norm before clipping."""
        from qwen3_research import titan

        max_norm = self.cfg.optimizer.grad_clip if self.cfg.optimizer.grad_clip > 0 else float("inf")
        params = [p for p in self.backend.model.parameters() if p.grad is not None]
        norm = titan.clip_grad_norm_(params, max_norm, ep_enabled=self.degrees.ep > 1)
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm

    def optimizer_step(self) -> None:
        """Apply the update, free the gradients, advance the learning-rate schedule."""
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

    def train_step(self) -> tuple[float, float]:
        """Optimizer step ``state.step + 1``; afterwards ``state.step`` counts it. (loss averaged over the
        data-parallel ranks, gradient norm)."""
        loss = torch.zeros((), device=self.device.torch_device)
        for batch in self.micro_batches(self.state.step):
            loss += self.forward_backward(batch)
        grad_norm = self.clip_gradients()
        loss_value, grad_value = float(self._all_reduce_mean(loss)), float(grad_norm)
        if not self.skips_update(loss_value, grad_value):
            self.optimizer_step()
        self.state.step += 1
        return loss_value, grad_value

    @torch.no_grad()
    def evaluate(self) -> float:
        t = self.cfg.training
        batches = self.data.val_batches(t.eval_batches, self.dp_rank, self.dp_size)
        if not batches:
            return float("nan")
        model = self.backend.model
        model.eval()
        total = torch.zeros((), device=self.device.torch_device)
        try:
            for b in batches:
                positions = None if b.positions is None else b.positions.to(self.device.torch_device)
                total += self._loss(b.inputs.to(self.device.torch_device), b.labels.to(self.device.torch_device),
                                    positions)
        finally:
            model.train()
            parallel.reshard(model)  # a forward without backward leaves FSDP's root unit gathered
        return float(self._all_reduce_mean(total / len(batches)))

    def _memory_rows(self) -> list[dict]:
        m = self.device.memory()
        row = {"rank": self.rank, "current_gib": round(m.current_gib, 4), "peak_gib": round(m.peak_gib, 4),
               "peak_pct": round(m.peak_pct, 3), "capacity_gib": round(m.capacity_gib, 2)}
        if self.state_bytes is not None:
            row["state_bytes"] = self.state_bytes["total"]
        if self.world_size == 1:
            return [row]
        rows = [None] * self.world_size
        torch.distributed.all_gather_object(rows, row)
        return rows

    def summary(self) -> dict:
        d = self.degrees
        return {
            "model": f"{self.cfg.model.backend}/{self.cfg.model.flavor}",
            "params": self.backend.num_params,
            "device": self.device.type,
            "layout": d.describe(),
            "tokens": self.data.num_tokens,
            "train_samples": len(self.data.train),
            "val_samples": len(self.data.val),
            "batch_size": self.cfg.data.batch_size, "mixed_precision": self.cfg.training.mixed_precision,
            "precision": self.precision,  # how it is carried out here (run.precision)
            "global_batch_tokens": self.cfg.data.batch_size * self.dp_size * self.cfg.training.grad_accum * self.cfg.data.seq_len,
            "compile": self._compile_line(),
            **(self.routing.summary() if self.routing is not None else {}),
        }

    def _compile_line(self) -> str:
        d = self.run.compile
        if d is None or not self.cfg.compile.enable:
            return f"off ({d.reason})" if d is not None else "off"
        return f"on: {self.compiled} ({d.reason}; cache {d.cache_dir or 'torch default'}, {d.cache_state})"

    def _compile_fields(self, since: float) -> dict:
        """compile_s (seconds this run spent compiling since ``since``) and compile_cache (warm | cold: whether the
        keyed cache directory held entries before this run) when compile is on."""
        if not self.cfg.compile.enable:
            return {}
        return {"compile_s": round(compiling.compile_seconds() - since, 3),
                "compile_cache": (self.run.compile.cache_state if self.run.compile else None) or "torch default"}

    def train(self) -> dict:
        cfg, t, state = self.cfg, self.cfg.training, self.state
        compile_start = compiling.compile_seconds()
        self.checkpointer.maybe_resume()
        if cfg.checkpoint.resume:
            self.sinks.resume_at(state.step)  # steps after the checkpoint are trained again
        config = {**self.resolved_config, "memory_plan": self.info.prediction} if self.info.prediction else self.resolved_config
        self.sinks.start(config, {**self.summary(), "plan": self.kernel_plan or "none"})
        tokens_per_step = cfg.data.batch_size * self.dp_size * t.grad_accum * cfg.data.seq_len
        peak = self.device.peak_flops(self._compute_dtype())
        peak_live_bytes, peak_categories = None, []
        self.backend.model.train()
        from qwen3_research.signals import Interrupted, StopOnSignal

        try:
            with StopOnSignal(self.world_size, self.device.torch_device) as stop:
                while state.step < t.steps:
                    self.profiler.before_step(state.step + 1)
                    self.device.synchronize()
                    t0 = time.perf_counter()
                    lr = self.scheduler.get_last_lr()[0]
                    # peak live tensor bytes of one steady step per rank: the second (AdamW's state exists),
                    # or the first of a one-step run
                    if t.track_memory and state.step == min(1, t.steps - 1):
                        from qwen3_research.memory import track_step

                        (loss, grad_norm), peak_live_bytes = track_step(self.train_step, self.backend.model,
                                                                        self.optimizer, self.world_size, peak_categories)
                    else:
                        loss, grad_norm = self.train_step()
                    self.device.synchronize()
                    dt = time.perf_counter() - t0
                    state.timer.add(dt)
                    if self.profiler.after_step(state.step):  # every rank wrote its files: rank 0 logs them all
                        self._log_profiles(barrier=True)
                    record = None
                    if state.step % t.log_every == 0 or state.step == t.steps or state.step == 1:
                        record = self._record(loss, grad_norm, lr, dt, tokens_per_step, peak)
                    if self.eval_every and (state.step % self.eval_every == 0 or state.step == t.steps):
                        _signal_launcher_at_eval(t.fault, state.step, self.rank, self.world_size)
                        state.final_eval_loss = self.evaluate()
                        record = record or {"step": state.step}
                        record["eval_loss"] = state.final_eval_loss
                    if record is not None and record.get("first_step"):
                        record.update(self._compile_fields(compile_start))
                    if record is not None and self.is_main:
                        self.sinks.log(record)
                        if "loss" in record:
                            state.final_loss = record["loss"]
                    self.checkpointer.maybe_save(state.step)
                    if self.checkpointer.last_saved == state.step:
                        self.sinks.commit()
                    signum = stop.requested()
                    if signum and state.step < t.steps:
                        raise Interrupted(signum, state.step, str(self.checkpointer.save_now()))
        except BaseException as e:
            status = "interrupted" if isinstance(e, Interrupted) else "failed"
            try:
                snapshot = self.profiler.on_error(e)
            except Exception as pe:  # noqa: BLE001 - writing the snapshot must not hide the step's own error
                print(f"warning: no memory snapshot ({type(pe).__name__}: {pe})", file=sys.stderr, flush=True)
                snapshot = []
            if snapshot:  # no barrier: the other ranks may be stuck in a collective; rank 0 logs what is there
                self._log_profiles(barrier=False)
            self.sinks.finish({"status": status, "step": state.step})
            from qwen3_research.profiling import is_out_of_memory

            if is_out_of_memory(e):  # one line naming the step, the rank and the snapshot, not a traceback
                first = (str(e).strip().splitlines() or [type(e).__name__])[0]
                raise TrainingError(
                    f"out of memory in step {state.step + 1} on rank {self.rank} ({first[:300]}); "
                    + (f"memory snapshot: {snapshot[0]}" if snapshot else
                       "profiling.memory_snapshot=true writes a memory snapshot when it happens")) from e
            raise
        if self.device.type == "neuron" and cfg.profiling.steps:  # what the Neuron runtime has written by now
            self._log_profiles(barrier=True)
        self.checkpointer.finish()
        if cfg.checkpoint.export_hf:
            self.export_hf()
        summary = {
            "status": "ok", "steps": state.step, "skipped_steps": state.skipped_steps, "final_loss": state.final_loss,
            "final_eval_loss": state.final_eval_loss, "batch_size": cfg.data.batch_size,
            "global_batch_tokens": tokens_per_step, "mixed_precision": t.mixed_precision, "precision": self.precision,
            "first_step_s": state.timer.first_step_s, "steady_step_s": state.timer.steady_mean_s, "build_s": self.build_s,
            "compile": self._compile_line(), **self._compile_fields(compile_start),
        }
        if peak_live_bytes:
            summary["peak_live_bytes_per_rank"] = peak_live_bytes
            # bytes by plan category at each rank's peak, and each category's largest over the step
            summary["live_categories_per_rank"] = peak_categories
        self.sinks.finish(summary)
        return {**summary, "device_facts": self.device_facts}  # summary.json only (a row per rank)

    def _log_profiles(self, *, barrier: bool) -> None:
        """Every rank's profiling files in the run dir as W&B artifacts, from rank 0 (``barrier``: after every
        rank has written its own)."""
        from qwen3_research.profiling import artifact_groups

        if barrier and self.world_size > 1:
            torch.distributed.barrier()
        if self.is_main:
            for kind, paths in artifact_groups(self.run_dir).items():
                self.sinks.artifact(kind, paths)

    def export_hf(self) -> dict | None:
        """The trained model -> ``<run dir>/hf``, verified (collective)."""
        from qwen3_research.run.export_hf import compute_dtype, export_trained, held_out_inputs

        return export_trained(self.backend, self.run_dir / "hf", inputs=held_out_inputs(self.data),
                              device=self.device.torch_device, tokenizer=self.tokenizer,
                              compute_dtype=compute_dtype(self.cfg, self.backend, self.precision))

    def _record(self, loss: float, grad_norm: float, lr: float, dt: float, tokens_per_step: int, peak: float) -> dict:
        from qwen3_research.metrics import mfu, tokens_per_second

        tps = tokens_per_second(tokens_per_step, dt)
        # a CPU peak measured while the cores were shared is too low: the run's own rate raises it (never MFU > 1)
        peak = self.device.observed_flops(self._compute_dtype(), self.backend.flops_per_token * tps / self.world_size)
        rows = self._memory_rows()
        record = {
            "step": self.state.step, "loss": loss, "grad_norm": grad_norm, "lr": lr,
            "tokens_per_s": tps, "mfu": mfu(self.backend.flops_per_token, tps, peak, self.world_size),
            "step_time_s": dt, "tokens": self.state.step * tokens_per_step,
            "mem_current_gib": rows[0]["current_gib"], "mem_peak_gib": max(r["peak_gib"] for r in rows),
            "mem_peak_pct": max(r["peak_pct"] for r in rows), "mem_per_rank": rows,
        }
        if self.routing is not None:  # collective: every rank reduces the routing counts of the interval
            record.update(self.routing.log_fields())
        if self.state.step == 1:
            record["first_step"] = True
        if self.state.skipped_steps and self.state.skipped_steps[-1] == self.state.step:
            record["skipped"] = True
        return record

    def close(self) -> None:
        if torch.distributed.is_initialized():  # also the one-rank group of a single MoE process
            torch.distributed.destroy_process_group()


def _fault_now(spec: str | None, kinds: tuple[str, ...], step: int, rank: int) -> str | None:
    """Test hook (training.fault = 'WHAT@N' or 'WHAT@N:rankR'): WHAT when it is due at this step on this rank."""
    if not spec:
        return None
    what, _, rest = spec.partition("@")
    at, _, who = rest.partition(":")
    if what not in kinds or int(at) != step or (who and who != f"rank{rank}"):
        return None
    return what


def _signal_launcher_at_eval(spec: str | None, step: int, rank: int, world_size: int) -> None:
    """Test hook 'term@N': as step N's evaluation starts, SIGTERM the launcher (Slurm preemption, scancel):
    the parent process in a worker group (the elastic agent, which passes it on to every rank), this process
    in a one-process run."""
    if _fault_now(spec, ("term",), step, rank):
        import signal

        os.kill(os.getppid() if world_size > 1 else os.getpid(), signal.SIGTERM)


def _inject_fault(spec: str | None, step: int, rank: int, loss: torch.Tensor) -> torch.Tensor:
    """Test hook (training.fault): 'raise@N', 'nan@N', 'kill@N', 'oom@N' in step N's forward; 'term@N' at its
    evaluation."""
    what = _fault_now(spec, ("raise", "nan", "kill", "oom"), step, rank)
    if what is None:
        return loss
    if what == "raise":
        raise RuntimeError(f"injected failure at step {step} on rank {rank} (training.fault={spec})")
    if what == "nan":
        return loss * float("nan")
    if what == "kill":
        import signal

        os.kill(os.getpid(), signal.SIGKILL)
    if what == "oom":  # a real allocator failure on any device: an allocation no device can hold (2**60 bytes)
        torch.empty(2**60, dtype=torch.uint8, device=loss.device)
    return loss
