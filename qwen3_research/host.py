"""The device kind a run will use, asked of the host without importing torch.

For defaults chosen per device before torch is loaded: the CPU allocator (``allocator``, which runs before any
heavy import and may re-exec the command) and the auto settings of the config (``config.resolve_auto_settings``).
``torch.cuda.is_available()`` in a launching parent would also spoil the CUDA state of workers forked from it.
Standard library only.

The same rule as ``devices.device_kind`` (the one device-kind function of code that must not import torch, asked of
each kind's spec). This module stays only because ``config.py`` (the base layer) may not import ``devices`` (the
adapters layer above it): once config's device decisions (``auto_loss``, ``auto_mixed_precision``,
``runs_on_neuron``) move to ``resolve``, which asks ``devices``, delete it.
"""

from __future__ import annotations

import importlib.util
import os


def device_kind_before_torch(requested: str) -> str:
    """The device a run with ``device.type=requested`` uses: ``requested`` unless it is auto; auto is neuron where
    TorchNeuron is installed, cuda where the NVIDIA driver lists a GPU (and CUDA_VISIBLE_DEVICES does not hide them
    all), else cpu (the rule of ``devices.device_kind``)."""
    if requested != "auto":
        return requested
    if importlib.util.find_spec("torch_neuronx") is not None:
        return "neuron"
    try:
        if os.listdir("/proc/driver/nvidia/gpus") and os.environ.get("CUDA_VISIBLE_DEVICES", "0") not in ("", "-1"):
            return "cuda"
    except OSError:
        pass
    return "cpu"
