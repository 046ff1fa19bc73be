"""The torchtitan adapter: this package is the only part of qwen3_research that imports torchtitan.

torchtitan's API changed across ~270 files between 0.2 and 0.3, and AWS's torchtitan-neuron fork
follows its own base (0.2.2). Everything the project needs from torchtitan is asked here, so a
torchtitan change is a change to this package alone. The rest of the package imports this facade
(``from qwen3_research import titan``) and never its modules:

- ``common.py``: what is the same on every API (feature detection, version facts, the MoE token-group
  padding for TorchNeuron, gradient clipping, the GPU peak table, FlexAttention masks);
- ``v03.py``: upstream 0.3.x (models from nested ``Config`` objects);
- ``v02.py``: the 0.2.x API (upstream 0.2.2, AWS's torchtitan-neuron 0.2.2+neuron.1; ModelArgs + JobConfig), and
  ``v02_seams.py``: what its model gets that 0.3.x has (chunked-loss hidden states, masks, MoE and TP on CPU).

Exactly one API module is bound below, once per process, by feature detection (``legacy()``: a probe for
a module on disk, never the version string). Dropping 0.2.x is deleting ``v02.py``, ``v02_seams.py`` and the one
line that binds it (``if legacy(): ...``). Both expose the same names (``API``); ``check_supported`` refuses at start-up, in one line,
what the installed version cannot run.

Import torchtitan (through any function here) only after ``device.prepare_torchtitan``: torchtitan reads
the device type at import. Importing this facade imports no torchtitan module.
"""

from __future__ import annotations

from qwen3_research.titan import v03 as api  # torchtitan 0.3.x
from qwen3_research.titan.common import (NEURON_GROUP_ALIGN, balanced_expert_exchange, clip_grad_norm_, distribution,
                                         flex_attention_masks, float32_experts,
                                         gpu_peak_flops, legacy, native_only_buffer, padded_groups, version)
from qwen3_research.titan.common import align_token_groups as _align_token_groups

if legacy(): from qwen3_research.titan import v02 as api  # noqa: E701 - the 0.2.x API; dropping 0.2.x deletes this line and v02.py

# What each API module provides, under the same names (tests/test_stack.py checks both have all of them).
API = (
    "check_supported", "expert_weights", "prepare_kernel_targets", "unpadded_experts_forward",
    "qwen3_model_config", "qwen3_config_for_architecture", "apply_parallelism_plans", "build_model",
    "nparams_and_flops", "init_weights", "parallelize_qwen3", "register_moe_load_balancing_hook",
    "state_dict_adapter", "parallel_dims", "training_configs", "apply_activation_checkpointing", "no_parallel",
    "mark_expert_counts_varying", "set_moe_load_balance", "attach_router_hooks", "document_attention_masks",
    "separate_qkv", "pipeline_qwen3",
)


def align_token_groups(model, device_type: str, align: int | None = None) -> int:
    """On neuron: pad each expert's token group to TorchNeuron's grouped-matmul alignment (``common``)."""
    return _align_token_groups(model, device_type, align, api.unpadded_experts_forward)


# -- the names the package uses, bound to the installed API ---------------------------------------
# check_supported(rc, *, moe): refuse at start-up, in one line (ConfigError), what the installed torchtitan
# cannot run for a torchtitan Qwen3 model (moe: Qwen3-MoE); the native backends ask it (models.check_run).
check_supported = api.check_supported
expert_weights = api.expert_weights  # (w1, w2, w3) of torchtitan's GroupedExperts
prepare_kernel_targets = api.prepare_kernel_targets  # modules kernels replace that the API lacks (0.2.x RoPE)
qwen3_model_config = api.qwen3_model_config  # torchtitan's Qwen3 config for a flavor
qwen3_config_for_architecture = api.qwen3_config_for_architecture  # ... for an HF config.json's architecture
separate_qkv = api.separate_qkv  # q/k/v as three Linears (LoRA's per-projection adapters), before the build
apply_parallelism_plans = api.apply_parallelism_plans  # TP/SP/EP plans on the config before the build
build_model = api.build_model  # the nn.Module (under torch.device("meta"))
nparams_and_flops = api.nparams_and_flops  # (parameters, training FLOPs per token): torchtitan's formula
init_weights = api.init_weights  # seeded init of the (full or sharded) model
parallelize_qwen3 = api.parallelize_qwen3  # FSDP, TP/SP, EP, activation checkpointing
pipeline_qwen3 = api.pipeline_qwen3  # pipeline stages (torchtitan's pipeline_llm), each sharded as above
register_moe_load_balancing_hook = api.register_moe_load_balancing_hook
state_dict_adapter = api.state_dict_adapter  # torchtitan's Qwen3 HF <-> native key mapping
parallel_dims = api.parallel_dims  # torchtitan's ParallelDims for our degrees
training_configs = api.training_configs  # the config objects parallelize_qwen3 reads
apply_activation_checkpointing = api.apply_activation_checkpointing  # single process, no sharding
no_parallel = api.no_parallel  # torchtitan's NoParallel TP style
mark_expert_counts_varying = api.mark_expert_counts_varying  # spmd_types' type checker (0.3.x)
set_moe_load_balance = api.set_moe_load_balance  # the expert-bias coefficient (None: off) on the config, before the build
attach_router_hooks = api.attach_router_hooks  # fn(layer, router, probs, ids) after each MoE router forward
document_attention_masks = api.document_attention_masks  # masks of packed documents from per-document positions
