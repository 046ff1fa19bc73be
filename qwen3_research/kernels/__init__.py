"""Kernel overrides: the registry (``registry.py``, a leaf) and the kernels that register into it.

``apply_overrides(model, cfg, device, dtype=...) -> {entry: [module FQN, ...]}`` is what the Trainer calls
before sharding. Kernels: ``moe_fast``/``rope_fast`` (CPU and CUDA, torch ops),
``triton_moe``/``triton_rope`` (CUDA; CPU under TRITON_INTERPRET=1), ``nki_moe``/``nki_rope``
(Trainium; torch_neuronx imported only when installed). See docs/KERNELS.md.

Importing this package imports every kernel module, and each registers its ``KernelSpec`` (and custom
ops) in ``registry.KERNELS``; the kernel modules import the registry and the shared verification helpers
(``verify``), never this package. Adding a kernel is one module and one import line below.
"""

from qwen3_research.kernels import moe, nki, rope, triton_kernels  # noqa: F401  (each registers its kernels)
from qwen3_research.kernels.registry import (KERNELS, KernelMatchWarning, format_plan, install, kernel_replaces,
                                             kernel_support, resolve)
from qwen3_research.kernels.verify import verify_plan

__all__ = ["KERNELS", "KernelMatchWarning", "apply_overrides", "format_plan", "kernel_replaces", "kernel_support",
           "resolve", "load"]


def apply_overrides(model, cfg, device, *, dtype: str):
    """Resolve, check, install; print and log the plan; verify if ``kernels.verify``. Before sharding. ``dtype``: the
    run's compute dtype (``resolve.PrecisionPlan.compute_dtype``)."""
    plan = install(model, resolve(model, cfg, device, dtype=dtype), cfg, device)
    if cfg.kernels.verify:
        verify_plan(model, plan, cfg, device, dtype=dtype, raise_on_fail=True)
    return plan


def load():
    """Every registered kernel (all are registered once this package is imported)."""
    return KERNELS
