"""``data=chat``: conversations read, rendered with the run's own tokenizer's chat template, and loss-masked.

Records come in TRL's two formats: ``messages`` (a list of ``{role, content}``) or ``prompt``/``completion`` (both
strings, or both lists of messages), read by ``chat_sources`` (JSONL files, a datasets dataset, or the default
corpus, chitchat).

Every conversation is rendered by transformers' ``apply_chat_template`` with the run's tokenizer (``tokenizer_config
.json``'s ``chat_template`` beside its ``tokenizer.json``): no template is written here. The loss mask
(``data.loss_on``):

- ``assistant``: each assistant turn as the template renders it after its generation prompt, up to and including the
  first special token after it, the end-of-turn token (Qwen3: ``<|im_end|>``; the newline the template writes after
  it is out: generation stops at that token, so the model never produces the newline). Qwen3's template renders an
  empty ``<think>\\n\\n</think>\\n\\n`` block in the last assistant turn and strips ``<think>`` blocks from assistant
  turns before the last user message: the mask covers the turn as rendered, so the thinking block of the last turn
  is in the loss and a stripped one is not.
- ``completion``: every token after the prompt (prompt/completion records; TRL's ``completion_only_loss``).
- ``all``: every token.

The assistant turns are located linearly: the generation prompt (what ``add_generation_prompt`` appends, Qwen3:
``<|im_start|>assistant\\n``) must occur once per assistant turn, and the rendering of the messages before the first
assistant turn, with the generation prompt, must be a prefix of the whole rendering. Rendering every prefix instead
is quadratic in the turns (9 s for one 385-message chitchat conversation). A template for which these checks fail is
refused by name, with the record.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from qwen3_research import chat_sources
from qwen3_research.config import ConfigError, DataConfig
from qwen3_research.devices import cache_dir
from qwen3_research.errors import write_failure

ROLES = ("system", "user", "assistant", "tool")
CHUNK = 256  # conversations rendered per apply_chat_template call
FORMAT = 1  # of the cache file: bump when what it holds changes


@dataclass
class Conversation:
    """One record: ``messages`` (as given, the template reads them), or ``text`` = (prompt, completion) strings;
    ``completion_at``: index of the first completion message (prompt/completion records), else None."""

    name: str
    messages: list | None = None
    text: tuple[str, str] | None = None
    completion_at: int | None = None


# -- records to conversations ------------------------------------------------------------------------


def _messages(value, name: str, key: str) -> list:
    if not isinstance(value, list) or not value:
        raise ConfigError(f"data=chat: {name}: {key!r} must be a non-empty list of {{role, content}} messages")
    for j, m in enumerate(value):
        if not isinstance(m, dict) or "role" not in m:
            raise ConfigError(f"data=chat: {name}: {key}[{j}] is not a {{role, content}} message")
        if m["role"] not in ROLES:
            raise ConfigError(f"data=chat: {name}: {key}[{j}] has the unknown role {m['role']!r}; give it one of "
                              f"the roles {', '.join(ROLES)}")
        if not isinstance(m.get("content"), str) and not (m["role"] == "assistant" and m.get("tool_calls")):
            raise ConfigError(f"data=chat: {name}: {key}[{j}] ({m['role']}) has no string content")
    return [dict(m) for m in value]


def conversation(name: str, row, loss_on: str) -> Conversation:
    """A record as a ``Conversation``, or a ConfigError naming the record and what is wrong with it."""
    if not isinstance(row, dict):
        raise ConfigError(f"data=chat: {name} is not a JSON object")
    if "messages" in row:
        msgs = _messages(row["messages"], name, "messages")
        if loss_on == "completion":
            raise ConfigError(f"data.loss_on=completion needs prompt/completion records; {name} holds messages: use "
                              "data.loss_on=assistant (or all)")
        conv = Conversation(name, messages=msgs)
    elif "prompt" in row and "completion" in row:
        p, c = row["prompt"], row["completion"]
        if isinstance(p, str) and isinstance(c, str):
            return Conversation(name, text=(p, c))
        if isinstance(p, str) or isinstance(c, str):
            raise ConfigError(f"data=chat: {name}: prompt and completion must both be strings or both lists of "
                              "messages (TRL's two prompt-completion formats)")
        prompt, completion = _messages(p, name, "prompt"), _messages(c, name, "completion")
        conv = Conversation(name, messages=prompt + completion, completion_at=len(prompt))
    else:
        raise ConfigError(f"data=chat: {name} has neither 'messages' nor 'prompt'/'completion' (its fields: "
                          f"{sorted(row)[:8]}); give conversations in one of TRL's formats")
    first = conv.completion_at or 0
    if not any(m["role"] == "assistant" for m in conv.messages[first:]):
        where = "its completion has" if conv.completion_at is not None else "it has"
        raise ConfigError(f"data=chat: {name}: {where} no assistant turn, so nothing to learn; remove the record or "
                          "add the assistant's reply")
    return conv


# -- the template ------------------------------------------------------------------------------------


def load_template_tokenizer(tokenizer_json: Path):
    """The transformers tokenizer of the run's ``tokenizer.json`` (its directory's tokenizer_config.json gives the
    chat template); a ConfigError when it has no chat template."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast  # deferred: start-up (transformers: seconds)

    folder = tokenizer_json.parent
    try:
        tok = AutoTokenizer.from_pretrained(str(folder)) if (folder / "tokenizer_config.json").is_file() else \
            PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_json))
    except Exception as e:  # noqa: BLE001 - transformers raises many types for a bad folder
        raise ConfigError(f"data=chat: cannot load the tokenizer in {folder} ({type(e).__name__}: "
                          f"{str(e).splitlines()[0][:160] if str(e) else ''})") from None
    if not getattr(tok, "chat_template", None):
        raise ConfigError(f"data=chat: the tokenizer in {folder} has no chat template (no chat_template in its "
                          "tokenizer_config.json or chat_template.jinja), so conversations cannot be rendered as the "
                          "model expects; use a chat model's tokenizer (data.tokenizer / model.path)")
    return tok


def generation_prompt(tok) -> str:
    """What ``add_generation_prompt`` appends after a user turn (Qwen3: ``<|im_start|>assistant\\n``)."""
    probe = [{"role": "user", "content": "?"}]
    plain = tok.apply_chat_template(probe, tokenize=False)
    gen = tok.apply_chat_template(probe, tokenize=False, add_generation_prompt=True)
    if not gen.startswith(plain) or len(gen) == len(plain):
        raise ConfigError("data=chat: the chat template's generation prompt does not extend a conversation "
                          "(add_generation_prompt), so assistant turns cannot be located")
    return gen[len(plain):]


class Renderer:
    """Token ids and loss masks of conversations, through one transformers tokenizer."""

    def __init__(self, tok, loss_on: str):
        self.tok, self.loss_on = tok, loss_on
        self.backend = tok.backend_tokenizer  # the tokenizers.Tokenizer: offsets in one pass
        self.special = set(tok.all_special_ids)
        self.eos = tok.eos_token_id
        self._gen = None

    @property
    def gen(self) -> str:
        if self._gen is None:
            self._gen = generation_prompt(self.tok)
        return self._gen

    def texts(self, convs: list[Conversation]) -> list[str]:
        chat = [c.messages for c in convs if c.messages is not None]
        rendered = iter(self.tok.apply_chat_template(chat, tokenize=False) if chat else [])
        return [next(rendered) if c.messages is not None else None for c in convs]

    def render(self, convs: list[Conversation]) -> list[tuple[np.ndarray, np.ndarray]]:
        """(ids int32, mask bool: the token is in the loss) per conversation."""
        texts = self.texts(convs)
        rendered = [t for t in texts if t is not None]
        encoded = iter(self.backend.encode_batch(rendered, add_special_tokens=False) if rendered else [])
        return [self._one(c, t, next(encoded) if t is not None else None) for c, t in zip(convs, texts)]

    def _one(self, c: Conversation, text: str | None, enc) -> tuple[np.ndarray, np.ndarray]:
        if c.text is not None:  # TRL's plain prompt/completion: no template; the completion ends with eos
            p = self.backend.encode(c.text[0], add_special_tokens=False).ids
            q = self.backend.encode(c.text[1], add_special_tokens=False).ids + [self.eos]
            ids = np.asarray(p + q, dtype=np.int32)
            mask = np.ones(len(ids), dtype=bool)
            if self.loss_on != "all":
                mask[: len(p)] = False
            return ids, mask
        ids = np.asarray(enc.ids, dtype=np.int32)
        ends = np.fromiter((e for _, e in enc.offsets), dtype=np.int64, count=len(ids))
        if self.loss_on == "all":
            return ids, np.ones(len(ids), dtype=bool)
        if self.loss_on == "completion":
            prompt = self.tok.apply_chat_template(c.messages[: c.completion_at], tokenize=False, add_generation_prompt=True)
            if not text.startswith(prompt):
                raise self._refused(c, "the prompt with its generation prompt is not a prefix of the whole")
            return ids, ends > len(prompt)
        return ids, self._assistant_mask(c, text, ids, ends)

    def _assistant_mask(self, c, text, ids, ends) -> np.ndarray:
        first = next(k for k, m in enumerate(c.messages) if m["role"] == "assistant")
        start = 0
        if first > 0:
            prefix = self.tok.apply_chat_template(c.messages[:first], tokenize=False, add_generation_prompt=True)
            if not text.startswith(prefix):
                raise self._refused(c, "its messages before the first assistant turn render differently alone")
            start = len(prefix) - len(self.gen)
        starts, at = [], text.find(self.gen, start)
        while at >= 0:
            starts.append(at + len(self.gen))
            at = text.find(self.gen, at + len(self.gen))
        wanted = [k for k, m in enumerate(c.messages) if m["role"] == "assistant"]
        if len(starts) != len(wanted):
            raise self._refused(c, f"the generation prompt {self.gen!r} occurs {len(starts)} times for "
                                   f"{len(wanted)} assistant turns")
        mask = np.zeros(len(ids), dtype=bool)
        keep = wanted if c.completion_at is None else [k for k in wanted if k >= c.completion_at]
        for k, s in zip(wanted, starts):
            t0 = int(np.searchsorted(ends, s, side="right"))  # the first token that ends after the turn starts
            t1 = next((t for t in range(t0, len(ids)) if int(ids[t]) in self.special), None)
            if t1 is None:
                raise self._refused(c, f"assistant message {k} is not closed by a special token")
            if k in keep:
                mask[t0: t1 + 1] = True
        return mask

    def _refused(self, c: Conversation, why: str) -> ConfigError:
        return ConfigError(f"data=chat: the chat template of {self.tok.name_or_path or 'the tokenizer'} cannot be "
                           f"split into turns for {c.name}: {why}; use data.loss_on=all, or another template")


# -- overlong conversations --------------------------------------------------------------------------


def _cuts(c: Conversation) -> list[int]:
    """Where the oldest turns can be cut: at a user message after the leading system messages, leaving an
    assistant turn to learn (prompt/completion records: inside the prompt only)."""
    lead = _lead(c)
    end = len(c.messages) if c.completion_at is None else c.completion_at
    return [i for i in range(len(lead) + 1, end) if c.messages[i]["role"] == "user"
            and any(m["role"] == "assistant" for m in c.messages[i:])]


def _lead(c: Conversation) -> list:
    """The leading system messages: kept by a cut."""
    out = []
    for m in c.messages:
        if m["role"] != "system":
            break
        out.append(m)
    return out


def _cut(c: Conversation, i: int) -> Conversation:
    msgs = _lead(c) + c.messages[i:]
    at = None if c.completion_at is None else c.completion_at - (len(c.messages) - len(msgs))
    return Conversation(c.name, messages=msgs, completion_at=at)


def fit(renderer: Renderer, c: Conversation, ids, mask, limit: int, policy: str):
    """(ids, mask, what happened: "" | "truncated" | "dropped") for a conversation of at most ``limit`` tokens."""
    if len(ids) <= limit:
        return ids, mask, ""
    cuts = _cuts(c) if (policy == "truncate_turns" and c.messages is not None) else []
    if not cuts:
        return None, None, "dropped"
    # Start at the cut that a share of the tokens proportional to the characters kept predicts, then walk: later
    # while the rest is too long, earlier while it still fits (one or two renders instead of one per turn).
    weight = np.cumsum([0] + [len(m.get("content") or "") + 16 for m in c.messages])
    est = [len(ids) * (weight[-1] - weight[i]) / weight[-1] for i in cuts]
    j = next((k for k, e in enumerate(est) if e <= limit), len(cuts) - 1)
    probes: dict[int, tuple] = {}

    def probe(k):
        if k not in probes:
            probes[k] = renderer.render([_cut(c, cuts[k])])[0]
        return probes[k]

    while j < len(cuts) and len(probe(j)[0]) > limit:
        j += 1
    if j == len(cuts):
        return None, None, "dropped"
    while j > 0 and len(probe(j - 1)[0]) <= limit:
        j -= 1
    best = probe(j)
    if best is None or not best[1].any():
        return None, None, "dropped"
    return best[0], best[1], "truncated"


# -- the prepared corpus (cached) -------------------------------------------------------------------


def cache_key(cfg: DataConfig, tokenizer_json: Path) -> str:
    folder = tokenizer_json.parent
    files = {n: hashlib.sha256((folder / n).read_bytes()).hexdigest() for n in
             ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")
             if (folder / n).is_file()}
    fields = {"tokenizer": files, "source": chat_sources.source_identity(cfg), "loss_on": cfg.loss_on, "overlong": cfg.overlong,
              "seq_len": cfg.seq_len, "max_documents": cfg.max_documents, "format": FORMAT}
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:24]


def prepare(cfg: DataConfig, tokenizer_json: Path) -> dict:
    """The rendered corpus: ``names`` (list), ``ids`` / ``mask`` (lists of arrays), ``meta`` (counts). Built once
    per source, tokenizer and settings under ``<cache>/chat/``; a bad record or template is a ConfigError here."""
    path = cache_dir() / "chat" / f"{cache_key(cfg, tokenizer_json)}.npz"
    if path.is_file():
        try:
            with np.load(path, allow_pickle=False) as z:
                lengths = z["lengths"]
                cut = np.cumsum(lengths)[:-1]
                return {"names": [str(n) for n in z["names"]], "ids": np.split(z["ids"], cut),
                        "mask": np.split(z["mask"], cut), "meta": json.loads(str(z["meta"]))}
        except (OSError, ValueError, KeyError):
            pass  # a damaged cache file is rebuilt below
    out = build(cfg, tokenizer_json)
    _save(path, out)
    return out


def build(cfg: DataConfig, tokenizer_json: Path) -> dict:
    tok = load_template_tokenizer(tokenizer_json)
    renderer = Renderer(tok, cfg.loss_on)
    limit = cfg.seq_len + 1  # a conversation of n tokens fills n - 1 inputs of a window
    names, ids, masks = [], [], []
    meta = {"records": 0, "truncated": 0, "dropped": 0, "skipped_no_reply": 0, "assistant_turns": 0}
    chunk: list[Conversation] = []

    def flush():
        for c, (i, m) in zip(chunk, renderer.render(chunk)):
            i, m, what = fit(renderer, c, i, m, limit, cfg.overlong)
            if what:
                meta[what] += 1
            if i is not None:
                names.append(c.name)
                ids.append(i)
                masks.append(m)
        chunk.clear()

    default = not cfg.files and not cfg.hf.name
    for name, row in chat_sources.records(cfg):
        if cfg.max_documents is not None and meta["records"] >= cfg.max_documents:
            break
        if default and sum(m["role"] == "assistant" for m in row["messages"]) == 0:
            meta["skipped_no_reply"] += 1  # a chitchat chat with one sender
            continue
        c = conversation(name, row, cfg.loss_on)
        meta["records"] += 1
        meta["assistant_turns"] += sum(m["role"] == "assistant" for m in (c.messages or [])) or 1
        chunk.append(c)
        if len(chunk) == CHUNK:
            flush()
    flush()
    if meta["records"] == 0:
        raise ConfigError(f"data=chat: the source ({chat_sources.describe(cfg)}) holds no conversation")
    if not ids:
        raise ConfigError(f"data=chat: all {meta['records']} conversations are longer than data.seq_len+1="
                          f"{limit} tokens (data.overlong={cfg.overlong}); raise data.seq_len")
    meta["conversations"] = len(ids)
    meta["tokens"] = int(sum(len(a) for a in ids))
    meta["loss_tokens"] = int(sum(int(m.sum()) for m in masks))
    return {"names": names, "ids": ids, "mask": masks, "meta": meta}


def _save(path: Path, out: dict) -> None:
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp.npz")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        np.savez(tmp, ids=np.concatenate(out["ids"]), mask=np.concatenate(out["mask"]),
                 lengths=np.array([len(a) for a in out["ids"]]), names=np.array(out["names"]),
                 meta=np.array(json.dumps(out["meta"])))
        os.replace(tmp, path)
    except OSError as e:  # the cache only saves the next run the rendering: this run goes on from memory
        tmp.unlink(missing_ok=True)
        if int(os.environ.get("RANK", "0")) == 0:
            why, fix = write_failure(e, path.parent, "QWEN3_RESEARCH_CACHE")
            print(f"warning: chat cache not written to {path.parent} ({why}); {fix}", file=sys.stderr, flush=True)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
