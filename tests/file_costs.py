"""Per-file test seconds from a pytest ``--durations=0`` log, for tests/conftest.py's longest-first order.

    .venv/bin/python -m pytest tests -q -n 2 --dist loadfile --no-loadscope-reorder --durations=0 > durations.log
    .venv/bin/python -m tests.file_costs durations.log      # rewrites tests/file_seconds.json

Setup, call and teardown seconds of every test of a file add up (a module fixture's run counts in its first test's
setup). Files the log does not mention keep their old figure."""

from __future__ import annotations

import json
import re
import sys
from collections import defaultdict
from pathlib import Path

from tests.conftest import FILE_SECONDS

LINE = re.compile(r"^([\d.]+)s (?:setup|call|teardown) +(tests/[^:]+\.py)::")


def file_seconds(log: str) -> dict[str, float]:
    out: dict[str, float] = defaultdict(float)
    for ln in log.splitlines():
        if m := LINE.match(ln):
            out[m.group(2)] += float(m.group(1))
    return dict(out)


if __name__ == "__main__":
    new = file_seconds(Path(sys.argv[1]).read_text())
    old = json.loads(FILE_SECONDS.read_text()) if FILE_SECONDS.exists() else {}
    merged = {f: round(s, 1) for f, s in sorted({**old, **new}.items(), key=lambda kv: -kv[1])}
    FILE_SECONDS.write_text(json.dumps(merged, indent=1) + "\n")
    print(f"{len(new)} files from the log, {sum(new.values()):.0f} s in all; the five longest: "
          + ", ".join(f"{f} {s:.0f} s" for f, s in list(merged.items())[:5]))
