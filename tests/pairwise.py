"""An all-pairs covering set over the config space (issue 33, deliver 4), and the table of its outcomes.

Every failure the adversarial rounds found sat where two features meet (document masking × tp, the planner ×
ep, export × the checkpoint it reads, ...). Testing every combination is out of reach (5 × 3 × 2 × 2 × 3 × 2 × 3
× 2 × 2 × 2 × 2 = 17,280 cells); every *pair* of option values is not: a greedy covering set (AETG's idea, made
deterministic) holds each pair of values of two factors in at least one cell, in a few dozen cells.

``FACTORS`` is the space: each factor's values and the overrides each adds. ``REFUSED`` names the combinations
known to be refused on a CPU host (each one line before any worker starts): they are kept out of the covering set
so that every *valid* pair is covered by a cell that runs, and each gets a refusal cell of its own
(``refusal_cells``). ``python -m tests.pairwise`` prints the cells.
"""

from __future__ import annotations

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
    "masking": {"off": [], "on": ["data.document_masking=true"]},
    "lifecycle": {  # resume: SIGKILL in step 2, then checkpoint.resume=auto; export: HF export at the end
        "plain": [],
        "resume": ["checkpoint.enable=true", "checkpoint.every=1"],
        "export": ["checkpoint.enable=true", "checkpoint.export_hf=true"],
    },
    "eval": {"off": ["training.eval_every=0"], "on": ["training.eval_every=2", "training.eval_batches=1"]},
    "grad_accum": {"1": [], "2": ["training.grad_accum=2"]},
    "compile": {"off": ["compile.enable=false"], "on": ["compile.enable=true"]},
    "attention": {"sdpa": [], "flex": ["model.attention=flex"]},
}


def _refusal(cell: dict[str, str]) -> str | None:
    """Why a (partial) cell is a known refusal on a CPU host, or None."""
    if cell.get("attention") == "flex":
        return "FlexAttention has no backward on CPU: model.attention=flex needs device=cuda"
    if cell.get("layout") == "ep2" and cell.get("model", "native_moe") != "native_moe":
        return "parallelism.ep=2 needs a MoE model (model=native_moe)"
    if (cell.get("compile") == "on" and cell.get("layout", "tp2").startswith("tp")
            and cell.get("model", "hf") in ("hf", "native_moe")):
        return "compile.enable=true with tp: per-block compile fails in the first backward for MoE and hf models"
    if cell.get("model") == "hf" and cell.get("kernels") in ("fast", "reference"):
        return "a kernel option that matches no module is refused (issue 40): model=hf has no CosSinRoPE/GroupedExperts"
    return None


REFUSED = [  # one cell per known refusal, the rest of the cell at the first value of each factor
    {"attention": "flex"},
    {"layout": "ep2", "model": "native"},
    {"layout": "tp2", "model": "native_moe", "compile": "on"},
    {"layout": "tp2_nosp", "model": "hf", "compile": "on"},
    {"model": "hf", "kernels": "fast"},
]


def _pairs(cell: dict[str, str]) -> set[tuple[str, str, str, str]]:
    items = sorted(cell.items())
    return {(a, va, b, vb) for (a, va), (b, vb) in combinations(items, 2)}


def covering_set(factors: dict[str, dict[str, list[str]]] = FACTORS) -> list[dict[str, str]]:
    """A deterministic greedy all-pairs covering set of the combinations ``_refusal`` allows."""
    names = list(factors)
    uncovered = {p for a, b in combinations(sorted(names), 2) for va in factors[a] for vb in factors[b]
                 for p in [(a, va, b, vb)] if _refusal({a: va, b: vb}) is None}
    cells: list[dict[str, str]] = []
    while uncovered:
        a, va, b, vb = min(uncovered)  # the first uncovered pair seeds the cell
        cell = {a: va, b: vb}
        for f in names:  # then each other factor takes the allowed value that covers the most new pairs
            if f in cell:
                continue
            best, gain = None, -1
            for v in factors[f]:
                trial = {**cell, f: v}
                if _refusal(trial) is not None:
                    continue
                g = len(_pairs(trial) & uncovered)
                if g > gain:
                    best, gain = v, g
            cell[f] = best
        cells.append({f: cell[f] for f in names})
        uncovered -= _pairs(cell)
    return cells


def refusal_cells(factors: dict[str, dict[str, list[str]]] = FACTORS) -> list[dict[str, str]]:
    return [{f: part.get(f, next(iter(factors[f]))) for f in factors} for part in REFUSED]


def pairs_covered(cells: list[dict[str, str]]) -> int:
    return len(set().union(*(_pairs(c) for c in cells))) if cells else 0


def overrides(cell: dict[str, str], factors: dict[str, dict[str, list[str]]] = FACTORS) -> list[str]:
    return [o for f, v in cell.items() for o in factors[f][v]]


def label(cell: dict[str, str]) -> str:
    return " ".join(f"{f}={v}" for f, v in cell.items())


if __name__ == "__main__":
    cells = covering_set()
    for i, c in enumerate(cells):
        print(f"{i:2d} {label(c)}")
    print(f"{len(cells)} cells cover {pairs_covered(cells)} pairs; {len(refusal_cells())} refusal cells")
