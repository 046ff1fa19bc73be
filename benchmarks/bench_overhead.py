"""(1) Framework overhead: our Trainer's steady step vs a bare PyTorch loop on the same model.

One process. The Trainer runs its real loop (``Trainer.train()``: data, loss, clip, finiteness
check, AdamW, LR schedule, memory query, console + metrics.jsonl logging every step); a hook
on the step's call (``trainer.step()``) runs one bare-loop step first, on the same batch, so the two alternate step
by step. A Trainer iteration is timed from the end of the bare step to the next hook call,
i.e. everything the Trainer does for one step, logging included.

    python benchmarks/bench_overhead.py            # --quick (default): ~1 min on 2 cores
    python benchmarks/bench_overhead.py --full     # more repeats
"""

from __future__ import annotations

import argparse
import sys
import time

import _common as C


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--full", action="store_true", help="8 repeats of 6 steps instead of 5 of 3")
    ap.add_argument("--flavor", default="tiny")
    ap.add_argument("--backend", default="native", choices=["native"])
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=2)
    args = ap.parse_args(argv)
    repeats, per = (8, 6) if args.full else (5, 3)
    C.header("bench_overhead", [sys.argv[0], *(argv if argv is not None else sys.argv[1:])])

    import torch

    total = args.warmup + repeats * per
    trainer = C.build_trainer([
        f"model={args.backend}", f"model.flavor={args.flavor}", f"data.seq_len={args.seq_len}",
        f"data.batch_size={args.batch_size}", f"training.steps={total}", "training.log_every=1",
        "training.loss=full",  # the bare loop's loss (the CPU default is chunked since issue 24)
    ])
    bare = C.BareLoop(args.backend, args.flavor, args.seq_len, seed=trainer.cfg.training.seed,
                      lr=trainer.cfg.optimizer.lr, weight_decay=trainer.cfg.optimizer.weight_decay,
                      grad_clip=trainer.cfg.optimizer.grad_clip)
    data = C.batches_from(trainer, total)

    bare_s: list[float] = []
    entries: list[float] = []  # when each of the Trainer's step calls began (after the bare step)
    hook_in: list[float] = []
    original = trainer.step.__call__

    def hooked():
        hook_in.append(time.perf_counter())
        inputs, labels = data[trainer.step.state.step]
        bare_s.append(C.time_call(bare.step, inputs, labels))
        entries.append(time.perf_counter())
        return original()

    C.hook_step_calls(trainer, hooked)
    with C.quiet_stdout():
        summary = trainer.train()
        end = time.perf_counter()
    trainer.close()
    hook_in.append(end)  # the last iteration ends when train() returns (it also finishes the sinks)
    trainer_s = [hook_in[i + 1] - entries[i] for i in range(total)]

    w = args.warmup
    blocks = []
    for r in range(repeats):
        lo, hi = w + r * per, w + (r + 1) * per
        tm = C.mmm(trainer_s[lo:hi])[1]
        bm = C.mmm(bare_s[lo:hi])[1]
        blocks.append((tm, bm, tm / bm))
    ratios = [b[2] for b in blocks]
    steady_t = trainer_s[w:-1]  # the very last iteration also closes metrics.jsonl/W&B: reported apart
    steady_b = bare_s[w:-1]
    tokens = args.batch_size * args.seq_len
    print(f"model={args.backend}/{args.flavor} batch={args.batch_size}x{args.seq_len} ({tokens} tokens/step), "
          f"params={bare.num_params:,}, warmup={w}, repeats={repeats}x{per} steps")
    print(f"trainer step s   min/median/max: {C.fmt_mmm(steady_t)}")
    print(f"bare loop step s min/median/max: {C.fmt_mmm(steady_b)}")
    for i, (tm, bm, r) in enumerate(blocks):
        print(f"  repeat {i}: trainer {tm:.4f} s  bare {bm:.4f} s  ratio {r:.4f}")
    print(f"OVERHEAD trainer/bare (median step per repeat) min/median/max: {C.fmt_mmm(ratios, '{:.4f}')}")
    print(f"last iteration (incl. sinks.finish): {trainer_s[-1]:.4f} s; trainer first step {trainer_s[0]:.3f} s, "
          f"bare first step {bare_s[0]:.3f} s; trainer final loss {summary['final_loss']:.4f}")
    return {"ratios": ratios, "trainer_s": steady_t, "bare_s": steady_b}


if __name__ == "__main__":
    main()
