"""AdamW with weight-decay groups and a warmup-then-decay learning-rate schedule."""

from __future__ import annotations

import math

import torch

from qwen3_research.config import OptimizerConfig


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices; leave norms, biases and the token embedding undecayed (standard LLM practice)."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if p.ndim < 2 or "tok_embeddings" in name or "embed_tokens" in name or "norm" in name:
            no_decay.append(p)
        else:
            decay.append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def lr_multiplier(step: int, total_steps: int, cfg: OptimizerConfig) -> float:
    """Multiplier of ``cfg.lr`` for optimizer step ``step`` (0-based)."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.decay == "constant":
        return 1.0
    span = max(1, total_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    floor = cfg.min_lr_ratio
    if cfg.decay == "linear":
        return floor + (1.0 - floor) * (1.0 - progress)
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_optimizer(model: torch.nn.Module, cfg: OptimizerConfig, total_steps: int):
    opt = torch.optim.AdamW(
        param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, foreach=True
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_multiplier(s, total_steps, cfg))
    return opt, sched
