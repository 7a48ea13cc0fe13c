"""The text API (`stree.LM`) on the shipped tiny target: texts equal to the token-level loop's,
batches equal to single prompts, EOS from the checkpoint, stop strings that end a row exactly
there, streaming, and the argument checks."""

import json
import shutil

import pytest
import torch

import stree
from stree.tools.demo import TARGET
from stree.drafters import NGramDrafter
from stree.decoding.loop import generate
from stree.lm import LM, checkpoint_eos, generation_defaults
from stree.decoding.stops import held_back
from stree.tree import TreeShape

PROMPTS = ["def fibonacci(n):", "class Stack:\n    def push(self, item):"]


@pytest.fixture(scope="module")
def lm():
    return stree.LM.from_pretrained(TARGET, dtype="float32")


def test_texts_are_the_decoded_tokens_of_generate(lm):
    out = lm.generate(PROMPTS, max_new_tokens=24)
    ids = [lm.tokenizer.encode(p) for p in PROMPTS]
    ref = generate(lm.model, ids, max_new_tokens=24, eos_token_id=lm.eos_token_id)
    assert out.token_ids == ref.new_tokens
    assert out.texts == [lm.tokenizer.decode(t, skip_special_tokens=True) for t in ref.new_tokens]
    assert out.finish_reasons == ["length", "length"]
    fixed = lm.generate(PROMPTS, max_new_tokens=24, tree=TreeShape.paper13())  # drafted every step
    assert fixed.token_ids == out.token_ids and fixed.stats.tau > 1
    assert [lm.generate(p, max_new_tokens=24).text for p in PROMPTS] == out.texts  # a batch = its rows alone
    with pytest.raises(ValueError, match="text is for one prompt; this output holds 2"):
        out.text


@pytest.mark.parametrize("drafter", ["stand", "stand-det", "consensus", "ngram"])
def test_every_named_drafter_gives_the_autoregressive_text(lm, drafter):
    ref = lm.generate(PROMPTS, max_new_tokens=20, method="autoregressive")
    assert lm.generate(PROMPTS, max_new_tokens=20, drafter=drafter).texts == ref.texts


def test_eos_comes_from_the_checkpoint(lm, tmp_path):
    """generation_config.json first, then config.json, then the tokenizer; a row ends at its EOS."""
    free = lm.generate(PROMPTS[0], max_new_tokens=16, eos_token_id=None)
    eos = free.token_ids[0][5]  # a token greedy decoding emits: make it the EOS
    ckpt = tmp_path / "ckpt"
    shutil.copytree(TARGET, ckpt)
    assert checkpoint_eos(ckpt) is None and LM.from_pretrained(ckpt).eos_token_id == lm.tokenizer.eos_token_id
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**config, "eos_token_id": 7}))
    assert checkpoint_eos(ckpt) == [7]
    (ckpt / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos, 7]}))
    ended = LM.from_pretrained(ckpt)
    assert ended.eos_token_id == [eos, 7]
    out = ended.generate(PROMPTS[0], max_new_tokens=16)
    first = free.token_ids[0].index(eos)
    assert out.token_ids == [free.token_ids[0][: first + 1]] and out.finish_reasons == ["eos"]


def test_decoding_defaults_come_from_generation_config_as_transformers_reads_it(lm, tmp_path):
    """do_sample true: its temperature, top_k, top_p and max_new_tokens are the defaults; the
    call's own values win; the output says what was used and what came from the file."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(TARGET, ckpt)
    gen = dict(do_sample=True, temperature=0.7, top_k=5, top_p=0.9, max_new_tokens=6, repetition_penalty=1.1)
    (ckpt / "generation_config.json").write_text(json.dumps(gen))
    assert generation_defaults(ckpt) == dict(temperature=0.7, top_k=5, top_p=0.9, max_new_tokens=6)
    sampled = LM.from_pretrained(ckpt, dtype="float32")
    out = sampled.generate(PROMPTS[0], seed=3)
    assert out.generation == dict(max_new_tokens=6, temperature=0.7, top_k=5, top_p=0.9,
                                  eos_token_id=sampled.eos_token_id,
                                  from_checkpoint=["max_new_tokens", "temperature", "top_k", "top_p"])
    explicit = lm.generate(PROMPTS[0], seed=3, max_new_tokens=6, temperature=0.7, top_k=5, top_p=0.9)
    assert out.token_ids == explicit.token_ids and len(out.token_ids[0]) == 6
    mine = sampled.generate(PROMPTS[0], max_new_tokens=4, temperature=0)
    assert mine.generation["from_checkpoint"] == ["top_k", "top_p"] and mine.generation["temperature"] == 0
    assert mine.token_ids == lm.generate(PROMPTS[0], max_new_tokens=4).token_ids
    assert lm.generate(PROMPTS[0], max_new_tokens=2).generation["from_checkpoint"] == []  # no file: stree's


@pytest.mark.parametrize("config, want", [
    ({}, {}),
    ({"temperature": 0.6}, {"temperature": 0.0}),  # no do_sample: greedy, as transformers decodes
    ({"do_sample": False, "top_k": 20}, {"temperature": 0.0, "top_k": 20}),
    ({"do_sample": True}, {"temperature": 1.0}),
    ({"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": None}, {"temperature": 0.6, "top_p": 0.95}),
])
def test_generation_config_values(tmp_path, config, want):
    (tmp_path / "generation_config.json").write_text(json.dumps(config))
    assert generation_defaults(tmp_path) == want


@pytest.mark.parametrize("text, match", [("[1]", "must hold a JSON object"), ("{", "not valid JSON"),
                                         ('{"do_sample": "yes"}', "do_sample must be true or false"),
                                         ('{"max_new_tokens": 1.5}', "max_new_tokens must be a number")])
def test_a_malformed_generation_config_is_named(tmp_path, text, match):
    (tmp_path / "generation_config.json").write_text(text)
    with pytest.raises(ValueError, match=match) as err:
        generation_defaults(tmp_path)
    assert "generation_config.json" in str(err.value)


def test_a_stop_string_ends_its_row_exactly_there(lm):
    free = lm.generate(PROMPTS, max_new_tokens=40)
    stop = "\n\n"
    assert stop in free.texts[0]
    out = lm.generate(PROMPTS, max_new_tokens=40, stop=[stop, "never seen"])
    ids = out.token_ids[0]
    assert out.texts[0] == free.texts[0][: free.texts[0].index(stop)]
    assert out.finish_reasons[0] == "stop"
    # the fewest tokens whose text holds the stop string: the accepted drafts past it are dropped
    assert ids == free.token_ids[0][: len(ids)]
    assert stop in lm.tokenizer.decode(ids) and stop not in lm.tokenizer.decode(ids[:-1])
    other = lm.generate(PROMPTS[1], max_new_tokens=40, stop=[stop, "never seen"])
    assert (out.texts[1], out.token_ids[1], out.finish_reasons[1]) == (other.text, other.token_ids[0],
                                                                        other.finish_reasons[0])


def test_a_stop_string_in_the_last_tokens_of_a_finished_row_still_cuts(lm):
    free = lm.generate(PROMPTS[0], max_new_tokens=40)
    # the shortest suffix found nowhere earlier: completed by the very last token, when the length limit ends the row
    k = next(k for k in range(3, len(free.text)) if free.text.find(free.text[-k:]) == len(free.text) - k)
    out = lm.generate(PROMPTS[0], max_new_tokens=40, stop=free.text[-k:])
    assert out.text == free.text[:-k] and out.finish_reasons == ["stop"]


def test_stream_yields_the_text_piece_by_piece(lm):
    for stop in (None, "\n\n"):
        stream = lm.stream(PROMPTS[0], max_new_tokens=40, stop=stop)
        pieces = list(stream)
        assert len(pieces) > 3 and "".join(pieces) == stream.output.text
        assert stream.output.text == lm.generate(PROMPTS[0], max_new_tokens=40, stop=stop).text


def test_held_back_text_is_what_could_begin_a_stop_string():
    assert held_back("abc\n", ["\n\n"]) == 1
    assert held_back("abcab", ["abcabd"]) == 5
    assert held_back("x\ufffd", []) == 1
    assert held_back("abc", ["\n\n", "zz"]) == 0


def test_bad_arguments_are_named(lm):
    with pytest.raises(TypeError, match="prompts must be a string or a non-empty list of strings"):
        lm.generate([], max_new_tokens=4)
    with pytest.raises(ValueError, match=r"prompt 1 \(''\) encodes to no tokens"):
        lm.generate(["x", ""], max_new_tokens=4)
    with pytest.raises(TypeError, match="stop must be a non-empty string or a list of them"):
        lm.generate("x", max_new_tokens=4, stop=[""])
    with pytest.raises(ValueError, match="drafter must be one of"):
        lm.generate("x", max_new_tokens=4, drafter="medusa")
    with pytest.raises(ValueError, match=r"drafter 'ssm-static' needs a drafter model"):
        lm.generate("x", max_new_tokens=4, drafter="ssm")
    with pytest.raises(TypeError, match="stream takes one prompt string"):
        lm.stream(PROMPTS)
    with pytest.raises(ValueError, match="dtype must be a torch dtype or one of"):
        LM.from_pretrained(TARGET, dtype="fp8")


def test_a_drafter_model_and_a_drafter_object(lm):
    from stree.tools.demo import DRAFTER

    with_ssm = LM.from_pretrained(TARGET, dtype=torch.float32, drafter_model=DRAFTER)
    ref = lm.generate(PROMPTS, max_new_tokens=16, method="autoregressive").texts
    assert with_ssm.generate(PROMPTS, max_new_tokens=16, drafter="ssm").texts == ref
    assert lm.generate(PROMPTS, max_new_tokens=16, drafter=NGramDrafter(max_n=2)).texts == ref


def test_a_drafter_model_runs_in_float32_on_the_cpu_and_in_the_targets_dtype_on_a_gpu(monkeypatch):
    """The shipped float16 pair by default: the target in its checkpoint's dtype, the drafter model
    in float32 on the CPU (its one-call greedy draft: drafted block by block in float16, chains cost more
    than they brought), the text plain decoding's, greedy and with a fixed chain; on a GPU the
    target's dtype (the load's arguments, no GPU needed)."""
    import stree.checkpoints.io as io
    from stree.lm import load_drafter_model
    from stree.tools.demo import DRAFTER

    half = LM.from_pretrained(TARGET, drafter_model=DRAFTER)
    assert half.model.dtype == torch.float16 and half.drafter_model.dtype == torch.float32
    ref = half.generate(PROMPTS, max_new_tokens=16, method="autoregressive").texts
    assert half.generate(PROMPTS, max_new_tokens=16, drafter="ssm").texts == ref
    assert half.generate(PROMPTS, max_new_tokens=16, drafter="ssm", tree=TreeShape.chain(3)).texts == ref
    asked = []
    monkeypatch.setattr(io, "load", lambda path, **kw: asked.append((path, kw)))
    load_drafter_model("small", torch.device("cuda", 1), torch.bfloat16)
    assert asked == [("small", dict(dtype=torch.bfloat16, device=torch.device("cuda", 1)))]


def test_a_checkpoint_without_a_tokenizer_takes_one_by_argument(tmp_path):
    """tokenizer=DIR for a checkpoint directory that holds none (the API twin of --tokenizer)."""
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(TARGET / name, bare / name)
    with pytest.raises(FileNotFoundError, match="holds no tokenizer"):
        LM.from_pretrained(bare)
    lm = LM.from_pretrained(bare, tokenizer=TARGET, dtype=torch.float32)
    assert lm.generate(PROMPTS[0], max_new_tokens=8).text == LM.from_pretrained(TARGET, dtype=torch.float32).generate(
        PROMPTS[0], max_new_tokens=8).text


def test_decoding_builds_no_autograd_graph(lm):
    """The text API drives the decode generator from code that has no torch.no_grad around it: every
    step (the drafter's calls included) must still run without autograd, or tensors handed to the
    drafter require grad (on CUDA the graph-captured step's outputs did: STAND's observe failed)."""
    seen = []

    class Spy(NGramDrafter):
        target_top_k = 4  # asks for the target's distributions, as STAND does

        def propose(self, context, shape):
            seen.append(torch.is_grad_enabled())
            return super().propose(context, shape)

        def observe(self, context, tokens, target):
            seen.append(torch.is_grad_enabled() or any(t.probs.requires_grad for t in target))
            return super().observe(context, tokens, target)

    assert torch.is_grad_enabled()
    lm.generate(PROMPTS, max_new_tokens=12, drafter=Spy(), tree=TreeShape.paper13())
    list(lm.stream(PROMPTS[0], max_new_tokens=6, drafter=Spy(), tree=TreeShape.paper13()))
    assert seen and not any(seen)
    assert torch.is_grad_enabled()  # and the mode ends with the call


@pytest.mark.parametrize("gpus", [0, 1, 2])
def test_each_rank_loads_on_its_own_gpu_or_all_on_the_cpu(monkeypatch, gpus):
    """rank_device under torchrun (LOCAL_WORLD_SIZE ranks on this machine): by default every rank
    its own GPU when there is one a rank, else every rank on the CPU (a rank without a GPU used to
    die on an invalid device ordinal); an explicit "cuda" with too few GPUs fails on every rank."""
    from stree.lm import rank_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert rank_device(None, 2) == (torch.device("cuda", 1) if gpus == 2 else torch.device("cpu"))
    assert rank_device(None, None) == (torch.device("cuda", 0) if gpus else torch.device("cpu"))  # one process
    assert rank_device("cpu", 2) == torch.device("cpu")
    if gpus == 1:
        with pytest.raises(ValueError, match="device cuda for 2 ranks on this machine, which has 1 GPUs"):
            rank_device("cuda", 2)
    if gpus == 2:
        assert rank_device("cuda", 2) == torch.device("cuda", 1)


def test_a_calls_stand_store_is_sized_to_the_call(lm, monkeypatch):
    """A STAND drafter made for one call gets a store with room for what the call can teach it
    (4 n-grams a token, a power of two >= 1024) instead of 2^20 entries (~150 MB) allocated anew
    for every call; a long-lived one (no token count) keeps the default."""
    from stree.drafters import registry
    from stree.drafters.registry import stand_capacity

    assert [stand_capacity(t) for t in (1, 256, 257, 300_000, 10**9)] == [1024, 1024, 2048, 1 << 20, 1 << 20]
    assert lm.drafter("stand", 1.0, tokens=600).store.capacity == 4096
    assert lm.drafter("stand-det").store.capacity == 1 << 20
    made = []
    real = registry.STANDStore
    monkeypatch.setattr(registry, "STANDStore", lambda **kw: made.append(kw) or real(**kw))
    out = lm.generate(PROMPTS, max_new_tokens=20, drafter="stand", temperature=1.0, seed=0)
    assert made == [dict(capacity=1024)] and len(out.token_ids) == 2  # 2 rows x 21 tokens x 4 n-grams


def test_a_drafter_made_by_name_serves_its_call_alone(lm, monkeypatch):
    """The drafter generate makes from a name is marked as serving that call alone
    (``Drafter.serves_one_call``: the loop does not teach it the call's last run of plain steps);
    a drafter object the caller passes, which may serve later calls, is not."""
    import stree.lm as lm_module

    given, real = [], lm_module.decode
    monkeypatch.setattr(lm_module, "decode", lambda *a, **kw: given.append(kw["drafter"]) or real(*a, **kw))
    own = NGramDrafter(max_n=2)
    ref = lm.generate(PROMPTS, max_new_tokens=12, method="autoregressive").texts
    assert lm.generate(PROMPTS, max_new_tokens=12, drafter="stand").texts == ref
    assert lm.generate(PROMPTS, max_new_tokens=12, drafter=own).texts == ref
    assert given[1].serves_one_call and given[2] is own and not own.serves_one_call


def test_a_row_ended_by_a_token_stop_sequence_finished_for_stop(lm):
    """finish_reasons come from one place (stree.decoding.stops.finish_reasons), which knows the token
    stop sequences too: the text API reported "length" for a row they had ended."""
    free = lm.generate(PROMPTS[0], max_new_tokens=12, eos_token_id=None)
    seq = free.token_ids[0][4:6]
    first = next(i for i in range(len(free.token_ids[0]) - 1) if free.token_ids[0][i: i + 2] == seq)
    for out in (lm.generate(PROMPTS[0], max_new_tokens=12, eos_token_id=None, stop_sequences=[seq]),
                lm.stream(PROMPTS[0], max_new_tokens=12, eos_token_id=None, stop_sequences=[seq])):
        if not hasattr(out, "finish_reasons"):
            list(out)
            out = out.output
        assert out.token_ids == [free.token_ids[0][: first + 2]] and out.finish_reasons == ["stop"]
