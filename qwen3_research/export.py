"""``python -m qwen3_research.export``: a saved DCP checkpoint -> a verified Hugging Face directory.

    python -m qwen3_research.export <checkpoint dir> <out_dir> [--max-shard-size 5GB] [--force] [--init-from DIR]

The model is rebuilt from the checkpoint's run config (an init_from model's architecture from its
config.json; ``--init-from`` names that directory when it has moved since training), its weights read
from any saved layout, then written, verified and published by ``qwen3_research.hf_interop.export``
(sharded safetensors + index, config.json, tokenizer files; moved into place only when transformers
reloads it with no missing/unexpected keys and matching logits). The report lands in
``out_dir/export_verification.json``; the command names the step it exported. On any failure (a
failed check, a full disk, Ctrl-C) nothing is left behind and an earlier out_dir is untouched. At the
end of a run, ``checkpoint.export_hf=true`` does the same from the trainer's (sharded) model into
``<run dir>/hf``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import sys
from pathlib import Path

if __name__ == "__main__":  # Ctrl-C / SIGTERM while torch imports: 128+signal, one line
    from qwen3_research import startup

    startup.exit_at_once_while_importing("before the export started; nothing was written")

import torch  # noqa: E402

from qwen3_research.errors import ConfigError, ExportError, check_writable, root_cause  # noqa: E402


# -- the command ----------------------------------------------------------------------------


def export_checkpoint(checkpoint: str, out_dir: str, *, max_shard_size="5GB", force: bool = False,
                      init_from: str | None = None) -> dict:
    """One process, any saved layout: rebuild the model from the checkpoint's config, load it, export."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from qwen3_research import device as devices
    from qwen3_research.run.checkpoint import _first_line, check_model_matches, find_checkpoint, read_meta
    from qwen3_research.config import to_run_config
    from qwen3_research.run.train_state import model_tensors

    path = find_checkpoint(checkpoint, what="checkpoint")
    out = Path(os.path.expanduser(out_dir)).resolve()
    _refuse_out_dir_holding_a_run(out, path)  # before --force: replacing out_dir must never delete a run's files
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not force:
        raise ConfigError(f"out_dir {out} exists and is not empty; choose a new directory or pass --force")
    check_writable(f"out_dir {out}", out)
    try:
        meta = read_meta(path)
    except ConfigError:
        _still_there(path)
        raise
    step = meta.get("step")
    rc = to_run_config(meta["config"])
    rc = _use_init_from(rc, path, init_from)
    print(f"export: step {step} of {path} -> {out}", flush=True)
    devices.prepare_torchtitan("cpu")
    from qwen3_research import models
    from qwen3_research.data import PackedDataset, Tokenizer, tokenizer_path

    tokenizer = Tokenizer(tokenizer_path(models.tokenizer_spec(rc)))
    # The architecture (init_from's config.json when set); the weights come from the checkpoint.
    backend = models.build(rc.model, torch.device("cpu"), seq_len=rc.data.seq_len, seed=rc.training.seed,
                           load_init_from=False)
    balance = getattr(backend, "balance", None)
    if balance is not None and balance.mode == "bias":  # before reading any weight
        raise ConfigError(f"checkpoint {path} was trained with model.moe.balance=bias"
                          + (f" ({balance.why})" if balance.why.startswith("auto") else "") + ": Hugging Face "
                          "Qwen3-MoE has no expert bias (it only chooses the experts, so it cannot be folded into the "
                          "router weights) and the export would route differently; resume it from the DCP checkpoint, "
                          "or train with model.moe.balance=aux_loss to export")
    if hasattr(backend, "materialize"):
        backend.materialize()
    tensors = model_tensors(backend.model)
    try:
        check_model_matches(path, tensors, what="checkpoint")
        try:
            dcp.load({"model": tensors}, checkpoint_id=str(path))  # in place, from any saved layout
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - DCP wraps a rank's error, Ctrl-C too
            cause = root_cause(e)
            if not isinstance(cause, Exception):  # Ctrl-C or SIGTERM inside DCP's read: unwind as that signal
                raise cause from None
            raise ConfigError(f"checkpoint {path}: cannot read the model weights ({_first_line(e)})") from None
    except ConfigError:
        _still_there(path)  # the weights are read once: from here on the directory may go
        raise
    from qwen3_research.hf_interop import export as hf_export

    try:
        inputs = hf_export.held_out_inputs(PackedDataset(rc.data, tokenizer))
    except ConfigError:  # the run's data is not available here: a seeded random batch instead
        inputs = torch.randint(0, tokenizer.vocab_size, (2, rc.data.seq_len), generator=torch.Generator().manual_seed(0))
    backend.model.eval()
    logits, dtype = hf_export.reference_logits(backend, inputs, hf_export.compute_dtype(rc, backend))
    if hasattr(backend, "flavor"):
        report = hf_export.export_native(backend, out, tokenizer_json=tokenizer.path, eos_id=tokenizer.eos_id,
                                         inputs=inputs, reference_logits=logits, compute_dtype=dtype,
                                         max_shard_size=max_shard_size)
    else:
        report = hf_export.export_hf_backend(backend, out, tokenizer_json=tokenizer.path, inputs=inputs,
                                             reference_logits=logits, max_shard_size=max_shard_size)
    return {**report, "step": step, "checkpoint": str(path)}


# What marks a run directory (Hydra's record, the run's own files, its lock) and a checkpoint directory.
_RUN_MARKERS = (".hydra", "metrics.jsonl", "summary.json", ".qwen3_research.lock")
_CHECKPOINT_MARKERS = ("meta.json", "owner.json")
_RUN_EXPORT_DIR = "hf"  # <run dir>/hf: where checkpoint.export_hf=true writes; the one place inside a run to export to


def _refuse_out_dir_holding_a_run(out: Path, checkpoint: Path) -> None:
    """``--force`` replaces out_dir after verification: an out_dir that is, contains or lies inside a run
    directory or the checkpoint read (its step directory or the directory of checkpoints it is in) is refused
    whatever --force says (it deleted both training checkpoints, or a run's metrics.jsonl, summary.json and
    .hydra/). The one exception: ``<run dir>/hf``, the run's own export directory."""
    protected = [checkpoint, checkpoint.parent]

    def what(d: Path) -> str | None:
        if d in protected:
            return "the checkpoint it reads" if d == checkpoint else "the directory of the checkpoint it reads"
        if any((d / m).exists() for m in _RUN_MARKERS):
            return "a run directory"
        if any((d / m).is_file() for m in _CHECKPOINT_MARKERS):
            return "a checkpoint directory"
        return None

    found = None
    for d in (out, *out.parents):  # out itself, or a directory it lies inside
        kind = what(d)
        if kind and not (d != out and kind == "a run directory" and out.relative_to(d).parts[0] == _RUN_EXPORT_DIR):
            found = (d, kind, "is" if d == out else "lies inside")
            break
    if found is None and out.is_dir():  # a directory it contains
        for root, dirs, _files in os.walk(out):
            for name in dirs:
                kind = what(Path(root) / name)
                if kind:
                    found = (Path(root) / name, kind, "contains")
                    break
            if found:
                break
    if found is None and checkpoint.is_relative_to(out):
        found = (checkpoint, "the checkpoint it reads", "contains")
    if found:
        d, kind, relation = found
        where = "" if d == out else f" {d}"
        raise ConfigError(f"out_dir {out} {relation} {kind}{where}; an export never writes into or replaces a run's "
                          f"or a checkpoint's files (--force or not): choose an out_dir outside them, e.g. a new "
                          f"directory next to the run, or <run dir>/{_RUN_EXPORT_DIR}")


def _use_init_from(rc, path: Path, init_from: str | None):
    """The checkpoint's config with the base model directory the architecture (config.json) and tokenizer come
    from: ``--init-from`` when given (a new config; the one read is not written), else the one recorded at
    training time, which must still exist."""
    from qwen3_research import models

    recorded = rc.model.init_from
    takes_init_from = models.spec(rc.model).takes_init_from
    if init_from is not None:
        if not takes_init_from or not recorded:
            raise ConfigError(f"--init-from: checkpoint {path} was not trained from model.init_from (model="
                              f"{rc.model.backend}); export it without --init-from")
        if not Path(os.path.expanduser(init_from)).is_dir():
            raise ConfigError(f"--init-from {init_from}: no such directory")
        return dataclasses.replace(rc, model=dataclasses.replace(
            rc.model, init_from=str(Path(os.path.expanduser(init_from)).resolve())))
    if recorded and takes_init_from and not Path(os.path.expanduser(recorded)).is_dir():
        raise ConfigError(f"checkpoint {path} was trained from model.init_from={recorded!r}, which is no longer a "
                          "directory (moved or deleted); pass --init-from DIR with that base model's new location")
    return rc


def _still_there(path: Path) -> None:
    """A checkpoint that vanished while it was read (a running run prunes its older ones, checkpoint.keep)
    is named as such, not as an unreadable file."""
    from qwen3_research.run.checkpoint import is_complete, list_checkpoints

    if is_complete(path):
        return
    newer = list_checkpoints(path.parent)
    raise ConfigError(f"checkpoint {path} was removed while it was being exported (a running run prunes its older "
                      f"checkpoints: checkpoint.keep); export again"
                      + (f": the newest is now {newer[-1]}" if newer else "")) from None


def main(argv: list[str] | None = None) -> None:
    from qwen3_research import startup
    from qwen3_research.hf_interop.export import parse_size

    ap = argparse.ArgumentParser(prog="python -m qwen3_research.export", description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint", help="a step-N checkpoint directory, or a directory of them (newest is used)")
    ap.add_argument("out_dir", help="the Hugging Face directory to write")
    ap.add_argument("--max-shard-size", default="5GB", help="largest safetensors file, e.g. 5GB or 500MB")
    ap.add_argument("--force", action="store_true", help="replace a non-empty out_dir (after verification)")
    ap.add_argument("--init-from", default=None, metavar="DIR",
                    help="the base model directory (model.init_from) when it moved since training")
    args = ap.parse_args(argv)
    startup.quiet_libraries()
    from qwen3_research.signals import Terminated, raise_terminated

    # From here Ctrl-C and SIGTERM unwind the export (its temporary directory is removed on the way out).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, raise_terminated)
    try:
        try:
            parse_size(args.max_shard_size)  # before any work (it failed after 11 s of loading)
        except ValueError as e:
            raise ConfigError(f"--max-shard-size: {e}; write e.g. 5GB, 500MB or a number of bytes") from None
        report = export_checkpoint(args.checkpoint, args.out_dir, max_shard_size=args.max_shard_size, force=args.force,
                                   init_from=args.init_from)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    except ExportError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(1)
    except (KeyboardInterrupt, Terminated) as e:
        name = "SIGTERM" if isinstance(e, Terminated) else "SIGINT"
        print(f"interrupted by {name}; nothing was exported (no partial files are left; {args.out_dir} is as it was)",
              file=sys.stderr, flush=True)
        sys.exit(128 + (signal.SIGTERM if isinstance(e, Terminated) else signal.SIGINT))
    print(json.dumps({k: report[k] for k in ("step", "checkpoint", "missing_keys", "unexpected_keys",
                                             "max_abs_logit_diff", "files")}))


if __name__ == "__main__":
    main()
