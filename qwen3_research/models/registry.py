"""Model backends by name: what each one declares (``BackendSpec``) and where the registry finds it.

``model.backend=NAME`` names a backend. Its module is ``model.module`` when the model config sets it
(an out-of-tree backend: any importable module, e.g. ``mylab.backends.toy``), else, by convention,
``qwen3_research.models.NAME``. That module defines ``BACKEND``: a ``BackendSpec`` named NAME. Adding a
backend is that one module plus one ``conf/model/<option>.yaml`` (``backend: NAME``, and ``module:`` for an
out-of-tree one); nothing else in the package names a backend (tests/test_backends.py adds one that way).

A spec says, without importing torch: how to describe the model for validation (heads, experts), how to
build it (the only part that imports torch), which flavors it has, whether it takes ``model.path`` /
``model.init_from``, its own config checks, which HF directory brings the tokenizer, its FLOPs per token
before any build, its architecture for closed-form estimates, and the Hugging Face ``model_type`` it
reads and writes. The generic rules (unknown flavor, ``model.path`` required, ``model.init_from`` refused)
are ``check`` below, from those declarations.

A backend's own folder holds its Hugging Face mapping (``models/native/``: config.json <-> flavor, safetensors
load and export, the ``model.init_from`` checks, which its spec exposes as ``check_init_from``). A spec may also
answer for names it had before (``renames``: ``native_moe`` and its flavors, now ``model=native``):
``canonical`` reads an old checkpoint's, plan's or run directory's model config as today's.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

from qwen3_research.compose import CONF_DIR
from qwen3_research.config import ModelConfig, RunConfig
from qwen3_research.errors import ConfigError

# model.flavor values that take the architecture from model.init_from's config.json (``from_hf``; ``auto``
# means the same with init_from and the backend's default without); ``config.default_flavor`` sets them.
FROM_CHECKPOINT = ("auto", "from_hf")


def _nan_flops(cfg: ModelConfig, seq_len: int) -> float:
    return float("nan")


def _no_architecture(cfg: ModelConfig):
    return None


def _hf_directory(cfg: ModelConfig) -> Optional[str]:
    return cfg.path or cfg.init_from


@dataclass(frozen=True)
class BackendSpec:
    """One model backend, as the rest of the package sees it before (and while) building it."""

    name: str  # the model.backend value
    # ModelConfig -> {"n_heads", "n_kv_heads", "num_experts", "is_moe"} for degree validation; no torch import.
    describe: Callable[[ModelConfig], dict]
    # (cfg, torch.device, *, seq_len, seed, tt_parallelism, tokenizer, load_init_from) -> models.base.ModelBackend
    build: Callable[..., Any]
    flavors: Mapping[str, Any] = field(default_factory=dict)  # model.flavor names (empty: the backend has none)
    takes_path: bool = False  # model.path (an HF directory or Hub id) names the model: required
    takes_init_from: bool = False  # model.init_from (an HF directory) gives the weights and architecture
    moe: bool = False  # every model of this backend is a mixture of experts (else: per flavor, ``describe``)
    torchtitan: bool = False  # built from torchtitan's Qwen3: the installed torchtitan's limits apply
    hf_model_types: tuple = ()  # config.json model_types it imports (init_from) and exports
    check: Optional[Callable[[ModelConfig], None]] = None  # its own config checks (ConfigError), after the generic ones
    check_run: Optional[Callable[[RunConfig], None]] = None  # whole-run checks before any worker starts
    # model.init_from checked in the launching process before any worker starts (config.json, safetensors
    # headers, tokenizer; no weights read): ConfigError, one line. None: the backend takes no init_from.
    check_init_from: Optional[Callable[[RunConfig], None]] = None
    # The HF directory whose tokenizer.json (when it has one) replaces data.tokenizer=qwen3.
    tokenizer_dir: Callable[[ModelConfig], Optional[str]] = _hf_directory
    # Training FLOPs per token (forward + backward) known before any build (the planner); NaN when only the
    # built model knows (ModelBackend.flops_per_token).
    flops_per_token: Callable[[ModelConfig, int], float] = _nan_flops
    # The architecture (models.flavors.Flavor) for closed-form estimates; None when the backend has none.
    architecture: Callable[[ModelConfig], Any] = _no_architecture
    # doctor --run: overrides a tiny 2-step run of this backend needs (it may write files under the directory).
    smoke_overrides: Callable[[Path], list] = lambda tmp: []
    # model.moe.balance values it runs (qwen3_research.routing); the first is its default without a checkpoint.
    balance_modes: tuple = ("none",)
    # The values one configured model runs, where they depend on it (native: a dense flavor has "none" only);
    # None: ``balance_modes`` for every model. Asked through ``registry.balance_modes(cfg)``.
    balance_modes_for: Optional[Callable[[ModelConfig], tuple]] = None
    # data.document_masking: forward(inputs, positions=...) restarts attention and RoPE at each document.
    document_masking: bool = False
    # training.loss=chunked: the model gives hidden_states(inputs) and lm_head_weight (qwen3_research.loss.lm_loss);
    # without them training.loss=auto is the full loss on every device, and chunked is a config error.
    chunked_loss: bool = True
    # torch.compile per block under tensor parallelism (compiling.TP_UNCOMPILABLE: false refuses compile with tp)
    compiles_under_tp: bool = True
    # Names it answers for besides its own: {old backend name: {old flavor: its flavor now}} (a flavor not listed
    # keeps its name). model.backend=<old name> is read as this backend (``canonical``).
    renames: Mapping[str, Mapping[str, str]] = field(default_factory=dict)


@functools.lru_cache(maxsize=None)
def _load(name: str, module: Optional[str]) -> BackendSpec:
    where = module or f"qwen3_research.models.{name}"
    unknown = ConfigError(f"model.backend={name!r} is not one of {in_tree()}; an out-of-tree backend names its "
                          "module in model.module")
    if module is None and not name.isidentifier():
        raise unknown
    try:
        mod = importlib.import_module(where)
    except ModuleNotFoundError as e:
        if module is None and e.name == where:
            raise unknown from None
        raise ConfigError(f"model.module={where!r} (model.backend={name!r}) cannot be imported ({e}); put it on "
                          "PYTHONPATH or fix model.module") from None
    except Exception as e:  # noqa: BLE001 - the backend module's own error: one line naming it
        first = (str(e).strip().splitlines() or [""])[0]
        raise ConfigError(f"model.module={where!r} (model.backend={name!r}) failed to import: "
                          f"{type(e).__name__}: {first}") from None
    spec = getattr(mod, "BACKEND", None)
    if not isinstance(spec, BackendSpec) or spec.name != name:
        found = f"BACKEND named {spec.name!r}" if isinstance(spec, BackendSpec) else "no BACKEND (a BackendSpec)"
        raise ConfigError(f"model.backend={name!r}: module {where} defines {found}; define "
                          f"BACKEND = BackendSpec(name={name!r}, ...) there")
    return spec


def get(name: str, module: Optional[str] = None) -> BackendSpec:
    """The spec of backend ``name`` (from ``module``, or qwen3_research.models.<name>; an old name an in-tree
    spec answers for, ``renames``, gives that spec); ConfigError if none."""
    if not module and name in _renamed():
        name = _renamed()[name]
    return _load(name, module or None)


def spec(cfg: ModelConfig) -> BackendSpec:
    """The spec of the configured backend (``model.backend``, ``model.module``)."""
    return get(cfg.backend, getattr(cfg, "module", None))


@functools.lru_cache(maxsize=None)
def _renamed() -> dict[str, str]:
    """{old backend name: the in-tree backend that answers for it now}."""
    return {old: n for n in _in_tree() for old in _load(n, None).renames}


def canonical(cfg):
    """``cfg`` (a ModelConfig, or a config's model section as a dict) with today's backend and flavor names: an old
    name an in-tree spec answers for (``renames``: model.backend=native_moe model.flavor=tiny -> native, tiny_moe) is
    replaced; anything else is returned as it is. A flavor read from model.init_from (auto/from_hf with it) stays."""
    get_ = cfg.get if isinstance(cfg, dict) else functools.partial(getattr, cfg)
    backend, flavor = get_("backend", None), get_("flavor", None)
    if get_("module", None) or backend not in _renamed():
        return cfg
    owner = _renamed()[backend]
    if not (flavor in FROM_CHECKPOINT and get_("init_from", None)):
        flavor = _load(owner, None).renames[backend].get(flavor, flavor)
    if isinstance(cfg, dict):
        return {**cfg, "backend": owner, "flavor": flavor}
    return dataclasses.replace(cfg, backend=owner, flavor=flavor)


def balance_modes(cfg) -> tuple:
    """model.moe.balance values the configured model runs (its spec's ``balance_modes_for``, else its
    ``balance_modes``); the first is its default without a checkpoint. ``cfg``: a ModelConfig or a model section."""
    if isinstance(cfg, dict):
        known = {f.name for f in dataclasses.fields(ModelConfig)} - {"moe"}
        cfg = ModelConfig(**{k: v for k, v in cfg.items() if k in known})
    cfg = canonical(cfg)
    s = spec(cfg)
    return s.balance_modes_for(cfg) if s.balance_modes_for is not None else s.balance_modes


@functools.lru_cache(maxsize=None)
def _options() -> tuple[tuple[str, str], ...]:
    from omegaconf import OmegaConf

    found = ((p.stem, str(OmegaConf.load(p).get("backend"))) for p in sorted(Path(CONF_DIR, "model").glob("*.yaml")))
    return tuple((o, b) for o, b in found if b != "None")


def _in_tree() -> tuple[str, ...]:
    return tuple(sorted({b for _, b in _options()}))


def options() -> dict[str, str]:
    """The shipped ``model=`` options (conf/model/*.yaml) and the backend each one configures (a preset such as
    native_moe: native with a MoE flavor)."""
    return dict(_options())


def in_tree() -> list[str]:
    """The backends shipped with the package: the ``backend`` of every conf/model option, sorted."""
    return list(_in_tree())


def check(cfg: ModelConfig) -> BackendSpec:
    """The rules every backend's declarations imply, then its own ``check``; returns the spec."""
    cfg = canonical(cfg)
    s = spec(cfg)
    if s.takes_path and not cfg.path:
        raise ConfigError(f"model.path is required with model={s.name}: a local HF directory or a Hub id")
    if cfg.init_from and not s.takes_init_from:
        takers = "|".join(n for n in in_tree() if get(n).takes_init_from)
        hint = f"with model={s.name} use model.path" if s.takes_path else f"model={s.name} builds without it"
        raise ConfigError(f"model.init_from is for model={takers}; {hint}")
    from_checkpoint = cfg.flavor == "auto" or (cfg.flavor in FROM_CHECKPOINT and cfg.init_from)
    if s.flavors and cfg.flavor not in s.flavors and not from_checkpoint:
        raise ConfigError(f"model.flavor={cfg.flavor!r} is not a {s.name} flavor; choose one of {list(s.flavors)}")
    balance = getattr(getattr(cfg, "moe", None), "balance", "auto")
    modes = balance_modes(cfg)
    if balance != "auto" and balance not in modes:
        raise ConfigError(f"model.moe.balance={balance} is not available with model={s.name}; choose one of "
                          f"{['auto', *modes]}" + (f" for model.flavor={cfg.flavor}" if modes != s.balance_modes else ""))
    if s.check is not None:
        s.check(cfg)
    return s


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token before any build (NaN where only the built model knows)."""
    cfg = canonical(cfg)
    value = spec(cfg).flops_per_token(cfg, seq_len)
    return float(value) if value is not None else math.nan
