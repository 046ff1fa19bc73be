"""``model=native``: torchtitan's Qwen3, dense and MoE, from a named flavor (``models.flavors.FLAVORS``: the
dense sizes and the mixtures of experts in one name space) or from ``model.init_from``'s config.json
(``model_type`` qwen3 or qwen3_moe), whose safetensors it then loads shard by shard.

This package is the backend: its spec (here, what validation needs, no torch import), the model
(``model.NativeQwen3``, imported by ``build``) and its Hugging Face mapping, as torchtitan keeps a model's
state-dict adapter beside the model:

- ``hf_config``: config.json <-> flavor, cheap directory/header checks (no torch);
- ``hf_load``: safetensors -> a (sharded) model, each rank reading its part;
- ``hf_export``: a trained model -> a verified HF directory (``NativeQwen3.export_hf``);
- ``init_from``: the ``model.init_from`` checks the launcher runs before any worker (``BACKEND.check_init_from``).

``model=native_moe`` is a preset of this backend (conf/model/native_moe.yaml: a MoE flavor); the names it had as a
backend of its own (``native_moe``, flavors ``tiny``/``debug``) are read as this one's (``BACKEND.renames``).
"""

from __future__ import annotations

from qwen3_research import titan
from qwen3_research.config import ConfigError, ModelConfig, RunConfig
from qwen3_research.models import registry
from qwen3_research.models.flavors import DEFAULT_FLAVOR, FLAVORS, NATIVE_MOE_RENAMES, Flavor
from qwen3_research.models.native import hf_config, init_from
from qwen3_research.models.registry import FROM_CHECKPOINT, BackendSpec

BALANCE_MOE = ("bias", "aux_loss", "none")  # torchtitan's expert bias first: a MoE's default without a checkpoint
BALANCE_DENSE = ("none",)


def resolve_flavor(cfg: ModelConfig) -> tuple[str, Flavor]:
    """(name, architecture) of a native model. With ``model.init_from`` the architecture is the checkpoint's
    config.json; ``model.flavor`` then defaults to it (``from_hf``/``auto``), and a named flavor must agree with it
    field by field (ConfigError naming the fields)."""
    cfg = registry.canonical(cfg)
    if cfg.init_from:
        arch = Flavor(**hf_config.architecture_fields(cfg.init_from))
        if cfg.flavor in FROM_CHECKPOINT:
            return "from_hf", arch
        if cfg.flavor not in FLAVORS:
            raise ConfigError(f"model.flavor={cfg.flavor!r} is not a native flavor; leave it unset to take "
                              f"model.init_from's architecture, or choose one of {list(FLAVORS)}")
        hf_config.check_named_flavor(cfg.flavor, FLAVORS[cfg.flavor], arch, f"model.init_from={cfg.init_from!r}")
        return cfg.flavor, arch
    if cfg.flavor == "from_hf":
        raise ConfigError(f"model.flavor=from_hf needs model.init_from=<HF directory>; or name a flavor ({list(FLAVORS)})")
    name = DEFAULT_FLAVOR if cfg.flavor in FROM_CHECKPOINT else cfg.flavor
    return name, FLAVORS[name]


def describe(cfg: ModelConfig) -> dict:
    _, f = resolve_flavor(cfg)
    return {"n_heads": f.n_heads, "n_kv_heads": f.n_kv_heads, "num_experts": f.num_experts, "is_moe": f.num_experts > 0,
            "n_layers": f.n_layers, "tie_embeddings": f.tie_embeddings}


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """torchtitan's formula (6 × active matmul params + attention), from the architecture alone; the built
    model's figure (``titan.nparams_and_flops``) counts the same parameters."""
    f = resolve_flavor(cfg)[1]
    d, hd = f.dim, f.head_dim
    attn = d * (f.n_heads + 2 * f.n_kv_heads) * hd + f.n_heads * hd * d
    ffn = (f.top_k * 3 * d * f.hidden_dim + d * f.num_experts) if f.num_experts else 3 * d * f.hidden_dim
    matmul = f.n_layers * (attn + ffn) + f.vocab_size * d
    return 6 * matmul + 12 * f.n_layers * f.n_heads * hd * seq_len


def balance_modes(cfg: ModelConfig) -> tuple:
    """A MoE flavor (or a qwen3_moe init_from) balances its experts; a dense one has nothing to balance. An
    init_from whose config.json cannot be read yet: every mode (``resolve_flavor`` names the problem)."""
    try:
        return BALANCE_MOE if resolve_flavor(cfg)[1].num_experts else BALANCE_DENSE
    except (ConfigError, KeyError):  # an unknown flavor or an unreadable init_from: check() says which
        return BALANCE_MOE


def check_run(rc: RunConfig) -> None:
    """What the installed torchtitan cannot run for this model (its 0.2.x API's limits), before any worker."""
    titan.check_supported(rc, moe=resolve_flavor(rc.model)[1].num_experts > 0)


def check_init_from(rc: RunConfig) -> None:
    """``model.init_from``: config.json, the safetensors headers and the tokenizer, before any worker starts."""
    init_from.check(rc, resolve_flavor(rc.model)[1])


def build(cfg: ModelConfig, device, *, seq_len: int, seed: int, tt_parallelism=None, tokenizer=None,
          load_init_from: bool = True):
    # deferred: start-up (this spec is read by the config checks, which exit before torch loads; the model loads it)
    from qwen3_research.models.native.model import NativeQwen3

    cfg = registry.canonical(cfg)
    name, flavor = resolve_flavor(cfg)
    if tokenizer is not None and tokenizer.vocab_size > flavor.vocab_size:
        raise ConfigError(
            f"data.tokenizer has {tokenizer.vocab_size} tokens but model.flavor={name} has "
            f"{flavor.vocab_size} embedding rows; use the Qwen3 tokenizer or a larger vocabulary"
        )
    # With init_from the weights are read after sharding, each rank its own part (NativeQwen3.materialize).
    return NativeQwen3(cfg, device, seq_len, seed, tt_parallelism, flavor=flavor, flavor_name=name,
                       init_from=cfg.init_from if load_init_from else None)


BACKEND = BackendSpec(
    name="native", describe=describe, build=build, flavors=FLAVORS, takes_init_from=True, torchtitan=True,
    hf_model_types=tuple(hf_config.MODEL_TYPES), check_run=check_run, check_init_from=check_init_from,
    tokenizer_dir=lambda cfg: cfg.init_from, flops_per_token=flops_per_token,
    architecture=lambda cfg: resolve_flavor(cfg)[1], balance_modes=BALANCE_MOE, balance_modes_for=balance_modes,
    document_masking=True, renames={"native_moe": NATIVE_MOE_RENAMES},
)
