"""``stree train-lm``: a small Mamba2 (or MambaInLlama-style hybrid) LM trained from scratch on
local Python sources, saved as a checkpoint directory ``stree.models.load`` and
``load_tokenizer`` read, with held-out bits per byte against a unigram baseline."""

from __future__ import annotations

import json
import math
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from transformers import AutoTokenizer

from ..models import HybridConfig, HybridLM, Mamba2Config, Mamba2LM
from ..checkpoints.io import DTYPES, save
from .corpus import TokenCorpus, code_prompts, find_sources, train_tokenizer
from ..checkpoints.atomic import write_text
from .loop import STATE_FILE, LoopConfig, masked_mean, prepare_out, train

ARCHS = ("mamba2", "hybrid")


@dataclass(frozen=True)
class ModelSize:
    d_model: int = 256
    n_layer: int = 4
    d_state: int = 32
    headdim: int = 64

    def build(self, arch: str, vocab_size: int):
        if arch == "mamba2":
            return Mamba2LM(Mamba2Config(d_model=self.d_model, n_layer=self.n_layer, vocab_size=vocab_size,
                                         d_state=self.d_state, headdim=self.headdim))
        if arch != "hybrid":
            raise ValueError(f"arch must be one of {ARCHS}, got {arch!r}")
        # MambaInLlama's shapes: one attention layer in the middle, SSM heads = attention heads,
        # d_xb = the KV width, headdim = d_state = the attention head_dim.
        heads = max(1, self.d_model // self.headdim)
        kv = max(1, heads // 2)
        return HybridLM(HybridConfig(
            d_model=self.d_model, n_layer=self.n_layer, vocab_size=vocab_size, attn_layers=(self.n_layer // 2,),
            intermediate_size=2 * self.d_model, num_attention_heads=heads, num_key_value_heads=kv,
            head_dim=self.headdim, d_inner=self.d_model, d_xb=kv * self.headdim, d_state=self.headdim, ngroups=heads,
            rope_theta=10000.0, tie_word_embeddings=True))


def init_weights(model: torch.nn.Module, n_layer: int) -> None:
    """GPT-2 style: N(0, 0.02) matrices and embeddings, zero biases, and the projections that
    write into the residual stream scaled by 1/sqrt(2 n_layer). Mamba2's A, dt and D keep the
    initialisation the mixer gave them."""
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
                std = 0.02 / math.sqrt(2 * n_layer) if name.endswith(("out_proj", "o_proj", "down_proj")) else 0.02
                torch.nn.init.normal_(module.weight, std=std)
                if getattr(module, "bias", None) is not None:
                    torch.nn.init.zeros_(module.bias)


def token_bytes(tokenizer, vocab_size: int) -> np.ndarray:
    """UTF-8 bytes each id stands for (byte-level BPE: one symbol per byte; special tokens 0)."""
    out = np.zeros(vocab_size, dtype=np.int64)
    special = set(tokenizer.all_special_ids)
    for i, piece in enumerate(tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))):
        if i < vocab_size and i not in special:
            out[i] = len(piece)
    return out


@torch.no_grad()
def held_out_nats(model, corpus: TokenCorpus, seq_len: int, max_tokens: int, device, batch: int = 8):
    """Per predicted token: the model's nats and the target ids, over consecutive held-out windows."""
    nats, targets = [], []
    for ids, mask in corpus.window_batches(seq_len + 1, max_tokens, batch, device):
        mask = mask[:, 1:]
        logits = model(ids[:, :-1]).float()
        loss = F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten(), reduction="none").view_as(mask)
        nats.append(loss[mask].cpu())
        targets.append(ids[:, 1:][mask].cpu())
    return torch.cat(nats).double().numpy(), torch.cat(targets).numpy()


def bits_per_byte(model, tokenizer, train_corpus: TokenCorpus, test_corpus: TokenCorpus, seq_len: int,
                  max_tokens: int, device) -> dict:
    """Held-out bits per byte of the model and of the add-one-smoothed unigram distribution of the
    training tokens, both over the same predicted tokens."""
    vocab = len(tokenizer)
    nats, targets = held_out_nats(model, test_corpus, seq_len, max_tokens, device)
    n_bytes = token_bytes(tokenizer, vocab)[targets].sum()
    counts = train_corpus.unigram_counts(vocab) + 1.0
    unigram_nats = -np.log(counts[targets] / counts.sum())
    to_bpb = lambda total: float(total / math.log(2) / n_bytes)
    return dict(held_out_tokens=int(len(targets)), held_out_bytes=int(n_bytes), model_bits_per_byte=to_bpb(nats.sum()),
                unigram_bits_per_byte=to_bpb(unigram_nats.sum()), model_loss_nats=float(nats.mean()))


def lm_loss(model, device):
    def loss_fn(ids, mask):
        ids, mask = ids.to(device), mask.to(device)
        logits = model(ids[:, :-1]).float()
        ce = F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten(), reduction="none").view(ids.shape[0], -1)
        return masked_mean(ce, mask[:, 1:].float())
    return loss_fn


def train_lm(out, *, corpus=None, held_out=None, corpus_glob: str = "*.py", arch="mamba2", vocab_size=4096,
             size=ModelSize(),
             loop: LoopConfig = LoopConfig(steps=600, batch_size=16, seq_len=128, lr=3e-3, warmup=30, seed=0),
             tokenizer_bytes: int | None = 4_000_000, eval_tokens: int = 40_000, save_dtype: str = "float32",
             resume: bool = False, overwrite: bool = False, device: str = "cpu", progress: bool = True) -> dict:
    """Train and save; returns the metrics also written to ``out/training.json`` (``seconds``:
    every part of a resumed run). A directory holding a checkpoint or a training state is
    refused unless ``resume`` (continue it) or ``overwrite``."""
    if save_dtype not in DTYPES:
        raise ValueError(f"save_dtype must be one of {sorted(DTYPES)}, got {save_dtype!r}")
    out = Path(out)
    split = find_sources(corpus, None if held_out is None else tuple(held_out), corpus_glob)  # checked first
    prepare_out(out, resume, overwrite)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    if resume:
        if not (out / STATE_FILE).exists():
            raise FileNotFoundError(f"--resume: {out / STATE_FILE} does not exist")
        tokenizer = AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    else:
        tokenizer = train_tokenizer(split.train, vocab_size, tokenizer_bytes)
        tokenizer.save_pretrained(str(out))
    train_corpus = TokenCorpus.encode(tokenizer, split.train)
    test_corpus = TokenCorpus.encode(tokenizer, split.held_out)
    torch.manual_seed(loop.seed)
    model = size.build(arch, len(tokenizer)).to(device)
    init_weights(model, size.n_layer)
    identity = dict(arch=arch, vocab_size=vocab_size, size=asdict(size), corpus=split.fingerprint(),
                    tokenizer_bytes=tokenizer_bytes)
    losses, earlier = train(model, lm_loss(model, device), train_corpus, loop, out, identity=identity, resume=resume,
                            desc="train-lm", progress=progress, started=t0)
    metrics = bits_per_byte(model, tokenizer, train_corpus, test_corpus, loop.seq_len, eval_tokens, device)
    save(model.to(DTYPES[save_dtype]), out)
    report = dict(command="train-lm", **identity, corpus_root=str(split.root), train_files=len(split.train),
                  held_out_files=[split.name(d) for d in split.held_out],
                  train_tokens=train_corpus.n_tokens, python=platform.python_version(), torch=torch.__version__,
                  save_dtype=save_dtype, seconds=round(earlier + time.time() - t0, 1), final_train_loss=losses[-1],
                  **metrics)
    write_text(out / "training.json", json.dumps(report, indent=2))
    # Held-out completion prompts travel with the model that never saw them (the demo reads them).
    write_text(out / "prompts.jsonl", "".join(json.dumps({"prompt": p}) + "\n" for p in code_prompts(split.held_out)))
    return report
