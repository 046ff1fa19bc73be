"""Kernel override registry and kernels (issue 5).

Registry: conflict error, no-match warning, device / seq_len-multiple / LNC errors, printed plan.
Kernels: moe_fast, rope_fast, triton_moe, triton_rope (Triton under TRITON_INTERPRET=1) match
their float32 references within 1e-5 forward and backward; opcheck (fake impl + autograd);
torch.compile; 10-step runs reproduce the reference runs within 1e-4; multi-process (slow).
NKI: the wrappers against contract doubles in tests/test_nki_contract.py; on hardware only where
torch_neuronx imports.
"""

from __future__ import annotations

import importlib.util
import json
import re
from types import SimpleNamespace

import pytest
import torch

from qwen3_research.config import ConfigError, KernelEntry, RunConfig
from tests.conftest import FAST, ROOT, assert_ok, cli_env, hooks_env, run_cli, train_losses

from qwen3_research import devices

devices.prepare_torchtitan("cpu")

from qwen3_research.kernels import KernelMatchWarning, apply_overrides, resolve  # noqa: E402
from qwen3_research.kernels.registry import KERNELS, device_kind, speed_note  # noqa: E402
from qwen3_research.kernels.moe import moe_fast, moe_reference, moe_experts_fwd  # noqa: E402
from qwen3_research.kernels.rope import rope_fast, rope_fast_op, rope_reference  # noqa: E402

CPU = SimpleNamespace(type="cpu", lnc=2, torch_device=torch.device("cpu"))
EXPERTS = "layers.*.moe.routed_experts.inner_experts"


@pytest.fixture(scope="module")
def moe_model():
    from qwen3_research.config import ModelConfig
    from qwen3_research.models.native.model import NativeQwen3

    return NativeQwen3(ModelConfig(backend="native_moe", flavor="tiny"), torch.device("cpu"), 32, 0).model


def _cfg(entries, seq_len=32, option=None, verify=False, force=True):
    """force: the kernels are installed whatever their speed measurements say (tests/test_kernels_gating.py tests the
    gate itself)."""
    cfg = RunConfig()
    cfg.kernels.force = force
    cfg.kernels.entries = [KernelEntry(name=n, target=t, options=o or {}) for n, t, *rest in entries for o in [rest[0] if rest else {}]]
    cfg.kernels.option = option
    cfg.kernels.verify = verify
    cfg.data.seq_len = seq_len
    cfg.data.batch_size = 2
    return cfg


# ----------------------------------------------------------------------------------- registry
def test_two_entries_claiming_one_module_is_an_error_naming_both(moe_model):
    cfg = _cfg([("moe_fast", EXPERTS), ("moe_reference", "type:GroupedExperts")])
    with pytest.raises(ConfigError) as e:
        resolve(moe_model, cfg, CPU, dtype="float32")
    assert str(e.value).startswith(
        "kernel entries 'moe_fast' and 'moe_reference' both claim module 'layers.0.moe.routed_experts.inner_experts'"
    ), str(e.value)


def test_a_target_missing_the_kernels_modules_is_one_config_error(moe_model):
    """A typo in a target: the model has the kernel's modules (CosSinRoPE) and the pattern reaches none of them.
    One ConfigError naming the entry, its pattern and where the modules are (resolve_run makes it on a meta-device
    model before any worker starts: tests/test_resolve.py)."""
    cfg = _cfg([("moe_fast", EXPERTS), ("rope_fast", "layers.*.mlp.rope")])
    with pytest.raises(ConfigError) as e:
        resolve(moe_model, cfg, CPU, dtype="float32")
    assert str(e.value) == ("kernel entry 'rope_fast' (target 'layers.*.mlp.rope') matches none of the model's 4 "
                            "CosSinRoPE modules (e.g. 'layers.0.attention.rope'); fix the target: an fnmatch pattern "
                            "over module names, or type:<class>")


def test_an_entry_for_modules_the_model_lacks_warns_with_entry_and_pattern(moe_model):
    """moe_fast where there are no experts beside rope_fast, which matches (kernels=fast on a dense model): nothing
    to replace for moe_fast, a warning; the option still does something."""
    attention = moe_model.get_submodule("layers.0.attention")  # a real part of the model: RoPE, no experts
    for target in (EXPERTS, "type:GroupedExperts"):  # a path; the shipped conf/kernels/moe_fast.yaml's class target
        with pytest.warns(KernelMatchWarning, match=rf"kernel entry 'moe_fast' \(target '{re.escape(target)}'\) "
                                                    r"matches no module"):
            plan = resolve(attention, _cfg([("moe_fast", target), ("rope_fast", "type:CosSinRoPE")]), CPU, dtype="float32")
        assert plan == {"moe_fast": [], "rope_fast": ["rope"]}


def test_an_option_none_of_whose_entries_matches_is_one_config_error(moe_model):
    """kernels=moe_fast on a dense model (issue 40): the option would change nothing, so the run is refused in one
    line naming what it replaces and the MoE flavors (was: one warning, and the dense model trained)."""
    attention = moe_model.get_submodule("layers.0.attention")
    with pytest.raises(ConfigError) as e:
        resolve(attention, _cfg([("moe_fast", "type:GroupedExperts")], option="moe_fast"), CPU, dtype="float32")
    assert str(e.value) == (
        "kernels=moe_fast matches no module of model=native model.flavor=tiny (it replaces GroupedExperts, which this "
        "model does not have), so it would change nothing; a mixture-of-experts flavor has them: "
        "model.flavor=tiny_moe|debug_moe|nki_debug|30B-A3B|235B-A22B; or drop kernels=moe_fast")


def test_the_device_rule_comes_before_the_targets(moe_model):
    """kernels=nki_moe on CPU on a model without experts (issue 40): the device error, not a no-match warning."""
    attention = moe_model.get_submodule("layers.0.attention")
    with pytest.raises(ConfigError, match=r"^kernels=nki_moe needs device neuron \(kernel nki_moe\); this run's "
                       r"device is cpu"):
        resolve(attention, _cfg([("nki_moe", "type:GroupedExperts")], seq_len=256, option="nki_moe"), CPU, dtype="float32")


def test_pattern_only_claims_the_kernels_module_type(moe_model):
    plan = resolve(moe_model, _cfg([("rope_fast", "layers.*")]), CPU, dtype="float32")  # broad pattern: only CosSinRoPE
    assert plan["rope_fast"] == [f"layers.{i}.attention.rope" for i in range(4)]


def test_neuron_kernel_on_cpu_is_a_device_error(moe_model):
    with pytest.raises(ConfigError, match=r"^kernels=nki_moe needs device neuron \(kernel nki_moe\); this run's "
                       r"device is cpu; .*kernels=moe_fast"):
        resolve(moe_model, _cfg([("nki_moe", EXPERTS)], seq_len=256, option="nki_moe"), CPU, dtype="float32")


def test_seq_len_multiple_of_128_x_lnc(moe_model, monkeypatch):
    from tests.nki_contract_doubles import pretend_neuron_packages

    pretend_neuron_packages(monkeypatch)  # a simulated Neuron host (the package check passes)
    neuron = SimpleNamespace(type="neuron", lnc=2)
    with pytest.raises(ConfigError) as e:
        resolve(moe_model, _cfg([("nki_rope", "type:CosSinRoPE")], seq_len=300, option="nki_rope"), neuron, dtype="float32")
    assert str(e.value) == (
        "kernels=nki_rope needs data.seq_len to be a multiple of 128 × LNC = 256; got 300 (e.g. data.seq_len=512 or 256)"
    )
    with pytest.raises(ConfigError, match=r"multiple of 128 × LNC = 128; got 300"):
        resolve(moe_model, _cfg([("nki_rope", "type:CosSinRoPE")], seq_len=300, option="nki_rope"),
                SimpleNamespace(type="neuron", lnc=1), dtype="float32")
    with pytest.raises(ConfigError, match=r"needs LNC in \[1, 2\] .*got 4"):
        resolve(moe_model, _cfg([("nki_rope", "type:CosSinRoPE")], seq_len=512, option="nki_rope"),
                SimpleNamespace(type="neuron", lnc=4), dtype="float32")
    plan = resolve(moe_model, _cfg([("nki_rope", "type:CosSinRoPE")], seq_len=512, option="nki_rope"), neuron, dtype="float32")
    assert len(plan["nki_rope"]) == 4  # requirements met (nki_moe's own checks: tests/test_nki_contract.py)


def test_triton_on_cpu_needs_the_interpreter(moe_model, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ConfigError, match=r"runs on cpu only under TRITON_INTERPRET=1.*kernels=moe_fast"):
        resolve(moe_model, _cfg([("triton_moe", EXPERTS)], option="triton_moe"), CPU, dtype="float32")


def test_unknown_kernel_and_unknown_option(moe_model):
    with pytest.raises(ConfigError, match=r"unknown kernel 'moe_fastest'; known kernels: \["):
        resolve(moe_model, _cfg([("moe_fastest", EXPERTS)]), CPU, dtype="float32")


def test_apply_prints_plan_and_swaps_classes(capsys):
    from qwen3_research.config import ModelConfig
    from qwen3_research.models.native.model import NativeQwen3

    model = NativeQwen3(ModelConfig(backend="native_moe", flavor="tiny"), torch.device("cpu"), 32, 0).model
    keys = list(model.state_dict())
    plan = apply_overrides(model, _cfg([("moe_fast", EXPERTS), ("rope_fast", "type:CosSinRoPE")], option="fast", verify=True), CPU, dtype="float32")
    out = capsys.readouterr().out
    assert "kernel plan (kernels=fast): 8 module(s) overridden" in out
    # the plan's note follows this CPU's own measurements (moe_fast is measured faster in float32 on some CPU kinds,
    # slower on others): applied by kernels.force=true only where it is not measured faster
    faster, _ = speed_note(KERNELS["moe_fast"], device_kind("cpu"), "float32")
    note = "" if faster else "; applied: kernels\\.force=true"
    assert re.search(r"  moe_fast \[layers\.\*\.moe\.routed_experts\.inner_experts\] -> 4 module\(s\) \([^\n]*"
                     + note + r"\):\n    layers\.0\.moe\.routed_experts\.inner_experts", out), out
    assert "  rope_fast [type:CosSinRoPE] -> 4 module(s) (" in out
    assert "moe_fast     x(128,128) E=8 F=128 top2 float32" in out and out.count("PASS") == 2  # kernels.verify=true
    assert type(model.layers["0"].moe.routed_experts.inner_experts).__name__ == "GroupedExperts_moe_fast"
    assert list(model.state_dict()) == keys  # same parameters and checkpoint keys
    assert plan["rope_fast"] == [f"layers.{i}.attention.rope" for i in range(4)]


# ----------------------------------------------------------------------------------- kernels
def _moe_inputs(E=8, D=32, Fh=48, tokens=40, k=2, seed=0, skew=False):
    g = torch.Generator().manual_seed(seed)
    if skew:  # most rows on one expert, one expert empty: exercises the per-expert loop path
        counts = torch.tensor([tokens * k - (E - 2) * 2] + [2] * (E - 2) + [0])
    else:
        counts = torch.bincount(torch.rand(tokens, E, generator=g).topk(k, -1).indices.flatten(), minlength=E)
    R = int(counts.sum())
    return (torch.randn(R, D, generator=g), torch.randn(E, Fh, D, generator=g) / 6,
            torch.randn(E, D, Fh, generator=g) / 7, torch.randn(E, Fh, D, generator=g) / 6, counts)


def _check_moe(op, **kw):
    x, w1, w2, w3, counts = _moe_inputs(**kw)
    gy = torch.randn(x.shape[0], x.shape[1], generator=torch.Generator().manual_seed(1))
    ref_in = [t.clone().requires_grad_(True) for t in (x, w1, w2, w3)]
    ref = moe_reference(*ref_in, counts)
    ref.backward(gy)
    k_in = [t.clone().requires_grad_(True) for t in (x, w1, w2, w3)]
    out = op(*k_in, counts)
    out.backward(gy)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)
    for a, b in zip(k_in, ref_in):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=1e-5)
    assert (ref - torch.zeros_like(ref)).abs().max() > 0.1  # a meaningful signal


@pytest.mark.parametrize("path", ["padded", "loop", "skewed"])
def test_moe_fast_matches_reference(path):
    if path == "padded":
        _check_moe(lambda *a: moe_fast(*a, pad_limit=2.0))
    elif path == "loop":
        _check_moe(lambda *a: moe_fast(*a, pad_limit=0.0))
    else:
        _check_moe(lambda *a: moe_fast(*a, pad_limit=2.0), skew=True)


def _check_rope(apply):
    g = torch.Generator().manual_seed(0)
    B, L, NH, H = 2, 8, 3, 16
    x = torch.randn(B, L, NH, H, generator=g)
    ang = torch.rand(1, L, 1, H // 2, generator=g) * 6
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1), torch.cat([ang.sin(), (ang * 1.3).sin()], -1)  # unequal halves
    gy = torch.randn(B, L, NH, H, generator=g)
    xr, xk = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    ref = rope_reference(xr, cos, sin)
    ref.backward(gy)
    out = apply(xk, cos, sin)
    out.backward(gy)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)
    torch.testing.assert_close(xk.grad, xr.grad, rtol=0, atol=1e-5)


def test_rope_fast_matches_reference():
    _check_rope(rope_fast)


def _triton_checks():
    """Runs in a fresh process with TRITON_INTERPRET=1 set before triton is imported (Triton reads it
    at import and at @jit time; torchtitan imports triton, so the pytest process cannot switch)."""
    from qwen3_research.kernels import triton_kernels as tk

    _check_moe(tk.moe_triton, E=4, D=24, Fh=40, tokens=24)
    _check_moe(tk.moe_triton, E=4, D=24, Fh=40, tokens=24, skew=True)
    _check_rope(tk.rope_triton)
    print("triton kernels match the float32 references")


def test_triton_kernels_match_references_under_interpreter():
    import subprocess
    import sys

    pytest.importorskip("triton")
    proc = subprocess.run([sys.executable, "-c", "from tests.test_kernels import _triton_checks; _triton_checks()"],
                          cwd=ROOT, env=cli_env(TRITON_INTERPRET="1"), capture_output=True, text=True, timeout=600)
    assert_ok(proc)
    assert "triton kernels match the float32 references" in proc.stdout


def test_opcheck_fake_impls_and_autograd():
    x, w1, w2, w3, counts = _moe_inputs(E=4, D=8, Fh=8, tokens=6)
    args = (x.requires_grad_(True), w1.requires_grad_(True), w2.requires_grad_(True), w3.requires_grad_(True), counts, 2.0)
    torch.library.opcheck(moe_experts_fwd, args, test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
    q = torch.randn(1, 4, 2, 8, requires_grad=True)
    torch.library.opcheck(rope_fast_op, (q, torch.rand(1, 4, 1, 8), torch.rand(1, 4, 1, 8), False))


def test_custom_ops_under_torch_compile():
    x, w1, w2, w3, counts = _moe_inputs(E=4, D=16, Fh=16, tokens=8)
    cos, sin = torch.rand(1, 4, 1, 16), torch.rand(1, 4, 1, 16)
    q = torch.randn(2, 4, 2, 16)

    def f(x, w1, w2, w3, q):
        return moe_fast(torch.tanh(x), w1, w2, w3, counts).sum() + rope_fast(q * 2, cos, sin).square().sum()

    ins = [t.clone().requires_grad_(True) for t in (x, w1, w2, w3, q)]
    eager = f(*ins)
    eager.backward()
    cins = [t.clone().requires_grad_(True) for t in (x, w1, w2, w3, q)]
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)(*cins)
    compiled.backward()
    torch.testing.assert_close(compiled, eager)
    for a, b in zip(cins, ins):
        torch.testing.assert_close(a.grad, b.grad)


# ----------------------------------------------------------------------------------- CLIs
def test_verify_kernels_cli(tmp_path):
    proc = run_cli(["model=native_moe", "kernels=fast", "data.seq_len=32", "data.batch_size=2"], module="qwen3_research.verify_kernels")
    assert_ok(proc)
    assert "moe_fast     x(128,128) E=8 F=128 top2 float32" in proc.stdout, proc.stdout
    assert "rope_fast    x(2,32,4,32) float32" in proc.stdout
    assert "2/2 kernel(s) pass" in proc.stdout
    bad = run_cli(["model=native_moe", "kernels=nki_rope", "data.seq_len=300"], module="qwen3_research.verify_kernels")
    assert bad.returncode == 2
    # the device rule comes first (issue 40): on cpu the NKI kernel is refused for its device, in one line, before its
    # shape rules (those are checked on a neuron device double above)
    assert bad.stderr.strip().splitlines() == [
        "config error: kernels=nki_rope needs device neuron (kernel nki_rope); this run's device is cpu; these are "
        "Trainium (NKI) kernels (device=neuron); on cpu/cuda use kernels=moe_fast / rope_fast (or triton_moe / "
        "triton_rope on cuda)"], bad.stderr


def _run(tmp_path, name, args, steps=10, env=None):
    fast = [a for a in FAST if not a.startswith("training.steps")] + [f"training.steps={steps}"]
    proc = run_cli(["model=native_moe", *fast, *args], run_dir=tmp_path / name, timeout=600, env=env)
    assert_ok(proc)
    return proc, train_losses(tmp_path / name)


@pytest.mark.feature("CPU kernels (kernels=fast)")
def test_ten_steps_with_kernels_reproduce_the_float32_reference_run(tmp_path):
    proc, fast = _run(tmp_path, "fast", ["kernels=fast", "kernels.force=true"])
    assert "kernel plan (kernels=fast): 8 module(s) overridden" in proc.stdout  # printed by the run
    _, ref = _run(tmp_path, "ref", ["kernels=reference"])
    assert len(fast) == len(ref) == 10
    diff = max(abs(a - b) for a, b in zip(fast, ref))
    print(f"10-step max |loss(fast) - loss(fp32 reference)| = {diff:.3e}")
    assert diff < 1e-4, (fast, ref)


def test_ten_steps_rope_kernel_reproduces_torchtitan_dense(tmp_path):
    fast = [a for a in FAST if not a.startswith("training.steps")] + ["training.steps=10"]
    a = run_cli(["model=native", *fast, "kernels=rope_fast", "kernels.force=true"], run_dir=tmp_path / "a", timeout=600)
    b = run_cli(["model=native", *fast, "kernels=none"], run_dir=tmp_path / "b", timeout=600)
    assert_ok(a)
    assert_ok(b)
    la, lb = train_losses(tmp_path / "a"), train_losses(tmp_path / "b")
    diff = max(abs(x - y) for x, y in zip(la, lb))
    print(f"10-step dense max |loss(rope_fast) - loss(torchtitan)| = {diff:.3e}")
    assert len(la) == 10 and diff < 1e-4


@pytest.mark.slow
# tp2 (the kernels inside tensor-parallel blocks); fsdp with kernels=fast and with kernels=reference, each against
# its one-process twin, is the pairwise matrix's (docs/PAIRWISE.md)
@pytest.mark.parametrize("layout", [
    ["parallelism.nproc_per_node=2", "parallelism.tp=2", "parallelism.dp_shard=1"],
], ids=["tp2"])
@pytest.mark.feature("tensor parallel without sequence parallel")
def test_kernels_multi_process(tmp_path, layout):
    """tp2 without sequence parallelism (parallelism.sequence_parallel defaults to false): the layout says tp=2 (not
    tp=2+sp) and each rank's transformer blocks get the whole sequence (2×32 tokens; with SP they would get 2×16),
    read in the workers by the test hook QWEN3_TEST_BLOCK_INPUT (tests/hooks). Same losses alone cannot tell SP
    from none."""
    proc, fast = _run(tmp_path, "fast", ["kernels=fast", "kernels.force=true", *layout], steps=4)
    assert "kernel plan (kernels=fast): 8 module(s) overridden" in proc.stdout  # installed in the workers
    probe = tmp_path / "block_input"
    probe.mkdir()
    proc, ref = _run(tmp_path, "ref", ["kernels=reference", *layout], steps=4,
                     env=cli_env(**hooks_env(QWEN3_TEST_BLOCK_INPUT=str(probe))))
    assert "kernel plan (kernels=reference): 8 module(s) overridden" in proc.stdout
    seen = {p.stem: json.loads(p.read_text()) for p in sorted(probe.glob("rank*.json"))}
    print(f"block input per rank: {seen}")
    assert "dp_shard=1 tp=2 " in proc.stdout and "tp=2+sp" not in proc.stdout
    assert sorted(seen) == ["rank0", "rank1"] and all(s["local_shape"][:2] == [2, 32] and s["placements"] == ["R"]
                                                     for s in seen.values()), seen
    diff = max(abs(a - b) for a, b in zip(fast, ref))
    print(f"{layout}: max |loss(fast) - loss(fp32 reference)| = {diff:.3e}")
    assert len(fast) == 4 and diff < 1e-4


# ----------------------------------------------------------------------------------- NKI
HAS_NEURON = importlib.util.find_spec("torch_neuronx") is not None and devices.neuron_available()


@pytest.mark.skipif(not HAS_NEURON, reason="NKI kernels need torch_neuronx and a Trainium device (not importable here)")
def test_nki_kernels_match_references_on_trainium():
    # nki_moe needs H >= 512 (moe_cte): nki_debug, the smallest flavor the kernels take, and bf16 (their dtype)
    proc = run_cli(["model=native_moe", "model.flavor=nki_debug", "device=neuron", "kernels=nki_moe",
                    "training.mixed_precision=bf16", "data.seq_len=256", "data.batch_size=1"],
                   module="qwen3_research.verify_kernels", timeout=1800)
    assert_ok(proc)
    proc = run_cli(["model=native_moe", "device=neuron", "kernels=nki_rope", "data.seq_len=256", "data.batch_size=1"],
                   module="qwen3_research.verify_kernels", timeout=1800)
    assert_ok(proc)
