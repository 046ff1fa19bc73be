"""Typed schemas for every config group, their ConfigStore registration, and value checks.

Hydra merges each YAML option in ``conf/<group>/`` onto the dataclass below it, so an
unknown key or a wrong type fails at compose time with the key's path. Value checks
(``validate``) run right after composition, before any process or model is started.
"""

from __future__ import annotations

import dataclasses
import glob
import math
import os
import stat
from dataclasses import dataclass, field
from typing import Any, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf


from qwen3_research.errors import ConfigError  # noqa: F401  (re-exported: config checks raise it)


def read_by(*reader: str, unset: tuple = ()) -> dict:
    """Field metadata: the key is read only by the option ``reader`` names, so a value other than its default (or
    one of ``unset``) under another option is refused at start-up, naming the reader (``resolve.refuse_unread_keys``;
    issue 40: data.files without data=files trained on the embedded corpus). ``reader``: ``("data.source", V)``,
    read where that key is V; ``("backend", ATTR)``, read by the model backends whose ``BackendSpec.ATTR`` is true;
    ``("balance", MODE, ...)``, read by a model that can balance with one of the MODEs (``registry.balance_modes``)."""
    return {"read_by": reader, "unset": unset}


def keys_read_by(cfg, prefix: str = "") -> list[tuple[str, Any, tuple]]:
    """(dotted key, value, reader) of every field with ``read_by`` metadata whose value is set (not its default nor
    an ``unset`` value), in the schema's order; a section with the metadata counts as one key."""
    out = []
    for f in dataclasses.fields(cfg):
        value, key = getattr(cfg, f.name), f"{prefix}{f.name}"
        reader = f.metadata.get("read_by")
        if reader is None:
            if dataclasses.is_dataclass(value):
                out += keys_read_by(value, key + ".")
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        if dataclasses.is_dataclass(value):  # a section: each of its keys that is set (data.hf.name=...)
            out += [(f"{key}.{g.name}", getattr(value, g.name), reader) for g in dataclasses.fields(value)
                    if getattr(value, g.name) != getattr(default, g.name)]
        elif value != default and value not in f.metadata["unset"]:
            out.append((key, value, reader))
    return out


@dataclass
class MoEConfig:
    """Mixture-of-experts routing (qwen3_research.routing): load balancing and routing statistics."""

    # auto: model.init_from / model.path a Qwen3-MoE checkpoint -> aux_loss with its router_aux_loss_coef; else bias
    # (native_moe, torchtitan's default; aux_loss with checkpoint.export_hf=true, as HF has no expert bias:
    # resolve._balance_for_export) or none (a backend without an expert bias). none | aux_loss | bias.
    balance: str = "auto"
    # balance=aux_loss: None = the checkpoint's router_aux_loss_coef, else 0.001
    aux_loss_coef: Optional[float] = field(default=None, metadata=read_by("balance", "aux_loss"))
    # balance=bias: torchtitan's load_balance_coeff (expert-bias step per optimizer step)
    bias_coef: float = field(default=1e-3, metadata=read_by("balance", "bias"))
    # tokens per expert, load ratio, entropy, ... in every logged step
    routing_stats: bool = field(default=True, metadata=read_by("balance", "aux_loss", "bias"))


@dataclass
class ModelConfig:
    backend: str = "native"  # native | native_moe | hf | another backend's name (qwen3_research.models.registry)
    # The module defining an out-of-tree backend's BACKEND spec; None: qwen3_research.models.<backend>.
    module: Optional[str] = None
    # a named architecture of the backend (qwen3_research.models.flavors); from_path: model=hf's, model.path's own
    flavor: str = field(default="tiny", metadata=read_by("backend", "flavors", unset=("from_path",)))
    path: Optional[str] = field(default=None, metadata=read_by("backend", "takes_path"))  # hf: local dir or Hub id
    # native backends: HF directory with safetensors
    init_from: Optional[str] = field(default=None, metadata=read_by("backend", "takes_init_from"))
    trust_remote_code: bool = field(default=False, metadata=read_by("backend", "takes_path"))
    attention: str = "sdpa"  # sdpa (CPU-safe, causal) | flex (CUDA)
    moe: MoEConfig = field(default_factory=MoEConfig)


# CPU ranks per core a run may start without parallelism.oversubscribe=true. Each rank is a whole process (its own
# torch, ~0.4 GiB before any tensor; a gloo group of N ranks opens N-1 connections per rank): 20000 ranks on 2 cores
# was accepted and never started. The tests run 4 ranks on 2 cores (gloo ranks mostly wait on each other), so the
# limit is well above the cores, not at them.
CPU_RANKS_PER_CORE = 8


@dataclass
class ParallelismConfig:
    nproc_per_node: int = -1  # -1 (auto): every device of the host (logical NeuronCores at the LNC, GPUs; 1 on cpu)
    nnodes: int = 1
    dp_replicate: int = 1
    dp_shard: int = -1  # -1: whatever the other degrees leave of the world size
    tp: int = 1
    sequence_parallel: bool = False
    ep: int = 1
    activation_checkpoint: str = "none"  # none | selective | full
    rdzv_endpoint: str = "127.0.0.1:0"  # 0 = pick a free port (single node)
    rdzv_timeout_s: int = 300  # multi-node: a node that has not met the others by then fails (one line)
    oversubscribe: bool = False  # cpu: allow more than CPU_RANKS_PER_CORE ranks per core of this host


@dataclass
class KernelEntry:
    name: str = MISSING  # a kernel in qwen3_research.kernels.KERNELS
    target: str = MISSING  # fnmatch pattern over module FQNs, or "type:ClassName"
    options: Any = field(default_factory=dict)


@dataclass
class KernelsConfig:
    option: Optional[str] = None  # the conf/kernels option's name, for messages (kernels=<option>)
    entries: List[KernelEntry] = field(default_factory=list)
    verify: bool = False  # compare every active kernel with its float32 reference at start-up, in the run's dtype
    # apply a speed kernel (moe_fast, rope_fast, triton_*) even where it was not measured faster on this device kind
    # and dtype (KernelSpec.measured): for experiments; by default such a kernel keeps the module it would replace
    force: bool = False


@dataclass
class OptimizerConfig:
    name: str = "adamw"
    lr: float = 3e-3
    betas: List[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    weight_decay: float = 0.1
    warmup_steps: int = 10
    decay: str = "cosine"  # cosine | linear | constant
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0  # max global grad norm; <= 0 disables clipping


@dataclass
class HFDatasetConfig:
    name: Optional[str] = None  # Hub id or local path understood by datasets.load_dataset
    config_name: Optional[str] = None
    split: str = "train"
    text_field: str = "text"
    streaming: bool = False
    max_documents: Optional[int] = None


@dataclass
class DataConfig:
    source: str = "embedded"  # embedded | hf | files
    tokenizer: str = "qwen3"  # "qwen3" (the packaged official tokenizer) or a path / HF dir
    seq_len: int = 128
    batch_size: int = 4  # sequences per data-parallel rank per micro-batch
    global_batch_tokens: Optional[int] = None  # if set: batch_size = this / (seq_len × dp × grad_accum)
    val_fraction: float = 0.05
    max_documents: Optional[int] = None  # cap for quick experiments
    files: Optional[str] = field(default=None, metadata=read_by("data.source", "files"))  # glob of .txt / .jsonl files
    # source=files, .jsonl: the field holding the text
    text_field: str = field(default="text", metadata=read_by("data.source", "files"))
    # Attention and RoPE positions restart at every document boundary inside a packed window; the end-of-text
    # token does not predict the next document's first token (its label is ignored).
    document_masking: bool = False
    hf: HFDatasetConfig = field(default_factory=HFDatasetConfig, metadata=read_by("data.source", "hf"))


@dataclass
class DeviceConfig:
    # auto | cpu | cuda | neuron, or a kind from a module QWEN3_RESEARCH_DEVICE_MODULES names (devices/__init__.py)
    type: str = "auto"
    lnc: Optional[int] = None  # neuron: logical NeuronCore config 1|2, exported to every worker; None = NEURON_LOGICAL_NC_CONFIG or 2
    memory_gib: Optional[float] = None  # capacity per rank for planning (qwen3_research.plan); None = detected
    # Planning a GPU this host does not have (device=cuda on a CPU-only host): a name from torchtitan's peak table
    # (H200, H100 SXM, H100 PCIe, H100 NVL, A100, L40S, L4: qwen3_research.compiling.PLANNED_GPUS), or
    # device.memory_gib + device.peak_tflops (dense bf16 TFLOP/s per GPU) for another one
    gpu: Optional[str] = None
    peak_tflops: Optional[float] = None


@dataclass
class CompileConfig:
    # auto: on where it was measured faster (cuda, dense model, bf16, no kernel entries: the H200 figures in
    # README), off elsewhere (cpu: a 20-30 s first step, neuron: not measured); true/false force it. Resolved once
    # at start-up (qwen3_research.compiling.decide), with its reason. Each transformer block and the loss are
    # compiled, not the whole model (as torchtitan's apply_compile).
    enable: Any = "auto"
    backend: Optional[str] = None  # None: inductor on cpu/cuda, "neuron" on neuron
    fullgraph: bool = False
    # One compile cache for every run and sweep point (inductor's FX graph / AOT autograd / autotune caches, Triton's,
    # TorchNeuron's NEFFs), in a subdirectory keyed by torch version, device and driver/compiler version, set in the
    # environment before any worker starts. auto: compile/ in the project's cache folder (QWEN3_RESEARCH_CACHE, else
    # ~/.cache/qwen3_research); a directory that cannot be written is a config error at start-up. None: leave the
    # environment (and torch's defaults) alone.
    cache_dir: Optional[str] = "auto"
    cache_key_extra: str = ""  # appended to the key: a different value never reuses an entry (tests simulate a torch upgrade)


@dataclass
class CheckpointConfig:
    every: int = 0  # save every N steps; 0 = only at the end when enabled
    enable: bool = False
    dir: str = "checkpoints"  # relative to the run dir
    resume: Optional[str] = None  # None | auto | <path to a step dir>
    keep: int = 2
    export_hf: bool = False
    overwrite: bool = False  # start over in a run dir that holds a run: its files are removed first
    allow_data_change: bool = False  # resume under another data layout (seq_len, batch, source, tokenizer)


@dataclass
class WandbConfig:
    mode: str = "offline"  # offline | online | disabled
    project: str = "qwen3_research"
    entity: Optional[str] = None
    group: Optional[str] = None  # None: the sweep dir name in multirun, else none
    name: Optional[str] = None  # None: derived from the overrides
    tags: List[str] = field(default_factory=list)
    init_timeout: float = 30.0  # seconds W&B may take to start online before the run falls back to offline


@dataclass
class LoggingConfig:
    wandb: WandbConfig = field(default_factory=WandbConfig)
    progress_bar: bool = True  # only drawn when stdout is a terminal
    print_config: bool = True


@dataclass
class TrainingConfig:
    steps: int = 60
    seed: int = 0
    log_every: int = 1
    eval_every: int = 20  # 0 disables evaluation
    eval_batches: int = 2
    grad_accum: int = 1
    # none | bf16: sharded layouts as torchtitan and AWS's recipes (FSDP2 gathers bf16 copies of the float32
    # parameters for forward/backward, reduces gradients in float32, float32 AdamW state: parallel.py), one process
    # autocast over float32 parameters | auto: bf16 on neuron (AWS's Trainium recipes), none elsewhere; resolved once
    # at start-up (resolve.auto_settings)
    mixed_precision: str = "auto"
    nan_policy: str = "stop"  # stop | skip
    # full | chunked (lm_head + cross-entropy a chunk of tokens at a time: qwen3_research.loss) | auto: chunked on cpu
    # (measured: faster and smaller, the same losses; benchmarks/RESULTS.md), full on cuda and neuron (not measured
    # there); resolved once at start-up (resolve.auto_settings)
    loss: str = "auto"
    loss_chunk_tokens: int = 1024  # training.loss=chunked: tokens per chunk (logits alive: this × vocab floats)
    track_memory: bool = False  # record the peak live tensor bytes per rank (torch's MemTracker) in summary.json


@dataclass
class ProfilingConfig:
    # [a, b]: a torch profiler trace (Chrome/Perfetto JSON) of training steps a..b (1-based, inclusive) on every rank,
    # <run dir>/profiling/trace_rank<r>.json; on neuron the Neuron runtime's own capture instead (qwen3_research.profiling)
    steps: List[int] = field(default_factory=list)
    # a memory snapshot per rank over the profiled steps (all steps when profiling.steps is empty), and one on an
    # out-of-memory error: cuda torch.cuda.memory._dump_snapshot (.pickle), cpu the profiler's memory timeline (.json)
    memory_snapshot: bool = False
    # neuron only: NEURON_RT_INSPECT_DEVICE_PROFILE (model | session) for device-level traces beside the system profile
    neuron_device_profile: Optional[str] = None


@dataclass
class SweepConfig:
    # multirun: plan every point (qwen3_research.plan) before the first one starts; fit: a point predicted not to fit
    # runs as its cheapest fitting variant instead (qwen3_research.fit; the swept keys stay as swept), recorded in
    # plan.json, the point's summary.json and W&B config (memory_plan.adjusted) and the report's "adjusted" column
    plan: Any = True  # true | false | fit
    skip_infeasible: bool = True  # do not start points predicted not to fit device memory (status "skipped: ...")
    resume: bool = True  # a point whose summary.json in the same sweep dir says ok is not run again


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    kernels: KernelsConfig = field(default_factory=KernelsConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    device: DeviceConfig = field(default_factory=DeviceConfig)
    compile: CompileConfig = field(default_factory=CompileConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    profiling: ProfilingConfig = field(default_factory=ProfilingConfig)
    sweep: SweepConfig = field(default_factory=SweepConfig)


GROUP_SCHEMAS = {
    "model": ModelConfig,
    "parallelism": ParallelismConfig,
    "kernels": KernelsConfig,
    "optimizer": OptimizerConfig,
    "data": DataConfig,
    "device": DeviceConfig,
}


def default_flavor(init_from, default: str = ModelConfig.flavor) -> str:
    """The Hydra default of ``model.flavor`` for the native backend's options: ``from_hf`` (the checkpoint's
    architecture) when ``model.init_from`` is set, else ``default`` (the schema's tiny; native_moe's tiny_moe)."""
    return "from_hf" if init_from else default


def register_configs() -> None:
    """Store the run schema and one schema per group (``<group>_schema``) for YAML options to extend.

    The group schemas are root-level configs, not a config group, so ``--help`` lists only the
    groups a user chooses from (a ``schema`` group would show up there as if it were one).
    """
    # conf/model/native*.yaml: model.flavor defaults to init_from's architecture ("from_hf") or "tiny".
    OmegaConf.register_new_resolver("default_flavor", default_flavor, replace=True)
    cs = ConfigStore.instance()
    cs.store(name="run_schema", node=RunConfig)
    for group, schema in GROUP_SCHEMAS.items():
        cs.store(name=f"{group}_schema", node=schema, package=group)


def to_run_config(cfg: dict | DictConfig) -> RunConfig:
    """Merge a composed (or resolved) config onto the schema; a key or type error becomes one line."""
    from omegaconf.errors import OmegaConfBaseException

    try:  # resolving can fail too: an interpolation loop (training.steps=${training.steps}), a missing key
        if isinstance(cfg, DictConfig):
            cfg = OmegaConf.to_container(cfg, resolve=True)
        cfg = {k: v for k, v in cfg.items() if k != "hydra"}
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(RunConfig), cfg))
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or "?"
        msg = str(getattr(e, "msg", None) or e).splitlines()[0]
        if msg.startswith("Recursive interpolation"):
            msg += f" (a ${{...}} loop back to {key}); give {key} a value"
        raise ConfigError(f"{key}: {msg}") from None


def resolve_batch_size(cfg: RunConfig, dp: int) -> int:
    """Per-rank batch size; with data.global_batch_tokens every layout sees the same tokens per step."""
    d = cfg.data
    if d.global_batch_tokens is None:
        return d.batch_size
    per = d.seq_len * dp * cfg.training.grad_accum
    if d.global_batch_tokens % per or d.global_batch_tokens < per:
        raise ConfigError(
            f"data.global_batch_tokens={d.global_batch_tokens} must be a multiple of data.seq_len×dp×grad_accum="
            f"{d.seq_len}×{dp}×{cfg.training.grad_accum}={per}"
        )
    return d.global_batch_tokens // per


def _choice(path: str, value: Any, allowed) -> None:
    if value not in allowed:
        raise ConfigError(f"{path}={value!r} is not one of {sorted(allowed)}")


def _non_finite(node: Any, path: str) -> str | None:
    """``key=value`` of the first NaN or ±inf float anywhere under ``node`` (dataclass fields, lists, dicts)."""
    if isinstance(node, float):
        return None if math.isfinite(node) else f"{path}={node}"
    if dataclasses.is_dataclass(node):
        items = [(f.name, getattr(node, f.name)) for f in dataclasses.fields(node)]
    elif isinstance(node, dict):
        items = list(node.items())
    elif isinstance(node, (list, tuple)):
        items = [(f"[{i}]", v) for i, v in enumerate(node)]
    else:
        return None
    for key, value in items:
        sub = f"{path}{key}" if str(key).startswith("[") else f"{path}.{key}" if path else str(key)
        found = _non_finite(value, sub)
        if found:
            return found
    return None


# 2**63 - 1: what torch (manual_seed), numpy (SeedSequence) and JSON/W&B (int64) all take.
SEED_MAX = 2**63 - 1
WANDB_PROJECT_FORBIDDEN = "/\\#?%:"  # W&B refuses these in a project name (wandb.sdk.wandb_settings.validate_project)


def data_files(pattern: str) -> list[str]:
    """The files ``data.files`` matches, sorted. None, or one that is not a regular file, is a ConfigError:
    reading a FIFO blocks until something writes to it (the run hung with no output), and a directory,
    socket or device holds no documents."""
    files = sorted(glob.glob(os.path.expanduser(pattern), recursive=True))
    if not files:
        raise ConfigError(f"data.files={pattern!r} matches no file; check the path (relative to {os.getcwd()})")
    for f in files:
        try:
            mode = os.stat(f).st_mode
        except OSError as e:  # a dangling symlink
            raise ConfigError(f"data.files={pattern!r} matches {f}, which cannot be read ({e.strerror})") from None
        if not stat.S_ISREG(mode):
            kind = ("a FIFO (named pipe)" if stat.S_ISFIFO(mode) else "a directory" if stat.S_ISDIR(mode) else
                    "a socket" if stat.S_ISSOCK(mode) else "a device")
            raise ConfigError(f"data.files={pattern!r} matches {f}, which is {kind}, not a regular file; narrow the "
                              "glob to the .txt/.jsonl files (e.g. 'corpus/*.txt')")
    return files


def _positive(path: str, value, *, allow_zero: bool = False) -> None:
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(f"{path} must be {'>= 0' if allow_zero else '> 0'}, got {value}")


def validate(cfg: RunConfig | DictConfig) -> RunConfig:
    """Check values the schema cannot express; return the config as a RunConfig object.

    Cheap checks only: nothing here imports torch or builds a model. The model backend's rules are
    ``models.check`` (its spec's); parallel degrees are checked in ``parallel.validate_degrees`` (needs
    the model's head counts, ``models.describe``).
    """
    if isinstance(cfg, DictConfig):
        cfg = OmegaConf.to_object(cfg)
    if cfg.compile.enable not in ("auto", True, False):
        raise ConfigError(f"compile.enable must be auto, true or false, got {cfg.compile.enable!r}")

    # One rule for every number: NaN and inf pass the comparisons below (nan <= 0 is False) and then fail
    # deep in a run, or not at all (weight_decay=nan trained into NaN weights). No key takes inf.
    bad = _non_finite(cfg, "")
    if bad:
        raise ConfigError(f"{bad} is not a finite number; every numeric key needs one (no nan or inf)")
    # The model backend's own rules (its name, flavor, model.path / model.init_from) are its spec's:
    # qwen3_research.models.check, which every entry point runs right after this.
    _choice("model.attention", cfg.model.attention, {"sdpa", "flex"})
    moe = cfg.model.moe
    _choice("model.moe.balance", moe.balance, {"auto", "none", "aux_loss", "bias"})
    if moe.aux_loss_coef is not None:
        _positive("model.moe.aux_loss_coef", moe.aux_loss_coef, allow_zero=True)
    _positive("model.moe.bias_coef", moe.bias_coef)
    # The expert-bias step is added to router scores in [0, 1] every optimizer step: above 1 one step outweighs
    # any score, and 1e308 overflowed to inf biases that routed silently (torchtitan's default is 1e-3).
    if moe.bias_coef > 1.0:
        raise ConfigError(f"model.moe.bias_coef={moe.bias_coef:g} must be in (0, 1]: it is the expert-bias step per "
                          "optimizer step, added to router scores in [0, 1] (default 1e-3)")

    p = cfg.parallelism
    if p.nproc_per_node == 0 or p.nproc_per_node < -1:
        raise ConfigError(f"parallelism.nproc_per_node must be -1 (auto: every device of the host) or >= 1, got {p.nproc_per_node}")
    for key in ("nnodes", "dp_replicate", "tp", "ep"):
        if getattr(p, key) < 1:
            raise ConfigError(f"parallelism.{key} must be >= 1, got {getattr(p, key)}")
    if p.dp_shard == 0 or p.dp_shard < -1:
        raise ConfigError(f"parallelism.dp_shard must be -1 (the rest) or >= 1, got {p.dp_shard}")
    if p.rdzv_timeout_s < 1:
        raise ConfigError(f"parallelism.rdzv_timeout_s must be >= 1 (seconds the nodes have to meet), got {p.rdzv_timeout_s}")
    _choice("parallelism.activation_checkpoint", p.activation_checkpoint, {"none", "selective", "full"})

    o = cfg.optimizer
    _choice("optimizer.name", o.name, {"adamw"})
    _positive("optimizer.lr", o.lr)
    # AdamW moves every weight by about lr per step: above 1 a run diverges at once, and 1e308 overflowed
    # float32 inside the optimizer (a 40-line traceback).
    if o.lr > 1.0:
        raise ConfigError(f"optimizer.lr={o.lr:g} must be in (0, 1]: AdamW moves every weight by about lr per step "
                          "(typical values 1e-4 … 3e-3)")
    if len(o.betas) != 2 or not all(0.0 <= b < 1.0 for b in o.betas):
        raise ConfigError(f"optimizer.betas must be two numbers in [0, 1), got {list(o.betas)}")
    _positive("optimizer.eps", o.eps)
    _positive("optimizer.weight_decay", o.weight_decay, allow_zero=True)
    _positive("optimizer.warmup_steps", o.warmup_steps, allow_zero=True)
    _choice("optimizer.decay", o.decay, {"cosine", "linear", "constant"})
    if not 0.0 <= o.min_lr_ratio <= 1.0:
        raise ConfigError(f"optimizer.min_lr_ratio must be in [0, 1], got {o.min_lr_ratio}")

    d = cfg.data
    _choice("data.source", d.source, {"embedded", "hf", "files"})
    if d.seq_len < 1:
        raise ConfigError(f"data.seq_len must be >= 1, got {d.seq_len}")
    if d.batch_size < 1:
        raise ConfigError(f"data.batch_size must be >= 1, got {d.batch_size}")
    if d.global_batch_tokens is not None and d.global_batch_tokens < 1:
        raise ConfigError(f"data.global_batch_tokens must be >= 1 (tokens per optimizer step, a multiple of "
                          f"data.seq_len × dp × grad_accum) or null (data.batch_size per rank), got {d.global_batch_tokens}")
    if not 0.0 <= d.val_fraction < 1.0:
        raise ConfigError(f"data.val_fraction must be in [0, 1), got {d.val_fraction}")
    for key, value in (("data.max_documents", d.max_documents), ("data.hf.max_documents", d.hf.max_documents)):
        if value is not None and value < 1:
            raise ConfigError(f"{key} must be >= 1 (or null: every document), got {value}")
    if d.source == "files":
        if not d.files:
            raise ConfigError("data.files is required with data=files: a glob such as 'corpus/*.txt'")
        data_files(d.files)
    if d.source == "hf" and not d.hf.name:
        raise ConfigError("data.hf.name is required with data=hf: a datasets Hub id or local path")

    # device.type: its registered kinds are checked in resolve.check_device_settings (the devices package)
    ck = cfg.checkpoint
    _positive("checkpoint.every", ck.every, allow_zero=True)
    _positive("checkpoint.keep", ck.keep)
    _choice("logging.wandb.mode", cfg.logging.wandb.mode, {"offline", "online", "disabled"})
    if cfg.logging.wandb.init_timeout <= 0:
        raise ConfigError(f"logging.wandb.init_timeout must be > 0 (seconds W&B may take to start online), got "
                          f"{cfg.logging.wandb.init_timeout:g}")
    project = cfg.logging.wandb.project
    forbidden = sorted({c for c in project if c in WANDB_PROJECT_FORBIDDEN})
    if not project or len(project) > 128 or forbidden:
        raise ConfigError(f"logging.wandb.project={project!r}: a W&B project name has 1-128 characters and none of "
                          f"{' '.join(WANDB_PROJECT_FORBIDDEN)}" + (f" (found {' '.join(forbidden)})" if forbidden else "")
                          + "; e.g. logging.wandb.project=qwen3_research")

    t = cfg.training
    _positive("training.steps", t.steps)
    if not 0 <= t.seed <= SEED_MAX:
        raise ConfigError(f"training.seed must be in [0, {SEED_MAX}] (0 … 2**63 - 1), got {t.seed}")
    _positive("training.log_every", t.log_every)
    _positive("training.eval_every", t.eval_every, allow_zero=True)
    _positive("training.eval_batches", t.eval_batches)
    _positive("training.grad_accum", t.grad_accum)
    _choice("training.mixed_precision", t.mixed_precision, {"auto", "none", "bf16"})
    _choice("training.nan_policy", t.nan_policy, {"stop", "skip"})
    _choice("training.loss", t.loss, {"auto", "full", "chunked"})
    if cfg.sweep.plan not in (True, False, "fit"):
        raise ConfigError(f"sweep.plan={cfg.sweep.plan!r} is not one of true, false, fit")
    _positive("training.loss_chunk_tokens", t.loss_chunk_tokens)
    _validate_profiling(cfg.profiling, t.steps)
    if cfg.device.memory_gib is not None and cfg.device.memory_gib <= 0:
        raise ConfigError(
            f"device.memory_gib must be > 0 (GiB per rank, e.g. 24 for a trn2 rank at LNC=2), got "
            f"{cfg.device.memory_gib}; or leave it unset to use the detected capacity"
        )
    return cfg


def _validate_profiling(p: ProfilingConfig, total_steps: int) -> None:
    """profiling.steps: the step window inside the run (what each device's own capture allows: ``resolve``)."""
    if p.steps:
        if len(p.steps) != 2 or not 1 <= p.steps[0] <= p.steps[1] <= total_steps:
            raise ConfigError(f"profiling.steps={list(p.steps)} must be [a,b] with 1 <= a <= b <= training.steps={total_steps} "
                              "(the first and last training step to profile, inclusive), e.g. profiling.steps=[2,3]")
    if p.neuron_device_profile is not None:
        _choice("profiling.neuron_device_profile", p.neuron_device_profile, {"model", "session"})
