"""Chunked cross-entropy (``training.loss=chunked``): lm_head and loss together, a chunk of tokens at a time.

With Qwen3's 151,936-token vocabulary the logits are the largest activation of a step: 8,192
tokens in fp32 are 4.6 GiB, and the full loss keeps them, their softmax and their gradient.
Here the lm_head matmul runs inside one autograd function, ``training.loss_chunk_tokens``
tokens at a time: the forward keeps only the per-token log-sum-exp (N floats), the backward
recomputes each chunk's logits, turns them into the gradient in place and frees them before
the next chunk. At most one chunk of logits (and one of its softmax) is alive at once.

Why not torchtitan's ``ChunkedLossWrapper`` (torchtitan 0.3.0, components/loss.py): it runs each
chunk's backward *inside* the loss call, before the trainer has scaled the loss (1/grad_accum,
the 1/dp factor of ``parallel.sum_gradients_over_dp``, the NaN fault hook), so the lm_head's
gradient would miss those factors; it needs the model's ``_skip_lm_head`` flag, which Hugging
Face models lack; and it needs seq_len divisible by its chunk count. A plain autograd function
composes with every scaling, backend and layout the trainer already has.

Tensor parallel: the lm_head weight is a DTensor sharded on the vocabulary (Shard(0)) over the
tp mesh. Each rank computes the logits of its vocabulary slice; the log-sum-exp, the target
logit and the hidden-state gradient are all-reduced over the tp group (vocabulary-parallel
cross-entropy), so no rank ever holds full-vocabulary logits.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

IGNORE_INDEX = -100  # as F.cross_entropy


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """mean over valid tokens of CE(hidden @ weight.T, labels), computed ``chunk`` rows at a time.

    hidden (N, D), weight (V_local, D) plain tensors; labels (N,) int64 with global vocabulary ids;
    ``group``/``vocab_start``: the tp process group and this rank's first vocabulary row (or None, 0).
    """

    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk: int, group, vocab_start: int):
        n, v_local = hidden.shape[0], weight.shape[0]
        lse = torch.empty(n, dtype=torch.float32, device=hidden.device)
        target = torch.zeros(n, dtype=torch.float32, device=hidden.device)
        local = labels - vocab_start
        in_shard = (local >= 0) & (local < v_local)
        local = local.clamp(0, v_local - 1)
        for s in range(0, n, chunk):
            logits = torch.matmul(hidden[s:s + chunk], weight.t()).float()
            lse[s:s + chunk] = torch.logsumexp(logits, dim=1)
            target[s:s + chunk] = logits.gather(1, local[s:s + chunk, None]).squeeze(1)
            del logits
        target = torch.where(in_shard, target, torch.zeros_like(target))
        if group is not None:  # vocabulary-parallel: combine the per-shard log-sum-exps and targets
            peak = lse.clone()
            dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
            sums = torch.exp(lse - peak)
            dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
            lse_local = lse
            lse = peak + torch.log(sums)
            del lse_local
            dist.all_reduce(target, op=dist.ReduceOp.SUM, group=group)
        valid = labels != IGNORE_INDEX
        count = valid.sum().clamp(min=1)
        loss = torch.where(valid, lse - target, torch.zeros_like(lse)).sum() / count
        ctx.save_for_backward(hidden, weight, labels, lse, local, in_shard & valid, valid, count)
        ctx.chunk, ctx.group = chunk, group
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        hidden, weight, labels, lse, local, hit, valid, count = ctx.saved_tensors
        chunk, group = ctx.chunk, ctx.group
        scale = (grad_loss / count).float()
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        for s in range(0, hidden.shape[0], chunk):
            h = hidden[s:s + chunk]
            g = torch.matmul(h, weight.t()).float()  # recomputed logits, turned into d loss / d logits in place
            g.sub_(lse[s:s + chunk, None]).exp_()
            g.scatter_add_(1, local[s:s + chunk, None], -hit[s:s + chunk, None].float())  # static shapes (fake tensors)
            g.mul_((valid[s:s + chunk].float() * scale)[:, None])
            g = g.to(hidden.dtype) if hidden.dtype != torch.float32 else g
            grad_hidden[s:s + chunk] = torch.matmul(g, weight.to(g.dtype))
            grad_weight.addmm_(g.t().float(), h.float())
            del g
        if group is not None:  # each tp rank holds the contribution of its vocabulary slice
            dist.all_reduce(grad_hidden, op=dist.ReduceOp.SUM, group=group)
        return grad_hidden, grad_weight.to(weight.dtype), None, None, None, None


def _vocab_sharding(weight) -> tuple[torch.Tensor, object, int]:
    """(local weight, tp group or None, first vocabulary row) for a plain or DTensor lm_head weight."""
    if not hasattr(weight, "device_mesh"):
        return weight, None, 0
    from torch.distributed.tensor import Shard

    mesh, group, start = weight.device_mesh, None, 0
    for dim, placement in enumerate(weight.placements):
        if isinstance(placement, Shard) and placement.dim == 0 and mesh.size(dim) > 1:
            if group is not None:
                raise NotImplementedError("chunked loss: lm_head weight sharded on the vocabulary over two mesh axes")
            size, rank = mesh.size(dim), mesh.get_local_rank(dim)
            group = mesh.get_group(dim)
            start = rank * -(-weight.shape[0] // size)  # torch's Shard: ceil-sized leading shards
        elif isinstance(placement, Shard):
            raise NotImplementedError(f"chunked loss: unexpected lm_head weight placement {weight.placements}")
    return weight.to_local(), group, start


def chunked_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_tokens: int) -> torch.Tensor:
    """Mean token cross-entropy of ``hidden @ weight.T`` against ``labels`` without the full logits.

    hidden (B, L, D) (a DTensor under tensor parallel: made whole; it is small), weight the lm_head
    weight (V, D) as the module holds it during the step (a plain tensor, or a DTensor sharded on
    the vocabulary over tp), labels (B, L).
    """
    if hasattr(hidden, "full_tensor"):
        hidden = hidden.full_tensor()
    w_local, group, start = _vocab_sharding(weight)
    if w_local.dtype != hidden.dtype:  # autocast: the matmul runs in the activations' dtype, as F.linear would
        w_local = w_local.to(hidden.dtype)
    return _ChunkedLinearCrossEntropy.apply(
        hidden.flatten(0, 1), w_local, labels.flatten(), max(1, int(chunk_tokens)), group, start
    )


def lm_loss(backend, inputs: torch.Tensor, labels: torch.Tensor, chunk_tokens: int) -> torch.Tensor:
    """The chunked loss of a model backend (``hidden_states`` + ``lm_head_weight``); call under the step's autocast."""
    hidden = backend.hidden_states(inputs)
    return chunked_cross_entropy(hidden, backend.lm_head_weight(), labels, chunk_tokens)
