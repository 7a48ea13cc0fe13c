"""The ``stree`` command line."""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

from ..drafters import STANDDrafter, STANDStore
from ..drafters.registry import DRAFTER_ALIASES, DRAFTER_NAMES, NEEDS_MODEL, drafter_name
from ..decoding.loop import METHODS
from ..checkpoints.hub import resolve
from ..checkpoints.io import DTYPES
from ..tree import tree_spec



MODEL_HELP = "a checkpoint directory or Hub id (org/name: from the Hub cache, else downloaded)"


def _add_drafter(p, extra: str | None = None) -> None:
    """``--drafter``: a registry name, or an alias of one (``ssm``), given to the code as the name."""
    aliases = ", ".join(f"{a} = {n}" for a, n in DRAFTER_ALIASES.items())
    p.add_argument("--drafter", type=drafter_name, choices=DRAFTER_NAMES, default="ngram",
                   help=f"({aliases})" + ("" if extra is None else f"; {extra}"))


def _add_revision(p) -> None:
    p.add_argument("--revision", default=None, help="the branch, tag or commit of a Hub id --model (default: main)")


def _add_model(p) -> None:
    """``--model``, its ``--revision`` and ``--tokenizer``."""
    p.add_argument("--model", required=True, help=MODEL_HELP)
    _add_revision(p)
    p.add_argument("--tokenizer", default=None, help="tokenizer directory or Hub id (default: --model)")


def _add_decoding(p) -> None:
    """The sampling flags (their defaults the checkpoint's), seed, dtype and device."""
    defaults = "default: the checkpoint's generation_config.json, else "
    p.add_argument("--temperature", type=float, default=None, help=defaults + "0 (greedy)")
    p.add_argument("--top-k", type=int, default=None, help=defaults + "0 (off)")
    p.add_argument("--top-p", type=float, default=None, help=defaults + "1.0 (off)")
    p.add_argument("--max-new-tokens", type=int, default=None, help=defaults + "128")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default: the checkpoint's")
    p.add_argument("--device", default=None, help="default: cuda when available, else cpu")


def _generate_parser(sub) -> None:
    p = sub.add_parser("generate", help="complete prompts with speculative tree decoding",
                       description="Under torchrun --nproc-per-node N, the model is split over the N ranks "
                                   "(tensor parallelism: NCCL on CUDA, gloo on the CPU) and rank 0 prints.")
    p.add_argument("--model", required=True, help=MODEL_HELP + " (mamba_ssm, transformers Mamba2, Bamba, Nemotron-H, "
                                                              "Granite 4.0-H, Falcon-H1, Llama, Qwen2, MambaInLlama)")
    _add_revision(p)
    p.add_argument("--tokenizer", default=None, help="tokenizer directory or Hub id, for a checkpoint without one "
                                                     "(default: --model)")
    p.add_argument("--prompt", default=None, help="one prompt (default: --prompt-file, else stdin)")
    p.add_argument("--prompt-file", default=None, help="prompts decoded as one batch: one per line, or JSONL (a .jsonl "
                                                       "file) with a 'prompt' field per line; stdin when neither "
                                                       "option is given (JSONL when its first line is a JSON object)")
    p.add_argument("--stop", action="append", default=None, help="a string that ends a row (repeatable)")
    p.add_argument("--num-samples", type=int, default=1, help="decode every prompt this many times in the one batch "
                                                              "(sampled trajectories that draft from each other with "
                                                              "--drafter consensus or stand)")
    p.add_argument("--json", action="store_true", help="print one JSON object: texts, finish reasons, token ids, stats")
    p.add_argument("--logprobs", type=int, default=None, metavar="K",
                   help="with --json: each generated token's log-probability and the K most likely entries of the "
                        "law it was drawn from")
    p.add_argument("--chat", action="store_true", help="each prompt is a user message through the model's chat "
                                                       "template (JSONL lines may hold a conversation under "
                                                       "'messages'); a <think> block is reported apart")
    p.add_argument("--system", default=None, help="with --chat: a system message before each prompt")
    p.add_argument("--method", choices=METHODS, default="stree")
    _add_drafter(p, "consensus drafts from the batch's own earlier text; ssm / ssm-beam need "
                    "--drafter-model")
    p.add_argument("--drafter-model", default=None, help="checkpoint directory or Hub id of a small drafter LM "
                                                         "(stree distill)")
    p.add_argument("--tree", default="auto", help="auto (default: each step's tree, or a plain step, chosen from "
                   "this machine's measured costs and the acceptance so far) | paper13 | chain:D | full:WxD | "
                   "PATH.json | dynamic:N[xD] (a tree of N nodes, at most D deep, grown each step by the stand, "
                   "stand-det or ssm drafter)")
    _add_decoding(p)
    p.add_argument("--compare", action="store_true", help="also decode autoregressively; print the speedup and "
                                                             "whether greedy outputs are identical")
    p.add_argument("--compile", action="store_true", help="CPU: torch.compile the step and tree pass (and "
                                                          "the drafter model's steps): seconds of compiling, then "
                                                          "faster decoding")


def _optimize_parser(sub) -> None:
    p = sub.add_parser("optimize-tree", help="calibrate a static STAND tree on prompts (STAND appendix A)")
    p.add_argument("--model", required=True, help=MODEL_HELP)
    _add_revision(p)
    p.add_argument("--tokenizer", default=None, help="tokenizer directory or Hub id (default: --model)")
    p.add_argument("--prompts", required=True, help="a text file, one prompt per line (.jsonl: a 'prompt' field per line)")
    p.add_argument("--out", required=True, help="where to write the tree JSON (for --tree PATH.json)")
    p.add_argument("--nodes", type=int, default=80, help="draft nodes kept besides the root")
    p.add_argument("--temperature", type=float, default=0.6)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None)
    p.add_argument("--device", default=None)


def _profile_parser(sub) -> None:
    p = sub.add_parser("profile", help="measure what decoding costs on this machine: a plain step and a speculative "
                                       "iteration (drafting included) per tree size; the table tree=auto decides by")
    p.add_argument("--model", required=True, help=MODEL_HELP)
    _add_revision(p)
    _add_drafter(p)
    p.add_argument("--drafter-model", default=None, help="checkpoint directory or Hub id of a small drafter LM "
                                                         "(ssm-static)")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--compile", action="store_true", help="CPU: the compiled decode path (compiles each size)")
    p.add_argument("--refresh", action="store_true", help="measure again whatever is cached")
    p.add_argument("--png", default="stree_profile.png", help="where to write the plot of cost against nodes")
    p.add_argument("--json", action="store_true", help="print the table as JSON")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None)
    p.add_argument("--device", default=None, help="default: cuda when available, else cpu")


def _run_profile(args) -> int:
    import json

    from ..decoding.autotree import auto_tree
    from ..decoding.cost import cache_file, describe, model_step_ms
    from ..decoding.cost import device_name as name_of
    from ..drafters.registry import make_drafter
    from ..lm import load_drafter_model, rank_device
    from ..runtime import CompiledModel
    from ..checkpoints.io import load

    if (args.drafter_model is None) == (args.drafter in NEEDS_MODEL):
        raise ValueError(f"--drafter {args.drafter} {'needs' if args.drafter in NEEDS_MODEL else 'takes no'} "
                         "--drafter-model")
    if isinstance(args.batch_size, bool) or args.batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1, got {args.batch_size}")
    model = load(args.model, dtype=DTYPES.get(args.dtype), device=rank_device(args.device, None), revision=args.revision)
    small = None
    if args.drafter_model is not None:
        small = load_drafter_model(args.drafter_model, model.device, model.dtype)
        small = CompiledModel(small) if args.compile else small
    drafter = make_drafter(args.drafter, drafter_model=small, vocab_size=model.vocab_size)
    mode = "compiled" if args.compile else "cuda_graph" if model.device.type == "cuda" else "eager"
    profile = auto_tree(model, drafter, args.batch_size, mode=mode, refresh=args.refresh).profile
    rows = describe(profile)
    # a drafter model's own step beside the target's, each timed alone at the batch size; and what a level adds
    # to its drafting, fitted over the measured trees (a level and a node: the depth and node terms), where its
    # greedy drafts may read a cut of the head
    steps = None if small is None else (model_step_ms(small, args.batch_size), model_step_ms(model, args.batch_size))
    level_ms = profile.draft_fit[1] + profile.draft_fit[2] if profile.depths else None
    if args.json:
        print(json.dumps(dict(device=name_of(model.device), mode=mode, batch_size=args.batch_size, rows=rows,
                              catch_up_ms_per_token=profile.catch_ms, drafter_level_ms=level_ms,
                              drafter_step_ms=None if steps is None else steps[0],
                              target_step_ms=None if steps is None else steps[1])))
    else:
        print(f"{name_of(model.device)}, {mode}, batch {args.batch_size}, drafter {args.drafter} "
              f"(cached in {cache_file()})")
        print(f"{'nodes':>6}{'target ms':>11}{'draft ms':>10}{'in steps':>10}")
        for r in rows:
            print(f"{r['nodes']:>6}{r['target_ms']:>11.3f}{r['draft_ms']:>10.3f}{r['steps']:>10.2f}")
        if steps is not None:
            print(f"drafter model: {steps[0]:.3f} ms a step, {steps[0] / steps[1]:.2f} of the target's "
                  f"({steps[1]:.3f} ms; each model's own step, timed alone); its drafting {level_ms:.3f} ms a level "
                  f"(fitted over the trees above)")
        if profile.catch_ms:
            print(f"drafter catch-up: {profile.catch_ms:.4f} ms a token")
    _plot_profile(rows, f"{args.drafter}, batch {args.batch_size}, {mode}, {name_of(model.device)}", args.png)
    return 0


def _plot_profile(rows: list[dict], title: str, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    nodes = [r["nodes"] for r in rows]
    ax.plot(nodes, [r["steps"] for r in rows], "o-", label="iteration, drafting included")
    ax.plot(nodes, [r["target_ms"] / rows[0]["target_ms"] for r in rows], "s--", label="target's part")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set(xscale="log", xlabel="tree nodes (1: a plain step)", ylabel="cost in autoregressive steps", title=title)
    ax.title.set_fontsize(8)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _chat_parser(sub) -> None:
    p = sub.add_parser("chat", help="talk to a model through its chat template (interactive, or one message a line "
                                    "over a pipe)",
                       description="Each line read is a user message; the reply streams as its tokens are accepted "
                                   "and the conversation is kept. /reset starts it again (the --system message "
                                   "stays), /exit or Ctrl-D leaves, Ctrl-C stops a reply.")
    _add_model(p)
    p.add_argument("--system", default=None, help="a system message opening the conversation")
    _add_drafter(p)
    p.add_argument("--drafter-model", default=None, help="checkpoint directory or Hub id of a small drafter LM")
    _add_decoding(p)


def _run_chat(args) -> int:
    from ..patterns.chat import chat_prompts
    from ..lm import LM, load_drafter_model

    if (args.drafter_model is None) == (args.drafter in NEEDS_MODEL):
        raise ValueError(f"--drafter {args.drafter} {'needs' if args.drafter in NEEDS_MODEL else 'takes no'} "
                         "--drafter-model")
    lm = LM.from_pretrained(args.model, device=args.device, dtype=args.dtype, tokenizer=args.tokenizer,
                            revision=args.revision)
    if args.drafter_model is not None:
        lm.drafter_model = load_drafter_model(args.drafter_model, lm.model.device, lm.model.dtype)
    opening = [{"role": "system", "content": args.system}] if args.system else []
    chat_prompts(lm.tokenizer, [opening + [{"role": "user", "content": "-"}]])  # no template: stop before reading
    kw = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
              seed=args.seed, drafter=args.drafter)
    tty = sys.stdin.isatty()
    history = list(opening)
    while True:
        if tty:
            sys.stdout.write("> ")
            sys.stdout.flush()
        line = sys.stdin.readline()
        if not line:  # Ctrl-D, or the pipe's end
            if tty:
                sys.stdout.write("\n")
            return 0
        message = line.rstrip("\n")
        if message.strip() in ("/exit", "/quit"):
            return 0
        if message.strip() == "/reset":
            history = list(opening)
            if tty:
                print("(a new conversation)")
            continue
        if not message.strip():
            continue
        stream = lm.chat_stream(history + [{"role": "user", "content": message}], **kw)
        try:
            for piece in stream:
                sys.stdout.write(piece)
                sys.stdout.flush()
        except KeyboardInterrupt:  # the reply stops; the conversation goes on without it
            print("\n(stopped)")
            continue
        print()
        history += [{"role": "user", "content": message}, {"role": "assistant", "content": stream.output.texts[0]}]


def _serve_parser(sub) -> None:
    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server: continuous batching over state slots, "
                                     "every request decoded speculatively",
                       description="/v1/completions, /v1/chat/completions (streaming by server-sent events), "
                                   "/v1/models, /health, /metrics. stree's own request fields: drafter, tree, top_k. "
                                   "SIGINT or SIGTERM: the requests in flight finish, then the server exits.")
    _add_model(p)
    p.add_argument("--drafter-model", default=None, help="checkpoint directory or Hub id of a small drafter LM (for "
                                                         "requests with drafter ssm)")
    p.add_argument("--served-name", default=None, help="the model name clients send (default: --model)")
    p.add_argument("--host", default="127.0.0.1", help="the address to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help="requests must carry 'Authorization: Bearer KEY'")
    p.add_argument("--max-slots", type=int, default=None, help="requests decoded at once (default: sized from memory)")
    p.add_argument("--max-length", type=int, default=2048, help="tokens a slot holds (prompt and completion)")
    p.add_argument("--max-queue", type=int, default=256, help="requests that may wait for a slot; beyond, 429")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default: the checkpoint's")
    p.add_argument("--device", default=None, help="default: cuda when available, else cpu")


def _run_serve(args) -> int:
    from ..lm import LM
    from ..serving.server import serve

    if not 0 < args.port < 65536:
        raise ValueError(f"--port must be in [1, 65535], got {args.port}")
    lm = LM.from_pretrained(args.model, device=args.device, dtype=args.dtype, tokenizer=args.tokenizer,
                            drafter_model=args.drafter_model, revision=args.revision)
    serve(lm, args.served_name or args.model, host=args.host, port=args.port, api_key=args.api_key,
          max_slots=args.max_slots, max_length=args.max_length, max_queue=args.max_queue)
    return 0


def _reason_parser(sub) -> None:
    p = sub.add_parser("reason", help="SpecReason: a small model writes reasoning steps, the model judges them "
                                      "and rewrites the rejected ones (paper 002)")
    p.add_argument("--model", required=True, help="the base model: " + MODEL_HELP)
    _add_revision(p)
    p.add_argument("--small-model", required=True, help="the small model's checkpoint directory or Hub id (same "
                                                        "vocabulary)")
    p.add_argument("--tokenizer", default=None, help="tokenizer directory (default: --model)")
    p.add_argument("--prompt", required=True)
    p.add_argument("--judge", choices=("prompt", "logprob"), default="prompt",
                   help="prompt: the model scores the step 0-9; logprob: its mean log-probability (nats)")
    p.add_argument("--score", choices=("greedy", "expected"), default="greedy", help="how the prompt judge's digit is read")
    p.add_argument("--threshold", type=float, default=None, help="keep a step scoring at least this (default: 7 for "
                                                                  "the prompt judge, -1.5 for logprob)")
    p.add_argument("--step-delimiter", default="\\n\\n", help="the text ending a step (backslash escapes read)")
    p.add_argument("--max-step-tokens", type=int, default=128)
    p.add_argument("--max-new-tokens", type=int, default=512)
    p.add_argument("--token-spec", choices=("stand", "stand-det", "ngram", "small", "off"), default="stand",
                   help="how the model writes rejected steps: STree with this drafter, or off (autoregressive)")
    p.add_argument("--base-steps", type=int, default=0, help="the first steps are the model's own, unjudged")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None)
    p.add_argument("--device", default=None)
    p.add_argument("--json", action="store_true", help="print one JSON object: text, steps, stats")


def _run_reason(args) -> int:
    import codecs
    import json
    from dataclasses import asdict

    from ..lm import LM
    from ..checkpoints.io import load
    from ..patterns.reasoning import spec_reason

    delimiter = codecs.decode(args.step_delimiter, "unicode_escape")
    lm = LM.from_pretrained(args.model, device=args.device, dtype=args.dtype, tokenizer=args.tokenizer,
                            revision=args.revision)
    small = load(args.small_model, dtype=lm.model.dtype, device=lm.model.device)
    out = spec_reason(lm.model, small, lm.tokenizer, args.prompt, judge=args.judge, threshold=args.threshold,
                      score=args.score, step_delimiter=delimiter, max_step_tokens=args.max_step_tokens,
                      max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                      token_spec=False if args.token_spec == "off" else args.token_spec, seed=args.seed,
                      eos_token_id=lm.eos_token_id, base_steps=args.base_steps)
    st = out.stats
    if args.json:
        print(json.dumps(dict(text=out.text, token_ids=out.token_ids, steps=[asdict(s) for s in out.steps],
                              stats=dict(asdict(st), share_accepted=st.share_accepted))))
        return 0
    print(args.prompt + out.text)
    print(f"[reason] steps {st.steps} | small's kept {st.accepted}/{st.judged} ({st.share_accepted:.0%}) | tokens: "
          f"small {st.small_tokens}, model {st.base_tokens} in {st.base_forwards} forwards | judge forwards "
          f"{st.judge_forwards} | time small {st.time_small:.2f}s judge {st.time_judge:.2f}s model {st.time_base:.2f}s "
          f"sync {st.time_sync:.2f}s total {st.time_total:.2f}s")
    return 0


def _loop_args(p, steps: int, batch_size: int, seq_len: int, lr: float) -> None:
    p.add_argument("--out", required=True, help="checkpoint directory to write")
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--batch-size", type=int, default=batch_size)
    p.add_argument("--seq-len", type=int, default=seq_len)
    p.add_argument("--lr", type=float, default=lr)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save-every", type=int, default=100, help="steps between resumable states (out/train_state.pt)")
    p.add_argument("--resume", action="store_true", help="continue from out/train_state.pt (--steps may grow)")
    p.add_argument("--overwrite", action="store_true", help="replace the checkpoint or training state in --out")
    p.add_argument("--corpus", default=None, help="a directory (its --corpus-glob files), a .jsonl file (a 'text' per "
                                                  "line: e.g. the target's own generations) or a text file (documents "
                                                  "cut at <|endoftext|>); default: this Python's standard library")
    p.add_argument("--corpus-glob", default="*.py", help="which files of a directory corpus (default *.py)")
    p.add_argument("--held-out", default=None, help="comma-separated paths relative to a directory corpus "
                                                    "(default: a fixed list of stdlib modules; a file corpus holds "
                                                    "out its last 5%% of documents)")
    p.add_argument("--eval-tokens", type=int, default=40_000, help="held-out tokens evaluated at the end")
    p.add_argument("--save-dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--device", default="cpu")


def _train_lm_parser(sub) -> None:
    p = sub.add_parser("train-lm", help="train a small Mamba2 (or hybrid) LM on local Python sources")
    _loop_args(p, steps=600, batch_size=16, seq_len=128, lr=3e-3)
    p.add_argument("--arch", choices=("mamba2", "hybrid"), default="mamba2")
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--tokenizer-bytes", type=int, default=4_000_000, help="training text the BPE is learnt from")
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--d-state", type=int, default=32)
    p.add_argument("--headdim", type=int, default=64)


def _distill_parser(sub) -> None:
    p = sub.add_parser("distill", help="distil a 1-2 layer Mamba2 drafter from a target checkpoint")
    p.add_argument("--target", required=True, help="the target's checkpoint directory or Hub id (with its tokenizer)")
    _loop_args(p, steps=300, batch_size=16, seq_len=128, lr=3e-3)
    p.add_argument("--n-layer", type=int, default=1)


def _run_distill(args) -> int:
    from ..training import distill

    report = distill(resolve(args.target), args.out, n_layer=args.n_layer, corpus=args.corpus, held_out=_held_out(args),
                     corpus_glob=args.corpus_glob,
                     loop=_loop_config(args), eval_tokens=args.eval_tokens, save_dtype=args.save_dtype,
                     resume=args.resume, overwrite=args.overwrite, device=args.device)
    init = report["at_init"]
    print(f"held-out KL {init['held_out_kl_nats']:.3f} -> {report['held_out_kl_nats']:.3f} nats/token, top-1 agreement "
          f"{init['held_out_top1_agreement']:.3f} -> {report['held_out_top1_agreement']:.3f}; {report['seconds']} s "
          f"-> {args.out}")
    return 0


def _loop_config(args):
    from ..training import LoopConfig

    return LoopConfig(steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr,
                      warmup=args.warmup, seed=args.seed, save_every=args.save_every)


def _held_out(args):
    return None if args.held_out is None else tuple(s.strip() for s in args.held_out.split(",") if s.strip())


def _run_train_lm(args) -> int:
    from ..training import ModelSize, train_lm

    report = train_lm(args.out, corpus=args.corpus, held_out=_held_out(args), corpus_glob=args.corpus_glob,
                      arch=args.arch,
                      vocab_size=args.vocab_size, loop=_loop_config(args), tokenizer_bytes=args.tokenizer_bytes,
                      size=ModelSize(args.d_model, args.n_layer, args.d_state, args.headdim),
                      eval_tokens=args.eval_tokens, save_dtype=args.save_dtype, resume=args.resume,
                      overwrite=args.overwrite, device=args.device)
    print(f"held-out bits/byte: model {report['model_bits_per_byte']:.3f}, unigram "
          f"{report['unigram_bits_per_byte']:.3f} ({report['held_out_bytes']} bytes); {report['seconds']} s -> {args.out}")
    return 0


def _load(args):
    from ..lm import rank_device
    from ..checkpoints.io import load
    from ..checkpoints.tokenizer import load_tokenizer

    path = resolve(args.model, args.revision)
    model = load(path, dtype=DTYPES.get(args.dtype), device=rank_device(args.device, None))
    return model, load_tokenizer(args.tokenizer or path, vocab_size=model.vocab_size)


def _parse_prompts(text: str, jsonl: bool, where: str, chat: bool = False) -> list:
    """Prompt strings, one per line or one per JSONL object's 'prompt'; with ``chat``, a JSONL
    object may carry a conversation under 'messages' instead."""
    import json

    lines = [line for line in text.splitlines() if line.strip()]
    if not jsonl:
        prompts = lines
    else:
        prompts = []
        field = "'prompt' (or, with --chat, 'messages')" if chat else "'prompt'"
        for n, line in enumerate(lines, 1):
            try:
                obj = json.loads(line)
                prompt = obj["messages"] if chat and "messages" in obj else obj["prompt"]
            except (ValueError, TypeError, KeyError):
                raise ValueError(f"{where} line {n}: not a JSON object with a {field} field") from None
            if not isinstance(prompt, (str, list)) or (isinstance(prompt, list) and not chat):
                raise ValueError(f"{where} line {n}: 'prompt' must be a string, got {type(prompt).__name__}")
            prompts.append(prompt)
    if not prompts:
        raise ValueError(f"{where} holds no prompts")
    return prompts


def _read_prompts(path: str, option: str = "--prompts", chat: bool = False) -> list:
    from pathlib import Path

    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"{option} {path}: no such file")
    return _parse_prompts(file.read_text(), path.endswith(".jsonl"), f"{option} {path}", chat)


def _generate_prompts(args) -> list:
    """--prompt, --prompt-file or stdin (with --chat, JSONL lines may hold 'messages')."""
    if args.prompt is not None and args.prompt_file is not None:
        raise ValueError("give --prompt or --prompt-file, not both")
    if args.prompt is not None:
        return [args.prompt]
    if args.prompt_file is not None:
        return _read_prompts(args.prompt_file, "--prompt-file", args.chat)
    if sys.stdin is None or sys.stdin.isatty():
        raise ValueError("no prompt: give --prompt, --prompt-file, or prompts on stdin")
    text = sys.stdin.read()
    return _parse_prompts(text, text.lstrip().startswith("{"), "stdin", args.chat)


def _conversation(prompt, system: str | None) -> list:
    """A prompt of ``stree generate --chat`` as a conversation: a user message (after the
    ``--system`` one), or the conversation a JSONL line gave."""
    if isinstance(prompt, list):
        return prompt
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]


def _run_optimize(args) -> int:
    from .optimize_tree import optimize_static_tree

    model, tokenizer = _load(args)
    prompts = [tokenizer.encode(p, add_special_tokens=False) for p in _read_prompts(args.prompts)]
    if any(not p for p in prompts):
        raise ValueError(f"--prompts {args.prompts}: a prompt encodes to no tokens")
    shape, counts = optimize_static_tree(model, prompts, STANDDrafter(STANDStore()), nodes=args.nodes,
                                         temperature=args.temperature, max_new_tokens=args.max_new_tokens,
                                         seed=args.seed, progress=True)
    shape.save(args.out)
    steps = int(counts[0])
    print(f"{len(prompts)} prompts, {steps} verify steps, tau {float(counts.sum()) / max(steps, 1):.2f} on the initial "
          f"tree; kept {shape.n - 1} nodes (depth {shape.max_depth}) -> {args.out}")
    return 0


def _stats(stats) -> dict:
    from dataclasses import asdict

    return dict(asdict(stats), tau=stats.tau, tokens_per_s=stats.tokens_per_s)


def _launched_world() -> int | None:
    """The number of ranks of a ``torchrun`` launch of more than one process (None otherwise):
    ``stree generate`` then splits the model over them (tensor parallelism)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return world if world > 1 else None


def _checked_generate_inputs(args) -> list[str]:
    """The prompts (each ``--num-samples`` times), after the checks that need no model."""
    prompts = _generate_prompts(args)
    if isinstance(args.num_samples, bool) or args.num_samples < 1:
        raise ValueError(f"--num-samples must be >= 1, got {args.num_samples}")
    if args.drafter_model is not None and args.drafter not in NEEDS_MODEL:
        raise ValueError(f"--drafter-model is only for --drafter {' / '.join(NEEDS_MODEL)}, not {args.drafter}")
    if args.drafter in NEEDS_MODEL and args.drafter_model is None:
        raise ValueError(f"--drafter {args.drafter} needs --drafter-model DIR")
    if args.logprobs is not None and (not args.json or args.logprobs < 0):
        raise ValueError(f"--logprobs takes K >= 0 and goes with --json, got {args.logprobs}"
                         + ("" if args.json else " without --json"))
    return [p for p in prompts for _ in range(args.num_samples)]


def _run_generate(args) -> int:
    from ..lm import LM, load_drafter_model

    world = _launched_world()
    error = None
    try:
        prompts = _checked_generate_inputs(args)
    except (ValueError, TypeError, OSError) as exc:
        if world is None:
            raise
        error = exc
    if world is not None:  # every rank checked its own inputs: all go on, or all stop with the first error
        from ..lm import rank_device
        from ..models.parallel import agree_on_error, join

        agree_on_error(join(world, rank_device(args.device, world)), error)
    lm = LM.from_pretrained(args.model, device=args.device, dtype=args.dtype, tokenizer=args.tokenizer,
                            tensor_parallel=world, revision=args.revision)
    if world is not None and lm.model.tp.rank != 0:
        sys.stdout = open(os.devnull, "w")  # every rank decodes the same; rank 0 reports
    if args.drafter_model is not None:
        lm.drafter_model = load_drafter_model(args.drafter_model, lm.model.device, lm.model.dtype)
        if args.compile:
            from ..runtime import CompiledModel

            lm.drafter_model = CompiledModel(lm.drafter_model)
    kw = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
              seed=args.seed, torch_compile=args.compile, stop=args.stop, logprobs=args.logprobs)
    tree = "auto" if args.tree == "auto" else tree_spec(args.tree)
    if args.chat:
        convs = [_conversation(p, args.system) for p in prompts]
        run = lambda **more: lm.chat(convs, **more)  # noqa: E731
    else:
        run = lambda **more: lm.generate(prompts, **more)  # noqa: E731
    warmup = 0.0
    if args.compare:  # compiling, measuring this machine's costs and every first use (the tree sizes the
        # choice takes, their products' paths): here, in the same calls once, not in the timed runs
        t0 = time.perf_counter()
        for method in (args.method, "autoregressive"):
            run(drafter=args.drafter, tree=tree, method=method, **kw)
        warmup = time.perf_counter() - t0
    out = run(drafter=args.drafter, tree=tree, method=args.method, **kw)
    ref = run(method="autoregressive", **kw) if args.compare else None
    same = ref is not None and out.token_ids == ref.token_ids
    if args.json:
        import json

        report = dict(texts=out.texts, finish_reasons=out.finish_reasons, token_ids=out.token_ids,
                      method=args.method, generation=out.generation, stats=_stats(out.stats))
        if args.chat:
            report["reasoning"] = out.reasoning
        if out.logprobs is not None:  # (-inf, a token a truncated law rules out, as null: JSON has no infinity)
            finite = lambda x: x if math.isfinite(x) else None  # noqa: E731
            report["logprobs"] = [[dict(token=lp.token, logprob=finite(lp.logprob),
                                        top=[[i, finite(p)] for i, p in lp.top]) for lp in row]
                                  for row in out.logprobs]
        if ref is not None:
            report.update(autoregressive_stats=_stats(ref.stats), identical=same,
                          speedup=out.stats.tokens_per_s / ref.stats.tokens_per_s, warmup_s=warmup)
        print(json.dumps(report))
        return 0
    for i, (prompt, text) in enumerate(zip(prompts, out.texts)):
        if len(prompts) > 1:
            sample = f" sample {i % args.num_samples}" if args.num_samples > 1 else ""
            print(f"=== prompt {i // args.num_samples}{sample} ({out.finish_reasons[i]}) ===")
        if args.chat and out.reasoning[i] is not None:
            print(f"[reasoning] {out.reasoning[i]}")
        print(text if args.chat else prompt + text)
    g = out.generation
    taken = f" (from generation_config.json: {', '.join(g['from_checkpoint'])})" if g["from_checkpoint"] else ""
    print(f"[decoding] max_new_tokens {g['max_new_tokens']} temperature {g['temperature']} top_k {g['top_k']} "
          f"top_p {g['top_p']}{taken}")
    print(f"[{args.method}] {out.stats.summary()}")
    if ref is not None:
        print(f"[autoregressive] {ref.stats.summary()}")
        speedup = out.stats.tokens_per_s / ref.stats.tokens_per_s
        yes = "yes" if same else "NO"
        t = g["temperature"]
        identical = yes if t == 0 else f"n/a at temperature {t} (same tokens: {yes})"
        print(f"warm-up {warmup:.1f}s before timing (compiling, measuring this machine's costs), not in tok/s")
        print(f"speedup x{speedup:.2f} | greedy outputs identical: {identical}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["demo"]:
        from .demo import main as demo_main

        return demo_main(argv[1:])
    parser = argparse.ArgumentParser(prog="stree", description="speculative tree decoding for Mamba2 and hybrids")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", add_help=False, help="the shipped tiny model pair: every decoding method and drafter, "
                                                "greedy identity, tau and tokens/s (stree demo --help)")
    _generate_parser(sub)
    _chat_parser(sub)
    _reason_parser(sub)
    _serve_parser(sub)
    _profile_parser(sub)
    _optimize_parser(sub)
    _train_lm_parser(sub)
    _distill_parser(sub)
    args = parser.parse_args(argv)
    run = {"generate": _run_generate, "chat": _run_chat, "reason": _run_reason, "optimize-tree": _run_optimize, "train-lm": _run_train_lm,
           "distill": _run_distill, "profile": _run_profile, "serve": _run_serve}[args.command]
    from ..training.loop import TrainingInterrupted

    from ..models.parallel import leave

    agreed = True  # whether every rank (under torchrun) ends here together
    global _LEFT_GROUP
    try:
        return run(args)
    except TrainingInterrupted as stop:
        print(f"stree {args.command}: {stop}", file=sys.stderr)
        return stop.exit_code
    except (ValueError, TypeError, OSError) as exc:
        # one write: under torchrun every rank prints it to the same stream, and print's two writes interleave
        sys.stderr.write(f"stree {args.command}: error: {exc}\n")
        return 2
    except BaseException:
        agreed = False
        raise
    finally:
        _LEFT_GROUP = leave(meet=agreed)  # tensor parallelism: the ranks meet, then end their process group


_LEFT_GROUP = False  # whether main() ended a process group it had started (a torchrun rank)


def entry() -> None:
    """The ``stree`` command (and ``python -m stree``): :func:`main`'s status as the exit status. A
    torchrun rank whose group main() ended exits at once, without the interpreter's teardown: its
    work is done and reported, and tearing down the native threads of torch.distributed and the
    runtimes beside it has aborted a rank at exit now and then (SIGABRT, "terminate called
    without an active exception") although the ranks had met and ended their group."""
    code = main()
    if _LEFT_GROUP:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(int(code or 0))
    sys.exit(code)


if __name__ == "__main__":
    entry()
