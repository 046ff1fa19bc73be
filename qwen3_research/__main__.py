"""``python -m qwen3_research [group=option ...] [key=value ...]``: compose, validate, launch.

A single run is composed once up front so that a bad key, type or option is reported as
one line (exit status 2) before Hydra creates a run directory. Multirun sweeps go straight
to Hydra; each point validates itself and a bad point fails alone.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from qwen3_research.config import ConfigError, register_configs

CONF_DIR = str(Path(__file__).resolve().parent.parent / "conf")
EXIT_CONFIG = 2
EXIT_FAILED = 1

register_configs()


def _split_argv(argv: list[str]) -> tuple[list[str], bool]:
    """The plain overrides, and whether this invocation is handled by Hydra alone."""
    hydra_only = {"-m", "--multirun", "--help", "-h", "--hydra-help", "--info", "-i", "--cfg", "-c",
                  "--config-dir", "-cd", "--config-name", "-cn", "--shell-completion", "-sc", "--version",
                  "--config-path", "-cp", "--experimental-rerun", "--resolve", "--package", "-p"}
    overrides, passthrough = [], False
    for a in argv:
        head = a.split("=", 1)[0]
        if a.startswith("-"):
            passthrough = passthrough or head in hydra_only
        else:
            overrides.append(a)
    return overrides, passthrough


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
            options = [ln.strip() for ln in text.splitlines()[1:] if ln.startswith("\t")]
            group = getattr(err, "missing_cfg_file", "") or ""
            hint = f"; available: {', '.join(options)}" if options else ""
            return f"config error: {first.strip()} ({group}){hint}"
    first = next((ln for ln in str(e).splitlines() if ln.strip()), type(e).__name__)
    return f"config error: {first.strip()}"


def preflight(overrides: list[str]) -> None:
    """Compose and validate once; exit 2 with one line on any configuration error."""
    from hydra import compose, initialize_config_dir
    from qwen3_research import models
    from qwen3_research.config import to_run_config, validate
    from qwen3_research.parallel import validate_degrees

    try:
        with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
            cfg = compose(config_name="config", overrides=overrides)
    except Exception as e:  # noqa: BLE001 - Hydra raises several types; all are config errors here
        _die(format_compose_error(e))
    try:
        rc = validate(to_run_config(cfg))  # also catches a '+key=' that bypassed the struct check
        # Under torchrun, also check the degrees against the world size it started.
        world = int(os.environ["WORLD_SIZE"]) if os.environ.get("TORCHELASTIC_RUN_ID") and "WORLD_SIZE" in os.environ else None
        validate_degrees(rc.parallelism, seq_len=rc.data.seq_len, world_size=world, **models.describe(rc.model))
    except ConfigError as e:
        _die(f"config error: {e}")


def _die(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
    sys.exit(EXIT_CONFIG)


def _wandb_identity() -> tuple[str | None, str | None, dict]:
    """Multirun: one group per sweep (its directory, fixed once), a run name and the swept keys
    from the point's overrides."""
    from omegaconf import OmegaConf

    from qwen3_research.sweep import parse_overrides, swept_keys_of_this_sweep

    hc = HydraConfig.get()
    if hc.mode.name != "MULTIRUN":
        return None, None, {}
    sweep_dir = Path(hc.sweep.dir)
    group = f"sweep_{sweep_dir.parent.name}_{sweep_dir.name}"
    overrides = parse_overrides(list(hc.overrides.task))
    params = OmegaConf.to_container(hc.sweeper.params) if hc.sweeper.get("params") else {}
    keys = swept_keys_of_this_sweep(params, sys.argv[1:])
    # In-process launchers see the sweep's command line; elsewhere every override counts.
    swept = {k: v for k, v in overrides.items() if k in keys} or overrides
    name = ",".join(f"{k}={v}" for k, v in swept.items()) or f"job{hc.job.num}"
    return group, name, swept


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="config")
def _task(cfg: DictConfig):
    from qwen3_research.errors import TrainingError, WorkerGroupError
    from qwen3_research.launch import run
    from qwen3_research.signals import Interrupted

    hc = HydraConfig.get()
    group, name, swept = _wandb_identity()
    multirun = hc.mode.name == "MULTIRUN"
    try:
        summary = run(cfg, hc.runtime.output_dir, wandb_group=group, wandb_name=name, swept=swept)
        if multirun and "optuna" in str(hc.sweeper.get("_target_", "")):
            # Optuna minimises what the task returns: the held-out loss when there is one.
            return summary.get("final_eval_loss") or summary["final_loss"]
        return summary
    except Exception as e:  # noqa: BLE001
        if multirun and isinstance(e, Interrupted) and os.environ.get("SLURM_JOB_ID"):
            # Preempted/requeued Slurm job: checkpoint saved; exit 128+signal without a result, so that
            # submitit keeps waiting for the requeued job, which resumes (launch._resume_when_requeued).
            print(str(e), file=sys.stderr, flush=True)
            sys.exit(e.exit_status)
        if multirun:
            # Hydra's basic sweeper aborts the sweep on a job exception; a failed point must not.
            # launch.run already wrote its summary.json (status failed + reason) for the report.
            print(f"sweep point {hc.job.num} failed: {str(e).splitlines()[0] if str(e) else type(e).__name__}",
                  file=sys.stderr, flush=True)
            return {"status": "failed", "reason": str(e)}
        if isinstance(e, ConfigError):
            _die(f"config error: {e}")
        if isinstance(e, Interrupted):
            print(str(e), file=sys.stderr, flush=True)
            sys.exit(e.exit_status)
        if isinstance(e, (WorkerGroupError, TrainingError)):
            print(f"error: {e}", file=sys.stderr, flush=True)
            sys.exit(EXIT_FAILED)
        raise


def main() -> None:
    overrides, passthrough = _split_argv(sys.argv[1:])
    try:  # hydra/launcher=slurm: partition and node count, before anything is submitted
        from qwen3_research.slurm import preflight as slurm_preflight

        slurm_preflight(overrides, CONF_DIR)
    except ConfigError as e:
        _die(f"config error: {e}")
    if not passthrough:
        preflight(overrides)
        from qwen3_research.launch import torchrun_overrides, under_torchrun

        if under_torchrun():  # one run dir for all ranks, agreed before Hydra creates it
            sys.argv += torchrun_overrides(overrides, CONF_DIR)
    _task()


if __name__ == "__main__":
    main()
