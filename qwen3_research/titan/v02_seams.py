"""The seams of the torchtitan 0.2.x model (``v02.build_model`` installs them): what 0.3.x has and upstream 0.2.2
(AWS's torchtitan-neuron base) lacks, given to 0.2.2's own modules without changing their state.

Each seam swaps the class of a built module for a subclass whose forward mirrors 0.2.2's line for line except where
its docstring says; no parameter, buffer or child is added (the RoPE module of ``rope_module_class`` holds a weak
reference only), so state dicts, checkpoints, FSDP units and TP plans are 0.2.2's. ``MIRRORED`` names the torchtitan
function each mirrors or wraps; tests/test_tt022.py pins their source by hash, so a fork update that changes one
fails there, loudly. Part of the 0.2.x API module (``v02.py``): dropping 0.2.x deletes both. Every torchtitan import
is inside a function (torchtitan reads the device type at import).
"""

from __future__ import annotations

import functools
from types import SimpleNamespace


@functools.lru_cache(maxsize=None)
def rope_module_class():
    import weakref

    import torch.nn as nn
    from torchtitan.models.qwen3.model.model import apply_rotary_emb, reshape_for_broadcast

    class CosSinRoPE(nn.Module):
        """0.2.x's RoPE as a module with 0.3.x's CosSinRoPE interface (the kernels' target type)."""

        def __init__(self, head_dim: int, model):
            super().__init__()
            self.config = SimpleNamespace(dim=head_dim)
            # The model's rope_cache buffer, read at each call (it is replaced when the weights are
            # materialized); a weak reference, so the model is not registered as a child of its own module.
            object.__setattr__(self, "_model", weakref.ref(model))

        @property
        def cache(self):
            return self._model().rope_cache

        def _reshape_cache(self, query, positions=None):
            return reshape_for_broadcast(self.cache, query, positions)  # [1|B, L, 1, 2 × head_dim]

        def forward(self, query, key, positions=None):
            return apply_rotary_emb(query, key, self.cache, positions)

    return CosSinRoPE


MIRRORED = {
    # (torchtitan module, qualified name): what mirrors it here
    ("torchtitan.models.qwen3.model.model", "Qwen3Model.forward"): "model_forward",
    ("torchtitan.models.qwen3.model.model", "Attention.forward"): "attention_forward",
    ("torchtitan.models.moe.moe", "TokenChoiceTopKRouter.forward"): "router_forward",
    ("torchtitan.models.moe.moe", "TokenReorderer.forward"): "reorderer_forward",
    ("torchtitan.models.moe.kernels", "generate_permute_indices"): "permute_indices_on_cpu",
    ("torchtitan.models.moe.utils", "_permute"): "permute_on_cpu",  # reads generate_permute_indices from its module
}


def install(model) -> None:
    """The 0.2.x model with what 0.3.x gives and 0.2.2 lacks (idempotent):

    - the model: ``_skip_lm_head`` (hidden states after the final norm, for training.loss=chunked), ``lm_head``
      (its ``output`` module), ``get_attention_masks(positions=)`` (a block-causal BlockMask);
    - every attention: a mask (boolean SDPA mask or BlockMask: data.document_masking, model.attention=flex) and
      tensor parallel on CPU (attention per head on the local shards);
    - every MoE router and reorderer: expert counts by ``scatter_add`` (0.2.2's ``torch.histc`` has no CPU kernel
      for integer ids), the same int64 counts on every device; CPU token permutation (``permute_indices_on_cpu``).
    """
    from torchtitan.models.moe.moe import TokenChoiceTopKRouter, TokenReorderer
    from torchtitan.models.qwen3.model.model import Attention

    if getattr(type(model), "forward", None) is not model_forward:
        model.__class__ = _seam_model_class(type(model))
    moe = False
    for module in model.modules():
        if isinstance(module, Attention) and getattr(type(module), "forward", None) is not attention_forward:
            module.__class__ = attention_class(type(module))
        elif isinstance(module, TokenChoiceTopKRouter) and type(module).forward is not router_forward:
            module.__class__ = _seam_class(type(module), router_forward)
            moe = True
        elif isinstance(module, TokenReorderer) and type(module).forward is not reorderer_forward:
            module.__class__ = _seam_class(type(module), reorderer_forward)
    if moe:
        permute_on_cpu()


@functools.lru_cache(maxsize=None)
def _seam_class(base, forward):
    return type(base.__name__, (base,), {"forward": forward, "__module__": __name__})


@functools.lru_cache(maxsize=None)
def _seam_model_class(base):
    return type(base.__name__, (base,), {
        "forward": model_forward, "get_attention_masks": _block_causal_masks, "_skip_lm_head": False,
        "lm_head": property(lambda self: self.output, doc="0.3.x's name of the output projection"),
        "__module__": __name__,
    })


def model_forward(self, tokens, attention_masks=None, positions=None):
    """0.2.2's ``Qwen3Model.forward`` (torchtitan/models/qwen3/model/model.py at v0.2.2), returning the hidden
    states after the final norm when ``_skip_lm_head`` is set (0.3.x's switch, models/common/decoder.py)."""
    h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
    for layer in self.layers.values():
        h = layer(h, self.rope_cache, attention_masks, positions)
    h = self.norm(h) if self.norm is not None else h
    if self._skip_lm_head:
        return h
    return self.output(h) if self.output is not None else h


def _block_causal_masks(self, positions):
    """The block-causal BlockMask of packed documents whose ``positions`` (B, L) restart at 0 at each
    document (all of 0..L-1: causal), as 0.3.x's ``Decoder.get_attention_masks(positions=)`` builds it; 0.2.2's
    own takes the tokens and an EOS id instead."""
    import torch
    from torch.nn.attention.flex_attention import create_block_mask

    doc = torch.cumsum(positions == 0, dim=1)

    def mask_mod(b, h, q, kv):
        return (q >= kv) & (doc[b, q] == doc[b, kv])

    B, L = positions.shape
    return create_block_mask(mask_mod, B, None, L, L, device=positions.device)


@functools.lru_cache(maxsize=None)
def attention_class(base):
    return _seam_class(base, attention_forward)


def attention_forward(self, x, rope_cache, attention_masks, positions=None):
    """0.2.2's ``Attention.forward`` (torchtitan/models/qwen3/model/model.py at v0.2.2) for the SDPA modules
    this adapter always builds (``qwen3_model_config``: attn_type="sdpa"), with two changes: RoPE through the
    ``rope`` child when a RoPE kernel added one (``prepare_kernel_targets``), and the attention itself through
    ``_attend`` (0.2.2's SDPA asserts ``attention_masks is None``). AWS's Qwen3 changes for Trainium leave this
    file alone (docs/torchtitan/qwen3/TorchTitan.diff in parmoham-aws/test-repo-parmoham touches only the SAC
    save list and the peak-FLOPs table)."""
    from torchtitan.models.qwen3.model.model import apply_rotary_emb

    bs, seqlen, _ = x.shape
    xq, xk, xv = self.wq(x), self.wk(x), self.wv(x)
    # -1: TP may have sharded the heads
    xq = xq.view(bs, seqlen, -1, self.head_dim)
    xk = xk.view(bs, seqlen, -1, self.head_dim)
    xv = xv.view(bs, seqlen, -1, self.head_dim)
    if self.q_norm:
        xq = self.q_norm(xq)
    if self.k_norm:
        xk = self.k_norm(xk)
    rope = self._modules.get("rope")
    if rope is not None:
        xq, xk = rope(xq, xk, positions)  # the model's rope_cache, as torchtitan passes it
    else:
        xq, xk = apply_rotary_emb(xq, xk, rope_cache, positions)
    xq, xk, xv = xq.transpose(1, 2), xk.transpose(1, 2), xv.transpose(1, 2)
    if self.attn_type != "sdpa":
        raise RuntimeError(f"the 0.2.x attention seam supports attn_type='sdpa' only (got {self.attn_type})")
    output = _attend(self, xq, xk, xv, attention_masks)
    output = output.transpose(1, 2).contiguous().view(bs, seqlen, -1)
    return self.wo(output)


def _attend(self, q, k, v, masks):
    """Attention of (B, heads, L, head_dim) q/k/v: causal SDPA (0.2.2's own module) without a mask; SDPA with a
    boolean (B, 1, L, L) mask (data.document_masking); FlexAttention with a BlockMask (model.attention=flex).
    Under tensor parallel q/k/v are DTensors sharded on the heads: attention is per head, so it runs on the local
    shards (DTensor has no sharding rule for the CPU flash-attention op 0.2.2's SDPA reaches) and the result
    is the same sharded DTensor again."""
    import torch.nn.functional as F
    from torch.distributed.tensor import DTensor
    from torch.nn.attention.flex_attention import BlockMask

    dt = q if isinstance(q, DTensor) else None
    if dt is not None:
        q, k, v = (t.to_local() for t in (q, k, v))
        if isinstance(masks, DTensor):
            masks = masks.to_local()
    if masks is None:
        out = self.inner_attention(q, k, v, scale=self.scaling, enable_gqa=self.enable_gqa)
    elif isinstance(masks, BlockMask):
        out = _flex_attention(q.device.type)(q, k, v, block_mask=masks, scale=self.scaling, enable_gqa=self.enable_gqa)
    else:
        # torch's own kernel choice: flash takes no mask, efficient attention and math do (as v03._MaskedSDPA)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=masks, scale=self.scaling, enable_gqa=self.enable_gqa)
    if dt is not None:
        out = DTensor.from_local(out, dt.device_mesh, dt.placements, run_check=False)
    return out


def _flex_attention(device_type: str):
    """torchtitan's compiled FlexAttention on CUDA (0.2.2's ``FlexAttentionWrapper``); torch's eager one
    elsewhere (a CPU forward for the tests: FlexAttention has no CPU backward, and a run refuses flex off CUDA)."""
    if device_type == "cuda":
        from torchtitan.models.attention import FlexAttentionWrapper

        return FlexAttentionWrapper._compiled_flex_attn
    from torch.nn.attention.flex_attention import flex_attention

    return flex_attention


def expert_counts(ids, num_experts: int):
    """Tokens per expert (int64, [num_experts]) of the routed expert ids: a scatter-add, which has a kernel on
    every device, a static shape (one compiled graph) and exact integer counts; 0.2.2's ``torch.histc`` has no CPU
    kernel for integer ids."""
    import torch

    flat = ids.reshape(-1)
    return torch.zeros(num_experts, dtype=torch.int64, device=ids.device).scatter_add_(0, flat, torch.ones_like(flat))


def router_forward(self, x, expert_bias=None):
    """0.2.2's ``TokenChoiceTopKRouter.forward`` (torchtitan/models/moe/moe.py at v0.2.2) with the counts from
    ``expert_counts`` instead of ``torch.histc``; every other line is torchtitan's."""
    import torch
    import torch.nn.functional as F

    scores = self.gate(x)
    # By default, sigmoid or softmax is performed in float32 to avoid loss explosion
    if self.score_func == "sigmoid":
        scores = torch.sigmoid(scores.to(torch.float32))
    elif self.score_func == "softmax":
        scores = F.softmax(scores.to(torch.float32), dim=1)
    else:
        raise NotImplementedError(f"Unknown score function {self.score_func}")
    scores_for_choice = scores if expert_bias is None else scores + expert_bias
    if self.num_expert_groups is not None:
        scores_for_choice = self._get_node_limited_routing_scores(scores_for_choice)
    _, selected_experts_indices = torch.topk(scores_for_choice, k=self.top_k, dim=-1, sorted=False)
    # the expert bias only routes: the gating value comes from the original scores
    top_scores = scores.gather(dim=1, index=selected_experts_indices)
    if self._debug_force_load_balance:
        selected_experts_indices, top_scores = self._debug_force_load_balance_routing(scores)
    if self.route_norm:
        denominator = top_scores.sum(dim=-1, keepdim=True) + 1e-20
        top_scores = top_scores / denominator
    top_scores = top_scores * self.route_scale
    return top_scores, selected_experts_indices, expert_counts(selected_experts_indices, self.num_experts)


def reorderer_forward(self, top_scores, selected_experts_indices):
    """0.2.2's ``TokenReorderer.forward`` (torchtitan/models/moe/moe.py at v0.2.2) with ``expert_counts``."""
    import torch

    num_tokens_per_expert = expert_counts(selected_experts_indices, self.num_experts)
    token_indices_experts_sorted = torch.argsort(selected_experts_indices.view(-1), stable=True)
    top_scores_experts_sorted = top_scores.view(-1)[token_indices_experts_sorted]
    return top_scores_experts_sorted, token_indices_experts_sorted, num_tokens_per_expert


@functools.lru_cache(maxsize=None)
def permute_on_cpu() -> None:
    """0.2.2 pads the experts' token groups (``models/moe/utils.py`` ``_permute``, called by ``GroupedExperts`` and
    by EP's token dispatch) with ``generate_permute_indices(..., use_cpu=False)``: a Triton kernel, which cannot
    take CPU tensors. Its own CPU implementation (``use_cpu=True``, the path AWS's GPT-OSS diff takes on Neuron)
    for CPU tensors; other devices unchanged. Installed once per process on the module ``_permute`` reads."""
    from torchtitan.models.moe import utils

    utils.generate_permute_indices = functools.partial(permute_indices_on_cpu, utils.generate_permute_indices)


def permute_indices_on_cpu(tt_generate, tokens_per_expert_group, *args, use_cpu: bool = False, **kwargs):
    return tt_generate(tokens_per_expert_group, *args, use_cpu=use_cpu or tokens_per_expert_group.device.type == "cpu",
                       **kwargs)
