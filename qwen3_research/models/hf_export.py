"""A trained model -> a verified Hugging Face directory (config.json, sharded safetensors + index, tokenizer).

Native models (any parallel layout) are written without gathering: torchtitan's ``to_hf`` renames each
rank's local shards, ``dcp.save`` with ``HuggingFaceStorageWriter(save_distributed=True)`` writes each
rank's part, and ``consolidate_safetensors_files_on_every_rank`` assembles the
``model-0000i-of-0000n.safetensors`` files (each rank builds some, file by file) plus
``model.safetensors.index.json`` — the same route as torchtitan's ``dcp_save(to_hf=True)``.

Verification, before anything is moved into place (a failure: ExportError, exit 1, the previous
export untouched, the temporary directory removed):
1. every tensor read back from the written files equals the trained one (each rank compares its own
   shards; the worst tensor is named);
2. ``AutoModelForCausalLM.from_pretrained`` (rank 0) reloads it with no missing, unexpected or
   mismatched keys, and its logits on held-out tokens match the trained model's within
   ``LOGIT_TOL[compute dtype]``.

``config.json`` is the trained architecture (``hf_interop.config.hf_config_fields``: rope_theta,
tie setting, eps of an init_from model), weights are written in the parameters' dtype (fp32).
"""

from __future__ import annotations

import contextlib

import json
import os
import shutil
from pathlib import Path

import torch

from qwen3_research.errors import ExportError, root_cause, write_failure

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt",
                   "special_tokens_map.json", "added_tokens.json")
REPORT = "export_verification.json"
# Max |logit| difference between the reloaded transformers model and the trained one, by the dtype the
# trained model computes in: fp32 everywhere (measured 0 to ~2e-6), or torchtitan's MoE experts in bf16
# (GroupedExperts casts to bf16 while transformers runs fp32 experts: measured ~4e-4 at init, more after training).
LOGIT_TOL = {"float32": 1e-4, "bfloat16": 5e-2}
# Test hook: swap these two tensors (comma-separated HF names) in the written files before verification.
SWAP_ENV = "QWEN3_RESEARCH_TEST_SWAP_EXPORT"


def _dist() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _barrier() -> None:
    if _dist():
        torch.distributed.barrier()


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    return getattr(model, "_orig_mod", model)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


# -- config and tokenizer -------------------------------------------------------------------------


def hf_config_for_flavor(flavor, moe: bool, eos_id: int | None):
    """Qwen3Config / Qwen3MoeConfig with the architecture's fields (the ones init_from reads)."""
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
                             num_experts_per_tok=f["num_experts_per_tok"], norm_topk_prob=f["norm_topk_prob"],
                             decoder_sparse_step=1, mlp_only_layers=[])
        cfg.architectures = ["Qwen3MoeForCausalLM"]
    else:
        cfg = Qwen3Config(**common, intermediate_size=f["intermediate_size"])
        cfg.architectures = ["Qwen3ForCausalLM"]
    cfg.dtype = "float32"
    return cfg


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


def _publish_report(report: dict, tmp: Path, out_dir: Path) -> None:
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


# -- native models: sharded write and verification -------------------------------------------------


def _hf_state(model, model_config) -> dict:
    from qwen3_research import titan

    sd = {k: v for k, v in _unwrap(model).state_dict().items() if not titan.native_only_buffer(k)}
    return titan.state_dict_adapter(model_config).to_hf(sd)


def _dropped_native_tensors(model) -> list[str]:
    """Non-zero native-only tensors ``_hf_state`` leaves out (torchtitan's MoE expert bias), with their size (this
    rank's part). Rank 0 alone calls it: buffers, not ``state_dict()``, which is collective under TP (torchtitan's
    fused QKV redistributes its shards on save; a 2-rank tp run hung there, its peer waiting in the broadcast)."""
    from qwen3_research import titan

    out = []
    for k, v in _unwrap(model).named_buffers():
        if titan.native_only_buffer(k):
            peak = float(_local(v).float().abs().max()) if _local(v).numel() else 0.0
            if peak > 0:
                out.append(f"{k} (max |value| {peak:.3g})")
    return out


def write_sharded(hf_sd: dict, tmp: Path, mapping: dict[str, int]) -> list[str]:
    """Collective: each rank writes its shards, then the consolidated files are built file by file."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torch.distributed.checkpoint._consolidate_hf_safetensors import (
        consolidate_safetensors_files,
        consolidate_safetensors_files_on_every_rank,
    )

    sharded = tmp / "sharded"
    dcp.save(hf_sd, storage_writer=HuggingFaceStorageWriter(path=str(sharded), save_distributed=True,
                                                            fqn_to_index_mapping=mapping, enable_consolidation=False))
    _barrier()
    if _dist():  # each rank builds some of the files; rank 0 writes the index
        consolidate_safetensors_files_on_every_rank(input_dir=str(sharded), output_dir=str(tmp), fqn_to_index_mapping=mapping)
    else:  # the on-every-rank variant writes no index without a process group
        consolidate_safetensors_files(input_dir=str(sharded), output_dir=str(tmp), fqn_to_index_mapping=mapping)
    _barrier()
    if not _dist() or torch.distributed.get_rank() == 0:
        shutil.rmtree(sharded, ignore_errors=True)
    return sorted(p.name for p in tmp.glob("*.safetensors"))


def _swap_for_test(tmp: Path) -> None:
    """Test hook (SWAP_ENV): exchange two stored tensors, so verification must catch it."""
    from safetensors.torch import load_file, save_file

    a, b = os.environ[SWAP_ENV].split(",")
    files = {p: load_file(str(p)) for p in tmp.glob("*.safetensors")}
    where = {k: p for p, d in files.items() for k in d}
    ta, tb = files[where[a]][a], files[where[b]][b]
    files[where[a]][a], files[where[b]][b] = tb.clone(), ta.clone()
    for p in {where[a], where[b]}:
        save_file(files[p], str(p), metadata={"format": "pt"})


def tensor_diffs(hf_sd: dict, tmp: Path, names: list[str]) -> dict[str, float]:
    """Collective: max |written - trained| per tensor; each rank reads back and compares only its shards."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    back = {k: torch.zeros_like(v) for k, v in hf_sd.items()}
    dcp.load(back, storage_reader=HuggingFaceStorageReader(str(tmp)))
    diffs = torch.zeros(len(names), dtype=torch.float64)
    pos = {k: i for i, k in enumerate(names)}
    for k, v in hf_sd.items():
        a, b = _local(back[k]).float(), _local(v).float()
        if a.numel() and k in pos:
            diffs[pos[k]] = float((a - b).abs().max())
    if _dist():
        torch.distributed.all_reduce(diffs, op=torch.distributed.ReduceOp.MAX)
    return dict(zip(names, diffs.tolist()))


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


def export_native(backend, out_dir: Path, *, tokenizer_json: Path, eos_id: int | None, inputs: torch.Tensor,
                  reference_logits: torch.Tensor, compute_dtype: str = "float32", max_shard_size="5GB") -> dict | None:
    """Collective over all ranks (also fine in one process): write, verify, publish. Returns rank 0's report."""
    is_main = not _dist() or torch.distributed.get_rank() == 0
    out_dir = Path(out_dir)
    tmp = out_dir.with_name(f".{out_dir.name}.tmp-export")
    if is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    try:
        return _export_native(backend, out_dir, tmp, is_main, tokenizer_json=tokenizer_json, eos_id=eos_id,
                              inputs=inputs, reference_logits=reference_logits, compute_dtype=compute_dtype,
                              max_shard_size=max_shard_size)
    except BaseException:  # a failed check, a full disk, Ctrl-C: the temporary directory never stays behind
        if is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        raise


def _export_native(backend, out_dir: Path, tmp: Path, is_main: bool, *, tokenizer_json, eos_id, inputs,
                   reference_logits, compute_dtype, max_shard_size) -> dict | None:
    from torch.distributed.checkpoint.api import CheckpointException

    from qwen3_research.hf_interop.config import expected_hf_shapes

    _barrier()
    error = None
    fix = "the previous export (if any) is kept"
    report: dict = {}
    try:
        hf_sd = _hf_state(backend.model, backend.model_config)
        shapes = expected_hf_shapes(backend.flavor)
        dtype_bytes = next(iter(hf_sd.values())).element_size()
        files = write_sharded(hf_sd, tmp, file_index(shapes, dtype_bytes, max_shard_size))
        if is_main:
            hf_config_for_flavor(backend.flavor, backend.is_moe, eos_id).save_pretrained(tmp)
            (tmp / "generation_config.json").unlink(missing_ok=True)
            report["tokenizer_files"] = copy_tokenizer(tokenizer_json, tmp)
            if os.environ.get(SWAP_ENV):
                _swap_for_test(tmp)
        _barrier()
        diffs = tensor_diffs(hf_sd, tmp, list(shapes))
        del hf_sd
        worst = max(diffs, key=diffs.get)
        report.update(files=files, max_abs_tensor_diff=diffs[worst], worst_tensor=worst, notes=[],
                      compute_dtype=compute_dtype, logit_tolerance=LOGIT_TOL[compute_dtype], out_dir=str(out_dir))
        if is_main:
            report.update(verify_reload(tmp, inputs, reference_logits))
            if diffs[worst] > 0:
                error = (f"HF export {out_dir}: written tensors differ from the trained ones; worst "
                         f"{worst} (max |diff| {diffs[worst]:.3g})")
            elif report["missing_keys"] or report["unexpected_keys"] or report["mismatched_keys"]:
                error = (f"HF export {out_dir} does not reload cleanly: missing={report['missing_keys'][:3]} "
                         f"unexpected={report['unexpected_keys'][:3]} mismatched={report['mismatched_keys'][:3]}")
            elif not report["max_abs_logit_diff"] <= LOGIT_TOL[compute_dtype]:
                # Every written tensor is the trained one here: name what the HF layout does not hold, not a tensor.
                dropped = _dropped_native_tensors(backend.model)
                error = (f"HF export {out_dir}: reloaded logits differ by {report['max_abs_logit_diff']:.3g} > "
                         f"{LOGIT_TOL[compute_dtype]:g} ({compute_dtype}) although all {len(diffs)} written tensors "
                         "equal the trained ones (max |diff| 0); "
                         + (f"not exported (no Hugging Face counterpart): {', '.join(dropped[:3])}"
                            + (f" and {len(dropped) - 3} more" if len(dropped) > 3 else "") if dropped
                            else "transformers computes this model differently from the trained one"))
    except ExportError:
        raise
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - a rank's write error (DCP wraps it): an export failure on every rank
        cause = root_cause(e)
        if not isinstance(cause, Exception):  # Ctrl-C or SIGTERM inside DCP's write: unwind as that signal
            raise cause from None
        why, advice = write_failure(e, out_dir.parent, "out_dir")  # before the partial files are removed
        error, fix = f"HF export {out_dir}: {why}"[:400], f"the partial export was removed; {advice}"
    if _dist():
        box = [(error, fix)]
        torch.distributed.broadcast_object_list(box, src=0)
        error, fix = box[0] if box[0][0] else (error, fix)
    if error:
        if is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        _barrier()
        raise ExportError(f"{error}; {fix}")
    if is_main:
        _publish_report(report, tmp, out_dir)
        print(f"hf export: {out_dir} files={len(report['files'])} missing_keys=0 unexpected_keys=0 "
              f"max_abs_tensor_diff={report['max_abs_tensor_diff']:.1e} max_abs_logit_diff="
              f"{report['max_abs_logit_diff']:.3e} (tol {report['logit_tolerance']:g}, {compute_dtype})", flush=True)
    _barrier()
    return report if is_main else None


# -- model=hf: gathered on rank 0 (transformers' own save_pretrained) -----------------------------


def export_hf_backend(backend, out_dir: Path, *, tokenizer_json: Path, inputs, reference_logits,
                      max_shard_size="5GB") -> dict | None:
    """model=hf: the full state dict gathered to rank 0, saved by transformers, then the same reload check."""
    from torch.distributed.tensor import DTensor
    from transformers import AutoModelForCausalLM

    is_main = not _dist() or torch.distributed.get_rank() == 0
    full = {}
    for k, v in _unwrap(backend.model).state_dict().items():
        v = v.full_tensor() if isinstance(v, DTensor) else v
        if is_main:
            full[k] = v.detach().cpu()
    report = None
    if is_main:
        out_dir = Path(out_dir)
        tmp = out_dir.with_name(f".{out_dir.name}.tmp-export")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        try:
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
            _publish_report(report, tmp, out_dir)
        except OSError as e:  # a full disk, a file-size limit, a read-only out_dir: one line
            shutil.rmtree(tmp, ignore_errors=True)
            why, advice = write_failure(e, out_dir.parent, "out_dir")
            raise ExportError(f"HF export {out_dir}: {why}; the partial export was removed; {advice}") from None
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        print(f"hf export: {out_dir} missing_keys=0 unexpected_keys=0 max_abs_logit_diff="
              f"{report['max_abs_logit_diff']:.3e}", flush=True)
    _barrier()
    return report


# -- from a run -------------------------------------------------------------------------------


def held_out_inputs(data) -> torch.Tensor:
    batches = data.val_batches(1, 0, 1)
    return batches[0].inputs if batches else data.train_batch(0, 0, 1, 0, 1, 0).inputs


def compute_dtype(cfg, backend, precision: dict | None = None) -> str:
    """float32, or bfloat16 where the trained model computes in it: FSDP2's bf16 parameters (``precision``, the
    Trainer's plan: the reference forward gathers bf16 copies, so its logits carry bf16 rounding against the float32
    reload: 2-3e-2 on tiny, tp2 bf16), or torchtitan's MoE experts (no fp32 expert kernel installed)."""
    from qwen3_research.kernels import kernel_replaces

    if (precision or {}).get("param_dtype") == "bfloat16":
        return "bfloat16"
    if not getattr(backend, "is_moe", False):
        return "float32"
    for entry in cfg.kernels.entries or []:
        if kernel_replaces(entry.name, "GroupedExperts") and (entry.options or {}).get("dtype", "input") in ("input", "float32"):
            return "float32"
    return "bfloat16"


@torch.no_grad()
def reference_logits(backend, inputs: torch.Tensor, compute_dtype: str) -> tuple[torch.Tensor, str]:
    """(the trained model's float32 logits on ``inputs``, the dtype they were computed in): a MoE whose experts run
    in bfloat16 is computed with float32 experts where torchtitan allows it (``titan.float32_experts``), as
    transformers computes the reload; its bf16 rounding, which near-tie routing amplifies on a few tokens (0.056),
    is then not charged to the export. Collective under a sharded model (every rank runs the forward)."""
    from qwen3_research import titan

    with titan.float32_experts(backend.model) if compute_dtype == "bfloat16" else contextlib.nullcontext(False) as f32:
        logits = backend.forward(inputs)
    logits = logits.full_tensor() if hasattr(logits, "full_tensor") else logits
    return logits.float(), "float32" if f32 else compute_dtype


def export_trained(backend, out_dir: Path, *, inputs: torch.Tensor, device: torch.device, tokenizer,
                   compute_dtype: str) -> dict | None:
    """A run's model (possibly sharded) -> ``out_dir``, verified against its own logits on ``inputs``.

    Collective: the reference forward on every rank, then the sharded write and verification.
    ``tokenizer``: the run's (``data.Tokenizer``: its file and end-of-text id go with the export).
    """
    model = backend.model
    model.eval()
    logits, compute_dtype = reference_logits(backend, inputs.to(device), compute_dtype)
    model.train()
    logits = logits.cpu()
    if hasattr(backend, "flavor"):
        return export_native(backend, out_dir, tokenizer_json=tokenizer.path, eos_id=tokenizer.eos_id, inputs=inputs,
                             reference_logits=logits, compute_dtype=compute_dtype)
    return export_hf_backend(backend, out_dir, tokenizer_json=tokenizer.path, inputs=inputs, reference_logits=logits)
