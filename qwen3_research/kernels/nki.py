"""Trainium kernels ``nki_rope`` and ``nki_moe``: AWS's NKI Library kernels bound as PyTorch ops.

NOT RUN ON HARDWARE (see docs/KERNELS.md): this machine has no Trainium, and the PyPI
``torch-neuronx``/``nki`` packages are placeholders. What runs here is the wrapper code below
against test doubles of the library kernels (tests/nki_contract_doubles.py).

Kernels called (AWS NKI Library, ``aws-neuron/nki-library``; bundled with ``neuronx-cc`` as the
``nkilib`` namespace, ``import nkilib`` on a Neuron host):

* ``nkilib.core.embeddings.rope_hf.rope_hf(q, k, q_out, k_out, cos, sin, rope_cache, backward)``
  (src/nkilib_src/nkilib/core/embeddings/rope_hf.py): layout [batch, heads, seq, head_dim],
  cos/sin [seq, head_dim] or [batch, seq, head_dim], rotate-half convention, ``backward=True``
  applies the transposed rotation; splits seq over the LNC programs (``nl.program_id``), hence
  ``seq_len % (128 × LNC) == 0`` (its ``_validate_apply_rope_inputs``).
* ``nkilib.core.moe.moe_cte.bwmm_shard_on_I.blockwise_mm_baseline_shard_intermediate``
  (src/nkilib_src/nkilib/core/moe/moe_cte/bwmm_shard_on_I.py; the kernel ``moe_cte`` runs for
  ``MoECTESpec(shard_on_i, ShardOnIConfig(checkpoint_activation=True))``, moe_cte.py; API:
  awsdocs-neuron .../nki/library/api/moe-cte.html), called directly with ``checkpoint_activation=True``
  and an explicit ``POST_SCALE`` (its own default is PRE_SCALE; moe_cte's is POST_SCALE): the variant
  that returns the activations the backward needs: (output [T+1, H], gate_up_activations_T
  [N, 2, I, B], down_activations [N, B, H]). Not through ``moe_cte``: torch_neuronx hashes every
  non-tensor kernel argument (``get_dconfig_and_tensor_args`` -> ``_generate_hash_key`` in
  torch_neuronx/nki_hop.py; ``_return_shape_dtype_or_hashable`` raises ``err_nki_param_not_hashable``
  for an unhashable one, torch_neuronx/nki_kernel.py, parmoham-aws/test-repo-parmoham), and
  ``MoECTESpec``/``ShardOnIConfig`` are plain (non-frozen) dataclasses, whose ``__hash__`` is None.
  Every constant passed here is an int, bool, enum member, None, or the kernels' dtype value.
* ``nkilib.experimental.moe.bwd.blockwise_mm_backward.blockwise_mm_bwd``
  (src/nkilib_src/nkilib/experimental/moe/bwd/blockwise_mm_backward.py, API: .../nki/library/api/
  blockwise-mm-backward.html): (hidden_states_grad, expert_affinities_masked_grad,
  gate_up_proj_weight_grad [E, H, 2, I], down_proj_weight_grad [E, I, H]).

Glue: torch_neuronx's ``nki_op`` (a ``torch.library.custom_op`` whose fake kernel is the op's
own body, so the body must never read tensor values) and ``wrap_nki(kernel)[grid](**kwargs)``
(the launch as one graph node; ``grid`` is a tuple): torch_neuronx/nki_hop.py in the public
TorchNeuron copy ``parmoham-aws/test-repo-parmoham`` and the docs' torch/guides/how-to-work-with-nki.
Both kernels launch on the LNC grid ``(lnc,)``, as the library's own tests do
(``nki.cpu_simulate(kernel)[lnc_count](...)``, nki-library test/utils/simulation_setup.py).

How our MoE maps onto the blockwise contract. torchtitan's ``GroupedExperts`` gets R expert-sorted
routed rows (R = tokens × top_k, static without expert parallelism) and per-expert counts. Each
routed row is one "token" of the kernels (so top_k = 1 for them): ``hidden_states`` is the rows
plus one zero padding row (index R), ``expert_affinities_masked`` is the one-hot [row, expert]
mask (1.0), scaled after the down projection (POST_SCALE, exact), ``token_position_to_id`` maps
each of the N×B block slots to a row (padding slots -> R) and ``block_to_expert`` [N, 1] gives each
block's expert; blocks past the used ones belong to the last expert and hold only padding, as in
AWS's own input generator (test/integration/nkilib/experimental/moe/test_bwmm_bwd_common.py,
``generate_token_position_to_id_and_experts``). N is fixed by the config, the worst case of any
routing (AWS's ``get_n_blocks``): N = floor((R + min(E, R)·(B-1)) / B), so no routing overflows
(dropless: no row is ever dropped) and one compiled graph serves every step. The map is built on
the device from the counts with static-shape ops (cumsum, searchsorted, scatter): no host sync,
no value read, so the op traces under FakeTensorMode / torch.compile.

Start-up checks (``_moe_check``/``_rope_check``, run by the registry) come from the kernels'
asserts and API pages; each is a one-line ConfigError naming the constraint.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Callable

import torch

from qwen3_research import models, titan
from qwen3_research.kernels.moe import install_experts, verify_moe
from qwen3_research.kernels.registry import KernelSpec, Requirements, register
from qwen3_research.kernels.rope import install_rope, verify_rope

NS = "qwen3_research"
MOE_BLOCK_SIZES = (256, 512, 1024)  # moe_cte: multiple of 256 in 256..1024; blockwise_mm_bwd: 128/256/512/1024
DEFAULT_BLOCK_SIZE = 256  # smallest both take: least padding (worst case (E-1)·(B-1) padded slots)
MOE_DTYPES = (torch.bfloat16, torch.float16)  # "Supported Data Types: Input: bfloat16, float16" (both API pages)
# "Total tokens T: Up to 32K tokens per call" (blockwise_mm_baseline_shard_intermediate's docstring,
# "Intended Usage"; the moe-cte API page). The kernel's token dimension is hidden_states' T+1 rows
# (our R routed rows + the padding row), so a call takes R <= 32,767; more rows are split into calls.
MAX_ROWS_PER_CALL = 32 * 1024
MOE_OPTIONS = {"block_size": DEFAULT_BLOCK_SIZE, "tokens_per_call": MAX_ROWS_PER_CALL}  # nki_moe's options


def row_chunks(rows: int, limit: int = MAX_ROWS_PER_CALL) -> list[int]:
    """Sizes of the calls ``rows`` routed rows are split into: each with ``size + 1 <= limit`` kernel
    tokens; full calls first, then the rest. Not balanced on purpose: every call adds its own worst-case
    padding, up to min(E, rows)·(B-1) slots, so a small last call costs least (32,768 rows, E=128, B=256:
    [32767, 1] -> 255 + 1 blocks; [16384, 16384] would be 191 + 191)."""
    full, rest = divmod(rows, limit - 1)
    return [limit - 1] * full + ([rest] if rest or not full else [])


def chunk_counts(counts: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """Per-expert counts of the expert-sorted rows [start, stop): static-shape ops, no value read."""
    end = torch.cumsum(counts.to(torch.int64), 0)
    begin = end - counts.to(torch.int64)
    return (end.clamp(start, stop) - begin.clamp(start, stop)).to(counts.dtype)


# ---------------------------------------------------------------------------- static block plan
def capacity_blocks(rows: int, experts: int, block_size: int) -> int:
    """Blocks N that hold any routing of ``rows`` rows over ``experts`` experts, each expert's rows
    padded to whole blocks: max Σ ceil(c_e/B) = floor((R + m(B-1))/B), m = min(E, R) non-empty experts
    (AWS's get_n_blocks, ceil((T·K - (E-1))/B) + E - 1, for R >= E - 1)."""
    return max(1, (rows + min(experts, rows) * (block_size - 1)) // block_size)


def block_plan(counts: torch.Tensor, rows: int, experts: int, block_size: int, n_blocks: int, dtype: torch.dtype,
               device=None):
    """(token_position_to_id int32 [N·B], block_to_expert int32 [N, 1], expert_affinities_masked [(R+1)·E, 1]).

    Static shapes, device-side, no tensor value is read (works on fake tensors). ``counts`` (E,) are the
    per-expert row counts of the expert-sorted rows (sum = R).
    """
    dev = counts.device if device is None else device
    B, E, R, N = block_size, experts, rows, n_blocks
    cnt = counts.to(device=dev, dtype=torch.int64)
    blocks = (cnt + (B - 1)) // B  # blocks per expert
    blk_end = torch.cumsum(blocks, 0)
    blk_start = blk_end - blocks
    row_end = torch.cumsum(cnt, 0)
    row_start = row_end - cnt
    r = torch.arange(R, device=dev, dtype=torch.int64)
    e_of_row = torch.searchsorted(row_end, r, right=True).clamp_(max=E - 1)  # expert of each sorted row
    slot = blk_start[e_of_row] * B + (r - row_start[e_of_row])  # its block slot
    tpi = torch.full((N * B,), R, device=dev, dtype=torch.int32)  # padding slots -> the zero row R
    tpi = tpi.scatter(0, slot, r.to(torch.int32))
    n = torch.arange(N, device=dev, dtype=torch.int64)
    b2e = torch.searchsorted(blk_end, n, right=True).clamp_(max=E - 1)  # unused blocks -> last expert
    aff = torch.zeros((R + 1) * E, device=dev, dtype=dtype)
    aff = aff.scatter(0, r * E + e_of_row, torch.ones(R, device=dev, dtype=dtype))
    return tpi, b2e.to(torch.int32).view(N, 1), aff.view(-1, 1)


def gate_up_layout(w1: torch.Tensor, w3: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """torchtitan w1/w3 [E, I, H] -> the kernels' gate_up_proj_weight [E, H, 2, I] (gate = 0, up = 1).

    One pass that also does the cast to the kernel dtype, i.e. the same copy torchtitan's own
    GroupedExperts makes each call (``w1_EFD.bfloat16()``); a layout stored in kernel order would
    change the parameters' shapes and checkpoint keys."""
    E, I, H = w1.shape
    out = torch.empty(E, H, 2, I, device=w1.device, dtype=dtype)
    out[:, :, 0, :].copy_(w1.transpose(1, 2))
    out[:, :, 1, :].copy_(w3.transpose(1, 2))
    return out


def down_layout(w2: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """torchtitan w2 [E, H, I] -> down_proj_weight [E, I, H], in the kernel dtype (one copy, as above)."""
    E, H, I = w2.shape
    out = torch.empty(E, I, H, device=w2.device, dtype=dtype)
    out.copy_(w2.transpose(1, 2))
    return out


def _with_pad_row(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[R, H] -> [R+1, H] with a zero last row: the padding token T of the kernels' contract."""
    out = t.new_zeros(t.shape[0] + 1, t.shape[1], dtype=dtype)
    out[: t.shape[0]].copy_(t)
    return out


def _rope_table(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """CosSinRoPE's cos/sin [1|B, L, 1, H] -> rope_hf's [L, H] (shared) or [B, L, H], in q's dtype."""
    if t.dim() == 4:
        t = t.squeeze(2)
    if t.dim() == 3 and t.shape[0] == 1:
        t = t[0]
    return t.to(dtype).contiguous()


# ---------------------------------------------------------------------------- backend
@dataclass
class Backend:
    """What the wrappers call: torch_neuronx's glue and the NKI Library kernels with their enums."""

    nki_op: Callable
    wrap_nki: Callable
    rope_hf: Any
    moe_fwd: Any  # blockwise_mm_baseline_shard_intermediate (what moe_cte runs for shard_on_i)
    blockwise_mm_bwd: Any
    fwd_kwargs: dict  # its constant arguments: activation, POST_SCALE, checkpoint_activation=True, ...
    bwd_kwargs: dict  # shard/affinity/kernel-type/activation enums for blockwise_mm_bwd
    nl_dtype: Callable[[torch.dtype], Any]  # torch dtype -> the kernels' compute_dtype value


def neuron_backend() -> Backend:
    """The real one: imports torch_neuronx and nkilib (Neuron hosts only; called on install)."""
    # deferred: optional platform packages (nki, nkilib, torch_neuronx exist on Neuron hosts only)
    import nki.language as nl
    from nkilib.core.embeddings.rope_hf import rope_hf
    from nkilib.core.moe.moe_cte.bwmm_shard_on_I import blockwise_mm_baseline_shard_intermediate
    from nkilib.core.utils.common_types import ActFnType as FwdActFnType
    from nkilib.core.utils.common_types import ExpertAffinityScaleMode
    from nkilib.experimental.moe.bwd.blockwise_mm_backward import blockwise_mm_bwd
    from nkilib.experimental.moe.bwd.moe_bwd_parameters import (
        ActFnType,
        AffinityOption,
        KernelTypeOption,
        ShardOption,
    )
    from torch_neuronx import nki_op, wrap_nki

    dtypes = {torch.bfloat16: nl.bfloat16, torch.float16: nl.float16, torch.float32: nl.float32}
    return Backend(
        nki_op=nki_op, wrap_nki=wrap_nki, rope_hf=rope_hf, moe_fwd=blockwise_mm_baseline_shard_intermediate,
        blockwise_mm_bwd=blockwise_mm_bwd,
        fwd_kwargs=shard_on_i_constants(FwdActFnType, ExpertAffinityScaleMode),
        bwd_kwargs=dict(shard_option=ShardOption.SHARD_ON_HIDDEN, affinity_option=AffinityOption.AFFINITY_ON_H,
                        kernel_type_option=KernelTypeOption.DROPLESS, activation_type=ActFnType.SiLU),
        nl_dtype=dtypes.__getitem__,
    )


def shard_on_i_constants(act_fn_type, scale_mode) -> dict:
    """The shard-on-I forward's constant arguments: what ``moe_cte`` passes for
    ``MoECTESpec(shard_on_i, ShardOnIConfig(checkpoint_activation=True))`` (moe_cte.py), with moe_cte's
    POST_SCALE default made explicit (the function's own default is PRE_SCALE). Clamps, biases, scales
    and ``skip_dma`` keep the function's defaults (None / its one default ``SkipMode()`` instance)."""
    return dict(activation_function=act_fn_type.SiLU, expert_affinities_scaling_mode=scale_mode.POST_SCALE,
                checkpoint_activation=True, expert_affinity_multiply_on_I=False)


def shape_backend() -> Backend:
    """The kernels' documented output shapes and nothing else, for planning memory (qwen3_research.plan)
    on a host without Neuron: each kernel returns uninitialised tensors of the shapes and dtypes its
    docstring states (rope_hf: q_out, k_out; shard-on-I with checkpoint_activation: [T+1, H],
    [N, 2, I_TP, B], [N, B, H]; blockwise_mm_bwd: [T, H], [T·E, 1], [E, H, 2, I_TP], [E, I_TP, H]).
    Never used to compute: the plan traces on fake tensors, where only shapes exist."""

    def op(name, fn=None, mutates_args=()):
        opdef = torch.library.custom_op(name, fn, mutates_args=mutates_args)
        opdef.register_fake(fn)
        return opdef

    class Launch:
        def __init__(self, fn):
            self.fn = fn

        def __getitem__(self, grid):
            return self.fn

    def rope_hf(q, k, q_out, k_out, cos=None, sin=None, rope_cache=None, backward=False):
        return q_out, k_out

    def moe_fwd(hidden_states, expert_affinities_masked, gate_up_proj_weight, down_proj_weight, block_size,
                token_position_to_id, block_to_expert, **_):
        N, (E, H, _two, I) = token_position_to_id.shape[0] // block_size, gate_up_proj_weight.shape
        return (torch.empty_like(hidden_states), gate_up_proj_weight.new_empty(N, 2, I, block_size),
                down_proj_weight.new_empty(N, block_size, H))

    def bwd(hidden_states, expert_affinities_masked, gate_up_proj_weight, down_proj_weight, *_, **__):
        return (torch.empty_like(hidden_states), torch.empty_like(expert_affinities_masked),
                torch.empty_like(gate_up_proj_weight), torch.empty_like(down_proj_weight))

    return Backend(nki_op=op, wrap_nki=Launch, rope_hf=rope_hf, moe_fwd=moe_fwd, blockwise_mm_bwd=bwd,
                   fwd_kwargs={}, bwd_kwargs={}, nl_dtype=lambda dt: dt)


# ---------------------------------------------------------------------------- ops
def build_ops(backend: Backend, prefix: str = "nki") -> SimpleNamespace:
    """Register the ``{prefix}_rope``, ``{prefix}_moe_fwd``, ``{prefix}_moe_bwd`` ops over ``backend``.

    The wrappers only change layouts, pad (one zero row), build the block map and cast to the
    kernel dtype; all the arithmetic is the library's.
    """
    be = backend
    rope_k, moe_k, bwd_k = be.wrap_nki(be.rope_hf), be.wrap_nki(be.moe_fwd), be.wrap_nki(be.blockwise_mm_bwd)

    # -- RoPE: q/k [B, L, heads, D] (torchtitan) <-> [B, heads, L, D] (rope_hf) --
    def rope_impl(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool,
                  lnc: int) -> tuple[torch.Tensor, torch.Tensor]:
        qh, kh = q.transpose(1, 2).contiguous(), k.transpose(1, 2).contiguous()
        q_out, k_out = rope_k[(lnc,)](
            q=qh, k=kh, q_out=torch.empty_like(qh), k_out=torch.empty_like(kh),
            cos=_rope_table(cos, q.dtype), sin=_rope_table(sin, q.dtype), backward=backward,
        )
        return q_out.transpose(1, 2), k_out.transpose(1, 2)

    rope_op = be.nki_op(f"{NS}::{prefix}_rope", rope_impl, mutates_args=())

    def rope_setup(ctx, inputs, output):
        q, k, cos, sin, backward, lnc = inputs
        ctx.save_for_backward(cos, sin)
        ctx.backward, ctx.lnc = backward, lnc
        ctx.meta = [(t.shape, t.dtype, t.device) for t in (q, k)]

    def rope_bwd(ctx, gq, gk):
        cos, sin = ctx.saved_tensors
        gq, gk = (torch.zeros(s, dtype=d, device=v) if g is None else g for g, (s, d, v) in zip((gq, gk), ctx.meta))
        dq, dk = rope_op(gq, gk, cos, sin, not ctx.backward, ctx.lnc)  # the transpose of a rotation
        return dq, dk, None, None, None, None

    rope_op.register_autograd(rope_bwd, setup_context=rope_setup)

    # -- MoE: expert-sorted rows x [R, H], w1/w3 [E, I, H], w2 [E, H, I], counts [E] --
    def moe_fwd_impl(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor, counts: torch.Tensor,
                     block_size: int, lnc: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        R, E = x.shape[0], w1.shape[0]
        N = capacity_blocks(R, E, block_size)
        tpi, b2e, aff = block_plan(counts, R, E, block_size, N, dtype, device=x.device)
        out, gate_up_T, down_act = moe_k[(lnc,)](
            hidden_states=_with_pad_row(x, dtype), expert_affinities_masked=aff,
            gate_up_proj_weight=gate_up_layout(w1, w3, dtype), down_proj_weight=down_layout(w2, dtype),
            token_position_to_id=tpi, block_to_expert=b2e, block_size=block_size,
            compute_dtype=be.nl_dtype(dtype), is_tensor_update_accumulating=False,  # one expert per row
            **be.fwd_kwargs,
        )
        return out[:R], gate_up_T, down_act

    def moe_bwd_impl(gy: torch.Tensor, x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor,
                     counts: torch.Tensor, gate_up_T: torch.Tensor, down_act: torch.Tensor, block_size: int, lnc: int,
                     dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        R, E = x.shape[0], w1.shape[0]
        N = capacity_blocks(R, E, block_size)
        tpi, b2e, aff = block_plan(counts, R, E, block_size, N, dtype, device=x.device)
        dh, _daff, dgu, ddown = bwd_k[(lnc,)](
            hidden_states=_with_pad_row(x, dtype), expert_affinities_masked=aff,
            gate_up_proj_weight=gate_up_layout(w1, w3, dtype), down_proj_weight=down_layout(w2, dtype),
            gate_up_proj_act_checkpoint_T=gate_up_T, down_proj_act_checkpoint=down_act,
            token_position_to_id=tpi, block_to_expert=b2e, output_hidden_states_grad=_with_pad_row(gy, dtype),
            block_size=block_size, compute_dtype=be.nl_dtype(dtype), is_tensor_update_accumulating=False,
            bias=False, **be.bwd_kwargs,
        )
        return (dh[:R].to(x.dtype), dgu[:, :, 0, :].transpose(1, 2).to(w1.dtype).contiguous(),
                ddown.transpose(1, 2).to(w2.dtype).contiguous(),
                dgu[:, :, 1, :].transpose(1, 2).to(w3.dtype).contiguous())

    moe_fwd_op = be.nki_op(f"{NS}::{prefix}_moe_fwd", moe_fwd_impl, mutates_args=())
    moe_bwd_op = be.nki_op(f"{NS}::{prefix}_moe_bwd", moe_bwd_impl, mutates_args=())

    def moe_setup(ctx, inputs, output):
        x, w1, w2, w3, counts, block_size, lnc, dtype = inputs
        _, gate_up_T, down_act = output
        ctx.save_for_backward(x, w1, w2, w3, counts, gate_up_T, down_act)
        ctx.args = (block_size, lnc, dtype)
        ctx.mark_non_differentiable(gate_up_T, down_act)

    def moe_backward(ctx, gy, _g1, _g2):
        x, w1, w2, w3, counts, gate_up_T, down_act = ctx.saved_tensors
        dx, dw1, dw2, dw3 = moe_bwd_op(gy.contiguous(), x, w1, w2, w3, counts, gate_up_T, down_act, *ctx.args)
        return dx, dw1, dw2, dw3, None, None, None, None

    moe_fwd_op.register_autograd(moe_backward, setup_context=moe_setup)

    def moe(x, w1, w2, w3, counts, block_size: int = DEFAULT_BLOCK_SIZE, *, lnc: int = 2,
            dtype: torch.dtype = torch.bfloat16, tokens_per_call: int = MAX_ROWS_PER_CALL):
        """Differentiable SwiGLU experts y [R, H] (in ``dtype``) from expert-sorted rows x [R, H].

        More than ``tokens_per_call`` - 1 rows: one kernel call per chunk of rows (``row_chunks``), each
        with its own counts (``chunk_counts``) and capacity; autograd sums the weight gradients."""
        x = x.contiguous()
        sizes = row_chunks(x.shape[0], int(tokens_per_call))
        if len(sizes) == 1:
            return moe_fwd_op(x, w1, w2, w3, counts, int(block_size), int(lnc), dtype)[0]
        outs, start = [], 0
        for size in sizes:
            c = chunk_counts(counts, start, start + size)
            outs.append(moe_fwd_op(x[start:start + size], w1, w2, w3, c, int(block_size), int(lnc), dtype)[0])
            start += size
        return torch.cat(outs)

    def rope(q, k, cos, sin, *, lnc: int = 2):
        return rope_op(q, k, cos, sin, False, int(lnc))

    return SimpleNamespace(rope=rope, moe=moe, rope_op=rope_op, moe_fwd_op=moe_fwd_op, moe_bwd_op=moe_bwd_op,
                           rope_impl=rope_impl, moe_fwd_impl=moe_fwd_impl, moe_bwd_impl=moe_bwd_impl)


@functools.lru_cache(maxsize=None)
def _ops(planning: bool = False) -> SimpleNamespace:
    """The ops over the real kernels; with ``planning``, over their output shapes (``shape_backend``)."""
    if planning:
        return build_ops(shape_backend(), prefix="nki_plan")
    return build_ops(neuron_backend())


@functools.lru_cache(maxsize=None)
def _moe_apply(lnc: int, planning: bool = False):
    return functools.partial(_ops(planning).moe, lnc=lnc, dtype=torch.bfloat16)


@functools.lru_cache(maxsize=None)
def _rope_apply(lnc: int, planning: bool = False):
    return functools.partial(_ops(planning).rope, lnc=lnc)


def _lnc(device) -> int:
    return int(getattr(device, "lnc", None) or 2)


def _planning(device) -> bool:
    return bool(getattr(device, "planning", False))


# ---------------------------------------------------------------------------- registry glue
def padded_slots(module, x, counts) -> int:
    """Block slots the kernel computes beyond the R routed rows: every call computes its N static capacity
    blocks of B slots (``capacity_blocks``; padding slots read the zero row), so sum N·B - R over the calls."""
    opts = {**MOE_OPTIONS, **getattr(module, "_kernel_options", {})}
    B, E, R = int(opts["block_size"]), int(counts.shape[0]), int(x.shape[0])
    return sum(capacity_blocks(r, E, B) * B for r in row_chunks(R, int(opts["tokens_per_call"]))) - R


def _install_moe(module, options, device=None):
    op = _moe_apply(_lnc(device), _planning(device))
    install_experts("nki_moe", op, MOE_OPTIONS, padded_rows=padded_slots)(module, options)


def _install_rope(module, options, device=None):
    install_rope("nki_rope", _rope_apply(_lnc(device), _planning(device)), pair=True)(module, options)


def _verify_moe(module, shapes, device, options):
    return verify_moe(module, shapes, device, {k: v for k, v in options.items() if k != "dtype"},
                      op=_moe_apply(_lnc(device)), default_options=MOE_OPTIONS,
                      compute_dtype=torch.bfloat16)


def _verify_rope(module, shapes, device, options):
    pair = _rope_apply(_lnc(device))
    return verify_rope(module, shapes, device, lambda x, c, s: pair(x, x, c, s)[0])


def _local_expert_shape(module, tp: int) -> tuple[int, int, int]:
    """(E, I_TP, H) one rank's kernel sees: the registry runs before sharding, and torchtitan's TP plan
    shards the experts' hidden width I (w1/w3 dim 1)."""
    w1 = titan.expert_weights(module)[0]
    if hasattr(w1, "to_local"):
        return tuple(w1.to_local().shape)
    E, I, H = w1.shape
    return E, I // max(tp, 1), H


def moe_cost(module, options, cfg, device, layers: int = 1) -> dict:
    """What nki_moe costs per micro-batch on one rank, from the run's shapes (no tensor needed).

    rows R = batch × seq_len × top_k (each routed row is one kernel token), split into ``row_chunks``
    calls; each call has the static capacity N blocks of B slots, all computed (shard_on_i runs every
    block, padding included: bwmm_shard_on_I.py "Processes all blocks sequentially without
    distinguishing padded vs non-padded blocks"); the forward keeps gate_up_activations_T [N, 2, I_TP, B]
    and down_activations [N, B, H] (bf16) for the backward, per MoE layer."""
    E, I, H = _local_expert_shape(module, cfg.parallelism.tp)
    B = int(options.get("block_size", DEFAULT_BLOCK_SIZE))
    top_k = _top_k(cfg)
    R = cfg.data.batch_size * cfg.data.seq_len * top_k
    limit = int(options.get("tokens_per_call", MAX_ROWS_PER_CALL))
    calls = row_chunks(R, limit)
    blocks = sum(capacity_blocks(r, E, B) for r in calls)
    saved = blocks * (2 * I * B + B * H) * 2  # bf16
    # Without activation checkpointing every MoE layer keeps its checkpoints until its backward; with it
    # (full, or torchtitan's op-level selective, whose save list has no custom op) the layer's forward is
    # recomputed in backward, one layer at a time.
    held = layers if cfg.parallelism.activation_checkpoint == "none" else 1
    return {"rows": R, "calls": len(calls), "tokens_per_call": limit, "blocks": blocks, "slots": blocks * B,
            "padding_factor": blocks * B / R, "saved_bytes_per_layer": saved, "saved_bytes": saved * held,
            "layers": layers, "held_layers": held, "block_size": B, "top_k": top_k}


def _top_k(cfg) -> int:
    """Routed rows per token: the native flavor's (or init_from architecture's) top-k."""
    return max(1, models.architecture(cfg.model).top_k)


def _describe_moe(module, options, cfg, device, layers: int) -> tuple[list[str], int]:
    c = moe_cost(module, options, cfg, device, layers)
    gib = 1024**3
    most = c["tokens_per_call"] - 1  # + the padding row = the kernel's tokens per call
    split = (f"split into {c['calls']} kernel calls of <= {most:,} rows (options.tokens_per_call="
             f"{c['tokens_per_call']:,}: 'up to 32K tokens per call')" if c["calls"] > 1
             else f"1 kernel call (<= {most:,} rows)")
    return [
        f"cost per micro-batch: {c['rows']:,} routed rows (batch × seq_len × top-{c['top_k']}), {split}; "
        f"{c['blocks']} blocks × {c['block_size']} = {c['slots']:,} slots computed (padding included: "
        f"{c['padding_factor']:.1f}× the rows)",
        f"saved for backward: {c['saved_bytes_per_layer'] / gib:.3f} GiB per MoE layer (gate_up_activations_T + "
        f"down_activations, bf16) × {c['held_layers']} held at once (of {c['layers']}; "
        f"parallelism.activation_checkpoint={cfg.parallelism.activation_checkpoint}) = {c['saved_bytes'] / gib:.2f} GiB",
    ], c["saved_bytes"]


def _moe_check(module, options, cfg, device, where):
    """The NKI Library MoE kernels' constraints for this module (local shapes) and run."""
    lnc = _lnc(device)
    E, I, H = _local_expert_shape(module, cfg.parallelism.tp)
    B = options.get("block_size", DEFAULT_BLOCK_SIZE)
    errors, warns = [], []
    if options.get("dtype", "bfloat16") not in ("input", "bfloat16"):
        errors.append(f"{where}: options.dtype={options['dtype']!r}; the NKI Library MoE kernels compute in bfloat16 "
                      "here (drop options.dtype)")
    limit = options.get("tokens_per_call", MAX_ROWS_PER_CALL)
    if not isinstance(limit, int) or not 2 <= limit <= MAX_ROWS_PER_CALL:
        errors.append(f"{where}: options.tokens_per_call={limit!r} must be an integer in 2..{MAX_ROWS_PER_CALL} "
                      "(rows + the padding row per kernel call; the shard-on-I kernel takes 'up to 32K tokens per call')")
    if B not in MOE_BLOCK_SIZES:
        errors.append(f"{where}: options.block_size={B} is not taken by both NKI Library MoE kernels (moe_cte: a "
                      f"multiple of 256 in 256..1024; blockwise_mm_bwd: 128, 256, 512 or 1024); use one of {list(MOE_BLOCK_SIZES)}")
    if cfg.training.mixed_precision != "bf16":
        errors.append(f"{where}: the NKI Library MoE kernels take bfloat16/float16 only (moe_cte, blockwise_mm_bwd "
                      "'Supported Data Types'); this run computes in float32: set training.mixed_precision=bf16")
    if not (512 <= H <= 8192 and H % 512 == 0):
        errors.append(f"{where}: hidden width H={H} (model.flavor={cfg.model.flavor}) is outside moe_cte's range "
                      "(512 <= H <= 8192, a multiple of 512); use a flavor with dim >= 512 (e.g. 30B-A3B) or kernels=none")
    if I % 16 or I % lnc or (I // lnc) % 32:
        errors.append(f"{where}: expert width I_TP={I} (per tensor-parallel rank, parallelism.tp={cfg.parallelism.tp}) must be a multiple of 16 (moe_cte) "
                      f"with I_TP/LNC a multiple of 32 (blockwise_mm_bwd DMA transpose); LNC={lnc}")
    if H % lnc or (H // lnc) % 32:
        errors.append(f"{where}: hidden width H={H} must give H/LNC a multiple of 32 (blockwise_mm_bwd); LNC={lnc}")
    if E != 1 and E % lnc:
        errors.append(f"{where}: {E} experts per rank do not split over LNC={lnc} cores (blockwise_mm_bwd zeroes the "
                      "weight gradients E/LNC experts per core)")
    if cfg.parallelism.ep != 1:
        errors.append(f"{where}: needs parallelism.ep=1: the block capacity is fixed from tokens × top_k, and expert "
                      "parallelism makes the routed row count vary per step")
    if not errors:  # the API page's intended-usage ranges that the kernel source does not assert
        if not 2048 <= I <= 16384:
            warns.append(f"{where}: expert width I_TP={I} is outside moe_cte's documented range 2048..16384 (not "
                         "asserted by the kernel; AWS's own tests run shard_on_i at 768 and 1536); check on hardware")
        if not 8 <= E <= 64:
            warns.append(f"{where}: {E} experts is outside moe_cte's documented range 8..64 (not asserted by the "
                         "kernel); check on hardware")
    return errors, warns


def _rope_check(module, options, cfg, device, where):
    D = module.config.dim if hasattr(module, "config") else None
    errors = []
    if D is not None and D % 2:
        errors.append(f"{where}: rope_hf rotates halves of head_dim; head_dim={D} is odd")
    return errors, []


_FIX = ("these are Trainium (NKI) kernels (device=neuron); on cpu/cuda use kernels=moe_fast / rope_fast "
        "(or triton_moe / triton_rope on cuda)")
# What the wrappers import on a Neuron host (neuron_backend), and AWS's install line (Neuron 2.33,
# setup/pytorch/update-manual; nkilib ships inside neuronx-cc since Neuron 2.27).
_MODULES = ("torch_neuronx", "nki", "nkilib")
_INSTALL = ('pip install "torch-neuronx==2.14.*" "neuronx-cc==2.*" nki --extra-index-url '
            "https://pip.repos.neuron.amazonaws.com (README 'Trainium hosts')")

register(KernelSpec(
    name="nki_moe",
    description="SwiGLU experts by the NKI Library's moe_cte (shard_on_i, activation checkpoint) forward and "
    "blockwise_mm_bwd backward on Trainium, bfloat16",
    module_types=("GroupedExperts",),
    install=_install_moe,
    # blockwise_mm_bwd: "Uses LNC2 sharding" and AWS tests it at LNC=2 only (test_bwmm_bwd.py)
    requirements=Requirements(devices=("neuron",), dtypes=("float32", "bfloat16"), lncs=(2,), fix=_FIX,
                              check=_moe_check, modules=_MODULES, install=_INSTALL,
                              # the tiny MoE flavors are below moe_cte's hidden-size floor (_moe_check)
                              verify_overrides={"neuron": ("model.flavor=nki_debug",)}),
    verify=_verify_moe,
    tolerance={"bfloat16": 2e-2},  # AWS's own test tolerance for both kernels in bf16 (rtol 2e-2)
    cost=_describe_moe,
))
register(KernelSpec(
    name="nki_rope",
    description="CosSin RoPE (rotate-half) by the NKI Library's rope_hf (q and k in one launch, backward=True "
    "for the gradient) on Trainium",
    module_types=("CosSinRoPE",),
    install=_install_rope,
    requirements=Requirements(devices=("neuron",), dtypes=("float32", "bfloat16"), seq_multiple=lambda lnc: 128 * lnc,
                              seq_multiple_text="128 × LNC", lncs=(1, 2), fix=_FIX, check=_rope_check,
                              modules=_MODULES, install=_INSTALL),
    verify=_verify_rope,
    tolerance={"float32": 1e-5, "bfloat16": 2e-2},
))
