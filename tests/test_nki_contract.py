"""nki_rope / nki_moe wrappers (qwen3_research/kernels/nki.py) checked on CPU against test doubles of the
NKI Library kernels' documented contracts (tests/nki_contract_doubles.py; nothing here is Trainium).

* the full ops (wrapper + contract double) match rope_reference / moe_reference, forward and backward;
* the block plan has the library's block-to-expert semantics;
* the MoE op traces with fake tensors, and two routings give one graph (static capacity);
* every kernel-level constraint is a one-line ConfigError at start-up.
"""

from __future__ import annotations

import dataclasses
import warnings
from types import SimpleNamespace

import pytest
import torch

from qwen3_research import devices

devices.prepare_torchtitan("cpu")

from qwen3_research.config import ConfigError, KernelEntry, RunConfig  # noqa: E402
from qwen3_research.kernels import KERNELS, KernelMatchWarning, resolve  # noqa: E402
from qwen3_research.kernels import nki  # noqa: E402
from qwen3_research.kernels.moe import moe_reference  # noqa: E402
from qwen3_research.kernels.rope import rope_reference  # noqa: E402
from qwen3_research.kernels.verify import _err, random_routing  # noqa: E402
from tests import nki_contract_doubles as dbl  # noqa: E402
from tests.conftest import run_cli  # noqa: E402

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
    from qwen3_research.models.native.model import NativeQwen3

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
    from qwen3_research.models.native.model import NativeQwen3

    return NativeQwen3(ModelConfig(backend="native_moe", flavor="30B-A3B"), torch.device("cpu"), 256, 0).model


@pytest.fixture(scope="module")
def tiny_moe():
    from qwen3_research.config import ModelConfig
    from qwen3_research.models.native.model import NativeQwen3

    return NativeQwen3(ModelConfig(backend="native_moe", flavor="tiny"), torch.device("cpu"), 256, 0).model


# The compute dtype a run's PrecisionPlan gives each training.mixed_precision (resolve.PrecisionPlan.compute_dtype):
# kernels.resolve takes it from the plan; these tests build no run.
DTYPE = {"bf16": "bfloat16", "none": "float32"}


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
        resolve(model, cfg, device, dtype=DTYPE[cfg.training.mixed_precision])
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
        plan = resolve(big_moe, _cfg("nki_moe", EXPERTS), NEURON2, dtype="bfloat16")
    assert len(plan["nki_moe"]) == 48  # every MoE layer of 30B-A3B
    texts = [str(w.message) for w in rec]
    assert any("expert width I_TP=768 is outside moe_cte's documented range 2048..16384" in t for t in texts)
    assert any("128 experts is outside moe_cte's documented range 8..64" in t for t in texts)
    plan = resolve(big_moe, _cfg("nki_rope", "type:CosSinRoPE", seq_len=512), NEURON2, dtype="bfloat16")
    assert len(plan["nki_rope"]) == 48


# ----------------------------------------------------------------------------------- tolerance
def test_verify_uses_the_kernel_specs_tolerance(monkeypatch):
    from qwen3_research.config import ModelConfig
    from qwen3_research.kernels import apply_overrides
    from qwen3_research.kernels.verify import verify_plan
    from qwen3_research.models.native.model import NativeQwen3

    model = NativeQwen3(ModelConfig(backend="native", flavor="tiny"), torch.device("cpu"), 32, 0).model
    cfg = RunConfig()
    cfg.kernels.entries = [KernelEntry(name="rope_fast", target="type:CosSinRoPE")]
    cfg.kernels.force = True  # rope_fast is measured slower on some CPUs: the tolerance is the point here
    cfg.data.seq_len, cfg.data.batch_size = 32, 2
    cpu = SimpleNamespace(type="cpu", lnc=None, torch_device=torch.device("cpu"))
    plan = apply_overrides(model, cfg, cpu, dtype="float32")
    (check,) = verify_plan(model, plan, cfg, cpu, printer=lambda s: None, dtype="float32")
    assert check.tol == 1e-5 and check.ok  # the spec's float32 tolerance
    monkeypatch.setattr(KERNELS["rope_fast"], "tolerance", {"float32": 1e-12})
    (check,) = verify_plan(model, plan, cfg, cpu, printer=lambda s: None, dtype="float32")
    print(f"rope_fast rel err {max(check.fwd_rel, check.bwd_rel):.2e} vs spec tolerance {check.tol}")
    assert check.tol == 1e-12 and not check.ok  # rounding (~1e-7) now exceeds the spec's tolerance


# ----------------------------------------------------------------------------------- wrap_nki's constants
def _moe_kernel_args(dtype=torch.bfloat16):
    """Tensor arguments of one shard-on-I / moe_cte launch, as the wrapper builds them."""
    E, H, I, counts, B, _ = MOE_CASES["uneven_empty_experts"]
    x, w1, w2, w3, _ = _moe_case(E, H, I, counts)
    R = x.shape[0]
    tpi, b2e, aff = nki.block_plan(counts, R, E, B, nki.capacity_blocks(R, E, B), dtype)
    return dict(hidden_states=nki._with_pad_row(x, dtype), expert_affinities_masked=aff,
                gate_up_proj_weight=nki.gate_up_layout(w1, w3, dtype), down_proj_weight=nki.down_layout(w2, dtype),
                token_position_to_id=tpi, block_to_expert=b2e, block_size=B, compute_dtype=dtype,
                is_tensor_update_accumulating=False)


def test_wrap_nki_rejects_an_unhashable_constant_argument():
    """torch_neuronx hashes every non-tensor kernel argument: nkilib's MoECTESpec (a plain dataclass,
    __hash__ None) fails as it would on a Trainium host, before the kernel runs; so does an unhashable
    value inside a list; a hashable spec of the same content passes."""
    spec = dbl.MoECTESpec(dbl.MoECTEImplementation.shard_on_i, shard_on_I=dbl.ShardOnIConfig(checkpoint_activation=True))
    assert dbl.MoECTESpec.__hash__ is None  # what @dataclass (eq=True, not frozen) does
    dbl.LAUNCHES.clear()
    with pytest.raises(RuntimeError, match=r"^sema\.err_nki_param_not_hashable") as e:
        dbl.wrap_nki(dbl.moe_cte)[(2,)](**_moe_kernel_args(), spec=spec)
    print(f"moe_cte(spec=MoECTESpec(...)) through wrap_nki: {type(e.value).__name__}: {e.value}")
    assert dbl.LAUNCHES == []  # rejected before anything ran
    with pytest.raises(RuntimeError, match="err_nki_param_not_hashable"):
        dbl.wrap_nki(dbl.blockwise_mm_baseline_shard_intermediate)[(2,)](
            **_moe_kernel_args(), gate_clamp_upper_limit=[dbl.ShardOnIConfig()])  # inside a list: mapped, then hashed
    frozen = dataclasses.make_dataclass("FrozenSpec", [("implementation", object), ("shard_on_I", object)], frozen=True)
    hashable_cfg = dataclasses.make_dataclass("FrozenCfg", [("checkpoint_activation", bool),
                                                            ("expert_affinity_multiply_on_I", bool)], frozen=True)
    out = dbl.wrap_nki(dbl.moe_cte)[(2,)](**_moe_kernel_args(), spec=frozen(
        dbl.MoECTEImplementation.shard_on_i, hashable_cfg(True, False)))
    assert len(out) == 3 and dbl.LAUNCHES == [("moe_cte", (2,))]  # the hashable spec ran


def test_the_projects_nki_calls_pass_wrap_nkis_hashing():
    """The wrappers' launches (rope_hf fwd/bwd, the shard-on-I forward, blockwise_mm_bwd) in bfloat16: every
    constant argument hashes, the forward's are moe_cte's shard_on_i ones with POST_SCALE explicit, and a
    second step registers no new constant set (one compiled kernel per shape, not one per call)."""
    E, H, I, counts, B, lnc = MOE_CASES["uneven_empty_experts"]
    x, w1, w2, w3, gy = _moe_case(E, H, I, counts)
    q, k = torch.randn(1, 256, 4, 64), torch.randn(1, 256, 2, 64)
    cos, sin = torch.rand(1, 256, 1, 64), torch.rand(1, 256, 1, 64)
    dbl.CONSTANT_KEYS.clear()
    for _ in range(2):  # two training steps
        ins = [t.clone().requires_grad_(True) for t in (x, w1, w2, w3)]
        OPS.moe(*ins, counts, B, lnc=lnc, dtype=torch.bfloat16).float().backward(gy)
        qr, kr = q.clone().requires_grad_(True), k.clone().requires_grad_(True)
        sum(t.sum() for t in OPS.rope(qr, kr, cos, sin, lnc=lnc)).backward()
    fwd = dbl.CONSTANTS[SHARD_ON_I]
    print({name: len(keys) for name, keys in dbl.CONSTANT_KEYS.items()}, {k: v for k, v in fwd.items() if v is not None})
    assert fwd["expert_affinities_scaling_mode"] == dbl.ExpertAffinityScaleMode.POST_SCALE  # not the PRE_SCALE default
    assert fwd["checkpoint_activation"] is True and fwd["expert_affinity_multiply_on_I"] is False
    assert fwd["is_tensor_update_accumulating"] is False and fwd["block_size"] == B
    assert dbl.CONSTANT_KEYS.keys() == {SHARD_ON_I, "blockwise_mm_bwd", "rope_hf"}
    assert {name: len(keys) for name, keys in dbl.CONSTANT_KEYS.items()} == {
        SHARD_ON_I: 1, "blockwise_mm_bwd": 1, "rope_hf": 2}  # rope: backward=False and backward=True


def test_wrap_nki_fake_path_takes_shapes_from_a_meta_trace():
    """On fake tensors the launch returns empty tensors of the shapes the kernel gives on meta tensors
    (torch_neuronx's get_dumped_config), the shapes the real call returns."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    args = _moe_kernel_args()
    real = dbl.wrap_nki(dbl.blockwise_mm_baseline_shard_intermediate)[(2,)](**args, **nki.shard_on_i_constants(
        dbl.ActFnType, dbl.ExpertAffinityScaleMode))
    with FakeTensorMode() as mode:
        fake_args = {n: mode.from_tensor(v) if isinstance(v, torch.Tensor) else v for n, v in args.items()}
        fake = dbl.wrap_nki(dbl.blockwise_mm_baseline_shard_intermediate)[(2,)](**fake_args, **nki.shard_on_i_constants(
            dbl.ActFnType, dbl.ExpertAffinityScaleMode))
    print("fake path shapes:", [tuple(t.shape) for t in fake])
    assert all(isinstance(t, FakeTensor) for t in fake)
    assert [(t.shape, t.dtype) for t in fake] == [(t.shape, t.dtype) for t in real]


# ----------------------------------------------------------------------------------- 32K tokens per call
def test_more_rows_than_a_call_takes_are_split_into_calls(widened):
    """R rows with tokens_per_call=T: ceil(R / (T-1)) launches of <= T-1 rows (+ the padding row), each with
    its own counts; forward and backward equal the reference as for one call."""
    E, H, I, counts, B, lnc = MOE_CASES["block512"]  # 600 rows
    x, w1, w2, w3, gy = _moe_case(E, H, I, counts)
    ref_in = [t.clone().requires_grad_(True) for t in (x, w1, w2, w3)]
    ref = moe_reference(*ref_in, counts)
    ref.backward(gy)
    k_in = [t.clone().requires_grad_(True) for t in (x, w1, w2, w3)]
    dbl.LAUNCHES.clear()
    y = OPS.moe(*k_in, counts, B, lnc=lnc, dtype=torch.float32, tokens_per_call=251)
    y.backward(gy)
    fwd = _err(y, ref)[1]
    bwd = max(_err(a.grad, b.grad)[1] for a, b in zip(k_in, ref_in))
    print(f"600 rows, tokens_per_call=251: calls {nki.row_chunks(600, 251)}; rel err fwd {fwd:.2e} bwd {bwd:.2e}")
    assert nki.row_chunks(600, 251) == [250, 250, 100]
    assert [n for n, _ in dbl.LAUNCHES] == [SHARD_ON_I] * 3 + ["blockwise_mm_bwd"] * 3
    assert fwd <= 1e-5 and bwd <= 1e-5
    # the documented limit: 32,767 rows + the padding row fit one call, 32,768 (seq 4096 x top-8) take two
    assert nki.row_chunks(32767) == [32767] and nki.row_chunks(32768) == [32767, 1]


def test_nki_moe_cost_is_stated_for_30b_a3b_at_seq_4096(big_moe):
    """The kernel plan's terms for Qwen3-30B-A3B at seq 4096, batch 1 (AWS's sequence length): 32,768 routed
    rows split into 2 calls (32,767 + 1); padding and saved bytes from the static capacity: ≈21 GiB saved
    for backward over 48 layers without activation checkpointing, one layer's with it."""
    cfg = _cfg("nki_moe", "type:GroupedExperts", seq_len=4096)
    module = next(m for m in big_moe.modules() if type(m).__name__ == "GroupedExperts")
    c = nki.moe_cost(module, {"block_size": 256}, cfg, NEURON2, layers=48)
    lines, saved = nki._describe_moe(module, {"block_size": 256}, cfg, NEURON2, 48)
    print("\n".join(lines))
    assert (c["rows"], c["calls"], c["blocks"]) == (32768, 2, 255 + 1)  # floor((32767 + 128·255) / 256) + 1
    assert saved == c["saved_bytes"] == 48 * 256 * (2 * 768 * 256 + 256 * 2048) * 2  # no AC: every layer's
    assert "split into 2 kernel calls" in lines[0] and "× 48 held at once" in lines[1]
    assert 20.5 < saved / 1024**3 < 21.5
    cfg.parallelism.activation_checkpoint = "full"
    assert nki.moe_cost(module, {"block_size": 256}, cfg, NEURON2, layers=48)["saved_bytes"] == saved // 48


def test_the_debug_flavor_meets_every_nki_constraint():
    """model.flavor=nki_debug is the smallest MoE the kernels take: nki_moe and nki_rope resolve on one LNC=2
    rank with no error (only the documented-range warning for I_TP=512, as for 30B-A3B's 768)."""
    from qwen3_research.config import ModelConfig
    from qwen3_research.models import get_flavor
    from qwen3_research.models.native.model import NativeQwen3

    f = get_flavor("native_moe", "nki_debug")
    model = NativeQwen3(ModelConfig(backend="native_moe", flavor="nki_debug"), torch.device("meta"), 256, 0).model
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        moe = resolve(model, _cfg("nki_moe", "type:GroupedExperts", flavor="nki_debug"), NEURON2, dtype="bfloat16")
        rope = resolve(model, _cfg("nki_rope", "type:CosSinRoPE", flavor="nki_debug"), NEURON2, dtype="bfloat16")
    texts = [str(w.message) for w in rec if issubclass(w.category, KernelMatchWarning)]
    print(f"nki_debug: dim {f.dim}, {f.n_layers} layers, {f.num_experts} experts of width {f.hidden_dim}, "
          f"top-{f.top_k}, head_dim {f.head_dim}; warnings: {texts}")
    assert len(moe["nki_moe"]) == len(rope["nki_rope"]) == f.n_layers == 2
    assert texts == ["kernels=nki_moe: expert width I_TP=512 is outside moe_cte's documented range 2048..16384 (not "
                     "asserted by the kernel; AWS's own tests run shard_on_i at 768 and 1536); check on hardware"]


def test_plan_a_trainium_kernel_run_on_cpu(tmp_path):
    """qwen3_research.plan for the debug flavor with kernels=nki_moe on device=neuron, on this CPU host:
    the capacity comes from device.memory_gib, the kernel's terms are printed, nothing claims Neuron."""
    args = ["model=native_moe", "model.flavor=nki_debug", "kernels=nki_moe", "device=neuron", "device.memory_gib=24",
            "training.mixed_precision=bf16", "data.seq_len=256", "data.batch_size=1"]
    proc = run_cli(args, module="qwen3_research.plan")
    print(proc.stdout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "cost per micro-batch: 512 routed rows (batch × seq_len × top-2), 1 kernel call" in proc.stdout
    assert "saved for backward: " in proc.stdout and "kernel saved" in proc.stdout
    assert "planned for device=neuron, which this host does not have" in proc.stdout
    assert "capacity per rank: 24.00 GiB (device.memory_gib); verdict: fits" in proc.stdout
    missing = run_cli(args[:4] + args[5:], module="qwen3_research.plan")
    assert missing.returncode == 2 and "planning it needs device.memory_gib" in missing.stderr
