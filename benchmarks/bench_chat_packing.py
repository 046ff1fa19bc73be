"""(issue 41, j) data=chat: packed vs padded windows, loss tokens per second, and the packing efficiency.

Two Trainers of the same command, ``experiment=sft`` (the default chat corpus, chitchat, rendered with the shipped
Qwen3 tokenizer's template, loss on the assistant's turns), one with ``data.packing=true`` (conversations packed
one per document, best-fit decreasing) and one with ``data.packing=false`` (one conversation per window, padded),
step in turns. Each step's loss tokens are the step's own count (``Step.loss_tokens``); loss tokens/s = a repeat's
loss tokens / its seconds, by this process's CPU time (the figure to quote on a shared machine) and by wall time. The packing efficiency is real tokens / window tokens over all training
windows of each setting (``ChatDataset.summary``).

    python benchmarks/bench_chat_packing.py            # --quick (default): 3 repeats x 4 steps each
    python benchmarks/bench_chat_packing.py --full     # 6 x 4
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import _common as C


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--full", action="store_true")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--max-documents", type=int, default=1000)
    ap.add_argument("--warmup", type=int, default=1)
    args = ap.parse_args(argv)
    repeats, per = (6, 4) if args.full else (3, 4)
    C.header("bench_chat_packing", [sys.argv[0], *(argv if argv is not None else sys.argv[1:])])
    common = ["experiment=sft", f"data.seq_len={args.seq_len}", f"data.batch_size={args.batch_size}",
              f"data.max_documents={args.max_documents}", "training.steps=1000"]
    trainers = {name: C.build_trainer([*common, f"data.packing={str(name == 'packed').lower()}"])
                for name in ("packed", "padded")}
    loss_tokens: dict[str, list[int]] = {name: [] for name in trainers}

    def stepper(name):
        trainer = trainers[name]

        def step(i: int):
            trainer.step()
            loss_tokens[name].append(trainer.step.loss_tokens)
        return step

    window = args.batch_size * args.seq_len
    print(f"experiment=sft, {args.max_documents} chitchat chats, batch {args.batch_size}x{args.seq_len} "
          f"({window} window tokens/step), warmup={args.warmup}, repeats={repeats}x{per}")
    summaries = {name: t.step.data.summary() for name, t in trainers.items()}
    for name, s in summaries.items():
        print(f"  {name}: {s['train_conversations']} conversations in {s['train_windows']} windows, packing "
              f"efficiency {s['packing_efficiency']:.3f} (real tokens / window tokens); {s['truncated']} cut, "
              f"{s['dropped']} dropped of {s['records']}")
    # Both clocks per step, the settings taking turns (who goes first alternates): wall time, and this process's CPU
    # time, which a shared machine's other load disturbs far less (the two settings do the same window compute).
    names = list(trainers)
    wall: dict[str, list[float]] = {n: [] for n in names}
    cpu: dict[str, list[float]] = {n: [] for n in names}
    with C.quiet_stdout():
        for i in range(args.warmup + repeats * per):
            for name in (names if i % 2 == 0 else names[::-1]):
                w0, c0 = time.perf_counter(), time.process_time()
                stepper(name)(i)
                if i >= args.warmup:
                    wall[name].append(time.perf_counter() - w0)
                    cpu[name].append(time.process_time() - c0)
    rates = {}
    for name in names:
        toks = loss_tokens[name][args.warmup:]
        rates[name] = {}
        for clock, secs in (("cpu", cpu[name]), ("wall", wall[name])):
            # per repeat: its loss tokens / its seconds (a step's loss tokens vary 2x with its windows' conversations)
            rates[name][clock] = [sum(toks[r * per:(r + 1) * per]) / sum(secs[r * per:(r + 1) * per])
                                  for r in range(repeats)]
        print(f"  {name:6s} step s wall min/median/max {C.fmt_mmm(wall[name])}, cpu {C.fmt_mmm(cpu[name])}; loss "
              f"tokens/step median {statistics.median(toks):.0f} ({100 * statistics.median(toks) / window:.1f} % of the "
              f"window), mean {statistics.mean(toks):.1f}")
    for clock in ("cpu", "wall"):
        r = [a / b for a, b in zip(rates["packed"][clock], rates["padded"][clock])]
        print(f"  LOSS TOKENS/S packed/padded per repeat ({clock} time) min/median/max: {C.fmt_mmm(r, '{:.2f}')}")
    ratios = [a / b for a, b in zip(rates["packed"]["cpu"], rates["padded"]["cpu"])]
    print(f"  PACKING EFFICIENCY packed {summaries['packed']['packing_efficiency']:.3f}, padded "
          f"{summaries['padded']['packing_efficiency']:.3f}")
    for t in trainers.values():
        t.close()
    return {"ratios": ratios, "efficiency": {k: s["packing_efficiency"] for k, s in summaries.items()}}


if __name__ == "__main__":
    main()
