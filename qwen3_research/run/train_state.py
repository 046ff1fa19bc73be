"""What a run carries from one step to the next, and what a checkpoint holds: ``TrainState``.

Model, optimizer, learning-rate schedule, the step, the progress the summary reports (skipped steps,
last losses, step timer) and this rank's random generators. ``state_dict()`` / ``load_state_dict()``
follow torchtitan's ``Stateful`` (torch.distributed.checkpoint.stateful.Stateful); the checkpointer
(``qwen3_research.run.checkpoint``) saves and loads exactly what they give. Their keys are the format on
disk: ``model`` (parameters and persistent buffers, ``model_tensors``), ``optim``, ``scheduler``,
``progress``, ``rng_rank<R>``. Small non-tensor state travels as JSON bytes, so loading a checkpoint
never unpickles our data.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from qwen3_research import devices
from qwen3_research.metrics import StepTimer


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    return getattr(model, "_orig_mod", model)  # torch.compile's wrapper


def model_tensors(model: torch.nn.Module, save_frozen: bool = True) -> dict[str, torch.Tensor]:
    """Parameters and persistent buffers by their module path, as stored (sharded DTensors stay sharded);
    without ``save_frozen`` only the trainable parameters (a LoRA run: its base is named in meta.json instead).

    Not ``state_dict()``: torchtitan's fused QKV renames its weight in state-dict hooks, which
    DCP's state-dict helpers cannot map back to a module. Detached views, so DCP loads in place.
    """
    model = unwrap(model)
    out = {name: p.detach() for name, p in model.named_parameters() if save_frozen or p.requires_grad}
    for mod_name, mod in model.named_modules():
        for name, b in mod._buffers.items():
            if b is not None and name not in mod._non_persistent_buffers_set:
                out[f"{mod_name}.{name}" if mod_name else name] = b.detach()
    return out


@dataclass
class TrainState:
    model: torch.nn.Module  # the whole model (compiled or not); a checkpoint holds its local shards
    optimizer: torch.optim.Optimizer
    scheduler: Any  # torch.optim.lr_scheduler.LRScheduler
    rank: int = 0  # whose random generators ``rng_rank<R>`` holds
    device_type: str | None = None  # the run's device kind: its own generator (cuda, neuron) is checkpointed too
    step: int = 0  # optimizer steps done (skipped ones included); also the data position (data.train_batch)
    skipped_steps: list[int] = field(default_factory=list)  # steps skipped under training.nan_policy=skip
    final_loss: float | None = None  # the last logged training loss
    final_eval_loss: float | None = None
    timer: StepTimer = field(default_factory=StepTimer)
    save_frozen: bool = True  # False (LoRA): frozen parameters are not checkpointed (the base is rebuilt from its source)

    @property
    def rng_key(self) -> str:
        """Per rank: a run resumed under another world size has ranks the checkpoint holds no generators of."""
        return f"rng_rank{self.rank}"

    def model_tensors(self) -> dict[str, torch.Tensor]:
        return model_tensors(self.model, self.save_frozen)

    def _optim_options(self):
        """Pipelined: the optimizer state flattened by parameter name (torchtitan's choice). Nested, its
        ``param_groups`` are a list whose entries DCP keys by position, and every stage has a group 0 of other
        parameters: DCP keeps one rank's copy, and the other stages resumed without their groups (KeyError 'betas'
        in AdamW's step). Unpipelined checkpoints keep the nested format they always had."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        return StateDictOptions(flatten_optimizer_state_dict=True) if self.stage_only else None

    @property
    def stage_only(self) -> bool:
        """The model is this rank's pipeline stages (parallelism.pp > 1): its tensors are a part of the whole
        model's names, and a checkpoint holds every stage's."""
        return getattr(unwrap(self.model), "stage_parts", None) is not None

    def progress(self) -> dict:
        """Everything the summary reports that a resumed run must carry on."""
        return {"skipped_steps": list(self.skipped_steps), "final_loss": self.final_loss,
                "final_eval_loss": self.final_eval_loss, "timer": self.timer.state()}

    def state_dict(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return {
            "model": self.model_tensors(),
            "optim": get_optimizer_state_dict(unwrap(self.model), self.optimizer, options=self._optim_options()),
            "scheduler": _to_json_bytes(self.scheduler.state_dict()),
            "progress": _to_json_bytes({"step": self.step, **self.progress()}),
            self.rng_key: _rng_state(self.device_type),
        }

    def load_state_dict(self, state: dict) -> None:
        """``state`` as DCP filled it in: the model's tensors were loaded in place; a missing ``rng_rank<R>``
        (resumed under another world size) keeps this rank's generators."""
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        set_optimizer_state_dict(unwrap(self.model), self.optimizer, state["optim"], options=self._optim_options())
        self.scheduler.load_state_dict(_from_json_bytes(state["scheduler"]))
        progress = _from_json_bytes(state["progress"])
        self.step = int(progress["step"])
        self.skipped_steps = list(progress.get("skipped_steps", []))
        if progress.get("final_loss") is not None:
            self.final_loss = progress["final_loss"]
        self.final_eval_loss = progress.get("final_eval_loss")
        if progress.get("timer"):
            self.timer.load(progress["timer"])
        if self.rng_key in state:
            _set_rng_state(state[self.rng_key], self.device_type)


def _to_json_bytes(obj) -> bytes:
    return json.dumps(obj).encode()


def _from_json_bytes(blob: bytes):
    return json.loads(bytes(blob).decode())


def _rng_state(device_type: str | None = None) -> bytes:
    """Python's, numpy's and torch's generators, and the device's own where it has one (``devices.rng_state``),
    under its torch device type ("cuda" as checkpoints before issue 39 named the CUDA generator's)."""
    np_state = np.random.get_state()
    state = {
        "python": [random.getstate()[0], list(random.getstate()[1]), random.getstate()[2]],
        "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
        "torch": torch.get_rng_state().tolist(),
    }
    device = devices.rng_state(device_type) if device_type is not None else None
    if device is not None:
        state[devices.get(device_type).device_type] = device
    return _to_json_bytes(state)


def _set_rng_state(blob: bytes, device_type: str | None = None) -> None:
    state = _from_json_bytes(blob)
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    key = devices.get(device_type).device_type if device_type is not None else None
    if key in state:  # saved on the same device type (another's generator state means nothing here)
        devices.set_rng_state(device_type, state[key])
