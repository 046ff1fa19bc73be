"""``python -m qwen3_research.doctor [--run] [overrides ...]``: what a run would use here, and what is missing.

Prints one table (Python, torch, torchtitan upstream or AWS's torchtitan-neuron fork, transformers,
the Neuron packages, the device found, the world size a run would start, LNC and logical cores,
memory per rank, process-group and compile backends, the kernel options that can run here, W&B
mode), then one fix per missing piece. Takes the same overrides as a run (``device=neuron``,
``device.lnc=1``, ``parallelism=...``), so it answers for the run you mean to start.

Exit status: 0 when that run can start, 1 when something is missing (each with its fix), 2 on a
configuration error in the overrides. ``--run`` then performs the first-hardware check: a 2-step tiny
run per model backend (native, native_moe, hf on a small checkpoint written to a temp dir: each backend's
``smoke_overrides``) on this device and ``verify_kernels`` for every kernel option that can run here,
each pass/fail with its time; any failure makes the exit status 1.

On a Trainium run (``device=neuron``, or ``auto`` where TorchNeuron is installed) it also checks the host as
the first hour on a trn2 needs it (``devices.neuron_host.host_checks``, the neuron spec's doctor rows): ``neuron-ls`` (devices, cores, processes already
holding cores), the Neuron driver (``/sys/module/neuron/version``) and the aws-neuronx runtime/collectives/tools
packages, ``NEURON_RT_*`` variables already set, the NEFF compile cache and its free disk, EFA (``fi_info -p
efa``) when ``parallelism.nnodes > 1``, and that ``torchtitan.models.qwen3`` imports (it needs triton on
torchtitan 0.2.x); ``--run`` there gives each check one NeuronCore. Every device-specific row is the device
spec's (``devices.get(kind).device_rows`` / ``lnc_row`` / ``doctor_rows`` / ``memory_row``); docs/TRAINIUM.md lists
each Trainium row's failures.

Nothing here starts a Neuron runtime in this process: the Neuron facts are asked in child processes.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as dist_version
from pathlib import Path

from qwen3_research import startup

if __name__ == "__main__":  # Ctrl-C / SIGTERM while the modules below import: 128+signal, one line
    startup.exit_at_once_while_importing("; the doctor was stopped")

from omegaconf import OmegaConf  # noqa: E402

from qwen3_research import allocator, devices, overrides, tables, titan  # noqa: E402
from qwen3_research.compose import CONF_DIR, compose  # noqa: E402
from qwen3_research.config import to_run_config  # noqa: E402
from qwen3_research.errors import ConfigError  # noqa: E402
from qwen3_research.models import registry  # noqa: E402
from qwen3_research.resolve import kernel_targets, resolve_run, warn_kernel_matches  # noqa: E402

TITAN_INSTALL = ("pip install torchtitan==0.3.0, or on Trainium AWS's fork: git clone -b release-2.33 "
                 "https://github.com/aws-neuron/torchtitan-neuron && pip install -e torchtitan-neuron")
TINY_RUN = ["training.steps=2", "data.seq_len=32", "data.batch_size=2", "training.eval_every=0",
            "logging.print_config=false", "logging.wandb.mode=disabled", "checkpoint.enable=false"]


@dataclass
class Row:
    item: str
    value: str
    status: str = "ok"  # ok | info | MISSING
    fix: str = ""


@dataclass
class DoctorContext:
    """What the doctor knows when it asks a device spec for its rows (``DeviceSpec.device_rows`` and the others take
    it as ``ctx``)."""

    requested: str  # device.type as given
    kind: str  # what it resolves to
    lnc: int | None = None
    nproc: int | None = None  # processes per node the run would start (None: unknown)
    ranks_here: int = 1  # the ranks sharing this host, as the run's resolution says (1 when it refused)
    nnodes: int = 1
    titan: dict = field(default_factory=dict)  # titan.distribution()
    device_ok: bool = True


def _version(dist: str) -> str | None:
    try:
        return dist_version(dist)
    except PackageNotFoundError:
        return None


def _kernels():
    """The kernel registry (every kernel module registered)."""
    from qwen3_research import kernels  # deferred: start-up (kernels imports torch; a config error exits before it)

    return kernels


def kernel_options(device_type: str, lnc: int | None = None) -> dict[str, str]:
    """Every conf/kernels option -> '' if it can run on this host's ``device_type``, else why not."""
    return {o: why for o, (why, _) in _kernel_options(device_type, lnc).items()}


def verifiable(option: str, device_type: str, lnc: int | None = None) -> bool:
    """Whether verify_kernels has something to check for the option (references have no verify)."""
    return _kernel_options(device_type, lnc).get(option, ("", False))[1]


def _kernel_options(device_type: str, lnc: int | None = None) -> dict[str, tuple[str, bool]]:
    """Per option: the reasons it cannot run here from the support check a run and verify_kernels make
    (``kernels.registry.kernel_support``: device, LNC, environment, packages; the model's shapes come at
    start-up), and whether verify_kernels has a check for it."""
    kernels = _kernels()
    out = {}
    for path in sorted(Path(CONF_DIR, "kernels").glob("*.yaml")):
        entries = OmegaConf.load(path).get("entries") or []
        why = kernels.kernel_support(entries, device_type, lnc, option=path.stem)
        checks = any(kernels.KERNELS[e.name].verify is not None for e in entries if e.name in kernels.KERNELS)
        out[path.stem] = ("; ".join(why), checks)
    return out


def collect(overrides: list[str]) -> tuple[list[Row], dict]:
    """The table rows, and what ``--run`` needs (device type, usable kernel options)."""
    rows: list[Row] = []
    ctx: dict = {"device": None, "kernels": []}
    py = sys.version_info
    py_ok = (3, 11) <= py[:2] < (3, 15)
    rows.append(Row("python", f"{py.major}.{py.minor}.{py.micro} ({sys.executable})", "ok" if py_ok else "MISSING",
                    "" if py_ok else "use Python 3.11-3.14 (torch-neuronx 2.14 supports 3.12-3.14)"))
    torch_v = _version("torch")
    rows.append(Row("torch", torch_v or "not installed", "ok" if torch_v else "MISSING",
                    "" if torch_v else "pip install torch==2.14.* (on Trainium it comes with torch-neuronx)"))
    tt = titan.distribution()
    if tt["installed"]:
        kind = "AWS torchtitan-neuron fork" if tt["fork"] else "upstream pytorch/torchtitan"
        rows.append(Row("torchtitan", f"{tt['version']} ({kind})"))
    else:
        rows.append(Row("torchtitan", "not installed", "MISSING", TITAN_INSTALL))
    tf_v = _version("transformers")
    rows.append(Row("transformers", tf_v or "not installed", "ok" if tf_v else "MISSING",
                    "" if tf_v else "pip install transformers==5.16.0"))
    neuron_pkgs = {d: _version(d) for d in ("torch-neuronx", "neuronx-cc", "nki", "nkilib")}
    present = [f"{d} {v}" for d, v in neuron_pkgs.items() if v]
    rows.append(Row("neuron packages", ", ".join(present) if present else "absent (not a Trainium install)", "info"))
    if not torch_v:
        return rows, ctx

    try:
        cfg = compose(overrides)
    except ConfigError as e:
        raise SystemExit(_config_exit(f"config error: {e}"))
    rc = to_run_config(cfg)
    requested = rc.device.type
    kind = devices.resolve_device_type(requested, check=False)  # nothing here starts a device runtime
    spec = devices.get(kind)
    dctx = DoctorContext(requested=requested, kind=kind, nnodes=rc.parallelism.nnodes, titan=tt)
    device_rows = spec.device_rows(dctx)
    rows += [Row(*r) for r in device_rows]
    device_ok = dctx.device_ok = all(r.status != "MISSING" for r in device_rows if r.item == "device")
    ctx["device"] = kind if device_ok else None
    ctx["lnc"] = None
    devices.prepare_torchtitan(kind)  # before anything imports torchtitan (it reads the device at import)

    # LNC and logical cores.
    lnc = None
    try:
        lnc = ctx["lnc"] = dctx.lnc = devices.resolve_lnc(rc.device.lnc, kind)
        row = spec.lnc_row(dctx)
        rows.append(Row(*row))
        device_ok = dctx.device_ok = device_ok and row.status != "MISSING"
    except ConfigError as e:
        rows.append(Row("LNC", str(e).split(";")[0], "MISSING", str(e).split("; ", 1)[-1]))
        device_ok = dctx.device_ok = False

    # World size and degrees: the run's own start-up resolution (its kernel entries: the "kernels" row below).
    run = None
    if device_ok:
        try:
            run = resolve_run(cfg, kernels=False)
            d = run.degrees
            auto = " (nproc_per_node=-1: auto)" if cfg.parallelism.nproc_per_node == -1 else ""
            rows.append(Row("world size", f"{run.nproc_per_node} x {rc.parallelism.nnodes} node(s) = {d.world_size}{auto}; "
                            f"{d.describe()}"))
        except ConfigError as e:
            # the refusal itself is the fix line (it names the key and what to change), not "see above"
            rows.append(Row("run config", "refused by the run's start-up checks", "MISSING", str(e).splitlines()[0]))
    dctx.nproc = run.nproc_per_node if run is not None else (
        rc.parallelism.nproc_per_node if rc.parallelism.nproc_per_node != -1 else None)
    dctx.ranks_here = run.nproc_per_node if run is not None else 1
    rows += [Row(*c) for c in spec.doctor_rows(dctx)]  # what else the host needs (neuron: the host checks)

    # Memory per rank.
    memory = spec.memory_row(dctx) if ctx["device"] else None
    if memory is not None:
        rows.append(Row(*memory))

    # Backends.
    if ctx["device"]:
        import torch.distributed as dist

        pg = spec.dist_backend
        pg_ok = dist.is_available() and getattr(dist, f"is_{pg}_available", lambda: True)()  # neuron: no such check
        rows.append(Row("process group", pg, "ok" if pg_ok else "MISSING", "" if pg_ok else f"this torch build lacks {pg}"))
        cb = rc.compile.backend or spec.compile_backend
        decided = run.compile if run is not None else None  # compile.enable=auto resolved, with its reason
        on = decided.enable if decided is not None else rc.compile.enable is True
        rows.append(Row("compile backend", f"{cb} ({decided.describe() if decided else f'compile.enable={rc.compile.enable}'})",
                        "ok" if on else "info"))

        options = kernel_options(ctx["device"], lnc)
        usable = [o for o, why in options.items() if not why and o != "none"]
        ctx["kernels"] = [o for o in usable if verifiable(o, ctx["device"], lnc)]
        rows.append(Row("kernel options here", ", ".join(usable) or "none", "info"))
        blocked = [f"{o} ({why.split('; ')[0]})" for o, why in options.items() if why]  # the first reason of each
        if blocked:
            rows.append(Row("kernel options not here", "; ".join(blocked), "info"))
        chosen = rc.kernels.option or "none"
        if options.get(chosen):
            rows.append(Row("kernels", f"kernels={chosen}: {options[chosen]}", "MISSING",
                            "choose one of the options that can run here (above)"))
        elif rc.kernels.entries:  # the model's shapes too, as the run's start-up resolves them (on a meta model)
            try:
                # the dtype only gates a speed kernel's use (not shown here): float32 where the run was refused
                dtype = run.precision.compute_dtype if run is not None else "float32"
                _, unmatched = kernel_targets(rc, ctx["device"], lnc, dtype=dtype)
                warn_kernel_matches(unmatched)
                rows.append(Row("kernels", f"kernels={chosen}: the run's start-up checks pass for model.flavor="
                                f"{rc.model.flavor}"))
            except ConfigError as e:
                rows.append(Row("kernels", str(e), "MISSING", "change the key the message names"))

    mode = os.environ.get("WANDB_MODE") or rc.logging.wandb.mode
    wb = _version("wandb")
    wb_ok = mode == "disabled" or bool(wb)
    source = "WANDB_MODE" if os.environ.get("WANDB_MODE") else "logging.wandb.mode"
    rows.append(Row("W&B", f"{mode} (from {source}); wandb {wb or 'not installed'}", "ok" if wb_ok else "MISSING",
                    "" if wb_ok else "pip install wandb==0.31.0 or logging.wandb.mode=disabled"))
    return rows, ctx


def _config_exit(message: str) -> int:
    print(message, file=sys.stderr, flush=True)
    return 2


def format_table(rows: list[Row], title: str) -> str:
    return title + "\n" + tables.render(["check", "status", "value"], [[r.item, r.status, r.value] for r in rows])


# -- --run: the first-hardware check ---------------------------------------------------------------
def _timed(cmd: list[str], timeout: float) -> tuple[bool, float, str]:
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return False, time.perf_counter() - t0, f"timed out after {timeout:.0f} s"
    dt = time.perf_counter() - t0
    if proc.returncode == 0:
        return True, dt, (proc.stdout.strip().splitlines() or [""])[-1][:120]
    err = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()] or [f"exit {proc.returncode}"]
    return False, dt, f"exit {proc.returncode}: {err[-1][:200]}"


def verify_args(option: str, device: str, lnc: int | None) -> list[str]:
    """verify_kernels overrides for one kernel option: shapes the option's kernels take. On neuron the NKI Library
    kernels need seq_len % (128 x LNC) == 0 (rope_hf) and, for MoE, the kernel-sized flavor nki_debug (hidden 1024;
    the tiny flavors are refused: docs/KERNELS.md); elsewhere the small CPU shapes."""
    kernels = _kernels()
    names = [e.name for e in OmegaConf.load(Path(CONF_DIR, "kernels", f"{option}.yaml")).get("entries") or []]
    moe = any(kernels.kernel_replaces(n, "GroupedExperts") for n in names)  # an expert kernel
    args = [f"model={'native_moe' if moe else 'native'}", *devices.get(device).verify_overrides(lnc)]
    # what each kernel's spec asks for on this device (Requirements.verify_overrides)
    extra = [o for n in names if n in kernels.KERNELS
             for o in kernels.KERNELS[n].requirements.verify_overrides.get(device, ())]
    return args + list(dict.fromkeys(extra))


def first_hardware_check(texts: list[str], ctx: dict, timeout: float = 1800) -> list[Row]:
    parsed = [o for o in overrides.parse(texts) if not o.key.startswith(("model", "kernels"))]
    run_overrides = [o.text for o in parsed]
    if devices.get(ctx["device"]).doctor_one_process:  # neuron: one NeuronCore per check (lnc.prepare_neuron_cores)
        run_overrides = [o.text for o in parsed if not o.key.startswith("parallelism")] + ["parallelism=single",
                                                                                          "parallelism.nproc_per_node=1"]
    rows = []
    with tempfile.TemporaryDirectory(prefix="qwen3_doctor_") as tmp:
        # every shipped model option (a preset too); those that load a checkpoint (written here by their
        # backend's smoke_overrides) last
        specs = sorted(((o, registry.get(b)) for o, b in registry.options().items()),
                       key=lambda option_spec: (option_spec[1].takes_path, option_spec[0]))
        for backend, spec in specs:
            extra = spec.smoke_overrides(Path(tmp))
            cmd = [sys.executable, "-m", "qwen3_research", f"model={backend}", *extra, *TINY_RUN, *run_overrides,
                   f"hydra.run.dir={Path(tmp) / ('run_' + backend)}"]
            ok, dt, msg = _timed(cmd, timeout)
            rows.append(Row(f"run model={backend}", f"{dt:6.1f} s  {msg if not ok else '2 steps'}", "pass" if ok else "FAIL"))
        for option in ctx["kernels"]:
            cmd = [sys.executable, "-m", "qwen3_research.verify_kernels", f"kernels={option}",
                   *verify_args(option, ctx["device"], ctx.get("lnc")), *run_overrides]
            ok, dt, msg = _timed(cmd, timeout)
            rows.append(Row(f"verify_kernels kernels={option}", f"{dt:6.1f} s  {msg}", "pass" if ok else "FAIL"))
    return rows


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if "-h" in args or "--help" in args:
        print(__doc__)
        return 0
    unknown = [a for a in args if a.startswith("-") and a != "--run"]
    if unknown:
        return _config_exit(f"doctor: unknown option {unknown[0]}; use --run or key=value overrides")
    if (why := allocator.refusal()) is not None:
        return _config_exit(f"config error: {why}")
    texts = [a for a in args if not a.startswith("-")]
    try:
        rows, ctx = collect(texts)
    except SystemExit as e:
        return int(e.code or 0)
    print(format_table(rows, "qwen3_research doctor: what a run with these overrides would use here"))
    missing = [r for r in rows if r.status == "MISSING"]
    if missing:
        print("\nmissing (the run cannot start until each is fixed):")
        for r in missing:
            print(f"- {r.item}: {r.fix}")
        return 1
    print("\nthe run can start here.")
    if "--run" not in args:
        return 0
    print(f"\nfirst-hardware check on {ctx['device']} (2-step tiny runs, then verify_kernels):", flush=True)
    checks = first_hardware_check(texts, ctx)
    print(format_table(checks, "results"))
    failed = [r for r in checks if r.status != "pass"]
    print(f"\n{len(checks) - len(failed)}/{len(checks)} checks pass")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(startup.run_tool(main, "the doctor was stopped"))
