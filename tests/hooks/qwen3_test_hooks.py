"""Test hooks that wrap parts of qwen3_research from outside; nothing of them is in the product's path.

Each is asked for by an environment variable, in a CLI run through ``sitecustomize.py`` on PYTHONPATH
(tests/conftest.py: ``fault_env``, ``hooks_env``), in the test process itself through ``fault_methods``:

- ``QWEN3_TEST_FAULT=WHAT@N[:rankR]``: a fault in optimizer step N (on rank R only, if given). ``raise``, ``nan``,
  ``kill``, ``oom`` happen in each micro-batch's forward-backward of step N, after the loss and before the backward
  (``Step.forward_backward``, through its ``loss``): a RuntimeError, a NaN loss (NaN gradients), SIGKILL of this
  rank, a real allocator failure (2**60 bytes). ``term`` SIGTERMs the launcher as step N's evaluation starts
  (``Step.evaluate``; Slurm preemption, scancel): the parent process in a worker group (the elastic agent, which
  passes it on to every rank), this process in a one-process run. The planner's trace step is never faulted.
- ``QWEN3_VALIDATE_ONLY=1``: ``python -m qwen3_research``, ``verify_kernels`` and the doctor's ``--run`` checks (which
  start those two) stop right before the first thing that needs the device, exit 0 and print ``VALIDATE_ONLY_LINE``:
  a run before its workers start (``launch.elastic.worker`` / ``_elastic``; no summary.json is written),
  ``verify_kernels`` before it prepares the device for its model (``devices.prepare_torchtitan``). The kernels'
  targets are then resolved on a meta-device model at resolution (``resolve_run`` as for a process that does not
  build the model next), so their checks run too. Used by tests/test_docs_commands.py to prove every documented
  Trainium command passes the project's own start-up validation on a simulated trn2 host.
- ``QWEN3_TEST_BLOCK_INPUT=DIR``: each rank writes ``DIR/rank<R>.json`` with the local shape (and, for a DTensor,
  the placements) of the first training forward's input to a transformer block: what tensor parallelism hands
  the blocks, sequence-sharded with sequence parallelism (seq_len / tp per rank), whole without it. Read by
  tests/test_kernels.py (TP without SP).
"""

from __future__ import annotations

import functools
import importlib
import os
import re
import signal
import sys

FAULT_ENV = "QWEN3_TEST_FAULT"
FAULT = re.compile(r"^(raise|nan|kill|term|oom)@[1-9][0-9]*(:rank[0-9]+)?$")
VALIDATE_ONLY_ENV = "QWEN3_VALIDATE_ONLY"
BLOCK_INPUT_ENV = "QWEN3_TEST_BLOCK_INPUT"
VALIDATE_ONLY_LINE = (f"{VALIDATE_ONLY_ENV}=1 (test hook): start-up validation passed; stopping before the device "
                      "is used")


def check_fault(spec: str) -> str:
    """``spec`` if it is WHAT@STEP[:rankR]; else ValueError (a test's own mistake, said before anything runs)."""
    if not FAULT.match(spec):
        raise ValueError(f"{FAULT_ENV}={spec!r} is not WHAT@STEP[:rankR] with WHAT one of raise, nan, kill, term, oom "
                         "(e.g. nan@2)")
    return spec


def install_from_environment() -> None:
    """Wrap the modules the environment's hooks name, as each is imported (none is imported here)."""
    patches = {}
    spec = os.environ.get(FAULT_ENV)
    if spec:
        check_fault(spec)
        patches["qwen3_research.step"] = functools.partial(_install_fault, spec=spec)
    probe_dir = os.environ.get(BLOCK_INPUT_ENV)
    if probe_dir:
        patches["qwen3_research.step"] = _chain(patches.get("qwen3_research.step"),
                                                functools.partial(_install_block_input_probe, out_dir=probe_dir))
    if os.environ.get(VALIDATE_ONLY_ENV) == "1":
        patches["qwen3_research.resolve"] = _validate_only_resolution
        patches["qwen3_research.launch.elastic"] = _validate_only_launch
    if patches:
        sys.meta_path.insert(0, _AfterImport(patches))


def _install_fault(step_module, spec: str) -> None:
    for name, method in fault_methods(step_module.Step, spec).items():
        setattr(step_module.Step, name, method)


def _chain(first, second):
    if first is None:
        return second
    return lambda module: (first(module), second(module))


# -- QWEN3_TEST_BLOCK_INPUT ------------------------------------------------------------------------------------
def _install_block_input_probe(_step_module, out_dir: str) -> None:
    """A global forward pre-hook (any model, any backend) that records the first training block input, then goes."""
    import json  # deferred: this module is imported at every interpreter's start-up

    import torch  # deferred: as above

    def probe(module, args):
        if not (args and type(module).__name__.endswith("TransformerBlock") and module.training
                and torch.is_grad_enabled()):
            return None
        x = args[0]
        placements = [str(p) for p in x.placements] if hasattr(x, "placements") else None
        local = x.to_local() if hasattr(x, "to_local") else x
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump({"block": type(module).__name__, "local_shape": list(local.shape), "placements": placements}, f)
        handle.remove()
        return None

    handle = torch.nn.modules.module.register_module_forward_pre_hook(probe)


class _AfterImport:
    """A meta path finder that runs ``patches[name](module)`` right after the module ``name`` is executed."""

    def __init__(self, patches: dict):
        self.patches = patches

    def find_spec(self, name, path=None, target=None):
        patch = self.patches.get(name)
        if patch is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        exec_module = spec.loader.exec_module

        def exec_then_patch(module):
            exec_module(module)
            patch(module)

        spec.loader.exec_module = exec_then_patch  # this spec's own loader instance only
        return spec


# -- QWEN3_TEST_FAULT --------------------------------------------------------------------------------------------
def _due(spec: str, kinds: tuple[str, ...], step: int, rank: int) -> str | None:
    """WHAT of ``spec`` when it is one of ``kinds`` and due at ``step`` on ``rank``."""
    what, _, rest = spec.partition("@")
    at, _, who = rest.partition(":")
    if what not in kinds or int(at) != step or (who and who != f"rank{rank}"):
        return None
    return what


def _inject_fault(what: str, spec: str, step: int, rank: int, loss):
    if what == "raise":
        raise RuntimeError(f"injected failure at step {step} on rank {rank} ({FAULT_ENV}={spec})")
    if what == "nan":
        return loss * float("nan")
    if what == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if what == "oom":  # a real allocator failure on any device: an allocation no device can hold (2**60 bytes)
        import torch  # deferred: this module is imported at every interpreter's start-up

        torch.empty(2**60, dtype=torch.uint8, device=loss.device)
    return loss


def fault_methods(step_class, spec: str) -> dict:
    """``Step.forward_backward`` and ``Step.evaluate`` wrapped to inject ``spec``'s fault (not in a trace)."""
    forward_backward, evaluate = step_class.forward_backward, step_class.evaluate

    @functools.wraps(forward_backward)
    def faulty_forward_backward(self, batch, tokens):
        step, rank = self.state.step + 1, self.where.rank
        what = None if self.where.trace else _due(spec, ("raise", "nan", "kill", "oom"), step, rank)
        if what is None:
            return forward_backward(self, batch, tokens)
        if what == "kill" and getattr(self, "pipeline", None) is not None:  # the schedule holds its own loss: die here
            _inject_fault(what, spec, step, rank, None)
        loss = self.loss  # the fault acts on the micro-batch's loss, before its backward
        self.loss = lambda *a, **k: _inject_fault(what, spec, step, rank, loss(*a, **k))
        try:
            return forward_backward(self, batch, tokens)
        finally:
            del self.loss

    @functools.wraps(evaluate)
    def evaluate_after_term(self, *args, **kwargs):
        if not self.where.trace and _due(spec, ("term",), self.state.step, self.where.rank):
            os.kill(os.getppid() if self.where.world_size > 1 else os.getpid(), signal.SIGTERM)
        return evaluate(self, *args, **kwargs)

    return {"forward_backward": faulty_forward_backward, "evaluate": evaluate_after_term}


# -- QWEN3_VALIDATE_ONLY -----------------------------------------------------------------------------------------
def _validate_only_resolution(resolve) -> None:
    """resolve_run resolves the kernels' targets on a meta-device model (as for a process that does not build the
    model next); a process that builds it next (verify_kernels: builds_here=True) stops before it prepares the
    device for it."""
    resolve_run = resolve.resolve_run

    @functools.wraps(resolve_run)
    def resolve_run_validating(*args, builds_here=None, **kwargs):
        run = resolve_run(*args, builds_here=False, **kwargs)
        if builds_here:
            devices = importlib.import_module("qwen3_research.devices")

            def stop(*_args, **_kwargs):
                resolve.warn_kernel_matches(run.kernel_warnings)
                print(VALIDATE_ONLY_LINE, flush=True)
                raise SystemExit(0)

            devices.prepare_torchtitan = stop
        return run

    resolve.resolve_run = resolve_run_validating


def _validate_only_launch(elastic) -> None:
    """The launcher stops where its workers would start, after every start-up check; no summary is written."""
    def stop(resolved, _info):
        importlib.import_module("qwen3_research.resolve").warn_kernel_matches(resolved.kernel_warnings)  # as the workers would
        print(VALIDATE_ONLY_LINE, flush=True)
        return {"status": "validated"}

    write_summary = elastic._write_summary

    def write_summary_unless_validated(path, summary):
        if summary.get("status") != "validated":
            write_summary(path, summary)

    elastic.worker, elastic._elastic, elastic._write_summary = stop, stop, write_summary_unless_validated
