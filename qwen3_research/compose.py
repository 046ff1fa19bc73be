"""Hydra composition outside ``@hydra.main``: the packaged config directory, one compose call, one-line errors.

Every place that composes a run config before (or beside) Hydra's own run -- the CLI's preflight and
run-dir check, the torchrun run-dir agreement, the planner, a sweep's plan of its points, the Slurm
preflight, the doctor, ``verify_kernels`` -- calls ``compose`` here, so all of them read the same
``conf/`` (``CONF_DIR``) and report a bad override as the same one line (``format_compose_error``).
"""

from __future__ import annotations

from pathlib import Path

from qwen3_research import overrides
from qwen3_research.config import register_configs
from qwen3_research.errors import ConfigError, log_call


def find_conf_dir() -> str:
    """The config tree: ``conf/`` at the repository root, which setuptools installs as the package
    ``qwen3_research.conf`` (setup.py maps the folder; pyproject.toml's package-data takes its YAML).

    A wheel or ``pip install .`` puts it inside the installed package (``<site>/qwen3_research/conf``); a checkout
    and an editable install import the package from the checkout, whose ``conf/`` is beside it. The first of the
    two that holds ``config.yaml``."""
    package = Path(__file__).resolve().parent
    candidates = (package / "conf", package.parent / "conf")
    for conf in candidates:
        if (conf / "config.yaml").is_file():
            return str(conf)
    raise ConfigError(f"no config tree: neither {candidates[0]} nor {candidates[1]} holds config.yaml "
                      "(reinstall the package, or run from a checkout)")


CONF_DIR = find_conf_dir()


def compose(overrides: list[str], *, config_name: str = "config", searchpath: list[str] | None = None,
            return_hydra_config: bool = False):
    """The composed (unresolved) DictConfig for ``overrides``: conf/config.yaml, or ``config_name`` found on
    the first ``searchpath`` entry with the others and conf/ searched after it (a sweep file given with
    ``--config-dir sweeps --config-name tp_seq``: Hydra finds a primary config only in the first directory).

    Any composition error is a ConfigError whose text is ``format_compose_error``'s line without its
    ``config error: `` prefix. Inside a running Hydra app (a sweep's callback) the app's Hydra is put aside
    for the call and restored after it."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    log_call("compose")
    register_configs()  # the schemas the YAML options extend (idempotent)
    gh = GlobalHydra.instance()
    outer = gh.hydra if gh.is_initialized() else None
    if outer is not None:
        gh.clear()
    try:
        first, extra = CONF_DIR, []
        if searchpath:
            first = searchpath[0].split("://", 1)[-1]
            extra = [f"hydra.searchpath=[{','.join([*searchpath[1:], 'file://' + CONF_DIR])}]"]
        with initialize_config_dir(config_dir=first, version_base="1.3"):
            return hydra_compose(config_name=config_name, overrides=[*extra, *overrides],
                                 return_hydra_config=return_hydra_config)
    except Exception as e:  # noqa: BLE001 - Hydra raises several types; all are config errors here
        raise ConfigError(format_compose_error(e).removeprefix("config error: ")) from None
    finally:
        if outer is not None:
            GlobalHydra.instance().clear()
            GlobalHydra.instance().initialize(outer)


def compose_resolved(overrides: list[str], *, config_name: str = "config", searchpath: list[str] | None = None) -> dict:
    """``compose``'s config with every interpolation resolved, as a plain dict (what the planner takes)."""
    from omegaconf import OmegaConf

    return OmegaConf.to_container(compose(overrides, config_name=config_name, searchpath=searchpath), resolve=True)


def format_compose_error(e: BaseException) -> str:
    """One line naming the key (or group) and what to do, from Hydra/OmegaConf's exception."""
    from hydra.errors import MissingConfigException
    from omegaconf.errors import OmegaConfBaseException

    chain, cur = [], e
    while cur is not None and cur not in chain:
        chain.append(cur)
        cur = cur.__cause__ or cur.__context__
    for err in chain:
        if isinstance(err, OmegaConfBaseException) and getattr(err, "full_key", None):
            msg = str(getattr(err, "msg", None) or err).splitlines()[0]
            if "not in struct" in msg or "not in" in msg and "Key" in msg:
                return f"config error: {err.full_key}: unknown key ({msg}); check the spelling, or print valid keys with --cfg job"
            return f"config error: {err.full_key}: {msg}"
    for err in chain:
        if isinstance(err, MissingConfigException):
            text = str(err)
            first = text.splitlines()[0]
            listing = text.split("Config search path", 1)[0]  # the options, not the search path after them
            options = [ln.strip() for ln in listing.splitlines()[1:] if ln.startswith("\t")]
            group = getattr(err, "missing_cfg_file", "") or ""
            hint = f"; available: {', '.join(options)}" if options else ""
            return f"config error: {first.strip()} ({group}){hint}"
    first = next((ln for ln in str(e).splitlines() if ln.strip()), type(e).__name__)
    return f"config error: {first.strip()}"


def swept_keys_of_this_sweep(sweeper_params: dict | None, argv: list[str]) -> set[str]:
    """Keys the sweep varies: the sweeper's params plus command-line overrides with sweep syntax."""
    return {str(k) for k in (sweeper_params or {})} | overrides.swept_keys(argv)


# A sweep point's directory name (hydra.sweep.subdir in conf/config.yaml): its number and the swept keys' values,
# never a fixed override's. Hydra's override_dirname named it after every override with the values verbatim: a `/`
# in a value (data.files=/data/*.txt, model.path, model.init_from, data.hf.name=org/set) nested each point five
# directories deep (the report then found no point: "the sweep has no points", exit 2), and ~15 overrides gave
# `OSError: File name too long`.
POINT_DIR_MAX = 80  # characters; a longer name keeps its first part and a hash of the whole
_POINT_VALUE_SAFE = "._-+"  # every other character of a value is percent-encoded (no `/`; reversible: no collisions)


def point_dir_name(num, point_overrides: list[str], swept: set[str] | None) -> str:
    """``<num>_<key>=<value>,…`` over the swept keys (all overrides when ``swept`` is None, e.g. a launcher that
    does not see the sweep's command line), values percent-encoded; over POINT_DIR_MAX characters, the first
    part and a short hash of the whole name."""
    import hashlib
    from urllib.parse import quote

    items = [f"{quote(key, safe=_POINT_VALUE_SAFE)}={quote(value, safe=_POINT_VALUE_SAFE)}"
             for key, value in overrides.point_values(point_overrides).items() if swept is None or key in swept]
    name = f"{num}_{','.join(items)}" if items else str(num)
    if len(name) > POINT_DIR_MAX:
        name = f"{name[:POINT_DIR_MAX - 9]}~{hashlib.sha256(name.encode()).hexdigest()[:8]}"
    return name


def _point_dir_resolver(*, _root_) -> str:
    import sys

    from omegaconf import OmegaConf

    hc = _root_.hydra
    params = OmegaConf.to_container(hc.sweeper.params) if hc.sweeper.get("params") else {}
    swept = swept_keys_of_this_sweep(params, sys.argv[1:]) or None
    return point_dir_name(hc.job.num, list(hc.overrides.task), swept)


def register_resolvers() -> None:
    """``${qwen3_point_dir:}`` (hydra.sweep.subdir); once per process, before Hydra resolves a job's directory."""
    from omegaconf import OmegaConf

    if not OmegaConf.has_resolver("qwen3_point_dir"):
        OmegaConf.register_new_resolver("qwen3_point_dir", _point_dir_resolver)


register_resolvers()
