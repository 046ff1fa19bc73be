"""(5) Memory per rank: bytes of params, grads and optimizer state, and peak process memory, dp_shard 1, 2, 4.

Each point starts N ranks with PyTorch's elastic launcher (as ``parallelism.nproc_per_node=N
parallelism.dp_shard=N`` does) and every rank reports the local-shard bytes the Trainer
measured right after its first optimizer step (``parallel.state_bytes``: DTensor local
shards) and its peak RSS. Ideal = the 1-rank figure / N (peak RSS also carries the Python +
torch runtime and the activations, which do not shard).

    python benchmarks/bench_memory.py              # --quick (default): dp_shard 1, 2, 4
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import uuid
from pathlib import Path

import _common as C

HERE = str(Path(__file__).resolve().parent)


def run_point(n: int, overrides: list[str]) -> list[dict]:
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from _mem_worker import worker

    resolved = C.compose([*overrides, f"parallelism.nproc_per_node={n}", f"parallelism.dp_shard={n}"])
    run_dir = tempfile.mkdtemp(prefix=f"mem_dp{n}_")
    if n == 1:
        import multiprocessing as mp

        with mp.get_context("spawn").Pool(1) as pool:  # a fresh process, like the others
            return [pool.apply(worker, (resolved, run_dir))]
    cfg = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=n, run_id=uuid.uuid4().hex[:12],
                       rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0", max_restarts=0,
                       monitor_interval=0.1, start_method="spawn")
    results = elastic_launch(cfg, worker)(resolved, run_dir)
    return [results[r] for r in sorted(results)]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1,2,4")
    ap.add_argument("--flavor", default="tiny")
    ap.add_argument("--backend", default="native")
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--steps", type=int, default=2)
    args = ap.parse_args(argv)
    C.header("bench_memory", [sys.argv[0], *(argv if argv is not None else sys.argv[1:])])
    os.environ["PYTHONPATH"] = os.pathsep.join([HERE, str(C.ROOT),
                                                os.environ.get("PYTHONPATH", "")])
    overrides = [f"model={args.backend}", f"model.flavor={args.flavor}", f"data.seq_len={args.seq_len}",
                 "data.batch_size=2", f"training.steps={args.steps}", "logging.print_config=false"]
    print(f"model={args.backend}/{args.flavor}, per-rank batch 2x{args.seq_len}, {args.steps} steps, fp32, AdamW")
    base = None
    mib = 1024 ** 2
    for n in [int(x) for x in args.sizes.split(",")]:
        rows = run_point(n, overrides)
        if base is None:
            base = rows[0]
        for r in rows:
            ideal = base["total"] / n
            print(f"dp_shard={n} rank {r['rank']}: params {r['params'] / mib:.2f} MiB, grads {r['grads'] / mib:.2f} MiB, "
                  f"optimizer {r['optimizer'] / mib:.2f} MiB, total {r['total'] / mib:.2f} MiB "
                  f"(ideal 1/{n}: {ideal / mib:.2f} MiB, ratio {r['total'] / ideal:.3f}); peak RSS {r['peak_rss_gib']:.3f} GiB; "
                  f"final loss {r['final_loss'] if r['final_loss'] is None else round(r['final_loss'], 4)} (rank 0 logs it)")


if __name__ == "__main__":
    main()
