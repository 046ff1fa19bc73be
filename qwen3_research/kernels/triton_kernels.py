"""Triton kernels: ``triton_moe`` (grouped GEMMs for SwiGLU experts) and ``triton_rope``.

They target CUDA. On CPU they run only under Triton's interpreter (``TRITON_INTERPRET=1``,
numpy underneath: slow, for tests); the registry refuses them on CPU without it. The
``@triton.jit`` functions are built on first use, because Triton decides at decoration time
whether to interpret.

* ``_gmm``: ``C[rows of e] = A[rows of e] @ B[e]`` for expert-sorted rows, over a host-built
  tile map (one M-tile never crosses experts). ``B`` is addressed by strides, so ``w1ᵀ`` etc.
  are views, never copies.
* ``_gmm_wgrad``: ``out[e] = A[rows of e]ᵀ @ G[rows of e]`` (weight gradients), a loop over
  the expert's rows with data-dependent bounds.
* ``_rope``: one program per (token, head) row; rotate-half with the cache row of its position.

Tiles are loaded as float32 and multiplied with ``input_precision="ieee"`` (no TF32), so a
float32 run matches the float32 reference to ~1e-6.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from qwen3_research.kernels.moe import install_experts, verify_moe
from qwen3_research.kernels.registry import KernelSpec, Measured, Requirements, register
from qwen3_research.kernels.rope import define_rope_op, install_rope, verify_rope

NS = "qwen3_research"

# Where they were timed against the module they replace (ratio = module time / kernel time, > 1: faster), on one
# H200 (issue 30; whole training steps, bf16 autocast, compile off): triton_moe vs torchtitan's grouped GEMM on the
# MoE debug flavor, triton_rope vs CosSinRoPE on Qwen3-0.6B. registry.speed_note reads these.
TRITON_MOE_MEASURED = (Measured("cuda", "bfloat16", 0.83, "RESULTS.md row 16", "H200 MoE debug step"),)
TRITON_ROPE_MEASURED = (Measured("cuda", "bfloat16", 1.09, "RESULTS.md row 16", "H200 0.6B step"),)
BM, BN, BK = 32, 32, 32


@functools.lru_cache(maxsize=None)
def _k():
    # deferred: optional platform package (triton may be absent: CPU-only and Neuron hosts)
    import triton
    import triton.language as tl

    @triton.jit
    def gmm(a_ptr, b_ptr, c_ptr, t_exp, t_start, t_end, N, K,
            s_am, s_ak, s_be, s_bk, s_bn, s_cm, s_cn,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        e = tl.load(t_exp + pid_m)
        r0 = tl.load(t_start + pid_m)
        r1 = tl.load(t_end + pid_m)
        rm = r0 + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + rk
            a = tl.load(a_ptr + rm[:, None] * s_am + kk[None, :] * s_ak,
                        mask=(rm[:, None] < r1) & (kk[None, :] < K), other=0.0).to(tl.float32)
            b = tl.load(b_ptr + e * s_be + kk[:, None] * s_bk + rn[None, :] * s_bn,
                        mask=(kk[:, None] < K) & (rn[None, :] < N), other=0.0).to(tl.float32)
            acc += tl.dot(a, b, input_precision="ieee")
        tl.store(c_ptr + rm[:, None] * s_cm + rn[None, :] * s_cn, acc.to(c_ptr.dtype.element_ty),
                 mask=(rm[:, None] < r1) & (rn[None, :] < N))

    @triton.jit
    def gmm_wgrad(a_ptr, g_ptr, o_ptr, e_start, e_end, K, N,
                  s_am, s_ak, s_gm, s_gn, s_oe, s_ok, s_on,
                  BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
        e = tl.program_id(0)
        pid_k = tl.program_id(1)
        pid_n = tl.program_id(2)
        r0 = tl.load(e_start + e)
        r1 = tl.load(e_end + e)
        rk = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rr = tl.arange(0, BLOCK_R)
        acc = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
        for s in range(r0, r1, BLOCK_R):
            rows = s + rr
            at = tl.load(a_ptr + rows[None, :] * s_am + rk[:, None] * s_ak,
                         mask=(rows[None, :] < r1) & (rk[:, None] < K), other=0.0).to(tl.float32)
            g = tl.load(g_ptr + rows[:, None] * s_gm + rn[None, :] * s_gn,
                        mask=(rows[:, None] < r1) & (rn[None, :] < N), other=0.0).to(tl.float32)
            acc += tl.dot(at, g, input_precision="ieee")
        tl.store(o_ptr + e * s_oe + rk[:, None] * s_ok + rn[None, :] * s_on, acc.to(o_ptr.dtype.element_ty),
                 mask=(rk[:, None] < K) & (rn[None, :] < N))

    @triton.jit
    def rope(x_ptr, c_ptr, s_ptr, o_ptr, L, NH, H, HALF, CB,
             BLOCK_H: tl.constexpr, TRANSPOSE: tl.constexpr):
        row = tl.program_id(0)
        b = row // (L * NH)
        pos = (row // NH) % L
        crow = (b % CB) * L + pos
        j = tl.arange(0, BLOCK_H)
        m = j < HALF
        x1 = tl.load(x_ptr + row * H + j, mask=m, other=0.0).to(tl.float32)
        x2 = tl.load(x_ptr + row * H + HALF + j, mask=m, other=0.0).to(tl.float32)
        c1 = tl.load(c_ptr + crow * H + j, mask=m, other=0.0).to(tl.float32)
        c2 = tl.load(c_ptr + crow * H + HALF + j, mask=m, other=0.0).to(tl.float32)
        s1 = tl.load(s_ptr + crow * H + j, mask=m, other=0.0).to(tl.float32)
        s2 = tl.load(s_ptr + crow * H + HALF + j, mask=m, other=0.0).to(tl.float32)
        if TRANSPOSE:
            o1 = x1 * c1 + x2 * s2
            o2 = x2 * c2 - x1 * s1
        else:
            o1 = x1 * c1 - x2 * s1
            o2 = x2 * c2 + x1 * s2
        tl.store(o_ptr + row * H + j, o1.to(o_ptr.dtype.element_ty), mask=m)
        tl.store(o_ptr + row * H + HALF + j, o2.to(o_ptr.dtype.element_ty), mask=m)

    return triton, gmm, gmm_wgrad, rope


# ---------------------------------------------------------------------------- MoE
def _tiles(counts: torch.Tensor, device):
    exp, start, end, es, ee, s = [], [], [], [], [], 0
    for e, c in enumerate(int(c) for c in counts.tolist()):
        es.append(s)
        ee.append(s + c)
        for r in range(s, s + c, BM):
            exp.append(e)
            start.append(r)
            end.append(s + c)
        s += c
    t = lambda v: torch.tensor(v, dtype=torch.int32, device=device)  # noqa: E731
    return t(exp), t(start), t(end), t(es), t(ee)


def _gmm(a, b_view, tiles, out_dtype=None):
    """rows of expert e of ``a`` (R, K) @ ``b_view[e]`` (K, N) -> (R, N)."""
    triton, gmm, _, _ = _k()
    t_exp, t_start, t_end = tiles[:3]
    R, K = a.shape
    N = b_view.shape[2]
    c = torch.zeros(R, N, dtype=out_dtype or a.dtype, device=a.device)
    if t_exp.numel() == 0:
        return c
    grid = (t_exp.numel(), triton.cdiv(N, BN))
    gmm[grid](a, b_view, c, t_exp, t_start, t_end, N, K,
              a.stride(0), a.stride(1), b_view.stride(0), b_view.stride(1), b_view.stride(2),
              c.stride(0), c.stride(1), BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK)
    return c


def _wgrad(a, g, tiles, E):
    """out[e] = a[rows of e]ᵀ @ g[rows of e] -> (E, K, N)."""
    triton, _, gmm_wgrad, _ = _k()
    es, ee = tiles[3:]
    K, N = a.shape[1], g.shape[1]
    out = torch.zeros(E, K, N, dtype=a.dtype, device=a.device)
    grid = (E, triton.cdiv(K, BK), triton.cdiv(N, BN))
    gmm_wgrad[grid](a, g, out, es, ee, K, N, a.stride(0), a.stride(1), g.stride(0), g.stride(1),
                    out.stride(0), out.stride(1), out.stride(2), BLOCK_R=BM, BLOCK_K=BK, BLOCK_N=BN)
    return out


@torch.library.custom_op(f"{NS}::moe_experts_triton_fwd", mutates_args=())
def moe_triton_fwd(
    x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor, counts: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    tiles = _tiles(counts, x.device)
    a = _gmm(x, w1.transpose(1, 2), tiles)
    b = _gmm(x, w3.transpose(1, 2), tiles)
    y = _gmm(F.silu(a) * b, w2.transpose(1, 2), tiles)
    return y, a, b


@moe_triton_fwd.register_fake
def _(x, w1, w2, w3, counts):
    R, Fh = x.shape[0], w1.shape[1]
    return x.new_empty(R, w2.shape[1]), x.new_empty(R, Fh), x.new_empty(R, Fh)


@torch.library.custom_op(f"{NS}::moe_experts_triton_bwd", mutates_args=())
def moe_triton_bwd(
    gy: torch.Tensor, x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor,
    counts: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    gy = gy.contiguous()
    E = w1.shape[0]
    tiles = _tiles(counts, x.device)
    sa = torch.sigmoid(a)
    sil = a * sa
    dw2 = _wgrad(gy, sil * b, tiles, E)
    dh = _gmm(gy, w2, tiles)
    db = (dh * sil).contiguous()
    da = (dh * b * sa * (1 + a * (1 - sa))).contiguous()
    dx = _gmm(da, w1, tiles) + _gmm(db, w3, tiles)
    return dx, _wgrad(da, x, tiles, E), dw2, _wgrad(db, x, tiles, E)


@moe_triton_bwd.register_fake
def _(gy, x, w1, w2, w3, counts, a, b):
    return torch.empty_like(x), torch.empty_like(w1), torch.empty_like(w2), torch.empty_like(w3)


def _moe_setup(ctx, inputs, output):
    x, w1, w2, w3, counts = inputs
    _, a, b = output
    ctx.save_for_backward(x, w1, w2, w3, counts, a, b)
    ctx.mark_non_differentiable(a, b)


def _moe_backward(ctx, gy, ga, gb):
    x, w1, w2, w3, counts, a, b = ctx.saved_tensors
    return (*moe_triton_bwd(gy, x, w1, w2, w3, counts, a, b), None)


moe_triton_fwd.register_autograd(_moe_backward, setup_context=_moe_setup)


def moe_triton(x, w1, w2, w3, counts):
    return moe_triton_fwd(x.contiguous(), w1.contiguous(), w2.contiguous(), w3.contiguous(), counts)[0]


# ---------------------------------------------------------------------------- RoPE
def _rope_launch(x, cos, sin, transpose):
    triton, _, _, rope = _k()
    x = x.contiguous()
    B, L, NH, H = x.shape
    cb = cos.shape[0]
    cos = cos.expand(cb, L, 1, H).contiguous()
    sin = sin.expand(cb, L, 1, H).contiguous()
    out = torch.empty_like(x)
    half = H // 2
    rope[(B * L * NH,)](x, cos, sin, out, L, NH, H, half, cb,
                         BLOCK_H=triton.next_power_of_2(half), TRANSPOSE=transpose)
    return out


rope_triton_op = define_rope_op("rope_triton", _rope_launch)


def rope_triton(x, cos, sin):
    return rope_triton_op(x, cos, sin, False)


# ---------------------------------------------------------------------------- registry
def _register():
    interp = {"cpu": "TRITON_INTERPRET"}

    def verify_moe_(module, shapes, device, options):
        return verify_moe(module, shapes, device, options, op=moe_triton, default_options={})

    def verify_rope_(module, shapes, device, options):
        return verify_rope(module, shapes, device, rope_triton)

    register(KernelSpec(
        name="triton_moe",
        description="SwiGLU experts by Triton grouped GEMMs (fp32 accumulate, IEEE fp32 dots)",
        module_types=("GroupedExperts",),
        install=install_experts("triton_moe", moe_triton, {}),
        requirements=Requirements(devices=("cuda", "cpu"), env=interp, fix="kernels=moe_fast"),
        verify=verify_moe_,
        speed=True,
        measured=TRITON_MOE_MEASURED,
    ))
    register(KernelSpec(
        name="triton_rope",
        description="CosSin RoPE (rotate-half) as one Triton program per (token, head)",
        module_types=("CosSinRoPE",),
        install=install_rope("triton_rope", rope_triton),
        requirements=Requirements(devices=("cuda", "cpu"), env=interp, fix="kernels=rope_fast"),
        verify=verify_rope_,
        speed=True,
        measured=TRITON_ROPE_MEASURED,
    ))


_register()
