"""LoRA's parameter arithmetic from an architecture alone (no model built): which projections ``model.lora``'s
targets name, their adapter sizes, and what stays frozen -- for the planner's closed form and ``plan --fit``'s screen
and cost, which must answer before anything is built (the built model's own counts come from PEFT).

A rank-r LoRA on a ``Linear(in, out)`` adds ``A: r x in`` and ``B: out x r``: ``r * (in + out)`` parameters, the only
ones with gradients and AdamW state; the base weight keeps its parameter bytes and has neither.
"""

from __future__ import annotations

from dataclasses import dataclass

# Hugging Face's Qwen3 projection names, and torchtitan's for the same Linear: a target may use either.
NATIVE_NAMES = {"wq": "q_proj", "wk": "k_proj", "wv": "v_proj", "wo": "o_proj",
                "w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
DENSE_MLP = ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class LoraCount:
    adapters: int  # trainable: every adapter's A and B over every layer
    frozen: int  # the base's parameters (all of them: embeddings, norms, projections)
    projections: tuple[str, ...]  # the HF names an adapter sits on in each layer

    @property
    def total(self) -> int:
        return self.adapters + self.frozen


def projection_shapes(f) -> dict[str, tuple[int, int]]:
    """(in, out) of each adapter-able projection of one layer of architecture ``f`` (``models.flavors.Flavor``). A
    mixture of experts' MLP projections are experts, which stay frozen (adapters on attention only, issue 41)."""
    d, hd, h, kv = f.dim, f.head_dim, f.n_heads, f.n_kv_heads
    shapes = {"q_proj": (d, h * hd), "k_proj": (d, kv * hd), "v_proj": (d, kv * hd), "o_proj": (h * hd, d)}
    if not f.num_experts:
        shapes.update({"gate_proj": (d, f.hidden_dim), "up_proj": (d, f.hidden_dim), "down_proj": (f.hidden_dim, d)})
    return shapes


def base_params(f) -> int:
    """Every parameter of architecture ``f`` (the planner's closed-form count)."""
    d, hd, h, kv, v = f.dim, f.head_dim, f.n_heads, f.n_kv_heads, f.vocab_size
    attn = d * (h + 2 * kv) * hd + h * hd * d + 2 * hd + 2 * d
    ffn = (f.num_experts * 3 * d * f.hidden_dim + d * f.num_experts) if f.num_experts else 3 * d * f.hidden_dim
    return f.n_layers * (attn + ffn) + v * d * (1 if f.tie_embeddings else 2) + d


def count(f, targets, rank: int) -> LoraCount:
    """Adapters and frozen parameters of architecture ``f`` with rank-``rank`` LoRA on ``targets`` (names as
    ``model.lora.target_modules``: HF's ``q_proj`` ... ``down_proj`` or torchtitan's ``wq`` ... ``w3``; a name
    matching none of the layer's projections adds nothing here -- the run's own check refuses it)."""
    shapes = projection_shapes(f)
    wanted = {NATIVE_NAMES.get(str(t).rsplit(".", 1)[-1], str(t).rsplit(".", 1)[-1]) for t in targets}
    on = tuple(p for p in shapes if p in wanted)
    per_layer = sum(rank * (shapes[p][0] + shapes[p][1]) for p in on)
    return LoraCount(f.n_layers * per_layer, base_params(f), on)


def lora_settings(model_cfg):
    """``model.lora`` when it is enabled, else None (a schema without the group reads as disabled)."""
    lora = getattr(model_cfg, "lora", None)
    if lora is None and isinstance(model_cfg, dict):
        lora = model_cfg.get("lora")
    enabled = lora is not None and (lora.get("enable") if isinstance(lora, dict) else getattr(lora, "enable", False))
    return lora if enabled else None


def _get(lora, key: str, default=None):
    return lora.get(key, default) if isinstance(lora, dict) else getattr(lora, key, default)


def count_for(f, model_cfg) -> LoraCount | None:
    """``count`` for the run's ``model`` config section, None without LoRA."""
    lora = lora_settings(model_cfg)
    if lora is None:
        return None
    targets = _get(lora, "target_modules") or (ATTENTION + DENSE_MLP)
    if isinstance(targets, str):
        targets = [targets]
    return count(f, list(targets), int(_get(lora, "rank", 8)))
