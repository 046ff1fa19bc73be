"""Profiler traces and memory snapshots of a run (``profiling.*``), written per rank into ``<run dir>/profiling/``.

- ``profiling.steps=[a,b]``: a torch profiler trace of training steps a..b on every rank, Chrome trace JSON
  (``trace_rank<r>.json``; opens in Perfetto, ui.perfetto.dev, and chrome://tracing).
- ``profiling.memory_snapshot=true``: a memory snapshot per rank over the profiled steps (every step when
  ``profiling.steps`` is empty), and one when a step runs out of memory (``oom_*``):
  cuda: the caching allocator's history, ``torch.<type>.memory._record_memory_history`` / ``_dump_snapshot``
  through ``devices.record_memory_history`` / ``dump_memory_snapshot``
  (``memory_snapshot_rank<r>.pickle``; drag it into pytorch.org/memory_viz);
  cpu: the CPU allocator keeps no history, so the torch profiler records every allocation and free
  (``profile_memory=True``) and this module writes them as a timeline (``memory_timeline_rank<r>.json``: time,
  bytes allocated since the window began, each event's size). Not the profiler's ``export_memory_timeline``: its
  categorisation asserts on FSDP's backward graph ('duplicate outputs: RegisterPostBackwardFunctionBackward',
  measured here on a 2-rank fsdp run, torch 2.14) and it is deprecated.
- neuron: AWS says not to combine the Neuron runtime's environment-variable capture with torch.profiler, so on
  neuron ``profiling.steps`` turns on that capture for the run's processes instead (``neuron_environment``,
  ``<run dir>/profiling/neuron``; ``profiling.neuron_device_profile`` adds device-level traces).

What each device records is its spec's (``devices.get(kind)``): ``torch_profiler`` and ``profiler_activities``,
``memory_snapshot`` (``allocator``: the caching allocator's history; ``profiler``: the profiler's memory events),
``profiler_environment`` (the runtime's own capture).

The Trainer calls ``Profiler.before_step`` / ``after_step`` around each step and ``on_error`` when a step raises;
what a rank wrote comes back as paths, which rank 0 logs as W&B artifacts (``MetricSink.artifact``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from qwen3_research import devices
from qwen3_research.config import ProfilingConfig
from qwen3_research.devices.neuron import neuron_environment  # noqa: F401  (re-exported: the launcher, tests)

PROFILE_DIR = "profiling"


def is_out_of_memory(e: BaseException) -> bool:
    """A device allocator's out-of-memory error: torch.OutOfMemoryError (cuda, neuron), or the CPU allocator's
    RuntimeError (c10's DefaultCPUAllocator raises a plain RuntimeError: 'can't allocate memory')."""
    return isinstance(e, torch.OutOfMemoryError) or (
        isinstance(e, RuntimeError) and "DefaultCPUAllocator: can't allocate memory" in str(e))


class Profiler:
    """One rank's profiling of one run. Inactive (every call a no-op) unless ``profiling.*`` asks for something."""

    def __init__(self, p: ProfilingConfig, *, device_type: str, rank: int, run_dir: Path, total_steps: int):
        self.rank = rank
        self.dir = Path(run_dir) / PROFILE_DIR
        self.device_type = device_type
        self.spec = devices.get(device_type)
        # neuron: the runtime captures (spec.profiler_environment, set by the launcher); torch.profiler stays off
        self.trace = bool(p.steps) and self.spec.torch_profiler
        self.memory = bool(p.memory_snapshot) and self.spec.memory_snapshot is not None
        first, last = (p.steps[0], p.steps[1]) if p.steps else (1, total_steps)
        self.window = (first, last)
        self.prof = None  # the torch profiler, between the window's first and last step
        self.recording = False  # cuda: the allocator records its history

    @property
    def enabled(self) -> bool:
        return self.trace or self.memory

    def before_step(self, step: int) -> None:
        """Step ``step`` (1-based) is about to run: start the window at its first step (or at the step a resumed
        run starts from, inside it)."""
        if not self.enabled or self.prof is not None or self.recording or not self.window[0] <= step <= self.window[1]:
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        if self.memory and self.spec.memory_snapshot == "allocator":  # cuda: the caching allocator's history
            devices.record_memory_history(self.device_type, True)
            self.recording = True
        profiler_memory = self.memory and self.spec.memory_snapshot == "profiler"  # cpu: the profiler's events
        if self.trace or profiler_memory:
            from torch.profiler import ProfilerActivity, profile

            for key, value in self.spec.profiler_log_env.items():  # before Kineto's first start in this process
                os.environ.setdefault(key, value)
            activities = [getattr(ProfilerActivity, a) for a in self.spec.profiler_activities]
            self.prof = profile(activities=activities, profile_memory=profiler_memory)
            self.prof.start()

    def after_step(self, step: int) -> list[Path]:
        """Step ``step`` finished: at the window's last step, stop and write this rank's files (their paths)."""
        if step != self.window[1] or (self.prof is None and not self.recording):
            return []
        return self._write("")

    def on_error(self, e: BaseException) -> list[Path]:
        """A step raised: stop profiling; on an out-of-memory error with ``profiling.memory_snapshot``, write this
        rank's snapshot up to the failure (``oom_*``)."""
        if self.memory and is_out_of_memory(e) and (self.prof is not None or self.recording):
            return self._write("oom_")
        self._stop()
        return []

    def _write(self, prefix: str) -> list[Path]:
        written = []
        if self.recording:
            path = self.dir / f"{prefix}memory_snapshot_rank{self.rank}.pickle"
            devices.dump_memory_snapshot(self.device_type, path)
            written.append(path)
        prof, self.prof = self.prof, None
        if prof is not None:
            prof.stop()
            if self.trace and not prefix:
                path = self.dir / f"trace_rank{self.rank}.json"
                prof.export_chrome_trace(str(path))
                written.append(path)
            if self.memory and self.spec.memory_snapshot == "profiler":
                path = self.dir / f"{prefix}memory_timeline_rank{self.rank}.json"
                path.write_text(json.dumps(cpu_memory_timeline(prof, self.window, prefix == "oom_")))
                written.append(path)
        self._stop()
        return written

    def _stop(self) -> None:
        if self.prof is not None:
            self.prof.stop()
            self.prof = None
        if self.recording:
            devices.record_memory_history(self.device_type, False)
            self.recording = False


def cpu_memory_timeline(prof, window: tuple[int, int], out_of_memory: bool) -> dict:
    """The CPU allocations and frees the profiler saw (its ``[memory]`` events: bytes > 0 allocated, < 0 freed), in
    time order: ``t_ms`` since the first, ``allocated_bytes`` the running sum (bytes allocated since the window
    began, tensors alive before it not counted), ``event_bytes`` each event's own size."""
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]" and str(e.device_type()).endswith("CPU"))
    t0 = events[0][0] if events else 0
    total, running = 0, []
    for _, n in events:
        total += n
        running.append(total)
    return {"device": "cpu", "steps": list(window), "out_of_memory": out_of_memory,
            "source": "torch.profiler profile(profile_memory=True): [memory] events", "unit": "bytes",
            "peak_allocated_bytes": max(running, default=0), "t_ms": [round((t - t0) / 1e6, 4) for t, _ in events],
            "allocated_bytes": running, "event_bytes": [n for _, n in events]}


def artifact_groups(run_dir: Path) -> dict[str, list[Path]]:
    """Every rank's profiling files in the run dir, by W&B artifact type: ``profile`` (traces), ``memory_snapshot``
    (snapshots and memory timelines, the out-of-memory ones included), ``neuron_profile`` (the Neuron runtime's)."""
    root = Path(run_dir) / PROFILE_DIR
    groups = {
        "profile": sorted(root.glob("trace_rank*.json")),
        "memory_snapshot": sorted([*root.glob("*memory_snapshot_rank*.pickle"), *root.glob("*memory_timeline_rank*.json")]),
        "neuron_profile": sorted(p for p in (root / "neuron").rglob("*") if p.is_file()),
    }
    return {k: v for k, v in groups.items() if v}
