"""Chunked cross-entropy (training.loss=chunked) vs the full loss: peak live tensor bytes and step time.

1. Peak live tensor bytes of one training step (forward, loss, backward, optimizer step) of ``tiny``
   at seq_len 2048, batch 4 (8,192 tokens), traced by ``qwen3_research.plan`` (PyTorch's MemTracker
   over the real Trainer's step on fake tensors: the full loss would need ~14 GiB of real memory).
2. The same, measured with real tensors (MemTracker in the run) at seq_len 2048, batch 1.
3. Median step time, the two trainers taking turns step by step at seq_len 2048, batch 1.

    python benchmarks/bench_chunked_loss.py [--steps 6]
"""

from __future__ import annotations

import argparse
import statistics
import time

import _common as C

GIB = 1024**3
BASE = ["model=native", "model.flavor=tiny", "data.seq_len=2048", "device=cpu"]


def traced_peak(loss: str, batch: int) -> int:
    from qwen3_research.compose import compose_resolved
    from qwen3_research.planner import make_plan

    plan = make_plan(compose_resolved(BASE + [f"data.batch_size={batch}", f"training.loss={loss}",
                                     "logging.wandb.mode=disabled", "training.eval_every=0"]))
    return plan.peak


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=6)
    args = ap.parse_args()

    full, chunked = traced_peak("full", 4), traced_peak("chunked", 4)
    print(f"traced peak live tensor bytes, tiny, seq_len 2048, batch 4: full {full / GIB:.3f} GiB, "
          f"chunked {chunked / GIB:.3f} GiB, reduction {100 * (1 - chunked / full):.1f} % (target >= 40 %)", flush=True)

    from qwen3_research.memory import track_step

    trainers = {k: C.build_trainer(BASE + ["data.batch_size=1", f"training.loss={k}", f"training.steps={args.steps + 1}"])
                for k in ("full", "chunked")}
    measured = {}
    for k, tr in trainers.items():
        _, peaks = track_step(tr.step, tr.step.backend.model, tr.step.optimizer)  # step 1
        measured[k] = peaks[0]
    print(f"measured peak live tensor bytes (real tensors), seq_len 2048, batch 1: full {measured['full'] / GIB:.3f} GiB, "
          f"chunked {measured['chunked'] / GIB:.3f} GiB, reduction {100 * (1 - measured['chunked'] / measured['full']):.1f} %",
          flush=True)
    times = {k: [] for k in trainers}
    losses = {k: [] for k in trainers}
    for step in range(1, args.steps + 1):
        for k, tr in trainers.items():
            t0 = time.perf_counter()
            loss, _ = tr.step()  # step + 1
            times[k].append(time.perf_counter() - t0)
            losses[k].append(loss)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"median step time over {args.steps} alternating steps, seq_len 2048, batch 1: full {med['full']:.3f} s, "
          f"chunked {med['chunked']:.3f} s; chunked speed = {med['full'] / med['chunked']:.3f} x full (target >= 0.95)")
    print(f"losses full {[round(x, 5) for x in losses['full']]}\n       chunked {[round(x, 5) for x in losses['chunked']]}")
    for tr in trainers.values():
        tr.close()


if __name__ == "__main__":
    main()
