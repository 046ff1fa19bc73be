"""A trained model -> a verified Hugging Face directory, from a run (``checkpoint.export_hf=true``: the Trainer's
possibly sharded model into ``<run dir>/hf``) or from a saved DCP checkpoint (``python -m qwen3_research.export``:
this module is that command's heavy half, which it imports once its arguments are read).

Both compute the trained model's reference logits on held-out tokens (``reference_logits``, in the dtype the
forward computes in: ``compute_dtype``, and a run's ``PrecisionPlan``) and hand them to the built model's own export (``ModelBackend.export_hf``:
``models/native/hf_export.py``, ``models/hf/export.py``), which writes, verifies against transformers' reload and
publishes. The export command rebuilds the model from the checkpoint's run config (an init_from model's
architecture from its config.json; ``--init-from`` names that directory when it has moved since training) and
reads its weights from any saved layout; on any failure (a failed check, a full disk, Ctrl-C) nothing is left
behind and an earlier out_dir is untouched.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from qwen3_research import devices
from qwen3_research import lora, models, titan
from qwen3_research.config import to_run_config
from qwen3_research.data import PackedDataset, Tokenizer, tokenizer_path
from qwen3_research.errors import ConfigError, check_writable, root_cause
from qwen3_research.kernels import kernel_replaces
from qwen3_research.models.hf_export import parse_size  # noqa: F401  (the export command checks --max-shard-size)
from qwen3_research.run.checkpoint import (_first_line, check_model_matches, find_checkpoint, is_complete,
                                           list_checkpoints, read_meta)
from qwen3_research.run.train_state import model_tensors


# -- from a run -------------------------------------------------------------------------------


def held_out_inputs(data) -> torch.Tensor:
    batches = data.val_batches(1, 0, 1)
    return batches[0].inputs if batches else data.train_batch(0, 0, 1, 0, 1, 0).inputs


def compute_dtype(cfg, backend) -> str:
    """The dtype an unsharded float32 model computes its forward in: float32, or bfloat16 for torchtitan's MoE experts
    (``GroupedExperts`` casts to bfloat16) unless a float32 expert kernel is installed (``cfg.kernels.entries``;
    None: the model has no kernels)."""
    if not getattr(backend, "is_moe", False):
        return "float32"
    for entry in (cfg.kernels.entries or []) if cfg is not None else []:
        if kernel_replaces(entry.name, "GroupedExperts") and (entry.options or {}).get("dtype", "input") in ("input", "float32"):
            return "float32"
    return "bfloat16"


@torch.no_grad()
def reference_logits(backend, inputs: torch.Tensor, compute_dtype: str) -> tuple[torch.Tensor, str]:
    """(the trained model's float32 logits on ``inputs``, the dtype they were computed in): a MoE whose experts run
    in bfloat16 is computed with float32 experts where torchtitan allows it (``titan.float32_experts``), as
    transformers computes the reload; its bf16 rounding, which near-tie routing amplifies on a few tokens (0.056),
    is then not charged to the export. Collective under a sharded model (every rank runs the forward)."""
    with titan.float32_experts(backend.model) if compute_dtype == "bfloat16" else contextlib.nullcontext(False) as f32:
        logits = backend.forward(inputs)
    logits = logits.full_tensor() if hasattr(logits, "full_tensor") else logits
    return logits.float(), "float32" if f32 else compute_dtype


def _float32_copy(backend, cfg):
    """Rank 0's unsharded float32 copy of a sharded run's model, holding its trained (float32 master) weights
    (gathered: collective), for the reference forward; None on the other ranks. FSDP2 under
    ``training.mixed_precision=bf16`` gathers bfloat16 copies for every forward, so the run's own model cannot compute
    in float32, and its bf16 logits differ from transformers' float32 reload by 0.067 on tiny_moe (near-tie routing),
    more than bfloat16's tolerance. No kernel is installed in the copy."""
    main = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
    full = {}
    # state_dict() as the export's own gather reads it (torchtitan 0.3's fused QKV renames its keys on save, which
    # DCP's get_model_state_dict cannot walk); every rank takes part in each full_tensor
    for k, v in backend.model.state_dict().items():
        v = v.full_tensor() if hasattr(v, "full_tensor") else v
        if main:
            full[k] = v.detach().to("cpu", torch.float32)
    if not main:
        return None
    copy = models.build(cfg.model, torch.device("cpu"), seq_len=cfg.data.seq_len, seed=cfg.training.seed,
                        load_init_from=False)
    if cfg.model.lora.enable:  # the same adapters' modules as the trained model, before its weights exist
        lora.apply_lora(copy, cfg.model.lora)
    if hasattr(copy, "materialize"):
        copy.materialize()
    copy.model.load_state_dict(full, strict=True)
    copy.model.eval()
    return copy


def export_trained(backend, out_dir: Path, *, inputs: torch.Tensor, device: torch.device, tokenizer, cfg,
                   precision) -> dict | None:
    """A run's model (possibly sharded) -> ``out_dir``, verified against its own logits on ``inputs``, computed in
    the dtype the run's ``PrecisionPlan`` (``precision``) gives its forward: where FSDP2 gathers bfloat16 parameters
    (``param_dtype``), on an unsharded float32 copy of the trained weights (``_float32_copy``) instead, so the
    export is held to float32's tolerance, as the same checkpoint's standalone export is; else on the model itself.

    Collective: the reference forward (or the copy's gather) on every rank, then the sharded write and verification.
    ``tokenizer``: the run's (``data.Tokenizer``: its file and end-of-text id go with the export).
    """
    logits, dtype = trained_reference(backend, inputs, device=device, cfg=cfg, precision=precision)
    return backend.export_hf(out_dir, tokenizer_json=tokenizer.path, eos_id=tokenizer.eos_id, inputs=inputs,
                             reference_logits=logits, compute_dtype=dtype)


def trained_reference(backend, inputs: torch.Tensor, *, device: torch.device, cfg, precision) -> tuple[torch.Tensor, str]:
    """(the trained model's float32 logits on ``inputs`` on CPU, the dtype they were computed in), as ``export_trained``
    and the LoRA export (``run/export_peft.py``) verify against; collective (rank 0's are empty under bf16 FSDP2)."""
    model = backend.model
    model.eval()
    if precision.param_dtype == "bfloat16":
        copy = _float32_copy(backend, cfg)
        if copy is None:  # only rank 0 verifies the reload
            logits, dtype = torch.empty(0), "float32"
        else:
            logits, dtype = reference_logits(copy, inputs, compute_dtype(None, copy))
            del copy
    else:
        logits, dtype = reference_logits(backend, inputs.to(device), compute_dtype(cfg, backend))
    model.train()
    return logits.cpu(), dtype


# -- from a saved checkpoint (python -m qwen3_research.export) ---------------------------------


def export_checkpoint(checkpoint: str, out_dir: str, *, max_shard_size="5GB", force: bool = False,
                      init_from: str | None = None) -> dict:
    """One process, any saved layout: rebuild the model from the checkpoint's config, load it, export."""
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
    rc = dataclasses.replace(rc, model=models.canonical(rc.model))  # a checkpoint of model=native_moe: today's names
    rc = _use_init_from(rc, path, init_from)
    print(f"export: step {step} of {path} -> {out}", flush=True)
    devices.prepare_torchtitan("cpu")
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
    try:
        inputs = held_out_inputs(PackedDataset(rc.data, tokenizer))
    except ConfigError:  # the run's data is not available here: a seeded random batch instead
        inputs = torch.randint(0, tokenizer.vocab_size, (2, rc.data.seq_len), generator=torch.Generator().manual_seed(0))
    backend.model.eval()
    logits, dtype = reference_logits(backend, inputs, compute_dtype(rc, backend))
    report = backend.export_hf(out, tokenizer_json=tokenizer.path, eos_id=tokenizer.eos_id, inputs=inputs,
                               reference_logits=logits, compute_dtype=dtype, max_shard_size=max_shard_size)
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
    if is_complete(path):
        return
    newer = list_checkpoints(path.parent)
    raise ConfigError(f"checkpoint {path} was removed while it was being exported (a running run prunes its older "
                      f"checkpoints: checkpoint.keep); export again"
                      + (f": the newest is now {newer[-1]}" if newer else "")) from None
