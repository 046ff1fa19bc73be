"""Pipeline parallel (issue 42, parallelism.pp): torchtitan's pipeline_llm and torch's schedules against one process.

Each case builds the real Trainer (resolution, torchtitan's stage split, FSDP on each stage, the schedule) in every
rank of an in-process gloo group (no CLI, no torchrun) and runs 3 optimizer steps on the untied small flavor
(tiny_untied: 6 layers, 8 stage units) in float32; rank 0 keeps each step's loss and gradient norm. One group of
processes runs every schedule in turn (the imports and the process group are paid once). A wrong loss normalisation
(a mean of micro-batch means, a loss not summed over the stages), a gradient norm of one stage only, or a stage
that trains a copy of a shared weight moves the losses or the norms by far more than the 1e-5 asked.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest
import torch

from qwen3_research.parallel import PP_SCHEDULES
from tests.conftest import FAST

TOL = 1e-5  # fp32: the issue measured the schedules equal to one process within 1.5e-8 on the gradients
STEPS = 3
BASE = [o for o in FAST if not o.startswith(("training.steps", "data.batch_size"))] + [
    f"training.steps={STEPS}", "data.batch_size=4", "device=cpu", "model.flavor=tiny_untied",
    "training.track_memory=false"]


def _compose(overrides: list[str]) -> dict:
    from qwen3_research.compose import compose_resolved

    return compose_resolved(overrides)


def train(overrides: list[str], run_dir: str) -> dict:
    """{"loss": [...], "grad_norm": [...], "stages": this rank's stage indices} of STEPS steps of the real Trainer."""
    from qwen3_research.resolve import resolve_run
    from qwen3_research.trainer import RunInfo, Trainer

    Path(run_dir).mkdir(parents=True, exist_ok=True)
    trainer = Trainer(resolve_run(_compose(overrides)), RunInfo(run_dir=run_dir))
    try:
        losses, norms = [], []
        for _ in range(STEPS):
            loss, norm = trainer.step()
            losses.append(loss)
            norms.append(norm)
        pipeline = trainer.step.pipeline
        stages = None if pipeline is None else list(pipeline.stages)
        # the forward-only schedule (torch's eval; refused for V schedules: resolve.check_pipeline_run)
        v_schedule = pipeline is not None and PP_SCHEDULES[trainer.run.degrees.pp_schedule] == "v"
        return {"loss": losses, "grad_norm": norms, "eval": None if v_schedule else trainer.step.evaluate(),
                "stages": trainer.where.gather(stages)}  # every rank's
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def _rank_main(rank: int, world: int, ports: list, cases: dict, run_dir: str, out: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1")
    torch.set_num_threads(1)
    results = {}
    for (name, overrides), port in zip(cases.items(), ports):
        os.environ["MASTER_PORT"] = str(port)  # a process group per case: a reused port races its last teardown
        results[name] = train(_base(overrides) + overrides, f"{run_dir}/{name}")
    if rank == 0:
        torch.save(results, out)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_group(cases: dict, tmp_path: Path, world: int) -> dict:
    """``cases`` ({name: overrides}) run one after another in one group of ``world`` gloo processes."""
    import torch.multiprocessing as mp

    out = str(tmp_path / "result.pt")
    ports = [_free_port() for _ in cases]
    mp.start_processes(_rank_main, args=(world, ports, cases, str(tmp_path), out), nprocs=world,
                       start_method="spawn")
    return torch.load(out)


def worst(ref: dict, got: dict) -> tuple[float, float]:
    """(largest loss difference, the evaluation loss's included; largest relative grad-norm difference)."""
    assert len(ref["loss"]) == len(got["loss"]) == STEPS
    evals = [(ref["eval"], got["eval"])] if got["eval"] is not None else []
    loss = max(abs(a - b) for a, b in [*zip(ref["loss"], got["loss"]), *evals])
    norm = max(abs(a - b) / a for a, b in zip(ref["grad_norm"], got["grad_norm"]))
    return loss, norm


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> dict:
    return train(BASE, str(tmp_path_factory.mktemp("single")))


PP2 = {  # schedule -> its stages per rank as torchtitan splits 8 units (6 layers + embedding + lm_head) on 2 ranks
    "1F1B": [[0], [1]], "GPipe": [[0], [1]], "Interleaved1F1B": [[0, 2], [1, 3]], "LoopedBFS": [[0, 2], [1, 3]],
    "InterleavedZeroBubble": [[0, 2], [1, 3]], "ZBVZeroBubble": [[0, 3], [1, 2]], "DualPipeV": [[0, 3], [1, 2]],
}


# CI runs one schedule of each family (one stage per rank; looped; V-shaped), ~25 s each on 2 cores;
# QWEN3_PP_ALL_SCHEDULES=1 runs all seven (all equal one process: issue 42's closing note has their figures).
CI_SCHEDULES = ("1F1B", "Interleaved1F1B", "ZBVZeroBubble")


@pytest.mark.feature("pipeline parallel (parallelism.pp)")
@pytest.mark.slow
def test_every_schedule_on_two_stages_equals_one_process(single, tmp_path):
    names = list(PP2) if os.environ.get("QWEN3_PP_ALL_SCHEDULES") == "1" else CI_SCHEDULES
    print(f"\nsingle: loss {[round(x, 6) for x in single['loss']]} grad_norm {[round(x, 6) for x in single['grad_norm']]}")
    _check_schedules(single, tmp_path, 2, {name: PP2[name] for name in names})


def _check_schedules(single: dict, tmp_path: Path, pp: int, stages: dict) -> None:
    """Each schedule of ``stages`` ({schedule: its stages per rank}) on ``pp`` gloo ranks (dp 1), in one group: the
    split as given, and losses (the held-out one too) and grad norms within TOL of one process."""
    cases = {name: [f"parallelism.nproc_per_node={pp}", f"parallelism.pp={pp}", f"parallelism.pp_schedule={name}"]
             for name in stages}
    results = run_group(cases, tmp_path, world=pp)
    for name, got in results.items():
        loss, norm = worst(single, got)
        print(f"pp={pp} {name:22s} stages {got['stages']}: largest loss difference {loss:.2e}, "
              f"relative grad-norm difference {norm:.2e}")
    for name, got in results.items():
        assert got["stages"] == stages[name], name
        assert worst(single, got) <= (TOL, TOL), name


PP4 = {  # schedule -> its stages per rank on 4 ranks (tiny_untied's 8 units); DualPipeV needs 2 x pp = 8 micro-batches,
    # which the per-rank batch of 4 cannot give (refused in one line: test_pipeline_refusals_are_one_line's kind)
    "1F1B": [[0], [1], [2], [3]], "GPipe": [[0], [1], [2], [3]],
    "Interleaved1F1B": [[0, 4], [1, 5], [2, 6], [3, 7]], "LoopedBFS": [[0, 4], [1, 5], [2, 6], [3, 7]],
    "InterleavedZeroBubble": [[0, 4], [1, 5], [2, 6], [3, 7]], "ZBVZeroBubble": [[0, 7], [1, 6], [2, 5], [3, 4]],
}


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("QWEN3_PP_ALL_SCHEDULES") != "1",
                    reason="4 ranks x 6 schedules (~6 minutes on 2 cores): QWEN3_PP_ALL_SCHEDULES=1 runs it; CI runs "
                           "pp(2) with one schedule of each family")
def test_every_schedule_on_four_stages_equals_one_process(single, tmp_path):
    """Issue 42 acceptance a, pp(4): each schedule torch offers, on 4 gloo ranks (dp 1: the one process's batch of
    4 sequences), 3 steps: losses, the held-out loss (not the V schedules: refused) and grad norms within 1e-5 of one
    process, and torchtitan's split as PP4 says."""
    _check_schedules(single, tmp_path, 4, PP4)


# -- refusals: one line naming the key and the fix, before any worker ----------------------------------------------
PP = ["parallelism.nproc_per_node=2", "parallelism.pp=2"]
REFUSED = {  # overrides -> fragments of the one line
    "tied": (["model.flavor=tiny", *PP], ["parallelism.pp=2 cannot pipeline a model with tied embeddings",
                                          "model.flavor=tiny_untied"]),
    "schedule": ([*PP, "parallelism.pp_schedule=Zigzag"], ["parallelism.pp_schedule='Zigzag' is not a pipeline",
                                                           "DualPipeV"]),
    "dualpipev_microbatches": ([*PP, "parallelism.pp_schedule=DualPipeV", "parallelism.pp_microbatches=2"],
                               ["pp_schedule=DualPipeV needs at least 4", "parallelism.pp_microbatches=4"]),
    "batch": ([*PP, "parallelism.pp_microbatches=3"], ["parallelism.pp_microbatches=3 must divide the per-rank "
                                                       "data.batch_size=4", "data.batch_size=6"]),
    "stages": ([*PP, "parallelism.pp_layers_per_stage=2"], ["pp_schedule=1F1B needs exactly 1 stage(s) per rank",
                                                            "4 stages", "pp_layers_per_stage=0"]),
    "too_many_stages": (["parallelism.nproc_per_node=8", "parallelism.pp=8", "parallelism.pp_schedule=Interleaved1F1B"],
                        ["parallelism.pp=8 with pp_schedule=Interleaved1F1B makes 16 stages, more than",
                         "lower parallelism.pp"]),
    "world": ([*PP, "parallelism.tp=2"], ["parallelism.dp_replicate×tp×pp=1×2×2=4 does not divide the world size"]),
    "hf_backend": (["model=hf", "model.path=/nonexistent", *PP], ["parallelism.pp=2 needs model=native"]),
    "document_masking": ([*PP, "data.document_masking=true"], ["data.document_masking=true with parallelism.pp=2"]),
    "v_schedule_eval": ([*PP, "parallelism.pp_schedule=ZBVZeroBubble", "training.eval_every=1"],
                        ["training.eval_every=1 with parallelism.pp_schedule=ZBVZeroBubble", "training.eval_every=0"]),
}


@pytest.mark.feature("pipeline parallel (parallelism.pp)")
@pytest.mark.parametrize("case", list(REFUSED))
def test_pipeline_refusals_are_one_line(case, tmp_path):
    from qwen3_research.config import ConfigError
    from qwen3_research.resolve import resolve_run

    overrides, fragments = REFUSED[case]
    if case == "hf_backend":  # a directory as model=hf reads it at resolution (a missing one is refused first)
        (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3", "num_attention_heads": 4,
                                                          "num_key_value_heads": 2}))
        overrides = [o.replace("/nonexistent", str(tmp_path)) for o in overrides]
    base = [o for o in BASE if not (case == "hf_backend" and o.startswith("model.flavor"))]
    with pytest.raises(ConfigError) as e:
        resolve_run(_compose(base + overrides))
    msg = str(e.value)
    print(f"\n{case}: {msg}")
    assert "\n" not in msg
    for f in fragments:
        assert f in msg, (f, msg)


def test_torchtitan_02_refuses_pp_in_one_line():
    """0.2.x's Qwen3 ModelSpec has pipelining_fn=None: its check (what models.check_run asks on that tier) refuses
    parallelism.pp > 1 before any worker starts."""
    from types import SimpleNamespace

    from qwen3_research.config import ConfigError
    from qwen3_research.titan import v02

    rc = SimpleNamespace(parallelism=SimpleNamespace(pp=2, tp=1, sequence_parallel=False))
    with pytest.raises(ConfigError) as e:
        v02.check_supported(rc, moe=False)
    print(f"\n{e.value}")
    assert "\n" not in str(e.value) and "parallelism.pp=2 needs torchtitan>=0.3.0" in str(e.value)
    assert "set parallelism.pp=1" in str(e.value)
    v02.check_supported(SimpleNamespace(parallelism=SimpleNamespace(pp=1, tp=1, sequence_parallel=False)), moe=False)


def test_schedule_names_are_torchs():
    """parallel.PP_SCHEDULES: every name torch's get_schedule_class maps to a concrete schedule, with its kind."""
    from torch.distributed.pipelining import schedules as s

    from qwen3_research.parallel import PP_SCHEDULES

    for name, kind in PP_SCHEDULES.items():
        cls = s.get_schedule_class(name)
        single = issubclass(cls, s.PipelineScheduleSingle)
        v = cls in (s.ScheduleZBVZeroBubble, s.ScheduleDualPipeV)
        assert kind == ("single" if single else "v" if v else "looped"), name
    abstract = {"PipelineScheduleSingle", "PipelineScheduleMulti"}
    try:
        s.get_schedule_class("nothing")
    except ValueError as e:  # torch lists its names in the message
        offered = {n.strip(" '[]") for n in str(e).split("options are")[1].split(",")}
        assert offered - abstract == set(PP_SCHEDULES), offered


# -- fsdp(2) × pp(2) on 4 ranks: parity, SIGKILL + resume, the HF export of its checkpoint ---------------------------
FSDP_PP = ["parallelism.nproc_per_node=4", "parallelism.pp=2", "data.batch_size=2"]  # dp_shard=-1: 2; 2 per rank


MOE = ["model=native_moe", "model.flavor=tiny_moe"]  # untied; 4 layers: 3 units per stage on 2 ranks
COMPOSED = {  # name -> overrides (each run on the 4 ranks of one group)
    "fsdp2xpp2": FSDP_PP,
    "tp2xpp2": ["parallelism.nproc_per_node=4", "parallelism.pp=2", "parallelism.tp=2"],  # dp 1: batch 4 per rank
    "ep2xpp2": [*MOE, "parallelism.nproc_per_node=4", "parallelism.pp=2", "parallelism.ep=2", "data.batch_size=2"],
}
MOE_TOL = (1e-3, 3e-3)  # bf16 experts (torchtitan): test_parallel.py allows 1e-2, 3e-3; measured 4.8e-6, 3.2e-5


def _base(overrides: list[str]) -> list[str]:
    return [o for o in BASE if not (o.startswith("model.flavor") and "model=native_moe" in overrides)]


@pytest.fixture(scope="module")
def composed(tmp_path_factory) -> dict:
    """fsdp(2)×pp(2), tp(2)×pp(2) and, on a MoE, ep(2)×pp(2), uninterrupted, in-process on 4 gloo ranks (the global
    batch of one process: 4 sequences)."""
    return run_group(COMPOSED, tmp_path_factory.mktemp("composed"), world=4)


@pytest.fixture(scope="module")
def fsdp_pp(composed) -> dict:
    return composed["fsdp2xpp2"]


@pytest.mark.feature("pipeline parallel (parallelism.pp)")
@pytest.mark.slow
def test_fsdp2_pp2_equals_one_process(single, fsdp_pp):
    loss, norm = worst(single, fsdp_pp)
    print(f"\nfsdp2×pp2 stages {fsdp_pp['stages']}: loss {[round(x, 6) for x in fsdp_pp['loss']]}; largest loss "
          f"difference {loss:.2e}, relative grad-norm difference {norm:.2e}")
    assert fsdp_pp["stages"] == [[0], [0], [1], [1]]  # torchtitan's mesh: pp outermost
    assert (loss, norm) <= (TOL, TOL)


@pytest.mark.feature("pipeline parallel (parallelism.pp)")
@pytest.mark.slow
def test_tp2_pp2_and_moe_ep2_pp2_equal_one_process(single, composed, tmp_path):
    moe_single = train(_base(MOE) + MOE, str(tmp_path / "moe_single"))
    for name, ref, tol in (("tp2xpp2", single, (TOL, TOL)), ("ep2xpp2", moe_single, MOE_TOL)):
        got = composed[name]
        loss, norm = worst(ref, got)
        print(f"\n{name} stages {got['stages']}: largest loss difference {loss:.2e}, relative grad-norm "
              f"difference {norm:.2e} (tolerances {tol})")
        assert got["stages"] == [[0], [0], [1], [1]]
        assert loss <= tol[0] and norm <= tol[1], name


@pytest.mark.feature("pipeline parallel (parallelism.pp)")
@pytest.mark.slow
def test_fsdp2_pp2_resumes_after_sigkill_and_its_checkpoint_exports(fsdp_pp, tmp_path):
    """The CLI on 4 ranks, killed in step 3 (after the step-2 save), resumed to step 3: the losses of the
    uninterrupted run (the DCP checkpoint holds each stage's shards under the whole model's names). Its step-3
    checkpoint then exports, in one process, to a Hugging Face directory that reloads logit-equal (the export
    command's own check)."""
    from tests.conftest import assert_ok, cli_env, fault_env, run_cli, train_losses

    run = tmp_path / "run"
    args = [*BASE, *FSDP_PP, "checkpoint.enable=true", "checkpoint.every=1", "logging.progress_bar=false"]
    killed = run_cli(args, run_dir=run, env=cli_env(**fault_env("kill@3")), timeout=400)
    assert killed.returncode != 0, killed.stderr[-2000:]
    assert train_losses(run) == pytest.approx(fsdp_pp["loss"][:2], abs=TOL)
    resumed = run_cli([*args, "checkpoint.resume=auto"], run_dir=run, timeout=400)
    assert_ok(resumed)
    assert "step-00000002 at step 2" in resumed.stdout, resumed.stdout[-2000:]
    got = train_losses(run)
    print(f"\nuninterrupted {fsdp_pp['loss']}\nkilled+resumed {got}")
    assert len(got) == STEPS and max(abs(a - b) for a, b in zip(got, fsdp_pp["loss"])) <= TOL
    out = tmp_path / "hf"
    export = run_cli([str(run / "checkpoints" / "step-00000003"), str(out)], module="qwen3_research.export",
                     timeout=300)
    assert_ok(export)
    report = json.loads(export.stdout.strip().splitlines()[-1])
    print(report)
    assert report["step"] == 3 and report["missing_keys"] == report["unexpected_keys"] == []
    assert report["max_abs_logit_diff"] <= TOL and (out / "config.json").exists()
