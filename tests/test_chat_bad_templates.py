"""Chat templates (and tokenizers) that ChatFormat cannot serve by appending turns are refused in one line at
construction, never turned into ids that differ from the template's rendering; those it can serve give exactly
the tokenizer's ids of the rendered conversation. On SmolLM2's real tokenizer with edited ChatML templates."""

from __future__ import annotations

import copy

import pytest
from tokenizers import AddedToken
from transformers import AutoTokenizer

from opsd.chat import ChatFormat, ChatTemplateError
from opsd.config import ModelSection
from opsd.models.hf import ensure_model

SYSTEM = "You play a text game."
GEN = "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"


def chatml(content: str = "m['content']", generation: str = GEN) -> str:
    """ChatML with `content` as the expression of a message's content."""
    return ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ " + content + " }}<|im_end|>\n{% endfor %}"
            + generation)


@pytest.fixture(scope="module")
def base():
    return AutoTokenizer.from_pretrained(ensure_model(ModelSection()), local_files_only=True)


def with_template(tok, template: str):
    tok = copy.deepcopy(tok)
    tok.chat_template = template
    return tok


def enc(tok, text: str) -> list[int]:
    return list(tok(text, add_special_tokens=False)["input_ids"])


def test_a_template_that_ignores_add_generation_prompt_is_refused(base):
    # Its "assistant header" was taken from a rendered assistant turn and encoded as plain text before the prefill:
    # '<|im_start|>' became 7 text ids instead of id 1.
    tok = with_template(base, chatml(generation="{% if false %}x{% endif %}"))
    with pytest.raises(ChatTemplateError, match=r"generation prompt lacks the assistant header.*add_generation_prompt"):
        ChatFormat(tok, "action")


@pytest.mark.parametrize("content", [
    "m['content'] | lower",
    "m['content'] | upper",
    "m['content'] | e",  # HTML-escaped
    "m['content'][:20]",  # truncated
    "('LONG ' if m['content'] | length > 10 else '') + m['content']",  # depends on the content
])
def test_a_template_that_rewrites_contents_is_refused(base, content):
    # The probe contents (sentinels) came through unchanged, so the real contents were placed as given: the ids
    # silently differed from the template's own rendering.
    with pytest.raises(ChatTemplateError, match="changes message contents"):
        ChatFormat(with_template(base, chatml(content)), "action")


def test_a_template_repeating_the_system_prompt_in_later_turns_is_refused(base):
    # The system sentinel inside the next-turn text was filled with the observation: "system\nIt opens."
    template = ("{% set sys = messages[0]['content'] %}{% for m in messages %}{% if m['role'] == 'user' %}"
                "<|im_start|>system\n{{ sys }}<|im_end|>\n{% endif %}{% if m['role'] != 'system' %}<|im_start|>"
                "{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}" + GEN)
    with pytest.raises(ChatTemplateError, match="repeats an earlier message"):
        ChatFormat(with_template(base, template), "action")


@pytest.mark.parametrize("flag", ["rstrip", "lstrip"])
def test_special_tokens_that_swallow_whitespace(base, flag):
    """Added tokens marked rstrip/lstrip (Hugging Face's Phi-3.5 role markers) drop the whitespace after/before them
    when the tokenizer encodes a rendered conversation: the turn pieces drop it too."""
    tok = copy.deepcopy(base)
    tok.add_tokens([AddedToken(t, special=True, normalized=False, **{flag: True})
                    for t in ("<|im_start|>", "<|im_end|>")], special_tokens=True)
    chat = ChatFormat(tok, "action")
    user, obs, reply = "  You are in a hall.\n", " It opens. ", "<action>open door</action>"
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]
    prompt = chat.initial_prompt_ids(SYSTEM, user)
    assert prompt == enc(tok, tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) + "<action>")
    head = enc(tok, tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True))
    msgs += [{"role": "assistant", "content": reply}, {"role": "user", "content": obs}]
    full = enc(tok, tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) + "<action>")
    response = enc(tok, reply)[len(enc(tok, "<action>")):]  # after the prefill: "open door</action>"
    assert full[len(head):][: len(enc(tok, reply))] == enc(tok, reply)  # a token boundary after the prefill
    # Sampled up to and including <|im_end|> (id 2), or cut before it: the same conversation either way.
    assert prompt + response + [2] + chat.continuation_ids(obs, ended_with_eos=True) == full
    assert prompt + response + chat.continuation_ids(obs, ended_with_eos=False) == full
