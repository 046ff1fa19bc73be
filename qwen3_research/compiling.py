"""torch.compile for a run: whether it is on (``decide``, once, at start-up, with its reason), the compile cache
every run and sweep point shares (``export_cache_env``), and what is compiled (``apply``: each transformer block,
and the loss).

Why per block: the blocks are identical, so dynamo traces one and reuses the graph for the rest (torchtitan's
``apply_compile`` compiles each ``TransformerBlock`` in place the same way); the module tree, its parameter names
and the hooks on it stay as they are (checkpoints, FSDP, routing hooks, kernel overrides), and a first step compiles
one block's graph, not the whole model's.

Measured (GUIDE §9, docs/GPU.md): one H200, torch 2.11, torchtitan 0.2.2, Qwen3-0.6B seq 2048 x 8 bf16: compile
off 0.318 s/step (26 % MFU, peak 70.0 GiB), the whole model compiled 0.190 s (43 %, peak 56.8 GiB). CPU (GUIDE §2):
first step 20-30 s, later steps 1.3-1.6x faster: a default CPU run (60 steps of ~1 s) and the test suite's short runs
would lose more to the compile than they gain, so auto keeps it off there. Neuron: not measured.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from qwen3_research import devices
from qwen3_research.errors import LOW_SPACE, ConfigError

# The compiled run's peak over the eager run's, measured on one H200 (Qwen3-0.6B seq 2048 x 8 bf16, torch 2.11,
# torchtitan 0.2.2; GUIDE §9): 56.8 / 70.0 GiB. The plan traces the eager step and prints this factor beside it.
COMPILED_PEAK_FACTOR = 56.8 / 70.0
COMPILED_PEAK_SOURCE = "measured on one H200, Qwen3-0.6B seq 2048x8 bf16: 56.8 GiB compiled / 70.0 GiB eager"

# MFU measured on one H200 (dense bf16 peak 989 TFLOP/s), Qwen3-0.6B seq 2048 x 8 bf16 (GUIDE §9): what the plan
# divides a step's FLOPs by to predict its time on a GPU this host does not have.
MEASURED_MFU = {True: 0.43, False: 0.26}
MEASURED_MFU_SOURCE = "MFU measured on one H200, Qwen3-0.6B seq 2048x8 bf16: 26 % compile off, 43 % on"

ENABLE_ENV_VARS = {"TORCHINDUCTOR_FX_GRAPH_CACHE": "1", "TORCHINDUCTOR_AUTOGRAD_CACHE": "1"}
NEFF_CACHE_ENV = "TORCH_NEURONX_NEFF_CACHE_DIR"  # TorchNeuron's NEFF cache (devices/neuron_host.py cites AWS's pages)
LEGACY_NEFF_CACHE_ENV = "NEURON_COMPILE_CACHE_URL"  # the torch-xla based torch-neuronx's


@dataclass(frozen=True)
class CompileDecision:
    """compile.enable resolved: on or off and why; where its cache is and whether it held entries already."""

    enable: bool
    reason: str
    backend: str  # inductor | neuron | compile.backend
    cache_root: str | None = None  # compile.cache_dir expanded (None: the environment's caches are left alone)
    cache_key: str = ""  # the keyed subdirectory's name
    cache_state: str | None = None  # warm (the keyed dir held entries before this run) | cold | None (compile off)

    @property
    def cache_dir(self) -> str | None:
        return None if self.cache_root is None else str(Path(self.cache_root) / self.cache_key)

    def describe(self) -> str:
        line = f"compile: {'on' if self.enable else 'off'} ({self.reason})"
        if self.enable and self.cache_dir:
            line += f"; cache {self.cache_dir} ({self.cache_state})"
        return line


# torch.compile per block under tensor parallelism fails in the first backward for these models (CPU, torch 2.14,
# found by the pairwise matrix, tests/pairwise.py): AOTAutograd guesses a block output's tangent wrong, "Expected a DTensor tangent
# but got a plain Tensor" (MoE: the router's outputs; model=hf: 'Tensor' object has no attribute '_local_tensor' in
# DTensor's redistribute backward). torchtitan's own dense Qwen3 compiles under TP (tp2 and tp2 + SP run).
TP_UNCOMPILABLE = "per-block torch.compile under tensor parallelism fails in the first backward for {what} " \
    "(AOTAutograd: 'Expected a DTensor tangent but got a plain Tensor')"


def decide(rc, device_type: str, *, is_moe: bool, probe: bool = True, tp_blocker: str | None = None) -> CompileDecision:
    """compile.enable for this run: true/false as given, auto by what was measured (module docstring). ``probe``:
    ask the host for the cache key's device facts (False: a plan for a device this host does not have).
    ``tp_blocker``: what keeps this model from compiling under its TP degree (None: nothing): true is refused with
    it, auto is off."""
    c = rc.compile
    spec = devices.get(device_type)
    backend = c.backend or spec.compile_backend
    if tp_blocker and c.enable is True:
        raise ConfigError(f"compile.enable=true with parallelism.tp={rc.parallelism.tp}: "
                          f"{TP_UNCOMPILABLE.format(what=tp_blocker)}; use compile.enable=false (or auto) with tp, "
                          "or parallelism.tp=1")
    if tp_blocker and c.enable not in (True, False):
        return CompileDecision(False, f"auto: {TP_UNCOMPILABLE.format(what=tp_blocker)}", backend)
    if c.enable is True or c.enable is False:
        enable, reason = bool(c.enable), f"compile.enable={str(c.enable).lower()}"
    elif spec.compile_default is not None:  # what was measured on the device (its spec)
        enable, reason = spec.compile_default(is_moe, rc.training.mixed_precision, rc.kernels.entries)
    else:
        enable, reason = False, f"auto: {device_type} compiled has not been measured"
    asked = c.backend  # torch.compile's backend (a model backend's name is models/' business)
    if enable and probe and asked and asked != spec.compile_backend:
        # issue 40: a backend torch does not know failed at step 1 with a dynamo traceback. The device's own backend
        # is not checked (neuron's registers when torch_neuronx loads, in the worker).
        import torch._dynamo  # deferred: only a named backend loads dynamo at resolution

        if asked not in torch._dynamo.list_backends(exclude_tags=()):  # debug and experimental ones count
            raise ConfigError(f"compile.backend={c.backend!r} is not a torch.compile backend here (torch's: "
                              f"{', '.join(sorted(torch._dynamo.list_backends()))}): name one of them, or drop "
                              f"compile.backend ({device_type}: {spec.compile_backend})")
    if not enable or not c.cache_dir:
        return CompileDecision(enable, reason, backend)
    root = cache_root(c.cache_dir)
    if probe:  # a cache this host cannot write is refused now (a plan for another host writes nothing here)
        refuse_unwritable_cache(root, c.cache_dir)
    key = cache_key(device_type, c.cache_key_extra, probe=probe)
    keyed = Path(root) / key
    warm = keyed.is_dir() and any(p.is_file() for p in keyed.rglob("*"))
    return CompileDecision(enable, reason, backend, root, key, "warm" if warm else "cold")


DEFAULT_CACHE_DIR = "auto"  # compile.cache_dir's default: <the project's cache folder>/compile


def cache_root(configured: str) -> str:
    """compile.cache_dir as an absolute path: ``auto`` is ``compile/`` in the project's cache folder
    (``devices.cache_path``: QWEN3_RESEARCH_CACHE, else $XDG_CACHE_HOME/qwen3_research; not created here)."""
    if configured == DEFAULT_CACHE_DIR:
        return str((devices.cache_path() / "compile").absolute())
    return str(Path(os.path.expanduser(configured)).absolute())


def refuse_unwritable_cache(root: str, configured: str) -> None:
    """ConfigError (one line, before any worker starts; nothing written to find out) when the compile cache cannot
    take files: a file in its place, a read-only or not writable directory, or less than ``LOW_SPACE`` free. Was:
    a Hydra traceback at the launcher's mkdir, or 236 lines of inductor error at step 1 on a full disk, naming
    neither the directory nor the key that moves it (issue 40)."""
    probe = Path(root)
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    why = None
    if not probe.is_dir():
        why = f"{probe} is a file, not a directory"
    elif not os.access(probe, os.W_OK | os.X_OK):
        try:
            read_only = bool(os.statvfs(probe).f_flag & os.ST_RDONLY)
        except OSError:
            read_only = False
        why = f"{probe} is {'on a read-only file system' if read_only else 'not writable for this user'}"
    else:
        free = shutil.disk_usage(probe).free
        if free < LOW_SPACE:
            why = f"{probe} has {free / 2**20:.1f} MiB free (No space left on device for compiled kernels)"
    if why is None:
        return
    moves = ("compile.cache_dir (default: QWEN3_RESEARCH_CACHE/compile)" if configured == DEFAULT_CACHE_DIR
             else "compile.cache_dir")
    raise ConfigError(f"compile.cache_dir={configured}: the compile cache {root} cannot be written: {why}; point "
                      f"{moves} at a writable directory with space, or use compile.cache_dir=null (torch's own "
                      "cache) or compile.enable=false")


def cache_key(device_type: str, extra: str = "", *, probe: bool = True) -> str:
    """The cache subdirectory's name: torch version, device kind and the device's own facts (its spec's
    ``compile_cache_facts``: the CPU model and ISA flags; the GPU name, driver and CUDA versions; the neuronx-cc
    version) (+ compile.cache_key_extra), so another torch, driver or device never reuses an entry. Readable where
    short, with a hash of the whole."""
    import torch

    parts = [f"torch{torch.__version__}", device_type, *devices.get(device_type).compile_cache_facts(probe)]
    if extra:
        parts.append(str(extra))
    full = "|".join(parts)
    readable = re.sub(r"[^A-Za-z0-9.+_-]+", "-", "-".join(parts))[:80].strip("-")
    return f"{readable}-{hashlib.sha256(full.encode()).hexdigest()[:10]}"


NEFF_COMPILERS = ("neuron",)  # torch.compile backends whose graphs become NEFFs (neuronx-cc)


def export_cache_env(decision: CompileDecision, env=None) -> dict:
    """Point every compile cache at the keyed directory, in this process's environment (which every worker
    inherits): before any worker starts, and again in each worker (idempotent). Returns what was set."""
    env = os.environ if env is None else env
    if not decision.enable or decision.cache_dir is None:
        return {}
    d = Path(decision.cache_dir)
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # checked at start-up (refuse_unwritable_cache); changed since: the same one line
        refuse_unwritable_cache(decision.cache_root, str(decision.cache_root))
        raise ConfigError(f"compile.cache_dir={decision.cache_root}: cannot create {d} ({e.strerror}); point "
                          "compile.cache_dir elsewhere, or use compile.enable=false") from None
    values = {"TORCHINDUCTOR_CACHE_DIR": str(d / "inductor"), "TRITON_CACHE_DIR": str(d / "triton"), **ENABLE_ENV_VARS}
    if decision.backend in NEFF_COMPILERS:  # TorchNeuron's NEFFs (and the older torch-xla stack's cache, which it ignores)
        values.update({NEFF_CACHE_ENV: str(d / "neff"), LEGACY_NEFF_CACHE_ENV: str(d / "neff-legacy")})
    env.update(values)
    return values


def find_blocks(model):
    """The transformer blocks: the children of the first ModuleDict/ModuleList named ``layers`` (torchtitan's
    ``model.layers``, transformers' ``model.model.layers``); None when the model has none."""
    import torch.nn as nn

    for name, module in model.named_modules():
        if name.split(".")[-1] == "layers" and isinstance(module, (nn.ModuleDict, nn.ModuleList)):
            return list(module.children())
    return None


def apply(model, decision: CompileDecision, *, fullgraph: bool, is_moe: bool) -> str:
    """Compile each transformer block in place (``nn.Module.compile``); a model without blocks is compiled whole,
    in place too. Returns what was compiled, for the run's summary."""
    import torch

    torch._inductor.config.fx_graph_cache = True  # as the environment says, for a process that imported torch first
    torch._functorch.config.enable_autograd_cache = True
    if is_moe:  # token-choice dispatch has data-dependent shapes (torchtitan's apply_compile sets the same)
        torch._dynamo.config.capture_scalar_outputs = True
    blocks = find_blocks(model)
    if not blocks:
        model.compile(backend=decision.backend, fullgraph=fullgraph)
        return "whole model (no transformer blocks found)"
    # every block is a different module object: the dynamo cache must hold one entry per block
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 8 + len(blocks))
    for block in blocks:
        block.compile(backend=decision.backend, fullgraph=fullgraph)
    return f"{len(blocks)} transformer blocks"


def compiled_cross_entropy(decision: CompileDecision):
    """The full loss (logits upcast to float32 and cross-entropy), compiled: inductor fuses the upcast into the
    loss instead of materialising float32 logits."""
    import torch

    return torch.compile(_cross_entropy, backend=decision.backend)


def _cross_entropy(logits, labels):
    import torch.nn.functional as F

    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


def compile_seconds() -> float:
    """Seconds this process has spent compiling so far (dynamo's forward and backward compile wall time)."""
    try:
        from torch._dynamo.utils import calculate_time_spent

        return float(calculate_time_spent().get("total_wall_time", 0.0))
    except Exception:  # noqa: BLE001 - a private API: no figure rather than a failed run
        return 0.0
