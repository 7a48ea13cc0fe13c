"""Chat through the tokenizer's template (`LM.chat`, `chat_stream`, `stree chat`): prompt ids
exactly transformers' `apply_chat_template`, a batch of conversations equal to each alone, the
reasoning of `<think>` templates apart from the answer, and clear errors."""

import io
import json
import subprocess
import sys

import pytest

import stree
from stree.patterns.chat import split_reasoning
from stree.tools.demo import TARGET
from stree.decoding.loop import generate
from chat_templates import PLAIN, THINKING, with_template

CHATS = [[{"role": "system", "content": "You write Python."}, {"role": "user", "content": "def fibonacci(n):"}],
         [{"role": "user", "content": "class Stack:"}]]


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    return stree.LM.from_pretrained(with_template(tmp_path_factory.mktemp("c"), PLAIN, "plain"), dtype="float32")


@pytest.fixture(scope="module")
def thinking(tmp_path_factory):
    return stree.LM.from_pretrained(with_template(tmp_path_factory.mktemp("c"), THINKING, "think"), dtype="float32")


def test_chat_prompts_are_the_templates_ids_and_decode_as_generate(plain):
    out = plain.chat(CHATS[0], max_new_tokens=12)
    ids = plain.tokenizer.apply_chat_template(CHATS[0], add_generation_prompt=True)["input_ids"]
    ref = generate(plain.model, [ids], max_new_tokens=12, eos_token_id=plain.eos_token_id)
    assert out.token_ids == ref.new_tokens and out.reasoning == [None]
    assert out.text == plain.tokenizer.decode(ref.new_tokens[0], skip_special_tokens=True)


def test_a_batch_of_conversations_equals_each_alone(plain):
    batch = plain.chat(CHATS, max_new_tokens=16, drafter="stand")
    alone = [plain.chat(c, max_new_tokens=16).texts[0] for c in CHATS]
    assert batch.texts == alone and len(batch.finish_reasons) == 2
    stop = alone[0][3:6]  # a stop string ends a chat's row as a prompt's
    cut = plain.chat(CHATS, max_new_tokens=16, drafter="ngram", stop=[stop])
    assert cut.texts[0] == alone[0][: alone[0].index(stop)] and cut.finish_reasons[0] == "stop"


@pytest.mark.parametrize("text, opened, want", [
    ("plan\n</think>\n\nanswer", True, ("plan", "answer")),
    ("still thinking", True, ("still thinking", "")),
    ("  <think>plan</think>answer", False, ("plan", "answer")),
    ("no block at all", False, (None, "no block at all")),
    ("a </think> b </think> c", True, ("a", "b </think> c")),  # the first close ends the block
])
def test_reasoning_splits_at_the_think_block(text, opened, want):
    assert split_reasoning(text, opened) == want


def test_a_template_that_opens_think_returns_the_reasoning_apart(thinking):
    out = thinking.chat(CHATS, max_new_tokens=10)
    ids = [thinking.tokenizer.apply_chat_template(c, add_generation_prompt=True)["input_ids"] for c in CHATS]
    assert all(thinking.tokenizer.decode(i).endswith("<|assistant|>\n<think>\n") for i in ids)
    raw = generate(thinking.model, ids, max_new_tokens=10, eos_token_id=thinking.eos_token_id)
    texts = [thinking.tokenizer.decode(t, skip_special_tokens=True) for t in raw.new_tokens]
    assert list(zip(out.reasoning, out.texts)) == [split_reasoning(t, True) for t in texts]
    assert out.reasoning[0] is not None


def test_chat_stream_yields_the_text_and_ends_with_the_split_output(thinking):
    stream = thinking.chat_stream(CHATS[1], max_new_tokens=10)
    pieces = list(stream)
    whole = thinking.chat(CHATS[1], max_new_tokens=10)
    assert split_reasoning("".join(pieces), True) == (whole.reasoning[0], whole.texts[0])
    assert stream.output.texts == whole.texts and stream.output.reasoning == whole.reasoning


def test_chat_errors_are_clear(plain):
    lm = stree.LM.from_pretrained(TARGET, dtype="float32")
    with pytest.raises(ValueError, match="has no chat template"):
        lm.chat(CHATS[0])
    with pytest.raises(TypeError, match="messages must be a conversation"):
        plain.chat("hello")
    with pytest.raises(TypeError, match="not a mix"):
        plain.chat([CHATS[0][0], CHATS[1]])
    with pytest.raises(ValueError, match="message 0 of conversation 1 must be a dict with 'role' and 'content'"):
        plain.chat([CHATS[0], [{"role": "user"}]])
    with pytest.raises(ValueError, match="conversation 0 holds no messages"):
        plain.chat([[]])
    with pytest.raises(TypeError, match="chat_stream takes one conversation"):
        plain.chat_stream(CHATS)


@pytest.fixture
def stree_cli(capsys, monkeypatch):
    """``stree ARGS`` with ``stdin``, as the command's ``main`` in this process (its exit status
    and what it wrote; tests/tools/test_cli.py runs the command itself)."""

    def run(*args, stdin=""):
        from stree.tools.cli import main

        capsys.readouterr()
        monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
        code = main(list(args))
        out, err = capsys.readouterr()
        return subprocess.CompletedProcess(args, code, out, err)

    return run


def test_stree_chat_over_a_pipe_keeps_the_conversation_and_resets(plain, stree_cli):
    """One reply line per message; the second reply continues the conversation (the first
    reply in it), and /reset starts again."""
    ckpt = plain.tokenizer.name_or_path
    kw = dict(max_new_tokens=6)
    first = plain.chat([{"role": "user", "content": "def f(x):"}], **kw).texts[0]
    second = plain.chat([{"role": "user", "content": "def f(x):"}, {"role": "assistant", "content": first},
                         {"role": "user", "content": "class A:"}], **kw).texts[0]
    fresh = plain.chat([{"role": "user", "content": "class A:"}], **kw).texts[0]
    assert second != fresh  # (the history changes the reply, so the test sees whether it is kept)
    run = stree_cli("chat", "--model", ckpt, "--max-new-tokens", "6", "--dtype", "float32",
                    stdin="def f(x):\nclass A:\n/reset\nclass A:\n")
    assert run.returncode == 0, run.stderr
    assert run.stdout == "".join(t + "\n" for t in (first, second, fresh))


def test_stree_chat_without_a_template_is_one_error_line(stree_cli):
    run = stree_cli("chat", "--model", str(TARGET), stdin="hello\n")
    assert run.returncode == 2 and run.stderr.count("\n") == 1 and "has no chat template" in run.stderr


def test_stree_generate_chat_takes_prompts_and_conversations(plain, tmp_path, stree_cli):
    lines = tmp_path / "p.jsonl"
    lines.write_text(json.dumps({"prompt": "def f(x):"}) + "\n" + json.dumps({"messages": CHATS[0]}) + "\n")
    run = stree_cli("generate", "--model", plain.tokenizer.name_or_path, "--prompt-file", str(lines), "--chat",
                    "--max-new-tokens", "6", "--json", "--dtype", "float32")
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout)
    want = plain.chat([[{"role": "user", "content": "def f(x):"}], CHATS[0]], max_new_tokens=6)
    assert report["texts"] == want.texts and report["reasoning"] == [None, None]
    bad = stree_cli("generate", "--model", plain.tokenizer.name_or_path, "--prompt-file", str(lines))
    assert bad.returncode == 2 and "not a JSON object with a 'prompt' field" in bad.stderr


def test_text_patterns_prompt_through_the_chat_template(plain):
    """SpecReason and search take a text prompt as the user's message when the tokenizer has a
    template: the same run as handing them the rendered template text without one."""
    import copy

    import torch

    from stree.patterns.chat import prompt_ids
    from stree.tools.demo import DRAFTER
    from stree.models import load
    from stree.patterns.reasoning import spec_reason
    from stree.patterns.search import beam_search

    tok = plain.tokenizer
    message = [{"role": "user", "content": "def f(x):"}]
    rendered = tok.apply_chat_template(message, add_generation_prompt=True, tokenize=False)
    assert prompt_ids(tok, "def f(x):") == tok.apply_chat_template(message, add_generation_prompt=True)["input_ids"]
    bare = copy.deepcopy(tok)
    bare.chat_template = None
    assert prompt_ids(bare, rendered) == prompt_ids(tok, "def f(x):")  # (this tokenizer adds no special tokens)
    small = load(DRAFTER, dtype=torch.float32)
    kw = dict(judge="logprob", max_new_tokens=16, max_step_tokens=8, eos_token_id=[])
    assert spec_reason(plain.model, small, tok, "def f(x):", **kw).token_ids == \
        spec_reason(plain.model, small, bare, rendered, **kw).token_ids
    kw = dict(scorer="logprob", steps=2, max_step_tokens=4, max_new_tokens=8, seed=1)
    assert beam_search(plain.model, "def f(x):", tokenizer=tok, **kw).tokens == \
        beam_search(plain.model, rendered, tokenizer=bare, **kw).tokens
    from stree.patterns.tts import sample_trajectories  # the STAND multi-trajectory pattern

    kw = dict(max_new_tokens=8, batch_size=2, seed=3)
    assert sample_trajectories(plain.model, "def f(x):", 2, tokenizer=tok, **kw).tokens == \
        sample_trajectories(plain.model, prompt_ids(tok, "def f(x):"), 2, **kw).tokens != \
        sample_trajectories(plain.model, bare.encode("def f(x):"), 2, **kw).tokens


def test_the_prompt_judge_asks_in_the_models_chat_format(plain, thinking):
    """With a chat template the judge's question is the user's next turn after the step (the
    reply closed, the next one opened, then the score prefix); without one, the plain template."""
    from stree.patterns.judge import JUDGE_PREFIX, JUDGE_QUESTION, JUDGE_TEMPLATE, Judge

    tok = plain.tokenizer
    want = f"\n<|user|>\n{JUDGE_QUESTION}\n<|assistant|>\n<think>\n{JUDGE_PREFIX}"
    assert Judge("prompt", tok).template == tok.encode(want, add_special_tokens=False)
    # a template that opens <think> itself: not opened twice
    assert Judge("prompt", thinking.tokenizer).template == tok.encode(want, add_special_tokens=False)
    bare = stree.LM.from_pretrained(TARGET, dtype="float32").tokenizer
    assert Judge("prompt", bare).template == bare.encode(JUDGE_TEMPLATE, add_special_tokens=False)
    assert Judge("prompt", tok, template="\nscore: ").template == tok.encode("\nscore: ", add_special_tokens=False)
