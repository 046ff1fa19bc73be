"""``python -m qwen3_research.verify_kernels kernels=<option> [overrides]``

Builds the run's model (same config as ``python -m qwen3_research``), resolves and installs the
kernel overrides exactly as a run would, then checks every active kernel against its float32
reference on random inputs of the run's shapes (batch × seq_len tokens, heads, experts, top-k),
forward and backward. Prints max abs and rel error per kernel with PASS/FAIL against the stated
tolerance. Exit status: 0 all pass, 1 a kernel fails or nothing was verified (an entry that matches
no module of the model, or no kernel to check), 2 a configuration error -- among them a kernel that
cannot run here, found by the same checks a run makes (``models.check_run``: ``titan.check_supported``, then
``kernels.resolve``: the device, LNC and package checks of ``kernels.registry.kernel_support`` and the
model's shapes).
"""

from __future__ import annotations

import sys

from qwen3_research import startup

if __name__ == "__main__":  # Ctrl-C / SIGTERM while the modules below import: 128+signal, one line
    startup.exit_at_once_while_importing("; no kernel was verified")

from qwen3_research import models  # noqa: E402
from qwen3_research.compose import compose  # noqa: E402
from qwen3_research.config import ConfigError  # noqa: E402
from qwen3_research.resolve import resolve_run  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    startup.quiet_libraries()  # a kernel entry that matches nothing: one warning line
    args = sys.argv[1:] if argv is None else argv
    if "-h" in args or "--help" in args:
        print(__doc__)
        return 0
    unknown = [a for a in args if a.startswith("-")]
    if unknown:  # was ignored: `--bogus` verified as if it were not there
        print(f"config error: verify_kernels: unknown option {unknown[0]}; it takes only a run's overrides "
              "(kernels=<option>, key=value)", file=sys.stderr)
        return 2
    overrides = args
    try:
        cfg = compose(overrides)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    try:
        # deferred: start-up (torch and the kernels load after the config is composed: a config error exits first)
        from qwen3_research import devices, kernels

        # The checks a run makes before any worker starts (resolve_run: the config, the backend's run checks --
        # titan.check_supported --, the kernels' kernel_support and their targets on a meta-device model), so a
        # kernel that cannot run here is the same one-line config error as in a run. This process builds the
        # model next, on the run's device. The LNC goes into the environment before TorchNeuron is imported (its
        # runtime reads it once); one process: one NeuronCore, not every core of the host.
        run = resolve_run(cfg, builds_here=True, prepare=lambda kind, lnc, _: devices.prepare_launch(kind, lnc, 1))
        rc = run.rc
        device_type = devices.resolve_device_type(run.device_kind)  # the resolved kind, torch-checked here
        devices.prepare_torchtitan(device_type)
        device = devices.Device(device_type, 0, rc.device.lnc)
        # In the worker, the overrides' own checks on the model it built (what resolve_run checked on the meta
        # device, now with the device's dtypes), then the install without kernels.verify: verified once, below.
        backend = models.build(rc.model, device.torch_device, seq_len=rc.data.seq_len, seed=rc.training.seed)
        # gate=False: a speed kernel is checked whether or not this run would apply it here (the plan says which)
        dtype = run.precision.compute_dtype
        plan = kernels.install(backend.model, kernels.resolve(backend.model, rc, device, dtype=dtype, gate=False), rc,
                               device)
        checks = kernels.verify_plan(backend.model, plan, rc, device, dtype=dtype)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    unverified = [f"entry '{label}' (target '{e.target}') matches no module of model={rc.model.backend}"
                  for label, e in kernels.registry.entry_labels(rc.kernels.entries)
                  if kernels.KERNELS[e.name].verify is not None and not plan.get(label)]
    failed = [c for c in checks if not c.ok]
    option = f"kernels={rc.kernels.option or 'custom'}"
    checkable = [label for label, e in kernels.registry.entry_labels(rc.kernels.entries)
                 if kernels.KERNELS[e.name].verify is not None]
    if not checkable:  # was "error: nothing verified for no active kernel has a check", exit 1
        names = ", ".join(label for label, _ in kernels.registry.entry_labels(rc.kernels.entries)) or "none"
        print(f"{option}: nothing to verify: its entries ({names}) have no check (a reference is what the other "
              "kernels are checked against)")
        return 0
    print(f"{len(checks) - len(failed)}/{len(checks)} kernel(s) pass")
    if not checks:  # every checkable entry matched nothing: nothing was verified
        print(f"error: {option}: nothing verified: {'; '.join(unverified)}", file=sys.stderr)
        return 1
    # an unmatched entry among matched ones: the kernels' own one warning line (as in a run), the checks stand
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(startup.run_tool(main, "no kernel was verified"))
