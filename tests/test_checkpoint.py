"""DCP checkpoints: exact resume, atomic saves under SIGKILL, HF export round trip, one-line errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.conftest import FAST, assert_ok, cli_env, fault_env, read_metrics, run_cli, train_losses
from tests.test_hf import run_in_process, tree_digest

BASE = [o for o in FAST if not o.startswith("training.steps")] + ["training.steps=20"]
KILL_ENV = "QWEN3_RESEARCH_TEST_KILL_IN_SAVE"


def step_dirs(run_dir: Path) -> list[str]:
    return sorted(p.name for p in (run_dir / "checkpoints").iterdir())


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> Path:
    """20 native steps in one go, a checkpoint every 10, HF export at the end."""
    run_dir = tmp_path_factory.mktemp("straight")
    run_in_process([*BASE, "checkpoint.enable=true", "checkpoint.every=10", "checkpoint.export_hf=true"], run_dir)
    return run_dir


def native_logits_from_checkpoint(step_dir: Path, inputs: torch.Tensor) -> torch.Tensor:
    """Test-side reference: plain DCP load of the saved parameters into a fresh tiny model."""
    import torch.distributed.checkpoint as dcp

    from qwen3_research import devices
    from qwen3_research.config import ModelConfig

    devices.prepare_torchtitan("cpu")
    from qwen3_research.models.native.model import NativeQwen3

    backend = NativeQwen3(ModelConfig(backend="native", flavor="tiny"), torch.device("cpu"), 32, seed=123)
    params = {n: p.detach() for n, p in backend.model.named_parameters()}
    before = params["tok_embeddings.weight"].clone()
    dcp.load({"model": params}, checkpoint_id=str(step_dir))
    assert not torch.equal(before, params["tok_embeddings.weight"])  # really loaded
    with torch.no_grad():
        return backend.forward(inputs)


def held_out_inputs() -> torch.Tensor:
    from qwen3_research.config import DataConfig
    from qwen3_research.data import PackedDataset, Tokenizer, tokenizer_path

    data = PackedDataset(DataConfig(seq_len=32, batch_size=2), Tokenizer(tokenizer_path("qwen3")))
    return data.val_batches(1, 0, 1)[0].inputs


def check_hf_dir_matches(hf_dir: Path, step_dir: Path, tag: str) -> float:
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="sdpa",
                                                       output_loading_info=True)
    inputs = held_out_inputs()
    with torch.no_grad():
        diff = float((model(input_ids=inputs).logits - native_logits_from_checkpoint(step_dir, inputs)).abs().max())
    print(f"\n[{tag}] {hf_dir.name}: missing={info['missing_keys']} unexpected={info['unexpected_keys']} "
          f"max |logit diff| vs native = {diff:.2e}")
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert diff < 1e-4
    return diff


# -- acceptance b: round trip ---------------------------------------------------------------


def test_export_at_end_reloads_with_transformers(straight):
    assert step_dirs(straight) == ["step-00000010", "step-00000020"]  # keep=2
    report = json.loads((straight / "hf" / "export_verification.json").read_text())
    assert report["missing_keys"] == [] and report["unexpected_keys"] == [] and report["max_abs_logit_diff"] < 1e-4
    assert {"config.json", "model-00001-of-00001.safetensors", "model.safetensors.index.json", "tokenizer.json",
            "tokenizer_config.json"} <= {p.name for p in (straight / "hf").iterdir()}
    assert report["max_abs_tensor_diff"] == 0  # every written tensor read back equal
    check_hf_dir_matches(straight / "hf", straight / "checkpoints" / "step-00000020", "run-end export")


def test_export_command_shards_and_refuses_to_overwrite(straight, tmp_path):
    out = tmp_path / "exported"
    proc = run_cli([str(straight / "checkpoints"), str(out), "--max-shard-size", "30MB"],
                   module="qwen3_research.export", timeout=300)
    assert_ok(proc)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    print(f"\nexport command: {len(shards)} shards {shards}")
    assert len(shards) >= 2
    check_hf_dir_matches(out, straight / "checkpoints" / "step-00000020", "export command")
    # Errors: one line, exit 2, nothing overwritten.
    before = tree_digest(out)
    again = run_cli([str(straight / "checkpoints"), str(out)], module="qwen3_research.export", timeout=300)
    missing = run_cli([str(tmp_path / "nope"), str(tmp_path / "out2")], module="qwen3_research.export", timeout=300)
    broken = tmp_path / "broken" / "step-00000020"
    shutil.copytree(straight / "checkpoints" / "step-00000020", broken)
    (broken / ".metadata").write_bytes(b"garbage")
    corrupt = run_cli([str(broken), str(tmp_path / "out3")], module="qwen3_research.export", timeout=300)
    for proc, expect in [(again, "exists and is not empty"), (missing, "no such directory"), (corrupt, "unreadable")]:
        last = proc.stderr.strip().splitlines()[-1]
        print(f"exit {proc.returncode}: {last}")
        assert proc.returncode == 2 and last.startswith("config error: ") and expect in last, proc.stderr[-2000:]
    assert tree_digest(out) == before
    assert not (tmp_path / "out2").exists() and not (tmp_path / "out3").exists()


# -- acceptance c: exact resume -------------------------------------------------------------


@pytest.mark.feature("checkpoint resume after SIGKILL")
def test_resume_reproduces_steps_11_to_20(straight, tmp_path):
    """Stop after step 10 (SIGKILL at step 11, after the step-10 save), resume=auto to 20: identical losses."""
    run = tmp_path / "run"
    killed = run_cli([*BASE, "checkpoint.enable=true", "checkpoint.every=10"], run_dir=run,
                     env=cli_env(**fault_env("kill@11")))
    assert killed.returncode == -9, killed.stderr[-2000:]
    resumed = run_cli([*BASE, "checkpoint.enable=true", "checkpoint.every=10", "checkpoint.resume=auto"], run_dir=run)
    assert_ok(resumed)
    assert "resumed from" in resumed.stdout and "step-00000010 at step 10" in resumed.stdout
    ref, got = train_losses(straight), train_losses(run)  # metrics.jsonl: steps 1-10, then 11-20 appended
    print(f"\nsteps 11-20 straight {ref[10:]}\n            resumed  {got[10:]}")
    assert len(got) == 20 and got == ref


# -- acceptance d: SIGKILL during a save ----------------------------------------------------


def test_kill_during_save_keeps_previous_checkpoint(straight, tmp_path):
    run = tmp_path / "run"
    args = [*BASE, "checkpoint.enable=true", "checkpoint.every=2"]
    proc = run_cli(args, run_dir=run, env=cli_env(**{KILL_ENV: "4"}))
    assert proc.returncode == -9, proc.stderr[-2000:]
    print(f"\nafter SIGKILL in the step-4 save: {step_dirs(run)}")
    assert step_dirs(run) == [".tmp-step-00000004", "step-00000002"]  # partial one unpublished
    assert (run / "checkpoints" / ".tmp-step-00000004" / ".metadata").exists()  # its data was written
    resumed = run_cli([*args, "checkpoint.resume=auto"], run_dir=run, env=cli_env(**fault_env("kill@5")))
    assert resumed.returncode == -9 and "step-00000002 at step 2" in resumed.stdout, resumed.stdout[-2000:]
    got, ref = train_losses(run), train_losses(straight)
    print(f"resumed from step 2: steps 3-4 {got[2:4]} vs straight {ref[2:4]}")
    # metrics.jsonl was cut back to step 2 on resume: steps 3-4 appear once, retrained
    assert [r["step"] for r in read_metrics(run)] == [1, 2, 3, 4]
    assert got[2:4] == ref[2:4]


@pytest.mark.slow
@pytest.mark.feature("asynchronous checkpoints (checkpoint.async_mode)")
def test_kill_during_an_async_save_resumes_from_the_previous_checkpoint(straight, tmp_path):
    """checkpoint.async_mode=async, a save every 2 steps: SIGKILL in the writer's thread once step 4's data is written,
    while training goes on. Step 4 stays an unpublished .tmp-step directory, resume=auto takes step 2, and steps 3-6
    retrain to the uninterrupted run's losses (each async checkpoint holds its own step's state: the resumed run
    restarts from step 2's and saves 4 and 6 asynchronously again). Fails if a directory were published before its
    write's future resolved (step-00000004 would exist)."""
    run = tmp_path / "run"
    args = [*BASE, "checkpoint.enable=true", "checkpoint.every=2", "checkpoint.async_mode=async"]
    proc = run_cli(args, run_dir=run, env=cli_env(**{KILL_ENV: "4"}))
    assert proc.returncode == -9, proc.stderr[-2000:]
    print(f"\nafter SIGKILL in step 4's asynchronous save: {step_dirs(run)}; logged steps "
          f"{[r['step'] for r in read_metrics(run)]}")
    assert step_dirs(run) == [".tmp-step-00000004", "step-00000002"]
    resumed = run_cli([*args, "checkpoint.resume=auto"], run_dir=run, env=cli_env(**fault_env("kill@7")))
    assert resumed.returncode == -9 and "step-00000002 at step 2" in resumed.stdout, resumed.stdout[-2000:]
    got, ref = train_losses(run), train_losses(straight)
    print(f"resumed from step 2: steps 3-6 {got[2:6]} vs straight {ref[2:6]}")
    assert [r["step"] for r in read_metrics(run)] == [1, 2, 3, 4, 5, 6]
    assert got[:6] == ref[:6]
    stalls = [r["checkpoint_stall_s"] for r in read_metrics(run) if "checkpoint_stall_s" in r]
    assert len(stalls) == 3 and all(s >= 0 for s in stalls)  # steps 2 (first run), 4 and 6 (resumed run)


# -- acceptance e: a checkpoint of another model shape --------------------------------------


def test_resume_with_another_model_shape_is_config_error(straight, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(straight / "checkpoints", run / "checkpoints")
    before = tree_digest(run / "checkpoints")
    proc = run_cli([*BASE, "model.flavor=debug", "checkpoint.resume=auto"], run_dir=run)
    last = proc.stderr.strip().splitlines()[-1]
    print(f"\nexit {proc.returncode}: {last}")
    assert proc.returncode == 2 and last.startswith("config error: ") and "another model shape" in last
    assert "flavor='tiny'" in last
    assert not (run / "metrics.jsonl").exists() and tree_digest(run / "checkpoints") == before


def test_shape_check_reads_the_saved_tensors(straight):
    """Layout-independent check on the DCP metadata itself, as the Trainer runs it before loading."""
    from qwen3_research import devices
    from qwen3_research.run.checkpoint import check_model_matches
    from qwen3_research.run.train_state import model_tensors
    from qwen3_research.config import ConfigError, ModelConfig

    devices.prepare_torchtitan("cpu")
    from qwen3_research.models.native.model import NativeQwen3

    other = NativeQwen3(ModelConfig(backend="native_moe", flavor="tiny"), torch.device("cpu"), 32, 0)
    with pytest.raises(ConfigError, match=r"holds another model shape .*model tensors not in the checkpoint") as e:
        check_model_matches(straight / "checkpoints" / "step-00000020", model_tensors(other.model), what="resume")
    print(f"\n{e.value}")
    assert "\n" not in str(e.value)


# -- dp_shard=2: round trip and resume across a 2-process run -------------------------------


@pytest.mark.slow
def test_dp_shard2_export_and_resume(straight, tmp_path):
    """2 processes: export from FSDP shards reloads cleanly; 3 + resume 3 == 6 straight (2 processes)."""
    base = [o for o in BASE if not o.startswith("training.steps")] + ["training.steps=6"]
    dp = ["parallelism.nproc_per_node=2", "parallelism.dp_shard=2", "checkpoint.enable=true", "checkpoint.every=3"]
    ref_run, run = tmp_path / "dp_straight", tmp_path / "dp_resumed"
    assert_ok(run_cli([*base, *dp, "checkpoint.export_hf=true"], run_dir=ref_run, timeout=600))
    check_hf_dir_matches(ref_run / "hf", ref_run / "checkpoints" / "step-00000006", "dp_shard=2 export")
    killed = run_cli([*base, *dp], run_dir=run, timeout=600, env=cli_env(**fault_env("kill@5")))
    assert killed.returncode != 0
    assert_ok(run_cli([*base, *dp, "checkpoint.resume=auto"], run_dir=run, timeout=600))
    ref, got = train_losses(ref_run), train_losses(run)
    print(f"\ndp_shard=2 steps 4-6 straight {ref[3:]}\n                    resumed  {got[3:]}")
    assert len(got) == 6 and got == ref


def test_checkpointer_saves_and_resumes_a_train_state_without_a_trainer(tmp_path):
    """The checkpointer's whole input is a TrainState and its config: a plain module, AdamW and a schedule
    round-trip (weights, optimizer moments, schedule, step, progress, RNG), and meta.json records what it was given."""
    from qwen3_research.run.checkpoint import Checkpointer
    from qwen3_research.config import CheckpointConfig
    from qwen3_research.run.train_state import TrainState

    def state(seed: int) -> TrainState:
        torch.manual_seed(seed)
        model = torch.nn.Linear(4, 3)
        opt = torch.optim.AdamW(model.parameters(), lr=0.1)
        return TrainState(model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1)))

    def checkpointer(s: TrainState, resume: str | None = None) -> Checkpointer:
        return Checkpointer(s, CheckpointConfig(enable=True, every=1, resume=resume), run_dir=tmp_path, total_steps=5,
                            layout="world=1", data_layout={"seq_len": 4}, config={"model": {"backend": "toy"}})

    saved = state(0)
    for _ in range(2):
        saved.model(torch.ones(2, 4)).sum().backward()
        saved.optimizer.step()
        saved.optimizer.zero_grad()
        saved.scheduler.step()
        saved.step += 1
    saved.skipped_steps, saved.final_loss, saved.final_eval_loss = [1], 0.5, 0.25
    saved.timer.add(1.0)
    path = checkpointer(saved).save(saved.step)
    rand_after_save = torch.rand(3)

    loaded = state(1)  # other weights, no optimizer state
    checkpointer(loaded, resume="auto").maybe_resume()
    assert loaded.step == 2 and loaded.skipped_steps == [1] and (loaded.final_loss, loaded.final_eval_loss) == (0.5, 0.25)
    assert loaded.timer.first_step_s == 1.0 and loaded.scheduler.get_last_lr() == saved.scheduler.get_last_lr()
    assert all(torch.equal(a, b) for a, b in zip(loaded.model.parameters(), saved.model.parameters()))
    for p_saved, p_loaded in zip(saved.model.parameters(), loaded.model.parameters()):
        assert torch.equal(saved.optimizer.state[p_saved]["exp_avg"], loaded.optimizer.state[p_loaded]["exp_avg"])
    assert torch.equal(torch.rand(3), rand_after_save)  # this rank's generator continues where the save left it
    meta = json.loads((path / "meta.json").read_text())
    assert (meta["step"], meta["layout"], meta["model"], meta["data_layout"]) == (2, "world=1", {"backend": "toy"}, {"seq_len": 4})


@pytest.mark.parametrize("saved, resumed", [("bias", "none"), ("none", "bias")])
def test_resume_across_moe_balance_modes_that_change_the_tensors_is_one_config_error(tmp_path, saved, resumed):
    """model.moe.balance=bias adds torchtitan's expert_bias and tokens_per_expert buffers: a checkpoint saved with
    one mode and resumed with the other is refused in one line by the check the Trainer runs before loading,
    naming the buffer (not a strict-load failure inside DCP)."""
    import torch.distributed.checkpoint as dcp

    from qwen3_research import devices
    from qwen3_research.config import ConfigError, ModelConfig, MoEConfig
    from qwen3_research.run.checkpoint import check_model_matches
    from qwen3_research.run.train_state import model_tensors

    devices.prepare_torchtitan("cpu")
    from qwen3_research.models.native.model import NativeQwen3

    def moe(balance):
        cfg = ModelConfig(backend="native_moe", flavor="tiny", moe=MoEConfig(balance=balance))
        return NativeQwen3(cfg, torch.device("cpu"), 32, 0).model

    ckpt = tmp_path / "step-00000002"
    dcp.save({f"model.{k}": v for k, v in model_tensors(moe(saved)).items()}, checkpoint_id=str(ckpt))
    (ckpt / "meta.json").write_text(json.dumps({"model": {"backend": "native_moe", "flavor": "tiny", "moe": {"balance": saved}}}))
    with pytest.raises(ConfigError, match=r"holds another model shape .*expert_bias") as e:
        check_model_matches(ckpt, model_tensors(moe(resumed)), what="checkpoint.resume=auto")
    print(f"\n{saved} -> {resumed}: {e.value}")
    assert "\n" not in str(e.value) and f"saved with model.moe.balance={saved}" in str(e.value)
