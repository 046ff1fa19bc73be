"""The pipeline schedule a pipelined step runs (``parallelism.pp > 1``): torch's schedule over this rank's stages
(torchtitan's ``pipeline_llm`` built them, ``titan.pipeline_qwen3``), the loss it calls on the last stage with this
project's normalisation (the global batch's token mean), and the loss sum reduced over the pipeline ranks.
``step.Step`` holds one and drives it per micro-batch group instead of its own forward and backward."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from qwen3_research.data import IGNORE_INDEX
from qwen3_research.loss import chunked_cross_entropy
from qwen3_research.pipeline_trace import replay


@dataclass(eq=False, kw_only=True)
class Pipeline:
    """A pipelined run's schedule (parallelism.pp > 1) and the loss it calls on the last stage.

    torch's schedule splits each batch into the micro-batches, runs this rank's stages and calls ``loss`` once per
    micro-batch on the last stage, backpropagating what it returns as it is; ``loss`` records each micro-batch's
    summed token loss (``sums``) for the report."""

    schedule: object = None
    stages: list = field(default_factory=list)  # this rank's stage indices (two on a V or looped schedule)
    has_first: bool = False
    has_last: bool = False
    group: object = None  # the pipeline ranks' process group
    chunk_tokens: int | None = None  # training.loss=chunked: tokens per chunk; None: the full loss
    lm_head: Callable | None = None  # the last stage's lm_head weight (the chunked loss)
    column_major: bool = False  # the chunked loss's weight copy (resolve.PrecisionPlan.lm_head_column_major)
    microbatches: int = 1  # per schedule step (parallelism.pp_microbatches)
    n_step: int = 1  # label tokens of the whole step (every micro-batch and data-parallel rank)
    scale: float = 1.0  # dp × loss_scale (Step.forward_backward)
    sums: list = field(default_factory=list)
    # the memory plan's trace (step.Placement.trace): no peer to run the schedule with, so this rank's part of it
    # is replayed (pipeline_trace), the stages' inputs from others empty tensors of ``boundary`` (shape, dtype)
    trace: bool = False
    boundary: tuple | None = None

    def loss(self, output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """One micro-batch's share of the step's token-mean loss (as ``Step.forward_backward`` weighs it)."""
        n = int((labels != IGNORE_INDEX).sum())
        if self.chunk_tokens is not None:  # output: the final norm's hidden states (the lm_head skipped)
            mean = chunked_cross_entropy(output, self.lm_head(), labels, self.chunk_tokens, self.column_major)
            total = mean * n if n else mean.nan_to_num(0.0) * 0.0
        else:
            logits = output.full_tensor() if hasattr(output, "full_tensor") else output
            total = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum")
        self.sums.append(total.detach())
        return total * (self.scale / self.n_step) if self.n_step else total * 0.0

    def run(self, inputs: torch.Tensor, labels: torch.Tensor, *, train: bool) -> torch.Tensor:
        """One batch through the schedule (forward and backward, or forward only); its summed token loss on the
        last stage, 0 elsewhere."""
        self.sums.clear()
        args = (inputs,) if self.has_first else ()
        kwargs = dict(target=labels if self.has_last else None, losses=[] if self.has_last else None)
        if train and self.trace:
            replay(self.schedule, n_microbatches=self.microbatches, inputs=inputs, labels=labels, loss=self.loss,
                   boundary=self.boundary)
        elif train:
            self.schedule.step(*args, return_outputs=False, **kwargs)
        else:
            self.schedule.eval(*args, **kwargs)
        # the micro-batches' own calls are the last ones: on its first step a stage runs the loss once more to learn
        # the shapes it exchanges (an empty batch, NaN)
        sums = self.sums[-self.microbatches:]
        return torch.stack(sums).sum() if sums else torch.zeros((), device=labels.device)

    def sum_over_stages(self, total: torch.Tensor) -> torch.Tensor:
        """``total[0]`` (a loss sum, held by the last stage) summed over the pipeline ranks."""
        loss = total[:1].clone()
        torch.distributed.all_reduce(loss, op=torch.distributed.ReduceOp.SUM, group=self.group)
        total[0] = loss[0]
        return total
