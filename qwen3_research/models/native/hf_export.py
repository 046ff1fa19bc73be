"""model=native -> a verified Hugging Face directory (config.json, sharded safetensors + index, tokenizer).

Any parallel layout is written without gathering: torchtitan's ``to_hf`` renames each rank's local shards,
``dcp.save`` with ``HuggingFaceStorageWriter(save_distributed=True)`` writes each rank's part, and
``consolidate_safetensors_files_on_every_rank`` assembles the ``model-0000i-of-0000n.safetensors`` files (each
rank builds some, file by file) plus ``model.safetensors.index.json`` — the same route as torchtitan's
``dcp_save(to_hf=True)``.

Verification, before anything is moved into place (``models.hf_export``: a failure is ExportError, exit 1, the
previous export untouched, the temporary directory removed):
1. every tensor read back from the written files equals the trained one (each rank compares its own
   shards; the worst tensor is named);
2. ``AutoModelForCausalLM.from_pretrained`` (rank 0) reloads it with no missing, unexpected or
   mismatched keys, and its logits on held-out tokens match the trained model's within
   ``LOGIT_TOL[compute dtype]``.

``config.json`` is the trained architecture (``hf_config.hf_config_fields``: rope_theta, tie setting, eps of an
init_from model), weights are written in the parameters' dtype (fp32).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter
from torch.distributed.checkpoint._consolidate_hf_safetensors import (
    consolidate_safetensors_files,
    consolidate_safetensors_files_on_every_rank,
)
from torch.distributed.checkpoint.api import CheckpointException

from qwen3_research import titan
from qwen3_research.errors import ExportError, root_cause, write_failure
from qwen3_research.models.hf_export import (LOGIT_TOL, barrier, copy_tokenizer, file_index, is_distributed, local,
                                             publish_report, unwrap, verify_reload)
from qwen3_research.models.native.hf_config import expected_hf_shapes, hf_config_fields

# Test hook: swap these two tensors (comma-separated HF names) in the written files before verification.
SWAP_ENV = "QWEN3_RESEARCH_TEST_SWAP_EXPORT"


def hf_config_for_flavor(flavor, moe: bool, eos_id: int | None):
    """Qwen3Config / Qwen3MoeConfig with the architecture's fields (the ones init_from reads)."""
    from transformers import Qwen3Config, Qwen3MoeConfig

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


def _hf_state(model, model_config) -> dict:
    sd = {k: v for k, v in unwrap(model).state_dict().items() if not titan.native_only_buffer(k)}
    return titan.state_dict_adapter(model_config).to_hf(sd)


def _dropped_native_tensors(model) -> list[str]:
    """Non-zero native-only tensors ``_hf_state`` leaves out (torchtitan's MoE expert bias), with their size (this
    rank's part). Rank 0 alone calls it: buffers, not ``state_dict()``, which is collective under TP (torchtitan's
    fused QKV redistributes its shards on save; a 2-rank tp run hung there, its peer waiting in the broadcast)."""
    out = []
    for k, v in unwrap(model).named_buffers():
        if titan.native_only_buffer(k):
            peak = float(local(v).float().abs().max()) if local(v).numel() else 0.0
            if peak > 0:
                out.append(f"{k} (max |value| {peak:.3g})")
    return out


def write_sharded(hf_sd: dict, tmp: Path, mapping: dict[str, int]) -> list[str]:
    """Collective: each rank writes its shards, then the consolidated files are built file by file."""
    sharded = tmp / "sharded"
    dcp.save(hf_sd, storage_writer=HuggingFaceStorageWriter(path=str(sharded), save_distributed=True,
                                                            fqn_to_index_mapping=mapping, enable_consolidation=False))
    barrier()
    if is_distributed():  # each rank builds some of the files; rank 0 writes the index
        consolidate_safetensors_files_on_every_rank(input_dir=str(sharded), output_dir=str(tmp), fqn_to_index_mapping=mapping)
    else:  # the on-every-rank variant writes no index without a process group
        consolidate_safetensors_files(input_dir=str(sharded), output_dir=str(tmp), fqn_to_index_mapping=mapping)
    barrier()
    if not is_distributed() or torch.distributed.get_rank() == 0:
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
    back = {k: torch.zeros_like(v) for k, v in hf_sd.items()}
    dcp.load(back, storage_reader=HuggingFaceStorageReader(str(tmp)))
    diffs = torch.zeros(len(names), dtype=torch.float64)
    pos = {k: i for i, k in enumerate(names)}
    for k, v in hf_sd.items():
        a, b = local(back[k]).float(), local(v).float()
        if a.numel() and k in pos:
            diffs[pos[k]] = float((a - b).abs().max())
    if is_distributed():
        torch.distributed.all_reduce(diffs, op=torch.distributed.ReduceOp.MAX)
    return dict(zip(names, diffs.tolist()))


def export_native(backend, out_dir: Path, *, tokenizer_json: Path, eos_id: int | None, inputs: torch.Tensor,
                  reference_logits: torch.Tensor, compute_dtype: str = "float32", max_shard_size="5GB") -> dict | None:
    """Collective over all ranks (also fine in one process): write, verify, publish. Returns rank 0's report."""
    is_main = not is_distributed() or torch.distributed.get_rank() == 0
    out_dir = Path(out_dir)
    tmp = out_dir.with_name(f".{out_dir.name}.tmp-export")
    try:  # from the directory's creation: a Ctrl-C right after mkdir leaves nothing behind either
        if is_main:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        return _export_native(backend, out_dir, tmp, is_main, tokenizer_json=tokenizer_json, eos_id=eos_id,
                              inputs=inputs, reference_logits=reference_logits, compute_dtype=compute_dtype,
                              max_shard_size=max_shard_size)
    except BaseException:  # a failed check, a full disk, Ctrl-C: the temporary directory never stays behind
        if is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        raise


def _export_native(backend, out_dir: Path, tmp: Path, is_main: bool, *, tokenizer_json, eos_id, inputs,
                   reference_logits, compute_dtype, max_shard_size) -> dict | None:
    barrier()
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
        barrier()
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
    if is_distributed():
        box = [(error, fix)]
        torch.distributed.broadcast_object_list(box, src=0)
        error, fix = box[0] if box[0][0] else (error, fix)
    if error:
        if is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        barrier()
        raise ExportError(f"{error}; {fix}")
    if is_main:
        publish_report(report, tmp, out_dir)
        print(f"hf export: {out_dir} files={len(report['files'])} missing_keys=0 unexpected_keys=0 "
              f"max_abs_tensor_diff={report['max_abs_tensor_diff']:.1e} max_abs_logit_diff="
              f"{report['max_abs_logit_diff']:.3e} (tol {report['logit_tolerance']:g}, {compute_dtype})", flush=True)
    barrier()
    return report if is_main else None

