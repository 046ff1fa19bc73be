"""Issue 33: the cases where a run, a sweep or an export lost work. Each test fails without its fix.

(1) document masking on tp/ep is in tests/test_document_masking.py; the others are here.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import FAST, run_cli
from tests.test_bad_inputs import one_line, tree

EXPORT = "qwen3_research.export"


@pytest.fixture(scope="module")
def checkpointed_run(tmp_path_factory) -> Path:
    """2 steps of the default model, a checkpoint after each (step-00000001, step-00000002)."""
    run = tmp_path_factory.mktemp("export_force") / "run"
    args = [a for a in FAST if not a.startswith("training.steps")]
    out = run_cli([*args, "training.steps=2", "checkpoint.enable=true", "checkpoint.every=1"], run_dir=run)
    assert out.returncode == 0, out.stderr[-2000:]
    return run


@pytest.mark.parametrize("target,force,relation", [
    ("checkpoints", True, "is the directory of the checkpoint it reads"),
    ("run", True, "is a run directory"),
    ("run", False, "is a run directory"),
    ("parent", True, "contains a run directory"),
    ("checkpoints/step-00000002/hf", False, "lies inside the checkpoint it reads"),
    (".hydra", True, "lies inside a run directory"),
])
def test_export_never_replaces_a_run_or_the_checkpoint_it_reads(checkpointed_run, target, force, relation):
    """Issue 33 (3): `export <run>/checkpoints <run>/checkpoints --force` exited 0 "verified" after deleting both
    training checkpoints; with the run dir as out_dir it deleted metrics.jsonl, summary.json and .hydra/. Now: one
    line, exit 2, every file of the run as it was, and the refusal never suggests --force."""
    run = checkpointed_run
    out = {"run": run, "parent": run.parent}.get(target, run / target)
    before = tree(run.parent)
    proc = run_cli([str(run / "checkpoints"), str(out), *(["--force"] if force else [])], module=EXPORT)
    line = one_line(proc, 2, f"config error: out_dir {out} {relation}")
    assert "--force or not" in line and "pass --force" not in line
    assert tree(run.parent) == before
