"""``python -m qwen3_research [group=option ...] [key=value ...]``: compose, validate, launch.

A single run is composed once up front so that a bad key, type or option is reported as
one line (exit status 2) before Hydra creates a run directory. Multirun sweeps go straight
to Hydra; each point validates itself and a bad point fails alone.
"""

from __future__ import annotations

BEFORE_TRAINING = "before training started; nothing was written"  # what a Ctrl-C while importing says

if __name__ == "__main__":  # Ctrl-C / SIGTERM before main() runs: 128+signal, one line, no traceback
    from qwen3_research import allocator, startup

    allocator.ensure("qwen3_research")  # first: may re-exec this command with mimalloc preloaded (allocator.py)
    # numpy_first=False: numpy, then torch, load once the config composed (preflight), so a config error loads neither
    startup.exit_at_once_while_importing(BEFORE_TRAINING, numpy_first=False)

import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import hydra  # noqa: E402
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from qwen3_research import overrides, resolve, slurm
from qwen3_research.compose import CONF_DIR, compose, format_compose_error
from qwen3_research.config import register_configs
from qwen3_research.errors import AlreadyComplete, ConfigError, ExportError, TrainingError, WorkerGroupError
from qwen3_research.launch.slurm import preflight as slurm_preflight
from qwen3_research.launch.sweep import prepare_point, stop_sweep, swept_keys_of_this_sweep, wandb_group
from qwen3_research.signals import Interrupted, Terminated, raise_terminated, signal_number
from qwen3_research.startup import import_numpy_before_torch, quiet_libraries

EXIT_CONFIG = 2
EXIT_FAILED = 1

register_configs()  # before @hydra.main composes: the schemas the YAML options extend


# Hydra's flags that take a value (the next word is not an override); --info's value is optional.
_VALUE_FLAGS = {"--cfg", "-c", "--package", "-p", "--config-dir", "-cd", "--config-name", "-cn", "--config-path",
                "-cp", "--experimental-rerun", "--shell-completion", "-sc"}
_INFO_VALUES = {"all", "config", "defaults", "defaults-tree", "plugins", "searchpath"}
_HYDRA_ONLY = {"-m", "--multirun", "--help", "-h", "--hydra-help", "--info", "-i", "--version", "--resolve",
               *_VALUE_FLAGS}
# Invocations whose overrides are composed against conf/config.yaml as they are: checked up front too.
_CHECKED_FLAGS = {"-m", "--multirun", "--cfg", "-c", "--resolve", "--package", "-p"}


def _split_argv(argv: list[str]) -> tuple[list[str], set[str]]:
    """The plain overrides, and the Hydra flags given (a non-empty set: Hydra runs the invocation)."""
    texts, flags = [], set()
    it = iter(range(len(argv)))
    for i in it:
        a = argv[i]
        head = a.split("=", 1)[0]  # why: a flag's name (--config-name=x), argparse's syntax, not an override's
        if a.startswith("-"):
            if head in _HYDRA_ONLY:
                flags.add(head)
            takes_value = head in _VALUE_FLAGS or (head in ("--info", "-i") and i + 1 < len(argv)
                                                    and argv[i + 1] in _INFO_VALUES)
            if takes_value and "=" not in a:
                next(it, None)  # the flag's value
        else:
            texts.append(a)
    return texts, flags


def check_override_syntax(texts: list[str]) -> None:
    """Every override is key=value (or ~key) in Hydra's grammar; else one line naming it, and the quoting
    that makes a value with spaces, parentheses, brackets, commas or quotes parse (a path, usually)."""
    for i, o in enumerate(texts):
        try:
            overrides.parse_one(o)
            continue
        except Exception as e:  # noqa: BLE001 - Hydra's OverrideParseException, or a lexer error inside it
            why = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), type(e).__name__)
        prefix, key, value = overrides.split_text(o)  # Hydra refused it: its parts by their characters
        if value is None and prefix != "~":
            prev = overrides.parse_one(texts[i - 1]) if i else None  # parsed: the loop stops at the first refusal
            hint = (f"; if it is the rest of {prev.head}'s value (the shell splits at spaces), quote the whole "
                    f"override: {_quoted(prev.head, prev.value + ' ' + o)}") if prev and prev.value is not None else ""
            _die(f"config error: {o!r} is not an override; write key=value (e.g. training.steps=10) or group=option "
                 f"(e.g. model=native_moe); list them with --help{hint}")
        _die(f"config error: {prefix + key}: Hydra cannot parse the value {value or ''!r} ({why}); "
             f"{_quoting_advice(prefix + key, value or '')}")


def _quoting_advice(key: str, value: str) -> str:
    """How to quote ``value`` so that Hydra parses it. Hydra's grammar takes a non-ASCII character only inside quotes,
    so a sweep (``a,b``) or a list (``[a,b]``) with one is quoted value by value: quoting the whole (the advice
    for a path with spaces) turned a sweep of two values into one string (issue 40 weak case)."""
    parts = value[1:-1].split(",") if value[:1] == "[" and value[-1:] == "]" else value.split(",")
    if any(ord(c) > 127 for c in value) and not any(q in value for q in "'\"") and (len(parts) > 1 or value[:1] == "["):
        import shlex  # deferred: only a refused override prints advice

        each = ",".join(json.dumps(p.strip(), ensure_ascii=False) for p in parts)
        word = f"{key}=[{each}]" if value[:1] == "[" else f"{key}={each}"
        return f"quote each value (Hydra takes non-ASCII characters only inside quotes): {shlex.quote(word)}"
    return f"quote it: {_quoted(key, value)}"


def _quoted(key: str, value: str) -> str:
    """``key="value"`` for Hydra (a double-quoted string; " escaped), quoted once more for the shell."""
    import shlex

    inner = value[1:-1] if len(value) > 1 and value[0] == value[-1] and value[0] in "'\"" else value
    escaped = inner.replace('"', '\\"')
    word = f'{key}="{escaped}"'
    if "'" not in word:
        return shlex.quote(word)
    return '"' + "".join("\\" + c if c in '\\"$`' else c for c in word) + '"'  # the shell's double quotes


def preflight_overrides(texts: list[str]) -> None:
    """A sweep or ``--cfg``: the keys, types and options of the overrides, composed once with the first
    value of every swept key, so a typo is one line (exit 2) as for a single run. Values are not
    validated here: an impossible point of a sweep fails alone (sweep report, exit 3)."""
    try:
        firsts = overrides.first_values(texts)
    except Exception as e:  # noqa: BLE001 - Hydra's parser raises several types; all are config errors here
        _die(format_compose_error(e))
    try:
        compose(firsts)
    except ConfigError as e:
        _die(f"config error: {e}")


# The run this process resolved before Hydra started (``preflight``), keyed by the overrides it was composed from:
# Hydra's task function hands it to the launcher instead of resolving it again.
_RESOLVED: tuple[tuple[str, ...], object] | None = None


def _task_key(texts) -> tuple[str, ...]:
    """The overrides Hydra hands the task (``hydra.overrides.task``): those of the config, not of Hydra itself."""
    return tuple(o.text for o in overrides.parse(texts) if not overrides.is_hydra_key(o.key))


def preflight(texts: list[str]) -> str | None:
    """Compose once and resolve once (``resolve.resolve_before_hydra``: ``resolve.resolve_run``, the same
    checks the launcher and every other entry point make, the kernel targets on a meta-device model included, then
    the run dir); exit 2 with one line on any configuration error, before Hydra creates anything. The result is
    kept for Hydra's task function (``_RESOLVED``). Returns the run dir checked (None: Hydra's run resolves it, or
    a rank other than 0 under torchrun, which gets rank 0's)."""
    global _RESOLVED
    try:
        composed = compose(texts, return_hydra_config=True)
        import_numpy_before_torch(BEFORE_TRAINING)  # the config composed: torch may load from here (resolve)
        cfg = OmegaConf.masked_copy(composed, [k for k in composed if k != "hydra"])
        _quiet_c10d_retries(OmegaConf.select(cfg, "parallelism.nnodes", throw_on_resolution_failure=False))
        try:
            run_dir = str(composed.hydra.run.dir)
        except Exception:  # noqa: BLE001 - an interpolation only Hydra's run can resolve: launch.elastic.run checks it
            run_dir = None
        run = resolve.resolve_before_hydra(cfg, run_dir)
    except ConfigError as e:
        _die(f"config error: {e}")
    except AlreadyComplete as done:  # a finished run asked to resume: nothing to train, nothing written
        print(str(done), flush=True)
        sys.exit(0)
    _RESOLVED = (_task_key(texts), run)
    return run.run_dir


def _launch():
    """The launcher (``launch.elastic``: torch, the Trainer, the models)."""
    # deferred: start-up (a bad override, key or value exits with one line before torch loads)
    from qwen3_research.launch import elastic

    return elastic


def _quiet_c10d_retries(nnodes) -> None:
    """A multi-node launcher waits for the other nodes at parallelism.rdzv_endpoint, and torch's TCPStore logs
    every failed try from C++ with a stack of frames (~100-200 lines for an unreachable endpoint) before
    launch reports the failed rendezvous in one line. c10 reads TORCH_CPP_LOG_LEVEL once, when torch loads:
    it is set while this process imports torch, then removed, so the workers start with the user's level."""
    if isinstance(nnodes, int) and nnodes > 1 and "torch" not in sys.modules and "TORCH_CPP_LOG_LEVEL" not in os.environ:
        os.environ["TORCH_CPP_LOG_LEVEL"] = "FATAL"
        try:
            import torch  # noqa: F401
        finally:
            del os.environ["TORCH_CPP_LOG_LEVEL"]


def _die(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
    sys.exit(EXIT_CONFIG)


def _wandb_identity() -> tuple[str | None, str | None, dict]:
    """Multirun: one group per sweep (its directory, fixed once), a run name and the swept keys
    from the point's overrides."""
    hc = HydraConfig.get()
    if hc.mode.name != "MULTIRUN":
        return None, None, {}
    sweep_dir = Path(hc.sweep.dir)
    group = wandb_group(sweep_dir)
    values = overrides.point_values(hc.overrides.task)
    params = OmegaConf.to_container(hc.sweeper.params) if hc.sweeper.get("params") else {}
    keys = swept_keys_of_this_sweep(params, sys.argv[1:])
    # In-process launchers see the sweep's command line; elsewhere every override counts.
    swept = {k: v for k, v in values.items() if k in keys} or values
    name = ",".join(f"{k}={v}" for k, v in swept.items()) or f"job{hc.job.num}"
    return group, name, swept


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="config")
def _task(cfg: DictConfig):
    quiet_libraries()  # after Hydra configured this job's logging
    hc = HydraConfig.get()
    group, name, swept = _wandb_identity()
    multirun = hc.mode.name == "MULTIRUN"
    prediction = None
    if multirun:  # resumed (already ok) or predicted not to fit: not started (qwen3_research.launch.sweep)
        # resolved: the resolution the point's plan made, when it runs that config (not resolved again)
        try:
            done, prediction, cfg, resolved = prepare_point(cfg, hc.runtime.output_dir, list(hc.overrides.task),
                                                            hc.sweep.dir)
        except ConfigError as e:  # the point's directory is another live process's: the sweep stops, one line
            _die(f"config error: {e}")
        if done is not None:
            return done
    else:  # the run resolved (and its run dir checked) before Hydra started, when it is this one: not resolved again
        resolved = _RESOLVED[1] if _RESOLVED and _RESOLVED[0] == _task_key(hc.overrides.task) else None
    try:
        summary = _launch().run(cfg, hc.runtime.output_dir, resolved=resolved, wandb_group=group, wandb_name=name, swept=swept,
                      prediction=prediction)
        if multirun and "optuna" in str(hc.sweeper.get("_target_", "")):
            # Optuna minimises what the task returns: the held-out loss when there is one.
            return summary.get("final_eval_loss") or summary["final_loss"]
        return summary
    except (Interrupted, KeyboardInterrupt, Terminated) as e:
        if multirun and slurm.job_id():
            # Preempted/requeued Slurm job: checkpoint saved; exit 128+signal without a result, so that
            # submitit keeps waiting for the requeued job, which resumes (launch.elastic._resume_when_requeued).
            if isinstance(e, Interrupted):
                print(str(e), file=sys.stderr, flush=True)
            sys.exit(128 + signal_number(e))
        if multirun:  # a signal stops the whole sweep, not only this point (the point saved as a run does)
            sys.exit(stop_sweep(Path(hc.sweep.dir), hc.runtime.output_dir, e))
        if isinstance(e, Interrupted):
            print(str(e), file=sys.stderr, flush=True)
            sys.exit(e.exit_status)
        raise
    except Exception as e:  # noqa: BLE001
        if multirun:
            # Hydra's basic sweeper aborts the sweep on a job exception; a failed point must not.
            # launch.elastic.run already wrote its summary.json (status failed + reason) for the report.
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            # a config error is the point's refusal, made before any of its workers started
            print(f"sweep point {hc.job.num} refused: config error: {first}" if isinstance(e, ConfigError)
                  else f"sweep point {hc.job.num} failed: {first}", file=sys.stderr, flush=True)
            return {"status": "failed", "reason": str(e)}
        if isinstance(e, ConfigError):
            _die(f"config error: {e}")
        if isinstance(e, (WorkerGroupError, TrainingError, ExportError)):  # ExportError: checkpoint.export_hf=true
            print(f"error: {e}", file=sys.stderr, flush=True)
            sys.exit(EXIT_FAILED)
        raise


def _interrupted(signum: int) -> None:
    print(f"interrupted by {signal.Signals(signum).name} before training started (or after it ended); no checkpoint "
          "saved by this signal", file=sys.stderr, flush=True)
    sys.exit(128 + signum)


def main() -> None:
    # From here Ctrl-C raises KeyboardInterrupt and SIGTERM raises Terminated; inside the training loop both
    # only ask the loop to stop after the step (qwen3_research.signals.StopOnSignal).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, raise_terminated)
    try:
        _main()
    except KeyboardInterrupt:  # Ctrl-C at any moment: 130 and one line, never a traceback
        _interrupted(signal.SIGINT)
    except Terminated:  # SIGTERM outside the loop: 143 and one line
        _interrupted(signal.SIGTERM)


def _names_run_dir(texts: list[str]) -> bool:
    return overrides.sets(texts, "hydra.run.dir")


def _main() -> None:
    texts, flags = _split_argv(sys.argv[1:])
    passthrough = bool(flags)
    check_override_syntax(texts)
    try:  # hydra/launcher=slurm: partition and node count, before anything is submitted
        slurm_preflight(texts)
    except ConfigError as e:
        _die(f"config error: {e}")
    if flags and flags <= _CHECKED_FLAGS:  # ad hoc sweeps and --cfg on conf/config.yaml (not named sweeps)
        preflight_overrides(texts)
    if not passthrough:
        run_dir = preflight(texts)
        if resolve.under_torchrun():  # one run dir for all ranks, agreed before Hydra creates it
            sys.argv += _launch().torchrun_overrides(texts, run_dir)
        elif run_dir is not None and not _names_run_dir(texts):  # Hydra's run uses the dir checked (${now:})
            sys.argv.append(f"hydra.run.dir={json.dumps(run_dir)}")
    import_numpy_before_torch(BEFORE_TRAINING)  # a sweep or a Hydra flag: before Hydra runs the task (torch)
    _task()


if __name__ == "__main__":
    main()
