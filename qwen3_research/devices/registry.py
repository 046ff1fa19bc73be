"""The device kinds: ``register`` (each spec module calls it at import), ``get(kind)``, ``kinds()``."""

from __future__ import annotations

import importlib
import pkgutil
from pathlib import Path

from qwen3_research.devices.spec import DeviceSpec
from qwen3_research.errors import ConfigError

REGISTRY: dict[str, DeviceSpec] = {}
AUTO = "auto"  # device.type=auto: the first present kind by ``DeviceSpec.auto_order``
# The package's modules that are not a device kind; every other module of the folder defines one (a new device is
# one module: ``discover`` imports it, nothing lists it).
NOT_KINDS = frozenset({"spec", "registry", "lnc", "host", "peaks", "neuron_host", "runtime"})
_discovered = False


def discover() -> None:
    """Import every device module of this folder once (each registers its spec at import; all are torch-free)."""
    global _discovered
    if _discovered:
        return
    _discovered = True
    for info in pkgutil.iter_modules([str(Path(__file__).parent)]):
        if info.name not in NOT_KINDS and not info.name.startswith("_"):
            importlib.import_module(f"{__package__}.{info.name}")


def register(spec: DeviceSpec) -> DeviceSpec:
    if spec.kind == AUTO:
        raise ValueError(f"'{AUTO}' is not a device kind (it picks one)")
    REGISTRY[spec.kind] = spec
    return spec


def kinds() -> list[str]:
    """Every registered kind, in auto order (the order device.type=auto tries them)."""
    discover()
    return sorted(REGISTRY, key=lambda k: (REGISTRY[k].auto_order, k))


def get(kind: str) -> DeviceSpec:
    """The spec of ``kind``; a ConfigError naming the known kinds otherwise."""
    spec = REGISTRY.get(kind)
    if spec is None:
        discover()
        spec = REGISTRY.get(kind)
    if spec is None:
        raise ConfigError(f"device.type={kind!r} is not a device kind; known: {', '.join([AUTO, *kinds()])}")
    return spec
