"""Conversations through a tokenizer's chat template, and the reasoning of ``<think>`` models.

A conversation is a list of ``{"role", "content"}`` messages; its prompt is exactly what
transformers' ``tokenizer.apply_chat_template(messages, add_generation_prompt=True)`` gives. A
reasoning model writes ``<think> ... </think>`` before its answer, the opening tag either in the
template's generation prompt (it opens the block for the model) or written by the model itself;
:func:`split_reasoning` separates the two parts of the generated text (the tags stay in the text
because reasoning templates make them added tokens that are not special: decoding keeps them).
"""

from __future__ import annotations

__all__ = ["THINK", "END_THINK", "chat_prompts", "conversations", "next_turn", "prompt_ids", "split_reasoning"]

THINK, END_THINK = "<think>", "</think>"


def conversations(messages) -> tuple[list[list[dict]], bool]:
    """``messages`` as a list of conversations, and whether it was one conversation (a list of
    message dicts) rather than a batch of them (a list of such lists); every message checked."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise TypeError(f"messages must be a conversation (a non-empty list of {{'role', 'content'}} dicts) or a "
                        f"list of conversations, got {messages!r}")
    single = all(isinstance(m, dict) for m in messages)
    if not single and not all(isinstance(c, (list, tuple)) for c in messages):
        raise TypeError("messages must be one conversation (a list of message dicts) or a list of conversations, "
                        "not a mix")
    convs = [list(messages)] if single else [list(c) for c in messages]
    for i, conv in enumerate(convs):
        if not conv:
            raise ValueError(f"conversation {i} holds no messages")
        for j, m in enumerate(conv):
            if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
                raise ValueError(f"message {j} of conversation {i} must be a dict with 'role' and 'content' strings, "
                                 f"got {m!r}")
    return convs, single


def chat_prompts(tokenizer, convs: list[list[dict]]) -> tuple[list[list[int]], list[bool]]:
    """Each conversation's prompt ids (the template with its generation prompt), and whether the
    template leaves a ``<think>`` block open for the model to write in."""
    if getattr(tokenizer, "chat_template", None) is None:
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        raise ValueError(f"the tokenizer {name!r} has no chat template (tokenizer_config.json 'chat_template' or "
                         "chat_template.jinja): prompt it with plain text through generate")
    ids, opened = [], []
    for conv in convs:
        ids.append(list(tokenizer.apply_chat_template(conv, add_generation_prompt=True, return_dict=False)))
        text = tokenizer.apply_chat_template(conv, add_generation_prompt=True, tokenize=False)
        opened.append(text.rfind(THINK) > text.rfind(END_THINK))
    return ids, opened


def prompt_ids(tokenizer, text: str) -> list[int]:
    """The ids of a text prompt for a pattern that decodes from text (SpecReason, search): the
    prompt as the user's message through the tokenizer's chat template when it has one (an
    instruct or reasoning model answers that), else the text's own ids."""
    if getattr(tokenizer, "chat_template", None) is None:
        return tokenizer.encode(text)
    return chat_prompts(tokenizer, [[{"role": "user", "content": text}]])[0][0]


def next_turn(tokenizer, message: str) -> str | None:
    """The text a chat template puts after an assistant reply to end it, give the user
    ``message`` and open the next reply (None without a template): what a model's own judge reads
    after a step it wrote (found by rendering a reply around a marker and taking what follows)."""
    if getattr(tokenizer, "chat_template", None) is None:
        return None
    marker = "\u2063stree-reply\u2063"
    conv = [{"role": "user", "content": "-"}, {"role": "assistant", "content": marker},
            {"role": "user", "content": message}]
    text = tokenizer.apply_chat_template(conv, add_generation_prompt=True, tokenize=False)
    if text.count(marker) != 1:
        return None  # a template that rewrites earlier replies: no turn to lift out of it
    return text.split(marker, 1)[1]


def split_reasoning(text: str, opened: bool) -> tuple[str | None, str]:
    """``(reasoning, answer)`` of a generated ``text``: the ``<think>`` block's content (None where
    there is none: the template did not open one and the text does not start with one) and what
    follows it. A text that stopped while still thinking is all reasoning, with an empty answer."""
    if not opened:
        start = text.lstrip()
        if not start.startswith(THINK):
            return None, text
        text = start[len(THINK):]
    end = text.find(END_THINK)
    if end < 0:
        return text.strip(), ""
    return text[:end].strip(), text[end + len(END_THINK):].lstrip()
