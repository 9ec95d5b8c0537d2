"""A conversation with a model: the file's chat template, the KV cache kept between turns.

``Chat.send(text)`` renders the whole conversation with the template, feeds the model only
what the cache does not hold yet (the new turn's tokens, at ``index_pos`` = the cache's
length) and yields the reply's text as it is generated; ``Chat.reset()`` forgets the history
and the cache. The command line's ``python -m qlib chat`` is a terminal loop around it.

How a turn is fed. After a reply, the cache holds the rendered conversation up to the reply
(the template's text ``P``, then the reply's tokens as generated; the last sampled token is
not fed yet). The next turn renders the conversation again with the new user message; when
that text starts with ``P`` + the reply's text (chat templates render earlier turns the same
way), only the rest is new: the pending token and the tokens of the rest are fed, the rest
starting at the template's end-of-turn marker. When it does not (a template that rewrites
earlier turns), the whole conversation is prefilled again from position 0.

Invariants: ``model.kv_len == len(chat.ids)`` whenever no reply is running, and the cache
holds exactly ``chat.ids``: a reply interrupted (``KeyboardInterrupt``, or the generator
closed) in the middle of a forward is resynchronized (the cache rebuilt from ``ids``).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from .generate import LogitsProcessor
from .llama.config import MAX_SEQ_LEN
from .tokenizer import Tokenizer, TokenOutputStream

# why a reply ended (Chat.stop_reason)
EOS = "eos"  # the model emitted an end-of-generation token (EOS, EOT, <|im_end|>, ...)
MAX_NEW_TOKENS = "max_new_tokens"  # the reply reached max_new_tokens
POSITION_LIMIT = "position_limit"  # the conversation filled every position
INTERRUPTED = "interrupted"  # KeyboardInterrupt, or the caller closed the reply


@dataclass
class _Turn:
    messages: list[dict[str, Any]]  # the conversation with the new user message
    rendered: str  # its rendering, ready for the assistant's reply
    feed: list[int]  # tokens to feed ...
    start: int  # ... at this position (0: the cache is dropped first)


class Chat:
    """A multi-turn conversation with ``model`` (any ``qlib.llama.engine.Engine``).

    ``max_new_tokens`` bounds each reply (stop tokens not counted); ``system`` is the system
    message (None: the template's default, if it has one). ``processor`` picks each token
    (default: greedy).
    """

    def __init__(
        self,
        model,
        tokenizer: Tokenizer,
        *,
        processor: LogitsProcessor | None = None,
        max_new_tokens: int = 256,
        system: str | None = None,
    ):
        if not tokenizer.chat_template:
            raise ValueError("this GGUF file has no tokenizer.chat_template: it cannot chat")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
        self.model = model
        self.tokenizer = tokenizer
        self.processor = processor or LogitsProcessor()
        self.max_new_tokens = max_new_tokens
        self.system = system
        self.stop_ids = tokenizer.eog_token_ids  # EOS, EOT, and <|im_end|>-like tokens
        # the fast engines hold their max_seq_len (the file's context length by default), the
        # faithful engine candle's RoPE table
        self.max_positions: int = int(getattr(model, "max_seq_len", None) or MAX_SEQ_LEN)
        self.stop_reason: str | None = None  # why the last reply ended
        self.notice: str | None = None  # set by send() when it had to clear the history
        self.reset()

    # state

    def reset(self) -> None:
        """Forget the conversation (the system message stays) and drop the KV cache."""
        self.messages: list[dict[str, Any]] = self._base_messages()
        self.ids: list[int] = []  # the tokens in the KV cache, in order
        self._covered = ""  # the rendered text that ids + _pending stand for
        self._pending: list[int] = []  # reply tokens sampled but not fed yet
        self._full = False  # the last reply stopped at the position limit
        self.model.clear_kv_cache()

    def _base_messages(self) -> list[dict[str, Any]]:
        return [] if self.system is None else [{"role": "system", "content": self.system}]

    @property
    def kv_len(self) -> int:
        return self.model.kv_len

    def render(self, messages: list[dict[str, Any]] | None = None) -> str:
        """The template's text of ``messages`` (default: the conversation), ready for a reply."""
        messages = self.messages if messages is None else messages
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)

    def _encode(self, text: str) -> list[int]:
        # the template writes BOS itself where the model wants one, as `generate --chat`
        return self.tokenizer.encode(text, add_special_tokens=False)

    # a turn

    def _plan(self, text: str) -> _Turn:
        messages = [*self.messages, {"role": "user", "content": text}]
        rendered = self.render(messages)
        if self.ids and not self._full and rendered.startswith(self._covered):
            feed = self._pending + self._encode(rendered[len(self._covered) :])
            turn = _Turn(messages, rendered, feed, len(self.ids))
        else:  # nothing cached, or a template that rewrote earlier turns: prefill it all
            turn = _Turn(messages, rendered, self._encode(rendered), 0)
        if turn.start + len(turn.feed) < self.max_positions and not self._full:
            return turn
        # the history no longer fits (or filled the positions last time): start over
        self.notice = (
            f"the conversation passed the position limit ({self.max_positions} positions): "
            "history cleared, starting a new one"
        )
        messages = [*self._base_messages(), {"role": "user", "content": text}]
        rendered = self.render(messages)
        turn = _Turn(messages, rendered, self._encode(rendered), 0)
        if len(turn.feed) >= self.max_positions:
            raise ValueError(
                f"the message is {len(turn.feed)} tokens with the template, past the position "
                f"limit ({self.max_positions}): shorten it"
            )
        return turn

    def send(self, text: str) -> Iterator[str]:
        """Add a user message; return an iterator over the reply's text, piece by piece.

        Checks happen now (``ValueError`` for a message that cannot fit; ``notice`` says when
        the history had to be cleared); the model runs as the iterator is consumed. Iterate
        it to the end or ``close()`` it; a ``KeyboardInterrupt`` during the reply ends it
        (``stop_reason == "interrupted"``) with the cache holding exactly what was fed.
        """
        self.notice = None
        return self._reply(self._plan(text))

    def _feed(self, tokens: list[int]) -> torch.Tensor:
        x = torch.tensor([tokens], dtype=torch.long, device=self.model.device)
        with torch.inference_mode():
            logits = self.model.forward(x, len(self.ids))
        self.ids.extend(tokens)
        return logits

    def _reply(self, turn: _Turn) -> Iterator[str]:
        self.stop_reason = None
        reply: list[int] = []  # tokens sampled for this reply (no stop token)
        prompt_end: int | None = None  # len(ids) once the turn's tokens are in the cache
        stream = TokenOutputStream(self.tokenizer)
        try:
            if turn.start == 0:
                self.model.clear_kv_cache()
                self.ids, self._covered, self._pending, self._full = [], "", [], False
            logits = self._feed(turn.feed)
            prompt_end = len(self.ids)
            self.messages, self._covered, self._pending = turn.messages, turn.rendered, []
            while True:
                token = self.processor.sample(logits[0])
                if token in self.stop_ids:
                    self.stop_reason = EOS
                    break
                reply.append(token)
                if piece := stream.next_token(token):
                    yield piece
                if len(reply) >= self.max_new_tokens:
                    self.stop_reason = MAX_NEW_TOKENS
                    break
                if len(self.ids) + 1 > self.max_positions:
                    self.stop_reason, self._full = POSITION_LIMIT, True
                    break
                logits = self._feed([token])
            if rest := stream.decode_rest():
                yield rest
        except (KeyboardInterrupt, GeneratorExit):
            self.stop_reason = INTERRUPTED
        finally:
            self._resync()
            if prompt_end is not None:  # the turn is in: record the reply, even a partial one
                content = self.tokenizer.decode(reply)
                self.messages = [*self.messages, {"role": "assistant", "content": content}]
                if self.ids:  # else the cache was lost while resynchronizing: all fed again
                    self._covered += content
                    self._pending = reply[len(self.ids) - prompt_end :]

    def _resync(self) -> None:
        """Make the cache hold exactly ``ids`` again after an interrupted forward."""
        if self.model.kv_len == len(self.ids):
            return
        try:
            self.model.clear_kv_cache()
            if self.ids:
                x = torch.tensor([self.ids], dtype=torch.long, device=self.model.device)
                with torch.inference_mode():
                    self.model.forward(x, 0)
        except KeyboardInterrupt:  # interrupted again: keep the history, drop the cache
            self.model.clear_kv_cache()
            self.ids, self._covered, self._pending = [], "", []
