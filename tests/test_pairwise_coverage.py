"""The pairwise matrix proves its own coverage (issue 40, deliver 2): docs/PAIRWISE.md's rows are recounted here,
independently of the generator in tests/pairwise.py. Valid pairs come from the refusal rules alone, by brute force
over every combination of the factors; covered pairs from the table's cells that ran. Any valid pair no running cell
holds fails the test, by name. Seconds, no CLI run."""

from __future__ import annotations

import functools
import itertools

from tests import pairwise
from tests.pairwise_run import TABLE


def _table_cells() -> list[tuple[dict[str, str], str]]:
    names = list(pairwise.FACTORS)
    out = []
    for ln in TABLE.read_text().splitlines():
        cols = [c.strip() for c in ln.split("|")[1:-1]]
        if len(cols) == len(names) + 2 and cols[0].isdigit():
            out.append((dict(zip(names, cols[1:-1])), cols[-1]))
    return out


@functools.cache
def _valid_pairs_by_brute_force() -> set[tuple[str, str, str, str]]:
    """Not pairwise.valid_pairs: the same definition, written again over the raw rules."""
    names = list(pairwise.FACTORS)
    order = sorted(names)
    rules = [[(names.index(f), vals) for f, vals in cond.items()] for cond, _ in pairwise.RULES]
    idx = [(names.index(a), names.index(b), a, b) for a, b in itertools.combinations(order, 2)]
    valid: set = set()
    for combo in itertools.product(*(list(pairwise.FACTORS[f]) for f in names)):
        if any(all(combo[i] in vals for i, vals in rule) for rule in rules):
            continue
        valid.update([(a, combo[i], b, combo[j]) for i, j, a, b in idx])
    return valid


def test_every_valid_pair_meets_in_a_cell_that_ran():
    cells = _table_cells()
    assert cells, f"no cells in {TABLE}"
    ran = [c for c, outcome in cells if outcome.startswith("ran")]
    refused = [(c, outcome) for c, outcome in cells if outcome.startswith("refused")]
    assert len(ran) + len(refused) == len(cells), [o for _, o in cells if not o.startswith(("ran", "refused"))]
    valid = _valid_pairs_by_brute_force()
    names = sorted(pairwise.FACTORS)
    covered = {(a, c[a], b, c[b]) for c in ran for a, b in itertools.combinations(names, 2)}
    uncovered = sorted(valid - covered)
    print(f"{len(valid)} valid pairs, {len(valid & covered)} covered by {len(ran)} running cells, "
          f"{len(uncovered)} uncovered; {len(refused)} refusal cells")
    assert not uncovered, f"valid pairs no running cell holds: {uncovered}"
    # A running cell is a valid combination, and each rule's refusal cell was refused: the rules are what the CLI does.
    for c in ran:
        assert pairwise.refusal(c) is None, f"a cell that ran matches a refusal rule: {c}"
    assert len(refused) == len(pairwise.RULES)
    for (c, _), (cond, _) in zip(refused, pairwise.RULES):
        assert all(c[f] in vals for f, vals in cond.items()), (c, cond)


def test_the_recount_sees_a_missing_pair():
    """The control: drop the one running cell that holds a pair no other cell holds, and the recount names it."""
    cells = [c for c, outcome in _table_cells() if outcome.startswith("ran")]
    names = sorted(pairwise.FACTORS)
    pairs = [{(a, c[a], b, c[b]) for a, b in itertools.combinations(names, 2)} for c in cells]
    for i, mine in enumerate(pairs):
        others = set().union(*(p for j, p in enumerate(pairs) if j != i))
        if mine - others:
            assert (mine - others) & _valid_pairs_by_brute_force()
            return
    raise AssertionError("every running cell is redundant: the covering set is not minimal anywhere")
