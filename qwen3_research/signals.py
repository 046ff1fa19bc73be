"""SIGTERM / Ctrl-C: finish the current step, save a checkpoint, close the sinks, exit 128+signal.

A handler only sets a flag; the Trainer checks it between steps, and in a worker group all
ranks agree on it (an all-reduce) so they stop at the same step and save together.
"""

from __future__ import annotations

import signal
import threading


class Interrupted(Exception):
    """The run stopped on a signal after saving; ``exit_status`` is 128 + the signal number."""

    def __init__(self, signum: int, step: int, checkpoint: str | None):
        self.signum, self.step, self.checkpoint = signum, step, checkpoint
        name = signal.Signals(signum).name
        where = f"checkpoint saved to {checkpoint}" if checkpoint else "no checkpoint saved"
        super().__init__(f"interrupted by {name} after step {step}; {where}; continue with checkpoint.resume=auto "
                         "and the same hydra.run.dir")

    @property
    def exit_status(self) -> int:
        return 128 + self.signum


class Terminated(BaseException):
    """SIGTERM outside the training loop (start-up, between sweep points, the final save): like Ctrl-C's
    ``KeyboardInterrupt``, it unwinds the process, which exits 143 with one line (``__main__``)."""

    signum = signal.SIGTERM


def raise_terminated(signum, frame) -> None:
    raise Terminated()


def signal_number(e: BaseException) -> int | None:
    """The signal behind a stop: ``Interrupted`` (the loop saved), ``KeyboardInterrupt``/``Terminated`` (outside it)."""
    if isinstance(e, Interrupted):
        return e.signum
    if isinstance(e, KeyboardInterrupt):
        return signal.SIGINT
    if isinstance(e, Terminated):
        return signal.SIGTERM
    return None


class StopOnSignal:
    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, world_size: int, device: "torch.device"):  # noqa: F821 - torch is imported where it is used
        self.world_size = world_size
        self.device = device
        self.signum = 0
        self._old: dict = {}

    def _handle(self, signum, frame) -> None:
        self.signum = signum

    def __enter__(self) -> "StopOnSignal":
        if threading.current_thread() is threading.main_thread():
            for s in self.SIGNALS:
                self._old[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for s, old in self._old.items():
            # A rank of a worker group that stops on a signal ignores the next ones: a Ctrl-C reaches it twice
            # (from the terminal and from the launcher's agent), and the agent ends the shutdown, forcing it
            # after its timeout. A KeyboardInterrupt while the rank exits would print a traceback per rank.
            signal.signal(s, signal.SIG_IGN if self.signum and self.world_size > 1 else old)

    def requested(self) -> int:
        """The signal to stop on (0 = go on), the same on every rank."""
        if self.world_size == 1:
            return self.signum
        import torch  # here, not at the top: __main__ imports this module before the config is known, and the
        # launcher of a multi-node run sets c10d's log level before torch loads (__main__._quiet_c10d_retries)

        flag = torch.tensor([self.signum], dtype=torch.int64, device=self.device)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        return int(flag.item())
