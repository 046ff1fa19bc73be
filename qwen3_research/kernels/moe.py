"""MoE expert kernel (``moe_fast``): SwiGLU experts over expert-sorted rows, in the input dtype.

Replaces the computation of torchtitan's ``GroupedExperts`` (which always casts to bf16 and
calls ``torch._grouped_mm``). Rows arrive sorted by expert with per-expert counts. The kernel
scatters them into an ``(E, C, D)`` padded block (C = the largest count) and runs ``torch.bmm``
— faster on CPU than ``_grouped_mm`` for balanced routing — or, when padding would waste more
than ``pad_limit`` × the rows, one ``mm`` per expert.

Custom ops (``torch.library.custom_op``), opaque to torch.compile, with fake impls and autograd:

* ``qwen3_research::moe_experts_fwd(x, w1, w2, w3, counts, pad_limit) -> (y, a, b)``
  (``a = x w1ᵀ``, ``b = x w3ᵀ`` are saved for backward)
* ``qwen3_research::moe_experts_bwd(gy, x, w1, w2, w3, counts, a, b, pad_limit) -> (dx, dw1, dw2, dw3)``

``moe_reference`` is the float32 reference (a per-expert loop, autograd through ATen ops).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from qwen3_research import titan
from qwen3_research.errors import ConfigError
from qwen3_research.kernels.registry import KernelSpec, Measured, Requirements, register
from qwen3_research.kernels.verify import _err, _local, _worst, random_routing

NS = "qwen3_research"

# Where moe_fast was timed against the module it replaces (torchtitan's GroupedExperts, bf16 _grouped_mm), forward +
# backward: ratio = module time / kernel time (> 1: faster). A speed kernel applies only where it is faster
# (registry.speed_note); add a row when a benchmark runs on a new device kind (benchmarks/bench_kernels.py).
MOE_FAST_MEASURED = (
    Measured("cpu-avx2", "float32", 9.79, "RESULTS.md row 8", "E=64 top-8 D=256 F=128"),
    Measured("cpu-avx512bf16", "float32", 0.44, "RESULTS.md row 17", "tiny"),
    Measured("cpu-avx512bf16", "float32", 0.64, "RESULTS.md row 17", "30B-A3B"),
    Measured("cpu-avx512bf16", "bfloat16", 0.89, "RESULTS.md row 17", "tiny"),
    Measured("cpu-avx512bf16", "bfloat16", 0.89, "RESULTS.md row 17", "30B-A3B"),
    Measured("cuda", "float32", 0.51, "RESULTS.md row 16", "H200 MoE debug step"),
)


# ---------------------------------------------------------------------------- reference
def moe_reference(x, w1, w2, w3, counts):
    """float32 SwiGLU experts, one expert at a time: y_e = (silu(x_e w1_eᵀ) * x_e w3_eᵀ) w2_eᵀ."""
    x, w1, w2, w3 = (t.float() for t in (x, w1, w2, w3))
    outs, s = [], 0
    for e, c in enumerate(counts.tolist()):
        xe = x[s : s + c]
        outs.append((F.silu(xe @ w1[e].T) * (xe @ w3[e].T)) @ w2[e].T)
        s += c
    return torch.cat(outs) if outs else x.new_zeros(0, w2.shape[1])


# ---------------------------------------------------------------------------- layouts
class _Groups:
    """Rows sorted by expert -> padded (E, C, ·) blocks, or per-expert slices."""

    def __init__(self, counts: torch.Tensor, rows: int, pad_limit: float, device):
        self.counts = [int(c) for c in counts.tolist()]
        self.E = len(self.counts)
        self.C = max(self.counts) if self.counts else 0
        self.R = rows
        self.padded = self.C > 0 and self.E * self.C <= pad_limit * max(rows, 1)
        starts, s = [], 0
        for c in self.counts:
            starts.append(s)
            s += c
        self.starts = starts
        if self.padded:
            cnt = torch.tensor(self.counts, device=device)
            e_r = torch.repeat_interleave(torch.arange(self.E, device=device), cnt, output_size=rows)
            start = torch.tensor(starts, device=device)
            self.idx = e_r * self.C + (torch.arange(rows, device=device) - start[e_r])

    def pad(self, t: torch.Tensor) -> torch.Tensor:
        out = t.new_zeros(self.E * self.C, t.shape[-1])
        out.index_copy_(0, self.idx, t)
        return out.view(self.E, self.C, t.shape[-1])

    def unpad(self, t: torch.Tensor) -> torch.Tensor:
        return t.reshape(self.E * self.C, t.shape[-1]).index_select(0, self.idx)

    def slices(self):
        for e, (s, c) in enumerate(zip(self.starts, self.counts)):
            if c:
                yield e, slice(s, s + c)


def _silu_parts(a):
    sa = torch.sigmoid(a)
    sil = a * sa
    return sa, sil


# ---------------------------------------------------------------------------- kernels
def _fwd_impl(x, w1, w2, w3, counts, pad_limit):
    R, D = x.shape
    Fh = w1.shape[1]
    g = _Groups(counts, R, pad_limit, x.device)
    if g.padded:
        xp = g.pad(x)
        ap = torch.bmm(xp, w1.transpose(1, 2))
        bp = torch.bmm(xp, w3.transpose(1, 2))
        yp = torch.bmm(F.silu(ap) * bp, w2.transpose(1, 2))
        return g.unpad(yp), g.unpad(ap), g.unpad(bp)
    y = x.new_zeros(R, w2.shape[1])
    a = x.new_zeros(R, Fh)
    b = x.new_zeros(R, Fh)
    for e, sl in g.slices():
        torch.mm(x[sl], w1[e].T, out=a[sl])
        torch.mm(x[sl], w3[e].T, out=b[sl])
        torch.mm(F.silu(a[sl]) * b[sl], w2[e].T, out=y[sl])
    return y, a, b


def _bwd_impl(gy, x, w1, w2, w3, counts, a, b, pad_limit):
    R = x.shape[0]
    g = _Groups(counts, R, pad_limit, x.device)
    dw1, dw2, dw3 = torch.zeros_like(w1), torch.zeros_like(w2), torch.zeros_like(w3)
    if g.padded:
        gp, xp, ap, bp = g.pad(gy), g.pad(x), g.pad(a), g.pad(b)
        sa, sil = _silu_parts(ap)
        torch.bmm(gp.transpose(1, 2), sil * bp, out=dw2)
        dh = torch.bmm(gp, w2)
        db = dh * sil
        da = dh * bp * sa * (1 + ap * (1 - sa))
        dxp = torch.bmm(da, w1)
        dxp.baddbmm_(db, w3)
        torch.bmm(da.transpose(1, 2), xp, out=dw1)
        torch.bmm(db.transpose(1, 2), xp, out=dw3)
        return g.unpad(dxp), dw1, dw2, dw3
    dx = torch.zeros_like(x)
    for e, sl in g.slices():
        ae, be, ge, xe = a[sl], b[sl], gy[sl], x[sl]
        sa, sil = _silu_parts(ae)
        torch.mm(ge.T, sil * be, out=dw2[e])
        dh = ge @ w2[e]
        db = dh * sil
        da = dh * be * sa * (1 + ae * (1 - sa))
        torch.mm(da, w1[e], out=dx[sl])
        dx[sl].addmm_(db, w3[e])
        torch.mm(da.T, xe, out=dw1[e])
        torch.mm(db.T, xe, out=dw3[e])
    return dx, dw1, dw2, dw3


def _no_autocast(t: torch.Tensor):
    """The kernels compute in their inputs' dtype, which the module override chose (``make_experts_forward``).
    Under a run's autocast (``training.mixed_precision=bf16`` on one process) a custom op's body would otherwise
    be autocast op by op: its ``torch.bmm(..., out=)`` into a buffer of the weights' dtype then fails ("Expected out
    tensor to have dtype BFloat16, but got float") and the saved pre-activations change dtype behind the fake."""
    return _autocast_off(t.device.type)


def _autocast_off(kind: str):
    if not torch.amp.is_autocast_available(kind):  # meta: no autocast to turn off
        return contextlib.nullcontext()
    return torch.autocast(device_type=kind, enabled=False)


@torch.library.custom_op(f"{NS}::moe_experts_fwd", mutates_args=())
def moe_experts_fwd(
    x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor, counts: torch.Tensor, pad_limit: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    with _no_autocast(x):
        return _fwd_impl(x, w1, w2, w3, counts, pad_limit)


@moe_experts_fwd.register_fake
def _(x, w1, w2, w3, counts, pad_limit):
    R, Fh = x.shape[0], w1.shape[1]
    return x.new_empty(R, w2.shape[1]), x.new_empty(R, Fh), x.new_empty(R, Fh)


@torch.library.custom_op(f"{NS}::moe_experts_bwd", mutates_args=())
def moe_experts_bwd(
    gy: torch.Tensor, x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor,
    counts: torch.Tensor, a: torch.Tensor, b: torch.Tensor, pad_limit: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    with _no_autocast(x):  # loss.backward() may run inside the step's autocast (CPU runs backward on its thread)
        return _bwd_impl(gy.to(x.dtype).contiguous(), x, w1, w2, w3, counts, a, b, pad_limit)


@moe_experts_bwd.register_fake
def _(gy, x, w1, w2, w3, counts, a, b, pad_limit):
    return torch.empty_like(x), torch.empty_like(w1), torch.empty_like(w2), torch.empty_like(w3)


def _setup(ctx, inputs, output):
    x, w1, w2, w3, counts, pad_limit = inputs
    _, a, b = output
    ctx.save_for_backward(x, w1, w2, w3, counts, a, b)
    ctx.pad_limit = pad_limit
    ctx.mark_non_differentiable(a, b)


def _backward(ctx, gy, ga, gb):
    x, w1, w2, w3, counts, a, b = ctx.saved_tensors
    dx, dw1, dw2, dw3 = moe_experts_bwd(gy, x, w1, w2, w3, counts, a, b, ctx.pad_limit)
    return dx, dw1, dw2, dw3, None, None


moe_experts_fwd.register_autograd(_backward, setup_context=_setup)


def moe_fast(x, w1, w2, w3, counts, pad_limit: float = 2.0):
    """Differentiable expert MLP: y (R, D) from expert-sorted rows x (R, D)."""
    return moe_experts_fwd(x.contiguous(), w1.contiguous(), w2.contiguous(), w3.contiguous(), counts, pad_limit)[0]


# ---------------------------------------------------------------------------- module override
_DTYPES = {"input": None, "float32": torch.float32, "bfloat16": torch.bfloat16}
_CLASS_CACHE: dict = {}


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype an ``input``-dtype kernel computes in: autocast's where the run autocasts (bf16 on one process,
    as torchtitan's own GroupedExperts computes there), else the activations' (float32, or bf16 under FSDP2 bf16
    parameters)."""
    kind = x.device.type
    if torch.amp.is_autocast_available(kind) and torch.is_autocast_enabled(kind):
        return torch.get_autocast_dtype(kind)
    return x.dtype


def make_experts_forward(op, default_options: dict):
    """A GroupedExperts.forward computing with ``op(x, w1, w2, w3, counts, **options)``."""

    def forward(self, x_RD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
        w1, w2, w3 = titan.expert_weights(self)  # 0.3.x w1_EFD/w2_EDF/w3_EFD, 0.2.x w1/w2/w3
        if isinstance(w1, DTensor):  # same as torchtitan: local shards inside the local_map region
            w1, w2, w3 = w1.to_local(), w2.to_local(), w3.to_local()
        counts = num_tokens_per_expert_E
        titan.mark_expert_counts_varying(counts)
        opts = {**default_options, **self._kernel_options}
        dt = _DTYPES[opts.pop("dtype", "input")] or compute_dtype(x_RD)
        with _autocast_off(x_RD.device.type):  # the casts below are the kernel's own
            y = op(x_RD.to(dt), w1.to(dt), w2.to(dt), w3.to(dt), counts, **opts)
        return y.type_as(x_RD)

    return forward


def install_experts(kernel: str, op, default_options: dict, padded_rows=None):
    """``padded_rows(module, x, counts)``: rows the kernel computes beyond the routed ones (block padding), for
    the routing statistics (qwen3_research.routing); None: the kernel pads nothing (it also replaces the
    group alignment a neuron base module pads with, ``titan.align_token_groups``)."""

    def install(module, options: dict, device=None) -> None:
        unknown = set(options) - set(default_options) - {"dtype"}
        if unknown:
            raise ConfigError(f"kernel {kernel}: unknown options {sorted(unknown)}; known: {sorted(default_options) + ['dtype']}")
        if options.get("dtype", "input") not in _DTYPES:
            raise ConfigError(f"kernel {kernel}: options.dtype must be one of {list(_DTYPES)}, got {options['dtype']!r}")
        base = type(module)
        key = (kernel, base, op)
        if key not in _CLASS_CACHE:
            _CLASS_CACHE[key] = type(
                f"{base.__name__}_{kernel}", (base,),
                {"forward": make_experts_forward(op, default_options), "kernel_name": kernel,
                 "padded_rows": padded_rows},
            )
        module.__class__ = _CLASS_CACHE[key]
        module._kernel_options = dict(options)

    return install


# -- verification against the float32 reference (KernelSpec.verify; qwen3_research.kernels.verify) -------
def verify_moe(module, shapes: dict, device, options: dict, *, op, default_options: dict,
               compute_dtype: torch.dtype | None = None) -> list[tuple]:
    """Checks as (shapes, fwd_abs, fwd_rel, bwd_abs, bwd_rel, compute dtype name). ``compute_dtype``: the
    dtype the kernel computes in when it is fixed by the kernel (NKI MoE: bfloat16), else options.dtype."""
    E, Fh, D = _local(titan.expert_weights(module)[0]).shape
    gen = torch.Generator().manual_seed(shapes.get("seed", 0))
    counts = random_routing(shapes["tokens"], E, shapes["top_k"], gen)
    R = int(counts.sum())
    x = torch.randn(R, D, generator=gen)
    w1 = torch.randn(E, Fh, D, generator=gen) * D**-0.5
    w3 = torch.randn(E, Fh, D, generator=gen) * D**-0.5
    w2 = torch.randn(E, D, Fh, generator=gen) * Fh**-0.5
    gy = torch.randn(R, D, generator=gen)
    opts = {**default_options, **{k: v for k, v in options.items() if k != "dtype"}}
    # the dtype the kernel computes in within this run: options.dtype, else the run's (``run_shapes``: bfloat16
    # under training.mixed_precision=bf16, as autocast or FSDP2's bf16 parameters hand it to the module)
    dt = _DTYPES[options.get("dtype", "input")] or shapes.get("dtype", torch.float32)
    cdt = compute_dtype or dt

    ins = [t.clone().requires_grad_(True) for t in (x, w1, w2, w3)]
    ref = moe_reference(*ins, counts)
    ref.backward(gy)
    dev = device.torch_device
    kin = [t.to(dev).clone().requires_grad_(True) for t in (x, w1, w2, w3)]
    out = op(*(t.to(dt) for t in kin), counts.to(dev), **opts).float()
    out.backward(gy.to(dev))
    fa, fr = _err(out, ref)
    ba, br = _worst([(k.grad, r.grad) for k, r in zip(kin, ins)])
    name = str(cdt).replace("torch.", "")
    return [(f"x({R},{D}) E={E} F={Fh} top{shapes['top_k']} {name}", fa, fr, ba, br, name)]



def _verify(module, shapes, device, options):
    return verify_moe(module, shapes, device, options, op=moe_fast, default_options={"pad_limit": 2.0})


register(KernelSpec(
    name="moe_fast",
    description="SwiGLU experts by padded torch.bmm (or per-expert mm), in the input dtype (fp32 capable)",
    module_types=("GroupedExperts",),
    install=install_experts("moe_fast", moe_fast, {"pad_limit": 2.0}),
    requirements=Requirements(devices=("cpu", "cuda"), dtypes=("float32", "bfloat16")),
    verify=_verify,
    speed=True,
    measured=MOE_FAST_MEASURED,
))


# torch.compiler.disable, applied on the first call (torch/_compile.py: _disable_dynamo imports torch._dynamo then):
# at import it would load dynamo and Triton (~2 s) into every process that resolves a run, a config error's included.
@torch._disable_dynamo  # eager inside a compiled block: its per-expert loop slices rows by data-dependent counts,
def _moe_reference_op(x, w1, w2, w3, counts):  # which inductor's codegen lost ("cannot access local variable 'u11'")
    with _no_autocast(x):  # the float32 reference stays float32 inside a bf16 autocast run
        return moe_reference(x, w1, w2, w3, counts).to(x.dtype)


register(KernelSpec(
    name="moe_reference",
    description="the float32 reference as a module override (per-expert loop, ATen autograd): "
    "torchtitan's expert math without its bf16 cast, for comparisons",
    module_types=("GroupedExperts",),
    install=install_experts("moe_reference", _moe_reference_op, {"dtype": "float32"}),  # float32 under autocast too
    requirements=Requirements(devices=("cpu", "cuda", "neuron")),
    reference=True,
))
