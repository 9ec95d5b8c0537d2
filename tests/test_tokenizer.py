"""qlib.tokenizer against independent references.

Real-file tests compare with transformers' own GGUF tokenizer
(``AutoTokenizer.from_pretrained(dir, gguf_file=name)``). transformers ignores
``tokenizer.ggml.pre == "smollm"`` (it applies the plain GPT-2 split, without
SmolLM2's isolated digits), so ids are also compared with transformers' vocabulary
under SmolLM2's own pre-tokenizer (Digits + ByteLevel, as in its tokenizer.json
and llama.cpp); see ``test_transformers_gguf_ignores_smollm_digit_split``.
SentencePiece vocabularies are checked against ``sentencepiece`` itself.
"""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"  # transformers must never reach a hub
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import random  # noqa: E402
import unicodedata  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import pytest  # noqa: E402

from qlib import models  # noqa: E402
from qlib.tokenizer import (  # noqa: E402
    BYTE,
    CONTROL,
    NORMAL,
    PRE_TOKENIZERS,
    UNKNOWN,
    USER_DEFINED,
    TemplateError,
    Tokenizer,
    TokenOutputStream,
    byte_to_unicode,
)

VARIED = (Path(__file__).resolve().parent.parent / "data" / "tokenizer_cases.txt").read_text(
    encoding="utf-8"
)

CASES: dict[str, str] = {
    "varied": VARIED,
    **{f"paragraph{i}": p for i, p in enumerate(VARIED.split("\n\n"))},
    "empty": "",
    "space": " ",
    "leading_spaces": "   leading spaces",
    "trailing_spaces": "trailing spaces   ",
    "multiple_spaces": "a  b   c    d     e",
    "tabs": "\tone\t\ttwo\t \tthree",
    "newlines": "line one\nline two\n\nparagraph\n\n\nend\n",
    "crlf": "windows\r\nline\r\n\r\nendings\r\n",
    "digits": "0 1 2 3 4 5 6 7 8 9 10 42 2024",
    "long_number": "3141592653589793238462643383279502884197169399375105820974944592",
    "number_in_words": "abc123def 1st 2nd 3rd 4th x86_64 ipv4 1e-9 0.001",
    "accents": "é ü ñ É Ü Ñ àçèìòù crème brûlée über año",
    "combining": "e\u0301 u\u0308 n\u0303",  # decomposed accents
    "cjk": "中文测试 日本語のテキスト 한국어 텍스트",
    "emoji": "🙂🚀 👍🏿 ❤️ 🇯🇵",
    "emoji_zwj": "👩‍💻 👨‍👩‍👧‍👦 🏳️‍🌈 🧑🏽‍🚀",
    "special_tokens": "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "endoftext": "first document<|endoftext|>second document",
    "special_glued": "a<|im_end|>b <|im_start|> c<|endoftext|><|endoftext|>",
    "special_partial": "<|im_start|<|im_end <|endoftext",
    "contractions": "I'm, you're, he's, we've, they'll, I'd, don't, DON'T, O'Neil's",
    "punctuation": "!!! ??? ... --- ;;; ::: \"\" '' `` ~~~ ^^^ @@@ ### $$$ %%% &&& ***",
    "a_x1000": "a" * 1000,
    "ha_x500": "ha" * 500,
    "spaces_x300": " " * 300,
    "newlines_x100": "\n" * 100,
    "mixed_scripts": "Ελληνικά, עברית, العربية, हिन्दी, ไทย",
    "control_chars": "null\x00bell\x07esc\x1b del\x7f nbsp\u00a0zwsp\u200b bom\ufeff",
    "digits_after_blank_line": "List:\n\n1. one\n2. two",
    "digits_after_spaces": "x  1   22    333",
}


def has_digit_after_whitespace_run(text: str) -> bool:
    """Where transformers' GGUF tokenizer (plain GPT-2 split) and SmolLM2's split can differ."""
    return any(
        text[i - 2 : i].isspace() and unicodedata.category(text[i])[0] == "N"
        for i in range(2, len(text))
    )


# fixtures


def gguf_metadata(path: Path) -> dict[str, Any]:
    """Metadata as plain Python values: qlib.gguf if it works, else gguf-py."""
    try:
        from qlib.gguf import Content

        with open(path, "rb") as f:
            metadata = dict(Content.read(f).metadata)
        if isinstance(metadata.get("tokenizer.ggml.tokens"), list):
            return metadata
    except Exception:  # not written yet, or not working yet: use the reference reader
        pass
    return reader_metadata(path)


def reader_metadata(path: Path) -> dict[str, Any]:
    """gguf.GGUFReader fields converted to plain Python values."""
    from gguf import GGUFReader, GGUFValueType

    out: dict[str, Any] = {}
    for name, field in GGUFReader(path).fields.items():
        if not field.types:
            continue
        if field.types[0] == GGUFValueType.ARRAY:
            kind = field.types[-1]
            items = [field.parts[i] for i in field.data]
            if kind == GGUFValueType.STRING:
                out[name] = [bytes(p).decode("utf-8") for p in items]
            else:
                out[name] = [p.tolist()[0] for p in items]
        elif field.types[0] == GGUFValueType.STRING:
            out[name] = bytes(field.parts[field.data[0]]).decode("utf-8")
        else:
            out[name] = field.parts[field.data[0]].tolist()[0]
    return out


@pytest.fixture(scope="module")
def model_path() -> Path:
    try:
        return models.path()
    except models.ModelNotFoundError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def metadata(model_path: Path) -> dict[str, Any]:
    return gguf_metadata(model_path)


@pytest.fixture(scope="module")
def tok(metadata: dict[str, Any]) -> Tokenizer:
    return Tokenizer.from_metadata(metadata)


@pytest.fixture(scope="module")
def hf(model_path: Path):
    """transformers' tokenizer built from the same GGUF file (offline)."""
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(
        str(model_path.parent), gguf_file=model_path.name
    )


@pytest.fixture(scope="module")
def hf_smollm(hf):
    """transformers' vocabulary and merges under SmolLM2's own pre-tokenizer."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import pre_tokenizers

    backend = HFTokenizer.from_str(hf.backend_tokenizer.to_str())
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    return backend


# the real file


def test_metadata_fields(tok: Tokenizer):
    assert tok.model == "gpt2" and tok.pre == "smollm"
    assert tok.vocab_size == 49152
    assert (tok.bos_token_id, tok.eos_token_id) == (1, 2)
    assert tok.id_to_token(1) == "<|im_start|>" and tok.token_to_id("<|im_end|>") == 2
    assert tok.token_to_id("Ġthe") is not None and tok.token_to_id("no such token") is None
    assert tok.add_bos_token is False
    assert tok.stop_token_ids == {2}


def test_vocab_matches_transformers(tok: Tokenizer, hf):
    vocab = hf.get_vocab()
    assert len(vocab) == tok.vocab_size
    assert all(tok.id_to_token(i) == t for t, i in vocab.items())
    assert set(hf.all_special_ids) <= tok.special_ids
    assert tok.special_ids == set(range(17))  # the CONTROL tokens


@pytest.mark.parametrize("name", list(CASES))
def test_ids_match_transformers(tok: Tokenizer, hf, hf_smollm, name: str):
    text = CASES[name]
    ids = tok.encode(text)
    assert ids == hf_smollm.encode(text, add_special_tokens=False).ids
    if not has_digit_after_whitespace_run(text):
        assert ids == hf.encode(text, add_special_tokens=False)
    assert tok.encode(text, add_special_tokens=True) == ids  # add_bos_token is false


def test_transformers_gguf_ignores_smollm_digit_split(tok: Tokenizer, hf):
    # SmolLM2 isolates every digit before the GPT-2 split, so a run of blanks stays whole
    # ("ĠĠ" = 256, "ĊĊ" = 1116); the plain GPT-2 split keeps the last blank for the digit.
    assert tok.encode("  1") == [256, 33]
    assert hf.encode("  1", add_special_tokens=False) == [216, 216, 33]
    assert tok.encode("\n\n1") == [1116, 33]
    assert hf.encode("\n\n1", add_special_tokens=False) == [198, 198, 33]


def test_bytes_missing_from_vocab_are_dropped_like_transformers(tok: Tokenizer, hf):
    # SmolLM2's vocabulary lacks a few bytes (0x04, 0x06, ...): they are dropped, as in
    # transformers (llama.cpp has no token for them either).
    assert tok.token_to_id(byte_to_unicode()[0x04]) is None
    assert tok.encode("a\x04b") == hf.encode("a\x04b", add_special_tokens=False) == [81, 82]


def test_special_tokens_in_text(tok: Tokenizer):
    assert tok.encode("<|im_start|>user\nhi<|im_end|>") == [1, 4093, 198, 6004, 2]
    assert tok.encode("x<|endoftext|>y") == [104, 0, 105]
    plain = tok.encode("x<|endoftext|>y", parse_special=False)
    assert 0 not in plain and tok.decode(plain) == "x<|endoftext|>y"
    assert tok.encode("<|im_start|>") == [1]  # encode_special_tokens was restored


@pytest.mark.parametrize("name", list(CASES))
def test_decode_round_trip(tok: Tokenizer, hf, name: str):
    text = CASES[name]
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert "".join(tok.decode_incremental(ids)) == text
    assert tok.decode(ids) == hf.decode(ids, skip_special_tokens=False)
    assert tok.decode(ids, skip_special_tokens=True) == hf.decode(ids, skip_special_tokens=True)


def test_decode_random_ids_like_transformers(tok: Tokenizer, hf):
    # Arbitrary ids cut characters anywhere: both decode invalid UTF-8 lossily, alike.
    rng = random.Random(0)
    byte_tokens = [tok.token_to_id(c) for c in byte_to_unicode().values()]
    byte_tokens = [i for i in byte_tokens if i is not None]  # 0xF5.. never occur in UTF-8
    for _ in range(200):
        pool = byte_tokens if rng.random() < 0.5 else range(tok.vocab_size)
        ids = [rng.choice(pool) for _ in range(rng.randint(1, 12))]
        for skip in (False, True):
            text = tok.decode(ids, skip_special_tokens=skip)
            assert text == hf.decode(ids, skip_special_tokens=skip), ids
            assert "".join(tok.decode_incremental(ids, skip)) == text, ids


def test_stream_emits_only_complete_characters(tok: Tokenizer):
    text = "Zürich 👨‍👩‍👧‍👦 東京"
    ids = tok.encode(text)
    stream = TokenOutputStream(tok)
    pieces = [stream.next_token(i) for i in ids]
    assert "".join(pieces) + stream.decode_rest() == text
    assert "\ufffd" not in "".join(pieces)
    assert "" in pieces  # the emoji span several tokens: some tokens complete nothing
    assert stream.decode_all() == text and stream.tokens == ids
    stream.clear()
    assert stream.tokens == [] and stream.next_token(ids[0]) == "Z"
    cut = TokenOutputStream(tok)
    assert cut.next_token(tok.token_to_id("ð")) == ""  # first byte of a 4-byte character
    assert cut.decode_rest() == "\ufffd"


def test_decode_rejects_bad_ids(tok: Tokenizer):
    with pytest.raises(ValueError, match="out of range"):
        tok.decode([tok.vocab_size])
    with pytest.raises(ValueError, match="out of range"):
        tok.decode([-1])


# chat template

CONVERSATION = [
    {"role": "system", "content": "You are a terse assistant."},
    {"role": "user", "content": "What is Rust?"},
    {"role": "assistant", "content": "A systems programming language."},
    {"role": "user", "content": "Who made it?\nAnswer in one line."},
]


def test_chat_prompt_matches_transformers(tok: Tokenizer, hf):
    messages = [{"role": "user", "content": "What is Rust?"}]
    expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert tok.chat_prompt("What is Rust?") == expected
    assert tok.apply_chat_template(messages) == expected
    assert "You are a helpful AI assistant named SmolLM" in expected  # the template's default
    assert tok.encode(expected) == hf.encode(expected, add_special_tokens=False)


@pytest.mark.parametrize("generation_prompt", [True, False])
@pytest.mark.parametrize("turns", [2, 3, 4])
def test_multi_turn_template_matches_transformers(tok: Tokenizer, hf, turns, generation_prompt):
    for messages in (CONVERSATION[:turns], CONVERSATION[1 : turns + 1]):
        expected = hf.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt
        )
        assert tok.apply_chat_template(messages, generation_prompt) == expected


def test_chat_prompt_with_system(tok: Tokenizer):
    prompt = tok.chat_prompt("Hi", system="Be brief.")
    assert prompt == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_gguf_metadata_helper_reads_plain_values(metadata: dict[str, Any]):
    assert isinstance(metadata["tokenizer.ggml.tokens"][0], str)
    assert isinstance(metadata["tokenizer.ggml.token_type"][0], int)
    assert metadata["tokenizer.ggml.model"] == "gpt2"
    assert isinstance(metadata["tokenizer.ggml.add_bos_token"], bool)


@pytest.mark.peers
def test_ids_match_llama_cpp(tok: Tokenizer, model_path: Path):
    llama_cpp = pytest.importorskip("llama_cpp")
    llm = llama_cpp.Llama(str(model_path), vocab_only=True, verbose=False)
    for name, text in CASES.items():
        if text:
            ids = llm.tokenize(text.encode(), add_bos=False, special=True)
            assert tok.encode(text) == ids, name


# synthetic vocabularies (no model file needed)


def byte_level_metadata(**extra: Any) -> dict[str, Any]:
    """A tiny byte-level vocabulary: the 256 byte characters, a few merges, 3 specials."""
    chars = list(byte_to_unicode().values())
    specials = ["<s>", "</s>", "<think>"]
    merged = ["Ġt", "he", "Ġthe", "12"]
    tokens = specials + chars + merged
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt-2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [CONTROL, CONTROL, USER_DEFINED] + [NORMAL] * 260,
        "tokenizer.ggml.merges": ["Ġ t", "h e", "Ġt he", "1 2"],
        "tokenizer.ggml.bos_token_id": 0,
        "tokenizer.ggml.eos_token_id": 1,
        "tokenizer.chat_template": "{{ bos_token }}{% for m in messages %}"
        "{% if m['role'] == 'bad' %}{{ raise_exception('bad role') }}{% endif %}"
        "{{ m['content'] | tojson }}\n{% endfor %}",
        **extra,
    }


@pytest.mark.parametrize("pre", sorted(PRE_TOKENIZERS))
def test_every_pre_tokenizer_builds_and_round_trips(pre: str):
    tok = Tokenizer.from_metadata(byte_level_metadata(**{"tokenizer.ggml.pre": pre}))
    for text in CASES.values():
        assert tok.decode(tok.encode(text)) == text


def test_byte_level_synthetic():
    tok = Tokenizer.from_metadata(byte_level_metadata())
    the, twelve = tok.token_to_id("Ġthe"), tok.token_to_id("12")
    assert tok.encode(" the 12") == [the, tok.token_to_id("Ġ"), twelve]
    assert tok.encode("<s><think>x</s>") == [0, 2, tok.token_to_id("x"), 1]
    assert tok.decode([0, 2, 1], skip_special_tokens=True) == "<think>"  # user-defined stays
    assert tok.encode("a", add_special_tokens=True) == [tok.token_to_id("a")]


def test_add_bos_and_eos_token():
    meta = byte_level_metadata(
        **{"tokenizer.ggml.add_bos_token": True, "tokenizer.ggml.add_eos_token": True}
    )
    tok = Tokenizer.from_metadata(meta)
    a = tok.token_to_id("a")
    assert tok.encode("a", add_special_tokens=True) == [0, a, 1]
    assert tok.encode("a") == [a]
    # llama-bpe adds BOS unless the file says otherwise
    llama3 = Tokenizer.from_metadata(byte_level_metadata(**{"tokenizer.ggml.pre": "llama-bpe"}))
    assert llama3.encode("a", add_special_tokens=True) == [0, a]


def test_template_helpers():
    tok = Tokenizer.from_metadata(byte_level_metadata())
    assert tok.apply_chat_template([{"role": "u", "content": 'é"x'}]) == '<s>"é\\"x"\n'
    with pytest.raises(TemplateError, match="bad role"):
        tok.apply_chat_template([{"role": "bad", "content": ""}])
    no_template = byte_level_metadata()
    del no_template["tokenizer.chat_template"]
    with pytest.raises(ValueError, match="chat_template"):
        Tokenizer.from_metadata(no_template).chat_prompt("hi")


def test_unsupported_vocabularies_fail_clearly():
    with pytest.raises(NotImplementedError, match="'no-such-pre'"):
        Tokenizer.from_metadata(byte_level_metadata(**{"tokenizer.ggml.pre": "no-such-pre"}))
    with pytest.raises(NotImplementedError, match="'bert'"):
        Tokenizer.from_metadata(byte_level_metadata(**{"tokenizer.ggml.model": "bert"}))
    with pytest.raises(ValueError, match="tokens"):
        Tokenizer.from_metadata({"tokenizer.ggml.model": "gpt2"})


SPM_TEXTS = [
    "Hello world",
    " leading space",
    "two  spaces and   three",
    "trailing ",
    "tabs\tand\nnewlines\n\n",
    "unseen characters: 東京 👩‍💻 ∑",
    "numbers 3.14159 and 1,234,567",
    "",
]


@pytest.fixture(scope="module")
def spm(tmp_path_factory):
    """A small SentencePiece BPE model with byte fallback, trained here, and its GGUF metadata."""
    spm_lib = pytest.importorskip("sentencepiece")
    prefix = tmp_path_factory.mktemp("spm") / "m"
    spm_lib.SentencePieceTrainer.train(
        sentence_iterator=iter(VARIED.splitlines() * 4),
        model_prefix=str(prefix),
        model_type="bpe",
        vocab_size=600,
        byte_fallback=True,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        split_digits=True,
        character_coverage=1.0,
        minloglevel=2,
    )
    sp = spm_lib.SentencePieceProcessor(model_file=f"{prefix}.model")
    n = sp.get_piece_size()
    types = [
        CONTROL
        if sp.is_control(i)
        else UNKNOWN
        if sp.is_unknown(i)
        else BYTE
        if sp.is_byte(i)
        else NORMAL
        for i in range(n)
    ]
    meta = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": [sp.id_to_piece(i) for i in range(n)],
        "tokenizer.ggml.scores": [sp.get_score(i) for i in range(n)],
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.bos_token_id": sp.bos_id(),
        "tokenizer.ggml.eos_token_id": sp.eos_id(),
        "tokenizer.ggml.unknown_token_id": sp.unk_id(),
        "tokenizer.ggml.add_space_prefix": True,
    }
    return sp, Tokenizer.from_metadata(meta)


@pytest.mark.parametrize("text", SPM_TEXTS)
def test_sentencepiece_vocab_matches_sentencepiece(spm, text: str):
    sp, tok = spm
    ids = tok.encode(text)
    assert ids == sp.encode(text)
    assert tok.decode(ids) == text == sp.decode(ids)
    assert "".join(tok.decode_incremental(ids)) == text
    assert tok.encode(text, add_special_tokens=True) == [sp.bos_id(), *ids]


def test_sentencepiece_special_tokens(spm):
    sp, tok = spm
    ids = tok.encode("<s>Hi</s>")
    assert ids[0] == sp.bos_id() and ids[-1] == sp.eos_id()
    assert ids[1:-1] == sp.encode("Hi")  # a space is prefixed after a special token, as llama.cpp
    assert tok.decode(ids, skip_special_tokens=True) == "Hi"
