"""``checkpoint.async_mode``: a checkpoint written while training goes on (torch.distributed.checkpoint.async_save).

What the loop waits for is the staging: the state is copied off the live tensors (``async``: synchronously, inside
``async_save``, into host buffers kept for the next save; ``async_with_pinned_mem``: on the accelerator's copy stream into pinned shared
memory, which ``wait_for_staging`` waits for before the next optimizer update touches the weights). The write itself
runs in a thread (``async``) or a writer process (``async_with_pinned_mem``), over a gloo process group of its own:
the training's collectives and the writer's must never interleave on one group, and NCCL cannot carry DCP's
object collectives from a side thread. torchtitan does the same (``components/checkpointer/dcp.py``).

The directory is published (``meta.json``, the rename: ``checkpoint.Checkpointer._publish``) by rank 0 once its
future resolved, which DCP sets only after every rank's data and the ``.metadata`` are written: a crash before that
leaves a ``.tmp-step-N`` that no resume takes. At most one save is in flight; the next save, the final one and a
signal's wait for it first (``wait``).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType, AsyncSaveResponse


@dataclass
class InFlight:
    """One asynchronous save: its step, the write's future, the staging's (pinned mode) and when it is published."""

    step: int
    future: Future
    staging: Future | None = None
    done: threading.Event = field(default_factory=threading.Event)  # set after ``on_done`` ran (published or failed)
    error: BaseException | None = None


class AsyncSaves:
    """The asynchronous saves of one checkpointer: one in flight at a time, its own gloo group, the stager."""

    def __init__(self, mode: str):
        self.mode = mode
        # Collective: every rank builds its Checkpointer at the same point of the Trainer's start.
        self.pg = dist.new_group(backend="gloo") if dist.is_available() and dist.is_initialized() else None
        self.stager = None
        self.inflight: InFlight | None = None

    def submit(self, step: int, state_dict: dict, checkpoint_id: str, on_done: Callable[[int], None]) -> None:
        """Stage ``state_dict`` and start writing it to ``checkpoint_id``; ``on_done(step)`` runs once the write
        succeeded (in the writer's thread)."""
        if self.mode == "async_with_pinned_mem":
            if self.stager is None:  # pinned shared buffers, kept across saves (torchtitan's settings)
                self.stager = DefaultStager(StagingOptions(use_pinned_memory=True, use_shared_memory=True,
                                                           use_async_staging=True, use_non_blocking_copy=True))
            result = dcp.async_save(state_dict, checkpoint_id=checkpoint_id, process_group=self.pg,
                                    async_checkpointer_type=AsyncCheckpointerType.PROCESS, async_stager=self.stager)
            assert isinstance(result, AsyncSaveResponse)
            job = InFlight(step, result.upload_completion, staging=result.staging_completion)
        else:  # copied in this thread before async_save returns
            if self.stager is None:  # its host buffers are reused by the next save (which waits for this write
                # first): a fresh copy page-faults its memory in again, ~3x the time of copying into the kept one
                self.stager = DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=False,
                                                           use_async_staging=False, use_non_blocking_copy=False))
            job = InFlight(step, dcp.async_save(state_dict, checkpoint_id=checkpoint_id, process_group=self.pg,
                                                async_stager=self.stager))
        self.inflight = job

        def finished(future: Future) -> None:
            try:
                future.result()
                on_done(job.step)
            except BaseException as e:  # noqa: BLE001 - raised in the training thread by ``wait``
                job.error = e
            finally:
                job.done.set()

        job.future.add_done_callback(finished)

    def wait_for_staging(self) -> float:
        """Block until the in-flight save's copy is taken (pinned mode); seconds waited."""
        job = self.inflight
        if job is None or job.staging is None:
            return 0.0
        t0 = time.perf_counter()
        job.staging.result()
        job.staging = None
        return time.perf_counter() - t0

    def wait(self) -> tuple[float, InFlight | None]:
        """Block until the in-flight save is written and published: (seconds waited, the save, or None). Its
        error, if it failed, is the caller's to raise (``InFlight.error``)."""
        job = self.inflight
        if job is None:
            return 0.0, None
        t0 = time.perf_counter()
        self.wait_for_staging()
        job.done.wait()
        self.inflight = None
        return time.perf_counter() - t0, job

    def close(self) -> None:
        if self.stager is not None:
            self.stager.close()
            self.stager = None
