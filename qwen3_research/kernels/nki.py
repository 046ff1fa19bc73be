"""Trainium kernels ``nki_moe`` and ``nki_rope``: NKI kernels bound as PyTorch ops with
torch_neuronx's ``nki_op`` (the ``triton_op`` analogue), backward through ``register_autograd``.

NOT VERIFIED ON HARDWARE (see docs/KERNELS.md): this machine has no Trainium and the PyPI
``torch-neuronx``/``nki`` packages are empty placeholders. The code follows AWS's public NKI
API (``nki.jit``, ``nki.language`` as ``nl``, ``nki.isa`` as ``nisa``: ``nl.ndarray`` buffers in
SBUF/PSUM, ``nisa.dma_copy``, ``nisa.nc_matmul``, ``nisa.tensor_tensor``, ``nisa.activation``)
and the torch-neuronx guide "How to work with NKI kernels". Everything here is imported only
when a neuron kernel is installed on a neuron device; the specs themselves are plain data, so
on cpu/cuda the registry stops at start-up with a clear ConfigError (device requirement).

Constraints: 128-partition tiles -> data.seq_len must be a multiple of 128 × LNC (LNC from
NEURON_LOGICAL_NC_CONFIG / device.lnc); the MoE kernel expects expert-sorted rows whose
per-expert counts are padded by the wrapper to multiples of 128 (blockwise matmul, as in
AWS's blockwise MoE design). The float32 references are the same as for the CPU kernels
(``moe.moe_reference``, ``rope.rope_reference``), so ``verify_kernels`` checks these too.
"""

from __future__ import annotations

import functools

import torch

from qwen3_research.kernels.registry import KernelSpec, Requirements, register

NS = "qwen3_research"
P = 128  # partitions per tile (nl.tile_size.pmax)


@functools.lru_cache(maxsize=None)
def _nki():
    """Build the NKI kernels and their torch ops. Neuron hosts only."""
    import nki
    import nki.isa as nisa
    import nki.language as nl
    from torch_neuronx import nki_op

    @nki.jit
    def rope_kernel(x, cos, sin, transpose: int):
        """x: (N, H) rows = (token, head) pairs; cos/sin: (N, H) matched rows. N % 128 == 0."""
        N, H = x.shape
        h = H // 2
        out = nl.ndarray((N, H), dtype=x.dtype, buffer=nl.shared_hbm)
        for t in nl.affine_range(N // P):
            xs = nl.ndarray((P, H), dtype=nl.float32, buffer=nl.sbuf)
            cs = nl.ndarray((P, H), dtype=nl.float32, buffer=nl.sbuf)
            ss = nl.ndarray((P, H), dtype=nl.float32, buffer=nl.sbuf)
            nisa.dma_copy(dst=xs, src=x[t * P:(t + 1) * P, :])
            nisa.dma_copy(dst=cs, src=cos[t * P:(t + 1) * P, :])
            nisa.dma_copy(dst=ss, src=sin[t * P:(t + 1) * P, :])
            o = nl.ndarray((P, H), dtype=nl.float32, buffer=nl.sbuf)
            a = nl.ndarray((P, h), dtype=nl.float32, buffer=nl.sbuf)
            b = nl.ndarray((P, h), dtype=nl.float32, buffer=nl.sbuf)
            # o = x * cos (both halves)
            nisa.tensor_tensor(dst=o, data1=xs, data2=cs, op=nl.multiply)
            if transpose == 0:  # o1 -= x2 s1 ; o2 += x1 s2
                nisa.tensor_tensor(dst=a, data1=xs[:, h:H], data2=ss[:, 0:h], op=nl.multiply)
                nisa.tensor_tensor(dst=o[:, 0:h], data1=o[:, 0:h], data2=a, op=nl.subtract)
                nisa.tensor_tensor(dst=b, data1=xs[:, 0:h], data2=ss[:, h:H], op=nl.multiply)
                nisa.tensor_tensor(dst=o[:, h:H], data1=o[:, h:H], data2=b, op=nl.add)
            else:  # o1 += x2 s2 ; o2 -= x1 s1
                nisa.tensor_tensor(dst=a, data1=xs[:, h:H], data2=ss[:, h:H], op=nl.multiply)
                nisa.tensor_tensor(dst=o[:, 0:h], data1=o[:, 0:h], data2=a, op=nl.add)
                nisa.tensor_tensor(dst=b, data1=xs[:, 0:h], data2=ss[:, 0:h], op=nl.multiply)
                nisa.tensor_tensor(dst=o[:, h:H], data1=o[:, h:H], data2=b, op=nl.subtract)
            ot = nl.ndarray((P, H), dtype=x.dtype, buffer=nl.sbuf)
            nisa.tensor_copy(dst=ot, src=o)
            nisa.dma_copy(dst=out[t * P:(t + 1) * P, :], src=ot)
        return out

    @nki.jit
    def block_mm_kernel(a, b, block_expert):
        """Blockwise grouped matmul: for block i of 128 rows, out[i] = a[i] @ b[block_expert[i]].

        a: (NB*128, K) expert-sorted and padded per expert to 128 rows; b: (E, K, N), K % 128 == 0,
        N <= 512 (one PSUM bank of fp32); block_expert: (NB,) int32 read on the host (static).
        """
        R, K = a.shape
        E, _, N = b.shape
        out = nl.ndarray((R, N), dtype=a.dtype, buffer=nl.shared_hbm)
        for i in nl.affine_range(R // P):
            e = block_expert[i]
            acc = nl.ndarray((P, N), dtype=nl.float32, buffer=nl.psum)
            for k in nl.affine_range(K // P):
                aT = nl.ndarray((P, P), dtype=a.dtype, buffer=nl.sbuf)  # (K-tile, rows): stationary
                nisa.dma_copy(dst=aT, src=a[i * P:(i + 1) * P, k * P:(k + 1) * P].T)
                bt = nl.ndarray((P, N), dtype=b.dtype, buffer=nl.sbuf)
                nisa.dma_copy(dst=bt, src=b[e, k * P:(k + 1) * P, :])
                nisa.nc_matmul(dst=acc, stationary=aT, moving=bt, accumulate=True)
            res = nl.ndarray((P, N), dtype=a.dtype, buffer=nl.sbuf)
            nisa.tensor_copy(dst=res, src=acc)
            nisa.dma_copy(dst=out[i * P:(i + 1) * P, :], src=res)
        return out

    @nki_op(f"{NS}::nki_rope", mutates_args=())
    def nki_rope_op(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, transpose: bool) -> torch.Tensor:
        B, L, NH, H = x.shape
        c = cos.expand(B, L, NH, H).reshape(-1, H).contiguous()
        s = sin.expand(B, L, NH, H).reshape(-1, H).contiguous()
        return rope_kernel(x.reshape(-1, H).contiguous(), c, s, int(transpose)).view(B, L, NH, H)

    def _rope_setup(ctx, inputs, output):
        ctx.save_for_backward(inputs[1], inputs[2])
        ctx.transpose = inputs[3]

    def _rope_bwd(ctx, g):
        cos, sin = ctx.saved_tensors
        return nki_rope_op(g.contiguous(), cos, sin, not ctx.transpose), None, None, None

    nki_rope_op.register_autograd(_rope_bwd, setup_context=_rope_setup)

    def grouped(a_rows, b, counts):
        """Pad each expert's rows to a multiple of 128, run the blockwise kernel, unpad."""
        cl = [int(c) for c in counts.tolist()]
        blocks, idx, block_expert, s, dst = [], [], [], 0, 0
        for e, c in enumerate(cl):
            nb = -(-c // P)
            idx.append(torch.arange(dst, dst + c))
            block_expert += [e] * nb
            dst += nb * P
            s += c
        index = torch.cat(idx).to(a_rows.device) if idx else torch.zeros(0, dtype=torch.long, device=a_rows.device)
        padded = a_rows.new_zeros(dst, a_rows.shape[1]).index_copy_(0, index, a_rows)
        out = block_mm_kernel(padded, b.contiguous(), block_expert)
        return out.index_select(0, index)

    @nki_op(f"{NS}::nki_moe_fwd", mutates_args=())
    def nki_moe_fwd(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor,
                    counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        a = grouped(x, w1.transpose(1, 2), counts)
        b = grouped(x, w3.transpose(1, 2), counts)
        y = grouped(torch.nn.functional.silu(a) * b, w2.transpose(1, 2), counts)
        return y, a, b

    def _moe_setup(ctx, inputs, output):
        x, w1, w2, w3, counts = inputs
        ctx.save_for_backward(x, w1, w2, w3, counts, output[1], output[2])
        ctx.mark_non_differentiable(output[1], output[2])

    def _moe_bwd(ctx, gy, ga, gb):
        # Activation grads through the NKI grouped matmul; weight grads per expert with torch.mm
        # on neuron (XLA-lowered), since a transposed blockwise kernel is not written yet.
        x, w1, w2, w3, counts, a, b = ctx.saved_tensors
        sa = torch.sigmoid(a)
        sil = a * sa
        h = sil * b
        dh = grouped(gy, w2, counts)
        db = dh * sil
        da = dh * b * sa * (1 + a * (1 - sa))
        dx = grouped(da, w1, counts) + grouped(db, w3, counts)
        dw1, dw2, dw3 = torch.zeros_like(w1), torch.zeros_like(w2), torch.zeros_like(w3)
        s = 0
        for e, c in enumerate(int(c) for c in counts.tolist()):
            if c:
                sl = slice(s, s + c)
                dw1[e] = da[sl].T @ x[sl]
                dw3[e] = db[sl].T @ x[sl]
                dw2[e] = gy[sl].T @ h[sl]
            s += c
        return dx, dw1, dw2, dw3, None

    nki_moe_fwd.register_autograd(_moe_bwd, setup_context=_moe_setup)

    def nki_moe(x, w1, w2, w3, counts):
        return nki_moe_fwd(x.contiguous(), w1, w2, w3, counts)[0]

    def nki_rope(x, cos, sin):
        return nki_rope_op(x, cos, sin, False)

    return nki_moe, nki_rope


def _install_moe(module, options):
    from qwen3_research.kernels.moe import install_experts

    nki_moe, _ = _nki()
    install_experts("nki_moe", nki_moe, {})(module, options)


def _install_rope(module, options):
    from qwen3_research.kernels.rope import install_rope

    _, nki_rope = _nki()
    install_rope("nki_rope", nki_rope)(module, options)


def _verify_moe(module, shapes, device, options):
    from qwen3_research.kernels.verify import verify_moe

    nki_moe, _ = _nki()
    res = verify_moe(module, shapes, device, options, op=nki_moe, default_options={})
    return [(s, fa, fr, ba, br, 2e-2 if tol > 1e-5 else 1e-3) for s, fa, fr, ba, br, tol in res]


def _verify_rope(module, shapes, device, options):
    from qwen3_research.kernels.verify import verify_rope

    _, nki_rope = _nki()
    return verify_rope(module, shapes, device, nki_rope)


_NEURON = Requirements(
    devices=("neuron",),
    dtypes=("float32", "bfloat16"),
    seq_multiple=lambda lnc: 128 * lnc,
    seq_multiple_text="128 × LNC",
    lncs=(1, 2),
    fix="these are Trainium (NKI) kernels; on cpu/cuda use kernels=moe_fast / rope_fast (or triton_moe / triton_rope on cuda)",
)

register(KernelSpec(
    name="nki_moe",
    description="SwiGLU experts by an NKI blockwise (128-row) grouped matmul on Trainium",
    module_types=("GroupedExperts",),
    install=_install_moe,
    requirements=_NEURON,
    verify=_verify_moe,
    tolerance=1e-3,
))
register(KernelSpec(
    name="nki_rope",
    description="CosSin RoPE (rotate-half) as an NKI kernel over 128-row tiles on Trainium",
    module_types=("CosSinRoPE",),
    install=_install_rope,
    requirements=_NEURON,
    verify=_verify_rope,
    tolerance=1e-3,
))
