"""The training loop over one ``step.Step``: checkpointer, sinks, profiler, signals.

``step.build_step`` assembles the step's parts (model, optimizer, schedule, data, loss, precision) and states the
step's order once (``Step.__call__``); the Trainer places it (``step.place``: device, process group, mesh),
resumes, runs it ``training.steps`` times, logs, evaluates, saves and reports.

Runs in every rank. Only rank 0 writes console lines, metrics.jsonl and the W&B run;
memory is gathered from every rank.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from qwen3_research import allocator, compiling
from qwen3_research.errors import ConfigError, TrainingError  # noqa: F401  (re-exported for callers)
from qwen3_research.run.export_hf import export_trained, held_out_inputs
from qwen3_research.metrics import mfu, tokens_per_second
from qwen3_research.memory import track_step
from qwen3_research.profiling import Profiler, artifact_groups, is_out_of_memory
from qwen3_research.resolve import ResolvedRun, RunInfo  # noqa: F401  (RunInfo re-exported for callers)
from qwen3_research.run.checkpoint import Checkpointer
from qwen3_research.run.sinks import build_sinks
from qwen3_research.signals import Interrupted, StopOnSignal
from qwen3_research.step import build_step, compute_dtype, place, signal_launcher_at_eval


class Trainer:
    """Place and build one step (``__init__``), then loop over it (``train``).

    ``self.step`` (``step.Step``) holds the parts and the step's one order; the planner (``qwen3_research.plan``)
    builds the same step on fake tensors. What a checkpoint holds is ``self.state`` (the step's ``TrainState``).
    The run's degrees, batch size, model facts and precision are the description's (``run``, resolved before any
    worker started); nothing here writes into its config.
    """

    def __init__(self, run: ResolvedRun, info: RunInfo):
        self.run = run
        self.cfg = cfg = run.rc
        self.info = info
        self.run_dir = Path(info.run_dir)
        t_start = time.perf_counter()
        # Device first (torchtitan must see it before its first import), then the process group and the mesh.
        self.where = where = place(run)
        self.rank, self.world_size, self.device = where.rank, where.world_size, where.device
        self.is_main = self.rank == 0
        self.degrees = run.degrees
        # After the process group (on neuron it starts the runtime on this rank's core): every rank's
        # device, LNC and environment as the worker sees them, for summary.json.
        self.device_facts = where.gather({**self.device.facts(compute_dtype(run)), "cpu_allocator": allocator.status(),
                                          "spawned": allocator.started_by_spawn()})  # as this rank observes them
        self.step = build_step(run, where, run_dir=self.run_dir)
        self.checkpointer = Checkpointer(
            self.state, cfg.checkpoint, run_dir=self.run_dir, total_steps=cfg.training.steps, layout=self.degrees.describe(),
            data_layout=self.step.data_layout, config=dataclasses.asdict(cfg), rank=self.rank, world_size=self.world_size,
        )
        self.sinks = build_sinks(cfg, self.run_dir, is_main=self.is_main, wandb_group=info.wandb_group,
                                 wandb_name=info.wandb_name, swept=info.swept)
        self.profiler = Profiler(cfg.profiling, device_type=self.device.type, rank=self.rank, run_dir=self.run_dir,
                                 total_steps=cfg.training.steps)
        self.resolved_config = run.config  # W&B's config and summary.json: the values used (data.batch_size resolved)
        self.build_s = time.perf_counter() - t_start

    # -- the step's parts, as callers (tests, benchmarks, export) reach them ----------------------------
    backend = property(lambda self: self.step.backend)
    optimizer = property(lambda self: self.step.optimizer)
    scheduler = property(lambda self: self.step.scheduler)
    data = property(lambda self: self.step.data)
    tokenizer = property(lambda self: self.step.tokenizer)
    state = property(lambda self: self.step.state)
    state_bytes = property(lambda self: self.step.state_bytes)
    routing = property(lambda self: self.step.routing)
    precision = property(lambda self: self.step.precision)
    kernel_plan = property(lambda self: self.step.kernel_plan)
    dp_rank = property(lambda self: self.step.dp_rank)
    dp_size = property(lambda self: self.step.dp_size)
    parallel_dims = property(lambda self: self.where.parallel_dims)

    def _loss(self, inputs: torch.Tensor, labels: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        return self.step.loss(inputs, labels, positions)

    def _compute_dtype(self) -> torch.dtype:
        return compute_dtype(self.run)

    # -- the loop --------------------------------------------------------------------------
    def train_step(self) -> tuple[float, float]:
        """Optimizer step ``state.step + 1`` (``Step.__call__``); afterwards ``state.step`` counts it. (loss averaged
        over the data-parallel ranks, gradient norm)."""
        return self.step()

    def evaluate(self) -> float:
        return self.step.evaluate()

    def _memory_rows(self) -> list[dict]:
        m = self.device.memory()
        row = {"rank": self.rank, "current_gib": round(m.current_gib, 4), "peak_gib": round(m.peak_gib, 4),
               "peak_pct": round(m.peak_pct, 3), "capacity_gib": round(m.capacity_gib, 2)}
        if self.state_bytes is not None:
            row["state_bytes"] = self.state_bytes["total"]
        return self.where.gather(row)

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
            "global_batch_tokens": self.run.tokens_per_step,
            "compile": self._compile_line(),
            **(self.routing.summary() if self.routing is not None else {}),
        }

    def _compile_line(self) -> str:
        d = self.run.compile
        if d is None or not self.cfg.compile.enable:
            return f"off ({d.reason})" if d is not None else "off"
        return f"on: {self.step.compiled} ({d.reason}; cache {d.cache_dir or 'torch default'}, {d.cache_state})"

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
        tokens_per_step = self.run.tokens_per_step
        peak = self.device.peak_flops(self._compute_dtype())
        peak_live_bytes, peak_categories = None, []
        self.backend.model.train()
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
                    if self.step.eval_every and (state.step % self.step.eval_every == 0 or state.step == t.steps):
                        signal_launcher_at_eval(t.fault, state.step, self.rank, self.world_size)
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
            if is_out_of_memory(e):  # one line naming the step, the rank and the snapshot, not a traceback
                first = (str(e).strip().splitlines() or [type(e).__name__])[0]
                raise TrainingError(
                    f"out of memory in step {state.step + 1} on rank {self.rank} ({first[:300]}); "
                    + (f"memory snapshot: {snapshot[0]}" if snapshot else
                       "profiling.memory_snapshot=true writes a memory snapshot when it happens")) from e
            raise
        if not self.device.spec.torch_profiler and cfg.profiling.steps:  # what the device runtime's profiler wrote
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
        if barrier and self.world_size > 1:
            torch.distributed.barrier()
        if self.is_main:
            for kind, paths in artifact_groups(self.run_dir).items():
                self.sinks.artifact(kind, paths)

    def export_hf(self) -> dict | None:
        """The trained model -> ``<run dir>/hf``, verified (collective)."""
        return export_trained(self.backend, self.run_dir / "hf", inputs=held_out_inputs(self.data),
                              device=self.device.torch_device, tokenizer=self.tokenizer, cfg=self.cfg,
                              precision=self.run.precision)

    def _record(self, loss: float, grad_norm: float, lr: float, dt: float, tokens_per_step: int, peak: float) -> dict:
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

