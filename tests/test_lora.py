"""LoRA adapters through PEFT (issue 41 deliver 2, acceptance c, d, g and i's LoRA part): qwen3_research/lora.py.

In process (seconds): model=native from an HF directory and model=hf on it, the same seeded adapters, three steps
each; the base stays bit-identical, the optimizer holds the adapters alone, the trainable count is PEFT's own.
CLI runs (slow): fsdp(2) killed and resumed, tp(2) on model=hf, ep(2) on a MoE, each against one process.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.conftest import FAST, assert_ok, cli_env, fault_env, run_cli, train_losses
from tests.test_bad_inputs import one_line, tree
from tests.test_hf import run_in_process, write_hf_checkpoint

LR = ["optimizer.lr=1e-2", "optimizer.warmup_steps=0"]  # adapters that move in three steps
LORA = ["model.lora.enable=true", *LR]
MOE_TOL = 1e-4  # bf16 experts (see test_moe_ep2_equals_one_process); dense layouts: 1e-5


def build_step(overrides: list[str], run_dir: Path):
    """The run's own step (resolve, place, build_step) in this process, one process."""
    from qwen3_research.compose import compose
    from qwen3_research.resolve import resolve_run
    from qwen3_research.step import build_step as build, place

    run = resolve_run(compose(overrides))
    return build(run, place(run), run_dir=run_dir)


def run_steps(step, n: int = 3) -> list[float]:
    return [step()[0] for _ in range(n)]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    return write_hf_checkpoint(tmp_path_factory.mktemp("lora") / "qwen3_tiny", moe=False)


@pytest.fixture(scope="module")
def trained(hf_dir, tmp_path_factory) -> dict:
    """Both backends on ``hf_dir`` with LoRA, three steps in this process: the step, base weights before, losses."""
    from qwen3_research import lora

    out = {}
    for name, model in (("hf", ["model=hf", f"model.path={hf_dir}"]),
                        ("native", ["model=native", f"model.init_from={hf_dir}"])):
        step = build_step([*model, *FAST, *LORA], tmp_path_factory.mktemp(name))
        base = {n: p.detach().clone() for n, p in step.backend.model.named_parameters() if not lora.is_adapter_key(n)}
        out[name] = {"step": step, "base": base, "losses": run_steps(step)}
    return out


# -- acceptance c: native LoRA equals HF LoRA --------------------------------------------------


def test_native_lora_equals_hf_lora(trained):
    """Same HF directory, the same adapters (seeded by their HF names): step 1-3 losses and the trained adapters
    (under PEFT's keys) equal to 1e-5, fp32. Fails if the native adapters were not per projection (a fused wqkv
    adapter has another shape) or if either backend's adapters were initialised apart."""
    from qwen3_research import lora

    hf, native = trained["hf"]["losses"], trained["native"]["losses"]
    diff = max(abs(a - b) for a, b in zip(hf, native))
    sd_hf = lora.adapter_state_dict(trained["hf"]["step"].backend.model)
    sd_nat = lora.adapter_state_dict(trained["native"]["step"].backend.model)
    adapters = max(float((sd_hf[k] - sd_nat[k]).abs().max()) for k in sd_hf)
    print(f"\nLoRA steps 1-3 model=hf {hf}\n           model=native {native}\n|loss diff| {diff:.2e}; "
          f"{len(sd_hf)} adapter tensors, max |diff| {adapters:.2e}")
    assert sorted(sd_hf) == sorted(sd_nat)
    assert hf[0] != hf[2]  # the adapters trained
    assert diff <= 1e-5 and adapters <= 1e-5


def test_adapter_keys_are_peft_keys(trained, hf_dir):
    """``adapter_state_dict`` names PEFT's own keys for this HF base (get_peft_model_state_dict), same shapes."""
    from peft import get_peft_model, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    from qwen3_research import lora
    from qwen3_research.config import LoraConfig

    peft_model = get_peft_model(AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32),
                                lora.peft_config(LoraConfig(enable=True)))
    want = {k: tuple(v.shape) for k, v in get_peft_model_state_dict(peft_model).items()}
    got = {k: tuple(v.shape) for k, v in lora.adapter_state_dict(trained["native"]["step"].backend.model).items()}
    print(f"\n{len(got)} keys, e.g. {sorted(got)[0]}")
    assert got == want


# -- acceptance d: the base stays frozen -------------------------------------------------------


@pytest.mark.parametrize("backend", ["hf", "native"])
def test_base_frozen_optimizer_holds_adapters_count_is_pefts(trained, hf_dir, backend):
    """Base weights bit-identical after three steps; the optimizer's parameters are exactly the adapters; the
    printed count (lora.count_line) equals PEFT's get_nb_trainable_parameters on the HF model."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from qwen3_research import lora
    from qwen3_research.config import LoraConfig

    step, base = trained[backend]["step"], trained[backend]["base"]
    params = dict(step.backend.model.named_parameters())
    changed = [n for n, before in base.items() if not torch.equal(before, params[n].detach())]
    in_optimizer = [p for g in step.optimizer.param_groups for p in g["params"]]
    adapters = [p for n, p in params.items() if lora.is_adapter_key(n)]
    ours = (sum(p.numel() for p in adapters), sum(p.numel() for p in params.values()))
    peft_model = get_peft_model(AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32),
                                lora.peft_config(LoraConfig(enable=True)))
    theirs = peft_model.get_nb_trainable_parameters()
    print(f"\n[{backend}] base tensors {len(base)}, changed {len(changed)}; optimizer holds {len(in_optimizer)} "
          f"tensors / {sum(p.numel() for p in in_optimizer):,d} elements; adapters {len(adapters)}\n"
          f"  ours: {lora.count_line(*ours)}\n  PEFT: {lora.count_line(*theirs)}")
    assert not changed and len(base) > 0
    assert {id(p) for p in in_optimizer} == {id(p) for p in adapters}
    assert all(not p.requires_grad for n, p in params.items() if not lora.is_adapter_key(n))
    assert ours == tuple(theirs)


# -- layouts in one process: each works, or is refused in one line by the resolution ------------


def test_evaluation_native_equals_hf_and_changes_nothing(trained):
    """training.eval_every's evaluation under LoRA: the held-out loss of the trained adapters is the same on both
    backends (≤1e-5: the same base, the same trained adapters) and evaluating moves no parameter."""
    evals = {}
    for backend in ("hf", "native"):
        model = trained[backend]["step"].backend.model
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        evals[backend] = trained[backend]["step"].evaluate()
        assert all(torch.equal(before[n], p.detach()) for n, p in model.named_parameters())
    print(f"\nheld-out loss after 3 LoRA steps: {evals}")
    assert abs(evals["hf"] - evals["native"]) <= 1e-5 and evals["hf"] == evals["hf"]


@pytest.mark.slow  # ~15 s unloaded, 31-35 s measured on the shared 2 cores
@pytest.mark.parametrize("backend", ["hf", "native"])
def test_accumulation_checkpointing_compile_equal_the_plain_run(trained, hf_dir, tmp_path, backend):
    """training.grad_accum=2 over data.batch_size=1, activation checkpointing (full) and torch.compile of each
    block (backend aot_eager: dynamo and AOT autograd through PEFT's layers, without inductor's C++ build), all at
    once: steps 1-2 equal the plain run's (batch 2, eager) to 1e-5 and the base stays bit-identical. Fails if any
    of them lost the adapters' gradients (step 2 would be the untouched base's loss) or trained the base."""
    from qwen3_research import lora

    model = ["model=hf", f"model.path={hf_dir}"] if backend == "hf" else ["model=native", f"model.init_from={hf_dir}"]
    step = build_step([*model, *FAST, *LORA, "training.steps=2", "data.batch_size=1", "training.grad_accum=2",
                       "parallelism.activation_checkpoint=full", "compile.enable=true", "compile.backend=aot_eager"],
                      tmp_path)
    m = step.backend.model
    base = {n: p.detach().clone() for n, p in m.named_parameters() if not lora.is_adapter_key(n)}
    losses, plain = run_steps(step, 2), trained[backend]["losses"][:2]
    names = [n for n, _ in m.named_modules()]
    checkpointed = getattr(m, "is_gradient_checkpointing", False) or any("checkpoint_wrapped" in n for n in names)
    print(f"\n[{backend}] accum 2 + AC + compile ({step.compiled}) {losses}\n     plain {plain}")
    assert step.compiled != "none" and checkpointed
    assert max(abs(a - b) for a, b in zip(losses, plain)) <= 1e-5 and losses[0] != losses[1]
    assert all(torch.equal(b, dict(m.named_parameters())[n].detach()) for n, b in base.items())


@pytest.mark.slow  # 14-40 s on the shared 2 cores: a bf16 step on CPU is ~12 s
def test_bf16_autocast_trains_the_adapters(trained, hf_dir, tmp_path):
    """training.mixed_precision=bf16 in one process (autocast over fp32 parameters), native, one step (a bf16
    step is ~12 s on CPU): the loss is the fp32 run's to bf16 rounding, every lora_B moved off its zero init
    (gradients reached each adapter through bf16), the base bit-identical."""
    from qwen3_research import lora

    step = build_step(["model=native", f"model.init_from={hf_dir}", *FAST, *LORA, "training.steps=1",
                       "training.mixed_precision=bf16"], tmp_path)
    m = step.backend.model
    base = {n: p.detach().clone() for n, p in m.named_parameters() if not lora.is_adapter_key(n)}
    loss, fp32 = run_steps(step, 1)[0], trained["native"]["losses"][0]
    b = {n: p for n, p in m.named_parameters() if ".lora_B." in n}
    print(f"\nbf16 autocast step 1 {loss} (fp32 {fp32}); {step.precision}; lora_B nonzero {sum(bool(p.abs().sum()) for p in b.values())}/{len(b)}")
    assert step.precision["mode"] == "autocast_bf16" and abs(loss - fp32) <= 1e-2
    assert b and all(p.abs().sum() > 0 for p in b.values())
    assert all(torch.equal(v, dict(m.named_parameters())[n].detach()) for n, v in base.items())


@pytest.mark.parametrize("overrides,expect", [
    (["model=native", "parallelism=tp2"], "model.lora.enable=true with parallelism.tp=2 on model=native: the adapters "
     "have no tensor-parallel plan on torchtitan's sharded Linears yet; use parallelism.tp=1 (FSDP and EP work), or "
     "model=hf for LoRA under tensor parallel"),
    (["model=native_moe", "model.lora.target_modules=[gate_proj,up_proj,down_proj]"], "model.lora.target_modules="
     "['gate_proj', 'up_proj', 'down_proj'] match no module of this MoE model: its MLPs are experts, which stay "
     "frozen; add the attention projections (q_proj, k_proj, v_proj, o_proj)"),
    (["model=hf", "model.path=HF", "parallelism=tp2", "model.lora.dropout=0.1"], "model.lora.dropout=0.1 with "
     "parallelism.tp=2: each tensor-parallel rank would draw its own dropout mask on the replicated adapter input; "
     "use model.lora.dropout=0"),
])
def test_what_lora_cannot_run_is_refused_by_the_resolution(hf_dir, overrides, expect):
    """Refused by ``resolve_run``, which the CLI, the launcher and the planner ask before any worker starts (its
    ConfigError is the CLI's one line, exit 2, nothing written: tests/test_resolve.py). In process: the resolution
    alone. Native TP: torchtitan 0.3 shards its Linears from their own configs, which PEFT's lora_A/lora_B have
    none of; model=hf has the adapter plan (lora.tp_plan)."""
    from qwen3_research.compose import compose
    from qwen3_research.errors import ConfigError
    from qwen3_research.resolve import resolve_run

    overrides = [o.replace("=HF", f"={hf_dir}") for o in overrides]
    with pytest.raises(ConfigError) as e:
        resolve_run(compose([*overrides, "device=cpu", "model.lora.enable=true", *FAST]))
    print(f"\nconfig error: {e.value}")
    assert str(e.value) == expect


# -- acceptance i: bad LoRA settings, one line before start -------------------------------------


@pytest.mark.parametrize("override,expect", [
    ("model.lora.rank=0", "model.lora.rank must be >= 1"),
    ("model.lora.target_modules=[qkv]", "match no module"),
])
def test_bad_lora_settings_are_one_line(tmp_path, override, expect):
    proc = run_cli(["model.lora.enable=true", override, *FAST], run_dir=tmp_path / "run")
    assert expect in one_line(proc, 2, "config error: ")
    assert not (tmp_path / "run").exists()


# -- CLI runs against one process (slow) --------------------------------------------------------


@pytest.mark.slow
def test_fsdp2_killed_and_resumed_equals_one_process(trained, hf_dir, tmp_path):
    """fsdp(2), SIGKILLed in step 2 after the step-1 save, resumed: steps 1-3 equal the one-process native run
    (≤1e-5). Its checkpoint holds the adapters and their optimizer state, not the base; sizes full vs LoRA."""
    run = tmp_path / "run"
    args = ["model=native", f"model.init_from={hf_dir}", *FAST, "data.batch_size=1", *LORA,
            "parallelism.nproc_per_node=2", "checkpoint.enable=true", "checkpoint.every=1"]
    killed = run_cli(args, run_dir=run, timeout=600, env=cli_env(**fault_env("kill@2:rank0")))
    assert killed.returncode != 0 and (run / "checkpoints" / "step-00000001").is_dir(), killed.stderr[-2000:]
    resumed = run_cli([*args, "checkpoint.resume=auto"], run_dir=run, timeout=600)
    assert_ok(resumed)
    assert "step-00000001 at step 1" in resumed.stdout
    one, two = trained["native"]["losses"], train_losses(run)
    ckpt = run / "checkpoints" / "step-00000003"
    meta = json.loads((ckpt / "meta.json").read_text())
    from qwen3_research.run.checkpoint import saved_tensor_shapes
    saved = saved_tensor_shapes(ckpt)
    lora_bytes = sum(f.stat().st_size for f in ckpt.iterdir())
    full = tmp_path / "full"  # the same model, every weight trained: one step, saved
    run_in_process(["model=native", f"model.init_from={hf_dir}", *FAST, "training.steps=1", "checkpoint.enable=true"],
                   full)
    full_bytes = sum(f.stat().st_size for f in next((full / "checkpoints").iterdir()).iterdir())
    print(f"\none process {one}\nfsdp(2) killed at step 2, resumed {two}\ncheckpoint: full {full_bytes / 2**20:.2f} MiB, "
          f"LoRA {lora_bytes / 2**20:.2f} MiB ({full_bytes / lora_bytes:.0f}x); base {meta['lora_base']}")
    assert len(two) == 3 and max(abs(a - b) for a, b in zip(one, two)) <= 1e-5
    assert all(".lora_" in k for k in saved if k.startswith("model."))
    assert any(k.startswith("optim.state.") and ".lora_A." in k for k in saved)
    assert meta["lora_base"]["path"] == str(hf_dir) and len(meta["lora_base"]["sha256"]) == 64


@pytest.mark.slow
def test_hf_tp2_equals_one_process(trained, hf_dir, tmp_path):
    """model=hf under tp(2): the adapters sharded as their base Linears; steps 1-3 equal one process (≤1e-5)."""
    proc = run_cli(["model=hf", f"model.path={hf_dir}", *FAST, *LORA, "parallelism.nproc_per_node=2",
                    "parallelism.tp=2"], run_dir=tmp_path / "tp", timeout=600)
    assert_ok(proc)
    one, two = trained["hf"]["losses"], train_losses(tmp_path / "tp")
    print(f"\none process {one}\ntp(2)       {two}")
    assert len(two) == 3 and max(abs(a - b) for a, b in zip(one, two)) <= 1e-5


@pytest.mark.slow
def test_moe_ep2_equals_one_process(tmp_path):
    """A MoE (native tiny_moe): adapters on attention only, experts frozen; ep(2) equals one process to MOE_TOL.
    Step 1 is bit-equal; later steps differ by the all-reduce's fp32 sum order, which torchtitan's experts (their
    grouped matmul in bf16, tests/test_parallel.py MOE_TOL) round to bf16: measured 2.8e-5 at step 3 of loss 12."""
    args = ["model=native_moe", *FAST, *LORA]
    from qwen3_research import lora

    step = build_step(args, tmp_path / "one")
    frozen = {n: p.detach().clone() for n, p in step.backend.model.named_parameters() if not lora.is_adapter_key(n)}
    one = run_steps(step)
    params = dict(step.backend.model.named_parameters())
    assert not any(".lora_" in n and "experts" in n for n in params)
    assert all(torch.equal(v, params[n].detach()) for n, v in frozen.items())  # the experts (and all the base)
    proc = run_cli([*args, "data.batch_size=1", "parallelism.nproc_per_node=2", "parallelism.ep=2"],
                   run_dir=tmp_path / "ep", timeout=600)
    assert_ok(proc)
    two = train_losses(tmp_path / "ep")
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("lora:"))
    print(f"\n{line}\none process {one}\nep(2)       {two}")
    assert "(k_proj,o_proj,q_proj,v_proj);" in line and "MoE experts are frozen" in line
    assert one[0] == two[0] and len(two) == 3 and max(abs(a - b) for a, b in zip(one, two)) <= MOE_TOL


@pytest.mark.slow
def test_resume_on_another_base_is_one_line(hf_dir, tmp_path):
    """A LoRA checkpoint names its base (path + sha256 of its weights): the same path with other weights is
    refused before anything starts, nothing written."""
    base = shutil.copytree(hf_dir, tmp_path / "base")
    run = tmp_path / "run"
    args = ["model=hf", f"model.path={base}", *FAST, "training.steps=1", *LORA, "checkpoint.enable=true"]
    run_in_process(args, run)
    write_hf_checkpoint(base, moe=False, seed=1)  # another model at the same path
    before = tree(run)
    proc = run_cli([*args, "training.steps=2", "checkpoint.resume=auto"], run_dir=run)
    assert "another base model" in one_line(proc, 2, "config error: ")
    assert tree(run) == before
