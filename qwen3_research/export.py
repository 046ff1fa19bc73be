"""Hugging Face export: config.json, safetensors (sharded with an index when large), tokenizer files.

At the end of a run (``checkpoint.export_hf=true``, into ``<run dir>/hf/``) or on demand:

    python -m qwen3_research.export <checkpoint dir> <out_dir> [--max-shard-size 5GB] [--force]

The model is gathered as a full state dict from any parallel layout, written into a
temporary directory, reloaded with ``AutoModelForCausalLM`` (no missing or unexpected
keys allowed) and compared with the trained model's logits on a held-out batch; only then
is it moved to ``out_dir``. The report lands in ``out_dir/export_verification.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
from pathlib import Path

import torch

from qwen3_research.errors import ConfigError, ExportError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt",
                   "special_tokens_map.json", "added_tokens.json")
REPORT = "export_verification.json"




# -- writing --------------------------------------------------------------------------------


def hf_config_for_flavor(flavor, moe: bool, eos_id: int | None):
    """Qwen3Config / Qwen3MoeConfig with the flavor's architecture (same fields init_from checks)."""
    from transformers import Qwen3Config, Qwen3MoeConfig

    from qwen3_research.hf_interop.config import hf_config_fields

    f = hf_config_fields(flavor, moe)
    common = dict(
        vocab_size=f["vocab_size"], hidden_size=f["hidden_size"], num_hidden_layers=f["num_hidden_layers"],
        num_attention_heads=f["num_attention_heads"], num_key_value_heads=f["num_key_value_heads"],
        head_dim=f["head_dim"], tie_word_embeddings=f["tie_word_embeddings"], rms_norm_eps=f["rms_norm_eps"],
        max_position_embeddings=flavor.max_seq_len,
        rope_parameters={"rope_type": "default", "rope_theta": f["rope_theta"]},
        bos_token_id=eos_id, eos_token_id=eos_id,
    )
    if moe:
        cfg = Qwen3MoeConfig(**common, moe_intermediate_size=f["moe_intermediate_size"],
                             intermediate_size=f["moe_intermediate_size"], num_experts=f["num_experts"],
                             num_experts_per_tok=f["num_experts_per_tok"], norm_topk_prob=True,
                             decoder_sparse_step=1, mlp_only_layers=[])
        cfg.architectures = ["Qwen3MoeForCausalLM"]
    else:
        cfg = Qwen3Config(**common, intermediate_size=f["intermediate_size"])
        cfg.architectures = ["Qwen3ForCausalLM"]
    cfg.dtype = "float32"
    return cfg


def write_safetensors(hf_sd: dict[str, torch.Tensor], out: Path, max_shard_size: str | int = "5GB") -> list[str]:
    """model.safetensors, or model-0000i-of-0000n.safetensors + model.safetensors.index.json."""
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file

    split = split_torch_state_dict_into_shards(hf_sd, filename_pattern="model{suffix}.safetensors",
                                               max_shard_size=max_shard_size)
    for filename, keys in split.filename_to_tensors.items():
        # clone: expert slices are views of one grouped tensor, which safetensors refuses to share
        save_file({k: hf_sd[k].detach().to("cpu").contiguous().clone() for k in keys}, str(out / filename),
                  metadata={"format": "pt"})
    if split.is_sharded:
        index = {"metadata": {"total_size": sum(v.numel() * v.element_size() for v in hf_sd.values())},
                 "weight_map": split.tensor_to_filename}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True))
    return sorted(split.filename_to_tensors)


def copy_tokenizer(tokenizer_json: Path, out: Path) -> list[str]:
    copied = []
    for name in TOKENIZER_FILES:
        src = Path(tokenizer_json).parent / name
        if src.is_file():
            shutil.copyfile(src, out / name)
            copied.append(name)
    return copied


def write_native(tmp: Path, backend, full_sd: dict, eos_id: int | None, max_shard_size) -> dict:
    from qwen3_research import titan

    notes = []
    bias = [v for k, v in full_sd.items() if k.endswith("expert_bias_E")]
    if bias and max(float(b.abs().max()) for b in bias) > 0:
        notes.append(f"native routing bias expert_bias_E (max |b|={max(float(b.abs().max()) for b in bias):.3g}) "
                     "has no Qwen3-MoE counterpart and is dropped: routing may differ")
    hf_sd = titan.state_dict_adapter(backend.model_config).to_hf(full_sd)
    hf_config_for_flavor(backend.flavor, backend.is_moe, eos_id).save_pretrained(tmp)
    return {"files": write_safetensors(hf_sd, tmp, max_shard_size), "notes": notes}


def write_hf_backend(tmp: Path, backend, full_sd: dict, max_shard_size) -> dict:
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        fresh = AutoModelForCausalLM.from_config(backend.config, dtype=torch.float32)
    fresh.load_state_dict(full_sd, strict=False, assign=True)
    fresh.tie_weights()
    fresh.save_pretrained(tmp, max_shard_size=max_shard_size)
    return {"files": sorted(p.name for p in tmp.glob("*.safetensors")), "notes": []}


# -- verification ---------------------------------------------------------------------------


@torch.no_grad()
def verify_reload(hf_dir: Path, inputs: torch.Tensor, reference_logits: torch.Tensor) -> dict:
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32, attn_implementation="sdpa",
                                                       output_loading_info=True, use_safetensors=True)
    model.eval()
    logits = model(input_ids=inputs, use_cache=False).logits.float()
    return {
        "missing_keys": sorted(info.get("missing_keys") or []),
        "unexpected_keys": sorted(info.get("unexpected_keys") or []),
        "mismatched_keys": [str(m) for m in info.get("mismatched_keys") or []],
        "max_abs_logit_diff": float((logits - reference_logits.float()).abs().max()),
        "batch_shape": list(inputs.shape),
    }


def publish(tmp: Path, out: Path) -> None:
    """Move the verified directory into place; an existing one is swapped out, not deleted first."""
    old = out.with_name(f".{out.name}.old-{os.getpid()}")
    if out.exists():
        os.rename(out, old)
    os.rename(tmp, out)
    shutil.rmtree(old, ignore_errors=True)


def export_model(backend, full_sd: dict, out_dir: Path, *, tokenizer_json: Path, eos_id: int | None,
                 inputs: torch.Tensor, reference_logits: torch.Tensor, max_shard_size="5GB") -> dict:
    """Write, reload, compare, publish (single process: the caller gathers ``full_sd``)."""
    out_dir = Path(out_dir)
    tmp = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        if hasattr(backend, "flavor"):
            written = write_native(tmp, backend, full_sd, eos_id, max_shard_size)
        else:
            written = write_hf_backend(tmp, backend, full_sd, max_shard_size)
        written["tokenizer_files"] = copy_tokenizer(tokenizer_json, tmp)
        report = {**written, **verify_reload(tmp, inputs, reference_logits), "out_dir": str(out_dir)}
        if report["missing_keys"] or report["unexpected_keys"] or report["mismatched_keys"]:
            raise ExportError(
                f"HF export does not reload cleanly: missing={report['missing_keys'][:3]} "
                f"unexpected={report['unexpected_keys'][:3]} mismatched={report['mismatched_keys'][:3]}"
            )
        (tmp / REPORT).write_text(json.dumps(report, indent=1))
        publish(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    print(f"hf export: {out_dir} missing_keys={len(report['missing_keys'])} unexpected_keys="
          f"{len(report['unexpected_keys'])} max_abs_logit_diff={report['max_abs_logit_diff']:.3e}"
          + "".join(f"\n  note: {n}" for n in report["notes"]), flush=True)
    return report


def _held_out_inputs(data) -> torch.Tensor:
    batches = data.val_batches(1, 0, 1)
    return batches[0].inputs if batches else data.train_batch(0, 0, 1, 0, 1, 0).inputs


def export_from_trainer(trainer, out_dir: Path) -> dict | None:
    """Collective: every rank gathers the full state dict and runs the reference forward; rank 0 writes."""
    from qwen3_research.checkpoint import full_state_dict

    model = trainer.backend.model
    full_sd = full_state_dict(model, trainer.is_main)
    inputs = _held_out_inputs(trainer.data)
    model.eval()
    with torch.no_grad():
        logits = trainer.forward(inputs.to(trainer.device.torch_device))
        logits = logits.full_tensor() if hasattr(logits, "full_tensor") else logits
    model.train()
    report = None
    if trainer.is_main:
        report = export_model(trainer.backend, full_sd, out_dir, tokenizer_json=trainer.tokenizer.path,
                              eos_id=trainer.tokenizer.eos_id, inputs=inputs, reference_logits=logits.float().cpu())
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    return report


# -- the command ----------------------------------------------------------------------------


def export_checkpoint(checkpoint: str, out_dir: str, *, max_shard_size="5GB", force: bool = False) -> dict:
    """One process, any saved layout: rebuild the model from the checkpoint's config, load it, export."""
    import torch.distributed.checkpoint as dcp

    from qwen3_research import device as devices
    from qwen3_research.checkpoint import _first_line, check_model_matches, find_checkpoint, model_tensors, read_meta
    from qwen3_research.config import to_run_config

    path = find_checkpoint(checkpoint, what="checkpoint")
    out = Path(os.path.expanduser(out_dir)).resolve()
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not force:
        raise ConfigError(f"out_dir {out} exists and is not empty; choose a new directory or pass --force")
    rc = to_run_config(read_meta(path)["config"])
    devices.prepare_torchtitan("cpu")
    from qwen3_research import models
    from qwen3_research.data import PackedDataset, Tokenizer, tokenizer_path

    tokenizer = Tokenizer(tokenizer_path(models.tokenizer_spec(rc)))
    model_cfg = dataclasses.replace(rc.model, init_from=None)  # weights come from the checkpoint
    backend = models.build(model_cfg, torch.device("cpu"), seq_len=rc.data.seq_len, seed=rc.training.seed)
    if getattr(backend, "_initialized", True) is False:  # large native models defer init to after sharding
        backend.init_weights()
    tensors = model_tensors(backend.model)
    check_model_matches(path, tensors, what="checkpoint")
    try:
        dcp.load({"model": tensors}, checkpoint_id=str(path))  # in place, from any saved layout
    except Exception as e:  # noqa: BLE001
        raise ConfigError(f"checkpoint {path}: cannot read the model weights ({_first_line(e)})") from None
    sd = {k: v.detach() for k, v in backend.model.state_dict().items()}
    try:
        inputs = _held_out_inputs(PackedDataset(rc.data, tokenizer))
    except ConfigError:  # the run's data is not available here: a seeded random batch instead
        inputs = torch.randint(0, tokenizer.vocab_size, (2, rc.data.seq_len), generator=torch.Generator().manual_seed(0))
    backend.model.eval()
    with torch.no_grad():
        logits = backend.forward(inputs).float()
    return export_model(backend, sd, out, tokenizer_json=tokenizer.path, eos_id=tokenizer.eos_id, inputs=inputs,
                        reference_logits=logits, max_shard_size=max_shard_size)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m qwen3_research.export", description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint", help="a step-N checkpoint directory, or a directory of them (newest is used)")
    ap.add_argument("out_dir", help="the Hugging Face directory to write")
    ap.add_argument("--max-shard-size", default="5GB", help="largest safetensors file, e.g. 5GB or 500MB")
    ap.add_argument("--force", action="store_true", help="replace a non-empty out_dir (after verification)")
    args = ap.parse_args(argv)
    try:
        report = export_checkpoint(args.checkpoint, args.out_dir, max_shard_size=args.max_shard_size, force=args.force)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    except ExportError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(1)
    print(json.dumps({k: report[k] for k in ("missing_keys", "unexpected_keys", "max_abs_logit_diff", "files")}))


if __name__ == "__main__":
    main()
