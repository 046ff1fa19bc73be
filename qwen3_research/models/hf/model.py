"""The nn side of ``model=hf`` (``models.hf``): Hugging Face Transformers' AutoModelForCausalLM from a
directory or Hub id, and its export (``models.hf.export``).

FSDP2 over the decoder layers (``model.model.layers``), and tensor parallel for dense
Qwen3-style blocks (q/k/v/o, gate/up/down projections). fp32 weights; SDPA attention.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

from qwen3_research import lora, routing, titan
from qwen3_research.config import ConfigError, ModelConfig
from qwen3_research.data import tokenizer_path
from qwen3_research.models import registry
from qwen3_research.models.base import ModelBackend
from qwen3_research.models.hf import export as hf_export
from qwen3_research.models.hf.source import check_source

# Module names of a Qwen3 / Llama-style dense decoder layer that tensor parallel shards.
_TP_DENSE_TYPES = {"qwen3", "qwen2", "llama", "mistral"}


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"


def hf_flops_per_token(model: nn.Module, text, n_heads: int, head_dim: int, seq_len: int) -> int:
    """torchtitan's formula (models/utils.get_moe_model_nparams_and_flops) for an HF model: 6 FLOPs per
    matmul parameter and token, counting only the active experts and keeping a tied embedding (it is
    also the lm_head), plus 12·layers·heads·head_dim·seq_len for attention scores."""
    named = dict(model.named_parameters())  # tied weights appear once
    total = sum(p.numel() for p in named.values())
    experts = sum(p.numel() for n, p in named.items() if ".experts." in n)
    num_experts = int(getattr(text, "num_experts", None) or getattr(text, "num_local_experts", None) or 0)
    top_k = int(getattr(text, "num_experts_per_tok", 0) or 0)
    active_experts = experts * top_k // num_experts if num_experts else experts
    emb = model.get_input_embeddings().weight.numel()
    tied = bool(getattr(text, "tie_word_embeddings", False))
    matmul = total - experts + active_experts - (0 if tied else emb)
    return int(6 * matmul + 12 * text.num_hidden_layers * n_heads * head_dim * seq_len)


class HFCausalLM(ModelBackend):
    def __init__(self, cfg: ModelConfig, device: torch.device, *, seq_len: int, seed: int):
        from transformers import AutoConfig, AutoModelForCausalLM

        path = os.path.expanduser(cfg.path)
        check_source(cfg.path)
        try:
            config = AutoConfig.from_pretrained(path, trust_remote_code=cfg.trust_remote_code)
        except Exception as e:  # noqa: BLE001 - transformers raises OSError, ValueError, KeyError …
            raise ConfigError(f"model.path={cfg.path!r}: cannot read the model config ({_one_line(e)})") from None
        torch.manual_seed(seed)  # weights the checkpoint lacks would be drawn from here (we refuse them below)
        try:
            model, info = AutoModelForCausalLM.from_pretrained(
                path, config=config, trust_remote_code=cfg.trust_remote_code, attn_implementation="sdpa",
                dtype=torch.float32, output_loading_info=True,
                use_safetensors=True,  # never unpickle a pytorch_model.bin
            )
        except Exception as e:  # noqa: BLE001 - corrupt/missing safetensors, unsupported architecture, …
            raise ConfigError(f"model.path={cfg.path!r}: cannot load the model ({_one_line(e)})") from None
        missing = list(info.get("missing_keys") or [])
        mismatched = list(info.get("mismatched_keys") or [])
        if missing or mismatched:
            what = missing[:3] + [m[0] if isinstance(m, tuple) else m for m in mismatched[:3]]
            raise ConfigError(
                f"model.path={cfg.path!r}: the checkpoint lacks or mis-shapes {len(missing) + len(mismatched)} "
                f"weights (e.g. {', '.join(map(str, what))}); it does not match its config.json"
            )
        max_pos = getattr(config, "max_position_embeddings", None)
        if max_pos and seq_len > max_pos:
            raise ConfigError(f"data.seq_len={seq_len} exceeds model.path's max_position_embeddings={max_pos}")
        self.config = config
        self.model = model.to(device)
        self.model.config.use_cache = False
        self.device = device
        self.model_type = getattr(config, "model_type", "?")
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        self.n_heads = int(text.num_attention_heads)
        self.n_kv_heads = int(getattr(text, "num_key_value_heads", None) or self.n_heads)
        self.num_experts = int(getattr(text, "num_experts", None) or getattr(text, "num_local_experts", None) or 0)
        self.vocab_size = int(text.vocab_size)
        self.num_params = sum(p.numel() for p in self.model.parameters())
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // self.n_heads
        self.flops_per_token = hf_flops_per_token(self.model, text, self.n_heads, head_dim, seq_len)
        if self.num_experts:  # auto follows the checkpoint: its router_aux_loss_coef (qwen3_research.routing)
            self.balance = routing.resolve_balance(cfg.moe, checkpoint=text.to_dict(), what="model.path",
                                                   modes=registry.balance_modes(cfg))
        elif cfg.moe.balance not in ("auto", "none"):
            raise ConfigError(f"model.moe.balance={cfg.moe.balance}: model.path={cfg.path!r} is not a mixture of "
                              "experts; use model.moe.balance=auto")

    def forward(self, inputs: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        # position_ids restarting at 0 make transformers mask each packed document apart (masking_utils:
        # find_packed_sequence_indices, with no attention_mask) and give RoPE the per-document positions
        return self.model(input_ids=inputs, position_ids=positions, use_cache=False).logits

    def attach_router_hooks(self, fn) -> tuple[list, list]:
        """Qwen3-MoE's ``mlp.gate`` (Qwen3MoeTopKRouter) returns (router_logits, router_scores, router_indices)
        (transformers/models/qwen3_moe/modeling_qwen3_moe.py); its probabilities are the softmax of the logits
        in float32, as the router and ``load_balancing_loss_func`` compute them."""
        handles, shapes = [], []
        routers = [layer.mlp.gate for layer in self._layers()
                   if hasattr(getattr(layer, "mlp", None), "gate") and hasattr(layer.mlp.gate, "top_k")]
        for i, gate in enumerate(routers):
            def hook(mod, args, out, i=i):
                logits, _scores, ids = out
                fn(i, mod, torch.softmax(logits.float(), dim=-1), ids)

            handles.append(gate.register_forward_hook(hook))
            shapes.append((int(gate.num_experts), int(gate.top_k)))
        return handles, shapes

    def finalize_single(self, tt) -> None:
        if tt.activation_checkpoint is not None:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    def _layers(self) -> nn.ModuleList:
        layers = getattr(getattr(self.model, "model", None), "layers", None)
        if not isinstance(layers, nn.ModuleList):
            raise ConfigError(
                f"model=hf: {type(self.model).__name__} has no model.layers list; FSDP/TP need a standard decoder-only LM"
            )
        return layers

    def parallelize(self, parallel_dims, tt) -> None:
        """Tensor parallel (dense Qwen3-style) on the tp mesh, then FSDP2 per decoder layer + root on the dp mesh."""
        layers = self._layers()
        if parallel_dims.tp_enabled:
            self._apply_tp(parallel_dims.get_mesh("tp"), layers)
        if tt.activation_checkpoint is not None:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if parallel_dims.fsdp_enabled or parallel_dims.dp_replicate_enabled:
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            names = (["dp_replicate"] if parallel_dims.dp_replicate_enabled else []) + (
                ["fsdp"] if parallel_dims.fsdp_enabled else []
            )
            dp_mesh = parallel_dims.get_mesh(names if len(names) > 1 else names[0])
            dtypes = {"bfloat16": torch.bfloat16, "float32": torch.float32}
            mp = MixedPrecisionPolicy(
                param_dtype=dtypes[tt.training.mixed_precision_param],
                reduce_dtype=dtypes[tt.training.mixed_precision_reduce],
            )
            for i, layer in enumerate(layers):
                # The last layer's params are gathered again right away by the root: keep them.
                fully_shard(layer, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=i < len(layers) - 1)
            fully_shard(self.model, mesh=dp_mesh, mp_policy=mp)

    def _apply_tp(self, tp_mesh, layers: nn.ModuleList) -> None:
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        if self.model_type not in _TP_DENSE_TYPES or self.num_experts:
            raise ConfigError(
                f"parallelism.tp={tp_mesh.size()} with model=hf supports dense Qwen3/Llama-style models, not "
                f"model_type={self.model_type!r}{' (MoE)' if self.num_experts else ''}; use model=native_moe for MoE TP"
            )
        for layer in layers:
            plan = {
                "input_layernorm": titan.no_parallel(use_local_output=True),
                "post_attention_layernorm": titan.no_parallel(use_local_output=True),
                "self_attn.q_proj": ColwiseParallel(),
                "self_attn.k_proj": ColwiseParallel(),
                "self_attn.v_proj": ColwiseParallel(),
                "self_attn.o_proj": RowwiseParallel(),
                "mlp.gate_proj": ColwiseParallel(),
                "mlp.up_proj": ColwiseParallel(),
                "mlp.down_proj": RowwiseParallel(),
            }
            for norm in ("q_norm", "k_norm"):  # per-head RMSNorm on (B, L, heads, head_dim): heads are sharded
                if hasattr(layer.self_attn, norm):
                    plan[f"self_attn.{norm}"] = _HeadShardedNorm()
            parallelize_module(layer, tp_mesh, lora.tp_plan(plan, layer, titan.no_parallel))
        tied = self.model.get_output_embeddings().weight is self.model.get_input_embeddings().weight
        parallelize_module(self.model, tp_mesh, {
            "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
            "model.norm": titan.no_parallel(use_local_output=True),
            "lm_head": ColwiseParallel(output_layouts=Replicate(), use_local_output=True),
        })
        if tied:  # both are vocab-sharded (Shard(0)); restore the single shared parameter
            self.model.lm_head.weight = self.model.model.embed_tokens.weight

    # -- chunked loss (qwen3_research.loss): hidden states and the lm_head weight, apart --------------
    def hidden_states(self, inputs: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """(B, L, hidden) after the final norm, from the whole model's forward (so FSDP's root unit gathers
        the lm_head weight) with ``lm_head`` swapped for an identity during the call."""
        lm_head = self.model.lm_head
        self.model.lm_head = nn.Identity()
        try:
            return self.model(input_ids=inputs, position_ids=positions, use_cache=False).logits
        finally:
            self.model.lm_head = lm_head

    def lm_head_module(self) -> nn.Module:
        return self.model.lm_head

    def lm_head_weight(self) -> torch.Tensor:
        return self.model.lm_head.weight

    def export_hf(self, out_dir, *, tokenizer_json, eos_id=None, inputs, reference_logits, compute_dtype="float32",
                  max_shard_size="5GB") -> dict | None:
        """Gathered to rank 0 and saved by transformers, then verified (float32: this backend's weights are)."""
        return hf_export.export_hf_backend(self, out_dir, tokenizer_json=tokenizer_json, inputs=inputs,
                                           reference_logits=reference_logits, max_shard_size=max_shard_size)


class _HeadShardedNorm(ParallelStyle):
    """Replicated weight; input and output sharded on dim 2 (attention heads), handed on as local tensors."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        def partition(name, mod, mesh):
            for pname, p in list(mod.named_parameters(recurse=False)):
                mod.register_parameter(pname, nn.Parameter(distribute_tensor(p, mesh, [Replicate()])))

        def input_fn(mod, inputs, mesh):
            x = inputs[0]
            if not isinstance(x, DTensor):
                x = DTensor.from_local(x, mesh, [Shard(2)], run_check=False)
            return (x, *inputs[1:])

        def output_fn(mod, out, mesh):
            return out.to_local() if isinstance(out, DTensor) else out

        return distribute_module(module, device_mesh, partition, input_fn, output_fn)


# -- doctor --run ----------------------------------------------------------------------------------
def write_tiny_checkpoint(out: Path) -> Path:
    """A random 2-layer Qwen3 checkpoint (save_pretrained) with the Qwen3 tokenizer files beside it."""
    from transformers import AutoModelForCausalLM, Qwen3Config
    cfg = Qwen3Config(vocab_size=151936, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True,
                      max_position_embeddings=4096)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(out)
    tok_dir = tokenizer_path("qwen3").parent
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt"):
        if (tok_dir / name).exists():
            shutil.copyfile(tok_dir / name, out / name)
    return out
