"""Compare runs: a table (terminal, CSV, Markdown) and PNG plots from run directories.

A sweep of two keys also gets a heatmap of tokens/s, MFU and peak memory per rank (the plan's prediction beside
the measured peak; skipped, failed and not-run points marked) and ``sweep_points.csv``; the last line names the
best point by tokens/s that fit.

``python -m qwen3_research.compare <sweep dir | run dir ...> [--out DIR]``; a multirun sweep
ends with the same report in its sweep directory (``SweepReport`` callback).
Numbers come from each run's own ``metrics.jsonl`` and ``summary.json``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from qwen3_research import startup

if __name__ == "__main__":  # Ctrl-C / SIGTERM while the report's modules import: 128+signal, one line
    startup.exit_at_once_while_importing("; the report may be incomplete")

from qwen3_research.report import EXIT_SOME_FAILED, best_point_line, report, sweep_points  # noqa: E402


def default_out(paths: list[Path]) -> Path:
    """A sweep directory holds its own report; run directories get ``comparison/`` beside them, in the deepest
    folder that holds them all (it was ./comparison: wherever the command happened to run)."""
    if len(paths) == 1 and not (paths[0] / ".hydra").is_dir():
        return paths[0]
    parents = [p.resolve().parent for p in paths]
    common = parents[0]
    while not all(common == q or common in q.parents for q in parents):
        common = common.parent
    return common / "comparison"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m qwen3_research.compare", description=__doc__.splitlines()[0])
    ap.add_argument("paths", nargs="+", type=Path, help="a sweep directory, or run directories")
    ap.add_argument("--out", type=Path, default=None,
                    help="where to write the report (default: the sweep dir; for run dirs, comparison/ in the "
                         "folder that holds them, never the working directory)")
    args = ap.parse_args(argv)
    unique: dict[Path, Path] = {}
    for p in args.paths:  # each directory once, in the order given (`compare D D` counted every run twice)
        unique.setdefault(p.resolve(), p)
    args.paths = list(unique.values())
    startup.quiet_libraries()  # matplotlib's warnings as one line each
    missing = [str(p) for p in args.paths if not p.is_dir()]
    if missing:
        print(f"compare: not a directory: {', '.join(missing)}", file=sys.stderr)
        return 2
    out = args.out or default_out(args.paths)
    runs = report(args.paths, out)
    print(best_point_line(runs, sweep_points(runs, args.paths)))
    return EXIT_SOME_FAILED if any(r.status != "ok" for r in runs) else 0


if __name__ == "__main__":
    sys.exit(startup.run_tool(main, "the report may be incomplete"))
