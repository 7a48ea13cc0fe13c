"""The OpenAI-compatible server, started on a free loopback port and spoken to by the official
``openai`` client and by raw HTTP: completions and chat equal ``LM.generate`` / ``LM.chat``
(greedy), streams reassemble to the same text, stop strings and ``n``, the error answers, the
API key, a client leaving mid-stream frees its slot, and 64 concurrent clients all served with
outputs identical to solo runs."""

import concurrent.futures
import http.client
import json
import signal
import socket
import subprocess
import sys
import threading
import time

import openai
import pytest
import torch
import uvicorn

import stree
from chat_templates import THINKING, with_template
from stree.serving import Engine
from stree.serving.server import make_app
from stree.tools.demo import TARGET

KEY = "sk-test"
MODEL = "tiny"
PROMPTS = ["def fibonacci(n):", "class Stack:\n    def push(self, item):", "import os\n", "for i in range("]


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    return stree.LM.from_pretrained(with_template(tmp_path_factory.mktemp("s"), THINKING, "think"), dtype="float32")


@pytest.fixture(scope="module")
def server(lm):
    """(base url, engine): a server with an API key on a free loopback port, for the module."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    engine = Engine(lm, max_slots=8, max_length=512, max_queue=128, seed=0)
    config = uvicorn.Config(make_app(engine, MODEL, KEY), host="127.0.0.1", port=port, log_level="warning")
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not srv.started:
        assert time.time() < deadline, "the server did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}", engine
    srv.should_exit = True
    thread.join(30)
    engine.close()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key=KEY, max_retries=0, timeout=120)


def _raw(server, method, path, body=None, key=KEY, raw_body=None):
    """(status, parsed JSON body) of one plain HTTP request."""
    host, port = server[0].removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    conn.request(method, path, body=raw_body if raw_body is not None else json.dumps(body), headers=headers)
    response = conn.getresponse()
    data = response.read()
    conn.close()
    return response.status, json.loads(data) if data.startswith(b"{") else data.decode()


def test_completions_and_chat_equal_the_library(lm, client):
    out = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=24, temperature=0)
    ref = lm.generate(PROMPTS[0], max_new_tokens=24, temperature=0)
    assert out.choices[0].text == ref.texts[0] and out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == len(ref.token_ids[0])
    assert out.usage.prompt_tokens == len(lm.encode(PROMPTS[0])[0])
    messages = [{"role": "user", "content": PROMPTS[1]}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0)
    ref = lm.chat(messages, max_new_tokens=24, temperature=0)
    message = chat.choices[0].message
    assert message.content == ref.texts[0]
    assert getattr(message, "reasoning_content", None) == ref.reasoning[0]  # the template opens <think>


def test_streams_reassemble_to_the_same_text(lm, client):
    pieces = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=30, temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    chunks = list(pieces)
    ref = lm.generate(PROMPTS[2], max_new_tokens=30, temperature=0)
    assert "".join(c.choices[0].text for c in chunks[:-1]) == ref.texts[0]
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ref.token_ids[0]) == 30
    messages = [{"role": "user", "content": PROMPTS[3]}]
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0,
                                            stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream)
    ref = lm.chat(messages, max_new_tokens=20, temperature=0)
    assert text == lm.tokenizer.decode(ref.token_ids[0], skip_special_tokens=True)  # the thinking streams as text


def test_stop_strings_and_n(lm, client):
    ref = lm.generate(PROMPTS[1], max_new_tokens=40, temperature=0, stop=["a string"])
    assert ref.finish_reasons == ["stop"]
    out = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=40, temperature=0, stop=["a string"],
                                    n=3)
    assert [c.text for c in out.choices] == ref.texts * 3
    assert [c.finish_reason for c in out.choices] == ["stop"] * 3
    assert [c.index for c in out.choices] == [0, 1, 2]


def test_logprobs_are_the_librarys_in_openais_shapes(lm, client, server):
    """Completions' ``logprobs`` and chat's ``logprobs`` / ``top_logprobs``: every generated
    token's log-probability and top entries, as ``LM.generate(logprobs=k)`` gives them, streamed
    or not; the bad values get a 400."""
    out = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=12, temperature=0, logprobs=3)
    ref = lm.generate(PROMPTS[0], max_new_tokens=12, temperature=0, logprobs=3)
    lp = out.choices[0].logprobs
    assert lp.tokens == [lm.tokenizer.decode([t]) for t in ref.token_ids[0]]
    assert lp.token_logprobs == pytest.approx([x.logprob for x in ref.logprobs[0]], abs=1e-4)
    assert [p for top in lp.top_logprobs for p in top.values()] == \
        pytest.approx([p for x in ref.logprobs[0] for _, p in x.top], abs=1e-4)
    assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(len(lp.tokens))]
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=12, temperature=0, logprobs=3,
                                            stream=True))
    assert [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.token_logprobs] == \
        pytest.approx(lp.token_logprobs, abs=1e-4)
    assert [o for c in chunks if c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset] == lp.text_offset

    messages = [{"role": "user", "content": PROMPTS[1]}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0, logprobs=True,
                                          top_logprobs=2)
    ref = lm.chat(messages, max_new_tokens=10, temperature=0, logprobs=2)
    content = chat.choices[0].logprobs.content
    assert [c.token for c in content] == [lm.tokenizer.decode([t]) for t in ref.token_ids[0]]
    assert [c.logprob for c in content] == pytest.approx([x.logprob for x in ref.logprobs[0]], abs=1e-4)
    assert [c.bytes for c in content] == [list(c.token.encode()) for c in content]
    assert [t.logprob for c in content for t in c.top_logprobs] == \
        pytest.approx([p for x in ref.logprobs[0] for _, p in x.top], abs=1e-4)
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0,
                                            logprobs=True, stream=True)
    streamed = [c for chunk in stream if chunk.choices and chunk.choices[0].logprobs
                for c in chunk.choices[0].logprobs.content]
    assert [c.logprob for c in streamed] == pytest.approx([c.logprob for c in content], abs=1e-4)
    assert all(c.top_logprobs == [] for c in streamed)
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0)
    assert plain.choices[0].logprobs is None
    for body, match in (({"top_logprobs": 2}, "top_logprobs needs logprobs set to true"),
                        ({"logprobs": 1}, "logprobs must be a boolean"),
                        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs must be an integer in [0, 20]")):
        status, answer = _raw(server, "POST", "/v1/chat/completions", dict(model=MODEL, messages=messages, **body))
        assert status == 400 and match in answer["error"]["message"], answer


def test_echo_scores_the_prompt_as_evaluation_harnesses_ask(lm, client, server):
    """``echo`` with ``logprobs`` and ``max_tokens: 0`` (how evaluation harnesses score a text):
    the prompt comes back with its tokens' log-probabilities under the model, the first null;
    with tokens to generate, the completion follows the prompt, streamed or not."""
    ids = lm.encode(PROMPTS[1])[0]
    cache = lm.model.allocate_cache(1, 64)
    want = [torch.log_softmax(lm.model.step(torch.tensor([t]), cache)[0].float(), -1)[nxt].item()
            for t, nxt in zip(ids, ids[1:])]
    out = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=0, echo=True, logprobs=1,
                                    temperature=0)
    choice = out.choices[0]
    assert choice.text == PROMPTS[1] and choice.finish_reason == "length" and out.usage.completion_tokens == 0
    assert choice.logprobs.tokens == [lm.tokenizer.decode([t]) for t in ids]
    assert choice.logprobs.token_logprobs[0] is None and choice.logprobs.top_logprobs[0] is None
    assert choice.logprobs.token_logprobs[1:] == pytest.approx(want, abs=1e-4)
    assert all(len(top) == 1 for top in choice.logprobs.top_logprobs[1:])

    ref = lm.generate(PROMPTS[1], max_new_tokens=8, temperature=0, logprobs=2)
    out = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=8, echo=True, logprobs=2,
                                    temperature=0)
    lp = out.choices[0].logprobs
    assert out.choices[0].text == PROMPTS[1] + ref.texts[0]
    assert lp.token_logprobs[1: len(ids)] == pytest.approx(want, abs=1e-4)
    assert lp.token_logprobs[len(ids):] == pytest.approx([x.logprob for x in ref.logprobs[0]], abs=1e-4)
    assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(len(lp.tokens))]
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=8, echo=True, logprobs=2,
                                            temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == out.choices[0].text
    streamed = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.token_logprobs]
    assert streamed[0] is None and streamed[1:] == pytest.approx(lp.token_logprobs[1:], abs=1e-4)
    plain = client.completions.create(model=MODEL, prompt=ids, max_tokens=3, echo=True, temperature=0)
    assert plain.choices[0].text.startswith(lm.tokenizer.decode(ids)) and plain.choices[0].logprobs is None
    for body, match in (({"max_tokens": 0}, "max_tokens must be an int >= 1, got 0 (0 only with echo)"),
                        ({"echo": 1}, "echo must be a boolean")):
        status, answer = _raw(server, "POST", "/v1/completions", dict(model=MODEL, prompt="x", **body))
        assert status == 400 and match in answer["error"]["message"], answer


def test_drafter_null_decodes_autoregressively(server, client):
    """``"drafter": null`` is a plain decode (the tree it names is not drafted); left out, the
    default n-gram drafter drafts it."""
    engine = server[1]
    for drafter, drafted in ((None, False), ("ngram", True)):
        before = engine.metrics()["trees"].get(13, 0)
        body = {"tree": "paper13"} if drafter == "ngram" else {"tree": "paper13", "drafter": None}
        client.completions.create(model=MODEL, prompt="def f(x):\n    return x\n" * 4, max_tokens=12, temperature=0,
                                  extra_body=body)  # (repeats: the n-gram drafter finds drafts)
        assert (engine.metrics()["trees"].get(13, 0) > before) == drafted, drafter


@pytest.mark.parametrize("body, status, match", [
    (None, 400, "not valid JSON"),
    ({"model": "gpt-4", "prompt": "x"}, 404, "does not exist"),
    ({"model": MODEL, "prompt": "x", "max_tokens": 0}, 400, "max_tokens must be an int >= 1"),
    ({"model": MODEL, "prompt": "x", "max_tokens": 100000}, 400, "does not fit"),
    ({"model": MODEL, "prompt": "x", "max_tokens": "5"}, 400, "max_tokens must be an integer"),
    ({"model": MODEL, "prompt": 5}, 400, "prompt must be"),
    ({"model": MODEL, "prompt": "x", "temperature": "hot"}, 400, "temperature must be a number"),
    ({"model": MODEL, "prompt": "x", "n": 99}, 400, "n must be at most"),
    ({"model": MODEL, "prompt": "x", "stream": "yes"}, 400, "stream must be a boolean"),
    ({"model": MODEL, "prompt": "x", "drafter": "nope"}, 400, "drafter must be one of"),
    ({"model": MODEL, "prompt": "x", "logit_bias": {}}, 400, "unsupported field"),
    ({"model": MODEL, "prompt": "x", "stream": True, "stream_options": {"include_usage": 1}}, 400, "stream_options"),
    ({"model": MODEL, "prompt": "x", "logprobs": 6}, 400, "logprobs must be an integer in [0, 5]"),
    ({"model": MODEL, "prompt": "x", "logprobs": True}, 400, "logprobs must be an integer"),
])
def test_bad_requests_get_openai_style_errors(server, body, status, match):
    submitted = server[1].metrics()["requests"]
    got, answer = _raw(server, "POST", "/v1/completions", body, raw_body="{not json" if body is None else None)
    assert got == status and match in answer["error"]["message"], answer
    assert set(answer["error"]) == {"message", "type", "param", "code"}
    assert server[1].metrics()["requests"] == submitted  # refused before anything was queued
    assert _raw(server, "GET", "/health")[0] == 200  # still serving


def test_the_api_key_and_the_other_routes(server, client):
    status, answer = _raw(server, "GET", "/v1/models", key=None)
    assert status == 401 and answer["error"]["code"] == "invalid_api_key"
    assert _raw(server, "POST", "/v1/completions", {"model": MODEL, "prompt": "x"}, key="wrong")[0] == 401
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert _raw(server, "GET", "/health", key=None) == (200, {"status": "ok"})
    status, text = _raw(server, "GET", "/metrics")
    assert status == 200
    for name in ("stree_requests_total", "stree_generated_tokens_total", "stree_tokens_per_second", "stree_tau",
                 "stree_queue_length", "stree_free_slots", "stree_tree_nodes_total"):
        assert f"\n{name}" in "\n" + text, name


def test_a_client_leaving_mid_stream_frees_its_slot(server):
    url, engine = server
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    body = json.dumps({"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 400, "temperature": 0, "stream": True,
                       "drafter": None})
    sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {KEY}\r\n"
                 f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n{body}".encode())
    assert b"data: " in sock.recv(4096) or b"data: " in sock.recv(4096)
    busy = engine.free_slots
    sock.close()
    deadline = time.time() + 30
    while engine.free_slots < 8:
        assert time.time() < deadline, f"slots still held: {engine.free_slots} free (while streaming: {busy})"
        time.sleep(0.05)
    assert busy < 8


def test_64_concurrent_clients_are_all_served_as_alone(lm, server):
    """64 clients at once (8 slots, the rest queued): every completion arrives, each equal to its
    prompt's solo run."""
    budgets = [8, 16]
    alone = {(p, m): lm.generate(p, max_new_tokens=m, temperature=0).texts[0] for p in PROMPTS for m in budgets}
    client = openai.OpenAI(base_url=server[0] + "/v1", api_key=KEY, max_retries=0, timeout=300)

    def one(i):
        prompt, budget = PROMPTS[i % len(PROMPTS)], budgets[i // len(PROMPTS) % 2]
        out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=budget, temperature=0,
                                        stream=i % 3 == 0)
        text = "".join(c.choices[0].text for c in out) if i % 3 == 0 else out.choices[0].text
        return text == alone[(prompt, budget)]

    with concurrent.futures.ThreadPoolExecutor(64) as pool:
        results = list(pool.map(one, range(64), timeout=600))
    assert results == [True] * 64
    assert server[1].free_slots == 8


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_stree_serve_drains_its_requests_on_sigterm(lm, capsys):
    """``stree serve`` in its own process: a stream running when SIGTERM comes is finished (every
    token, then [DONE]) and the process exits 0; a bad flag is one line and exit 2."""
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "stree", "serve", "--model", str(TARGET), "--port", str(port),
                             "--max-slots", "2", "--dtype", "float32", "--served-name", MODEL],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.time() + 120
        while True:
            try:
                if _raw((url, None), "GET", "/health", key=None)[0] == 200:
                    break
            except OSError:
                assert time.time() < deadline and proc.poll() is None, proc.stdout.read() if proc.poll() else "slow"
                time.sleep(0.2)
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
        stream = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=300, temperature=0,
                                           stream=True, extra_body={"drafter": None})
        chunks = [next(stream)]
        proc.send_signal(signal.SIGTERM)
        chunks += list(stream)
        assert chunks[-1].choices[0].finish_reason == "length"
        ids = lm.encode("".join(c.choices[0].text for c in chunks))[0]
        assert abs(len(ids) - 300) <= 30  # (re-encoding merges tokens: the count is near, not exact)
        assert proc.wait(60) == 0
    finally:
        proc.kill()
    from stree.tools.cli import main

    assert main(["serve", "--model", str(TARGET), "--port", "70000"]) == 2  # (the CLI's main, in this process)
    assert capsys.readouterr().err.strip().splitlines() == [
        "stree serve: error: --port must be in [1, 65535], got 70000"]
