"""Half of the pairwise matrix's cells (tests/pairwise_run.py says what a cell must do and how the cells are split;
docs/PAIRWISE.md is the table). The matrix is split in two files so that the two pytest workers each run half of it."""

from __future__ import annotations

import pytest

from tests.pairwise_run import check_rows, half, hf_dir, run_and_record  # noqa: F401 (hf_dir: a fixture)

pytestmark = pytest.mark.slow

MINE = half(0)
RESULTS: dict[int, str] = {}  # cell -> its table outcome, as the cells of this file run


@pytest.mark.parametrize("i", MINE)
def test_cell_runs_or_is_refused_before_it_starts(i, hf_dir, tmp_path):
    run_and_record(i, hf_dir, tmp_path, RESULTS)


def test_the_table_rows_are_what_the_cells_did():
    check_rows(MINE, RESULTS, with_header=True)
