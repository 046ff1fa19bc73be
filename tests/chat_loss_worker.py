"""Run under torchrun: build a Trainer from Hydra overrides (data=chat), as a run does, and write, per rank, each
conversation's loss from the run's packed windows against its loss from padded windows of the same conversations,
through the run's own (sharded) model, as OUT.<rank>.json (tests/test_chat.py, acceptance b under fsdp).

usage: python -m torch.distributed.run --nproc_per_node=2 tests/chat_loss_worker.py OUT override...
"""

from __future__ import annotations

import json
import os
import sys

import torch


def main() -> None:
    out, overrides = sys.argv[1], sys.argv[2:]
    from qwen3_research.compose import compose_resolved
    from qwen3_research.resolve import resolve_run
    from qwen3_research.trainer import RunInfo, Trainer
    from tests.test_chat import conversation_losses

    trainer = Trainer(resolve_run(compose_resolved(overrides)), RunInfo(run_dir=os.path.dirname(out)))
    data, backend = trainer.step.data, trainer.step.backend
    assert data.cfg.packing and data.cfg.document_masking
    backend.model.eval()
    packed, padded = data._train, data.windows("train", packing=False)  # the run's windows; data.packing=false's

    def logits_at(x, pos, keep):
        logits = backend.forward(x, pos)
        return (logits.full_tensor() if hasattr(logits, "full_tensor") else logits)[keep]

    a, b = conversation_losses(logits_at, packed), conversation_losses(logits_at, padded)
    assert sorted(a) == sorted(b)
    row = {"rank": int(os.environ.get("RANK", 0)), "world": int(os.environ.get("WORLD_SIZE", 1)),
           "conversations": len(b), "packed_windows": len(packed), "padded_windows": len(padded),
           "max_abs_diff": max(abs(a[k] - b[k]) for k in b)}
    with open(f"{out}.{row['rank']}.json", "w") as fh:
        json.dump(row, fh)
    torch.distributed.barrier() if torch.distributed.is_initialized() else None


if __name__ == "__main__":
    main()
