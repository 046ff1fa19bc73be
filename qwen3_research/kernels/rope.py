"""RoPE kernel (``rope_fast``) for torchtitan's ``CosSinRoPE`` (rotate-half convention, as Qwen3).

``y = x·cos + rotate_half(x)·sin`` computed in float32 on the two halves with in-place
multiply-adds (no ``cat`` of a rotated copy), output in the input dtype. The backward is the
transposed rotation, ``g·cos + rotate_halfᵀ(g·sin)``, i.e. the same kernel with ``transpose=True``.
cos/sin are the module's non-trainable cache and receive no gradient.

Custom op: ``qwen3_research::rope_fast(x, cos, sin, transpose) -> y`` (fake impl + autograd).
``rope_reference`` is the float32 reference (torchtitan's own formula).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Shard

from qwen3_research.errors import ConfigError
from qwen3_research.kernels.registry import KernelSpec, Measured, Requirements, register
from qwen3_research.kernels.verify import _err

NS = "qwen3_research"

# Where rope_fast was timed against torchtitan's CosSinRoPE (q and k, forward + backward): ratio = module time /
# kernel time (> 1: faster); registry.speed_note reads it (benchmarks/bench_kernels.py adds rows).
ROPE_FAST_MEASURED = (
    Measured("cpu-avx512bf16", "float32", 0.65, "RESULTS.md row 17", "tiny"),
    Measured("cpu-avx512bf16", "float32", 1.85, "RESULTS.md row 17", "30B-A3B"),
    Measured("cpu-avx512bf16", "bfloat16", 0.71, "RESULTS.md row 17", "tiny"),
    Measured("cpu-avx512bf16", "bfloat16", 1.52, "RESULTS.md row 17", "30B-A3B"),
)


def rope_reference(x, cos, sin):
    """float32 reference: x·cos + rotate_half(x)·sin (torchtitan ``CosSinRoPE.apply_rotary_emb``)."""
    xf = x.float()
    h = xf.shape[-1] // 2
    rot = torch.cat((-xf[..., h:], xf[..., :h]), dim=-1)
    return xf * cos.float() + rot * sin.float()


def _rope_impl(x, cos, sin, transpose: bool):
    xf = x.float()
    cos, sin = cos.float(), sin.float()
    h = x.shape[-1] // 2
    x1, x2 = xf[..., :h], xf[..., h:]
    c1, c2, s1, s2 = cos[..., :h], cos[..., h:], sin[..., :h], sin[..., h:]
    out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    o1, o2 = out[..., :h], out[..., h:]
    torch.mul(x1, c1, out=o1)
    torch.mul(x2, c2, out=o2)
    if not transpose:  # o1 = x1 c1 - x2 s1 ; o2 = x2 c2 + x1 s2
        o1.addcmul_(x2, s1, value=-1.0)
        o2.addcmul_(x1, s2)
    else:  # o1 = x1 c1 + x2 s2 ; o2 = x2 c2 - x1 s1
        o1.addcmul_(x2, s2)
        o2.addcmul_(x1, s1, value=-1.0)
    return out.to(x.dtype)


def define_rope_op(name: str, impl):
    """A RoPE custom op over ``impl(x, cos, sin, transpose)``, with its fake and its autograd.

    The gradient of a rotation is the inverse rotation: the same op with ``transpose`` flipped.
    """

    @torch.library.custom_op(f"{NS}::{name}", mutates_args=())
    def op(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, transpose: bool) -> torch.Tensor:
        return impl(x, cos, sin, transpose)

    @op.register_fake
    def _(x, cos, sin, transpose):
        return torch.empty_like(x)

    def setup(ctx, inputs, output):
        _, cos, sin, transpose = inputs
        ctx.save_for_backward(cos, sin)
        ctx.transpose = transpose

    def backward(ctx, g):
        cos, sin = ctx.saved_tensors
        return op(g.contiguous(), cos, sin, not ctx.transpose), None, None, None

    op.register_autograd(backward, setup_context=setup)
    return op


rope_fast_op = define_rope_op("rope_fast", _rope_impl)


def rope_fast(x, cos, sin):
    return rope_fast_op(x, cos, sin, False)


# ---------------------------------------------------------------------------- module override
_CLASS_CACHE: dict = {}


def make_rope_forward(apply, pair: bool = False):
    """A CosSinRoPE.forward that applies ``apply(x, cos, sin)`` to query and key, or with ``pair``
    ``apply(query, key, cos, sin) -> (q, k)`` once for both (kernels that rotate q and k in one launch)."""

    def both(q, k, cos, sin):
        return apply(q, k, cos, sin) if pair else (apply(q, cos, sin), apply(k, cos, sin))

    def forward(self, query: torch.Tensor, key: torch.Tensor, positions: torch.Tensor | None = None):
        cache = self._reshape_cache(query, positions)
        if isinstance(cache, DTensor):
            cache = cache.to_local()
        head_dim = query.shape[-1]
        cos, sin = cache[..., :head_dim], cache[..., head_dim:]
        if isinstance(query, DTensor):
            # Tensor parallel shards heads (Shard(2)); the rotation is per position and head.
            for p in (*query.placements, *key.placements):
                if isinstance(p, Shard) and p.dim in (1, 3):
                    raise RuntimeError(f"{type(self).__name__}: q/k sharded on dim {p.dim} is not supported")
            q_out, k_out = both(query.to_local(), key.to_local(), cos, sin)
            return (
                DTensor.from_local(q_out, query.device_mesh, query.placements, run_check=False),
                DTensor.from_local(k_out, key.device_mesh, key.placements, run_check=False),
            )
        return both(query, key, cos, sin)

    return forward


def install_rope(kernel: str, apply, pair: bool = False):
    def install(module, options: dict, device=None) -> None:
        if options:
            raise ConfigError(f"kernel {kernel} takes no options; got {sorted(options)}")
        base = type(module)
        key = (kernel, base, apply)
        if key not in _CLASS_CACHE:
            _CLASS_CACHE[key] = type(
                f"{base.__name__}_{kernel}", (base,), {"forward": make_rope_forward(apply, pair), "kernel_name": kernel}
            )
        module.__class__ = _CLASS_CACHE[key]
        module._kernel_options = {}

    return install


# -- verification against the float32 reference (KernelSpec.verify; qwen3_research.kernels.verify) -------
def verify_rope(module, shapes: dict, device, apply) -> list[tuple]:
    gen = torch.Generator().manual_seed(shapes.get("seed", 0))
    B, L, NH, H = shapes["batch"], shapes["seq_len"], shapes["n_heads"], module.config.dim
    cache = module.cache.detach().float().cpu()[:L]
    cos, sin = cache[:, :H].view(1, L, 1, H), cache[:, H:].view(1, L, 1, H)
    x = torch.randn(B, L, NH, H, generator=gen)
    g = torch.randn(B, L, NH, H, generator=gen)
    xr = x.clone().requires_grad_(True)
    ref = rope_reference(xr, cos, sin)
    ref.backward(g)
    dev = device.torch_device
    dt = shapes.get("dtype", torch.float32)  # the run's: q/k arrive in bf16 under training.mixed_precision=bf16
    xk = x.to(dev).requires_grad_(True)
    out = apply(xk.to(dt), cos.to(dev), sin.to(dev))
    out.backward(g.to(dev).to(dt))
    fa, fr = _err(out, ref)
    ba, br = _err(xk.grad, xr.grad)
    name = str(dt).replace("torch.", "")
    return [(f"x({B},{L},{NH},{H}) {name}", fa, fr, ba, br, name)]



def _verify(module, shapes, device, options):
    return verify_rope(module, shapes, device, rope_fast)


register(KernelSpec(
    name="rope_fast",
    description="CosSin RoPE (rotate-half) by in-place half-wise multiply-adds in float32",
    module_types=("CosSinRoPE",),
    install=install_rope("rope_fast", rope_fast),
    requirements=Requirements(devices=("cpu", "cuda"), dtypes=("float32", "bfloat16")),
    verify=_verify,
    speed=True,
    measured=ROPE_FAST_MEASURED,
))


register(KernelSpec(
    name="rope_reference",
    description="the float32 reference as a module override (torchtitan's formula), for comparisons",
    module_types=("CosSinRoPE",),
    install=install_rope("rope_reference", lambda x, c, s: rope_reference(x, c, s).to(x.dtype)),
    requirements=Requirements(devices=("cpu", "cuda", "neuron")),
    reference=True,
))
