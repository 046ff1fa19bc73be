"""training.loss=chunked: the same loss and gradients as the full loss (fp32, 1e-5) on every backend and on tp2.

Each case builds the real Trainer (model, sharding, data) in every rank, runs one forward+backward
with the full loss and one with the chunked loss on the same batch, and compares the loss and every
parameter's gradient (made whole over the ranks). A wrong chunk boundary, a missing all-reduce over
the tp ranks or a wrong vocabulary offset changes the gradients by far more than 1e-5.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
import torch

from tests.conftest import FAST

TOL = 1e-5
# 32-token windows; chunks of 24 tokens: not a divisor of the 64 tokens per rank, so a ragged last chunk is tested.
BASE = [o for o in FAST if not o.startswith("training.steps")] + ["training.steps=1", "training.loss_chunk_tokens=24",
                                                                  "device=cpu"]


def _compose(overrides: list[str]) -> dict:
    from qwen3_research.compose import compose_resolved

    return compose_resolved(overrides)


def loss_and_grads(overrides: list[str], run_dir: str) -> tuple[dict, dict]:
    """{loss kind: loss}, {loss kind: {param name: full gradient}} for one step of the real Trainer (this rank)."""
    from qwen3_research.resolve import resolve_run
    from qwen3_research.trainer import RunInfo, Trainer

    trainer = Trainer(resolve_run(_compose(overrides)), RunInfo(run_dir=run_dir))
    try:
        batch = trainer.step.data.train_batch(0, 0, 1, trainer.step.dp_rank, trainer.step.dp_size, 0)
        losses, grads = {}, {}
        for kind in ("full", "chunked"):
            trainer.cfg.training.loss = kind
            trainer.step.optimizer.zero_grad(set_to_none=True)
            loss = trainer.step.loss(batch.inputs, batch.labels)
            loss.backward()
            losses[kind] = float(loss.detach())
            grads[kind] = {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).detach().clone()
                           for n, p in trainer.step.backend.model.named_parameters() if p.grad is not None}
        w = trainer.step.backend.lm_head_weight()
        losses["lm_head_placements"] = str(getattr(w, "placements", "plain"))
        return losses, grads
    finally:
        trainer.close()


def _rank_main(rank: int, world: int, port: int, overrides: list[str], run_dir: str, out: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    result = loss_and_grads(overrides, run_dir)
    if rank == 0:
        torch.save(result, out)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_case(overrides: list[str], tmp_path: Path, world: int = 1) -> tuple[dict, dict]:
    overrides = BASE + overrides
    if world == 1:
        return loss_and_grads(overrides, str(tmp_path))
    import torch.multiprocessing as mp

    out = str(tmp_path / "result.pt")
    mp.start_processes(_rank_main, args=(world, _free_port(), overrides, str(tmp_path), out), nprocs=world,
                       start_method="spawn")
    return torch.load(out)


def assert_same(losses: dict, grads: dict) -> None:
    print(f"loss full {losses['full']:.8f} chunked {losses['chunked']:.8f}")
    assert abs(losses["full"] - losses["chunked"]) <= TOL * max(1.0, abs(losses["full"]))
    assert set(grads["full"]) == set(grads["chunked"]) and grads["full"]
    worst = max(((g - grads["chunked"][n]).abs().max().item() / max(1.0, g.abs().max().item()), n)
                for n, g in grads["full"].items())
    print(f"{len(grads['full'])} gradients, largest difference {worst[0]:.2e} ({worst[1]})")
    assert worst[0] <= TOL, worst


# torchtitan's MoE experts always compute in bf16 (GroupedExperts casts), where one rounding step of a
# gradient is ~1e-3 relative: the fp32 comparison runs the experts with this project's moe_fast kernel
# in the input dtype (float32).
MODELS = {"native": ["model=native"], "native_moe": ["model=native_moe", "kernels=moe_fast", "kernels.force=true"]}  # force: applied whatever the speed measurements say (issue 30)


@pytest.mark.feature("chunked loss (training.loss=chunked)")
@pytest.mark.parametrize("model", list(MODELS))
def test_chunked_loss_matches_full_single(model, tmp_path):
    assert_same(*run_case(MODELS[model], tmp_path))


def test_chunked_loss_matches_full_hf(tmp_path):
    from tests.test_hf import write_hf_checkpoint

    ckpt = write_hf_checkpoint(tmp_path / "hf", moe=False)
    assert_same(*run_case(["model=hf", f"model.path={ckpt}"], tmp_path))


# Chunked × fsdp and chunked × a MoE under tp2 are the pairwise matrix's (losses and grad norms against a one-process
# twin with the full loss, every step: docs/PAIRWISE.md); the vocabulary-parallel path of each backend is here.
@pytest.mark.slow
def test_chunked_loss_matches_full_tp2(tmp_path):
    losses, grads = run_case(MODELS["native"] + ["parallelism=tp2"], tmp_path, world=2)
    assert "Shard(dim=0)" in losses["lm_head_placements"]  # vocabulary-parallel path: no rank holds all logits
    assert_same(losses, grads)


@pytest.mark.slow
def test_chunked_loss_matches_full_hf_tp2(tmp_path):
    from tests.test_hf import write_hf_checkpoint

    ckpt = write_hf_checkpoint(tmp_path / "hf", moe=False)
    losses, grads = run_case(["model=hf", f"model.path={ckpt}", "parallelism=tp2"], tmp_path, world=2)
    assert "Shard(dim=0)" in losses["lm_head_placements"]
    assert_same(losses, grads)


def test_loss_options_are_validated():
    from qwen3_research.config import ConfigError, to_run_config, validate

    for bad, key in ((["training.loss=sparse"], "training.loss"), (["training.loss_chunk_tokens=0"], "training.loss_chunk_tokens"),
                     (["device.memory_gib=0"], "device.memory_gib"), (["device.memory_gib=-3"], "device.memory_gib")):
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            validate(to_run_config(_compose(bad)))


def test_the_lm_head_takes_a_column_major_copy_where_the_device_says_16bit_gemm_is_slow(monkeypatch):
    """The resolution decides it once (``PrecisionPlan.lm_head_column_major``: a 16-bit run on a device whose spec
    says ``slow_16bit_nn_gemm``, ATen's own bf16 GEMM on a CPU without AVX-512; benchmarks/bench_bf16_lm_head.py,
    RESULTS.md row 23) and both losses read it: ``column_major_lm_head`` makes the lm_head multiply by a column-major
    copy of its weight -- the same logits, the same gradients to the (tied) weight and the input, the copy made from
    the weight as it is at each call. Expected: the plan says yes only for bf16 on such a device (a plan for neuron
    made on this CPU says no), the forward is replaced only when told, logits equal, gradients within bf16 rounding,
    and the chunked loss with the flag gives the same loss and gradients as without."""
    import torch

    from qwen3_research import loss
    from qwen3_research.parallel import Degrees
    from qwen3_research.resolve import precision_plan

    one = Degrees(1, 1, 1, 1, 1, False)
    monkeypatch.setattr("qwen3_research.devices.cpu.cpu_isa", lambda: "avx2")
    assert precision_plan("bf16", one, torchtitan=True, device_kind="cpu").lm_head_column_major
    assert not precision_plan("none", one, torchtitan=True, device_kind="cpu").lm_head_column_major
    assert not precision_plan("bf16", one, torchtitan=True, device_kind="neuron").lm_head_column_major
    monkeypatch.setattr("qwen3_research.devices.cpu.cpu_isa", lambda: "avx512_bf16")
    assert not precision_plan("bf16", one, torchtitan=True, device_kind="cpu").lm_head_column_major

    torch.manual_seed(0)
    x = torch.randn(2, 8, 32)
    ref, head = torch.nn.Linear(32, 1000, bias=False), torch.nn.Linear(32, 1000, bias=False)
    head.weight = ref.weight  # one Parameter, as a tied embedding's
    assert not loss.column_major_lm_head(head, False) and not loss.column_major_lm_head(None, True)
    assert "forward" not in vars(head)
    assert loss.column_major_lm_head(head, True)
    grads = []
    for mod in (ref, head):
        xi = x.clone().requires_grad_()
        ref.weight.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = mod(xi)
        out.float().square().mean().backward()
        grads.append((out.detach(), xi.grad, ref.weight.grad.clone()))
    (o1, gx1, gw1), (o2, gx2, gw2) = grads
    print(f"\nlogits max |diff| {(o1 - o2).abs().max():.1e}, input grad {(gx1 - gx2).abs().max():.1e}, "
          f"weight grad {(gw1 - gw2).abs().max():.1e}")
    assert torch.equal(o1, o2)
    assert torch.allclose(gx1, gx2, rtol=2e-2, atol=1e-6) and torch.allclose(gw1, gw2, rtol=2e-2, atol=1e-6)
    with torch.no_grad():
        ref.weight.mul_(2)  # the copy follows the weight as it is at the call (FSDP2 gathers it anew each step)
    assert torch.allclose(head(x), ref(x))
    labels = torch.randint(0, 1000, (2, 8))
    chunked = []
    for flag in (False, True):
        xi = x.clone().requires_grad_()
        ref.weight.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16):
            value = loss.chunked_cross_entropy(xi.to(torch.bfloat16), ref.weight, labels, 4, column_major=flag)
        value.backward()
        chunked.append((value.detach(), xi.grad, ref.weight.grad.clone()))
    (l1, h1, w1), (l2, h2, w2) = chunked
    assert torch.equal(l1, l2) and torch.allclose(h1, h2, rtol=2e-2, atol=1e-6) and torch.equal(w1, w2)
