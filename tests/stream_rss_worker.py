"""Subprocess of tests/test_token_stream.py: build data=hf's token stream from a large local JSONL dataset and
read every window once, sampling the process's anonymous resident memory (RssAnon: the heap; the memory-mapped
stream is file-backed, RssFile) every 5 ms. Prints one JSON line: baseline and peak RssAnon, sizes."""

from __future__ import annotations

import json
import sys
import threading
import time


def rss_anon() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


def main(data_dir: str, warm_dir: str, tokenizer: str) -> None:
    import numpy as np

    from qwen3_research.config import DataConfig, HFDatasetConfig
    from qwen3_research.data import PackedDataset, Tokenizer

    tok = Tokenizer(__import__("pathlib").Path(tokenizer))
    # The same path over a dataset of a few rows first: datasets imports its JSON builder, pyarrow's reader
    # and their dependencies on the first load_dataset (~290 MiB measured, whatever the size): not the data.
    PackedDataset(DataConfig(source="hf", seq_len=8, val_fraction=0, hf=HFDatasetConfig(name=warm_dir, streaming=True)), tok)
    cfg = DataConfig(source="hf", seq_len=128, batch_size=8, hf=HFDatasetConfig(name=data_dir, streaming=True))
    base = rss_anon()
    peak, stop = [base], threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], rss_anon())
            time.sleep(0.005)

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    t0 = time.perf_counter()
    ds = PackedDataset(cfg, tok)
    built_s = time.perf_counter() - t0
    checksum = 0
    steps = len(ds.train) // cfg.batch_size
    for step in range(steps):  # every window once, in the seeded order
        checksum += int(ds.train_batch(step, 0, 1, 0, 1, seed=0).inputs[:, 0].sum())
    stop.set()
    t.join()
    print(json.dumps({"base": base, "peak": peak[0], "windows": len(ds.train), "val_windows": len(ds.val),
                      "tokens": ds.num_tokens, "documents": ds.num_documents, "build_s": built_s,
                      "memmap": isinstance(ds.train, np.memmap), "steps": steps, "checksum": checksum}))


if __name__ == "__main__":
    main(*sys.argv[1:])
