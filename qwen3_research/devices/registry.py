"""The device kinds: ``register`` (each spec module calls it at import), ``get(kind)``, ``kinds()``.

A kind defined outside the package (tests/toy_device.py) is a module named in ``QWEN3_RESEARCH_DEVICE_MODULES``
(comma-separated, importable from ``sys.path``): ``discover`` imports it with the package's own, in every process of a
run (workers inherit the environment), before anything asks for a kind -- the CPU allocator before its re-exec and
the launcher before any config is composed, which a config key could not reach.
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path

from qwen3_research.devices.spec import DeviceSpec
from qwen3_research.errors import ConfigError

REGISTRY: dict[str, DeviceSpec] = {}
AUTO = "auto"  # device.type=auto: the first present kind by ``DeviceSpec.auto_order``
# The package's modules that are not a device kind; every other module of the folder defines one (a new device is
# one module: ``discover`` imports it, nothing lists it).
NOT_KINDS = frozenset({"spec", "registry", "lnc", "host", "peaks", "neuron_host", "runtime"})
MODULES_ENV = "QWEN3_RESEARCH_DEVICE_MODULES"  # more device modules, outside the package: "pkg.mod,other"
_discovered = False


def discover() -> None:
    """Import every device module of this folder once, then those ``QWEN3_RESEARCH_DEVICE_MODULES`` names (each
    registers its spec at import; all are torch-free). A named module that does not import is a ConfigError."""
    global _discovered
    if _discovered:
        return
    _discovered = True
    # The folder's *.py files, listed directly: pkgutil.iter_modules imports inspect (~6 ms of a config error, whose
    # first process asks the device kind before the allocator's re-exec).
    for path in sorted(Path(__file__).parent.glob("*.py")):
        if path.stem not in NOT_KINDS and not path.stem.startswith("_"):
            importlib.import_module(f"{__package__}.{path.stem}")
    for name in filter(None, (m.strip() for m in os.environ.get(MODULES_ENV, "").split(","))):
        try:
            importlib.import_module(name)
        except ImportError as e:
            raise ConfigError(f"{MODULES_ENV}={os.environ[MODULES_ENV]!r}: device module {name!r} does not import "
                              f"({e}); fix the name or put its folder on PYTHONPATH") from None


def register(spec: DeviceSpec) -> DeviceSpec:
    if spec.kind == AUTO:
        raise ValueError(f"'{AUTO}' is not a device kind (it picks one)")
    REGISTRY[spec.kind] = spec
    return spec


def kinds() -> list[str]:
    """Every registered kind, in auto order (the order device.type=auto tries them)."""
    discover()
    return sorted(REGISTRY, key=lambda k: (REGISTRY[k].auto_order, k))


def find(kind: str) -> DeviceSpec | None:
    """The spec of ``kind``, or None when no module registers it (the caller names the kind in its own terms)."""
    if kind not in REGISTRY:
        discover()
    return REGISTRY.get(kind)


def get(kind: str) -> DeviceSpec:
    """The spec of ``kind``; a ConfigError naming the known kinds otherwise."""
    spec = find(kind)
    if spec is None:
        raise ConfigError(f"device.type={kind!r} is not a device kind; known: {', '.join([AUTO, *kinds()])}")
    return spec
