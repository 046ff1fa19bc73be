"""Issue 33's weak cases: each ends in one line (``config error: …`` exit 2 naming the key and the fix, 130 for
Ctrl-C) or in the correct behaviour, with nothing lost. In-process where the case allows; a cold process only where
the case is the process itself (a signal, a CLI's exit status).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from qwen3_research.compose import compose
from qwen3_research.config import to_run_config, validate
from qwen3_research.errors import ConfigError
from tests.conftest import ROOT, cli_env, sigint_at_import


def lines(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.strip()]


# -- value checks ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("override, start", [
    # crashed in AdamW's foreach kernel ("value cannot be converted to type float without overflow"), 40 lines
    ("optimizer.lr=1e308", "optimizer.lr=1e+308 must be in (0, 1]"),
    ("parallelism.rdzv_timeout_s=-1", "parallelism.rdzv_timeout_s must be >= 1"),  # trained, silently
    # said "must be a multiple of data.seq_len×dp×grad_accum=32": 0 is one
    ("data.global_batch_tokens=0", "data.global_batch_tokens must be >= 1"),
    ("logging.wandb.init_timeout=-1", "logging.wandb.init_timeout must be > 0"),  # trained, silently
    ("model.moe.bias_coef=1e308", "model.moe.bias_coef=1e+308 must be in (0, 1]"),  # trained into inf biases
    # issue 40: 1 == True but is not True, so compiling.decide took 1 and 0 for auto, silently
    ("compile.enable=1", "compile.enable must be auto, true or false, got 1: write compile.enable=true"),
    ("compile.enable=0", "compile.enable must be auto, true or false, got 0: write compile.enable=false"),
    # issue 40: trained into NaN weights, and the NaN policy's message advised lowering optimizer.lr
    ("optimizer.weight_decay=1e308", "optimizer.weight_decay=1e+308 with optimizer.lr=0.003: AdamW multiplies every"),
    ("device.memory_gib=1e308", "device.memory_gib must be in (0, 1048576] (GiB per rank"),  # the plan printed 309 digits
], ids=["lr", "rdzv-timeout", "global-batch-tokens", "wandb-init-timeout", "bias-coef", "compile-1", "compile-0",
        "weight-decay", "memory-gib"])
def test_a_value_out_of_range_is_one_config_error(override, start):
    with pytest.raises(ConfigError) as e:
        validate(compose(["model=native_moe", override] if "moe" in override else [override]))
    print(f"{override}: config error: {e.value}")
    assert str(e.value).startswith(start) and "\n" not in str(e.value)


def test_an_unknown_compile_backend_is_one_config_error():
    """Issue 40: compile.backend=bogus was accepted until step 1 (a dynamo traceback in every rank); a backend torch
    knows (eager) passes."""
    from qwen3_research.compiling import decide

    rc = to_run_config(compose(["compile.enable=true", "compile.backend=bogus"]))
    with pytest.raises(ConfigError) as e:
        decide(rc, "cpu", is_moe=False)
    print(f"config error: {e.value}")
    assert str(e.value).startswith("compile.backend='bogus' is not a torch.compile backend here (torch's: ")
    assert "inductor" in str(e.value) and "\n" not in str(e.value)
    assert decide(to_run_config(compose(["compile.enable=true", "compile.backend=eager"])), "cpu", is_moe=False).enable


def test_the_moe_preset_with_a_dense_model_is_refused(tmp_path):
    """Issue 40: model=native_moe with a dense flavor (or a dense model.init_from) trained a dense model under the MoE
    preset silently. Expected: one config error naming the flavor (or checkpoint) and the MoE flavors; the preset's
    own MoE flavors and model=native with a dense flavor resolve."""
    from qwen3_research.resolve import resolve_run
    from tests.test_hf import write_hf_checkpoint

    dense = write_hf_checkpoint(tmp_path / "dense", moe=False)
    for overrides, names in ((["model=native_moe", "model.flavor=tiny"], "model.flavor=tiny (a dense flavor)"),
                             (["model=native_moe", f"model.init_from={dense}"], f"model.init_from={dense} (its config")):
        with pytest.raises(ConfigError) as e:
            resolve_run(compose(overrides), plan=True, kernels=False)
        print(f"config error: {e.value}")
        assert str(e.value).startswith(f"model=native_moe with {names}") and "tiny_moe, debug_moe" in str(e.value)
    assert resolve_run(compose(["model=native_moe"]), plan=True, kernels=False).model["is_moe"]
    assert not resolve_run(compose(["model=native", "model.flavor=tiny"]), plan=True, kernels=False).model["is_moe"]


def test_a_missing_local_model_path_says_so():
    """Issue 40: a missing absolute model.path was reported with the Hub client's "Repo id must be in the form
    'repo_name' or 'namespace/repo_name'" (the path is no repo id)."""
    import torch

    from qwen3_research.models.hf.model import HFCausalLM

    cfg = to_run_config(compose(["model=hf", "model.path=/nonexistent/qwen3"])).model
    with pytest.raises(ConfigError) as e:
        HFCausalLM(cfg, torch.device("cpu"), seq_len=32, seed=0)
    print(f"config error: {e.value}")
    assert str(e.value) == ("model.path='/nonexistent/qwen3': no such directory (a local path; a Hub id is "
                            "namespace/name): give the directory that holds config.json and the weights")


def test_a_hub_id_without_network_is_one_line_at_once(monkeypatch, tmp_path):
    """Issue 40: model=hf with a Hub id on a host without network retried for ~30 s and printed 25 lines. Expected: at
    resolution, one config error naming the id, the host and the fix, in well under a second; with HF_HUB_OFFLINE set
    the cache alone decides (no refusal here). The host's name resolution is made to fail (as it does on this CI
    machine), so the test means the same on a host with network."""
    import socket
    import time

    from huggingface_hub import constants

    from qwen3_research.models import hf
    from qwen3_research.models.hf import source

    def no_dns(*a, **k):
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))  # an empty cache
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(source.socket, "getaddrinfo", no_dns)
    t0 = time.perf_counter()
    with pytest.raises(ConfigError) as e:
        hf.describe(to_run_config(compose(["model=hf", "model.path=Qwen/Qwen3-0.6B"])).model)
    took = time.perf_counter() - t0
    print(f"config error ({took:.2f} s): {e.value}")
    assert str(e.value).startswith("model.path='Qwen/Qwen3-0.6B' is a Hub id that is not in this host's Hugging Face "
                                   "cache, and huggingface.co cannot be reached") and "model.path=DIR" in str(e.value)
    assert took < 5
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert hf.describe(to_run_config(compose(["model=hf", "model.path=Qwen/Qwen3-0.6B"])).model)["n_heads"] is None


# -- the tools' arguments -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("module, argv, start", [
    ("plan", ["-m", "parallelism.tp=1,2"], "config error: plan: unknown option -m (a sweep: run it"),  # a lexer error
    ("plan", ["--bogus"], "config error: plan: unknown option --bogus; plan takes one run's overrides"),
    ("verify_kernels", ["--bogus"], "config error: verify_kernels: unknown option --bogus"),  # was ignored
], ids=["plan-m", "plan-bogus", "verify_kernels-bogus"])
def test_an_unknown_option_is_one_config_error(capsys, module, argv, start):
    import importlib

    status = importlib.import_module(f"qwen3_research.{module}").main(argv)
    err = lines(capsys.readouterr().err)
    print(f"{module} {' '.join(argv)}: exit {status}: {err}")
    assert status == 2 and len(err) == 1 and err[0].startswith(start)


@pytest.mark.parametrize("module", ["plan", "doctor"])
def test_a_bad_allocator_is_refused_by_the_tools_as_by_a_run(capsys, monkeypatch, module):
    """Issue 40: QWEN3_CPU_ALLOCATOR=bogus was accepted by doctor and plan, and refused by the run they checked."""
    import importlib

    monkeypatch.setenv("QWEN3_CPU_ALLOCATOR", "bogus")
    status = importlib.import_module(f"qwen3_research.{module}").main([])
    err = lines(capsys.readouterr().err)
    assert status == 2 and err == ["config error: QWEN3_CPU_ALLOCATOR='bogus' is not one of auto, mimalloc, mallopt, "
                                   "system (auto: mimalloc on CPU runs; system: glibc as it comes)"], err


def _run_dir(path: Path, loss: float) -> Path:
    (path / ".hydra").mkdir(parents=True)
    (path / ".hydra" / "overrides.yaml").write_text("- training.steps=1\n")
    (path / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": loss, "tokens_per_s": 10.0}) + "\n")
    (path / "summary.json").write_text(json.dumps({"status": "ok", "steps": 1, "final_loss": loss}))
    return path


def test_compare_counts_each_run_once(tmp_path, capsys):
    """`compare D D` (or a sweep dir and one of its runs) listed every run twice and tallied "4 ok" for 2 runs."""
    from qwen3_research import compare

    sweep = tmp_path / "sweep"
    _run_dir(sweep / "0_a", 2.0), _run_dir(sweep / "1_b", 3.0)
    status = compare.main([str(sweep), str(sweep), str(sweep / "0_a"), "--out", str(tmp_path / "cmp")])
    rows = (tmp_path / "cmp" / "comparison.csv").read_text().splitlines()[1:]
    print(f"exit {status}: {len(rows)} rows: {rows}")
    assert status == 0 and len(rows) == 2 and "2 ok;" in capsys.readouterr().out


def test_compare_writes_beside_the_runs_not_in_the_working_directory(tmp_path, capsys, monkeypatch):
    """Issue 40: `compare RUN RUN` wrote ./comparison/ wherever it ran; the report goes beside the runs and says where."""
    from qwen3_research import compare

    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    a, b = _run_dir(tmp_path / "runs" / "a", 2.0), _run_dir(tmp_path / "runs" / "b", 3.0)
    for run in (a, b):
        (run / ".hydra").mkdir(exist_ok=True)  # run directories, not a sweep
    assert compare.main([str(a), str(b)]) == 0
    out = capsys.readouterr().out
    assert (tmp_path / "runs" / "comparison" / "comparison.md").is_file() and not list(cwd.iterdir())
    assert f"report: {tmp_path / 'runs' / 'comparison' / 'comparison.md'}" in out, out


# -- Ctrl-C in a tool -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("tool, args, trigger, stopped", [
    ("plan", ["training.steps=1"], "qwen3_research.planner", "the plan was stopped; nothing was written"),
    ("plan", ["--fit", "training.steps=1"], "qwen3_research.fit", "the plan was stopped; nothing was written"),
    ("doctor", [], "qwen3_research.resolve", "the doctor was stopped"),
    ("verify_kernels", ["kernels=moe_fast", "model=native_moe"], "qwen3_research.resolve", "no kernel was verified"),
    ("compare", ["SWEEP"], "qwen3_research.report", "the report may be incomplete"),
], ids=["plan", "plan-fit", "doctor", "verify_kernels", "compare"])
def test_ctrl_c_in_a_tool_is_one_line(tmp_path, tool, args, trigger, stopped):
    """Each printed a 22-53-line KeyboardInterrupt traceback (the run itself: one line, exit 130)."""
    marker = tmp_path / "fired"
    if args == ["SWEEP"]:
        args = [str(_run_dir(tmp_path / "sweep" / "0_a", 2.0).parent), "--out", str(tmp_path / "cmp")]
    proc = subprocess.run([sys.executable, "-m", f"qwen3_research.{tool}", *args], cwd=ROOT,
                          env=cli_env(**sigint_at_import(tmp_path, trigger, marker)), capture_output=True,
                          text=True, timeout=300)
    assert marker.exists(), f"{trigger} was never imported\n{proc.stderr[-2000:]}"
    err = lines(proc.stderr)
    print(f"{tool}: exit {proc.returncode}: {err}")
    assert proc.returncode == 130 and err == [f"interrupted by SIGINT; {stopped}"], proc.stderr[-3000:]


# -- resume ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("key, saved, now, overrides", [
    ("model.moe.balance", "aux_loss", "none", ["model=native_moe"]),
    ("data.document_masking", True, False, []),
    ("training.mixed_precision", "bf16", "none", []),
], ids=["moe-balance", "document-masking", "mixed-precision"])
def test_a_resume_across_a_training_setting_is_refused(tmp_path, monkeypatch, key, saved, now, overrides):
    """model.moe.balance aux_loss -> none, data.document_masking true -> false and training.mixed_precision bf16 -> none
    (issue 40 weak case) resumed silently and rewrote the run's recorded config (no tensor differs, so the model-shape check let them through). The checkpoint's
    meta.json is the composed config with the saved value; ``preflight`` is what the launcher runs first."""
    from omegaconf import OmegaConf

    from qwen3_research.config import to_run_config
    from qwen3_research.run import checkpoint

    section, name = key.split(".", 1)
    cfg = compose([*overrides, f"{key}={str(now).lower()}", "checkpoint.resume=auto"])
    recorded = OmegaConf.to_container(cfg, resolve=True)
    node = recorded[section]
    for part in name.split(".")[:-1]:
        node = node[part]
    node[name.split(".")[-1]] = saved
    ckpt = tmp_path / "checkpoints" / "step-00000001"
    ckpt.mkdir(parents=True)
    (ckpt / "meta.json").write_text(json.dumps({"step": 1, "model": recorded["model"], "config": recorded}))
    monkeypatch.setattr(checkpoint, "find_checkpoint", lambda *a, **k: ckpt)
    with pytest.raises(ConfigError) as e:
        checkpoint.preflight(to_run_config(cfg), tmp_path)
    show = str(saved).lower()
    print(f"{key}: config error: {e.value}")
    assert str(e.value).startswith(f"checkpoint.resume=auto: {ckpt} was trained with {key}={show}, but this run sets "
                                   f"{key}={str(now).lower()}") and f"resume with {key}={show}" in str(e.value)
    node[name.split(".")[-1]] = now  # the same value: resumes
    (ckpt / "meta.json").write_text(json.dumps({"step": 1, "model": recorded["model"], "config": recorded}))
    checkpoint.preflight(to_run_config(cfg), tmp_path)


def test_a_sigterm_during_the_final_export_is_redone_on_resume(tmp_path):
    """SIGTERM while checkpoint.export_hf writes at the end of the run: the resume said "already complete" (the last
    step is checkpointed) and the export never happened. Now the run is complete once its summary says ok, which is
    written after the export: the resume exports from the last checkpoint, and then the run is complete."""
    import signal
    import time

    from tests.conftest import FAST, assert_ok, run_cli

    run = tmp_path / "r"
    args = [*FAST, "training.steps=1", "optimizer.warmup_steps=0", "checkpoint.enable=true", "checkpoint.export_hf=true"]
    proc = subprocess.Popen([sys.executable, "-m", "qwen3_research", *args, f"hydra.run.dir={run}"], cwd=ROOT,
                            env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 240
    while not list(run.glob(".hf.tmp-export*")) and proc.poll() is None and time.time() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)  # while the export writes
    out, err = proc.communicate(timeout=240)
    print(f"SIGTERM during the export: exit {proc.returncode}: {lines(err)}")
    assert proc.returncode == 143 and not (run / "hf").exists(), err[-3000:]
    assert (run / "checkpoints" / "step-00000001").is_dir()

    resumed = run_cli([*args, "checkpoint.resume=auto"], run_dir=run)
    assert_ok(resumed)
    said = [ln for ln in lines(resumed.stdout) if ln.startswith(("resume:", "already complete"))]
    print(f"resume: exit {resumed.returncode}: {said}")
    assert said and said[0].startswith(f"resume: {run}/checkpoints/step-00000001 is at training.steps=1, but the run's "
                                       "HF export (checkpoint.export_hf) did not finish; exporting it now")
    assert (run / "hf" / "config.json").is_file() and json.loads((run / "summary.json").read_text())["status"] == "ok"
    again = run_cli([*args, "checkpoint.resume=auto"], run_dir=run)  # now it is complete
    assert_ok(again)
    assert lines(again.stdout)[-1].startswith("already complete:")


# -- data -----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("content, start", [
    (b"\x00" * 4096, "is not a text file (a NUL byte at character 0): it looks binary"),  # trained silently
    (b"\x01\x02\x1b\x7f" * 100, "holds only control characters, no text"),
], ids=["nul-bytes", "control-characters"])
def test_a_corpus_file_without_text_is_refused_by_name(tmp_path, content, start):
    from qwen3_research.data import file_documents

    (tmp_path / "a.txt").write_text("to be or not to be, that is the question " * 40)
    (tmp_path / "b.txt").write_bytes(content)
    with pytest.raises(ConfigError) as e:
        file_documents(str(tmp_path / "*.txt"), "text")
    print(f"config error: {e.value}")
    assert str(e.value).startswith(f"data.files: {tmp_path}/b.txt {start}")


# -- a worker group ---------------------------------------------------------------------------------------------------


def test_a_failed_rank_is_one_line_without_the_agents_traceback(tmp_path):
    """torch elastic's agent logged the failed rank's traceback (43 lines of "E1206 … api.py:836] …", and a
    "Terminating process" warning) before the one line that names the cause; the traceback is in the run's log."""
    from tests.conftest import FAST, fault_env, run_cli

    run = tmp_path / "r"
    proc = run_cli([*FAST, "training.steps=2", "optimizer.warmup_steps=0", "parallelism.nproc_per_node=2"], run_dir=run,
                   env=cli_env(**fault_env("raise@1:rank1")))
    err = lines(proc.stderr)
    print(f"exit {proc.returncode}: {err}")
    assert proc.returncode == 1 and err == ["error: rank 1 failed (exit code 1): RuntimeError: injected failure at step 1 "
                                            "on rank 1 (QWEN3_TEST_FAULT=raise@1:rank1)"], proc.stderr[-3000:]
    assert "in _inject_fault" in (run / "__main__.log").read_text()


# -- CPU ranks and their memory ---------------------------------------------------------------------------------------


def test_cpu_ranks_far_above_the_cores_are_refused_unless_forced(monkeypatch):
    """parallelism.nproc_per_node=20000 on 2 cores was accepted by the doctor and the run. The limit is 8 ranks per
    core (the tests run 4 ranks on 2 cores); parallelism.oversubscribe=true starts them anyway; a plan is not refused."""
    from qwen3_research import devices
    from qwen3_research.resolve import resolve_run

    monkeypatch.setattr(devices, "cpu_cores", lambda: 2)
    with pytest.raises(ConfigError) as e:
        resolve_run(compose(["device=cpu", "parallelism.nproc_per_node=20000"]), kernels=False)
    print(f"config error: {e.value}")
    assert str(e.value) == ("parallelism.nproc_per_node=20000 starts 20000 CPU ranks on the 2 core(s) this process may "
                            "use, more than 8 per core (each rank is a whole process with its own torch); use at most 16, "
                            "or start them anyway with parallelism.oversubscribe=true")
    for ok in (["parallelism.nproc_per_node=16"], ["parallelism.nproc_per_node=4"],
               ["parallelism.nproc_per_node=20000", "parallelism.oversubscribe=true"]):
        assert resolve_run(compose(["device=cpu", *ok]), kernels=False).nproc_per_node in (4, 16, 20000)
    assert resolve_run(compose(["device=cpu", "parallelism.nproc_per_node=20000"]), plan=True, kernels=False)


def test_the_doctor_refuses_cpu_ranks_far_above_the_cores(capsys):
    from qwen3_research import doctor
    from qwen3_research.devices import cpu_cores

    n = 8 * cpu_cores() + 1
    status = doctor.main(["device=cpu", f"parallelism.nproc_per_node={n}"])
    fixes = [ln for ln in lines(capsys.readouterr().out) if ln.startswith("- run config:")]
    print(f"exit {status}: {fixes}")
    assert status == 1 and len(fixes) == 1 and f"parallelism.nproc_per_node={n} starts {n} CPU ranks" in fixes[0]


@pytest.mark.parametrize("limit, ranks, want", [
    ("8589934592", 4, (2.0, "GiB cgroup limit")),  # a container of 8 GiB, 4 ranks: 2 GiB each
    ("max", 2, None),  # cgroup v2 without a limit: the host's RAM, halved
], ids=["cgroup-limit-over-4-ranks", "no-limit-over-2-ranks"])
def test_a_cpu_ranks_plan_capacity_is_its_share_of_the_cgroup_limit(tmp_path, monkeypatch, limit, ranks, want):
    """The planner credited every CPU rank with the whole host RAM: 4 ranks in an 8 GiB container were each
    told they had the host's 24 GiB."""
    import psutil

    from qwen3_research import devices
    from qwen3_research.config import to_run_config
    from qwen3_research.planner import capacity

    (tmp_path / "memory.max").write_text(limit + "\n")
    monkeypatch.setattr(devices.host, "cgroup_memory_files", lambda: [str(tmp_path / "memory.max")])  # devices/host.py
    gib, source = capacity(to_run_config(compose(["device=cpu"])), "cpu", ranks)
    print(f"{gib:.2f} GiB per rank ({source})")
    if want is None:
        assert gib == pytest.approx(psutil.virtual_memory().total / ranks / 1024**3) and "host RAM / 2 ranks" in source
    else:
        assert gib == pytest.approx(want[0]) and want[1] in source and f"/ {ranks} ranks" in source


# -- sweep planning -----------------------------------------------------------------------------------------------------


def test_sweep_points_that_differ_only_in_seed_or_lr_share_one_plan(tmp_path, monkeypatch):
    """Sweep planning traced every point (~1-4 s each) even when only training.seed or optimizer.lr differed, and
    printed torchtitan's "Total parameter count" line per point. Points with the same planned shape now share one
    trace; each point's own values are still validated (seed=-1 is a config error, not the shared plan)."""
    from omegaconf import OmegaConf

    from qwen3_research import planner
    from qwen3_research.launch import sweep

    base = ["training.steps=1", "data.seq_len=32", "data.batch_size=2"]
    jobs = [[*base, "training.seed=0"], [*base, "training.seed=1"], [*base, "training.seed=1", "optimizer.lr=1e-3"],
            [*base, "training.seed=-1"], ["training.steps=1", "data.seq_len=64", "data.batch_size=2", "training.seed=0"]]
    traced = []
    real = planner.make_plan
    monkeypatch.setattr(planner, "make_plan", lambda composed, **k: traced.append(composed) or real(composed, **k))
    monkeypatch.setattr(sweep, "sweep_jobs", lambda config: jobs)
    config = OmegaConf.create({"hydra": {"job": {"config_name": "config"}, "runtime": {"config_sources": []},
                                         "sweeper": {"params": None}}, "sweep": {"plan": True}})
    echoed = []
    entries = sweep.plan_points(config, tmp_path, echo=echoed.append)
    print("\n".join(echoed))
    got = [entries[sweep._point_key(j)] for j in jobs]
    assert len(traced) == 2  # seq_len 32 once, seq_len 64 once
    assert got[0]["predicted_peak_gib"] == got[1]["predicted_peak_gib"] == got[2]["predicted_peak_gib"]
    assert got[3]["error"].startswith("config error: training.seed must be in [0, ")
    # make_plan gets each point's one resolution (sweep.resolve_point), which its run starts from
    assert [c.config["data"]["seq_len"] for c in traced] == [32, 64] and "predicted_peak_gib" in got[4]


def test_a_corrupt_metadata_in_the_newest_checkpoint_falls_back_to_the_previous(tmp_path, capsys):
    """Issue 40: a newest checkpoint whose .metadata is garbage stopped checkpoint.resume=auto with a config error,
    where a missing or truncated shard falls back to the previous checkpoint with a warning (docs/RELIABILITY.md).
    Expected: auto resumes step 1 with one warning naming step 2 and the fallback; a path to step 2 itself stays an
    error naming step 1; a .metadata that unpickles to a foreign class is still refused (tampering, not damage)."""
    import pickle

    import torch
    import torch.distributed.checkpoint as dcp

    from qwen3_research.run import checkpoint

    root = tmp_path / "checkpoints"
    for step in (1, 2):
        path = root / f"step-{step:08d}"
        dcp.save({"w": torch.full((4,), float(step))}, checkpoint_id=str(path))
        (path / checkpoint.META).write_text(json.dumps({"step": step}))
    (root / "step-00000002" / ".metadata").write_bytes(b"garbage")
    assert checkpoint.find_checkpoint("auto", root, warn=True) == root / "step-00000001"
    warned = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("warning: ")]
    print(warned)
    assert len(warned) == 1 and "skipping step-00000002" in warned[0] and "unreadable" in warned[0] \
        and f"falling back to {root / 'step-00000001'}" in warned[0]
    with pytest.raises(ConfigError, match="unreadable.*the next-newest intact checkpoint is .*step-00000001"):
        checkpoint.find_checkpoint(str(root / "step-00000002"), root)
    (root / "step-00000002" / ".metadata").write_bytes(pickle.dumps(subprocess.Popen))
    with pytest.raises(ConfigError, match="tampered"):
        checkpoint.find_checkpoint("auto", root, warn=True)


def test_verify_kernels_on_a_dense_model_and_the_references(capsys):
    """Issue 40: ``verify_kernels kernels=fast`` on a dense model printed "1/1 kernel(s) pass" and then ended in an
    error (moe_fast matches no module), and ``kernels=reference`` printed "nothing verified for no active kernel has
    a check" with exit 1. Expected: fast passes with the kernels' one warning for moe_fast (as a run warns of an
    unmatched entry among matched ones), exit 0; reference says it has nothing to verify, exit 0 (in-process: the tool's main)."""
    from qwen3_research import verify_kernels

    small = ["data.seq_len=32", "data.batch_size=2"]
    with pytest.warns(UserWarning, match="kernel entry 'moe_fast' .* matches no module"):
        assert verify_kernels.main(["kernels=fast", *small]) == 0
    out = capsys.readouterr()
    print(out.out[-500:])
    assert "1/1 kernel(s) pass" in out.out and "error" not in out.err
    assert verify_kernels.main(["kernels=reference", *small]) == 0
    out = capsys.readouterr()
    print(out.out[-300:])
    assert "kernels=reference: nothing to verify: its entries (moe_reference, rope_reference) have no check" in out.out
    assert "error" not in out.err


def test_a_run_dir_name_longer_than_the_file_system_takes_is_one_line(tmp_path):
    """Issue 40: a 300-character hydra.run.dir component ended in a 28-line "File name too long" traceback. Expected:
    one config error naming the key, the component's length and the limit; nothing created."""
    from qwen3_research.run.rundir import check_run_dir

    rc = to_run_config(compose([]))
    with pytest.raises(ConfigError) as e:
        check_run_dir(rc, tmp_path / ("a" * 300) / "run")
    print(f"config error: {e.value}")
    assert str(e.value).startswith("hydra.run.dir: the component aaaa") and "300 bytes" in str(e.value)
    assert list(tmp_path.iterdir()) == []
    assert check_run_dir(rc, tmp_path / ("a" * 200)) is None  # long but allowed: a fresh start


def test_a_swept_non_ascii_value_gets_advice_that_keeps_the_sweep():
    """Issue 40: ``-m data.text=é,ü`` was refused with "quote it: 'data.text="é,ü"'", which makes the two-point sweep
    one string. Expected: each value quoted; the advised override parses as a sweep of the two values (a list as a
    list); a single value keeps the whole-value advice."""
    import shlex

    from qwen3_research import overrides
    from qwen3_research.__main__ import _quoting_advice

    for value, sweep in (("é,ü", True), ("[é,b]", False)):
        advice = _quoting_advice("data.text", value)
        print(advice)
        word = shlex.split(advice.rsplit(": ", 1)[1])[0]
        parsed = overrides.parse_one(word)
        assert advice.startswith("quote each value") and parsed.sweep is sweep
        assert parsed.value == ('"é","ü"' if sweep else '["é","b"]')
    assert _quoting_advice("data.text", "é") == "quote it: 'data.text=\"é\"'"


def test_a_stop_signal_abandons_a_long_evaluation(tmp_path):
    """Issue 40: Ctrl-C during a long evaluation waited for all of its batches. Expected: ``Step.evaluate`` asks the
    loop's stop flag before each batch after the first and returns None once it is set: one forward (3 without a stop,
    on 3 held-out batches); the model is back in training mode; without a stop the value is the plain evaluation's."""
    from qwen3_research.compose import compose as compose_run
    from qwen3_research.resolve import resolve_run
    from qwen3_research.step import build_step, place

    run = resolve_run(compose_run(["training.eval_batches=3", "data.seq_len=32", "data.batch_size=2",
                                   "logging.wandb.mode=disabled"]))
    step = build_step(run, place(run), run_dir=tmp_path)
    forwards = []
    hook = step.backend.model.register_forward_hook(lambda *a: forwards.append(1))
    asked = []
    assert step.evaluate(lambda: asked.append(1) or 2) is None  # SIGINT's number, as StopOnSignal.requested gives
    print(f"stopped: {len(forwards)} forward(s), asked {len(asked)} time(s)")
    assert len(forwards) == 1 and len(asked) == 1 and step.backend.model.training
    forwards.clear()
    plain = step.evaluate()
    assert len(forwards) == 3 and step.evaluate(lambda: 0) == plain
    hook.remove()


def test_a_sweep_says_how_many_earlier_attempts_it_keeps(tmp_path):
    """Issue 40: with sweep.resume=false every point's earlier attempt went to .previous_attempts on each run of the
    sweep, which grew without a word. Expected: no line when there are none; one line with the count, the folder and
    its size when there are (the sweep prints it before its summary line)."""
    from qwen3_research.launch.sweep import previous_attempts_line

    assert previous_attempts_line(tmp_path) is None
    for point, n in (("0_training.seed=1", 1), ("0_training.seed=1", 2), ("1_training.seed=2", 1)):
        d = tmp_path / ".previous_attempts" / point / str(n)
        d.mkdir(parents=True)
        (d / "metrics.jsonl").write_bytes(b"x" * 2**20)
    line = previous_attempts_line(tmp_path)
    print(line)
    assert line == (f"earlier attempts kept: 3 in {tmp_path / '.previous_attempts'} (3.0 MiB); nothing there is deleted "
                    "for you: remove the folder once you no longer need them")
