"""TEST DOUBLES of AWS's NKI Library kernels and of torch_neuronx's NKI glue, for CPU tests only.

Each double is a PyTorch implementation of the kernel's documented contract, written here from:

* ``rope_hf`` -- aws-neuron/nki-library src/nkilib_src/nkilib/core/embeddings/rope_hf.py (docstring,
  ``_validate_apply_rope_inputs``, ``_apply_rope_single``: forward y = x·cos + rotate_half(x)·sin,
  backward [g1·c1 + g2·s2, g2·c2 - g1·s1]); its torch reference rope_hf_torch.py.
* ``blockwise_mm_baseline_shard_intermediate`` (the shard-on-I forward the wrapper calls) and ``moe_cte``
  (its dispatcher, kept for the hashing contract) -- nkilib/core/moe/moe_cte/bwmm_shard_on_I.py (docstring,
  pseudocode, signature and defaults: PRE_SCALE, ``skip_dma=SkipMode()``;
  ``check_blockwise_mm_shard_I_kernel_compatibility``) and moe_cte.py (``MoECTESpec``/``ShardOnIConfig``:
  plain ``@dataclass``es, so unhashable); API page nki/library/api/moe-cte.rst in aws-neuron/aws-neuron-sdk;
  semantics as AWS's golden moe_cte_torch.py.
* ``blockwise_mm_bwd`` -- nkilib/experimental/moe/bwd/blockwise_mm_backward.py, moe_bwd_parameters.py
  (``validate``, ``validate_sharding``), bwmm_bwd_dropless.py (gradients zero-initialised, experts'
  gradient init split E // num_shards); API page nki/library/api/blockwise-mm-backward.rst; semantics as
  the golden ``_generate_bwd_golden`` in test/integration/nkilib/experimental/moe/test_bwmm_bwd_common.py.
* ``nki_op`` / ``wrap_nki`` -- torch_neuronx/nki_hop.py and nki_kernel.py (parmoham-aws/test-repo-parmoham):
  ``nki_op`` wraps ``torch.library.custom_op`` and registers the op's own body as its fake kernel;
  ``wrap_nki(kernel)[grid](...)`` (``NKIHOPCaller``) binds arguments by the kernel's parameter names and
  fills the kernel's defaults, ``grid`` becomes ``tuple(map(int, grid))``; every non-tensor argument is a
  constant that is hashed (``get_dconfig_and_tensor_args`` -> ``_generate_hash_key``, each value through
  ``TorchNeuronNKIKernelV2._return_shape_dtype_or_hashable``: tensors -> (shape, dtype), str as is,
  sequences and dicts element-wise, anything else must be ``Hashable`` or ``RuntimeError(
  "sema.err_nki_param_not_hashable(...)")``); on fake tensors the output shapes come from
  ``kernel[grid].dump_config`` on meta tensors (``get_dumped_config``: "NKI V2 doesn't support
  FakeTensors yet"), returned as empty tensors of those shapes.

Same argument names, layouts, dtypes, block sizes and block-to-expert semantics as the originals;
each ``kernel_assert`` of the contract is a ``ContractError`` here. Value checks (index ranges) are
skipped on fake tensors, like a kernel that never reads host values. ``widen_float32=True`` lets the
MoE doubles take float32 (the real kernels take bfloat16/float16 only) so the wrapper's layout logic
can be checked against the float32 references at 1e-5; production passes bfloat16.
"""

from __future__ import annotations

import inspect
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from enum import Enum

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor

LAUNCHES: list[tuple[str, tuple]] = []  # (kernel name, grid) of every launch, for tests
CONSTANTS: dict[str, dict] = {}  # kernel name -> the constant (non-tensor) arguments of its last launch
CONSTANT_KEYS: dict[str, set] = {}  # kernel name -> hash keys of its constant arguments (one per compile)
_STATE = {"num_programs": 1, "widen_float32": False}


class ContractError(AssertionError):
    """A documented constraint of an NKI Library kernel was violated (its kernel_assert)."""


def kernel_assert(ok, msg: str) -> None:
    if not ok:
        raise ContractError(msg)


def _fake(*ts) -> bool:
    """Fake or meta tensors, or a make_fx trace in progress: values are not there to check (as on the
    device, where the kernel reads them but the host never does)."""
    from torch.fx.experimental.proxy_tensor import get_proxy_mode

    return get_proxy_mode() is not None or any(isinstance(t, FakeTensor) or t.is_meta for t in ts)


# ------------------------------------------------------------------ torch_neuronx glue (nki_hop.py)
def nki_op(name, fn=None, mutates_args=()):
    """Double of ``torch_neuronx.nki_op``: a custom op whose fake kernel is ``fn`` itself."""

    def dec(fn):
        op = torch.library.custom_op(name, fn, mutates_args=mutates_args)
        op.register_fake(fn)  # as nki_hop.py: "register it as the Fake/meta kernel"
        return op

    return dec if fn is None else dec(fn)


def return_shape_dtype_or_hashable(t, name):
    """torch_neuronx/nki_kernel.py ``TorchNeuronNKIKernelV2._return_shape_dtype_or_hashable``, line for line."""
    if isinstance(t, torch.Tensor):
        return (t.shape, t.dtype)
    if isinstance(t, str):
        return t
    if isinstance(t, Sequence):
        return tuple(return_shape_dtype_or_hashable(e, name=f"{name}[{i}]") for i, e in enumerate(t))
    elif isinstance(t, dict):
        return tuple((k, return_shape_dtype_or_hashable(v, name=f"{name}[{k}]")) for k, v in sorted(t.items()))
    if not isinstance(t, Hashable):
        raise RuntimeError("sema.err_nki_param_not_hashable(name=name, ty=type(t))")
    return t


def constant_key(constants: dict) -> int:
    """The hash key torch_neuronx registers a launch's constant arguments under (``_generate_hash_key``,
    the UnifiedKernel method nki_hop.py calls; its body is not in the public copy: here, the hash of every
    value mapped as above, which raises where the real one does)."""
    return hash(tuple((k, return_shape_dtype_or_hashable(v, k)) for k, v in constants.items()))


class _Caller:
    def __init__(self, kernel, grid=()):
        self.kernel, self.grid = kernel, grid
        sig = inspect.signature(kernel)
        self.arg_names = list(sig.parameters)
        self.defaults = {n: p.default for n, p in sig.parameters.items() if p.default is not inspect.Parameter.empty}

    def __getitem__(self, grid):
        return _Caller(self.kernel, tuple(map(int, grid)))  # nki_hop.NKIHOPCaller.__getitem__: grid iterable

    def __call__(self, *args, **kwargs):
        bound = {**dict(zip(self.arg_names, args)), **kwargs}
        # Stricter than NKIHOPCaller, which drops unknown names silently (the kernel then takes its default):
        # a misspelt argument is a wrapper bug we want to see.
        unknown = set(bound) - set(self.arg_names)
        kernel_assert(not unknown, f"{self.kernel.__name__}: no parameters {sorted(unknown)}")
        missing = [n for n in self.arg_names if n not in bound and n not in self.defaults]
        if missing:  # NKIHOPCaller: self.kernel_default_args[arg_name] -> KeyError
            raise KeyError(missing[0])
        full = {n: bound[n] if n in bound else self.defaults[n] for n in self.arg_names}
        constants = {n: v for n, v in full.items() if not isinstance(v, torch.Tensor)}
        key = constant_key(constants)  # raises for an unhashable constant, before anything runs
        name = self.kernel.__name__
        CONSTANTS[name] = constants
        CONSTANT_KEYS.setdefault(name, set()).add(key)
        LAUNCHES.append((name, self.grid))
        tensors = [v for v in full.values() if isinstance(v, torch.Tensor)]
        if any(isinstance(t, FakeTensor) for t in tensors):
            return self._fake_outputs(full)
        return self._run(full)

    def _run(self, full):
        prev = _STATE["num_programs"]
        _STATE["num_programs"] = self.grid[0] if self.grid else 1  # nl.num_programs(axes=0)
        try:
            return self.kernel(**full)
        finally:
            _STATE["num_programs"] = prev

    def _fake_outputs(self, full):
        """nki_hop.py ``nki_kernel_wrapper_fake_tensor_mode``: output shapes from the kernel traced on meta
        tensors (``get_dumped_config``), then empty tensors of those shapes in the fake mode."""
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        mode = next(t.fake_mode for t in full.values() if isinstance(t, FakeTensor))
        with unset_fake_temporarily():
            meta = {n: torch.empty(v.shape, dtype=v.dtype, device="meta") if isinstance(v, torch.Tensor) else v
                    for n, v in full.items()}
            outs = self._run(meta)
        single = isinstance(outs, torch.Tensor)
        with mode:
            made = [torch.empty(o.shape, dtype=o.dtype) for o in ((outs,) if single else outs)]
        return made[0] if single else tuple(made)


def wrap_nki(kernel):
    """Double of ``torch_neuronx.wrap_nki``."""
    return _Caller(kernel)


# ------------------------------------------------------------------ nkilib enums / config classes
class ActFnType(Enum):  # nkilib/core/utils/common_types.py
    SiLU = 0
    GELU = 1
    GELU_Tanh_Approx = 2
    Swish = 3


class ExpertAffinityScaleMode(Enum):  # nkilib/core/utils/common_types.py
    NO_SCALE = 0
    POST_SCALE = 1
    PRE_SCALE = 2
    PRE_SCALE_DELAYED = 3


class MoECTEImplementation(Enum):  # moe_cte.py
    shard_on_block = 0
    shard_on_i = 1
    shard_on_i_hybrid = 2
    shard_on_i_dropping = 3


@dataclass
class ShardOnIConfig:  # moe_cte.py
    checkpoint_activation: bool = False
    expert_affinity_multiply_on_I: bool = False
    num_static_block: int | None = None


@dataclass
class MoECTESpec:  # moe_cte.py
    implementation: MoECTEImplementation
    shard_on_block: object = None
    shard_on_I: ShardOnIConfig | None = None


@dataclass(frozen=True)
class SkipMode:  # moe_bwd_parameters.py (frozen: hashable by value)
    skip_token: bool = False
    skip_weight: bool = False


class CteSkipMode:  # moe_cte_utils.py: a plain NKIObject class (hashable by identity)
    def __init__(self, skip_token: bool = False, skip_weight: bool = False):
        self.skip_token = skip_token
        self.skip_weight = skip_weight


class ShardOption(Enum):  # moe_bwd_parameters.py
    AUTO = 0
    SHARD_ON_HIDDEN = 1
    SHARD_ON_INTERMEDIATE = 2
    BASELINE_LNC1 = 3


class AffinityOption(Enum):
    AFFINITY_ON_H = 0
    AFFINITY_ON_I = 1


class KernelTypeOption(Enum):
    DROPPING = 0
    DROPLESS = 1


class BwdActFnType(Enum):  # moe_bwd_parameters.ActFnType (its own enum)
    SiLU = 0
    GELU = 1
    GELU_Tanh_Approx = 2
    Swish = 3


def _float_dtypes():
    return (torch.bfloat16, torch.float16) + ((torch.float32,) if _STATE["widen_float32"] else ())


# ------------------------------------------------------------------ rope_hf
def rope_hf(q, k, q_out, k_out, cos=None, sin=None, rope_cache=None, backward=False):
    """Double of nkilib.core.embeddings.rope_hf.rope_hf: [batch, heads, seq, head_dim], writes q_out/k_out."""
    n = _STATE["num_programs"]
    kernel_assert(q.dim() == 4, f"apply_rope only supports 4D tensors, got input shape {tuple(q.shape)}")
    kernel_assert(q.shape[-1] == k.shape[-1], "Head dim mismatch")
    kernel_assert(q.shape[0] == k.shape[0] and q.shape[2] == k.shape[2], "q/k batch or seq mismatch")
    D = q.shape[-1]
    if rope_cache is not None:
        kernel_assert(cos is None and sin is None, "Expected either rope_cache or separate cos/sin tensors, got both")
        kernel_assert(rope_cache.shape[-1] == 2 * D, "Packed rope_cache expects head_dim*2")
        cos, sin, table = rope_cache[..., :D], rope_cache[..., D:], rope_cache
    else:
        kernel_assert(cos is not None and sin is not None, "Expected either rope_cache or separate cos/sin tensors")
        kernel_assert(cos.shape == sin.shape, "Shape of cos Tensor doesn't match shape of sin Tensor")
        kernel_assert(cos.shape[-1] == D, f"Head dim mismatch: q={D}, cos={cos.shape[-1]}")
        table = cos
    kernel_assert(table.dim() == 2 or (table.dim() == 3 and table.shape[0] == q.shape[0]),
                  "rope_cache or cos tensor batch size doesn't match q batch size")
    kernel_assert(table.shape[-2] >= q.shape[2], "rope_cache or cos tensor seq len smaller than q seq len")
    kernel_assert(q.shape[2] % (128 * n) == 0, f"seq len must be multiple of 128 * LNC={n}, got {q.shape[2]}")
    # The kernel loads cos/sin into SBUF tiles of q's dtype and computes in q's dtype.
    kernel_assert(cos.dtype == q.dtype == k.dtype, "q, k, cos, sin must share one dtype")
    kernel_assert(q_out.shape == q.shape and k_out.shape == k.shape, "q_out/k_out must have q/k's shapes")
    L = q.shape[2]
    c = cos[..., :L, :].unsqueeze(-3)  # [.., 1, L, D] over heads
    s = sin[..., :L, :].unsqueeze(-3)
    h = D // 2
    for x, out in ((q, q_out), (k, k_out)):
        x1, x2 = x[..., :h], x[..., h:]
        if not backward:  # y = [x1, x2]·[c1, c2] + [-x2, x1]·[s1, s2]
            y = torch.cat((x1 * c[..., :h] - x2 * s[..., :h], x2 * c[..., h:] + x1 * s[..., h:]), -1)
        else:  # dy = [dx1, dx2]·[c1, c2] + [dx2, -dx1]·[s2, s1]
            y = torch.cat((x1 * c[..., :h] + x2 * s[..., h:], x2 * c[..., h:] - x1 * s[..., :h]), -1)
        out.copy_(y)
    return q_out, k_out


# ------------------------------------------------------------------ shared MoE contract checks
def _check_block_map(token_position_to_id, block_to_expert, block_size, T, E):
    kernel_assert(token_position_to_id.dtype == torch.int32 and block_to_expert.dtype == torch.int32,
                  "token_position_to_id and block_to_expert must be nl.int32 tensors")
    kernel_assert(token_position_to_id.dim() == 1 and token_position_to_id.numel() % block_size == 0,
                  "token_position_to_id must be [N * B]")
    N = token_position_to_id.numel() // block_size
    kernel_assert(tuple(block_to_expert.shape) == (N, 1), f"block_to_expert must be [N, 1] = [{N}, 1]")
    if not _fake(token_position_to_id, block_to_expert):  # the device would read out of bounds
        kernel_assert(int(token_position_to_id.min()) >= 0 and int(token_position_to_id.max()) <= T,
                      f"token_position_to_id must lie in [0, T={T}] (T = the padding token)")
        kernel_assert(int(block_to_expert.min()) >= 0 and int(block_to_expert.max()) < E,
                      f"block_to_expert must lie in [0, E={E})")
    return N


def _gather_blocks(table_TH, token_position_to_id, N, B):
    idx = token_position_to_id.long().view(N, B)
    return idx, table_TH.float()[idx]  # [N, B, H]


# ------------------------------------------------------------------ moe_cte (shard_on_i)
def moe_cte(hidden_states, expert_affinities_masked, gate_up_proj_weight, down_proj_weight, token_position_to_id,
            block_to_expert, block_size, spec, conditions=None, gate_and_up_proj_bias=None, down_proj_bias=None,
            quantization_config=None, gate_up_activations_T=None, down_activations=None,
            activation_function=ActFnType.SiLU, skip_dma=SkipMode(False, False), compute_dtype=torch.bfloat16,
            is_tensor_update_accumulating=True, expert_affinities_scaling_mode=ExpertAffinityScaleMode.POST_SCALE,
            gate_clamp_upper_limit=None, gate_clamp_lower_limit=None, up_clamp_upper_limit=None,
            up_clamp_lower_limit=None):
    """Double of nkilib.core.moe.moe_cte.moe_cte for spec.implementation == shard_on_i: what moe_cte.py
    passes to blockwise_mm_baseline_shard_intermediate (no bias, quantization or clamping)."""
    kernel_assert(spec.implementation == MoECTEImplementation.shard_on_i, "double implements shard_on_i only")
    kernel_assert(quantization_config is None, "double: no quantization")
    cfg = spec.shard_on_I or ShardOnIConfig()
    return blockwise_mm_baseline_shard_intermediate(
        hidden_states=hidden_states, expert_affinities_masked=expert_affinities_masked,
        gate_up_proj_weight=gate_up_proj_weight, down_proj_weight=down_proj_weight, block_size=block_size,
        token_position_to_id=token_position_to_id, block_to_expert=block_to_expert,
        gate_and_up_proj_bias=gate_and_up_proj_bias, down_proj_bias=down_proj_bias,
        activation_function=activation_function, skip_dma=CteSkipMode(), compute_dtype=compute_dtype,
        is_tensor_update_accumulating=is_tensor_update_accumulating,
        expert_affinities_scaling_mode=expert_affinities_scaling_mode, gate_clamp_upper_limit=gate_clamp_upper_limit,
        gate_clamp_lower_limit=gate_clamp_lower_limit, up_clamp_lower_limit=up_clamp_lower_limit,
        up_clamp_upper_limit=up_clamp_upper_limit, checkpoint_activation=cfg.checkpoint_activation,
        expert_affinity_multiply_on_I=cfg.expert_affinity_multiply_on_I)


_CTE_SKIP = CteSkipMode()  # the signature default: one instance, so its identity hash is the same every launch


def blockwise_mm_baseline_shard_intermediate(
        hidden_states, expert_affinities_masked, gate_up_proj_weight, down_proj_weight, block_size,
        token_position_to_id, block_to_expert, gate_and_up_proj_bias=None, down_proj_bias=None,
        gate_up_proj_scale=None, down_proj_scale=None, activation_function=ActFnType.SiLU, skip_dma=_CTE_SKIP,
        compute_dtype=torch.bfloat16, is_tensor_update_accumulating=True,
        expert_affinities_scaling_mode=ExpertAffinityScaleMode.PRE_SCALE, gate_clamp_upper_limit=None,
        gate_clamp_lower_limit=None, up_clamp_lower_limit=None, up_clamp_upper_limit=None,
        checkpoint_activation=False, expert_affinity_multiply_on_I=False):
    """Double of nkilib.core.moe.moe_cte.bwmm_shard_on_I.blockwise_mm_baseline_shard_intermediate (same
    signature and defaults; no bias, fp8 scales or clamping: what the wrapper uses)."""
    kernel_assert(_STATE["num_programs"] in (1, 2), "unsupported NUM_SHARDS")
    kernel_assert(gate_and_up_proj_bias is None and down_proj_bias is None and gate_up_proj_scale is None
                  and down_proj_scale is None, "double: no bias / quantization scales")
    kernel_assert(activation_function == ActFnType.SiLU, "double: SiLU only")
    kernel_assert(None in (gate_clamp_upper_limit, gate_clamp_lower_limit, up_clamp_lower_limit, up_clamp_upper_limit)
                  and {gate_clamp_upper_limit, gate_clamp_lower_limit, up_clamp_lower_limit, up_clamp_upper_limit} == {None},
                  "double: no clamping")
    if expert_affinities_scaling_mode == ExpertAffinityScaleMode.PRE_SCALE_DELAYED:
        expert_affinities_scaling_mode = ExpertAffinityScaleMode.PRE_SCALE
    T1, H = hidden_states.shape
    T = T1 - 1  # hidden_states is [T+1, H]: the last row is the padding token T
    E, H2, two, I = gate_up_proj_weight.shape
    B = block_size
    kernel_assert(H2 == H and two == 2, "gate_up_proj_weight must be [E, H, 2, I_TP]")
    kernel_assert(tuple(down_proj_weight.shape) == (E, I, H), "down_proj_weight must be [E, I_TP, H]")
    kernel_assert(tuple(expert_affinities_masked.shape) == (T1 * E, 1), "expert_affinities_masked must be [(T+1)*E, 1]")
    kernel_assert(B % 256 == 0, "Blocksize must be a multiple of 256")
    kernel_assert(512 <= H <= 8192, f"Hidden dims must be between 512 and 8192, found {H}")
    kernel_assert(H % 512 == 0, f"Hidden dim size must be multiples of 512, found {H}")
    kernel_assert(I % 16 == 0, f"down_proj_weight I must be divisible by 16, found {I}")
    kernel_assert(not skip_dma.skip_weight, "DMA weight skipping is not yet supported")
    dts = {t.dtype for t in (hidden_states, expert_affinities_masked, gate_up_proj_weight, down_proj_weight)}
    kernel_assert(len(dts) == 1, "All input/output tensors must have the same floating point dtype")
    kernel_assert(hidden_states.dtype in _float_dtypes(), f"Supported input dtypes: bfloat16, float16; got {dts}")
    kernel_assert(compute_dtype == hidden_states.dtype, "double: compute_dtype is the I/O dtype")
    N = _check_block_map(token_position_to_id, block_to_expert, B, T, E)

    idx, xb = _gather_blocks(hidden_states, token_position_to_id, N, B)
    e = block_to_expert.long().view(N)
    gu = torch.bmm(xb, gate_up_proj_weight.float()[e].reshape(N, H, 2 * I)).view(N, B, 2, I)
    aff = expert_affinities_masked.float().view(T1, E)[idx, e[:, None]]  # [N, B]
    if expert_affinities_scaling_mode == ExpertAffinityScaleMode.PRE_SCALE:  # pseudocode step 4
        gu = gu * aff[..., None, None]
    gate, up = gu[:, :, 0], gu[:, :, 1]
    down = torch.bmm(F.silu(gate) * up, down_proj_weight.float()[e])  # [N, B, H], before affinity scaling
    if expert_affinities_scaling_mode == ExpertAffinityScaleMode.POST_SCALE:  # step 8
        scaled = down * aff[..., None]
    else:
        kernel_assert(expert_affinities_scaling_mode in (ExpertAffinityScaleMode.NO_SCALE,
                                                         ExpertAffinityScaleMode.PRE_SCALE), "double: no such mode")
        scaled = down
    flat_idx, flat = idx.reshape(-1), scaled.reshape(N * B, H).to(hidden_states.dtype)
    if is_tensor_update_accumulating:  # output zero-initialised, blocks accumulate (top-k > 1)
        output = torch.zeros_like(hidden_states).index_add_(0, flat_idx, flat)
    else:  # output[token_indices] = block_output; rows no block writes are uninitialised memory
        output = torch.full_like(hidden_states, float("nan")).index_copy_(0, flat_idx, flat)
    if not checkpoint_activation:
        return output
    gate_up_T = gu.permute(0, 2, 3, 1).to(gate_up_proj_weight.dtype).contiguous()  # [N, 2, I_TP, B]
    if expert_affinity_multiply_on_I:
        return output, gate_up_T
    return output, gate_up_T, down.to(down_proj_weight.dtype)  # [N, B, H]


# ------------------------------------------------------------------ blockwise_mm_bwd
def blockwise_mm_bwd(hidden_states, expert_affinities_masked, gate_up_proj_weight, down_proj_weight,
                     gate_up_proj_act_checkpoint_T, down_proj_act_checkpoint, token_position_to_id, block_to_expert,
                     output_hidden_states_grad, block_size, skip_dma=None, compute_dtype=torch.bfloat16,
                     is_tensor_update_accumulating=True, shard_option=ShardOption.SHARD_ON_HIDDEN,
                     affinity_option=AffinityOption.AFFINITY_ON_H, kernel_type_option=KernelTypeOption.DROPLESS,
                     clamp_limits=None, bias=False, activation_type=BwdActFnType.SiLU, block_tile_size=None):
    """Double of nkilib.experimental.moe.bwd.blockwise_mm_backward.blockwise_mm_bwd (dropless, no bias,
    no clamping, SiLU, affinity on H)."""
    n = _STATE["num_programs"]
    kernel_assert(kernel_type_option == KernelTypeOption.DROPLESS, "Currently only supports DROPLESS kernel type")
    kernel_assert(affinity_option == AffinityOption.AFFINITY_ON_H and not bias and clamp_limits is None,
                  "double: AFFINITY_ON_H, no bias, no clamping")
    kernel_assert(activation_type == BwdActFnType.SiLU, "double: SiLU only")
    T1, H = hidden_states.shape
    E, I, H2 = down_proj_weight.shape
    B = block_size
    kernel_assert(H2 == H and tuple(gate_up_proj_weight.shape) == (E, H, 2, I), "weights must be [E,H,2,I], [E,I,H]")
    kernel_assert(B in (128, 256, 512, 1024), f"block_size must be 128, 256, 512, or 1024, got {B}")
    kernel_assert(I % 2 == 0 and H % 2 == 0, "I_TP and H must be divisible by 2")
    kernel_assert(H % n == 0 and (H // n) % 32 == 0, f"H/num_shards must be a multiple of 32 (H={H}, shards={n})")
    kernel_assert(I % n == 0 and (I // n) % 32 == 0, f"I_TP/num_shards must be a multiple of 32 (I={I}, shards={n})")
    kernel_assert(E == 1 or E % n == 0, f"gradient init splits E={E} experts E // num_shards per core")
    kernel_assert(tuple(expert_affinities_masked.shape) == (T1 * E, 1), "expert_affinities_masked must be [T*E, 1]")
    kernel_assert(output_hidden_states_grad.shape == hidden_states.shape, "output_hidden_states_grad must be [T, H]")
    dts = {t.dtype for t in (hidden_states, expert_affinities_masked, gate_up_proj_weight, down_proj_weight,
                             gate_up_proj_act_checkpoint_T, down_proj_act_checkpoint, output_hidden_states_grad)}
    kernel_assert(len(dts) == 1 and next(iter(dts)) in _float_dtypes(),
                  f"Supported input dtypes: bfloat16, float16 (one dtype); got {dts}")
    N = _check_block_map(token_position_to_id, block_to_expert, B, T1 - 1, E)
    kernel_assert(tuple(gate_up_proj_act_checkpoint_T.shape) == (N, 2, I, B), "gate_up_proj_act_checkpoint_T: [N,2,I,B]")
    kernel_assert(tuple(down_proj_act_checkpoint.shape) == (N, B, H), "down_proj_act_checkpoint: [N, B, H]")

    idx, xb = _gather_blocks(hidden_states, token_position_to_id, N, B)
    _, g = _gather_blocks(output_hidden_states_grad, token_position_to_id, N, B)
    e = block_to_expert.long().view(N)
    aff2d = expert_affinities_masked.float().view(T1, E)
    aff = aff2d[idx, e[:, None]]
    aff_grad_blocks = (g * down_proj_act_checkpoint.float()).sum(-1)  # d loss / d affinity, [N, B]
    dog = g * aff[..., None]  # gradient at the down projection's output
    gate = gate_up_proj_act_checkpoint_T[:, 0].float().transpose(1, 2)  # [N, B, I]
    up = gate_up_proj_act_checkpoint_T[:, 1].float().transpose(1, 2)
    sg = torch.sigmoid(gate)
    act = gate * sg
    W_down = down_proj_weight.float()[e]  # [N, I, H]
    W_gu = gate_up_proj_weight.float()[e].reshape(N, H, 2 * I)
    d_down = torch.bmm((act * up).transpose(1, 2), dog)  # [N, I, H]
    fdg = torch.bmm(dog, W_down.transpose(1, 2))  # [N, B, I]
    gug = torch.cat((fdg * up * sg * (1 + gate * (1 - sg)), fdg * act), -1)  # [N, B, 2I]: gate | up
    d_gu = torch.bmm(xb.transpose(1, 2), gug)  # [N, H, 2I]
    d_h = torch.bmm(gug, W_gu.transpose(1, 2))  # [N, B, H]

    # all gradients are zero-initialised by the kernel (_initialize_gradient_outputs_shard)
    dev = hidden_states.device
    down_grad = torch.zeros(E, I, H, device=dev).index_add_(0, e, d_down).to(down_proj_weight.dtype)
    gu_grad = torch.zeros(E, H, 2 * I, device=dev).index_add_(0, e, d_gu).view(E, H, 2, I).to(gate_up_proj_weight.dtype)
    flat_idx, flat = idx.reshape(-1), d_h.reshape(N * B, H)
    hs_grad = torch.zeros(T1, H, device=dev)
    hs_grad = hs_grad.index_add_(0, flat_idx, flat) if is_tensor_update_accumulating else hs_grad.index_copy_(0, flat_idx, flat)
    aff_grad = torch.zeros(T1, E, device=dev).index_put_((idx.reshape(-1), e[:, None].expand(N, B).reshape(-1)),
                                             aff_grad_blocks.reshape(-1))
    return (hs_grad.to(hidden_states.dtype), aff_grad.reshape(-1, 1).to(expert_affinities_masked.dtype),
            gu_grad, down_grad)


# ------------------------------------------------------------------ the backend the wrappers take
def backend(widen_float32: bool = False):
    from qwen3_research.kernels.nki import Backend, shard_on_i_constants

    _STATE["widen_float32"] = widen_float32
    return Backend(
        nki_op=nki_op, wrap_nki=wrap_nki, rope_hf=rope_hf, moe_fwd=blockwise_mm_baseline_shard_intermediate,
        blockwise_mm_bwd=blockwise_mm_bwd,
        fwd_kwargs=shard_on_i_constants(ActFnType, ExpertAffinityScaleMode),  # the production constants
        bwd_kwargs=dict(shard_option=ShardOption.SHARD_ON_HIDDEN, affinity_option=AffinityOption.AFFINITY_ON_H,
                        kernel_type_option=KernelTypeOption.DROPLESS, activation_type=BwdActFnType.SiLU),
        nl_dtype=lambda dt: dt,
    )


def set_widen_float32(on: bool) -> None:
    _STATE["widen_float32"] = on


def pretend_neuron_packages(monkeypatch) -> None:
    """A simulated Neuron host for the registry's package check: torch_neuronx, nki and nkilib are found
    (the doubles above stand in for what the wrappers take from them); every other module as usual."""
    from qwen3_research.kernels import nki, registry

    real = registry._find_spec
    monkeypatch.setattr(registry, "_find_spec", lambda util, name: object() if name in nki._MODULES else real(util, name))
