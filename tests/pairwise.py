"""An all-pairs covering set over the config space (issue 33, deliver 4; issue 40, deliver 2), and the table of its
outcomes.

Every failure the adversarial rounds found sat where two features meet (document masking × tp, the planner × ep,
export × the checkpoint it reads, ...). Testing every combination is out of reach (``n_combinations()``: tens of
thousands of cells); every *pair* of option values is not: a greedy covering set (AETG's idea, made deterministic)
holds each valid pair of values of two factors in at least one cell, in about twenty cells.

``FACTORS`` is the space: each factor's values and the overrides each adds. ``RULES`` are the combinations known
to be refused on a CPU host (each one line before any worker starts), as conditions on a few factors. A combination
is valid when no rule matches it; a *pair* is valid when some valid combination holds it (``valid_pairs`` counts
them by brute force over every combination, independently of the generator). The covering set holds only valid
combinations, so every valid pair meets in a cell that runs; each rule gets a refusal cell of its own
(``refusal_cells``).

The generator weighs each cell by what it costs to run (``cell_cost``: ranks, a one-process twin, a kill and a
resume, bf16 on a CPU without bf16 units, a compile), so that the pairs are covered by cheap cells where a cheap cell
can hold them: CI time is the budget this matrix spends. ``python -m tests.pairwise`` prints the cells.
"""

from __future__ import annotations

import functools
import itertools
import random
from itertools import combinations

FACTORS: dict[str, dict[str, list[str]]] = {
    "layout": {
        "single": [],
        "fsdp": ["parallelism=fsdp"],
        "tp2": ["parallelism=tp2"],
        "tp2_nosp": ["parallelism=tp2", "parallelism.sequence_parallel=false"],
        "ep2": ["parallelism=ep2"],
    },
    "model": {"native": [], "native_moe": ["model=native_moe"], "hf": ["model=hf"]},  # hf: model.path set by the test
    "precision": {"fp32": ["training.mixed_precision=none"], "bf16": ["training.mixed_precision=bf16"]},
    "loss": {"full": ["training.loss=full"], "chunked": ["training.loss=chunked"]},
    "kernels": {"none": [], "fast": ["kernels=fast", "kernels.force=true"], "reference": ["kernels=reference"]},
    "masking": {"off": ["data.document_masking=false"], "on": ["data.document_masking=true"]},
    "lifecycle": {  # resume: SIGKILL in step 2, then checkpoint.resume=auto; export: HF export at the end
        "plain": [],
        "resume": ["checkpoint.enable=true", "checkpoint.every=1"],
        "export": ["checkpoint.enable=true", "checkpoint.export_hf=true"],
    },
    "eval": {"off": ["training.eval_every=0"], "on": ["training.eval_every=2", "training.eval_batches=1"]},
    "grad_accum": {"1": [], "2": ["training.grad_accum=2"]},
    "compile": {"off": ["compile.enable=false"], "on": ["compile.enable=true"]},
    "attention": {"sdpa": [], "flex": ["model.attention=flex"]},
    # issue 41: conversations (the default chitchat corpus, 64 of them, rendered with the run's tokenizer's chat
    # template, the loss on the assistant's turns, packed one per document; packed = padded per conversation is
    # tests/test_chat.py's); LoRA adapters (PEFT's, rank 16 on every attention and MLP projection) on a frozen base
    "data": {"text": [], "chat": ["data=chat", "data.max_documents=64", "data.seq_len=128"]},
    "lora": {"off": [], "on": ["model.lora.enable=true"]},
}

# (condition, why): a combination is refused when, for every factor the condition names, its value is one of those
# listed. Each is one line before any worker starts (the refusal cells show the line).
RULES: list[tuple[dict[str, set[str]], str]] = [
    ({"attention": {"flex"}}, "FlexAttention has no backward on CPU: model.attention=flex needs device=cuda"),
    ({"layout": {"ep2"}, "model": {"native", "hf"}}, "parallelism.ep=2 needs a MoE model (model=native_moe)"),
    ({"compile": {"on"}, "layout": {"tp2", "tp2_nosp"}, "model": {"hf", "native_moe"}},
     "compile.enable=true with tp: per-block compile fails in the first backward for MoE and hf models"),
    ({"model": {"hf"}, "kernels": {"fast", "reference"}},
     "a kernel option that matches no module is refused (issue 40): model=hf has no CosSinRoPE/GroupedExperts"),
    ({"data": {"chat"}, "masking": {"off"}},
     "data.packing=true needs data.document_masking=true with data=chat: packed conversations would attend to each other"),
    ({"lora": {"on"}, "layout": {"tp2", "tp2_nosp"}, "model": {"native", "native_moe"}},
     "model.lora.enable=true with parallelism.tp=2 on torchtitan's models: the adapters have no TP plan there yet"),
    ({"lora": {"on"}, "lifecycle": {"export"}, "model": {"native", "native_moe"}},
     "LoRA's export is a PEFT adapter for the base's Hugging Face checkpoint: a seeded native base has none"),
]

# Where the 2-step runs of this matrix spend their time, relative to a one-process fp32 eager run (measured on the
# 2-core CI host: a 2-rank run ~2x, a kill + resume ~2x, bf16 on a CPU without bf16 units ~1.5x, a first compile ~3x).
COST = {
    "layout": {"single": 1.0, "fsdp": 2.0, "tp2": 2.0, "tp2_nosp": 2.0, "ep2": 2.3},
    "model": {"native": 1.0, "native_moe": 1.3, "hf": 1.2},
    "precision": {"fp32": 1.0, "bf16": 1.5},
    "lifecycle": {"plain": 1.0, "resume": 2.0, "export": 1.4},
    "compile": {"off": 1.0, "on": 3.0},
    "data": {"text": 1.0, "chat": 2.0},  # 4x the tokens per window (seq 128), and the rendering
}
# The factors this round's failures lived in (issue 40): the generator prefers cells that also cover their triples.
TRIPLE_FACTORS = ("layout", "precision", "model", "lifecycle")


def refusal(cell: dict[str, str]) -> str | None:
    """Why a combination (every factor set) is refused on a CPU host, or None when it runs."""
    for cond, why in RULES:
        if all(cell.get(f) in vals for f, vals in cond.items()):
            return why
    return None


def _completable(partial: dict[str, str], factors: dict[str, dict[str, list[str]]]) -> bool:
    """Some valid combination extends ``partial``: only the unset factors that a rule names can matter."""
    free = sorted({f for cond, _ in RULES for f in cond if f not in partial})
    # every factor a rule names is set in each trial, so refusal() decides it as for a whole combination
    return any(refusal({**partial, **dict(zip(free, values))}) is None
               for values in itertools.product(*(list(factors[f]) for f in free)))


def _pairs(cell: dict[str, str]) -> set[tuple[str, str, str, str]]:
    items = sorted(cell.items())
    return {(a, va, b, vb) for (a, va), (b, vb) in combinations(items, 2)}


def _triples(cell: dict[str, str]) -> set[tuple]:
    return {tuple((f, cell[f]) for f in fs) for fs in combinations(TRIPLE_FACTORS, 3)}


def n_combinations(factors: dict[str, dict[str, list[str]]] = FACTORS) -> int:
    n = 1
    for values in factors.values():
        n *= len(values)
    return n


@functools.cache
def _valid_combinations() -> tuple[tuple[str, ...], ...]:
    names = list(FACTORS)
    return tuple(c for c in itertools.product(*(list(FACTORS[f]) for f in names))
                 if refusal(dict(zip(names, c))) is None)


def valid_pairs() -> set[tuple[str, str, str, str]]:
    """Every pair of values of two factors that some valid combination holds: brute force over all combinations."""
    names = list(FACTORS)
    out: set = set()
    for c in _valid_combinations():
        out |= _pairs(dict(zip(names, c)))
    return out


def valid_triples() -> set[tuple]:
    """The valid value triples of three of ``TRIPLE_FACTORS``, by the same brute force."""
    names = list(FACTORS)
    out: set = set()
    for c in _valid_combinations():
        out |= _triples(dict(zip(names, c)))
    return out


def cell_cost(cell: dict[str, str]) -> float:
    """Estimated CPU seconds of a cell, in one-process 2-step runs: the cell's run(s), and its one-process twin unless
    the cell is its own twin."""
    run = 1.0
    for f, costs in COST.items():
        run *= costs[cell[f]]
    reference = {"layout": "single", "lifecycle": "plain", "compile": "off", "loss": "full", "kernels": "none",
                 "grad_accum": "1"}  # tests/pairwise_run.REFERENCE: what a twin changes
    twin = 0.0 if all(cell[f] == v for f, v in reference.items()) else \
        COST["model"][cell["model"]] * COST["precision"][cell["precision"]]
    return run + twin


# The generator's knobs, chosen by ``python -m tests.pairwise --search`` (the cheapest full cover it found).
ALPHA, SEED = 0.5, 49


def covering_set(factors: dict[str, dict[str, list[str]]] = FACTORS, *, alpha: float | None = None,
                 seed: int | None = None) -> list[dict[str, str]]:
    """A deterministic greedy all-pairs covering set of valid combinations, cheap cells preferred.

    Each round builds candidate cells, each seeded by an uncovered pair and completed factor by factor (in a seeded
    random order) with the value that covers the most new pairs (then the most new triples of ``TRIPLE_FACTORS``,
    then the cheaper value), among the values that keep the cell completable to a valid combination; the candidate
    with the most new pairs per unit of cost (cost ** ``alpha``) joins the set. Cells whose pairs the others hold
    are then dropped, the most expensive first."""
    alpha = ALPHA if alpha is None else alpha
    names = list(factors)
    rng = random.Random(SEED if seed is None else seed)
    uncovered = set(valid_pairs()) if factors is FACTORS else {
        p for a, b in combinations(sorted(names), 2) for va in factors[a] for vb in factors[b]
        for p in [(a, va, b, vb)] if _completable({a: va, b: vb}, factors)}
    triples_left = valid_triples() if factors is FACTORS else set()
    cells: list[dict[str, str]] = []
    while uncovered:
        seeds = sorted(uncovered)
        if len(seeds) > 40:
            seeds = [seeds[0], *rng.sample(seeds[1:], 39)]
        best, best_score = None, -1.0
        for (a, va, b, vb), cheap in itertools.product(seeds, (False, True)):
            cell = {a: va, b: vb}
            order = [f for f in names if f not in cell]
            rng.shuffle(order)
            for f in order:
                options = []
                for v in factors[f]:
                    trial = {**cell, f: v}
                    if not _completable(trial, factors):
                        continue
                    gain = len(_pairs(trial) & uncovered)
                    cost = COST.get(f, {}).get(v, 1.0)
                    # greedy: the most new pairs; cheap: the cheapest value that covers a new pair, else the cheapest
                    key = ((-min(gain, 1), cost, -gain) if cheap else (-gain, cost)) + (
                        -len(_triples_of(trial) & triples_left), list(factors[f]).index(v))
                    options.append((key, v))
                cell[f] = min(options)[1]
            full = {f: cell[f] for f in names}
            assert refusal(full) is None, full
            score = len(_pairs(full) & uncovered) / cell_cost(full) ** alpha
            if score > best_score:
                best, best_score = full, score
        cells.append(best)
        uncovered -= _pairs(best)
        triples_left -= _triples_of(best)
    for cell in sorted(cells, key=cell_cost, reverse=True):
        rest = [c for c in cells if c is not cell]
        if rest and _pairs(cell) <= set().union(*(_pairs(c) for c in rest)):
            cells = rest
    return cells


def _triples_of(partial: dict[str, str]) -> set[tuple]:
    return {tuple((f, partial[f]) for f in fs) for fs in combinations(TRIPLE_FACTORS, 3)
            if all(f in partial for f in fs)}


def refusal_cells(factors: dict[str, dict[str, list[str]]] = FACTORS) -> list[dict[str, str]]:
    """One cell per rule: the rule's first values, every other factor at its first value."""
    cells = []
    for cond, _ in RULES:
        cell = {f: (sorted(cond[f], key=list(factors[f]).index)[0] if f in cond else next(iter(factors[f])))
                for f in factors}
        assert refusal(cell) is not None, cell
        cells.append(cell)
    return cells


def pairs_covered(cells: list[dict[str, str]]) -> int:
    return len(set().union(*(_pairs(c) for c in cells))) if cells else 0


def overrides(cell: dict[str, str], factors: dict[str, dict[str, list[str]]] = FACTORS) -> list[str]:
    return [o for f, v in cell.items() for o in factors[f][v]]


def label(cell: dict[str, str]) -> str:
    return " ".join(f"{f}={v}" for f, v in cell.items())


if __name__ == "__main__":
    import sys
    import time

    if "--search" in sys.argv:
        tried = []
        for a in (0.0, 0.5, 1.0, 1.5):
            for sd in range(40, 52):
                cs = covering_set(alpha=a, seed=sd)
                tried.append((sum(map(cell_cost, cs)), len(cs), a, sd))
                print(f"alpha {a} seed {sd}: {len(cs)} cells, cost {tried[-1][0]:.1f}", flush=True)
        print("cheapest:", min(tried))
        raise SystemExit
    t0 = time.perf_counter()
    cells = covering_set()
    for i, c in enumerate(cells):
        print(f"{i:2d} cost {cell_cost(c):5.1f}  {label(c)}")
    trip = set().union(*(_triples(c) for c in cells))
    print(f"{len(cells)} cells (cost {sum(map(cell_cost, cells)):.1f}) cover {pairs_covered(cells)} of "
          f"{len(valid_pairs())} valid pairs and {len(trip & valid_triples())} of {len(valid_triples())} valid "
          f"{'×'.join(TRIPLE_FACTORS)} triples; {len(refusal_cells())} refusal cells; {n_combinations()} combinations; "
          f"{time.perf_counter() - t0:.1f} s")
