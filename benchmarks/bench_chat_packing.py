"""(issue 41, j) data=chat: packed vs padded windows, loss tokens per second, and the packing efficiency.

Two Trainers of the same command, ``experiment=sft`` (the default chat corpus, chitchat, rendered with the shipped
Qwen3 tokenizer's template, loss on the assistant's turns), one with ``data.packing=true`` (conversations packed
one per document, best-fit decreasing) and one with ``data.packing=false`` (one conversation per window, padded),
step in turns (``_common.alternate``). Each step's loss tokens are the step's own count (``Step.loss_tokens``);
loss tokens/s = a repeat's loss tokens / its seconds. The packing efficiency is real tokens / window tokens over all training
windows of each setting (``ChatDataset.summary``).

    python benchmarks/bench_chat_packing.py            # --quick (default): 3 repeats x 4 steps each
    python benchmarks/bench_chat_packing.py --full     # 6 x 4
"""

from __future__ import annotations

import argparse
import statistics
import sys

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
    with C.quiet_stdout():
        res = C.alternate({name: stepper(name) for name in trainers}, warmup=args.warmup, repeats=repeats, per=per)
    rates = {}
    for name in trainers:
        toks = loss_tokens[name][args.warmup:]
        steps = res[name]["steps"]
        per_step = [n / dt for n, dt in zip(toks, steps)]
        # per repeat: its loss tokens / its seconds (a step's loss tokens vary 2x with its windows' conversations)
        rates[name] = [sum(toks[r * per:(r + 1) * per]) / sum(steps[r * per:(r + 1) * per]) for r in range(repeats)]
        lo, med, hi = C.mmm(res[name]["steps"])
        print(f"  {name:6s} step s min/median/max {lo:.3f} / {med:.3f} / {hi:.3f}; loss tokens/step median "
              f"{statistics.median(toks):.0f} ({100 * statistics.median(toks) / window:.1f} % of the window); "
              f"loss tokens/s median {statistics.median(per_step):.0f}")
    ratios = [a / b for a, b in zip(rates["packed"], rates["padded"])]
    print(f"  LOSS TOKENS/S packed/padded per repeat min/median/max: {C.fmt_mmm(ratios, '{:.2f}')}")
    print(f"  PACKING EFFICIENCY packed {summaries['packed']['packing_efficiency']:.3f}, padded "
          f"{summaries['padded']['packing_efficiency']:.3f}")
    for t in trainers.values():
        t.close()
    return {"ratios": ratios, "efficiency": {k: s["packing_efficiency"] for k, s in summaries.items()}}


if __name__ == "__main__":
    main()
