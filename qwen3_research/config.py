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

    balance: str = "auto"
    """How the router's load is balanced: none | aux_loss | bias | auto. auto: model.init_from / model.path a
    Qwen3-MoE checkpoint -> aux_loss with its router_aux_loss_coef; else bias (native, torchtitan's default;
    aux_loss with checkpoint.export_hf=true, as HF has no expert bias) or none (a backend without an expert bias).
    Resolved in resolve._balance_for_export and the backend spec; applied by routing.py and the model backends."""
    aux_loss_coef: Optional[float] = field(default=None, metadata=read_by("balance", "aux_loss"))
    """balance=aux_loss: the auxiliary load-balancing loss weight; None = the checkpoint's router_aux_loss_coef,
    else 0.001. Read by routing.py and models/hf/model.py."""
    bias_coef: float = field(default=1e-3, metadata=read_by("balance", "bias"))
    """balance=bias: the expert-bias step per optimizer step (torchtitan's load_balance_coeff), in (0, 1]. Read by
    routing.py and models/native/model.py."""
    routing_stats: bool = field(default=True, metadata=read_by("balance", "aux_loss", "bias"))
    """Log tokens per expert, load ratio, routing entropy, ... in every logged step (routing.py)."""


# The attention and MLP projections, in Hugging Face's module names: AWS's Trainium LoRA tutorial's targets.
LORA_DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class LoraConfig:
    """LoRA adapters through PEFT on a frozen base (qwen3_research/lora.py): only the adapters train and are
    checkpointed; the checkpoint names the base it needs."""

    enable: bool = False
    """Train LoRA adapters (PEFT's LoRA Linear) on the target projections; every base weight is frozen (no
    gradient, no optimizer state, not in the checkpoint). Runs in one process, FSDP2, EP (a MoE's experts stay
    frozen), TP on model=hf, bf16, activation checkpointing, compile, training.grad_accum, evaluation and
    checkpoint/resume; TP on model=native is refused at start-up (lora.check_run). Read by lora.py, step.py and
    run/checkpoint.py."""
    rank: int = 16
    """The adapters' rank r (> 0): lora_A is r x in, lora_B out x r (lora.py)."""
    alpha: float = 32.0
    """The scale numerator: the adapter's output is multiplied by alpha / rank, as PEFT's lora_alpha (lora.py)."""
    dropout: float = 0.0
    """Dropout on the adapter's input, in [0, 1) (PEFT's lora_dropout); 0 keeps the run deterministic; must be 0
    with parallelism.tp > 1 (each rank would draw its own mask: refused, lora.check_run)."""
    target_modules: List[str] = field(default_factory=lambda: list(LORA_DEFAULT_TARGETS))
    """The projections that get an adapter, in Hugging Face's names (q_proj, k_proj, v_proj, o_proj, gate_proj,
    up_proj, down_proj) on both backends; model=native maps them to torchtitan's modules (lora.py). MoE experts
    are never targeted: on a MoE layer the MLP names match nothing, and a MoE run naming no attention projection
    is refused at start-up (lora.check_run)."""


@dataclass
class ModelConfig:
    """The model: which backend builds it (qwen3_research.models.registry) and which architecture."""

    backend: str = "native"
    """native | native_moe | hf | another backend's name: the BackendSpec that describes and builds the model
    (models/registry.py finds qwen3_research.models.<backend> or model.module)."""
    module: Optional[str] = None
    """The module defining an out-of-tree backend's BACKEND spec; None: qwen3_research.models.<backend>
    (models/registry.py)."""
    flavor: str = field(default="tiny", metadata=read_by("backend", "flavors", unset=("from_path",)))
    """A named architecture of the backend (models/flavors.py; native: tiny, debug, 0.6B ... 32B, tiny_moe,
    debug_moe, nki_debug, 30B-A3B, 235B-A22B; from_hf: model.init_from's config.json)."""
    path: Optional[str] = field(default=None, metadata=read_by("backend", "takes_path"))
    """hf backend: a local directory or Hub id that transformers loads (models/hf/model.py)."""
    init_from: Optional[str] = field(default=None, metadata=read_by("backend", "takes_init_from"))
    """native backends: an HF directory with safetensors whose config.json is the architecture and whose weights
    are loaded sharded at start-up (models/native/init_from.py, models/native/hf_load.py)."""
    trust_remote_code: bool = field(default=False, metadata=read_by("backend", "takes_path"))
    """hf backend: passed to transformers' from_pretrained to allow a checkpoint's own code (models/hf/model.py)."""
    require_moe: bool = False
    """Set by the ``model=native_moe`` preset: the model must be a mixture of experts (its flavor, or
    model.init_from's config.json); a dense one is refused before any worker starts (resolve.py), where it used to
    train a dense model under a MoE preset silently. Dense models: ``model=native``."""
    attention: str = "sdpa"
    """Attention kernel: sdpa (CPU-safe, causal) | flex (FlexAttention, CUDA). Read by the model backends and the
    torchtitan adapter (titan/)."""
    moe: MoEConfig = field(default_factory=MoEConfig)
    """Mixture-of-experts routing settings (model.moe.*), used by MoE flavors only."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA adapters on a frozen base (model.lora.*; qwen3_research/lora.py)."""


# CPU ranks per core a run may start without parallelism.oversubscribe=true. Each rank is a whole process (its own
# torch, ~0.4 GiB before any tensor; a gloo group of N ranks opens N-1 connections per rank): 20000 ranks on 2 cores
# was accepted and never started. The tests run 4 ranks on 2 cores (gloo ranks mostly wait on each other), so the
# limit is well above the cores, not at them.
CPU_RANKS_PER_CORE = 8


@dataclass
class ParallelismConfig:
    """Processes and the device mesh: degrees checked in parallel.validate_degrees, applied by titan/."""

    nproc_per_node: int = -1
    """Worker processes per host; -1 (auto): every device of the host (logical NeuronCores at the LNC, GPUs; 1 on
    cpu). Resolved in resolve.py; launch/elastic.py starts them."""
    nnodes: int = 1
    """Hosts in the job (multi-node: launch/elastic.py's rendezvous, launch/slurm.py)."""
    dp_replicate: int = 1
    """Data-parallel replicas (HSDP's replicate dimension; parallel.py, titan/)."""
    dp_shard: int = -1
    """FSDP2 shard degree; -1: whatever the other degrees leave of the world size (parallel.py, titan/)."""
    tp: int = 1
    """Tensor-parallel degree (parallel.py, titan/)."""
    sequence_parallel: bool = False
    """With tp > 1: shard norms and activations along the sequence too (parallel.py, titan/; torchtitan 0.2.x
    always does)."""
    ep: int = 1
    """Expert-parallel degree for MoE flavors (parallel.py, titan/)."""
    pp: int = 1
    """Pipeline-parallel degree: the model's layers split into pp stages on as many ranks, run by torchtitan's own
    pipelining (``pipeline_llm``, titan/v03.py) and torch's schedules. The world is dp_replicate×dp_shard×tp×pp.
    torchtitan 0.3.x and model=native only, and not with tied embeddings (each stage would hold its own copy of
    the tied weight and train it apart: a flavor like tiny is refused, tiny_untied is its untied twin) (parallel.py)."""
    pp_schedule: str = "1F1B"
    """With pp > 1: the pipeline schedule, a name torch.distributed.pipelining's get_schedule_class accepts:
    1F1B, GPipe (one stage per rank), Interleaved1F1B, LoopedBFS, InterleavedZeroBubble (several stages per rank),
    ZBVZeroBubble, DualPipeV (two stages per rank in a V) (parallel.PP_SCHEDULES)."""
    pp_microbatches: int = 0
    """With pp > 1: micro-batches per pipeline step (each of data.batch_size / pp_microbatches sequences; it must
    divide data.batch_size); 0 (auto): pp, or the 2×pp stages DualPipeV needs. training.grad_accum repeats the
    whole pipeline step (parallel.py)."""
    pp_layers_per_stage: int = 0
    """With pp > 1: transformer layers per pipeline stage (the embedding and the norm+lm_head count one each, as
    torchtitan weighs them); 0 (auto): torchtitan's even split over pp stages per rank-stage. The stages must come
    out a multiple of pp, one per rank for 1F1B/GPipe, two or more for the others (parallel.py)."""
    activation_checkpoint: str = "none"
    """none | selective | full: recompute activations in backward (titan/ applies torchtitan's AC; the planner
    models it)."""
    rdzv_endpoint: str = "127.0.0.1:0"
    """host:port of the workers' c10d rendezvous; port 0 = pick a free port (single node). launch/elastic.py."""
    rdzv_timeout_s: int = 300
    """Multi-node: seconds a node has to meet the others before it fails with one line (launch/elastic.py)."""
    oversubscribe: bool = False
    """cpu: allow more than CPU_RANKS_PER_CORE (8) ranks per core of this host (resolve.py)."""


# Keys that act only with pipeline stages: a run with parallelism.pp=1 ignores them, so a sweep's points that differ
# only in them are one run (launch/sweep.py runs it once).
PIPELINE_ONLY_KEYS = ("parallelism.pp_schedule", "parallelism.pp_microbatches", "parallelism.pp_layers_per_stage")


def inert_keys(config: dict) -> dict[str, str]:
    """The keys of a composed config (``compose_resolved``) that change nothing in its run, each with why; always a
    subset of ``PIPELINE_ONLY_KEYS``. Whether a key is inert never depends on one of those keys (the sweep's repeat
    check composes one point of a group and applies the answer to the others)."""
    pp = (config.get("parallelism") or {}).get("pp", 1)
    return {key: "has no effect at parallelism.pp=1" for key in PIPELINE_ONLY_KEYS} if pp == 1 else {}


@dataclass
class KernelEntry:
    """One kernel override (qwen3_research.kernels.registry)."""

    name: str = MISSING
    """A kernel in qwen3_research.kernels.KERNELS."""
    target: str = MISSING
    """Which modules it replaces: an fnmatch pattern over module FQNs, or "type:ClassName" (kernels/registry.py)."""
    options: Any = field(default_factory=dict)
    """The kernel's own options, passed to it as keyword arguments (kernels/registry.py)."""


@dataclass
class KernelsConfig:
    """Kernel overrides applied to the built model (qwen3_research.kernels; docs/KERNELS.md)."""

    option: Optional[str] = None
    """The conf/kernels option's name, for messages (kernels=<option>); set by the option's YAML."""
    entries: List[KernelEntry] = field(default_factory=list)
    """The overrides: name, module pattern and options of each (kernels/registry.py plans and applies them)."""
    verify: bool = False
    """Compare every active kernel with its float32 reference at start-up, in the run's dtype (kernels/verify.py)."""
    force: bool = False
    """Apply a speed kernel (moe_fast, rope_fast, triton_*) even where it was not measured faster on this device
    kind and dtype (KernelSpec.measured): for experiments; by default such a kernel keeps the module it would
    replace (kernels/registry.py)."""


@dataclass
class OptimizerConfig:
    """The optimizer and learning-rate schedule (qwen3_research.optim, built in step.py)."""

    name: str = "adamw"
    """Optimizer; only adamw (optim.py)."""
    lr: float = 3e-3
    """Peak learning rate, in (0, 1] (optim.py)."""
    betas: List[float] = field(default_factory=lambda: [0.9, 0.95])
    """AdamW's two moment decay rates, each in [0, 1) (optim.py)."""
    eps: float = 1e-8
    """AdamW's epsilon (optim.py)."""
    weight_decay: float = 0.1
    """Decoupled weight decay, applied to matrices only (optim.py)."""
    warmup_steps: int = 10
    """Linear warm-up steps from 0 to optimizer.lr (optim.py's scheduler)."""
    decay: str = "cosine"
    """cosine | linear | constant: the schedule after warm-up (optim.py)."""
    min_lr_ratio: float = 0.1
    """The final learning rate as a fraction of optimizer.lr, in [0, 1] (optim.py)."""
    grad_clip: float = 1.0
    """Max global gradient norm; <= 0 disables clipping (step.py)."""


@dataclass
class HFDatasetConfig:
    """data=hf: a datasets dataset (qwen3_research.data, token_stream.py)."""

    name: Optional[str] = None
    """Hub id or local path understood by datasets.load_dataset; required with data=hf."""
    config_name: Optional[str] = None
    """The dataset's configuration name (datasets.load_dataset's second argument)."""
    split: str = "train"
    """The split to read."""
    text_field: str = "text"
    """The record field holding the text."""
    streaming: bool = False
    """Stream the dataset instead of downloading it whole (data.py)."""
    max_documents: Optional[int] = None
    """Read at most this many documents; None: every one."""


@dataclass
class DataConfig:
    """The corpus, tokenizer and batches (qwen3_research.data, token_stream.py)."""

    source: str = "embedded"
    """embedded (Shakespeare, shipped as a package) | hf | files (data.py) | chat (conversations rendered with the
    tokenizer's chat template: chat.py, chat_windows.py; docs/CHAT_DATA.md)."""
    tokenizer: str = "qwen3"
    """"qwen3" (the packaged official tokenizer, sha256 checked) or a path / HF directory with tokenizer.json
    (data.py)."""
    seq_len: int = 128
    """Tokens per sample; documents are packed into seq_len + 1 windows (data.py)."""
    batch_size: int = 4
    """Sequences per data-parallel rank per micro-batch (data.py; derived instead with data.global_batch_tokens)."""
    global_batch_tokens: Optional[int] = None
    """If set: tokens per optimizer step whatever the layout; batch_size = this / (seq_len x dp x grad_accum)
    (config.resolve_batch_size, read in trainer.py and fit.py)."""
    val_fraction: float = 0.05
    """Fraction of documents held out for evaluation, chosen by a hash of their name (data.py)."""
    max_documents: Optional[int] = None
    """Read at most this many documents, for quick experiments; None: every one (data.py)."""
    files: Optional[str] = field(default=None, metadata=read_by("data.source", "files", "chat"))
    """source=files: a glob of regular .txt / .jsonl files (config.data_files, data.py); source=chat: a glob of .jsonl
    files of conversations (chat.py)."""
    text_field: str = field(default="text", metadata=read_by("data.source", "files"))
    """source=files, .jsonl: the field holding the text, a string in every record (data.py)."""
    document_masking: bool = False
    """Attention and RoPE positions restart at every document boundary inside a packed window; the end-of-text
    token does not predict the next document's first token (its label is ignored). data.py builds the document
    ids; the model backends and titan/ mask attention."""
    hf: HFDatasetConfig = field(default_factory=HFDatasetConfig, metadata=read_by("data.source", "hf", "chat"))
    """data=hf: the dataset to read (data.hf.*); data=chat: a dataset of conversations (text_field unused)."""
    loss_on: str = field(default="assistant", metadata=read_by("data.source", "chat"))
    """data=chat: assistant | completion | all. assistant: each assistant turn as the template renders it and its
    end-of-turn token (Qwen3: <|im_end|>; not the newline after it); completion: every token after the prompt of
    prompt/completion records (TRL's completion_only_loss); all: every token (chat.py)."""
    packing: bool = field(default=True, metadata=read_by("data.source", "chat"))
    """data=chat: pack conversations into data.seq_len windows, one conversation per document (needs
    data.document_masking=true); false: one conversation per window, padded (chat_windows.py)."""
    overlong: str = field(default="truncate_turns", metadata=read_by("data.source", "chat"))
    """data=chat: a conversation longer than data.seq_len + 1 tokens: truncate_turns (cut its oldest turns, keeping
    the system prompt) | drop; both counted in summary.json's data section (chat.py)."""


@dataclass
class DeviceConfig:
    """The device kind and its planning facts (qwen3_research.devices; resolve.check_device_settings)."""

    type: str = "auto"
    """auto | cpu | cuda | neuron, or a kind from a module that QWEN3_RESEARCH_DEVICE_MODULES names: the devices/
    spec a run uses; auto picks the best present (devices/__init__.py)."""
    lnc: Optional[int] = None
    """neuron: logical NeuronCore config 1|2, exported to every worker before the runtime starts; None =
    NEURON_LOGICAL_NC_CONFIG or 2 (devices/lnc.py)."""
    memory_gib: Optional[float] = None
    """Capacity per rank in GiB for planning (qwen3_research.plan, planner.py); None = detected."""
    gpu: Optional[str] = None
    """Planning a GPU this host does not have (device=cuda on a CPU-only host): a name from torchtitan's peak
    table (H200, H100 SXM, H100 PCIe, H100 NVL, A100, L40S, L4: compiling.PLANNED_GPUS); devices/cuda.py,
    planner.py."""
    peak_tflops: Optional[float] = None
    """Planning another GPU: its dense bf16 TFLOP/s, with device.memory_gib (devices/cuda.py)."""


@dataclass
class CompileConfig:
    """torch.compile of each transformer block and the loss (qwen3_research.compiling; docs/GPU.md "Compile")."""

    enable: Any = "auto"
    """auto | true | false. auto: on where it was measured faster (cuda, dense model, bf16, no kernel entries: the
    H200 figures in docs/GPU.md), off elsewhere (cpu: a 20-30 s first step, neuron: not measured). Resolved once at
    start-up (compiling.decide), with its reason; applied per block as torchtitan's apply_compile (titan/)."""
    backend: Optional[str] = None
    """torch.compile backend; None: inductor on cpu/cuda, "neuron" on neuron (compiling.py)."""
    fullgraph: bool = False
    """torch.compile's fullgraph: fail on a graph break instead of falling back (compiling.py)."""
    cache_dir: Optional[str] = "auto"
    """One compile cache for every run and sweep point (inductor's FX graph / AOT autograd / autotune caches,
    Triton's, TorchNeuron's NEFFs), in a subdirectory keyed by torch version, device and driver/compiler version,
    set in the environment before any worker starts. auto: compile/ in the project's cache folder
    (QWEN3_RESEARCH_CACHE, else ~/.cache/qwen3_research); a directory that cannot be written is a config error at
    start-up. None: leave the environment (and torch's defaults) alone (compiling.py)."""
    cache_key_extra: str = ""
    """Appended to the cache key: a different value never reuses an entry (tests simulate a torch upgrade;
    compiling.py)."""


@dataclass
class CheckpointConfig:
    """Distributed checkpoints, resume and Hugging Face export (qwen3_research.run.checkpoint, run/export_hf.py)."""

    every: int = 0
    """Save every N steps; 0 = only at the end when enabled (run/checkpoint.py)."""
    enable: bool = False
    """Save checkpoints (run/checkpoint.py)."""
    dir: str = "checkpoints"
    """Where checkpoints go, relative to the run dir; one outside it records its run in owner.json
    (run/checkpoint.py, run/rundir.py)."""
    resume: Optional[str] = None
    """None | auto | <path to a step dir>: continue a run from its latest (auto) or a given checkpoint
    (run/checkpoint.py, run/rundir.py)."""
    keep: int = 2
    """Checkpoints kept; older step dirs are removed (run/checkpoint.py)."""
    export_hf: bool = False
    """Export Hugging Face safetensors to <run dir>/hf at the end, verified (run/export_hf.py). With model.lora.enable=true:
    <run dir>/hf_adapter, the adapters in PEFT's format for the base's HF checkpoint (model.path / model.init_from,
    required), and <run dir>/hf, the merged model; each verified by the reload its users do (run/export_peft.py)."""
    overwrite: bool = False
    """Start over in a run dir that holds a run: its files are removed first (run/rundir.py)."""
    allow_data_change: bool = False
    """Resume under another data layout (seq_len, batch, source, tokenizer) (run/checkpoint.py)."""
    async_mode: str = "disabled"
    """disabled | async | async_with_pinned_mem: how a periodic save is written. async: the state is copied to host
    memory, then written by a thread over its own gloo group while training goes on (torch.distributed.checkpoint.
    async_save); async_with_pinned_mem: the copy into pinned memory overlaps the next step too, the write runs in a
    process (an accelerator only: refused on cpu). The last step's save and a signal's are synchronous; a directory is
    published only once its write completed; summary.json records each save's stall (run/async_checkpoint.py,
    docs/RELIABILITY.md)."""


@dataclass
class WandbConfig:
    """The run's Weights & Biases run (qwen3_research.run.sinks; docs/WANDB.md)."""

    mode: str = "offline"
    """offline | online | disabled; WANDB_MODE in the environment wins (run/sinks.py)."""
    project: str = "qwen3_research"
    """W&B project, 1-128 characters without / \\ # ? % :; WANDB_PROJECT wins (run/sinks.py)."""
    entity: Optional[str] = None
    """W&B entity (user or team); WANDB_ENTITY wins (run/sinks.py)."""
    group: Optional[str] = None
    """W&B group; None: the sweep dir's name in a multirun, else none (launch/elastic.py, launch/sweep.py)."""
    name: Optional[str] = None
    """W&B run name; None: derived from the overrides (run/sinks.py)."""
    tags: List[str] = field(default_factory=list)
    """W&B tags (run/sinks.py)."""
    init_timeout: float = 30.0
    """Seconds W&B may take to start online before the run falls back to offline (run/sinks.py)."""


@dataclass
class LoggingConfig:
    """What a run prints and logs (qwen3_research.run.sinks)."""

    wandb: WandbConfig = field(default_factory=WandbConfig)
    """Weights & Biases (logging.wandb.*)."""
    progress_bar: bool = True
    """Draw a progress bar; only drawn when stdout is a terminal (run/sinks.py)."""
    print_config: bool = True
    """Print the composed config at start-up (run/sinks.py)."""


@dataclass
class TrainingConfig:
    """The training loop (qwen3_research.trainer, step.py)."""

    steps: int = 60
    """Optimizer steps (trainer.py; the schedule in optim.py)."""
    seed: int = 0
    """Seeds weights and data order, in [0, 2**63 - 1]: same seed, same losses (step.py, data.py)."""
    log_every: int = 1
    """Log every N steps; step 1 and the last are always logged (trainer.py)."""
    eval_every: int = 20
    """Evaluate on the held-out documents every N steps; 0 disables evaluation (trainer.py)."""
    eval_batches: int = 2
    """Batches per evaluation (step.py)."""
    grad_accum: int = 1
    """Micro-batches per optimizer step (step.py, data.py)."""
    mixed_precision: str = "auto"
    """none | bf16 | auto. bf16: sharded layouts as torchtitan and AWS's recipes (FSDP2 gathers bf16 copies of
    the float32 parameters for forward/backward, reduces gradients in float32, float32 AdamW state: parallel.py),
    one process autocast over float32 parameters. auto: bf16 on neuron, none elsewhere; resolved once at start-up
    (resolve.auto_settings)."""
    nan_policy: str = "stop"
    """stop | skip: on a non-finite loss or gradient, fail the run or skip the step (step.py)."""
    loss: str = "auto"
    """full | chunked | auto. chunked: lm_head + cross-entropy a chunk of tokens at a time (loss.py). auto: chunked
    on cpu (measured faster and smaller, the same losses: benchmarks/RESULTS.md), full on cuda and neuron (not
    measured there); resolved once at start-up (resolve.auto_settings)."""
    loss_chunk_tokens: int = 1024
    """training.loss=chunked: tokens per chunk; logits alive at once: this x vocab floats (loss.py)."""
    track_memory: bool = False
    """Record the peak live tensor bytes per rank of the second step (torch's MemTracker) in summary.json
    (memory.py, trainer.py)."""


@dataclass
class ProfilingConfig:
    """Profiler traces and memory snapshots (qwen3_research.profiling; docs/PROFILING.md)."""

    steps: List[int] = field(default_factory=list)
    """[a, b]: a torch profiler trace (Chrome/Perfetto JSON) of training steps a..b (1-based, inclusive) on every
    rank, <run dir>/profiling/trace_rank<r>.json; on neuron the Neuron runtime's own capture instead
    (profiling.py, devices/neuron.py)."""
    memory_snapshot: bool = False
    """A memory snapshot per rank over the profiled steps (all steps when profiling.steps is empty), and one on an
    out-of-memory error: cuda the caching allocator's history (.pickle), cpu the profiler's memory timeline (.json)
    (profiling.py, the devices/ spec)."""
    neuron_device_profile: Optional[str] = None
    """neuron only: model | session, sets NEURON_RT_INSPECT_DEVICE_PROFILE for device-level traces beside the
    system profile (profiling.py, devices/neuron.py)."""


@dataclass
class SweepConfig:
    """Multirun sweeps (qwen3_research.launch.sweep; docs/SWEEPS.md)."""

    plan: Any = True
    """true | false | fit. true: plan every point (planner.py) before the first one starts; fit: a point predicted
    not to fit runs as its cheapest fitting variant instead (fit.py; the swept keys stay as swept), recorded in
    plan.json, the point's summary.json and W&B config (memory_plan.adjusted) and the report's "adjusted" column
    (launch/sweep.py)."""
    skip_infeasible: bool = True
    """Do not start points predicted not to fit device memory (status "skipped: ..."; launch/sweep.py)."""
    resume: bool = True
    """A point whose summary.json in the same sweep dir says ok is not run again (launch/sweep.py)."""


@dataclass
class RunConfig:
    """A whole run: one section per config group or key family."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """The model (group model=)."""
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    """Processes and layout (group parallelism=)."""
    kernels: KernelsConfig = field(default_factory=KernelsConfig)
    """Kernel overrides (group kernels=)."""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    """Optimizer and schedule (group optimizer=)."""
    data: DataConfig = field(default_factory=DataConfig)
    """Corpus and batches (group data=)."""
    device: DeviceConfig = field(default_factory=DeviceConfig)
    """Device kind (group device=)."""
    compile: CompileConfig = field(default_factory=CompileConfig)
    """torch.compile (compile.*)."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpoints, resume, export (checkpoint.*)."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """Console and W&B (logging.*)."""
    training: TrainingConfig = field(default_factory=TrainingConfig)
    """The training loop (training.*)."""
    profiling: ProfilingConfig = field(default_factory=ProfilingConfig)
    """Profiler traces and memory snapshots (profiling.*)."""
    sweep: SweepConfig = field(default_factory=SweepConfig)
    """Multirun planning and resume (sweep.*)."""


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
    if not (cfg.compile.enable == "auto" or isinstance(cfg.compile.enable, bool)):  # 1 == True, but is not True:
        # compile.enable=1 was taken for auto by the decision (compiling.decide tests `is True`)
        raise ConfigError(f"compile.enable must be auto, true or false, got {cfg.compile.enable!r}"
                          + (f": write compile.enable={str(bool(cfg.compile.enable)).lower()}"
                             if cfg.compile.enable in (0, 1) else ""))

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

    lora = cfg.model.lora
    if lora.enable:
        if lora.rank < 1:
            raise ConfigError(f"model.lora.rank must be >= 1 (the adapters' rank; e.g. 16), got {lora.rank}")
        _positive("model.lora.alpha", lora.alpha)
        if not 0.0 <= lora.dropout < 1.0:
            raise ConfigError(f"model.lora.dropout must be in [0, 1), got {lora.dropout}")
        unknown = [t for t in lora.target_modules if t not in LORA_DEFAULT_TARGETS]
        if unknown or not lora.target_modules:
            raise ConfigError(f"model.lora.target_modules={list(lora.target_modules)}: {unknown or 'empty'} match no "
                              f"module; the targets are Hugging Face projection names, a subset of "
                              f"[{','.join(LORA_DEFAULT_TARGETS)}]")

    p = cfg.parallelism
    if p.nproc_per_node == 0 or p.nproc_per_node < -1:
        raise ConfigError(f"parallelism.nproc_per_node must be -1 (auto: every device of the host) or >= 1, got {p.nproc_per_node}")
    for key in ("nnodes", "dp_replicate", "tp", "ep", "pp"):
        if getattr(p, key) < 1:
            raise ConfigError(f"parallelism.{key} must be >= 1, got {getattr(p, key)}")
    if p.dp_shard == 0 or p.dp_shard < -1:
        raise ConfigError(f"parallelism.dp_shard must be -1 (the rest) or >= 1, got {p.dp_shard}")
    for key in ("pp_microbatches", "pp_layers_per_stage"):
        if getattr(p, key) < 0:
            raise ConfigError(f"parallelism.{key} must be >= 0 (0: auto), got {getattr(p, key)}")
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
    if o.lr * o.weight_decay >= 1.0:  # trained into NaN, and the NaN policy then advised lowering optimizer.lr
        raise ConfigError(f"optimizer.weight_decay={o.weight_decay:g} with optimizer.lr={o.lr:g}: AdamW multiplies every "
                          f"decayed weight by 1 - lr x weight_decay = {1 - o.lr * o.weight_decay:.3g} each step, which "
                          f"zeroes or flips them; use optimizer.weight_decay < 1/lr = {1 / o.lr:.3g} (typical 0.01 … 0.1)")
    _positive("optimizer.warmup_steps", o.warmup_steps, allow_zero=True)
    _choice("optimizer.decay", o.decay, {"cosine", "linear", "constant"})
    if not 0.0 <= o.min_lr_ratio <= 1.0:
        raise ConfigError(f"optimizer.min_lr_ratio must be in [0, 1], got {o.min_lr_ratio}")

    d = cfg.data
    _choice("data.source", d.source, {"embedded", "hf", "files", "chat"})
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
    if d.source == "chat":
        _choice("data.loss_on", d.loss_on, {"assistant", "completion", "all"})
        _choice("data.overlong", d.overlong, {"drop", "truncate_turns"})
        if d.files and d.hf.name:
            raise ConfigError("data=chat reads data.files or data.hf.name, not both; drop one")
        if d.files:
            data_files(d.files)
        if d.packing and not d.document_masking:
            raise ConfigError("data.packing=true needs data.document_masking=true with data=chat: packed conversations "
                              "would attend to each other; set data.document_masking=true, or data.packing=false")

    # device.type: its registered kinds are checked in resolve.check_device_settings (the devices package)
    ck = cfg.checkpoint
    _positive("checkpoint.every", ck.every, allow_zero=True)
    _positive("checkpoint.keep", ck.keep)
    _choice("checkpoint.async_mode", ck.async_mode, {"disabled", "async", "async_with_pinned_mem"})
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
    if cfg.device.memory_gib is not None and not 0 < cfg.device.memory_gib <= 2**20:  # 1 PiB: the plan printed
        # 1e308 with its 309 digits, and no device has it
        raise ConfigError(
            f"device.memory_gib must be in (0, 1048576] (GiB per rank, e.g. 24 for a trn2 rank at LNC=2), got "
            f"{cfg.device.memory_gib:g}; or leave it unset to use the detected capacity"
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
