"""The kernel override registry: match ``kernels.entries`` against the built model, check
requirements, swap in the kernels, and report the plan.

An entry (``conf/kernels/<option>.yaml``) names a kernel from ``KERNELS``, a target (an
fnmatch pattern over module fully-qualified names such as ``layers.*.moe.routed_experts.inner_experts``,
or ``type:ClassName``) and options. ``apply_overrides`` runs before sharding:

* every entry is matched against ``model.named_modules()``; a module a kernel cannot replace
  (wrong class) is never matched, so a broad pattern only picks the kernel's own module type;
* two entries claiming one module -> ``ConfigError`` naming both entries and the module;
* an entry that matches nothing -> a warning naming the entry and its pattern;
* unmet requirements (device type, dtype, sequence-length multiple, LNC, and the kernel's own
  ``Requirements.check``, e.g. the NKI Library kernels' shape/dtype constraints, once the device
  fits) -> one one-line ``ConfigError`` listing each with what to change;
* each matched module's class is swapped for the kernel's subclass (parameters, buffers,
  state-dict keys unchanged), so FSDP2, tensor parallel and checkpoints see the same module.
"""

from __future__ import annotations

import fnmatch
import logging
import os
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

import torch.nn as nn

from qwen3_research.config import ConfigError

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
    # Kernel-specific start-up checks, run on the first matched module once the device type fits:
    # (module, entry options, cfg, device, where) -> (errors, warnings); each a one-line message.
    check: Callable[..., tuple[list[str], list[str]]] | None = None


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


KERNELS: dict[str, KernelSpec] = {}


def register(spec: KernelSpec) -> KernelSpec:
    KERNELS[spec.name] = spec
    return spec


def _load_kernels() -> None:
    # Importing the kernel modules registers their specs (and custom ops). NKI bindings register
    # only their specs here; torch_neuronx is imported when a neuron kernel is installed.
    from qwen3_research.kernels import moe, nki, rope, triton_kernels  # noqa: F401


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


def _where(option: str | None, entry_name: str) -> str:
    return f"kernels={option}" if option else f"kernels entry '{entry_name}'"


def resolve(model: nn.Module, cfg, device) -> dict[str, list[str]]:
    """Entry -> matched module FQNs, after all checks (raises ConfigError; warns on no match)."""
    _load_kernels()
    kc = cfg.kernels
    option = getattr(kc, "option", None)
    modules = [(fqn, m) for fqn, m in model.named_modules() if fqn]
    plan: dict[str, list[str]] = {}
    owner: dict[str, str] = {}
    problems: list[str] = []
    for label, entry in entry_labels(kc.entries):
        spec = KERNELS.get(entry.name)
        if spec is None:
            raise ConfigError(
                f"{_where(option, entry.name)}: unknown kernel '{entry.name}'; known kernels: {sorted(KERNELS)}"
            )
        matched = []
        for fqn, m in modules:
            if not _matches(entry.target, fqn, m):
                continue
            if type(m).__name__ not in spec.module_types and not any(
                c.__name__ in spec.module_types for c in type(m).__mro__
            ):
                continue  # the pattern may be broad; the kernel only replaces its own module type
            if fqn in owner:
                raise ConfigError(
                    f"kernel entries '{owner[fqn]}' and '{label}' both claim module '{fqn}'; "
                    "each module takes one override: narrow one target pattern or drop one entry"
                )
            owner[fqn] = label
            matched.append(fqn)
        if not matched:
            msg = (
                f"kernel entry '{label}' (target '{entry.target}') matches no module of the built model "
                f"(it replaces {'/'.join(spec.module_types)}); it has no effect"
            )
            warnings.warn(msg, KernelMatchWarning, stacklevel=2)
        plan[label] = matched
        if matched:
            problems += _check_requirements(spec, entry, option, cfg, device, dict(modules), matched)
    if problems:
        raise ConfigError("; ".join(dict.fromkeys(problems)))
    return plan


def _check_requirements(spec, entry, option, cfg, device, modules, matched) -> list[str]:
    req = spec.requirements
    where = _where(option, entry.name)
    out = []
    if device.type not in req.devices:
        fix = f"; {req.fix}" if req.fix else ""
        out.append(
            f"{where} needs device {' or '.join(req.devices)} (kernel {spec.name}); this run's device is "
            f"{device.type}{fix}"
        )
    var = req.env.get(device.type)
    if var and os.environ.get(var) != "1":
        out.append(
            f"{where}: kernel {spec.name} runs on {device.type} only under {var}=1 (slow, for tests); "
            f"set {var}=1 or use {req.fix or 'another kernels option'}"
        )
    for fqn in matched:
        dtypes = {str(p.dtype).replace("torch.", "") for p in modules[fqn].parameters(recurse=True)}
        bad = dtypes - set(req.dtypes)
        if bad:
            out.append(
                f"{where}: kernel {spec.name} supports parameter dtypes {list(req.dtypes)}; module '{fqn}' has "
                f"{sorted(bad)}"
            )
            break
    lnc = getattr(device, "lnc", None)
    if req.lncs is not None and device.type == "neuron" and lnc not in req.lncs:
        out.append(
            f"{where} needs LNC in {list(req.lncs)} (NEURON_LOGICAL_NC_CONFIG or device.lnc); got {lnc}"
        )
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


def format_plan(plan: dict[str, list[str]], cfg) -> str:
    option = getattr(cfg.kernels, "option", None) or "custom"
    entries = dict(entry_labels(cfg.kernels.entries))
    lines = [f"kernel plan (kernels={option}): {sum(len(v) for v in plan.values())} module(s) overridden"]
    for label, fqns in plan.items():
        target = entries[label].target if label in entries else "?"
        lines.append(f"  {label} [{target}] -> {len(fqns)} module(s)" + (":" if fqns else " (no match)"))
        for fqn in fqns:
            lines.append(f"    {fqn}")
    return "\n".join(lines)


def apply_overrides(model: nn.Module, cfg, device) -> dict[str, list[str]]:
    """Resolve, check, install; print and log the plan; verify if ``kernels.verify``. Before sharding."""
    plan = resolve(model, cfg, device)
    mods = dict(model.named_modules())
    for label, entry in entry_labels(cfg.kernels.entries):
        spec = KERNELS[entry.name]
        for fqn in plan.get(label, []):
            spec.install(mods[fqn], dict(entry.options or {}), device)
    text = format_plan(plan, cfg)
    if int(os.environ.get("RANK", "0")) == 0:
        print(text, flush=True)
    log.info(text)
    if cfg.kernels.verify:
        from qwen3_research.kernels.verify import verify_plan

        verify_plan(model, plan, cfg, device, raise_on_fail=True)
    return plan
