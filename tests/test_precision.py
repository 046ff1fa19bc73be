"""training.mixed_precision=bf16: sharded layouts as torchtitan does it (FSDP2 bf16 parameter copies, float32 master
weights, reduction and AdamW state), one process autocast; the run records the values it used, and the plan counts
the gathered bf16 parameters."""

from __future__ import annotations

import json

import pytest

from tests.conftest import FAST, assert_ok, run_cli, train_losses, wandb_records

ARGS = [a for a in FAST if not a.startswith(("data.batch_size", "logging.wandb", "training.steps"))] + [
    "training.mixed_precision=bf16", "data.global_batch_tokens=64", "training.steps=2", "logging.wandb.mode=offline",
    "training.loss=full"]
FSDP = ["parallelism.nproc_per_node=2", "parallelism.dp_shard=2"]
PLAN_TOL = 0.15  # the plan's parameter bytes at the peak vs the run's own (the same tracker)


@pytest.mark.slow
def test_bf16_single_process_vs_fsdp_bf16_parameters_and_the_plan(tmp_path):
    single, fsdp = tmp_path / "single", tmp_path / "fsdp"
    # One step of the one-process run is enough for its precision record: the losses of fsdp's bf16 parameters
    # against one process's autocast, every step, are the pairwise matrix's (docs/PAIRWISE.md: fsdp x bf16 and its
    # one-process twin), a bf16 step costing ~10 s on a CPU without bf16 units.
    assert_ok(run_cli([*ARGS, "training.steps=1"], run_dir=single))
    assert_ok(run_cli(ARGS + FSDP + ["training.track_memory=true"], run_dir=fsdp))
    assert len(train_losses(single)) == 1 and len(train_losses(fsdp)) == 2
    summaries = {}
    for run, batch in ((single, 2), (fsdp, 1)):  # 64 tokens = batch × seq_len 32 × dp
        summary = summaries[run] = json.loads((run / "summary.json").read_text())
        assert summary["batch_size"] == batch and summary["global_batch_tokens"] == 64
        assert summary["mixed_precision"] == "bf16"
        config = next(r for r in wandb_records(run) if r["type"] == "run")["run"]["config"]["update"]
        assert config["data"]["batch_size"] == batch  # W&B's config: the value used, not the configured 2
    # Read from the built model: FSDP2's policy and the dtype the optimizer updates (the master weights).
    assert summaries[single]["precision"] == {"mode": "autocast_bf16", "master_dtype": "float32"}
    assert summaries[fsdp]["precision"] == {"mode": "fsdp2_bf16_params", "param_dtype": "bfloat16",
                                           "reduce_dtype": "float32", "master_dtype": "float32"}

    # The plan of the same fsdp run: the largest parameter bytes over the step (float32 shards + FSDP's gathered
    # bf16 copies), the same tracker as the run's training.track_memory=true.
    proc = run_cli(ARGS + FSDP + ["--json"], module="qwen3_research.plan")
    assert_ok(proc)
    plan = json.loads(proc.stdout.strip().splitlines()[-1])
    planned, shards = plan["per_rank_params_max_bytes"]["0"], plan["per_rank_param_shard_bytes"]["0"]
    measured = summaries[fsdp]["live_categories_per_rank"][0]["max"]["params"]
    gathered = planned - shards
    print(f"params, most over the step, rank 0: planned {planned / 2**20:.2f} MiB (shards {shards / 2**20:.2f} + "
          f"gathered {gathered / 2**20:.2f}), measured {measured / 2**20:.2f} MiB, ratio {planned / measured:.3f}; "
          f"gathered / shards {gathered / shards:.3f}")
    assert abs(planned / measured - 1) <= PLAN_TOL
    # bf16 copies: the whole model gathered in bf16 over 2 ranks is one float32 shard (~0.97: the gathered units
    # at the largest point); float32 copies would be ~2 shards.
    assert 0.5 <= gathered / shards <= 1.05
    assert "most gathered" in proc.stdout


# -- issue 32 (acceptance c): the precision walk, YAML -> FSDP2 policy and autocast, in <= 6 hops --------------------

# (module, qualified name) per hop; the last FSDP hop is torchtitan's own (whichever API is installed).
WALK_FSDP = [("qwen3_research.resolve", "auto_settings"), ("qwen3_research.resolve", "precision_plan"),
             ("qwen3_research.step", "build_step"), ("qwen3_research.parallel", "torchtitan_training_configs"),
             ("qwen3_research.titan", "training_configs"), ("torchtitan", "apply_fsdp_to_decoder | apply_fsdp")]
WALK_AUTOCAST = [("qwen3_research.resolve", "auto_settings"), ("qwen3_research.resolve", "precision_plan"),
                 ("qwen3_research.step", "build_step"), ("qwen3_research.devices.runtime", "Device.autocast")]
TORCHTITAN_FSDP = {"apply_fsdp_to_decoder": "torchtitan.distributed.fsdp",
                   "apply_fsdp": "torchtitan.models.qwen3.infra.parallelize"}


def _function(module: str, qualname: str):
    import importlib

    if module == "torchtitan":  # the installed API's FSDP entry
        for name in qualname.split(" | "):
            try:
                return getattr(importlib.import_module(TORCHTITAN_FSDP[name]), name)
            except (ImportError, AttributeError):
                continue
        raise AssertionError(f"torchtitan has none of {qualname}")
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def test_the_precision_walk_is_at_most_six_hops():
    """Each function of ARCHITECTURE.md's precision walk exists and is named there; each walk is <= 6 hops; and the setting
    reaches both effects through the plan: torchtitan's parameter dtype is the plan's, autocast only without
    FSDP2 units."""
    from pathlib import Path

    from qwen3_research import models
    from qwen3_research.config import ModelConfig, ParallelismConfig, RunConfig
    from qwen3_research.parallel import torchtitan_training_configs, validate_degrees
    from qwen3_research.resolve import PrecisionPlan, auto_settings, precision_plan

    doc = (Path(__file__).resolve().parent.parent / "ARCHITECTURE.md").read_text()
    doc = doc[doc.index("## The precision walk"):]
    doc = doc[:doc.find("\n## ", 3) if "\n## " in doc[3:] else len(doc)]
    for walk in (WALK_FSDP, WALK_AUTOCAST):
        assert len(walk) <= 6
        for module, qualname in walk:
            assert callable(_function(module, qualname)), (module, qualname)
            for name in qualname.split(" | "):
                assert name.split(".")[-1] in doc, name
    print(f"\nprecision walk: FSDP2 policy {len(WALK_FSDP)} hops, autocast {len(WALK_AUTOCAST)} hops")

    facts = models.describe(ModelConfig())
    one = validate_degrees(ParallelismConfig(nproc_per_node=1), seq_len=32, **facts)
    fsdp = validate_degrees(ParallelismConfig(nproc_per_node=2, dp_shard=-1), seq_len=32, **facts)
    assert auto_settings({"device": {"type": "cpu"}})["training"]["mixed_precision"] == "none"
    assert auto_settings({"device": {"type": "neuron"}})["training"]["mixed_precision"] == "bf16"
    sharded, single = precision_plan("bf16", fsdp, torchtitan=True), precision_plan("bf16", one, torchtitan=True)
    assert (sharded.mode, sharded.param_dtype, sharded.reduce_dtype, sharded.autocast) == \
        ("fsdp2_bf16_params", "bfloat16", "float32", False)
    assert (single.mode, single.autocast, single.compute_dtype) == ("autocast_bf16", True, "bfloat16")
    assert precision_plan("none", fsdp, torchtitan=True).summary() == {"mode": "float32", "master_dtype": "float32"}
    tt = torchtitan_training_configs(fsdp, activation_checkpoint="none", compile_cfg=RunConfig().compile,
                                     mixed_precision=sharded.setting, run_dir="/tmp")
    assert tt.training.mixed_precision_param == sharded.param_dtype
    assert tt.training.mixed_precision_reduce == sharded.reduce_dtype
    # the Trainer's check: a built model that does not carry out the plan is one clear error
    sharded.check(("bfloat16", "float32"), "float32")
    single.check(None, "float32")
    for policy, master in ((None, "float32"), (("float32", "float32"), "float32"), (("bfloat16", "float32"), "bfloat16")):
        with pytest.raises(RuntimeError, match="does not match the precision plan"):
            sharded.check(policy, master)
    assert isinstance(sharded, PrecisionPlan)


def test_the_planner_and_the_readers_read_the_plan_not_the_setting(monkeypatch):
    """Issue 39 (2): the planner's closed form sized activations from ``training.mixed_precision=bf16 and sharded``,
    which says bf16 parameter copies for a tp-only layout where torchtitan 0.2.x has no FSDP2 units (autocast, float32
    activations). It now reads the run's PrecisionPlan: the same resolved tp2 bf16 run, with the 0.2.x plan
    (autocast) and the 0.3.x plan (FSDP2 bf16 copies), gives float32 activations, twice the bf16 ones (the old rule
    gave both the same). The kernel registry, its verification and the export no longer compare the setting at all."""
    import dataclasses
    import re
    from pathlib import Path

    from qwen3_research import titan
    from qwen3_research.compose import compose_resolved
    from qwen3_research.closed_form import estimate
    from qwen3_research.resolve import precision_plan, resolve_run

    run = resolve_run(compose_resolved(["parallelism=tp2", "training.mixed_precision=bf16", "device=cpu",
                                        "data.seq_len=32", "data.batch_size=2"]), plan=True, kernels=False)
    monkeypatch.setattr(titan, "legacy", lambda: True)
    v02 = precision_plan("bf16", run.degrees, torchtitan=True)
    monkeypatch.setattr(titan, "legacy", lambda: False)
    v03 = precision_plan("bf16", run.degrees, torchtitan=True)
    assert (v02.mode, v03.mode) == ("autocast_bf16", "fsdp2_bf16_params")
    old = estimate(dataclasses.replace(run, precision=v02)), estimate(dataclasses.replace(run, precision=v03))
    print(f"\ntp2 bf16 activations: 0.2.x plan (autocast) {old[0]['activations']} B, 0.3.x plan (FSDP2 bf16) "
          f"{old[1]['activations']} B")
    assert old[0]["activations"] == 2 * old[1]["activations"]
    root = Path(__file__).resolve().parent.parent / "qwen3_research"
    for reader in ("planner.py", "kernels/registry.py", "kernels/verify.py", "run/export_hf.py"):
        code = "\n".join(ln.split("#")[0] for ln in (root / reader).read_text().splitlines())
        assert not re.search(r"mixed_precision\W*(==|!=|in\b)", code), reader
