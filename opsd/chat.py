"""Chat formatting as token ids (ChatML), response parsing and decoding.

Token-in/token-out: a trajectory's ids are built by appending, never by
re-rendering text, so each turn's prompt ids are a prefix of the next turn's
(bad-input case 8). The pieces appended here are derived from the tokenizer's
own chat template, so prompt + sampled response + continuation gives exactly
the ids of the whole conversation rendered by the template (case 9) whenever
the response ids are the canonical encoding of their text.

Text is tokenized segment by segment between the template's special tokens
(what the tokenizer does to a rendered template anyway), but message contents
are tokenized with special-token parsing OFF: an observation containing the
text "<|im_end|>" stays plain text and cannot forge a turn boundary.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal, Sequence

PREFILLS = {"action": "<action>", "think": "<think>"}
PRIVILEGED_HEADER = "[Privileged Skill Information]\n"

# Private-use characters: never produced by a template, never in real text we render.
_SENTINEL = "\ue000{}\ue001"
_SENTINEL_RE = re.compile("\ue000(\\d+)\ue001")


class ChatTemplateError(ValueError):
    """The tokenizer's chat template does not render turns by simple concatenation."""


class ChatFormat:
    """Build prompt and continuation ids for one prompt format with one tokenizer.

    prompt_format "action": the assistant turn is prefilled with the env's
    action tag (``<action>``; ``<answer>`` for single-turn answers; nothing
    when the env has several, as Search's ``<search>``/``<answer>``);
    "think": with ``<think>``. Prefilled tokens are prompt (loss mask 0).
    A system message is always rendered (SmolLM2's template otherwise inserts
    its own default system prompt).
    """

    def __init__(self, tokenizer, prompt_format: Literal["action", "think"], action_tags: Sequence[str] = ("action",)):
        if prompt_format not in PREFILLS:
            raise ValueError(f"unknown prompt_format {prompt_format!r} (expected one of {sorted(PREFILLS)})")
        self.tokenizer = tokenizer
        self.prompt_format = prompt_format
        self.action_tags = tuple(action_tags)
        if not self.action_tags or not all(re.fullmatch(r"[a-z_]+", t) for t in self.action_tags):
            raise ValueError(f"action_tags must be lower-case tag names, got {action_tags!r}")
        # Special tokens by text, longest first so a regex split prefers the longest match.
        specials = {
            tok.content: int(idx)
            for idx, tok in tokenizer.added_tokens_decoder.items()
            if getattr(tok, "special", False)
        }
        self._special_ids = specials
        self._special_re = re.compile(
            "(" + "|".join(re.escape(s) for s in sorted(specials, key=len, reverse=True)) + ")"
        ) if specials else None
        self._derive_turn_pieces()

    # -- template probing ----------------------------------------------------

    def _render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        text = self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        if not isinstance(text, str):
            raise ChatTemplateError("apply_chat_template(tokenize=False) did not return a string")
        return text

    def _derive_turn_pieces(self) -> None:
        """Find, from the template itself, the text that closes an assistant turn and opens the next.

        Renders probe conversations with sentinel contents and checks that a
        longer conversation's render extends the shorter one's (otherwise the
        template rewrites history, e.g. drops old thinking, and appending ids
        cannot reproduce it: ChatTemplateError).
        """
        s, u, a, o = (_SENTINEL.format(i) for i in range(4))
        base = [{"role": "system", "content": s}, {"role": "user", "content": u}]
        with_gen = self._render(base, True)
        closed = self._render(base + [{"role": "assistant", "content": a}], False)
        nxt = self._render(
            base + [{"role": "assistant", "content": a}, {"role": "user", "content": o}], True
        )
        if not closed.startswith(with_gen) or not nxt.startswith(closed):
            raise ChatTemplateError("chat template does not render conversations by appending turns")
        # closed = with_gen + a + end_of_turn ; nxt = closed + user_turn(o) + assistant header
        if closed[len(with_gen) :][: len(a)] != a:
            raise ChatTemplateError("assistant content is not rendered verbatim after the generation prompt")
        end_text = closed[len(with_gen) + len(a) :]
        parts = self._split_specials(end_text)
        if not parts or parts[0][0] != "special":
            raise ChatTemplateError(f"assistant turns must end with a special token, got {end_text!r}")
        self.end_of_turn_id: int = parts[0][1]  # type: ignore[assignment]  # <|im_end|> for ChatML
        self._end_of_turn_special = self._special_re.match(end_text).group(0)  # type: ignore[union-attr]
        self._end_of_turn_text = end_text  # "<|im_end|>\n" for ChatML
        self._next_turn_text = nxt[len(closed) :]  # "<|im_start|>user\n{o}<|im_end|>\n<|im_start|>assistant\n"
        if self._next_turn_text.count(o) != 1:
            raise ChatTemplateError("user content must appear once in the rendered turn")
        self._next_turn_text = self._next_turn_text.replace(o, _SENTINEL.format(0))

    def _split_specials(self, text: str) -> list[tuple[str, object]]:
        """Split template text into ("special", id) and ("text", str) parts (sentinels kept in text)."""
        if self._special_re is None:
            return [("text", text)] if text else []
        out: list[tuple[str, object]] = []
        for k, piece in enumerate(self._special_re.split(text)):
            if not piece:
                continue
            out.append(("special", self._special_ids[piece]) if k % 2 else ("text", piece))
        return out

    def _encode_template(self, template_text: str, contents: Sequence[str], suffix: str = "") -> list[int]:
        """Token ids of template text whose sentinel i stands for contents[i], with `suffix` appended.

        Special tokens are recognised only in the template's own text; each
        text segment between them (structure + contents + suffix) is encoded
        in one piece, as the tokenizer would encode the rendered string.
        """
        parts = self._split_specials(template_text)
        if suffix:
            if parts and parts[-1][0] == "text":
                parts[-1] = ("text", parts[-1][1] + suffix)  # type: ignore[operator]
            else:
                parts.append(("text", suffix))
        ids: list[int] = []
        for kind, val in parts:
            if kind == "special":
                ids.append(val)  # type: ignore[arg-type]
                continue
            text = _SENTINEL_RE.sub(lambda m: contents[int(m.group(1))], val)  # type: ignore[arg-type]
            ids.extend(self._encode_text(text))
        return ids

    def _encode_text(self, text: str) -> list[int]:
        if not text:
            return []
        return list(self.tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"])

    # -- public API ------------------------------------------------------------

    @classmethod
    def for_env(cls, tokenizer, env_cfg) -> "ChatFormat":
        """The ChatFormat of an EnvSection: its prompt format and its env adapter's ACTION_TAGS."""
        from opsd.envs import get_adapter  # the adapters import this module's users, not the reverse

        return cls(tokenizer, env_cfg.prompt_format, get_adapter(env_cfg.name).ACTION_TAGS)

    @property
    def prefill_text(self) -> str:
        """The text prefilled at the start of every assistant turn: "<think>" (think format), else
        the action tag ("<action>", "<answer>"), or "" when the env has several action tags."""
        if self.prompt_format == "think":
            return PREFILLS["think"]
        return f"<{self.action_tags[0]}>" if len(self.action_tags) == 1 else ""

    def initial_prompt_ids(
        self, system: str, user: str, one_shot: Sequence[tuple[str, str]] = ()
    ) -> list[int]:
        """Ids of the first prompt: system, one-shot (user, assistant) example turns, the user
        message, the assistant header and the prefill. Returns list[int] (no BOS added:
        ChatML has none)."""
        messages: list[dict] = [{"role": "system", "content": _SENTINEL.format(0)}]
        contents = [system]
        for ex_user, ex_assistant in one_shot:
            messages.append({"role": "user", "content": _SENTINEL.format(len(contents))})
            contents.append(ex_user)
            messages.append({"role": "assistant", "content": _SENTINEL.format(len(contents))})
            contents.append(ex_assistant)
        messages.append({"role": "user", "content": _SENTINEL.format(len(contents))})
        contents.append(user)
        return self._encode_template(self._render(messages, True), contents, self.prefill_text)

    def continuation_ids(self, observation: str, ended_with_eos: bool) -> list[int]:
        """Ids to append after a sampled response so the conversation continues.

        ended_with_eos: the response's last sampled id was the end-of-turn
        token (finish "stop"); then only the separator after it ("\\n" in
        ChatML) is added. Otherwise (length-truncated) the turn is closed
        with "<|im_end|>\\n". Then come the user turn holding `observation`,
        the assistant header and the prefill. All of it is prompt (loss mask 0).
        """
        end = self._end_of_turn_text
        if ended_with_eos:
            # The end-of-turn token was sampled: keep only what the template puts after it.
            end = end[len(self._end_of_turn_special) :]
        return self._encode_template(end + self._next_turn_text, [observation], self.prefill_text)

    def privileged_prefix_ids(self, text: str) -> list[int]:
        """Ids of ``"[Privileged Skill Information]\\n" + text + "\\n\\n"`` (spec §0).

        The teacher's prompt is these ids followed by the unchanged student
        prompt ids (they go before the system turn); the response ids follow verbatim.
        """
        return self._encode_text(PRIVILEGED_HEADER + text + "\n\n")


# ---------------------------------------------------------------------------
# Decoding and parsing


def decode(tokenizer, ids: Sequence[int]) -> str:
    """Decode a whole response at once, special tokens skipped, spaces untouched.

    Multi-byte characters split over several tokens decode correctly because
    the ids are decoded together (case 14). A response cut by the token limit
    inside a character ends in an incomplete UTF-8 sequence, which decodes to
    U+FFFD; the tokens that hold it can also hold whole characters before it
    (SmolLM2's " \\xf0\\x9f" is a space plus half an emoji). So the shortest
    tail of at most 3 tokens (an incomplete character has at most 3 bytes)
    after which the text no longer ends in U+FFFD is found, and only the
    trailing U+FFFD of that tail is dropped: the space stays. A U+FFFD the
    model sampled at the very end is dropped too (it carries no text); one
    elsewhere is kept. Returns str.
    """
    special = set(getattr(tokenizer, "all_special_ids", ()))
    ids = [int(i) for i in ids]
    while ids and ids[-1] in special:  # skipped anyway; they must not use up the 3-token tail
        ids.pop()
    text = tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    if not text.endswith("\ufffd"):
        return text
    for drop in range(1, min(3, len(ids)) + 1):
        shorter = tokenizer.decode(ids[:-drop], skip_special_tokens=True, clean_up_tokenization_spaces=False)
        if not shorter.endswith("\ufffd") and text.startswith(shorter):
            return shorter + text[len(shorter) :].rstrip("\ufffd")
    return text


# CJK ideographs (unified, extension A, compatibility), kana and hangul syllables.
# The released ALFWorld/WebShop code checks only U+4E00-U+9FFF; the wider set
# also catches Japanese/Korean drift.
_CJK_RE = re.compile("[\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uf900-\ufaff]")
_THINK_RE = re.compile(r"<think>(.*?)</think>", re.IGNORECASE | re.DOTALL)


@dataclass
class ParsedResponse:
    """thinking: stripped think content ("" when absent); action: stripped action ("" when
    invalid); valid: format-valid; reason: why invalid ("" when valid); tag: the action's
    tag ("action", "search", "answer"; "" when invalid)."""

    thinking: str
    action: str
    valid: bool
    reason: str
    tag: str = ""


def _count(tag: str, text: str) -> int:
    return len(re.findall(re.escape(tag), text, re.IGNORECASE))


def parse_response(
    text: str, prompt_format: str, env: str = "textworld", action_tags: Sequence[str] | None = None
) -> ParsedResponse:
    """Parse a decoded response (spec §0).

    `text` must include the prefilled opening tag (callers pass prefill +
    decoded completion, case 10). Rules: thinking = first case-insensitive
    ``<think>...</think>``; the action tag (``<action>``; for env "search":
    exactly one of ``<search>``/``<answer>``) is searched only outside the
    thinking block (case 11); each tag must appear exactly once (case 13),
    open and closed (case 12); the "think" format requires the think block,
    the "action" format only allows it; empty action, an action with control
    characters (other than tab and newlines), or any CJK character anywhere,
    is invalid. Actions are not lower-cased. `action_tags` (an env
    adapter's ACTION_TAGS) overrides the tags chosen by `env`; with several,
    exactly one of them must appear.
    """
    if prompt_format not in PREFILLS:
        raise ValueError(f"unknown prompt_format {prompt_format!r}")
    thinking = ""

    def bad(reason: str) -> ParsedResponse:
        return ParsedResponse(thinking, "", False, reason)

    n_open, n_close = _count("<think>", text), _count("</think>", text)
    m = _THINK_RE.search(text)
    if m is not None:
        thinking = m.group(1).strip()
    if (n_open, n_close) != (0, 0):
        if (n_open, n_close) != (1, 1):
            return bad(f"think tags must appear exactly once each (found {n_open} open, {n_close} close)")
        if m is None:
            return bad("malformed think block (</think> before <think>)")
    elif prompt_format == "think":
        return bad("missing <think>...</think> block")
    outside = text if m is None else text[: m.start()] + text[m.end() :]

    tags = tuple(action_tags) if action_tags else (("search", "answer") if env == "search" else ("action",))
    found: list[tuple[str, str]] = []
    for tag in tags:
        o, c = _count(f"<{tag}>", outside), _count(f"</{tag}>", outside)
        if (o, c) == (0, 0):
            continue
        if (o, c) != (1, 1):
            return bad(f"<{tag}> tags must appear exactly once each outside thinking (found {o} open, {c} close)")
        am = re.search(f"<{tag}>(.*?)</{tag}>", outside, re.IGNORECASE | re.DOTALL)
        if am is None:
            return bad(f"malformed <{tag}> block (closing tag first)")
        found.append((tag, am.group(1).strip()))
    if not found:
        return bad(f"missing <{'>/<'.join(tags)}>...</...> block outside thinking")
    if len(found) > 1:
        return bad(f"both {' and '.join(f'<{t}>' for t, _ in found)} blocks")
    tag, action = found[0]
    if not action:
        return bad("empty action")
    if any(not c.isprintable() and c not in "\t\n\r" for c in action):
        return bad("control characters in the action")  # a NUL crashes some interpreters (Jericho)
    if _CJK_RE.search(text):
        return bad("contains CJK characters")
    return ParsedResponse(thinking, action, True, "", tag)
