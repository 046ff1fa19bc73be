"""docs/FEATURES.md's table: features (rows) × torchtitan API (columns), written from the tests that show them.

A test declares the row it shows with ``@pytest.mark.feature("<row>")``, or ``refused="<the one line>"`` when it
checks that the API refuses the feature in one line. The column is where the test runs: every test file runs in the
main environment (torchtitan 0.3.x); tests/test_tt022.py also runs in the tt022 one (upstream torchtitan 0.2.2, the
base of AWS's torchtitan-neuron 0.2.2+neuron.1), where its tests marked ``@only_on_legacy(...)`` run only (they
are skipped on 0.3.x, whose main-suite tests cover them). The markers are read from the test files' source (``ast``, no import), so
either environment writes the whole table, and removing or unmarking a test removes its ✔ (the page check in
tests/test_tt022.py then fails until the page is regenerated): a cell says what a test shows, never what was meant.

    python -m tests.feature_table            # print the table
    python -m tests.feature_table --write    # replace docs/FEATURES.md's table with it
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "FEATURES.md"  # README links to it (issue 39: README keeps the first five minutes)
BEGIN, END = "<!-- feature-table:begin (python -m tests.feature_table --write) -->", "<!-- feature-table:end -->"

APIS = ("0.3.x", "0.2.x")
HEADER = ("torchtitan 0.3.x", "torchtitan 0.2.x (AWS's torchtitan-neuron base)")
TT022_FILE = "test_tt022.py"
# Row order; a marker naming a row not listed here is an error (a typo would otherwise add a row).
ROWS = (
    "FSDP (parallelism.dp_shard)",
    "tensor parallel + sequence parallel",
    "tensor parallel without sequence parallel",
    "MoE (model=native_moe) on CPU",
    "expert parallel (parallelism.ep)",
    "pipeline parallel (parallelism.pp)",
    "MoE balance: auxiliary loss",
    "MoE balance: expert bias",
    "routing statistics",
    "chunked loss (training.loss=chunked)",
    "document masking (data.document_masking)",
    "FlexAttention with a BlockMask (forward on CPU)",
    "checkpoint resume after SIGKILL",
    "asynchronous checkpoints (checkpoint.async_mode)",
    "activation checkpointing",
    "HF import (model.init_from)",
    "CPU kernels (kernels=fast)",
)
NOT_SHOWN = "— (no test)"


def _feature_marks(node: ast.FunctionDef):
    """(row, refusal or None) for every ``pytest.mark.feature(...)`` decorator of a test function."""
    for dec in node.decorator_list:
        if (isinstance(dec, ast.Call) and isinstance(dec.func, ast.Attribute) and dec.func.attr == "feature"
                and ast.unparse(dec.func.value) == "pytest.mark"):
            refused = next((ast.literal_eval(k.value) for k in dec.keywords if k.arg == "refused"), None)
            yield ast.literal_eval(dec.args[0]), refused


def _apis(filename: str, node: ast.FunctionDef) -> tuple[str, ...]:
    if filename != TT022_FILE:
        return ("0.3.x",)
    legacy_only = any(isinstance(d, ast.Call) and ast.unparse(d.func) == "only_on_legacy" for d in node.decorator_list)
    return ("0.2.x",) if legacy_only else APIS


def collect(tests_dir: Path = ROOT / "tests") -> dict[tuple[str, str], dict]:
    """{(row, api): {"tests": [file::test, ...], "refused": line or None}} from every tests/test_*.py."""
    cells: dict[tuple[str, str], dict] = {}
    for path in sorted(tests_dir.glob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.FunctionDef) or not node.name.startswith("test_"):
                continue
            for row, refused in _feature_marks(node):
                if row not in ROWS:
                    raise ValueError(f"{path.name}::{node.name}: feature {row!r} is not a row of tests/feature_table.py")
                for api in _apis(path.name, node):
                    cell = cells.setdefault((row, api), {"tests": [], "refused": None})
                    cell["tests"].append(f"{path.name}::{node.name}")
                    if refused:
                        cell["refused"] = refused
    return cells


def table(cells: dict | None = None) -> str:
    cells = collect() if cells is None else cells
    lines = ["| feature | " + " | ".join(HEADER) + " |", "|---|" + "---|" * len(APIS)]
    for row in ROWS:
        marks = []
        for api in APIS:
            cell = cells.get((row, api))
            marks.append(NOT_SHOWN if cell is None else f"refused: {cell['refused']}" if cell["refused"] else "✔")
        lines.append(f"| {row} | " + " | ".join(marks) + " |")
    return "\n".join(lines)


def page_table(text: str | None = None) -> str:
    """The table between the page's markers."""
    text = PAGE.read_text() if text is None else text
    return text.split(BEGIN, 1)[1].split(END, 1)[0].strip()


def write() -> None:
    text = PAGE.read_text()
    head, rest = text.split(BEGIN, 1)
    PAGE.write_text(f"{head}{BEGIN}\n{table()}\n{END}{rest.split(END, 1)[1]}")


if __name__ == "__main__":
    write() if "--write" in sys.argv[1:] else print(table())
