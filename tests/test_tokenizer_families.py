"""The model families' real tokenizers and chat templates (tests/tokenizer_families.py): each loads, renders a
conversation with its turn markers, and encodes what its files say it encodes. The asserts also pin down the
differences between families that chat formatting code has to get right: which templates trim, which emit a
BOS that the tokenizer adds again, what eos each names against the end-of-turn token its template writes, and
whether a text segment encodes alike on its own and after a special token."""

from __future__ import annotations

import importlib.metadata
import os
import re
from pathlib import Path

import jinja2
import pytest
from transformers import PreTrainedTokenizerFast

from tests import tokenizer_families as tf

ROOT = Path(__file__).resolve().parents[1]
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "Bye"},
]
NO_SYSTEM = CHAT[1:]
CUTOFF = "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n"
# CHAT rendered with add_generation_prompt=True, as each family's template writes it.
RENDERED = {
    "smollm2": "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n"
               "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n",
    "qwen2.5": "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n"
               "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n",
    "llama3.1": "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n" + CUTOFF + "Be brief.<|eot_id|>"
                "<|start_header_id|>user<|end_header_id|>\n\nHi there<|eot_id|>"
                "<|start_header_id|>assistant<|end_header_id|>\n\nHello!<|eot_id|>"
                "<|start_header_id|>user<|end_header_id|>\n\nBye<|eot_id|>"
                "<|start_header_id|>assistant<|end_header_id|>\n\n",
    # No generation prompt in Mistral's format; the system message goes into the last user turn.
    "mistral-v0.3": "<s>[INST] Hi there[/INST] Hello!</s>[INST] Be brief.\n\nBye[/INST]",
    # The system message goes into the first user turn.
    "gemma3": "<bos><start_of_turn>user\nBe brief.\n\nHi there<end_of_turn>\n<start_of_turn>model\nHello!<end_of_turn>\n"
              "<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n",
    "phi3.5": "<|system|>\nBe brief.<|end|>\n<|user|>\nHi there<|end|>\n<|assistant|>\nHello!<|end|>\n"
              "<|user|>\nBye<|end|>\n<|assistant|>\n",
}
RENDERED["qwen3"] = RENDERED["qwen2.5"]
RENDERED["llama3.2"] = RENDERED["llama3.1"]
# Gemma 2's template refuses a system message: NO_SYSTEM instead.
RENDERED["gemma2"] = ("<bos><start_of_turn>user\nHi there<end_of_turn>\n<start_of_turn>model\nHello!<end_of_turn>\n"
                      "<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n")

# Token -> id, as the package files list them (tokenizer.json, the sp model, the GGUF's token list).
QWEN_IDS = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645, "<tool_call>": 151657,
            "<tool_response>": 151665, "<think>": 151667, "</think>": 151668}
LLAMA_IDS = {"<|begin_of_text|>": 128000, "<|end_of_text|>": 128001, "<|finetune_right_pad_id|>": 128004,
             "<|start_header_id|>": 128006, "<|end_header_id|>": 128007, "<|eom_id|>": 128008,
             "<|eot_id|>": 128009, "<|python_tag|>": 128010}
GEMMA_IDS = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3, "<start_of_turn>": 105, "<end_of_turn>": 106, "\n": 107}
KNOWN_IDS = {
    "smollm2": {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2},
    "qwen2.5": QWEN_IDS, "qwen3": QWEN_IDS, "llama3.1": LLAMA_IDS, "llama3.2": LLAMA_IDS,
    "mistral-v0.3": {"<unk>": 0, "<s>": 1, "</s>": 2, "[INST]": 3, "[/INST]": 4, "[TOOL_CALLS]": 5,
                     "[AVAILABLE_TOOLS]": 6, "[/AVAILABLE_TOOLS]": 7, "[TOOL_RESULTS]": 8, "[/TOOL_RESULTS]": 9},
    "gemma2": GEMMA_IDS, "gemma3": GEMMA_IDS,
    "phi3.5": {"<unk>": 0, "<s>": 1, "</s>": 2, "<|endoftext|>": 32000, "<|assistant|>": 32001, "<|system|>": 32006,
               "<|end|>": 32007, "<|user|>": 32010},
}
# (eos the tokenizer names, the token the template ends a turn with): the same only for ChatML and Mistral.
EOS_AND_END_OF_TURN = {
    "smollm2": ("<|im_end|>", "<|im_end|>"), "qwen2.5": ("<|im_end|>", "<|im_end|>"),
    "qwen3": ("<|im_end|>", "<|im_end|>"), "llama3.1": ("<|end_of_text|>", "<|eot_id|>"),
    "llama3.2": ("<|end_of_text|>", "<|eot_id|>"), "mistral-v0.3": ("</s>", "</s>"),
    "gemma2": ("<eos>", "<end_of_turn>"), "gemma3": ("<eos>", "<end_of_turn>"), "phi3.5": ("<|endoftext|>", "<|end|>"),
}


def _render(tok, messages, **kw) -> str:
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kw)


def test_records_name_every_family_with_pinned_packages_and_a_licence():
    assert tuple(tf.FAMILIES) == tf.FAMILY_KEYS
    for key, fam in tf.FAMILIES.items():
        assert fam.key == key and fam.display and fam.licence and fam.note
        assert fam.packages and all(re.fullmatch(r"[\w.-]+==[\w.]+", p) for p in fam.packages), fam.packages


def test_the_makefile_installs_exactly_the_pins():
    make = (ROOT / "Makefile").read_text()
    target = make[make.index("$(TOKENIZER_FILES):"):]
    for pin in (*tf.PINS, tf.LLAMA_CPP):
        assert pin in make, f"{pin} is not in the Makefile"
    assert "--no-deps" in target and "test-main: $(STAMP) $(TOKENIZER_FILES)" in make
    for plain in ("install", "demo"):  # they install none of it
        assert "TOKENIZER" not in re.search(rf"^{plain}:.*$", make, re.M).group()
    assert "OPSD_REQUIRE_TOKENIZER_FILES=1" in (ROOT / ".ci" / "run").read_text()


@pytest.mark.parametrize("pin", tf.PINS)
def test_installed_versions_are_the_pins(pin):
    name, version = pin.split("==")
    try:
        installed = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        if os.environ.get(tf.REQUIRE_ENV) == "1":
            pytest.fail(f"{pin} is not installed ({tf.REQUIRE_ENV}=1)")
        pytest.skip(f"{pin} is not installed: {tf.INSTALL_HINT}")
    assert installed == version, f"{name} {installed} installed, {version} pinned: rm .venv/.tokenizer-files, make test"


@pytest.mark.parametrize("key", tf.FAMILY_KEYS)
def test_loads_and_renders_the_turn_markers(key):
    tok = tf.family_or_skip(key)
    assert isinstance(tok, PreTrainedTokenizerFast)
    messages = NO_SYSTEM if key == "gemma2" else CHAT
    assert _render(tok, messages) == RENDERED[key]
    # ... and each end-of-turn marker in it encodes as its one id.
    ids = tok.encode(RENDERED[key], add_special_tokens=False)
    end_of_turn = EOS_AND_END_OF_TURN[key][1]
    assert ids.count(tok.convert_tokens_to_ids(end_of_turn)) == RENDERED[key].count(end_of_turn) > 0


def test_gemma2_template_refuses_a_system_message():
    tok = tf.family_or_skip("gemma2")
    with pytest.raises(jinja2.TemplateError, match="System role not supported"):
        _render(tok, CHAT)


@pytest.mark.parametrize("key", tf.FAMILY_KEYS)
def test_known_ids(key):
    tok = tf.family_or_skip(key)
    for token, token_id in KNOWN_IDS[key].items():
        assert tok.convert_tokens_to_ids(token) == token_id, token
        assert tok.encode(token, add_special_tokens=False) == [token_id], token


@pytest.mark.parametrize("key", tf.FAMILY_KEYS)
def test_eos_is_not_always_the_end_of_turn_token(key):
    tok = tf.family_or_skip(key)
    eos, end_of_turn = EOS_AND_END_OF_TURN[key]
    assert tok.eos_token == eos
    assert end_of_turn in _render(tok, NO_SYSTEM if key == "gemma2" else CHAT)


@pytest.mark.parametrize(("key", "name"), [("qwen3", "qwen2"), ("llama3.1", "llama-bpe"), ("phi3.5", "phi-3")])
def test_agrees_with_llama_cpps_reference_encodings(key, name):
    """llama.cpp's NAME.gguf.inp/.out: 46 texts (spaces, newlines, digits, emoji, Khmer, ...) and the ids Hugging
    Face's own tokenizer of that model gave them."""
    tok = tf.family_or_skip(key)
    texts = tf.llama_cpp_file(f"ggml-vocab-{name}.gguf.inp").read_text("utf-8").split("\n__ggml_vocab_test__\n")
    expected = tf.llama_cpp_file(f"ggml-vocab-{name}.gguf.out").read_text().split("\n")
    assert len(texts) == len(expected) == 47 and texts[-1] == expected[-1] == ""
    wrong = [(text, ids) for text, ids in zip(texts, expected)
             if tok.encode(text, add_special_tokens=False) != [int(i) for i in ids.split()]]
    assert wrong == []


def test_llama3_keeps_a_word_the_vocabulary_holds_whole():
    # Why the loader sets ignore_merges: the package's tokenizer.json alone gives 5 ids here.
    tok = tf.family_or_skip("llama3.1")
    assert tok.encode("Cửa Việt", add_special_tokens=False) == [34, 91163, 101798]


def test_mistral_agrees_with_its_sentencepiece_model():
    tok = tf.family_or_skip("mistral-v0.3")
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_file=str(tf.mistral_sp_model()))
    texts = ["Hello world", "ied 4 ½ months", "Äpfel", "a\n\nb\tc", "Hello\n    Hello", "333333333",
             "нещо на Български", "🚀 (normal) 😶\u200d🌫️", "Hello, y'all! How are you 😁 ?我想",
             "x[REFERENCE_DOC_1]y"]
    for text in texts:
        assert tok.encode(text, add_special_tokens=False) == sp.encode(text), text
    # A text that starts with a space: sentencepiece prepends its '▁' regardless, the fast tokenizer does not.
    assert sp.encode(" Hello") == [29473, 23325] and tok.encode(" Hello", add_special_tokens=False) == [23325]
    # The chat as mistral-common's v3 tokenizer builds it: <s>, [INST] sp(user) [/INST], sp(answer) </s>, and
    # the system message before the last user message.
    ids = tok.encode(RENDERED["mistral-v0.3"], add_special_tokens=False)
    assert ids == [1, 3, *sp.encode("Hi there"), 4, *sp.encode("Hello!"), 2, 3, *sp.encode("Be brief.\n\nBye"), 4]


@pytest.mark.parametrize(("key", "alone", "after_marker"), [
    # (family, "Hi" encoded on its own, "Hi" right after a special token). Byte-level BPE and Gemma add no prefix;
    # Mistral prepends '▁' at the start of the text only, Phi-3 (legacy) to every segment, after specials too.
    ("qwen3", ["Hi"], ["Hi"]), ("llama3.1", ["Hi"], ["Hi"]), ("smollm2", ["Hi"], ["Hi"]),
    ("gemma3", ["Hi"], ["Hi"]), ("mistral-v0.3", ["▁Hi"], ["Hi"]), ("phi3.5", ["▁Hi"], ["▁Hi"]),
])
def test_a_segment_alone_and_after_a_special_token(key, alone, after_marker):
    tok = tf.family_or_skip(key)
    assert tok.convert_ids_to_tokens(tok.encode("Hi", add_special_tokens=False)) == alone
    marker = tok.eos_token
    assert tok.convert_ids_to_tokens(tok.encode(marker + "Hi", add_special_tokens=False))[1:] == after_marker


def test_phi35_writes_a_space_piece_before_each_newline_after_a_marker():
    tok = tf.family_or_skip("phi3.5")
    assert tok.encode("<|user|>\nHi<|end|>\n", add_special_tokens=False) == [32010, 29871, 13, 18567, 32007, 29871, 13]


@pytest.mark.parametrize(("key", "trimmed"), [
    ("smollm2", set()), ("qwen2.5", set()), ("qwen3", set()), ("phi3.5", set()),
    ("llama3.1", {"user", "assistant"}), ("mistral-v0.3", {"assistant"}), ("gemma3", {"user", "assistant"}),
])
def test_which_templates_trim_message_contents(key, trimmed):
    tok = tf.family_or_skip(key)
    text = _render(tok, [{"role": "user", "content": " q "}, {"role": "assistant", "content": " a "},
                         {"role": "user", "content": " r "}])
    assert (" q " not in text) == ("user" in trimmed) and (" a " not in text) == ("assistant" in trimmed), text


@pytest.mark.parametrize(("key", "bos_in_template", "bos_added_on_encode"), [
    ("smollm2", False, False), ("qwen3", False, False), ("llama3.1", True, True), ("mistral-v0.3", True, True),
    ("gemma3", True, True), ("phi3.5", False, True),
])
def test_bos_from_the_template_and_from_encode(key, bos_in_template, bos_added_on_encode):
    """Where both hold, encoding a rendered chat with add_special_tokens=True starts with two BOS ids. (SmolLM2's
    bos_token is <|im_start|>, which its template writes as a turn marker, never as bos_token.)"""
    tok = tf.family_or_skip(key)
    text = _render(tok, NO_SYSTEM)
    assert ("bos_token" in tok.chat_template) == bos_in_template
    assert text.startswith(tok.bos_token or "<none>") == (bos_in_template or key == "smollm2")
    ids = tok.encode("x")
    added = len(ids) > len(tok.encode("x", add_special_tokens=False))
    assert (added and ids[0] == tok.bos_token_id) == bos_added_on_encode
    if bos_in_template and bos_added_on_encode:
        assert tok.encode(text)[:2] == [tok.bos_token_id] * 2


def test_qwen3_template_thinks_and_qwen25_does_not():
    qwen3, qwen25 = tf.family_or_skip("qwen3"), tf.family_or_skip("qwen2.5")
    assert _render(qwen3, NO_SYSTEM, enable_thinking=False).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    done = [*NO_SYSTEM, {"role": "assistant", "content": "Bye!", "reasoning_content": "They left."}]
    text = qwen3.apply_chat_template(done, tokenize=False)
    assert text.endswith("<|im_start|>assistant\n<think>\nThey left.\n</think>\n\nBye!<|im_end|>\n")
    assert "<think>" not in text.split("<|im_start|>user\nBye")[0]  # reasoning before the last user turn: dropped
    # <think> is an added token but not a special one: skip_special_tokens keeps it.
    assert qwen3.decode([151667, 9707], skip_special_tokens=True) == "<think>Hello"
    # qwen2.5's template knows no thinking, and adds Qwen's system prompt when none is given.
    assert "<think>" not in qwen25.apply_chat_template(done, tokenize=False)
    assert _render(qwen25, NO_SYSTEM).startswith("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud.")
    assert not _render(qwen3, NO_SYSTEM).startswith("<|im_start|>system")


def test_gemma3_words_and_bytes():
    tok = tf.family_or_skip("gemma3")
    assert tok.encode("Hello world", add_special_tokens=False) == [9259, 1902]
    text = "Hello  world\n\n x é😀 ½ 333"
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


def test_a_missing_package_skips_or_fails_with_the_reason(monkeypatch):
    with pytest.raises(tf.FamilyUnavailable, match="no-such-package==1 is not installed"):
        tf.package_dir("no-such-package==1", "no_such_package")

    def missing(key):
        raise tf.FamilyUnavailable("not here")

    monkeypatch.setattr(tf, "load_tokenizer", missing)
    monkeypatch.delenv(tf.REQUIRE_ENV, raising=False)
    with pytest.raises(pytest.skip.Exception, match="gemma3: not here"):
        tf.family_or_skip("gemma3")
    monkeypatch.setenv(tf.REQUIRE_ENV, "1")
    with pytest.raises(pytest.fail.Exception, match="not here"):
        tf.family_or_skip("gemma3")
