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
the first hour on a trn2 needs it (``neuron_host.host_checks``): ``neuron-ls`` (devices, cores, processes already
holding cores), the Neuron driver (``/sys/module/neuron/version``) and the aws-neuronx runtime/collectives/tools
packages, ``NEURON_RT_*`` variables already set, the NEFF compile cache and its free disk, EFA (``fi_info -p
efa``) when ``parallelism.nnodes > 1``, and that ``torchtitan.models.qwen3`` imports (it needs triton on
torchtitan 0.2.x); ``--run`` there gives each check one NeuronCore. The host checks are ``neuron_host``'s;
docs/TRAINIUM.md lists each row's failures.

Nothing here starts a Neuron runtime in this process: the Neuron facts are asked in child processes.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as dist_version
from pathlib import Path

# AWS's install line for TorchNeuron on PyTorch 2.14 (Neuron 2.33, setup/pytorch/update-manual).
NEURON_INSTALL = ('pip install "torch-neuronx==2.14.*" "neuronx-cc==2.*" nki '
                  "--extra-index-url https://pip.repos.neuron.amazonaws.com "
                  "--extra-index-url https://download.pytorch.org/whl/cpu (README 'Trainium hosts')")
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


def _version(dist: str) -> str | None:
    try:
        return dist_version(dist)
    except PackageNotFoundError:
        return None


def _has(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _child(code: str, env: dict | None = None, timeout: float = 600) -> tuple[bool, str]:
    proc = subprocess.run([sys.executable, "-c", code], env={**os.environ, **(env or {})},
                          capture_output=True, text=True, timeout=timeout)
    out = (proc.stdout.strip().splitlines() or [""])[-1]
    err = (proc.stderr.strip().splitlines() or ["no output"])[-1]
    return proc.returncode == 0, out if proc.returncode == 0 else err


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
    from omegaconf import OmegaConf

    from qwen3_research.compose import CONF_DIR
    from qwen3_research.kernels import KERNELS as kernels
    from qwen3_research.kernels import kernel_support

    out = {}
    for path in sorted(Path(CONF_DIR, "kernels").glob("*.yaml")):
        entries = OmegaConf.load(path).get("entries") or []
        why = kernel_support(entries, device_type, lnc, option=path.stem)
        checks = any(kernels[e.name].verify is not None for e in entries if e.name in kernels)
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
    from qwen3_research import titan

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

    from qwen3_research.compose import compose
    from qwen3_research.errors import ConfigError

    try:
        cfg = compose(overrides)
    except ConfigError as e:
        raise SystemExit(_config_exit(f"config error: {e}"))
    import torch

    from qwen3_research import device as devices
    from qwen3_research.config import to_run_config

    rc = to_run_config(cfg)
    requested = rc.device.type
    kind = devices.requested_device_kind(requested)
    device_ok = True
    if kind == "neuron" and not _has("torch_neuronx"):
        device_ok = False
        rows.append(Row("device", f"{requested} -> neuron: torch_neuronx not installed", "MISSING", NEURON_INSTALL))
    elif kind == "cuda" and not torch.cuda.is_available():
        device_ok = False
        rows.append(Row("device", f"{requested} -> cuda: torch.cuda.is_available() is False", "MISSING",
                        devices.cuda_unavailable_reason()))
    else:
        found = {"cpu": f"cpu ({os.cpu_count()} cores)", "neuron": "neuron (torch_neuronx importable)",
                 "cuda": f"cuda: {torch.cuda.get_device_name(0) if kind == 'cuda' else ''}"}[kind]
        rows.append(Row("device", f"device.type={requested} -> {found}"))
    ctx["device"] = kind if device_ok else None
    ctx["lnc"] = None
    if kind == "neuron" and tt["installed"] and not tt["fork"]:
        rows.append(Row("torchtitan on neuron", "upstream build; AWS tests Trainium with its torchtitan-neuron fork "
                        "(0.2.2+neuron.1, release-2.33)", "info"))
    devices.prepare_torchtitan(kind)  # before anything imports torchtitan (it reads the device at import)

    # LNC and logical cores.
    lnc = None
    try:
        lnc = ctx["lnc"] = devices.resolve_lnc(rc.device.lnc, kind)
    except ConfigError as e:
        rows.append(Row("LNC", str(e).split(";")[0], "MISSING", str(e).split("; ", 1)[-1]))
        device_ok = False
    if kind == "neuron" and device_ok:
        try:
            cores = devices.neuron_logical_core_count(lnc)
            rows.append(Row("LNC / logical cores", f"LNC={lnc} ({devices.LNC_ENV} exported to workers), {cores} logical cores"))
        except ConfigError as e:
            rows.append(Row("LNC / logical cores", f"LNC={lnc}, count failed", "MISSING", str(e)))
            device_ok = False
    elif kind == "neuron" and lnc is not None:
        rows.append(Row("LNC / logical cores", f"LNC={lnc}; logical cores unknown until torch_neuronx is installed", "info"))
    elif "LNC" not in [r.item for r in rows]:
        rows.append(Row("LNC / logical cores", f"{'LNC=' + str(lnc) + ' exported' if lnc else 'n/a'} "
                        f"(no NeuronCores: device is {kind})", "info"))

    # World size and degrees: the run's own start-up resolution (its kernel entries: the "kernels" row below).
    run = None
    if device_ok:
        from qwen3_research.resolve import resolve_run

        try:
            run = resolve_run(cfg, kernels=False)
            d = run.degrees
            auto = " (nproc_per_node=-1: auto)" if cfg.parallelism.nproc_per_node == -1 else ""
            rows.append(Row("world size", f"{run.nproc_per_node} x {rc.parallelism.nnodes} node(s) = {d.world_size}{auto}; "
                            f"{d.describe()}"))
        except ConfigError as e:
            # the refusal itself is the fix line (it names the key and what to change), not "see above"
            rows.append(Row("run config", "refused by the run's start-up checks", "MISSING", str(e).splitlines()[0]))
    if kind == "neuron":  # with or without TorchNeuron: the host facts say what else the first run needs
        from qwen3_research.neuron_host import host_checks

        nproc = run.nproc_per_node if run is not None else (
            rc.parallelism.nproc_per_node if rc.parallelism.nproc_per_node != -1 else None)
        rows += [Row(*c) for c in host_checks(nproc, rc.parallelism.nnodes, lnc)]
        rows.append(_titan_models_row())

    # Memory per rank.
    if ctx["device"] == "cuda":
        cap = torch.cuda.get_device_properties(0).total_memory
        rows.append(Row("memory per rank", f"{cap / 1024**3:.1f} GiB HBM (torch.cuda.get_device_properties)"))
    elif ctx["device"] == "neuron" and device_ok:
        ok, out = _child("import torch, torch_neuronx; print(torch.neuron.get_device_properties(0).total_memory)",
                         {devices.LNC_ENV: str(lnc)})
        rows.append(Row("memory per rank", f"{int(out) / 1024**3:.1f} GiB HBM per logical core (get_device_properties)"
                        if ok else f"could not read: {out}", "ok" if ok else "MISSING",
                        "" if ok else "check the Neuron driver and runtime (neuron-ls)"))
    elif ctx["device"] == "cpu":
        total, source = devices.host_memory()
        n = run.nproc_per_node if run is not None else 1  # the ranks on this host share it
        rows.append(Row("memory per rank", f"{total / n / 1024**3:.1f} GiB ({total / 1024**3:.1f} GiB {source}"
                        + (f" / {n} ranks" if n > 1 else "") + ", cpu)", "info"))

    # Backends.
    if ctx["device"]:
        import torch.distributed as dist

        pg = {"cuda": "nccl", "neuron": "neuron", "cpu": "gloo"}[ctx["device"]]
        pg_ok = dist.is_available() and (pg == "neuron" or getattr(dist, f"is_{pg}_available")())
        rows.append(Row("process group", pg, "ok" if pg_ok else "MISSING", "" if pg_ok else f"this torch build lacks {pg}"))
        cb = rc.compile.backend or ("neuron" if ctx["device"] == "neuron" else "inductor")
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
            from qwen3_research.resolve import kernel_targets, warn_kernel_matches

            try:
                _, unmatched = kernel_targets(rc, ctx["device"], lnc)
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


def _titan_models_row() -> Row:
    """torchtitan's Qwen3 package imports (in a child: it reads the device at import). On torchtitan 0.2.x it
    imports triton (models/moe/kernels.py), which TorchNeuron does not bring."""
    ok, msg = _child("import torchtitan.models.qwen3")
    if ok:
        return Row("torchtitan models", "import torchtitan.models.qwen3: ok")
    fix = ("pip install triton (torchtitan's MoE kernels module imports it; AWS's Qwen3 guide installs it; "
           "requirements-neuron.txt)" if "triton" in msg else "reinstall torchtitan as README 'Trainium hosts' says")
    return Row("torchtitan models", f"import torchtitan.models.qwen3 failed: {msg}", "MISSING", fix)


def _config_exit(message: str) -> int:
    print(message, file=sys.stderr, flush=True)
    return 2


def format_table(rows: list[Row], title: str) -> str:
    w1 = max(len(r.item) for r in rows)
    w3 = max([len("status")] + [len(r.status) for r in rows])
    lines = [title, f"{'check':<{w1}}  {'status':<{w3}}  value", f"{'-' * w1}  {'-' * w3}  {'-' * 5}"]
    lines += [f"{r.item:<{w1}}  {r.status:<{w3}}  {r.value}" for r in rows]
    return "\n".join(lines)


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
    from omegaconf import OmegaConf

    from qwen3_research.compose import CONF_DIR
    from qwen3_research.kernels import KERNELS, kernel_replaces

    names = [e.name for e in OmegaConf.load(Path(CONF_DIR, "kernels", f"{option}.yaml")).get("entries") or []]
    moe = any(kernel_replaces(n, "GroupedExperts") for n in names)  # an expert kernel
    args = [f"model={'native_moe' if moe else 'native'}"]
    if device == "neuron":
        args += [f"data.seq_len={128 * (lnc or 2)}", "data.batch_size=1"]
    else:
        args += ["data.seq_len=32", "data.batch_size=2"]
    # what each kernel's spec asks for on this device (Requirements.verify_overrides)
    extra = [o for n in names if n in KERNELS for o in KERNELS[n].requirements.verify_overrides.get(device, ())]
    return args + list(dict.fromkeys(extra))


def first_hardware_check(overrides: list[str], ctx: dict, timeout: float = 1800) -> list[Row]:
    run_overrides = [o for o in overrides if not o.split("=", 1)[0].lstrip("+~").startswith(("model", "kernels"))]
    if ctx["device"] == "neuron":  # one process, one NeuronCore per check (device.prepare_neuron_cores)
        run_overrides = [o for o in run_overrides if not o.startswith("parallelism")] + ["parallelism=single",
                                                                                          "parallelism.nproc_per_node=1"]
    from qwen3_research.models import registry

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
    overrides = [a for a in args if not a.startswith("-")]
    try:
        rows, ctx = collect(overrides)
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
    checks = first_hardware_check(overrides, ctx)
    print(format_table(checks, "results"))
    failed = [r for r in checks if r.status != "pass"]
    print(f"\n{len(checks) - len(failed)}/{len(checks)} checks pass")
    return 1 if failed else 0


if __name__ == "__main__":
    from qwen3_research.startup import run_tool

    sys.exit(run_tool(main, "the doctor was stopped"))
