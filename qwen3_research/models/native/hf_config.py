"""Hugging Face ``config.json`` <-> model=native's architecture (``models.flavors.Flavor``), and cheap checks of a
checkpoint directory: no torch import, so the launcher runs them before any worker starts.

- ``architecture_fields(dir)``: the Flavor fields that ``config.json`` describes (a Qwen3 or a Qwen3-MoE:
  ``MODEL_TYPES``; transformers 5's ``rope_parameters`` or 4.x's ``rope_theta``/``rope_scaling``); anything
  torchtitan's Qwen3 cannot express (RoPE scaling, sliding window, attention bias, decoder_sparse_step != 1,
  mlp_only_layers) is a one-line ConfigError naming the field.
- ``check_named_flavor``: an explicit ``model.flavor`` must describe the same architecture.
- ``check_weights(dir, flavor)``: the safetensors files exist, their headers parse and cover their
  data (truncation), an index names only present files, and every tensor the model needs is there
  with the right shape, read from the headers alone (no tensor data is read).
- ``hf_config_fields``: the config.json fields an export writes for a Flavor.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

from qwen3_research.errors import ConfigError

# The config.json model_types model=native reads (init_from) and writes (export): whether each is a mixture of experts.
MODEL_TYPES = {"qwen3": False, "qwen3_moe": True}

INDEX = "model.safetensors.index.json"
# Fields an architecture cannot do without (the rest have transformers' Qwen3Config defaults).
REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")
ROPE_TYPES_SUPPORTED = ("default",)


def _where(hf_dir: str, what: str) -> str:
    return f"{what}={hf_dir!r}"


def read_hf_config(hf_dir: str, what: str = "model.init_from") -> dict:
    path = Path(os.path.expanduser(hf_dir))
    if not path.is_dir():
        raise ConfigError(f"{_where(hf_dir, what)}: no such directory")
    try:
        return json.loads((path / "config.json").read_text())
    except FileNotFoundError:
        raise ConfigError(
            f"{_where(hf_dir, what)}: no config.json; point it at a Hugging Face model directory "
            "(e.g. `hf download Qwen/Qwen3-0.6B --local-dir DIR`)"
        ) from None
    except (OSError, ValueError) as e:
        raise ConfigError(f"{_where(hf_dir, what)}: config.json is unreadable ({e})") from None


def rope_of(cfg: dict, where: str) -> tuple[float, str]:
    """(rope_theta, rope_type) from transformers 5's ``rope_parameters`` or 4.x's ``rope_theta``/``rope_scaling``."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and params and all(isinstance(v, dict) for v in params.values()):
        kinds = sorted({json.dumps(v, sort_keys=True) for v in params.values()})  # per layer type
        if len(kinds) > 1:
            raise ConfigError(f"{where}: config.json rope_parameters differ per layer type ({sorted(params)}); "
                              "torchtitan's Qwen3 has one RoPE for every layer")
        params = next(iter(params.values()))
    params = params if isinstance(params, dict) else {}
    scaling = cfg.get("rope_scaling") if isinstance(cfg.get("rope_scaling"), dict) else {}
    rope_type = params.get("rope_type") or params.get("type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type not in ROPE_TYPES_SUPPORTED:
        raise ConfigError(
            f"{where}: config.json asks for RoPE scaling rope_type={rope_type!r}, which model=native does not "
            f"implement (supported: {', '.join(ROPE_TYPES_SUPPORTED)}); use model=hf model.path=... for this checkpoint"
        )
    theta = params.get("rope_theta", cfg.get("rope_theta"))
    return float(10000.0 if theta is None else theta), rope_type


def architecture_fields(hf_dir: str, what: str = "model.init_from") -> dict:
    return fields_from_config(read_hf_config(hf_dir, what), _where(hf_dir, what))


def fields_from_config(cfg: dict, where: str) -> dict:
    """The Flavor fields a Qwen3 / Qwen3-MoE config.json describes; a one-line error for what we cannot build."""
    if cfg.get("num_experts") is None and cfg.get("num_local_experts") is not None:
        cfg = {**cfg, "num_experts": cfg["num_local_experts"]}  # transformers 5 writes num_local_experts
    backend = "native"
    got = cfg.get("model_type")
    if got not in MODEL_TYPES:
        arch = ",".join(cfg.get("architectures") or []) or "?"
        want = " or ".join(repr(t) for t in MODEL_TYPES)
        raise ConfigError(f"{where}: config.json is model_type={got!r} ({arch}) but model={backend} needs "
                          f"model_type={want}; use model=hf model.path=... for other architectures")
    moe = MODEL_TYPES[got]
    absent = [k for k in REQUIRED + (("moe_intermediate_size", "num_experts", "num_experts_per_tok")
                                     if moe else ("intermediate_size",)) if cfg.get(k) is None]
    if absent:
        raise ConfigError(f"{where}: config.json lacks {', '.join(absent)}")
    unsupported = []
    if cfg.get("use_sliding_window"):
        unsupported.append(f"use_sliding_window={cfg['use_sliding_window']!r} (full attention only)")
    if cfg.get("attention_bias"):
        unsupported.append("attention_bias=true (Qwen3 projections have no bias)")
    if cfg.get("hidden_act", "silu") != "silu":
        unsupported.append(f"hidden_act={cfg['hidden_act']!r} (SwiGLU with silu only)")
    if moe:
        if cfg.get("decoder_sparse_step", 1) != 1:
            unsupported.append(f"decoder_sparse_step={cfg['decoder_sparse_step']!r} (every layer MoE: 1 only)")
        if cfg.get("mlp_only_layers"):
            unsupported.append(f"mlp_only_layers={cfg['mlp_only_layers']!r} (every layer MoE: [] only)")
    if unsupported:
        raise ConfigError(f"{where}: config.json has {'; '.join(unsupported)}, which model={backend} does not "
                          "implement; use model=hf model.path=... for this checkpoint")
    theta, _ = rope_of(cfg, where)
    heads = int(cfg["num_attention_heads"])
    kw = dict(
        dim=int(cfg["hidden_size"]), n_layers=int(cfg["num_hidden_layers"]), n_heads=heads,
        n_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads),
        vocab_size=int(cfg["vocab_size"]), rope_theta=theta,
        max_seq_len=int(cfg.get("max_position_embeddings") or 32768),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
    )
    if kw["n_heads"] % kw["n_kv_heads"]:
        raise ConfigError(f"{where}: num_attention_heads={heads} is not a multiple of num_key_value_heads={kw['n_kv_heads']}")
    if moe:
        return dict(**kw, hidden_dim=int(cfg["moe_intermediate_size"]), num_experts=int(cfg["num_experts"]),
                    top_k=int(cfg["num_experts_per_tok"]), norm_topk_prob=bool(cfg.get("norm_topk_prob", False)))
    return dict(**kw, hidden_dim=int(cfg["intermediate_size"]))


# Fields that fix the maths and the shapes (max_seq_len and torchtitan_name do not).
_COMPARED = ("dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "hidden_dim", "vocab_size", "num_experts",
             "top_k", "rope_theta", "tie_embeddings", "rms_norm_eps", "norm_topk_prob")
_HF_NAME = {"dim": "hidden_size", "n_layers": "num_hidden_layers", "n_heads": "num_attention_heads",
            "n_kv_heads": "num_key_value_heads", "head_dim": "head_dim", "vocab_size": "vocab_size",
            "num_experts": "num_experts", "top_k": "num_experts_per_tok", "rope_theta": "rope_theta",
            "tie_embeddings": "tie_word_embeddings", "rms_norm_eps": "rms_norm_eps", "norm_topk_prob": "norm_topk_prob"}


def check_named_flavor(name: str, named, arch, where: str) -> None:
    """An explicit model.flavor must be the architecture config.json describes; name every differing field."""
    moe = bool(arch.num_experts)
    differ = []
    for f in _COMPARED:
        a, b = getattr(arch, f), getattr(named, f)
        if f == "norm_topk_prob" and not named.num_experts:
            continue
        same = abs(float(a) - float(b)) <= 1e-9 * abs(float(b)) if isinstance(b, float) else a == b
        if not same:
            hf = _HF_NAME.get(f) or ("moe_intermediate_size" if moe else "intermediate_size")
            differ.append(f"{hf}={a!r} (flavor {name}: {b!r})")
    if differ:
        raise ConfigError(f"{where}: config.json differs from model.flavor={name}: {', '.join(differ)}; "
                          "leave model.flavor unset (it defaults to the checkpoint's architecture)")


def hf_config_fields(flavor, moe: bool) -> dict:
    """The config.json fields (HF names) that fix the weights' shapes and the maths, from a flavor."""
    fields = {
        "model_type": "qwen3_moe" if moe else "qwen3",
        "vocab_size": flavor.vocab_size, "hidden_size": flavor.dim, "num_hidden_layers": flavor.n_layers,
        "num_attention_heads": flavor.n_heads, "num_key_value_heads": flavor.n_kv_heads,
        "head_dim": flavor.head_dim, "tie_word_embeddings": flavor.tie_embeddings,
        "rope_theta": flavor.rope_theta, "rms_norm_eps": flavor.rms_norm_eps,
    }
    if moe:
        fields.update(moe_intermediate_size=flavor.hidden_dim, num_experts=flavor.num_experts,
                      num_experts_per_tok=flavor.top_k, norm_topk_prob=flavor.norm_topk_prob)
    else:
        fields.update(intermediate_size=flavor.hidden_dim)
    return fields


# -- the weights, from the safetensors headers ------------------------------------------------------


def expected_hf_shapes(f) -> dict[str, tuple[int, ...]]:
    """Every tensor (on-disk HF name) a Qwen3 / Qwen3-MoE of this architecture has, with its shape."""
    D, hd = f.dim, f.head_dim
    out = {"model.embed_tokens.weight": (f.vocab_size, D), "model.norm.weight": (D,)}
    if not f.tie_embeddings:
        out["lm_head.weight"] = (f.vocab_size, D)
    for i in range(f.n_layers):
        p = f"model.layers.{i}."
        out.update({
            p + "self_attn.q_proj.weight": (f.n_heads * hd, D), p + "self_attn.k_proj.weight": (f.n_kv_heads * hd, D),
            p + "self_attn.v_proj.weight": (f.n_kv_heads * hd, D), p + "self_attn.o_proj.weight": (D, f.n_heads * hd),
            p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,),
            p + "input_layernorm.weight": (D,), p + "post_attention_layernorm.weight": (D,),
        })
        if f.num_experts:
            out[p + "mlp.gate.weight"] = (f.num_experts, D)
            for e in range(f.num_experts):
                q = f"{p}mlp.experts.{e}."
                out.update({q + "gate_proj.weight": (f.hidden_dim, D), q + "up_proj.weight": (f.hidden_dim, D),
                            q + "down_proj.weight": (D, f.hidden_dim)})
        else:
            out.update({p + "mlp.gate_proj.weight": (f.hidden_dim, D), p + "mlp.up_proj.weight": (f.hidden_dim, D),
                        p + "mlp.down_proj.weight": (D, f.hidden_dim)})
    return out


_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


def safetensors_header(path: Path, where: str) -> dict:
    """The JSON header of a safetensors file, checked against the file's size (truncation, garbage)."""
    bad = f"{where}: {path.name} is corrupt or truncated"
    try:
        with open(path, "rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                raise ConfigError(f"{bad} ({path.stat().st_size} bytes)")
            (n,) = struct.unpack("<Q", head)
            size = path.stat().st_size
            if n > size - 8:
                raise ConfigError(f"{bad} (header of {n} bytes in a {size}-byte file)")
            header = json.loads(fh.read(n))
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise ConfigError(f"{bad} ({type(e).__name__}: {str(e).splitlines()[0][:120]})") from None
    header.pop("__metadata__", None)
    end = 0
    for k, v in header.items():
        try:
            begin, stop = v["data_offsets"]
            count = 1
            for s in v["shape"]:
                count *= s
            if stop - begin != count * _DTYPE_BYTES.get(v["dtype"], 0) and v["dtype"] in _DTYPE_BYTES:
                raise ConfigError(f"{bad} (tensor {k}: {stop - begin} bytes for shape {v['shape']} {v['dtype']})")
        except (KeyError, TypeError, ValueError):
            raise ConfigError(f"{bad} (tensor {k} has no valid dtype/shape/data_offsets)") from None
        end = max(end, stop)
    if 8 + n + end > size:
        raise ConfigError(f"{bad} (its tensors need {8 + n + end} bytes, the file has {size})")
    return header


def safetensors_files(hf_dir: str, what: str = "model.init_from") -> list[Path]:
    where = _where(hf_dir, what)
    path = Path(os.path.expanduser(hf_dir))
    index = path / INDEX
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise ConfigError(f"{where}: {INDEX} is unreadable ({type(e).__name__}: {e})") from None
        files = [path / n for n in names]
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise ConfigError(f"{where}: {INDEX} names files that are not there: {', '.join(absent[:3])}"
                              f"{f' (+{len(absent) - 3} more)' if len(absent) > 3 else ''}; download them again")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        bins = sorted(p.name for p in path.glob("*.bin"))
        hint = f" (found {bins[0]}: only safetensors are read, never pickles)" if bins else ""
        raise ConfigError(f"{where}: no *.safetensors weights there{hint}")
    return files


def check_weights(hf_dir: str, flavor, what: str = "model.init_from") -> dict[str, tuple]:
    """Headers of every file: present, parseable, not truncated; every tensor the model needs there, shaped right.

    Returns {HF name: (dtype, shape)} of what is stored.
    """
    where = _where(hf_dir, what)
    stored: dict[str, tuple] = {}
    for f in safetensors_files(hf_dir, what):
        for k, v in safetensors_header(f, where).items():
            stored[k] = (v["dtype"], tuple(v["shape"]))
    want = expected_hf_shapes(flavor)
    missing = sorted(k for k in want if k not in stored)
    bad = sorted(k for k in want if k in stored and stored[k][1] != want[k])
    if missing or bad:
        parts = [f"{k}: stored {list(stored[k][1])}, config.json needs {list(want[k])}" for k in bad[:2]]
        if missing:
            parts.append(f"{len(missing)} tensors missing (e.g. {missing[0]})")
        raise ConfigError(f"{where}: the safetensors do not fit config.json: {'; '.join(parts)}")
    return stored


def check_tokenizer_fits(vocab_size: int, flavor, where: str) -> None:
    if vocab_size > flavor.vocab_size:
        raise ConfigError(
            f"{where}: the tokenizer has {vocab_size} tokens but the model has {flavor.vocab_size} embedding rows "
            "(config.json vocab_size); use the tokenizer the checkpoint was trained with (data.tokenizer=<its directory>)"
        )
