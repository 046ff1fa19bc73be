"""Faults that must not lose work or hide what happened: NaN steps, no network for W&B, secrets."""

from __future__ import annotations

import json
from pathlib import Path

from tests.conftest import FAST, assert_ok, cli_env, fault_env, read_metrics, run_cli, train_losses

QUICK = [a for a in FAST if not a.startswith("training.steps")]


def test_nan_stop_names_the_step(tmp_path):
    proc = run_cli(QUICK + ["training.steps=4"], run_dir=tmp_path / "r", env=cli_env(**fault_env("nan@2")))
    assert proc.returncode == 1, proc.stderr[-2000:]
    last = [ln for ln in proc.stderr.splitlines() if ln.strip()][-1]
    assert last.startswith("error: step 2: non-finite loss=nan"), last
    assert "training.nan_policy=skip" in last
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["reason"].startswith("step 2: non-finite")
    assert [r["step"] for r in read_metrics(tmp_path / "r") if "loss" in r] == [1]  # nothing logged past the bad step


def test_nan_skip_skips_only_that_step(tmp_path):
    assert_ok(run_cli(QUICK + ["training.steps=4"], run_dir=tmp_path / "clean"))
    proc = run_cli(QUICK + ["training.steps=4", "training.nan_policy=skip"], run_dir=tmp_path / "skip",
                   env=cli_env(**fault_env("nan@2")))
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


def test_remote_code_in_a_model_directory_never_runs_by_default(tmp_path):
    """An HF directory whose config.json maps the model to its own Python file (auto_map): model=hf loads
    the built-in Qwen3 class and never imports that file unless model.trust_remote_code=true."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    marker = tmp_path / "remote_code_ran"
    d = tmp_path / "remote"
    cfg = Qwen3Config(vocab_size=151936, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=32, tie_word_embeddings=True)
    Qwen3ForCausalLM(cfg).save_pretrained(d)
    config = json.loads((d / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.EvilModel"}
    (d / "config.json").write_text(json.dumps(config))
    (d / "evil.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n"
                               "from transformers import Qwen3Config as EvilConfig, Qwen3ForCausalLM as EvilModel\n")
    proc = run_cli(QUICK + ["training.steps=1", "model=hf", f"model.path={d}"], run_dir=tmp_path / "r")
    assert_ok(proc)
    assert not marker.exists(), "the model directory's own code ran without model.trust_remote_code=true"


# -- kill, interrupt, disk full, tampering ---------------------------------------------------------

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import ROOT, wandb_records

CKPT = ["checkpoint.enable=true", "checkpoint.every=1", "checkpoint.keep=2"]


def _uninterrupted(tmp_path, steps: int, extra=()) -> list[float]:
    run = tmp_path / "straight"
    assert_ok(run_cli(QUICK + [f"training.steps={steps}", *extra], run_dir=run))
    return train_losses(run)


def _losses_by_step(run_dir) -> dict[int, float]:
    out: dict[int, float] = {}
    for r in read_metrics(run_dir):
        if r.get("loss") is not None:
            out[r["step"]] = r["loss"]  # a resumed run appends; the later row for a step wins
    return out


@pytest.mark.slow
def test_sigkill_at_three_steps_then_resume_is_exact(tmp_path):
    steps = 7
    straight = _uninterrupted(tmp_path, steps)
    # The last step (its checkpoint is the one before it): a kill in step 2, after the first save, is every
    # resume cell's of the pairwise matrix (docs/PAIRWISE.md) and test_rundir's kill at 6; mid-run two-rank kills
    # with evaluation and W&B are test_combinations'.
    kills = [steps]
    print("kill steps", kills)
    for k in kills:
        run = tmp_path / f"kill{k}"
        proc = run_cli(QUICK + CKPT + [f"training.steps={steps}"], run_dir=run, env=cli_env(**fault_env(f"kill@{k}")))
        assert proc.returncode == -signal.SIGKILL, (k, proc.returncode, proc.stderr[-1500:])
        assert (run / "checkpoints" / f"step-{k - 1:08d}").is_dir()
        proc = run_cli(QUICK + CKPT + [f"training.steps={steps}", "checkpoint.resume=auto"], run_dir=run)
        assert_ok(proc)
        assert f"at step {k - 1}" in proc.stdout
        got = _losses_by_step(run)
        assert [got[s] for s in range(1, steps + 1)] == straight, (k, got, straight)


@pytest.mark.slow
def test_sigterm_saves_finishes_wandb_and_resumes_exactly(tmp_path):
    steps = 8
    straight = _uninterrupted(tmp_path, steps)
    run = tmp_path / "term"
    env = cli_env(WANDB_MODE="offline")
    cmd = [sys.executable, "-m", "qwen3_research", *[a for a in QUICK if not a.startswith("logging.wandb")],
           f"training.steps={steps}", "logging.wandb.mode=offline", f"hydra.run.dir={run}"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 240
    while time.time() < deadline and len(train_losses(run) if (run / "metrics.jsonl").exists() else []) < 2:
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
    line = [ln for ln in err.splitlines() if ln.startswith("interrupted by SIGTERM")][0]
    stopped = int(line.split("after step ")[1].split(";")[0])
    assert 2 <= stopped < steps
    assert (run / "checkpoints" / f"step-{stopped:08d}").is_dir()
    assert json.loads((run / "summary.json").read_text())["status"] == "interrupted"
    records = wandb_records(run)
    assert any(r["type"] == "exit" for r in records), "the W&B run was not finished"
    proc2 = run_cli([a for a in QUICK if not a.startswith("logging.wandb")] +
                    [f"training.steps={steps}", "checkpoint.resume=auto", "logging.wandb.mode=disabled"], run_dir=run)
    assert_ok(proc2)
    got = _losses_by_step(run)
    assert [got[s] for s in range(1, steps + 1)] == straight


def test_nan_stop_keeps_the_last_good_checkpoint(tmp_path):
    run = tmp_path / "r"
    proc = run_cli(QUICK + CKPT + ["training.steps=5"], run_dir=run, env=cli_env(**fault_env("nan@3")))
    assert proc.returncode == 1
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-00000001", "step-00000002"]


@pytest.mark.slow
def test_disk_full_during_save_keeps_the_previous_checkpoint(tmp_path):
    probe = tmp_path / "probe"
    assert_ok(run_cli(QUICK + ["training.steps=1", "checkpoint.enable=true"], run_dir=probe))
    size = sum(p.stat().st_size for p in (probe / "checkpoints").rglob("*") if p.is_file())
    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={int(size * 1.5)}", "tmpfs", str(mnt)]).returncode:
        pytest.skip("this machine does not allow mounting a small tmpfs")
    try:
        run = tmp_path / "r"
        proc = run_cli(QUICK + CKPT + ["training.steps=3", f"checkpoint.dir={mnt}"], run_dir=run)
        assert proc.returncode == 1, proc.stderr[-2000:]
        last = [ln for ln in proc.stderr.splitlines() if ln.strip()][-1]
        assert last.startswith("error: checkpoint: cannot save step 2") and "No space left on device" in last
        assert f"the last good checkpoint {mnt}/step-00000001 is kept" in last
        assert sorted(p.name for p in mnt.iterdir()) == ["owner.json", "step-00000001"]  # partial save removed; the owner record of this run
        from qwen3_research.run.checkpoint import is_complete, saved_tensor_shapes

        assert is_complete(mnt / "step-00000001") and saved_tensor_shapes(mnt / "step-00000001")
    finally:
        subprocess.run(["umount", str(mnt)])


def test_tampered_checkpoint_metadata_is_refused(tmp_path):
    import pickle

    run = tmp_path / "r"
    assert_ok(run_cli(QUICK + ["training.steps=1", "checkpoint.enable=true"], run_dir=run))
    ckpt = run / "checkpoints" / "step-00000001"
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    (ckpt / ".metadata").write_bytes(pickle.dumps(Evil()))
    before = (run / "summary.json").read_text()
    proc = run_cli(QUICK + ["training.steps=2", "checkpoint.enable=true", "checkpoint.resume=auto"], run_dir=run)
    assert proc.returncode == 2
    assert "refusing to load it" in proc.stderr and "posix.system" in proc.stderr
    assert not marker.exists(), "the checkpoint ran code"
    assert (run / "summary.json").read_text() == before  # the earlier run's record is kept


def test_hf_backend_refuses_pickled_weights(tmp_path):
    """A pytorch_model.bin (pickle) is never loaded: only safetensors."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(vocab_size=151936, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=32, tie_word_embeddings=True)
    d = tmp_path / "pickled"
    d.mkdir()
    cfg.save_pretrained(d)
    torch.save(Qwen3ForCausalLM(cfg).state_dict(), d / "pytorch_model.bin")
    proc = run_cli(QUICK + ["training.steps=1", "model=hf", f"model.path={d}"], run_dir=tmp_path / "r")
    assert proc.returncode == 2, proc.stderr[-2000:]
    last = [ln for ln in proc.stderr.splitlines() if ln.strip()][-1]
    assert last.startswith(f"config error: model.path='{d}': cannot load the model"), last
