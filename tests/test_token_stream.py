"""Issue 25 (3): data=hf streams (qwen3_research.token_stream): documents read one at a time into an on-disk token
stream, windows read back through a memory map; bounded memory on a large generated dataset."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import ROOT


def word_tokenizer(out: Path, words: list[str]) -> Path:
    """A word-level tokenizer.json (whitespace split) with <|endoftext|>: fast enough to tokenize 40 MB in a test."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit

    vocab = {w: i for i, w in enumerate(words)}
    vocab.update({"<|endoftext|>": len(vocab), "<unk>": len(vocab) + 1})
    tok = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = WhitespaceSplit()
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    return out / "tokenizer.json"


def write_jsonl(path: Path, docs: list[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as fh:
        for d in docs:
            fh.write(json.dumps({"text": d}) + "\n")


def test_streamed_windows_split_and_cache(tmp_path, monkeypatch):
    """The training windows are the training documents' tokens, each followed by EOS, cut in seq_len+1 windows, in
    stream order; held-out documents are those whose name hashes below val_fraction; a second build reads the
    cache; the seeded order and resume-from-step are the listed sources' (batch_indices)."""
    from qwen3_research import token_stream
    from qwen3_research.config import DataConfig, HFDatasetConfig
    from qwen3_research.data import PackedDataset, Tokenizer

    monkeypatch.setenv("QWEN3_RESEARCH_CACHE", str(tmp_path / "cache"))
    words = [f"w{i}" for i in range(50)]
    rng = random.Random(0)
    docs = [" ".join(rng.choice(words) for _ in range(rng.randint(5, 60))) for _ in range(300)]
    docs[7] = "   "  # empty: skipped
    write_jsonl(tmp_path / "ds" / "part.jsonl", docs)
    tok = Tokenizer(word_tokenizer(tmp_path / "tok", words))
    cfg = DataConfig(source="hf", seq_len=16, val_fraction=0.1, hf=HFDatasetConfig(name=str(tmp_path / "ds"), streaming=True))
    ds = PackedDataset(cfg, tok)
    names = [f"{tmp_path / 'ds'}:{i}" for i in range(len(docs))]
    val = [i for i in range(len(docs)) if docs[i].strip() and token_stream.held_out(names[i], 0.1)]
    stream = [t for i, d in enumerate(docs) if d.strip() and i not in val for t in [*tok.encode_batch([d])[0], tok.eos_id]]
    n = len(stream) // 17
    print(f"\n{len(docs) - 1} documents, {len(val)} held out (hash < 0.1·2**64), {len(ds.train)} training windows of 17 "
          f"tokens from a {len(stream)}-token stream; memmap {type(ds.train).__name__}")
    assert isinstance(ds.train, np.memmap) and ds.num_documents == len(docs) - 1 and ds.val_documents == len(val)
    assert 15 <= len(val) <= 45  # ~10 % of 299
    assert np.array_equal(np.asarray(ds.train), np.array(stream[: n * 17]).reshape(n, 17))
    meta = next((tmp_path / "cache" / "tokens").glob("hf-*/meta.json"))
    stamp = meta.stat().st_mtime_ns
    again = PackedDataset(cfg, tok)  # from the cache: not built again
    assert meta.stat().st_mtime_ns == stamp and np.array_equal(again.train, ds.train)
    assert np.array_equal(again.batch_indices(5, 8, seed=3), ds.batch_indices(5, 8, seed=3))
    b = ds.train_batch(2, 0, 1, 0, 1, seed=0)
    assert b.inputs.dtype.is_floating_point is False and b.inputs.shape == (4, 16)


def _stream_in_worker(tmp_path: Path, n_docs: int) -> dict:
    """stream_rss_worker.py over ``n_docs`` generated documents (100-600 words of 4,000): its JSON line + sizes."""
    rng = np.random.default_rng(0)
    words = [f"w{i}" for i in range(4000)]
    vocab = np.array(words)
    root = tmp_path / str(n_docs)
    write_jsonl(root / "ds" / "big.jsonl", [" ".join(vocab[rng.integers(0, 4000, int(n))])
                                           for n in rng.integers(100, 600, n_docs)])
    write_jsonl(root / "warm" / "small.jsonl", ["w1 w2 w3"] * 20)
    tok = word_tokenizer(root / "tok", words)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "QWEN3_RESEARCH_CACHE": str(root / "cache"),
           "HF_DATASETS_CACHE": str(root / "hf_cache")}
    out = subprocess.run([sys.executable, str(ROOT / "tests" / "stream_rss_worker.py"), str(root / "ds"),
                          str(root / "warm"), str(tok)], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    r["mb"] = (root / "ds" / "big.jsonl").stat().st_size / 1e6
    r["growth_mib"] = (r["peak"] - r["base"]) / 2**20
    print(f"\n{r['mb']:.1f} MB JSONL, {r['documents']} documents, {r['tokens']:,} tokens, {r['windows']:,} windows "
          f"(+{r['val_windows']} held out); built in {r['build_s']:.1f} s; RssAnon {r['base'] / 2**20:.0f} MiB -> peak "
          f"{r['peak'] / 2**20:.0f} MiB (+{r['growth_mib']:.1f} MiB) while building and reading all {r['steps']} batches")
    assert r["memmap"] and r["documents"] == n_docs
    return r


@pytest.mark.slow
def test_streaming_a_large_dataset_keeps_memory_bounded(tmp_path):
    """16 MB and 64 MB of JSONL (2.8 M and 11 M tokens) through data=hf, each in a fresh process: the heap
    (RssAnon) grows by a constant, not with the data: under 160 MiB for 64 MB, and by less than 48 MiB more than
    for 16 MB (datasets' JSON reader buffers ~10 MB blocks; our chunk is 256 documents). Listing the 64 MB as
    before held every text (64 MB), every token as a Python int (~400 MB) and the int64 windows (~90 MB)."""
    small, big = _stream_in_worker(tmp_path, 8000), _stream_in_worker(tmp_path, 32000)
    assert big["tokens"] > 3.9 * small["tokens"]
    assert big["growth_mib"] < 160 and big["growth_mib"] - small["growth_mib"] < 48
