"""model=hf -> a verified Hugging Face directory: the full state dict gathered to rank 0, saved by transformers'
``save_pretrained``, then the shared reload check (``models.hf_export.verify_reload``) before it is published."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM

from qwen3_research.errors import ExportError, write_failure
from qwen3_research.models.hf_export import (LOGIT_TOL, barrier, copy_tokenizer, is_distributed, publish_report,
                                             unwrap, verify_reload)


def export_hf_backend(backend, out_dir: Path, *, tokenizer_json: Path, inputs, reference_logits,
                      max_shard_size="5GB") -> dict | None:
    """model=hf: the full state dict gathered to rank 0, saved by transformers, then the same reload check."""
    is_main = not is_distributed() or torch.distributed.get_rank() == 0
    full = {}
    for k, v in unwrap(backend.model).state_dict().items():
        v = v.full_tensor() if isinstance(v, DTensor) else v
        if is_main:
            full[k] = v.detach().cpu()
    report = None
    if is_main:
        out_dir = Path(out_dir)
        tmp = out_dir.with_name(f".{out_dir.name}.tmp-export")
        try:  # from the directory's creation: a Ctrl-C right after mkdir leaves nothing behind either
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            with torch.device("meta"):
                fresh = AutoModelForCausalLM.from_config(backend.config, dtype=torch.float32)
            fresh.load_state_dict(full, strict=False, assign=True)
            fresh.tie_weights()
            fresh.save_pretrained(tmp, max_shard_size=max_shard_size)
            report = {"files": sorted(p.name for p in tmp.glob("*.safetensors")), "notes": [],
                      "tokenizer_files": copy_tokenizer(tokenizer_json, tmp), "out_dir": str(out_dir),
                      "logit_tolerance": LOGIT_TOL["float32"], **verify_reload(tmp, inputs, reference_logits)}
            if report["missing_keys"] or report["unexpected_keys"] or report["mismatched_keys"] or \
                    not report["max_abs_logit_diff"] <= LOGIT_TOL["float32"]:
                raise ExportError(f"HF export {out_dir} fails verification: missing={report['missing_keys'][:3]} "
                                  f"unexpected={report['unexpected_keys'][:3]} max_abs_logit_diff="
                                  f"{report['max_abs_logit_diff']:.3g}; the previous export (if any) is kept")
            publish_report(report, tmp, out_dir)
        except OSError as e:  # a full disk, a file-size limit, a read-only out_dir: one line
            shutil.rmtree(tmp, ignore_errors=True)
            why, advice = write_failure(e, out_dir.parent, "out_dir")
            raise ExportError(f"HF export {out_dir}: {why}; the partial export was removed; {advice}") from None
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        print(f"hf export: {out_dir} missing_keys=0 unexpected_keys=0 max_abs_logit_diff="
              f"{report['max_abs_logit_diff']:.3e}", flush=True)
    barrier()
    return report

