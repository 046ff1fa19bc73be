"""What both backends' Hugging Face exports share: the verification against transformers' reload, the tokenizer
files, the file split, and publishing the verified directory in place of an earlier one.

A backend's export writes into a temporary directory beside ``out_dir``, verifies it, then ``publish_report``
moves it into place (a failure: ExportError, exit 1, the previous export untouched, the temporary directory
removed). Verification: ``AutoModelForCausalLM.from_pretrained`` reloads it with no missing, unexpected or
mismatched keys, and its logits on held-out tokens match the trained model's within ``LOGIT_TOL[compute dtype]``
(``verify_reload``). The backends' own halves: ``models/native/hf_export.py`` (sharded write, no gather) and
``models/hf/export.py`` (gathered on rank 0, transformers' ``save_pretrained``); what a run or the export command
adds (the reference logits, the held-out batch): ``run/export_hf.py``.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from qwen3_research.errors import ExportError, write_failure

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt",
                   "special_tokens_map.json", "added_tokens.json")
REPORT = "export_verification.json"
# Max |logit| difference between the reloaded transformers model and the trained one, by the dtype the
# trained model computes in: fp32 everywhere (measured 0 to ~2e-6), or torchtitan's MoE experts in bf16
# (GroupedExperts casts to bf16 while transformers runs fp32 experts: measured ~4e-4 at init, more after training).
LOGIT_TOL = {"float32": 1e-4, "bfloat16": 5e-2}


def is_distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def barrier() -> None:
    if is_distributed():
        torch.distributed.barrier()


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    return getattr(model, "_orig_mod", model)


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def copy_tokenizer(tokenizer_json: Path, out: Path) -> list[str]:
    copied = []
    for name in TOKENIZER_FILES:
        src = Path(tokenizer_json).parent / name
        if src.is_file():
            shutil.copyfile(src, out / name)
            copied.append(name)
    return copied


def publish(tmp: Path, out: Path) -> None:
    """Move the verified directory into place; an existing one is swapped out, not deleted first (and put
    back if the new one cannot take its place)."""
    old = out.with_name(f".{out.name}.old-{os.getpid()}")
    if out.exists():
        os.rename(out, old)
    try:
        os.rename(tmp, out)
    except BaseException:
        if old.exists():
            os.rename(old, out)
        raise
    shutil.rmtree(old, ignore_errors=True)


def publish_report(report: dict, tmp: Path, out_dir: Path) -> None:
    """The verification report into the verified directory, then the directory into place; an error is one line."""
    try:
        (tmp / REPORT).write_text(json.dumps(report, indent=1))
        publish(tmp, out_dir)
    except OSError as e:
        why, advice = write_failure(e, out_dir.parent, "out_dir")
        raise ExportError(f"HF export {out_dir}: {why}; the partial export was removed; {advice}") from None


def parse_size(size) -> int:
    """Bytes of ``5GB``, ``500MB``, ``64KB``, ``100B`` or a plain number; ValueError for anything else (or <= 0)."""
    if isinstance(size, int) and not isinstance(size, bool):
        n = size
    else:
        s = str(size).strip().upper()
        unit, mult = next(((u, m) for u, m in (("GB", 10**9), ("MB", 10**6), ("KB", 10**3), ("B", 1)) if s.endswith(u)),
                          ("", 1))
        try:
            n = int(float(s[: len(s) - len(unit)]) * mult)
        except (ValueError, OverflowError):  # "lots", "nanGB" (int(nan)), "infGB"
            raise ValueError(f"{size!r} is not a size") from None
    if n <= 0:
        raise ValueError(f"{size!r} is not a positive size")
    return n


def file_index(shapes: dict[str, tuple], bytes_per_elem: int, max_shard_size) -> dict[str, int]:
    """HF name -> output file number (1..n), greedily in name order, each file <= max_shard_size."""
    limit, out, idx, used = parse_size(max_shard_size), {}, 1, 0
    for k in shapes:
        n = bytes_per_elem
        for s in shapes[k]:
            n *= s
        if used and used + n > limit:
            idx, used = idx + 1, 0
        out[k] = idx
        used += n
    return out


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

