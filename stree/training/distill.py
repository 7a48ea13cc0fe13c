"""``stree distill``: a 1-2 layer Mamba2 drafter trained to match a target's next-token
distributions (forward KL(target || drafter) at temperature 1, padding masked), initialised from
the target's embeddings, on a corpus: by default the one the target was trained on; the papers'
setting, the target's own text, is a JSONL corpus of its generations (one ``{"text": ...}`` per
line, e.g. from ``stree generate --json``)."""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from ..checkpoints.atomic import write_text
from ..models import Mamba2Config, Mamba2LM
from ..checkpoints.io import DTYPES, load, save, write_draft_vocab
from ..checkpoints.tokenizer import load_tokenizer
from .corpus import TokenCorpus, find_sources
from .loop import LoopConfig, masked_mean, prepare_out, train
from .train_lm import init_weights

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def student_config(teacher, n_layer: int) -> Mamba2Config:
    """The drafter: the target's width, vocabulary and (for a Mamba2 target) SSM sizes."""
    if n_layer < 1:
        raise ValueError(f"n_layer must be >= 1, got {n_layer}")
    cfg = teacher.cfg
    if isinstance(teacher, Mamba2LM):
        return Mamba2Config(d_model=cfg.d_model, n_layer=n_layer, vocab_size=cfg.vocab_size, d_state=cfg.d_state,
                            headdim=cfg.headdim, ngroups=cfg.ngroups, d_conv=cfg.d_conv, expand=cfg.expand,
                            pad_vocab_size_multiple=cfg.pad_vocab_size_multiple)
    return Mamba2Config(d_model=cfg.d_model, n_layer=n_layer, vocab_size=cfg.vocab_size, d_state=cfg.d_state,
                        headdim=cfg.d_state, d_conv=cfg.d_conv, expand=2)


def init_from_teacher(student: Mamba2LM, teacher) -> list[str]:
    """Copy the target's token embeddings (the tied head follows) and final-norm weight; for a
    Mamba2 target also evenly spaced layers (first and last for two). Returns what was copied."""
    body = teacher.backbone if isinstance(teacher, Mamba2LM) else teacher.model
    emb = body.embedding.weight if isinstance(teacher, Mamba2LM) else body.embed_tokens.weight
    norm = body.norm_f.weight if isinstance(teacher, Mamba2LM) else body.norm.weight
    copied = ["embedding", "final norm"]
    with torch.no_grad():
        rows = min(emb.shape[0], student.backbone.embedding.weight.shape[0])
        student.backbone.embedding.weight[:rows] = emb[:rows].to(student.dtype)
        student.backbone.norm_f.weight.copy_(norm)
        if isinstance(teacher, Mamba2LM):
            n_s, n_t = student.cfg.n_layer, teacher.cfg.n_layer
            picks = np.linspace(0, n_t - 1, n_s).round().astype(int) if n_s > 1 else [0]
            for i, j in enumerate(picks):
                student.backbone.layers[i].load_state_dict(teacher.backbone.layers[int(j)].state_dict())
                copied.append(f"layer {i} <- target layer {int(j)}")
    return copied


def kl_terms(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per position: KL(p_teacher || q_student) in nats over the teacher's vocabulary (the student's
    extra padded ids get teacher probability 0) and whether the two argmaxes agree."""
    V = teacher_logits.shape[-1]
    if student_logits.shape[-1] < V:
        raise ValueError(f"the drafter's vocabulary ({student_logits.shape[-1]}) is smaller than the target's ({V})")
    log_p = F.log_softmax(teacher_logits.float(), dim=-1)
    log_q = F.log_softmax(student_logits.float(), dim=-1)
    kl = (log_p.exp() * (log_p - log_q[..., :V])).sum(-1)
    return kl, student_logits.argmax(-1) == teacher_logits.argmax(-1)


def distill_loss(student, teacher, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean KL over the real positions of windows ``ids [B, T+1]`` (the last token is only ever
    a label in training, so it is not fed, as in train-lm)."""
    ids, mask = ids[:, :-1], mask[:, :-1]
    with torch.no_grad():
        teacher_logits = teacher(ids)
    kl, _ = kl_terms(student(ids), teacher_logits)
    return masked_mean(kl, mask.float())


@torch.no_grad()
def held_out_agreement(student, teacher, corpus: TokenCorpus, seq_len: int, max_tokens: int, device,
                       batch: int = 8) -> dict:
    kl_sum, agree, count = 0.0, 0, 0
    for ids, mask in corpus.window_batches(seq_len, max_tokens, batch, device):
        kl, same = kl_terms(student(ids), teacher(ids))
        kl_sum += float(kl[mask].sum())
        agree += int(same[mask].sum())
        count += int(mask.sum())
    return dict(held_out_positions=count, held_out_kl_nats=kl_sum / count, held_out_top1_agreement=agree / count)


def distill(target, out, *, n_layer: int = 1, corpus=None, held_out=None, corpus_glob: str = "*.py",
            loop: LoopConfig = LoopConfig(steps=300, batch_size=16, seq_len=128, lr=3e-3, warmup=30, seed=0),
            eval_tokens: int = 40_000, save_dtype: str = "float32", resume: bool = False, overwrite: bool = False,
            device: str = "cpu", progress: bool = True) -> dict:
    """Distil and save (with the target's tokenizer); returns the metrics in ``out/distill.json``
    (``seconds``: every part of a resumed run). ``out`` is refused as train-lm's is."""
    if save_dtype not in DTYPES:
        raise ValueError(f"save_dtype must be one of {sorted(DTYPES)}, got {save_dtype!r}")
    target, out = Path(target), Path(out)
    t0 = time.time()
    teacher = load(target, dtype=torch.float32, device=device).requires_grad_(False)
    tokenizer = load_tokenizer(target, vocab_size=teacher.vocab_size)
    split = find_sources(corpus, None if held_out is None else tuple(held_out), corpus_glob)
    prepare_out(out, resume, overwrite)  # the inputs are checked before the output is touched
    train_corpus = TokenCorpus.encode(tokenizer, split.train)
    test_corpus = TokenCorpus.encode(tokenizer, split.held_out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(loop.seed)
    student = Mamba2LM(student_config(teacher, n_layer)).to(device)
    init_weights(student, n_layer)
    copied = init_from_teacher(student, teacher)

    def loss_fn(ids, mask):
        return distill_loss(student, teacher, ids.to(device), mask.to(device))

    before = held_out_agreement(student, teacher, test_corpus, loop.seq_len, eval_tokens, device)
    identity = dict(target=str(target.resolve()), n_layer=n_layer, corpus=split.fingerprint())
    losses, earlier = train(student, loss_fn, train_corpus, loop, out, identity=identity, resume=resume,
                            desc="distill", progress=progress, started=t0)
    after = held_out_agreement(student, teacher, test_corpus, loop.seq_len, eval_tokens, device)
    save(student.to(DTYPES[save_dtype]), out)
    for name in TOKENIZER_FILES:
        if (target / name).exists():
            shutil.copy(target / name, out / name)
    report = dict(command="distill", **identity, initialised_from=copied, loop=asdict(loop), save_dtype=save_dtype,
                  teacher_format=type(teacher).__name__, final_train_kl=losses[-1],
                  seconds=round(earlier + time.time() - t0, 1), at_init=before, **after)
    write_draft_vocab(out, train_corpus.docs, split.fingerprint())
    write_text(out / "distill.json", json.dumps(report, indent=2))
    return report
