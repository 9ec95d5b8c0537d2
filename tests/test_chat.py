"""``qlib.chat.Chat`` and ``python -m qlib chat``: the chat template, the KV cache kept
between turns (only the new turn is fed), Ctrl-C in a reply, the position limit."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from synthetic import write_tiny_llama

from qlib import models
from qlib.chat import EOS, INTERRUPTED, MAX_NEW_TOKENS, POSITION_LIMIT, Chat
from qlib.generate import generate
from qlib.llama.config import MAX_SEQ_LEN
from qlib.llama.engine import load
from qlib.tokenizer import Tokenizer, read_metadata

# Incremental feeding (prompt, then one token at a time, then the next turn at index_pos =
# cache length) and one prefill of the same tokens differ only in the order of float sums:
# measured 3e-5 on SmolLM2's f32 logits (about 34 at most); 1e-3 leaves room.
ATOL = 1e-3


def logits_after(model, ids: list[int]) -> torch.Tensor:
    """Next-token logits of ``ids`` prefilled at once on a fresh cache."""
    model.clear_kv_cache()
    with torch.inference_mode():
        return model.forward(torch.tensor([ids]), 0)[0]


class Recorder:
    """Greedy, keeping every logits vector it was asked about."""

    def __init__(self):
        self.seen: list[torch.Tensor] = []

    def sample(self, logits: torch.Tensor) -> int:
        self.seen.append(logits.clone())
        return int(logits.argmax())


# -- on the embedded SmolLM2 ------------------------------------------------------


@pytest.fixture(scope="module")
def smol_f32():
    model, content = load(models.path(), "cpu", form="f32")
    return model, Tokenizer.from_metadata(content.metadata)


@pytest.mark.slow
def test_two_turns_equal_one_prefill_of_the_conversation(smol_f32):
    model, tok = smol_f32
    rec = Recorder()
    chat = Chat(model, tok, processor=rec, max_new_tokens=6)
    first = "".join(chat.send("hello"))
    n_first = len(rec.seen)
    start = len(chat.ids) + 1  # the second turn starts after the reply's pending token
    second = "".join(chat.send("What is 2+2?"))
    assert first and second and chat.stop_reason in (EOS, MAX_NEW_TOKENS)
    assert model.kv_len == len(chat.ids) > start
    # the conversation as the template renders it, up to the second reply
    rendered = chat.render(chat.messages[:-1])
    ids = tok.encode(rendered)
    assert chat.ids[: len(ids)] == ids  # the cache holds exactly the rendered conversation
    got = rec.seen[n_first]  # the logits the second reply's first token was chosen from
    torch.testing.assert_close(got, logits_after(model, ids), rtol=0, atol=ATOL)


@pytest.mark.slow
def test_chat_through_stdin():
    """The terminal loop on piped input: two replies, /reset between them, /exit leaves."""
    proc = subprocess.run(
        [sys.executable, "-m", "qlib", "chat", "-n", "4"],
        input="hello\n/reset\nhi\n/exit\n",
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    assert "history and KV cache cleared" in proc.stderr
    # each reply is what `generate --chat` gives for that prompt alone (/reset forgot "hello")
    model, content = load(models.path(), "cpu")
    tok = Tokenizer.from_metadata(content.metadata)
    expected = []
    for prompt in ("hello", "hi"):
        ids = generate(model, tok.encode(tok.chat_prompt(prompt)), 4)
        ends = [k for k, i in enumerate(ids) if i in tok.eog_token_ids]
        expected.append(tok.decode(ids[: ends[0]] if ends else ids))
    assert all(expected)
    assert proc.stdout.splitlines() == expected


# -- on a tiny random model with SmolLM2's tokenizer (fast) ---------------------


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    md = read_metadata(models.path())
    tokenizer_md = {k: v for k, v in md.items() if k.startswith("tokenizer.")}
    return write_tiny_llama(
        tmp_path_factory.mktemp("chat") / "tiny.gguf",
        vocab=len(md["tokenizer.ggml.tokens"]),
        extra_metadata=tokenizer_md,
    )


@pytest.fixture
def tiny(tiny_path):
    model, content = load(tiny_path, "cpu", form="f32")
    return model, Tokenizer.from_metadata(content.metadata)


def test_chat_command_options_and_end_of_input(tiny_path):
    """-m, --engine fast, --system, sampling flags; the end of the input leaves (exit 0)."""
    argv = ["-m", str(tiny_path), "--engine", "fast", "-n", "3", "--system", "Be brief.",
            "--temperature", "0.8", "--top-k", "5", "-s", "1", "-t", "1"]  # fmt: skip
    runs = [
        subprocess.run(
            [sys.executable, "-m", "qlib", "chat", *argv],
            input="hello\n/help\n/nope\n",
            capture_output=True,
            text=True,
            timeout=300,
        )
        for _ in range(2)
    ]
    for proc in runs:
        assert proc.returncode == 0, proc.stderr
        assert len(proc.stdout) > 1 and "/reset" in proc.stderr  # a reply (the tiny model's
        # random weights may well pick only newlines), then the line's end
        assert "unknown command /nope" in proc.stderr
    assert runs[0].stdout == runs[1].stdout  # the seed fixes the sampled reply


def assert_cache_holds(model, chat: Chat) -> None:
    """The KV cache is exactly ``chat.ids``: length, and the next token's logits."""
    assert model.kv_len == len(chat.ids)
    probe = 42
    with torch.inference_mode():
        got = model.forward(torch.tensor([[probe]]), len(chat.ids))[0]
    want = logits_after(model, [*chat.ids, probe])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
    model.clear_kv_cache()  # leave the cache as it was
    if chat.ids:
        logits_after(model, chat.ids)


class Interrupting:
    """An engine that raises KeyboardInterrupt at its ``at``-th forward, before or after it."""

    def __init__(self, model, at: int, after: bool = False):
        self.model, self.at, self.after, self.calls = model, at, after, 0
        self.device = model.device

    def forward(self, x, index_pos, **kw):
        self.calls += 1
        if self.calls == self.at and not self.after:
            raise KeyboardInterrupt
        out = self.model.forward(x, index_pos, **kw)
        if self.calls == self.at and self.after:
            raise KeyboardInterrupt  # the cache took the tokens, the chat did not see it
        return out

    def clear_kv_cache(self):
        self.model.clear_kv_cache()

    @property
    def kv_len(self):
        return self.model.kv_len


@pytest.mark.parametrize("after", [False, True], ids=["before-forward", "after-forward"])
@pytest.mark.parametrize("at", [1, 3, 8], ids=["first-prompt", "first-reply", "second-reply"])
def test_interrupt_keeps_the_cache_exact(tiny, at, after):
    model, tok = tiny
    engine = Interrupting(model, at, after)
    chat = Chat(engine, tok, max_new_tokens=5)
    replies = []
    for text in ("hello", "and then?", "more"):
        replies.append("".join(chat.send(text)))
        assert_cache_holds(model, chat)
    assert engine.calls > at
    # the turn where the interrupt fell says so; the conversation goes on after it
    assert chat.stop_reason == MAX_NEW_TOKENS
    assert sum(r == "" for r in replies) <= 1


def test_interrupt_in_the_middle_of_a_forward(tiny):
    """Ctrl-C between two layers (the faithful cache is then half-written): resynchronized."""
    model, tok = tiny
    layer = model.layers[1]
    real, calls = layer.forward_attn, []

    def attn(*a, **kw):
        calls.append(1)
        if len(calls) == 3:  # the second reply token's forward, after layer 0 took its K, V
            raise KeyboardInterrupt
        return real(*a, **kw)

    layer.forward_attn = attn
    chat = Chat(model, tok, max_new_tokens=5)
    reply = "".join(chat.send("hello"))
    assert chat.stop_reason == INTERRUPTED and reply
    assert_cache_holds(model, chat)
    "".join(chat.send("go on"))
    assert chat.stop_reason == MAX_NEW_TOKENS
    assert_cache_holds(model, chat)


def test_closing_a_reply_stops_it(tiny):
    model, tok = tiny
    chat = Chat(model, tok, max_new_tokens=20)
    reply = chat.send("hello")
    next(reply)
    reply.close()
    assert chat.stop_reason == INTERRUPTED
    assert chat.messages[-1]["role"] == "assistant"
    assert_cache_holds(model, chat)
    start = len(chat.ids)
    "".join(chat.send("go on"))
    assert len(chat.ids) > start  # the next turn was fed after what was there
    assert_cache_holds(model, chat)


def test_second_turn_feeds_only_the_new_tokens(tiny):
    model, tok = tiny
    calls = []
    real = model.forward

    def spy(x, index_pos, **kw):
        calls.append((x.shape[1], index_pos))
        return real(x, index_pos, **kw)

    model.forward = spy
    chat = Chat(model, tok, max_new_tokens=3)
    "".join(chat.send("hello"))
    n = len(chat.ids)
    calls.clear()
    "".join(chat.send("hi"))
    new_turn = tok.encode("<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert calls[0] == (1 + len(new_turn), n)  # the pending reply token + the new turn
    assert all(t == 1 for t, _ in calls[1:])


def test_reset_forgets_the_history(tiny):
    model, tok = tiny
    chat = Chat(model, tok, max_new_tokens=3, system="Be brief.")
    "".join(chat.send("hello"))
    chat.reset()
    assert model.kv_len == 0 and chat.ids == []
    assert chat.messages == [{"role": "system", "content": "Be brief."}]
    "".join(chat.send("hi"))
    assert tok.decode(chat.ids).startswith("<|im_start|>system\nBe brief.<|im_end|>\n")
    assert_cache_holds(model, chat)


def test_position_limit_clears_the_history(tiny):
    model, tok = tiny
    chat = Chat(model, tok, max_new_tokens=4)
    first = len(tok.encode(chat.render([{"role": "user", "content": "hello"}])))
    chat.max_positions = first + 10
    "".join(chat.send("hello"))
    assert chat.notice is None and chat.stop_reason == MAX_NEW_TOKENS
    "".join(chat.send("hello"))  # does not fit after the first turn: starts over
    assert chat.notice and "position limit" in chat.notice
    assert [m["role"] for m in chat.messages] == ["user", "assistant"]
    assert_cache_holds(model, chat)
    chat.max_new_tokens = 100
    "".join(chat.send("x"))  # no room for 100 tokens: the reply stops at the limit
    assert chat.stop_reason == POSITION_LIMIT and len(chat.ids) == chat.max_positions
    assert_cache_holds(model, chat)
    with pytest.raises(ValueError, match="position limit"):
        chat.send("word " * 50)


def test_position_limit_is_the_engines(tiny_path):
    """A chat holds what its engine holds: a fast engine's ``max_seq_len`` (here past candle's
    4,096), the faithful engine's RoPE table."""
    tok = Tokenizer.from_gguf(tiny_path)
    fast, _ = load(tiny_path, "cpu", engine="fast", max_seq_len=6000)
    assert Chat(fast, tok).max_positions == 6000
    faithful, _ = load(tiny_path, "cpu", form="f32")
    assert Chat(faithful, tok).max_positions == MAX_SEQ_LEN


def test_fast_engine_keeps_the_cache_between_turns(tiny_path):
    model, content = load(tiny_path, "cpu", engine="fast")
    tok = Tokenizer.from_metadata(content.metadata)
    chat = Chat(model, tok, max_new_tokens=4)
    "".join(chat.send("hello"))
    first = list(chat.ids)
    "".join(chat.send("hi"))
    assert model.kv_len == len(chat.ids) > len(first)
    assert chat.ids[: len(first)] == first
    assert tok.decode(chat.ids).startswith(chat.render(chat.messages[:-1]))
