"""The tt022 tier: the Neuron stack minus Neuron (Python 3.12, torch 2.14.0, transformers 5.16.0,
upstream torchtitan 0.2.2, the base of AWS's torchtitan-neuron 0.2.2+neuron.1).

CI builds that environment from requirements-tt022.lock and runs ``pytest -m tt022`` in it (.ci/run).
Everything here also runs in the main (torchtitan 0.3.0) environment: the cheap checks pass on both;
the multi-step runs that the main suite already makes on 0.3.0 (named in each skip reason) and the
refusals that only exist on 0.2.x are skipped there. ``@pytest.mark.feature`` marks write docs/FEATURES.md's
feature table (tests/feature_table.py): a test marked ``@only_on_legacy`` shows its row on 0.2.x, the others on both.
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from pathlib import Path

import pytest
import torch

from qwen3_research import titan
from tests.conftest import FAST, assert_ok, cli_env, fault_env, read_metrics, run_cli, train_losses

pytestmark = pytest.mark.tt022

LEGACY = titan.legacy()  # torchtitan 0.2.x API (file probe: no torchtitan code runs at collection)
ON_030 = "torchtitan 0.3.x here: the main suite covers this (tests/{})"


def only_on_legacy(covered_by: str):
    return pytest.mark.skipif(not LEGACY, reason=ON_030.format(covered_by))


def _backend(flavor_backend: str, seed: int):
    from qwen3_research import devices
    from qwen3_research.config import ModelConfig

    devices.prepare_torchtitan("cpu")
    from qwen3_research.models.native.model import NativeQwen3

    return NativeQwen3(ModelConfig(backend=flavor_backend, flavor="tiny"), torch.device("cpu"), 32, seed=seed)


# -- both versions ------------------------------------------------------------------------------


@pytest.mark.parametrize("backend,params,flops", [
    # Qwen3 tiny: 151,936×128 tied embedding + 4 layers; 6·params + 6·4 layers·4 heads·2·32·32 tokens.
    ("native", 20_235_648, 121_610_496),
    # tiny MoE: untied embeddings, 8 experts top-2 (a quarter of the expert weights are active).
    ("native_moe", 40_670_592, 120_455_424),
])
def test_params_and_flops_are_the_same_on_both_torchtitans(backend, params, flops):
    """0.3.0's formula on both (0.2.2's own undercounts a tied model: 787,840 params)."""
    b = _backend(backend, seed=0)
    print(f"\n[torchtitan {titan.version()}] {backend}/tiny params={b.num_params:,} flops/token(seq 32)={b.flops_per_token:,}")
    assert (b.num_params, b.flops_per_token) == (params, flops)


def test_seeded_init_is_deterministic():
    """Same seed: identical weights; another seed: different ones (the dense tiny model, full init on CPU)."""
    a, b, c = _backend("native", 7), _backend("native", 7), _backend("native", 8)
    sa, sb, sc = (dict(x.model.named_parameters()) for x in (a, b, c))
    same = all(torch.equal(sa[k], sb[k]) for k in sa)
    differ = sum(not torch.equal(sa[k], sc[k]) for k in sa)
    print(f"\n[torchtitan {titan.version()}] seed 7 twice identical: {same}; seed 8 differs in {differ}/{len(sa)} tensors")
    assert same
    assert differ == len([k for k in sa if "norm" not in k])  # norms start at 1 whatever the seed


@pytest.mark.feature("chunked loss (training.loss=chunked)")
def test_default_run_trains_and_the_chunked_loss_equals_the_full_one(tmp_path):
    """The default run (tiny dense, one CPU process), 3 steps, with training.loss=chunked and with full: exit 0,
    3 finite losses near ln(vocab), the same to 1e-5 (fp32; on 0.2.x the hidden states come from the adapter's
    model seam, titan/v02_seams.model_forward)."""
    runs = {}
    for loss in ("chunked", "full"):
        proc = run_cli([*FAST, f"training.loss={loss}"], run_dir=tmp_path / loss)
        assert_ok(proc)
        runs[loss] = train_losses(tmp_path / loss)
    print(f"\n[torchtitan {titan.version()}] chunked {runs['chunked']}\n{' ' * 20}full    {runs['full']} "
          f"(ln 151936 = {math.log(151936):.2f})")
    assert len(runs["chunked"]) == 3 and all(math.isfinite(x) for x in runs["chunked"])
    assert all(abs(x - math.log(151936)) < 1.5 for x in runs["chunked"])  # random init of a 151,936-way softmax
    assert max(abs(a - b) for a, b in zip(runs["chunked"], runs["full"])) <= 1e-5


def test_training_loss_auto_is_the_same_choice_on_both_torchtitans():
    """auto: chunked on cpu, full on cuda and neuron, whichever torchtitan API is installed (0.2.x used to
    resolve it to full: it had no hidden states without the lm_head)."""
    from qwen3_research.resolve import _loss_for_backend, device_spec

    for backend in ("native", "native_moe"):
        for loss in ("auto", "chunked"):
            cfg = {"model": {"backend": backend}, "training": {"loss": loss}}
            assert _loss_for_backend(cfg)["training"]["loss"] == loss
    assert (device_spec("cpu")[1].default_loss, device_spec("cuda")[1].default_loss) == ("chunked", "full")


@pytest.mark.feature("HF import (model.init_from)")
def test_init_from_logits_match_transformers(tmp_path):
    """model.init_from through the adapter's HF state-dict adapter: logits vs transformers within 1e-4 (fp32)."""
    from transformers import AutoModelForCausalLM

    from qwen3_research.config import ModelConfig
    from tests.test_hf import write_hf_checkpoint

    hf_dir = write_hf_checkpoint(tmp_path / "qwen3_tiny", moe=False)
    from qwen3_research import devices

    devices.prepare_torchtitan("cpu")
    from qwen3_research.models import build

    backend = build(ModelConfig(backend="native", flavor="tiny", init_from=str(hf_dir)), torch.device("cpu"),
                    seq_len=32, seed=1)
    backend.materialize()  # init_from loads after sharding (here: one process), each rank its own part
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="sdpa")
    x = torch.randint(0, 151669, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, theirs = backend.forward(x), hf(input_ids=x).logits
    diff = float((ours - theirs).abs().max())
    print(f"\n[torchtitan {titan.version()}] native(init_from) vs transformers max |logit diff| = {diff:.2e}")
    assert diff < 1e-4
    assert float(theirs.abs().max()) > 1e-2  # the comparison is not between two zero tensors


def test_moe_load_balancing_hook_moves_expert_bias():
    """The optimizer pre-step hook (0.3.0's own, or the adapter's copy of it for 0.2.x): counts
    [10,0,0,0,0,0,0,6] (mean 2) -> bias += 1e-3·sign(mean - count), centred: -1.5e-3 for the two busy
    experts, +0.5e-3 for the idle six; the counts are then zeroed. Runs on the built CPU model, no forward."""
    from qwen3_research.parallel import Degrees, build_parallel_dims

    b = _backend("native_moe", seed=0)
    dims = build_parallel_dims(Degrees(1, 1, 1, 1, 1, False), "cpu", single_process_mesh=True)
    opt = torch.optim.SGD(b.model.parameters(), lr=0.0)
    b.register_optimizer_hooks(opt, dims)
    bufs = dict(b.model.named_buffers())
    counts = [k for k in bufs if "tokens_per_expert" in k]
    biases = [k for k in bufs if "expert_bias" in k]
    for k in counts:
        bufs[k].copy_(torch.tensor([10.0, 0, 0, 0, 0, 0, 0, 6]))
    opt.step()
    want = torch.tensor([-1.5e-3, *[0.5e-3] * 6, -1.5e-3])
    print(f"\n[torchtitan {titan.version()}] {biases[0]} after one step: {bufs[biases[0]].tolist()}")
    assert len(counts) == len(biases) == 4  # one per MoE layer of tiny
    assert all(torch.allclose(bufs[k], want, atol=1e-9) for k in biases)
    assert all(not bufs[k].any() for k in counts)


@pytest.mark.feature("activation checkpointing")
@pytest.mark.parametrize("mode", ["full", "selective"])
def test_activation_checkpointing_keeps_the_losses(mode, tmp_path):
    """torchtitan's AC wrapper through the adapter (single process): the same 2 losses as without AC, and AC is
    really on: each of tiny's 4 blocks sits in torch's CheckpointWrapper and its forward runs again in the backward
    (2 steps × 4 blocks = 8 block forwards without AC, 16 with; selective is 0.3.x's per-op policy, which also
    recomputes the whole block and keeps only the listed ops' outputs). Same losses alone cannot tell AC from none."""
    from collections import Counter

    from tests.test_hf import run_in_process

    def counted(overrides, run_dir) -> Counter:
        calls = Counter()

        def hook(module, _args, _out):
            if torch.is_grad_enabled():  # training forwards and the backward's recompute, not evaluation
                name = type(module).__name__  # Qwen3TransformerBlock on 0.3.x, TransformerBlock on 0.2.x
                calls["TransformerBlock" if name.endswith("TransformerBlock") else name] += 1

        handle = torch.nn.modules.module.register_module_forward_hook(hook)
        try:
            run_in_process(overrides, run_dir)
        finally:
            handle.remove()
        return calls

    base = [o for o in FAST if not o.startswith("training.steps")] + ["training.steps=2"]
    plain_calls = counted(base, tmp_path / "plain")
    ac_calls = counted([*base, f"parallelism.activation_checkpoint={mode}"], tmp_path / "ac")
    plain, ac = train_losses(tmp_path / "plain"), train_losses(tmp_path / "ac")
    print(f"\n[torchtitan {titan.version()}] AC={mode}: {ac} vs none: {plain}; block forwards "
          f"{ac_calls['TransformerBlock']} vs {plain_calls['TransformerBlock']}, "
          f"CheckpointWrapper forwards {ac_calls['CheckpointWrapper']} vs {plain_calls['CheckpointWrapper']}")
    assert len(ac) == 2 and max(abs(a - b) for a, b in zip(ac, plain)) < 1e-5
    assert (plain_calls["TransformerBlock"], plain_calls["CheckpointWrapper"]) == (8, 0)
    assert (ac_calls["TransformerBlock"], ac_calls["CheckpointWrapper"]) == (16, 8), "AC applied to no block"


# -- multi-step runs on 0.2.x (the main suite makes them on 0.3.x) ------------------------------


@pytest.mark.feature("checkpoint resume after SIGKILL")
@only_on_legacy("test_checkpoint.py::test_resume_reproduces_steps_11_to_20")
@pytest.mark.slow
def test_checkpoint_resume_reproduces_the_straight_run(tmp_path):
    """6 steps straight vs killed at step 4 (after the step-3 save) + resume=auto: identical losses 4-6."""
    base = [o for o in FAST if not o.startswith("training.steps")] + [
        "training.steps=6", "checkpoint.enable=true", "checkpoint.every=3"]
    straight, run = tmp_path / "straight", tmp_path / "run"
    assert_ok(run_cli([*base, "checkpoint.export_hf=true"], run_dir=straight))
    killed = run_cli(base, run_dir=run, env=cli_env(**fault_env("kill@4")))
    assert killed.returncode == -9, killed.stderr[-2000:]
    resumed = run_cli([*base, "checkpoint.resume=auto"], run_dir=run)
    assert_ok(resumed)
    assert "step-00000003 at step 3" in resumed.stdout
    ref, got = train_losses(straight), train_losses(run)
    print(f"\n[torchtitan {titan.version()}] steps 4-6 straight {ref[3:]}\n                    resumed  {got[3:]}")
    assert len(ref) == 6 and got[-3:] == ref[3:]
    # The HF export (the adapter's to_hf) loads into transformers with every key in place.
    from transformers import AutoModelForCausalLM

    _, info = AutoModelForCausalLM.from_pretrained(straight / "hf", dtype=torch.float32, output_loading_info=True)
    print(f"export hf/: missing={info['missing_keys']} unexpected={info['unexpected_keys']}")
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]


@pytest.mark.feature("FSDP (parallelism.dp_shard)")
@only_on_legacy("test_parallel.py::test_torchrun_fsdp_parity_memory_and_one_run_dir")
@pytest.mark.slow
def test_fsdp_two_ranks_match_one_process(tmp_path):
    """dp_shard=2 (FSDP, tied embeddings in one unit) × batch 2 == one process × batch 4, to 1e-4 (fp32)."""
    base = [o for o in FAST if not o.startswith("data.batch_size")]
    assert_ok(run_cli([*base, "data.batch_size=4"], run_dir=tmp_path / "one"))
    assert_ok(run_cli([*base, "parallelism=fsdp", "data.batch_size=2"], run_dir=tmp_path / "fsdp", timeout=600))
    one, two = train_losses(tmp_path / "one"), train_losses(tmp_path / "fsdp")
    print(f"\n[torchtitan {titan.version()}] 1 process {one}\n                    FSDP×2    {two}")
    assert len(one) == len(two) == 3
    assert max(abs(a - b) for a, b in zip(one, two)) < 1e-4


# -- what the 0.2.x API cannot run: one line, exit 2, before any worker ------------------------------


@only_on_legacy("test_kernels.py::test_kernels_multi_process[tp2] trains TP without SP on 0.3.0")
@pytest.mark.feature("tensor parallel without sequence parallel", refused="0.2.x always shards the sequence with TP")
def test_tp_without_sequence_parallel_is_a_one_line_config_error(tmp_path):
    """0.2.2's TP plan hard-codes the sequence sharding (docs/PARALLELISM.md names the lines): exit 2, one line
    naming the torchtitan needed, no worker started."""
    proc = run_cli(["parallelism=tp2", "parallelism.sequence_parallel=false", *FAST], run_dir=tmp_path / "run")
    err = proc.stderr.strip()
    print(f"\n{err}")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert len(err.splitlines()) == 1 and ("parallelism.tp=2 with parallelism.sequence_parallel=false needs "
                                           "torchtitan>=0.3.0 (found 0.2.2): 0.2.x always shards the sequence with TP") in err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@only_on_legacy("test_pipeline.py::test_every_schedule_on_two_stages_equals_one_process pipelines on 0.3.0")
@pytest.mark.feature("pipeline parallel (parallelism.pp)", refused="0.2.x registers Qwen3 without pipelining")
def test_pipeline_parallel_is_a_one_line_config_error(tmp_path):
    """0.2.2's Qwen3 ModelSpec has pipelining_fn=None: exit 2, one line naming the torchtitan needed, no worker."""
    proc = run_cli(["model.flavor=tiny_untied", "parallelism.nproc_per_node=2", "parallelism.pp=2", *FAST],
                   run_dir=tmp_path / "run")
    err = proc.stderr.strip()
    print(f"\n{err}")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert len(err.splitlines()) == 1 and ("parallelism.pp=2 needs torchtitan>=0.3.0 (found 0.2.2): 0.2.x registers "
                                           "Qwen3 without pipelining") in err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@only_on_legacy("test_async_checkpoint.py")
@pytest.mark.feature("asynchronous checkpoints (checkpoint.async_mode)")
def test_an_async_save_on_the_legacy_stack_is_its_steps_state(tmp_path, monkeypatch):
    """Issue 42 deliver 5: checkpoint.async_mode on the tt022 stack (torch's dcp.async_save, Python 3.12). The main
    suite's test, run here: an async save holds its step's state and stays unpublished until its write completed."""
    from tests.test_async_checkpoint import test_an_async_save_is_its_steps_state_and_unpublished_until_written as check

    check(tmp_path, monkeypatch)


# -- kernels on both APIs (issue 22): never a vacuous pass, the contract doubles verify, MoE aligned ----


VERIFY_CASES = {
    # the command docs/KERNELS.md gave for trn2 first (it printed "0/0 kernel(s) pass", exit 0, on 0.2.2)
    "nki_rope": ["kernels=nki_rope"],
    "nki_moe_debug": ["model=native_moe", "model.flavor=nki_debug", "kernels=nki_moe", "data.seq_len=256",
                      "training.mixed_precision=bf16"],
    # nothing to replace, but the device rule comes first (issue 40): the device error, not "nothing verified"
    "nki_moe_on_a_dense_model": ["kernels=nki_moe"],
    "nki_rope_device_neuron": ["kernels=nki_rope", "device=neuron", "data.seq_len=256"],
}


@pytest.mark.parametrize("case", list(VERIFY_CASES))
def test_verify_kernels_nki_here_fails_with_its_reason(case):
    """No Neuron device here: verify_kernels for an NKI option exits nonzero with one line saying why, on both
    torchtitans; never "0/0 kernel(s) pass" with exit 0."""
    proc = run_cli(VERIFY_CASES[case], module="qwen3_research.verify_kernels")
    last = (proc.stderr.strip().splitlines() or [""])[-1]
    print(f"\n[torchtitan {titan.version()}] verify_kernels {' '.join(VERIFY_CASES[case])}: exit {proc.returncode}: {last}")
    assert proc.returncode in (1, 2), proc.stdout[-2000:] + proc.stderr[-2000:]
    assert last.startswith(("config error: ", "error: ")) and "Traceback" not in proc.stderr
    if case == "nki_moe_on_a_dense_model":
        assert proc.returncode == 2 and "needs device neuron (kernel nki_moe)" in last
    elif case == "nki_rope_device_neuron":
        assert "device.type=neuron needs TorchNeuron" in last
    else:
        assert "needs device neuron (kernel nki_" in last


def _simulated_neuron(monkeypatch):
    """A Neuron host as far as the kernel overrides see it: device type neuron at LNC=2 over CPU tensors,
    the NKI packages found, and the NKI Library kernels replaced by the CPU contract doubles."""

    from qwen3_research.kernels import nki
    from tests import nki_contract_doubles as dbl

    dbl.pretend_neuron_packages(monkeypatch)
    ops = nki.build_ops(dbl.backend(), prefix="nki_tt022_double")
    monkeypatch.setattr(nki, "_moe_apply", lambda lnc, planning=False: lambda *a, **k: ops.moe(*a, lnc=lnc, **k))
    monkeypatch.setattr(nki, "_rope_apply", lambda lnc, planning=False: lambda *a, **k: ops.rope(*a, lnc=lnc, **k))
    return SimpleNamespace(type="neuron", lnc=2, torch_device=torch.device("cpu")), dbl


@pytest.mark.parametrize("option", ["nki_rope", "nki_moe"])
def test_nki_kernels_install_and_verify_against_the_contract_doubles(option, monkeypatch):
    """The same resolve/install/verify a run and verify_kernels make, on this torchtitan's modules (0.2.x:
    the adapter's RoPE module, experts at layers.N.moe.experts), with the doubles as the kernels."""
    from qwen3_research.config import RunConfig
    from qwen3_research.kernels import apply_overrides
    from qwen3_research.kernels.verify import verify_plan
    from qwen3_research.models import build

    device, dbl = _simulated_neuron(monkeypatch)
    from qwen3_research.compose import compose_resolved

    rc = RunConfig()
    composed = compose_resolved(
        [f"kernels={option}", "data.seq_len=256", "data.batch_size=1", "training.mixed_precision=bf16",
         *(["model=native_moe", "model.flavor=nki_debug"] if option == "nki_moe" else [])])
    from qwen3_research.config import to_run_config

    rc = to_run_config(composed)
    from qwen3_research import devices

    devices.prepare_torchtitan("cpu")
    # nki_debug's experts on the meta device (verify reads only their shapes); tiny dense for RoPE (its cache)
    where = torch.device("meta") if option == "nki_moe" else torch.device("cpu")
    model = build(rc.model, where, seq_len=256, seed=0).model
    dbl.LAUNCHES.clear()
    plan = apply_overrides(model, rc, device, dtype="bfloat16")
    checks = verify_plan(model, plan, rc, device, dtype="bfloat16")
    fqns = plan[option]
    print(f"\n[torchtitan {titan.version()}] {option}: {len(fqns)} module(s) from {fqns[0]}; "
          + "; ".join(f"{c.shapes} fwd rel {c.fwd_rel:.1e} bwd rel {c.bwd_rel:.1e} tol {c.tol:.0e}" for c in checks))
    assert len(checks) == 1 and checks[0].ok
    assert len(fqns) == (2 if option == "nki_moe" else 4)
    if option == "nki_rope":
        assert fqns[0] == "layers.0.attention.rope"
    else:
        assert fqns[0] == ("layers.0.moe.experts" if LEGACY else "layers.0.moe.routed_experts.inner_experts")
    kernel = "rope_hf" if option == "nki_rope" else "blockwise_mm_baseline_shard_intermediate"
    assert (kernel, (2,)) in dbl.LAUNCHES  # the double ran: the check is not vacuous


@pytest.mark.feature("CPU kernels (kernels=fast)")
def test_kernels_fast_finds_the_experts_and_rope_of_this_torchtitan():
    """kernels=fast (moe_fast + rope_fast, CPU and CUDA) resolves on both torchtitans' module trees (0.2.x:
    layers.N.moe.experts and the adapter's RoPE module), installs and verifies against the float32 references.
    Its target was 0.3.x's path, so on AWS's 0.2.x base a GPU run was refused as matching no module."""
    from qwen3_research import devices
    from qwen3_research.compose import compose_resolved
    from qwen3_research.config import to_run_config
    from qwen3_research.kernels import apply_overrides
    from qwen3_research.kernels.verify import verify_plan
    from qwen3_research.models import build

    rc = to_run_config(compose_resolved(["model=native_moe", "kernels=fast", "kernels.force=true", "data.seq_len=32",
                                         "data.batch_size=2"]))  # force: installed here whatever the measurements say
    devices.prepare_torchtitan("cpu")
    model = build(rc.model, torch.device("cpu"), seq_len=32, seed=0).model
    device = SimpleNamespace(type="cpu", lnc=None, torch_device=torch.device("cpu"))
    plan = apply_overrides(model, rc, device, dtype="bfloat16")
    checks = verify_plan(model, plan, rc, device, dtype="bfloat16")
    print(f"\n[torchtitan {titan.version()}] kernels=fast: " + "; ".join(f"{k}: {len(v)} from {v[0]}" for k, v in plan.items())
          + " | " + "; ".join(f"{c.shapes} fwd rel {c.fwd_rel:.1e} tol {c.tol:.0e} {'ok' if c.ok else 'FAIL'}" for c in checks))
    experts = "layers.0.moe.experts" if LEGACY else "layers.0.moe.routed_experts.inner_experts"
    assert plan["moe_fast"][0] == experts and len(plan["moe_fast"]) == 4
    assert plan["rope_fast"][0] == "layers.0.attention.rope" and len(plan["rope_fast"]) == 4
    assert len(checks) == 2 and all(c.ok for c in checks)


def test_rope_module_the_adapter_adds_keeps_the_logits():
    """0.2.x has no RoPE module: the adapter's (for RoPE kernels) gives the same logits and state-dict keys."""
    from qwen3_research import devices

    devices.prepare_torchtitan("cpu")
    model = _backend("native", seed=0).model
    tokens = torch.randint(0, 1000, (1, 32), generator=torch.Generator().manual_seed(0))
    keys = sorted(model.state_dict())
    with torch.no_grad():
        ref = model(tokens)
        titan.prepare_kernel_targets(model, rope=True)
        out = model(tokens)
    ropes = [n for n, m in model.named_modules() if type(m).__name__ == "CosSinRoPE"]
    print(f"\n[torchtitan {titan.version()}] RoPE modules {ropes}; max |logits diff| {float((out - ref).abs().max()):.1e}")
    assert ropes == [f"layers.{i}.attention.rope" for i in range(4)]
    assert torch.equal(out, ref) and sorted(model.state_dict()) == keys


def _grouped_mm_experts(w1, w2, w3, x, counts):
    """torchtitan's expert math (both versions' _grouped_mm path) on the unpadded rows: the reference."""
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    h = torch.nn.functional.silu(torch._grouped_mm(x.bfloat16(), w1.bfloat16().transpose(-2, -1), offs=offs))
    h = h * torch._grouped_mm(x.bfloat16(), w3.bfloat16().transpose(-2, -1), offs=offs)
    return torch._grouped_mm(h, w2.bfloat16().transpose(-2, -1), offs=offs).type_as(x)


def test_moe_token_groups_padded_to_128_on_simulated_neuron(monkeypatch):
    """MoE without kernels on neuron: every grouped matmul sees group offsets and a row count in multiples of
    128 (TorchNeuron's validate_offs), and the result and gradients equal the unpadded computation on CPU."""
    import copy

    model = _backend("native_moe", seed=0).model
    assert titan.align_token_groups(copy.deepcopy(model), "cpu") == 0  # off neuron: unchanged
    experts = next(m for m in model.modules() if type(m).__name__ == "GroupedExperts")
    plain = copy.deepcopy(experts)
    assert titan.align_token_groups(model, "neuron") == 4  # one per MoE layer of tiny
    seen, real = [], torch._grouped_mm

    def neuron_grouped_mm(a, b, offs=None, **kw):  # TorchNeuron's precondition (python_ops/grouped_mm.py)
        seen.append((a.shape[0], offs.tolist()))
        assert a.shape[0] % 128 == 0 and bool((offs % 128 == 0).all()) and bool((offs <= a.shape[0]).all())
        return real(a, b, offs=offs, **kw)

    counts = torch.tensor([0, 37, 1, 129, 0, 0, 200, 17])  # empty experts, a group just over 128
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(int(counts.sum()), 128, generator=gen)
    gy = torch.randn(x.shape, generator=gen)
    xa, xb = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    monkeypatch.setattr(torch, "_grouped_mm", neuron_grouped_mm)
    ya = experts(xa, counts)
    monkeypatch.setattr(torch, "_grouped_mm", real)
    yb = _grouped_mm_experts(*titan.expert_weights(plain), xb, counts)
    (ya * gy).sum().backward()
    (yb * gy).sum().backward()
    wa, wb = titan.expert_weights(experts), titan.expert_weights(plain)
    print(f"\n[torchtitan {titan.version()}] grouped matmuls (rows, offsets): {seen[0]} x{len(seen)}; "
          f"max |y diff| {float((ya - yb).abs().max().detach()):.1e}, max |dx diff| {float((xa.grad - xb.grad).abs().max()):.1e}")
    # 384 rows: groups padded to 128, 128, 256, 256, 128 (empty experts take none); a static 1,408 rows, the
    # worst case over all routings (384 + 8 × 127, rounded up to 128), so one compiled graph serves every step
    assert len(seen) == 3 and seen[0] == (1408, [0, 128, 256, 512, 512, 512, 768, 896])
    assert torch.equal(ya, yb) and torch.equal(xa.grad, xb.grad)
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(wa, wb))
    if not LEGACY:  # 0.3.x's own module, unpadded, gives the same
        assert torch.equal(plain(x, counts), yb.detach())


def test_moe_token_group_padding_has_static_shapes():
    """The padding reads no tensor value: forward and backward run on fake tensors, for any routing."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    model = _backend("native_moe", seed=0).model
    titan.align_token_groups(model, "neuron")
    experts = next(m for m in model.modules() if type(m).__name__ == "GroupedExperts")
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        x = mode.from_tensor(torch.randn(384, 128)).requires_grad_(True)
        y = experts(x, mode.from_tensor(torch.tensor([0, 37, 1, 129, 0, 0, 200, 17])))
        y.sum().backward()
    print(f"\n[torchtitan {titan.version()}] padded experts on fake tensors: y {tuple(y.shape)}, dx {tuple(x.grad.shape)}")
    assert y.shape == x.shape == x.grad.shape


# -- issue 29: what 0.3.x runs, on 0.2.x through the adapter's seams (titan/v02_seams.py) ----------


@only_on_legacy("test_loss.py")
@pytest.mark.feature("chunked loss (training.loss=chunked)")
@pytest.mark.parametrize("layout,world", [("single", 1), pytest.param("fsdp", 2, marks=pytest.mark.slow),
                                          pytest.param("tp2", 2, marks=pytest.mark.slow)])
@pytest.mark.feature("tensor parallel + sequence parallel")
def test_chunked_loss_and_gradients_equal_the_full_ones(layout, world, tmp_path):
    """tests/test_loss.py's check on 0.2.x: one step of the real Trainer with each loss on the same weights and batch,
    loss and every gradient within 1e-5 (fp32). tp2 (+SP): the lm_head is sharded on the vocabulary and the
    chunked loss takes the vocabulary-parallel path, as on 0.3.x."""
    from tests.test_loss import assert_same, run_case

    losses, grads = run_case(["model=native", f"parallelism={layout}"], tmp_path, world=world)
    print(f"[torchtitan {titan.version()}] {layout}: lm_head weight {losses['lm_head_placements']}")
    if layout == "tp2":
        assert "Shard(dim=0)" in losses["lm_head_placements"]  # no rank holds all the logits
    assert_same(losses, grads)


@only_on_legacy("test_document_masking.py")
@pytest.mark.feature("document masking (data.document_masking)")
def test_document_masked_native_logits_equal_transformers(tmp_path):
    """tests/test_document_masking.py's check on 0.2.x: the same checkpoint as model=native (init_from) and
    model=hf, a packed batch of several documents per row: masked logits within 1e-5 (fp32), and masking changes
    them (0.2.2's attention asserts it gets no mask: the adapter's attention seam gives SDPA the mask)."""
    from qwen3_research.config import ModelConfig
    from qwen3_research.data import document_positions
    from qwen3_research.models.hf.model import HFCausalLM
    from tests.test_document_masking import EOS
    from tests.test_hf import write_hf_checkpoint
    from tests.test_hf_interop import native_from

    hf_dir = write_hf_checkpoint(tmp_path / "qwen3_tiny", moe=False)
    hf = HFCausalLM(ModelConfig(backend="hf", path=str(hf_dir)), torch.device("cpu"), seq_len=64, seed=0)
    hf.model.eval()
    native = native_from(hf_dir, moe=False, seq_len=64)
    x = torch.randint(0, 151000, (2, 64), generator=torch.Generator().manual_seed(0))
    x[0, [9, 30, 31]] = EOS  # documents of 10, 21, 1 and 32 tokens; row 1: EOS at 50 only
    x[1, 50] = EOS
    pos = document_positions(x, EOS)
    with torch.no_grad():
        ours, theirs, unmasked = native.forward(x, positions=pos), hf.forward(x, positions=pos), native.forward(x)
    diff, moved = float((ours - theirs).abs().max()), float((ours - unmasked).abs().max())
    print(f"\n[torchtitan {titan.version()}] native vs hf masked: max |logit diff| {diff:.2e}; masked vs unmasked {moved:.2f}")
    assert diff <= 1e-5
    assert moved > 1e-2


@only_on_legacy("test_flex.py")
@pytest.mark.feature("FlexAttention with a BlockMask (forward on CPU)")
def test_flex_forward_with_the_document_block_mask_equals_masked_sdpa():
    """FlexAttention's forward runs on CPU (no backward there): with the block-causal BlockMask of the documents
    (titan.document_attention_masks(flex=True)) the logits equal the SDPA path's with the boolean mask to 1e-5;
    and the causal BlockMask (titan.flex_attention_masks, what model.attention=flex uses) equals causal SDPA."""
    from torch.nn.attention.flex_attention import BlockMask

    model = _backend("native", seed=0).model
    x = torch.randint(0, 151000, (2, 32), generator=torch.Generator().manual_seed(1))
    pos = torch.tensor([[*range(10), *range(22)], [*range(5), *range(5), *range(22)]])
    with torch.no_grad():
        block = titan.document_attention_masks(model, pos, flex=True)
        flex = model(x, positions=pos, attention_masks=block)
        sdpa = model(x, positions=pos, attention_masks=titan.document_attention_masks(model, pos, flex=False))
        causal_flex = model(x, attention_masks=titan.flex_attention_masks(model, 2, 32, torch.device("cpu")))
        causal = model(x)
    diff, causal_diff = float((flex - sdpa).abs().max()), float((causal_flex - causal).abs().max())
    print(f"\n[torchtitan {titan.version()}] flex vs sdpa, document masks: {diff:.1e}; causal: {causal_diff:.1e}; "
          f"masked vs causal {float((sdpa - causal).abs().max()):.2f}")
    assert isinstance(block, BlockMask) and tuple(block.shape) == (2, 1, 32, 32)
    assert diff < 1e-5 and causal_diff < 1e-5
    assert float((sdpa - causal).abs().max()) > 1e-2  # the masks are not both causal


ROUTING_KEYS = {"moe_max_load", "moe_cv", "moe_empty_frac", "moe_entropy", "moe_per_layer"}


@only_on_legacy("test_parallel.py::test_moe_dp2_ep2_parity, test_routing.py, test_checkpoint.py")
@pytest.mark.slow
@pytest.mark.feature("MoE (model=native_moe) on CPU")
@pytest.mark.feature("expert parallel (parallelism.ep)")
@pytest.mark.feature("MoE balance: auxiliary loss")
@pytest.mark.feature("MoE balance: expert bias")
@pytest.mark.feature("routing statistics")
@pytest.mark.feature("checkpoint resume after SIGKILL")
def test_moe_trains_single_fsdp_and_ep_in_each_balance_mode_and_resumes_after_sigkill(tmp_path):
    """model=native_moe, 3 steps in each layout, one balance mode each: single (none), FSDP×2 (aux_loss, with
    document masking), EP×2 (bias, 4 steps, checkpoint every 2). metrics.jsonl has the routing statistics every
    step (every token routed to top-2 of 8). EP×2 again, SIGKILLed at step 3 and resumed with checkpoint.resume=auto
    from step 2: steps 3-4 equal the straight run's (the expert bias and the EP-sharded experts come back)."""
    base = ["model=native_moe", *[o for o in FAST if not o.startswith("training.steps")]]
    ep = ["parallelism=ep2", "model.moe.balance=bias", "training.steps=4", "checkpoint.enable=true", "checkpoint.every=2"]
    runs = {
        "single": ["model.moe.balance=none", "training.steps=3"],
        "fsdp": ["parallelism=fsdp", "model.moe.balance=aux_loss", "data.document_masking=true", "training.steps=3"],
        "ep2": ep,
    }
    for name, args in runs.items():
        proc = run_cli([*base, *args], run_dir=tmp_path / name, timeout=600)
        assert_ok(proc)
        rows = [r for r in read_metrics(tmp_path / name) if "loss" in r]
        world = 1 if name == "single" else 2
        print(f"\n[torchtitan {titan.version()}] native_moe {name} ({args[0]} {args[1]}): losses "
              f"{[round(r['loss'], 4) for r in rows]} max_load {[round(r['moe_max_load'], 3) for r in rows]}"
              + (f" aux_loss {[round(r['aux_loss'], 3) for r in rows]}" if name == "fsdp" else ""))
        assert len(rows) == (4 if name == "ep2" else 3) and all(math.isfinite(r["loss"]) for r in rows)
        for r in rows:
            assert ROUTING_KEYS <= set(r) and len(r["moe_per_layer"]) == 4
            assert all(sum(x["tokens"]) == world * 2 * 32 * 2 for x in r["moe_per_layer"])  # ranks×batch×seq×top-2
        assert ("aux_loss" in rows[0]) == (name == "fsdp")
        if name == "ep2":
            assert "moe_balance=bias" in proc.stdout
            # the bias moves (±1e-3 per expert per step, centred): after step s its largest |value| is in (0, 2e-3·s]
            bias = [r["moe_expert_bias"] for r in rows]
            print(f"  largest |expert bias| per step: {bias}")
            assert all(0 < b <= 2e-3 * s for s, b in enumerate(bias, 1)), bias
        else:  # none and aux_loss build no expert bias
            assert not any("moe_expert_bias" in r for r in rows)
    killed = run_cli([*base, *ep], run_dir=tmp_path / "resumed", timeout=600,
                     env=cli_env(**fault_env("kill@3")))
    assert killed.returncode != 0
    resumed = run_cli([*base, *ep, "checkpoint.resume=auto"], run_dir=tmp_path / "resumed", timeout=600)
    assert_ok(resumed)
    ref, got = train_losses(tmp_path / "ep2"), train_losses(tmp_path / "resumed")
    print(f"EP×2 steps 3-4 straight {ref[2:]}\n              resumed  {got[-2:]}")
    assert got[-2:] == ref[2:]
    bias = [[r["moe_expert_bias"] for r in read_metrics(tmp_path / d) if "loss" in r][-2:] for d in ("ep2", "resumed")]
    assert bias[0] == bias[1], bias  # the resumed run's expert bias is the straight run's


# torchtitan 0.2.2 source each seam of titan/v02_seams.py mirrors or wraps (v02_seams.MIRRORED): sha256[:16] of
# inspect.getsource. A torchtitan (or torchtitan-neuron) update that changes one fails here: compare the new source
# with the seam named in the message, update the seam, then the hash.
MIRRORED_SHA = {
    ("torchtitan.models.qwen3.model.model", "Qwen3Model.forward"): "2c18a3dfd9a1385a",
    ("torchtitan.models.qwen3.model.model", "Attention.forward"): "ae5ea2947f6a04ac",
    ("torchtitan.models.moe.moe", "TokenChoiceTopKRouter.forward"): "46772c215d8b513a",
    ("torchtitan.models.moe.moe", "TokenReorderer.forward"): "3d64d9007a2cf165",
    ("torchtitan.models.moe.kernels", "generate_permute_indices"): "97cd691552e2bf80",
    ("torchtitan.models.moe.utils", "_permute"): "57802930f8daa67a",
}


@pytest.mark.skipif(not LEGACY, reason="torchtitan 0.3.x here: no 0.2.x seam to pin")
def test_the_torchtitan_source_each_seam_mirrors_is_unchanged():
    import hashlib
    import importlib
    import inspect

    from qwen3_research import devices

    devices.prepare_torchtitan("cpu")
    from qwen3_research.titan import v02_seams as v02

    assert set(v02.MIRRORED) == set(MIRRORED_SHA)
    changed = []
    for (module, qualname), seam in v02.MIRRORED.items():
        obj = importlib.import_module(module)
        for part in qualname.split("."):
            obj = getattr(obj, part)
        sha = hashlib.sha256(inspect.getsource(obj).encode()).hexdigest()[:16]
        if sha != MIRRORED_SHA[(module, qualname)]:
            changed.append(f"{module}.{qualname} (sha {sha}; mirrored by titan/v02_seams.py {seam})")
    print(f"\n[torchtitan {titan.version()}] {len(v02.MIRRORED)} mirrored functions checked; changed: {changed}")
    assert not changed, "torchtitan changed what a 0.2.x seam mirrors: " + "; ".join(changed)


# -- docs/FEATURES.md's feature table (tests/feature_table.py) --------------------------------------


def test_feature_table_is_what_the_tests_show():
    """docs/FEATURES.md's table equals the one written from the tests' feature markers (both environments: the markers are
    read from the source). After adding, removing or re-marking a test: python -m tests.feature_table --write."""
    from tests import feature_table

    got, want = feature_table.page_table(), feature_table.table()
    print(f"\n{want}")
    assert got == want, "docs/FEATURES.md's feature table is stale: run python -m tests.feature_table --write"


def test_a_removed_test_removes_its_check_mark(tmp_path):
    """A row's cell comes from the tests that declare it: a 0.2.x-only test gives ✔ on 0.2.x alone, a refusal its
    line; without the test the cell says no test shows it."""
    from tests import feature_table

    (tmp_path / "test_tt022.py").write_text(
        "@only_on_legacy('x')\n@pytest.mark.feature('routing statistics')\ndef test_a():\n    pass\n\n\n"
        "@pytest.mark.feature('chunked loss (training.loss=chunked)')\ndef test_b():\n    pass\n\n\n"
        "@only_on_legacy('x')\n@pytest.mark.feature('document masking (data.document_masking)', refused='no mask')\n"
        "def test_c():\n    pass\n")
    (tmp_path / "test_other.py").write_text("@pytest.mark.feature('routing statistics')\ndef test_d():\n    pass\n")
    rows = {r.split(" | ")[0][2:]: r for r in feature_table.table(feature_table.collect(tmp_path)).splitlines()[2:]}
    assert rows["routing statistics"].endswith("| ✔ | ✔ |")
    assert rows["chunked loss (training.loss=chunked)"].endswith("| ✔ | ✔ |")
    assert rows["document masking (data.document_masking)"].endswith("| — (no test) | refused: no mask |")
    (tmp_path / "test_other.py").unlink()
    rows = {r.split(" | ")[0][2:]: r for r in feature_table.table(feature_table.collect(tmp_path)).splitlines()[2:]}
    assert rows["routing statistics"].endswith("| — (no test) | ✔ |")
    assert rows["FSDP (parallelism.dp_shard)"].endswith("| — (no test) | — (no test) |")
