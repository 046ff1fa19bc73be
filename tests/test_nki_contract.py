"""nki_rope / nki_moe wrappers (qwen3_research/kernels/nki.py) checked on CPU against test doubles of the
NKI Library kernels' documented contracts (tests/nki_contract_doubles.py; nothing here is Trainium).

* the full ops (wrapper + contract double) match rope_reference / moe_reference, forward and backward;
* the block plan has the library's block-to-expert semantics;
* the MoE op traces with fake tensors, and two routings give one graph (static capacity);
* every kernel-level constraint is a one-line ConfigError at start-up.
"""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import pytest
import torch

from qwen3_research import device as devices

devices.prepare_torchtitan("cpu")

from qwen3_research.config import ConfigError, KernelEntry, RunConfig  # noqa: E402
from qwen3_research.kernels import KERNELS, KernelMatchWarning, resolve  # noqa: E402
from qwen3_research.kernels import nki  # noqa: E402
from qwen3_research.kernels.moe import moe_reference  # noqa: E402
from qwen3_research.kernels.rope import rope_reference  # noqa: E402
from qwen3_research.kernels.verify import _err, random_routing  # noqa: E402
from tests import nki_contract_doubles as dbl  # noqa: E402

OPS = nki.build_ops(dbl.backend(), prefix="nki_double")  # the wrappers over the contract doubles
EXPERTS = "layers.*.moe.routed_experts.inner_experts"
SHARD_ON_I = "blockwise_mm_baseline_shard_intermediate"  # what moe_cte runs for shard_on_i, called directly


@pytest.fixture(autouse=True)
def neuron_packages_here(monkeypatch):
    """A simulated Neuron host: the registry's package check finds torch_neuronx, nki and nkilib."""
    dbl.pretend_neuron_packages(monkeypatch)


@pytest.fixture
def widened():
    """Let the MoE doubles take float32 (the real kernels: bf16/fp16) so the layout logic is checked at 1e-5."""
    dbl.set_widen_float32(True)
    yield
    dbl.set_widen_float32(False)


# ----------------------------------------------------------------------------------- RoPE
@pytest.mark.parametrize("B,L,NQ,NK,D,lnc,batched", [
    (2, 256, 4, 2, 32, 2, False),  # GQA, LNC=2: seq split over two programs
    (1, 128, 3, 1, 64, 1, False),  # LNC=1
    (2, 512, 2, 2, 128, 2, True),  # per-batch cos/sin [B, L, D] (positions given)
])
def test_nki_rope_matches_reference_forward_and_backward(B, L, NQ, NK, D, lnc, batched):
    g = torch.Generator().manual_seed(L + D)
    ang = torch.rand(B if batched else 1, L, 1, D // 2, generator=g) * 6
    cos = torch.cat([ang.cos(), (ang * 0.7).cos()], -1)  # unequal halves: catches a swapped half
    sin = torch.cat([ang.sin(), (ang * 1.3).sin()], -1)
    q, k = torch.randn(B, L, NQ, D, generator=g), torch.randn(B, L, NK, D, generator=g)
    gq, gk = torch.randn(B, L, NQ, D, generator=g), torch.randn(B, L, NK, D, generator=g)
    qr, kr = q.clone().requires_grad_(True), k.clone().requires_grad_(True)
    ((rope_reference(qr, cos, sin) * gq).sum() + (rope_reference(kr, cos, sin) * gk).sum()).backward()
    qk, kk = q.clone().requires_grad_(True), k.clone().requires_grad_(True)
    dbl.LAUNCHES.clear()
    qo, ko = OPS.rope(qk, kk, cos, sin, lnc=lnc)
    ((qo * gq).sum() + (ko * gk).sum()).backward()
    errs = [_err(qo, rope_reference(q, cos, sin))[0], _err(ko, rope_reference(k, cos, sin))[0],
            _err(qk.grad, qr.grad)[0], _err(kk.grad, kr.grad)[0]]
    print(f"rope {B}x{L}x{NQ}/{NK}x{D} lnc={lnc}: max abs err q, k, dq, dk = {errs}")
    assert max(errs) <= 1e-5  # float32 end to end: only rounding
    assert qo.shape == q.shape and ko.shape == k.shape
    assert dbl.LAUNCHES == [("rope_hf", (lnc,)), ("rope_hf", (lnc,))]  # fwd + bwd, each on the LNC grid


def test_nki_rope_installs_on_the_models_rope_module():
    """The real CosSinRoPE cache layout goes through the wrapper: a tiny dense model's forward is unchanged."""
    from qwen3_research.config import ModelConfig
    from qwen3_research.kernels.rope import install_rope
    from qwen3_research.models.native import NativeQwen3

    model = NativeQwen3(ModelConfig(backend="native", flavor="tiny"), torch.device("cpu"), 256, 0).model
    tokens = torch.randint(0, 1000, (1, 256), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(tokens)
        apply = lambda q, k, c, s: OPS.rope(q, k, c, s, lnc=2)  # noqa: E731
        for name, m in model.named_modules():
            if type(m).__name__ == "CosSinRoPE":
                install_rope("nki_rope_double", apply, pair=True)(m, {})
        dbl.LAUNCHES.clear()
        out = model(tokens)
    assert dbl.LAUNCHES == [("rope_hf", (2,))] * 4  # one launch (q and k) per layer: the kernel did run
    diff = (out - ref).abs().max().item()
    print(f"tiny dense model, rope via rope_hf double: max |logits - torchtitan| = {diff:.2e}")
    assert diff < 1e-4  # same math, float32; differences only from rounding order


# ----------------------------------------------------------------------------------- MoE
def _moe_case(E, H, I, counts, seed=0):
    g = torch.Generator().manual_seed(seed)
    R = int(counts.sum())
    return (torch.randn(R, H, generator=g), torch.randn(E, I, H, generator=g) * H**-0.5,
            torch.randn(E, H, I, generator=g) * I**-0.5, torch.randn(E, I, H, generator=g) * H**-0.5,
            torch.randn(R, H, generator=g))


MOE_CASES = {
    # name: (E, H, I, counts, block_size, lnc)
    "random_top2": (8, 512, 64, random_routing(20, 8, 2, torch.Generator().manual_seed(3)), 256, 2),
    "uneven_empty_experts": (4, 512, 128, torch.tensor([0, 290, 0, 10]), 256, 2),
    "fills_capacity_exactly": (4, 1024, 64, torch.tensor([1, 1, 1, 597]), 256, 1),
    "full_blocks_then_next_expert": (4, 512, 64, torch.tensor([256, 0, 44, 0]), 256, 2),  # block edges exact
    "block512": (8, 512, 64, torch.tensor([100, 0, 37, 300, 0, 0, 63, 100]), 512, 2),
}


@pytest.mark.parametrize("case", list(MOE_CASES))
def test_nki_moe_matches_reference_forward_and_backward(case, widened):
    E, H, I, counts, B, lnc = MOE_CASES[case]
    x, w1, w2, w3, gy = _moe_case(E, H, I, counts)
    R = x.shape[0]
    ref_in = [t.clone().requires_grad_(True) for t in (x, w1, w2, w3)]
    ref = moe_reference(*ref_in, counts)
    ref.backward(gy)
    k_in = [t.clone().requires_grad_(True) for t in (x, w1, w2, w3)]
    dbl.LAUNCHES.clear()
    y = OPS.moe(*k_in, counts, B, lnc=lnc, dtype=torch.float32)
    y.backward(gy)
    fwd = _err(y, ref)[1]
    bwd = max(_err(a.grad, b.grad)[1] for a, b in zip(k_in, ref_in))
    N = nki.capacity_blocks(R, E, B)
    used = int(((counts + B - 1) // B).sum())
    print(f"moe {case}: R={R} E={E} H={H} I={I} B={B} lnc={lnc}: blocks used {used}/{N}; "
          f"rel err fwd {fwd:.2e} bwd {bwd:.2e}")
    assert used <= N  # the fixed capacity holds this routing: nothing dropped
    if case == "fills_capacity_exactly":
        assert used == N == 6  # the worst case routing uses every block of the capacity
    assert fwd <= 1e-5 and bwd <= 1e-5  # rel = max abs err / max |reference|, as verify_kernels
    assert not torch.isnan(y).any()  # no row read from an unwritten (NaN in the double) output row
    assert dbl.LAUNCHES == [(SHARD_ON_I, (lnc,)), ("blockwise_mm_bwd", (lnc,))]


def test_nki_moe_bfloat16_path_matches_reference_within_aws_tolerance():
    """The production path: bfloat16 into the strict doubles (which refuse float32, as the real kernels)."""
    E, H, I, counts, B, lnc = MOE_CASES["uneven_empty_experts"]
    x, w1, w2, w3, gy = _moe_case(E, H, I, counts, seed=1)
    with pytest.raises(dbl.ContractError, match="Supported input dtypes: bfloat16, float16"):
        OPS.moe(x, w1, w2, w3, counts, B, lnc=lnc, dtype=torch.float32)
    ref_in = [t.clone().requires_grad_(True) for t in (x, w1, w2, w3)]
    ref = moe_reference(*ref_in, counts)
    ref.backward(gy)
    k_in = [t.clone().requires_grad_(True) for t in (x, w1, w2, w3)]
    y = OPS.moe(*k_in, counts, B, lnc=lnc, dtype=torch.bfloat16)
    y.float().backward(gy)
    fwd = _err(y, ref)[1]
    bwd = max(_err(a.grad, b.grad)[1] for a, b in zip(k_in, ref_in))
    tol = KERNELS["nki_moe"].tolerance["bfloat16"]
    print(f"moe bf16: rel err fwd {fwd:.2e} bwd {bwd:.2e} (tolerance {tol})")
    assert y.dtype == torch.bfloat16 and all(a.grad.dtype == torch.float32 for a in k_in)
    assert fwd <= tol and bwd <= tol  # 2e-2: AWS's own bf16 test tolerance for these kernels


def test_block_plan_has_the_librarys_block_to_expert_semantics():
    """counts [0, 290, 0, 10], B=256: expert 1 takes blocks 0-1, expert 3 block 2; capacity N=5 blocks,
    the two spare blocks belong to the last expert and hold only the padding row (AWS's generator)."""
    counts, R, E, B = torch.tensor([0, 290, 0, 10]), 300, 4, 256
    N = nki.capacity_blocks(R, E, B)
    tpi, b2e, aff = nki.block_plan(counts, R, E, B, N, torch.float32)
    assert N == 5 and tpi.dtype == b2e.dtype == torch.int32 and b2e.shape == (5, 1)
    assert b2e.flatten().tolist() == [1, 1, 3, 3, 3]
    expect = torch.full((N * B,), R, dtype=torch.int32)
    expect[0:290] = torch.arange(290)
    expect[512:522] = torch.arange(290, 300)
    assert torch.equal(tpi, expect)
    aff2 = aff.view(R + 1, E)
    assert aff2[:290, 1].eq(1).all() and aff2[290:300, 3].eq(1).all() and aff2.sum() == R  # one-hot, padding row 0


# ----------------------------------------------------------------------------------- static shapes
def _graph_signature(gm) -> list[str]:
    """Every node with the shape and dtype of its value: the graph and its shape signature."""
    out = []
    for n in gm.graph.nodes:
        v = n.meta.get("val")
        shape = tuple(v.shape) if isinstance(v, torch.Tensor) else None
        out.append(f"{n.op} {n.target} {shape} {getattr(v, 'dtype', None)}")
    return out


def test_nki_moe_traces_without_data_dependent_access_and_one_graph_serves_every_routing(widened):
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    E, H, I, B, lnc = 8, 512, 64, 256, 2
    a = torch.tensor([160, 0, 0, 0, 0, 0, 0, 0])  # everything on one expert
    b = random_routing(80, E, 2, torch.Generator().manual_seed(0))  # spread
    assert a.sum() == b.sum() == 160 and not torch.equal(a, b)
    x, w1, w2, w3, gy = _moe_case(E, H, I, a)

    # 1. the op, forward and backward, on fake tensors: any .item()/.tolist() would raise here
    with FakeTensorMode(allow_non_fake_inputs=False) as mode:
        fx, fw1, fw2, fw3, fgy, fc = (mode.from_tensor(t) for t in (x, w1, w2, w3, gy, b))
        ins = [t.requires_grad_(True) for t in (fx, fw1, fw2, fw3)]
        y = OPS.moe(*ins, fc, B, lnc=lnc, dtype=torch.float32)
        y.backward(fgy)
        assert y.shape == (160, H) and ins[1].grad.shape == w1.shape

    # 2. the wrapper bodies traced (fake and real tensors) for two routings: the same graph, node for node
    def fwd(x, w1, w2, w3, c):
        return OPS.moe_fwd_impl(x, w1, w2, w3, c, B, lnc, torch.float32)

    def bwd(gy, x, w1, w2, w3, c):
        _, gu, down = OPS.moe_fwd_impl(x, w1, w2, w3, c, B, lnc, torch.float32)
        return OPS.moe_bwd_impl(gy, x, w1, w2, w3, c, gu, down, B, lnc, torch.float32)

    for mode_name in ("fake", "real"):  # real tracing would bake any host-read value into the graph
        for f, args in ((fwd, (x, w1, w2, w3)), (bwd, (gy, x, w1, w2, w3))):
            ga = make_fx(f, tracing_mode=mode_name)(*args, a)
            gb = make_fx(f, tracing_mode=mode_name)(*args, b)
            assert ga.code == gb.code, f"{mode_name} trace of {f.__name__} differs between routings"
            assert _graph_signature(ga) == _graph_signature(gb)
            print(f"{mode_name} trace of {f.__name__}: {len(ga.graph.nodes)} nodes, identical for both routings")

    # 3. torch.compile: one compiled graph for both routings (no recompile), same numbers as eager
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")

    def step(x, w1, w2, w3, c):
        return OPS.moe(x, w1, w2, w3, c, B, lnc=lnc, dtype=torch.float32).square().sum()

    compiled = torch.compile(step, backend=counter, fullgraph=True)
    for c in (a, b):
        ins = [t.clone().requires_grad_(True) for t in (x, w1, w2, w3)]
        loss = compiled(*ins, c)
        loss.backward()
        eager = [t.clone().requires_grad_(True) for t in (x, w1, w2, w3)]
        step(*eager, c).backward()
        torch.testing.assert_close(ins[1].grad, eager[1].grad)
    print(f"torch.compile frames compiled for two routings: {counter.frame_count}")
    assert counter.frame_count == 1


# ----------------------------------------------------------------------------------- start-up checks
NEURON2 = SimpleNamespace(type="neuron", lnc=2, torch_device=torch.device("cpu"))


@pytest.fixture(scope="module")
def big_moe():
    """Qwen3-30B-A3B's real module shapes (H=2048, I=768, E=128), built on the meta device (no memory)."""
    from qwen3_research.config import ModelConfig
    from qwen3_research.models.native import NativeQwen3

    return NativeQwen3(ModelConfig(backend="native_moe", flavor="30B-A3B"), torch.device("cpu"), 256, 0).model


@pytest.fixture(scope="module")
def tiny_moe():
    from qwen3_research.config import ModelConfig
    from qwen3_research.models.native import NativeQwen3

    return NativeQwen3(ModelConfig(backend="native_moe", flavor="tiny"), torch.device("cpu"), 256, 0).model


def _cfg(name, target, flavor="30B-A3B", seq_len=256, mp="bf16", options=None, ep=1, tp=1):
    cfg = RunConfig()
    cfg.kernels.entries = [KernelEntry(name=name, target=target, options=options or {})]
    cfg.kernels.option = name
    cfg.model.backend, cfg.model.flavor = "native_moe", flavor
    cfg.data.seq_len, cfg.data.batch_size = seq_len, 1
    cfg.training.mixed_precision = mp
    cfg.parallelism.ep, cfg.parallelism.tp = ep, tp
    return cfg


def _one_line_error(model, cfg, device) -> str:
    with pytest.raises(ConfigError) as e, warnings.catch_warnings():
        warnings.simplefilter("ignore", KernelMatchWarning)
        resolve(model, cfg, device)
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_every_kernel_constraint_is_a_one_line_startup_error(big_moe, tiny_moe):
    cases = [
        # (model, cfg, device, expected start of the message or a fragment)
        (big_moe, _cfg("nki_rope", "type:CosSinRoPE", seq_len=384), NEURON2,
         "kernels=nki_rope needs data.seq_len to be a multiple of 128 × LNC = 256; got 384 (e.g. data.seq_len=512 or 256)"),
        (tiny_moe, _cfg("nki_moe", EXPERTS, flavor="tiny"), NEURON2,
         "kernels=nki_moe: hidden width H=128 (model.flavor=tiny) is outside moe_cte's range (512 <= H <= 8192, a multiple of 512)"),
        (big_moe, _cfg("nki_moe", EXPERTS, mp="none"), NEURON2,
         "kernels=nki_moe: the NKI Library MoE kernels take bfloat16/float16 only"),
        (big_moe, _cfg("nki_moe", EXPERTS), SimpleNamespace(type="cpu", lnc=None, torch_device=torch.device("cpu")),
         "kernels=nki_moe needs device neuron (kernel nki_moe); this run's device is cpu"),
        (big_moe, _cfg("nki_moe", EXPERTS), SimpleNamespace(type="neuron", lnc=1), "kernels=nki_moe needs LNC in [2]"),
        (big_moe, _cfg("nki_moe", EXPERTS, options={"block_size": 128}), NEURON2,
         "kernels=nki_moe: options.block_size=128 is not taken by both NKI Library MoE kernels"),
        (big_moe, _cfg("nki_moe", EXPERTS, ep=2), NEURON2, "kernels=nki_moe: needs parallelism.ep=1"),
        (big_moe, _cfg("nki_moe", EXPERTS, tp=8), NEURON2,  # 768 / 8 = 96 per rank: 96 / LNC=2 = 48, not % 32
         "kernels=nki_moe: expert width I_TP=96 (per tensor-parallel rank, parallelism.tp=8) must be a multiple of 16"),
    ]
    assert len(cases) == 8
    for model, cfg, device, expected in cases:
        msg = _one_line_error(model, cfg, device)
        print(msg)
        assert expected in msg, (expected, msg)
    # on a wrong device only the device line: the kernel checks run once the device fits
    msg = _one_line_error(tiny_moe, _cfg("nki_moe", EXPERTS, flavor="tiny", mp="none"),
                          SimpleNamespace(type="cpu", lnc=None))
    assert msg.startswith("kernels=nki_moe needs device neuron") and "hidden width" not in msg


def test_a_config_the_kernels_take_passes_with_the_documented_range_warnings(big_moe):
    with pytest.warns(KernelMatchWarning) as rec:
        plan = resolve(big_moe, _cfg("nki_moe", EXPERTS), NEURON2)
    assert len(plan["nki_moe"]) == 48  # every MoE layer of 30B-A3B
    texts = [str(w.message) for w in rec]
    assert any("expert width I_TP=768 is outside moe_cte's documented range 2048..16384" in t for t in texts)
    assert any("128 experts is outside moe_cte's documented range 8..64" in t for t in texts)
    plan = resolve(big_moe, _cfg("nki_rope", "type:CosSinRoPE", seq_len=512), NEURON2)
    assert len(plan["nki_rope"]) == 48


# ----------------------------------------------------------------------------------- tolerance
def test_verify_uses_the_kernel_specs_tolerance(monkeypatch):
    from qwen3_research.config import ModelConfig
    from qwen3_research.kernels import apply_overrides
    from qwen3_research.kernels.verify import verify_plan
    from qwen3_research.models.native import NativeQwen3

    model = NativeQwen3(ModelConfig(backend="native", flavor="tiny"), torch.device("cpu"), 32, 0).model
    cfg = RunConfig()
    cfg.kernels.entries = [KernelEntry(name="rope_fast", target="type:CosSinRoPE")]
    cfg.data.seq_len, cfg.data.batch_size = 32, 2
    cpu = SimpleNamespace(type="cpu", lnc=None, torch_device=torch.device("cpu"))
    plan = apply_overrides(model, cfg, cpu)
    (check,) = verify_plan(model, plan, cfg, cpu, printer=lambda s: None)
    assert check.tol == 1e-5 and check.ok  # the spec's float32 tolerance
    monkeypatch.setattr(KERNELS["rope_fast"], "tolerance", {"float32": 1e-12})
    (check,) = verify_plan(model, plan, cfg, cpu, printer=lambda s: None)
    print(f"rope_fast rel err {max(check.fwd_rel, check.bwd_rel):.2e} vs spec tolerance {check.tol}")
    assert check.tol == 1e-12 and not check.ok  # rounding (~1e-7) now exceeds the spec's tolerance
