"""Throughput, MFU and memory maths for one logged step (no I/O here)."""

from __future__ import annotations

import math


def tokens_per_second(tokens: int, seconds: float) -> float:
    return tokens / seconds if seconds > 0 else 0.0


def mfu(flops_per_token: float, tokens_per_s: float, peak_flops_per_device: float, num_devices: int) -> float:
    """Model FLOPs utilisation: achieved training FLOP/s over the devices' peak (torchtitan's definition)."""
    if peak_flops_per_device <= 0 or num_devices <= 0:
        return 0.0
    return flops_per_token * tokens_per_s / (peak_flops_per_device * num_devices)


def is_finite(*values: float) -> bool:
    return all(math.isfinite(v) for v in values)


class StepTimer:
    """Separates the first step (compile / warm-up) from steady steps."""

    def __init__(self):
        self.first_step_s: float | None = None
        self.steady_sum = 0.0
        self.steady_n = 0
        self._warm = True  # the next step is a warm-up (the first of this process)

    def add(self, seconds: float) -> None:
        if self.first_step_s is None:
            self.first_step_s = seconds
        elif not self._warm:
            self.steady_sum += seconds
            self.steady_n += 1
        self._warm = False

    @property
    def steady_mean_s(self) -> float:
        return self.steady_sum / self.steady_n if self.steady_n else (self.first_step_s or 0.0)

    def state(self) -> dict:
        return {"first_step_s": self.first_step_s, "steady_sum": self.steady_sum, "steady_n": self.steady_n}

    def load(self, state: dict) -> None:
        """Continue a resumed run's timing; this process's first step is again a warm-up, not steady."""
        self.first_step_s = state.get("first_step_s")
        self.steady_sum, self.steady_n = float(state.get("steady_sum", 0.0)), int(state.get("steady_n", 0))
        self._warm = True
