"""qwen3_research/overrides.py: command-line overrides read by Hydra's parser, and nothing else splitting them."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from qwen3_research import overrides

ROOT = Path(__file__).resolve().parents[1]
# What splitting an override by hand looks like: at '=', or its +/~ prefix stripped or tested.
HAND_SPLIT = re.compile(r"""partition\(["']="\)|split\(["']=["'], ?1\)|lstrip\(["']\+~?["']\)|startswith\(["'][~+]["']\)""")


@pytest.mark.parametrize("text, prefix, key, value, sweep", [
    ("optimizer.lr=1e-3", "", "optimizer.lr", "1e-3", False),  # as typed: Hydra's own string would be 0.001
    ("+a.b=3", "+", "a.b", "3", False),
    ("++a.b=x", "++", "a.b", "x", False),
    ("~a.b", "~", "a.b", None, False),
    ("model@pkg=native", "", "model@pkg", "native", False),
    ("x=", "", "x", "", False),
    ("x=1,2", "", "x", "1,2", True),
    ("x=range(1,3)", "", "x", "range(1,3)", True),
    ('x="a,b"', "", "x", '"a,b"', False),  # a quoted comma is one value (the hand-written check said sweep)
    ("x=a\\,b", "", "x", "a\\,b", False),  # so is an escaped one
])
def test_an_override_is_read_by_hydras_grammar(text, prefix, key, value, sweep):
    o = overrides.parse_one(text)
    assert (o.prefix, o.key, o.value, o.sweep, o.text) == (prefix, key, value, sweep, text)
    assert o.head == text.split("=")[0]


def test_point_values_first_values_and_swept_keys():
    """3 point keys (Hydra's and W&B's mode left out; ~key gives ""), a sweep with no value dropped, flags skipped."""
    assert overrides.point_values(["x=1", "hydra.run.dir=/r", "logging.wandb.mode=offline", "~y", "+z=a b"]) == {
        "x": "1", "y": "", "z": "a b"}
    assert overrides.first_values(["x=1,2", "y=range(0,0)", "+z=3"]) == ["x=1", "+z=3"]
    assert overrides.swept_keys(["-m", "x=1,2", "--config-dir=/a", "/a=b,c", 'z="a,b"', "y=range(1,3)"]) == {"x", "y"}
    assert overrides.sets(["+hydra.run.dir=/r"], "hydra.run.dir") and not overrides.sets(["x=1"], "hydra.run.dir")
    with pytest.raises(Exception, match="missing EQUAL"):
        overrides.parse(["x=1", "train"])


def test_importing_it_loads_no_hydra():
    """The allocator's re-exec decision (devices.device_kind) runs before Hydra loads: importing the module, and
    the devices package that uses its split_text, loads none of it."""
    code = ("import json, sys; import qwen3_research.overrides, qwen3_research.devices as d; "
            "k = d.device_kind(argv=['+device=cpu', '~device=cuda']); "
            "print(json.dumps([k, sorted(m for m in sys.modules if m.split('.')[0] in ('hydra', 'omegaconf'))]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == ["cpu", []]


def test_no_override_is_split_by_hand_in_the_package():
    """Every match of HAND_SPLIT in the package is the helper's own split_text or a line saying why it is not an
    override (a Hydra flag, scontrol's Key=Value): 0 others (24 before issue 39, in 9 modules)."""
    found = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}"
             for p in sorted((ROOT / "qwen3_research").rglob("*.py"))
             for i, line in enumerate(p.read_text().splitlines(), 1) if HAND_SPLIT.search(line)]
    others = [f for f in found if not f.startswith("qwen3_research/overrides.py") and "# why:" not in f]
    print(f"\n{len(found)} matches of {HAND_SPLIT.pattern}:" + "".join(f"\n  {f}" for f in found))
    assert len(found) >= 1 and others == []  # >= 1: the pattern still finds the helper's own split
