"""Profiler traces and memory snapshots (issue 25 point 4): per rank in the run dir, W&B artifacts, one on an
out-of-memory error; bad values are one config error line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from qwen3_research.config import RunConfig, validate
from qwen3_research.config import validate as config_validate
from qwen3_research.errors import ConfigError
from tests.conftest import FAST, cli_env, fault_env, run_cli, wandb_records

QUICK = [a for a in FAST if not a.startswith(("training.steps", "logging.wandb"))]
PARAM_BYTES = 20_235_648 * 4  # native/tiny's float32 parameters (summary: params=20235648)


def _artifacts(run_dir: Path) -> dict[str, list[str]]:
    """W&B artifact type -> the file names in its manifest, from the offline run (W&B's own reader)."""
    out = {}
    for r in wandb_records(run_dir):
        if r["type"] == "artifact":
            a = r["artifact"]
            out[a["type"]] = sorted(c["path"] for c in a["manifest"]["contents"])
    return out


def _timeline_peak_bytes(path: Path) -> float:
    t = json.loads(path.read_text())  # qwen3_research.profiling.cpu_memory_timeline
    assert len(t["t_ms"]) == len(t["allocated_bytes"]) == len(t["event_bytes"]) > 10
    assert t["allocated_bytes"][-1] == sum(t["event_bytes"]) and t["peak_allocated_bytes"] == max(t["allocated_bytes"])
    return t["peak_allocated_bytes"]


@pytest.mark.slow
def test_profiled_two_rank_run_writes_a_trace_per_rank_and_w_and_b_artifacts(tmp_path):
    run = tmp_path / "run"
    proc = run_cli(QUICK + ["parallelism=fsdp", "parallelism.nproc_per_node=2", "training.steps=2", "profiling.steps=[2,2]",
                            "profiling.memory_snapshot=true", "logging.wandb.mode=offline"], run_dir=run, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    prof = run / "profiling"
    print(sorted((p.name, p.stat().st_size) for p in prof.iterdir()))
    for rank in (0, 1):
        events = json.loads((prof / f"trace_rank{rank}.json").read_text())["traceEvents"]
        names = {e.get("name", "") for e in events}
        # the profiled step itself: its matmuls and the FSDP collectives gloo ran for it
        assert any(n.startswith("aten::mm") or n.startswith("aten::addmm") for n in names), sorted(names)[:50]
        assert any("all_gather" in n or "reduce_scatter" in n for n in names), sorted(n for n in names if "c10d" in n)
        peak = _timeline_peak_bytes(prof / f"memory_timeline_rank{rank}.json")
        print(f"rank {rank}: step 2 allocated up to {peak / 2**20:.1f} MiB beyond what was alive before it")
        assert peak > PARAM_BYTES / 2  # FSDP gathers every layer's parameters, and this rank's gradient shard
    assert _artifacts(run) == {"profile": ["trace_rank0.json", "trace_rank1.json"],
                               "memory_snapshot": ["memory_timeline_rank0.json", "memory_timeline_rank1.json"]}
    # issue 40: the files are named once (rank 0), and Kineto's own USDT/ERROR lines are gone (DeviceSpec.profiler_log_env)
    said = [ln for ln in proc.stdout.splitlines() if ln.startswith("profiling: ")]
    assert said == [f"profiling: 2 profile files, 2 memory snapshot files in {prof}"], said
    assert not [ln for ln in proc.stderr.splitlines() if ln.startswith(("USDT:", "ERROR:", "STAGE:"))], proc.stderr[-2000:]


@pytest.mark.slow
def test_an_out_of_memory_error_leaves_a_snapshot(tmp_path):
    """A fault (tests/hooks: oom@2) allocates 2**60 bytes in step 2: the CPU allocator's real failure, through the same
    handler as any out-of-memory error."""
    run = tmp_path / "run"
    proc = run_cli(QUICK + ["training.steps=2", "profiling.memory_snapshot=true", "logging.wandb.mode=offline"],
                   run_dir=run, timeout=300, env=cli_env(**fault_env("oom@2")))
    snapshot = run / "profiling" / "oom_memory_timeline_rank0.json"
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error: ")]
    assert proc.returncode == 1 and len(errors) == 1, proc.stderr[-3000:]
    assert errors[0].startswith("error: out of memory in step 2 on rank 0 (") and errors[0].endswith(
        f"memory snapshot: {snapshot}"), errors[0]
    peak = _timeline_peak_bytes(snapshot)
    print(f"out-of-memory snapshot: {snapshot.stat().st_size} bytes, peak {peak / 2**20:.1f} MiB")
    assert peak > 3 * PARAM_BYTES  # step 1's gradients and AdamW's two moments, allocated inside the window
    assert json.loads((run / "summary.json").read_text())["status"] == "failed"
    assert _artifacts(run) == {"memory_snapshot": ["oom_memory_timeline_rank0.json"]}


@pytest.mark.parametrize("steps, total", [([0, 2], 3), ([2, 1], 3), ([2, 4], 3), ([1, 2, 3], 3), ([2], 3)])
def test_bad_profiling_steps_name_the_key(steps, total):
    rc = RunConfig()
    rc.training.steps, rc.device.type, rc.profiling.steps = total, "cpu", steps
    with pytest.raises(ConfigError, match=rf"^profiling.steps=\[.*\] must be \[a,b\] with 1 <= a <= b <= training.steps={total}"):
        validate(rc)


def test_each_device_s_capture_on_its_device_only(monkeypatch):
    import importlib.util

    from qwen3_research.profiling import Profiler, neuron_environment

    from qwen3_research.resolve import check_device_settings  # the device kind's rules (its DeviceSpec)

    def validate(rc):
        return check_device_settings(config_validate(rc))

    rc = RunConfig()
    rc.device.type, rc.profiling.neuron_device_profile = "cpu", "session"
    with pytest.raises(ConfigError, match="profiling.neuron_device_profile='session' is a Neuron runtime capture"):
        validate(rc)
    real = importlib.util.find_spec  # a Trainium host: torch_neuronx installed
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "torch_neuronx" else real(name, *a))
    rc = RunConfig()
    rc.device.type, rc.profiling.memory_snapshot = "neuron", True
    with pytest.raises(ConfigError, match="profiling.memory_snapshot=true has no Neuron equivalent"):
        validate(rc)
    rc.profiling.memory_snapshot, rc.profiling.steps, rc.profiling.neuron_device_profile = False, [2, 3], "session"
    rc.training.steps = 4
    validate(rc)
    assert neuron_environment(rc.profiling, Path("/runs/r")) == {
        "NEURON_RT_INSPECT_ENABLE": "1", "NEURON_RT_INSPECT_OUTPUT_DIR": "/runs/r/profiling/neuron",
        "NEURON_RT_INSPECT_DEVICE_PROFILE": "session"}
    # AWS: not combined with torch.profiler, so on neuron the Trainer's profiler does nothing
    assert not Profiler(rc.profiling, device_type="neuron", rank=0, run_dir=Path("/runs/r"), total_steps=4).enabled
    assert neuron_environment(RunConfig().profiling, Path("/runs/r")) == {}
