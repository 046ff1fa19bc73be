"""What the torchtitan adapter does the same way on every supported torchtitan API (``qwen3_research.titan``
re-exports it): which API is installed (feature detection), version facts for the doctor, the MoE
token-group padding for TorchNeuron's grouped matmul, and the few torchtitan calls that did not change
between 0.2.x and 0.3.x. Nothing here imports torchtitan at module import.
"""

from __future__ import annotations

import contextlib

import functools


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("torchtitan")
    except PackageNotFoundError:
        return "not installed"



# -- which torchtitan API (feature detection, never the version string) ------------------------
# torchtitan 0.3.0 builds models from nested ``Config`` objects (``torchtitan.models.common``:
# CosSinRoPE, Embedding, Linear, ...). Upstream 0.2.2 and AWS's torchtitan-neuron fork built on it
# (0.2.2+neuron.1) build from a ``Qwen3ModelArgs`` dataclass and parallelize from a ``JobConfig``
# (github.com/pytorch/torchtitan tag v0.2.2: torchtitan/models/qwen3/__init__.py,
# infra/parallelize.py). The facade (``titan/__init__.py``) asks ``legacy()`` once and binds v02 or v03.
def module_exists(name: str) -> bool:
    """Whether torchtitan ships module ``name``, found on disk without executing any torchtitan code.

    (Importing torchtitan before ``device.prepare_torchtitan`` would fix its device type to cuda.)
    """
    from importlib.machinery import PathFinder

    path, spec = None, None
    for part in name.split("."):
        spec = PathFinder.find_spec(part, path)
        if spec is None:
            return False
        path = spec.submodule_search_locations
    return spec is not None


@functools.lru_cache(maxsize=None)
def legacy() -> bool:
    """True for the torchtitan 0.2.x API (ModelArgs + JobConfig), False for 0.3.x (Config objects)."""
    # torchtitan absent: the 0.3.x path, whose first import then names the missing package.
    return module_exists("torchtitan") and not module_exists("torchtitan.models.common")



def needs() -> str:
    """The middle of a one-line ConfigError: the torchtitan it needs and the one installed here."""
    return f"needs torchtitan>=0.3.0 (found {version()})"


# -- MoE token groups aligned for TorchNeuron's grouped matmul --------------------------------------
# TorchNeuron's aten::_grouped_mm (2D x 3D, the expert forward) requires every group offset and the row
# count to be multiples of TORCH_NEURONX_ATEN_GMM_ALIGN (default 128): torch_neuronx/python_ops/grouped_mm.py
# (``validate_offs``) and torch_neuronx/utils.py (``get_gmm_align``) in parmoham-aws/test-repo-parmoham.
# Neither torchtitan pads to it on Neuron: 0.2.2 pads groups to TOKEN_GROUP_ALIGN_SIZE_M = 8
# (torchtitan/models/moe/utils.py, settable by set_token_group_alignment_size_m) with a Triton index
# kernel that cannot run on a Neuron device (AWS's GPT-OSS diff, docs/torchtitan/gpt-oss/TorchTitan.diff,
# patches that file to 128 with the CPU fallback and copies back); 0.3.0 pads only through
# TorchAOTokenDispatcher(pad_multiple=...), which calls torchao's permute_and_pad (torchao is not part
# of the Neuron stack). So the adapter pads, the same way on both, with static shapes (no host read).
NEURON_GROUP_ALIGN = 128


def align_token_groups(model, device_type: str, align: int | None, unpadded_forward) -> int:
    """On neuron: every GroupedExperts pads each expert's rows to a multiple of ``align`` (default
    TORCH_NEURONX_ATEN_GMM_ALIGN or 128) before torchtitan's grouped matmuls and drops the padding after.
    Returns the number of modules changed (0 off neuron). Kernel overrides replace the forward later.
    ``unpadded_forward(base)``: the API's expert computation on already padded groups (v03, v02)."""
    import os

    if device_type != "neuron":
        return 0
    align = int(align or os.environ.get("TORCH_NEURONX_ATEN_GMM_ALIGN") or NEURON_GROUP_ALIGN)
    n = 0
    for module in model.modules():
        if type(module).__name__ == "GroupedExperts" and not hasattr(module, "group_align"):
            module.__class__ = _aligned_experts_class(type(module), unpadded_forward)
            module.group_align = align
            n += 1
    return n



@functools.lru_cache(maxsize=None)
def _aligned_experts_class(base, unpadded_forward):
    experts = unpadded_forward(base)

    def forward(self, x, num_tokens_per_expert):
        slot, padded_counts, M = padded_groups(num_tokens_per_expert, x.shape[0], self.group_align)
        x_pad = x.new_zeros(M, x.shape[1]).index_copy(0, slot, x)
        return experts(self, x_pad, padded_counts).index_select(0, slot)

    def padded_rows(self, x, num_tokens_per_expert):
        """Rows added to align the groups (qwen3_research.routing's statistics): sum_e ceil(c_e/a)·a - c_e."""
        c, a = num_tokens_per_expert.to(torch.int64), self.group_align
        return ((c + (a - 1)) // a * a - c).sum()

    import torch

    return type(base.__name__, (base,), {"forward": forward, "padded_rows": padded_rows, "__module__": __name__})


def padded_groups(counts, rows: int, align: int):
    """(slot of each expert-sorted row in the padded layout [R], padded counts [E], padded rows M).

    Each expert's c_e rows start at a multiple of ``align``; M = the worst case over all routings,
    ceil((R + E·(align-1)) / align)·align, so the shape is static (one compiled graph) and every offset
    cumsum(padded counts) <= M is a multiple of ``align``. Device-side ops only."""
    import torch

    E = counts.shape[0]
    M = -(-(rows + E * (align - 1)) // align) * align
    cnt = counts.to(torch.int64)
    padded = (cnt + (align - 1)) // align * align
    start = torch.cumsum(cnt, 0) - cnt
    pstart = torch.cumsum(padded, 0) - padded
    r = torch.arange(rows, device=counts.device)
    e_of_row = torch.searchsorted(torch.cumsum(cnt, 0), r, right=True).clamp_(max=E - 1)
    slot = pstart[e_of_row] + (r - start[e_of_row])
    return slot, padded.to(counts.dtype), M



def native_only_buffer(key: str) -> bool:
    """State-dict keys with no Qwen3 HF counterpart: the MoE routing bias (0.3.x ``expert_bias_E``,
    0.2.x ``expert_bias``), which stays 0 on HF import and is dropped on export."""
    return key.endswith(("moe.expert_bias_E", "moe.expert_bias"))



def clip_grad_norm_(params, max_norm: float, *, ep_enabled: bool, pp_mesh=None):
    """torchtitan's clipping; ``pp_mesh``: the norm is of every stage's gradients (summed over the pipeline ranks)."""
    from torchtitan.distributed.utils import clip_grad_norm_ as tt_clip

    if pp_mesh is None:
        return tt_clip(params, max_norm, foreach=True, ep_enabled=ep_enabled)
    return tt_clip(params, max_norm, foreach=True, ep_enabled=ep_enabled, pp_mesh=pp_mesh)



# -- doctor --------------------------------------------------------------------------------------
def distribution() -> dict:
    """Which torchtitan is installed: version, and whether it is AWS's torchtitan-neuron fork.

    The fork (https://github.com/aws-neuron/torchtitan-neuron, release-2.33) installs the package
    ``torchtitan`` with a ``+neuron`` local version, e.g. ``0.2.2+neuron.1`` (Neuron 2.33 release
    notes, release-notes/components/torchtitan-neuron); an editable install records its Git URL.
    """
    import json
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import distribution as dist

    try:
        d = dist("torchtitan")
    except PackageNotFoundError:
        return {"installed": False, "version": None, "fork": False, "source": None}
    source = None
    try:
        source = json.loads(d.read_text("direct_url.json") or "{}").get("url")
    except ValueError:
        pass
    fork = "+neuron" in d.version or "torchtitan-neuron" in (source or "")
    return {"installed": True, "version": d.version, "fork": fork, "source": source}


def gpu_peak_flops(device_name: str) -> float:
    """torchtitan's dense bf16 peak FLOP/s for a GPU name (its table tells H100 SXM / PCIe / NVL
    apart, reading ``lspci`` where it can). Unknown names get torchtitan's A100 fallback."""
    from torchtitan.tools.utils import get_peak_flops

    return float(get_peak_flops(device_name))



# -- flex attention --
def flex_attention_masks(model, batch: int, seq_len: int, device):
    """The BlockMask torchtitan's trainer builds for FlexAttention (``Decoder.get_attention_masks``, as in
    torchtitan/trainer.py's post_dataloading_process), from positions 0..seq_len-1 in every row: one
    document per packed window, i.e. causal attention, the same maths as the SDPA path (``is_causal``)."""
    import torch

    model = getattr(model, "_orig_mod", model)  # torch.compile's wrapper
    positions = torch.arange(seq_len, device=device).expand(batch, seq_len)
    return model.get_attention_masks(positions=positions)



@contextlib.contextmanager
def balanced_expert_exchange():
    """The memory plan's expert-parallel token exchange: every rank sends and receives the balanced count.

    Under expert parallelism torchtitan's all-to-all dispatcher reads the exchanged per-expert token counts back
    on the host (``AllToAllTokenDispatcher._sync_token_count_exchange``: ``tolist``) to size its variable
    all-to-all; fake tensors have no values (``DataDependentOutputException: aten._local_scalar_dense``). While
    planning, the split sizes are None instead, which ``all_to_all_single`` reads as equal splits: each of the
    ep ranks gets 1/ep of every rank's routed tokens, the balanced routing a plan assumes (an unbalanced step
    holds more on the busier ranks). The counts tensor itself (used for the expert-major permutation and the
    grouped matmul's offsets, shapes only) is passed on unchanged. A torchtitan without that method: no change."""
    try:
        from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher
    except ImportError:
        AllToAllTokenDispatcher = None
    original = getattr(AllToAllTokenDispatcher, "_sync_token_count_exchange", None)
    if original is None:
        yield
        return

    def balanced(self, num_local_tokens_per_expert_E, num_global_tokens_per_local_expert_EP_e, ep_size):
        import torch

        counts = torch.ops._c10d_functional.wait_tensor(num_global_tokens_per_local_expert_EP_e)
        return counts.reshape(-1), None, None

    AllToAllTokenDispatcher._sync_token_count_exchange = balanced
    try:
        yield
    finally:
        AllToAllTokenDispatcher._sync_token_count_exchange = original


@contextlib.contextmanager
def float32_experts(model):
    """While open, torchtitan's MoE experts of ``model`` compute in float32; yields whether they do.

    ``GroupedExperts`` always casts to bfloat16, so a MoE model's logits carry bf16 rounding that a few tokens
    whose routing is a near-tie amplify (0.056 at seq 128 x 4 after 3 steps, against 1e-3 typically), while
    transformers' Qwen3-MoE computes in float32. The export verifies its reload against the trained weights
    computed in float32 (``run.export_hf.reference_logits``), which is then exact. A per-expert loop (one host
    sync: verification only). False, nothing changed: a torchtitan without that class (0.2.x), or experts whose
    forward is not the class's (a kernel, TorchNeuron's padding, torchtitan's EP/TP wrapper bound at parallelize)."""
    try:
        from torchtitan.models.common.moe import GroupedExperts
    except ImportError:
        yield False
        return
    experts = [m for m in model.modules() if isinstance(m, GroupedExperts)]
    if not experts or any("forward" in vars(m) or type(m).forward is not GroupedExperts.forward for m in experts):
        yield False
        return
    original = GroupedExperts.forward
    GroupedExperts.forward = _float32_experts_forward
    try:
        yield True
    finally:
        GroupedExperts.forward = original


def _float32_experts_forward(self, x_RD, num_tokens_per_expert_E):
    """``GroupedExperts.forward`` in float32: SwiGLU of each expert over its contiguous group of rows."""
    import torch.nn.functional as F

    w1, w2, w3 = ((w.to_local() if hasattr(w, "to_local") else w).float()
                  for w in (self.w1_EFD, self.w2_EDF, self.w3_EFD))
    x = x_RD.float()
    out = x.new_zeros(x.shape[0], w2.shape[1])
    start = 0
    for e, n in enumerate(num_tokens_per_expert_E.tolist()):
        if n:
            rows = x[start:start + n]
            out[start:start + n] = (F.silu(rows @ w1[e].t()) * (rows @ w3[e].t())) @ w2[e].t()
        start += n
    return out.type_as(x_RD)
