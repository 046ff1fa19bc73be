"""Hugging Face safetensors -> a native (possibly sharded) Qwen3 model, each rank reading only its part.

The same steps as torchtitan's own HF loading (``components/checkpointer/dcp.py: dcp_load(from_hf=True)``):
the model's ``state_dict()`` (local shards, as DTensors when sharded) is renamed to HF keys by
torchtitan's ``Qwen3StateDictAdapter.to_hf``, ``torch.distributed.checkpoint.load`` fills those
tensors through ``HuggingFaceStorageReader`` (each rank reads the byte ranges of its own shards),
``from_hf`` maps them back and ``load_state_dict`` copies them into the parameters.

Memory: every tensor loaded into is a rank-local shard, except what torchtitan's fused-QKV state-dict
hooks gather per layer (q/k/v of each attention, replicated) and the per-expert views of the
grouped MoE weights; no rank materialises the full model (measured in tests/test_hf_interop.py).

dtype: each stored tensor (bf16, fp16 or fp32) is converted to the parameter's dtype on copy
(``Tensor.copy_`` inside DCP): a bf16 checkpoint trained in fp32 gets bf16 values widened exactly;
training.mixed_precision=bf16 then casts them back for compute only.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import HuggingFaceStorageReader

from qwen3_research import lora, titan
from qwen3_research.errors import ConfigError


def _first_line(e: BaseException) -> str:
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return f"{type(e).__name__}: {lines[0] if lines else ''}"[:300]


def _chunks(model: torch.nn.Module):
    """(module, prefix, its state_dict) piece by piece: the top-level tensors (embedding, final norm,
    lm_head) first, then one decoder layer at a time, so only one layer's fused-QKV gather is alive."""
    top = {}
    for name, child in model.named_children():
        if name != "layers":
            top.update(child.state_dict(prefix=f"{name}."))
    top.update({n: p for n, p in model.named_parameters(recurse=False)})
    yield model, "", top
    layers = getattr(model, "layers", {})
    for key, layer in (layers.items() if hasattr(layers, "items") else enumerate(layers)):
        yield layer, f"layers.{key}.", layer.state_dict(prefix=f"layers.{key}.")


def load_hf_weights(model: torch.nn.Module, model_config, hf_dir: str) -> dict:
    """Fill a materialised (sharded or not) native Qwen3 from ``hf_dir``; collective when distributed.

    One ``dcp.load`` per piece (``_chunks``): the peak is this rank's shards plus one layer's
    temporaries. Returns {"tensors": n, "ignored": [stored keys the model does not use]}.
    """
    where = f"model.init_from={hf_dir!r}"
    path = str(Path(os.path.expanduser(hf_dir)))
    top_adapter = titan.state_dict_adapter(model_config)
    # Layer pieces carry no embedding: torchtitan's from_hf would otherwise re-tie lm_head from a missing one.
    layer_adapter = titan.state_dict_adapter(dataclasses.replace(model_config, enable_weight_tying=False))
    try:
        stored = HuggingFaceStorageReader(path).read_metadata().state_dict_metadata
    except Exception as e:  # noqa: BLE001 - damaged headers raise SafetensorError / ValueError / OSError
        raise ConfigError(f"{where}: cannot read the safetensors ({_first_line(e)})") from None
    used: set[str] = set()
    with torch.no_grad():
        for module, prefix, piece in _chunks(model):
            adapter = top_adapter if prefix == "" else layer_adapter
            # LoRA (qwen3_research/lora.py): the base weights under their own names, the adapters left to lora.py
            own = {lora.base_key(k): k for k in piece if not lora.is_adapter_key(k)}
            piece = {lora.base_key(k): v for k, v in piece.items()
                     if not titan.native_only_buffer(k) and not lora.is_adapter_key(k)}
            hf_sd = adapter.to_hf(piece)
            missing = sorted(k for k in hf_sd if k not in stored)
            bad = sorted(k for k in hf_sd if k in stored and tuple(stored[k].size) != tuple(hf_sd[k].shape))
            if missing or bad:
                parts = [f"{k}: stored {list(stored[k].size)} vs model {list(hf_sd[k].shape)}" for k in bad[:2]]
                parts += [f"{len(missing)} tensors missing (e.g. {missing[0]})"] if missing else []
                raise ConfigError(f"{where}: the safetensors do not fit the model: {'; '.join(parts)}")
            try:
                dcp.load(hf_sd, storage_reader=HuggingFaceStorageReader(path))
            except Exception as e:  # noqa: BLE001 - DCP wraps per-rank read errors in CheckpointException
                raise ConfigError(f"{where}: cannot read the safetensors ({_first_line(e)})") from None
            used.update(hf_sd)
            loaded = {own.get(k, k)[len(prefix):]: v for k, v in adapter.from_hf(hf_sd).items()}
            del hf_sd, piece
            # load_state_dict, not copies into state_dict(): the fused-QKV load hook merges wq/wk/wv.
            result = module.load_state_dict(loaded, strict=False)
            del loaded
            left = [k for k in result.missing_keys if not titan.native_only_buffer(k) and not lora.is_adapter_key(k)
                    and (prefix or not k.startswith("layers."))]
            if left or result.unexpected_keys:
                raise ConfigError(f"{where}: not loaded: {left[:3]} unexpected: {result.unexpected_keys[:3]}")
    return {"tensors": len(used), "ignored": sorted(set(stored) - used)}
