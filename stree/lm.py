"""Text in, text out: a target model with its tokenizer and end-of-sequence ids.

    lm = LM.from_pretrained("path/to/checkpoint")
    out = lm.generate(["def f(x):", "class A:"], max_new_tokens=64, drafter="stand", stop=["\\n\\n"])
    out.texts, out.finish_reasons, out.stats

``generate`` batches the prompts through :func:`stree.generate.decode`; stop strings are checked
on each row's decoded text after every decoding step, and a row that shows one ends there (the
drafted tokens accepted past it are dropped, the row leaves the batch). ``stream`` yields the text
of one prompt as its tokens are accepted.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from .drafters.base import Drafter
from .drafters.registry import DRAFTER_NAMES, NEEDS_MODEL, make_drafter
from .generate import GenerationStats, decode
from .stops import TextStops, apply_text_stops, held_back, stop_strings

# Short names for the registry's: "ssm" is the distilled drafter filling a static tree.
DRAFTER_ALIASES = {"ssm": "ssm-static"}
FINISH_REASONS = ("eos", "stop", "length")


@dataclass
class TextOutput:
    """Per prompt: the generated ``texts`` (special tokens skipped; a stop string and what follows
    it cut off), ``token_ids`` (the generated tokens, through the one that completed a stop
    string) and ``finish_reasons`` ("eos", "stop" or "length"); the decoding ``stats``."""

    texts: list[str]
    token_ids: list[list[int]]
    finish_reasons: list[str]
    stats: GenerationStats

    @property
    def text(self) -> str:
        """The one prompt's text (a ValueError for a batch)."""
        if len(self.texts) != 1:
            raise ValueError(f"text is for one prompt; this output holds {len(self.texts)}: use texts")
        return self.texts[0]


def checkpoint_eos(path) -> list[int] | None:
    """The end-of-sequence ids a checkpoint directory declares: generation_config.json's
    ``eos_token_id``, else config.json's (an int or a list); None when neither has one."""
    import json

    for name in ("generation_config.json", "config.json"):
        file = Path(path) / name
        if file.exists():
            value = json.loads(file.read_text()).get("eos_token_id")
            if value is not None:
                return [int(v) for v in (value if isinstance(value, list) else [value])]
    return None


def rank_device(device, tensor_parallel: int | None) -> torch.device:
    """The device a process loads on: ``device`` (checked), else CUDA when available, else the
    CPU; under tensor parallelism (torchrun) an unnumbered CUDA device is this rank's own GPU, and
    by default the ranks go to the CPU (gloo) when the machine has fewer GPUs than ranks."""
    from .models.loading import check_device
    from .models.parallel import local_rank, local_world_size

    ranks = local_world_size() if tensor_parallel is not None else 1
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    explicit = check_device(device)
    device = explicit or torch.device("cuda" if 0 < ranks <= gpus else "cpu")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", local_rank() if tensor_parallel is not None else 0)
    if device.type == "cuda" and tensor_parallel is not None and ranks > gpus:
        # every rank reaches the same verdict, so all of them stop here (none waits in the group's start)
        raise ValueError(f"device {explicit} for {ranks} ranks on this machine, which has {gpus} GPUs: "
                         "one GPU a rank, or device='cpu'")
    return device


class LM:
    """``model`` (a loaded stree model) with its ``tokenizer`` (a transformers tokenizer) and the
    ids that end a row (``eos_token_id``: default the tokenizer's). ``drafter_model``: the small
    model the "ssm" / "ssm-beam" drafters run."""

    def __init__(self, model, tokenizer, eos_token_id: int | list[int] | None = None, drafter_model=None):
        self.model, self.tokenizer, self.drafter_model = model, tokenizer, drafter_model
        if eos_token_id is None:
            eos_token_id = tokenizer.eos_token_id
        self.eos_token_id = eos_token_id

    @classmethod
    def from_pretrained(cls, path, *, device=None, dtype=None, tokenizer=None, drafter_model=None,
                        tensor_parallel: int | None = None, revision: str | None = None) -> "LM":
        """Load the checkpoint directory or Hub id ``path`` (every format :func:`stree.models.load`
        reads; an id, at ``revision``, comes from the Hub cache or is downloaded into it), its
        tokenizer (or ``tokenizer``: a directory or id, for checkpoints without one) and the EOS
        ids it declares (generation_config.json, config.json, else the tokenizer's). ``device``:
        default CUDA when available (under torchrun, the process's local GPU); ``dtype`` (a torch
        dtype or its name): default the checkpoint's. ``drafter_model``: a checkpoint directory or
        Hub id (loaded like the target, whole, on every rank) or a loaded model, for the "ssm"
        drafters. ``tensor_parallel=N``: launched by ``torchrun --nproc-per-node N``, each rank
        loads its slice of the model (:mod:`stree.models.parallel`); every rank then calls
        ``generate`` with the same arguments and gets the same output."""
        from .models import DTYPES, join, load, load_tokenizer
        from .models.hub import resolve

        if isinstance(dtype, str):
            if dtype not in DTYPES:
                raise ValueError(f"dtype must be a torch dtype or one of {sorted(DTYPES)}, got {dtype!r}")
            dtype = DTYPES[dtype]
        path = resolve(path, revision)
        device = rank_device(device, tensor_parallel)
        tp = None if tensor_parallel is None else join(tensor_parallel, device)
        model = load(path, dtype=dtype, device=device, tensor_parallel=tp)
        tok = load_tokenizer(tokenizer or path, vocab_size=model.vocab_size)
        if isinstance(drafter_model, (str, Path)):
            drafter_model = load(drafter_model, dtype=model.dtype, device=device)
        return cls(model, tok, checkpoint_eos(path), drafter_model)

    def close(self) -> None:
        """Tensor parallelism: meet the other ranks and end the process group that
        ``from_pretrained`` started (``with LM.from_pretrained(...) as lm:`` does it on leaving
        the block; at exit it happens anyway). Nothing to do for one process; idempotent."""
        from .models import leave

        if getattr(self.model, "tp", None) is not None:
            leave()

    def __enter__(self) -> "LM":
        return self

    def __exit__(self, kind, error, trace) -> None:
        if getattr(self.model, "tp", None) is not None:
            from .models import leave

            leave(meet=error is None)  # a rank failing alone must not wait for the others

    def encode(self, prompts) -> list[list[int]]:
        if isinstance(prompts, str):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)) or not prompts or not all(isinstance(p, str) for p in prompts):
            raise TypeError(f"prompts must be a string or a non-empty list of strings, got {prompts!r}")
        for i, p in enumerate(prompts):
            try:
                p.encode("utf-8")
            except UnicodeEncodeError as exc:  # e.g. undecodable bytes on a command line
                raise ValueError(f"prompt {i} is not valid UTF-8 text (character {exc.start}: "
                                 f"{p[exc.start:exc.end]!r})") from None
        ids = [self.tokenizer.encode(p) for p in prompts]
        empty = [i for i, p in enumerate(ids) if not p]
        if empty:
            raise ValueError(f"prompt {empty[0]} ({prompts[empty[0]]!r}) encodes to no tokens")
        return ids

    def drafter(self, name, temperature: float = 0.0, tokens: int | None = None) -> Drafter | None:
        """A drafter by name ("ngram", "stand", "stand-det", "consensus", "ssm", "ssm-beam"), or
        ``name`` itself when it is a Drafter. ``tokens``: the most it will see emitted (one call's),
        which sizes a fresh STAND store."""
        if name is None or isinstance(name, Drafter):
            return name
        if not isinstance(name, str):
            raise TypeError(f"drafter must be a name or a Drafter, got {type(name).__name__}")
        name = DRAFTER_ALIASES.get(name, name)
        if name == "stand" and temperature == 0:  # greedy verification takes the target's top token: STAND's
            name = "stand-det"  # random drafts only waste slots there, so it drafts its most likely ones
        if name not in DRAFTER_NAMES:
            raise ValueError(f"drafter must be one of {sorted({*DRAFTER_NAMES, *DRAFTER_ALIASES})} or a Drafter, "
                             f"got {name!r}")
        if name in NEEDS_MODEL and self.drafter_model is None:
            raise ValueError(f"drafter {name!r} needs a drafter model (LM.from_pretrained(..., drafter_model=DIR))")
        return make_drafter(name, drafter_model=self.drafter_model if name in NEEDS_MODEL else None,
                            vocab_size=self.model.vocab_size, temperature=temperature, include_self=True, tokens=tokens)

    def _steps(self, prompts, *, max_new_tokens: int = 128, drafter="ngram", stop=None, temperature: float = 0.0,
               eos_token_id="checkpoint", **kwargs):
        """The rows' text trackers, the decoding steps, and the EOS ids in force."""
        stops = stop_strings(stop)
        ids = self.encode(prompts)
        eos = self.eos_token_id if eos_token_id == "checkpoint" else eos_token_id
        rows = [TextStops(self.tokenizer, stops) for _ in ids]
        budget = max_new_tokens if isinstance(max_new_tokens, int) and max_new_tokens > 0 else None  # decode checks it
        steps = decode(self.model, ids, max_new_tokens=max_new_tokens, temperature=temperature, eos_token_id=eos,
                       drafter=self.drafter(drafter, temperature, None if budget is None else len(ids) * (budget + 1)),
                       **kwargs)
        return rows, steps, eos

    def _output(self, out, rows: list[TextStops], eos) -> TextOutput:
        eos = set([] if eos is None else [eos] if isinstance(eos, int) else eos)
        reasons = []
        for row, tokens in zip(rows, out.new_tokens):
            if row.cut is not None:
                reasons.append("stop")
            else:
                reasons.append("eos" if tokens and tokens[-1] in eos else "length")
                row.text = row.decode(tokens)
        return TextOutput([r.text for r in rows], out.new_tokens, reasons, out.stats)

    def generate(self, prompts, **kwargs) -> TextOutput:
        """Complete ``prompts`` (a string or a list, decoded as one batch). ``max_new_tokens``
        (default 128); ``drafter``: "ngram" (default), "stand", "stand-det", "consensus", "ssm",
        "ssm-beam" or a Drafter; ``stop``: a string or strings that end a row; ``eos_token_id``:
        default the checkpoint's (None: no EOS). Every other argument is
        :func:`stree.generate.decode`'s: ``method``, ``tree``, ``temperature``, ``top_k``,
        ``top_p``, ``seed``, ``torch_compile``, ..."""
        rows, steps, eos = self._steps(prompts, **kwargs)
        while True:
            try:
                batch = next(steps)
            except StopIteration as end:
                return self._output(end.value, rows, eos)
            apply_text_stops(batch, rows)

    def stream(self, prompt: str, **kwargs) -> "TextStream":
        """Yield the completion of one ``prompt`` as its tokens are accepted (the arguments of
        :meth:`generate`); after the last piece, the stream's ``output`` is the
        :class:`TextOutput`. Text that could still begin a stop string is held back until it
        cannot."""
        if not isinstance(prompt, str):
            raise TypeError(f"stream takes one prompt string, got {type(prompt).__name__}")
        return TextStream(self, prompt, kwargs)


class TextStream:
    """The pieces of one prompt's completion (see :meth:`LM.stream`); ``output`` once exhausted."""

    def __init__(self, lm: LM, prompt: str, kwargs: dict):
        self.lm, self.prompt, self.kwargs = lm, prompt, kwargs
        self.output: TextOutput | None = None

    def __iter__(self):
        lm = self.lm
        rows, steps, eos = lm._steps(self.prompt, **self.kwargs)
        row, sent = rows[0], 0
        while True:
            try:
                batch = next(steps)
            except StopIteration as end:
                self.output = lm._output(end.value, rows, eos)
                break
            apply_text_stops(batch, rows)
            if row.cut is None:
                row.update(batch.generated(0))
                ready = len(row.text) - held_back(row.text, row.stops)
                if ready > sent:
                    yield row.text[sent:ready]
                    sent = ready
        if len(self.output.text) > sent:
            yield self.output.text[sent:]
