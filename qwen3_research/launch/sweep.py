"""Sweep support: the end-of-sweep report (a Hydra callback) and per-point W&B identity."""

from __future__ import annotations

import atexit
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from qwen3_research import devices, overrides, slurm
from qwen3_research.compose import compose_resolved, swept_keys_of_this_sweep
from qwen3_research.config import WandbConfig
from qwen3_research.errors import ConfigError
from qwen3_research.launch import repeats
from qwen3_research.report import (DUPLICATE, EXIT_SOME_FAILED, POINT_COLUMNS, best_point_line, find_runs, report,
                                   sweep_points)
from qwen3_research.resolve import ResolvedRun, planned_elsewhere, resolve_run
from qwen3_research.signals import Interrupted, signal_number
from qwen3_research.startup import quiet_libraries


_SWEEP_LOCKS: dict[str, Any] = {}  # sweep dir -> its rundir.RunDirLock, while this process's sweep runs
# A point with one of these statuses did not fail: it ran, was predicted not to fit, or repeats another point's run.
FINE = ("ok", "skipped", DUPLICATE)


class SweepReport(Callback):
    """Before a multirun: the plan of every point (``sweep.plan``, printed, ``plan.json``). At its end:
    comparison table and plots in the sweep dir, sweep.json with the wall time; exit status 3 when
    any point failed, else 5 when points predicted not to fit were skipped, else 0."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        self.t0 = time.perf_counter()
        # held in the module, not on the callback: a remote launcher (submitit) pickles the callbacks with the
        # job, and a lock (its RLock) does not pickle
        _SWEEP_LOCKS[str(config.hydra.sweep.dir)] = lock_sweep_dir(Path(config.hydra.sweep.dir))
        jobs = sweep_jobs(config) or []
        repeated = repeats.find_repeats(jobs, point_composer(config))  # before any point starts, with or without a plan
        repeats.write(Path(config.hydra.sweep.dir), jobs, repeated, _point_key)
        if config.get("sweep") is not None and config.sweep.plan:
            def plan() -> dict:
                resolutions: dict = {}
                plan_points(config, Path(config.hydra.sweep.dir), resolutions=resolutions, repeated=repeated)
                return resolutions

            _POINT_RESOLUTIONS.clear()
            _POINT_RESOLUTIONS.update(in_a_forked_child(plan))

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        if not sweep_dir.is_dir():
            return
        if not find_runs([sweep_dir]):  # e.g. -m 'training.steps=range(0,0)': Hydra launched 0 jobs
            params = OmegaConf.to_container(config.hydra.sweeper.params) if config.hydra.sweeper.get("params") else {}
            swept = " ".join(o for o in config.hydra.overrides.task) or ", ".join(f"{k}={v}" for k, v in params.items())
            print(f"config error: the sweep has no points: its swept values ({swept or 'none'}) give no "
                  "combination to run; give every swept key at least one value", file=sys.stderr, flush=True)
            sys.exit(2)
        wall = time.perf_counter() - getattr(self, "t0", time.perf_counter())
        runs = report([sweep_dir], sweep_dir)
        summary_line = sweep_summary(runs, sweep_dir, config)
        point_s = [r.summary.get("wall_s") for r in runs]
        (sweep_dir / "sweep.json").write_text(json.dumps({
            "wall_s": wall, "points": len(runs), "failed": sum(r.status not in FINE for r in runs),
            "skipped": sum(r.status == "skipped" for r in runs), "duplicates": sum(r.status == DUPLICATE for r in runs),
            "points_wall_s": point_s,
        }, indent=1))
        kept = previous_attempts_line(sweep_dir)
        if kept is not None:
            print(kept, flush=True)
        print(summary_line, flush=True)  # the sweep's last stdout line
        lock = _SWEEP_LOCKS.pop(str(config.hydra.sweep.dir), None)
        if lock is not None:
            lock.release()
        if any(r.status not in FINE for r in runs):
            print(f"sweep finished with failed points (exit status {EXIT_SOME_FAILED})", file=sys.stderr, flush=True)
            sys.exit(EXIT_SOME_FAILED)
        if any(r.status == "skipped" for r in runs):
            print(f"sweep finished; points predicted not to fit were skipped (exit status {EXIT_SOME_SKIPPED})",
                  file=sys.stderr, flush=True)
            sys.exit(EXIT_SOME_SKIPPED)


def lock_sweep_dir(sweep_dir: Path):
    """One sweep writes a sweep directory at a time: the run-dir lock (``rundir.RunDirLock``) on the sweep dir,
    held until the sweep ends (released at exit, whatever ends it). A second sweep into a directory whose lock a
    live process holds exits 2 in one line before it moves or starts anything (issue 40: it moved the first sweep's
    live lock and checkpoints into .previous_attempts and trained in the same point directory); a lock left by a
    dead sweep is taken over (``RunDirLock``'s note), so the same command resumes a killed sweep."""
    # deferred: start-up (the run-dir module loads torch through checkpoint; a config error exits before it)
    from qwen3_research.run import rundir

    holder = rundir.lock_holder(sweep_dir)
    if holder is None:
        try:
            lock = rundir.RunDirLock(sweep_dir).acquire()
        except ConfigError:  # taken between the look and the lock: by a live process, as below
            holder = rundir.lock_holder(sweep_dir) or {}
    if holder is not None:
        print(f"config error: hydra.sweep.dir={sweep_dir} is in use by another sweep (pid {holder.get('pid', '?')} on "
              f"{holder.get('host', '?')}, {rundir.LOCK_NAME}); nothing was moved or started: wait for that sweep to "
              "end (the same command then resumes this one), or choose another hydra.sweep.dir",
              file=sys.stderr, flush=True)
        sys.exit(2)
    owner = os.getpid()
    atexit.register(lambda: lock.release() if os.getpid() == owner else None)  # not in a forked child's exit
    return lock


def refuse_a_live_point(run_path: Path) -> None:
    """A point directory whose run-dir lock a live process holds (a run started there with hydra.run.dir) is that
    process's: ConfigError, and nothing in it is moved (``prepare_point``, before its earlier attempt is moved)."""
    # deferred: start-up (the run-dir module loads torch through checkpoint; a config error exits before it)
    from qwen3_research.run import rundir

    holder = rundir.lock_holder(run_path)
    if holder is not None:
        raise ConfigError(f"sweep point {run_path.name}: {run_path} is in use by pid {holder.get('pid', '?')} on "
                          f"{holder.get('host', '?')} ({rundir.LOCK_NAME}); its files were left as they are and no "
                          "further point started: wait for that run to end, or choose another hydra.sweep.dir")


def in_a_forked_child(fn):
    """``fn()`` run in a forked copy of this process; its result (or exception) comes back pickled.

    The plan traces a Trainer per point on fake tensors. Run here, that would make this process one that has built
    a Trainer, whose CPU worker groups must then be spawned (``launch.elastic._start_method``: autograd's threads do
    not survive a fork), paying a fresh interpreter's imports per rank of every point (~7 s on 2 cores). In a child
    the sweep's own process stays fork-clean. Where ``os.fork`` is missing, or the caller is not the main thread,
    ``fn`` runs here. A signal during the plan reaches the child and this process alike: the child exits quietly
    (128 + signal), and this process raises as it would have."""
    import pickle
    import threading

    if not hasattr(os, "fork") or threading.current_thread() is not threading.main_thread():
        return fn()
    sys.stdout.flush()
    sys.stderr.flush()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into the caller's stack
        code = 0
        try:
            os.close(r)
            try:
                data = pickle.dumps((True, fn()))
            except KeyboardInterrupt:
                data, code = b"", 130
            except BaseException as e:  # noqa: BLE001 - handed to the parent, which raises it
                try:
                    data = pickle.dumps((False, e))
                except Exception:  # noqa: BLE001 - an exception that does not pickle: its text
                    data = pickle.dumps((False, RuntimeError(f"{type(e).__name__}: {e}")))
            with os.fdopen(w, "wb") as f:
                f.write(data)
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        data = f.read()
    _, status = os.waitpid(pid, 0)
    if not data:
        code = os.waitstatus_to_exitcode(status)
        if code == 130 or code == -2:
            raise KeyboardInterrupt
        raise RuntimeError(f"the sweep's plan process ended with exit status {code} and no result")
    ok, value = pickle.loads(data)
    if not ok:
        raise value
    return value


def wandb_group(sweep_dir: Path) -> str:
    """The W&B group of a sweep's points and of its report: the sweep dir (fixed once per sweep)."""
    return f"sweep_{sweep_dir.parent.name}_{sweep_dir.name}"


def sweep_summary(runs, sweep_dir: Path, config: DictConfig) -> str:
    """The grid of the two swept keys to W&B as the sweep group's summary table (with the heatmap), and the
    one-line summary: the best point by tokens/s that fit."""
    points = sweep_points(runs, [sweep_dir])
    if points and config.get("logging") is not None:
        wandb_cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(WandbConfig), config.logging.wandb))
        heatmap = sweep_dir / "heatmap.png"
        from qwen3_research.run.sinks import log_sweep_table  # deferred: start-up (sinks loads torch; __main__ imports this)

        log_sweep_table(wandb_cfg, sweep_dir, wandb_group(sweep_dir), POINT_COLUMNS,
                        [[p[c] for c in POINT_COLUMNS] for p in points], [heatmap] if heatmap.is_file() else [])
    return best_point_line(runs, points)


def stop_sweep(sweep_dir: Path, point_dir: str, e: BaseException) -> int:
    """A signal stopped a point (it saved as a run does): start no further point, write the report of what
    ran (the stopped point marked ``interrupted`` at its step), say how to resume; return 128 + signal."""
    import signal as signals

    signum = signal_number(e)
    saved = (f"after step {e.step}, " + (f"checkpoint saved to {e.checkpoint}" if e.checkpoint else "no checkpoint saved")
             if isinstance(e, Interrupted) else "before its training loop, no checkpoint saved")
    try:
        report([sweep_dir], sweep_dir)
    except (Exception, SystemExit) as err:  # noqa: BLE001 - the report must not hide the stop
        print(f"warning: no sweep report ({err})", file=sys.stderr, flush=True)
    print(f"sweep interrupted by {signals.Signals(signum).name} in point {Path(point_dir).name} ({saved}); no further "
          f"point started; run the same command with hydra.sweep.dir={sweep_dir} to resume it (finished points are "
          "skipped, the interrupted one continues from its checkpoint)", file=sys.stderr, flush=True)
    return 128 + signum


# -- plan first, resume (issue 15) ---------------------------------------------------------------
# Exit status of a sweep whose points all ran ok or were skipped as predicted not to fit (some were).
EXIT_SOME_SKIPPED = 5
PLAN_FILE = "plan.json"
PREVIOUS_ATTEMPTS = ".previous_attempts"  # <sweep dir>/.previous_attempts/<point>/<n>/: a point's earlier attempts


def _point_key(texts) -> str:
    return json.dumps(sorted(str(o) for o in texts))


def sweep_jobs(config: DictConfig) -> list[list[str]] | None:
    """Every point's overrides as Hydra's basic sweeper will run them; None for other sweepers (Optuna)."""
    from omegaconf import OmegaConf

    hc = config.hydra
    if "BasicSweeper" not in str(hc.sweeper.get("_target_", "")):
        return None
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper

    params = OmegaConf.to_container(hc.sweeper.params) if hc.sweeper.get("params") else {}
    args = [f"{k}={v}" for k, v in (params or {}).items()] + list(hc.overrides.task)
    parsed = overrides.hydra_parse(args)
    return [list(job) for batch in BasicSweeper.split_arguments(parsed, None) for job in batch]


# Keys that change no tensor's shape or lifetime in the planned step: points that differ only in them (a seed
# sweep, a learning-rate sweep) share one traced plan. Tracing took ~1-4 s a point, the same answer every time.
PLAN_FREE_KEYS = ("training.seed", "optimizer.lr", "optimizer.betas", "optimizer.eps", "optimizer.weight_decay",
                  "optimizer.warmup_steps", "optimizer.decay", "optimizer.min_lr_ratio", "logging")


def plan_key(composed: dict) -> str:
    """A point's resolved config without ``PLAN_FREE_KEYS``: equal keys, equal plans."""
    import copy

    trimmed = copy.deepcopy(composed)
    for dotted in PLAN_FREE_KEYS:
        *parents, last = dotted.split(".")
        node = trimmed
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node.pop(last, None)
    return json.dumps(trimmed, sort_keys=True, default=str)


# Each point's one resolution, made by its plan (``plan_points``, in the forked child) and handed back: point key ->
# (the composed config it resolved, the resolution). The point's run starts from it (``prepare_point``) when it runs
# that config in this process (Hydra's basic launcher); otherwise the launcher resolves the point itself.
_POINT_RESOLUTIONS: dict[str, tuple[dict, ResolvedRun]] = {}


def resolve_point(composed: dict) -> tuple[ResolvedRun, bool]:
    """A sweep point's resolution for its plan, and whether its run can start from it: resolved as the run resolves
    it (``launch.elastic.run``), or, for a device this host lacks, as a plan (the run is then refused here)."""
    if planned_elsewhere((composed.get("device") or {}).get("type", "auto")):
        return resolve_run(composed, plan=True), False
    return resolve_run(composed, prepare=devices.prepare_launch), True  # a fork's (or this point's own) environment


def point_composer(config: DictConfig):
    """``compose(job) -> dict``: a point as the sweep composes it: the sweep's own config file (--config-name) on the
    directories given with --config-dir, not conf/config.yaml alone (whose nproc_per_node and batch may differ)."""
    config_name = config.hydra.job.config_name or "config"
    searchpath = [f"{s.schema}://{s.path}" for s in config.hydra.runtime.config_sources
                  if s.provider == "command-line" and s.path]
    return lambda job: compose_resolved(list(job), config_name=config_name, searchpath=searchpath)


def plan_points(config: DictConfig, sweep_dir: Path, echo=print, resolutions: dict | None = None,
                repeated: dict[int, dict] | None = None) -> dict:
    """Plan every point (qwen3_research.plan), print the table, write plan.json; key -> entry. Each point is
    resolved once (``resolve_point``; ``resolutions`` gets those its run can start from, by point key); points whose
    configs differ only in ``PLAN_FREE_KEYS`` are traced once; a point that repeats another's run
    (``repeated``: ``repeats.find_repeats``) is neither resolved nor planned. A point its resolution refuses is
    listed with its one config-error line (it will fail alone, before its workers start); a resolved point the
    planner cannot plan, with ``no plan:`` and the reason (it runs)."""
    # deferred: start-up (__main__ imports this module for override parsing; the plan loads torch)
    from qwen3_research import fit, planner

    quiet_libraries()  # torchtitan's INFO lines ("Total parameter count") per traced point stay off the console
    planned: dict[str, dict] = {}

    jobs = sweep_jobs(config)
    if not jobs:
        return {}
    compose = point_composer(config)
    repeated = repeated or {}
    entries = {}
    rows = []
    params = OmegaConf.to_container(config.hydra.sweeper.params) if config.hydra.sweeper.get("params") else {}
    swept = swept_keys_of_this_sweep(params, sys.argv[1:])  # sweep.plan=fit keeps these as swept
    for num, job in enumerate(jobs):
        label = ",".join(o.text for o in overrides.parse(job) if overrides.is_point_key(o.key)) or f"job{num}"
        if num in repeated:
            entry = {"not_run": repeats.describe(repeated[num])}
            entries[_point_key(job)] = {"num": num, "overrides": list(job), **entry}
            rows.append((num, label, entry))
            continue
        try:
            composed = compose(job)
            run, runnable = resolve_point(composed)  # its own seed, lr, … too where the plan is shared
        except ConfigError as e:
            entry = {"error": f"config error: {e}"}
        except Exception as e:  # noqa: BLE001 - a plan that cannot be made must not stop the sweep
            entry = {"error": f"plan failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
        else:
            if runnable and resolutions is not None:
                resolutions[_point_key(job)] = (composed, run)
            key = plan_key(composed)
            try:
                if key in planned:
                    entry = dict(planned[key])
                else:
                    plan = planner.make_plan(run)
                    entry = plan.as_dict()
                    if not plan.fits and config.sweep.plan == "fit":
                        entry = _fitted(entry, composed, list(job), swept)
                    planned[key] = entry
            except ConfigError as e:  # the point resolved: it runs, unplanned
                entry = {"error": f"no plan: {e}"}
            except Exception as e:  # noqa: BLE001 - a plan that cannot be made must not stop the sweep
                entry = {"error": f"plan failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
        entries[_point_key(job)] = {"num": num, "overrides": list(job), **entry}
        rows.append((num, label, entry))
    sweep_dir.mkdir(parents=True, exist_ok=True)
    (sweep_dir / PLAN_FILE).write_text(json.dumps(entries, indent=1))
    echo("sweep plan (predicted peak live tensor bytes per rank, before any point starts):")
    for num, label, e in rows:
        if "error" in e or "not_run" in e:
            echo(f"  {num:>3}  {label}: {e.get('error') or 'not run: ' + e['not_run']}")
        else:
            adjusted = ("; adjusted to fit: " + " ".join(e["adjusted_overrides"]) + f" (was {e['unadjusted_peak_gib']:.3f} "
                        "GiB)") if e.get("adjusted") else ""
            echo(f"  {num:>3}  {label}: {e['predicted_peak_gib']:.3f} GiB of {e['capacity_gib']:.2f} GiB -> {e['verdict']}"
                 f"{adjusted}{'; ' + e['fit'] if e.get('fit') else ''}")
    sys.stdout.flush()
    return entries


def _fitted(entry: dict, composed: dict, job: list[str], swept: set[str]) -> dict:
    """``sweep.plan=fit``: a point predicted not to fit gets its cheapest fitting variant (``qwen3_research.fit``),
    the swept keys and the keys its command line sets kept; the entry then is that variant's plan, with what changed
    (``adjusted``: key -> [configured, used]) and the overrides that change it. Nothing fits: the entry keeps its
    verdict (the point is skipped) and says what dominates."""
    from qwen3_research import fit  # deferred: start-up (as in the plan above: fit loads torch)

    result = fit.search(composed, frozen=swept | fit.explicit_keys(job), k=1, echo=lambda msg: None)
    if not result.fits:
        return {**entry, "fit": f"no variant fits: {result.dominant}"}
    best = result.fits[0]
    configured = {k: _get(composed, k) for k in best.changes}
    return {**best.plan.as_dict(), "unadjusted_peak_gib": entry["predicted_peak_gib"],
            "adjusted": {k: [configured[k], v] for k, v in best.changes.items()}, "adjusted_overrides": best.overrides()}


def _get(config: dict, dotted: str):
    node = config
    for key in dotted.split("."):
        node = node[key]
    return node


def previous_attempts_line(sweep_dir: Path) -> str | None:
    """The earlier attempts this sweep dir keeps (``_move_previous_attempt``), said at the sweep's end: with
    sweep.resume=false every point moved its last attempt there on each run of the sweep, silently growing it
    (issue 40 weak case). None: there are none."""
    root = Path(sweep_dir) / PREVIOUS_ATTEMPTS
    attempts = [d for d in root.glob("*/*") if d.is_dir()] if root.is_dir() else []
    if not attempts:
        return None
    size = sum(f.stat().st_size for d in attempts for f in d.rglob("*") if f.is_file())
    return (f"earlier attempts kept: {len(attempts)} in {root} ({size / 2**20:.1f} MiB); nothing there is deleted "
            "for you: remove the folder once you no longer need them")


def _move_previous_attempt(run_dir: Path) -> Path | None:
    """A point run again: its earlier attempt's files (all but Hydra's .hydra/ and log) go to
    <sweep dir>/.previous_attempts/<point>/<n>/, so the point starts in a clean run dir and nothing is lost."""
    leftovers = [p for p in run_dir.iterdir() if p.name != ".hydra" and not p.name.endswith(".log")]
    if not leftovers:
        return None
    root = run_dir.parent / PREVIOUS_ATTEMPTS / run_dir.name
    n = 1
    while (root / str(n)).exists():
        n += 1
    dest = root / str(n)
    dest.mkdir(parents=True)
    for p in leftovers:
        p.rename(dest / p.name)
    return dest


def _interrupted_checkpoint(cfg: DictConfig, run_path: Path, summary: dict) -> Path | None:
    """The checkpoint an interrupted point continues from (None: it was not interrupted, or saved nothing)."""
    if summary.get("status") != "interrupted" or cfg.checkpoint.resume:
        return None
    # deferred: start-up (__main__ imports this module at the top; torch loads only to resume a point)
    from qwen3_research.run.checkpoint import checkpoint_root, find_checkpoint

    try:
        return find_checkpoint("auto", checkpoint_root(cfg.checkpoint, run_path))
    except ConfigError:
        return None


def point_resolution(cfg: DictConfig, task_overrides) -> ResolvedRun | None:
    """The resolution this point's plan made (``plan_points``), when the point runs the config it resolved; its
    environment is prepared here, as resolving it here would have (``device.prepare_launch``). None: the launcher
    resolves the point."""
    found = _POINT_RESOLUTIONS.get(_point_key(task_overrides))
    if found is None:
        return None
    composed, run = found
    if OmegaConf.to_container(cfg, resolve=True) != composed:  # resumed or adjusted to fit: another config
        return None
    devices.prepare_launch(run.device_type, run.lnc, run.world_size)
    return run


def prepare_point(cfg: DictConfig, run_dir: str, task_overrides, sweep_dir: str
                  ) -> tuple[dict | None, dict, DictConfig, ResolvedRun | None]:
    """Before a sweep point starts: (its summary when it must not run, its prediction, the config to run it
    with: ``cfg`` itself, or a copy with ``checkpoint.resume=auto`` for an interrupted attempt; the composed
    config is never written; the resolution its plan made of that config, ``point_resolution``, or None).

    Skips a point whose summary.json already says ok (``sweep.resume``), a point that repeats another point's run
    (``launch.repeats``: status duplicate), and a point planned not to fit (``sweep.skip_infeasible``); an earlier
    failed attempt is moved aside. A point directory a live
    process holds (its run-dir lock) is refused: ConfigError, nothing moved.
    """
    run_path = Path(run_dir)
    # A multi-node Slurm job runs this task on every node, and node 0's ranks own the point directory (they write its
    # run files and hold its lock): another node only reads it. It must neither take node 0's live lock for another
    # process's nor move node 0's fresh files aside (a requeue test saw node 2 exit 2 on that lock, stalling node 0).
    owner = slurm.node_rank() == 0
    if owner:
        refuse_a_live_point(run_path)  # an earlier attempt is moved aside (or resumed) only when its owner is gone
    summary_path = run_path / "summary.json"
    if cfg.sweep.resume and summary_path.is_file():
        try:
            old = json.loads(summary_path.read_text())
        except ValueError:
            old = {}
        if old.get("status") == "ok":
            print(f"sweep point {run_path.name}: already ok (summary.json), not run again", flush=True)
            return old, old.get("prediction") or {}, cfg, None
        resume_from = _interrupted_checkpoint(cfg, run_path, old)
        if resume_from is not None:  # stopped by a signal after saving: continue it, as a run resumes
            resumed = OmegaConf.merge(cfg, {"checkpoint": {"resume": "auto"}})  # a new config, as an override would
            print(f"sweep point {run_path.name}: resuming the interrupted attempt from {resume_from}", flush=True)
            return None, old.get("prediction") or {}, resumed, None
    repeat = repeats.read(Path(sweep_dir), _point_key(task_overrides))
    if repeat is not None:  # another point runs this run: not started (launch/repeats.py)
        return repeats.record(run_path, repeat, write_summary=owner), {}, cfg, None
    entry = {}
    plan_path = Path(sweep_dir) / PLAN_FILE
    if plan_path.is_file():
        entry = json.loads(plan_path.read_text()).get(_point_key(task_overrides), {})
    prediction = {k: v for k, v in entry.items() if k not in ("num", "overrides")}
    if owner and run_path.is_dir():
        moved = _move_previous_attempt(run_path)
        if moved is not None:
            print(f"sweep point {run_path.name}: earlier attempt moved to {moved}", flush=True)
    if prediction.get("adjusted"):  # sweep.plan=fit: the point runs as its fitting variant (before it is resolved)
        adjusted = OmegaConf.create()
        for key, (_, used) in prediction["adjusted"].items():
            OmegaConf.update(adjusted, key, used, merge=False)
        cfg = OmegaConf.merge(cfg, adjusted)  # a new config, as the override lines would give; Hydra's stays as composed
        print(f"sweep point {run_path.name}: adjusted to fit (sweep.plan=fit): "
              + " ".join(f"{k}={old}->{new}" for k, (old, new) in prediction["adjusted"].items()), flush=True)
    if "verdict" in prediction and prediction["verdict"] == "does not fit" and cfg.sweep.skip_infeasible:
        reason = (f"predicted {prediction['predicted_peak_gib']:.2f} GiB > {prediction['capacity_gib']:.2f} GiB per rank "
                  "(sweep.skip_infeasible=false runs it anyway)")
        summary = {"status": "skipped", "reason": reason, "prediction": prediction}
        run_path.mkdir(parents=True, exist_ok=True)
        tmp = run_path / "summary.json.tmp"
        tmp.write_text(json.dumps(summary, indent=1))
        tmp.replace(summary_path)
        print(f"sweep point {run_path.name}: skipped: {reason}", flush=True)
        return summary, prediction, cfg, None
    return None, prediction, cfg, point_resolution(cfg, task_overrides)
