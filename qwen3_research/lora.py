"""LoRA adapters through PEFT on a frozen base, on ``model=hf`` and ``model=native`` (dense and MoE): ``model.lora.*``.

The API (what the step, the checkpointer, the planner and the exports use):

- ``hf_module_name(name) -> str | None``: a module path of either backend as Hugging Face's Qwen3 names it
  (``layers.3.attention.qkv_linear.wq`` -> ``model.layers.3.self_attn.q_proj``); None for a module HF has no
  counterpart of. Wrappers (torch.compile's ``_orig_mod``, activation checkpointing's) are ignored.
- ``target_names(model, lora_cfg) -> list[str]``: the model's Linear modules that get an adapter (HF names matched
  against ``model.lora.target_modules``); MoE experts are never among them (they are not Linears).
- ``apply_lora(backend, lora_cfg) -> dict``: PEFT's ``inject_adapter_in_model`` with a ``peft.LoraConfig`` on
  ``backend.model`` in place (the model keeps its own class and names, so sharding, kernels and the loss see the
  same model), every base parameter frozen; returns {"targets", "trainable", "total"}. Call it on the whole model
  (before sharding; on meta tensors too). model=native must have been built with q/k/v as three Linears
  (``titan.separate_qkv``: torchtitan 0.3 fuses them, and one adapter on the fused ``wqkv`` would share one A
  across q, k and v, which is not HF's adapter).
- ``freeze_base(model)``: only the adapters require gradients; call it again after sharding (sharding re-creates
  parameters with requires_grad=True).
- ``init_adapters(model, seed)``: every adapter's weights, in any layout (whole, FSDP- or TP-sharded): A drawn as
  PEFT draws it (kaiming-uniform, a=sqrt(5)) from a generator seeded by ``seed`` and the module's HF name, B zero.
  The same seed gives the same adapters on both backends and every layout. Call it after the weights exist
  (after sharding / materializing).
- ``adapter_state_dict(model) -> dict``: the adapters as full tensors under PEFT's keys for the HF base
  (``base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight``); collective under a sharded model.
- ``tp_plan(plan, root, no_parallel) -> dict``: a tensor-parallel plan over Linears rewritten for their adapters.
- ``check_run(rc, degrees, backend_spec, is_moe=False)``: the combinations refused before any worker starts
  (resolve.py), and targets a MoE has no Linear for.
- ``is_adapter_key(key)``, ``base_key(key)``: a state-dict key of an adapter; a base weight's key without PEFT's
  ``base_layer`` (what loaders of the base's weights match).
- ``peft_config(lora_cfg, targets=None) -> peft.LoraConfig``: the PEFT config of these keys (adapter_config.json).
- ``count_line(trainable, total)``: PEFT's ``print_trainable_parameters`` line.
- ``base_fingerprint(model_cfg, seed) -> dict``: the base a LoRA checkpoint needs: its path (or flavor and seed)
  and a sha256 of its weight files' contents; ``base_difference(saved, now)`` says why two differ (None: same).
"""

from __future__ import annotations

import hashlib
import math
import os
import re
import zlib
from pathlib import Path

from qwen3_research.config import ConfigError, LoraConfig

ADAPTER = "default"  # PEFT's adapter name (its modules: lora_A.default, lora_B.default)
_WRAPPERS = re.compile(r"(^|\.)(_orig_mod|_checkpoint_wrapped_module|_fsdp_wrapped_module|base_model\.model)(?=\.|$)")
# native module path (torchtitan 0.3.x and 0.2.x) -> HF's, per projection; MoE experts are parameters, not Linears
_NATIVE_TO_HF = (
    (re.compile(r"^layers\.(\d+)\.attention\.(?:qkv_linear\.)?wq$"), r"model.layers.\1.self_attn.q_proj"),
    (re.compile(r"^layers\.(\d+)\.attention\.(?:qkv_linear\.)?wk$"), r"model.layers.\1.self_attn.k_proj"),
    (re.compile(r"^layers\.(\d+)\.attention\.(?:qkv_linear\.)?wv$"), r"model.layers.\1.self_attn.v_proj"),
    (re.compile(r"^layers\.(\d+)\.attention\.wo$"), r"model.layers.\1.self_attn.o_proj"),
    (re.compile(r"^layers\.(\d+)\.feed_forward\.w1$"), r"model.layers.\1.mlp.gate_proj"),
    (re.compile(r"^layers\.(\d+)\.feed_forward\.w3$"), r"model.layers.\1.mlp.up_proj"),
    (re.compile(r"^layers\.(\d+)\.feed_forward\.w2$"), r"model.layers.\1.mlp.down_proj"),
)
_HF = re.compile(r"^model\.layers\.\d+\.(?:self_attn\.(?:q|k|v|o)_proj|mlp\.(?:gate|up|down)_proj)$")


def _clean(name: str) -> str:
    return _WRAPPERS.sub("", name).lstrip(".")


def hf_module_name(name: str) -> str | None:
    """``name`` (a module path of model=native or model=hf) in HF's Qwen3 names; None: not a target projection."""
    name = _clean(name)
    if _HF.match(name):
        return name
    for pattern, hf in _NATIVE_TO_HF:
        if pattern.match(name):
            return pattern.sub(hf, name)
    return None


_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


def check_run(rc, degrees, backend_spec, is_moe: bool = False) -> None:
    """The combinations a LoRA run cannot run, refused in one line before any worker starts (resolve.resolve_run).
    ``is_moe``: every decoder layer's MLP is experts (parameters, not Linears), so only attention takes adapters;
    without this the miss surfaced in each rank's build (apply_lora), after the workers started."""
    lc = rc.model.lora
    if not lc.enable:
        return
    if is_moe and not set(lc.target_modules) & set(_ATTENTION):
        raise ConfigError(f"model.lora.target_modules={list(lc.target_modules)} match no module of this MoE model: its "
                          "MLPs are experts, which stay frozen; add the attention projections (q_proj, k_proj, "
                          "v_proj, o_proj)")
    if degrees.tp > 1 and backend_spec.torchtitan:
        raise ConfigError(f"model.lora.enable=true with parallelism.tp={degrees.tp} on model={backend_spec.name}: the "
                          "adapters have no tensor-parallel plan on torchtitan's sharded Linears yet; use parallelism.tp=1 "
                          "(FSDP and EP work), or model=hf for LoRA under tensor parallel")
    if degrees.tp > 1 and lc.dropout > 0:
        raise ConfigError(f"model.lora.dropout={lc.dropout:g} with parallelism.tp={degrees.tp}: each tensor-parallel "
                          "rank would draw its own dropout mask on the replicated adapter input; use model.lora.dropout=0")
    if rc.checkpoint.export_hf and not (rc.model.path or rc.model.init_from):
        # the PEFT adapter is for a base's Hugging Face checkpoint (run/export_peft.py): a seeded base has none
        raise ConfigError("checkpoint.export_hf=true with model.lora.enable=true needs the base as a Hugging Face "
                          "directory (model.init_from=DIR on model=native, model.path=DIR on model=hf): the exported "
                          "PEFT adapter is for that checkpoint; export a seeded base first (python -m "
                          "qwen3_research.export) or use checkpoint.export_hf=false")


def tp_plan(plan: dict, root: nn.Module, no_parallel) -> dict:
    """A tensor-parallel plan (module path -> ParallelStyle) whose Linears may carry an adapter, made consistent
    with the base's sharding: the base Linear takes the style under ``base_layer``; a colwise base gets lora_A
    replicated (its input is) and lora_B colwise (its output is sharded as the base's); a rowwise base gets lora_A
    rowwise (its input is sharded; the r-wide output all-reduced) and lora_B replicated. ``no_parallel``: the
    replicated style (titan.no_parallel). Exact: the same sums as one process, in another order."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    out = {}
    for key, style in plan.items():
        module = root.get_submodule(key)
        if not _is_lora_layer(module):
            out[key] = style
            continue
        out[f"{key}.base_layer"] = style
        if isinstance(style, ColwiseParallel):
            out[f"{key}.lora_A.{ADAPTER}"] = no_parallel(use_local_output=True)
            out[f"{key}.lora_B.{ADAPTER}"] = ColwiseParallel()
        elif isinstance(style, RowwiseParallel):
            out[f"{key}.lora_A.{ADAPTER}"] = RowwiseParallel()
            out[f"{key}.lora_B.{ADAPTER}"] = no_parallel(use_local_output=True)
        else:
            raise ConfigError(f"model.lora: {key} is sharded with {type(style).__name__}, which has no adapter plan; "
                              f"leave {key.rsplit('.', 1)[-1]} out of model.lora.target_modules")
    return out


def _is_lora_layer(module: nn.Module) -> bool:
    from peft.tuners.lora import LoraLayer  # deferred: see peft_config

    return isinstance(module, LoraLayer)


def is_adapter_key(key: str) -> bool:
    """A state-dict key or parameter name of an adapter (``...q_proj.lora_A.default.weight``)."""
    return ".lora_" in key


def base_key(key: str) -> str:
    """A base weight's key as the model without adapters names it (PEFT moves it under ``base_layer``)."""
    return key.replace(".base_layer.", ".")


def target_names(model: nn.Module, lora_cfg: LoraConfig) -> list[str]:
    """The module paths of ``model`` (as named there) whose HF name's projection is in ``model.lora.target_modules``."""
    import torch.nn as nn  # deferred: resolve.py (start-up, no torch) imports this module for check_run

    wanted = set(lora_cfg.target_modules)
    out = []
    for name, module in model.named_modules():
        hf = hf_module_name(name)
        if hf is not None and hf.rsplit(".", 1)[1] in wanted and isinstance(module, nn.Linear):
            out.append(name)
    return out


def peft_config(lora_cfg: LoraConfig, targets=None):
    """PEFT's LoraConfig for these keys; ``targets``: module paths (default: the HF projection names)."""
    from peft import LoraConfig as PeftLoraConfig  # deferred: peft imports transformers (seconds), only LoRA runs

    return PeftLoraConfig(r=int(lora_cfg.rank), lora_alpha=float(lora_cfg.alpha), lora_dropout=float(lora_cfg.dropout),
                          target_modules=list(targets if targets is not None else lora_cfg.target_modules),
                          bias="none", task_type="CAUSAL_LM")


def apply_lora(backend, lora_cfg: LoraConfig) -> dict:
    """PEFT LoRA layers injected into ``backend.model`` in place; the base frozen. See the module docstring."""
    from peft import inject_adapter_in_model  # deferred: see peft_config

    model = backend.model
    for name, module in model.named_modules():  # one adapter on a fused q/k/v would share A across q, k and v
        if _clean(name).endswith("wqkv"):
            raise ConfigError("model.lora.enable=true: this native model fuses q/k/v into one wqkv Linear; build it "
                              "with titan.separate_qkv (models/native/model.py does when model.lora.enable=true)")
    targets = target_names(model, lora_cfg)
    if not targets:
        raise ConfigError(f"model.lora.target_modules={list(lora_cfg.target_modules)} match no Linear module of "
                          f"this model ({type(model).__name__}); MoE experts are never targeted: add q_proj, k_proj, "
                          "v_proj or o_proj")
    for p in model.parameters():
        p.requires_grad_(False)
    inject_adapter_in_model(peft_config(lora_cfg, targets), model, adapter_name=ADAPTER)
    trainable = freeze_base(model)  # PEFT marks the adapters trainable; this is the rule, stated once
    total = sum(p.numel() for p in model.parameters())
    matched = sorted({hf_module_name(t).rsplit(".", 1)[1] for t in targets})
    return {"targets": matched, "modules": len(targets), "trainable": trainable, "total": total,
            "unmatched": sorted(set(lora_cfg.target_modules) - set(matched))}


def count_line(trainable: int, total: int) -> str:
    """PEFT's own wording (PeftModel.print_trainable_parameters)."""
    return f"trainable params: {trainable:,d} || all params: {total:,d} || trainable%: {100 * trainable / total:.4f}"


def freeze_base(model: nn.Module) -> int:
    """Only the adapters require gradients (again): sharding re-creates parameters (``nn.Parameter(distribute_tensor(
    ...))`` in torch's TP styles and ours) with requires_grad=True, which trained the base's q/k norms under TP.
    Returns the trainable count (this rank's elements)."""
    for name, p in model.named_parameters():
        p.requires_grad_(is_adapter_key(name))
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def lora_layers(model: nn.Module):
    """(HF module name, PEFT LoRA layer) for every adapter of ``model``."""
    from peft.tuners.lora import LoraLayer  # deferred: see peft_config

    for name, module in model.named_modules():
        if isinstance(module, LoraLayer) and ADAPTER in module.lora_A:
            yield hf_module_name(name) or _clean(name), module


def _seed_for(seed: int, name: str) -> int:
    return (int(seed) * 1_000_003 + zlib.crc32(name.encode())) % (2 ** 63)


def init_adapters(model: nn.Module, seed: int) -> int:
    """Every adapter's A (kaiming-uniform, a=sqrt(5): PEFT's default) from a per-module generator, B zero; any
    layout (a DTensor gets its shard of the same full tensor). Returns how many adapters."""
    import torch  # deferred: see target_names
    import torch.nn as nn
    from torch.distributed.tensor import DTensor, distribute_tensor

    n = 0
    with torch.no_grad():
        for name, layer in lora_layers(model):
            for which in ("lora_A", "lora_B"):
                p = getattr(layer, which)[ADAPTER].weight
                full = torch.zeros(tuple(p.shape), dtype=torch.float32)
                if which == "lora_A":
                    gen = torch.Generator().manual_seed(_seed_for(seed, name))
                    nn.init.kaiming_uniform_(full, a=math.sqrt(5), generator=gen)
                if isinstance(p, DTensor):
                    p.copy_(distribute_tensor(full.to(p.dtype), p.device_mesh, p.placements))
                else:
                    p.copy_(full.to(device=p.device, dtype=p.dtype))
            n += 1
    return n


def adapter_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapters as full CPU tensors under PEFT's keys for the HF base model (what ``adapter_model.safetensors``
    holds); collective under a sharded model (every rank must call it)."""
    out = {}
    for name, layer in lora_layers(model):
        for which in ("lora_A", "lora_B"):
            p = getattr(layer, which)[ADAPTER].weight
            full = p.full_tensor() if hasattr(p, "full_tensor") else p
            out[f"base_model.model.{name}.{which}.weight"] = full.detach().cpu().clone()
    return out


# -- the base a LoRA checkpoint needs ---------------------------------------------------------------
_HASHES: dict = {}


def _files_sha256(folder: Path) -> str | None:
    """sha256 over the weight files of an HF directory (names and contents, in name order); None: none there."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        return None
    key = tuple((str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files)
    if key not in _HASHES:
        h = hashlib.sha256()
        for f in files:
            h.update(f.name.encode() + b"\0")
            with open(f, "rb") as fh:
                for chunk in iter(lambda: fh.read(1 << 24), b""):
                    h.update(chunk)
        _HASHES[key] = h.hexdigest()
    return _HASHES[key]


def base_fingerprint(model_cfg, seed: int) -> dict:
    """What a LoRA run's base is: {"path", "sha256"} for an HF directory (model.path / model.init_from), or
    {"flavor", "seed"} for a seeded native model. ``model_cfg``: a ModelConfig or its dict."""
    get = model_cfg.get if isinstance(model_cfg, dict) else (lambda k, d=None: getattr(model_cfg, k, d))
    path = get("path") or get("init_from")
    if path:
        folder = Path(os.path.expanduser(path))
        return {"path": str(path), "sha256": _files_sha256(folder) if folder.is_dir() else None}
    return {"backend": get("backend"), "flavor": get("flavor"), "seed": int(seed)}


def base_difference(saved: dict | None, now: dict) -> str | None:
    """Why the base ``now`` is not the checkpoint's ``saved`` one (None: the same, or nothing recorded)."""
    if not saved:
        return None
    if saved.get("sha256") and now.get("sha256") and saved["sha256"] != now["sha256"]:
        return f"its weights differ (sha256 {saved['sha256'][:12]}… saved, {now['sha256'][:12]}… now, at {now.get('path')})"
    for key in ("path", "flavor", "seed"):
        if key in saved and saved.get(key) != now.get(key) and not (key == "path" and saved.get("sha256")):
            return f"{key} {saved.get(key)!r} saved, {now.get(key)!r} now"
    return None
