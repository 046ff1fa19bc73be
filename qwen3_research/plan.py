"""``python -m qwen3_research.plan [the same overrides as a run]``: per-rank memory and feasibility, on CPU.

It traces one real training step of the run's own step (``step.build_step``, the Trainer's builder) -- model
build, torchtitan sharding, kernel overrides, and the step's one order (``Step.__call__``: ``forward_backward`` on
the run's micro-batches, ``clip_gradients``, ``optimizer_step``) -- under a trace placement
(``planner.trace_placement``): on fake tensors (``torch._subclasses.FakeTensorMode``) over a fake process group
(``torch.testing._internal.distributed.fake_pg``), nothing in the run's config rewritten, with PyTorch's ``MemTracker``
(``qwen3_research.memory``), so the prediction follows the code that will run. No
tensor memory is allocated: 8B over 64 ranks plans on a laptop (4B over 64 FSDP ranks at seq 4096:
about 30 s on 2 cores). A closed-form estimate is printed beside it as a cross-check.

Rank roles: rank 0 and the largest rank. When every sharded parameter dimension divides evenly over
its mesh axis (``evenly_sharded``) every rank holds the same shapes and runs the same operators, so
only rank 0 is traced and the output says so; ``--trace-all-roles`` traces the largest rank anyway.
With ``parallelism.pp > 1`` the roles are per pipeline stage group (the first and the largest rank of each):
each traced rank steps through its part of torch's schedule, replayed in torch's order (a fake process group
has no peer to run it with: ``qwen3_research.pipeline_trace``); each stage's peak is printed and the plan's
per-rank figure is the largest stage's.

Two things a real run does outside the tracked step are kept outside it here too: host work (the
device mesh, built by the trace placement on the host and concatenated by FSDP; the meta-device model
build: ``planner._HostWork``), and DTensor's sharding propagation, which runs operators on global-shape
fake tensors in a fake mode of its own (``planner._sharding_propagation_in_its_own_fake_mode``). The tracker keeps only the
whole-rank peak (``memory.peak_tracker``: upstream also walks every module after every operator).

Not modelled: allocations a collective backend makes internally. On CPU, gloo's reduce-scatter copies
its input on its worker thread, which the run's tracker sees (one FSDP unit's unsharded gradient: the
MoE fsdp2 benchmark config measures 12 % above the plan); the fake group, like NCCL or Neuron
collectives, does not.

A run planned for Trainium (``device=neuron``) plans on a host without it too: the configuration is
checked as for a run, ``device.memory_gib`` gives the capacity (there is nothing to detect), the kernel
overrides are checked against the planned device and LNC (``kernels.registry.planning_for``), and the
NKI kernels are traced by their documented output shapes (``kernels.nki.shape_backend``): what they
keep for backward is in the traced peak, and each kernel's own terms (padding, saved activations) are
printed under the table. Nothing runs on, or claims to have run on, a Neuron device.

``--fit`` searches the knobs a user would turn (micro-batch with gradient accumulation keeping the global batch,
activation checkpointing, chunked loss, bf16, tensor parallel degree with sequence parallel, pipeline parallel
degree on an untied model) and prints the few
variants that fit, cheapest predicted step first, each as the whole command line; exit 0 with suggestions, 4 when
nothing fits (naming the term that dominates). How it searches and ranks: ``qwen3_research.fit``.

``--json`` adds one JSON line after the table. Exit status: 0 fits (with headroom, or tight: peak above
85 % of the capacity), 4 does not fit (then the largest terms, largest first), 2 configuration error
(the same one line as a run), 1 the trace itself failed.

The traced step is a steady one: the optimizer's state exists before it starts, as in every step after
the first (``_optimizer_state_as_after_one_step``). The same tracker measures a real run's second step
(its first when ``training.steps=1``) with ``training.track_memory=true``
(``peak_live_bytes_per_rank`` in summary.json), which is what the prediction is checked against
(``benchmarks/bench_plan.py``).
"""

from __future__ import annotations

import json
import sys

from qwen3_research.startup import exit_at_once_while_importing, quiet_libraries, run_tool

if __name__ == "__main__":  # Ctrl-C / SIGTERM while the modules below import: 128+signal, one line
    exit_at_once_while_importing("; the plan was stopped; nothing was written")

from qwen3_research import allocator  # noqa: E402
from qwen3_research.compose import compose_resolved  # noqa: E402
from qwen3_research.errors import ConfigError  # noqa: E402
from qwen3_research.resolve import resolve_run  # noqa: E402

EXIT_FITS = 0
EXIT_DOES_NOT_FIT = 4
EXIT_CONFIG = 2
EXIT_FAILED = 1
PLAN_FLAGS = ("--fit", "--json", "--trace-all-roles", "--help")


def main(argv: list[str] | None = None) -> int:
    quiet_libraries()  # the trace builds the run's model: its library warnings as one line each

    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        return 0
    if (why := allocator.refusal()) is not None:
        print(f"config error: {why}", file=sys.stderr, flush=True)
        return 2
    unknown = [a for a in argv if a.startswith("-") and a not in PLAN_FLAGS]
    if unknown:  # else Hydra's override lexer failed on it (a 2-line "token recognition error")
        sweep = (" (a sweep: run it; it plans every point before any starts, sweep.plan=true)"
                 if unknown[0] in ("-m", "--multirun") else "")
        print(f"config error: plan: unknown option {unknown[0]}{sweep}; plan takes one run's overrides (key=value, "
              f"group=option) and {', '.join(PLAN_FLAGS)}", file=sys.stderr, flush=True)
        return EXIT_CONFIG
    as_json = "--json" in argv  # also one JSON line (per-rank bytes) after the table, for scripts
    trace_all = "--trace-all-roles" in argv  # trace the largest rank even when its shapes are rank 0's
    fit = "--fit" in argv  # search the variants that fit (qwen3_research.fit)
    argv = [a for a in argv if a not in ("--json", "--trace-all-roles", "--fit")]
    try:  # resolved as a run would be, before the trace's heavy half is imported: a config error exits without it
        run = resolve_run(compose_resolved(argv), plan=True)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr, flush=True)
        return EXIT_CONFIG
    # deferred: start-up (the heavy half: torch and the step's parts, after a config error has exited)
    from qwen3_research import fit as fitting, planner

    if fit:
        return _fit(fitting, argv, run, as_json)
    try:
        plan = planner.make_plan(run, trace_all=trace_all)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr, flush=True)
        return EXIT_CONFIG
    print(planner.render(plan), flush=True)
    if as_json:
        print(json.dumps({**plan.as_dict(), "per_rank_peak_bytes": plan.per_rank_peak(), "mirrored_ranks": plan.mirrored,
                          "per_rank_traced_bytes": {r.rank: r.traced for r in plan.ranks},
                          "per_rank_param_shard_bytes": {r.rank: r.param_shards for r in plan.ranks},
                          "per_rank_params_max_bytes": {r.rank: r.params_max for r in plan.ranks},
                          "estimate_bytes": plan.ranks[0].estimate, "tokens_per_step": plan.tokens_per_step,
                          "flops_per_step": plan.flops_per_step, "predicted_step_s": plan.predicted_step_s,
                          "compile": plan.compile_line}), flush=True)
    return EXIT_FITS if plan.fits else EXIT_DOES_NOT_FIT


def _fit(fit, argv: list[str], run, as_json: bool) -> int:
    try:
        result = fit.search(run, frozen=fit.explicit_keys(argv))
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr, flush=True)
        return EXIT_CONFIG
    print(fit.render(result, argv), flush=True)
    if as_json:
        print(json.dumps({"fits": [{"overrides": fit.replace_overrides(argv, c.changes), "changes": c.changes,
                                    "predicted_peak_gib": round(c.plan.peak_gib, 4), "compute_s": c.compute_s,
                                    "comm_bytes": c.comm_bytes} for c in result.fits],
                          "considered": result.considered, "traced": result.traced, "wall_s": result.wall_s,
                          "dominant": result.dominant}), flush=True)
    return EXIT_FITS if result.fits else EXIT_DOES_NOT_FIT


if __name__ == "__main__":
    sys.exit(run_tool(main, "the plan was stopped; nothing was written"))
