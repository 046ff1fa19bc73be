"""A sweep's points that are one run: they differ only in keys their config ignores (``config.inert_keys``: the
pipeline keys at ``parallelism.pp=1``, e.g. ``parallelism.pp=1,2 × parallelism.pp_schedule=1F1B,GPipe``). The first
of them runs; the others are not started: each gets a summary.json with status ``duplicate`` naming the point it
repeats, so a report never shows two measurements of one run as if its settings differed."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from qwen3_research import overrides
from qwen3_research.config import PIPELINE_ONLY_KEYS, inert_keys
from qwen3_research.errors import ConfigError
from qwen3_research.report import DUPLICATE

REPEATS_FILE = "repeats.json"  # written before the first point starts, read by each point (a remote one too)


def find_repeats(jobs: list[list[str]], compose: Callable[[list[str]], dict]) -> dict[int, dict]:
    """Point number -> ``{"same_as": the earlier point it repeats, "keys": {key: why it changes nothing}}``.

    Points that differ in nothing but ``PIPELINE_ONLY_KEYS`` form a group; one point of a group is composed to learn
    which of those keys its config ignores (whether a key is inert never depends on such a key: ``inert_keys``). A
    sweep that varies none of them composes nothing."""
    values = [overrides.point_values(job) for job in jobs]
    varying = {k for v in values for k in v if len({w.get(k) for w in values}) > 1}
    if not varying & set(PIPELINE_ONLY_KEYS):
        return {}
    groups: dict[str, list[int]] = {}
    for num, v in enumerate(values):
        rest = sorted((k, x) for k, x in v.items() if k not in PIPELINE_ONLY_KEYS)
        groups.setdefault(json.dumps(rest), []).append(num)
    repeats: dict[int, dict] = {}
    for nums in groups.values():
        if len(nums) < 2:
            continue
        try:
            inert = inert_keys(compose(jobs[nums[0]]))
        except ConfigError:  # each point of the group fails alone, with its own line
            continue
        first: dict[str, int] = {}  # the values of the keys that act -> the first point with them
        for num in nums:
            acting = json.dumps(sorted((k, x) for k, x in values[num].items() if k in PIPELINE_ONLY_KEYS and k not in inert))
            if acting not in first:
                first[acting] = num
                continue
            same = first[acting]
            repeats[num] = {"same_as": same, "keys": {k: inert[k] for k in PIPELINE_ONLY_KEYS
                                                      if values[num].get(k) != values[same].get(k)}}
    return repeats


def describe(repeat: dict) -> str:
    """``the same run as point 0 (parallelism.pp_schedule has no effect at parallelism.pp=1)``."""
    why = "; ".join(f"{k} {reason}" for k, reason in repeat["keys"].items())
    return f"the same run as point {repeat['same_as']}" + (f" ({why})" if why else "")


def write(sweep_dir: Path, jobs: list[list[str]], repeats: dict[int, dict], point_key: Callable) -> None:
    """``repeats.json`` in the sweep dir, by point key (as plan.json); an earlier sweep's file is replaced."""
    path = sweep_dir / REPEATS_FILE
    if not repeats:
        path.unlink(missing_ok=True)
        return
    sweep_dir.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({point_key(jobs[num]): {"num": num, **r} for num, r in repeats.items()}, indent=1))


def read(sweep_dir: Path, key: str) -> dict | None:
    """The point's entry of ``repeats.json`` (None: the point runs)."""
    path = sweep_dir / REPEATS_FILE
    return json.loads(path.read_text()).get(key) if path.is_file() else None


def record(run_path: Path, repeat: dict, write_summary: bool) -> dict:
    """A repeated point, not started: its summary.json (status ``duplicate``, which point it repeats, why) and one
    line; returns the summary."""
    summary = {"status": DUPLICATE, "reason": describe(repeat), "same_as": repeat["same_as"]}
    if write_summary:
        run_path.mkdir(parents=True, exist_ok=True)
        tmp = run_path / "summary.json.tmp"
        tmp.write_text(json.dumps(summary, indent=1))
        tmp.replace(run_path / "summary.json")
    print(f"sweep point {run_path.name}: not run: {summary['reason']}", flush=True)
    return summary
