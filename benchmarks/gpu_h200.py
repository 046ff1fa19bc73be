"""(8) GPU acceptance (prepared; run only where a GPU is lent): Qwen3-0.6B, bf16, torch.compile, one GPU.

Superseded by ``gpu_suite.py`` (every CUDA path, one results file; its Trainer-vs-bare step compiles both sides per
block, as the Trainer now does). Kept for the earlier figures' command: here the bare loop compiles the whole model.

Our Trainer (``model=native model.flavor=0.6B training.mixed_precision=bf16 compile.enable=true``)
and a bare torchtitan loop over the same model (same config, seed, batch, AdamW foreach,
grad clip 1.0, bf16 autocast, ``torch.compile`` of the whole model) step alternately on the
same GPU; tokens/s and MFU (H200 dense bf16 peak 989 TFLOP/s, torchtitan's figure) for both,
and the ratio per repeat (min/median/max). Each side's first step (the compile) is timed alone.

    python benchmarks/gpu_h200.py                  # ~3-4 min on one H200 (two compiles)
    python benchmarks/gpu_h200.py --seq-len 2048 --batch-size 8 --repeats 5 --per 5
"""

from __future__ import annotations

import argparse
import sys
import time

import _common as C


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--flavor", default="0.6B")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--per", type=int, default=4)
    ap.add_argument("--no-compile", action="store_true")
    args = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("no CUDA device: this script is the GPU acceptance check (benchmarks/RESULTS.md §8); nothing measured")
        return 2
    C.header("gpu_h200", [sys.argv[0], *(argv if argv is not None else sys.argv[1:])])
    print(f"device: {torch.cuda.get_device_name(0)}")
    compile_flag = "false" if args.no_compile else "true"
    ours = C.build_trainer([
        "device=cuda", "model=native", f"model.flavor={args.flavor}", f"data.seq_len={args.seq_len}",
        f"data.batch_size={args.batch_size}", "training.mixed_precision=bf16", f"compile.enable={compile_flag}",
        "training.steps=1000", "model.attention=sdpa",
    ])
    dev = torch.device("cuda", 0)

    # Bare loop: same torchtitan config (SDPA, as model.attention=sdpa above), same seed and init.
    from qwen3_research import titan
    from qwen3_research.models import get_flavor

    flavor = get_flavor("native", args.flavor)
    cfg = titan.qwen3_model_config(flavor, "sdpa", "cuda")
    with torch.device("meta"):
        model = titan.build_model(cfg)
    model.to_empty(device=dev)
    with torch.no_grad():
        torch.manual_seed(0)
        titan.init_weights(model, dev)
    model.train()
    fwd = torch.compile(model) if not args.no_compile else model
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, foreach=True)
    params = list(model.parameters())
    batches = [(i.to(dev), l.to(dev)) for i, l in C.batches_from(ours, 4)]

    def bare_step(step: int):
        inputs, labels = batches[step % len(batches)]
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = fwd(inputs)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()

    def ours_step(step: int):  # the Trainer trains its state's next step
        ours.step()
        torch.cuda.synchronize()

    t0 = time.perf_counter()
    ours_step(0)
    first_ours = time.perf_counter() - t0
    t0 = time.perf_counter()
    bare_step(0)
    first_bare = time.perf_counter() - t0
    res = C.alternate({"ours": ours_step, "bare": bare_step}, warmup=args.warmup, repeats=args.repeats, per=args.per)
    tokens = args.batch_size * args.seq_len
    peak = ours.where.device.peak_flops(torch.bfloat16)
    fpt = ours.step.backend.flops_per_token
    print(f"model native/{args.flavor} params {ours.step.backend.num_params:,}; batch {args.batch_size}x{args.seq_len}; "
          f"bf16 autocast; compile={compile_flag}; peak {peak / 1e12:.0f} TFLOP/s")
    print(f"first step (compile): ours {first_ours:.1f} s, bare {first_bare:.1f} s")
    for name in ("ours", "bare"):
        lo, med, hi = C.mmm(res[name]["steps"])
        tps = tokens / med
        print(f"  {name}: step s {lo:.4f} / {med:.4f} / {hi:.4f}; tokens/s {tps:,.0f}; MFU {100 * fpt * tps / peak:.1f} %; "
              f"peak memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB (process)")
    print(f"RATIO step time ours/bare per repeat min/median/max: {C.fmt_mmm(C.ratio_per_repeat(res, 'ours', 'bare'), '{:.4f}')}")
    ours.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
