"""(2) Our Trainer vs torchtitan's own Trainer: tokens/s on the same model config, batch and steps.

One process, two real training loops taking turns step by step: ours (``Trainer.train()``) in
the main thread, torchtitan's (``torchtitan.trainer.Trainer.train()``, CPU workarounds in
``_tt_trainer.py``) in a second thread. A baton passed at each step call (ours: ``trainer.step()``;
torchtitan's: ``train_step``) lets only one loop run at a time; each loop's iteration is timed while it
holds the baton (so it includes that loop's own logging, LR schedule, checkpoint/validation checks, GC policy).
Same tokens (torchtitan gets a dataloader over our batches), AdamW foreach with the same
hyper-parameters, grad clipping 1.0, fp32, logging every step in both.

    python benchmarks/bench_vs_torchtitan.py           # --quick (default)
    python benchmarks/bench_vs_torchtitan.py --full
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time

import _common as C
import _tt_trainer as T


class Baton:
    def __init__(self, first: str):
        self.cond = threading.Condition()
        self.turn = first
        self.done: set[str] = set()

    def hand_over(self, me: str, other: str) -> None:
        with self.cond:
            if other not in self.done:
                self.turn = other
                self.cond.notify_all()
            while self.turn != me and other not in self.done:
                if not self.cond.wait(timeout=600):
                    raise TimeoutError("the other training loop never handed the baton back")

    def finish(self, me: str, other: str) -> None:
        with self.cond:
            self.done.add(me)
            self.turn = other
            self.cond.notify_all()


def instrument(obj, name: str, me: str, other: str, baton: Baton, segments: list):
    """Wrap obj.<name> (ours: its step's call): hand the baton over at each call, time what runs while we hold it."""
    original = obj.step.__call__ if name == "step" else getattr(obj, name)
    state = {"start": None}

    def hooked(*a, **k):
        now = time.perf_counter()
        if state["start"] is not None:
            segments.append(now - state["start"])
        baton.hand_over(me, other)
        state["start"] = time.perf_counter()
        return original(*a, **k)

    if name == "step":
        C.hook_step_calls(obj, hooked)
    else:
        setattr(obj, name, hooked)
    return state


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--full", action="store_true")
    ap.add_argument("--flavor", default="tiny")
    ap.add_argument("--backend", default="native", choices=["native", "native_moe"])
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=2)
    args = ap.parse_args(argv)
    repeats, per = (8, 6) if args.full else (5, 3)
    C.header("bench_vs_torchtitan", [sys.argv[0], *(argv if argv is not None else sys.argv[1:])])
    steps = args.warmup + repeats * per + 1  # +1: the last iteration (sinks.finish, tt's 2 s sleep) is dropped

    ours = C.build_trainer([
        f"model={args.backend}", f"model.flavor={args.flavor}", f"data.seq_len={args.seq_len}",
        f"data.batch_size={args.batch_size}", f"training.steps={steps}", "training.log_every=1",
    ])
    batches = C.batches_from(ours, steps)
    tt = T.build_tt_trainer(ours, batches, steps=steps, log_freq=1, dump_folder=tempfile.mkdtemp(prefix="tt_bench_"))
    import logging

    logging.getLogger().setLevel(logging.WARNING)  # torchtitan's per-step console lines still run their code

    baton = Baton(first="ours")
    seg_ours: list[float] = []
    seg_tt: list[float] = []
    st_ours = instrument(ours, "step", "ours", "tt", baton, seg_ours)
    st_tt = instrument(tt, "train_step", "tt", "ours", baton, seg_tt)
    errors = []

    def run_tt():
        try:
            with baton.cond:
                while baton.turn != "tt":
                    baton.cond.wait()
            tt.train()
        except BaseException as e:  # noqa: BLE001
            errors.append(e)
        finally:
            baton.finish("tt", "ours")

    thread = threading.Thread(target=run_tt, name="torchtitan-trainer")
    thread.start()
    with C.quiet_stdout():
        try:
            summary = ours.train()
        finally:
            baton.finish("ours", "tt")
    thread.join()
    tt.close()
    ours.close()
    if errors:
        raise errors[0]
    # seg lists hold iterations 1..steps-1 (each closed by the next step call).
    w = args.warmup
    tokens = args.batch_size * args.seq_len
    blocks = []
    for r in range(repeats):
        lo, hi = w + r * per - 1, w + (r + 1) * per - 1
        mo, mt = C.mmm(seg_ours[lo:hi])[1], C.mmm(seg_tt[lo:hi])[1]
        blocks.append((mo, mt, mt / mo))  # tokens/s ratio ours/tt = time tt / time ours
    ratios = [b[2] for b in blocks]
    so, stt = seg_ours[w - 1:], seg_tt[w - 1:]
    print(f"model={args.backend}/{args.flavor} batch={args.batch_size}x{args.seq_len} ({tokens} tokens/step), "
          f"steps={steps}, warmup={w}, repeats={repeats}x{per}")
    print(f"ours       step s min/median/max: {C.fmt_mmm(so)}  tokens/s median {tokens / C.mmm(so)[1]:.0f}")
    print(f"torchtitan step s min/median/max: {C.fmt_mmm(stt)}  tokens/s median {tokens / C.mmm(stt)[1]:.0f}")
    for i, (mo, mt, r) in enumerate(blocks):
        print(f"  repeat {i}: ours {mo:.4f} s  torchtitan {mt:.4f} s  tokens/s ratio {r:.4f}")
    print(f"RATIO tokens/s ours/torchtitan (median step per repeat) min/median/max: {C.fmt_mmm(ratios, '{:.4f}')}")
    print(f"our final loss {summary['final_loss']:.4f}")
    return {"ratios": ratios}


if __name__ == "__main__":
    main()
