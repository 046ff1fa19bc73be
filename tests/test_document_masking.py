"""Issue 25 (3): document masking inside packed windows (data.document_masking).

Positions restart at 0 after every end-of-text token; attention stays inside a document; the end-of-text token does
not predict the next document. A token's logits do not change when the document before it in the window is
replaced (native: torchtitan's Qwen3 with a boolean SDPA mask; hf: transformers' packed-sequence mask from
position_ids), and the two backends agree with masking on.
"""

from __future__ import annotations

import pytest
import torch

from tests.test_hf import write_hf_checkpoint

EOS = 151643  # <|endoftext|> of the Qwen3 tokenizer


def test_positions_restart_after_end_of_text_and_its_label_is_ignored():
    from qwen3_research.config import DataConfig
    from qwen3_research.data import PackedDataset, document_positions

    x = torch.tensor([[5, 6, EOS, 7, 8, 9, EOS, 3], [1, 2, 3, 4, 5, 6, 7, 8]])
    assert document_positions(x, EOS).tolist() == [[0, 1, 2, 0, 1, 2, 3, 0], list(range(8))]
    ds = PackedDataset.__new__(PackedDataset)  # only _to_batch: no corpus needed
    ds.cfg, ds.eos_id = DataConfig(document_masking=True), EOS
    window = torch.cat([x[0], torch.tensor([11])])[None].numpy()
    b = ds._to_batch(window)
    assert b.positions.tolist() == [[0, 1, 2, 0, 1, 2, 3, 0]]
    assert b.labels.tolist() == [[6, EOS, -100, 8, 9, EOS, -100, 11]]  # EOS -> next document's first: ignored
    ds.cfg = DataConfig(document_masking=False)
    assert ds._to_batch(window).positions is None and ds._to_batch(window).labels.tolist() == [[6, EOS, 7, 8, 9, EOS, 3, 11]]


@pytest.fixture(scope="module")
def hf_dense(tmp_path_factory):
    return write_hf_checkpoint(tmp_path_factory.mktemp("docmask") / "qwen3_tiny", moe=False)


@pytest.fixture(scope="module")
def backends(hf_dense):
    """model=hf and model=native (init_from the same checkpoint), fp32 on CPU (SDPA)."""
    from qwen3_research.config import ModelConfig
    from qwen3_research.models.hf.model import HFCausalLM
    from tests.test_hf_interop import native_from

    hf = HFCausalLM(ModelConfig(backend="hf", path=str(hf_dense)), torch.device("cpu"), seq_len=64, seed=0)
    hf.model.eval()
    return {"native": native_from(hf_dense, moe=False, seq_len=64), "hf": hf}


def _doc(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 151000, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", ["native", "hf"])
def test_replacing_the_previous_document_leaves_a_tokens_logits_unchanged(backends, name):
    """Window = doc A, EOS, doc B. Replace A by another document of another length: doc B's logits are the same
    (it starts at position 0 and sees only itself), and equal doc B run alone; without masking they move."""
    from qwen3_research.data import document_positions

    backend = backends[name]
    B = _doc(19, 3)
    w1 = torch.cat([_doc(12, 1), torch.tensor([EOS]), B])[None]
    w2 = torch.cat([_doc(7, 2), torch.tensor([EOS]), B])[None]
    with torch.no_grad():
        l1 = backend.forward(w1, positions=document_positions(w1, EOS))[0, -19:]
        l2 = backend.forward(w2, positions=document_positions(w2, EOS))[0, -19:]
        alone = backend.forward(B[None])[0]
        plain = backend.forward(w1)[0, -19:]
    replaced, vs_alone, unmasked = (float((l1 - o).abs().max()) for o in (l2, alone, plain))
    print(f"\n[{name}] doc B logits: previous doc replaced max|diff| {replaced:.1e}; vs doc B alone {vs_alone:.1e}; "
          f"plain causal (no masking) {unmasked:.2f}")
    assert replaced <= 1e-5 and vs_alone <= 1e-5
    assert unmasked > 1e-2  # the control: without masking doc B sees doc A


@pytest.mark.feature("document masking (data.document_masking)")
def test_native_and_hf_agree_with_masking(backends):
    """Same checkpoint, same packed batch (2 rows, several documents each): logits within 1e-5 (fp32)."""
    from qwen3_research.data import document_positions

    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 151000, (2, 64), generator=g)
    x[0, [9, 30, 31]] = EOS  # documents of 10, 21, 1 and 32 tokens; row 1: EOS at 50 only
    x[1, 50] = EOS
    pos = document_positions(x, EOS)
    with torch.no_grad():
        native, hf = (backends[n].forward(x, positions=pos) for n in ("native", "hf"))
    diff = float((native - hf).abs().max())
    print(f"\nnative vs hf with document masking: max |logit diff| {diff:.2e} over {tuple(native.shape)}")
    assert diff <= 1e-5


@pytest.mark.slow
def test_tp2_masked_losses_equal_the_single_process_masked_losses(tmp_path):
    """Issue 33 (1): data.document_masking with parallelism=tp2 died at step 1 (`ScaledDotProductAttention does not
    support attention_masks`): torchtitan's Module.parallelize stores each sharded module's bound forward on the
    instance, so the masked SDPA swapped in at the first masked step was never called. Short documents (3-12 words)
    put several in every 32-token window: the tp2 losses equal one process's to 1e-5 (fp32), and differ from the
    unmasked run's (the control: masking acts)."""
    import json
    import random

    from tests.conftest import FAST, run_cli, train_losses

    words = "the a king queen sword river night morning stone bread wine ship sea storm crown".split()
    r = random.Random(0)
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": " ".join(r.choice(words) for _ in range(r.randint(3, 12)))}) + "\n"
                            for _ in range(300)))
    base = [*FAST, "data=files", f"data.files={docs}"]
    losses = {}
    for name, extra in [("one", ["data.document_masking=true"]), ("tp2", ["data.document_masking=true", "parallelism=tp2"]),
                        ("unmasked", [])]:
        out = run_cli([*base, *extra], run_dir=tmp_path / name)
        assert out.returncode == 0, out.stderr[-2000:]
        losses[name] = train_losses(tmp_path / name)
    print(f"\nmasked one process {losses['one']}\nmasked tp2 {losses['tp2']}\nunmasked {losses['unmasked']}")
    assert len(losses["tp2"]) == 3
    assert max(abs(a - b) for a, b in zip(losses["one"], losses["tp2"])) <= 1e-5
    assert max(abs(a - b) for a, b in zip(losses["one"], losses["unmasked"])) > 1e-3
