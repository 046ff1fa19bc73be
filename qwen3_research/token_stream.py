"""``data=hf`` streamed: documents read one at a time, tokenized a chunk at a time into an on-disk token stream
(one for training, one for validation), then read back as a memory map. Memory stays bounded by one chunk
of documents whatever the dataset's size; the windows, their seeded order and resume-from-step are the ones
``data.PackedDataset`` gives every source (a window is ``seq_len + 1`` consecutive tokens of the stream).

- Validation split without knowing the number of documents: a document is held out when the first 8 bytes of
  the sha256 of its name (``<hf.name>:<row>``), as an integer, fall below ``val_fraction · 2**64`` (for the
  listed sources the lowest-hash ``round(val_fraction · N)`` documents are held out: ``data.PackedDataset``).
- The stream is built once per dataset, tokenizer and split settings (``cache_key``), under
  ``<cache>/tokens/hf-<key>/``: ``train.bin`` and ``val.bin`` (int32 tokens, each document followed by the
  end-of-text token) and ``meta.json``, written last. A build that stops half way leaves nothing behind (it
  writes into a temporary directory renamed at the end); ranks and runs starting together wait for one build
  (a file lock). A Hub dataset that changes upstream is not noticed: delete the directory to read it again.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Callable, Iterator

import filelock
import numpy as np

from qwen3_research.errors import ConfigError, TrainingError, write_failure

CHUNK_DOCS = 256  # documents tokenized at once: what bounds memory (with datasets' own read buffer)
META = "meta.json"
# The cache's file system refusing a write (full, quota, file-size limit, read-only, permission).
_WRITE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EACCES, errno.EPERM)


def held_out(name: str, val_fraction: float) -> bool:
    """The streamed validation rule: a stable hash of the document's name below ``val_fraction`` of its range."""
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big") < val_fraction * 2**64


def _local_files(path: str) -> list[list]:
    """[relative path, size, mtime_ns] of the files under a local dataset path (none for a Hub id)."""
    p = Path(os.path.expanduser(path))
    files = [p] if p.is_file() else sorted(f for f in p.rglob("*") if f.is_file()) if p.is_dir() else []
    return [[str(f.relative_to(p) if p.is_dir() else f.name), f.stat().st_size, f.stat().st_mtime_ns] for f in files]


def cache_key(cfg, tokenizer_sha256: str) -> str:
    """What fixes the token streams, known before reading a row."""
    h = cfg.hf
    fields = {"tokenizer": tokenizer_sha256, "name": h.name, "config_name": h.config_name, "split": h.split,
              "text_field": h.text_field, "rows": h.max_documents, "max_documents": cfg.max_documents,
              "val_fraction": cfg.val_fraction, "files": _local_files(h.name), "format": 1}
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:24]


def build(directory: Path, documents: Iterator[tuple[str, str]], tokenizer, val_fraction: float,
          max_documents: int | None) -> dict:
    """Tokenize ``documents`` (non-empty ones, up to ``max_documents``) into train.bin / val.bin under ``directory``."""
    eos = np.array([tokenizer.eos_id], dtype=np.int32)
    meta = {"documents": 0, "tokens": 0, "val_documents": 0, "train_tokens": 0, "val_tokens": 0}
    with open(directory / "train.bin", "wb") as train, open(directory / "val.bin", "wb") as val:
        def flush(chunk: list[tuple[str, str]]) -> None:
            for (name, _), ids in zip(chunk, tokenizer.encode_batch([t for _, t in chunk])):
                is_val = held_out(name, val_fraction)
                (val if is_val else train).write(np.asarray(ids, dtype=np.int32).tobytes() + eos.tobytes())
                meta["documents"] += 1
                meta["tokens"] += len(ids)
                meta["val_documents"] += is_val
                meta["val_tokens" if is_val else "train_tokens"] += len(ids) + 1

        chunk: list[tuple[str, str]] = []
        for name, text in documents:
            if not text.strip():
                continue
            if max_documents is not None and meta["documents"] + len(chunk) >= max_documents:
                break
            chunk.append((name, text))
            if len(chunk) == CHUNK_DOCS:
                flush(chunk)
                chunk = []
        if chunk:
            flush(chunk)
    (directory / META).write_text(json.dumps(meta))
    return meta


def open_or_build(cfg, tokenizer, documents: Callable[[], Iterator[tuple[str, str]]], cache_root: Path) -> tuple[Path, dict]:
    """(the stream's directory, its meta), building it first when no complete one exists."""
    final = cache_root / "tokens" / f"hf-{cache_key(cfg, tokenizer.sha256)}"
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        with filelock.FileLock(final.with_name(final.name + ".lock")):  # one build; whoever waited finds it complete
            try:
                return final, json.loads((final / META).read_text())
            except (OSError, ValueError):
                shutil.rmtree(final, ignore_errors=True)  # incomplete or damaged: built again
            tmp = final.with_name(f"{final.name}.tmp-{os.getpid()}")
            shutil.rmtree(tmp, ignore_errors=True)
            try:  # on any failure (a full disk, Ctrl-C) the partial stream goes: it held the space for later runs
                tmp.mkdir()
                meta = build(tmp, documents(), tokenizer, cfg.val_fraction, cfg.max_documents)
                os.replace(tmp, final)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
            return final, meta
    except OSError as e:  # the stream is this run's data (data=hf): without it the run cannot train
        if e.errno not in _WRITE_ERRNOS:  # e.g. the dataset's own read failing: its own error
            raise
        why, fix = write_failure(e, final.parent, "QWEN3_RESEARCH_CACHE")
        raise TrainingError(f"data: cannot write the token stream to {final.parent} ({why}); the partial stream was "
                            f"removed; {fix}") from None


def windows(path: Path, window: int) -> np.ndarray:
    """The stream's ``window``-token windows, (n, window) int32, memory-mapped (read-only: pages come from the
    file, not from the process's own memory)."""
    n = path.stat().st_size // 4 // window
    if n == 0:
        return np.zeros((0, window), dtype=np.int32)
    return np.memmap(path, dtype=np.int32, mode="r", shape=(n * window,)).reshape(n, window)


def dataset_rows(h) -> Iterator[tuple[int, dict]]:
    """(index, row) of ``data.hf``'s dataset, at most ``h.max_documents`` of them, one at a time (``h.streaming``:
    datasets' IterableDataset, nothing downloaded up front). A dataset that does not load is one ConfigError line.
    Both readers of data.hf use it: raw text (data.py) and conversations (chat_sources.py)."""
    import datasets  # deferred: start-up (datasets loads pyarrow; only a run reading data.hf.name needs it)

    try:
        ds = datasets.load_dataset(h.name, h.config_name, split=h.split, streaming=h.streaming)
    except Exception as e:  # datasets raises many types; the message is what matters
        raise ConfigError(f"data.hf.name={h.name!r}: cannot load ({type(e).__name__}: {str(e).splitlines()[0][:200]})") from None
    for i, row in enumerate(ds):
        if h.max_documents is not None and i >= h.max_documents:
            break
        yield i, row
