"""Run under torchrun (or alone): build a Trainer from Hydra overrides, as a run does, and report
(a) the logits on a fixed batch against a reference saved by the test, (b) this rank's memory while
``NativeQwen3.materialize`` runs (allocation + HF load), as JSON lines in OUT.<rank>.json.

Memory is measured as the process's anonymous resident memory (RssAnon in /proc/self/status: every
tensor the CPU allocator holds, not the mmapped safetensors pages), sampled every 0.5 ms by a thread
from just before ``materialize`` to just after it; the figure is peak minus the value at its start
(the meta-device model and everything built before hold no weight bytes).

usage: python tests/hf_load_worker.py OUT REFERENCE.pt override...
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

import torch


def rss_anon() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


class PeakSampler:
    def __enter__(self):
        self.start = rss_anon()
        self.peak = self.start
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_anon())
            time.sleep(0.0005)

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, rss_anon())


def main() -> None:
    out, ref_path, overrides = sys.argv[1], sys.argv[2], sys.argv[3:]
    from qwen3_research.compose import compose_resolved
    from qwen3_research.models.native import model as native
    from qwen3_research.resolve import resolve_run
    from qwen3_research.trainer import RunInfo, Trainer

    measured = {}
    original = native.NativeQwen3.materialize

    def materialize(self):
        if self._initialized:
            return original(self)
        with PeakSampler() as s:
            original(self)
        measured.update(start=s.start, peak=s.peak)

    native.NativeQwen3.materialize = materialize
    resolved = compose_resolved(overrides)
    run_dir = os.path.dirname(out)
    trainer = Trainer(resolve_run(resolved), RunInfo(run_dir=run_dir))
    ref = torch.load(ref_path, weights_only=True)
    trainer.step.backend.model.eval()
    with torch.no_grad():
        logits = trainer.step.backend.forward(ref["inputs"])
        logits = logits.full_tensor() if hasattr(logits, "full_tensor") else logits
    local = sum((p.to_local() if hasattr(p, "to_local") else p).numel() * p.element_size()
                for p in trainer.step.backend.model.parameters())  # this rank's shards
    row = {
        "rank": trainer.where.rank, "world": trainer.where.world_size, "max_abs_logit_diff": float((logits.float() - ref["logits"]).abs().max()),
        "load_peak_bytes": measured.get("peak", 0) - measured.get("start", 0),
        "params": trainer.step.backend.num_params, "local_param_bytes": local,
    }
    with open(f"{out}.{trainer.where.rank}.json", "w") as fh:
        json.dump(row, fh)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
