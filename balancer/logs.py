"""Logging set-up: plain text for people, one JSON object per line for log pipelines."""

from __future__ import annotations

import logging
import time

import orjson

# The `extra` key under which a record carries its facts as a mapping; the JSON formatter
# writes them as keys of their own beside the message (the access log does this).
LOG_FIELDS = "kvlb_fields"


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": record.created,
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        fields = record.__dict__.get(LOG_FIELDS)
        if fields:
            entry.update(fields)
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return orjson.dumps(entry).decode()


def configure_logging(level: str, fmt: str) -> None:
    handler = logging.StreamHandler()
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


class ThrottledWarnings:
    """At most one warning per source (a replica, a peer) every `every_s`; the rest go to
    debug and are counted into the next warning. Bad input can arrive many times a second,
    and a log that floods hides everything else in it. At most `max_sources` are
    remembered, the least recently warned about forgotten first: where source names come
    from others' data, they must not grow the table without end."""

    def __init__(self, logger: logging.Logger, every_s: float = 60.0, max_sources: int = 1000) -> None:
        self.logger = logger
        self.every_s = every_s
        self.max_sources = max_sources
        self._warned_at: dict[str, float] = {}  # monotonic, least recent first
        self._quiet: dict[str, int] = {}  # logged at debug since the last warning

    def warn(self, source: str, message: str, *args: object, exc_info: bool = False) -> None:
        now = time.monotonic()
        last = self._warned_at.get(source)
        if last is not None and now - last < self.every_s:
            self._quiet[source] = self._quiet.get(source, 0) + 1
            self.logger.debug(message, *args, exc_info=exc_info)
            return
        self._warned_at.pop(source, None)
        self._warned_at[source] = now
        while len(self._warned_at) > self.max_sources:
            self.forget(next(iter(self._warned_at)))
        quiet = self._quiet.pop(source, 0)
        more = f" ({quiet} more since the last warning)" if quiet else ""
        self.logger.warning(message + more, *args, exc_info=exc_info)

    def forget(self, source: str) -> None:
        self._warned_at.pop(source, None)
        self._quiet.pop(source, None)
