"""Parallel degrees: validation, the device mesh (torchtitan ParallelDims), and sharding the model."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

from qwen3_research.config import ConfigError, ParallelismConfig


@dataclass(frozen=True)
class Degrees:
    world_size: int
    dp_replicate: int
    dp_shard: int
    tp: int
    ep: int
    sequence_parallel: bool

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def sharded(self) -> bool:
        return self.world_size > 1

    def describe(self) -> str:
        sp = "+sp" if self.sequence_parallel else ""
        return f"world={self.world_size} dp_replicate={self.dp_replicate} dp_shard={self.dp_shard} tp={self.tp}{sp} ep={self.ep}"


def validate_degrees(
    p: ParallelismConfig,
    *,
    seq_len: int,
    n_heads: int | None = None,
    n_kv_heads: int | None = None,
    num_experts: int | None = None,
    is_moe: bool = False,
    world_size: int | None = None,
) -> Degrees:
    """Resolve dp_shard=-1 and check every degree; each failure names the keys and a fix."""
    asked = p.nproc_per_node * p.nnodes
    if world_size is not None and world_size != asked:
        raise ConfigError(
            f"parallelism.nproc_per_node×nnodes={p.nproc_per_node}×{p.nnodes}={asked} but the launcher started "
            f"{world_size} processes; set parallelism.nproc_per_node={world_size // max(p.nnodes, 1)}"
        )
    world = asked
    others = p.dp_replicate * p.tp
    if p.dp_shard == -1:
        if world % others:
            raise ConfigError(
                f"parallelism.dp_replicate×tp={p.dp_replicate}×{p.tp}={others} does not divide the world size "
                f"{world} (nproc_per_node×nnodes); choose degrees whose product divides {world}"
            )
        dp_shard = world // others
    else:
        dp_shard = p.dp_shard
        if p.dp_replicate * dp_shard * p.tp != world:
            raise ConfigError(
                f"parallelism.dp_replicate×dp_shard×tp={p.dp_replicate}×{dp_shard}×{p.tp}="
                f"{p.dp_replicate * dp_shard * p.tp} must equal nproc_per_node×nnodes={world}; "
                "set parallelism.dp_shard=-1 to take the rest"
            )
    if p.tp > 1 and n_heads is not None:
        if n_heads % p.tp or (n_kv_heads and n_kv_heads % p.tp):
            raise ConfigError(
                f"parallelism.tp={p.tp} must divide the model's n_heads={n_heads} and n_kv_heads={n_kv_heads}; "
                f"use a tp that divides {n_kv_heads or n_heads}"
            )
    if p.sequence_parallel:
        if p.tp == 1:
            raise ConfigError("parallelism.sequence_parallel=true needs parallelism.tp > 1; set tp=2 or sequence_parallel=false")
        if seq_len % p.tp:
            raise ConfigError(
                f"parallelism.sequence_parallel: data.seq_len={seq_len} must be divisible by parallelism.tp={p.tp}"
            )
    if p.ep > 1:
        if not is_moe:
            raise ConfigError(f"parallelism.ep={p.ep} needs a MoE model (model=native_moe); set parallelism.ep=1")
        if num_experts and num_experts % p.ep:
            raise ConfigError(f"parallelism.ep={p.ep} must divide the number of experts {num_experts}")
        if (dp_shard * p.tp) % p.ep:
            raise ConfigError(
                f"parallelism.ep={p.ep} must divide dp_shard×tp={dp_shard}×{p.tp}={dp_shard * p.tp} (experts are "
                "sharded over the data-parallel and tensor-parallel ranks)"
            )
    return Degrees(world, p.dp_replicate, dp_shard, p.tp, p.ep, p.sequence_parallel)


def torchtitan_parallelism(d: Degrees):
    """torchtitan's ParallelismConfig for our degrees (the partial_dtensor backend: DTensor on model axes)."""
    from torchtitan.config import ParallelismConfig as TTParallelism

    return TTParallelism(
        data_parallel_replicate_degree=d.dp_replicate,
        data_parallel_shard_degree=d.dp_shard,
        tensor_parallel_degree=d.tp,
        enable_sequence_parallel=d.sequence_parallel,
        expert_parallel_degree=d.ep,
        spmd_backend="partial_dtensor",
    )


def build_parallel_dims(d: Degrees, device_type: str):
    """torchtitan ParallelDims with its mesh built on the current process group (when sharded)."""
    from torchtitan.distributed import ParallelDims

    dims = ParallelDims(
        dp_replicate=d.dp_replicate, dp_shard=d.dp_shard, cp=1, tp=d.tp, pp=1, ep=d.ep,
        world_size=d.world_size, spmd_backend="partial_dtensor",
    )
    if d.sharded:
        dims.build_mesh()
    return dims


def torchtitan_training_configs(d: Degrees, *, activation_checkpoint: str, compile_cfg, mixed_precision: str, run_dir: str):
    """The torchtitan config objects ``parallelize_qwen3`` reads."""
    from torchtitan.config import CompileConfig, TrainingConfig
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC

    ac = {"none": None, "full": FullAC.Config(), "selective": SelectiveAC.Config()}[activation_checkpoint]
    param_dtype = "bfloat16" if mixed_precision == "bf16" else "float32"
    return SimpleNamespace(
        parallelism=torchtitan_parallelism(d),
        training=TrainingConfig(mixed_precision_param=param_dtype),
        # Compile is applied by the Trainer around the whole model, not per block here.
        compile=CompileConfig(enable=False, backend=compile_cfg.backend or "inductor"),
        activation_checkpoint=ac,
        dump_folder=run_dir,
    )
