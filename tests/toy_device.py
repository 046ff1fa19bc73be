"""A toy device kind, added the way any kind is added (qwen3_research/devices/__init__.py): this one module, which
builds a ``DeviceSpec`` and registers it, and one YAML file (tests/conf/device/toy.yaml, ``type: toy``). Nothing in
qwen3_research changes: ``QWEN3_RESEARCH_DEVICE_MODULES=tests.toy_device`` makes the registry import it, and
``hydra.searchpath=[file://tests/conf]`` lets ``device=toy`` find its YAML (a shipped kind's sits in conf/device/).

The kind is backed by the host's CPU (``torch_type="cpu"``: torch's device module and tensors are the CPU's) but is
its own kind to everything that asks the registry: its own dist backend choice, start method, auto settings and
reference peaks. Torch-free at import, as every spec module.
"""

from __future__ import annotations

from qwen3_research.devices.cpu import HostMemory
from qwen3_research.devices.registry import register
from qwen3_research.devices.spec import DeviceSpec

PEAKS = {"bf16": 1e12, "fp32": 1e12}  # made-up reference peaks: nothing is measured for a toy


def _torch_device(device_type: str, local_rank: int):
    import torch

    return torch.device(device_type)


SPEC = register(DeviceSpec(
    kind="toy",
    torch_type="cpu",
    dist_backend="gloo",
    start_method="spawn",  # unlike cpu: proves the kind, not the cpu spec, decides how workers start
    auto_order=1000,  # never auto's choice: a run asks for it by name
    present=lambda: False,
    available=lambda: True,
    visible=lambda: True,
    unavailable_reason=lambda: "",
    local_devices=lambda lnc: 1,
    default_precision="none",
    default_loss="full",
    runs_on_host=True,  # its memory is the host's, its compute the CPU's
    peaks=PEAKS,
    torch_device=_torch_device,
    memory=HostMemory,
    peak_flops=lambda dev, key, dtype: PEAKS[key],
))
