"""One start-up resolution (issue 23 point 3): ``resolve.resolve_run`` is what the CLI, the launcher, the planner,
the doctor and ``verify_kernels`` ask before they start anything, and the Trainer builds from its result.

- a bad kernel target (two entries claiming one module, or a target that misses the kernel's modules: found only on
  the model) in a 2-rank run is one line, exit 2, before any worker starts and before Hydra creates the run dir (it
  used to start both ranks, which failed after building their models: exit 1, a traceback per rank, a summary.json;
  a typo only warned, in every rank);
- every entry point refuses it with the same line;
- the description is resolved (batch size from ``data.global_batch_tokens``, mixed precision, nproc) and frozen,
  and building a Trainer from it writes into neither it nor the composed config.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest

from tests.conftest import FAST, run_cli

# Two entries on layers.0's experts: a refusal only the model can give (kernels.resolve), not a static one.
TWO_CLAIMS = ["model=native_moe", "parallelism=fsdp", "kernels.entries=[{name:moe_fast,target:'layers.*.moe.routed_"
              "experts.inner_experts'},{name:moe_fast,target:'layers.0.*'}]", *FAST]
CLAIM = ("kernel entries 'moe_fast' and 'moe_fast@layers.0.*' both claim module 'layers.0.moe.routed_experts."
         "inner_experts'; each module takes one override: narrow one target pattern or drop one entry")


def test_a_bad_kernel_target_fails_before_any_worker_starts(tmp_path):
    """parallelism=fsdp (2 ranks): the refusal comes from the parent's resolution on a meta-device model. No rank
    started: no 'rank N failed', no kernel plan (rank 0 prints it once its model is built), no run dir at all."""
    run_dir = tmp_path / "run"
    proc = run_cli(TWO_CLAIMS, run_dir=run_dir)
    out = proc.stdout + proc.stderr
    print(f"\nexit {proc.returncode}: {proc.stderr.strip()}")
    assert proc.returncode == 2, out[-3000:]
    assert proc.stderr.strip().splitlines() == [f"config error: {CLAIM}"]
    assert "rank" not in out and "kernel plan" not in out and "Traceback" not in out
    assert not run_dir.exists()


def test_a_target_that_misses_the_models_modules_is_refused_by_the_resolution():
    """A typo in a kernel target (the model has 4 CosSinRoPE modules, the pattern reaches none) in a 2-rank run:
    ``resolve_run`` refuses it on the meta-device model, which is before the launcher starts any worker (the CLI's
    preflight turns any ConfigError of the resolution into one line before Hydra starts: the test above). In
    process: no run, the resolution alone."""
    from qwen3_research.compose import compose
    from qwen3_research.errors import ConfigError
    from qwen3_research.resolve import resolve_run

    cfg = compose(["model=native_moe", "parallelism=fsdp", "device=cpu", "kernels=rope_fast",
                   "kernels.entries=[{name:rope_fast,target:'layers.*.atention.rope'}]", *FAST])
    with pytest.raises(ConfigError) as e:
        resolve_run(cfg)
    print(f"\nconfig error: {e.value}")
    assert str(e.value) == ("kernel entry 'rope_fast' (target 'layers.*.atention.rope') matches none of the model's 4 "
                            "CosSinRoPE modules (e.g. 'layers.0.attention.rope'); fix the target: an fnmatch pattern "
                            "over module names, or type:<class>")


@pytest.mark.parametrize("module,code", [("qwen3_research.plan", 2), ("qwen3_research.verify_kernels", 2),
                                         ("qwen3_research.doctor", 1)])
def test_every_entry_point_refuses_it_with_the_same_line(module, code):
    """The planner (which did not check kernel targets before its trace) and verify_kernels: the run's line, exit 2;
    the doctor: its kernels row and the fix, exit 1."""
    proc = run_cli(TWO_CLAIMS, module=module)
    print(f"\n{module}: exit {proc.returncode}: {(proc.stderr.strip().splitlines() or [''])[-1][:120]}")
    assert proc.returncode == code, (proc.stdout + proc.stderr)[-3000:]
    if module == "qwen3_research.doctor":
        row = next(ln for ln in proc.stdout.splitlines() if ln.startswith("kernels "))
        assert row.split(None, 2)[1:] == ["MISSING", CLAIM], row
    else:
        assert proc.stderr.strip().splitlines()[-1] == f"config error: {CLAIM}"


def test_the_description_is_resolved_and_nothing_writes_into_it(tmp_path):
    """data.global_batch_tokens=128 over seq 32 x dp 1 x grad_accum 1: batch 4 per rank, in the description's
    config (what W&B and summary.json record) and its typed rc; nproc_per_node=-1 resolved beside it (1 on cpu) and
    recorded as configured. A Trainer built from it (it used to set cfg.data.batch_size itself) leaves the
    description and the composed config as they were."""
    from omegaconf import OmegaConf

    from qwen3_research.compose import compose
    from qwen3_research.resolve import resolve_run
    from qwen3_research.trainer import RunInfo, Trainer

    cfg = compose([*FAST, "device=cpu", "data.batch_size=7", "data.global_batch_tokens=128"])
    composed = OmegaConf.to_container(cfg)
    run = resolve_run(cfg)
    print(f"\nbatch_size {run.batch_size}, mixed_precision {run.mixed_precision}, nproc {run.nproc_per_node}, "
          f"{run.degrees.describe()}, device {run.device_type}")
    assert (run.batch_size, run.config["data"]["batch_size"], run.mixed_precision, run.config["training"]
            ["mixed_precision"]) == (4, 4, "none", "none")
    assert (run.nproc_per_node, run.config["parallelism"]["nproc_per_node"], run.world_size) == (1, -1, 1)
    assert run.device_type == "cpu" and run.kernel_targets == {} and run.model["is_moe"] is False
    with pytest.raises(dataclasses.FrozenInstanceError):
        run.degrees = None
    before = copy.deepcopy(run.config), dataclasses.asdict(run.rc)
    trainer = Trainer(run, RunInfo(run_dir=str(tmp_path)))
    try:
        assert trainer.summary()["batch_size"] == 4 and trainer.resolved_config["data"]["batch_size"] == 4
    finally:
        trainer.close()
    assert (run.config, dataclasses.asdict(run.rc)) == before
    assert OmegaConf.to_container(cfg) == composed and composed["data"]["batch_size"] == 7


# -- issue 32 (acceptance a): one resolution per process -----------------------------------------------------------

CALLED = ("compose", "resolve_run", "check_run_dir", "checkpoint.preflight")


def _calls(log) -> dict[tuple[str, str], dict[str, int]]:
    """(pid, role) -> {name: how often}, from the call log (``errors.log_call``)."""
    out: dict[tuple[str, str], dict[str, int]] = {}
    for line in log.read_text().splitlines() if log.exists() else []:
        pid, role, name = line.split()
        counts = out.setdefault((pid, role), {})
        counts[name] = counts.get(name, 0) + 1
    return out


def _logged_run(args, run_dir, log):
    from tests.conftest import assert_ok, cli_env

    log.unlink(missing_ok=True)
    proc = run_cli(args, run_dir=run_dir, env=cli_env(QWEN3_RESEARCH_CALL_LOG=str(log)))
    assert_ok(proc)
    calls = _calls(log)
    print(f"\n{' '.join(args[:2])}: " + "; ".join(f"{role} {c}" for (_, role), c in calls.items()))
    return calls


@pytest.mark.parametrize("layout", [[], ["parallelism=fsdp", "parallelism.nproc_per_node=2"]], ids=["single", "fsdp2"])
def test_one_cli_run_resolves_and_composes_once_per_process(tmp_path, layout):
    """One CLI run composes the config, resolves it (``resolve_run``) and checks its run dir once, in the process
    that starts it; the 2 ranks of an fsdp run receive the description (no rank resolves, composes or checks)."""
    calls = _logged_run([*layout, *FAST], tmp_path / "run", tmp_path / "calls.log")
    main = [c for (_, role), c in calls.items() if role == "main"]
    assert len(main) == 1, calls
    assert main[0] == {"compose": 1, "resolve_run": 1, "check_run_dir": 1}, calls
    for (_, role), counts in calls.items():
        assert all(n == 1 for n in counts.values()), calls  # each process: at most once each


def test_a_resume_checks_its_run_dir_and_checkpoint_once(tmp_path):
    """A resume: the run dir and the checkpoint it continues from are checked once (``check_run_dir``, which runs
    ``checkpoint.preflight``), with one compose and one resolution."""
    run_dir, log = tmp_path / "run", tmp_path / "calls.log"
    base = [*FAST, "checkpoint.enable=true", "checkpoint.every=3"]
    _logged_run(base, run_dir, log)
    calls = _logged_run([*base, "training.steps=4", "checkpoint.resume=auto"], run_dir, log)
    main = [c for (_, role), c in calls.items() if role == "main"]
    assert main == [{"compose": 1, "resolve_run": 1, "check_run_dir": 1, "checkpoint.preflight": 1}], calls


def test_a_sweep_resolves_each_point_once_per_process(tmp_path):
    """A 2-point sweep (data.seq_len=32,64: two plans, nothing shared between the points): each point is resolved
    once in all, by its plan (``sweep.plan_points``, in the forked child that traces it), and that resolution is
    the one its run starts from; the launcher does not resolve it again. It used to be 2 per point: the plan's, then
    ``launch.elastic.run(resolved=None)``'s."""
    from tests.conftest import assert_ok, cli_env

    log, sweep_dir = tmp_path / "calls.log", tmp_path / "sweep"
    args = ["-m", "data.seq_len=32,64", *[a for a in FAST if not a.startswith("data.seq_len")], "training.steps=2",
            f"hydra.sweep.dir={sweep_dir}"]
    proc = run_cli(args, env=cli_env(QWEN3_RESEARCH_CALL_LOG=str(log)))
    assert_ok(proc)
    calls = _calls(log)
    points = 2
    resolves = sum(c.get("resolve_run", 0) for c in calls.values())
    per_process = {pid: c.get("resolve_run", 0) for (pid, _), c in calls.items()}
    print(f"\n2-point sweep: {resolves} resolve_run calls in all, {resolves / points:g} per point; per process: "
          f"{per_process}")
    assert resolves == points, calls  # once per point
    assert all(n <= points for n in per_process.values()), calls
