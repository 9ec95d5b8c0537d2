"""Small real tokenizers as GGUF metadata, and vocab-only GGUF files that llama.cpp loads.

``spm_metadata`` trains a SentencePiece BPE model (``sentencepiece``) with byte fallback
and writes its pieces, scores and types as llama.cpp's converter does
(``tokenizer.ggml.model = "llama"``). ``bpe_metadata`` trains a byte-level BPE with the
``tokenizers`` trainer (``tokenizer.ggml.model = "gpt2"``, any ``tokenizer.ggml.pre``).
``write_vocab_gguf`` writes such metadata with a tiny llama's hyperparameters and no
tensors, the shape of llama.cpp's own ``ggml-vocab-*.gguf`` test files, so that
``llama_cpp.Llama(path, vocab_only=True)`` tokenizes with it.

``STRESS_CASES`` and ``random_texts`` are texts that tell pre-tokenizers apart (whitespace
of every kind, scripts, digits, symbols, special-token text); ``CHAT_TEMPLATES`` are the
chat templates of Llama 2, Llama 3, DeepSeek LLM and DeepSeek Coder (as their
``tokenizer_config.json`` files have them).
"""

from __future__ import annotations

import json
import random
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from synthetic import tiny_llama_metadata

from qlib.gguf import GGUFValueType, Typed, write
from qlib.tokenizer import BYTE, CONTROL, NORMAL, UNKNOWN, UNUSED, USER_DEFINED, byte_to_unicode

VT = GGUFValueType
DATA = Path(__file__).resolve().parent.parent / "data"

# CONTROL and USER_DEFINED tokens the BPE vocabularies carry (Llama 3, ChatML, DeepSeek)
BPE_CONTROL = (
    "<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>", "<|eot_id|>",
    "<|start_header_id|>", "<|end_header_id|>", "<｜begin▁of▁sentence｜>",
    "<｜end▁of▁sentence｜>", "<|EOT|>", "<|endoftext|>",
)  # fmt: skip
BPE_USER_DEFINED = ("<think>", "</think>", "<|User|>", "<|Assistant|>")
SPM_USER_DEFINED = ("<think>", "[INST]", "[/INST]")

STRESS_CASES: dict[str, str] = {
    "spm_specials": "<s>Hello</s> <unk> x<s> </s><s><s>",
    "spm_inst": "[INST] hi [/INST] <think>ok</think>[INST]x",
    "llama3_specials": "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>",
    "deepseek_specials": "<｜begin▁of▁sentence｜>User: hi\n\nAssistant:<｜end▁of▁sentence｜>",
    "user_defined": "<|User|>hi<|Assistant|><think>\nhmm\n</think>answer",
    "special_overlap": "<|im_start|im_end|> <<|im_end|>> <|<|eot_id|>|>",
    "whitespace_zoo": "a\u00a0b\u1680c\u2000d\u2001e\u2002f\u2003g\u200ah\u2028i\u2029j"
    "\u202fk\u205fl\u3000m\x85n\x1cq\x1dr\x1es\x1ft\x0bu\x0cv",
    "whitespace_runs": "a\u3000\u3000b \u3000 c\u2003\u2003 d  \u00a0\u00a0e\u3000",
    "cjk_spaced": "中\u3000文 测\u2000试 日本\u00a0語 한\u3000국 。\u3000、",
    "fullwidth": "ＡＢＣ　ｄｅｆ！？（テスト）「引用」『二重』…—～",
    "tilde": "~/path ~user a~b ~~ x ~= y <~> ~123",
    "symbols": "$+<=>^`|~ ∑∞≠→©®™ ½²³ ①② ٣٤٥ ५६",
    "cased": "HelloWorld ÉcoleÉcole ПриветМир camelCaseWord XMLHttpRequest ǅungla ÀÉÎ àéî",
    "digit_groups": "1 12 123 1234 12345 123456 1234567 12345678 ١٢٣٤٥ 12,345,678 0x1234abc",
    "digits_glued": "x  1 ab12cd 1234 y12345z ½²³ 1,234,567 abc",
    "code": "def f(x):\n    return {'a': [1, 2], \"b\": x ** 2}  # comment\n\n"
    "\tif x != y: pass\r\n",
    "urls": "https://example.com/a_b-c?d=1&e=%20 user@mail.org C:\\Windows\\path",
    "greek_letterlike": "ώ ΐ Ί ι Ω K Å ℂ ℕ ﬀ ﬁ Ａ ｚ 𐐀 𞤀",
    "marks": "क्षत्रिय ক্ষ ภาษาไทย a\u0300\u0301\u0302 ء ـ",
    "southeast_asian": "ภาษาไทย กขค ๑๒๓ ສະບາຍດີ ខ្មែរ မြန်မာ 가나 ᄀᄁ ｱｲｳ ⼀⼁ 豈更 a กข",
    "apostrophes": "'s 'S 'T 'Re 'VE 'M 'LL 'D 'x ’s ‘t' ''s",
    "mixed_newlines": "a\n\n\n b\r\n\r\n c \n d\t\n\te",
    "only_whitespace": " \t \n ",
    "long_whitespace": "x" + " " * 700 + "y" + "\t" * 40 + "z",
    "rare": "\U0001f9ea \u0378 \ue000 \U000f0000 \ufffd",
}

_RANDOM_POOLS = (
    [chr(c) for c in range(0x20, 0x7F)],
    list(
        " \t\n\r\x0b\x0c\x1c\x1d\x1e\x1f\x85\xa0\u1680\u2000\u2003\u200a\u2028\u2029"
        "\u202f\u205f\u3000\u180e\u200b\ufeff"
    ),
    [chr(c) for c in range(0xA1, 0x250)],
    [chr(c) for c in [*range(0x370, 0x3FF), *range(0x400, 0x4FF), *range(0x1F00, 0x1FFF)]],
    [
        chr(c)
        for c in [
            *range(0x4E00, 0x4E80),
            *range(0x3000, 0x3100),
            *range(0xAC00, 0xAC40),
            *range(0xFF00, 0xFF70),
        ]
    ],  # fmt: skip
    [chr(c) for c in [*range(0xE00, 0xE7F), *range(0x600, 0x6FF), *range(0x900, 0x97F)]],
    [
        chr(c)
        for c in [*range(0x300, 0x36F), *range(0x2000, 0x2BFF, 7), *range(0x1F300, 0x1F6FF, 3)]
    ],
    list("0123456789" * 3 + "٠١۳०²½Ⅰ①１"),
    "'s 't 're 'S 'LL \n\n \r\n <s> </s> <unk> <|im_start|> <|im_end|> <think> <|endoftext|>"
    " <｜end▁of▁sentence｜> [INST] ▁ <0x41> \u200d \ufe0f \u2126 \u212a \u017f \u0130".split(" "),
)
_RANDOM_WEIGHTS = (3, 2, 1, 1, 1, 1, 1, 2, 1)


def random_texts(seed: int, n: int) -> list[str]:
    """``n`` random texts mixing ASCII, every kind of whitespace, scripts and special text."""
    rng = random.Random(seed)
    texts = []
    for _ in range(n):
        parts = []
        for _ in range(rng.randint(1, 40)):
            pool = rng.choices(_RANDOM_POOLS, _RANDOM_WEIGHTS)[0]
            parts.append(rng.choice(pool) * (rng.randint(2, 4) if rng.random() < 0.1 else 1))
        texts.append("".join(parts))
    return texts


# chat templates (jinja2), as the models' tokenizer_config.json files have them
CHAT_TEMPLATES = {
    "llama2": (
        "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
        "{% set system_message = messages[0]['content'] %}{% else %}"
        "{% set loop_messages = messages %}{% set system_message = false %}{% endif %}"
        "{% for message in loop_messages %}"
        "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('Conversation roles must alternate "
        "user/assistant/user/assistant/...') }}"
        "{% endif %}{% if loop.index0 == 0 and system_message != false %}"
        "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' "
        "+ message['content'] %}"
        "{% else %}{% set content = message['content'] %}{% endif %}"
        "{% if message['role'] == 'user' %}"
        "{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
        "{% elif message['role'] == 'assistant' %}{{ ' '  + content.strip() + ' ' + eos_token }}"
        "{% endif %}{% endfor %}"
    ),
    "llama3": (
        "{% set loop_messages = messages %}{% for message in loop_messages %}"
        "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
        "+ message['content'] | trim + '<|eot_id|>' %}"
        "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
        "{{ content }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
        "{% endif %}"
    ),
    "deepseek-llm": (
        "{% if not add_generation_prompt is defined %}{% set add_generation_prompt = false %}"
        "{% endif %}{{ bos_token }}{% for message in messages %}"
        "{% if message['role'] == 'user' %}{{ 'User: ' + message['content'] + '\n\n' }}"
        "{% elif message['role'] == 'assistant' %}"
        "{{ 'Assistant: ' + message['content'] + eos_token }}"
        "{% elif message['role'] == 'system' %}{{ message['content'] + '\n\n' }}{% endif %}"
        "{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
    ),
    "deepseek-coder": (
        "{% if not add_generation_prompt is defined %}\n{% set add_generation_prompt = false %}\n"
        "{% endif %}\n{%- set ns = namespace(found=false) -%}\n{%- for message in messages -%}\n"
        "    {%- if message['role'] == 'system' -%}\n        {%- set ns.found = true -%}\n"
        "    {%- endif -%}\n{%- endfor -%}\n{{bos_token}}{%- if not ns.found -%}\n"
        "{{'You are an AI programming assistant, utilizing the Deepseek Coder model, developed"
        " by Deepseek Company, and you only answer questions related to computer science. For"
        " politically sensitive questions, security and privacy issues, and other non-computer"
        " science questions, you will refuse to answer\\n'}}\n{%- endif %}\n"
        "{%- for message in messages %}\n    {%- if message['role'] == 'system' %}\n"
        "{{ message['content'] }}\n    {%- else %}\n        {%- if message['role'] == 'user' %}\n"
        "{{'### Instruction:\\n' + message['content'] + '\\n'}}\n        {%- else %}\n"
        "{{'### Response:\\n' + message['content'] + '\\n<|EOT|>\\n'}}\n        {%- endif %}\n"
        "    {%- endif %}\n{%- endfor %}\n{% if add_generation_prompt %}\n{{'### Response:'}}\n"
        "{% endif %}"
    ),
}


def training_text(extra: Iterable[str] = ()) -> list[str]:
    """Lines to train on: the varied cases, a passage, code, digits, CJK, emoji, ``extra``.

    Training on the very texts a test then tokenizes gives merges across every boundary
    in them, so a pre-tokenizer that splits differently shows in the ids.
    """
    lines = (DATA / "tokenizer_cases.txt").read_text(encoding="utf-8").splitlines()
    passage = DATA / "passage.txt"
    if passage.is_file():
        lines += passage.read_text(encoding="utf-8").splitlines()
    lines += [
        "def main():\n    return [x ** 2 for x in range(10)]  # squares",
        "for (int i = 0; i < n; ++i) { sum += a[i]; }",
        "1234567890 3.14159 2,718 1e-9 0x1F 100% $42.00 #1 @home",
        "中文测试，日本語のテキスト。한국어 텍스트！　全角スペース",
        "Привет, мир! Γειά σου κόσμε. مرحبا بالعالم",
        "emoji 🙂🚀👍 ❤️ and symbols ∑ ∞ ≠ → © ® ™ ~ ^ ` |",
        "    indented\n\tTabbed\r\nCRLF  double  spaces   triple",
        "I'm you're he's we've they'll I'd DON'T O'Neil's",
    ]
    for text in extra:
        lines += text.splitlines(keepends=True) + [text]
    return [line for line in lines if line.strip()] * 3


def spm_metadata(
    vocab_size: int = 700,
    user_defined: tuple[str, ...] = SPM_USER_DEFINED,
    texts: Iterable[str] = (),
    **extra: Any,
) -> dict[str, Any]:
    """A trained SentencePiece BPE vocabulary with byte fallback, as GGUF metadata."""
    import sentencepiece as spm

    with tempfile.TemporaryDirectory() as tmp:
        prefix = Path(tmp) / "m"
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(training_text(texts)),
            model_prefix=str(prefix),
            model_type="bpe",
            vocab_size=vocab_size,
            byte_fallback=True,
            user_defined_symbols=list(user_defined),
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            split_digits=True,
            character_coverage=0.9995,
            hard_vocab_limit=False,
            minloglevel=2,
        )
        sp = spm.SentencePieceProcessor(model_file=f"{prefix}.model")
    tokens, scores, types = [], [], []
    for i in range(sp.get_piece_size()):
        piece = sp.id_to_piece(i)
        kind = NORMAL
        if sp.is_unknown(i):
            kind = UNKNOWN
        elif sp.is_control(i):
            kind = CONTROL
        elif sp.is_unused(i):
            kind = UNUSED
        elif sp.is_byte(i):
            kind = BYTE
        elif piece in user_defined:
            kind = USER_DEFINED
        tokens.append(piece)
        scores.append(float(sp.get_score(i)))
        types.append(kind)
    md = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": Typed(VT.STRING, tokens),
        "tokenizer.ggml.scores": Typed(VT.FLOAT32, scores),
        "tokenizer.ggml.token_type": Typed(VT.INT32, types),
        "tokenizer.ggml.bos_token_id": Typed(VT.UINT32, sp.bos_id()),
        "tokenizer.ggml.eos_token_id": Typed(VT.UINT32, sp.eos_id()),
        "tokenizer.ggml.unknown_token_id": Typed(VT.UINT32, sp.unk_id()),
        "tokenizer.ggml.add_bos_token": True,
        "tokenizer.ggml.add_eos_token": False,
    }
    md.update(extra)
    return md


def bpe_metadata(
    pre: str,
    vocab_size: int = 1200,
    control: tuple[str, ...] = BPE_CONTROL,
    user_defined: tuple[str, ...] = BPE_USER_DEFINED,
    texts: Iterable[str] = (),
    **extra: Any,
) -> dict[str, Any]:
    """A trained byte-level BPE vocabulary (merges across words too), as GGUF metadata."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers, trainers

    tk = HFTokenizer(models.BPE())
    # Whole lines are words: merges cross spaces, digits and punctuation, so a pre-tokenizer
    # that splits differently gives different ids.
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=list(control),
        show_progress=False,
    )
    tk.train_from_iterator(training_text(texts), trainer)
    model = json.loads(tk.to_str())["model"]
    vocab: dict[str, int] = model["vocab"]
    tokens = [""] * len(vocab)
    for t, i in vocab.items():
        tokens[i] = t
    types = [CONTROL if t in control else NORMAL for t in tokens]
    for t in user_defined:  # learnt already (plain ASCII), or added at the end
        if t in vocab:
            types[vocab[t]] = USER_DEFINED
        else:
            tokens.append(t)
            types.append(USER_DEFINED)
    assert set(byte_to_unicode().values()) <= set(tokens)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    md = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": Typed(VT.STRING, tokens),
        "tokenizer.ggml.token_type": Typed(VT.INT32, types),
        "tokenizer.ggml.merges": Typed(VT.STRING, merges),
        "tokenizer.ggml.bos_token_id": Typed(VT.UINT32, tokens.index(control[0])),
        "tokenizer.ggml.eos_token_id": Typed(VT.UINT32, tokens.index(control[1])),
    }
    md.update(extra)
    return md


def plain(md: dict[str, Any]) -> dict[str, Any]:
    """Metadata as plain Python values (``Typed`` unwrapped), as ``qlib.gguf`` reads it back."""
    return {k: v.value if isinstance(v, Typed) else v for k, v in md.items()}


def write_vocab_gguf(path: str | Path, tokenizer_md: dict[str, Any]) -> Path:
    """A vocab-only llama GGUF (hyperparameters, tokenizer, no tensors)."""
    path = Path(path)
    md = tiny_llama_metadata()
    md["general.name"] = "vocab-only"
    md["llama.vocab_size"] = Typed(VT.UINT32, len(plain(tokenizer_md)["tokenizer.ggml.tokens"]))
    md.update(tokenizer_md)
    with open(path, "wb") as f:
        write(f, md, {})
    return path
