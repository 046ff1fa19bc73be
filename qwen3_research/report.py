"""The comparison of runs: a table (terminal, CSV, Markdown) and PNG plots from run directories (``report``).

Numbers come from each run's own ``metrics.jsonl`` and ``summary.json``. The command is
``python -m qwen3_research.compare``; a multirun sweep ends with the same report in its sweep directory
(``qwen3_research.launch.sweep.SweepReport``).
"""

from __future__ import annotations

import csv
import json
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from qwen3_research import overrides, tables
EXIT_SOME_FAILED = 3  # a sweep finished, but at least one point failed
# The status of a sweep point that was not started because another point runs the same run (launch/repeats.py):
# its summary.json names that point (``same_as``) and why the keys it differs in change nothing.
DUPLICATE = "duplicate"


@dataclass
class RunRecord:
    run_dir: Path
    name: str
    overrides: dict[str, str]
    status: str
    reason: str = ""
    rows: list[dict] = field(default_factory=list)
    summary: dict = field(default_factory=dict)

    @property
    def train_rows(self) -> list[dict]:
        return [r for r in self.rows if r.get("loss") is not None]

    def final_loss(self) -> float | None:
        """The last training loss of a finished run; None for a point that did not finish (interrupted,
        failed, skipped): its last loss is not a final one and must not be compared as if it were."""
        rows = self.train_rows
        return rows[-1]["loss"] if rows and self.status == "ok" else None

    def steps_reached(self) -> str | None:
        """'reached/planned' steps, e.g. '4/8' for a point interrupted after step 4; None for a duplicate (its
        steps are the other point's)."""
        if self.status == DUPLICATE:
            return None
        done = self.summary.get("steps") or self.summary.get("step") or max((r.get("step", 0) for r in self.rows), default=0)
        planned = self.planned_steps()
        return f"{done}/{planned}" if planned else (str(done) if done else None)

    def planned_steps(self) -> int | None:
        path = self.run_dir / ".hydra" / "config.yaml"
        try:
            return int(OmegaConf.select(OmegaConf.load(path), "training.steps", throw_on_missing=True))
        except (OSError, ValueError, TypeError, OmegaConfBaseException, yaml.YAMLError):
            return None

    def best_eval_loss(self) -> float | None:
        evals = [r["eval_loss"] for r in self.rows if r.get("eval_loss") is not None]
        return min(evals) if evals else None

    def _steady(self, key: str) -> float | None:
        # Step 1 carries compile / warm-up time; report the steady state when there is one.
        rows = [r for r in self.train_rows if not r.get("first_step")] or self.train_rows
        values = [r[key] for r in rows if r.get(key) is not None]
        return statistics.median(values) if values else None

    def tokens_per_s(self) -> float | None:
        return self._steady("tokens_per_s")

    def mfu(self) -> float | None:
        return self._steady("mfu")

    def peak_mem_per_rank(self) -> dict[int, float]:
        peaks: dict[int, float] = {}
        for r in self.train_rows:
            for m in r.get("mem_per_rank") or []:
                peaks[m["rank"]] = max(peaks.get(m["rank"], 0.0), m["peak_gib"])
        return peaks


def _read_overrides(run_dir: Path) -> dict[str, str]:
    """The run's own overrides (Hydra's ``.hydra/overrides.yaml``), key -> value as typed."""
    path = run_dir / ".hydra" / "overrides.yaml"
    if not path.is_file():
        return {}
    return overrides.point_values(OmegaConf.to_container(OmegaConf.load(path), resolve=False) or [])  # as written


def read_metrics(path: Path) -> tuple[list[dict], str | None]:
    """metrics.jsonl's records, and what is wrong with the file (None: nothing). A last line that is not JSON
    was cut short by a killed run and is left out; any other line must be a UTF-8 JSON object with a step."""
    lines = path.read_bytes().splitlines()
    rows = []
    for i, raw in enumerate(lines):
        if not raw.strip():
            continue
        try:
            row = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError as e:
            return rows, f"{path} line {i + 1} is not UTF-8 text (byte {raw[e.start]:#04x} at column {e.start + 1})"
        except json.JSONDecodeError as e:
            if i == len(lines) - 1:
                break  # cut by a kill
            return rows, f"{path} line {i + 1} is not JSON ({e.msg}, column {e.colno})"
        if not isinstance(row, dict) or not isinstance(row.get("step"), int):
            return rows, f"{path} line {i + 1} is not a metrics record (a JSON object with an integer step)"
        rows.append(row)
    return rows, None


def load_run(run_dir: Path) -> RunRecord:
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    metrics = run_dir / "metrics.jsonl"
    rows, problem = read_metrics(metrics) if metrics.is_file() else ([], None)
    status = summary.get("status") or ("running or killed" if rows else "no result")
    reason = summary.get("reason", "")
    last = max((r["step"] for r in rows), default=0)  # the last step is always logged
    if problem is None and status == "ok" and isinstance(summary.get("steps"), int) and last < summary["steps"]:
        problem = (f"{metrics} ends at step {last} but summary.json has {summary['steps']} steps (a truncated or "
                   "replaced file): its last loss is not the run's final loss")
    if problem is not None:  # never "ok" beside numbers the file cannot back
        print(f"warning: {problem}; {run_dir.name} is reported as unreadable", file=sys.stderr, flush=True)
        status, reason = "unreadable", problem
    return RunRecord(run_dir, run_dir.name, _read_overrides(run_dir), status, reason, rows, summary)


def find_runs(paths: list[Path]) -> list[RunRecord]:
    """The runs under ``paths``, each once: ``compare D D`` (or a sweep dir and one of its runs) counted every run
    twice, in the table, the tally and the plots."""
    run_dirs: dict[Path, Path] = {}  # resolved -> as given
    for p in paths:
        if (p / ".hydra").is_dir() or (p / "summary.json").is_file():
            run_dirs.setdefault(p.resolve(), p)
        else:
            subdirs = sorted((d for d in p.iterdir() if d.is_dir() and ((d / ".hydra").is_dir() or (d / "summary.json").is_file())),
                             key=lambda d: (int(d.name.split("_")[0]) if d.name.split("_")[0].isdigit() else 1 << 30, d.name))
            for d in subdirs:
                run_dirs.setdefault(d.resolve(), d)
    return [load_run(d) for d in run_dirs.values()]


def swept_keys(runs: list[RunRecord]) -> list[str]:
    keys: list[str] = []
    for r in runs:
        for k in r.overrides:
            if k not in keys:
                keys.append(k)
    if len(runs) > 1:
        keys = [k for k in keys if len({r.overrides.get(k) for r in runs}) > 1]
    return keys


def table(runs: list[RunRecord]) -> tuple[list[str], list[list[Any]]]:
    keys = swept_keys(runs)
    header = ["run", *keys, "steps", "final_loss", "best_eval_loss", "tokens_per_s", "mfu", "peak_mem_gib_per_rank",
              "predicted_peak_gib", "measured_live_peak_gib", "status"]
    adjusted = any((r.summary.get("prediction") or {}).get("adjusted") for r in runs)
    if adjusted:  # sweep.plan=fit changed a point to make it fit: what it changed
        header.insert(header.index("status"), "adjusted")
    body = []
    for r in runs:
        peaks = r.peak_mem_per_rank()
        body.append([
            r.name, *[r.overrides.get(k, "") for k in keys],
            r.steps_reached(), r.final_loss(), r.best_eval_loss(), r.tokens_per_s(), r.mfu(),
            " ".join(f"{peaks[k]:.3f}" for k in sorted(peaks)) if peaks else None,
            (r.summary.get("prediction") or {}).get("predicted_peak_gib"),
            max(r.summary["peak_live_bytes_per_rank"]) / 1024**3 if r.summary.get("peak_live_bytes_per_rank") else None,
            *([" ".join(f"{k}={old}->{new}" for k, (old, new) in ((r.summary.get("prediction") or {}).get("adjusted")
                                                                  or {}).items()) or None] if adjusted else []),
            r.status if r.status in ("ok", "interrupted") else f"{r.status}: {r.reason}".rstrip(": "),
        ])
    return header, body


def _cell(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}" if abs(v) < 1e5 else f"{v:.3e}"
    return str(v)


def render_text(header: list[str], body: list[list[Any]]) -> str:
    return tables.render(header, [[_cell(v) for v in row] for row in body])


def render_markdown(header: list[str], body: list[list[Any]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(_cell(v).replace("|", "/") for v in row) + " |" for row in body]
    return "\n".join(out) + "\n"


def plot(runs: list[RunRecord], out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    fig, ax = plt.subplots(figsize=(8, 5))
    for r in runs:
        rows = r.train_rows
        if rows:
            ax.plot([x["step"] for x in rows], [x["loss"] for x in rows], label=r.name, marker="." if len(rows) < 30 else None)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title("loss vs step")
    if any(r.train_rows for r in runs):
        ax.legend(fontsize=7)
    path = out_dir / "loss.png"
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    written.append(path)

    ok = [r for r in runs if r.train_rows]
    labels = [" ".join(f"{k.split('.')[-1]}={r.overrides.get(k, '')}" for k in swept_keys(runs)) or r.name for r in ok]
    # A run's label can be all its overrides (paths included): too long for the axis, tight_layout gives up with a warning.
    labels = [lb if len(lb) <= 48 else lb[:47] + "…" for lb in labels]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.5))
    ax1.bar(range(len(ok)), [r.tokens_per_s() or 0 for r in ok], color="tab:blue")
    ax1.set_ylabel("tokens/s (median of steady steps)")
    ax1.set_title("throughput")
    peaks = [max(r.peak_mem_per_rank().values(), default=0.0) for r in ok]
    ax2.bar(range(len(ok)), peaks, color="tab:orange")
    ax2.set_ylabel("peak memory, largest rank (GiB)")
    ax2.set_title("memory")
    for ax in (ax1, ax2):
        ax.set_xticks(range(len(ok)))
        ax.set_xticklabels(labels, rotation=30, ha="right", fontsize=7)
    fig.tight_layout()
    path = out_dir / "throughput_memory.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    written.append(path)
    return written


# -- the sweep at a glance: two swept keys as a grid (issue 25 point 5) ------------------------------------
PLAN_FILE = "plan.json"  # written by the sweep before its first point (qwen3_research.launch.sweep.plan_points)
POINT_COLUMNS = ["point", "key_x", "x", "key_y", "y", "status", "tokens_per_s", "mfu", "peak_mem_gib",
                 "peak_mem_gib_per_rank", "predicted_peak_gib", "measured_live_peak_gib", "same_as"]


def _plan_entries(paths: list[Path]) -> dict[int, dict]:
    """The sweep's plan (plan.json of a sweep dir among ``paths``), by point number; {} without one."""
    for p in paths:
        f = p / PLAN_FILE
        if f.is_file():
            try:
                entries = json.loads(f.read_text())
            except ValueError:
                print(f"warning: {f} is not JSON; the report has no plan column from it", file=sys.stderr, flush=True)
                return {}
            return {e["num"]: e for e in entries.values() if isinstance(e, dict) and isinstance(e.get("num"), int)}
    return {}


def _point_num(name: str) -> int | None:
    head = name.split("_")[0]
    return int(head) if head.isdigit() else None


def _sort_values(values: list[str]) -> list[str]:
    try:
        return sorted(values, key=float)
    except ValueError:
        return values  # the sweep's own order


def sweep_points(runs: list[RunRecord], paths: list[Path]) -> list[dict]:
    """One row per point of the sweep (``POINT_COLUMNS``): its two swept values, status, steady tokens/s, MFU,
    measured peak memory (largest rank and per rank), the plan's predicted peak; a duplicate names the point whose
    run it is (``same_as``) and carries no number; points the plan listed that have no run directory (a sweep
    stopped before them) are ``not run``. Empty unless exactly two keys vary."""
    keys = swept_keys(runs)
    plan = _plan_entries(paths)
    if len(keys) != 2:
        return []
    kx, ky = keys
    rows, seen = [], set()
    for r in runs:
        num = _point_num(r.name)
        seen.add(num)
        peaks = r.peak_mem_per_rank()
        predicted = (r.summary.get("prediction") or plan.get(num, {})).get("predicted_peak_gib")
        live = r.summary.get("peak_live_bytes_per_rank")
        status = r.status if r.status in ("ok", "skipped", "interrupted", DUPLICATE) else "failed"
        rows.append({"point": r.name, "key_x": kx, "x": r.overrides.get(kx, ""), "key_y": ky, "y": r.overrides.get(ky, ""),
                     "status": status, "tokens_per_s": r.tokens_per_s(), "mfu": r.mfu(),
                     "peak_mem_gib": max(peaks.values()) if peaks else None,
                     "peak_mem_gib_per_rank": " ".join(f"{peaks[k]:.3f}" for k in sorted(peaks)) or None,
                     "predicted_peak_gib": predicted, "measured_live_peak_gib": max(live) / 1024**3 if live else None,
                     "same_as": r.summary.get("same_as")})
    for num, entry in sorted(plan.items()):
        if num in seen:
            continue
        over = overrides.point_values(entry.get("overrides", []))
        rows.append({"point": f"{num} (planned)", "key_x": kx, "x": over.get(kx, ""), "key_y": ky, "y": over.get(ky, ""),
                     "status": "not run", "tokens_per_s": None, "mfu": None, "peak_mem_gib": None,
                     "peak_mem_gib_per_rank": None, "predicted_peak_gib": entry.get("predicted_peak_gib"),
                     "measured_live_peak_gib": None, "same_as": None})
    return rows


def best_point_line(runs: list[RunRecord], points: list[dict] | None = None) -> str:
    """One line: the point with the most tokens/s among those that ran to the end (status ok: it fit), and how
    many did not; duplicates (another point's run) are counted apart, not as points that did not run."""
    ok = [r for r in runs if r.status == "ok" and r.tokens_per_s() is not None]
    others = {}
    duplicates = sum(r.status == DUPLICATE for r in runs)
    dup_tail = (f"; {duplicates} duplicate point{'s' if duplicates > 1 else ''} not run (the same run as another point)"
                if duplicates else "")
    for r in runs:
        if r.status not in ("ok", DUPLICATE):
            key = r.status if r.status in ("skipped", "interrupted") else "failed"
            others[key] = others.get(key, 0) + 1
    not_run = sum(p["status"] == "not run" for p in points or [])
    if not_run:
        others["not run"] = not_run
    tail = ", ".join(f"{n} {k}" for k, n in sorted(others.items()))
    if not ok:
        return f"sweep summary: no point ran to the end ({tail or 'no points'}){dup_tail}"
    best = max(ok, key=lambda r: r.tokens_per_s())
    keys = swept_keys(runs)
    label = " ".join(f"{k}={best.overrides.get(k, '')}" for k in keys) or best.name
    peaks = best.peak_mem_per_rank()
    predicted = (best.summary.get("prediction") or {}).get("predicted_peak_gib")
    mfu = best.mfu()
    return (f"sweep summary: best point by tokens/s that fit: {label}: {best.tokens_per_s():.1f} tokens/s"
            + (f", MFU {mfu:.4f}" if mfu is not None else "")
            + (f", peak {max(peaks.values()):.3f} GiB per rank" if peaks else "")
            + (f" (plan {predicted:.3f} GiB)" if predicted is not None else "")
            + f"; {len(ok)} of {len(runs) + not_run - duplicates} points ran to the end" + (f" ({tail})" if tail else "")
            + dup_tail)


def plot_heatmap(points: list[dict], path: Path) -> Path | None:
    """tokens/s, MFU and peak memory per rank over the two swept keys; skipped, failed, not-run and duplicate points
    marked (a duplicate with the point whose run it is), the planner's predicted peak beside the measured one. None
    without points."""
    if not points:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    kx, ky = points[0]["key_x"], points[0]["key_y"]
    xs = _sort_values(list(dict.fromkeys(p["x"] for p in points)))
    ys = _sort_values(list(dict.fromkeys(p["y"] for p in points)))
    panels = [("tokens_per_s", "tokens/s (median of steady steps)", "{:.0f}"), ("mfu", "MFU", "{:.4f}"),
              ("peak_mem_gib", "peak memory, largest rank (GiB)", "{:.3f}")]
    fig, axes = plt.subplots(1, 3, figsize=(5 * len(panels), 1.2 * len(ys) + 2.6))
    marks = {"skipped": "skipped\n(plan: no fit)", "failed": "failed", "not run": "not run", "interrupted": "interrupted"}
    for ax, (key, title, fmt) in zip(axes, panels):
        grid = np.full((len(ys), len(xs)), np.nan)
        cell = {}
        for p in points:
            i, j = ys.index(p["y"]), xs.index(p["x"])
            cell[i, j] = p
            if p["status"] == "ok" and p[key] is not None:
                grid[i, j] = p[key]
        ax.set_facecolor("#eeeeee")
        finite = grid[np.isfinite(grid)]
        image = ax.imshow(np.ma.masked_invalid(grid), cmap="viridis", aspect="auto", origin="lower",
                          vmin=finite.min() if finite.size else 0, vmax=finite.max() if finite.size else 1)
        fig.colorbar(image, ax=ax, fraction=0.046, pad=0.04)
        for (i, j), p in cell.items():
            if p["status"] == "ok" and p[key] is not None:
                text = fmt.format(p[key])
                if key == "peak_mem_gib" and p.get("measured_live_peak_gib") is not None:  # training.track_memory
                    text += f"\nlive {p['measured_live_peak_gib']:.3f}"
                if key == "peak_mem_gib" and p["predicted_peak_gib"] is not None:
                    text += f"\nplan {p['predicted_peak_gib']:.3f}"
                value = (p[key] - finite.min()) / ((finite.max() - finite.min()) or 1)
                color = "black" if value > 0.6 else "white"
            else:
                text = (f"same run as\npoint {p['same_as']}" if p["status"] == DUPLICATE  # the cell holding its numbers
                        else marks.get(p["status"], p["status"]))
                if key == "peak_mem_gib" and p["predicted_peak_gib"] is not None:
                    text += f"\nplan {p['predicted_peak_gib']:.3f}"
                color = "tab:red" if p["status"] == "failed" else "black"
                ax.add_patch(plt.Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, hatch="//", edgecolor="#999999", lw=0))
            ax.text(j, i, text, ha="center", va="center", fontsize=8, color=color)
        ax.set_xticks(range(len(xs)), xs)
        ax.set_yticks(range(len(ys)), ys)
        ax.set_xlabel(kx)
        ax.set_ylabel(ky)
        ax.set_title(title, fontsize=10)
    fig.suptitle(f"sweep: {kx} × {ky} (hatched: not measured; peak: the device's (process RSS on cpu); live: measured "
                 "peak live tensors (training.track_memory); plan: the planner's predicted peak live tensors)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def report(paths: list[Path], out_dir: Path, *, echo=print) -> list[RunRecord]:
    runs = find_runs(paths)
    if not runs:
        raise SystemExit(f"compare: no run directories under {', '.join(map(str, paths))}")
    out_dir.mkdir(parents=True, exist_ok=True)
    header, body = table(runs)
    with open(out_dir / "comparison.csv", "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(header)
        w.writerows([["" if v is None else v for v in row] for row in body])
    (out_dir / "comparison.md").write_text(render_markdown(header, body))
    pngs = plot(runs, out_dir)
    points = sweep_points(runs, paths)
    if points:  # exactly two swept keys: the grid, as a table and a heatmap
        with open(out_dir / "sweep_points.csv", "w", newline="") as fh:
            w = csv.DictWriter(fh, fieldnames=POINT_COLUMNS)
            w.writeheader()
            w.writerows([{k: ("" if v is None else v) for k, v in p.items()} for p in points])
        pngs.append(plot_heatmap(points, out_dir / "heatmap.png"))
    echo(render_text(header, body))
    counts: dict[str, int] = {}
    for r in runs:
        counts[r.status] = counts.get(r.status, 0) + 1
    tally = ", ".join(f"{n} {status}" for status, n in sorted(counts.items(), key=lambda kv: kv[0] != "ok"))
    echo(f"{tally}; report: {out_dir / 'comparison.md'}, "
         f"{out_dir / 'comparison.csv'}, " + ", ".join(str(p) for p in pngs))
    return runs
