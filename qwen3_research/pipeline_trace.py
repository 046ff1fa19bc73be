"""A pipelined step replayed on one rank alone, for the memory plan's fake-tensor trace (``planner``).

A real rank runs torch's schedule (``Pipeline.run``: ``schedule.step``), which talks to its peers: the shapes its
stages exchange are learned on the first step by sending pickled metadata and votes between the ranks, and every
micro-batch's activations and gradients cross by send and receive. The plan traces one rank on a fake process
group with no peer (nothing to receive, no value to read), so the schedule itself cannot run there. This replays
what it does on this rank instead, with the same parts and in torch's order:

- the order: each rank's actions as torch's schedule runs them (torch 2.10-2.14 sources,
  ``torch/distributed/pipelining/schedules.py``): ``ScheduleGPipe._step_microbatches`` (every forward, then every
  backward), ``Schedule1F1B._step_microbatches`` (``min(n_microbatches, num_stages - stage_index)`` forwards
  first, then one backward and one forward in turn, then the remaining backwards), and for the schedules with
  several stages per rank (looped, zero-bubble, V) the lowered program the schedule itself executes,
  ``pipeline_order_with_comms[rank]`` (F, B, I, W, UNSHARD, RESHARD, REDUCE_GRAD and OVERLAP_F_B of them);
- the work: each stage's own calls torch's stage makes (``forward_maybe_with_nosync``,
  ``backward_maybe_with_nosync`` with its FSDP settings: no resharding and no gradient reduction until
  ``perform_reduce_grad`` after the last micro-batch, so a stage holds its unsharded gradients over the whole
  step), and this project's loss on the last stage right after each forward (``_maybe_compute_loss``);
- what a stage keeps: each micro-batch's outputs and inputs from its forward to its backward (torch's
  ``fwd_cache``): the first stage of 1F1B holds ``pp`` micro-batches of activations at once, GPipe every one. A
  zero-bubble schedule's input-gradient half (I) keeps what the weight gradients need until W (``backward_state``);
  here the whole backward runs at W, which keeps a micro-batch's activations until then: at most what the split
  keeps (an upper bound), because the split's input half runs ``autograd.grad`` on leaf inputs, which the
  tracker's gradient hooks on module inputs refuse ("A leaf node was passed to _will_engine_execute_node"). A stage that is not first
  holds one receive buffer per micro-batch (``args_recv_info``; made on the first step and kept), whose
  gradient torch's backward accumulates and keeps until the next step (``clear_runtime_states``); a stage that is
  not last one gradient buffer per micro-batch (``grad_recv_info``). They are made here, inside the traced step,
  so the plan counts them (a run's tracker, started on its second step, never sees those made on its first).

What crosses between ranks here is an empty tensor of the boundary's shape (``boundary``: one micro-batch's hidden
states as a block returns them, local under sequence parallel) in place of the peer's values; between two stages
on this rank (a V schedule's middle) the output itself, detached, as torch's ``set_local_fwd_input`` passes it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

FORWARD, FULL_BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT = "F", "B", "I", "W"
UNSHARD, RESHARD, REDUCE_GRAD, OVERLAP_F_B = "UNSHARD", "RESHARD", "REDUCE_GRAD", "OVERLAP_F_B"


def schedule_stages(schedule) -> list:
    """The stage objects of this rank (torch keeps them private: ``_stages``, or ``_stage`` for one)."""
    return list(getattr(schedule, "_stages", None) or [schedule._stage])


def rank_actions(schedule, n_microbatches: int) -> list[tuple[str, int, int | None, tuple]]:
    """This rank's actions in torch's order: (type, stage index, micro-batch or None, sub-actions)."""
    lowered = getattr(schedule, "pipeline_order_with_comms", None)
    if lowered is not None:  # the looped, zero-bubble and V schedules' own program
        return [(_kind(a), a.stage_index, a.microbatch_index,
                 tuple((_kind(s), s.stage_index, s.microbatch_index, ()) for s in a.sub_actions or ()))
                for a in lowered[schedule.rank] if a is not None]
    (stage,) = schedule_stages(schedule)
    s, n = stage.stage_index, n_microbatches
    # a single-stage schedule's own loop (its pipeline_order is a drawing: torch 2.14's 1F1B one numbers the
    # micro-batches from 1 on every rank but the first)
    name = type(schedule).__name__
    if name == "ScheduleGPipe":
        order = [(FORWARD, i) for i in range(n)] + [(FULL_BACKWARD, i) for i in range(n)]
    elif name == "Schedule1F1B":
        warmup = min(n, stage.num_stages - s)
        order = [(FORWARD, i) for i in range(warmup)]
        for b in range(n):
            order.append((FULL_BACKWARD, b))
            if warmup + b < n:
                order.append((FORWARD, warmup + b))
    else:
        raise NotImplementedError(f"the memory plan cannot replay the pipeline schedule {name}")
    return [(k, s, i, ()) for k, i in order] + [(REDUCE_GRAD, s, None, ())]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _kind(action) -> str:
    return action.computation_type.value


def replay(schedule, *, n_microbatches: int, inputs: torch.Tensor, labels: torch.Tensor,
           loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], boundary: tuple) -> None:
    """One training step of this rank's stages, in torch's order, with no peer (see the module docstring).
    ``boundary``: (local shape, dtype, None or (tp mesh, placements, global shape)) of one micro-batch's hidden
    states between two stages (``step.stage_boundary``)."""
    stages = {s.stage_index: s for s in schedule_stages(schedule)}
    shape, dtype, spread = boundary
    device = inputs.device

    def received(buffer: torch.Tensor) -> torch.Tensor:
        """A received local tensor as the stage sees it: under tensor parallel a DTensor on the tp mesh (torch's
        ``_retrieve_recv_activations`` / ``_retrieve_recv_grads`` rebuild it the same way)."""
        if spread is None:
            return buffer
        mesh, placements, full = spread
        return DTensor.from_local(buffer, device_mesh=mesh, placements=placements, shape=full,
                                  stride=torch.empty(full, device="meta").stride(), run_check=False)
    xs, ys = inputs.tensor_split(n_microbatches), labels.tensor_split(n_microbatches)
    # the receive buffers torch keeps per stage and micro-batch (see the module docstring)
    recv = {(s, i): torch.empty(shape, dtype=dtype, device=device) for s, st in stages.items() if not st.is_first
            and s - 1 not in stages for i in range(n_microbatches)}
    grad_recv = {(s, i): torch.empty(shape, dtype=dtype, device=device) for s, st in stages.items() if not st.is_last
                 and s + 1 not in stages for i in range(n_microbatches)}
    local_in, local_grad, cache, pending = {}, {}, {}, {}

    def forward(s: int, i: int) -> None:
        st = stages[s]
        if st.is_first:
            args = (xs[i],)
        else:
            x = local_in.pop((s, i)) if (s, i) in local_in else received(recv[(s, i)])
            args = (x.requires_grad_(True),)
        out = st.forward_maybe_with_nosync(*args)
        outs = out if isinstance(out, tuple) else (out,)
        if s + 1 in stages:  # a V schedule's two stages on this rank: the output itself, detached
            local_in[(s + 1, i)] = received(_local(outs[0]).detach())
        elif not st.is_last:  # what this stage sends is what the next rank's stage is given here
            sent = _local(outs[0])
            if (tuple(sent.shape), sent.dtype) != (tuple(shape), dtype):
                raise RuntimeError(f"stage {s} sends {tuple(sent.shape)} {sent.dtype} per micro-batch; the plan gave "
                                   f"the next stage {tuple(shape)} {dtype} (step.stage_boundary)")
        # torch keeps the outputs (the last stage's logits too, beside its loss) until the micro-batch's backward
        cache[(s, i)] = (outs, [a for a in args if isinstance(a, torch.Tensor)], loss(out, ys[i]) if st.is_last else None)

    def bwd_kwargs(s: int, i: int) -> dict:
        st = stages[s]
        outs, inputs_, loss_ = cache.pop((s, i))
        if st.is_last:
            return {"stage_output": loss_, "output_grads": None, "input_values": inputs_, "outputs": outs}
        grads = local_grad.pop((s, i)) if (s, i) in local_grad else (received(grad_recv[(s, i)]),)
        return {"stage_output": outs, "output_grads": grads, "input_values": inputs_, "outputs": outs}

    def after_backward(s: int, i: int, kw: dict, grads_in) -> None:
        st = stages[s]
        if s - 1 in stages and grads_in is not None:  # torch hands the local part over (set_local_bwd_input)
            local_grad[(s - 1, i)] = tuple(received(_local(g)) if g is not None else None for g in grads_in)
        if st.is_last and not st.is_first:  # torch frees the last stage's graph context this way
            for t in kw.pop("outputs"):
                if not t._is_view():
                    t.detach_()

    def act(kind: str, s: int, i: int | None, subs: tuple) -> None:
        st = stages.get(s)
        if kind == OVERLAP_F_B:
            for sub in subs:
                act(*sub)
        elif kind == FORWARD:
            forward(s, i)
        elif kind == FULL_BACKWARD:
            kw = bwd_kwargs(s, i)
            grads_in, _ = st.backward_maybe_with_nosync("full", kw)
            after_backward(s, i, kw, grads_in)
        elif kind == BACKWARD_INPUT:  # the whole backward waits for W here (see the module docstring)
            pending[(s, i)] = bwd_kwargs(s, i)
            if s - 1 in stages:  # what a V schedule's next action on this rank receives from this one
                local_grad[(s - 1, i)] = (received(torch.empty(shape, dtype=dtype, device=device)),)
        elif kind == BACKWARD_WEIGHT:
            kw = pending.pop((s, i))
            st.backward_maybe_with_nosync("full", kw)
            after_backward(s, i, kw, None)
        elif kind in (UNSHARD, RESHARD):
            for m in st.submod.modules():
                if isinstance(m, FSDPModule):
                    m.unshard() if kind == UNSHARD else m.reshard()
        elif kind == REDUCE_GRAD:
            st.perform_reduce_grad(1)  # the gradients' scale does not change their bytes
        # SEND_F, RECV_F, SEND_B, RECV_B: no peer here (the buffers above stand for what they move)

    for action in rank_actions(schedule, n_microbatches):
        act(*action)
