"""Issue 25 (1, 2): MoE routing statistics and load balancing (qwen3_research.routing).

- A router forced onto one expert reads as collapsed: max/mean load = E and (E-1)/E empty experts with top-1,
  E/K and (E-K)/E with top-K; padded rows where an expert module pads.
- Qwen3's auxiliary loss equals transformers' ``Qwen3MoeForCausalLM(..., output_router_logits=True).aux_loss`` on the
  same weights and batch (native_moe model.init_from, and model=hf), and ``balance=auto`` follows the checkpoint.
- A MoE run through the CLI: routing figures in metrics.jsonl, on the console and in the offline W&B run; the
  auxiliary loss logged apart from the language-model loss.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from tests.conftest import FAST, assert_ok, read_metrics, run_cli, wandb_records
from tests.test_hf import write_hf_checkpoint


def _native_moe(flavor_overrides: dict | None = None, balance: str = "auto"):
    from qwen3_research import devices
    from qwen3_research.config import ModelConfig, MoEConfig

    devices.prepare_torchtitan("cpu")
    from qwen3_research.models.flavors import MOE
    from qwen3_research.models.native.model import NativeQwen3

    flavor = dataclasses.replace(MOE["tiny_moe"], **(flavor_overrides or {}))
    cfg = ModelConfig(backend="native_moe", flavor="tiny", moe=MoEConfig(balance=balance))
    return NativeQwen3(cfg, torch.device("cpu"), 32, 0, flavor=flavor, flavor_name="tiny")


def _monitor(backend, stats: bool = True):
    from qwen3_research.routing import RoutingMonitor

    return RoutingMonitor(backend, backend.balance, stats=stats, device=torch.device("cpu"))


def _force(model, favourite: dict[int, float]) -> None:
    """Add a large constant to some experts' router logits (every token's choice), on every MoE layer."""
    def push(mod, args, out):
        shift = torch.zeros(out.shape[-1], dtype=out.dtype)
        for e, v in favourite.items():
            shift[e] = v
        return out + shift

    for name, module in model.named_modules():
        if name.endswith("moe.router.gate"):
            module.register_forward_hook(push)


TOKENS = torch.randint(0, 151669, (2, 32), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("top_k,favourite", [(1, {0: 1e4}), (2, {0: 40.0, 5: 20.0})], ids=["top1", "top2"])
def test_router_forced_onto_experts_reads_as_collapsed(top_k, favourite):
    """Every token on expert 0 (top-1): max/mean = E = 8, empty fraction (E-1)/E = 0.875, entropy 0. With top-2
    (experts 0 and 5 for every token): max/mean = E/K = 4, empty (E-K)/E = 0.75. Untouched router: near 1."""
    backend = _native_moe({"top_k": top_k})
    monitor = _monitor(backend)
    backend.model.train()
    with torch.no_grad():
        backend.forward(TOKENS)
    healthy = monitor.log_fields()
    _force(backend.model, favourite)
    with torch.no_grad():
        backend.forward(TOKENS)
    forced = monitor.log_fields()
    E, K, n = 8, top_k, 4
    print(f"\n[top-{K}] untouched: max_load {healthy['moe_max_load']:.3f} empty {healthy['moe_empty_frac']:.3f} "
          f"entropy {healthy['moe_entropy']:.3f}; forced: max_load {forced['moe_max_load']:.3f} cv "
          f"{forced['moe_cv']:.3f} empty {forced['moe_empty_frac']:.3f} entropy {forced['moe_entropy']:.2e}; "
          f"layer 0 tokens {forced['moe_per_layer'][0]['tokens']}")
    assert len(forced["moe_per_layer"]) == n
    for row in forced["moe_per_layer"]:
        assert sum(row["tokens"]) == TOKENS.numel() * K  # every routed choice counted once
        assert row["max_load"] == pytest.approx(E / K) and row["empty_frac"] == pytest.approx((E - K) / E)
        assert row["cv"] == pytest.approx(math.sqrt(E / K - 1))  # K experts at E/K × the mean, the rest at 0
        assert row["entropy"] < 1e-3
    assert forced["moe_max_load"] == pytest.approx(E / K) and forced["moe_empty_frac"] == pytest.approx((E - K) / E)
    assert healthy["moe_max_load"] < 4 and healthy["moe_empty_frac"] <= 0.25 and healthy["moe_entropy"] > 0.9  # random init


def test_no_counting_in_evaluation_or_activation_checkpoint_recomputation():
    """Evaluation forwards are not counted; under full activation checkpointing the recomputed forward in the
    backward pass is not counted again (its hooks fire a second time there)."""
    from torch.utils.checkpoint import checkpoint

    backend = _native_moe()
    monitor = _monitor(backend)
    backend.model.eval()
    with torch.no_grad():
        backend.forward(TOKENS)
    assert "moe_per_layer" not in monitor.log_fields()
    backend.model.train()
    model = backend.model
    blocks = dict(model.layers.items())
    for key, block in blocks.items():  # every block recomputed in backward, as full AC does
        block.forward = (lambda b: lambda *a, **kw: checkpoint(type(b).forward, b, *a, use_reentrant=False, **kw))(block)
    model(TOKENS).float().mean().backward()
    rows = monitor.log_fields()["moe_per_layer"]
    print(f"\nunder checkpointing: tokens counted per layer {[sum(r['tokens']) for r in rows]}")
    assert all(sum(r["tokens"]) == TOKENS.numel() * 2 for r in rows)


def test_padded_rows_of_the_neuron_group_alignment():
    """titan.align_token_groups (TorchNeuron's 128-row groups, simulated on CPU): padded rows = sum over experts of
    ceil(c/128)·128 - c per forward, reported per layer and summed."""
    from qwen3_research import titan

    backend = _native_moe()
    assert titan.align_token_groups(backend.model, "neuron") == 4
    monitor = _monitor(backend)
    backend.model.train()
    with torch.no_grad():  # 1,024 routed rows: ~128 per expert, some groups just over a multiple of 128
        backend.forward(torch.randint(0, 151669, (8, 64), generator=torch.Generator().manual_seed(1)))
    fields = monitor.log_fields()
    expect = [sum(-(-c // 128) * 128 - c for c in row["tokens"]) for row in fields["moe_per_layer"]]
    print(f"\npadded rows per layer {[r['padded_rows'] for r in fields['moe_per_layer']]} (expected {expect}), "
          f"total {fields['moe_padded_rows']}")
    assert [r["padded_rows"] for r in fields["moe_per_layer"]] == expect and fields["moe_padded_rows"] == sum(expect)


def test_nki_kernel_padding_is_its_static_block_capacity():
    """kernels=nki_moe computes N·B slots per call (N = capacity_blocks: any routing fits): 128 rows over 8
    experts with 256-row blocks are 8 blocks, 2048 slots, 1920 of them padding."""
    from types import SimpleNamespace

    from qwen3_research.kernels.nki import padded_slots

    module = SimpleNamespace(_kernel_options={})
    assert padded_slots(module, torch.zeros(128, 4), torch.zeros(8)) == 8 * 256 - 128


# -- balancing -----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def hf_moe_dir(tmp_path_factory):
    """A random 2-layer Qwen3-MoE checkpoint (8 experts, top-2) trained, per its config, with aux coef 0.02."""
    return write_hf_checkpoint(tmp_path_factory.mktemp("moe") / "qwen3_moe", moe=True, num_hidden_layers=2,
                               router_aux_loss_coef=0.02)


def _hf_aux(hf_dir, x) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="sdpa")
    with torch.no_grad():
        return float(model(input_ids=x, output_router_logits=True, use_cache=False).aux_loss)


def test_aux_loss_matches_transformers_and_auto_follows_the_checkpoint(hf_moe_dir):
    """Same weights, same batch: our auxiliary loss (native_moe init_from with float32 experts, and model=hf)
    equals transformers' aux_loss within 1e-5 (fp32). 2 MoE layers: the counts and probabilities are pooled over
    layers before the product, as transformers does; float32 experts keep layer 1's router input the same.
    balance=auto with the checkpoint's router_aux_loss_coef=0.02 resolves to aux_loss, coefficient 0.02."""
    from qwen3_research.config import ModelConfig
    from qwen3_research.models.hf.model import HFCausalLM
    from tests.test_hf_interop import native_from

    x = TOKENS
    native = native_from(hf_moe_dir, moe=True, experts_fp32=True)
    assert native.balance.mode == "aux_loss" and native.balance.aux_loss_coef == 0.02
    assert "expert_bias" not in " ".join(k for k, _ in native.model.named_buffers())  # no bias steers the routing
    hf = HFCausalLM(ModelConfig(backend="hf", path=str(hf_moe_dir)), torch.device("cpu"), seq_len=32, seed=0)
    ours = {}
    for name, backend in (("native_moe", native), ("hf", hf)):
        monitor = _monitor(backend, stats=False)
        backend.model.train()
        backend.forward(x)
        term = monitor.aux_term()
        ours[name] = float(term.detach()) / backend.balance.aux_loss_coef
        assert monitor.log_fields()["aux_loss"] == pytest.approx(ours[name], rel=1e-6)
        term.backward()  # the loss reaches the routers' weights
        grads = [p.grad for n, p in backend.model.named_parameters() if n.endswith(("router.gate.weight", "mlp.gate.weight"))]
        assert len(grads) == 2 and all(g is not None and float(g.abs().sum()) > 0 for g in grads)
    reference = _hf_aux(hf_moe_dir, x)
    print(f"\naux loss: transformers {reference:.8f}, native_moe {ours['native_moe']:.8f} "
          f"(|diff| {abs(ours['native_moe'] - reference):.1e}), model=hf {ours['hf']:.8f} "
          f"(|diff| {abs(ours['hf'] - reference):.1e}); balanced would be 2 (top-2), collapsed 8")
    assert abs(ours["native_moe"] - reference) <= 1e-5 and abs(ours["hf"] - reference) <= 1e-5


def test_balance_modes_build_what_they_name():
    """bias: torchtitan's expert bias buffer and its optimizer pre-hook; none and aux_loss: neither (no bias
    steers routing). Without a checkpoint, auto is bias (torchtitan's default, coefficient 1e-3)."""
    from qwen3_research.optim import build_optimizer
    from qwen3_research.config import OptimizerConfig

    for mode, expect_bias in (("auto", True), ("bias", True), ("none", False), ("aux_loss", False)):
        backend = _native_moe(balance=mode)
        biases = [n for n, _ in backend.model.named_buffers() if n.endswith("expert_bias_E")]
        opt, _ = build_optimizer(backend.model, OptimizerConfig(), 3)
        backend.register_optimizer_hooks(opt, None)
        print(f"balance={mode}: {backend.balance.describe()}; expert bias buffers {len(biases)}, "
              f"optimizer pre-hooks {len(opt._optimizer_step_pre_hooks)}")
        assert (len(biases) == 4) == expect_bias and (len(opt._optimizer_step_pre_hooks) > 0) == expect_bias
    assert _native_moe().balance.bias_coef == 1e-3


def test_balance_choices_are_checked_per_backend():
    from qwen3_research import models
    from qwen3_research.config import ModelConfig, MoEConfig
    from qwen3_research.errors import ConfigError

    with pytest.raises(ConfigError, match=r"^model.moe.balance=bias is not available with model=hf; choose one of "
                                          r"\['auto', 'none', 'aux_loss'\]$"):
        models.check(ModelConfig(backend="hf", path="Qwen/Qwen3-30B-A3B", moe=MoEConfig(balance="bias")))
    with pytest.raises(ConfigError, match=r"model.moe.balance=aux_loss is not available with model=native;"):
        models.check(ModelConfig(backend="native", moe=MoEConfig(balance="aux_loss")))


# -- a MoE run through the CLI ---------------------------------------------------------------------------------
@pytest.mark.feature("MoE balance: auxiliary loss")
@pytest.mark.feature("routing statistics")
def test_moe_run_logs_routing_to_metrics_console_and_wandb(tmp_path):
    """Acceptance a (and b's logging): model=native_moe with the auxiliary loss and W&B offline. metrics.jsonl
    has the routing figures and per-layer rows every logged step, the console one figure (moe_max_load=), the
    W&B run the same figures and a tokens-per-expert histogram per layer; aux_loss is apart from loss."""
    run_dir = tmp_path / "moe"
    steps = [o for o in FAST if not o.startswith(("training.steps", "logging.wandb"))] + ["training.steps=2"]
    proc = run_cli(["model=native_moe", "model.moe.balance=aux_loss", "logging.wandb.mode=offline", *steps],
                   run_dir=run_dir)
    assert_ok(proc)
    rows = [r for r in read_metrics(run_dir) if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert {"moe_max_load", "moe_cv", "moe_empty_frac", "moe_entropy", "aux_loss"} <= set(r)
        assert len(r["moe_per_layer"]) == 4 and all(sum(x["tokens"]) == 2 * 32 * 2 for x in r["moe_per_layer"])
        assert 1 <= r["moe_max_load"] <= 8 and 1.9 < r["aux_loss"] < 8  # top-2 of 8: 2 balanced, 8 collapsed
        assert "moe_expert_bias" not in r  # aux_loss builds no expert bias
    assert "moe_max_load=" in proc.stdout and "aux_loss=" in proc.stdout
    assert "moe_balance=aux_loss coef=0.001 (model.moe.balance)" in proc.stdout
    history = [r["history"]["item"] for r in wandb_records(run_dir) if r["type"] == "history"]
    print(f"\nstep 1: loss {rows[0]['loss']:.4f} aux_loss {rows[0]['aux_loss']:.4f} max_load {rows[0]['moe_max_load']:.3f}; "
          f"W&B keys {sorted(k for k in history[0] if k.startswith('moe/layer0'))}")
    for item, r in zip(history, rows):
        assert item["train/loss"] == pytest.approx(r["loss"]) and item["train/aux_loss"] == pytest.approx(r["aux_loss"])
        assert item["moe/max_load"] == pytest.approx(r["moe_max_load"]) and "moe/layer3/entropy" in item
        assert item["moe/layer0/tokens_per_expert._type"] == "histogram"
        assert item["moe/layer0/tokens_per_expert.values"] == r["moe_per_layer"][0]["tokens"]
