"""``python -m qwen3_research.export``: a saved DCP checkpoint -> a verified Hugging Face directory.

    python -m qwen3_research.export <checkpoint dir> <out_dir> [--max-shard-size 5GB] [--force]

The model is rebuilt from the checkpoint's run config (an init_from model's architecture from its
config.json), its weights read from any saved layout, then written, verified and published by
``qwen3_research.hf_interop.export`` (sharded safetensors + index, config.json, tokenizer files;
moved into place only when transformers reloads it with no missing/unexpected keys and matching
logits). The report lands in ``out_dir/export_verification.json``. At the end of a run,
``checkpoint.export_hf=true`` does the same from the trainer's (sharded) model into ``<run dir>/hf``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

from qwen3_research.errors import ConfigError, ExportError


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
    # The architecture (init_from's config.json when set); the weights come from the checkpoint.
    backend = models.build(rc.model, torch.device("cpu"), seq_len=rc.data.seq_len, seed=rc.training.seed,
                           load_init_from=False)
    if hasattr(backend, "materialize"):
        backend.materialize()
    tensors = model_tensors(backend.model)
    check_model_matches(path, tensors, what="checkpoint")
    try:
        dcp.load({"model": tensors}, checkpoint_id=str(path))  # in place, from any saved layout
    except Exception as e:  # noqa: BLE001
        raise ConfigError(f"checkpoint {path}: cannot read the model weights ({_first_line(e)})") from None
    from qwen3_research.hf_interop import export as hf_export

    try:
        inputs = hf_export.held_out_inputs(PackedDataset(rc.data, tokenizer))
    except ConfigError:  # the run's data is not available here: a seeded random batch instead
        inputs = torch.randint(0, tokenizer.vocab_size, (2, rc.data.seq_len), generator=torch.Generator().manual_seed(0))
    backend.model.eval()
    with torch.no_grad():
        logits = backend.forward(inputs).float()
    if hasattr(backend, "flavor"):
        return hf_export.export_native(backend, out, tokenizer_json=tokenizer.path, eos_id=tokenizer.eos_id, inputs=inputs,
                                       reference_logits=logits, compute_dtype=hf_export.compute_dtype(rc, backend),
                                       max_shard_size=max_shard_size)
    return hf_export.export_hf_backend(backend, out, tokenizer_json=tokenizer.path, inputs=inputs,
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
