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
