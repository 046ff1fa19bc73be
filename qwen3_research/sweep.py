"""Sweep support: the end-of-sweep report (a Hydra callback) and per-point W&B identity."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig


def parse_overrides(overrides: list[str]) -> dict[str, str]:
    out = {}
    for item in overrides:
        key, _, value = item.partition("=")
        key = key.lstrip("+~")
        if not key.startswith("hydra.") and key != "logging.wandb.mode":
            out[key] = value
    return out


_SWEEP_FUNCS = ("range(", "choice(", "interval(", "glob(", "tag(")


def _is_sweep_value(value: str) -> bool:
    depth = 0
    for ch in value:
        depth += ch in "[{("
        depth -= ch in "]})"
        if ch == "," and depth == 0:
            return True
    return value.startswith(_SWEEP_FUNCS)


def swept_keys_of_this_sweep(sweeper_params: dict | None, argv: list[str]) -> set[str]:
    """Keys the sweep varies: the sweeper's params plus command-line overrides with sweep syntax."""
    keys = {str(k) for k in (sweeper_params or {})}
    for arg in argv:
        if arg.startswith("-") or "=" not in arg:
            continue
        key, _, value = arg.partition("=")
        if _is_sweep_value(value):
            keys.add(key.lstrip("+~"))
    return keys


def swept_config_fields(swept: dict[str, str]) -> dict[str, Any]:
    """Top-level W&B config fields for the swept keys: 'tp', 'seq_len', … (full key on a clash)."""
    short = {}
    for key, value in swept.items():
        name = key.split(".")[-1]
        if name in short or sum(k.split(".")[-1] == name for k in swept) > 1:
            name = key.replace(".", "_")
        try:
            short[name] = json.loads(value)
        except (TypeError, ValueError):
            short[name] = value
    return short


class SweepReport(Callback):
    """At the end of a multirun: comparison table and plots in the sweep dir, sweep.json with
    the wall time, and exit status 3 when any point failed."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        self.t0 = time.perf_counter()

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        from qwen3_research.compare import EXIT_SOME_FAILED, report

        sweep_dir = Path(config.hydra.sweep.dir)
        if not sweep_dir.is_dir():
            return
        wall = time.perf_counter() - getattr(self, "t0", time.perf_counter())
        runs = report([sweep_dir], sweep_dir)
        point_s = [r.summary.get("wall_s") for r in runs]
        (sweep_dir / "sweep.json").write_text(json.dumps({
            "wall_s": wall, "points": len(runs), "failed": sum(r.status != "ok" for r in runs),
            "points_wall_s": point_s,
        }, indent=1))
        if any(r.status != "ok" for r in runs):
            print(f"sweep finished with failed points (exit status {EXIT_SOME_FAILED})", file=sys.stderr, flush=True)
            sys.exit(EXIT_SOME_FAILED)
