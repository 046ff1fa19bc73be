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
from qwen3_research.run.export_peft import export_lora
from qwen3_research.metrics import mfu, tokens_per_second
from qwen3_research.memory import track_step
from qwen3_research.profiling import PROFILE_DIR, Profiler, artifact_groups, is_out_of_memory
from qwen3_research.resolve import ResolvedRun, RunInfo  # noqa: F401  (RunInfo re-exported for callers)
from qwen3_research.run.checkpoint import Checkpointer
from qwen3_research.run.sinks import build_sinks
from qwen3_research.signals import Interrupted, StopOnSignal
from qwen3_research.step import build_step, compute_dtype, place


@dataclass
class _Progress:
    """What the loop carries from one step to the next and into the run's summary."""

    compile_start: float  # compiling.compile_seconds() before the first step
    tokens_per_step: int
    peak_live_bytes: list | None = None  # training.track_memory: per rank, one steady step
    peak_categories: list = field(default_factory=list)


class Trainer:
    """Place and build one step (``__init__``), then loop over it (``train``).

    ``self.step`` (``step.Step``) holds the parts (model backend, optimizer, schedule, data, the ``TrainState`` a
    checkpoint holds) and the step's one order; ``self.where`` (``step.Placement``) the device, rank, world size and
    mesh. Callers reach the part they need there (``trainer.step.backend``, ``trainer.where.rank``). The planner
    (``qwen3_research.plan``) builds the same step on fake tensors. The run's degrees, batch size, model facts and
    precision are the description's (``run``, resolved before any worker started); nothing here writes into its
    config.
    """

    def __init__(self, run: ResolvedRun, info: RunInfo):
        self.run = run
        self.cfg = cfg = run.rc
        self.info = info
        self.run_dir = Path(info.run_dir)
        t_start = time.perf_counter()
        # Device first (torchtitan must see it before its first import), then the process group and the mesh.
        self.where = where = place(run)
        self.is_main = where.rank == 0
        # After the process group (on neuron it starts the runtime on this rank's core): every rank's
        # device, LNC and environment as the worker sees them, for summary.json.
        self.device_facts = where.gather({**where.device.facts(compute_dtype(run)), "cpu_allocator": allocator.status(),
                                          "spawned": allocator.started_by_spawn()})  # as this rank observes them
        self.step = step = build_step(run, where, run_dir=self.run_dir)
        if step.pipeline is not None:  # summary.json names each rank's pipeline stages (collective)
            self.device_facts = [{**f, "pp_stages": s} for f, s in zip(self.device_facts, where.gather(step.pipeline.stages))]
        self.checkpointer = Checkpointer(
            step.state, cfg.checkpoint, run_dir=self.run_dir, total_steps=cfg.training.steps,
            layout=run.degrees.describe(), data_layout=step.data_layout, config=dataclasses.asdict(cfg),
            rank=where.rank, world_size=where.world_size,
        )
        step.before_update = self.checkpointer.wait_for_staging  # the weights change only once a save copied them
        self.sinks = build_sinks(cfg, self.run_dir, is_main=self.is_main, wandb_group=info.wandb_group,
                                 wandb_name=info.wandb_name, swept=info.swept)
        self.profiler = Profiler(cfg.profiling, device_type=where.device.type, rank=where.rank, run_dir=self.run_dir,
                                 total_steps=cfg.training.steps)
        self.resolved_config = run.config  # W&B's config and summary.json: the values used (data.batch_size resolved)
        self.committed = 0  # the sinks hold the logged steps through this one as checkpointed (W&B: delivered)
        self.build_s = time.perf_counter() - t_start

    def _memory_rows(self) -> list[dict]:
        m = self.where.device.memory()
        row = {"rank": self.where.rank, "current_gib": round(m.current_gib, 4), "peak_gib": round(m.peak_gib, 4),
               "peak_pct": round(m.peak_pct, 3), "capacity_gib": round(m.capacity_gib, 2)}
        if self.step.state_bytes is not None:
            row["state_bytes"] = self.step.state_bytes["total"]
        if self.step.pipeline is not None:  # the memory of a pipelined run is per stage
            row["pp_stages"] = self.step.pipeline.stages
        return self.where.gather(row)

    def summary(self) -> dict:
        cfg, step = self.cfg, self.step
        return {
            "model": f"{cfg.model.backend}/{cfg.model.flavor}",
            "params": step.backend.num_params,
            "device": self.where.device.type,
            "layout": self.run.degrees.describe(),
            "tokens": step.data.num_tokens,
            "train_samples": len(step.data.train),
            "val_samples": len(step.data.val),
            "batch_size": cfg.data.batch_size, "mixed_precision": cfg.training.mixed_precision,
            "precision": step.precision,  # how it is carried out here (run.precision)
            "global_batch_tokens": self.run.tokens_per_step,
            "compile": self._compile_line(),
            **(step.routing.summary() if step.routing is not None else {}),
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

    # -- the loop: start, then per step (timed step, record, evaluate, log, save), then finish ------------------
    def train(self) -> dict:
        """Resume and start the sinks; run the step until training.steps (each: timed, recorded, evaluated, logged,
        saved, and a stop signal honoured after it); then finish (export, summary). A failure is recorded first."""
        t, state = self.cfg.training, self.step.state
        progress = self._start()
        try:
            with StopOnSignal(self.where.world_size, self.where.device.torch_device) as stop:
                while state.step < t.steps:
                    loss, grad_norm, lr, dt = self._timed_step(progress)
                    record = None
                    if state.step % t.log_every == 0 or state.step == t.steps or state.step == 1:
                        record = self._record(loss, grad_norm, lr, dt, progress.tokens_per_step)
                    record = self._evaluate_when_due(record, stop)
                    record = self._save_when_due(record, progress)
                    self._log(record, progress)
                    self._commit_or_stop(stop)
        except BaseException as e:
            self._record_failure(e)  # raises TrainingError instead for an out-of-memory error
            raise
        return self._finish(progress)

    def _start(self) -> _Progress:
        """Resume from the checkpoint (checkpoint.resume), start the sinks with the run's config and summary."""
        cfg, t, step = self.cfg, self.cfg.training, self.step
        compile_start = compiling.compile_seconds()
        self.checkpointer.maybe_resume()
        if cfg.checkpoint.resume:
            self.sinks.resume_at(step.state.step)  # steps after the checkpoint are trained again
        config = self.resolved_config
        if self.info.prediction:
            config = {**config, "memory_plan": self.info.prediction}
        self.sinks.start(config, {**self.summary(), "plan": step.kernel_plan or "none"})
        tokens_per_step = self.run.tokens_per_step
        self.where.device.peak_flops(compute_dtype(self.run))  # measured (CPU) before the first step, not inside it
        step.backend.model.train()
        return _Progress(compile_start=compile_start, tokens_per_step=tokens_per_step)

    def _timed_step(self, progress: _Progress) -> tuple[float, float, float, float]:
        """One optimizer step (``Step.__call__``), synchronized and timed, profiled when due: (loss, gradient norm,
        its learning rate, seconds)."""
        t, step, device = self.cfg.training, self.step, self.where.device
        self.profiler.before_step(step.state.step + 1)
        device.synchronize()
        t0 = time.perf_counter()
        lr = step.scheduler.get_last_lr()[0]
        # peak live tensor bytes of one steady step per rank: the second (AdamW's state exists), or the first of a
        # one-step run
        if t.track_memory and step.state.step == min(1, t.steps - 1):
            (loss, grad_norm), progress.peak_live_bytes = track_step(step, step.backend.model, step.optimizer,
                                                                     self.where.world_size, progress.peak_categories)
        else:
            loss, grad_norm = step()
        device.synchronize()
        dt = time.perf_counter() - t0
        step.state.timer.add(dt)
        if self.profiler.after_step(step.state.step):  # every rank wrote its files: rank 0 logs them all
            self._log_profiles(barrier=True)
        return loss, grad_norm, lr, dt

    def _evaluate_when_due(self, record: dict | None, stop: StopOnSignal) -> dict | None:
        """Every eval_every steps and at the last: the held-out loss, into ``record`` (one is made if none). A stop
        signal during it abandons it (said once): the loop then saves and stops, as after any step."""
        state, eval_every = self.step.state, self.step.eval_every
        if not eval_every or (state.step % eval_every != 0 and state.step != self.cfg.training.steps):
            return record
        loss = self.step.evaluate(stop.requested)
        if loss is None:
            if self.is_main:
                print(f"evaluation after step {state.step} abandoned: a stop signal came during it", flush=True)
            return record
        state.final_eval_loss = loss
        return {**(record or {"step": state.step}), "eval_loss": state.final_eval_loss}

    def _log(self, record: dict | None, progress: _Progress) -> None:
        """``record`` to the sinks (rank 0), with the compile time on the first step's."""
        if record is None:
            return
        if record.get("first_step"):
            record.update(self._compile_fields(progress.compile_start))
        if self.is_main:
            self.sinks.log(record)
            if "loss" in record:
                self.step.state.final_loss = record["loss"]

    def _save_when_due(self, record: dict | None, progress: _Progress) -> dict | None:
        """A checkpoint when due; the seconds it blocked the loop into ``record`` (``checkpoint_stall_s``). A failed
        save still logs the step it followed."""
        try:
            stall = self.checkpointer.maybe_save(self.step.state.step)
        except BaseException:
            self._log(record, progress)
            raise
        if stall is not None and record is not None:
            record = {**record, "checkpoint_stall_s": round(stall, 4)}
        return record

    def _commit_or_stop(self, stop: StopOnSignal) -> None:
        """The sinks committed through the newest complete checkpoint; a stop signal saves now (synchronously, after
        any save in flight) and ends the loop."""
        state, published = self.step.state, self.checkpointer.published
        if published is not None and published > self.committed:
            self.sinks.commit(through=published)
            self.committed = published
        signum = stop.requested()
        if signum and state.step < self.cfg.training.steps:
            raise Interrupted(signum, state.step, str(self.checkpointer.save_now()))

    def _record_failure(self, e: BaseException) -> None:
        """The loop failed or was interrupted: a memory snapshot when asked, the sinks finished with the status; an
        out-of-memory error raised as one line naming the step, the rank and the snapshot (not a traceback)."""
        status = "interrupted" if isinstance(e, Interrupted) else "failed"
        try:
            snapshot = self.profiler.on_error(e)
        except Exception as pe:  # noqa: BLE001 - writing the snapshot must not hide the step's own error
            print(f"warning: no memory snapshot ({type(pe).__name__}: {pe})", file=sys.stderr, flush=True)
            snapshot = []
        if snapshot:  # no barrier: the other ranks may be stuck in a collective; rank 0 logs what is there
            self._log_profiles(barrier=False)
        state = self.step.state
        self.sinks.finish({"status": status, "step": state.step})
        if is_out_of_memory(e):
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise TrainingError(
                f"out of memory in step {state.step + 1} on rank {self.where.rank} ({first[:300]}); "
                + (f"memory snapshot: {snapshot[0]}" if snapshot else
                   "profiling.memory_snapshot=true writes a memory snapshot when it happens")) from e

    def _finish(self, progress: _Progress) -> dict:
        """The device profiler's files, the final checkpoint, the export (checkpoint.export_hf), the summary."""
        cfg, t, state = self.cfg, self.cfg.training, self.step.state
        if not self.where.device.spec.torch_profiler and cfg.profiling.steps:  # what the device's own profiler wrote
            self._log_profiles(barrier=True)
        self.checkpointer.finish()
        if cfg.checkpoint.export_hf:
            self.export_hf()
        summary = {
            "status": "ok", "steps": state.step, "skipped_steps": state.skipped_steps, "final_loss": state.final_loss,
            "final_eval_loss": state.final_eval_loss, "batch_size": cfg.data.batch_size,
            "global_batch_tokens": progress.tokens_per_step, "mixed_precision": t.mixed_precision,
            "precision": self.step.precision, "first_step_s": state.timer.first_step_s,
            "steady_step_s": state.timer.steady_mean_s, "build_s": self.build_s,
            "compile": self._compile_line(), **self._compile_fields(progress.compile_start),
            **self.checkpointer.stall_summary(),
        }
        if hasattr(self.step.data, "summary"):  # data=chat: conversations rendered, truncated, dropped; packing
            summary["data"] = self.step.data.summary()
        if progress.peak_live_bytes:
            summary["peak_live_bytes_per_rank"] = progress.peak_live_bytes
            # bytes by plan category at each rank's peak, and each category's largest over the step
            summary["live_categories_per_rank"] = progress.peak_categories
        self.sinks.finish(summary)
        return {**summary, "device_facts": self.device_facts}  # summary.json only (a row per rank)

    def _log_profiles(self, *, barrier: bool) -> None:
        """Every rank's profiling files in the run dir as W&B artifacts, from rank 0 (``barrier``: after every
        rank has written its own)."""
        if barrier and self.where.world_size > 1:
            torch.distributed.barrier()
        if self.is_main:
            groups = artifact_groups(self.run_dir)
            for kind, paths in groups.items():
                self.sinks.artifact(kind, paths)
            if groups:  # issue 40: the files were written without a word (at the window's end, or a failure's)
                what = ", ".join(f"{len(paths)} {kind.replace('_', ' ')} file{'s' * (len(paths) > 1)}"
                                 for kind, paths in groups.items())
                print(f"profiling: {what} in {self.run_dir / PROFILE_DIR}", flush=True)

    def export_hf(self) -> dict | None:
        """The trained model -> ``<run dir>/hf``, verified (collective); a LoRA run also its PEFT adapter in
        ``<run dir>/hf_adapter``, ``hf`` then being the merged model (run/export_peft.py)."""
        step = self.step
        common = dict(inputs=held_out_inputs(step.data), device=self.where.device.torch_device,
                      tokenizer=step.tokenizer, cfg=self.cfg, precision=self.run.precision)
        if self.cfg.model.lora.enable:
            return export_lora(step.backend, self.run_dir, **common)
        return export_trained(step.backend, self.run_dir / "hf", **common)

    def _record(self, loss: float, grad_norm: float, lr: float, dt: float, tokens_per_step: int) -> dict:
        step, state, world_size = self.step, self.step.state, self.where.world_size
        tps = tokens_per_second(tokens_per_step, dt)
        # a CPU peak measured while the cores were shared is too low: the run's own rate raises it (never MFU > 1)
        flops_per_s = step.backend.flops_per_token * tps / world_size
        peak = self.where.device.observed_flops(compute_dtype(self.run), flops_per_s)
        rows = self._memory_rows()
        record = {
            "step": state.step, "loss": loss, "grad_norm": grad_norm, "lr": lr,
            "tokens_per_s": tps, "mfu": mfu(step.backend.flops_per_token, tps, peak, world_size),
            "step_time_s": dt, "tokens": state.step * tokens_per_step,
            # the labels in the loss (data=chat: the assistant's tokens) and their share of the step's windows
            "loss_tokens": step.loss_tokens, "loss_token_share": step.loss_tokens / tokens_per_step,
            "mem_current_gib": rows[0]["current_gib"], "mem_peak_gib": max(r["peak_gib"] for r in rows),
            "mem_peak_pct": max(r["peak_pct"] for r in rows), "mem_per_rank": rows,
        }
        if step.routing is not None:  # collective: every rank reduces the routing counts of the interval
            record.update(step.routing.log_fields())
        if state.step == 1:
            record["first_step"] = True
        if state.skipped_steps and state.skipped_steps[-1] == state.step:
            record["skipped"] = True
        return record

    def close(self) -> None:
        if torch.distributed.is_initialized():  # also the one-rank group of a single MoE process
            torch.distributed.destroy_process_group()

