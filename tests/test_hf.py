"""model=hf and model.init_from: parity of the two backends on the same HF checkpoint, and one-line errors.

The HF checkpoints are random small Qwen3 / Qwen3-MoE models written with ``save_pretrained``,
shaped like our ``tiny`` flavors (no Qwen3 weights ship in any package we can install).
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.conftest import FAST, assert_ok, read_metrics, run_cli, train_losses

TINY_DENSE = dict(vocab_size=151936, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=True,
                  rope_parameters={"rope_type": "default", "rope_theta": 1e6}, rms_norm_eps=1e-6,
                  max_position_embeddings=4096)
TINY_MOE = {**TINY_DENSE, "tie_word_embeddings": False, "moe_intermediate_size": 128, "num_experts": 8,
            "num_experts_per_tok": 2, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": []}
ONE_STEP = [o for o in FAST if not o.startswith("training.steps")] + ["training.steps=1"]


def qwen3_tokenizer_dir() -> Path:
    from qwen3_research.data import tokenizer_path

    return tokenizer_path("qwen3").parent


def write_hf_checkpoint(out: Path, moe: bool, seed: int = 0, **overrides) -> Path:
    """A random Qwen3(-MoE) checkpoint on disk, with the Qwen3 tokenizer files beside it."""
    from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3MoeConfig

    cfg = (Qwen3MoeConfig if moe else Qwen3Config)(**{**(TINY_MOE if moe else TINY_DENSE), **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt"):
        shutil.copyfile(qwen3_tokenizer_dir() / name, out / name)
    return out


def run_in_process(overrides: list[str], run_dir: Path) -> dict:
    """One run through the launcher's real path (validate, preflight, Trainer), in this process."""
    from qwen3_research.compose import compose
    from qwen3_research.launch.elastic import run

    return run(compose(overrides), str(run_dir))


def tree_digest(path: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(Path(path).rglob("*")):
        if p.is_file():
            h.update(str(p.relative_to(path)).encode())
            h.update(p.read_bytes())
    return h.hexdigest()


@pytest.fixture(scope="module")
def hf_dense(tmp_path_factory) -> Path:
    return write_hf_checkpoint(tmp_path_factory.mktemp("hf") / "qwen3_tiny", moe=False)


@pytest.fixture(scope="module")
def hf_moe(tmp_path_factory) -> Path:
    return write_hf_checkpoint(tmp_path_factory.mktemp("hf") / "qwen3_moe_tiny", moe=True)


# -- acceptance a: backend parity ------------------------------------------------------------


@pytest.mark.parametrize("moe,tol", [(False, 1e-5)], ids=["dense"])
def test_step1_loss_hf_backend_equals_native_init_from(hf_dense, hf_moe, tmp_path, moe, tol):
    """Same weights, same batch: model=hf and model=native init_from agree on the step-1 loss.

    Dense is fp32 on both sides (measured 0 to 1e-6). MoE parity is checked on logits, with fp32
    experts to 1e-5, in tests/test_hf_interop.py (a step-1 loss cannot tell MoE inits apart).
    """
    hf_dir = hf_moe if moe else hf_dense
    native = "native_moe" if moe else "native"
    run_in_process(["model=hf", f"model.path={hf_dir}", *ONE_STEP], tmp_path / "hf")
    run_in_process([f"model={native}", f"model.init_from={hf_dir}", *ONE_STEP], tmp_path / "native")
    run_in_process([f"model={native}", *ONE_STEP], tmp_path / "random")  # control: init_from must matter
    hf_loss, = train_losses(tmp_path / "hf")
    native_loss, = train_losses(tmp_path / "native")
    random_loss, = train_losses(tmp_path / "random")
    print(f"\n[{native}] step-1 loss model=hf: {hf_loss:.7f}  model={native} init_from: {native_loss:.7f}  "
          f"|diff|={abs(hf_loss - native_loss):.2e} (tol {tol:g}); random init: {random_loss:.7f}")
    assert abs(hf_loss - native_loss) < tol
    assert abs(random_loss - native_loss) > 1e-4  # the HF weights were loaded, not our own seeded init
    assert read_metrics(tmp_path / "hf")[0]["first_step"] is True


def test_init_from_logits_match_transformers(hf_dense):
    """The converted weights, not only the loss: full logits vs transformers within 1e-4 (fp32)."""
    from transformers import AutoModelForCausalLM

    from qwen3_research import devices
    from qwen3_research.config import ModelConfig

    devices.prepare_torchtitan("cpu")
    from qwen3_research.models import build

    backend = build(ModelConfig(backend="native", flavor="tiny", init_from=str(hf_dense)), torch.device("cpu"),
                    seq_len=32, seed=1)
    backend.materialize()
    hf = AutoModelForCausalLM.from_pretrained(hf_dense, dtype=torch.float32, attn_implementation="sdpa")
    x = torch.randint(0, 151669, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = float((backend.forward(x) - hf(input_ids=x).logits).abs().max())
    print(f"\nnative(init_from) vs transformers max |logit diff| = {diff:.2e}")
    assert diff < 1e-4


# -- acceptance e: one-line errors, exit 2, nothing written ----------------------------------


def _damaged_copy(src: Path, dst: Path, how: str) -> Path:
    shutil.copytree(src, dst)
    st = dst / "model.safetensors"
    if how == "corrupt":
        data = st.read_bytes()
        st.write_bytes(data[:8] + b"{not json" + data[17: len(data) // 3])  # damaged header, truncated
    elif how == "missing":
        st.unlink()
    elif how == "llama":
        cfg = json.loads((dst / "config.json").read_text())
        cfg.update(model_type="llama", architectures=["LlamaForCausalLM"])
        (dst / "config.json").write_text(json.dumps(cfg))
    elif how == "truncated":
        st.write_bytes(st.read_bytes()[: st.stat().st_size // 2])
    elif how == "noconfig":
        (dst / "config.json").unlink()
    elif how == "index":
        names = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
        st.rename(dst / names[0])
        index = {"metadata": {}, "weight_map": {"model.embed_tokens.weight": names[0], "model.norm.weight": names[1]}}
        (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    elif how == "yarn":
        cfg = json.loads((dst / "config.json").read_text())
        cfg["rope_parameters"] = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6,
                                  "original_max_position_embeddings": 32768}
        (dst / "config.json").write_text(json.dumps(cfg))
    elif how == "sparse":
        cfg = json.loads((dst / "config.json").read_text())
        cfg.update(decoder_sparse_step=2)
        (dst / "config.json").write_text(json.dumps(cfg))
    elif how == "shape":
        cfg = json.loads((dst / "config.json").read_text())
        cfg.update(hidden_size=256, num_hidden_layers=2)
        (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("how,model,expect", [
    ("corrupt", "native", "model.safetensors is corrupt or truncated"),
    ("missing", "native", "no *.safetensors weights"),
    ("llama", "native", "model_type='llama' (LlamaForCausalLM) but model=native needs model_type='qwen3'"),
    ("shape", "native", "the safetensors do not fit config.json: model.embed_tokens.weight: stored [151936, 128], "
                        "config.json needs [151936, 256]"),
    ("truncated", "native", "model.safetensors is corrupt or truncated (its tensors need"),
    ("noconfig", "native", "no config.json; point it at a Hugging Face model directory"),
    ("index", "native", "model.safetensors.index.json names files that are not there: model-00002-of-00002.safetensors"),
    ("yarn", "native", "RoPE scaling rope_type='yarn', which model=native does not implement"),
    ("sparse", "native_moe", "decoder_sparse_step=2 (every layer MoE: 1 only)"),
    ("corrupt", "hf", "cannot load the model"),
    ("missing", "hf", "cannot load the model"),
])
def test_bad_hf_checkpoint_is_one_line_config_error(hf_dense, hf_moe, tmp_path, how, model, expect):
    bad = _damaged_copy(hf_moe if model == "native_moe" else hf_dense, tmp_path / f"bad_{how}", how)
    before = tree_digest(bad)
    arg = f"model.path={bad}" if model == "hf" else f"model.init_from={bad}"
    proc = run_cli([f"model={model}", arg, *ONE_STEP], run_dir=tmp_path / "run", timeout=240)
    err = [ln for ln in proc.stderr.splitlines() if ln.strip() and "Warning" not in ln and "warn(" not in ln]
    print(f"\n[{how}/{model}] exit {proc.returncode}: {err[-1] if err else ''}")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert err[-1].startswith("config error: ") and expect in err[-1], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert tree_digest(bad) == before
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_tokenizer_larger_than_the_checkpoints_vocab_is_config_error(tmp_path):
    """A checkpoint with 1,000 embedding rows and the 151,669-token Qwen3 tokenizer: refused before training."""
    small = write_hf_checkpoint(tmp_path / "small_vocab", moe=False, vocab_size=1000)
    proc = run_cli([f"model.init_from={small}", *ONE_STEP], run_dir=tmp_path / "run", timeout=240)
    last = proc.stderr.strip().splitlines()[-1]
    print(f"\nexit {proc.returncode}: {last}")
    assert proc.returncode == 2 and last.startswith("config error: ")
    assert "the tokenizer has 151669 tokens but the model has 1000 embedding rows" in last
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


# -- model=hf under FSDP2 and tensor parallel ------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["tp2", "dp_shard2"])
def test_hf_backend_parallel_matches_single_process(hf_dense, tmp_path, layout):
    """2 processes (gloo): tp=2 sees the same batch of 2, dp_shard=2 splits a global batch of 4."""
    two = [o for o in FAST if not o.startswith(("training.steps", "data.batch_size"))] + ["training.steps=2"]
    par = ["parallelism.tp=2", "parallelism.dp_shard=1"] if layout == "tp2" else ["parallelism.dp_shard=2"]
    batch = "data.batch_size=2"
    ref_batch = "data.batch_size=2" if layout == "tp2" else "data.batch_size=4"
    run_in_process(["model=hf", f"model.path={hf_dense}", *two, ref_batch], tmp_path / "single")
    proc = run_cli(["model=hf", f"model.path={hf_dense}", *two, batch, "parallelism.nproc_per_node=2", *par],
                   run_dir=tmp_path / "multi", timeout=400)
    assert_ok(proc)
    single, multi = train_losses(tmp_path / "single"), train_losses(tmp_path / "multi")
    print(f"\n[hf {layout}] single {single} vs 2 processes {multi}")
    assert len(multi) == 2 and max(abs(a - b) for a, b in zip(single, multi)) < 1e-5


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_hf_flops_per_token_equals_torchtitans(moe):
    """The same model in both backends gets the same FLOPs per token, so MFU compares across backends."""
    import torch
    from transformers import AutoModelForCausalLM

    from qwen3_research import devices

    devices.prepare_torchtitan("cpu")
    from qwen3_research.models.native.hf_config import hf_config_fields
    from qwen3_research.config import ModelConfig
    from qwen3_research.models import get_flavor
    from qwen3_research.models.hf.model import hf_flops_per_token
    from qwen3_research.models.native.model import NativeQwen3

    backend = "native_moe" if moe else "native"
    native = NativeQwen3(ModelConfig(backend=backend, flavor="tiny"), torch.device("cpu"), 64, 0)
    from transformers import Qwen3Config, Qwen3MoeConfig

    fields = hf_config_fields(get_flavor(backend, "tiny"), moe)
    text = (Qwen3MoeConfig if moe else Qwen3Config)(**fields)
    hf = AutoModelForCausalLM.from_config(text)
    f = get_flavor(backend, "tiny")
    ours = hf_flops_per_token(hf, text, f.n_heads, f.head_dim, 64)
    print(f"flops/token native {native.flops_per_token} hf {ours}")
    assert ours == native.flops_per_token
