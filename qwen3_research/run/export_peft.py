"""A LoRA run (``model.lora.enable=true``, ``checkpoint.export_hf=true``) -> two verified directories users load
elsewhere, from either backend and any layout:

- ``<run dir>/hf_adapter``: the adapters in PEFT's format (``adapter_config.json`` + ``adapter_model.safetensors``)
  for the base model's Hugging Face checkpoint (``model.path`` / ``model.init_from``, named in the config's
  ``base_model_name_or_path``);
- ``<run dir>/hf``: the merged model (each adapter folded into its base weight, ``W + alpha/r * B @ A``) as a full
  Hugging Face checkpoint with the run's tokenizer files.

Both are written by PEFT and Transformers themselves (``get_peft_model`` on the base, the trained adapters set into
it, ``save_pretrained``; ``merge_and_unload``, ``save_pretrained``), then reloaded the way a user loads them --
``PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter)`` and
``AutoModelForCausalLM.from_pretrained(merged)`` -- and each reload's logits on held-out tokens must equal the trained
model's (``export_hf.trained_reference``: the run's own forward, float32 where FSDP2 computes in bf16) within
``LOGIT_TOL`` of the compute dtype, with no missing or unexpected keys. A failure is ExportError (exit 1), the earlier
exports untouched, nothing half-written left. The adapters are gathered out of any sharding (``lora.adapter_state_dict``,
collective); rank 0 does the rest while the others wait.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch

from qwen3_research import lora
from qwen3_research.errors import ExportError, write_failure
from qwen3_research.models.hf_export import LOGIT_TOL, barrier, copy_tokenizer, is_distributed, publish_report, verify_reload
from qwen3_research.run.export_hf import trained_reference

ADAPTER_DIR, MERGED_DIR = "hf_adapter", "hf"
# Module names an adapter may sit on in HF's Qwen3 (a MoE layer's experts and router are not among them).
_PROJECTIONS = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
                "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def base_dir(model_cfg) -> str | None:
    """The base model's Hugging Face checkpoint a LoRA run trained on (``model.path`` or ``model.init_from``)."""
    return getattr(model_cfg, "path", None) or getattr(model_cfg, "init_from", None)


def target_regex(names) -> str:
    """PEFT's ``target_modules`` as one full-match pattern over HF module paths: exactly the projections that carry
    an adapter (a bare name list would also reach a MoE's fused experts through PEFT's parameter targeting)."""
    projs = sorted({n.rsplit(".", 1)[-1] for n in names})
    attn = [p for p in projs if _PROJECTIONS.get(p) == "self_attn"]
    mlp = [p for p in projs if _PROJECTIONS.get(p) == "mlp"]
    parts = ([rf"self_attn\.({'|'.join(attn)})"] if attn else []) + ([rf"mlp\.({'|'.join(mlp)})"] if mlp else [])
    return rf"^model\.layers\.\d+\.({'|'.join(parts)})$"


@torch.no_grad()
def _logits(model, inputs: torch.Tensor) -> torch.Tensor:
    model.eval()
    return model(input_ids=inputs, use_cache=False).logits.float()


def _load_base(path: str):
    from transformers import AutoModelForCausalLM  # deferred: only a LoRA export loads transformers' model code

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, attn_implementation="sdpa",
                                                use_safetensors=True)


def export_lora(backend, run_dir: Path, *, inputs: torch.Tensor, device: torch.device, tokenizer, cfg,
                precision) -> dict | None:
    """The trained adapters and the merged model into ``run_dir`` (``ADAPTER_DIR``, ``MERGED_DIR``), each verified
    by its user's reload against the trained model's logits; collective. Returns rank 0's report (None elsewhere)."""
    from peft import PeftModel, get_peft_model, set_peft_model_state_dict  # deferred: see _load_base

    base = base_dir(cfg.model)
    if not base:  # resolve refuses this before any worker starts (lora.check_run); kept for a direct caller
        raise ExportError("LoRA export: the run has no base Hugging Face checkpoint (model.path / model.init_from)")
    reference, dtype = trained_reference(backend, inputs, device=device, cfg=cfg, precision=precision)
    adapters = lora.adapter_state_dict(backend.model)  # collective: every rank gathers its shards
    is_main = not is_distributed() or torch.distributed.get_rank() == 0
    report = None
    if is_main:
        tol = LOGIT_TOL[dtype]
        run_dir = Path(run_dir)
        out_a, out_m = run_dir / ADAPTER_DIR, run_dir / MERGED_DIR
        tmp_a, tmp_m = (d.with_name(f".{d.name}.tmp-export") for d in (out_a, out_m))
        try:
            for tmp in (tmp_a, tmp_m):
                shutil.rmtree(tmp, ignore_errors=True)
            pc = lora.peft_config(cfg.model.lora)
            pc.target_modules = target_regex(k.split(".lora_")[0] for k in adapters)
            pc.base_model_name_or_path = str(base)
            model = get_peft_model(_load_base(base), pc)
            result = set_peft_model_state_dict(model, adapters)
            missing = sorted(k for k in result.missing_keys if lora.is_adapter_key(k))
            unexpected = sorted(result.unexpected_keys)
            if missing or unexpected:
                raise ExportError(f"LoRA export: the trained adapters do not fit PEFT's model of {base}: missing="
                                  f"{missing[:3]} unexpected={unexpected[:3]}")
            model.save_pretrained(tmp_a)
            reloaded = PeftModel.from_pretrained(_load_base(base), str(tmp_a))
            adapter_diff = float((_logits(reloaded, inputs) - reference).abs().max())
            del reloaded
            merged = model.merge_and_unload()
            merged.save_pretrained(tmp_m)
            del model, merged
            merged_check = {"tokenizer_files": copy_tokenizer(tokenizer.path, tmp_m),
                            **verify_reload(tmp_m, inputs, reference)}
            report = {
                "base": str(base), "compute_dtype": dtype, "logit_tolerance": tol, "batch_shape": list(inputs.shape),
                "adapter": {"out_dir": str(out_a), "files": sorted(os.listdir(tmp_a)), "tensors": len(adapters),
                            "max_abs_logit_diff": adapter_diff},
                "merged": {"out_dir": str(out_m), "files": sorted(p.name for p in tmp_m.glob("*.safetensors")),
                           **merged_check},
            }
            bad_keys = merged_check["missing_keys"] or merged_check["unexpected_keys"] or merged_check["mismatched_keys"]
            if bad_keys or not adapter_diff <= tol or not merged_check["max_abs_logit_diff"] <= tol:
                raise ExportError(f"LoRA export fails verification: PEFT adapter reload max_abs_logit_diff={adapter_diff:.3g}, "
                                  f"merged reload {merged_check['max_abs_logit_diff']:.3g} (tolerance {tol:g}), merged "
                                  f"missing={merged_check['missing_keys'][:3]} unexpected={merged_check['unexpected_keys'][:3]}; "
                                  "the previous exports (if any) are kept")
            publish_report(report, tmp_a, out_a)
            publish_report(report, tmp_m, out_m)
        except OSError as e:  # a full disk, a file-size limit, a read-only run dir: one line
            why, advice = write_failure(e, run_dir, "run dir")
            raise ExportError(f"LoRA export into {run_dir}: {why}; the partial export was removed; {advice}") from None
        finally:
            for tmp in (tmp_a, tmp_m):
                shutil.rmtree(tmp, ignore_errors=True)
        print(f"lora export: {out_a} (PEFT adapter, {len(adapters)} tensors, reload max_abs_logit_diff="
              f"{report['adapter']['max_abs_logit_diff']:.3e}); {out_m} (merged, reload max_abs_logit_diff="
              f"{report['merged']['max_abs_logit_diff']:.3e})", flush=True)
    barrier()
    return report
