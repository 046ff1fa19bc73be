"""Shared helpers for the benchmark scripts (not a test module, not part of the package).

Everything runs on the device ``prepare_torchtitan`` pins (cpu here) and in one process
unless a script says otherwise. Ratios are measured side by side: the two contenders take
turns step by step, so a noisy neighbour slows both alike.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from qwen3_research import allocator  # noqa: E402  (standard library only)

# The CPU allocator a run of the CLI gets (issue 24), before torch is imported: the bare loops compared with the
# Trainer run in this same process, so both have it (QWEN3_CPU_ALLOCATOR=system measures glibc as it comes).
allocator.ensure_script()

from qwen3_research import devices  # noqa: E402  (light: torch + config only)

devices.prepare_torchtitan(devices.resolve_device_type("auto"))


# -- config and trainer ------------------------------------------------------------------------
def compose(overrides: list[str]) -> dict:
    """The resolved config dict ``python -m qwen3_research <overrides>`` would run."""
    from qwen3_research.compose import compose_resolved
    from qwen3_research.config import to_run_config, validate

    base = ["logging.wandb.mode=disabled", "logging.progress_bar=false", "logging.print_config=false",
            "training.eval_every=0"]
    resolved = compose_resolved(base + list(overrides))
    resolved.pop("hydra", None)
    validate(to_run_config(resolved))
    return resolved


def build_trainer(overrides: list[str], run_dir: str | None = None):
    from qwen3_research.resolve import resolve_run
    from qwen3_research.trainer import RunInfo, Trainer

    run = resolve_run(compose(overrides))
    run_dir = run_dir or tempfile.mkdtemp(prefix="qwen3_bench_")
    return Trainer(run, RunInfo(run_dir=run_dir))


class quiet_stdout:
    """Silence the console sink's per-step lines while timing (they still cost their time)."""

    def __enter__(self):
        self._old = sys.stdout
        sys.stdout = open(os.devnull, "w")
        return self

    def __exit__(self, *exc):
        sys.stdout.close()
        sys.stdout = self._old


# -- the bare loop -----------------------------------------------------------------------------
class BareLoop:
    """The same torchtitan model trained by hand: forward, cross-entropy, backward, clip, AdamW.

    Built from the same torchtitan config, seed and init as ``model=native``; no framework code
    in the step (pre-made batches, no logging, no scheduler, no finiteness check).
    """

    def __init__(self, backend: str, flavor: str, seq_len: int, seed: int = 0, lr: float = 3e-3,
                 weight_decay: float = 0.1, grad_clip: float = 1.0, mixed_precision: str = "none",
                 flavor_obj=None):
        import torch

        from qwen3_research import titan
        from qwen3_research.models import get_flavor

        self.torch = torch
        self.flavor = flavor_obj or get_flavor(backend, flavor)
        cfg = titan.qwen3_model_config(self.flavor, "sdpa", "cpu")  # what model=native builds (models/native.py)
        with torch.device("meta"):
            self.model = titan.build_model(cfg)
        self.num_params, self.flops_per_token = titan.nparams_and_flops(cfg, self.model, seq_len)
        self.model.to_empty(device="cpu")
        with torch.no_grad():
            torch.manual_seed(seed)
            titan.init_weights(self.model, torch.device("cpu"))
        self.model.train()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr, betas=(0.9, 0.95), eps=1e-8,
                                     weight_decay=weight_decay, foreach=True)
        self.grad_clip = grad_clip
        self.bf16 = mixed_precision == "bf16"
        self.params = list(self.model.parameters())

    def step(self, inputs, labels) -> None:
        torch = self.torch
        if self.bf16:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = self.model(inputs)
        else:
            logits = self.model(inputs)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, self.grad_clip, foreach=True)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


def batches_from(trainer, n: int) -> list:
    """The trainer's own first ``n`` batches, materialised (so the bare loop sees the same tokens)."""
    t = trainer.cfg.training
    out = []
    for s in range(n):
        b = trainer.step.data.train_batch(s, 0, 1, 0, 1, t.seed)
        out.append((b.inputs, b.labels))
    return out


# -- timing helpers ----------------------------------------------------------------------------
def mmm(values) -> tuple[float, float, float]:
    v = list(values)
    return min(v), statistics.median(v), max(v)


def fmt_mmm(values, fmt="{:.3f}") -> str:
    lo, med, hi = mmm(values)
    return f"{fmt.format(lo)} / {fmt.format(med)} / {fmt.format(hi)}"


def time_call(fn, *args) -> float:
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


def loadavg() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "?"


def header(name: str, argv: list[str]) -> None:
    import torch

    print(f"# {name}: torch {torch.__version__}, threads {torch.get_num_threads()}, "
          f"load average {loadavg()}, CPU allocator {allocator.status()}", flush=True)
    print(f"# command: python {' '.join(argv)}", flush=True)


def cpu_peak(dtype_name: str = "float32") -> float:
    import torch

    return devices.cached_cpu_peak(getattr(torch, dtype_name))


def alternate(contenders: dict, *, warmup: int, repeats: int, per: int) -> dict:
    """Step every contender in turn (``fn(step)`` runs one training step); time each call.

    Returns {name: {"steps": [s...] (after warm-up), "first": s, "medians": [per repeat]}}.
    """
    out = {name: {"steps": [], "first": None, "medians": []} for name in contenders}
    names = list(contenders)
    for step in range(warmup + repeats * per):
        order = names if step % 2 == 0 else names[::-1]  # alternate who goes first (cache warmth)
        for name in order:
            dt = time_call(contenders[name], step)
            if step == 0:
                out[name]["first"] = dt
            if step >= warmup:
                out[name]["steps"].append(dt)
    for name in names:
        s = out[name]["steps"]
        out[name]["medians"] = [statistics.median(s[r * per:(r + 1) * per]) for r in range(repeats)]
    return out


def ratio_per_repeat(res: dict, num: str, den: str) -> list[float]:
    """time[num] / time[den] per repeat (so > 1 means num is slower)."""
    return [a / b for a, b in zip(res[num]["medians"], res[den]["medians"])]


def trainer_stepper(trainer):
    def step(i: int):  # i: the caller's count; the Trainer trains its state's next step
        trainer.step()
    return step


def hook_step_calls(trainer, hooked) -> None:
    """Make the loop's step calls (``trainer.step()``, in ``Trainer.train``) call ``hooked()`` instead; ``hooked``
    calls the original (``type(trainer.step).__call__(trainer.step)``) itself. ``__call__`` is looked up on the
    type, so the instance gets a subclass of its own."""
    step = trainer.step
    step.__class__ = type(f"Hooked{type(step).__name__}", (type(step),), {"__call__": lambda self: hooked()})
