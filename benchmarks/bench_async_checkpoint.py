"""Asynchronous checkpoints (issue 42, acceptance d): what a save costs the training loop, sync vs async.

Two Trainers of the same run (``model.flavor=debug`` by default, a checkpoint after every step), one with
``checkpoint.async_mode=disabled`` and one with ``async``, built in this process and stepped in turn (the order
alternating), each save timed where the loop waits for it (``Checkpointer.maybe_save``'s stall: the synchronous
write, or the wait for the previous write plus the copy of the state). The steps themselves are timed too: on a CPU
the writer thread shares the cores with training, so part of the write moves into the next steps; the last line
says what a step plus its save costs in each mode.

    python benchmarks/bench_async_checkpoint.py [--flavor debug] [--saves 8] [--seq-len 64] [--batch-size 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

from _common import build_trainer, fmt_mmm, header, quiet_stdout

MODES = ("disabled", "async")


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    except OSError:
        return "?"
    name = next((ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("Model name")), "?")
    flags = next((ln for ln in out.splitlines() if ln.startswith("Flags")), "")
    return f"{name}, {os.cpu_count()} cores, AVX-512 {'yes' if 'avx512f' in flags else 'no'}"


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--flavor", default="debug")
    ap.add_argument("--saves", type=int, default=8, help="steps per mode, each followed by a save")
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=2)
    args = ap.parse_args(argv)
    header("bench_async_checkpoint", [sys.argv[0], *argv])
    print(f"# cpu: {cpu_name()}", flush=True)
    overrides = [f"model.flavor={args.flavor}", f"data.seq_len={args.seq_len}", f"data.batch_size={args.batch_size}",
                 f"training.steps={args.saves + 1}",  # every measured save is a periodic one (the last is synchronous)
                 "training.log_every=1000", "checkpoint.enable=true", "checkpoint.every=1", "checkpoint.keep=2"]
    trainers = {}
    with quiet_stdout():
        for mode in MODES:
            trainers[mode] = t = build_trainer([*overrides, f"checkpoint.async_mode={mode}"],
                                               tempfile.mkdtemp(prefix=f"qwen3_bench_ckpt_{mode}_"))
            t._start()
    params = trainers["disabled"].step.backend.num_params
    print(f"# model.flavor={args.flavor} ({params / 1e6:.1f} M parameters), {args.batch_size}x{args.seq_len} tokens, "
          f"AdamW, fp32; a save after each of {args.saves} steps per mode, taking turns", flush=True)
    step_s = {m: [] for m in MODES}
    stall_s = {m: [] for m in MODES}
    with quiet_stdout():
        for i in range(args.saves):
            for mode in (MODES if i % 2 == 0 else MODES[::-1]):
                t = trainers[mode]
                t0 = time.perf_counter()
                t.step()
                step_s[mode].append(time.perf_counter() - t0)
                stall_s[mode].append(t.checkpointer.maybe_save(t.step.state.step))
        for t in trainers.values():
            t.checkpointer.wait()
    last = trainers["disabled"].checkpointer.root / f"step-{args.saves:08d}"
    size = sum(f.stat().st_size for f in last.iterdir() if f.is_file())
    print(f"# checkpoint size {size / 2**20:.0f} MiB (model + AdamW moments)", flush=True)
    for mode in MODES:
        print(f"{mode:>8}: stall per save (s) {' '.join(f'{s:.3f}' for s in stall_s[mode])}", flush=True)
        print(f"{mode:>8}: step time (s)      {' '.join(f'{s:.3f}' for s in step_s[mode])}", flush=True)
    steady = {m: stall_s[m][1:] for m in MODES}  # the first save of each also allocates its buffers
    for mode in MODES:
        print(f"{mode:>8}: stall min / median / max over saves 2-{args.saves}: {fmt_mmm(steady[mode])} s; "
              f"step {fmt_mmm(step_s[mode][1:])} s", flush=True)
    med = {m: statistics.median(steady[m]) for m in MODES}
    both = {m: statistics.median([a + b for a, b in zip(step_s[m][1:], stall_s[m][1:])]) for m in MODES}
    print(f"RATIO stall per save sync / async (median): {med['disabled'] / med['async']:.1f}x "
          f"({med['disabled']:.3f} / {med['async']:.3f} s)", flush=True)
    print(f"RATIO step + its save sync / async (median): {both['disabled'] / both['async']:.2f}x "
          f"({both['disabled']:.3f} / {both['async']:.3f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
