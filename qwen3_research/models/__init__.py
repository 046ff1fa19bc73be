"""Model backends behind one registry (``models.registry``): what the rest of the package asks of a model.

Each backend is a package (or module) with a ``BACKEND`` spec: ``native`` (torchtitan's Qwen3, dense and MoE
flavors; ``model=native_moe`` is a preset of it) and ``hf`` (Transformers), each folder holding its model and its
Hugging Face mapping; out-of-tree ones through ``model.module``. ``hf_export`` is what both exports share. The
functions here take the model config and ask the configured backend's spec, so no caller tests a backend's name:

- ``check(cfg)``: the backend's config rules (its name, flavor, model.path / model.init_from); after
  ``config.validate``, before anything else reads the model config.
- ``describe(cfg)``: heads and experts for degree validation (no torch import).
- ``build(cfg, device, ...)``: the ``models.base.ModelBackend`` (the only call that imports torch).
- ``check_run(rc)``: the backend's whole-run checks before any worker (native: the installed torchtitan's limits).
- ``check_init_from(rc)``: ``model.init_from`` checked by its backend before any worker (no weights read).
- ``canonical(cfg)``: an old config's backend and flavor names as today's (``native_moe``/``tiny`` -> ``native``/
  ``tiny_moe``): old checkpoints, plans and run directories.
- ``tokenizer_spec(rc)``, ``flops_per_token(cfg, seq_len)``, ``architecture(cfg)``, ``flavors_for``/``get_flavor``.
"""

from __future__ import annotations

import os

from qwen3_research.config import ModelConfig, RunConfig
from qwen3_research.errors import ConfigError
from qwen3_research.models import flavors, registry
from qwen3_research.models.registry import BackendSpec, canonical, spec

__all__ = ["BackendSpec", "spec", "canonical", "check", "check_run", "check_init_from", "describe", "build",
           "tokenizer_spec", "flops_per_token", "architecture", "flavors_for", "get_flavor"]


def check(cfg: ModelConfig) -> BackendSpec:
    """The configured backend's config rules (ConfigError, one line); returns its spec."""
    return registry.check(cfg)


def describe(cfg: ModelConfig) -> dict:
    """n_heads, n_kv_heads, num_experts, is_moe for degree validation (after the backend's checks)."""
    return check(cfg).describe(cfg)


def moe_flavors() -> list[str]:
    """The named MoE architectures of the native backend (a config error's list)."""
    return list(flavors.MOE)


def build(cfg: ModelConfig, device, *, seq_len: int, seed: int, tt_parallelism=None, tokenizer=None,
          load_init_from: bool = True):
    """The built model (``models.base.ModelBackend``) on ``device``, seeded."""
    return check(cfg).build(cfg, device, seq_len=seq_len, seed=seed, tt_parallelism=tt_parallelism,
                            tokenizer=tokenizer, load_init_from=load_init_from)


def check_run(rc: RunConfig) -> None:
    """The backend's checks of the whole run before any worker starts (native: what the installed torchtitan
    cannot run, ``titan.check_supported``)."""
    s = check(rc.model)
    if rc.data.document_masking and not s.document_masking:
        raise ConfigError(f"data.document_masking=true: model={s.name} takes no per-document positions; use "
                          f"data.document_masking=false or a backend that does ({[n for n in registry.in_tree() if registry.get(n).document_masking]})")
    if rc.checkpoint.export_hf and rc.model.moe.balance == "bias" and "bias" in registry.balance_modes(rc.model):
        raise ConfigError("checkpoint.export_hf=true with model.moe.balance=bias: Hugging Face Qwen3-MoE has no expert "
                          "bias (it only chooses the experts, so it cannot be folded into the router weights) and the "
                          "export would route differently; use model.moe.balance=aux_loss (or auto), or "
                          "checkpoint.export_hf=false")
    if s.check_run is not None:
        s.check_run(rc)


def check_init_from(rc: RunConfig) -> None:
    """``model.init_from`` checked by the configured backend's spec (``BackendSpec.check_init_from``) in the
    launching process, before any worker starts; nothing without an init_from."""
    if rc.model.init_from:
        s = check(rc.model)
        if s.check_init_from is not None:
            s.check_init_from(rc)


def tokenizer_spec(cfg: RunConfig) -> str:
    """An HF directory (model=hf's path, a native model's init_from) brings its own tokenizer when it has one."""
    own = spec(cfg.model).tokenizer_dir(cfg.model)
    if cfg.data.tokenizer == "qwen3" and own:
        if os.path.isfile(os.path.join(os.path.expanduser(own), "tokenizer.json")):
            return own
    return cfg.data.tokenizer


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token before any build (the planner); NaN where only the built model knows."""
    return registry.flops_per_token(cfg, seq_len)


def architecture(cfg: ModelConfig):
    """The architecture (``models.flavors.Flavor``) for closed-form estimates; None when the backend has none."""
    return spec(cfg).architecture(cfg)


def flavors_for(backend: str) -> list[str]:
    """The named flavors of ``backend`` (an in-tree backend's name)."""
    return list(registry.get(backend).flavors)


def get_flavor(backend: str, name: str):
    """The architecture of flavor ``name`` of ``backend`` (an old name, e.g. native_moe's tiny, as today's)."""
    new = canonical({"backend": backend, "flavor": name})
    return registry.get(new["backend"]).flavors[new["flavor"]]
