"""The runner of the pairwise matrix (issue 33, deliver 4): every combination runs or is refused before it starts.
The all-pairs cells of tests/pairwise.py each run through the real CLI for 2 steps, half of them in
tests/test_pairwise.py and half in tests/test_pairwise_odd.py, so that the two pytest workers (``--dist loadfile``)
share the matrix instead of one running all of it while the other idles.

A cell passes when it either
- finishes (exit 0), and, where it checkpoints, resumes after a SIGKILL in step 2 (lifecycle=resume) or exports a verified
  Hugging Face directory (lifecycle=export), and, where it has a one-process twin on the same batches (every
  multi-rank cell; a resumed single-process cell's twin is its uninterrupted run), its losses and MoE routing
  statistics equal the twin's within the layout's tolerance; or
- is refused: exit 2, the last line ``config error: ...``, no traceback, and nothing of a worker in the run
  directory (no metrics.jsonl, no checkpoint).
A crash after start, a traceback, or a refusal after workers started fails it.

The cells and their outcomes are docs/PAIRWISE.md; this test fails when that table differs from what it ran
(``QWEN3_WRITE_PAIRWISE=1`` rewrites its rows), so a combination that starts or stops being refused is a reviewed
change. Each half checks its own rows, and the even half the header.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import filelock
import pytest

from tests import pairwise
from tests.conftest import ROOT, cli_env, fault_env, read_metrics, run_cli
from tests.test_hf import write_hf_checkpoint

STEPS = 2
BASE = [f"training.steps={STEPS}", "data.seq_len=32", "data.batch_size=2", "logging.print_config=false",
        "logging.wandb.mode=disabled", "logging.progress_bar=false"]
DP = {"single": 1, "fsdp": 2, "tp2": 1, "tp2_nosp": 1, "ep2": 2}  # data-parallel ranks of each layout
ROUTING_KEYS = ("moe_max_load", "moe_cv", "moe_empty_frac", "moe_entropy")
TABLE = ROOT / "docs" / "PAIRWISE.md"


def tolerance(cell: dict[str, str]) -> float:
    """Loss tolerance against the one-process twin: fp32 dense layouts reproduce it to 1e-4 (tests/test_parallel.py);
    torchtitan's experts compute in bf16 (1e-2, as test_parallel's MOE_TOL); bf16 on a sharded layout is FSDP2's
    bf16 parameters against one process's autocast (2e-2 over 2 steps); compile reorders float sums (1e-3)."""
    tol = 1e-4
    if cell["model"] == "native_moe" or cell["precision"] == "bf16":
        tol = 2e-2
    if cell["compile"] == "on":
        tol = max(tol, 1e-3)
    return tol


def _lines(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.strip()]


def _refused(proc, run_dir: Path) -> str | None:
    """The one-line refusal, if ``proc`` was refused before any worker started; None if it was not a refusal."""
    if proc.returncode != 2:
        return None
    err = _lines(proc.stderr)
    assert err and err[-1].startswith("config error: "), f"exit 2 without a config error line:\n{proc.stderr[-3000:]}"
    assert "Traceback" not in proc.stderr, f"a refusal with a traceback:\n{proc.stderr[-3000:]}"
    assert not (run_dir / "metrics.jsonl").exists(), f"refused after a worker logged a step: {err[-1]}"
    assert not (run_dir / "checkpoints").exists(), f"refused after a worker saved: {err[-1]}"
    return err[-1]


def _fail(proc, what: str) -> str:
    return f"{what}: exit {proc.returncode}\n{proc.stderr[-3000:]}"


def _twin(cell: dict[str, str], hf_args: list[str], tmp: Path) -> tuple[list[float], list[dict]]:
    """The one-process twin of ``cell`` on the same global batches: plain, eager, data.batch_size × dp."""
    twin = {**cell, "layout": "single", "lifecycle": "plain", "compile": "off"}
    args = [*BASE, *pairwise.overrides(twin), *hf_args, f"data.batch_size={2 * DP[cell['layout']]}"]
    proc = run_cli(args, run_dir=tmp)
    assert proc.returncode == 0, _fail(proc, "the one-process twin")
    rows = read_metrics(tmp)
    return [r["loss"] for r in rows], rows


def run_cell(cell: dict[str, str], hf_args: list[str], tmp: Path) -> tuple[str, str]:
    """(outcome for the table, detail for the log) of one cell; an assertion error when it breaks the rule."""
    args = [*BASE, *pairwise.overrides(cell), *hf_args]
    run = tmp / "run"
    if cell["lifecycle"] == "resume":  # rank 0 SIGKILLed in step 2 after step 1's checkpoint; then resume to the end
        first = run_cli(args, run_dir=run, env=cli_env(**fault_env("kill@2:rank0")))
        line = _refused(first, run)
        if line is not None:
            return f"refused: {line}", ""
        assert first.returncode not in (0, 2), _fail(first, "SIGKILL in step 2")
        assert (run / "checkpoints" / "step-00000001").is_dir(), _fail(first, "no step-1 checkpoint before the kill")
        proc = run_cli([*args, "checkpoint.resume=auto"], run_dir=run)
        assert proc.returncode == 0, _fail(proc, "the resume")
        assert f"resumed from {run}/checkpoints/step-00000001 at step 1" in proc.stdout, proc.stdout[-2000:]
    else:
        proc = run_cli(args, run_dir=run)
        line = _refused(proc, run)
        if line is not None:
            return f"refused: {line}", ""
        assert proc.returncode == 0, _fail(proc, "the run")
    rows = read_metrics(run)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1)), [r["step"] for r in rows]
    assert json.loads((run / "summary.json").read_text())["status"] == "ok"
    outcome = {"plain": "ran", "resume": "ran, resumed", "export": "ran, exported"}[cell["lifecycle"]]
    if cell["lifecycle"] == "export":  # the run verifies the reloaded logits itself, or fails
        config = json.loads((run / "hf" / "config.json").read_text())
        assert config["model_type"] in ("qwen3", "qwen3_moe"), config
    if cell["layout"] == "single" and cell["lifecycle"] != "resume":
        return outcome, ""
    losses = [r["loss"] for r in rows]
    twin_losses, twin_rows = _twin(cell, hf_args, tmp / "twin")
    diff = max(abs(a - b) for a, b in zip(losses, twin_losses))
    tol = tolerance(cell)
    assert diff <= tol, f"losses {losses} vs the one-process twin's {twin_losses}: |diff| {diff:.2e} > {tol:.0e}"
    detail = f"max |loss - twin| {diff:.1e} (tol {tol:.0e})"
    if cell["model"] == "native_moe":  # routing statistics are all-reduced over the ranks: the twin's, step 1
        # fp32: the same routing to 1e-3; bf16 parameters (or compile) move near-tie scores, so a token or two of
        # 2 × 32 × top-2 picks another expert (measured: CV 0.3289 vs 0.3307 under fsdp bf16): 2 %
        rtol = 1e-3 if cell["precision"] == "fp32" and cell["compile"] == "off" else 2e-2
        for key in ROUTING_KEYS:
            a, b = rows[0][key], twin_rows[0][key]
            assert abs(a - b) <= rtol * max(1.0, abs(b)), f"step 1 {key} {a} vs the twin's {b} (rtol {rtol:.0e})"
        detail += f"; step-1 routing = twin's (max_load {rows[0]['moe_max_load']:.3f})"
    return f"{outcome}, = one-process twin", detail


CELLS = pairwise.covering_set() + pairwise.refusal_cells()


def header(n_cells: int, n_pairs: int) -> list[str]:
    names = list(pairwise.FACTORS)
    return ["# The pairwise matrix", "",
           "Generated by `tests/test_pairwise.py` and `tests/test_pairwise_odd.py` (`QWEN3_WRITE_PAIRWISE=1` rewrites it; they fail when it differs",
           "from what the cells did). Each cell runs the CLI for 2 steps on CPU; `tests/pairwise.py` builds the cells: a",
           "greedy all-pairs covering set, so every pair of values of two factors below meets in at least one cell that is",
           "not a known refusal; each known refusal has a cell of its own. A cell either runs (and resumes, exports, and",
           "equals its one-process twin where it has one) or is refused in one line before any worker starts.",
           "", f"{n_cells} cells, {n_pairs} pairs of values covered.", "",
           "| # | " + " | ".join(names) + " | outcome |", "|---" * (len(names) + 2) + "|"]


def row(i: int, outcome: str) -> str:
    return f"| {i} | " + " | ".join(CELLS[i][n] for n in pairwise.FACTORS) + f" | {outcome.replace('|', '/')} |"


def run_and_record(i: int, hf_dir: Path, tmp_path: Path, results: dict[int, str]) -> None:
    """Run cell ``i``; record its table outcome in ``results``; fail (after recording) when it broke the rule."""
    cell = CELLS[i]
    hf_args = [f"model.path={hf_dir}"] if cell["model"] == "hf" else []
    t0 = time.perf_counter()
    try:
        outcome, detail = run_cell(cell, hf_args, tmp_path / f"cell{i}")
    except (AssertionError, subprocess.TimeoutExpired) as e:  # a hang is a failure of this cell, not of the rest
        results[i] = "FAILED"
        raise AssertionError(f"cell {i} ({pairwise.label(cell)}): {e}") from None
    results[i] = outcome.replace(str(tmp_path), "<tmp>").replace(str(hf_dir), "<hf>")
    print(f"cell {i:2d} {time.perf_counter() - t0:6.1f}s {pairwise.label(cell)}: {results[i]} {detail}", flush=True)


def check_rows(indices: list[int], results: dict[int, str], *, with_header: bool) -> None:
    """docs/PAIRWISE.md's rows of ``indices`` (and its header) are what the cells did; QWEN3_WRITE_PAIRWISE=1
    rewrites them (under a lock: the other half may write its rows at the same time)."""
    missing = [i for i in indices if i not in results]
    if missing:
        pytest.skip(f"cells {missing} did not run here (deselected): the table is not checked")
    n_pairs = pairwise.pairs_covered(pairwise.covering_set())
    want_head = header(len(CELLS), n_pairs)
    with filelock.FileLock(str(TABLE) + ".lock"):
        lines = TABLE.read_text().splitlines() if TABLE.exists() else []
        rows = {int(ln.split("|")[1]): ln for ln in lines if ln.startswith("| ") and ln.split("|")[1].strip().isdigit()}
        if os.environ.get("QWEN3_WRITE_PAIRWISE"):
            rows.update({i: row(i, results[i]) for i in indices})
            rows = {i: r for i, r in rows.items() if i < len(CELLS)}
            TABLE.write_text("\n".join([*want_head, *(rows[i] for i in sorted(rows))]) + "\n")
            lines = TABLE.read_text().splitlines()
    got_head = lines[:len(want_head)]
    if with_header:
        assert got_head == want_head, ("docs/PAIRWISE.md's header differs from the cells (rewrite it with "
                                       "QWEN3_WRITE_PAIRWISE=1):\n" + "\n".join(want_head))
    differ = [(rows.get(i), row(i, results[i])) for i in indices if rows.get(i) != row(i, results[i])]
    assert not differ, ("docs/PAIRWISE.md differs from what the cells did; if the change is meant, rewrite it with "
                        "QWEN3_WRITE_PAIRWISE=1:\n" + "\n".join(f"table: {a}\nran:   {b}" for a, b in differ))


