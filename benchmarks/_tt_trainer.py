"""torchtitan 0.3.0's own ``torchtitan.trainer.Trainer`` on CPU (GUIDE §2 workarounds).

What it takes to run torchtitan's trainer (not just its model) on a CPU-only host:
  1. device detection pinned to "cpu" before torchtitan is imported (``_common`` does it);
  2. torchtitan's ``device_module`` (bound at import in tools.utils, components.metrics,
     distributed.utils, tools.profiler) is ``torch.cpu``, which lacks ``get_device_name`` /
     ``get_device_properties`` / ``memory_stats`` / ``empty_cache``, and whose
     ``current_device()`` returns "cpu" (``barrier(device_ids=["cpu"])`` then raises a
     TypeError after step 1): a small shim answers them (psutil for memory, index 0);
  3. torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE = 0, 0, 1), and
     ``init_distributed`` needs a process group: a one-rank gloo group over a HashStore;
  4. attention: SDPA (FlexAttention has no CPU backward) — we hand it the same model config
     ``model=native`` builds, which already uses SDPA on CPU;
  5. CUDA graphs off (``training.disable_cuda_graphs``), AdamW ``foreach`` (``fused`` is CUDA-first),
     activation checkpointing off, checkpointing off, no dataset download: a dataloader that
     yields the very batches our Trainer reads (same tokens, same order).
"""

from __future__ import annotations

import dataclasses
import os
import types
from dataclasses import dataclass

import _common as C  # noqa: F401  (pins the device first)


def _cpu_device_module_shim():
    import psutil
    import torch

    shim = types.SimpleNamespace()
    shim.get_device_name = lambda *a, **k: "cpu"
    shim.current_device = lambda *a, **k: 0
    shim.get_device_properties = lambda *a, **k: types.SimpleNamespace(total_memory=psutil.virtual_memory().total,
                                                                        name="cpu")
    shim.reset_peak_memory_stats = lambda *a, **k: None
    shim.empty_cache = lambda *a, **k: None
    shim.memory_stats = lambda *a, **k: {"active_bytes.all.peak": psutil.Process().memory_info().rss,
                                         "reserved_bytes.all.peak": psutil.Process().memory_info().rss,
                                         "num_alloc_retries": 0, "num_ooms": 0}
    shim.synchronize = lambda *a, **k: None
    shim.set_device = lambda *a, **k: None
    shim.device_count = lambda: 1
    shim.is_available = lambda: True
    shim.__getattr__ = lambda name: getattr(torch.cpu, name)
    return shim


def apply_cpu_workarounds() -> None:
    import torch
    import torch.distributed as dist
    from torchtitan.components import metrics as tt_metrics
    from torchtitan.tools import utils as tt_utils

    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_WORLD_SIZE", "1")):
        os.environ.setdefault(key, value)  # torchtitan reads its rank from the torchrun environment
    shim = _cpu_device_module_shim()
    import torchtitan.distributed.utils as tt_dist
    import torchtitan.tools.profiler as tt_profiler

    # Every torchtitan module that bound torch.cpu as "device_module" at import.
    for module in (tt_metrics, tt_utils, tt_dist, tt_profiler):
        if getattr(module, "device_module", None) is torch.cpu:
            module.device_module = shim
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    torch.autograd.set_multithreading_enabled(False)  # what torchtitan's init_distributed would set
    # torchtitan.tools.utils.get_peak_flops shells out to lspci for GPUs; on CPU it falls back
    # to an A100 figure. MFU is not compared here (tokens/s is), so that is left as is.


def make_dataloader_config(batches):
    """A torchtitan dataloader Config that yields our Trainer's batches (dict(input=...), labels)."""
    import torch
    from torchtitan.components.dataloader import BaseDataLoader

    class ListDataLoader(BaseDataLoader):
        @dataclass(kw_only=True, slots=True)
        class Config(BaseDataLoader.Config):
            pass

        def __init__(self, config=None, **kwargs):
            self.batches = batches

        def __iter__(self):
            for inputs, labels in self.batches:
                yield {"input": inputs.clone()}, labels.clone()

        def state_dict(self):
            return {}

        def load_state_dict(self, state_dict):
            pass

    return ListDataLoader.Config()


def build_tt_trainer(our_trainer, batches, *, steps: int, log_freq: int = 1, dump_folder: str):
    """torchtitan's Trainer over the same model config, batch, steps, optimizer and clipping."""
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.components.metrics import MetricsProcessor
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
    from torchtitan.components.tokenizer import HuggingFaceTokenizer
    from torchtitan.config import ParallelismConfig, TrainingConfig
    from torchtitan.models.qwen3 import model_registry
    from torchtitan.trainer import Trainer as TTTrainer

    from qwen3_research.data import tokenizer_path
    from qwen3_research.titan import qwen3_model_config

    apply_cpu_workarounds()
    cfg = our_trainer.cfg
    flavor = our_trainer.step.backend.flavor
    spec = dataclasses.replace(model_registry("debugmodel"), flavor=cfg.model.flavor,
                               model=qwen3_model_config(flavor, "sdpa", "cpu"))
    if not flavor.num_experts:
        spec = dataclasses.replace(spec, post_optimizer_build_fn=None)
    o = cfg.optimizer
    config = TTTrainer.Config(
        model_spec=spec,
        hf_assets_path=str(tokenizer_path("qwen3").parent),
        dump_folder=dump_folder,
        loss=CrossEntropyLoss.Config(),
        tokenizer=HuggingFaceTokenizer.Config(),
        metrics=MetricsProcessor.Config(log_freq=log_freq),
        dataloader=make_dataloader_config(batches),
        optimizer=dataclasses.replace(default_adamw(lr=o.lr, weight_decay=o.weight_decay, eps=o.eps,
                                                    betas=tuple(o.betas)), implementation="foreach"),
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps=o.warmup_steps, decay_type="cosine",
                                                  min_lr_factor=o.min_lr_ratio),
        training=TrainingConfig(local_batch_size=cfg.data.batch_size, seq_len=cfg.data.seq_len, steps=steps,
                                max_norm=o.grad_clip, dtype="float32", mixed_precision_param="float32",
                                disable_cuda_graphs=True),
        parallelism=ParallelismConfig(spmd_backend="partial_dtensor"),
        checkpoint=CheckpointManager.Config(enable=False),
        activation_checkpoint=None,
    )
    return TTTrainer(config)
