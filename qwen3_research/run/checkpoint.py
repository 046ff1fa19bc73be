"""Distributed checkpoints (save, keep, resume). Hugging Face import/export: each backend's own folder
(``models/native/``: ``hf_load``, ``hf_export``, ``init_from``), the export command's work ``run/export_hf.py``.

A checkpoint is one directory ``<run dir>/<checkpoint.dir>/step-00000010/`` written by
torch.distributed.checkpoint (DCP: the run's ``train_state.TrainState`` -- model, optimizer,
scheduler, step, progress, per-rank RNG) plus ``meta.json`` (step, layout, data layout, run config).
Every rank writes into ``.tmp-step-…`` first; rank 0 adds ``meta.json`` last and renames the
directory, so a crash mid-save leaves the previous checkpoints untouched and the partial one
invisible. DCP reshards on load, so a checkpoint resumes (or exports) under any parallel layout.
With ``checkpoint.async_mode`` the write goes on while training continues (``run/async_checkpoint.py``);
rank 0 publishes the directory the same way once the write's future resolved; the last step's save and a
signal's are synchronous. ``stalls`` records what each save cost the training loop.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from torch.distributed.checkpoint.api import CheckpointException

from qwen3_research import lora, models
from qwen3_research.config import CheckpointConfig, RunConfig
from qwen3_research.data import layout_differences
from qwen3_research.errors import ConfigError, TrainingError, log_call, write_failure
from qwen3_research.run.async_checkpoint import AsyncSaves
from qwen3_research.run.train_state import TrainState, unwrap

STEP_DIR = re.compile(r"^step-(\d+)$")
META = "meta.json"
# Test hook: SIGKILL this process during the save of this step (after the DCP write, before the rename; an
# asynchronous save: in its writer's thread, while training goes on).
KILL_IN_SAVE_ENV = "QWEN3_RESEARCH_TEST_KILL_IN_SAVE"


# -- finding checkpoints --------------------------------------------------------------------


def is_complete(path: Path) -> bool:
    return STEP_DIR.match(path.name) is not None and (path / META).is_file() and (path / ".metadata").is_file()


def list_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under ``root``, oldest first."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and is_complete(p)]
    return sorted(found, key=lambda p: int(STEP_DIR.match(p.name).group(1)))


_WARNED: set[str] = set()


def damage(path: Path) -> str | None:
    """None if every data file that ``.metadata`` refers to is there and long enough, else what is wrong."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        check_metadata_pickle(path)
    except UnreadableMetadata as e:  # damage, as a missing shard is (resume=auto falls back past it); tampering raises
        return str(e).removeprefix(f"checkpoint {path}: ")
    try:
        md = FileSystemReader(str(path)).read_metadata()
    except Exception as e:  # noqa: BLE001 - a damaged .metadata raises pickle/OS errors
        return f"{path / '.metadata'} is unreadable ({type(e).__name__})"
    need: dict[str, int] = {}
    for info in (md.storage_data or {}).values():
        need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(need.items()):
        f = path / name
        have = f.stat().st_size if f.is_file() else None
        if have is None:
            return f"{f} is missing"
        if have < size:
            return f"{f} is truncated ({have} of {size} bytes)"
    return None


def find_checkpoint(spec: str, root: Path | None = None, *, what: str = "checkpoint.resume",
                    warn: bool = False) -> Path | None:
    """``auto`` -> newest intact one under ``root`` (None if none; a damaged newer one is skipped with a
    warning when ``warn``); a path -> that step dir, or the newest in it (a damaged one is an error that
    names the file and the next-newest intact checkpoint)."""
    if spec == "auto":
        found = list_checkpoints(root) if root is not None else []
        for i in range(len(found) - 1, -1, -1):
            bad = damage(found[i])
            if bad is None:
                return found[i]
            line = (f"warning: {what}=auto: skipping {found[i].name}: {bad}; "
                    f"{'falling back to ' + str(found[i - 1]) if i else 'no older checkpoint'}")
            if warn and line not in _WARNED:  # once per process (checked before Hydra and again in launch.elastic.run)
                _WARNED.add(line)
                print(line, file=sys.stderr, flush=True)
        return None
    path = Path(os.path.expanduser(spec)).resolve()
    found = [path] if is_complete(path) else list_checkpoints(path)
    if found:
        bad = damage(found[-1])
        if bad is None:
            return found[-1]
        siblings = [p for p in list_checkpoints(found[-1].parent) if p != found[-1] and
                    int(STEP_DIR.match(p.name).group(1)) < int(STEP_DIR.match(found[-1].name).group(1))]
        older = next((p for p in reversed(siblings) if damage(p) is None), None)
        raise ConfigError(
            f"{what}={spec!r}: {bad}; "
            + (f"the next-newest intact checkpoint is {older}: resume from it with {what}={older}"
               if older else "no older intact checkpoint exists")
        )
    if not path.exists():
        raise ConfigError(f"{what}={spec!r}: no such directory")
    raise ConfigError(
        f"{what}={spec!r}: not a complete checkpoint (a step-N directory with {META} and .metadata) "
        "and holds none; an interrupted save leaves only a .tmp-step-N directory"
    )


# -- who owns a checkpoint directory ----------------------------------------------------------
# A checkpoint directory inside its run directory belongs to that run by where it is. One elsewhere
# (checkpoint.dir=/fsx/ckpts/...) records its run in OWNER when the run first saves into it, so that a
# second run pointed at it is refused by name, and checkpoint.overwrite=true never deletes another run's
# checkpoints.
OWNER = "owner.json"


def checkpoint_owner(root: Path) -> str | None:
    """The run directory recorded as the owner of the checkpoint directory ``root`` (None: no record)."""
    try:
        return json.loads((Path(root) / OWNER).read_text()).get("run_dir")
    except (OSError, ValueError, AttributeError):
        return None


def owner_conflict(root: Path, run_dir: Path, *, resuming: bool) -> str | None:
    """Why the run in ``run_dir`` must not write into the checkpoint directory ``root`` (None: it may)."""
    root, run_dir = Path(root).resolve(), Path(run_dir).resolve()
    if root.is_relative_to(run_dir):
        return None
    owner = checkpoint_owner(root)
    if owner is not None:
        if Path(owner).resolve() == run_dir:
            return None
        return (f"checkpoint.dir={root} belongs to the run in {owner} ({root / OWNER}); a run never writes into, "
                f"resumes from or overwrites another run's checkpoint directory: choose another checkpoint.dir, or "
                f"continue that run with hydra.run.dir={owner} checkpoint.resume=auto")
    kept = list_checkpoints(root)
    if kept and not resuming:
        return (f"checkpoint.dir={root} already holds checkpoints ({kept[-1].name}) of a run with no owner record; "
                "choose another checkpoint.dir (or continue the run that wrote them with checkpoint.resume=auto)")
    return None


def claim_checkpoint_dir(root: Path, run_dir: Path) -> None:
    """Record ``run_dir`` as the owner of ``root`` (outside the run directory only); refuse another run's."""
    root, run_dir = Path(root).resolve(), Path(run_dir).resolve()
    if root.is_relative_to(run_dir):
        return
    why = owner_conflict(root, run_dir, resuming=True)
    if why is not None:
        raise TrainingError(f"checkpoint: {why}")
    if checkpoint_owner(root) is None:
        root.mkdir(parents=True, exist_ok=True)
        tmp = root / f".{OWNER}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps({"run_dir": str(run_dir), "since": time.time()}) + "\n")
        os.replace(tmp, root / OWNER)


def read_meta(path: Path) -> dict:
    try:
        return json.loads((path / META).read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"checkpoint {path}: {META} is unreadable ({e})") from None


def saved_tensor_shapes(path: Path) -> dict[str, tuple]:
    """Global tensor shapes recorded in a DCP checkpoint (layout-independent)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    check_metadata_pickle(path)
    try:
        md = FileSystemReader(str(path)).read_metadata()
    except Exception as e:  # noqa: BLE001 - a damaged .metadata raises pickle/OS errors
        raise ConfigError(f"checkpoint {path}: .metadata is unreadable ({type(e).__name__}: {e})") from None
    return {k: tuple(v.size) for k, v in md.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}


def check_model_matches(path: Path, model_state: dict, *, what: str, stage_only: bool = False) -> None:
    """A one-line ConfigError unless the checkpoint's model tensors have the current model's names and shapes.
    ``stage_only``: ``model_state`` is one rank's pipeline stages (parallelism.pp), a part of the whole model's
    names: the checkpoint's other tensors are the other stages'."""
    saved = {k[len("model."):]: v for k, v in saved_tensor_shapes(path).items() if k.startswith("model.")}
    current = {k: tuple(v.shape) for k, v in model_state.items() if isinstance(v, torch.Tensor)}
    missing = sorted(set(current) - set(saved))
    extra = [] if stage_only else sorted(set(saved) - set(current))
    differ = sorted(k for k in set(saved) & set(current) if saved[k] != current[k])
    if not (missing or extra or differ):
        return
    meta = read_meta(path).get("model", {})
    saved_as = f"{meta.get('backend', '?')}/{meta.get('flavor', '?')}" + (f" {meta['path']}" if meta.get("path") else "")
    parts = [f"{k}: checkpoint {list(saved[k])} vs model {list(current[k])}" for k in differ[:2]]
    parts += [f"{len(missing)} model tensors not in the checkpoint (e.g. {missing[0]})"] if missing else []
    parts += [f"{len(extra)} checkpoint tensors not in the model (e.g. {extra[0]})"] if extra else []
    if any("expert_bias" in k for k in missing + extra):  # torchtitan's buffers of model.moe.balance=bias
        was = (meta.get("moe") or {}).get("balance", "?")
        parts.append(f"saved with model.moe.balance={was}: only bias has expert-bias buffers")
    raise ConfigError(
        f"{what}: {path} holds another model shape (saved as model={saved_as}): {'; '.join(parts)}; "
        "resume with the same model settings, or use another checkpoint.dir"
    )


def full_state_dict(model: torch.nn.Module, is_main: bool) -> dict[str, torch.Tensor]:
    """The unsharded ``state_dict()`` (native key names) on CPU, on rank 0; collective under FSDP/TP."""
    from torch.distributed.tensor import DTensor

    out = {}
    for k, v in unwrap(model).state_dict().items():
        if isinstance(v, DTensor):
            v = v.full_tensor()
        if is_main:
            out[k] = v.detach().cpu()
    return out


# -- the data order a resume continues ------------------------------------------------------


def refuse_layout_change(saved: dict | None, current: dict, ckpt: Path, allow: bool, quiet: bool = False) -> None:
    """A resume under another data layout (``data.data_layout``) would not continue the run's data order:
    refused, or with ``checkpoint.allow_data_change=true`` said once (not by every rank: ``quiet``)."""
    diffs = layout_differences(saved, current)
    if not diffs:
        return
    if allow:
        if quiet:
            return
        print(f"warning: checkpoint.allow_data_change=true: resuming {ckpt} under another data layout "
              f"({'; '.join(diffs)}); the data order differs from the original run", file=sys.stderr, flush=True)
        return
    raise ConfigError(
        f"checkpoint.resume: {ckpt} was trained with another data layout ({'; '.join(diffs)}), so the run would not "
        "continue its data order; resume with the same data settings, or accept it with checkpoint.allow_data_change=true"
    )


# -- the checkpointer --------------------------------------------------------------------------


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# DCP writes its .metadata with pickle. Before DCP reads it, we unpickle it ourselves with an
# allow-list of classes (DCP's metadata dataclasses, torch dtypes/sizes, plain containers), so a
# tampered checkpoint cannot run code on load. Tensors themselves load with weights_only=True.
_SAFE_TORCH_NAMES = {"Size", "device", "dtype", "layout", "memory_format"}
_SAFE_BUILTINS = {"set", "frozenset", "slice", "complex", "tuple", "list", "dict", "bytearray", "int", "float", "str", "bytes", "bool"}


def _allowed_global(module: str, name: str) -> bool:
    if module.startswith("torch.distributed.checkpoint.") or module == "torch.distributed.checkpoint":
        return True
    if module == "torch":
        return name in _SAFE_TORCH_NAMES or isinstance(getattr(torch, name, None), torch.dtype)
    if module == "torch.serialization":
        return name == "_get_layout"  # maps "torch.strided" to the layout object
    if module == "pathlib":
        return name in ("PosixPath", "PurePosixPath", "Path")  # DCP records the checkpoint_id
    if module == "collections":
        return name in ("OrderedDict", "defaultdict")
    if module == "builtins":
        return name in _SAFE_BUILTINS
    return False


class UnreadableMetadata(ConfigError):
    """A checkpoint's ``.metadata`` that is not a pickle (truncated, garbage, empty): damage, not tampering."""


def check_metadata_pickle(path: Path) -> None:
    import io
    import pickle

    class _AllowList(pickle.Unpickler):
        def find_class(self, module, name):
            if not _allowed_global(module, name):
                raise ConfigError(
                    f"checkpoint {path}: .metadata references {module}.{name}, which a checkpoint never needs; "
                    "refusing to load it (the directory may have been tampered with)"
                )
            return super().find_class(module, name)

    try:
        _AllowList(io.BytesIO((path / ".metadata").read_bytes())).load()
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - truncated or garbage pickle
        raise UnreadableMetadata(f"checkpoint {path}: .metadata is unreadable ({type(e).__name__}: {e})") from None


def checkpoint_root(cfg: CheckpointConfig, run_dir: Path) -> Path:
    """Where the run keeps its checkpoints: ``checkpoint.dir``, relative to the run directory unless absolute."""
    root = Path(os.path.expanduser(cfg.dir))
    return root if root.is_absolute() else Path(run_dir) / root


class Checkpointer:
    """Save ``state`` every ``checkpoint.every`` steps and at the end; resume it before the loop.

    ``state``: the run's ``TrainState`` (a torchtitan-style Stateful: what ``state_dict()`` gives is
    saved, ``load_state_dict()`` gets it back). ``layout``, ``data_layout`` and ``config`` (the run's config as a
    dict) are what each ``meta.json`` records beside the step; ``data_layout`` is also what a resume must match.
    """

    def __init__(self, state: TrainState, cfg: CheckpointConfig, *, run_dir: Path, total_steps: int, layout: str,
                 data_layout: dict | None, config: dict, rank: int = 0, world_size: int = 1):
        self.state = state
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.root = checkpoint_root(cfg, self.run_dir)
        self.total_steps = total_steps
        self.rank, self.world_size, self.is_main = rank, world_size, rank == 0
        self.meta = {"layout": layout, "model": config["model"], "config": config, "data_layout": data_layout}
        if (config["model"].get("lora") or {}).get("enable") and self.is_main:  # what the adapters were trained on
            self.meta["lora_base"] = lora.base_fingerprint(config["model"], config["training"]["seed"])
        self.last_saved: int | None = None  # the newest step saved or being saved (an async save in flight)
        self.published: int | None = None  # the newest step whose checkpoint is complete (rank 0 knows it first)
        self.stalls: list[dict] = []  # per save: step, mode, stall_s (seconds the training loop was blocked)
        self.async_saves = AsyncSaves(cfg.async_mode) if cfg.enable and cfg.async_mode != "disabled" else None
        self.resume_from: Path | None = None
        if self.cfg.resume:
            self.resume_from = find_checkpoint(self.cfg.resume, self.root)  # the launcher warned
            if self.resume_from is not None:  # fail before anything is written, on every rank
                check_model_matches(self.resume_from, state.model_tensors(), what=f"checkpoint.resume={self.cfg.resume}",
                                    stage_only=state.stage_only)
                # quiet: the run dir's owner said it before any worker started (resolve.at_run_dir -> check_run_dir);
                # a rank saying it again printed it twice, in other words (issue 40 weak case)
                refuse_layout_change(read_meta(self.resume_from).get("data_layout"), data_layout,
                                     self.resume_from, self.cfg.allow_data_change, quiet=True)

    def _log(self, text: str) -> None:
        if self.is_main:
            print(text, flush=True)

    # -- resume ---------------------------------------------------------------------------
    def maybe_resume(self) -> None:
        if self.cfg.resume and self.resume_from is None:
            self._log(f"checkpoint.resume={self.cfg.resume}: no complete checkpoint under {self.root}; starting at step 0")
        if self.resume_from is None:
            return
        import torch.distributed.checkpoint as dcp

        state = self.state.state_dict()
        saved = _metadata_keys(self.resume_from)
        for key in [k for k in state if k.startswith("rng_rank") and k not in saved]:
            state.pop(key)  # resumed under a different world size: this rank keeps its own generators
        check_metadata_pickle(self.resume_from)
        try:
            dcp.load(state, checkpoint_id=str(self.resume_from))
        except Exception as e:  # noqa: BLE001 - DCP wraps per-rank failures in CheckpointException
            raise ConfigError(f"checkpoint.resume: cannot read {self.resume_from} ({_first_line(e)})") from None
        self.state.load_state_dict(state)
        self.last_saved = self.published = self.state.step
        self._log(f"resumed from {self.resume_from} at step {self.state.step}")

    # -- save -----------------------------------------------------------------------------
    def maybe_save(self, step: int) -> float | None:
        """The periodic save when due (asynchronous with ``checkpoint.async_mode``; the last step is ``finish``'s):
        the seconds it blocked the training loop, or None when none was due."""
        if self.cfg.enable and self.cfg.every and step % self.cfg.every == 0 and step < self.total_steps:
            self.save(step, asynchronous=self.async_saves is not None)
            return self.stalls[-1]["stall_s"]
        return None

    def save_now(self) -> Path:
        """A checkpoint of the current step (also when periodic checkpoints are off), complete when this returns: on
        a stop signal. An asynchronous save of this step in flight is waited for, not repeated."""
        step = self.state.step
        if self.last_saved == step:
            self.wait()
            if self.published == step:
                return self.root / f"step-{step:08d}"
        return self.save(step)

    def wait_for_staging(self) -> None:
        """Before the optimizer changes the weights: an asynchronous save's copy must be taken (pinned mode stages
        on the accelerator's copy stream; ``async`` copied before it returned). Counted in that save's stall."""
        if self.async_saves is not None:
            waited = self.async_saves.wait_for_staging()
            if waited and self.stalls:
                self.stalls[-1]["stall_s"] += waited

    def wait(self) -> float:
        """Block until an asynchronous save in flight is written and published; raise its failure as the save's.
        Returns the seconds waited."""
        if self.async_saves is None:
            return 0.0
        waited, job = self.async_saves.wait()
        if job is not None and job.error is not None:
            self._failed(job.step, job.error, self.root / f".tmp-step-{job.step:08d}")
        return waited

    def save(self, step: int, *, asynchronous: bool = False) -> Path:
        """Save ``step`` into ``step-N`` (the path returned); ``asynchronous``: return once the state is staged,
        the directory being published when its write completes."""
        t0 = time.perf_counter()
        self.wait()  # one save at a time: the previous one is complete before this one starts
        final = self.root / f"step-{step:08d}"
        tmp = self.root / f".tmp-step-{step:08d}"
        if self.is_main:
            claim_checkpoint_dir(self.root, self.run_dir)
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        _barrier()
        try:
            if asynchronous:
                self.async_saves.submit(step, self.state.state_dict(), str(tmp), self._after_write)
            else:
                self._write(step, tmp)
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - disk full, permissions, any rank's DCP error
            self._failed(step, e, tmp)
        stall = time.perf_counter() - t0
        self.stalls.append({"step": step, "mode": "async" if asynchronous else "sync", "stall_s": stall})
        if self.is_main:
            self._log(f"checkpoint: step {step} -> {final} ({'staged in ' if asynchronous else ''}{stall:.1f}s"
                      f"{', writing in the background' if asynchronous else ''})")
        if not asynchronous:
            _barrier()
        self.last_saved = step
        return final

    def _failed(self, step: int, e: BaseException, tmp: Path) -> None:
        why, fix = write_failure(e, self.root, "checkpoint.dir")  # before the partial save is removed
        if self.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        kept = list_checkpoints(self.root)
        raise TrainingError(
            f"checkpoint: cannot save step {step} to {self.root} ({why}); "
            f"{'the last good checkpoint ' + str(kept[-1]) + ' is kept' if kept else 'no earlier checkpoint exists'}; "
            f"{fix}, then resume with checkpoint.resume=auto"
        ) from None

    def _write(self, step: int, tmp: Path) -> None:
        """DCP into tmp, then (rank 0) meta.json and the rename."""
        import torch.distributed.checkpoint as dcp

        dcp.save(self.state.state_dict(), checkpoint_id=str(tmp))
        _barrier()
        self._after_write(step)

    def _after_write(self, step: int) -> None:
        """Every rank's data and DCP's .metadata are in ``.tmp-step-N``: publish it (rank 0; an asynchronous save:
        in its writer's thread, once its future resolved)."""
        if os.environ.get(KILL_IN_SAVE_ENV) == str(step) and self.is_main:
            os.kill(os.getpid(), signal.SIGKILL)  # test hook: die with the data written, before it is published
        if self.is_main:
            self._publish(step, self.root / f".tmp-step-{step:08d}", self.root / f"step-{step:08d}")
        self.published = step

    def _publish(self, step: int, tmp: Path, final: Path) -> None:
        """meta.json last, then an atomic rename to ``final``; older checkpoints pruned."""
        meta = {"step": step, "time": time.time(), "world_size": self.world_size, **self.meta}
        with open(tmp / META, "w") as fh:
            json.dump(meta, fh, indent=1, default=str)
            fh.flush()
            os.fsync(fh.fileno())
        _fsync_dir(tmp)
        old = self.root / f".old-step-{step:08d}"
        if final.exists():  # re-saving a step (after a resume): swap, never delete first
            os.rename(final, old)
        os.rename(tmp, final)
        _fsync_dir(self.root)
        shutil.rmtree(old, ignore_errors=True)
        self._prune(step)

    def _prune(self, step: int) -> None:
        complete = list_checkpoints(self.root)
        for p in complete[: max(0, len(complete) - self.cfg.keep)]:
            shutil.rmtree(p, ignore_errors=True)
        for p in self.root.glob(".tmp-step-*"):  # leftovers of interrupted saves
            shutil.rmtree(p, ignore_errors=True)

    def finish(self) -> None:
        """The final save, synchronous (unless this step is saved already), after any save in flight."""
        if not self.cfg.enable:
            return
        waited = self.wait()
        if self.published != self.state.step:
            self.save(self.state.step)
        if waited and self.stalls:  # the loop's end waited for the write in flight
            self.stalls[-1]["stall_s"] += waited
        if self.async_saves is not None:
            self.async_saves.close()

    def stall_summary(self) -> dict:
        """summary.json's record of what the saves cost the training loop (seconds blocked, per save and in all)."""
        if not self.stalls:
            return {}
        return {"checkpoint_async_mode": self.cfg.async_mode,
                "checkpoint_stalls": [{**s, "stall_s": round(s["stall_s"], 4)} for s in self.stalls],
                "checkpoint_stall_s": round(sum(s["stall_s"] for s in self.stalls), 4)}


def _metadata_keys(path: Path) -> set[str]:
    from torch.distributed.checkpoint import FileSystemReader

    check_metadata_pickle(path)
    return set(FileSystemReader(str(path)).read_metadata().state_dict_metadata)


def _first_line(e: BaseException) -> str:
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return f"{type(e).__name__}: {lines[0] if lines else ''}"[:300]


def _same_base_model(resume: str, found: Path, saved: str | None, now: str | None) -> None:
    """A resume continues the checkpoint's weights, and the run's recorded config (``.hydra/``, W&B,
    ``meta.json``) must keep naming the base model they came from: another ``model.init_from`` is refused,
    unless the recorded directory is gone (the base model moved), which is said once."""
    def real(p):
        return os.path.realpath(os.path.expanduser(p)) if p else None

    if saved == now or real(saved) == real(now):
        return
    if saved and now and not os.path.isdir(os.path.expanduser(saved)):
        line = (f"note: checkpoint.resume={resume}: the checkpoint's base model model.init_from={saved!r} is gone; "
                f"continuing with model.init_from={now!r} (checked against the checkpoint's tensors), which the run's "
                "config now records")
        if line not in _WARNED:
            _WARNED.add(line)
            print(line, file=sys.stderr, flush=True)
        return
    was = f"model.init_from={saved!r}" if saved else "no model.init_from"
    raise ConfigError(
        f"checkpoint.resume={resume}: {found} was trained from {was}, but this run sets "
        f"{'model.init_from=' + repr(now) if now else 'none'}; a resume continues the checkpoint's weights, so "
        f"resume with {'model.init_from=' + saved if saved else 'model.init_from unset'}, or start a new run "
        "(another hydra.run.dir) from the other base model"
    )


def _same_objective(resume: str, found: Path, saved: dict, rc: RunConfig) -> None:
    """Settings that change what is trained without changing a tensor: a resume under another value went on
    silently and rewrote the run's recorded config (``.hydra/``, W&B, the next ``meta.json``), so the run's record
    no longer said how its first steps were trained. Refused, as another ``model.init_from`` is."""
    model, data, training = saved.get("model") or {}, saved.get("data") or {}, saved.get("training") or {}
    for key, was, now, what in (
            ("model.moe.balance", (model.get("moe") or {}).get("balance"), rc.model.moe.balance, "load balancing"),
            ("data.document_masking", data.get("document_masking"), rc.data.document_masking, "attention"),
            # resolved on both sides (bf16 | none); "auto" in a config recorded before the resolution wrote it back
            ("training.mixed_precision", training.get("mixed_precision"), rc.training.mixed_precision, "precision")):
        if was is None or was == now or "auto" in (was, now):  # an older checkpoint without the key: nothing to compare
            continue
        was, now = (str(v).lower() if isinstance(v, bool) else v for v in (was, now))
        raise ConfigError(
            f"checkpoint.resume={resume}: {found} was trained with {key}={was}, but this run sets {key}={now}; "
            f"a resume continues that run (its {what} and its recorded config), so resume with {key}={was}, or start "
            "a new run (another hydra.run.dir)"
        )


def _same_lora_base(resume: str, found: Path, meta: dict, rc: RunConfig) -> None:
    """A LoRA checkpoint holds the adapters only: they mean something on the base they were trained on alone
    (``meta.json``'s ``lora_base``: its path and a sha256 of its weights). Another base, or a resume that turns
    LoRA on or off, is refused."""
    was = bool((((meta.get("config") or {}).get("model") or {}).get("lora") or {}).get("enable"))
    if was != rc.model.lora.enable:
        raise ConfigError(
            f"checkpoint.resume={resume}: {found} was trained with model.lora.enable={str(was).lower()}, but this run "
            f"sets model.lora.enable={str(rc.model.lora.enable).lower()}; resume with the same setting, or start a new "
            "run (another hydra.run.dir)")
    if not was:
        return
    why = lora.base_difference(meta.get("lora_base"), lora.base_fingerprint(rc.model, rc.training.seed))
    if why is not None:
        raise ConfigError(
            f"checkpoint.resume={resume}: {found} holds LoRA adapters trained on another base model ({why}); "
            "adapters only fit the base they were trained on: resume with that base, or start a new run")


def preflight(rc: RunConfig, run_dir: Path) -> None:
    """Cheap checks in the launching process (before workers start): resume target, and model.init_from as its
    backend's spec checks it (``models.check_init_from``)."""
    log_call("checkpoint.preflight")
    ck = rc.checkpoint
    if ck.resume:
        found = find_checkpoint(ck.resume, checkpoint_root(ck, run_dir))
        if found is not None:
            saved = models.canonical(read_meta(found).get("model", {}))  # model=native_moe's names as today's
            now = models.canonical(rc.model)
            differ = [f"{k}={saved.get(k)!r}" for k in ("backend", "flavor", "path") if saved.get(k) != getattr(now, k)]
            if differ:
                raise ConfigError(
                    f"checkpoint.resume={ck.resume}: {found} holds another model shape (saved with model "
                    f"{', '.join(differ)}); resume with the same model settings, or use another checkpoint.dir"
                )
            _same_base_model(ck.resume, found, saved.get("init_from"), rc.model.init_from)
            _same_objective(ck.resume, found, read_meta(found).get("config") or {}, rc)
            _same_lora_base(ck.resume, found, read_meta(found), rc)
    models.check_init_from(rc)
