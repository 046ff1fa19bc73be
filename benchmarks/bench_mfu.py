"""(4) MFU against the measured CPU matmul peak: tiny and debug, fp32 vs bf16, eager vs compile.

MFU = FLOPs/token (torchtitan's formula) × tokens/s / peak, with the peak measured on this
machine (best square-matmul FLOP/s at the current thread count, ``device.cached_cpu_peak``)
for the dtype that does the matmuls (fp32, or bf16 under ``training.mixed_precision=bf16``;
both figures also against the fp32 peak).

Part A: for each flavor, an fp32 and a bf16 Trainer step alternately (``trainer.step()``, the Trainer's ``step.Step``).
Part B: an eager and a ``compile.enable=true`` Trainer on the same flavor; the compiled one's
first step (the compile) is timed alone, then the two step alternately.

    python benchmarks/bench_mfu.py                 # --quick (default)
    python benchmarks/bench_mfu.py --full
"""

from __future__ import annotations

import argparse
import sys

import _common as C


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--full", action="store_true")
    ap.add_argument("--flavors", default="tiny,debug")
    ap.add_argument("--compile-flavor", default="tiny")
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--skip-compile", action="store_true")
    ap.add_argument("--bf16-flavor", default="tiny")
    ap.add_argument("--bf16-seq-len", type=int, default=32)
    ap.add_argument("--bf16-batch-size", type=int, default=1)
    args = ap.parse_args(argv)
    repeats, per = (5, 4) if args.full else (3, 2)
    C.header("bench_mfu", [sys.argv[0], *(argv if argv is not None else sys.argv[1:])])
    peaks = {"fp32": C.cpu_peak("float32"), "bf16": C.cpu_peak("bfloat16")}
    tokens = args.batch_size * args.seq_len
    print(f"measured matmul peak: fp32 {peaks['fp32'] / 1e9:.1f} GFLOP/s, bf16 {peaks['bf16'] / 1e9:.1f} GFLOP/s; "
          f"batch={args.batch_size}x{args.seq_len} ({tokens} tokens/step), warmup={args.warmup}, repeats={repeats}x{per}")
    common = [f"data.seq_len={args.seq_len}", f"data.batch_size={args.batch_size}", "training.steps=1000"]
    out = {}

    def report(tag, res, name, fpt, peak_key):
        nonlocal tokens
        lo, med, hi = C.mmm(res[name]["steps"])
        tps = tokens / med
        mfu = 100 * fpt * tps / peaks[peak_key]
        mfu32 = 100 * fpt * tps / peaks["fp32"]
        print(f"  {tag:22s} step s min/median/max {lo:.4f} / {med:.4f} / {hi:.4f}; tokens/s {tps:.0f}; "
              f"MFU {mfu:.1f} % of {peak_key} peak ({mfu32:.1f} % of fp32 peak); first step {res[name]['first']:.3f} s")
        return mfu

    # Part A: fp32 MFU, the flavors stepping alternately.
    flavors = args.flavors.split(",")
    tr = {f: C.build_trainer(["model=native", f"model.flavor={f}", *common]) for f in flavors}
    with C.quiet_stdout():
        res = C.alternate({f: C.trainer_stepper(t) for f, t in tr.items()}, warmup=args.warmup, repeats=repeats, per=per)
    for f, t in tr.items():
        fpt = t.step.backend.flops_per_token
        print(f"[native/{f}] params {t.step.backend.num_params:,}, FLOPs/token {fpt / 1e6:.1f} M")
        out[(f, "fp32")] = report(f"{f} fp32", res, f, fpt, "fp32")
        t.close()

    # Part A2: fp32 vs bf16 autocast (bf16 matmuls are slow on a CPU without bf16 units: small batch).
    b16 = [f"data.seq_len={args.bf16_seq_len}", f"data.batch_size={args.bf16_batch_size}", "training.steps=1000"]
    t32 = C.build_trainer(["model=native", f"model.flavor={args.bf16_flavor}", *b16])
    t16 = C.build_trainer(["model=native", f"model.flavor={args.bf16_flavor}", "training.mixed_precision=bf16", *b16])
    fpt = t32.step.backend.flops_per_token
    with C.quiet_stdout():
        res = C.alternate({"fp32": C.trainer_stepper(t32), "bf16": C.trainer_stepper(t16)},
                          warmup=1, repeats=2, per=1 if not args.full else 2)
    saved_tokens = tokens
    tokens = args.bf16_batch_size * args.bf16_seq_len
    print(f"[native/{args.bf16_flavor}] fp32 vs training.mixed_precision=bf16 at batch "
          f"{args.bf16_batch_size}x{args.bf16_seq_len} ({tokens} tokens/step)")
    out["fp32_small"] = report("fp32", res, "fp32", fpt, "fp32")
    out["bf16_small"] = report("bf16 (autocast)", res, "bf16", fpt, "bf16")
    print(f"  STEP TIME bf16/fp32 per repeat min/median/max: {C.fmt_mmm(C.ratio_per_repeat(res, 'bf16', 'fp32'))}")
    tokens = saved_tokens
    t32.close()
    t16.close()

    # Part B: eager vs compile.
    if not args.skip_compile:
        flavor = args.compile_flavor
        eager = C.build_trainer(["model=native", f"model.flavor={flavor}", *common])
        comp = C.build_trainer(["model=native", f"model.flavor={flavor}", "compile.enable=true", *common])
        fpt = eager.step.backend.flops_per_token
        with C.quiet_stdout():
            compile_s = C.time_call(C.trainer_stepper(comp), 0)
            res = C.alternate({"eager": C.trainer_stepper(eager), "compile": C.trainer_stepper(comp)},
                              warmup=args.warmup, repeats=repeats, per=per)
        print(f"[native/{flavor}] eager vs compile.enable=true (inductor): first compiled step (compile + run) "
              f"{compile_s:.1f} s")
        report("eager", res, "eager", fpt, "fp32")
        report("compile", res, "compile", fpt, "fp32")
        ratio = C.ratio_per_repeat(res, "eager", "compile")
        print(f"  SPEEDUP compile (eager/compiled step time) per repeat min/median/max: {C.fmt_mmm(ratio)}")
        out["compile_s"] = compile_s
        eager.close()
        comp.close()
    return out


if __name__ == "__main__":
    main()
