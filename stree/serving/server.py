"""An OpenAI-compatible HTTP server on the engine (:mod:`.engine`): Starlette routes served by
uvicorn (the ASGI stack the field's servers use; Starlette alone, without FastAPI's schema layer:
the bodies are checked by the engine's own argument checks, which name the argument).

``/v1/completions`` and ``/v1/chat/completions`` (the model's chat template; a ``<think>`` block
comes back as ``reasoning_content``), streamed as server-sent events with ``"stream": true``;
``n``, ``stop``, ``temperature``, ``top_p``, ``max_tokens``, ``seed``, ``logprobs`` (completions: the
top count, at most 5; chat: ``logprobs`` and ``top_logprobs``, at most 20), and stree's own
``drafter``, ``tree`` and ``top_k`` as extra body fields; ``/v1/models``, ``/health`` and ``/metrics``
(Prometheus text). A bad request gets a 4xx with an OpenAI-style error body; a client that goes
away mid-stream cancels its request (its slots are free at the engine's next iteration).
"""

from __future__ import annotations

import asyncio
import json
import math
import numbers
import signal
import time
import uuid

from starlette.applications import Starlette
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.routing import Route

from ..patterns.chat import chat_prompts, conversations, split_reasoning
from .engine import Engine, EngineClosed, Overloaded

__all__ = ["make_app", "serve"]

DEFAULT_MAX_TOKENS = 16  # OpenAI's for completions; chat's default is what the slot leaves
# body fields a request may carry: OpenAI's that are honoured, and stree's own
COMPLETION_FIELDS = {"model", "prompt", "max_tokens", "temperature", "top_p", "n", "stop", "seed", "stream",
                     "drafter", "tree", "top_k", "user", "stream_options", "logprobs", "echo"}
CHAT_FIELDS = (COMPLETION_FIELDS - {"prompt", "echo"}) | {"messages", "max_completion_tokens", "top_logprobs"}
# OpenAI's limits on the top entries a token's logprobs list, and its stand-in for a log-probability of -inf
MAX_LOGPROBS = {"completions": 5, "chat": 20}
NO_LOGPROB = -9999.0


class APIError(Exception):
    """An error the client caused: ``status`` and an OpenAI-style body."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.kind, self.param, self.code = status, kind, param, code

    def response(self) -> JSONResponse:
        body = {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status)


def make_app(engine: Engine, model_name: str, api_key: str | None = None) -> Starlette:
    """The server's routes over ``engine``, answering to ``model_name``; with ``api_key``, every
    route but ``/health`` wants ``Authorization: Bearer <api_key>``."""
    started = time.time()

    def guarded(handler):
        async def route(request: HTTPRequest):
            try:
                if api_key is not None and request.headers.get("authorization") != f"Bearer {api_key}":
                    raise APIError(401, "a valid API key is needed (Authorization: Bearer <key>)",
                                   "authentication_error", code="invalid_api_key")
                return await handler(request)
            except APIError as error:
                return error.response()

        return route

    async def body(request: HTTPRequest, fields: set[str]) -> dict:
        try:
            data = json.loads(await request.body())
        except (ValueError, UnicodeDecodeError) as error:
            raise APIError(400, f"the body is not valid JSON: {error}") from None
        if not isinstance(data, dict):
            raise APIError(400, "the body must be a JSON object")
        unknown = sorted(set(data) - fields)
        if unknown:
            raise APIError(400, f"unsupported field(s): {', '.join(unknown)}", param=unknown[0])
        if data.get("model") != model_name:
            raise APIError(404, f"the model {data.get('model')!r} does not exist; this server has {model_name!r}",
                           param="model", code="model_not_found")
        return data

    def submit(prompt, data: dict, max_tokens, logprobs: int | None = None, prompt_logprobs: int | None = None):
        stream = data.get("stream", False)
        if not isinstance(stream, bool):
            raise APIError(400, f"stream must be a boolean, got {stream!r}", param="stream")
        options = {name: data[name] for name in ("temperature", "top_p", "top_k", "n", "stop", "seed", "tree")
                   if data.get(name) is not None}  # (clients send null for what they leave unset)
        if "drafter" in data:  # null: autoregressive
            options["drafter"] = data["drafter"]
        if "temperature" not in options:
            options["temperature"] = 1.0  # OpenAI's default
        for name in ("temperature", "top_p"):
            if name in options and (isinstance(options[name], bool) or not isinstance(options[name], numbers.Real)):
                raise APIError(400, f"{name} must be a number, got {options[name]!r}", param=name)
        try:
            return engine.submit(prompt, max_tokens=max_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                                 **options), stream
        except Overloaded as error:
            raise APIError(429, str(error), "server_overloaded", code="overloaded") from None
        except EngineClosed as error:
            raise APIError(503, str(error), "server_shutting_down") from None
        except (TypeError, ValueError) as error:
            raise APIError(400, str(error)) from None

    def budget(data: dict, name: str, default: int, prompt: list[int]) -> int:
        value = data.get(name)
        if value is None:
            return default if default > 0 else engine.max_length - len(prompt)
        if isinstance(value, bool) or not isinstance(value, int):
            raise APIError(400, f"{name} must be an integer, got {value!r}", param=name)
        return value

    async def completions(request: HTTPRequest):
        data = await body(request, COMPLETION_FIELDS)
        prompt = data.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if not (isinstance(prompt, str) and prompt) and not (isinstance(prompt, list) and prompt and
                                                            all(isinstance(t, int) for t in prompt)):
            raise APIError(400, "prompt must be a non-empty string or list of token ids (one prompt a request)",
                           param="prompt")
        ids = _encode(engine, prompt)
        usage = _usage(data)  # (every check before the request is queued)
        top = _count(data, "logprobs", "completions")
        echo = False if data.get("echo") is None else data["echo"]
        if not isinstance(echo, bool):
            raise APIError(400, f"echo must be a boolean, got {echo!r}", param="echo")
        max_tokens = budget(data, "max_tokens", DEFAULT_MAX_TOKENS, ids)
        if max_tokens == 0 and not echo:
            raise APIError(400, "max_tokens must be an int >= 1, got 0 (0 only with echo)", param="max_tokens")
        # echo: the prompt comes back before the completion, scored where logprobs are asked for (or
        # where nothing is generated: the engine reads a prompt alone only to score it)
        scored = top if top is not None else 0 if max_tokens == 0 else None
        job, stream = submit(ids, data, max_tokens, top, scored if echo else None)
        shown = (prompt if isinstance(prompt, str) else engine.lm.tokenizer.decode(ids), ids) if echo else None
        return await _answer(request, job, stream, "text_completion", model_name, len(ids), None, usage,
                             _Logprobs(engine.lm.tokenizer, chat=False) if top is not None else None, shown)

    async def chat(request: HTTPRequest):
        data = await body(request, CHAT_FIELDS)
        try:
            convs, single = conversations(data.get("messages"))
            if not single:
                raise TypeError("messages must be one conversation (a list of message dicts)")
            (ids,), (opened,) = chat_prompts(engine.lm.tokenizer, convs)
        except (TypeError, ValueError) as error:
            raise APIError(400, str(error), param="messages") from None
        name = "max_completion_tokens" if data.get("max_completion_tokens") is not None else "max_tokens"
        usage = _usage(data)  # (every check before the request is queued)
        top = _chat_logprobs(data)
        job, stream = submit(ids, data, budget(data, name, 0, ids), top)
        return await _answer(request, job, stream, "chat.completion", model_name, len(ids), opened, usage,
                             _Logprobs(engine.lm.tokenizer, chat=True) if top is not None else None)

    async def models(request: HTTPRequest):
        return JSONResponse({"object": "list", "data": [{"id": model_name, "object": "model", "created": int(started),
                                                         "owned_by": "stree"}]})

    async def health(request: HTTPRequest):
        return JSONResponse({"status": "ok"})

    async def metrics(request: HTTPRequest):
        return PlainTextResponse(_metrics(engine), media_type="text/plain; version=0.0.4")

    routes = [Route("/v1/completions", guarded(completions), methods=["POST"]),
              Route("/v1/chat/completions", guarded(chat), methods=["POST"]),
              Route("/v1/models", guarded(models), methods=["GET"]),
              Route("/metrics", guarded(metrics), methods=["GET"]),
              Route("/health", health, methods=["GET"])]

    async def not_found(request, exc):
        status = getattr(exc, "status_code", 500)
        return APIError(status, getattr(exc, "detail", None) or "not found", "invalid_request_error").response()

    return Starlette(routes=routes, exception_handlers={404: not_found, 405: not_found})


def _usage(data: dict) -> bool:
    """Whether a stream ends with a usage chunk (``stream_options: {"include_usage": true}``)."""
    options = data.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool):
        raise APIError(400, f"stream_options must be an object with a boolean include_usage, got {options!r}",
                       param="stream_options")
    return options.get("include_usage", False)


def _count(data: dict, name: str, route: str) -> int | None:
    """The top count ``data[name]`` asks for (None: no logprobs), at most OpenAI's limit."""
    value, most = data.get(name), MAX_LOGPROBS[route]
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= most:
        raise APIError(400, f"{name} must be an integer in [0, {most}], got {value!r}", param=name)
    return value


def _chat_logprobs(data: dict) -> int | None:
    """Chat's ``logprobs`` (a boolean) and ``top_logprobs`` (which needs it) as one top count."""
    wanted = data.get("logprobs")
    if wanted is not None and not isinstance(wanted, bool):
        raise APIError(400, f"logprobs must be a boolean, got {wanted!r}", param="logprobs")
    top = _count(data, "top_logprobs", "chat")
    if top is not None and not wanted:
        raise APIError(400, "top_logprobs needs logprobs set to true", param="top_logprobs")
    return (top or 0) if wanted else None


class _Logprobs:
    """A choice's token log-probabilities in OpenAI's shapes: completions' ``tokens`` /
    ``token_logprobs`` / ``top_logprobs`` / ``text_offset`` (offsets counted over the tokens' own
    text from the start of the choice), chat's ``content`` list. A token's text is its own decoding;
    -inf (a token a processed law rules out) is OpenAI's -9999.0."""

    def __init__(self, tokenizer, chat: bool):
        self.tokenizer, self.chat = tokenizer, chat
        self.offsets: dict[int, int] = {}  # choice index -> text offset of its next token

    def text(self, token: int) -> str:
        return self.tokenizer.decode([token])

    def __call__(self, index: int, logprobs, first: int | None = None) -> dict:
        """``logprobs`` (:class:`~stree.decoding.rows.TokenLogprob` s) of choice ``index``; ``first``:
        a token before them that has none (an echoed prompt's first: null in completions)."""
        if self.chat:
            return {"content": [dict(self._entry(lp.token, lp.logprob),
                                     top_logprobs=[self._entry(i, p) for i, p in lp.top]) for lp in logprobs],
                    "refusal": None}
        head = [] if first is None else [(first, None)]
        pairs = head + [(lp.token, lp) for lp in logprobs]
        tokens = [self.text(t) for t, _ in pairs]
        offsets, at = [], self.offsets.get(index, 0)
        for t in tokens:
            offsets.append(at)
            at += len(t)
        self.offsets[index] = at
        return {"tokens": tokens, "token_logprobs": [None if lp is None else _finite(lp.logprob) for _, lp in pairs],
                "top_logprobs": [None if lp is None else {self.text(i): _finite(p) for i, p in lp.top}
                                 for _, lp in pairs],
                "text_offset": offsets}

    def _entry(self, token: int, logprob: float) -> dict:
        text = self.text(token)
        return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode("utf-8"))}


def _finite(logprob: float) -> float:
    return max(logprob, NO_LOGPROB)


def _encode(engine: Engine, prompt) -> list[int]:
    if isinstance(prompt, list):
        return prompt
    try:
        return engine.lm.encode(prompt)[0]
    except (TypeError, ValueError) as error:
        raise APIError(400, str(error), param="prompt") from None


async def _answer(http: HTTPRequest, job, stream: bool, kind: str, model: str, prompt_tokens: int,
                  opened: bool | None, usage: bool = False, logprobs: _Logprobs | None = None,
                  echo: tuple[str, list[int]] | None = None):
    """The request's response: one JSON body, or its events as server-sent events (``usage``: the
    last of them the token counts; ``logprobs``: each choice's, or each chunk's tokens', in
    OpenAI's shape; ``echo``: the prompt's text and ids, which each choice begins with)."""

    def echoed(index: int) -> tuple[str, dict | None]:
        """Choice ``index``'s echoed prompt: its text and, where asked for, its log-probabilities."""
        text, ids = echo
        if logprobs is None or job.prompt_scores is None:  # (none: cancelled before its prompt was read)
            return text, None
        return text, logprobs(index, job.prompt_scores[1:], first=ids[0])

    loop = asyncio.get_running_loop()
    events: asyncio.Queue = asyncio.Queue()
    job.attach(loop, events.put_nowait)
    rid = f"{'chatcmpl' if opened is not None else 'cmpl'}-{uuid.uuid4().hex}"
    created = int(time.time())
    def counts(choices) -> dict:
        completion = sum(len(c.token_ids) for c in choices)
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                "total_tokens": prompt_tokens + completion}

    if not stream:
        try:
            while await events.get() is not None:
                pass
        except asyncio.CancelledError:
            job.cancel()
            raise
        if job.error is not None:
            raise APIError(500, str(job.error), "server_error")
        choices = job.result()
        out = []
        for c in choices:
            head, lp = echoed(c.index) if echo is not None else ("", None)
            if logprobs is not None:
                tail = logprobs(c.index, c.logprobs)
                lp = tail if lp is None else {key: lp[key] + tail[key] for key in lp}
            if opened is None:
                out.append({"index": c.index, "text": head + c.text, "logprobs": lp, "finish_reason": _reason(c)})
            else:
                reasoning, answer = split_reasoning(c.text, opened)
                message = {"role": "assistant", "content": answer}
                if reasoning is not None:
                    message["reasoning_content"] = reasoning
                out.append({"index": c.index, "message": message, "logprobs": lp, "finish_reason": _reason(c)})
        return JSONResponse({"id": rid, "object": kind, "created": created, "model": model, "choices": out,
                             "usage": counts(choices)})

    chunk_kind = "chat.completion.chunk" if opened is not None else "text_completion"

    def chunk(index: int, text: str | None, reason: str | None, first: bool = False, tokens=None,
              scores: dict | None = None) -> str:
        lp = scores if scores is not None else None if logprobs is None or tokens is None else logprobs(index, tokens)
        if opened is None:
            choice = {"index": index, "text": text or "", "logprobs": lp, "finish_reason": reason}
        else:
            delta = {} if text is None else {"content": text}
            if first:
                delta["role"] = "assistant"
            choice = {"index": index, "delta": delta, "logprobs": lp, "finish_reason": reason}
        return "data: " + json.dumps({"id": rid, "object": chunk_kind, "created": created, "model": model,
                                      "choices": [choice]}) + "\n\n"

    async def sse():
        try:
            if opened is not None:
                for i in range(job.n):
                    yield chunk(i, "", None, first=True)
            shown = set()
            while (event := await events.get()) is not None:
                if echo is not None and event.index not in shown:  # the prompt before the choice's first tokens
                    shown.add(event.index)
                    text, scores = echoed(event.index)
                    yield chunk(event.index, text, None, scores=scores)
                sent = event.logprobs if event.token_ids else None  # each token's with the chunk it came in
                if event.text or event.finish_reason is None:
                    yield chunk(event.index, event.text, None, tokens=sent)
                    sent = None
                if event.finish_reason is not None:
                    yield chunk(event.index, None, _reason(event), tokens=sent)
            if job.error is not None:
                yield "data: " + json.dumps({"error": {"message": str(job.error), "type": "server_error"}}) + "\n\n"
            elif usage:
                yield "data: " + json.dumps({"id": rid, "object": chunk_kind, "created": created, "model": model,
                                             "choices": [], "usage": counts(job.result())}) + "\n\n"
            yield "data: [DONE]\n\n"
        finally:  # (also where the client went away: the request's slots are freed)
            if not job.done:
                job.cancel()

    return StreamingResponse(sse(), media_type="text/event-stream")


def _reason(choice) -> str:
    """OpenAI's finish reasons: "stop" (a stop string or the EOS), "length"; a cancelled choice
    (only a client that went away sees one) as "abort"."""
    return {"eos": "stop", "stop": "stop", "length": "length"}.get(choice.finish_reason, "abort")


def _metrics(engine: Engine) -> str:
    """Prometheus text of the engine's counters and gauges."""
    stats = engine.metrics()
    lines = []
    for name, kind, help_text, value in (
            ("stree_requests_total", "counter", "requests submitted", stats["requests"]),
            ("stree_generated_tokens_total", "counter", "tokens generated", stats["tokens"]),
            ("stree_target_steps_total", "counter", "rows stepped by the target (a tree pass or a plain step each)",
             stats["row_steps"]),
            ("stree_tokens_per_second", "gauge", "tokens generated per second over the last minute",
             stats["tokens_per_s"]),
            ("stree_tau", "gauge", "tokens per row per target step (1: plain decoding)", stats["tau"]),
            ("stree_queue_length", "gauge", "requests waiting for a slot", stats["queue"]),
            ("stree_free_slots", "gauge", "state slots free", stats["free_slots"]),
            ("stree_slots", "gauge", "state slots", stats["slots"])):
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}",
                  f"{name} {value if math.isfinite(value) else 0}"]
    lines += ["# HELP stree_tree_nodes_total target steps by the nodes of the tree drafted (1: a plain step)",
              "# TYPE stree_tree_nodes_total counter"]
    lines += [f'stree_tree_nodes_total{{nodes="{n}"}} {count}' for n, count in sorted(stats["trees"].items())]
    return "\n".join(lines) + "\n"


def serve(lm, model_name: str, *, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
          max_slots: int | None = None, max_length: int = 2048, max_queue: int = 256,
          log_level: str = "info") -> None:
    """Serve ``lm`` as ``model_name`` until SIGINT or SIGTERM, then let the requests in flight
    finish and stop (the arguments: :class:`~stree.serving.engine.Engine`'s, the address and the
    key)."""
    import uvicorn

    engine = Engine(lm, max_slots=max_slots, max_length=max_length, max_queue=max_queue)
    # uvicorn stops on SIGINT / SIGTERM after the requests in flight, then raises the signal again
    # under the handlers found at its start: these let that end in a normal return (status 0)
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        uvicorn.run(make_app(engine, model_name, api_key), host=host, port=port, log_level=log_level,
                    timeout_graceful_shutdown=600)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        engine.close()
