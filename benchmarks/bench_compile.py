"""(16) torch.compile per transformer block (the Trainer's, ``compiling.apply``) vs the whole model, CPU: the cold
first step (each contender compiles into its own empty inductor cache, in its own process) and the losses, which must
equal the eager run's within float32 tolerance. Then the same per-block run again on its now warm cache.

    python benchmarks/bench_compile.py                       # tiny and debug, 3 steps each, 2x32 tokens
    python benchmarks/bench_compile.py --flavors tiny --steps 3

Each measurement is a separate process (``--one``): an in-process second compile would reuse dynamo's and
inductor's in-memory state and not be cold.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import _common as C

MODES = ("eager", "blocks", "whole", "blocks-warm")


def one(flavor: str, mode: str, steps: int, seq_len: int, batch: int) -> dict:
    """One contender in this process: build the Trainer with compile off, compile as ``mode`` says, train."""
    import torch

    from qwen3_research import compiling

    over = ["device=cpu", "model=native", f"model.flavor={flavor}", f"data.seq_len={seq_len}", f"data.batch_size={batch}",
            f"training.steps={steps}", "training.eval_every=0", "logging.wandb.mode=disabled", "training.loss=full",
            "compile.enable=false"]
    trainer = C.build_trainer(over)
    decision = compiling.CompileDecision(True, "bench", "inductor")
    if mode.startswith("blocks"):
        what = compiling.apply(trainer.step.backend.model, decision, fullgraph=False, is_moe=False)
        trainer.step.cross_entropy = compiling.compiled_cross_entropy(decision)  # the step's loss (step.Step)
    elif mode == "whole":
        trainer.step.backend.model = torch.compile(trainer.step.backend.model)
        trainer.step.cross_entropy = compiling.compiled_cross_entropy(decision)  # the step's loss (step.Step)
        what = "whole model + loss"
    else:
        what = "eager"
    times, losses = [], []
    c0 = compiling.compile_seconds()
    for _ in range(steps):
        t0 = time.perf_counter()
        loss, _ = trainer.step()
        times.append(time.perf_counter() - t0)
        losses.append(loss)
    out = {"flavor": flavor, "mode": mode, "what": what, "first_step_s": times[0], "compile_s": compiling.compile_seconds() - c0,
           "later_step_s": sorted(times[1:])[len(times[1:]) // 2] if steps > 1 else None, "losses": losses}
    trainer.close()
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--flavors", default="tiny,debug")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--seq-len", type=int, default=32)
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--one", nargs=2, metavar=("FLAVOR", "MODE"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one:
        print("RESULT " + json.dumps(one(*args.one, args.steps, args.seq_len, args.batch_size)), flush=True)
        return 0
    C.header("bench_compile", [sys.argv[0], *(argv if argv is not None else sys.argv[1:])])
    print(f"# cpu: {_cpu_name()}", flush=True)
    rows = {}
    for flavor in args.flavors.split(","):
        caches = {"blocks": tempfile.mkdtemp(prefix="bench_compile_blocks_"),
                  "whole": tempfile.mkdtemp(prefix="bench_compile_whole_"), "eager": tempfile.mkdtemp(prefix="bench_eager_")}
        for mode in MODES:
            cache = caches[mode.split("-")[0]]
            env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": os.path.join(cache, "inductor"),
                   "TRITON_CACHE_DIR": os.path.join(cache, "triton")}
            cmd = [sys.executable, __file__, "--one", flavor, mode, "--steps", str(args.steps), "--seq-len",
                   str(args.seq_len), "--batch-size", str(args.batch_size)]
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
            line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
            if line is None:
                print(f"{flavor} {mode}: failed\n{proc.stderr[-2000:]}", flush=True)
                continue
            r = rows[(flavor, mode)] = json.loads(line[7:])
            print(f"{flavor:6s} {mode:12s} first step {r['first_step_s']:8.2f} s (compile {r['compile_s']:7.2f} s), "
                  f"later step {r['later_step_s'] or float('nan'):.3f} s, losses {[round(x, 6) for x in r['losses']]}",
                  flush=True)
        eager = rows.get((flavor, "eager"))
        for mode in ("blocks", "whole"):
            r = rows.get((flavor, mode))
            if eager and r:
                diff = max(abs(a - b) for a, b in zip(eager["losses"], r["losses"]))
                print(f"{flavor}: {mode} max |loss - eager loss| {diff:.2e}", flush=True)
        b, w = rows.get((flavor, "blocks")), rows.get((flavor, "whole"))
        if b and w:
            print(f"RATIO {flavor}: cold first step per-block / whole-model {b['first_step_s'] / w['first_step_s']:.3f} "
                  f"({b['first_step_s']:.1f} / {w['first_step_s']:.1f} s)", flush=True)
    return 0


def _cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        name = next((ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("Model name")), "?")
        bf16 = "avx512_bf16" in out
        return f"{name}, {os.cpu_count()} cores, AVX512-BF16 {'yes' if bf16 else 'no'}"
    except OSError:
        return "?"


if __name__ == "__main__":
    sys.exit(main())
