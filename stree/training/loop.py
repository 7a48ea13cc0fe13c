"""The optimisation loop train-lm and distill share: AdamW, linear warm-up then cosine decay,
gradient clipping, a seeded batch stream, tqdm, and a resumable state file that nothing loses:
written atomically, saved on SIGINT / SIGTERM before exiting, never written over a finished run
unless asked to."""

from __future__ import annotations

import math
import signal
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from ..checkpoints.atomic import write_with
from .corpus import TokenCorpus

STATE_FILE = "train_state.pt"
# What a finished or running run leaves in its directory.
RUN_FILES = ("config.json", "model.safetensors", STATE_FILE)
# Settings a resumed run may change: more steps, another save interval.
RESUMABLE = ("steps", "save_every")


class TrainingInterrupted(Exception):
    """SIGINT or SIGTERM stopped training after a whole step; its state was saved first."""

    def __init__(self, signum: int, step: int, path: Path):
        self.signum, self.step, self.path = signum, step, path
        self.exit_code = 128 + signum
        super().__init__(f"interrupted by {signal.Signals(signum).name} after step {step}; the state is saved in "
                         f"{path}: continue with --resume")


def prepare_out(out: Path, resume: bool, overwrite: bool) -> None:
    """Refuse to write into a directory holding a checkpoint or a training state, unless the run
    resumes it or ``overwrite`` says to replace it."""
    if resume and overwrite:
        raise ValueError("--resume continues the run in --out and --overwrite replaces it: give one")
    existing = [name for name in RUN_FILES if (out / name).exists()]
    if existing and not (resume or overwrite):
        raise ValueError(f"{out} already holds {', '.join(existing)}: --resume continues that run, --overwrite "
                         "replaces it")


class _Signals:
    """SIGINT and SIGTERM noted (not raised) while training, so that a step is never cut in half."""

    def __enter__(self):
        self.caught, self.previous = [], {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self.previous[sig] = signal.signal(sig, lambda signum, frame: self.caught.append(signum))
        return self

    def __exit__(self, *exc):
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


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
          resume: bool, desc: str, progress: bool = True, started: float | None = None) -> tuple[list[float], float]:
    """Run ``cfg.steps`` optimiser steps of ``loss_fn(ids [B, T+1], mask [B, T+1]) -> loss``.

    Every ``save_every`` steps and at the end the model, optimiser, batch-stream state, loss
    history and seconds spent go to ``out/train_state.pt`` (atomically). With ``resume`` that file
    is read (tensors and plain data only) and training continues where it stopped, bit-identical
    to an uninterrupted run; its ``identity`` (the run's settings) must equal this run's except
    ``steps`` (a run may be extended) and ``save_every``. SIGINT / SIGTERM end the current step,
    save, and raise :class:`TrainingInterrupted`. Returns the per-step losses and the seconds the
    earlier parts of a resumed run took (each part counted from ``started``, default: now).
    """
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    gen = torch.Generator().manual_seed(cfg.seed)
    identity = {**identity, "loop": {k: v for k, v in asdict(cfg).items() if k not in RESUMABLE}}
    out.mkdir(parents=True, exist_ok=True)
    state_path = out / STATE_FILE
    start, losses, earlier = 0, [], 0.0
    if resume:
        if not state_path.exists():
            raise FileNotFoundError(f"--resume: {state_path} does not exist")
        try:
            state = torch.load(state_path, weights_only=True)
        except Exception as exc:  # a truncated or foreign file: say which, whatever torch raised
            raise ValueError(f"--resume: {state_path} is not a readable training state ({type(exc).__name__})") from None
        if state["identity"] != identity:
            diff = sorted(k for k in set(identity) | set(state["identity"]) if identity.get(k) != state["identity"].get(k))
            raise ValueError(f"--resume: {state_path} was written by a run with different settings ({diff})")
        if state["step"] > cfg.steps:
            raise ValueError(f"--resume: {state_path} is at step {state['step']}, past --steps {cfg.steps}")
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        gen.set_state(state["generator"])
        start, losses, earlier = state["step"], state["losses"], state.get("seconds", 0.0)
    t0 = time.time() if started is None else started

    def save(step):
        write_with(state_path, lambda tmp: torch.save(dict(identity=identity, model=model.state_dict(), optimizer=opt.state_dict(),
                         generator=gen.get_state(), step=step, losses=losses,
                                                            seconds=earlier + time.time() - t0), tmp))

    model.train()
    bar = tqdm(range(start, cfg.steps), desc=desc, initial=start, total=cfg.steps, disable=not progress)
    with _Signals() as signals:
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
            if (step + 1) % cfg.save_every == 0 or step + 1 == cfg.steps or signals.caught:
                save(step + 1)
            if signals.caught:
                bar.close()
                raise TrainingInterrupted(signals.caught[0], step + 1, state_path)
    model.eval()
    return losses, earlier
