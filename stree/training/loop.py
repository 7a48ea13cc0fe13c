"""The optimisation loop train-lm and distill share: AdamW, linear warm-up then cosine decay,
gradient clipping, a seeded batch stream, tqdm, and a resumable state file."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from .corpus import TokenCorpus

STATE_FILE = "train_state.pt"


@dataclass(frozen=True)
class LoopConfig:
    steps: int
    batch_size: int
    seq_len: int
    lr: float
    warmup: int
    seed: int
    save_every: int = 100
    clip: float = 1.0

    def __post_init__(self):
        for name in ("steps", "batch_size", "seq_len", "save_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.lr > 0 or self.warmup < 0:
            raise ValueError(f"lr must be > 0 and warmup >= 0, got lr={self.lr}, warmup={self.warmup}")

    def lr_at(self, step: int) -> float:
        if step < self.warmup:
            return self.lr * (step + 1) / self.warmup
        progress = (step - self.warmup) / max(1, self.steps - self.warmup)
        return self.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (values * mask).sum() / mask.sum().clamp(min=1)


def train(model: torch.nn.Module, loss_fn, corpus: TokenCorpus, cfg: LoopConfig, out: Path, *, identity: dict,
          resume: bool, desc: str, progress: bool = True) -> list[float]:
    """Run ``cfg.steps`` optimiser steps of ``loss_fn(ids [B, T+1], mask [B, T+1]) -> loss``.

    Every ``save_every`` steps and at the end the model, optimiser, batch-stream state and the loss
    history go to ``out/train_state.pt``. With ``resume`` that file is read and training continues
    where it stopped (bit-identical to an uninterrupted run); its ``identity`` (the run's settings)
    must equal this run's. Returns the per-step losses.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    gen = torch.Generator().manual_seed(cfg.seed)
    identity = {**identity, "loop": asdict(cfg)}
    out.mkdir(parents=True, exist_ok=True)
    state_path = out / STATE_FILE
    start, losses = 0, []
    if resume:
        if not state_path.exists():
            raise FileNotFoundError(f"--resume: {state_path} does not exist")
        state = torch.load(state_path, weights_only=False)
        if state["identity"] != identity:
            diff = sorted(k for k in set(identity) | set(state["identity"]) if identity.get(k) != state["identity"].get(k))
            raise ValueError(f"--resume: {state_path} was written by a run with different settings ({diff})")
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        gen.set_state(state["generator"])
        start, losses = state["step"], state["losses"]

    def save(step):
        torch.save(dict(identity=identity, model=model.state_dict(), optimizer=opt.state_dict(),
                        generator=gen.get_state(), step=step, losses=losses), state_path)

    model.train()
    bar = tqdm(range(start, cfg.steps), desc=desc, initial=start, total=cfg.steps, disable=not progress)
    for step in bar:
        for group in opt.param_groups:
            group["lr"] = cfg.lr_at(step)
        ids, mask = corpus.sample(cfg.batch_size, cfg.seq_len + 1, gen)
        loss = loss_fn(ids, mask)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.clip)
        opt.step()
        losses.append(loss.item())
        bar.set_postfix(loss=f"{losses[-1]:.3f}")
        if (step + 1) % cfg.save_every == 0 or step + 1 == cfg.steps:
            save(step + 1)
    model.eval()
    return losses
