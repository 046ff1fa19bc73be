"""Parallel degrees: validation, the device mesh (torchtitan ParallelDims), and sharding the model."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from qwen3_research import slurm, titan
from qwen3_research.config import ConfigError, ParallelismConfig
from qwen3_research.devices import host_nproc_per_node


@dataclass(frozen=True)
class Degrees:
    world_size: int
    dp_replicate: int
    dp_shard: int
    tp: int
    ep: int
    sequence_parallel: bool
    pp: int = 1
    pp_schedule: str = "1F1B"
    pp_microbatches: int = 1  # per pipeline step, resolved (1 without pp)
    pp_layers_per_stage: int = 0  # 0: torchtitan's split

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def pipelined(self) -> bool:
        return self.pp > 1

    @property
    def sharded(self) -> bool:
        return self.world_size > 1

    def describe(self) -> str:
        sp = "+sp" if self.sequence_parallel else ""
        pp = f" pp={self.pp} ({self.pp_schedule}, {self.pp_microbatches} microbatches)" if self.pipelined else ""
        return f"world={self.world_size} dp_replicate={self.dp_replicate} dp_shard={self.dp_shard} tp={self.tp}{sp} ep={self.ep}{pp}"


# The schedules torch.distributed.pipelining.schedules.get_schedule_class names (torch 2.10-2.14), by how many
# stages each rank holds: one (single), several in a loop (looped), two in a V. tests/test_pipeline.py checks the
# names against torch's map. PipelineScheduleSingle/Multi are its abstract bases (torchtitan refuses them).
PP_SCHEDULES = {"1F1B": "single", "GPipe": "single", "Interleaved1F1B": "looped", "LoopedBFS": "looped",
                "InterleavedZeroBubble": "looped", "ZBVZeroBubble": "v", "DualPipeV": "v"}
# torchtitan's stage split weighs the embedding and the norm+lm_head as one layer each
# (ParallelismConfig.pipeline_parallel_first/last_stage_less_layers' defaults)
PP_EDGE_LAYERS = 2


def validate_degrees(
    p: ParallelismConfig,
    *,
    seq_len: int,
    n_heads: int | None = None,
    n_kv_heads: int | None = None,
    num_experts: int | None = None,
    is_moe: bool = False,
    world_size: int | None = None,
    n_layers: int | None = None,
    tie_embeddings: bool | None = None,
) -> Degrees:
    """Resolve dp_shard=-1 and check every degree; each failure is one line naming the keys and a fix.

    ``world_size``: what the launcher actually started (torchrun / a worker), if known.
    """
    if p.nproc_per_node == -1:  # auto; the launch paths resolve it for the run's device first (device.prepare_launch)
        p = dataclasses.replace(p, nproc_per_node=host_nproc_per_node(world_size, p.nnodes))
    asked = p.nproc_per_node * p.nnodes
    if world_size is not None and world_size != asked:
        raise ConfigError(
            f"parallelism.nproc_per_node×nnodes={p.nproc_per_node}×{p.nnodes}={asked} but the launcher started "
            f"{world_size} processes; "
            + (f"set parallelism.nproc_per_node={world_size // p.nnodes}" if world_size % p.nnodes == 0
               else f"set parallelism.nproc_per_node and parallelism.nnodes so their product is {world_size}")
        )
    world = asked
    others = p.dp_replicate * p.tp * p.pp
    if p.dp_shard == -1:
        if world % others:
            what = "dp_replicate×tp" + ("×pp" if p.pp > 1 else "")
            values = f"{p.dp_replicate}×{p.tp}" + (f"×{p.pp}" if p.pp > 1 else "")
            raise ConfigError(
                f"parallelism.{what}={values}={others} does not divide the world size "
                f"nproc_per_node×nnodes={world} (dp_shard=-1 takes the rest); set parallelism.nproc_per_node to a "
                f"multiple of {others}, or tp / dp_replicate to divisors of {world}"
            )
        dp_shard = world // others
    else:
        dp_shard = p.dp_shard
        if p.dp_replicate * dp_shard * p.tp * p.pp != world:
            product = p.dp_replicate * dp_shard * p.tp * p.pp
            fix = (f"set parallelism.dp_shard=-1 (the rest: {world // others})" if world % others == 0
                   else f"set parallelism.nproc_per_node={product // p.nnodes or 1}")
            what = "dp_replicate×dp_shard×tp" + ("×pp" if p.pp > 1 else "")
            values = f"{p.dp_replicate}×{dp_shard}×{p.tp}" + (f"×{p.pp}" if p.pp > 1 else "")
            raise ConfigError(f"parallelism.{what}={values}={product} must equal nproc_per_node×nnodes={world}; {fix}")
    if p.tp > 1 and n_heads is not None:
        kv = n_kv_heads or n_heads
        if n_heads % p.tp or kv % p.tp:
            valid = [t for t in range(1, kv + 1) if n_heads % t == 0 and kv % t == 0]
            raise ConfigError(
                f"parallelism.tp={p.tp} must divide the model's n_heads={n_heads} and n_kv_heads={kv}; "
                f"use parallelism.tp in {valid}"
            )
    if p.sequence_parallel:
        if p.tp == 1:
            raise ConfigError(
                "parallelism.sequence_parallel=true needs parallelism.tp > 1; set parallelism.tp=2 or "
                "parallelism.sequence_parallel=false"
            )
        if seq_len % p.tp:
            raise ConfigError(
                f"parallelism.sequence_parallel=true needs data.seq_len divisible by parallelism.tp={p.tp}, got "
                f"data.seq_len={seq_len}; use data.seq_len={(seq_len // p.tp + 1) * p.tp} or "
                "parallelism.sequence_parallel=false"
            )
    if p.ep > 1:
        if not is_moe:
            raise ConfigError(f"parallelism.ep={p.ep} needs a MoE model; use model=native_moe or set parallelism.ep=1")
        if num_experts and num_experts % p.ep:
            valid = [e for e in range(1, num_experts + 1) if num_experts % e == 0 and (dp_shard * p.tp) % e == 0]
            raise ConfigError(
                f"parallelism.ep={p.ep} must divide the model's number of experts {num_experts}; "
                f"use parallelism.ep in {valid}"
            )
        if (dp_shard * p.tp) % p.ep:
            raise ConfigError(
                f"parallelism.ep={p.ep} must divide dp_shard×tp={dp_shard}×{p.tp}={dp_shard * p.tp} (experts are "
                f"sharded over the data-parallel and tensor-parallel ranks); use a smaller parallelism.ep or more ranks"
            )
    microbatches = check_pipeline(p, n_layers=n_layers, tie_embeddings=tie_embeddings)
    if "TORCHELASTIC_RUN_ID" not in os.environ:  # under torchrun (and in our workers) the group has met already
        check_rendezvous_endpoint(p)
    if (p.nnodes > 1 and is_loopback(p.rdzv_endpoint) and slurm.job_nodelist() is None
            and "TORCHELASTIC_RUN_ID" not in os.environ):  # torchrun has already met the other nodes
        raise ConfigError(
            f"parallelism.nnodes={p.nnodes} needs parallelism.rdzv_endpoint=<head node>:<port> reachable from "
            f"every node (got {p.rdzv_endpoint!r}, this machine only); or start with hydra/launcher=slurm, which "
            "takes the head node from Slurm"
        )
    return Degrees(world, p.dp_replicate, dp_shard, p.tp, p.ep, p.sequence_parallel, p.pp, p.pp_schedule,
                   microbatches, p.pp_layers_per_stage)


def check_pipeline(p: ParallelismConfig, *, n_layers: int | None, tie_embeddings: bool | None) -> int:
    """The pipeline keys checked before any worker starts (what torchtitan's ``pipeline_llm`` and torch's schedules
    would refuse, or, for tied embeddings, silently get wrong); returns the micro-batches per pipeline step (1
    without pp). The batch is checked once resolved (``check_pipeline_batch``)."""
    if p.pp == 1:
        return 1
    kind = PP_SCHEDULES.get(p.pp_schedule)
    if kind is None:
        raise ConfigError(f"parallelism.pp_schedule={p.pp_schedule!r} is not a pipeline schedule torch offers; use "
                          f"one of {list(PP_SCHEDULES)}")
    if n_layers is None:
        raise ConfigError(f"parallelism.pp={p.pp} needs model=native (torchtitan's Qwen3 pipelining); this model "
                          "backend has no pipeline stages: set parallelism.pp=1")
    if tie_embeddings:
        # torchtitan refuses this only in Decoder.Config.update_from_config, which pipeline_llm never calls: each
        # stage deep-copies the tied weight and trains its own copy (gradients measured off by 0.12)
        raise ConfigError(f"parallelism.pp={p.pp} cannot pipeline a model with tied embeddings (the first and last "
                          "stages would each train their own copy of the shared weight); use an untied flavor "
                          "(model.flavor=tiny_untied, 8B and larger) or parallelism.pp=1")
    units = n_layers + PP_EDGE_LAYERS
    if p.pp_layers_per_stage:
        stages = -(-units // p.pp_layers_per_stage)
    else:
        stages = p.pp * (1 if kind == "single" else 2)
    per_rank, rest = divmod(stages, p.pp)
    need = "exactly 1" if kind == "single" else "exactly 2" if kind == "v" else "at least 2"
    if rest or (kind == "single" and per_rank != 1) or (kind == "v" and per_rank != 2) or per_rank < 1 \
            or (kind == "looped" and per_rank < 2):
        raise ConfigError(
            f"parallelism.pp_schedule={p.pp_schedule} needs {need} stage(s) per rank, but parallelism.pp_layers_per_stage="
            f"{p.pp_layers_per_stage} makes {stages} stages of the {n_layers} layers (+{PP_EDGE_LAYERS} for the "
            f"embedding and lm_head) on pp={p.pp} ranks; set parallelism.pp_layers_per_stage=0 (auto) or another value")
    if stages > units:
        raise ConfigError(
            f"parallelism.pp={p.pp} with pp_schedule={p.pp_schedule} makes {stages} stages, more than the model's "
            f"{n_layers} layers (+{PP_EDGE_LAYERS} for the embedding and lm_head) can fill; lower parallelism.pp or "
            "use a single-stage schedule (1F1B, GPipe)")
    needed = stages if p.pp_schedule == "DualPipeV" else p.pp
    microbatches = p.pp_microbatches or needed
    if microbatches < needed:
        raise ConfigError(f"parallelism.pp_microbatches={microbatches}: pp_schedule={p.pp_schedule} needs at least "
                          f"{needed} (one per {'stage' if p.pp_schedule == 'DualPipeV' else 'pipeline rank'}); set "
                          f"parallelism.pp_microbatches={needed} or 0 (auto)")
    rounds = max(1, microbatches // p.pp)
    if p.pp_schedule in ("Interleaved1F1B", "InterleavedZeroBubble") and microbatches % rounds:
        # torch's interleaved schedules run the micro-batches in max(1, n // pp) equal rounds
        raise ConfigError(f"parallelism.pp_microbatches={microbatches} with pp_schedule={p.pp_schedule} must split "
                          f"into {rounds} equal rounds (n // pp); use parallelism.pp_microbatches={rounds * p.pp}")
    return microbatches


def check_pipeline_batch(d: Degrees, batch_size: int) -> None:
    """The pipeline's micro-batches are equal slices of the per-rank data.batch_size."""
    if d.pipelined and batch_size % d.pp_microbatches:
        raise ConfigError(f"parallelism.pp_microbatches={d.pp_microbatches} must divide the per-rank data.batch_size="
                          f"{batch_size} (each micro-batch is an equal slice); use data.batch_size="
                          f"{-(-batch_size // d.pp_microbatches) * d.pp_microbatches} or another "
                          "parallelism.pp_microbatches")


def check_rendezvous_endpoint(p: ParallelismConfig) -> None:
    """HOST[:PORT] as torch's elastic launcher parses it; a single node must host its own rendezvous."""
    ep = p.rdzv_endpoint.strip()
    bracketed = ep.startswith("[") and ep.endswith("]")  # an IPv6 address without a port
    host, port = (ep, "") if bracketed or ":" not in ep else ep.rsplit(":", 1)
    host = host[1:-1] if len(host) > 1 and host[0] == "[" and host[-1] == "]" else host
    if not host or any(c.isspace() for c in host) or (port and not (port.isdigit() and int(port) < 2**16)):
        raise ConfigError(f"parallelism.rdzv_endpoint={p.rdzv_endpoint!r} is not HOST:PORT with a port in 0-65535 "
                          "(e.g. 10.0.0.1:29500; 127.0.0.1:0 picks a free port on one node)")
    if p.nnodes == 1 and not _is_this_host(host):
        raise ConfigError(f"parallelism.rdzv_endpoint={p.rdzv_endpoint!r}: {host} is not an address of this host, and "
                          "a single-node run (parallelism.nnodes=1) hosts its own rendezvous; leave the default "
                          "127.0.0.1:0, or set parallelism.nnodes for a multi-node run")


def _is_this_host(host: str) -> bool:
    """Whether ``host`` resolves to an address of this machine (one a socket can bind)."""
    import socket

    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    for family, kind, _, _, addr in infos:
        try:
            with socket.socket(family, kind) as s:
                s.bind((addr[0], 0))
            return True
        except OSError:
            continue
    return False


def is_loopback(endpoint: str) -> bool:
    host = endpoint.rsplit(":", 1)[0]
    return host in ("127.0.0.1", "localhost", "::1", "[::1]", "")


def rdzv_endpoint(p: ParallelismConfig) -> str:
    """Where the worker group meets: the configured endpoint, or under Slurm the job's first node."""
    return rendezvous(p)[1]


def rendezvous(p: ParallelismConfig) -> tuple[str, str, dict]:
    """(backend, endpoint, options) for PyTorch's elastic launcher.

    Under Slurm (a multi-node job, no endpoint configured): the static backend at the job's
    first node, *by its address*: ``NodeAddr`` from ``scontrol show node``, since a Slurm node
    name need not resolve (``n1`` gave ``gai error: -2 - Name or service not known``). The node
    rank is ``SLURM_NODEID``, so node 0 holds global ranks 0..nproc_per_node-1 and the rank that
    writes metrics and the W&B run is on the node that writes ``summary.json``. The port is
    29500 + job id mod 1000 (two jobs sharing a node do not collide), unless the endpoint names one.
    Elsewhere: c10d at ``parallelism.rdzv_endpoint``. Either way a node that does not meet the
    others within ``parallelism.rdzv_timeout_s`` fails.
    """
    timeout = int(p.rdzv_timeout_s)
    if p.nnodes > 1 and is_loopback(p.rdzv_endpoint) and slurm.job_nodelist():
        endpoint = slurm.head_node_endpoint(int(p.rdzv_endpoint.rsplit(":", 1)[1] or 0))
        return "static", endpoint, {"rank": slurm.node_rank(), "timeout": timeout}
    return "c10d", p.rdzv_endpoint, {"join_timeout": timeout, "read_timeout": timeout}


def build_parallel_dims(d: Degrees, device_type: str, *, single_process_mesh: bool = False):
    """torchtitan ParallelDims with its mesh built on the current process group.

    Sharded runs always get a mesh. One process gets one only with ``single_process_mesh``
    (MoE: torchtitan's load-balancing optimizer hook asks for the "loss" mesh even at world
    size 1); it then runs on a one-rank process group over an in-memory store.
    """
    import torch.distributed as dist

    dims = titan.parallel_dims(d)
    if not d.sharded and single_process_mesh and not dist.is_initialized():
        backend = dist.Backend.default_device_backend_map.get(device_type, "gloo")
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    if d.sharded or single_process_mesh:
        dims.build_mesh()
    return dims


def torchtitan_training_configs(d: Degrees, *, activation_checkpoint: str, compile_cfg, mixed_precision: str, run_dir: str):
    """The torchtitan config objects ``parallelize_qwen3`` reads.

    ``training.mixed_precision=bf16`` where the layout shards is torchtitan's own default and AWS's Trainium
    recipes: FSDP2's ``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)`` (torchtitan's
    ``mixed_precision_param`` / ``mixed_precision_reduce``), i.e. bf16 copies of the parameters gathered for forward
    and backward (half the gathered bytes and all-gather volume), float32 master weights, gradients reduced and kept
    in float32, float32 AdamW state; no autocast (``resolve.PrecisionPlan``). One process keeps autocast over
    float32 parameters."""
    return titan.training_configs(
        d, activation_checkpoint=activation_checkpoint, compile_backend=compile_cfg.backend or "inductor",
        mixed_precision=mixed_precision, run_dir=run_dir,
    )


def has_fsdp_units(d: Degrees, *, torchtitan: bool) -> bool:
    """Whether the sharded model of this layout has FSDP2 units, i.e. where ``training.mixed_precision=bf16`` is FSDP2's
    bf16 parameter copies rather than autocast (``resolve.precision_plan`` decides on it; ``PrecisionPlan.check``
    compares the built model). torchtitan 0.3.x wraps every sharded layout (``apply_fsdp_to_decoder``), 0.2.x only
    with dp_shard > 1 (its ``fsdp_enabled``; dp_replicate alone is DDP, tp alone has none); the HF backend wraps
    with dp_shard or dp_replicate > 1 (``HFModel.parallelize``)."""
    if not d.sharded:
        return False
    if torchtitan:
        return d.dp_shard > 1 or not titan.legacy()
    return d.dp_shard > 1 or d.dp_replicate > 1


def model_modules(model) -> list:
    """Every module of ``model``; a pipelined model's (``StageParts``) with its stages' roots, which hold FSDP
    units of their own outside its module tree."""
    parts = getattr(model, "stage_parts", None)
    return [m for part in parts for m in part.modules()] if parts else list(model.modules())


def fsdp_precision(model) -> tuple[str, str] | None:
    """(param_dtype, reduce_dtype) of the MixedPrecisionPolicy of ``model``'s FSDP2 units, None without FSDP2 units
    (a policy dtype of None, i.e. the parameter's own, is reported as float32)."""
    from torch.distributed.fsdp import FSDPModule

    for module in model_modules(model):
        if isinstance(module, FSDPModule):
            # a unit may hold several groups (torch's per-parameter meshes: a pipelined stage's root with EP);
            # they share the unit's policy
            state = module._get_fsdp_state()
            groups = getattr(state, "_fsdp_param_groups", None)  # torch < 2.12: one group per unit
            group = (groups[0] if groups else None) if groups is not None else state._fsdp_param_group
            if group is not None:
                mp = group.mp_policy
                return tuple(str(d).replace("torch.", "") if d is not None else "float32"
                             for d in (mp.param_dtype, mp.reduce_dtype))
    return None


def sum_gradients_over_dp(model, degrees: Degrees) -> float:
    """Make every FSDP/HSDP unit *sum* gradients over the dp ranks; return the loss scale 1/dp.

    This is torchtitan's own convention (``apply_fsdp_to_decoder`` sets each unit's divide
    factor to 1 and its trainer normalizes the loss globally); we set it again here so any
    backend's FSDP units follow it. The trainer multiplies each rank's mean loss by the
    returned scale before backward, so the summed gradients are the global-batch mean.
    Measured on gloo: letting FSDP divide instead (factor = dp) halves the expert gradients
    with ep=2, because FSDP divides twice when an expert unit's reduce group has size 1.
    """
    from torch.distributed.fsdp import FSDPModule

    for module in model_modules(model):
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
    return 1.0 / degrees.dp


def reshard(model) -> None:
    """Put every FSDP2 unit's parameters back to their shards after a forward that had no backward.

    FSDP2 does not reshard the root unit after its forward (the backward that normally follows would
    gather the same parameters again at once), and only the backward's final callback reshards it. An
    evaluation forward under ``no_grad`` has no backward, so the root unit stays gathered and the model's
    registered parameters are the unsharded tensors, not the DTensors the optimizer holds: DCP's
    ``get_optimizer_state_dict`` then cannot map the optimizer's parameters to names (``KeyError`` on a
    parameter index) and the next checkpoint save fails on every layout that shards (fsdp, hsdp, tp, ep:
    torchtitan wraps the root in FSDP there too). ``FSDPModule.reshard()`` is a no-op on a resharded unit.
    """
    from torch.distributed.fsdp import FSDPModule

    for module in model_modules(model):
        if isinstance(module, FSDPModule):
            module.reshard()


def local_bytes(tensor) -> int:
    """Bytes this rank actually holds for a tensor (the local shard of a DTensor)."""
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.numel() * local.element_size()


def state_bytes(model, optimizer=None) -> dict:
    """This rank's bytes of parameters, gradients and optimizer state, from the local shards."""
    import torch

    params = list(model.parameters())
    out = {
        "params": sum(local_bytes(p) for p in params),
        "grads": sum(local_bytes(p.grad) for p in params if p.grad is not None),
        "optimizer": 0,
    }
    if optimizer is not None:
        for state in optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor) and value.dim() > 0:  # skip scalar 'step'
                    out["optimizer"] += local_bytes(value)
    out["total"] = out["params"] + out["grads"] + out["optimizer"]
    return out


def keep_embeddings_tied_through_tp(model) -> None:
    """Re-tie ``tok_embeddings.weight`` to ``lm_head.weight`` right after torchtitan's TP step.

    torchtitan 0.3.0's ``Module.parallelize`` distributes each module's parameters on its
    own, so a tied model comes out of tensor parallelism with two independent weights
    (measured: tp=2 gradients differ from one process by 25 %). Both are ``Shard(0)`` over
    the vocabulary on the tp mesh, so sharing the lm_head's DTensor restores the tie before
    FSDP groups them into one unit (which it does for tied models).
    """
    if not getattr(model, "enable_weight_tying", False) or "parallelize" in vars(model):
        return
    if not hasattr(model, "parallelize"):  # torchtitan 0.2.x: TP is not a model method (titan/v02.py re-ties)
        return
    tp_parallelize = model.parallelize

    def parallelize_and_retie(parallel_dims):
        tp_parallelize(parallel_dims)
        model.tok_embeddings.weight = model.lm_head.weight

    model.parallelize = parallelize_and_retie
