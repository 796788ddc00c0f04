"""Chat formatting as token ids from the model's own chat template, response parsing and decoding.

Token-in/token-out: a trajectory's ids are built by appending, never by
re-rendering text, so each turn's prompt ids are a prefix of the next turn's
(bad-input case 8). The pieces appended here are derived from the tokenizer's
chat template (any family: ChatML, Llama 3, Mistral, Gemma, Phi), so prompt +
sampled response + continuation gives exactly the ids of the conversation
rendered by the template (case 9) whenever the response ids are the canonical
encoding of their text. Where a template rewrites history, opsd keeps what the
policy saw and sampled (see `ChatFormat` for the rules).

Text is tokenized segment by segment between the template's special tokens
(what the tokenizer does to a rendered template anyway), each segment encoded
as the tokenizer encodes it after a special token (a SentencePiece tokenizer
that adds its leading "▁" only at the start of the text adds none there), and
message contents are tokenized with special-token parsing OFF: an observation
containing the text "<|im_end|>" stays plain text and cannot forge a turn boundary.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Literal, Sequence

# "<think>\n": the newline is part of the prefill so that the BPE merge of ">\n" (Llama 3, Qwen2.5, SmolLM2)
# falls inside the prompt, not across the prompt/response boundary; thinking models open their reasoning so.
PREFILLS = {"action": "<action>", "think": "<think>\n"}
PRIVILEGED_HEADER = "[Privileged Skill Information]\n"

# Private-use characters: never produced by a template, never in real text we render.
_SENTINEL = "\ue000{}\ue001"
_SENTINEL_RE = re.compile("\ue000(\\d+)\ue001")
_WS = " \n"  # wrapped around probe contents to learn which whitespace a template strips
# What a tokenizer's added token with rstrip/lstrip swallows after/before itself: Rust's char::is_whitespace
# (Unicode White_Space), not Python's str.strip() set (which also strips U+001C..U+001F).
_TOKEN_WS = "\t\n\x0b\x0c\r \x85\xa0\u1680" + "".join(map(chr, range(0x2000, 0x200B))) + (
    "\u2028\u2029\u202f\u205f\u3000")
# Ordinary contents (mixed case, markup, digits, longer than a sentinel) for the check that the template
# renders contents as given.
_CHECK_SYSTEM = "Rules: Reply With One Command & Nothing Else (v2)."
_CHECK_USERS = ("You See a <b>Door</b> & 2 Keys; Exits: North.", "It Opens. 'A Hall' Lies Beyond & Nothing Else.")
_CHECK_REPLY = "<action>Open Door</action>"


class ChatTemplateError(ValueError):
    """The tokenizer's chat template cannot be served by appending turns (one line: the reason)."""


def _strip_rule(rendered: str, sentinel: str) -> str:
    """How a template treats whitespace around a content it rendered as `_WS + sentinel + _WS`:
    "keep", "strip" (Jinja's trim), "lstrip" or "rstrip"."""
    lead, trail = (_WS + sentinel) in rendered, (sentinel + _WS) in rendered
    return {(True, True): "keep", (False, False): "strip", (False, True): "lstrip", (True, False): "rstrip"}[lead, trail]


def _apply_rule(rule: str, text: str) -> str:
    return text if rule == "keep" else getattr(text, rule)()


def _tail_encoder(tokenizer) -> Any:
    """For a fast tokenizer whose Metaspace adds the leading "▁" only at the start of the whole text
    (prepend_scheme "first": Mistral, Llama 2), a copy of its `tokenizers.Tokenizer` with "never" and
    special-token text encoded as plain text: how a segment that follows a special token is encoded.
    None for every other tokenizer, whose own call (split_special_tokens=True) already does that."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    parts = [x for x in (getattr(backend, "pre_tokenizer", None), getattr(backend, "normalizer", None)) if x]
    if not any(b'"prepend_scheme":"first"' in x.__getstate__() for x in parts):
        return None
    from tokenizers import Tokenizer

    spec = json.loads(backend.to_str())

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if node.get("prepend_scheme") == "first":
                node["prepend_scheme"] = "never"
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(spec.get("pre_tokenizer"))
    walk(spec.get("normalizer"))
    copy = Tokenizer.from_str(json.dumps(spec))
    copy.encode_special_tokens = True
    return copy


class ChatFormat:
    """Build prompt and continuation ids for one prompt format with one tokenizer and its chat template.

    prompt_format "action": the assistant turn is prefilled with the env's
    action tag (``<action>``; ``<answer>`` for single-turn answers; nothing
    when the env has several, as Search's ``<search>``/``<answer>``);
    "think": with ``<think>\\n``. Prefilled tokens are prompt (loss mask 0).
    `template_kwargs` go to every ``apply_chat_template`` call (e.g.
    ``{"enable_thinking": False}`` for Qwen3). A system message is always
    rendered (SmolLM2's template otherwise inserts its own default system prompt).

    Rules where a template is not plain concatenation (the trajectory is what
    the policy saw and sampled; the next turn's ids are derived from the template):

    - contents: system and user contents get the whitespace treatment the
      template gives that role (Llama 3 and Gemma ``trim``); sampled responses
      are kept verbatim, so a response ending in whitespace keeps it where a
      re-render would trim it;
    - earlier turns are never re-rendered: Qwen3 drops the thinking of
      assistant turns before the last user message when it re-renders a
      conversation, opsd keeps the thinking the policy sampled;
    - the system prompt stays where the first prompt put it: Mistral moves it
      into the LAST user turn on every re-render, Gemma 3 puts it in the first
      user turn; templates that refuse a system role (Gemma 2) get it folded
      into the first user message as ``system + "\\n\\n" + user`` (Gemma 3's rule);
    - a template that puts text between the generation prompt and the
      assistant content (Mistral's " " after ``[/INST]``) gets it before a prefill.

    `system_rule` says which applied ("template", "first_user", "last_user");
    `strip_rules` the per-role whitespace rules. Special tokens the tokenizer
    marks rstrip/lstrip drop the whitespace after/before them, as when it
    encodes a rendered conversation. Raises ChatTemplateError (one line) for a
    template that cannot be served this way: one that changes contents (checked
    on a conversation with ordinary contents, as text and as the tokenizer's
    ids), repeats an earlier message in later turns, renders no generation
    prompt, or whose text the tokenizer encodes differently around its special tokens.
    """

    def __init__(self, tokenizer, prompt_format: Literal["action", "think"], action_tags: Sequence[str] = ("action",),
                 template_kwargs: dict | None = None):
        if prompt_format not in PREFILLS:
            raise ValueError(f"unknown prompt_format {prompt_format!r} (expected one of {sorted(PREFILLS)})")
        self.tokenizer = tokenizer
        self.prompt_format = prompt_format
        self.action_tags = tuple(action_tags)
        if not self.action_tags or not all(re.fullmatch(r"[a-z_]+", t) for t in self.action_tags):
            raise ValueError(f"action_tags must be lower-case tag names, got {action_tags!r}")
        self.template_kwargs = dict(template_kwargs or {})
        if not getattr(tokenizer, "chat_template", None):
            raise ChatTemplateError("the tokenizer has no chat template (set model.chat_template to a template file)")
        # Special tokens by text, longest first so a regex split prefers the longest match.
        specials = {
            tok.content: int(idx)
            for idx, tok in tokenizer.added_tokens_decoder.items()
            if getattr(tok, "special", False)
        }
        self._special_ids = specials
        # Added tokens that swallow the whitespace after (rstrip) / before (lstrip) them when the tokenizer
        # encodes a rendered conversation (Hugging Face's Phi-3.5 role markers): segments are cut the same way.
        self._rstrip_ids = {int(i) for i, t in tokenizer.added_tokens_decoder.items() if getattr(t, "rstrip", False)}
        self._lstrip_ids = {int(i) for i, t in tokenizer.added_tokens_decoder.items() if getattr(t, "lstrip", False)}
        self._special_re = re.compile(
            "(" + "|".join(re.escape(s) for s in sorted(specials, key=len, reverse=True)) + ")"
        ) if specials else None
        self._tail = _tail_encoder(tokenizer)
        self._derive_turn_pieces()
        self._check_segment_encoding()
        self._check_contents()

    # -- template probing ----------------------------------------------------

    def _render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt, **self.template_kwargs
            )
        except Exception as e:  # jinja2's TemplateError or the template's own raise_exception
            raise ChatTemplateError(f"the chat template failed to render a conversation: {e}") from e
        if not isinstance(text, str):
            raise ChatTemplateError("apply_chat_template(tokenize=False) did not return a string")
        return text

    def _conversation(self, system: str | None, turns: Sequence[tuple[str, str | None]]) -> list[dict]:
        """Messages for the template: (user, assistant or None) turns after `system`, per `system_rule`
        (None: no system message, folded into the first user content by the caller)."""
        msgs: list[dict] = []
        if system is not None and self.system_rule != "first_user":
            msgs.append({"role": "system", "content": system})
        for k, (user, assistant) in enumerate(turns):
            if k == 0 and system is not None and self.system_rule == "first_user":
                user = system + "\n\n" + user
            msgs.append({"role": "user", "content": user})
            if assistant is not None:
                msgs.append({"role": "assistant", "content": assistant})
        return msgs

    def _derive_turn_pieces(self) -> None:
        """Find, from the template itself, the text that closes an assistant turn and opens the next.

        Renders a probe conversation (system, user, assistant, user + generation
        prompt) with sentinel contents and cuts it at the sentinels.
        """
        s, u, a, o = (_SENTINEL.format(i) for i in range(4))
        self.system_rule = "template"
        try:
            text = self._render(self._conversation(s, [(u, a), (o, None)]), True)
        except ChatTemplateError:
            text = ""
        if s not in text:  # the template refuses (Gemma 2) or drops a system role: fold it into the first user turn
            self.system_rule = "first_user"
            text = self._render(self._conversation(s, [(u, a), (o, None)]), True)
            s = ""
        elif text.index(s) > text.index(a):  # moved to the last user turn (Mistral): cut the turns without it
            self.system_rule = "last_user"
            text = self._render([{"role": "user", "content": u}, {"role": "assistant", "content": a},
                                 {"role": "user", "content": o}], True)
        for name, sent in (("user", u), ("assistant", a), ("user", o)):
            if text.count(sent) != 1:
                raise ChatTemplateError(f"a {name} content must appear once in the rendered conversation")
        if not text.index(u) < text.index(a) < text.index(o):
            raise ChatTemplateError("the template does not render turns in conversation order")
        history_header = text[text.index(u) + len(u) : text.index(a)]  # end of a user turn + assistant header
        between = text[text.index(a) + len(a) : text.index(o)]  # end of an assistant turn + user header
        generation_header = text[text.index(o) + len(o) :]  # end of a user turn + the generation prompt
        parts = self._split_specials(between)
        if not parts or parts[0][0] != "special":
            raise ChatTemplateError(
                f"assistant turns must end with a special token of this tokenizer, got {between[:60]!r} (a template "
                "of another model family? its turn markers must be special tokens of this tokenizer)")
        self.end_of_turn_id: int = parts[0][1]  # type: ignore[assignment]  # <|im_end|>, <|eot_id|>, <end_of_turn>
        self._next_turn_text = between + _SENTINEL.format(0) + generation_header
        self._template_specials = [v for k, v in self._split_specials(text) if k == "special"]
        # Text the template puts between the generation prompt and the content (Mistral: " "): goes before a prefill.
        self._content_prefix = ""
        if history_header.startswith(generation_header):
            self._content_prefix = history_header[len(generation_header) :]
        if _SENTINEL_RE.search(between + generation_header + self._content_prefix):  # filled with the observation
            raise ChatTemplateError("the template repeats an earlier message (e.g. the system prompt) in later "
                                    "turns: a continuation cannot be appended")
        if self._content_prefix and self._special_re is not None and self._special_re.search(self._content_prefix):
            # It would be encoded as plain text: the template ignores add_generation_prompt, or writes its
            # assistant header only before an assistant content.
            raise ChatTemplateError(f"the generation prompt lacks the assistant header {self._content_prefix!r} "
                                    "the template writes before an assistant content (add_generation_prompt ignored?)")
        if self.prompt_format == "think" and "</think>" in generation_header:
            raise ChatTemplateError("the generation prompt already closes a think block (enable_thinking off?): "
                                    "use env.prompt_format: action")
        # Whitespace: probe the same conversation with padded contents.
        pad = [_WS + x + _WS if x else x for x in (s, u, a, o)]
        if self.system_rule == "last_user":
            padded = self._render([{"role": "user", "content": pad[1]}, {"role": "assistant", "content": pad[2]},
                                   {"role": "user", "content": pad[3]}], True)
            system_rule = _strip_rule(self._render(self._conversation(pad[0], [(pad[1], None)]), True), s)
        else:
            padded = self._render(self._conversation(pad[0], [(pad[1], pad[2]), (pad[3], None)]), True)
            system_rule = _strip_rule(padded, s) if s else "keep"
        self.strip_rules = {"system": system_rule, "user": _strip_rule(padded, o),
                            "assistant": _strip_rule(padded, a)}

    def _check_segment_encoding(self) -> None:
        """Encoding a segment on its own must give the ids the tokenizer gives it after (and before) each special
        token the template writes."""
        names = {v: k for k, v in self._special_ids.items()}
        for special in dict.fromkeys(names[i] for i in self._template_specials):
            for probe in ("Hello world\n", " two  spaces", "\nnew line", "<action>go north</action>"):
                for text in (special + probe, probe + special):
                    want = self.tokenizer(text, add_special_tokens=False)["input_ids"]
                    if list(want) != self._encode_template(text, (), at_start=True):
                        raise ChatTemplateError(f"cannot reproduce how the tokenizer encodes text around {special!r}")

    def _check_contents(self) -> None:
        """The template must render message contents as given: the first prompt of a conversation with ordinary
        contents (a one-shot turn, then a user turn) built from the probed pieces must be the template's own
        rendering of it, as text and as the tokenizer's ids. Raises ChatTemplateError where not (a template
        that lower-cases, escapes or otherwise rewrites contents)."""
        u0, u1 = _CHECK_USERS
        first_user = self.system_rule == "first_user"  # the system prompt is part of the first user content
        contents = [_CHECK_SYSTEM + "\n\n" + u0, u1] if first_user else [_CHECK_SYSTEM, u0, u1]
        sent = [_SENTINEL.format(i) for i in range(len(contents))]
        rendered = self._render(self._conversation(None if first_user else sent[0],
                                                   [(sent[-2], _CHECK_REPLY), (sent[-1], None)]), True)
        ours = _SENTINEL_RE.sub(lambda m: contents[int(m.group(1))], rendered)
        want = self._render(self._conversation(_CHECK_SYSTEM, [(u0, _CHECK_REPLY), (u1, None)]), True)
        if ours != want:
            raise ChatTemplateError("the chat template changes message contents (e.g. lower-cases or escapes them): "
                                    "opsd cannot place them")
        ids = self.initial_prompt_ids(_CHECK_SYSTEM, u1, [(u0, _CHECK_REPLY)])
        if ids != list(self.tokenizer(want + self._prompt_suffix, add_special_tokens=False)["input_ids"]):
            raise ChatTemplateError("cannot reproduce how the tokenizer encodes a rendered conversation")

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

    def _encode_template(self, template_text: str, contents: Sequence[str], suffix: str = "",
                         at_start: bool = False) -> list[int]:
        """Token ids of template text whose sentinel i stands for contents[i], with `suffix` appended.

        Special tokens are recognised only in the template's own text; each
        text segment between them (structure + contents + suffix) is encoded
        in one piece, as the tokenizer would encode the rendered string;
        `at_start`: the text opens a sequence (its first segment is encoded as
        the start of a text), else it follows a special token.
        """
        parts = self._split_specials(template_text)
        if suffix:
            if parts and parts[-1][0] == "text":
                parts[-1] = ("text", parts[-1][1] + suffix)  # type: ignore[operator]
            else:
                parts.append(("text", suffix))
        ids: list[int] = []
        for k, (kind, val) in enumerate(parts):
            if kind == "special":
                ids.append(val)  # type: ignore[arg-type]
                continue
            text = _SENTINEL_RE.sub(lambda m: contents[int(m.group(1))], val)  # type: ignore[arg-type]
            if k > 0 and parts[k - 1][0] == "special" and parts[k - 1][1] in self._rstrip_ids:  # swallowed by it
                text = text.lstrip(_TOKEN_WS)
            if k + 1 < len(parts) and parts[k + 1][0] == "special" and parts[k + 1][1] in self._lstrip_ids:
                text = text.rstrip(_TOKEN_WS)
            ids.extend(self._encode_text(text, at_start=at_start and k == 0))
        return ids

    def _encode_text(self, text: str, at_start: bool = True) -> list[int]:
        if not text:
            return []
        if not at_start and self._tail is not None:
            return list(self._tail.encode(text, add_special_tokens=False).ids)
        return list(self.tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"])

    # -- public API ------------------------------------------------------------

    @classmethod
    def for_env(cls, tokenizer, env_cfg, model_cfg=None) -> "ChatFormat":
        """The ChatFormat of an EnvSection: its prompt format and its env adapter's ACTION_TAGS, with
        `model_cfg.chat_template_kwargs` (a ModelSection; None = no extra template arguments)."""
        from opsd.envs import get_adapter  # the adapters import this module's users, not the reverse

        kwargs = getattr(model_cfg, "chat_template_kwargs", None)
        return cls(tokenizer, env_cfg.prompt_format, get_adapter(env_cfg.name).ACTION_TAGS, kwargs)

    @property
    def prefill_text(self) -> str:
        """The text prefilled at the start of every assistant turn: "<think>\\n" (think format), else
        the action tag ("<action>", "<answer>"), or "" when the env has several action tags."""
        if self.prompt_format == "think":
            return PREFILLS["think"]
        return f"<{self.action_tags[0]}>" if len(self.action_tags) == 1 else ""

    @property
    def _prompt_suffix(self) -> str:
        return self._content_prefix + self.prefill_text if self.prefill_text else ""

    def initial_prompt_ids(
        self, system: str, user: str, one_shot: Sequence[tuple[str, str]] = ()
    ) -> list[int]:
        """Ids of the first prompt: system, one-shot (user, assistant) example turns, the user
        message, the assistant header and the prefill, as the template renders them (the
        one-shot replies are rendered by the template itself, e.g. Qwen3 drops their thinking).
        Returns list[int] (a BOS only where the template writes one)."""
        rules = self.strip_rules
        contents = [_apply_rule(rules["system"], system)]
        turns: list[tuple[str, str | None]] = []
        for ex_user, ex_assistant in one_shot:
            turns.append((_SENTINEL.format(len(contents)), ex_assistant))
            contents.append(_apply_rule(rules["user"], ex_user))
        turns.append((_SENTINEL.format(len(contents)), None))
        contents.append(_apply_rule(rules["user"], user))
        system_content: str | None = _SENTINEL.format(0)
        if self.system_rule == "first_user":  # one content: the template trims the folded message as a whole
            first = user if not one_shot else one_shot[0][0]
            contents.append(_apply_rule(rules["user"], system + "\n\n" + first))
            turns[0] = (_SENTINEL.format(len(contents) - 1), turns[0][1])
            system_content = None
        return self._encode_template(self._render(self._conversation(system_content, turns), True), contents,
                                     self._prompt_suffix, at_start=True)

    def continuation_ids(self, observation: str, ended_with_eos: bool) -> list[int]:
        """Ids to append after a sampled response so the conversation continues.

        ended_with_eos: the response's last sampled id was a stop id (finish
        "stop"); then only what the template puts after its end-of-turn token
        ("\\n" in ChatML, nothing for Llama 3) is added. Otherwise
        (length-truncated) the turn is closed with the end-of-turn text
        ("<|im_end|>\\n"). Then come the user turn holding `observation`, the
        assistant header and the prefill. All of it is prompt (loss mask 0).
        """
        # Encoded from the end-of-turn token on (its rstrip, if any, applies to what follows); sampled, it is dropped.
        ids = self._encode_template(self._next_turn_text, [_apply_rule(self.strip_rules["user"], observation)],
                                    self._prompt_suffix)
        return ids[1:] if ended_with_eos else ids

    def privileged_prefix_ids(self, text: str) -> list[int]:
        """Ids of ``"[Privileged Skill Information]\\n" + text + "\\n\\n"`` (spec §0).

        The teacher's prompt is these ids followed by the unchanged student
        prompt ids (they go before the system turn); the response ids follow verbatim.
        """
        return self._encode_text(PRIVILEGED_HEADER + text + "\n\n", at_start=True)


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
