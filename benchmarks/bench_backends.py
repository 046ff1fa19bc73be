"""(3) Backends: model=native (torchtitan) vs model=hf (transformers) on the same dense and MoE configs.

For each kind (dense ``native/<flavor>``, MoE ``native_moe/<flavor>``) the script writes a
randomly initialised Hugging Face checkpoint with the same architecture
(``Qwen3Config`` / ``Qwen3MoeConfig`` from ``qwen3_research.export.hf_config_for_flavor``),
builds two Trainers (native, hf) on the same data, batch and optimizer, and steps them
alternately (``trainer.step()``, the Trainer's ``step.Step``). MFU uses the measured CPU fp32 matmul peak and the
same FLOPs/token for both (torchtitan's formula on the native model).

    python benchmarks/bench_backends.py            # --quick (default)
    python benchmarks/bench_backends.py --full
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import _common as C


def write_hf_dir(backend: str, flavor_name: str, out: Path) -> Path:
    import torch

    from qwen3_research.models.native.hf_export import hf_config_for_flavor
    from qwen3_research.models import get_flavor

    moe = backend == "native_moe"
    cfg = hf_config_for_flavor(get_flavor(backend, flavor_name), moe, eos_id=None)
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.save_pretrained(out)
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--full", action="store_true")
    ap.add_argument("--flavor", default="tiny")
    ap.add_argument("--kinds", default="native,native_moe")
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=1)
    args = ap.parse_args(argv)
    repeats, per = (6, 4) if args.full else (3, 3)
    C.header("bench_backends", [sys.argv[0], *(argv if argv is not None else sys.argv[1:])])
    peak = C.cpu_peak("float32")
    tokens = args.batch_size * args.seq_len
    print(f"measured fp32 matmul peak {peak / 1e9:.1f} GFLOP/s; batch={args.batch_size}x{args.seq_len} "
          f"({tokens} tokens/step), warmup={args.warmup}, repeats={repeats}x{per}")
    results = {}
    for kind in args.kinds.split(","):
        hf_dir = write_hf_dir(kind, args.flavor, Path(tempfile.mkdtemp(prefix=f"hf_{kind}_")))
        common = [f"data.seq_len={args.seq_len}", f"data.batch_size={args.batch_size}", "training.steps=1000"]
        native = C.build_trainer([f"model={kind}", f"model.flavor={args.flavor}", *common])
        hf = C.build_trainer(["model=hf", f"model.path={hf_dir}", *common])
        fpt = native.step.backend.flops_per_token
        with C.quiet_stdout():
            res = C.alternate({"native": C.trainer_stepper(native), "hf": C.trainer_stepper(hf)},
                              warmup=args.warmup, repeats=repeats, per=per)
        ratios = C.ratio_per_repeat(res, "hf", "native")
        print(f"[{kind}/{args.flavor}] params native {native.step.backend.num_params:,} hf {hf.step.backend.num_params:,}; "
              f"FLOPs/token {fpt / 1e6:.1f} M (hf backend's own formula {hf.step.backend.flops_per_token / 1e6:.1f} M)")
        for name in ("native", "hf"):
            lo, med, hi = C.mmm(res[name]["steps"])
            tps = tokens / med
            print(f"  {name:6s} step s min/median/max {lo:.4f} / {med:.4f} / {hi:.4f}; tokens/s {tps:.0f} "
                  f"(min-max {tokens / hi:.0f}-{tokens / lo:.0f}); MFU {100 * fpt * tps / peak:.1f} %; "
                  f"first step {res[name]['first']:.3f} s")
        print(f"  STEP TIME hf/native per repeat min/median/max: {C.fmt_mmm(ratios, '{:.3f}')}")
        results[kind] = ratios
        for t in (native, hf):
            t.close()
    return results


if __name__ == "__main__":
    main()
