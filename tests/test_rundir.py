"""A run directory has one owner and one history (issue 14): resume is one run, bad inputs lose nothing.

One killed-and-resumed run (module fixture) serves several refusals: each asserts its exit status,
its one line, and that the run's files are byte-identical afterwards.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.conftest import (FAST, ROOT, assert_ok, cli_env, fault_env, read_metrics, run_cli, sigint_at_import,
                            train_losses, wandb_history)

QUICK = [a for a in FAST if not a.startswith(("training.steps", "logging.wandb"))]
STEPS = 8
CKPT3 = ["checkpoint.enable=true", "checkpoint.every=3", "logging.wandb.mode=offline", f"training.steps={STEPS}"]
DP2 = ["parallelism.nproc_per_node=2", "parallelism.dp_shard=2", "data.batch_size=1"]


def snapshot(run_dir: Path) -> dict[str, bytes]:
    """Every file of an earlier run (Hydra's own .hydra/ and log included), by relative path."""
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in sorted(Path(run_dir).rglob("*")) if p.is_file()}


def last_line(proc) -> str:
    return [ln for ln in proc.stderr.splitlines() if ln.strip()][-1]


def kill_and_resume(tmp_path: Path, extra: list[str]) -> dict:
    """An uninterrupted run, and the same run SIGKILLed at step 6 (checkpoints every 3 steps) then resumed."""
    straight = tmp_path / "straight"
    assert_ok(run_cli(QUICK + CKPT3 + extra, run_dir=straight))
    run = tmp_path / "run"
    killed = run_cli(QUICK + CKPT3 + extra, run_dir=run, env=cli_env(**fault_env("kill@6:rank0")))
    assert killed.returncode != 0
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-00000003"]
    resumed = run_cli(QUICK + CKPT3 + extra + ["checkpoint.resume=auto"], run_dir=run)
    assert_ok(resumed)
    return {"straight": straight, "run": run, "resumed": resumed}


def assert_one_run(r: dict) -> None:
    run = r["run"]
    steps = [row["step"] for row in read_metrics(run)]
    print("metrics.jsonl steps", steps)
    assert steps == list(range(1, STEPS + 1))  # steps 4 and 5 (logged before the kill) appear once
    ids, wb_steps = wandb_history(run)
    print("W&B run ids", ids, "history steps", wb_steps)
    assert len(ids) == 1 and ids == {json.loads((run / "wandb_run.json").read_text())["id"]}
    assert wb_steps == list(range(1, STEPS + 1))
    assert train_losses(run) == train_losses(r["straight"])  # bit-identical on CPU
    assert json.loads((run / "summary.json").read_text())["final_loss"] == train_losses(r["straight"])[-1]


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    return kill_and_resume(tmp_path_factory.mktemp("one_rank"), [])


@pytest.mark.slow
def test_kill_at_6_then_resume_is_one_run(resumed):
    assert_one_run(resumed)


# Two ranks (with evaluation, SIGTERM and SIGKILL, on fsdp, tp2 and ep2): tests/test_combinations.py.


# -- refusals on the finished run: exit status, one line, nothing changed ----------------------------


@pytest.mark.slow
@pytest.mark.parametrize("args, status, line", [
    ([], 2, "config error: hydra.run.dir={run} already holds a run (checkpoints, metrics.jsonl, summary.json, wandb); "
            "continue it with checkpoint.resume=auto, choose another hydra.run.dir, or discard it with checkpoint.overwrite=true"),
    (["checkpoint.resume=auto"], 0, "already complete: {run}/checkpoints/step-00000008 is at training.steps=8; "
                                    "nothing to do (raise training.steps to train further)"),
    (["checkpoint.resume=auto", "training.steps=5"], 2,
     "config error: training.steps=5 is below step 8 of the checkpoint {run}/checkpoints/step-00000008; "
     "set training.steps=8 (nothing to do) or more to continue"),
    (["checkpoint.resume=auto", "training.steps=9", "data.seq_len=64"], 2,
     "config error: checkpoint.resume: {run}/checkpoints/step-00000008 was trained with another data layout "
     "(seq_len: checkpoint 32, now 64), so the run would not continue its data order; resume with the same data "
     "settings, or accept it with checkpoint.allow_data_change=true"),
    (["checkpoint.resume=auto", "training.steps=9", "data.batch_size=3"], 2, "(global_batch_seqs: checkpoint 2, now 3)"),
], ids=["rerun-without-resume", "finished-run-resumed", "steps-below-checkpoint", "seq_len-changed", "batch-changed"])
def test_finished_run_is_never_rewritten(resumed, args, status, line):
    run = resumed["run"]
    before = snapshot(run)
    argv = QUICK + [a for a in CKPT3 if not a.startswith("training.steps") or not any(x.startswith("training.steps") for x in args)]
    proc = run_cli(argv + args, run_dir=run)
    out = [ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.strip() and "Warning" not in ln and "return func" not in ln]
    assert proc.returncode == status, proc.stderr[-2000:]
    assert len(out) == 1, out  # one line, no traceback
    expected = line.format(run=run)
    assert out[0] == expected if not expected.startswith("(") else expected in out[0], out[0]
    assert snapshot(run) == before  # .hydra/, summary, metrics, checkpoints, W&B: byte-identical


@pytest.mark.slow
def test_data_change_accepted_explicitly(resumed, tmp_path):
    run = tmp_path / "copy"
    shutil.copytree(resumed["run"], run)
    proc = run_cli(QUICK + CKPT3 + ["checkpoint.resume=auto", "training.steps=9", "data.batch_size=3",
                                    "checkpoint.allow_data_change=true", "logging.wandb.mode=disabled"], run_dir=run)
    assert_ok(proc)
    said = [ln for ln in proc.stderr.splitlines() if ln.startswith("warning: checkpoint.allow_data_change=true: resuming")]
    assert len(said) == 1, said  # once (issue 40: the launcher and rank 0 each said it, in other words)
    assert [r["step"] for r in read_metrics(run)] == list(range(1, 10))


@pytest.mark.slow
def test_truncated_checkpoint_names_the_file_and_auto_falls_back(resumed, tmp_path):
    run = tmp_path / "copy"
    shutil.copytree(resumed["run"], run)
    ckpts = run / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["step-00000006", "step-00000008"]  # keep=2
    data = ckpts / "step-00000008" / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    before = snapshot(run)
    args = QUICK + CKPT3 + ["training.steps=9", "logging.wandb.mode=disabled"]
    proc = run_cli(args + [f"checkpoint.resume={ckpts / 'step-00000008'}"], run_dir=run)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert last_line(proc).startswith(f"config error: checkpoint.resume='{ckpts / 'step-00000008'}': {data} is truncated (")
    assert last_line(proc).endswith(f"the next-newest intact checkpoint is {ckpts / 'step-00000006'}: resume from it "
                                    f"with checkpoint.resume={ckpts / 'step-00000006'}")
    assert "Traceback" not in proc.stderr and snapshot(run) == before
    proc = run_cli(args + ["checkpoint.resume=auto"], run_dir=run)
    assert_ok(proc)
    warning = [ln for ln in proc.stderr.splitlines() if ln.startswith("warning: checkpoint.resume=auto: skipping")]
    assert len(warning) == 1 and f"falling back to {ckpts / 'step-00000006'}" in warning[0], proc.stderr[-2000:]
    assert f"resumed from {ckpts / 'step-00000006'} at step 6" in proc.stdout
    assert [r["step"] for r in read_metrics(run)] == list(range(1, 10))


@pytest.mark.slow
def test_overwrite_discards_the_earlier_run(resumed, tmp_path):
    run = tmp_path / "copy"
    shutil.copytree(resumed["run"], run)
    proc = run_cli(QUICK + ["training.steps=2", "checkpoint.enable=true", "checkpoint.overwrite=true"], run_dir=run)
    assert_ok(proc)
    assert "checkpoint.overwrite=true: removed the earlier run's" in proc.stderr
    assert [r["step"] for r in read_metrics(run)] == [1, 2]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-00000002"]  # no step-8 outranking it


# -- one owner: the lock -----------------------------------------------------------------------------


def test_a_locked_run_dir_is_refused_and_a_stale_lock_taken_over(tmp_path):
    from qwen3_research.run.rundir import LOCK_NAME, RunDirLock

    run = tmp_path / "r"
    with RunDirLock(run):  # a live owner (this test process)
        proc = run_cli(QUICK + ["training.steps=1", "checkpoint.resume=auto"], run_dir=run)
        assert proc.returncode == 2
        assert last_line(proc) == (f"config error: hydra.run.dir={run} is in use by pid {os.getpid()} on "
                                   f"{os.uname().nodename} ({LOCK_NAME}); wait for that run to end, or choose another hydra.run.dir")
        assert sorted(p.name for p in run.iterdir()) == [LOCK_NAME]  # nothing written
    # A lock left by a process that died (SIGKILL): its pid is gone and nobody holds the flock.
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (run / LOCK_NAME).write_text(json.dumps({"pid": dead.pid, "host": os.uname().nodename}))
    proc = run_cli(QUICK + ["training.steps=1", "checkpoint.resume=auto"], run_dir=run)
    assert_ok(proc)
    assert f"note: took over a stale lock of pid {dead.pid}" in proc.stderr
    assert not (run / LOCK_NAME).exists()  # released on exit


# -- bad inputs: one line, the right status, nothing lost --------------------------------------------


def test_a_file_as_run_dir_is_a_config_error(tmp_path):
    f = tmp_path / "notes.txt"
    f.write_text("my notes\n")
    proc = run_cli(QUICK + ["training.steps=1"], run_dir=f)
    assert proc.returncode == 2
    assert last_line(proc) == f"config error: hydra.run.dir={f}: is a file, not a directory; choose another hydra.run.dir"
    assert "Traceback" not in proc.stderr and f.read_text() == "my notes\n"


def test_a_file_that_is_not_a_tokenizer_is_a_config_error(tmp_path):
    f = tmp_path / "tokenizer.json"
    f.write_text("this is not json\n")
    proc = run_cli(QUICK + ["training.steps=1", f"data.tokenizer={f}"], run_dir=tmp_path / "r")
    assert proc.returncode == 2
    assert last_line(proc).startswith(f"config error: data.tokenizer: {f} is not a tokenizer.json (")
    assert "Traceback" not in proc.stderr and not (tmp_path / "r").exists()


def test_a_tokenizer_without_end_of_text_is_a_config_error(tmp_path):
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers.models import WordLevel

    from qwen3_research.data import Tokenizer
    from qwen3_research.errors import ConfigError

    path = tmp_path / "tokenizer.json"
    HFTokenizer(WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]")).save(str(path))
    with pytest.raises(ConfigError, match=r"has no <\|endoftext\|> token and no eos_token"):
        Tokenizer(path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "[UNK]"}))
    assert Tokenizer(path).eos_id == 1  # the tokenizer's own end-of-sequence token, never token 0 by default


def test_batch_size_beyond_the_data_is_a_config_error(tmp_path):
    corpus = tmp_path / "c.txt"
    corpus.write_text("to be or not to be " * 40)  # ~240 tokens: 7 sequences of 33
    proc = run_cli(QUICK + ["training.steps=1", "data=files", f"data.files={corpus}", "data.val_fraction=0",
                            "data.batch_size=1000"], run_dir=tmp_path / "r", timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    line = last_line(proc)
    assert line.startswith("config error: data.batch_size=1000 × dp 1 × training.grad_accum=1 = 1000 sequences per step, "
                           "but the data holds only "), line
    assert line.endswith("lower data.batch_size (or data.seq_len), or add data")
    assert not (tmp_path / "r" / "summary.json").exists()  # exit 2 writes no summary, also after start-up


def test_no_held_out_documents_turn_evaluation_off_and_json_has_no_nan(tmp_path):
    corpus = tmp_path / "c.txt"
    corpus.write_text("to be or not to be, that is the question " * 60)
    run = tmp_path / "r"
    proc = run_cli(QUICK + ["training.steps=2", "training.eval_every=1", "data=files", f"data.files={corpus}"], run_dir=run)
    assert_ok(proc)
    warnings = [ln for ln in proc.stderr.splitlines() if ln.startswith("warning: no held-out documents")]
    assert len(warnings) == 1, proc.stderr[-2000:]
    assert "warning: optimizer.warmup_steps=10 > training.steps=2" in proc.stderr  # the other silent case
    assert all("eval_loss" not in r for r in read_metrics(run))
    summary = json.loads((run / "summary.json").read_text(), parse_constant=lambda c: pytest.fail(f"{c} in summary.json"))
    assert summary["status"] == "ok" and summary["final_eval_loss"] is None


def test_summary_json_never_holds_nan(tmp_path):
    run = tmp_path / "r"
    proc = run_cli(QUICK + ["training.steps=2", "training.nan_policy=skip"], run_dir=run,
                   env=cli_env(**fault_env("nan@2")))
    assert_ok(proc)
    text = (run / "summary.json").read_text()
    summary = json.loads(text, parse_constant=lambda c: pytest.fail(f"{c} in summary.json"))
    assert summary["final_loss"] is None and summary["non_finite"] == ["final_loss=nan"] and summary["skipped_steps"] == [2]
    for line in (run / "metrics.jsonl").read_text().splitlines():
        json.loads(line, parse_constant=lambda c: pytest.fail(f"{c} in metrics.jsonl"))


@pytest.mark.slow
@pytest.mark.parametrize("moment", ["importing", "start-up", "training"])
def test_ctrl_c_at_any_moment_exits_130(tmp_path, moment):
    run = tmp_path / "r"
    cmd = [sys.executable, "-m", "qwen3_research", *QUICK, "training.steps=50", "logging.wandb.mode=disabled",
           f"hydra.run.dir={run}"]
    env = cli_env()
    if moment == "importing":  # the Ctrl-C lands while the command imports its modules (hydra, the first heavy one),
        # not by a timer: 0.3 s after the start it fell inside the interpreter's own start-up (site) on a loaded
        # host, before any code of ours runs, where Python itself dies of SIGINT
        env.update(sigint_at_import(tmp_path, "hydra", tmp_path / "fired"))
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 240
    ready = {"importing": lambda: True, "start-up": lambda: (run / ".hydra").is_dir(),
             "training": lambda: (run / "metrics.jsonl").exists() and len(read_metrics(run)) >= 1}[moment]
    if moment != "importing":
        time.sleep(0.3)
        while not ready() and time.time() < deadline:
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=240)
    print(moment, err[-500:])
    assert moment != "importing" or (tmp_path / "fired").exists(), err[-2000:]
    assert proc.returncode == 130, err[-2000:]
    assert "Traceback" not in err
    assert [ln for ln in err.splitlines() if ln.startswith("interrupted by SIGINT")], err[-2000:]
    if (run / "summary.json").exists():
        assert json.loads((run / "summary.json").read_text())["status"] == "interrupted"
    if moment == "training":
        assert json.loads((run / "summary.json").read_text())["status"] == "interrupted"


def _tagged(tag: str) -> list:
    """Live processes (zombies aside) whose environment carries the tag: the launcher and all it started."""
    import psutil

    found = []
    for p in psutil.process_iter():
        try:
            if p.status() != psutil.STATUS_ZOMBIE and p.environ().get("QWEN3_TEST_TAG") == tag:
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    return found


def _workers_started(pid: int) -> int:
    """The launcher's worker processes, not the resource tracker: forked on CPU (the launcher's own command
    line, torch already loaded: they build the Trainer), spawned on other devices (spawn_main, loading torch)."""
    import psutil

    n = 0
    for p in psutil.Process(pid).children(recursive=True):
        try:
            cmd = " ".join(p.cmdline())
            n += "resource_tracker" not in cmd and ("spawn_main" in cmd or "qwen3_research" in cmd)
        except (psutil.Error, OSError):
            pass
    return n


@pytest.mark.slow
@pytest.mark.parametrize("to, moment", [("group", "start-up"), ("launcher", "start-up"), ("group", "training")],
                         ids=["group-start-up", "launcher-start-up", "group-training"])
def test_ctrl_c_in_a_two_rank_run_exits_130(tmp_path, to, moment):
    """Ctrl-C reaches the whole foreground group (launcher and both workers) or only the launcher (its agent
    passes it on). start-up: the workers exist and build the Trainer (no metrics yet); training: a metrics row. (SIGINT to the
    launcher alone during training takes the agent's path of the group case; left out to save ~40 s.)"""
    from qwen3_research.run.rundir import LOCK_NAME, RunDirLock

    run, tag = tmp_path / "r", uuid.uuid4().hex
    cmd = [sys.executable, "-m", "qwen3_research", *QUICK, *DP2, "training.steps=50", "logging.wandb.mode=disabled",
           f"hydra.run.dir={run}"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=cli_env(QWEN3_TEST_TAG=tag), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)  # its own group, as in a shell
    try:
        ready = {"start-up": lambda: _workers_started(proc.pid) >= 2 and not (run / "metrics.jsonl").exists(),
                 "training": lambda: (run / "metrics.jsonl").exists() and len(read_metrics(run)) >= 1}[moment]
        deadline = time.time() + 240
        while not ready() and proc.poll() is None and time.time() < deadline:
            time.sleep(0.02)
        assert proc.poll() is None and ready(), f"never reached {moment}: {proc.poll()}"
        if to == "group":
            os.killpg(proc.pid, signal.SIGINT)
        else:
            os.kill(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    print(moment, to, err[-800:])
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err and "Exception ignored" not in err, err[-3000:]
    lines = [ln for ln in err.splitlines() if ln.startswith("interrupted by SIGINT")]
    assert len(lines) == 1, err[-3000:]  # one line for the run, not one per rank
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["reason"] == lines[0]
    if moment == "training":
        m = re.match(r"interrupted by SIGINT after step (\d+); checkpoint saved to (\S+);", lines[0])
        assert m and int(m[1]) >= read_metrics(run)[0]["step"] and Path(m[2]).is_dir(), lines[0]
        assert Path(m[2]).name == f"step-{int(m[1]):08d}"
    deadline = time.time() + 15  # no worker (nor the resource tracker) outlives the launcher
    while _tagged(tag) and time.time() < deadline:
        time.sleep(0.1)
    assert not _tagged(tag), [(p.pid, p.cmdline()) for p in _tagged(tag)]
    assert not (run / LOCK_NAME).exists()  # released: the next run (checkpoint.resume=auto) may own the dir
    RunDirLock(run).acquire().release()


# -- weaker cases ------------------------------------------------------------------------------------


def test_a_bare_word_gets_the_key_value_hint(tmp_path):
    proc = run_cli(["train"], run_dir=tmp_path / "r")
    assert proc.returncode == 2
    assert proc.stderr.strip() == ("config error: 'train' is not an override; write key=value (e.g. training.steps=10) "
                                   "or group=option (e.g. model=native_moe); list them with --help")
    assert not (tmp_path / "r").exists()


def test_a_malformed_jsonl_line_is_named_by_its_number(tmp_path):
    f = tmp_path / "docs.jsonl"
    f.write_text('{"text": "one"}\n{"text": "two"}\n{"text": oops}\n')
    proc = run_cli(QUICK + ["training.steps=1", "data=files", f"data.files={f}"], run_dir=tmp_path / "r")
    assert proc.returncode == 2
    assert last_line(proc) == f"config error: data.files: {f} line 3 is not JSON (Expecting value, column 10)"


def test_an_unknown_wandb_mode_is_one_warning(tmp_path):
    proc = run_cli(QUICK + ["training.steps=1", "logging.wandb.mode=offline"], run_dir=tmp_path / "r",
                   env=cli_env(WANDB_MODE="bogus"))
    assert_ok(proc)
    lines = [ln for ln in proc.stderr.splitlines() if "bogus" in ln]
    assert lines == ["warning: WANDB_MODE='bogus' is not one of online, offline, disabled; W&B is off for this run"]
    assert not (tmp_path / "r" / "wandb").exists()


def test_a_checkpoint_dir_has_one_owner(tmp_path):
    """Run A saves into a checkpoint.dir outside its run dir and is recorded there (owner.json). Run B in a new
    run dir pointed at it is refused by name, whatever it asks (a fresh start, overwrite=true, resume=auto), and
    A's files stay byte-identical: checkpoint.overwrite=true once deleted A's checkpoints."""
    shared = tmp_path / "shared_ckpts"
    args = QUICK + ["training.steps=1", "logging.wandb.mode=disabled", "checkpoint.enable=true", f"checkpoint.dir={shared}"]
    run_a = tmp_path / "a"
    assert_ok(run_cli(args, run_dir=run_a))
    assert json.loads((shared / "owner.json").read_text())["run_dir"] == str(run_a)
    before = {**snapshot(run_a), **{f"shared/{k}": v for k, v in snapshot(shared).items()}}
    run_b = tmp_path / "b"
    expected = (f"config error: checkpoint.dir={shared} belongs to the run in {run_a} ({shared}/owner.json); a run "
                "never writes into, resumes from or overwrites another run's checkpoint directory: choose another "
                f"checkpoint.dir, or continue that run with hydra.run.dir={run_a} checkpoint.resume=auto")
    for extra in ([], ["checkpoint.overwrite=true"], ["checkpoint.resume=auto"]):
        proc = run_cli(args + extra, run_dir=run_b)
        lines = [ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.strip()]
        assert proc.returncode == 2 and lines == [expected], (extra, proc.returncode, lines)
        assert not run_b.exists()
        assert {**snapshot(run_a), **{f"shared/{k}": v for k, v in snapshot(shared).items()}} == before
    # A itself continues in its own checkpoint.dir.
    assert_ok(run_cli([a for a in args if not a.startswith("training.steps")] + ["training.steps=2", "checkpoint.resume=auto"],
                      run_dir=run_a))
    assert (shared / "step-00000002").is_dir()


# The agent stores its process context only when start_processes returns; this driver delivers SIGINT inside it,
# after both workers were forked, which is the race a Ctrl-C at start-up sometimes lost (the launcher exited 130
# and the orphaned workers held its pipes for minutes, waiting for the store that had gone with it).
_SIGINT_INSIDE_START = """
import os, runpy, signal, sys, time
import torch.distributed.elastic.agent.server.local_elastic_agent as agent
original = agent.start_processes
def start_then_interrupted(*args, **kwargs):
    pcontext = original(*args, **kwargs)
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(5)  # the handler raises here, before the agent has the context
    return pcontext
agent.start_processes = start_then_interrupted
sys.argv = ["qwen3_research", *sys.argv[1:]]
runpy.run_module("qwen3_research", run_name="__main__")
"""


@pytest.mark.slow
def test_a_signal_while_the_workers_start_leaves_no_worker_behind(tmp_path):
    run, tag = tmp_path / "r", uuid.uuid4().hex
    cmd = [sys.executable, "-c", _SIGINT_INSIDE_START, *QUICK, *DP2, "training.steps=50",
           "logging.wandb.mode=disabled", f"hydra.run.dir={run}"]
    t0 = time.perf_counter()
    # mallopt: no re-exec for mimalloc's preload, which would start a fresh interpreter without the driver's patch
    env = cli_env(QWEN3_TEST_TAG=tag, QWEN3_CPU_ALLOCATOR="mallopt")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    left = _tagged(tag)
    for p in left:
        p.kill()
    print(f"exit {proc.returncode} after {time.perf_counter() - t0:.1f} s; workers left: {len(left)}; "
          f"{proc.stderr.strip().splitlines()[-1:]}")
    assert proc.returncode == 130, proc.stderr[-3000:]
    assert left == [], [p.cmdline() for p in left]
