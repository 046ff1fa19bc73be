"""What a Trainium run needs from the host beyond Python packages, asked of AWS's tools and files.

``host_checks(nproc, nnodes, lnc)`` -> one ``Check`` (item, value, status ok|info|MISSING, fix) per fact: ``neuron-ls``
(devices, cores, processes already holding cores), the Neuron driver (``/sys/module/neuron/version``), the
aws-neuronx runtime/collectives/tools packages (dpkg-query or rpm), ``NEURON_RT_*`` variables already set, the NEFF
compile cache and its free disk, and EFA (``fi_info -p efa``) for more than one node. The doctor shows them
(qwen3_research/doctor.py, through the neuron spec's doctor rows: ``devices/neuron.py``); docs/TRAINIUM.md says
what each failure means. Nothing here starts a Neuron runtime.
Test hook: ``QWEN3_SYSFS_ROOT`` replaces ``/sys`` (tests/neuron_host_double.py, a simulated trn2 host).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from qwen3_research.devices import lnc as lnc_facts
from qwen3_research.devices.spec import Check
from qwen3_research.errors import ConfigError


# neuron-ls: AWS's Neuron LS user guide (tools/neuron-sys-tools/neuron-ls, Neuron 2.33:
# https://awsdocs-neuron.readthedocs-hosted.com/en/v2.33.0/tools/neuron-sys-tools/neuron-ls.html). `--json-output`
# (`-j`) prints one object per Neuron device: neuron_device, nc_count (NeuronCores of the device; on trn2 the
# logical ones, 4 at LNC=2), logical_neuroncore_config, memory_size (bytes), neuroncore_ids (newer tools),
# neuron_processes [{pid, command, neuron_runtime_version}] = the processes using the device. Neuron 2.34 drops
# that flag for `--output-format json` (https://awsdocs-neuron.readthedocs-hosted.com/en/latest/about-neuron/
# announcements/neuron2.x/announce-intent-eos-neuron-ls-json.html): both are tried, and a top-level object holding
# the device list is accepted.
NEURON_BIN = "/opt/aws/neuron/bin"  # where the DLAMI and AWS's packages put neuron-ls (not always on PATH)
EFA_BIN = "/opt/amazon/efa/bin"  # where the EFA installer puts fi_info
SYSFS_ENV = "QWEN3_SYSFS_ROOT"  # test hook: a fake /sys
MIN_CACHE_FREE_GIB = 20  # an 8B compile writes several GiB of NEFFs and work files; a full disk fails mid-compile
MIN_CACHE_FREE_ENV = "QWEN3_NEFF_CACHE_MIN_GIB"  # overrides it (a smaller model, a cache already warm)
# TorchNeuron keeps compiled NEFFs in TORCH_NEURONX_NEFF_CACHE_DIR (default /tmp/neff_cache) and its local locks
# in TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR (/tmp/local_cache): torch_neuronx/kernels/cache_utils.py and
# csrc/core/cache/PersistentCacheBackend.cpp in parmoham-aws/test-repo-parmoham; AWS's page
# https://awsdocs-neuron.readthedocs-hosted.com/en/latest/compiler/about-compiler-artifacts.html. The torch-xla based
# torch-neuronx used NEURON_COMPILE_CACHE_URL or NEURON_CC_FLAGS --cache_dir (default /var/tmp/neuron-compile-cache,
# https://awsdocs-neuron.readthedocs-hosted.com/en/v2.29.1/about-neuron/arch/neuron-features/neuron-caching.html),
# which TorchNeuron does not read: reported when set, so a user relying on it knows.
NEFF_CACHE_ENV, NEFF_CACHE_DEFAULT = "TORCH_NEURONX_NEFF_CACHE_DIR", "/tmp/neff_cache"
LEGACY_CACHE_DEFAULT = "/var/tmp/neuron-compile-cache"
# Debian/Ubuntu and Amazon Linux package names of the Neuron driver, runtime, collectives and tools (Neuron setup
# guides, https://awsdocs-neuron.readthedocs-hosted.com/en/v2.33.0/setup/pytorch/update-manual.html).
NEURON_DEBS = ("aws-neuronx-dkms", "aws-neuronx-runtime-lib", "aws-neuronx-collectives", "aws-neuronx-tools")
DLAMI_FIX = ("use AWS's Deep Learning AMI Neuron (it has them) or install them from AWS's Neuron apt/yum "
             "repository (README 'Trainium hosts')")


def _tool(name: str, fallback_dir: str) -> str | None:
    return shutil.which(name) or (str(Path(fallback_dir, name)) if os.access(Path(fallback_dir, name), os.X_OK) else None)


def _run_tool(cmd: list[str], timeout: float = 60) -> tuple[int, str, str]:
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as e:
        return 127, "", str(e)
    return proc.returncode, proc.stdout, proc.stderr


def neuron_ls_devices() -> tuple[list[dict] | None, str]:
    """neuron-ls's devices (None when it is missing or fails) and what to say about it."""
    exe = _tool("neuron-ls", NEURON_BIN)
    if exe is None:
        return None, "missing"
    errors = []
    for flags in (["--json-output"], ["--output-format", "json"]):
        rc, out, err = _run_tool([exe, *flags])
        if rc == 0:
            try:
                data = json.loads(out)
            except ValueError:
                errors.append(f"{' '.join(flags)}: not JSON")
                continue
            if isinstance(data, dict):  # the 2.34 format: a top-level object holding the device list
                data = next((v for v in data.values() if isinstance(v, list) and v and isinstance(v[0], dict)
                             and "neuron_device" in v[0]), [])
            return [d for d in data if isinstance(d, dict)], exe
        errors.append((err.strip().splitlines() or [f"exit {rc}"])[-1])
    return None, f"{exe} failed: {errors[0]}"


def _device_cores(d: dict) -> list[int]:
    """The logical core ids of one neuron-ls device (neuroncore_ids, else numbered by device)."""
    ids = d.get("neuroncore_ids")
    if isinstance(ids, list) and ids:
        return [int(i) for i in ids]
    n = int(d.get("nc_count") or 0)
    return list(range(int(d.get("neuron_device", 0)) * n, int(d.get("neuron_device", 0)) * n + n))


def _ranges(ids: list[int]) -> str:
    out, ids = [], sorted(set(ids))
    start = prev = None
    for i in ids + [None]:
        if start is not None and (i is None or i != prev + 1):
            out.append(f"{start}" if start == prev else f"{start}-{prev}")
            start = None
        if i is not None and start is None:
            start = i
        prev = i
    return ",".join(out)


def host_checks(nproc: int | None, nnodes: int, lnc: int | None) -> list[Check]:
    """What a Trainium run needs from this host beyond Python packages; one fix per missing piece."""
    rows: list[Check] = []
    # neuron-ls: devices, cores, who holds them.
    found, how = neuron_ls_devices()
    total = None
    if found is None and how == "missing":
        rows.append(Check("neuron-ls", "not found on PATH nor in " + NEURON_BIN, "MISSING",
                        f"the Neuron tools (aws-neuronx-tools) are missing: export PATH={NEURON_BIN}:$PATH, or {DLAMI_FIX}"))
    elif found is None or not found:
        rows.append(Check("neuron-ls", how if found is None else "no Neuron device listed", "MISSING",
                        "no Neuron device is usable: check the driver (lsmod | grep neuron; sudo modprobe neuron) "
                        "and that this is a Trainium instance"))
    else:
        total = sum(len(_device_cores(d)) for d in found)
        host_lnc = found[0].get("logical_neuroncore_config")
        mem = int(found[0].get("memory_size") or 0) / 1024**3
        rows.append(Check("neuron-ls", f"{len(found)} devices x {len(_device_cores(found[0]))} cores = {total} logical "
                        f"cores (LNC={host_lnc if host_lnc is not None else '?'} by default), {mem:.0f} GiB per device"))
        held = {}
        for d in found:
            for p in d.get("neuron_processes") or []:
                if str(p.get("command", "")).startswith("neuron-ls"):
                    continue
                held.setdefault((p.get("pid"), str(p.get("command", "?"))[:60]), []).extend(_device_cores(d))
        single = (nproc or total) * nnodes == 1
        need = 1 if single else (nproc or total)
        held_ids = {i for ids in held.values() for i in ids}
        if not held:
            rows.append(Check("cores in use", "none: no other process holds a NeuronCore"))
        else:
            who = "; ".join(f"pid {pid} ({cmd}) holds cores {_ranges(ids)}" for (pid, cmd), ids in held.items())
            # A worker group takes cores 0..n-1 (torch_neuronx: NEURON_RT_VISIBLE_CORES=local rank); one process
            # with NEURON_RT_NUM_CORES=1 takes any free core.
            clash = (total - len(held_ids) < 1) if single else bool(held_ids & set(range(need)))
            pids = " ".join(str(pid) for pid, _ in held)
            rows.append(Check("cores in use", who, "MISSING" if clash else "info",
                            f"the run needs {'one free core' if single else f'cores 0-{need - 1}'}: stop the other "
                            f"process (kill {pids}) or wait for it; a reserved core stays unusable until its process "
                            "ends (Neuron Runtime configuration guide)" if clash else ""))
        if nproc and nproc > total:
            rows.append(Check("cores for the run", f"parallelism.nproc_per_node={nproc} > {total} logical cores here",
                            "MISSING", f"set parallelism.nproc_per_node to at most {total} (or -1: every core)"))
    # Driver and packages.
    sysfs = Path(os.environ.get(SYSFS_ENV) or "/sys")
    try:
        driver = (sysfs / "module" / "neuron" / "version").read_text().strip()
        rows.append(Check("neuron driver", f"{driver} ({sysfs / 'module/neuron/version'})"))
    except OSError:
        rows.append(Check("neuron driver", f"not loaded ({sysfs / 'module/neuron/version'} absent)", "MISSING",
                        "load the Neuron kernel driver: sudo modprobe neuron (package aws-neuronx-dkms); " + DLAMI_FIX))
    pkgs = _installed_neuron_packages()
    if pkgs is None:
        rows.append(Check("neuron runtime", "no dpkg-query or rpm to ask (a container?): not checked", "info"))
    else:
        lacking = [p for p in NEURON_DEBS[1:3] if p not in pkgs]
        value = ", ".join(f"{p} {v}" for p, v in sorted(pkgs.items())) or "no aws-neuronx-* package installed"
        rows.append(Check("neuron runtime", value, "MISSING" if lacking else "ok",
                        f"install {' '.join(lacking)} (the Neuron runtime and collectives): {DLAMI_FIX}" if lacking else ""))
    # Variables the runtime reads, already set by the user.
    preset = {k: v for k, v in sorted(os.environ.items()) if k.startswith("NEURON_RT_")
              or k in (lnc_facts.LNC_ENV, "TORCH_DEVICE_BACKEND_AUTOLOAD")}
    world = (nproc or total or 0) * nnodes
    try:
        cores = lnc_facts.prepare_neuron_cores(world or 1, env=dict(os.environ)) if world else "unknown world size"
        rows.append(Check("NEURON_RT_* set", (", ".join(f"{k}={v}" for k, v in preset.items()) or "none")
                        + f"; the run's cores: {cores}", "info"))
    except ConfigError as e:
        rows.append(Check("NEURON_RT_* set", ", ".join(f"{k}={v}" for k, v in preset.items()), "MISSING", str(e)))
    rows += _cache_rows()
    if nnodes > 1:
        rows.append(_efa_row(nnodes))
    return rows


def _installed_neuron_packages() -> dict[str, str] | None:
    if shutil.which("dpkg-query"):
        rc, out, _ = _run_tool(["dpkg-query", "-W", "-f", "${Package} ${Version} ${db:Status-Status}\\n", "aws-neuronx-*"])
        # "name version status"; a known but absent package has an empty version and status "not-installed"
        return {p[0]: p[1] for p in (ln.split(" ", 2) for ln in out.splitlines()) if len(p) == 3 and p[2] == "installed"}
    if shutil.which("rpm"):
        rc, out, _ = _run_tool(["rpm", "-qa", "--queryformat", "%{NAME} %{VERSION}\\n", "aws-neuronx-*"])
        return {p[0]: p[1] for p in (ln.split() for ln in out.splitlines()) if len(p) >= 2}
    return None


def _free_gib(path: Path) -> tuple[float, Path]:
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return shutil.disk_usage(probe).free / 1024**3, probe


def _min_cache_free_gib() -> float | None:
    """The free space the NEFF cache's disk needs: MIN_CACHE_FREE_GIB, or MIN_CACHE_FREE_ENV; None if that is not a
    number >= 0."""
    raw = os.environ.get(MIN_CACHE_FREE_ENV, "").strip()
    if not raw:
        return MIN_CACHE_FREE_GIB
    try:
        need = float(raw)
    except ValueError:
        return None
    return need if need >= 0 else None


def _cache_rows() -> list[Check]:
    cache = Path(os.environ.get(NEFF_CACHE_ENV) or NEFF_CACHE_DEFAULT)
    free, probe = _free_gib(cache)
    writable = os.access(probe, os.W_OK)
    source = NEFF_CACHE_ENV if os.environ.get(NEFF_CACHE_ENV) else f"default; {NEFF_CACHE_ENV} unset"
    need = _min_cache_free_gib()
    if need is None:
        return [Check("NEFF cache", f"{MIN_CACHE_FREE_ENV}={os.environ[MIN_CACHE_FREE_ENV]!r}", "MISSING",
                      f"set {MIN_CACHE_FREE_ENV} to a number of GiB >= 0, or unset it (default {MIN_CACHE_FREE_GIB})")]
    ok = writable and free >= need
    fix = ""
    if not ok:
        fix = (f"{'make ' + str(probe) + ' writable' if not writable else f'free disk there (need >= {need:g} GiB; {MIN_CACHE_FREE_ENV} sets the minimum)'}"
               f", or point {NEFF_CACHE_ENV} at a larger writable disk (e.g. export {NEFF_CACHE_ENV}=/opt/dlami/nvme/neff_cache)")
    rows = [Check("NEFF cache", f"{cache} ({source}): {free:.0f} GiB free{'' if writable else ', not writable'}",
                "ok" if ok else "MISSING", fix)]
    flags = os.environ.get("NEURON_CC_FLAGS", "")
    legacy = os.environ.get("NEURON_COMPILE_CACHE_URL") or ("--cache_dir" in flags and flags)
    if legacy:
        rows.append(Check("legacy compile cache", f"NEURON_COMPILE_CACHE_URL / NEURON_CC_FLAGS --cache_dir set ({legacy}): "
                        f"torch-xla's persistent cache (default {LEGACY_CACHE_DEFAULT}); TorchNeuron keeps NEFFs in "
                        f"{NEFF_CACHE_ENV} instead", "info"))
    return rows


def _efa_row(nnodes: int) -> Check:
    """EFA carries the collectives between trn2 nodes: `fi_info -p efa` lists the provider when the EFA software
    and interfaces are there (AWS's EFA guide: https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/efa-start.html)."""
    fix = ("install the EFA software (aws-efa-installer) and launch every node with EFA network interfaces "
           "(https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/efa-start.html)")
    exe = _tool("fi_info", EFA_BIN)
    if exe is None:
        return Check("EFA", f"fi_info not found (PATH, {EFA_BIN}); parallelism.nnodes={nnodes} needs EFA", "MISSING", fix)
    rc, out, err = _run_tool([exe, "-p", "efa"])
    n = sum(1 for ln in out.splitlines() if ln.strip().startswith("provider:") and ln.split(":", 1)[1].strip() == "efa")
    if rc != 0 or n == 0:
        tail = (err.strip().splitlines() or out.strip().splitlines() or [f"exit {rc}"])[-1]
        return Check("EFA", f"fi_info -p efa: no efa provider ({tail})", "MISSING", fix)
    return Check("EFA", f"fi_info -p efa: {n} efa endpoint(s) for parallelism.nnodes={nnodes}")


def titan_models_row() -> Check:
    """torchtitan's Qwen3 package imports (in a child: it reads the device at import). On torchtitan 0.2.x it
    imports triton (models/moe/kernels.py), which TorchNeuron does not bring."""
    proc = subprocess.run([sys.executable, "-c", "import torchtitan.models.qwen3"], capture_output=True, text=True,
                          timeout=600)
    if proc.returncode == 0:
        return Check("torchtitan models", "import torchtitan.models.qwen3: ok")
    msg = (proc.stderr.strip().splitlines() or ["no output"])[-1]
    fix = ("pip install triton (torchtitan's MoE kernels module imports it; AWS's Qwen3 guide installs it; "
           "requirements-neuron.txt)" if "triton" in msg else "reinstall torchtitan as README 'Trainium hosts' says")
    return Check("torchtitan models", f"import torchtitan.models.qwen3 failed: {msg}", "MISSING", fix)
