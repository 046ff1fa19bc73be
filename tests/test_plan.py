"""python -m qwen3_research.plan, and sweeps that plan first and resume (issue 15).

The plan traces one step of the real Trainer on fake tensors; a real run with training.track_memory=true
measures its own second step (the first with AdamW's state, like the traced one). Points predicted not to fit are skipped before any worker starts; a sweep
started again in the same sweep dir runs only the points that are not ok yet.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import FAST, ROOT, cli_env, read_metrics, run_cli, wandb_records

QUICK = [a for a in FAST if not a.startswith(("training.steps", "logging.wandb"))]
GIB = 1024**3


def _plan(args: list[str], timeout: float = 600) -> subprocess.CompletedProcess:
    return run_cli(args, module="qwen3_research.plan", timeout=timeout)


def _json_line(proc) -> dict:
    return json.loads(next(ln for ln in proc.stdout.splitlines() if ln.startswith("{")))


def test_plan_small_run_fits_and_prints_the_table():
    proc = _plan(["data.seq_len=64", "data.batch_size=2", "device.memory_gib=8", "--json"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    for row in ("params", "grads", "optimizer", "activations", "logits and loss", "peak (live tensors)",
                "capacity per rank: 8.00 GiB (device.memory_gib)", "verdict: fits with headroom", "FLOPs/step"):
        assert row in proc.stdout, row
    data = _json_line(proc)
    # tiny (dense, tied): 0.6M layer + 19.4M embedding params, fp32: the traced params are exactly these bytes
    assert data["per_rank_traced_bytes"]["0"]["params"] == data["estimate_bytes"]["params"]
    assert data["tokens_per_step"] == 128


def test_8b_on_one_24_gib_rank_does_not_fit():
    proc = _plan(["model.flavor=8B", "parallelism=single", "device.memory_gib=24", "data.seq_len=128",
                  "data.batch_size=1"], timeout=900)
    assert proc.returncode == 4, proc.stdout[-2000:] + proc.stderr[-3000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("does not fit"))
    print(line)
    # 8.2B fp32 params are 30.5 GiB alone, and AdamW's two moments twice that: the largest terms come first
    assert "> 24.00 GiB" in line
    import re

    terms = re.findall(r"([a-z ]+) ([0-9.]+) GiB", line.split("largest terms: ")[1])
    sizes = [float(v) for _, v in terms]
    assert sizes == sorted(sizes, reverse=True) and terms[0][0].strip() == "optimizer" and sizes[0] > 55, terms
    # --fit: no variant of one rank fits (issue 24 acceptance d); exit 4 naming the dominant term
    fit = _plan(["model.flavor=8B", "parallelism=single", "device.memory_gib=24", "--fit"], timeout=900)
    print(fit.stdout.strip())
    assert fit.returncode == 4, fit.stdout[-2000:] + fit.stderr[-3000:]
    assert "fit: nothing fits in 24.00 GiB per rank" in fit.stdout
    # the smallest variant is LoRA's (issue 41: --fit offers model.lora.enable): the frozen float32 base alone is
    # 30.7 GiB, its adapters' gradients and AdamW state 0.5 (full training's state was 122.1 GiB)
    assert "float32 parameters + gradients + AdamW state alone are 31.2 GiB per rank (params 30.7, grads 0.2, " \
           "optimizer 0.3 GiB over 1 shards)" in fit.stdout


@pytest.mark.slow
def test_fit_suggestions_each_fit_when_planned_alone():
    """`plan --fit` on 2 ranks (tiny at seq 512, the full loss frozen, 1.5 GiB per rank: micro-batch 4 needs ~4 GiB of
    logits): every suggested line, planned on its own as a user would paste it, fits; the global batch is kept."""
    base = [*QUICK_NO_SEQ_BATCH, "data.seq_len=512", "parallelism=fsdp", "device.memory_gib=1.5", "training.loss=full"]
    proc = _plan([*base, "--fit", "--json"], timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    print(proc.stdout)
    fits = _json_line(proc)["fits"]
    assert 1 <= len(fits) <= 3
    for f in fits:
        assert "training.loss" not in f["changes"]  # set on the command line: frozen
        alone = _plan([*f["overrides"], "--json"])
        assert alone.returncode == 0, alone.stdout[-3000:] + alone.stderr[-3000:]
        data = _json_line(alone)
        print(" ".join(f["overrides"][len(base):]) or "(as given)", "->", data["predicted_peak_gib"], "GiB")
        assert data["verdict"] != "does not fit" and data["tokens_per_step"] == 4 * 512 * 2  # batch 4 x dp 2


@pytest.mark.slow
def test_sweep_plan_fit_runs_an_infeasible_point_as_its_fitting_variant(tmp_path):
    """sweep.plan=fit: tiny at seq 256 with the default micro-batch 4 and the full loss needs ~1.9 GiB; in 1 GiB the
    point runs with a smaller micro-batch and gradient accumulation (same sequences per step); plan.json, the point's
    summary.json, its W&B config and the report name the change. The precision is frozen on the command line: where
    this CPU's measured bf16 matmul rate beats fp32 (AVX512-BF16, AMX), bf16 would be a cheaper variant."""
    sweep_dir = tmp_path / "sweep"
    proc = run_cli(["-m", *QUICK_NO_SEQ_BATCH, "training.steps=1", "data.seq_len=256", "device.memory_gib=1",
                    "training.loss=full", "training.mixed_precision=auto", "sweep.plan=fit", "logging.wandb.mode=offline",
                    f"hydra.sweep.dir={sweep_dir}"],
                   timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    print(proc.stdout)
    (point,) = _point_dirs(sweep_dir)
    summary = json.loads((point / "summary.json").read_text())
    adjusted = summary["prediction"]["adjusted"]
    assert summary["status"] == "ok" and adjusted["data.batch_size"][0] == 4 and adjusted["data.batch_size"][1] < 4
    b, g = adjusted["data.batch_size"][1], adjusted["training.grad_accum"][1]
    assert b * g == 4 and summary["batch_size"] == b and summary["global_batch_tokens"] == 4 * 256
    assert "adjusted to fit" in proc.stdout
    cfg = next(r for r in wandb_records(point) if r["type"] == "run")["run"]["config"]["update"]
    assert cfg["memory_plan"]["adjusted"] == adjusted and cfg["data"]["batch_size"] == b
    import csv

    with open(sweep_dir / "comparison.csv") as fh:
        (row,) = list(csv.DictReader(fh))
    assert row["adjusted"] == f"data.batch_size=4->{b} training.grad_accum=1->{g}" and row["status"] == "ok"


@pytest.mark.parametrize("bad", [["parallelism.tp=3"], ["device.memory_gib=0"], ["device.memory_gib=-1"]])
def test_bad_input_is_the_same_one_line_as_a_run(bad, tmp_path):
    plan = _plan(bad)
    run = run_cli(QUICK + ["logging.wandb.mode=disabled"] + bad, run_dir=tmp_path / "run")
    assert plan.returncode == run.returncode == 2
    assert plan.stderr.strip() == run.stderr.strip() and len(plan.stderr.strip().splitlines()) == 1, (plan.stderr, run.stderr)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["dense tp2 s256 chunked AC none", "moe fsdp2 s128 chunked AC none"])
def test_prediction_within_15_percent_of_the_measured_peak(name):
    """Two ranks each (tensor parallel with the vocabulary-parallel chunked loss; MoE under FSDP): the
    plan traces rank 0 (even shards) and the run measures both ranks in its own second step."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_plan

    overrides = dict(bench_plan.CONFIGS)[name]
    rows = bench_plan.compare(overrides)
    assert [r for r, *_ in rows] == [0, 1]
    for rank, predicted, measured, traced in rows:
        print(f"{name} rank {rank}: predicted {predicted / GIB:.4f} GiB, measured {measured / GIB:.4f} GiB"
              f"{'' if traced else ' (not traced: shapes of rank 0)'}")
        assert abs(predicted / measured - 1) <= 0.15


@pytest.mark.slow  # 209 s on the shared 2 cores: 3 traces here, 3 runs of 2, 2 and 4 ranks
@pytest.mark.parametrize("name", ["pp2 1F1B", "pp2 Interleaved1F1B", "fsdp2xpp2 GPipe"])  # bench_plan.PP_CONFIGS
def test_pipelined_prediction_within_15_percent_of_each_stages_measured_peak(name, tmp_path):
    """Issue 42 acceptance c: the plan of a pipelined run (each stage group's first rank traced, torch's schedule
    replayed on it: qwen3_research.pipeline_trace) against the run's own second step on every rank, tiny_untied at
    seq 32 over 2 steps: 1F1B (stage 0 holds both micro-batches at once), Interleaved1F1B (two stages per rank, the
    schedule's own lowered program) and fsdp(2) x pp(2) under GPipe (4 ranks; every micro-batch held, gradients
    unsharded until the last). Measured: within 0.7 % on every rank but fsdp2xpp2's stage 0 (9.7 % low: gloo's
    reduce-scatter copies its input on CPU, unmodelled as for the unpipelined MoE fsdp2 case). At seq 32 the
    151,936 x 128 embedding and lm_head dominate: this fails on a wrong split (one process's model: 2x the
    parameter bytes), a missing unsharded copy or optimizer state, or the last stage's logits not held (78 MB of
    0.52 GiB), not on the activations a stage holds (under 2 %)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_plan

    from qwen3_research import planner
    from qwen3_research.compose import compose_resolved
    from qwen3_research.resolve import resolve_run

    overrides = dict(bench_plan.PP_CONFIGS)[name]
    plan = planner.make_plan(resolve_run(compose_resolved([*bench_plan.PP_COMMON, *overrides]), plan=True))
    predicted = plan.per_rank_peak()
    measured = bench_plan.measure(overrides, tmp_path / "run", bench_plan.PP_COMMON)
    assert sorted(predicted) == list(range(len(measured))), (predicted, measured)
    stage_of = {r.rank: r.stages for r in plan.ranks}
    worst = 0.0
    for rank, m in enumerate(measured):
        p = predicted[rank]
        stages = stage_of.get(rank) or stage_of[plan.mirror_of[rank]]
        worst = max(worst, abs(p / m - 1))
        print(f"{name} rank {rank} stage {','.join(map(str, stages))}: predicted {p / GIB:.4f} GiB, measured "
              f"{m / GIB:.4f} GiB ({100 * (p / m - 1):+.1f} %){'' if rank in stage_of else ' (not traced)'}")
    assert len(plan.per_stage_peak()) == 2 * (2 if "Interleaved" in name else 1)
    assert worst <= 0.15


def test_fit_offers_pp_only_on_an_untied_model_and_ranks_it_after_the_same_variant_without():
    """Issue 42: plan --fit's pp knob, in this process (no trace). On 4 ranks (dp_shard=-1) an untied flavor gets
    pp 2 and 4 (divisors of the world up to its 8 stage units), each variant with its auto micro-batches (pp)
    dividing its micro-batch; the tied tiny gets none (torchtitan's split refuses tied embeddings), nor does one
    whose command line sets parallelism.pp. A pp variant costs the 1F1B bubble more compute than the same variant
    without pp: (2 pp - 1) / pp, 1.5 at pp 2."""
    from qwen3_research import fit
    from qwen3_research.compose import compose_resolved
    from qwen3_research.resolve import resolve_run

    def cands(flavor, frozen=frozenset()):
        run = resolve_run(compose_resolved([f"model.flavor={flavor}", "parallelism=fsdp", "parallelism.nproc_per_node=4",
                                            "data.seq_len=32", "data.batch_size=4", "device=cpu"]), plan=True)
        out = fit.candidates(run, frozen)
        for c in out:
            fit.cost(c, run)
        return out

    untied = cands("tiny_untied")
    assert sorted({c.pp for c in untied}) == [1, 2, 4]
    assert all(c.batch % c.pp == 0 for c in untied) and all(c.changes.get("parallelism.pp", 1) == c.pp for c in untied)
    assert {c.pp for c in cands("tiny")} == {1}
    assert {c.pp for c in cands("tiny_untied", frozenset({"parallelism.pp"}))} == {1}
    by_key = {(c.tp, c.pp, c.batch, c.ac, c.chunked, c.bf16, c.lora): c for c in untied}
    pairs = [(c, by_key[(c.tp, 1, c.batch, c.ac, c.chunked, c.bf16, c.lora)]) for c in untied if c.pp == 2]
    assert pairs and all(abs(p.compute_s / q.compute_s - 1.5) < 1e-9 for p, q in pairs)


def test_uneven_shards_trace_the_last_rank_too():
    """tiny's dimensions (128, 384, 151,936) divide by 2 but not by 3: over 3 FSDP ranks the last rank holds
    smaller shards, so the plan traces it as well; over 2 it traces rank 0 only and says so."""
    base = ["parallelism=fsdp", "data.seq_len=32", "data.batch_size=1", "--json"]
    three = _plan(base + ["parallelism.nproc_per_node=3"])
    assert three.returncode == 0, three.stderr[-3000:]
    data = _json_line(three)
    assert data["mirrored_ranks"] == [] and "not traced" not in three.stdout and "traced r2" in three.stdout
    traced = data["per_rank_traced_bytes"]
    assert traced["2"]["params"] < traced["0"]["params"]  # ceil-sized leading shards: the last one is smaller
    two = _plan(base)
    assert two.returncode == 0, two.stderr[-3000:]
    data = _json_line(two)
    assert data["mirrored_ranks"] == [1] and "rank 1 not traced" in two.stdout
    assert data["per_rank_peak_bytes"]["1"] == data["per_rank_peak_bytes"]["0"]


def test_the_planner_builds_the_runs_step_and_rewrites_nothing(fault_hook, monkeypatch):
    """Issue 32: the plan traces the run's own step, built by ``step.build_step`` with the planner's trace placement
    (fake CPU tensors, a fake process group, a local gather), from the resolved run as it is: its config (and its
    RunConfig) equal before and after planning, although it asks for W&B, checkpoints, compile and memory tracking
    (the old planner rewrote six config sections to turn them off); a fault hook around the step (tests/hooks:
    raise@1) that the trace passes through and never fires; os.environ untouched (no RANK/WORLD_SIZE rewrite); and
    during the build none of the attributes the old planner patched is replaced."""
    import copy
    import dataclasses

    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    from qwen3_research import parallel, planner, titan
    from qwen3_research.compose import compose_resolved
    from qwen3_research.resolve import resolve_run
    from qwen3_research.step import Step

    config = compose_resolved(["parallelism=fsdp", "data.seq_len=32", "data.batch_size=1", "device.memory_gib=8",
                               "logging.wandb.mode=offline", "checkpoint.enable=true", "checkpoint.export_hf=true",
                               "training.track_memory=true"])
    run = resolve_run(config, plan=True)
    # torch sets TORCHINDUCTOR_CACHE_DIR itself the first time anything asks for Inductor's cache directory (the import
    # of torchtitan's attention module does, through torch.compile): asked here first, so that the snapshot holds it
    # whichever test this worker ran before (the test failed when it was the first to import torchtitan)
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    cache_dir()
    before = (copy.deepcopy(run.config), dataclasses.asdict(run.rc), dict(os.environ))
    originals = (titan.build_model, parallel.build_parallel_dims, DeviceMesh.__init__, dist.all_gather_object)
    built, traced = [], []
    real_build_step = planner.build_step
    fault_hook("raise@1")
    faulty = Step.forward_backward

    def counted(self, batch, tokens):
        traced.append(self.where.trace)
        return faulty(self, batch, tokens)

    monkeypatch.setattr(Step, "forward_backward", counted)

    def spy(run_arg, where, **kw):
        step = real_build_step(run_arg, where, **kw)
        seen = (titan.build_model, parallel.build_parallel_dims, DeviceMesh.__init__, dist.all_gather_object)
        built.append((run_arg is run, where.trace, where.rank, where.world_size, step.compiled,
                      seen == originals, dict(os.environ) == before[2]))
        return step

    planner.build_step = spy
    try:
        plan = planner.make_plan(run, trace_all=True)
    finally:
        planner.build_step = real_build_step
    assert built == [(True, True, 0, 2, "none", True, True), (True, True, 1, 2, "none", True, True)]
    assert traced and all(traced)  # step 1's forward-backward ran in the trace, through the hook, and was not faulted
    assert (run.config, dataclasses.asdict(run.rc), dict(os.environ)) == before
    assert [r.rank for r in plan.ranks] == [0, 1] and plan.ranks[0].peak == plan.ranks[1].peak > 0


NO_SEQ = [a for a in QUICK if not a.startswith("data.seq_len")]  # the sweeps below choose seq_len
QUICK_NO_SEQ_BATCH = [a for a in NO_SEQ if not a.startswith("data.batch_size")]  # --fit may change the batch


def _sweep(args: list[str], sweep_dir: Path, **kw) -> subprocess.CompletedProcess:
    return run_cli(["-m", *NO_SEQ, "training.steps=2", f"hydra.sweep.dir={sweep_dir}", *args], **kw)


def _point_dirs(sweep_dir: Path) -> list[Path]:
    return sorted((d for d in sweep_dir.iterdir() if (d / ".hydra").is_dir()), key=lambda d: int(d.name.split("_")[0]))


@pytest.mark.slow
def test_sweep_skips_a_point_predicted_not_to_fit(tmp_path):
    sweep_dir = tmp_path / "sweep"
    # tiny at seq 32 x 2: ~0.3 GiB live; at seq 1024 x 2 the full-vocabulary logits alone are ~2.6 GiB (> 1 GiB)
    proc = _sweep(["data.seq_len=32,1024", "device.memory_gib=1", "logging.wandb.mode=offline", "training.loss=full"],
                  sweep_dir, timeout=900)
    assert proc.returncode == 5, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.index("sweep plan") < proc.stdout.index("sweep point 1_")  # planned before the point
    ok, skipped = _point_dirs(sweep_dir)
    s_ok = json.loads((ok / "summary.json").read_text())
    s_skip = json.loads((skipped / "summary.json").read_text())
    assert s_ok["status"] == "ok" and s_ok["prediction"]["verdict"] != "does not fit"
    assert s_skip["status"] == "skipped" and s_skip["reason"].startswith("predicted ")
    assert "GiB > 1.00 GiB per rank" in s_skip["reason"]
    assert not (skipped / "metrics.jsonl").exists() and not (skipped / "wandb").exists()  # no worker started
    cfg = next(r for r in wandb_records(ok) if r["type"] == "run")["run"]["config"]["update"]
    assert cfg["memory_plan"]["predicted_peak_gib"] == s_ok["prediction"]["predicted_peak_gib"]
    import csv

    with open(sweep_dir / "comparison.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert rows[0]["status"] == "ok" and float(rows[0]["predicted_peak_gib"]) > 0
    assert rows[1]["status"].startswith("skipped: predicted") and float(rows[1]["predicted_peak_gib"]) > 1
    # and sweep.skip_infeasible=false runs it anyway
    proc = _sweep(["data.seq_len=1024", "data.batch_size=1", "device.memory_gib=0.5", "sweep.skip_infeasible=false",
                   "logging.wandb.mode=disabled", "training.loss=full"], tmp_path / "anyway", timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (point,) = _point_dirs(tmp_path / "anyway")
    summary = json.loads((point / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["prediction"]["verdict"] == "does not fit"


@pytest.mark.slow
def test_interrupted_sweep_runs_only_the_remaining_points(tmp_path):
    sweep_dir = tmp_path / "sweep"
    args = ["-m", *NO_SEQ, "training.steps=2", "logging.wandb.mode=disabled", "sweep.plan=false",
            "data.seq_len=16,32", "optimizer.lr=1e-3,2e-3", f"hydra.sweep.dir={sweep_dir}"]
    cmd = [sys.executable, "-m", "qwen3_research", *args]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=cli_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        deadline = time.time() + 900
        while time.time() < deadline:  # interrupt (SIGKILL) as soon as two points are ok
            done = [p for p in sweep_dir.glob("*/summary.json") if json.loads(p.read_text()).get("status") == "ok"] \
                if sweep_dir.is_dir() else []
            if len(done) >= 2 or proc.poll() is not None:
                break
            time.sleep(0.2)
        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        proc.wait()
    first = {p.parent.name: p.stat().st_mtime_ns for p in sweep_dir.glob("*/summary.json")
             if json.loads(p.read_text()).get("status") == "ok"}
    assert len(first) == 2, f"the sweep was not interrupted after two points: {sorted(first)}"
    again = run_cli(args, timeout=900)
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout.count("already ok (summary.json), not run again") == 2
    points = _point_dirs(sweep_dir)
    assert len(points) == 4
    for p in points:
        summary = json.loads((p / "summary.json").read_text())
        assert summary["status"] == "ok"
        if p.name in first:  # not run again: same file
            assert (p / "summary.json").stat().st_mtime_ns == first[p.name]
        else:
            assert [r["step"] for r in read_metrics(p) if "loss" in r] == [1, 2]
    assert "4 ok; report:" in again.stdout



@pytest.mark.slow  # 28 s on the shared 2 cores: one trace, most of it importing PEFT and transformers
def test_lora_plan_traces_only_the_adapters_with_adamw_state():
    """Issue 41 (planner): a LoRA run is traced as it runs (its frozen base without gradients or AdamW state) and the
    closed form counts the same. tiny, one rank, in this process (one trace). Expected, from the architecture: the
    adapters are rank 16 x (in + out) on q, k, v, o, gate, up, down in each of 4 layers = 155,648 parameters in 56
    tensors, so AdamW holds 8 B per adapter parameter plus its float32 step per tensor (1,245,408 B; full training:
    8 x 20.4M); the parameter bytes are the base's and the adapters' (traced = closed form). Fails if the trace breaks
    on the frozen base (it did: PEFT's Module.to on fake tensors, MemTracker's gradient hooks) or if the optimizer or
    the closed form's gradients count the base."""
    from qwen3_research import planner
    from qwen3_research.compose import compose_resolved
    from qwen3_research.resolve import resolve_run

    run = resolve_run(compose_resolved(["data.seq_len=32", "data.batch_size=1", "device.memory_gib=8",
                                        "model.lora.enable=true"]), plan=True)
    plan = planner.make_plan(run)
    r0, adapters = plan.ranks[0], 155_648
    print(f"\n{plan.lora_line}\ntraced {r0.traced}\nclosed form {r0.estimate}")
    assert r0.traced["optimizer"] == 8 * adapters + 4 * 56 and r0.estimate["optimizer"] == 8 * adapters, r0.traced
    assert r0.estimate["grads"] == 4 * adapters and r0.traced["params"] == r0.estimate["params"], r0.estimate
    assert plan.lora_line.startswith("LoRA: 155,648 adapter parameters train")
