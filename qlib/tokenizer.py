"""Tokenizer and chat template from a GGUF file's metadata.

A GGUF file has no ``tokenizer.json``: it stores the vocabulary under llama.cpp's
keys (``tokenizer.ggml.*``). ``Tokenizer.from_metadata`` rebuilds a ``tokenizers``
tokenizer from them and follows llama.cpp's reading of those keys:

- ``tokenizer.ggml.model == "gpt2"``: byte-level BPE from ``tokens`` and ``merges``;
  the text is first split with the regexes llama.cpp uses for ``tokenizer.ggml.pre``
  (``"smollm"`` isolates every digit, then applies the GPT-2 regex).
- ``tokenizer.ggml.model == "llama"``: SentencePiece BPE from ``tokens`` and
  ``scores`` (merges are rebuilt from the scores), byte fallback to ``<0xXX>`` tokens,
  a space prefixed to every run of text (``tokenizer.ggml.add_space_prefix``).
- Tokens of type CONTROL (3) and USER_DEFINED (4) are matched whole in the input,
  CONTROL ones as special tokens (skipped by ``decode(..., skip_special_tokens=True)``).

Decoding maps each token to its bytes (byte-level alphabet, ``▁`` or ``<0xXX>``;
CONTROL and USER_DEFINED tokens as written), so ``decode`` and the streaming
``TokenOutputStream`` agree byte for byte.
"""

from __future__ import annotations

import codecs
import json
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

# Regexes llama.cpp applies, one after the other, to split text before byte-level BPE.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class PreTokenizer:
    """How llama.cpp prepares text for one ``tokenizer.ggml.pre`` value."""

    regexes: tuple[str, ...]
    ignore_merges: bool = False  # a word that is itself a token is not merged
    add_bos: bool = False  # default for add_bos_token when the file does not say


_DEFAULT = PreTokenizer((r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"))
_DIGITS_GPT2 = PreTokenizer((r"\p{N}", _GPT2))
_LLAMA3_PRE = PreTokenizer((_LLAMA3,), ignore_merges=True, add_bos=True)

PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    "default": _DEFAULT,
    **dict.fromkeys(("gpt-2", "phi-2", "mpt", "olmo", "jais"), PreTokenizer((_GPT2,))),
    **dict.fromkeys(
        ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"),
        _DIGITS_GPT2,
    ),
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral"), _LLAMA3_PRE),
    **dict.fromkeys(("dbrx", "smaug-bpe"), PreTokenizer((_LLAMA3,))),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "stablelm2", "megrez"), PreTokenizer((_QWEN2,))),
    "falcon": PreTokenizer((r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]")),
    **dict.fromkeys(("gpt-4o", "llama4"), PreTokenizer((_GPT4O,))),
    "tekken": PreTokenizer((_TEKKEN,), ignore_merges=True, add_bos=True),
}


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


def _spm_merges(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """Merges equivalent to SentencePiece BPE: join the adjacent pair whose result scores best."""
    vocab = {t: i for i, t in enumerate(tokens) if types[i] == NORMAL}
    ranked = []
    for token, i in vocab.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                ranked.append((-scores[i], i, left, right))
    ranked.sort()
    return [(left, right) for _, _, left, right in ranked]


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
        self.bos_token_id: int | None = _opt_int(get("ggml.bos_token_id"))
        self.eos_token_id: int | None = _opt_int(get("ggml.eos_token_id"))
        self.unk_token_id: int | None = _opt_int(get("ggml.unknown_token_id"))
        self.pad_token_id: int | None = _opt_int(get("ggml.padding_token_id"))
        self.eot_token_id: int | None = _opt_int(get("ggml.eot_token_id"))
        self.eom_token_id: int | None = _opt_int(get("ggml.eom_token_id"))
        self.chat_template: str | None = get("chat_template")
        self.pre: str | None = None
        self.add_space_prefix = False

        if self.model == "gpt2":
            self.pre = get("ggml.pre") or "default"
            if self.pre not in PRE_TOKENIZERS:
                raise NotImplementedError(
                    f"unknown tokenizer.ggml.pre {self.pre!r}; "
                    f"supported: {', '.join(sorted(PRE_TOKENIZERS))}"
                )
            pre = PRE_TOKENIZERS[self.pre]
            merges = [_split_merge(m) for m in get("ggml.merges") or []]
            bpe = models.BPE(vocab=self._vocab(), merges=merges, ignore_merges=pre.ignore_merges)
            tk = _HFTokenizer(bpe)
            splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in pre.regexes]
            tk.pre_tokenizer = pre_tokenizers.Sequence(
                [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
            )
            tk.decoder = decoders.ByteLevel()
            default_bos = pre.add_bos
        elif self.model == "llama":
            scores = get("ggml.scores")
            if scores is None:
                raise ValueError("cannot find tokenizer.ggml.scores in metadata")
            merges = _spm_merges(self.tokens, [float(s) for s in scores], self.token_types)
            unk = self.tokens[self.unk_token_id] if self.unk_token_id is not None else None
            bpe = models.BPE(
                vocab=self._vocab(),
                merges=merges,
                unk_token=unk,
                byte_fallback=True,
                fuse_unk=True,
            )
            tk = _HFTokenizer(bpe)
            self.add_space_prefix = bool(get("ggml.add_space_prefix", True))
            steps = [normalizers.Replace(" ", SPM_SPACE)]
            if self.add_space_prefix:
                steps.insert(0, normalizers.Prepend(SPM_SPACE))
            tk.normalizer = normalizers.Sequence(steps)
            tk.decoder = decoders.Sequence(
                [decoders.Replace(SPM_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
                + ([decoders.Strip(" ", 1, 0)] if self.add_space_prefix else [])
            )
            default_bos = True
        else:
            raise NotImplementedError(
                f"tokenizer.ggml.model {self.model!r} is not supported "
                "(supported: 'gpt2' byte-level BPE, 'llama' SentencePiece BPE)"
            )
        self.add_bos_token = bool(get("ggml.add_bos_token", default_bos))
        self.add_eos_token = bool(get("ggml.add_eos_token", False))

        # CONTROL tokens are special (skippable); USER_DEFINED ones are plain added tokens.
        # Their text is in the vocabulary already, so they keep their ids.
        tk.add_special_tokens(
            [AddedToken(t, special=True, normalized=False) for t in self._of_type(CONTROL)]
        )
        tk.add_tokens(
            [AddedToken(t, special=False, normalized=False) for t in self._of_type(USER_DEFINED)]
        )
        self.backend = tk

        special = {i for i, t in enumerate(self.token_types) if t in (UNKNOWN, CONTROL)}
        ids = (self.bos_token_id, self.eos_token_id, self.unk_token_id, self.pad_token_id)
        self.special_ids: frozenset[int] = frozenset(special | {i for i in ids if i is not None})
        self._bytes = [self._token_bytes(i) for i in range(n)]

    # construction

    @classmethod
    def from_metadata(cls, metadata: dict[str, Any]) -> Tokenizer:
        """Build from a GGUF metadata dict of plain Python values."""
        return cls(metadata)

    @classmethod
    def from_gguf(cls, path: str | Path) -> Tokenizer:
        """Read a GGUF file's metadata and build its tokenizer."""
        return cls(read_metadata(path))

    def _vocab(self) -> dict[str, int]:
        # A repeated string maps to its last id, as in llama.cpp and transformers.
        return {t: i for i, t in enumerate(self.tokens)}

    def _of_type(self, kind: int) -> list[str]:
        return [t for t, k in zip(self.tokens, self.token_types, strict=True) if k == kind]

    def _token_bytes(self, i: int) -> bytes:
        text, kind = self.tokens[i], self.token_types[i]
        if kind in (CONTROL, USER_DEFINED):
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

    def token_to_id(self, token: str) -> int | None:
        """Id of a token as spelled in the vocabulary (``"Ġthe"``, ``"<|im_start|>"``)."""
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str:
        """The vocabulary's spelling of a token."""
        return self.tokens[token_id]

    # encode / decode

    def encode(
        self, text: str, add_special_tokens: bool = False, parse_special: bool = True
    ) -> list[int]:
        """Token ids of ``text``.

        ``add_special_tokens`` adds BOS (and EOS) where the file's ``add_bos_token``
        (``add_eos_token``) says so. With ``parse_special=False`` the text of CONTROL
        tokens (``<|im_start|>``) is tokenized as plain text. A character whose bytes
        have no token is dropped, as in transformers (SmolLM2 lacks e.g. ``"\\x04"``).
        """
        tk = self.backend
        if parse_special:
            ids = tk.encode(text, add_special_tokens=False).ids
        else:
            tk.encode_special_tokens = True
            try:
                ids = tk.encode(text, add_special_tokens=False).ids
            finally:
                tk.encode_special_tokens = False
        if add_special_tokens:
            if self.add_bos_token and self.bos_token_id is not None:
                ids.insert(0, self.bos_token_id)
            if self.add_eos_token and self.eos_token_id is not None:
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
