"""Kernel overrides: the registry (``registry.py``) and the kernels it can install.

``apply_overrides(model, cfg, device) -> {entry: [module FQN, ...]}`` is what the Trainer calls
before sharding. Kernels: ``moe_fast``/``rope_fast`` (CPU and CUDA, torch ops),
``triton_moe``/``triton_rope`` (CUDA; CPU under TRITON_INTERPRET=1), ``nki_moe``/``nki_rope``
(Trainium; torch_neuronx imported only when installed). See docs/KERNELS.md.
"""

from qwen3_research.kernels.registry import KERNELS, KernelMatchWarning, apply_overrides, format_plan, resolve


def __getattr__(name):  # the kernel modules register on first access of KERNELS' contents
    raise AttributeError(name)


__all__ = ["KERNELS", "KernelMatchWarning", "apply_overrides", "format_plan", "resolve", "load"]


def load():
    from qwen3_research.kernels.registry import _load_kernels

    _load_kernels()
    return KERNELS
