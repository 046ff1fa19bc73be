"""``data=chat`` in windows: rendered conversations (``chat``) packed into ``data.seq_len`` windows, one conversation
per document (``data.packing=true``: best-fit decreasing, positions restarting at each conversation, so attention
stays inside it), or one conversation per window, padded (``data.packing=false``). Both give each conversation the
same loss: its tokens see the same context at the same positions.

A conversation of n tokens fills n - 1 window positions: inputs ``ids[:-1]``, labels ``ids[1:]`` where the mask says
the label is in the loss, else ``IGNORE_INDEX``. The rest of a window is padding (the end-of-text token, labels
ignored, positions restarting at 0: a document of its own). Held-out conversations are chosen as the listed
sources' documents are (``data.PackedDataset``: the lowest sha256 of their names, ``data.val_fraction``); the
windows' seeded order, the batches and resume are ``PackedDataset``'s.
"""

from __future__ import annotations

import bisect
import hashlib

import numpy as np
import torch

from qwen3_research import chat
from qwen3_research.config import ConfigError, DataConfig
from qwen3_research.data import IGNORE_INDEX, Batch, PackedDataset, Tokenizer, tokenizer_path


def prepare(cfg: DataConfig, tokenizer_spec: str) -> dict:
    """The start-up check of ``data=chat`` (``resolve.resolve_before_hydra``): every record read and rendered with
    the tokenizer's template, so a bad one is a ConfigError before any worker starts; the result is cached for
    the workers' ``ChatDataset``."""
    return chat.prepare(cfg, tokenizer_path(tokenizer_spec))


def pack(lengths: list[int], window: int, packing: bool) -> list[list[int]]:
    """Conversation indices per window: best-fit decreasing (the fullest window that still has room), or one each."""
    if not packing:
        return [[i] for i in range(len(lengths))]
    bins: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (room left, bin index), sorted
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        at = bisect.bisect_left(free, (lengths[i], -1))
        if at < len(free):
            room, b = free.pop(at)
            bins[b].append(i)
            bisect.insort(free, (room - lengths[i], b))
        else:
            bins.append([i])
            bisect.insort(free, (window - lengths[i], len(bins) - 1))
    return bins


class Windows:
    """Inputs, labels and positions (n, seq_len) of one split, and which conversation holds each position."""

    def __init__(self, ids: list[np.ndarray], mask: list[np.ndarray], seq_len: int, pad_id: int, packing: bool):
        lengths = [len(a) - 1 for a in ids]
        self.groups = pack(lengths, seq_len, packing)
        n = len(self.groups)
        self.inputs = np.full((n, seq_len), pad_id, dtype=np.int32)
        self.labels = np.full((n, seq_len), IGNORE_INDEX, dtype=np.int32)
        self.positions = np.zeros((n, seq_len), dtype=np.int32)
        self.owner = np.full((n, seq_len), -1, dtype=np.int32)  # conversation index of each position, -1: padding
        for w, group in enumerate(self.groups):
            at = 0
            for i in group:
                m = lengths[i]
                self.inputs[w, at: at + m] = ids[i][:-1]
                self.labels[w, at: at + m] = np.where(mask[i][1:], ids[i][1:], IGNORE_INDEX)
                self.positions[w, at: at + m] = np.arange(m)
                self.owner[w, at: at + m] = i
                at += m
            self.positions[w, at:] = np.arange(seq_len - at)  # padding: a document of its own
        self.loss_tokens = (self.labels != IGNORE_INDEX).sum(axis=1)
        self.real_tokens = int((self.owner >= 0).sum())

    def __len__(self) -> int:
        return len(self.groups)


class ChatDataset(PackedDataset):
    """``data=chat`` behind ``PackedDataset``'s interface: ``train`` / ``val`` are window indices into ``Windows``."""

    def __init__(self, cfg: DataConfig, tokenizer: Tokenizer):
        self.cfg, self.eos_id = cfg, tokenizer.eos_id
        corpus = chat.prepare(cfg, tokenizer.path)
        names, ids, mask = corpus["names"], corpus["ids"], corpus["mask"]
        self.meta = corpus["meta"]
        order = sorted(range(len(names)), key=lambda i: hashlib.sha256(names[i].encode()).hexdigest())
        n_val = int(round(cfg.val_fraction * len(names))) if len(names) > 1 else 0
        if cfg.val_fraction > 0 and n_val == 0 and len(names) > 1:
            n_val = 1
        held = set(order[:n_val])
        self.train_ids = [i for i in range(len(names)) if i not in held]
        self.val_ids = [i for i in range(len(names)) if i in held]
        self.names, self.ids, self.mask = names, ids, mask
        self._train, self._val = self.windows("train", cfg.packing), self.windows("val", cfg.packing)
        self.train = np.arange(len(self._train))
        self.val = np.arange(len(self._val))
        self.num_tokens = int(self.meta["tokens"])
        self.num_documents, self.val_documents = len(names), n_val
        if len(self.train) == 0:
            raise ConfigError(f"data=chat: data.val_fraction={cfg.val_fraction} holds out all {len(names)} "
                              "conversations; lower data.val_fraction")

    def windows(self, split: str, packing: bool) -> Windows:
        """The windows of the ``train`` or ``val`` conversations, packed or one per window."""
        which = self.train_ids if split == "train" else self.val_ids
        return Windows([self.ids[i] for i in which], [self.mask[i] for i in which], self.cfg.seq_len, self.eos_id,
                       packing)

    def _to_batch(self, rows: np.ndarray) -> Batch:
        w = self._val if getattr(self, "_reading_val", False) else self._train
        rows = np.asarray(rows, dtype=np.int64)
        batch = Batch(inputs=torch.from_numpy(w.inputs[rows].astype(np.int64)),
                      labels=torch.from_numpy(w.labels[rows].astype(np.int64)))
        if self.cfg.document_masking:
            batch.positions = torch.from_numpy(w.positions[rows].astype(np.int64))
        return batch

    def val_batches(self, n: int, dp_rank: int, dp_size: int) -> list[Batch]:
        self._reading_val = True
        try:
            return super().val_batches(n, dp_rank, dp_size)
        finally:
            self._reading_val = False

    def loss_tokens(self, step: int, grad_accum: int, dp_size: int, seed: int) -> int:
        """Label tokens in the loss over optimizer step ``step`` (0-based) on every data-parallel rank."""
        idx = self.batch_indices(step, self.cfg.batch_size * dp_size * grad_accum, seed)
        return int(self._train.loss_tokens[idx].sum())

    def summary(self) -> dict:
        """What summary.json records of the chat data (counts of the rendering and of the windows)."""
        w = self._train
        return {**self.meta, "train_conversations": len(self.train_ids), "val_conversations": len(self.val_ids),
                "train_windows": len(w), "val_windows": len(self._val), "packing": self.cfg.packing,
                "loss_on": self.cfg.loss_on, "overlong": self.cfg.overlong,
                "packing_efficiency": round(w.real_tokens / max(1, len(w) * self.cfg.seq_len), 4)}
