"""Features where they meet (issue 21): several ranks × evaluation × periodic checkpoints × W&B × signals.

For each multi-rank layout (fsdp, tp2, MoE ep2), one run with evaluation every 2 steps, checkpoints every
2 steps and an offline W&B run is stopped by SIGTERM at an evaluation step (step 2, sent to the launcher as
Slurm or scancel would), resumed and SIGKILLed during step 4, then resumed to the end. It must end as one
run: exit 0, each step once in metrics.jsonl, one W&B run id whose history has each step once, the final
checkpoint present, and training and held-out losses equal to an uninterrupted run's (bit-identical on
CPU: the data order, RNG and optimizer state all resume exactly).

Every earlier resume test turned evaluation off, which is how the post-evaluation save failure (FSDP's
root unit left gathered after an evaluation forward, ``parallel.reshard``) went unseen.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from tests.conftest import FAST, assert_ok, cli_env, fault_env, read_metrics, run_cli, wandb_history

STEPS = 4
BASE = [a for a in FAST if not a.startswith(("training.steps", "training.eval_every", "logging.wandb"))] + [
    f"training.steps={STEPS}", "training.eval_every=2", "training.eval_batches=1",
    "checkpoint.enable=true", "checkpoint.every=2", "logging.wandb.mode=offline",
]
# ep2 only: its checkpoint holds both data-parallel and expert shards. A SIGKILL and resume on fsdp, tp2 and
# tp2_nosp, each against its one-process twin, are the pairwise matrix's (docs/PAIRWISE.md, lifecycle=resume);
# fsdp's save, export and resume over 6 steps is tests/test_checkpoint.py's.
LAYOUTS = {
    "ep2": ["model=native_moe", "parallelism=ep2"],
}


def _last_line(proc) -> str:
    return [ln for ln in proc.stderr.splitlines() if ln.strip()][-1]


def _eval_losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["eval_loss"] for r in read_metrics(run_dir) if r.get("eval_loss") is not None}


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_eval_checkpoints_wandb_sigterm_sigkill_resume_is_one_run(layout, tmp_path):
    args = BASE + LAYOUTS[layout]
    straight = tmp_path / "straight"
    assert_ok(run_cli(args, run_dir=straight))
    assert (straight / "checkpoints" / f"step-{STEPS:08d}").is_dir()  # the save after the last evaluation

    run = tmp_path / "run"
    # 1. SIGTERM to the launcher as step 2's evaluation starts: the ranks finish the step, save, exit 143.
    termed = run_cli(args, run_dir=run, env=cli_env(**fault_env("term@2:rank0")))
    assert termed.returncode == 128 + signal.SIGTERM, termed.stderr[-3000:]
    assert _last_line(termed) == (f"interrupted by SIGTERM after step 2; checkpoint saved to {run}/checkpoints/"
                                  "step-00000002; continue with checkpoint.resume=auto and the same hydra.run.dir")
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["step"] == 2, summary
    # 2. Resumed, then rank 0 SIGKILLed in step 4's forward: the group stops; step 2 stays the newest checkpoint.
    killed = run_cli(args + ["checkpoint.resume=auto"], run_dir=run, env=cli_env(**fault_env("kill@4:rank0")))
    assert killed.returncode == 1, killed.stderr[-3000:]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-00000002"]
    # 3. Resumed to the end.
    resumed = run_cli(args + ["checkpoint.resume=auto"], run_dir=run)
    assert_ok(resumed)
    assert f"resumed from {run}/checkpoints/step-00000002 at step 2" in resumed.stdout

    rows = read_metrics(run)
    steps = [r["step"] for r in rows]
    losses = [r["loss"] for r in rows]
    ids, wb_steps = wandb_history(run)
    print(f"{layout}: metrics steps {steps}, losses {losses}, eval {_eval_losses(run)}, W&B ids {sorted(ids)}, "
          f"W&B history steps {wb_steps}")
    assert steps == list(range(1, STEPS + 1))  # step 3 (logged before the kill) once
    assert len(ids) == 1 and ids == {json.loads((run / "wandb_run.json").read_text())["id"]}
    assert wb_steps == list(range(1, STEPS + 1))
    assert losses == [r["loss"] for r in read_metrics(straight)]
    assert _eval_losses(run) == _eval_losses(straight) and sorted(_eval_losses(run)) == [2, 4]
    assert (run / "checkpoints" / f"step-{STEPS:08d}" / "meta.json").is_file()
    final = json.loads((run / "summary.json").read_text())
    assert final["status"] == "ok" and final["steps"] == STEPS and final["final_loss"] == losses[-1]
