"""Speed kernels apply only where measured faster (issue 30): ``KernelSpec.measured`` per device kind and dtype.

A kernel whose name promises speed (moe_fast, rope_fast, triton_*) replaces its modules only where its recorded
ratio (module time / kernel time) is above 1 on this device kind and the run's dtype; elsewhere the run keeps the
module and the kernel plan says so in one line; ``kernels.force=true`` applies it anyway. The reference kernels are
always applied (a correctness tool, not a speed option).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from qwen3_research.config import KernelEntry, RunConfig

from qwen3_research import devices

devices.prepare_torchtitan("cpu")

from qwen3_research.kernels import KERNELS, apply_overrides  # noqa: E402
from qwen3_research.kernels.registry import Measured, device_kind, speed_note  # noqa: E402

CPU = SimpleNamespace(type="cpu", lnc=None, torch_device=torch.device("cpu"))
KIND = device_kind("cpu")  # this host's CPU kind, e.g. cpu-avx512bf16


def _model():
    from qwen3_research.config import ModelConfig
    from qwen3_research.models.native.model import NativeQwen3

    return NativeQwen3(ModelConfig(backend="native_moe", flavor="tiny"), torch.device("cpu"), 32, 0).model


def _cfg(name, target="type:GroupedExperts", force=False, precision="none", option=None):
    cfg = RunConfig()
    cfg.kernels.entries = [KernelEntry(name=name, target=target, options={})]
    cfg.kernels.option = option or name
    cfg.kernels.force = force
    cfg.training.mixed_precision = precision
    cfg.data.seq_len, cfg.data.batch_size = 32, 2
    return cfg


SLOWER = (Measured(KIND, "float32", 0.44, "RESULTS.md row 17", "tiny"),
          Measured(KIND, "float32", 0.80, "RESULTS.md row 17", "30B-A3B"))
FASTER = (Measured(KIND, "float32", 1.50, "a test table"),)


@pytest.fixture
def table(monkeypatch):
    def use(rows):
        monkeypatch.setattr(KERNELS["moe_fast"], "measured", rows)
    return use


def test_slower_here_keeps_the_module_and_says_so_in_one_line(table, capsys):
    table(SLOWER)
    model = _model()
    plan = apply_overrides(model, _cfg("moe_fast"), CPU, dtype="float32")
    out = capsys.readouterr().out
    line = (f"  moe_fast [type:GroupedExperts] -> 0 of 4 module(s): measured 0.44x (tiny) / 0.80x (30B-A3B) the "
            f"module's speed on {KIND} float32, slower (RESULTS.md row 17); not applied, keeps GroupedExperts "
            "(kernels.force=true applies it)")
    print(out)
    assert line + "\n" in out + "\n"
    assert "kernel plan (kernels=moe_fast): 0 module(s) overridden" in out
    assert type(model.layers["0"].moe.routed_experts.inner_experts).__name__ == "GroupedExperts"
    assert plan["moe_fast"] == [] and len(plan.kept["moe_fast"]) == 4


def test_force_applies_it_anyway(table, capsys):
    table(SLOWER)
    model = _model()
    plan = apply_overrides(model, _cfg("moe_fast", force=True), CPU, dtype="float32")
    out = capsys.readouterr().out
    assert (f"  moe_fast [type:GroupedExperts] -> 4 module(s) (measured 0.44x (tiny) / 0.80x (30B-A3B) the module's "
            f"speed on {KIND} float32, slower (RESULTS.md row 17); applied: kernels.force=true):") in out, out
    assert type(model.layers["0"].moe.routed_experts.inner_experts).__name__ == "GroupedExperts_moe_fast"
    assert len(plan["moe_fast"]) == 4 and not plan.kept


def test_faster_here_applies_with_its_ratio(table, capsys):
    table(FASTER)
    model = _model()
    apply_overrides(model, _cfg("moe_fast"), CPU, dtype="float32")
    out = capsys.readouterr().out
    assert (f"  moe_fast [type:GroupedExperts] -> 4 module(s) (measured 1.50x the module's speed on {KIND} float32, "
            "faster (a test table)):") in out, out
    assert type(model.layers["0"].moe.routed_experts.inner_experts).__name__ == "GroupedExperts_moe_fast"


def test_a_measurement_in_another_dtype_or_device_does_not_count(table, capsys):
    """Faster in float32 on this CPU says nothing of bf16, nor of another CPU kind or a GPU."""
    table((*FASTER, Measured("cuda", "bfloat16", 2.0, "elsewhere")))
    model = _model()
    apply_overrides(model, _cfg("moe_fast", precision="bf16"), CPU, dtype="bfloat16")
    out = capsys.readouterr().out
    assert (f"  moe_fast [type:GroupedExperts] -> 0 of 4 module(s): not measured on {KIND} bfloat16; not applied, "
            "keeps GroupedExperts (kernels.force=true applies it)") in out, out
    assert speed_note(KERNELS["moe_fast"], "cuda", "bfloat16") == (
        True, "measured 2.00x the module's speed on cuda bfloat16, faster (elsewhere)")


def test_the_reference_is_always_applied(capsys):
    model = _model()
    plan = apply_overrides(model, _cfg("moe_reference", option="reference"), CPU, dtype="float32")
    assert len(plan["moe_reference"]) == 4 and not plan.kept
    assert KERNELS["moe_reference"].reference and not KERNELS["moe_reference"].speed and not KERNELS["nki_moe"].speed
    line = capsys.readouterr().out.split("moe_reference [type:GroupedExperts]")[1].split("\n")[0]
    assert line == " -> 4 module(s):", line  # no speed note: a correctness tool


def test_speed_options_name_their_records():
    """Every speed kernel is gated, and each recorded measurement names its RESULTS row; the H200 figures of
    issue 30 are recorded as measured slower on cuda (triton_moe bf16 0.83x, moe_fast fp32 0.51x)."""
    speed = {n for n, s in KERNELS.items() if s.speed}
    assert speed == {"moe_fast", "rope_fast", "triton_moe", "triton_rope"}
    for n in speed:
        assert all("RESULTS.md row" in m.where for m in KERNELS[n].measured), n
    assert speed_note(KERNELS["triton_moe"], "cuda", "bfloat16")[0] is False
    assert speed_note(KERNELS["moe_fast"], "cuda", "float32")[0] is False
    assert "0.83x" in speed_note(KERNELS["triton_moe"], "cuda", "bfloat16")[1]
    assert "0.51x" in speed_note(KERNELS["moe_fast"], "cuda", "float32")[1]


def test_nki_speed_is_not_measured_until_a_trainium_host_runs_the_benchmark():
    """NKI kernels are not speed-gated (a Trainium run asks for them) but the plan says their speed is unknown."""
    assert speed_note(KERNELS["nki_moe"], "neuron", "bfloat16") == (False, "not measured on neuron bfloat16")
    assert speed_note(KERNELS["nki_rope"], "neuron", "float32") == (False, "not measured on neuron float32")
