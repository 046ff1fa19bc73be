"""Every CUDA path of the project on one GPU, small step counts, one results file (grown from gpu_h200.py).

Runs on whatever torch and torchtitan the host has (torch 2.11 + torchtitan 0.2.2 on the lent H200, GUIDE §9;
a path the installed torchtitan cannot run is recorded as refused, with its one line). Steps, in order:

1. the CLI's main job with default flags (compile.enable=auto: on), then compile.enable=false: Qwen3-0.6B seq
   2048 x 8 bf16 -- steady step, MFU, peak, compile_s and compile_cache;
2. our Trainer vs a bare torchtitan loop over the same model and batch, both compiled per block (gpu_h200.py);
3. each kernel option vs none, bf16, MoE debug seq 2048 x 4 (the experts and RoPE are both there);
4. training.loss=chunked vs full (0.6B);
5. data.document_masking=true and model.attention=flex (0.6B; refused on torchtitan 0.2.x);
6. the profiler (profiling.steps=[3,4]);
7. the plan vs the measured peak of step 1's compile-off run (eager; the plan states the compiled factor);
8. Qwen3-1.7B seq 4096 x 4, selective activation checkpointing.

    python benchmarks/gpu_suite.py                       # ~8 min on one H200 -> benchmarks/results/gpu_suite.json
    python benchmarks/gpu_suite.py --only main,plan --steps 6
    python benchmarks/gpu_suite.py --dry-run             # CPU: composes and checks every step, tiny sizes

``--dry-run`` (device=cpu, tiny sizes) composes and validates every step's configuration and imports what each
step runs, so a typo or an API drift shows up before a GPU is lent (tests/test_compile.py runs it in both tiers).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAIN = ["model=native", "model.flavor=0.6B", "data.seq_len=2048", "data.batch_size=8", "training.mixed_precision=bf16"]
MOE = ["model=native_moe", "model.flavor=debug_moe", "data.seq_len=2048", "data.batch_size=4", "training.mixed_precision=bf16"]
BIG = ["model=native", "model.flavor=1.7B", "data.seq_len=4096", "data.batch_size=4", "training.mixed_precision=bf16",
       "parallelism.activation_checkpoint=selective"]
GPU_KERNEL_OPTIONS = ("none", "reference", "moe_fast", "rope_fast", "fast", "triton_rope", "triton_moe")


def steps(n: int) -> list[tuple[str, str, list[str]]]:
    """(group, name, CLI overrides) of every CLI step; the Trainer-vs-bare step is in-process (``trainer_vs_bare``)."""
    s = [f"training.steps={n}", "training.eval_every=0", "logging.wandb.mode=disabled", "logging.print_config=false"]
    out = [("main", "default flags (compile auto)", MAIN + s),
           ("main", "compile off", MAIN + s + ["compile.enable=false"])]
    out += [("kernels", f"kernels={k}", MOE + s + [f"kernels={k}", "compile.enable=false"]) for k in GPU_KERNEL_OPTIONS]
    out += [("loss", f"loss={loss}", MAIN + s + [f"training.loss={loss}"]) for loss in ("full", "chunked")]
    out += [("attention", "document masking", MAIN + s + ["data.document_masking=true"]),
            ("attention", "flex", MAIN + s + ["model.attention=flex"]),
            ("profiler", "profiling.steps=[3,4]", MAIN + s + ["profiling.steps=[3,4]", "compile.enable=false"]),
            ("big", "1.7B seq 4096x4 selective AC", BIG + s)]
    return out


def tiny(overrides: list[str]) -> list[str]:
    """The dry run's form of a step: device=cpu, tiny flavors, 32-token sequences, 4 steps."""
    flavor = "tiny_moe" if "model=native_moe" in overrides else "tiny"  # the MoE preset refuses a dense flavor
    swap = {"model.flavor": f"model.flavor={flavor}", "data.seq_len": "data.seq_len=32", "data.batch_size": "data.batch_size=2",
            "training.steps": "training.steps=4"}
    out = [swap.get(o.split("=", 1)[0], o) for o in overrides]
    return [o for o in out if not o.startswith("model.attention=flex")] + ["device=cpu"]


def run_cli(overrides: list[str], run_dir: Path, timeout: float) -> dict:
    """One CLI run in its own process; its summary.json, first metrics row and exit status."""
    env = {**os.environ, "WANDB_MODE": "disabled", "PYTHONUNBUFFERED": "1"}
    t0 = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, "-m", "qwen3_research", "device=cuda", *overrides,
                               f"hydra.run.dir={run_dir}"], cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"status": f"timeout after {timeout:.0f} s", "wall_s": time.perf_counter() - t0}
    row = {"rc": proc.returncode, "wall_s": round(time.perf_counter() - t0, 1)}
    summary = run_dir / "summary.json"
    if summary.exists():
        s = json.loads(summary.read_text())
        row.update({k: s.get(k) for k in ("status", "steady_step_s", "first_step_s", "compile", "compile_s",
                                          "compile_cache", "final_loss", "reason")})
    metrics = run_dir / "metrics.jsonl"
    if metrics.exists():
        rows = [json.loads(ln) for ln in metrics.read_text().splitlines() if ln.strip()]
        last = [r for r in rows if "mfu" in r]
        if last:
            row["mfu"] = round(sorted(r["mfu"] for r in last[1:] or last)[len(last[1:] or last) // 2], 4)
            row["mem_peak_gib"] = max(r["mem_peak_gib"] for r in last)
    if proc.returncode != 0:
        err = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
        row["status"] = row.get("status") or "failed"
        row["error"] = err[-1][:400] if err else ""
    row["warned_unfused_norm"] = "Cannot dispatch to fused implementation" in proc.stderr
    return row


def plan_json(overrides: list[str], timeout: float) -> dict:
    proc = subprocess.run([sys.executable, "-m", "qwen3_research.plan", "device=cuda", *overrides, "--json"], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)
    if proc.returncode not in (0, 4):
        return {"status": "failed", "error": (proc.stderr.strip().splitlines() or [""])[-1][:400]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def trainer_vs_bare(n: int, dry: bool) -> dict:
    """gpu_h200.py's comparison with the Trainer's own compile (per block + loss) on both sides."""
    sys.path.insert(0, str(Path(__file__).parent))
    import _common as C
    import torch

    from qwen3_research import compiling, titan
    from qwen3_research.models import get_flavor

    over = (tiny if dry else (lambda o: o))(["device=cuda", *MAIN, "training.steps=1000", "compile.enable=true",
                                               "logging.wandb.mode=disabled"])
    if dry:  # compose and check only: nothing is built on the CPU
        from qwen3_research.compose import compose_resolved
        from qwen3_research.config import to_run_config, validate

        validate(to_run_config(compose_resolved(over)))
        from qwen3_research.models.native import model as native_model

        for owner, name in ((C, "build_trainer"), (C, "batches_from"), (C, "alternate"), (C, "ratio_per_repeat"),
                            (C, "mmm"), (titan, "qwen3_model_config"), (titan, "build_model"), (titan, "init_weights"),
                            (compiling, "apply"), (compiling, "compiled_cross_entropy"),
                            (native_model, "norms_in_input_dtype")):
            assert callable(getattr(owner, name)), f"{owner.__name__}.{name}"
        return {"status": "dry-run: composed"}
    ours = C.build_trainer(over)
    dev = torch.device("cuda", 0)
    cfg = titan.qwen3_model_config(get_flavor("native", "0.6B"), "sdpa", "cuda")
    with torch.device("meta"):
        model = titan.build_model(cfg)
    model.to_empty(device=dev)
    with torch.no_grad():
        torch.manual_seed(0)
        titan.init_weights(model, dev)
    from qwen3_research.models.native.model import norms_in_input_dtype

    norms_in_input_dtype(model)  # the same module math as ours
    compiling.apply(model, ours.run.compile, fullgraph=False, is_moe=False)
    ce = compiling.compiled_cross_entropy(ours.run.compile)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, foreach=True)
    params = list(model.parameters())
    batches = [(i.to(dev), lab.to(dev)) for i, lab in C.batches_from(ours, 4)]

    def bare(step: int):
        inputs, labels = batches[step % len(batches)]
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = ce(model(inputs), labels)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()

    def mine(step: int):
        ours.step()
        torch.cuda.synchronize()

    t0 = time.perf_counter()
    mine(0)
    first_ours = time.perf_counter() - t0
    t0 = time.perf_counter()
    bare(0)
    first_bare = time.perf_counter() - t0
    res = C.alternate({"ours": mine, "bare": bare}, warmup=2, repeats=3, per=max(2, n // 2))
    ratios = C.ratio_per_repeat(res, "ours", "bare")
    peak, fpt, tokens = ours.where.device.peak_flops(torch.bfloat16), ours.step.backend.flops_per_token, 8 * 2048
    out = {"first_step_s": {"ours": round(first_ours, 1), "bare": round(first_bare, 1)},
           "ratio_ours_over_bare": [round(r, 4) for r in C.mmm(ratios)]}
    for name in ("ours", "bare"):
        med = C.mmm(res[name]["steps"])[1]
        out[name] = {"step_s": round(med, 4), "mfu": round(fpt * tokens / med / peak, 4)}
    ours.close()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8, help="training steps per CLI run")
    ap.add_argument("--only", default="", help="comma-separated groups: main,bare,kernels,loss,attention,profiler,plan,big")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "gpu_suite.json"))
    ap.add_argument("--timeout", type=float, default=300, help="seconds per CLI run")
    ap.add_argument("--dry-run", action="store_true", help="device=cpu, tiny: compose and check every step, run nothing")
    args = ap.parse_args(argv)
    only = set(filter(None, args.only.split(",")))
    want = (lambda g: not only or g in only)
    import torch

    from qwen3_research import titan

    t_start = time.perf_counter()
    head = {"torch": torch.__version__, "torchtitan": titan.version(), "cuda": torch.version.cuda,
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None, "dry_run": args.dry_run,
            "command": " ".join([sys.argv[0], *(argv if argv is not None else sys.argv[1:])])}
    print(json.dumps(head), flush=True)
    if not args.dry_run and not torch.cuda.is_available():
        print("no CUDA device: run with --dry-run here, or on a GPU host (docs/GPU.md)")
        return 2
    results = {"host": head, "runs": []}
    run_root = Path(os.environ.get("GPU_SUITE_RUNS", "/tmp/gpu_suite_runs")) / time.strftime("%Y%m%d-%H%M%S")
    if args.dry_run:
        from qwen3_research.compose import compose_resolved
        from qwen3_research.config import to_run_config, validate

        import qwen3_research.plan  # noqa: F401  (every module a step runs)
        import qwen3_research.profiling  # noqa: F401
        import qwen3_research.trainer  # noqa: F401
        from qwen3_research import compiling  # noqa: F401
    for group, name, over in steps(args.steps):
        if not want(group):
            continue
        if args.dry_run:
            validate(to_run_config(compose_resolved(tiny(over))))
            row = {"status": "dry-run: composed"}
        else:
            row = run_cli(over, run_root / f"{group}-{len(results['runs'])}", args.timeout)
        row = {"group": group, "name": name, "overrides": over, **row}
        results["runs"].append(row)
        print(json.dumps(row), flush=True)
    if want("bare"):
        try:
            row = trainer_vs_bare(args.steps, args.dry_run)
        except Exception as e:  # noqa: BLE001 - one failed step must not lose the others' results
            if args.dry_run:
                raise
            row = {"status": "failed", "error": f"{type(e).__name__}: {e}"[:400]}
        results["runs"].append({"group": "bare", "name": "Trainer vs bare loop", **row})
        print(json.dumps(results["runs"][-1]), flush=True)
    if want("plan"):
        over = MAIN + ["compile.enable=false"]
        if args.dry_run:
            validate(to_run_config(compose_resolved(tiny(over))))
            row = {"status": "dry-run: composed"}
        else:
            plan = plan_json(over, args.timeout)
            eager = next((r for r in results["runs"] if r["name"] == "compile off"), {})
            row = {"predicted_peak_gib": plan.get("predicted_peak_gib"), "measured_peak_gib": eager.get("mem_peak_gib"),
                   "predicted_step_s": plan.get("predicted_step_s"), "measured_step_s": eager.get("steady_step_s"),
                   "compile": plan.get("compile"), **({"error": plan["error"]} if "error" in plan else {})}
            if row["predicted_peak_gib"] and row["measured_peak_gib"]:
                row["ratio_plan_over_measured"] = round(row["predicted_peak_gib"] / row["measured_peak_gib"], 3)
        results["runs"].append({"group": "plan", "name": "plan vs measured peak (eager)", **row})
        print(json.dumps(results["runs"][-1]), flush=True)
    results["wall_s"] = round(time.perf_counter() - t_start, 1)
    if not args.dry_run:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=1))
        print(f"results: {args.out}")
    print(f"gpu_suite: {len(results['runs'])} steps in {results['wall_s']} s{' (dry run)' if args.dry_run else ''}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
