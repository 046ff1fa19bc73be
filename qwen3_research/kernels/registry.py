"""The kernel override registry: match ``kernels.entries`` against the built model, check
requirements, swap in the kernels, and report the plan.

A leaf of the kernels package: the kernel modules (``moe``, ``rope``, ``triton_kernels``, ``nki``) import
this module and ``register`` their ``KernelSpec``; ``qwen3_research.kernels`` (the package) imports every
kernel module, so ``KERNELS`` is complete whenever this module is reachable. Adding a kernel: one module
that registers its spec, one import line in ``kernels/__init__.py``, one ``conf/kernels/<option>.yaml``.

An entry (``conf/kernels/<option>.yaml``) names a kernel from ``KERNELS``, a target (an
fnmatch pattern over module fully-qualified names such as ``layers.*.moe.routed_experts.inner_experts``,
or ``type:ClassName``) and options. ``apply_overrides`` runs before sharding:

* every entry is matched against ``model.named_modules()``; a module a kernel cannot replace
  (wrong class) is never matched, so a broad pattern only picks the kernel's own module type;
* two entries claiming one module -> ``ConfigError`` naming both entries and the module;
* a kernel whose device is not this run's -> ``ConfigError`` first, before any target is matched;
* an entry that matches nothing -> a warning naming the entry and its pattern, when another entry of the option
  matches; an option none of whose entries matches -> ``ConfigError`` naming what it replaces (and the MoE flavors);
* unmet requirements (device type, dtype, sequence-length multiple, LNC, the packages the kernel
  imports, and the kernel's own ``Requirements.check``, e.g. the NKI Library kernels' shape/dtype
  constraints, once the device fits) -> one one-line ``ConfigError`` listing each with what to change;
  the model-independent part is ``kernel_support``, the one check a run, ``verify_kernels`` and the
  doctor share;
* a speed kernel (``KernelSpec.speed``: moe_fast, rope_fast, triton_*) keeps the module it would replace unless
  its ``KernelSpec.measured`` says it is faster on this device kind and the run's dtype, or ``kernels.force=true``;
  the plan says which in one line per entry (issue 30);
* each matched module's class is swapped for the kernel's subclass (parameters, buffers,
  state-dict keys unchanged), so FSDP2, tensor parallel and checkpoints see the same module.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import importlib.util
import logging
import os
import warnings
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Callable

import torch.nn as nn

from qwen3_research import devices, models, titan
from qwen3_research.errors import ConfigError

log = logging.getLogger("qwen3_research.kernels")


class KernelMatchWarning(UserWarning):
    """An override entry matched no module of the built model (one ``warning: …`` line: qwen3_research.startup)."""


@dataclass
class Requirements:
    devices: tuple[str, ...] = ("cpu", "cuda")
    dtypes: tuple[str, ...] = ("float32", "bfloat16")  # parameter dtypes of the target module
    seq_multiple: Callable[[int], int] | None = None  # lnc -> required multiple of data.seq_len
    seq_multiple_text: str = ""  # how the multiple is derived, e.g. "128 × LNC"
    lncs: tuple[int, ...] | None = None  # allowed logical-core configs (neuron)
    env: dict[str, str] = field(default_factory=dict)  # device -> env var that must be "1" there
    fix: str = ""  # what to use instead when the device does not fit
    # Python modules the kernel imports on its device (found with importlib, nothing imported), and how
    # to install them.
    modules: tuple[str, ...] = ()
    install: str = ""
    # Overrides verify_kernels needs, per device, for the kernel to take the model it builds (the doctor's
    # --run), e.g. the NKI MoE kernels' smallest flavor on neuron: {"neuron": ("model.flavor=nki_debug",)}.
    verify_overrides: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # Kernel-specific start-up checks, run on the first matched module once the device type fits:
    # (module, entry options, cfg, device, where) -> (errors, warnings); each a one-line message.
    check: Callable[..., tuple[list[str], list[str]]] | None = None


@dataclass(frozen=True)
class Measured:
    """One speed measurement of a kernel against the module it replaces (forward + backward, the same shapes):
    ``ratio`` = time(module) / time(kernel), > 1 when the kernel is faster; ``where`` = the record
    (``benchmarks/RESULTS.md`` row) it comes from."""

    device: str  # device kind (``device_kind``): cpu-avx512bf16 | cpu-avx512 | cpu-avx2 | cuda | neuron
    dtype: str  # the run's compute dtype: float32 | bfloat16
    ratio: float
    where: str
    shape: str = ""  # which shape, where several were measured (e.g. "tiny", "30B-A3B")


@dataclass
class KernelSpec:
    """One kernel: which module class it replaces, how, and how to check it."""

    name: str
    description: str
    module_types: tuple[str, ...]  # class names it can replace
    install: Callable[..., None]  # (module, options, device) -> None: swaps the module's class / sets options
    requirements: Requirements
    # (module, shapes, device, options) -> [(shapes, fwd_abs, fwd_rel, bwd_abs, bwd_rel, compute dtype name)]
    verify: Callable[..., list] | None = None
    # Max relative error vs the float32 reference (fwd and bwd) per compute dtype; verify_kernels reads
    # exactly this (a dtype missing here fails the check).
    tolerance: dict[str, float] = field(default_factory=lambda: {"float32": 1e-5, "bfloat16": 2e-2})
    # (first matched module, options, cfg, device, number of matched modules) -> (lines for the kernel
    # plan, bytes the kernel keeps for backward on one rank): what it costs beyond the module it replaces.
    cost: Callable[..., tuple[list[str], int]] | None = None
    # Its name promises speed (moe_fast, rope_fast, triton_*): it replaces a module only on a device kind and dtype
    # where ``measured`` says it is faster, unless ``kernels.force=true``. False: always applied when asked for
    # (the references, a correctness tool; the NKI kernels, the point of a Trainium run, not yet timed there).
    speed: bool = False
    measured: tuple[Measured, ...] = ()
    reference: bool = False  # a float32 reference as an override (kernels=reference): no speed note at all


class KernelPlan(dict):
    """Entry label -> matched module FQNs (what ``apply_overrides`` returns), with the printed ``text`` and
    ``saved_bytes``: per entry, what its kernel keeps for backward on this rank (``KernelSpec.cost``).
    ``speed``: per entry with a match, its one-line speed note (``speed_note``); ``kept``: the entries a speed
    option did not apply (not measured faster here) -> the module FQNs that keep their own module."""

    text: str = ""
    saved_bytes: dict = {}
    speed: dict = {}
    kept: dict = {}


# -- applied only where faster (issue 30) -----------------------------------------------------------
def device_kind(device_type: str) -> str:
    """The kind of device a speed measurement holds for. CPUs differ by their matrix units (bf16 is 10-100x
    slower than fp32 without AVX512-BF16 and faster with it: GUIDE §7), so a CPU kind names them."""
    if not devices.get(device_type).runs_on_host:
        return device_type
    return _cpu_kind()


def _cpu_kind() -> str:
    return f"cpu-{devices.cpu_isa()}"  # the CPU's features are the devices package's (devices/cpu.py)


def speed_note(spec: KernelSpec, kind: str, dtype: str, table=None) -> tuple[bool, str]:
    """(faster here, the plan's note) from the kernel's measurements (``table``, default ``spec.measured``) on this
    device kind and dtype: faster only where every shape measured there was faster."""
    ms = [m for m in (spec.measured if table is None else table) if m.device == kind and m.dtype == dtype]
    if not ms:
        return False, f"not measured on {kind} {dtype}"
    faster = all(m.ratio > 1 for m in ms)
    ratios = " / ".join(f"{m.ratio:.2f}x" + (f" ({m.shape})" if m.shape else "") for m in ms)
    where = "; ".join(dict.fromkeys(m.where for m in ms))
    return faster, f"measured {ratios} the module's speed on {kind} {dtype}, {'faster' if faster else 'slower'} ({where})"


KERNELS: dict[str, KernelSpec] = {}


def register(spec: KernelSpec) -> KernelSpec:
    KERNELS[spec.name] = spec
    return spec


def kernel_replaces(name: str, module_type: str) -> bool:
    """Whether kernel ``name`` replaces modules of class ``module_type`` (``GroupedExperts``: an expert kernel)."""
    spec = KERNELS.get(name)
    return spec is not None and module_type in spec.module_types


def entry_labels(entries) -> list[tuple[str, Any]]:
    """A unique label per entry: the kernel name, or name@target when a kernel appears twice."""
    out, seen = [], set()
    for entry in entries:
        label = entry.name if entry.name not in seen else f"{entry.name}@{entry.target}"
        seen.add(label)
        out.append((label, entry))
    return out


def _matches(pattern: str, fqn: str, module: nn.Module) -> bool:
    if pattern.startswith("type:"):
        return type(module).__name__ == pattern[5:] or any(
            c.__name__ == pattern[5:] for c in type(module).__mro__
        )
    return fnmatch.fnmatchcase(fqn, pattern)


def _replaceable(spec: KernelSpec, module: nn.Module) -> bool:
    """``module`` is of a class the kernel replaces (or a subclass of one)."""
    return any(c.__name__ in spec.module_types for c in type(module).__mro__)


def _where(option: str | None, entry_name: str) -> str:
    return f"kernels={option}" if option else f"kernels entry '{entry_name}'"


# -- planning a device that is not here --------------------------------------------------------
# ``qwen3_research.plan`` traces a run on fake CPU tensors. For a run planned for another device
# (device=neuron on a host without it) the requirement checks must see that device, and a kernel
# that only exists there installs its shape-only form (``KernelSpec.install`` gets ``device.planning``).
_PLANNED: dict = {}


class planning_for:
    """Context: kernel checks and installs see device ``device_type`` (LNC ``lnc``) while tensors stay on
    the tracing device. Used by qwen3_research.plan only; nothing runs on ``device_type``."""

    def __init__(self, device_type: str, lnc: int | None):
        self.device_type, self.lnc = device_type, lnc

    def __enter__(self):
        _PLANNED.update(type=self.device_type, lnc=self.lnc)
        return self

    def __exit__(self, *exc):
        _PLANNED.clear()


def _effective(device):
    if not _PLANNED:
        return device
    return SimpleNamespace(type=_PLANNED["type"], lnc=_PLANNED["lnc"] or getattr(device, "lnc", None),
                           torch_device=getattr(device, "torch_device", None), planning=True)


def kernel_support(entries, device_type: str, lnc: int | None = None, option: str | None = None) -> list[str]:
    """Why ``entries`` (a conf/kernels option's entries) cannot run on ``device_type`` here: one line each,
    empty when they can (the model's own shape checks come at start-up, in ``resolve``). The check a
    run makes (``resolve``), ``verify_kernels`` makes first, and the doctor shows per option."""
    out = []
    for entry in entries:
        spec = KERNELS.get(entry.name)
        where = _where(option, entry.name)
        if spec is None:
            out.append(f"{where}: unknown kernel '{entry.name}'; known kernels: {sorted(KERNELS)}")
            continue
        out += _static_problems(spec, where, device_type, lnc)
    return list(dict.fromkeys(out))


def _static_problems(spec, where: str, device_type: str, lnc: int | None, planning: bool = False) -> list[str]:
    """What does not depend on the model: device type, environment variable, LNC, importable modules."""
    req = spec.requirements
    out = _device_problem(spec, where, device_type)
    if out:
        return out
    var = req.env.get(device_type)
    if var and os.environ.get(var) != "1":
        out.append(
            f"{where}: kernel {spec.name} runs on {device_type} only under {var}=1 (slow, for tests); "
            f"set {var}=1 or use {req.fix or 'another kernels option'}"
        )
    if req.lncs is not None and devices.get(device_type).logical_cores and lnc not in req.lncs:
        out.append(
            f"{where} needs LNC in {list(req.lncs)} (NEURON_LOGICAL_NC_CONFIG or device.lnc); got {lnc}"
        )
    missing = [] if planning else [m for m in req.modules if _find_spec(importlib.util, m) is None]
    if missing:
        how = f": {req.install}" if req.install else ""
        out.append(f"{where}: kernel {spec.name} imports {', '.join(missing)}, not installed here{how}")
    return out


def _device_problem(spec, where: str, device_type: str) -> list[str]:
    """The kernel's device rule: the one line when ``device_type`` is not one it runs on, else nothing."""
    req = spec.requirements
    if device_type in req.devices:
        return []
    fix = f"; {req.fix}" if req.fix else ""
    return [f"{where} needs device {' or '.join(req.devices)} (kernel {spec.name}); this run's device is "
            f"{device_type}{fix}"]


def _find_spec(util, name: str):
    try:
        return util.find_spec(name)
    except (ImportError, ValueError):
        return None


def resolve(model: nn.Module, cfg, device, *, dtype: str, gate: bool = True) -> KernelPlan:
    """Entry -> matched module FQNs, after all checks (raises ConfigError; warns on no match). ``dtype``: the run's
    compute dtype, as its precision plan decided it (``resolve.PrecisionPlan.compute_dtype``: float32 or bfloat16).
    A speed kernel (``KernelSpec.speed``) not measured faster on this device kind and ``dtype`` keeps its modules
    (``plan.kept``; the plan says so in one line) unless ``kernels.force=true`` or ``gate=False``
    (verify_kernels checks what the kernel computes, applied or not)."""
    device = _effective(device)
    kc = cfg.kernels
    option = getattr(kc, "option", None)
    # torchtitan 0.2.x has no RoPE module: the adapter adds one when a RoPE kernel is asked for.
    titan.prepare_kernel_targets(model, rope=any(
        "CosSinRoPE" in KERNELS[e.name].module_types for e in kc.entries if e.name in KERNELS))
    modules = [(fqn, m) for fqn, m in model.named_modules() if fqn]
    plan: dict[str, list[str]] = {}
    owner: dict[str, str] = {}
    problems: list[str] = []
    # The device rule before any target is matched: a kernel that cannot run on this device is refused whether or
    # not the model has its modules (kernels=nki_moe on a dense CPU model trained the dense model with one
    # no-match warning, issue 40).
    for label, entry in entry_labels(kc.entries):
        spec = KERNELS.get(entry.name)
        if spec is None:
            raise ConfigError(
                f"{_where(option, entry.name)}: unknown kernel '{entry.name}'; known kernels: {sorted(KERNELS)}"
            )
        problems += _device_problem(spec, _where(option, entry.name), device.type)
    if problems:
        raise ConfigError("; ".join(dict.fromkeys(problems)))
    unmatched: list[str] = []
    for label, entry in entry_labels(kc.entries):
        spec = KERNELS[entry.name]
        matched = []
        for fqn, m in modules:
            if not _matches(entry.target, fqn, m):
                continue
            if not _replaceable(spec, m):
                continue  # the pattern may be broad; the kernel only replaces its own module type
            if fqn in owner:
                raise ConfigError(
                    f"kernel entries '{owner[fqn]}' and '{label}' both claim module '{fqn}'; "
                    "each module takes one override: narrow one target pattern or drop one entry"
                )
            owner[fqn] = label
            matched.append(fqn)
        if not matched:
            ours = [fqn for fqn, m in modules if _replaceable(spec, m)]
            if ours:  # the model has the kernel's modules and the target reaches none of them: a wrong target
                raise ConfigError(
                    f"kernel entry '{label}' (target '{entry.target}') "
                    f"matches none of the model's {len(ours)} {'/'.join(spec.module_types)} modules (e.g. "
                    f"'{ours[0]}'); fix the target: an fnmatch pattern over module names, or type:<class>"
                )
            # A model without the kernel's module type (moe_fast on a dense model): nothing to replace
            unmatched.append(
                f"kernel entry '{label}' (target '{entry.target}') matches no module of the built model "
                f"(it replaces {'/'.join(spec.module_types)}); it has no effect"
            )
        plan[label] = matched
        if matched:
            problems += _check_requirements(spec, entry, option, cfg, device, dict(modules), matched)
    if kc.entries and not any(plan.values()):  # the whole option does nothing on this model: not what was asked
        raise ConfigError(_matches_nothing(option, kc.entries, cfg))
    for msg in unmatched:  # one entry without modules among matched ones (kernels=fast on a dense model)
        warnings.warn(msg, KernelMatchWarning, stacklevel=2)
    if problems:
        raise ConfigError("; ".join(dict.fromkeys(problems)))
    out = KernelPlan(plan)
    out.speed, out.kept = {}, {}
    force = bool(getattr(kc, "force", False)) or not gate
    kind = device_kind(device.type)
    for label, entry in entry_labels(kc.entries):
        spec = KERNELS[entry.name]
        if not plan.get(label) or spec.reference:
            continue
        faster, note = speed_note(spec, kind, dtype)
        if not spec.speed:  # the NKI kernels: applied where they run, their speed shown as recorded or not
            out.speed[label] = f"{note}; not speed-gated"
            continue
        if faster:
            out.speed[label] = note
        elif getattr(kc, "force", False):
            out.speed[label] = f"{note}; applied: kernels.force=true"
        elif force:  # gate=False: verify_kernels installs it to check it
            out.speed[label] = (f"{note}; installed to be checked: a run keeps {'/'.join(spec.module_types)} "
                                "unless kernels.force=true")
        else:
            out.speed[label] = f"{note}; not applied, keeps {'/'.join(spec.module_types)} (kernels.force=true applies it)"
            out.kept[label], out[label] = out[label], []
    return out


def _matches_nothing(option, entries, cfg) -> str:
    """The one line for a kernel option none of whose entries matches a module of the model: what it replaces and,
    for a dense model whose backend has mixture-of-experts flavors, those flavors."""
    what = sorted({t for e in entries for t in KERNELS[e.name].module_types})
    name = f"kernels={option}" if option else f"kernel entries {[e.name for e in entries]}"
    model = getattr(cfg, "model", None)
    moe_flavors, this = [], "the built model"
    if model is not None:
        this = f"model={model.backend} model.flavor={model.flavor}"
        try:
            if not models.describe(model).get("is_moe"):
                moe_flavors = [f for f in models.spec(model).flavors
                               if models.describe(dataclasses.replace(model, flavor=f, init_from=None)).get("is_moe")]
        except ConfigError:
            pass  # a model the checks refuse is named as it is
    fix = (f"; a mixture-of-experts flavor has them: model.flavor={'|'.join(moe_flavors)}" if moe_flavors else "")
    return (f"{name} matches no module of {this} (it replaces {'/'.join(what)}, which this model does not have), so "
            f"it would change nothing{fix}; or drop {name}")


def _check_requirements(spec, entry, option, cfg, device, modules, matched) -> list[str]:
    req = spec.requirements
    where = _where(option, entry.name)
    lnc = getattr(device, "lnc", None)
    out = _static_problems(spec, where, device.type, lnc, planning=getattr(device, "planning", False))
    for fqn in matched:
        dtypes = {str(p.dtype).replace("torch.", "") for p in modules[fqn].parameters(recurse=True)}
        bad = dtypes - set(req.dtypes)
        if bad:
            out.append(
                f"{where}: kernel {spec.name} supports parameter dtypes {list(req.dtypes)}; module '{fqn}' has "
                f"{sorted(bad)}"
            )
            break
    if req.check is not None and device.type in req.devices:
        errors, warns = req.check(modules[matched[0]], dict(entry.options or {}), cfg, device, where)
        out += errors
        for msg in warns:
            warnings.warn(msg, KernelMatchWarning, stacklevel=3)
    if req.seq_multiple is not None:
        m = req.seq_multiple(lnc or 1)
        seq = cfg.data.seq_len
        if seq % m:
            how = f"{req.seq_multiple_text} = {m}" if req.seq_multiple_text else str(m)
            lower, upper = (seq // m) * m, (seq // m + 1) * m
            hint = f" (e.g. data.seq_len={upper}" + (f" or {lower})" if lower else ")")
            out.append(f"{where} needs data.seq_len to be a multiple of {how}; got {seq}{hint}")
    return out


def format_plan(plan: dict[str, list[str]], cfg, model: nn.Module | None = None, device=None) -> str:
    """The plan as printed at start-up; with ``model``, each kernel's own cost lines (``KernelSpec.cost``)."""
    return _plan_text_and_costs(plan, cfg, model, device)[0]


def _plan_text_and_costs(plan, cfg, model, device) -> tuple[str, dict]:
    option = getattr(cfg.kernels, "option", None) or "custom"
    entries = dict(entry_labels(cfg.kernels.entries))
    mods = dict(model.named_modules()) if model is not None else {}
    saved = {}
    lines = [f"kernel plan (kernels={option}): {sum(len(v) for v in plan.values())} module(s) overridden"]
    speed, kept = getattr(plan, "speed", {}), getattr(plan, "kept", {})
    for label, fqns in plan.items():
        entry = entries.get(label)
        target = entry.target if entry is not None else "?"
        if label in kept:  # a speed option not measured faster here: one line
            lines.append(f"  {label} [{target}] -> 0 of {len(kept[label])} module(s): {speed[label]}")
            continue
        note = f" ({speed[label]})" if label in speed else ""
        lines.append(f"  {label} [{target}] -> {len(fqns)} module(s)" + (f"{note}:" if fqns else " (no match)"))
        for fqn in fqns:
            lines.append(f"    {fqn}")
        spec = KERNELS.get(entry.name) if entry is not None else None
        if fqns and mods and spec is not None and spec.cost is not None:
            text, saved[label] = spec.cost(mods[fqns[0]], dict(entry.options or {}), cfg, _effective(device), len(fqns))
            lines += [f"    {line}" for line in text]
    return "\n".join(lines), saved


def install(model: nn.Module, resolved: dict[str, list[str]], cfg, device) -> KernelPlan:
    """Swap in every matched module's kernel (``resolve``'s plan); print and log the plan. Before sharding."""
    plan = KernelPlan(resolved)
    plan.speed, plan.kept = dict(getattr(resolved, "speed", {})), dict(getattr(resolved, "kept", {}))
    mods = dict(model.named_modules())
    for label, entry in entry_labels(cfg.kernels.entries):
        spec = KERNELS[entry.name]
        for fqn in plan.get(label, []):
            spec.install(mods[fqn], dict(entry.options or {}), _effective(device))
    text, plan.saved_bytes = _plan_text_and_costs(plan, cfg, model, device)
    plan.text = text
    if int(os.environ.get("RANK", "0")) == 0:
        print(text, flush=True)
    log.info(text)
    return plan
