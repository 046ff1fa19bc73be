"""Each kernel against the module it replaces, forward + backward, per dtype, on this device (issue 30).

    python benchmarks/bench_kernels.py [--shapes model,30b] [--dtypes float32,bfloat16] [--kernels moe_fast,rope_fast]
                                       [--repeats 5] [--tokens-30b 4096]

Contenders take turns repeat by repeat in one process, on the same weights and inputs:

* MoE (``moe_fast``; ``triton_moe`` on cuda): torchtitan's ``GroupedExperts`` as built (its bf16 ``_grouped_mm``)
  vs the same module with the kernel installed (``kernels.registry`` swaps its class), on expert-sorted rows
  with random top-k routing. Shapes: ``model`` = ``model=native_moe`` tiny (E=8, top-2, D=128, F=128) at the
  default run's 4 × 128 tokens; ``30b`` = Qwen3-30B-A3B's experts (E=128, top-8, D=2048, F=768) at 2048 tokens (``--tokens-30b``).
* RoPE (``rope_fast``; ``triton_rope`` on cuda): torchtitan's ``CosSinRoPE`` vs the kernel, q and k together.
  ``model`` = tiny (4 × 128 tokens, 4 q / 2 kv heads of 32); ``30b`` = Qwen3-30B-A3B's attention (1 × 4096
  tokens, 32 q / 4 kv heads of 128).

dtypes: ``float32`` = a float32 run (float32 activations and weights; torchtitan's experts still cast to bf16);
``bfloat16`` = a bf16 run on one process (``torch.autocast`` over float32 weights; RoPE gets bf16 q/k, as from
autocast's linears).

Prints one row per (kernel, shape, dtype): median ms of each, and the ratio time(module) / time(kernel) as
min / median / max over repeats (> 1: the kernel is faster). These ratios are what ``KernelSpec.measured``
records (qwen3_research/kernels/*.py) and what gates a speed option (docs/KERNELS.md, "Applied only where faster").
"""

from __future__ import annotations

import argparse
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from qwen3_research import devices  # noqa: E402

DT = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def device_name(dev: torch.device) -> str:
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        name = next((ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("Model name")), "?")
        flags = next((ln for ln in out.splitlines() if ln.startswith("Flags")), "")
    except OSError:
        name, flags = platform.processor() or "?", ""
    feats = "AVX512-BF16" if "avx512_bf16" in flags else ("AVX-512" if "avx512f" in flags else "AVX2")
    return f"{name} ({feats}), {torch.get_num_threads()} threads"


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


# ------------------------------------------------------------------------------------------- MoE
def moe_case(shape: str, dev, tokens_30b: int):
    from torchtitan.models.common.moe import GroupedExperts

    E, K, D, Fh, T = (8, 2, 128, 128, 512) if shape == "model" else (128, 8, 2048, 768, tokens_30b)
    g = torch.Generator().manual_seed(0)
    m = GroupedExperts.Config(dim=D, hidden_dim=Fh, num_experts=E).build()
    with torch.no_grad():
        m.w1_EFD.data = torch.randn(E, Fh, D, generator=g) * D**-0.5
        m.w3_EFD.data = torch.randn(E, Fh, D, generator=g) * D**-0.5
        m.w2_EDF.data = torch.randn(E, D, Fh, generator=g) * Fh**-0.5
    m.to(dev)
    ids = torch.rand(T, E, generator=g).topk(K, -1).indices
    counts = torch.bincount(ids.flatten(), minlength=E).to(dev)
    R = int(counts.sum())
    x = torch.randn(R, D, generator=g).to(dev)
    gy = torch.randn(R, D, generator=g).to(dev)
    label = f"E={E} top{K} D={D} F={Fh} T={T}"
    return m, (x, counts), gy, label


def moe_install(kernel: str, m):
    import copy

    from qwen3_research.kernels import KERNELS

    k = copy.copy(m)  # same parameters, its own class
    k.__dict__ = dict(m.__dict__)
    KERNELS[kernel].install(k, {}, None)
    return k


# ------------------------------------------------------------------------------------------- RoPE
def rope_case(shape: str, dev):
    from torchtitan.models.common.rope import CosSinRoPE

    B, L, NQ, NKV, H = (4, 128, 4, 2, 32) if shape == "model" else (1, 4096, 32, 4, 128)
    m = CosSinRoPE.Config(dim=H, max_seq_len=L, theta=1e6).build()
    m._init_self_buffers(buffer_device=dev) if hasattr(m, "_init_self_buffers") else None
    m.to(dev)
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(B, L, NQ, H, generator=g).to(dev), torch.randn(B, L, NKV, H, generator=g).to(dev)
    return m, (q, k), None, f"B={B} L={L} heads {NQ}/{NKV} d={H}"


def rope_install(kernel: str, m):
    import copy

    from qwen3_research.kernels import KERNELS

    k = copy.copy(m)
    k.__dict__ = dict(m.__dict__)
    KERNELS[kernel].install(k, {}, None)
    return k


# ------------------------------------------------------------------------------------------- timing
def step_fn(module, inputs, gy, dtype: str, dev, is_moe: bool):
    dt = DT[dtype]

    def f():
        if is_moe:
            x = inputs[0].clone().requires_grad_(True)
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dtype == "bfloat16"):
                y = module(x, inputs[1])
            y.float().backward(gy)
        else:
            q = inputs[0].to(dt).requires_grad_(True)
            k = inputs[1].to(dt).requires_grad_(True)
            qo, ko = module(q, k)
            (qo.float().square().sum() + ko.float().square().sum()).backward()
        for p in module.parameters():
            p.grad = None

    return f


def bench(base_fn, kern_fn, repeats: int, dev, min_s: float):
    """Median seconds per call of each, and the sorted per-repeat ratios base / kernel. On CPU the clock is this
    process's CPU time (``time.process_time``): the machines here are shared, and CPU time counts the work done,
    not the waits for a core another job holds; on cuda wall time after a synchronize."""
    clock = time.perf_counter if dev.type == "cuda" else time.process_time

    def timed(fn, n):
        sync(dev)
        t0 = clock()
        for _ in range(n):
            fn()
        sync(dev)
        return (clock() - t0) / n

    # warm-up (first-call allocations, Triton compiles), timed to choose the calls per sample
    n = max(1, int(min_s / max(timed(base_fn, 1), timed(kern_fn, 1), 1e-6)))
    tb, tk = [], []
    for i in range(repeats):
        for fn, out in ((base_fn, tb), (kern_fn, tk)) if i % 2 == 0 else ((kern_fn, tk), (base_fn, tb)):
            out.append(timed(fn, n))
    ratios = sorted(b / k for b, k in zip(tb, tk))
    return statistics.median(tb), statistics.median(tk), ratios


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="model,30b")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--kernels", default="")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--min-s", type=float, default=0.3, help="least time per sample (calls are repeated to reach it)")
    p.add_argument("--repeats-30b", type=int, default=2)
    p.add_argument("--tokens-30b", type=int, default=2048)
    p.add_argument("--device", default="")
    p.add_argument("--threads", type=int, default=1,
                   help="CPU threads (default 1: on a shared machine a waiting OpenMP thread spins, and its CPU time "
                        "would count as the kernel's; 0 = torch's default)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dev = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    devices.prepare_torchtitan(dev.type)
    default = "moe_fast,rope_fast,triton_moe,triton_rope" if dev.type == "cuda" else "moe_fast,rope_fast"
    kernels = [k for k in (args.kernels or default).split(",") if k]
    clock = "wall time" if dev.type == "cuda" else "process CPU time"
    print(f"device: {device_name(dev)}; torch {torch.__version__}; clock: {clock}")
    print(f"{'kernel':<12} {'shape':<5} {'dtype':<9} {'sizes':<36} {'module ms':>10} {'kernel ms':>10}  "
          "module/kernel min / median / max")
    for shape in args.shapes.split(","):
        reps = args.repeats if shape == "model" else args.repeats_30b
        for kernel in kernels:
            is_moe = "moe" in kernel
            m, inputs, gy, label = moe_case(shape, dev, args.tokens_30b) if is_moe else rope_case(shape, dev)
            k = (moe_install if is_moe else rope_install)(kernel, m)
            for dtype in args.dtypes.split(","):
                tb, tk, r = bench(step_fn(m, inputs, gy, dtype, dev, is_moe), step_fn(k, inputs, gy, dtype, dev, is_moe),
                                  reps, dev, args.min_s)
                print(f"{kernel:<12} {shape:<5} {dtype:<9} {label:<36} {tb * 1e3:>10.2f} {tk * 1e3:>10.2f}  "
                      f"{r[0]:.2f} / {statistics.median(r):.2f} / {r[-1]:.2f}", flush=True)
            del m, k, inputs


if __name__ == "__main__":
    main()
