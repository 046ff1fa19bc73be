"""Faults that must not lose work or hide what happened: NaN steps, no network for W&B, secrets."""

from __future__ import annotations

import json
from pathlib import Path

from tests.conftest import FAST, assert_ok, cli_env, read_metrics, run_cli, train_losses

QUICK = [a for a in FAST if not a.startswith("training.steps")]


def test_nan_stop_names_the_step(tmp_path):
    proc = run_cli(QUICK + ["training.steps=4", "training.fault=nan@2"], run_dir=tmp_path / "r")
    assert proc.returncode == 1, proc.stderr[-2000:]
    last = [ln for ln in proc.stderr.splitlines() if ln.strip()][-1]
    assert last.startswith("error: step 2: non-finite loss=nan"), last
    assert "training.nan_policy=skip" in last
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["reason"].startswith("step 2: non-finite")
    assert [r["step"] for r in read_metrics(tmp_path / "r") if "loss" in r] == [1]  # nothing logged past the bad step


def test_nan_skip_skips_only_that_step(tmp_path):
    assert_ok(run_cli(QUICK + ["training.steps=4"], run_dir=tmp_path / "clean"))
    proc = run_cli(QUICK + ["training.steps=4", "training.fault=nan@2", "training.nan_policy=skip"], run_dir=tmp_path / "skip")
    assert_ok(proc)
    rows = {r["step"]: r for r in read_metrics(tmp_path / "skip") if "step" in r}
    clean = train_losses(tmp_path / "clean")
    assert rows[2]["skipped"] is True and rows[2]["loss"] is None  # NaN is written as null
    assert rows[1]["loss"] == clean[0]
    # Step 2 made no update, so step 3 sees the weights after step 1 (not the clean run's after step 2).
    assert rows[3]["loss"] != clean[2]
    assert json.loads((tmp_path / "skip" / "summary.json").read_text())["skipped_steps"] == [2]


def test_wandb_online_without_network_falls_back_to_offline(tmp_path):
    env = cli_env(WANDB_API_KEY="0123456789abcdef0123456789abcdef01234567")
    args = [a for a in QUICK if not a.startswith("logging.wandb")] + [
        "training.steps=3", "logging.wandb.mode=online", "logging.wandb.init_timeout=5"]
    proc = run_cli(args, run_dir=tmp_path / "r", env=env, timeout=300)
    assert_ok(proc)
    assert "W&B online start failed" in proc.stderr and "wandb sync" in proc.stderr
    assert len(train_losses(tmp_path / "r")) == 3
    assert list((tmp_path / "r" / "wandb").glob("offline-run-*/run-*.wandb")), "no offline run kept"


def test_secrets_never_reach_the_run_directory(tmp_path):
    secrets = {"WANDB_API_KEY": "wbsecret0123456789abcdef0123456789abcdef", "HF_TOKEN": "hf_topsecrettokenvalue42"}
    env = cli_env(**secrets, WANDB_MODE="offline")
    args = [a for a in QUICK if not a.startswith("logging.wandb")] + [
        "training.steps=2", "logging.print_config=true", "logging.wandb.tags=[${oc.env:HF_TOKEN}]"]
    proc = run_cli(args, run_dir=tmp_path / "r", env=env, timeout=300)
    assert_ok(proc)
    files = [p for p in (tmp_path / "r").rglob("*") if p.is_file()]
    assert any(p.suffix == ".wandb" for p in files) and any(p.name == "metrics.jsonl" for p in files)
    for p in files:
        data = p.read_bytes()
        for name, value in secrets.items():
            assert value.encode() not in data, f"{name} leaked into {p}"
    for name, value in secrets.items():
        assert value not in proc.stdout and value not in proc.stderr, f"{name} printed"
    assert "<redacted>" in proc.stdout  # the printed config shows the tag was redacted


def test_trust_remote_code_is_off_by_default():
    from qwen3_research.config import RunConfig

    assert RunConfig().model.trust_remote_code is False
