"""Worker for bench_memory.py: one rank trains a few steps and returns its memory figures.

A separate importable module: the elastic launcher's spawned ranks import it by name.
"""

from __future__ import annotations

import os


def worker(resolved: dict, run_dir: str) -> dict:
    import _common  # noqa: F401  (pins the device before torchtitan is imported)
    from qwen3_research.launch.elastic import _limit_threads
    from qwen3_research.parallel import state_bytes
    from qwen3_research.resolve import resolve_run
    from qwen3_research.trainer import RunInfo, Trainer

    _limit_threads(int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    trainer = Trainer(resolve_run(resolved), RunInfo(run_dir=run_dir))
    try:
        summary = trainer.train()
        sb = state_bytes(trainer.step.backend.model, trainer.step.optimizer)  # after the last step (grads freed)
        first = trainer.step.state_bytes or {}  # measured by the Trainer right after the first optimizer step
        mem = trainer.where.device.memory()
        return {"rank": trainer.where.rank, "params": first.get("params", sb["params"]), "grads": first.get("grads", 0),
                "optimizer": first.get("optimizer", sb["optimizer"]), "total": first.get("total", 0),
                "peak_rss_gib": mem.peak_gib, "final_loss": summary["final_loss"]}
    finally:
        trainer.close()
