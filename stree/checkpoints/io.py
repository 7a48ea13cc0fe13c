"""Checkpoint directories in and out: build a model from a directory's config (a Hub id is
resolved to one by :mod:`.hub`; the formats are :mod:`.formats`') and fill it with the files'
weights (:mod:`.weights`), whole or a tensor-parallel rank's slices; wrap a loaded transformers
model; write a model in any of the formats (test fixtures, exports)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..models.families.mambainllama import HybridLM
from ..models.families.mamba2 import Mamba2LM
from ..models.parallel import TensorParallel, plan
from .atomic import write_text, write_with
from .formats import (FAMILIES, FORMATS, config_files, detect_format, file_key, json_object, model_key, read_config,
                      read_hf, read_json, tied, with_file_head)
from .hub import resolve
from .weights import SlicedWeights, check_finite_weights, check_shapes, file_name, fill, read_weights, slices

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _load_shard(build, cfg, fmt: str, path: Path, dtype, device, check_finite: bool, tp: TensorParallel):
    """:func:`load` of rank ``tp.rank``'s slice: the model is built on "meta" at full size, its
    checkpoint shapes checked against the files, resized by ``plan`` (the divisibility checks),
    and only then are the rank's slices read."""
    source = SlicedWeights(path)
    to_file = {model_key(fmt, k): k for k in source.keys()}
    cfg = with_file_head(fmt, cfg, "lm_head.weight" in to_file)
    if build.embed_key not in to_file:
        raise ValueError(f"{source.file}: missing key {build.embed_key!r}")
    model = build(cfg, device="meta", dtype=dtype or source.dtype(to_file[build.embed_key]))
    is_tied = model.lm_head.weight is model.embed.weight
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if is_tied:
        expected.pop("lm_head.weight")
        to_file.pop("lm_head.weight", None)
    check_shapes(expected, {k: source.shape(f) for k, f in to_file.items()}, source.file, path / "config.json")
    rules = plan(model, tp)
    local = model.state_dict()
    state = slices(expected, rules, lambda key, idx: source.read(to_file[key], idx), tp, local,
                    device or torch.device("cpu"))
    if check_finite:
        check_finite_weights(state, source.file)
    fill(model, state, is_tied, source.file, path / "config.json", share=True)
    return model.eval()


def shard(model, tp: TensorParallel):
    """Rank ``tp.rank``'s slice of an in-memory stree model (``model`` is left whole; the
    replicated tensors are shared with it, the split ones are copies): what ``load(...,
    tensor_parallel=tp)`` makes of the model's checkpoint."""
    if not isinstance(tp, TensorParallel):
        raise TypeError(f"tp must be a TensorParallel, got {type(tp).__name__}")
    if getattr(model, "tp", None) is not None:
        raise ValueError(f"the model is already a slice ({model.tp})")
    local = type(model)(model.cfg, device="meta", dtype=model.dtype)
    is_tied = model.lm_head.weight is model.embed.weight
    full = model.state_dict()
    if is_tied:
        full.pop("lm_head.weight")
    rules = plan(local, tp)
    state = slices({k: tuple(t.shape) for k, t in full.items()}, rules,
                    lambda key, idx: full[key] if idx is None else full[key][idx], tp, local.state_dict(), model.device)
    fill(local, state, is_tied, f"{type(model).__name__}.state_dict()", "its config", share=True)
    return local.eval()


def check_device(device) -> torch.device | None:
    """``device`` as a torch.device that exists here (None stays None), else a ValueError."""
    if device is None:
        return None
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device {device!r} is not a device (cpu, cuda, cuda:N, ...)") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {str(device)!r}: CUDA is not available here")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"device {str(device)!r}: only {torch.cuda.device_count()} CUDA device(s) here")
    elif device.type not in ("cpu", "meta"):
        raise ValueError(f"device {str(device)!r} is not supported (cpu or cuda)")
    return device


def load(path, dtype: torch.dtype | None = None, device=None, plain_rope: bool = False, check_finite: bool = True,
         tensor_parallel: TensorParallel | None = None, revision: str | None = None):
    """Build and load the model in checkpoint directory ``path`` (format auto-detected), or of
    the Hub id ``path`` (``org/name``; ``revision``: its branch, tag or commit), fetched into or
    found in the Hub cache (:mod:`stree.checkpoints.hub`).

    ``dtype`` defaults to the checkpoint's embedding dtype; Mamba2's D stays fp32 as in mamba_ssm.
    ``plain_rope`` drops a hybrid's llama3 RoPE scaling (what MIL's own inference code runs).
    ``check_finite``: refuse weights holding NaN or inf (one pass over every tensor; off for speed).
    ``tensor_parallel``: load this rank's slice of every layer (see :mod:`stree.models.parallel`),
    reading only those slices of safetensors files.
    Everything is checked (config, device, dtype, the world size's divisibility) before the
    weights are read.
    """
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    if tensor_parallel is not None and not isinstance(tensor_parallel, TensorParallel):
        raise TypeError(f"tensor_parallel must be a TensorParallel (stree.models.parallel.join), got "
                        f"{type(tensor_parallel).__name__}")
    device = check_device(device)
    path = resolve(path, revision)
    fmt = detect_format(path)
    config_file = path / "config.json"
    build, cfg = read_config(fmt, read_json(config_file), path, plain_rope)
    if tensor_parallel is not None:
        return _load_shard(build, cfg, fmt, path, dtype, device, check_finite, tensor_parallel)
    state, weights_file = read_weights(path)
    if check_finite:
        check_finite_weights(state, weights_file)
    state = {model_key(fmt, k): v for k, v in state.items()}
    cfg = with_file_head(fmt, cfg, "lm_head.weight" in state)
    embedding = state.get(build.embed_key)
    if embedding is None:
        raise ValueError(f"{weights_file}: missing key {file_key(fmt, build.embed_key)!r}")
    model = build(cfg, device=device, dtype=dtype or embedding.dtype)
    fill(model, state, tied(cfg), weights_file, config_file)
    if (path / DRAFT_VOCAB).exists():
        model.draft_vocab = read_draft_vocab(path / DRAFT_VOCAB, model.vocab_size)
    return model.eval()


# A drafter checkpoint's token ids, most frequent first in the text it was trained on (``stree distill``
# writes it): what a drafter's greedy drafts may cut its head to (stree.drafters.ssm.SSMDrafter).
DRAFT_VOCAB = "draft_vocab.json"


def write_draft_vocab(out: Path, docs, corpus: str) -> None:
    """``out/draft_vocab.json``: the ids of ``docs`` (token arrays) by count, most frequent first
    (ties: the lower id), with their counts and ``corpus`` (what they were counted in)."""
    counts = torch.bincount(torch.cat([torch.as_tensor(d, dtype=torch.long).flatten() for d in docs]))
    ids = sorted((int(i) for i in torch.nonzero(counts).flatten()), key=lambda i: (-int(counts[i]), i))
    write_text(Path(out) / DRAFT_VOCAB, json.dumps(dict(corpus=corpus, ids=ids, counts=[int(counts[i]) for i in ids])))


def read_draft_vocab(path: Path, vocab_size: int) -> torch.Tensor:
    """The ids of a draft_vocab.json (int64), checked: distinct ints in ``[0, vocab_size)``."""
    ids = read_json(path).get("ids")
    if (not isinstance(ids, list) or not ids or not all(type(i) is int and 0 <= i < vocab_size for i in ids)
            or len(set(ids)) != len(ids)):
        raise ValueError(f"{path}: 'ids' must be a non-empty list of distinct token ids in [0, {vocab_size})")
    return torch.tensor(ids, dtype=torch.long)


def from_transformers(hf_model):
    """The stree model of a loaded transformers ``Mamba2ForCausalLM``, ``BambaForCausalLM``,
    ``NemotronHForCausalLM``, ``GraniteMoeHybridForCausalLM``, ``FalconH1ForCausalLM``, ``LlamaForCausalLM``
    or ``Qwen2ForCausalLM``, sharing its parameter tensors (no copy: a change to one is a
    change to the other). Its config is read as ``load`` reads config.json."""
    config = getattr(hf_model, "config", None)
    model_type = getattr(config, "model_type", None)
    where = f"{type(hf_model).__name__}.config"
    if model_type != "mamba2" and model_type not in FAMILIES:
        raise ValueError(f"{where}: model_type {model_type!r} is not supported (supported: "
                         f"{', '.join(repr(t) for t in ('mamba2', *FAMILIES))})")
    raw = json.loads(json.dumps(config.to_dict(), default=str), object_pairs_hook=json_object)
    state = dict(hf_model.state_dict())
    if model_type == "mamba2":
        build, cfg = Mamba2LM, read_hf(raw, where)
        state = {model_key("hf", k): v for k, v in state.items()}
    else:
        build = FAMILIES[model_type]
        cfg = build.config_class.from_hf(raw, where)
        prefix = build.embed_key.split(".")[0] + "."  # transformers keeps the modules under "model."
        state = {file_name(prefix + k[len("model."):] if k.startswith("model.") else k,
                           getattr(build, "memory_names", {})): v for k, v in state.items()}
        if hasattr(build, "file_state"):
            state = build.file_state(state)
    weights = next(iter(state.values()))
    model = build(cfg, device="meta", dtype=weights.dtype)
    fill(model, state, tied(cfg), f"{type(hf_model).__name__}.state_dict()", where, share=True)
    return model.eval()


def save(model, path, format: str | None = None) -> None:
    """Write ``model`` as a checkpoint directory (config file(s) + model.safetensors): a Mamba2LM
    as ``mamba_ssm`` (default) or ``hf``, a HybridLM as ``mil``, a transformers family as
    transformers saves it (its model_type)."""
    family = getattr(model, "model_type", None)
    if format is None:
        format = family or ("mil" if isinstance(model, HybridLM) else "mamba_ssm")
    if format not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {format!r}")
    fits = format == family if family else (format == "mil") == isinstance(model, HybridLM) and format not in FAMILIES
    if not fits:
        raise ValueError(f"format {format!r} does not fit a {type(model).__name__}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    state = {file_key(format, k): v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    if tied(model.cfg):
        state.pop("lm_head.weight")  # safetensors stores each tensor once; loading re-ties
    write_with(path / "model.safetensors", lambda tmp: save_file(state, str(tmp)))
    for name, config in config_files(model, format).items():
        write_text(path / name, json.dumps(config, indent=2))
