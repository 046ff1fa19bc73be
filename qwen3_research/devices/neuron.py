"""device=neuron: AWS Trainium through TorchNeuron (``torch_neuronx``), imported only on the neuron path.

LNC and the cores a process reserves are ``lnc.py``'s; the host checks the doctor shows are ``neuron_host.py``'s.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

from qwen3_research.devices import lnc as lnc_facts
from qwen3_research.devices import neuron_host
from qwen3_research.devices.registry import register
from qwen3_research.devices.spec import Check, DeviceSpec
from qwen3_research.errors import ConfigError

# Trainium2, per physical NeuronCore-v3. bf16: AWS's torchtitan changes for Qwen3 report 157e12 per
# LNC=2 rank (parmoham-aws/test-repo-parmoham, docs/torchtitan/qwen3/TorchTitan.diff, get_peak_flops),
# i.e. 78.5e12 per physical core; the architecture page gives 79 BF16 TFLOPS per core
# (https://awsdocs-neuron.readthedocs-hosted.com/en/latest/about-neuron/arch/neuron-hardware/neuron-core-v3.html).
# fp32: 181 FP32 TFLOPS per 8-core chip (.../arch/neuron-hardware/trainium2.html) = 22.625e12 per core.
TRN2_CORE_PEAK = {"bf16": 157e12 / 2, "fp32": 181e12 / 8}

# AWS's install line for TorchNeuron on PyTorch 2.14 (Neuron 2.33, setup/pytorch/update-manual).
NEURON_INSTALL = ('pip install "torch-neuronx==2.14.*" "neuronx-cc==2.*" nki '
                  "--extra-index-url https://pip.repos.neuron.amazonaws.com "
                  "--extra-index-url https://download.pytorch.org/whl/cpu (README 'Trainium hosts')")


def present() -> bool:
    """Without importing it: TorchNeuron is installed."""
    try:
        return importlib.util.find_spec("torch_neuronx") is not None
    except (ImportError, ValueError):
        return False


def available() -> bool:
    """TorchNeuron imports (which registers the "neuron" device with torch)."""
    try:
        import torch_neuronx  # noqa: F401  (registers the "neuron" device)
    except ImportError:
        return False
    import torch

    return hasattr(torch, "neuron")


def unavailable_reason() -> str:
    return ("device.type=neuron needs TorchNeuron (torch_neuronx from AWS's Neuron package index) "
            "and a Trainium host; it is not importable here. Use device=cpu or device=cuda, or see "
            "README 'Trainium hosts'")


def _local_devices(lnc: int | None) -> int:
    return lnc_facts.neuron_logical_core_count(lnc or lnc_facts.LNC_DEFAULT_NEURON)


def _prepare_launch(world_size: int) -> None:
    lnc_facts.prepare_neuron_cores(world_size)


def neuron_environment(p, run_dir: Path) -> dict[str, str]:
    """The Neuron runtime's profiler environment for ``profiling.steps`` on neuron (empty when not profiling).

    AWS Neuron Explorer, "Neuron Explorer Environment Variables" (Neuron 2.33):
    https://awsdocs-neuron.readthedocs-hosted.com/en/v2.33.1/tools/neuron-explorer/environment-variables.html
    NEURON_RT_INSPECT_ENABLE=1 is the master switch of environment-variable capture (system profile on by
    default), NEURON_RT_INSPECT_OUTPUT_DIR the output directory, NEURON_RT_INSPECT_DEVICE_PROFILE=1|model|session
    adds device-level traces; NEURON_RT_* are read when the runtime starts ("set them before the workload
    starts"), and the page warns not to combine this capture with torch.profiler. The runtime cannot be told
    which training steps to capture through these variables: the whole run is captured.
    """
    if not p.steps:
        return {}
    env = {"NEURON_RT_INSPECT_ENABLE": "1", "NEURON_RT_INSPECT_OUTPUT_DIR": str(Path(run_dir) / "profiling" / "neuron")}
    if p.neuron_device_profile:
        env["NEURON_RT_INSPECT_DEVICE_PROFILE"] = p.neuron_device_profile
    return env


def _peak_flops(dev, key: str, dtype) -> float:
    return TRN2_CORE_PEAK["bf16" if key == "bf16" else "fp32"] * (dev.lnc or lnc_facts.LNC_DEFAULT_NEURON)


def _package_version(name: str) -> str:
    from importlib import metadata  # here: 20 ms the allocator's re-exec would pay twice at every start

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "none"


def _child(code: str, env: dict | None = None, timeout: float = 600) -> tuple[bool, str]:
    proc = subprocess.run([sys.executable, "-c", code], env={**os.environ, **(env or {})},
                          capture_output=True, text=True, timeout=timeout)
    out = (proc.stdout.strip().splitlines() or [""])[-1]
    err = (proc.stderr.strip().splitlines() or ["no output"])[-1]
    return proc.returncode == 0, out if proc.returncode == 0 else err


def _device_rows(ctx) -> list[Check]:
    if not present():
        rows = [Check("device", f"{ctx.requested} -> neuron: torch_neuronx not installed", "MISSING", NEURON_INSTALL)]
    else:
        rows = [Check("device", f"device.type={ctx.requested} -> neuron (torch_neuronx importable)")]
    if ctx.titan.get("installed") and not ctx.titan.get("fork"):
        rows.append(Check("torchtitan on neuron", "upstream build; AWS tests Trainium with its torchtitan-neuron fork "
                          "(0.2.2+neuron.1, release-2.33)", "info"))
    return rows


def _lnc_row(ctx) -> Check:
    if ctx.device_ok:
        try:
            cores = lnc_facts.neuron_logical_core_count(ctx.lnc)
            return Check("LNC / logical cores",
                         f"LNC={ctx.lnc} ({lnc_facts.LNC_ENV} exported to workers), {cores} logical cores")
        except ConfigError as e:
            return Check("LNC / logical cores", f"LNC={ctx.lnc}, count failed", "MISSING", str(e))
    return Check("LNC / logical cores", f"LNC={ctx.lnc}; logical cores unknown until torch_neuronx is installed", "info")


def _host_rows(ctx) -> list[Check]:
    """With or without TorchNeuron: the host facts say what else the first run needs."""
    return [*neuron_host.host_checks(ctx.nproc, ctx.nnodes, ctx.lnc), neuron_host.titan_models_row()]


def _memory_row(ctx) -> Check | None:
    if not ctx.device_ok:
        return None
    ok, out = _child("import torch, torch_neuronx; print(torch.neuron.get_device_properties(0).total_memory)",
                     {lnc_facts.LNC_ENV: str(ctx.lnc)})
    return Check("memory per rank", f"{int(out) / 1024**3:.1f} GiB HBM per logical core (get_device_properties)"
                 if ok else f"could not read: {out}", "ok" if ok else "MISSING",
                 "" if ok else "check the Neuron driver and runtime (neuron-ls)")


def _verify_overrides(lnc: int | None) -> list[str]:
    """The NKI Library kernels need seq_len % (128 x LNC) == 0 (rope_hf); one sequence per rank."""
    return [f"data.seq_len={128 * (lnc or lnc_facts.LNC_DEFAULT_NEURON)}", "data.batch_size=1"]


SPEC = register(DeviceSpec(
    kind="neuron",
    dist_backend="neuron",
    start_method="spawn",  # the Neuron runtime is not fork-safe once anything has touched it
    auto_order=10,  # TorchNeuron installed: a Trainium host, whatever else it has
    present=present,
    available=available,
    visible=present,  # asked without importing TorchNeuron (a launching parent starts no runtime)
    refused_before_torch=True,  # TorchNeuron not installed: nothing else decides, refused at validation
    unavailable_reason=unavailable_reason,
    local_devices=_local_devices,
    prepare_launch=_prepare_launch,
    default_lnc=lnc_facts.LNC_DEFAULT_NEURON,  # trn2/trn3's runtime default
    # bf16 as AWS's Trainium recipes (torchtitan's mixed_precision_param default, bfloat16, in
    # parmoham-aws/test-repo-parmoham docs/torchtitan/qwen3/qwen3_8b_tp4_fsdp.toml)
    default_precision="bf16",
    default_loss="full",  # the chunked loss has not been measured on Trainium
    compile_backend="neuron",
    compile_default=None,  # not measured compiled
    compile_cache_facts=lambda probe: [f"neuronxcc{_package_version('neuronx-cc')}"],
    kernels_by_shape=True,  # a plan traces the NKI kernels by their documented output shapes (no device here)
    # AWS says not to combine the runtime's environment-variable capture with torch.profiler: the runtime captures
    profiler_activities=(),
    memory_snapshot=None,
    profiler_environment=neuron_environment,
    # one LNC=2 rank. AWS: 157e12 bf16 per LNC=2 rank (TorchTitan.diff), 181e12 fp32 per 8-core trn2 chip
    peaks={k: v * lnc_facts.LNC_DEFAULT_NEURON for k, v in TRN2_CORE_PEAK.items()},
    peak_flops=_peak_flops,
    device_rows=_device_rows,
    lnc_row=_lnc_row,
    doctor_rows=_host_rows,
    memory_row=_memory_row,
    verify_overrides=_verify_overrides,
    doctor_one_process=True,  # each --run check takes one NeuronCore (lnc.prepare_neuron_cores)
))
