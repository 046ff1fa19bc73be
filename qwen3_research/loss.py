"""Chunked cross-entropy (``training.loss=chunked``): lm_head and loss together, a chunk of tokens at a time.

With Qwen3's 151,936-token vocabulary the logits are the largest activation of a step: 8,192
tokens in fp32 are 4.6 GiB, and the full loss keeps them, their softmax and their gradient.
Here the lm_head matmul runs inside one autograd function, ``training.loss_chunk_tokens``
tokens at a time: each chunk's logits are turned into the loss and, in place, into their
gradient, which is multiplied back into the hidden-state and lm_head gradients before the next
chunk; at most one chunk of logits is alive at once (see ``_ChunkedLinearCrossEntropy``).

Why not torchtitan's ``ChunkedLossWrapper`` (torchtitan 0.3.0, components/loss.py): it runs each
chunk's backward *inside* the loss call, before the trainer has scaled the loss (1/grad_accum,
the 1/dp factor of ``parallel.sum_gradients_over_dp``, the tests' NaN fault hook), so the lm_head's
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
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Shard


IGNORE_INDEX = -100  # as F.cross_entropy


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """mean over valid tokens of CE(hidden @ weight.T, labels), computed ``chunk`` rows at a time.

    hidden (N, D), weight (V_local, D) plain tensors; labels (N,) int64 with global vocabulary ids;
    ``group``/``vocab_start``: the tp process group and this rank's first vocabulary row (or None, 0).

    The gradients are formed in the forward, chunk by chunk, while each chunk's logits are at hand
    (as Liger-Kernel's fused linear cross-entropy does): three matmuls per chunk, the same count as
    the full loss, instead of four with a recomputation in backward. What stays alive from forward to
    backward is the hidden-state gradient (N × D) and an fp32 lm_head gradient buffer (V_local × D,
    the size of the weight), never a (chunk × V) block. The backward only scales them by the
    incoming gradient, so every factor the trainer applies to the loss reaches the lm_head too.
    """

    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk: int, group, vocab_start: int, need_grad: bool, column_major: bool):
        n, v_local = hidden.shape[0], weight.shape[0]
        local = labels - vocab_start
        in_shard = (local >= 0) & (local < v_local)
        local = local.clamp(0, v_local - 1)
        valid = labels != IGNORE_INDEX
        count = valid.sum().clamp(min=1).float()
        hit = (in_shard & valid).float()
        weigh = valid.float() / count
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_hidden = torch.empty_like(hidden) if need_grad else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_grad else None
        weight_nn = weight  # the right operand of the hidden-state gradient's GEMM, (V_local, D)
        if need_grad and column_major:  # a 16-bit run (its weight, or autocast's GEMM) on a device that asks for it
            # one column-major copy per step (the weight's size) for a GEMM that is otherwise ~25x slower: tiny's bf16
            # chunked loss took 8.3x less CPU time (RESULTS.md row 23); the 16-bit cast keeps the layout
            weight_nn = weight.t().contiguous().t()
        with torch.no_grad():
            for s in range(0, n, chunk):
                e = min(s + chunk, n)
                h = hidden[s:e]
                logits = torch.matmul(h, weight.t()).float()
                target = logits.gather(1, local[s:e, None]).squeeze(1) * hit[s:e]
                # log-sum-exp with one exp pass, in place: exp(logits - row max) stays in the logits' buffer and is
                # the unnormalised softmax the gradient needs (torch.logsumexp allocates a temporary of the chunk's
                # size and exponentiates it, and the gradient then exponentiated the logits a second time).
                peak = logits.amax(dim=1)
                probs = logits.sub_(peak[:, None]).exp_()
                lse = peak + torch.log(probs.sum(dim=1))
                if group is not None:  # vocabulary-parallel: combine the per-shard log-sum-exps and targets
                    top = lse.clone()
                    dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
                    sums = torch.exp(lse - top)
                    dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
                    lse = top + torch.log(sums)
                    dist.all_reduce(target, op=dist.ReduceOp.SUM, group=group)
                total += ((lse - target) * weigh[s:e]).sum()
                if need_grad:  # d loss / d logits = (softmax - onehot) × valid / count, in place of the logits
                    # softmax = exp(logits - peak) · exp(peak - lse): one scaling pass, with the token weights
                    g = probs.mul_((torch.exp(peak - lse) * weigh[s:e])[:, None])
                    g.scatter_add_(1, local[s:e, None], -(hit[s:e] * weigh[s:e])[:, None])
                    gh = g.to(hidden.dtype) if hidden.dtype != torch.float32 else g
                    grad_hidden[s:e] = torch.matmul(gh, weight_nn.to(gh.dtype))
                    grad_weight.addmm_(g.t(), h.float())
                    del g, gh
                del logits, probs
        if need_grad and group is not None:  # each tp rank holds the contribution of its vocabulary slice
            dist.all_reduce(grad_hidden, op=dist.ReduceOp.SUM, group=group)
        if need_grad:
            ctx.save_for_backward(grad_hidden, grad_weight)
            ctx.weight_dtype = weight.dtype
        return total

    @staticmethod
    def backward(ctx, grad_loss):
        grad_hidden, grad_weight = ctx.saved_tensors
        return (grad_hidden * grad_loss.to(grad_hidden.dtype), (grad_weight * grad_loss.float()).to(ctx.weight_dtype),
                None, None, None, None, None, None)


def _vocab_sharding(weight) -> tuple[torch.Tensor, object, int]:
    """(local weight, tp group or None, first vocabulary row) for a plain or DTensor lm_head weight."""
    if not hasattr(weight, "device_mesh"):
        return weight, None, 0
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


def chunked_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_tokens: int,
                          column_major: bool = False) -> torch.Tensor:
    """Mean token cross-entropy of ``hidden @ weight.T`` against ``labels`` without the full logits.

    hidden (B, L, D) (a DTensor under tensor parallel: made whole; it is small), weight the lm_head
    weight (V, D) as the module holds it during the step (a plain tensor, or a DTensor sharded on
    the vocabulary over tp), labels (B, L). ``column_major``: the hidden-state gradient's 16-bit GEMM takes a
    column-major copy of the weight (``PrecisionPlan.lm_head_column_major``, decided at resolution).
    """
    if hasattr(hidden, "full_tensor"):
        hidden = hidden.full_tensor()
    w_local, group, start = _vocab_sharding(weight)
    if w_local.dtype != hidden.dtype:  # autocast: the matmul runs in the activations' dtype, as F.linear would
        w_local = w_local.to(hidden.dtype)
    need_grad = torch.is_grad_enabled() and (hidden.requires_grad or w_local.requires_grad)  # not under eval's no_grad
    return _ChunkedLinearCrossEntropy.apply(
        hidden.flatten(0, 1), w_local, labels.flatten(), max(1, int(chunk_tokens)), group, start, need_grad,
        column_major)


def lm_loss(backend, inputs: torch.Tensor, labels: torch.Tensor, chunk_tokens: int, positions=None,
            column_major: bool = False) -> torch.Tensor:
    """The chunked loss of a model backend (``hidden_states`` + ``lm_head_weight``); call under the step's autocast.
    ``positions``: per-document positions (data.document_masking), passed on to the backend; ``column_major``: as
    ``chunked_cross_entropy``'s."""
    hidden = backend.hidden_states(inputs) if positions is None else backend.hidden_states(inputs, positions=positions)
    return chunked_cross_entropy(hidden, backend.lm_head_weight(), labels, chunk_tokens, column_major)


def column_major_lm_head(lm_head: torch.nn.Module | None, enable: bool) -> bool:
    """The full loss's lm_head multiplies by a column-major copy of its weight where a 16-bit GEMM with a row-major
    (V x D) right operand is slow (``enable``: ``PrecisionPlan.lm_head_column_major``, the device spec's
    ``slow_16bit_nn_gemm`` in a 16-bit run: ATen's own bf16 GEMM on a CPU without AVX-512).
    The backward's input gradient is ``grad @ weight``, a reduction over the ~152k vocabulary rows: 5.1 s for 64
    tokens against 0.19 s with the copy (RESULTS.md row 23). The copy is differentiable (the gradient reaches the
    weight, tied or not) and made at each call from the weight as FSDP2 gathered it; a vocabulary-parallel DTensor
    weight (tensor parallel) is left to torch. ``lm_head`` None: a backend without one (nothing to do). True when the
    forward was replaced."""
    if not enable or lm_head is None:
        return False

    def forward(x: torch.Tensor) -> torch.Tensor:
        weight = lm_head.weight
        if isinstance(weight, DTensor):
            return F.linear(x, weight, lm_head.bias)
        return F.linear(x, weight.t().contiguous().t(), lm_head.bias)

    lm_head.forward = forward
    return True

