"""A simulated trn2.48xlarge for CPU tests: TEST DOUBLES of what a Trainium host has. No Neuron hardware here.

``trn2_host(tmp_path, ...)`` writes, under ``tmp_path``, and returns the environment that makes a child process
see them:

- ``pkgs/``: importable test doubles of ``torch_neuronx`` (``device_count()`` per LNC and visible cores: 64
  logical cores at LNC=2, 128 at LNC=1, as a trn2.48xlarge; ``torch.neuron.get_device_properties(i).total_memory``
  = 24 GiB per LNC=2 core), of ``nki`` and ``nkilib`` (importable, empty), with ``*.dist-info`` so
  ``importlib.metadata`` reports AWS's package versions; optionally a ``triton`` that fails to import as an
  absent triton does (``triton_missing``).
- ``bin/``: ``neuron-ls`` printing AWS's documented ``--json-output`` shape (16 devices x 4 logical cores,
  96 GiB each; optionally a process holding some devices), ``fi_info`` listing the efa provider, and
  ``dpkg-query`` listing the aws-neuronx packages.
- ``sys/module/neuron/version``: the driver version (``QWEN3_SYSFS_ROOT`` points the doctor there).
- ``neff_cache/``: ``TORCH_NEURONX_NEFF_CACHE_DIR``.

Only start-up validation can run against these (every run, doctor and verify command stops before a device is
used, or asks these doubles in child processes); nothing here imitates computation.
"""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GIB = 1024**3
DRIVER_VERSION = "2.25.4.0"
PACKAGES = {"aws-neuronx-dkms": "2.25.4.0", "aws-neuronx-runtime-lib": "2.29.40.0",
            "aws-neuronx-collectives": "2.29.41.0", "aws-neuronx-tools": "2.27.33.0"}
DISTS = {"torch_neuronx": ("torch-neuronx", "2.14.0"), "neuronx_cc": ("neuronx-cc", "2.22.12471.0"),
         "nki": ("nki", "0.3.0"), "nkilib": ("nkilib", "0.3.0")}

TORCH_NEURONX = '''"""TEST DOUBLE of AWS's torch_neuronx (tests/neuron_host_double.py): only the facts start-up validation asks of
a trn2.48xlarge. device_count(): logical cores at NEURON_LOGICAL_NC_CONFIG (64 at 2, 128 at 1), limited by
NEURON_RT_VISIBLE_CORES / NEURON_RT_NUM_CORES as the runtime limits them; torch.neuron.get_device_properties(i)
.total_memory: 24 GiB per LNC=2 core. No device, no runtime."""
import os
import types

import torch


def _visible():
    vis = os.environ.get("NEURON_RT_VISIBLE_CORES", "").strip()
    if vis:
        lo, _, hi = vis.partition("-")
        return int(hi or lo) - int(lo) + 1
    return int(os.environ.get("NEURON_RT_NUM_CORES") or 0)


def device_count():
    cores = {"1": 128, "2": 64}[os.environ.get("NEURON_LOGICAL_NC_CONFIG", "2")]
    return min(cores, _visible() or cores)


def _properties(device=None):
    lnc = int(os.environ.get("NEURON_LOGICAL_NC_CONFIG", "2"))
    return types.SimpleNamespace(name="trn2 (test double)", total_memory=12 * 1024**3 * lnc)


torch.neuron = types.SimpleNamespace(device_count=device_count, get_device_properties=_properties)
'''

NEURON_LS = '''#!{python}
"""TEST DOUBLE of neuron-ls: AWS's --json-output shape (Neuron LS user guide), from neuron-ls.json beside it."""
import sys
from pathlib import Path
if "--json-output" not in sys.argv and "-j" not in sys.argv:
    sys.exit("test double: only --json-output")
sys.stdout.write(Path(__file__).with_suffix(".json").read_text())
'''

FI_INFO = '''#!/bin/sh
# TEST DOUBLE of libfabric's fi_info -p efa on a trn2.48xlarge with EFA interfaces.
for i in 0 1; do
  echo "provider: efa"
  echo "    fabric: efa"
  echo "    domain: rdmap${i}s0-rdm"
  echo "    version: 122.0"
  echo "    type: FI_EP_RDM"
  echo "    protocol: FI_PROTO_EFA"
done
'''


def _script(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)


def neuron_ls_json(held: dict[int, tuple[int, str]] | None = None) -> list[dict]:
    """16 devices x 4 logical cores at LNC=2 (AWS's trn2 example); ``held``: device -> (pid, command)."""
    held = held or {}
    return [{"neuron_device": d, "bdf": f"{0xcc - d:02x}:00.0", "connected_to": [(d + 12) % 16, (d + 3) % 16],
             "nc_count": 4, "logical_neuroncore_config": 2, "memory_size": 96 * GIB,
             "neuroncore_ids": [4 * d + i for i in range(4)],
             "neuron_processes": ([{"pid": held[d][0], "command": held[d][1], "neuron_runtime_version": "2.29.40.0"}]
                                  if d in held else [])} for d in range(16)]


def trn2_host(tmp_path: Path, *, held: dict[int, tuple[int, str]] | None = None, triton_missing: bool = False,
              efa: bool = True, env: dict | None = None) -> dict:
    """Write the simulated host under ``tmp_path``; return ``env`` (default os.environ) plus what points at it."""
    base = Path(tmp_path) / "trn2_host_double"
    pkgs, bin_dir, sysfs = base / "pkgs", base / "bin", base / "sys"
    for d in (pkgs, bin_dir, sysfs / "module" / "neuron", base / "neff_cache"):
        d.mkdir(parents=True, exist_ok=True)
    (pkgs / "torch_neuronx").mkdir(exist_ok=True)
    (pkgs / "torch_neuronx" / "__init__.py").write_text(TORCH_NEURONX)
    for name in ("nki", "nkilib"):
        (pkgs / name).mkdir(exist_ok=True)
        (pkgs / name / "__init__.py").write_text(f'"""TEST DOUBLE of AWS\'s {name}: importable only."""\n')
    for module, (dist, version) in DISTS.items():
        info = pkgs / f"{module}-{version}.dist-info"
        info.mkdir(exist_ok=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    if triton_missing:  # what `import triton` does where triton is not installed
        (pkgs / "triton").mkdir(exist_ok=True)
        (pkgs / "triton" / "__init__.py").write_text(
            '"""TEST DOUBLE: triton absent."""\nraise ModuleNotFoundError("No module named \'triton\'", name="triton")\n')
    (bin_dir / "neuron-ls.json").write_text(json.dumps(neuron_ls_json(held), indent=1))
    _script(bin_dir / "neuron-ls", NEURON_LS.format(python=sys.executable))
    if efa:
        _script(bin_dir / "fi_info", FI_INFO)
    lines = "".join(f"{p} {v} installed\\n" for p, v in PACKAGES.items())
    _script(bin_dir / "dpkg-query", f"#!/bin/sh\n# TEST DOUBLE of dpkg-query -W for aws-neuronx-*\nprintf '{lines}'\n")
    (sysfs / "module" / "neuron" / "version").write_text(DRIVER_VERSION + "\n")
    out = dict(os.environ if env is None else env)
    out["PATH"] = f"{bin_dir}{os.pathsep}{out.get('PATH', '')}"
    out["PYTHONPATH"] = os.pathsep.join(p for p in (str(pkgs), str(ROOT), out.get("PYTHONPATH", "")) if p)
    out["QWEN3_SYSFS_ROOT"] = str(sysfs)
    out["TORCH_NEURONX_NEFF_CACHE_DIR"] = str(base / "neff_cache")
    # A trn2.48xlarge has TBs of NVMe; the disk under tmp_path is this machine's, which may have less than 20 GiB
    # free: the simulated host's cache check asks for none. The threshold itself: test_doctor's test_neff_cache_*.
    out["QWEN3_NEFF_CACHE_MIN_GIB"] = "0"
    for var in ("NEURON_RT_VISIBLE_CORES", "NEURON_RT_NUM_CORES", "NEURON_LOGICAL_NC_CONFIG"):
        out.pop(var, None)
    return out
