"""Tokenizer and chat template from a GGUF file's metadata, with llama.cpp's ids.

A GGUF file has no ``tokenizer.json``: it stores the vocabulary under llama.cpp's
keys (``tokenizer.ggml.*``). ``Tokenizer.from_metadata`` reads them as llama.cpp's
``llama-vocab.cpp`` does, and ``encode`` gives the ids ``llama_tokenize`` gives:

- Special tokens first: the text of every CONTROL, USER_DEFINED and UNKNOWN token is
  cut out of the input, longest token first (``parse_special=False`` leaves CONTROL and
  UNKNOWN text as plain text; USER_DEFINED tokens are always matched). Tokens that
  llama.cpp recognises by their text (``<|eot_id|>``, ``<|im_end|>``, ``<|fim_prefix|>``,
  ...) count as CONTROL whatever their type says, as there.
- ``tokenizer.ggml.model == "gpt2"``: each remaining piece is split with the regexes
  llama.cpp uses for ``tokenizer.ggml.pre`` (``PRE_TOKENIZERS``; written for the
  ``tokenizers`` library so that they split as llama.cpp's own matchers do), then
  byte-level BPE with ``merges``.
- ``tokenizer.ggml.model == "llama"`` (SentencePiece): each piece gets a leading space
  (``add_space_prefix``: at the start and after every special token), spaces become ``▁``,
  and llama.cpp's SentencePiece merge runs: the adjacent pair whose join is a token with
  the best ``score`` merges first (the leftmost on ties); characters without a token
  fall back to ``<0xXX>`` byte tokens.
- ``add_special_tokens=True`` adds BOS/EOS where ``add_bos_token``/``add_eos_token``
  (or llama.cpp's default for the vocabulary) say so.

``backend`` is the same tokenizer as a ``tokenizers.Tokenizer`` (what ``qlib.convert``
writes as ``tokenizer.json``); it agrees with ``encode`` except where the ``tokenizers``
library cannot express llama.cpp (SentencePiece ties, the order special tokens are found).

Decoding maps each token to its bytes (byte-level alphabet, ``▁`` or ``<0xXX>``;
CONTROL and USER_DEFINED tokens as written), so ``decode`` and the streaming
``TokenOutputStream`` agree byte for byte.
"""

from __future__ import annotations

import codecs
import heapq
import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as _HFTokenizer

from .gguf import Content

# tokenizer.ggml.token_type values (llama.cpp's llama_token_type)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

SPM_SPACE = "\u2581"  # ▁, SentencePiece's visible space

# ----------------------------------------------------------------------------- pre-tokenizers
#
# llama.cpp splits text with a list of regexes, each applied to every piece the previous
# ones left; matches and the text between them both become pieces (the tokenizers
# library's Split(..., "isolated")). It runs a few regexes with hand-written matchers
# (GPT-2's, Llama 3's, the digit grouping of AFMoE and Tiny Aya) and every other one with
# std::regex on a stand-in text: a character above U+007F becomes one byte naming its
# category (letter, number, punctuation, mark, symbol, other) or \x0B if it is
# whitespace, and \p{..} becomes the matching byte class. The regexes below are
# llama.cpp's, rewritten where that makes them mean something else than in Oniguruma
# (the tokenizers library's engine):
# - \p{Lu}, \p{Ll}, \p{Lt}, \p{Lm}, \p{Lo} all mean any letter there (one stand-in byte);
# - a literal character range does not match whitespace above U+007F (it is \x0B there);
# - \d is ASCII-only (std::regex, "C" locale);
# - (?i:'s|...) is spelt out as '[sS]|..., as llama.cpp does (Oniguruma's case folding
#   would also take e.g. "'ſ").
# tests/test_tokenizer.py checks every one against llama.cpp itself.


def _chars(*ranges: int | tuple[int, int]) -> str:
    """Body of a character class: code points and (first, last) ranges above U+007F."""
    out = []
    for r in ranges:
        a, b = r if isinstance(r, tuple) else (r, r)
        if min(a, b) < 0x80:
            raise ValueError("ASCII belongs in the pattern text, escaped")
        out.append(chr(a) if a == b else f"{chr(a)}-{chr(b)}")
    return "".join(out)


def _no_space(cls: str) -> str:
    """One character of ``[cls]`` that is not whitespace (see above)."""
    return rf"(?:(?!\s)[{cls}])"


_CONTRACTION = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (
    _CONTRACTION + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    _CONTRACTION + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35 = (
    _CONTRACTION + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_JAIS2 = (
    _CONTRACTION
    + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    + "".join(rf"|\s{{{n}}}(?!\S)" for n in (512, 256, 128, 64, 32, 16, 8, 4))
    + r"|\s{1,2}(?!\S)|\s{1}"
)
_BAILING = (
    r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+"
)
_SEED_CODER = (
    _CONTRACTION + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}"
    r"| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_UFAKZEKA = r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_EXAONE_MOE = (
    _CONTRACTION + r"|[^\r\n\p{L}\p{N}]?(?:\p{L}\p{M}*(?: \p{L}\p{M}*)*)+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n/]?|\s*[\r\n]|\s+(?!\S)|\s+"
)
_MINICPM5 = (
    _CONTRACTION + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}+"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _cased(letters: str, numbers: str, contraction: str, tail: str = r"[\r\n/]*") -> str:
    """GPT-4o-style split: an upper-then-lower run of ``letters`` items, numbers, the rest."""
    up = rf"(?:(?={letters})[^a-z])"  # llama.cpp: a letter that is not a-z ...
    low = rf"(?:(?={letters})[^A-Z])"  # ... and one that is not A-Z
    pre = r"[^\r\n\p{L}\p{N}]?"
    return (
        rf"{pre}{up}*{low}+{contraction}|{pre}{up}+{low}*{contraction}"
        rf"|{numbers}| ?[^\s\p{{L}}\p{{N}}]+{tail}|\s*[\r\n]+|\s+(?!\S)|\s+"
    )


_GPT4O = _cased(r"\p{L}", r"\p{N}{1,3}", _CONTRACTION + "?")
_TEKKEN = _cased(r"\p{L}", r"\p{N}", "")
_GRANITE_MULTI = _cased(r"[\p{L}\p{M}]", r"\p{N}{1,3}", _CONTRACTION + "?")


def _any_case(numbers: str) -> str:
    """The original GPT-4o regex as llama.cpp runs it: \\p{Lu}.. \\p{Lo} all mean any letter."""
    lm = r"[\p{L}\p{M}]"
    pre = r"[^\r\n\p{L}\p{N}]?"
    c = _CONTRACTION + "?"
    return (
        rf"{pre}{lm}*{lm}+{c}|{pre}{lm}+{lm}*{c}|{numbers}"
        r"| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
    )


# DeepSeek LLM: cased letters (Lu, Ll, Lt) of the scripts its tokenizer.json lists
_DEEPSEEK_LETTERS = _chars(
    0xB5, (0xC0, 0xD6), (0xD8, 0xF6), (0xF8, 0x1BA), (0x1BC, 0x1BF), (0x1C4, 0x293),
    (0x295, 0x2AF), (0x370, 0x373), 0x376, 0x377, (0x37B, 0x37D), 0x37F, 0x386,
    (0x388, 0x38A), 0x38C, (0x38E, 0x3A1), (0x3A3, 0x3F5), (0x3F7, 0x481), (0x48A, 0x52F),
    (0x531, 0x556), (0x10A0, 0x10C5), (0x13A0, 0x13F5), (0x13F8, 0x13FD), (0x1C90, 0x1CBA),
    (0x1CBD, 0x1CBF), (0x1D00, 0x1D2B), (0x1D6B, 0x1D77), (0x1D79, 0x1D9A), (0x1E00, 0x1F15),
    (0x1F18, 0x1F1D), (0x1F20, 0x1F45), (0x1F48, 0x1F4D), (0x1F50, 0x1F57), 0x1F59, 0x1F5B,
    0x1F5D, (0x1F5F, 0x1F7D), (0x1F80, 0x1FB4), (0x1FB6, 0x1FBC), 0x1FBE, (0x1FC2, 0x1FC4),
    (0x1FC6, 0x1FCC), (0x1FD0, 0x1FD3), (0x1FD6, 0x1FDB), (0x1FE0, 0x1FEC), (0x1FF2, 0x1FF4),
    (0x1FF6, 0x1FFC), 0x2102, 0x2107, (0x210A, 0x2113), 0x2115, (0x2119, 0x211D), 0x2124,
    0x2126, 0x2128, (0x212A, 0x212D), (0x212F, 0x2134), 0x2139, (0x213C, 0x213F),
    (0x2145, 0x2149), 0x214E, 0x2183, 0x2184, (0x2C00, 0x2C7B), (0x2C7E, 0x2CE4),
    (0x2CEB, 0x2CEE), 0x2CF2, 0x2CF3, (0xA640, 0xA66D), (0xA680, 0xA69B), (0xA722, 0xA76F),
    (0xA771, 0xA787), (0xA78B, 0xA78E), (0xAB70, 0xABBF), (0xFB00, 0xFB06), (0xFB13, 0xFB17),
    (0xFF21, 0xFF3A), (0xFF41, 0xFF5A), (0x10400, 0x1044F), (0x104B0, 0x104D3),
    (0x104D8, 0x104FB), (0x10C80, 0x10CB2), (0x10CC0, 0x10CF2), (0x118A0, 0x118DF),
    (0x1E900, 0x1E943),
)  # fmt: skip
# fullwidth ASCII punctuation, quotation marks, 、。 (U+3000, the ideographic space, is
# in DeepSeek's range but never matches in llama.cpp: it is whitespace)
_DEEPSEEK_PUNCT = _chars((0xFF01, 0xFF0F), (0xFF1A, 0xFF5E), (0x2018, 0x201F), (0x3001, 0x3002))
# CJK ideographs U+4E00-U+9FA5, U+0800-U+4E00 (sic) and Hangul U+AC00-U+D7FF, but not the
# whitespace among them
_DEEPSEEK_CJK = _no_space(_chars((0x4E00, 0x9FA5), (0x800, 0x4E00), (0xAC00, 0xD7FF))) + "+"
# CJK ideographs, hiragana, katakana
_CJK_KANA = "[" + _chars((0x4E00, 0x9FA5), (0x3040, 0x309F), (0x30A0, 0x30FF)) + "]+"
_PS = r"\p{P}\p{S}"
_DEEPSEEK3_WORDS = (
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+"
    rf"|[^\r\n\p{{L}}{_PS}]?[\p{{L}}\p{{M}}]+| ?[{_PS}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPARK_WORDS = (
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+"
    rf"|[^\r\n\p{{L}}{_PS}]?[\p{{L}}\p{{M}}]+| ?[{_PS}]+|[\r\n]|\s+(?!\S)|\s+"
)
_YOUTU_CJK = "|".join(
    "[" + c + "]+"
    for c in (
        _chars((0xAC00, 0xD7A3), (0x3131, 0x318E)),  # Hangul syllables, jamo
        _chars(0xFF01, 0x2026, 0x201C, 0x201D, 0x2018, 0x2019, 0x2014, 0xFF1A, 0xFF1B, 0xFF0C,
               (0x3001, 0x303F), (0xFE30, 0xFE4F)),  # CJK punctuation
        _chars((0x3105, 0x312F)),  # bopomofo
        _chars((0x4E00, 0x9FA5), (0x3040, 0x309F), (0x30A0, 0x30FF)),
    )
)  # fmt: skip
# AFMoE: CJK (from U+8C48, sic), kana, Kangxi radicals, halfwidth katakana, Thai (from
# U+0E40), Lao, Khmer, Myanmar, Hangul
_AFMOE_ASIAN = "[" + _chars(
    (0x4E00, 0x9FFF), (0x3400, 0x4DBF), (0x8C48, 0xFAFF), (0x3040, 0x309F), (0x30A0, 0x30FF),
    (0xFF65, 0xFF9F), (0x2F00, 0x2FDF), (0x0E40, 0x0E7F), (0x0E80, 0x0EFF), (0x1780, 0x17FF),
    (0x1000, 0x109F), (0xAA60, 0xAA7F), (0xA9E0, 0xA9FF), (0xAC00, 0xD7AF), (0x1100, 0x11FF),
) + "]+"  # fmt: skip
# llama.cpp's digit grouping for AFMoE and Tiny Aya (hand-written there): a run of digits
# splits into groups of three from the right, the text before a run staying with its
# first group.
_DIGIT_GROUPS = (r"\p{N}{1,3}(?=(?:\p{N}{3})*(?!\p{N}))", "merged_with_previous")
# Bloom, Poro: anything but whitespace and . , ! ? … 。 ， 、 । ۔ ، ( | )
_PORO = r" ?[^(\s|.,!?" + _chars(0x2026, 0x3002, 0xFF0C, 0x3001, 0x964, 0x6D4, 0x60C) + ")]+"


@dataclass(frozen=True)
class PreTokenizer:
    """How llama.cpp prepares text for one ``tokenizer.ggml.pre`` value.

    ``regexes`` split as llama.cpp does, each an isolating split or ``(regex, behavior)``
    for another ``tokenizers.pre_tokenizers.Split`` behavior; ``hf_regexes``, where given,
    are the original ``tokenizer.json`` regexes llama.cpp's differ from (``qlib.convert``
    matches both).
    """

    regexes: tuple[str | tuple[str, str], ...]  # a regex, or (regex, tokenizers' behavior)
    ignore_merges: bool = False  # a word that is itself a token is not merged
    add_bos: bool = False  # default for add_bos_token when the file does not say
    hf_regexes: tuple[str | tuple[str, str], ...] | None = None


def _names(names: str, spec: PreTokenizer) -> dict[str, PreTokenizer]:
    return dict.fromkeys(names.split(), spec)


_ORIGINAL_GPT4O = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_ORIGINAL_TEKKEN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Every byte-level BPE pre-tokenizer of llama.cpp's llama-vocab.cpp, by tokenizer.ggml.pre
# (the first name of a group is the one qlib.convert writes for it).
PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    "default": PreTokenizer((r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]")),
    **_names(
        "gpt-2 phi-2 mpt olmo jais jina-es jina-de jina-v2-es jina-v2-de jina-v1-en jina-v2-code"
        " roberta-bpe gigachat a.x-4.0 mellum modern-bert exaone4 trillion granite-docling",
        PreTokenizer((_GPT2,)),
    ),
    **_names(
        "smollm starcoder refact command-r codeshell exaone minerva-7b mellum2",
        PreTokenizer((r"\p{N}", _GPT2)),
    ),
    **_names(
        "llama3 llama-v3 llama-bpe falcon3 falcon-h1 pixtral midm-2.0 lfm2 jina-v5-nano",
        PreTokenizer((_LLAMA3,), ignore_merges=True, add_bos=True),
    ),
    **_names("dbrx smaug-bpe glm4 chatglm-bpe", PreTokenizer((_LLAMA3,))),
    **_names(
        "qwen2 deepseek-r1-qwen stablelm2 megrez kormo f2llmv2 hunyuan solar-open grok-2",
        PreTokenizer((_QWEN2,)),
    ),
    "falcon": PreTokenizer((r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]")),
    **_names(
        "gpt-4o llama4 kanana2 talkie minimax-m2",
        PreTokenizer((_GPT4O,), hf_regexes=(_ORIGINAL_GPT4O,)),
    ),
    "tekken": PreTokenizer(
        (_TEKKEN,), ignore_merges=True, add_bos=True, hf_regexes=(_ORIGINAL_TEKKEN,)
    ),
    "deepseek-llm": PreTokenizer(
        (
            r"[\r\n]",
            rf"\s?[A-Za-z{_DEEPSEEK_LETTERS}]+",
            rf"\s?[!-/:-~{_DEEPSEEK_PUNCT}]+",
            r"\s+\z",
            _DEEPSEEK_CJK,
            r"\p{N}+",
        )
    ),
    "deepseek-coder": PreTokenizer(
        (r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _DEEPSEEK_CJK, r"\p{N}")
    ),
    **_names(
        "deepseek-v3 hunyuan-dense joyai-llm hy_v4",
        PreTokenizer((r"\p{N}{1,3}", _CJK_KANA, _DEEPSEEK3_WORDS)),
    ),
    "spark2_5": PreTokenizer((r"\p{N}{1,3}", _CJK_KANA, _SPARK_WORDS, r"\p{N}")),
    "youtu": PreTokenizer((_YOUTU_CJK, _any_case(r"\p{N}")), ignore_merges=True),
    "qwen35": PreTokenizer((_QWEN35,)),
    "jais-2": PreTokenizer((_JAIS2,)),
    "minicpm5": PreTokenizer((r"\p{N}{1,3}", _MINICPM5), ignore_merges=True),
    **_names("poro-chat bloom gpt3-finnish", PreTokenizer((_PORO,))),
    "viking": PreTokenizer((_PORO, r"\p{N}")),
    "chameleon": PreTokenizer(
        (
            r"<sentinel:[0-9]+>",
            r"(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z",
            r"([\t\n]|    |  )",
            r"\p{N}",
            r"[\p{P}!-/:-@\[-`{-~]",
            _GPT2,
        ),
        add_bos=True,
    ),
    "granite-embed-multi-97m": PreTokenizer((_GRANITE_MULTI,), ignore_merges=True),
    **_names(
        "tiny_aya cohere2moe",
        PreTokenizer((_DIGIT_GROUPS, _any_case(r"\p{N}{1,3}"))),
    ),
    "afmoe": PreTokenizer((_DIGIT_GROUPS, _AFMOE_ASIAN, _DEEPSEEK3_WORDS)),
    "superbpe": PreTokenizer((r"\p{N}+", r"(?=(?:[0-9]{3})+(?![0-9]))")),
    **_names("bailingmoe bailingmoe2 llada-moe", PreTokenizer((_BAILING,))),
    "seed-coder": PreTokenizer((_SEED_CODER,)),
    "ufakzeka": PreTokenizer((_UFAKZEKA,)),
    "laguna": PreTokenizer((r"[^\n]+|[\n]+", _QWEN2)),
    "exaone-moe": PreTokenizer((_EXAONE_MOE,)),
}

# llama.cpp values qlib does not split like llama.cpp (hand-written matchers, or not
# byte-level BPE), with why
UNSUPPORTED_PRE: dict[str, str] = {
    "kimi-k2": "llama.cpp splits it with hand-written code (Han runs)",
    "gemma4": "SentencePiece-style BPE on raw UTF-8",
    "granite-embed-multi-311m": "SentencePiece-style BPE on raw UTF-8",
    "sarvam-moe": "SentencePiece-style BPE on raw UTF-8",
    "whitespace": "a whitespace-split tokenizer",
}


def hf_pre_tokenizer(
    regexes: Iterable[str | tuple[str, str]],
) -> pre_tokenizers.PreTokenizer:
    """The splits (in order), then GPT-2's byte-level alphabet, as a ``tokenizers`` object."""
    splits = []
    for r in regexes:
        pattern, behavior = (r, "isolated") if isinstance(r, str) else r
        splits.append(pre_tokenizers.Split(Regex(pattern), behavior=behavior))
    return pre_tokenizers.Sequence(
        [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )


def pre_tokenizer_for(pre: str | None) -> PreTokenizer:
    """The ``PreTokenizer`` of a ``tokenizer.ggml.pre`` value (missing: ``"default"``)."""
    name = pre or "default"
    if name in PRE_TOKENIZERS:
        return PRE_TOKENIZERS[name]
    why = UNSUPPORTED_PRE.get(name)
    raise NotImplementedError(
        f"tokenizer.ggml.pre {name!r} is not supported"
        + (f" ({why})" if why else " (llama.cpp does not know it either)")
        + f"; supported: {', '.join(sorted(PRE_TOKENIZERS))}"
    )


# Tokens llama.cpp makes CONTROL by their text whatever tokenizer.ggml.token_type says
# (llama-vocab.cpp: every end-of-generation token; for each fill-in-the-middle role the
# file names no token for, one token of that role's list).
_EOG_TEXTS = frozenset(
    """<|eot_id|> <|im_end|> <|end|> <|return|> <|call|> <|flush|> <|calls|> <end_of_turn>
    <|endoftext|> </s> <|eom_id|> <EOT> _<EOT> [EOT] [EOS] <|end_of_text|> <end_of_utterance>
    <eos> <turn|> <|tool_response> <｜end▁of▁sentence｜> [e~[""".split()
)
_FIM_TEXTS = {
    "fim_pre": """<|fim_prefix|> <fim-prefix> <fim_prefix> <｜fim▁begin｜> <PRE> ▁<PRE>
        <|code_prefix|> <|prefix|>""",
    "fim_suf": """<|fim_suffix|> <fim-suffix> <fim_suffix> <｜fim▁hole｜> <SUF> ▁<SUF>
        <|code_suffix|> <|suffix|>""",
    "fim_mid": """<|fim_middle|> <fim-middle> <fim_middle> <｜fim▁end｜> <MID> ▁<MID>
        <|code_middle|> <|middle|>""",
    "fim_pad": "<|fim_pad|> <fim-pad> <fim_pad> <PAD> [PAD]",
    "fim_rep": "<|fim_repo|> <|repo_name|> <fim-repo> <REPO> <reponame>",
    "fim_sep": "<|file_sep|>",
}
_FIM_OLD_KEYS = {"fim_pre": "prefix", "fim_suf": "suffix", "fim_mid": "middle"}


def byte_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: every byte as a printable character."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


_UNICODE_TO_BYTE = {c: b for b, c in byte_to_unicode().items()}


def _split_merge(merge: str) -> tuple[str, str]:
    # As llama.cpp: the first space after the first character separates the two parts.
    i = merge.find(" ", 1)
    if i < 0:
        raise ValueError(f"malformed merge {merge!r} in tokenizer.ggml.merges")
    return merge[:i], merge[i + 1 :]


def _spm_merges(vocab: dict[str, int], scores: list[float]) -> list[tuple[str, str]]:
    """Merges for the ``tokenizers`` BPE model that follow SentencePiece's scores.

    llama.cpp joins the adjacent pair whose join is a token (of any type) with the best
    score; ranking every split of every token by that score is the same, except on ties
    (``Tokenizer.encode`` runs llama.cpp's algorithm itself).
    """
    ranked = []
    for token, i in vocab.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                ranked.append((-scores[i], i, left, right))
    ranked.sort()
    return [(left, right) for _, _, left, right in ranked]


# where a word starts: a ▁ after anything but ▁
_WORD_START = re.compile(f"(?<=[^{SPM_SPACE}])(?={SPM_SPACE})")


class _SentencePiece:
    """llama.cpp's SentencePiece tokenizer (``llm_tokenizer_spm``) for one piece of text.

    llama.cpp merges over the whole piece. When no token has a ▁ after another character
    (true of SentencePiece vocabularies), no merge crosses the start of a word, so words
    are merged one by one, and remembered: the same ids, faster.
    """

    def __init__(self, vocab: dict[str, int], scores: list[float], unk: int | None):
        self.vocab = vocab
        self.scores = scores
        self.unk = unk
        self.byte_ids: list[int | None] = []
        for b in range(256):
            i = vocab.get(f"<0x{b:02X}>")
            if i is None and b < 0x80:
                i = vocab.get(chr(b))
            self.byte_ids.append(i)
        self.by_word = not any(_WORD_START.search(t) for t in vocab)
        self.cache: dict[str, list[int]] = {}

    def encode(self, text: str) -> list[int]:
        if not self.by_word:
            return self.merge(text)
        ids: list[int] = []
        cache = self.cache
        for word in _WORD_START.split(text):
            got = cache.get(word)
            if got is None:
                got = self.merge(word)
                if len(cache) >= 100_000:
                    cache.clear()
                cache[word] = got
            ids.extend(got)
        return ids

    def merge(self, text: str) -> list[int]:
        vocab, scores = self.vocab, self.scores
        n = len(text)
        if n == 0:
            return []
        start = list(range(n))  # symbol i covers text[start[i]:start[i] + size[i]]
        size = [1] * n
        nxt = [*range(1, n), -1]
        prv = list(range(-1, n - 1))
        heap: list[tuple[float, int, int, int]] = []

        def bigram(left: int, right: int) -> None:
            if left < 0 or right < 0:
                return
            joined = text[start[left] : start[right] + size[right]]
            i = vocab.get(joined)
            if i is not None:  # best score first, then the leftmost
                heapq.heappush(heap, (-scores[i], left, right, len(joined)))

        for i in range(1, n):
            bigram(i - 1, i)
        while heap:
            _, left, right, total = heapq.heappop(heap)
            if size[left] == 0 or size[right] == 0 or size[left] + size[right] != total:
                continue  # one side was merged already
            size[left] += size[right]
            size[right] = 0
            nxt[left] = nxt[right]
            if nxt[right] >= 0:
                prv[nxt[right]] = left
            bigram(prv[left], left)
            bigram(left, nxt[left])

        ids: list[int] = []
        i = 0
        while i != -1:
            piece = text[start[i] : start[i] + size[i]]
            token = vocab.get(piece)
            if token is not None:
                ids.append(token)
            else:  # no token: its UTF-8 bytes as <0xXX> tokens
                for b in piece.encode("utf-8", errors="surrogatepass"):
                    token = self.byte_ids[b]
                    if token is None:
                        token = self.unk
                    if token is not None:
                        ids.append(token)
            i = nxt[i]
        return ids


class Tokenizer:
    """A GGUF file's tokenizer: encode, decode, stream, and render its chat template."""

    def __init__(self, metadata: dict[str, Any]):
        def get(key: str, default: Any = None) -> Any:
            return metadata.get(f"tokenizer.{key}", default)

        self.model: str = get("ggml.model", "")
        self.tokens: list[str] = [str(t) for t in get("ggml.tokens") or []]
        if not self.tokens:
            raise ValueError("cannot find tokenizer.ggml.tokens in metadata")
        n = len(self.tokens)
        types = get("ggml.token_type")
        self.token_types: list[int] = [int(t) for t in types] if types is not None else [NORMAL] * n
        if len(self.token_types) != n:
            raise ValueError(f"{len(self.token_types)} token types for {n} tokens")
        if self.model not in ("gpt2", "llama"):
            raise NotImplementedError(
                f"tokenizer.ggml.model {self.model!r} is not supported "
                "(supported: 'gpt2' byte-level BPE, 'llama' SentencePiece BPE)"
            )
        # llama.cpp's defaults for a SentencePiece vocabulary without these keys
        spm_default = {"bos": 1, "eos": 2, "unknown": 0} if self.model == "llama" else {}

        def token_id(name: str) -> int | None:
            i = _opt_int(get(f"ggml.{name}_token_id", spm_default.get(name)))
            return i if i is not None and 0 <= i < n else None

        self.bos_token_id: int | None = token_id("bos")
        self.eos_token_id: int | None = token_id("eos")
        self.unk_token_id: int | None = token_id("unknown")
        self.pad_token_id: int | None = token_id("padding")
        self.eot_token_id: int | None = token_id("eot")
        self.eom_token_id: int | None = token_id("eom")
        self.chat_template: str | None = get("chat_template")
        self.pre: str | None = None
        self.add_space_prefix = False
        # A repeated string maps to its last id, as in transformers (llama.cpp refuses it).
        self._vocab = {t: i for i, t in enumerate(self.tokens)}
        self._mark_control_by_text(get)

        if self.model == "gpt2":
            self.pre = get("ggml.pre") or "default"
            self._pre = pre_tokenizer_for(self.pre)
            # the merges as the file has them ("a b"); split into pairs only to build the
            # ``tokenizers`` backend (the pairs as Python tuples would hold ~8 MB more)
            self._merges = list(get("ggml.merges") or [])
            for m in self._merges:
                _split_merge(m)  # malformed merges fail here, as before
            default_bos = self._pre.add_bos
        else:
            scores = get("ggml.scores")
            if scores is None:
                raise ValueError("cannot find tokenizer.ggml.scores in metadata")
            self._scores = [float(s) for s in scores]
            if len(self._scores) < n:
                raise ValueError(f"{len(self._scores)} scores for {n} tokens")
            self.add_space_prefix = bool(get("ggml.add_space_prefix", True))
            self._spm = _SentencePiece(self._vocab, self._scores, self.unk_token_id)
            default_bos = True
        self.add_bos_token = bool(get("ggml.add_bos_token", default_bos))
        self.add_eos_token = bool(get("ggml.add_eos_token", False))

        # Special tokens, longest first (llama.cpp's order: a stable sort here).
        found = [i for i, t in enumerate(self.token_types) if t in (CONTROL, USER_DEFINED, UNKNOWN)]
        found.sort(key=lambda i: -len(self.tokens[i].encode()))
        self._specials = [(self.tokens[i], i, self.token_types[i] != USER_DEFINED) for i in found]
        special = {i for i, t in enumerate(self.token_types) if t in (UNKNOWN, CONTROL)}
        ids = (self.bos_token_id, self.eos_token_id, self.unk_token_id, self.pad_token_id)
        self.special_ids: frozenset[int] = frozenset(special | {i for i in ids if i is not None})
        self._bytes = [self._token_bytes(i) for i in range(n)]
        self._raw_backend: _HFTokenizer | None = None
        self._backend: _HFTokenizer | None = None

    def _mark_control_by_text(self, get: Any) -> None:
        # and llama.cpp's end-of-generation tokens: these, the FIM pad/repo/file-separator
        # tokens, EOS, EOT and EOM
        self._eog = {i for i, t in enumerate(self.tokens) if t in _EOG_TEXTS}
        for i in self._eog:
            self.token_types[i] = CONTROL
        for role, texts in _FIM_TEXTS.items():
            i = _opt_int(get(f"ggml.{role}_token_id"))
            if i is None and role in _FIM_OLD_KEYS:
                i = _opt_int(get(f"ggml.{_FIM_OLD_KEYS[role]}_token_id"))
            if i is None or not 0 <= i < len(self.tokens):
                # llama.cpp takes the first its hash map yields; here the first of the list
                present = [t for t in texts.split() if t in self._vocab]
                if not present:
                    continue
                i = self._vocab[present[0]]
                self.token_types[i] = CONTROL
            if role in ("fim_pad", "fim_rep", "fim_sep"):
                self._eog.add(i)

    # construction

    @classmethod
    def from_metadata(cls, metadata: dict[str, Any]) -> Tokenizer:
        """Build from a GGUF metadata dict of plain Python values."""
        return cls(metadata)

    @classmethod
    def from_gguf(cls, path: str | Path) -> Tokenizer:
        """Read a GGUF file's metadata and build its tokenizer."""
        return cls(read_metadata(path))

    def _build_backend(self, added: bool) -> _HFTokenizer:
        if self.model == "gpt2":
            bpe = models.BPE(
                vocab=dict(self._vocab),
                merges=[_split_merge(m) for m in self._merges],
                ignore_merges=self._pre.ignore_merges,
            )
            tk = _HFTokenizer(bpe)
            tk.pre_tokenizer = hf_pre_tokenizer(self._pre.regexes)
            tk.decoder = decoders.ByteLevel()
        else:
            unk = self.tokens[self.unk_token_id] if self.unk_token_id is not None else None
            bpe = models.BPE(
                vocab=dict(self._vocab),
                merges=_spm_merges(self._vocab, self._scores),
                unk_token=unk,
                byte_fallback=True,
                fuse_unk=True,
            )
            tk = _HFTokenizer(bpe)
            steps = [normalizers.Replace(" ", SPM_SPACE)]
            if self.add_space_prefix:
                steps.insert(0, normalizers.Prepend(SPM_SPACE))
            tk.normalizer = normalizers.Sequence(steps)
            tk.decoder = decoders.Sequence(
                [decoders.Replace(SPM_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
                + ([decoders.Strip(" ", 1, 0)] if self.add_space_prefix else [])
            )
        if added:
            # CONTROL and UNKNOWN tokens are special (skippable); USER_DEFINED ones are
            # plain added tokens. Their text is in the vocabulary already: they keep their ids.
            tk.add_special_tokens(
                [
                    AddedToken(t, special=True, normalized=False)
                    for t, k in zip(self.tokens, self.token_types, strict=True)
                    if k in (CONTROL, UNKNOWN)
                ]
            )
            tk.add_tokens(
                [
                    AddedToken(t, special=False, normalized=False)
                    for t in self._of_type(USER_DEFINED)
                ]
            )
        return tk

    @property
    def backend(self) -> _HFTokenizer:
        """This tokenizer as a ``tokenizers.Tokenizer`` (special tokens as added tokens)."""
        if self._backend is None:
            self._backend = self._build_backend(added=True)
        return self._backend

    def _of_type(self, kind: int) -> list[str]:
        return [t for t, k in zip(self.tokens, self.token_types, strict=True) if k == kind]

    def _token_bytes(self, i: int) -> bytes:
        text, kind = self.tokens[i], self.token_types[i]
        if kind in (CONTROL, USER_DEFINED, UNKNOWN):
            return text.encode()
        if self.model == "gpt2":
            try:
                return bytes(_UNICODE_TO_BYTE[c] for c in text)
            except KeyError:  # not in the byte alphabet: the text as written
                return text.encode()
        if kind == BYTE and len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
            return bytes([int(text[3:5], 16)])
        return text.replace(SPM_SPACE, " ").encode()

    # vocabulary

    @property
    def vocab_size(self) -> int:
        """Number of tokens in the file (the model's embedding rows)."""
        return len(self.tokens)

    @property
    def stop_token_ids(self) -> frozenset[int]:
        """Ids that end a generation: EOS, and EOT/EOM where the file names them."""
        ids = (self.eos_token_id, self.eot_token_id, self.eom_token_id)
        return frozenset(i for i in ids if i is not None)

    @property
    def eog_token_ids(self) -> frozenset[int]:
        """llama.cpp's end-of-generation ids (``llama_vocab_is_eog``): the stop ids, and the
        tokens it knows by their text (``<|im_end|>``, ``<|eot_id|>``, ``<|endoftext|>``, ...).
        """
        return frozenset(self._eog) | self.stop_token_ids

    def token_to_id(self, token: str) -> int | None:
        """Id of a token as spelled in the vocabulary (``"Ġthe"``, ``"<|im_start|>"``)."""
        return self._vocab.get(token)

    def id_to_token(self, token_id: int) -> str:
        """The vocabulary's spelling of a token."""
        return self.tokens[token_id]

    # encode / decode

    def split_special(self, text: str, parse_special: bool = True) -> list[str | int]:
        """``text`` as llama.cpp cuts it: pieces of text and ids of special tokens.

        Each special token in turn, longest first, is cut out of every piece left; with
        ``parse_special=False`` only USER_DEFINED tokens are.
        """
        parts: list[str | int] = [text] if text else []
        for token, i, is_control in self._specials:
            if is_control and not parse_special:
                continue
            if not any(isinstance(p, str) and token in p for p in parts):
                continue
            out: list[str | int] = []
            for p in parts:
                if isinstance(p, int) or token not in p:
                    out.append(p)
                    continue
                for k, piece in enumerate(p.split(token)):
                    if k:
                        out.append(i)
                    if piece:
                        out.append(piece)
            parts = out
        return parts

    def _encode_text(self, text: str) -> list[int]:
        if self.model == "llama":
            if self.add_space_prefix:
                text = " " + text
            return self._spm.encode(text.replace(" ", SPM_SPACE))
        if self._raw_backend is None:
            self._raw_backend = self._build_backend(added=False)
        return self._raw_backend.encode(text, add_special_tokens=False).ids

    def encode(
        self, text: str, add_special_tokens: bool = False, parse_special: bool = True
    ) -> list[int]:
        """Token ids of ``text``, as llama.cpp's ``llama_tokenize`` gives them.

        ``add_special_tokens`` (llama.cpp's ``add_special``) adds BOS (and EOS) where the
        file's ``add_bos_token`` (``add_eos_token``) says so. ``parse_special`` (llama.cpp's
        ``parse_special``): CONTROL tokens written in the text (``<|im_start|>``, ``<s>``,
        ``<unk>``) become their ids; with ``False`` they are tokenized as plain text.
        A character whose bytes have no token is dropped, as in llama.cpp and
        transformers (SmolLM2 lacks e.g. ``"\\x04"``).
        """
        ids: list[int] = []
        if add_special_tokens and self.add_bos_token and self.bos_token_id is not None:
            ids.append(self.bos_token_id)
        for part in self.split_special(text, parse_special):
            if isinstance(part, int):
                ids.append(part)
            else:
                ids.extend(self._encode_text(part))
        if add_special_tokens and self.add_eos_token and self.eos_token_id is not None:
            ids.append(self.eos_token_id)
        return ids

    def token_bytes(self, token_id: int, skip_special_tokens: bool = False) -> bytes:
        """The bytes a token stands for (``b""`` for a skipped special token)."""
        if not 0 <= token_id < len(self._bytes):
            raise ValueError(f"token id {token_id} out of range [0, {len(self._bytes)})")
        if skip_special_tokens and token_id in self.special_ids:
            return b""
        return self._bytes[token_id]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """Text of ``ids``; invalid UTF-8 becomes U+FFFD."""
        data = b"".join(self.token_bytes(int(i), skip_special_tokens) for i in ids)
        if self.add_space_prefix and data.startswith(b" "):
            data = data[1:]
        return data.decode("utf-8", errors="replace")

    def decode_incremental(
        self, ids: Iterable[int], skip_special_tokens: bool = False
    ) -> Iterator[str]:
        """Yield text as ``ids`` arrive, each piece complete UTF-8 (see ``TokenOutputStream``)."""
        stream = TokenOutputStream(self, skip_special_tokens)
        for i in ids:
            if text := stream.next_token(i):
                yield text
        if text := stream.decode_rest():
            yield text

    # chat template

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> str:
        """Render ``tokenizer.chat_template`` as transformers does (sandboxed jinja2)."""
        if not self.chat_template:
            raise ValueError("this GGUF file has no tokenizer.chat_template")
        variables = {
            name: self.tokens[i] if i is not None else None
            for name, i in (
                ("bos_token", self.bos_token_id),
                ("eos_token", self.eos_token_id),
                ("unk_token", self.unk_token_id),
                ("pad_token", self.pad_token_id),
            )
        }
        variables.update(kwargs)
        return _compile(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt, **variables
        )

    def chat_prompt(self, user_text: str, system: str | None = None) -> str:
        """Prompt for one user message, ready for the assistant's reply.

        Without ``system`` the template's own default applies (SmolLM2 inserts
        "You are a helpful AI assistant named SmolLM, trained by Hugging Face").
        """
        messages = [{"role": "system", "content": system}] if system is not None else []
        messages.append({"role": "user", "content": user_text})
        return self.apply_chat_template(messages, add_generation_prompt=True)

    def __repr__(self) -> str:
        return (
            f"Tokenizer(model={self.model!r}, pre={self.pre!r}, vocab_size={self.vocab_size}, "
            f"bos={self.bos_token_id}, eos={self.eos_token_id})"
        )


class TokenOutputStream:
    """Text of generated tokens as they come, only ever emitting complete UTF-8 characters.

    The idea of candle's ``TokenOutputStream``: a token can end inside a multi-byte
    character (an emoji spans several byte-level tokens), so bytes are held back until
    the character is complete. ``"".join`` of everything returned equals ``decode``.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.clear()

    def clear(self) -> None:
        """Forget all tokens."""
        self.tokens: list[int] = []
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._at_start = True

    def next_token(self, token_id: int) -> str:
        """Add a token; return the text it completes (may be ``""``)."""
        self.tokens.append(int(token_id))
        data = self.tokenizer.token_bytes(int(token_id), self.skip_special_tokens)
        if self._at_start and data:
            self._at_start = False
            if self.tokenizer.add_space_prefix and data.startswith(b" "):
                data = data[1:]
        return self._utf8.decode(data)

    def decode_rest(self) -> str:
        """Flush what is held back (an incomplete character becomes U+FFFD)."""
        return self._utf8.decode(b"", final=True)

    def decode_all(self) -> str:
        """Text of all tokens so far."""
        return self.tokenizer.decode(self.tokens, self.skip_special_tokens)


def _opt_int(value: Any) -> int | None:
    return None if value is None else int(value)


# chat templates


class TemplateError(Exception):
    """Raised by a chat template through ``raise_exception``."""


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False, **kw: Any) -> str:
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, **kw)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


_templates: dict[str, Any] = {}


def _compile(source: str) -> Any:
    """A chat template compiled as transformers does (trim_blocks, lstrip_blocks, sandbox)."""
    if source not in _templates:
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        _templates[source] = env.from_string(source)
    return _templates[source]


# metadata


def read_metadata(path: str | Path) -> dict[str, Any]:
    """A GGUF file's metadata as plain Python values."""
    with open(path, "rb") as f:
        return dict(Content.read(f).metadata)
