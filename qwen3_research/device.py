"""Shim: the device code moved to the ``qwen3_research.devices`` package (issue 32, devices as specs). Every name
this module had is re-exported from there; nothing is defined here. Delete it once no module imports it (the sed in
the devices branch's report rewrites the importers)."""

from __future__ import annotations

from functools import partial

from qwen3_research.devices import *  # noqa: F401,F403
from qwen3_research.devices import (CGROUP_MEMORY_LIMITS, GPU_FP32_BY_BF16_PEAK, LNC_DEFAULT_NEURON,  # noqa: F401
                                    LNC_ENV, NUM_CORES_ENV, PLANNED_GPUS, TRN2_CORE_PEAK, VALIDATE_ONLY_ENV,
                                    VALIDATE_ONLY_LINE, VISIBLE_CORES_ENV, cached_cpu_peak, cgroup_memory_files,
                                    cpu_cores, cuda_unavailable_reason, export_lnc, host_memory, host_nproc_per_node,
                                    measure_matmul_peak, neuron_available, neuron_logical_core_count, planned_gpu,
                                    prepare_launch, prepare_neuron_cores, raise_cpu_peak, resolve_device_type,
                                    resolve_lnc, resolve_nproc_per_node, tf32_enabled, validate_only)
from qwen3_research.devices.host import cache_dir as _cache_dir  # noqa: F401
from qwen3_research.devices.lnc import _set_by_us  # noqa: F401
from qwen3_research.devices import __getattr__  # noqa: F401  (Device, prepare_torchtitan, ...: loaded on first use)

requested_device_kind = partial(resolve_device_type, check=False)  # the old name of the launching parent's choice
