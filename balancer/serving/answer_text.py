"""An answer's text as it passes through, for the prefix index: a conversation's next turn
sends it back after its prompt, and the replica that wrote it holds its KV
(`RoutingCore.answered_text`).

Only the first choice counts (`index` 0): a chat's `message.content` or streamed
`delta.content`, a completion's `text`, SGLang's /generate `text`. At most `limit`
characters are kept; a longer answer's start is still a true prefix of the next prompt.
The body passes through untouched: this only reads it.

A streamed OpenAI answer is a token's text per event, so reading each event as it passes
would cost the relay's hottest path a parse per token. Instead the chunks are kept as they
come, up to `BATCH_BYTES`, and read a batch at a time: one regular expression over the
batch finds every event's text, in C, where the engines write compact JSON and one choice
(vLLM, SGLang); a batch it finds nothing in, or with a second choice, is parsed event by
event. What is held is the text
and at most one batch; a line longer than `LINE_LIMIT` ends the reading (the text so far
stays). SGLang's /generate stream repeats the text so far in every event, so only its last
event is read, once the stream has ended (`from_last_event`).
"""

from __future__ import annotations

import re
from typing import Any

import orjson

from balancer.serving.usage import parse_json

BATCH_BYTES = 32 * 1024
# An OpenAI stream's event holds one token's text and some fields: a few hundred bytes.
LINE_LIMIT = 64 * 1024
# A streamed event's text as the engines write it. The quote before the key keeps
# `"reasoning_content":"` out, a key quoted inside a string is escaped (`\"content\":\"`),
# and logprobs' `"content":[` is no string. Escapes stay escaped here and are decoded as JSON.
# Starting with a literal lets the search skip to its candidates, in C.
CHAT_TEXT = re.compile(rb'"content":"([^"\\]*(?:\\.[^"\\]*)*)"')
COMPLETION_TEXT = re.compile(rb'"text":"([^"\\]*(?:\\.[^"\\]*)*)"')


class AnswerText:
    __slots__ = ("_chat", "_pattern", "_limit", "_parts", "_chars", "_pending", "_pending_bytes", "_done")

    def __init__(self, route: str, limit: int) -> None:
        self._chat = route == "/v1/chat/completions"
        self._pattern = CHAT_TEXT if self._chat else COMPLETION_TEXT
        self._limit = limit
        self._parts: list[str] = []
        self._chars = 0
        self._pending: list[bytes] = []  # stream chunks not read yet
        self._pending_bytes = 0
        self._done = limit <= 0

    @property
    def text(self) -> str:
        if self._pending:
            self._read_pending(final=True)
        return "".join(self._parts)

    def feed(self, chunk: bytes) -> None:
        """One chunk of an OpenAI route's event stream."""
        if self._done:
            return
        self._pending.append(chunk)
        self._pending_bytes += len(chunk)
        if self._pending_bytes >= BATCH_BYTES:
            self._read_pending(final=False)

    def _read_pending(self, final: bool) -> None:
        batch = b"".join(self._pending)
        end = len(batch) if final else batch.rfind(b"\n") + 1
        rest = batch[end:]
        self._pending = [rest] if rest else []
        self._pending_bytes = len(rest)
        if len(rest) > LINE_LIMIT:
            self._stop()
        if self._done or not end:
            return
        whole = batch[:end] if end < len(batch) else batch
        pieces = self._pattern.findall(whole)
        if not pieces or b'"index":1' in whole:
            # Spaced JSON the pattern missed, or more than one choice: event by event.
            self._read_events(whole)
            return
        joined = b"".join(pieces)
        try:
            # Escapes (`\n`, `\"`, `\u00e9`) are rare in a token: only then piece by piece.
            text = joined.decode() if b"\\" not in joined else "".join(
                orjson.loads(b'"' + piece + b'"') if b"\\" in piece else piece.decode() for piece in pieces)
        except (orjson.JSONDecodeError, UnicodeDecodeError):
            self._read_events(whole)
            return
        self._add(text)

    def _read_events(self, whole: bytes) -> None:
        for line in whole.split(b"\n"):
            if line.startswith(b"data:") and line[5:].lstrip()[:1] == b"{":
                try:
                    event = orjson.loads(line[5:])
                except orjson.JSONDecodeError:
                    continue
                self._add(_first_choice_text(event, self._chat, "delta"))
                if self._done:
                    return

    def body(self, data: bytes | None = None, payload: Any = None) -> None:
        """A whole answer: its parsed `payload`, or its bytes."""
        if payload is None and data is not None:
            payload = parse_json(data)
        if isinstance(payload, dict):
            text = payload.get("text") if "choices" not in payload else _first_choice_text(
                payload, self._chat, "message")
            self._add(text if isinstance(text, str) else None)

    def from_last_event(self, chunk: bytes) -> None:
        """The last whole `data:` event of a /generate stream's final chunks."""
        for line in reversed(chunk.split(b"\n")):
            if line.startswith(b"data:") and line[5:].lstrip()[:1] == b"{":
                try:
                    event = orjson.loads(line[5:])
                except orjson.JSONDecodeError:
                    continue  # the event straddling into a chunk that was not kept
                self.body(payload=event)
                return

    def _add(self, text: str | None) -> None:
        if text:
            room = self._limit - self._chars
            if len(text) >= room:
                text = text[:room]
                self._stop()
            self._parts.append(text)
            self._chars += len(text)

    def _stop(self) -> None:
        self._done = True
        self._pending = []
        self._pending_bytes = 0


def _first_choice_text(payload: Any, chat: bool, key: str) -> str | None:
    choices = payload.get("choices") if isinstance(payload, dict) else None
    if not isinstance(choices, list):
        return None
    for choice in choices:
        if isinstance(choice, dict) and choice.get("index", 0) == 0:
            if not chat:
                text = choice.get("text")
            else:
                message = choice.get(key)
                text = message.get("content") if isinstance(message, dict) else None
            return text if isinstance(text, str) else None
    return None
