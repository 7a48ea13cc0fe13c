"""Text in, text out: a target model with its tokenizer, end-of-sequence ids and decoding defaults.

    lm = LM.from_pretrained("path/to/checkpoint")  # or a Hub id, "org/name"
    out = lm.generate(["def f(x):", "class A:"], max_new_tokens=64, drafter="stand", stop=["\\n\\n"])
    out.texts, out.finish_reasons, out.stats, out.generation
    lm.chat([{"role": "user", "content": "Hi"}]).texts  # through the chat template

``generate`` batches the prompts through :func:`stree.decoding.loop.decode`; stop strings are checked
on each row's decoded text after every decoding step, and a row that shows one ends there (the
drafted tokens accepted past it are dropped, the row leaves the batch). ``stream`` yields the text
of one prompt as its tokens are accepted; ``chat`` and ``chat_stream`` do the same for
conversations (:mod:`stree.patterns.chat`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from .drafters.base import Drafter
from .drafters.registry import drafter_name, resolve_drafter
from .decoding.loop import GenerationStats, decode, drain
from .decoding.stops import TextStops, apply_text_stops, finish_reasons, held_back, stop_strings

FINISH_REASONS = ("eos", "stop", "length")


@dataclass
class TextOutput:
    """Per prompt: the generated ``texts`` (special tokens skipped; a stop string and what follows
    it cut off), ``token_ids`` (the generated tokens, through the one that completed a stop
    string) and ``finish_reasons`` ("eos", "stop" or "length"); the decoding ``stats`` and the
    ``generation`` values used (max_new_tokens, temperature, top_k, top_p, eos_token_id, and
    which of them came from the checkpoint); ``logprobs``: per prompt a
    :class:`~stree.decoding.rows.TokenLogprob` per token of ``token_ids``, where the call passed
    ``logprobs=k``."""

    texts: list[str]
    token_ids: list[list[int]]
    finish_reasons: list[str]
    stats: GenerationStats
    generation: dict = field(default_factory=dict)  # the decoding values used (LM.generation)
    reasoning: list[str | None] | None = None  # a chat's thinking per row (LM.chat), None where there is none
    logprobs: list | None = None

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


# What generation_config.json may set that decoding here honours, with stree's own defaults.
SAMPLING_DEFAULTS = dict(max_new_tokens=128, temperature=0.0, top_k=0, top_p=1.0)


def generation_defaults(path) -> dict:
    """The decoding defaults a checkpoint directory's generation_config.json declares, as
    transformers reads them: ``do_sample`` true samples at its ``temperature`` (1.0 if unset),
    anything else decodes greedily; ``top_k``, ``top_p`` and ``max_new_tokens`` as set. Only what
    the file sets is returned; a malformed value is a ValueError naming the file."""
    import json

    file = Path(path) / "generation_config.json"
    if not file.exists():
        return {}
    try:
        config = json.loads(file.read_text())
    except ValueError as exc:
        raise ValueError(f"{file} is not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{file} must hold a JSON object")
    out = {}
    sample = config.get("do_sample", False)
    if not isinstance(sample, bool):
        raise ValueError(f"{file}: do_sample must be true or false, got {sample!r}")
    if sample:
        out["temperature"] = config.get("temperature", 1.0)
    elif "do_sample" in config or "temperature" in config:
        out["temperature"] = 0.0  # transformers decodes greedily unless do_sample is set, whatever the temperature
    for name in ("top_k", "top_p", "max_new_tokens"):
        if config.get(name) is not None:
            out[name] = config[name]
    for name, value in out.items():
        kind = int if name in ("top_k", "max_new_tokens") else (int, float)
        if isinstance(value, bool) or not isinstance(value, kind):
            raise ValueError(f"{file}: {name} must be a number, got {value!r}")
    return out


def rank_device(device, tensor_parallel: int | None) -> torch.device:
    """The device a process loads on: ``device`` (checked), else CUDA when available, else the
    CPU; under tensor parallelism (torchrun) an unnumbered CUDA device is this rank's own GPU, and
    by default the ranks go to the CPU (gloo) when the machine has fewer GPUs than ranks."""
    from .checkpoints.io import check_device
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


def load_drafter_model(path, device: torch.device, dtype: torch.dtype):
    """The small model the "ssm" drafters run, from the checkpoint directory or Hub id ``path``, for a
    target on ``device`` in ``dtype``: on that device, in that dtype on a GPU and in float32 on the
    CPU. A drafter's precision never changes what the target emits (every drafted token is verified),
    and on the CPU float32 is the one-call greedy draft's (:mod:`stree.models.fused_step`): drafted
    block by block in the shipped target's float16, chains cost more than they brought
    (docs/benchmarks.md)."""
    from .checkpoints.io import load

    return load(path, dtype=torch.float32 if device.type == "cpu" else dtype, device=device)


class LM:
    """``model`` (a loaded stree model) with its ``tokenizer`` (a transformers tokenizer) and the
    ids that end a row (``eos_token_id``: default the tokenizer's). ``drafter_model``: the small
    model the "ssm" / "ssm-beam" drafters run. ``defaults``: the decoding values ``generate``
    takes where the call sets none (``max_new_tokens``, ``temperature``, ``top_k``, ``top_p``;
    :func:`generation_defaults` reads a checkpoint's), else ``SAMPLING_DEFAULTS``."""

    def __init__(self, model, tokenizer, eos_token_id: int | list[int] | None = None, drafter_model=None,
                 defaults: dict | None = None):
        self.model, self.tokenizer, self.drafter_model = model, tokenizer, drafter_model
        if eos_token_id is None:
            eos_token_id = tokenizer.eos_token_id
        self.eos_token_id = eos_token_id
        unknown = set(defaults or {}) - set(SAMPLING_DEFAULTS)
        if unknown:
            raise ValueError(f"defaults may set {sorted(SAMPLING_DEFAULTS)}, got {sorted(unknown)}")
        self.defaults = dict(defaults or {})

    @classmethod
    def from_pretrained(cls, path, *, device=None, dtype=None, tokenizer=None, drafter_model=None,
                        tensor_parallel: int | None = None, revision: str | None = None) -> "LM":
        """Load the checkpoint directory or Hub id ``path`` (every format :func:`stree.models.load`
        reads; an id, at ``revision``, comes from the Hub cache or is downloaded into it), its
        tokenizer (or ``tokenizer``: a directory or id, for checkpoints without one), the EOS
        ids it declares (generation_config.json, config.json, else the tokenizer's) and its
        decoding defaults (generation_config.json: :func:`generation_defaults`). ``device``:
        default CUDA when available (under torchrun, the process's local GPU); ``dtype`` (a torch
        dtype or its name): default the checkpoint's. ``drafter_model``: a checkpoint directory or
        Hub id (loaded whole on every rank, as :func:`load_drafter_model` loads it) or a loaded model,
        for the "ssm" drafters. ``tensor_parallel=N``: launched by ``torchrun --nproc-per-node N``, each rank
        loads its slice of the model (:mod:`stree.models.parallel`); every rank then calls
        ``generate`` with the same arguments and gets the same output."""
        from .models import join
        from .checkpoints.io import DTYPES, load
        from .checkpoints.tokenizer import load_tokenizer
        from .checkpoints.hub import resolve

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
            drafter_model = load_drafter_model(drafter_model, model.device, model.dtype)
        return cls(model, tok, checkpoint_eos(path), drafter_model, generation_defaults(path))

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
        if isinstance(name, str) and drafter_name(name) == "stand" and temperature == 0:
            # greedy verification takes the target's top token: STAND's random drafts only waste
            # slots there, so it drafts its most likely ones
            name = "stand-det"
        return resolve_drafter(name, drafter_model=self.drafter_model, vocab_size=self.model.vocab_size,
                               model_hint=" (LM.from_pretrained(..., drafter_model=DIR))", temperature=temperature,
                               include_self=True, tokens=tokens)

    def generation(self, **given) -> dict:
        """The decoding values in force for a call that sets ``given`` (None: not set): the call's,
        else the checkpoint's defaults, else stree's; and ``"from_checkpoint"``, the names taken
        from the checkpoint."""
        out, taken = {}, []
        for name, default in SAMPLING_DEFAULTS.items():
            if given.get(name) is not None:
                out[name] = given[name]
            elif name in self.defaults:
                out[name] = self.defaults[name]
                taken.append(name)
            else:
                out[name] = default
        return dict(out, from_checkpoint=taken)

    def _steps(self, prompts, *, max_new_tokens: int | None = None, drafter="ngram", stop=None,
               temperature: float | None = None, top_k: int | None = None, top_p: float | None = None,
               eos_token_id="checkpoint", **kwargs):
        """The rows' text trackers, the decoding steps, the EOS ids and the decoding values in force;
        ``prompts``: text, or :class:`_Ids` (token ids already)."""
        stops = stop_strings(stop)
        ids = prompts.ids if isinstance(prompts, _Ids) else self.encode(prompts)
        eos = self.eos_token_id if eos_token_id == "checkpoint" else eos_token_id
        params = self.generation(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p)
        params["eos_token_id"] = eos
        rows = [TextStops(self.tokenizer, stops) for _ in ids]
        budget = params["max_new_tokens"]
        budget = budget if isinstance(budget, int) and budget > 0 else None  # decode checks it
        temperature = params["temperature"]
        made = self.drafter(drafter, temperature, None if budget is None else len(ids) * (budget + 1))
        if made is not None and made is not drafter:  # (made by name for this call alone: Drafter.serves_one_call)
            made.serves_one_call = True
        steps = decode(self.model, ids, max_new_tokens=params["max_new_tokens"], temperature=temperature,
                       top_k=params["top_k"], top_p=params["top_p"], eos_token_id=eos, drafter=made, **kwargs)
        return rows, steps, eos, params

    def _output(self, out, rows: list[TextStops], eos, params: dict, stop_sequences=()) -> TextOutput:
        for row, tokens in zip(rows, out.new_tokens):
            if row.cut is None:
                row.text = row.decode(tokens)
        reasons = finish_reasons(out.new_tokens, rows, eos, stop_sequences)
        return TextOutput([r.text for r in rows], out.new_tokens, reasons, out.stats, params, logprobs=out.logprobs)

    def generate(self, prompts, **kwargs) -> TextOutput:
        """Complete ``prompts`` (a string or a list, decoded as one batch). ``max_new_tokens``,
        ``temperature``, ``top_k``, ``top_p``: default the checkpoint's generation_config.json,
        else 128 tokens, greedy (the output's ``generation`` says what was used); ``drafter``:
        "ngram" (default), "stand", "stand-det", "consensus", "ssm", "ssm-beam" or a Drafter;
        ``stop``: a string or strings that end a row; ``eos_token_id``: default the checkpoint's
        (None: no EOS). Every other argument is :func:`stree.decoding.loop.decode`'s: ``method``,
        ``tree``, ``seed``, ``torch_compile``, ..."""
        rows, steps, eos, params = self._steps(prompts, **kwargs)
        out = drain(steps, lambda batch: apply_text_stops(batch, rows))
        return self._output(out, rows, eos, params, kwargs.get("stop_sequences"))

    def chat(self, messages, **kwargs) -> TextOutput:
        """Answer ``messages``: one conversation (a list of ``{"role", "content"}`` dicts) or a
        list of them (one batch), each prompted exactly as ``tokenizer.apply_chat_template(
        conversation, add_generation_prompt=True)`` gives, then decoded as :meth:`generate`
        decodes (every argument of it). A reasoning model's ``<think>`` block, opened by the
        template or by the model, comes back apart: ``texts`` hold the answers and ``reasoning``
        the thinking (None for a row without a block). A tokenizer without a chat template is a
        ValueError."""
        from .patterns.chat import chat_prompts, conversations

        convs, _ = conversations(messages)
        ids, opened = chat_prompts(self.tokenizer, convs)
        return _split(self.generate(_Ids(ids), **kwargs), opened)

    def chat_stream(self, messages, **kwargs) -> "TextStream":
        """:meth:`chat` of one conversation, its text yielded as tokens are accepted (the thinking
        included, as generated); the stream's ``output`` holds the answer and reasoning apart."""
        from .patterns.chat import chat_prompts, conversations

        convs, single = conversations(messages)
        if not single:
            raise TypeError("chat_stream takes one conversation (a list of message dicts), not a batch of them")
        ids, opened = chat_prompts(self.tokenizer, convs)
        return TextStream(self, _Ids(ids), kwargs, opened)

    def stream(self, prompt: str, **kwargs) -> "TextStream":
        """Yield the completion of one ``prompt`` as its tokens are accepted (the arguments of
        :meth:`generate`); after the last piece, the stream's ``output`` is the
        :class:`TextOutput`. Text that could still begin a stop string is held back until it
        cannot."""
        if not isinstance(prompt, str):
            raise TypeError(f"stream takes one prompt string, got {type(prompt).__name__}")
        return TextStream(self, prompt, kwargs)


@dataclass
class _Ids:
    """Prompts given as token ids (a chat template's)."""

    ids: list[list[int]]


def _split(out: TextOutput, opened: list[bool]) -> TextOutput:
    """``out`` with each row's ``<think>`` block moved from ``texts`` to ``reasoning``."""
    from .patterns.chat import split_reasoning

    parts = [split_reasoning(text, o) for text, o in zip(out.texts, opened)]
    out.reasoning = [r for r, _ in parts]
    out.texts = [t for _, t in parts]
    return out


class TextStream:
    """The pieces of one prompt's completion (see :meth:`LM.stream`); ``output`` once exhausted.
    ``opened``: a chat's (:meth:`LM.chat_stream`): whether its template opened a think block."""

    def __init__(self, lm: LM, prompt, kwargs: dict, opened: list[bool] | None = None):
        self.lm, self.prompt, self.kwargs, self.opened = lm, prompt, kwargs, opened
        self.output: TextOutput | None = None

    def __iter__(self):
        lm = self.lm
        rows, steps, eos, params = lm._steps(self.prompt, **self.kwargs)
        row, sent = rows[0], 0
        while True:
            try:
                batch = next(steps)
            except StopIteration as end:
                self.output = lm._output(end.value, rows, eos, params, self.kwargs.get("stop_sequences"))
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
        if self.opened is not None:
            _split(self.output, self.opened)
