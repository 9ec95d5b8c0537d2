"""llama.cpp's ``tokenizer.*`` metadata from a transformers folder's tokenizer files.

Byte-level BPE tokenizers only (``tokenizer.ggml.model = "gpt2"``), as llama.cpp's
``convert_hf_to_gguf.py`` writes them: every id gets a token (``[PAD{i}]`` for
holes), added tokens are CONTROL when special and USER_DEFINED otherwise. The
pre-tokenizer name (``tokenizer.ggml.pre``) is found as llama.cpp finds it, by
behaviour: the folder's pre-tokenizer splits a check text, and the first name in
qlib's table whose regexes split it the same way wins.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..gguf import GGUFValueType, Typed
from ..tokenizer import CONTROL, NORMAL, PRE_TOKENIZERS, USER_DEFINED, hf_pre_tokenizer

VT = GGUFValueType

CHECK_TEXT = (
    "Hello World! It's 2024: 3.14159, 1234567 and 12 345.\n\n \t  tabs\tand   spaces  \r\n"
    "we'll they've I'M don't HELLO's ... !!! ??? --> <tag> x=y+z^2 | a~b `code`\n"
    "naïve café Ünïcödé 你好世界 こんにちは 안녕하세요 Привет мир ١٢٣ 🚀🦙 ⚡️\n"
    "    indented\n\n\n end"
)


def _content(v: Any) -> str | None:
    if isinstance(v, dict):
        return v.get("content")
    return v


def detect_pre(tokenizer_json: str) -> str:
    """The ``tokenizer.ggml.pre`` name whose splitting matches this ``tokenizer.json``'s."""
    from tokenizers import Tokenizer as HFTokenizer

    pre = HFTokenizer.from_str(tokenizer_json).pre_tokenizer
    if pre is None:
        raise ValueError("tokenizer.json has no pre-tokenizer: cannot pick tokenizer.ggml.pre")
    want = [p for p, _ in pre.pre_tokenize_str(CHECK_TEXT)]
    seen = set()
    for name, spec in PRE_TOKENIZERS.items():
        if id(spec) in seen:
            continue
        seen.add(id(spec))
        # llama.cpp's regexes, and the tokenizer.json ones where they are written otherwise
        for regexes in filter(None, (spec.regexes, spec.hf_regexes)):
            if [p for p, _ in hf_pre_tokenizer(regexes).pre_tokenize_str(CHECK_TEXT)] == want:
                return name
    raise NotImplementedError(
        "the tokenizer's pre-tokenizer matches none of qlib's tokenizer.ggml.pre values; "
        "pass pre=NAME to choose one"
    )


def _chat_template(folder: Path, cfg: dict[str, Any]) -> str | None:
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    ct = cfg.get("chat_template")
    if isinstance(ct, list):  # named templates: take the default
        ct = next((t["template"] for t in ct if t.get("name") == "default"), None)
    return ct


def tokenizer_metadata(
    folder: str | Path, n_vocab: int, config: dict[str, Any], pre: str | None = None
) -> dict[str, Any]:
    """The ``tokenizer.*`` GGUF keys (typed) for a folder with ``tokenizer.json``."""
    folder = Path(folder)
    text = (folder / "tokenizer.json").read_text(encoding="utf-8")
    tj = json.loads(text)
    model = tj.get("model", {})
    if model.get("type") != "BPE" or model.get("byte_fallback"):
        kind = repr(model.get("type"))
        if model.get("byte_fallback"):
            kind += " with byte fallback"
        raise NotImplementedError(
            f"only byte-level BPE tokenizers convert (tokenizer.ggml.model gpt2), not {kind}"
        )
    tcfg_path = folder / "tokenizer_config.json"
    tcfg = json.loads(tcfg_path.read_text(encoding="utf-8")) if tcfg_path.is_file() else {}

    tokens = [f"[PAD{i}]" for i in range(n_vocab)]
    types = [USER_DEFINED] * n_vocab
    for tok, i in model["vocab"].items():
        if i < n_vocab:
            tokens[i], types[i] = tok, NORMAL
    for added in tj.get("added_tokens", []):
        i = added["id"]
        if i < n_vocab:
            tokens[i] = added["content"]
            types[i] = CONTROL if added.get("special") else USER_DEFINED
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    vocab = {t: i for i, t in enumerate(tokens)}

    md: dict[str, Any] = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre or detect_pre(text),
        "tokenizer.ggml.tokens": Typed(VT.STRING, tokens),
        "tokenizer.ggml.token_type": Typed(VT.INT32, types),
        "tokenizer.ggml.merges": Typed(VT.STRING, merges),
    }
    for key, gguf_key, cfg_key in (
        ("bos_token", "bos_token_id", "bos_token_id"),
        ("eos_token", "eos_token_id", "eos_token_id"),
        ("unk_token", "unknown_token_id", None),
        ("pad_token", "padding_token_id", "pad_token_id"),
    ):
        name = _content(tcfg.get(key))
        i = vocab.get(name) if name is not None else None
        if i is None and cfg_key is not None and isinstance(config.get(cfg_key), int):
            i = config[cfg_key]
        if i is not None:
            md[f"tokenizer.ggml.{gguf_key}"] = Typed(VT.UINT32, int(i))
    for key in ("add_bos_token", "add_eos_token"):
        if isinstance(tcfg.get(key), bool):
            md[f"tokenizer.ggml.{key}"] = tcfg[key]
    template = _chat_template(folder, tcfg)
    if template:
        md["tokenizer.chat_template"] = template
    return md
