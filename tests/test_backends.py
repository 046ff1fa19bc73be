"""The model-backend registry (qwen3_research.models.registry): a backend is one module and one YAML option.

A toy backend (tests/toy_backend.py, a bigram model) is added exactly as a user would add one: its module
plus conf/model/toy.yaml in a config directory of its own, put on Hydra's search path. It trains through
the real CLI with nothing in the package changed; the in-tree backends answer the same questions through
their specs, and no caller names a backend.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from qwen3_research.config import ModelConfig
from qwen3_research.models import registry
from tests.conftest import FAST, ROOT, assert_ok, read_metrics, run_cli

TOY_YAML = """\
# A toy bigram language model: the backend module is tests/toy_backend.py (model.module).
defaults:
  - /model_schema@_here_
  - _self_
backend: toy
module: tests.toy_backend
flavor: bigram
"""


@pytest.fixture(scope="module")
def toy_conf(tmp_path_factory) -> Path:
    conf = tmp_path_factory.mktemp("toy_conf")
    (conf / "model").mkdir()
    (conf / "model" / "toy.yaml").write_text(TOY_YAML)
    return conf


def test_toy_backend_trains_through_the_cli(toy_conf, tmp_path):
    """model=toy from a config directory on Hydra's search path: 2 steps on CPU, loss from the toy's own
    bigram model (log(vocab) ≈ 11.9 at the start), the summary naming the backend."""
    run_dir = tmp_path / "run"
    proc = run_cli(["model=toy", f"hydra.searchpath=[file://{toy_conf}]", *FAST, "training.steps=2",
                    "device=cpu"], run_dir=run_dir, timeout=300)
    assert_ok(proc)
    rows = [r for r in read_metrics(run_dir) if "loss" in r]
    summary = json.loads((run_dir / "summary.json").read_text())
    needed = ["tests/toy_backend.py (its module: BACKEND)", f"{toy_conf / 'model' / 'toy.yaml'} (its option)"]
    print(f"\nfiles the toy backend needed: {len(needed)}: {needed}; qwen3_research/: untouched")
    named = [ln for ln in proc.stdout.splitlines() if "toy/bigram" in ln]
    print(f"losses {[round(r['loss'], 4) for r in rows]}; summary status={summary['status']}; {named[:1]}")
    assert summary["status"] == "ok" and summary["steps"] == 2 and len(rows) == 2
    assert all(10.0 < r["loss"] < 13.0 for r in rows)  # a fresh bigram model over ~152k tokens: ~ln(151669) = 11.9


def test_toy_backend_bad_module_is_one_line(toy_conf, tmp_path):
    """A model.module that does not import is one config-error line naming it (exit 2), before any run dir."""
    proc = run_cli(["model=toy", f"hydra.searchpath=[file://{toy_conf}]", "model.module=tests.no_such_backend",
                    *FAST], run_dir=tmp_path / "run", timeout=120)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    print(f"\n{lines}")
    assert proc.returncode == 2 and len(lines) == 1
    assert lines[0].startswith("config error: model.module='tests.no_such_backend' (model.backend='toy') cannot be imported")
    assert not (tmp_path / "run").exists()


def test_in_tree_specs_declare_what_callers_asked_by_name():
    """What callers once decided from a backend's name, each spec now says: native takes init_from and is
    torchtitan's Qwen3 (dense and MoE flavors, with their HF model_types; the old native_moe answers as native
    with its flavors renamed); hf needs model.path."""
    specs = {n: registry.get(n) for n in registry.in_tree()}
    facts = {n: (s.takes_path, s.takes_init_from, s.torchtitan, s.moe, s.hf_model_types, len(s.flavors))
             for n, s in specs.items()}
    print(f"\n{facts}")
    assert facts == {"hf": (True, False, False, False, (), 0),
                     "native": (False, True, True, False, ("qwen3", "qwen3_moe"), 14)}  # tiny_untied: pp
    assert registry.get("native_moe") is specs["native"]
    assert registry.canonical(ModelConfig(backend="native_moe", flavor="tiny")) == ModelConfig(backend="native",
                                                                                               flavor="tiny_moe")
    old_meta = {"backend": "native_moe", "flavor": "debug", "path": None, "init_from": None}  # a meta.json's model
    assert registry.canonical(old_meta) == {**old_meta, "backend": "native", "flavor": "debug_moe"}
    assert registry.canonical(ModelConfig(backend="native_moe", flavor="auto", init_from="/m")).flavor == "auto"
    assert registry.balance_modes(ModelConfig(backend="native", flavor="tiny")) == ("none",)
    assert registry.balance_modes(ModelConfig(backend="native", flavor="tiny_moe"))[0] == "bias"


def test_backend_modules_validate_without_torch(tmp_path):
    """Describing a model (what validation needs) imports no torch: every in-tree spec module, and the toy's. (hf: a
    directory with its config.json, which validation reads; a missing one is refused at resolution.)"""
    (tmp_path / "config.json").write_text('{"num_attention_heads": 4, "num_key_value_heads": 2}')
    code = ("import sys; from qwen3_research import models; from qwen3_research.config import ModelConfig; "
            f"[models.describe(ModelConfig(backend=b, path={str(tmp_path)!r})) for b in ('native', 'native_moe', 'hf')]; "
            "models.describe(ModelConfig(backend='toy', module='tests.toy_backend', flavor='bigram')); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))")
    out = subprocess.run([__import__("sys").executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         timeout=120)
    print(f"\ntorch modules imported: {out.stdout.strip()}")
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"


def test_no_backend_name_test_outside_the_registry():
    """Acceptance b: no ``backend ==``/``!=``/``in (``/``not in`` test on a name anywhere in the package
    outside qwen3_research/models/ (the registry and the backend modules)."""
    pattern = re.compile(r"\bbackend\s*(==|!=|not\s+in|in\s*[(\[{])|\"(hf|native|native_moe)\"\s*(==|!=|in\b)")
    # \b: a model backend's name, not torch.distributed's (devices' ``dist_backend != "gloo"``)
    hits = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}"
            for p in sorted((ROOT / "qwen3_research").rglob("*.py")) if "models" not in p.relative_to(ROOT).parts
            for i, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    print(f"\nbackend-name tests outside qwen3_research/models/: {hits or 'none'}")
    assert hits == []


def test_unknown_backend_names_the_shipped_ones():
    from qwen3_research import models
    from qwen3_research.errors import ConfigError

    with pytest.raises(ConfigError) as e:
        models.check(ModelConfig(backend="transformer"))
    print(f"\n{e.value}")
    assert str(e.value).startswith("model.backend='transformer' is not one of ['hf', 'native']")


def test_native_takes_a_moe_flavor_and_nki_moe_is_refused_on_cpu(tmp_path):
    """Issue 32 acceptance f: ``model=native model.flavor=tiny_moe`` trains a MoE (routing keys in metrics.jsonl);
    with ``kernels=nki_moe`` on CPU the run is refused in one config-error line naming device=neuron, before any
    run directory."""
    run_dir = tmp_path / "moe"
    proc = run_cli(["model=native", "model.flavor=tiny_moe", *FAST, "training.steps=2", "device=cpu"],
                   run_dir=run_dir, timeout=300)
    assert_ok(proc)
    rows = [r for r in read_metrics(run_dir) if "loss" in r]
    moe_keys = sorted(k for k in rows[-1] if k.startswith("moe_"))
    named = [ln for ln in proc.stdout.splitlines() if ln.startswith("model=native/tiny_moe")]
    print(f"\nsteps {len(rows)}, routing keys {moe_keys}; {named[0][:80] if named else ''}")
    assert len(rows) == 2 and {"moe_max_load", "moe_entropy"} <= set(moe_keys) and named
    # issue 40: CPU autocast's refusal of the router's float32 gate printed on every MoE run (startup.NOISE)
    assert "cpu autocast" not in (proc.stdout + proc.stderr).lower(), proc.stderr[-2000:]
    refused = run_cli(["model=native", "model.flavor=tiny_moe", "kernels=nki_moe", *FAST, "training.steps=2",
                       "device=cpu"], run_dir=tmp_path / "nki", timeout=300)
    lines = [ln for ln in refused.stderr.splitlines() if ln.strip()]
    print(f"exit {refused.returncode}: {lines}")
    assert refused.returncode == 2 and len(lines) == 1
    assert lines[0].startswith("config error: ") and "device=neuron" in lines[0]
    assert not (tmp_path / "nki").exists()


def test_training_loss_auto_is_the_full_loss_for_a_backend_without_a_chunked_one():
    """BackendSpec.chunked_loss=False (the toy bigram gives logits only): auto resolves to the full loss, chunked asked
    for is one config error; an in-tree torchtitan backend keeps auto (the chunked loss on cpu) on both torchtitan APIs
    (0.2.x through titan/v02's model seam)."""
    from qwen3_research.errors import ConfigError
    from qwen3_research.resolve import _loss_for_backend

    toy = {"model": {"backend": "toy", "module": "tests.toy_backend"}, "training": {"loss": "auto"}}
    assert _loss_for_backend(toy)["training"]["loss"] == "full"
    with pytest.raises(ConfigError, match=r"training.loss=chunked: model.backend='toy' has no hidden_states"):
        _loss_for_backend({**toy, "training": {"loss": "chunked"}})
    native = {"model": {"backend": "native"}, "training": {"loss": "auto"}}
    assert _loss_for_backend(native)["training"]["loss"] == "auto"
