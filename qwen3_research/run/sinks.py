"""Where metrics go: console, metrics.jsonl, Weights & Biases. The Trainer sees only ``MetricSink``.

Every sink gets the same flat record per logged step. A sink that fails (W&B above all)
is reported once and switched off; training goes on.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from qwen3_research.config import RunConfig
from qwen3_research.run.rundir import wandb_state, write_wandb_state

METRICS_FILE = "metrics.jsonl"


class MetricSink:
    def resume_at(self, step: int) -> None: ...  # a resumed run continues from this step's checkpoint (before start)
    def start(self, config: dict, summary: dict) -> None: ...
    def log(self, record: dict) -> None: ...
    def commit(self, through: int | None = None) -> None: ...  # a checkpoint now holds the logged steps through this one (None: all)
    def artifact(self, kind: str, paths: list[Path]) -> None: ...  # files of the run dir (profiler traces, snapshots)
    def finish(self, summary: dict) -> None: ...


def build_sinks(cfg: RunConfig, run_dir: Path, *, is_main: bool, wandb_group: str | None = None,
                wandb_name: str | None = None, swept: dict | None = None) -> MetricSink:
    """The run's sinks: console, ``metrics.jsonl`` and W&B on rank 0 (appending when the run resumes), none
    on the other ranks."""
    if not is_main:
        return Sinks([])
    lc, ck = cfg.logging, cfg.checkpoint
    metrics = run_dir / METRICS_FILE
    return Sinks([
        ConsoleSink(cfg.training.steps, lc.progress_bar, lc.print_config),
        JsonlSink(metrics, append=bool(ck.resume)),
        # With periodic checkpoints W&B receives rows when a checkpoint holds them, so a run killed
        # and resumed logs every step once in its one W&B run.
        WandbSink(lc.wandb, run_dir, wandb_group, wandb_name or run_dir.name, swept=swept,
                  hold_until_commit=bool(ck.enable and ck.every), metrics=metrics),
    ])


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        if v != 0 and (abs(v) < 1e-3 or abs(v) >= 1e5):
            return f"{v:.3e}"
        return f"{v:.4f}"
    return str(v)


class ConsoleSink(MetricSink):
    """One line per logged step; a progress bar on top when stdout is a terminal."""

    KEYS = ("loss", "aux_loss", "grad_norm", "lr", "loss_tokens", "loss_token_share", "tokens_per_s", "mfu",
            "mem_peak_gib", "step_time_s", "moe_max_load")

    def __init__(self, total_steps: int, progress_bar: bool, print_config: bool):
        self.total = total_steps
        self.print_config = print_config
        self.bar = None
        if progress_bar and sys.stdout.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total_steps, unit="step", dynamic_ncols=True, leave=False)

    def _write(self, line: str) -> None:
        if self.bar is not None:
            self.bar.write(line)
        else:
            print(line, flush=True)

    def start(self, config: dict, summary: dict) -> None:
        if self.print_config:
            self._write("config:\n" + OmegaConf.to_yaml(redact_secrets(config)).rstrip())
        self._write(" ".join(f"{k}={v}" for k, v in summary.items()))

    def log(self, record: dict) -> None:
        if "loss" in record:
            parts = [f"step {record['step']:>5}/{self.total}"] + [
                f"{k}={_fmt(record[k])}" for k in self.KEYS if k in record
            ]
            if "eval_loss" in record:
                parts.append(f"eval_loss={_fmt(record['eval_loss'])}")
            self._write(" ".join(parts))
            if self.bar is not None:
                self.bar.n = record["step"]
                self.bar.refresh()
        elif "eval_loss" in record:
            self._write(f"step {record['step']:>5}/{self.total} eval_loss={_fmt(record['eval_loss'])}")

    def finish(self, summary: dict) -> None:
        if self.bar is not None:
            self.bar.close()
        self._write("done: " + " ".join(f"{k}={_fmt(v)}" for k, v in summary.items()))


def rows_through(path: Path, step: int) -> list[tuple[str, dict]]:
    """(line, row) of the ``metrics.jsonl`` rows of steps <= ``step``; a line cut short by a kill is skipped."""
    out = []
    for line in path.read_text(encoding="utf-8").splitlines() if path.is_file() else []:
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] <= step:
            out.append((line, row))
    return out


class JsonlSink(MetricSink):
    """``metrics.jsonl``: one JSON object per logged step, flushed line by line."""

    def __init__(self, path: Path, append: bool = False):
        self.path = path
        self.fh = open(path, "a" if append else "w", encoding="utf-8")

    def resume_at(self, step: int) -> None:
        """Keep only the rows of steps <= ``step`` (the steps after it are trained again), atomically."""
        self.fh.close()
        kept = [line + "\n" for line, _ in rows_through(self.path, step)]
        tmp = self.path.with_name(self.path.name + ".tmp")
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.writelines(kept)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, self.path)
        self.fh = open(self.path, "a", encoding="utf-8")

    def log(self, record: dict) -> None:
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        self.fh.write(json.dumps(clean) + "\n")
        self.fh.flush()

    def finish(self, summary: dict) -> None:
        self.fh.close()


def _wandb_flat(record: dict) -> dict:
    out = {"train/step": record["step"]}
    for k, v in record.items():
        if k == "step":
            continue
        if k == "mem_per_rank":
            for row in v:
                for mk in ("current_gib", "peak_gib", "peak_pct"):
                    out[f"memory/rank{row['rank']}/{mk}"] = row[mk]
        elif k.startswith("eval_"):
            out[f"eval/{k[5:]}"] = v
        elif k.startswith("moe_"):  # MoE routing (qwen3_research.routing): moe/max_load, moe/layer0/..., ...
            out.update(_wandb_moe(k, v))
        elif isinstance(v, (int, float)):
            out[f"train/{k}"] = v
    return out


def _wandb_moe(key: str, value) -> dict:
    """``moe_<figure>`` -> ``moe/<figure>``; ``moe_per_layer`` rows -> ``moe/layer<i>/<figure>`` and the tokens
    per expert as a W&B histogram (one bin per expert, logged inline in the history row)."""
    if key != "moe_per_layer":
        return {f"moe/{key[4:]}": value}
    import wandb

    out = {}
    for row in value:
        prefix = f"moe/layer{row['layer']}"
        out.update({f"{prefix}/{k}": v for k, v in row.items() if k not in ("layer", "tokens")})
        out[f"{prefix}/tokens_per_expert"] = wandb.Histogram(np_histogram=(row["tokens"], list(range(len(row["tokens"]) + 1))))
    return out


SECRET_ENV_VARS = ("WANDB_API_KEY", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")


def redact_secrets(obj):
    """Replace any occurrence of a secret from the environment (API keys, tokens) by '<redacted>'."""
    secrets = [os.environ[k] for k in SECRET_ENV_VARS if len(os.environ.get(k, "")) >= 8]
    if not secrets:
        return obj

    def walk(x):
        if isinstance(x, dict):
            return {k: walk(v) for k, v in x.items()}
        if isinstance(x, list):
            return [walk(v) for v in x]
        if isinstance(x, str):
            for s in secrets:
                x = x.replace(s, "<redacted>")
        return x

    return walk(obj)


def swept_config_fields(swept: dict[str, str]) -> dict[str, Any]:
    """Top-level W&B config fields for the swept keys: 'tp', 'seq_len', … (full key on a clash)."""
    short = {}
    for key, value in swept.items():
        name = key.split(".")[-1]
        if name in short or sum(k.split(".")[-1] == name for k in swept) > 1:
            name = key.replace(".", "_")
        try:
            short[name] = json.loads(value)
        except (TypeError, ValueError):
            short[name] = value
    return short


class WandbSink(MetricSink):
    """A W&B run (offline by default). Any W&B error turns this sink off with one warning."""

    def __init__(self, cfg, run_dir: Path, group: str | None, name: str, job_type: str = "train",
                 swept: dict | None = None, hold_until_commit: bool = False, metrics: Path | None = None):
        self.cfg = cfg
        self.metrics = metrics  # the run's metrics.jsonl: what a resumed run replays from
        self.hold_until_commit = hold_until_commit
        self.pending: list[dict] = []
        self.replay: list[dict] = []  # a resumed run: metrics.jsonl rows up to its checkpoint
        self.logged_through = 0
        self.run_dir = run_dir
        self.group = group
        self.name = name
        self.job_type = job_type
        self.swept = swept or {}
        self.run = None

    def resume_at(self, step: int) -> None:
        """The checkpointed rows (metrics.jsonl up to ``step``), for ``start`` to log those this W&B run lacks."""
        self.replay = [row for _, row in rows_through(self.metrics, step)] if self.metrics else []

    def _fail(self, what: str, e: BaseException) -> None:
        warnings.warn(f"W&B {what} failed ({type(e).__name__}: {e}); training continues without W&B", stacklevel=2)
        self.run = None

    def start(self, config: dict, summary: dict) -> None:
        mode = os.environ.get("WANDB_MODE") or self.cfg.mode
        if mode == "disabled":
            return
        if mode not in ("online", "offline", "dryrun", "run"):
            print(f"warning: WANDB_MODE={mode!r} is not one of online, offline, disabled; W&B is off for this run",
                  file=sys.stderr, flush=True)
            return
        try:
            self.run = self._init(config, mode)
        except Exception as e:  # noqa: BLE001 - W&B must never stop training
            if mode != "online":
                self._fail("init", e)
                return
            warnings.warn(
                f"W&B online start failed ({type(e).__name__}: {str(e).splitlines()[0][:200]}); the run is kept "
                f"offline in {self.run_dir / 'wandb'}: upload it later with `wandb sync <offline-run dir>`",
                stacklevel=2,
            )
            try:
                import wandb

                # The failed online attempt leaves its W&B service holding this run id: start a fresh one,
                # or the offline run's records land in the online attempt's directory and never close.
                wandb.teardown()
                self.run = self._init(config, "offline")
            except Exception as e2:  # noqa: BLE001
                self._fail("offline fallback", e2)
                return
        try:
            self.run.define_metric("train/step")
            for pattern in ("train/*", "eval/*", "memory/*", "moe/*"):
                self.run.define_metric(pattern, step_metric="train/step")
            self.run.summary.update({f"run/{k}": v for k, v in summary.items()})
        except Exception as e:  # noqa: BLE001
            self._fail("setup", e)
            return
        # A resumed run: the W&B run already holds the steps an earlier segment delivered (offline: up to
        # its clean finish; online: up to the server's last step); log the checkpointed rows it lacks.
        have = max(self.logged_through, getattr(self.run, "starting_step", 0) - 1)
        if self.replay and self.replay[-1]["step"] > have and getattr(self.run, "offline", False):
            have = max(have, _offline_steps_delivered(self.run_dir, self.run.id))
        self.logged_through = have
        self.pending = [r for r in self.replay if r["step"] > have] + self.pending
        self.replay = []
        self.commit()

    def _init(self, config: dict, mode: str):
        import wandb

        state = wandb_state(self.run_dir)
        self.logged_through = int(state.get("logged_through", 0))
        return wandb.init(
            id=state["id"],  # one W&B run per run dir: a resume continues it
            resume="allow",
            project=os.environ.get("WANDB_PROJECT") or self.cfg.project,
            entity=os.environ.get("WANDB_ENTITY") or self.cfg.entity,
            group=self.group,
            job_type=self.job_type,
            name=self.name,
            tags=redact_secrets(list(self.cfg.tags)),
            dir=str(self.run_dir),
            config=redact_secrets(self._with_swept(config)),
            mode=mode,
            reinit="finish_previous",
            settings=wandb.Settings(quiet=True, init_timeout=self.cfg.init_timeout),
        )

    def _with_swept(self, config: dict) -> dict:
        if not self.swept:
            return config
        return {**config, **swept_config_fields(self.swept), "swept_keys": sorted(self.swept)}

    def log(self, record: dict) -> None:
        if self.run is None:
            return
        self.pending.append(record)
        if not self.hold_until_commit:
            self.commit()

    def commit(self, through: int | None = None) -> None:
        if self.run is None:
            return
        try:
            held = [r for r in self.pending if through is not None and r["step"] > through]  # an async save in flight
            for record in self.pending:  # W&B's step is the training step: monotonic across resumes
                if record["step"] > self.logged_through and (through is None or record["step"] <= through):
                    self.run.log(_wandb_flat(record), step=record["step"])
                    self.last_step = record["step"]
            self.pending = held
        except Exception as e:  # noqa: BLE001
            self._fail("log", e)

    def artifact(self, kind: str, paths: list[Path]) -> None:
        """``paths`` as one W&B artifact of type ``kind``, named ``<kind>-<W&B run id>`` (one per run; a later call
        of the same kind is its next version). Offline runs keep it for ``wandb sync``."""
        if self.run is None or not paths:
            return
        try:
            import wandb

            art = wandb.Artifact(f"{kind}-{self.run.id}", type=kind)
            for p in paths:
                art.add_file(str(p), name=Path(p).name, policy="immutable")  # no staging copy: written once
            self.run.log_artifact(art)
        except Exception as e:  # noqa: BLE001
            self._fail("artifact", e)

    def finish(self, summary: dict) -> None:
        if self.run is None:
            return
        self.commit()
        if self.run is None:
            return
        try:
            self.run.summary.update(summary)
            self.run.finish()
        except Exception as e:  # noqa: BLE001
            self._fail("finish", e)
            return
        if getattr(self, "last_step", 0) > self.logged_through:  # delivered: a resume must not log these again
            write_wandb_state(self.run_dir, {**wandb_state(self.run_dir), "logged_through": self.last_step})


def _offline_steps_delivered(run_dir: Path, run_id: str) -> int:
    """The last train/step the earlier offline segments of this W&B run hold, read with W&B's own reader
    (``wandb leet inspect``): a killed segment may have written some rows before it died."""
    last = 0
    for f in sorted(Path(run_dir).glob(f"wandb/offline-run-*-{run_id}/run-{run_id}.wandb")):
        try:
            out = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(f)],
                                 capture_output=True, text=True, timeout=120, check=True).stdout
        except (OSError, subprocess.SubprocessError):
            continue
        for line in out.splitlines():
            if line.startswith('{"num"') and '"type":"history"' in line:
                step = json.loads(line)["history"]["item"].get("train/step")
                if isinstance(step, (int, float)):
                    last = max(last, int(step))
    return last


class Sinks(MetricSink):
    def __init__(self, sinks: list[MetricSink]):
        self.sinks = sinks

    def resume_at(self, step: int) -> None:
        for s in self.sinks:
            s.resume_at(step)

    def start(self, config: dict, summary: dict) -> None:
        for s in self.sinks:
            s.start(config, summary)

    def log(self, record: dict) -> None:
        for s in self.sinks:
            s.log(record)

    def commit(self, through: int | None = None) -> None:
        for s in self.sinks:
            s.commit(through)

    def artifact(self, kind: str, paths: list[Path]) -> None:
        for s in self.sinks:
            s.artifact(kind, paths)

    def finish(self, summary: dict) -> None:
        for s in self.sinks:
            s.finish(summary)


def log_sweep_table(wandb_cfg, out_dir: Path, group: str, columns: list[str], rows: list[list], images: list[Path]) -> Path | None:
    """The sweep's summary table (and its heatmap) as a small W&B run of its own in the sweep's group
    (``job_type=sweep_report``, named ``<group>/report``), offline by default like every run; its files under
    ``out_dir/wandb``. Returns the W&B run's directory, None when W&B is off or fails (one warning: a report must
    not fail a sweep)."""
    mode = os.environ.get("WANDB_MODE") or wandb_cfg.mode
    if mode == "disabled" or mode not in ("online", "offline", "dryrun", "run"):
        return None
    try:
        import wandb

        run = wandb.init(project=os.environ.get("WANDB_PROJECT") or wandb_cfg.project,
                         entity=os.environ.get("WANDB_ENTITY") or wandb_cfg.entity, group=group, job_type="sweep_report",
                         name=f"{group}/report", dir=str(out_dir), mode=mode, reinit="finish_previous",
                         tags=redact_secrets(list(wandb_cfg.tags)),
                         settings=wandb.Settings(quiet=True, init_timeout=wandb_cfg.init_timeout))
        record = {"sweep/points": wandb.Table(columns=columns, data=rows)}
        record.update({f"sweep/{Path(p).stem}": wandb.Image(str(p)) for p in images})
        run.log(record)  # a table logged once is also the run's summary value
        run_dir = Path(run.dir).parent
        run.finish()
        return run_dir
    except Exception as e:  # noqa: BLE001
        warnings.warn(f"W&B sweep table failed ({type(e).__name__}: {e}); the report files are written", stacklevel=2)
        return None
