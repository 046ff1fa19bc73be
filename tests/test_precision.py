"""training.mixed_precision=bf16 means the same in every layout, and the run records the values it used."""

from __future__ import annotations

import json

import pytest

from tests.conftest import FAST, assert_ok, run_cli, train_losses, wandb_records

ARGS = [a for a in FAST if not a.startswith(("data.batch_size", "logging.wandb"))] + [
    "training.mixed_precision=bf16", "data.global_batch_tokens=128", "training.steps=1", "logging.wandb.mode=offline"]


@pytest.mark.slow
def test_bf16_single_process_equals_fsdp_and_records_the_derived_batch(tmp_path):
    single, fsdp = tmp_path / "single", tmp_path / "fsdp"
    assert_ok(run_cli(ARGS, run_dir=single))
    assert_ok(run_cli(ARGS + ["parallelism.nproc_per_node=2", "parallelism.dp_shard=2"], run_dir=fsdp))
    a, b = train_losses(single), train_losses(fsdp)
    print("bf16 losses single", a, "fsdp", b)
    # Autocast with float32 parameters in both: the same sequences give the same step-1 loss up to the
    # order of the dp reduction (~1e-6). bf16 FSDP parameters (the old meaning) differ by ~1e-3.
    assert abs(a[0] - b[0]) < 1e-4
    for run, batch in ((single, 4), (fsdp, 2)):  # 128 tokens = batch × seq_len 32 × dp
        summary = json.loads((run / "summary.json").read_text())
        assert summary["batch_size"] == batch and summary["global_batch_tokens"] == 128
        assert summary["mixed_precision"] == "bf16"
        config = next(r for r in wandb_records(run) if r["type"] == "run")["run"]["config"]["update"]
        assert config["data"]["batch_size"] == batch  # W&B's config: the value used, not the configured 4


# training.mixed_precision=bf16_params (issue 24): torchtitan's FSDP2 policy, bf16 parameter copies for forward and
# backward, float32 master weights, reduction and AdamW state. The full loss keeps the root unit (embedding and tied
# lm_head, 19.4 M parameters) gathered at the step's peak, so the gathered bf16 copies are in the peak's bytes. 64
# tokens per step: bf16 matmuls are slow on CPUs without bf16 units.
BF16P = [a for a in FAST if not a.startswith(("data.batch_size", "data.seq_len", "training.steps"))] + [
    "training.mixed_precision=bf16_params", "training.loss=full", "data.seq_len=16", "data.global_batch_tokens=64",
    "training.steps=2"]
PARITY_TOL = 1e-3  # |loss difference| per step; measured 1e-4 after 3 steps (bf16 gradients rounded per rank)
PLAN_TOL = 0.15


@pytest.fixture(scope="module")
def bf16_params_runs(tmp_path_factory):
    """One process (FSDP2 over a one-rank mesh, as torchtitan runs one device) and fsdp over 2 ranks, same batch."""
    tmp = tmp_path_factory.mktemp("bf16_params")
    single, fsdp = tmp / "single", tmp / "fsdp"
    assert_ok(run_cli(BF16P, run_dir=single))
    assert_ok(run_cli(BF16P + ["parallelism=fsdp", "training.track_memory=true"], run_dir=fsdp))
    return single, fsdp


@pytest.mark.slow
def test_bf16_params_fsdp_matches_one_process(bf16_params_runs):
    single, fsdp = bf16_params_runs
    a, b = train_losses(single), train_losses(fsdp)
    print("bf16_params losses one process", a, "fsdp 2 ranks", b, "max |diff|", max(abs(x - y) for x, y in zip(a, b)))
    assert len(a) == len(b) == 2 and all(abs(x - y) <= PARITY_TOL for x, y in zip(a, b))
    for run in (single, fsdp):
        assert json.loads((run / "summary.json").read_text())["mixed_precision"] == "bf16_params"


@pytest.mark.slow
def test_plan_counts_the_gathered_bf16_parameters(bf16_params_runs):
    """The plan's parameter bytes at the peak (fp32 shards + FSDP's gathered bf16 copies) against the run's own
    (training.track_memory=true, the same tracker), and the gathered part half of float32's."""
    _, fsdp = bf16_params_runs
    measured = json.loads((fsdp / "summary.json").read_text())["peak_live_categories_per_rank"][0]["params"]
    plans = {}
    for mp in ("bf16_params", "none"):
        args = [a for a in BF16P if not a.startswith("training.mixed_precision")]
        proc = run_cli(args + ["parallelism=fsdp", f"training.mixed_precision={mp}", "--json"],
                       module="qwen3_research.plan")
        assert_ok(proc)
        plans[mp] = json.loads(proc.stdout.strip().splitlines()[-1])
    planned = plans["bf16_params"]["per_rank_traced_bytes"]["0"]["params"]
    gathered = {mp: p["per_rank_traced_bytes"]["0"]["params"] - p["per_rank_param_shard_bytes"]["0"]
                for mp, p in plans.items()}
    print(f"params at the peak: planned {planned / 2**20:.1f} MiB, measured {measured / 2**20:.1f} MiB "
          f"(ratio {planned / measured:.3f}); gathered bf16 {gathered['bf16_params'] / 2**20:.1f} MiB vs float32 "
          f"{gathered['none'] / 2**20:.1f} MiB")
    assert abs(planned / measured - 1) <= PLAN_TOL
    assert 0.45 <= gathered["bf16_params"] / gathered["none"] <= 0.55
