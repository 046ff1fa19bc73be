"""Where ``data=chat``'s records come from (``chat``): ``data.files`` (JSON lines), ``data.hf.*`` (a datasets
dataset, streaming too), or the default corpus, the registry package ``chitchat-dataset`` (MIT; 7,168 two-person
chats in one ``dataset.json``; the first sender the user, the other the assistant; no text written here).
Each record comes with a name that says where it is (``data.files F line N``, ``data.hf.name=X row N``,
``chitchat:ID``): errors quote it, and held-out conversations are chosen by its hash.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
from pathlib import Path

from qwen3_research import token_stream
from qwen3_research.config import ConfigError, DataConfig, data_files


def _package_file(dist: str, module: str, name: str) -> Path:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(f"data=chat: package {dist!r} is not installed (the default chat corpus); reinstall with "
                          "README's install command, or give data.files / data.hf.name")
    return Path(list(spec.submodule_search_locations)[0]) / name


def chitchat_path() -> Path:
    return _package_file("chitchat-dataset", "chitchat_dataset", "dataset.json")


def chitchat_records(data: dict | None = None):
    """The chitchat corpus (``data``: its dataset.json, already read) as ``messages`` records: first sender user,
    second assistant; one sender's texts in a row joined by a newline. A chat with one sender has no reply to learn
    (3,150 of the 7,168): the caller skips and counts it."""
    data = data if data is not None else json.loads(chitchat_path().read_text(encoding="utf-8"))
    for cid, chat in data.items():
        runs = chat.get("messages") or []
        senders = []
        messages = []
        for run in runs:
            if not run:
                continue
            sender = run[0]["sender"]
            if sender not in senders:
                senders.append(sender)
            role = "user" if sender == senders[0] else "assistant"
            text = "\n".join(u["text"] for u in run)
            if messages and messages[-1]["role"] == role:
                messages[-1]["content"] += "\n" + text
            else:
                messages.append({"role": role, "content": text})
        yield f"chitchat:{cid}", {"messages": messages}


def file_records(pattern: str):
    for f in data_files(pattern):
        if not f.endswith(".jsonl"):
            raise ConfigError(f"data.files: {f} is not a .jsonl file; data=chat reads JSON lines, one conversation each")
        with open(f, encoding="utf-8") as fh:
            for i, line in enumerate(fh):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ConfigError(f"data.files: {f} line {i + 1} is not JSON ({e.msg}, column {e.colno})") from None
                yield f"data.files {f} line {i + 1}", row


def hf_records(h):
    for i, row in token_stream.dataset_rows(h):
        yield f"data.hf.name={h.name} row {i}", row


def source_identity(cfg: DataConfig) -> dict:
    """What fixes the records, known without reading them (files by size and mtime, as token_stream's key)."""
    if cfg.files:
        return {"files": [[f, os.path.getsize(f), os.stat(f).st_mtime_ns] for f in data_files(cfg.files)]}
    if cfg.hf.name:
        h = cfg.hf
        return {"hf": [h.name, h.config_name, h.split, h.max_documents, token_stream._local_files(h.name)]}
    p = chitchat_path() if _has_chitchat() else None
    return {"chitchat": [importlib.metadata.version("chitchat-dataset"), p.stat().st_size if p else None]}


def _has_chitchat() -> bool:
    try:
        return chitchat_path().is_file()
    except ConfigError:
        return False


def records(cfg: DataConfig):
    """(name, record) of the configured chat source, in order."""
    if cfg.files:
        return file_records(cfg.files)
    if cfg.hf.name:
        return hf_records(cfg.hf)
    return chitchat_records()


def describe(cfg: DataConfig) -> str:
    return f"data.files={cfg.files!r}" if cfg.files else f"data.hf.name={cfg.hf.name!r}" if cfg.hf.name else "chitchat"
