"""Structured server logs: an event name plus scalar fields, rendered as JSON lines or `key=value` text.

Only scalars are accepted as fields, so hidden states, tensors or whole frames cannot end up in a
log line by accident; session ids are cut to a prefix (the full id is a capability).
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import TextIO

log = logging.getLogger("splitllm.server")

_SCALARS = (str, int, float, bool, type(None))


def event(name: str, level: int = logging.INFO, **fields: object) -> None:
    """Log one event; non-scalar fields are replaced by their type name."""
    if log.isEnabledFor(level):
        clean = {k: v if isinstance(v, _SCALARS) else type(v).__name__ for k, v in fields.items()}
        log.log(level, name, extra={"fields": clean})


def session_tag(session_id: str) -> str:
    return session_id[:8]


class _Formatter(logging.Formatter):
    def __init__(self, as_json: bool) -> None:
        super().__init__()
        self.as_json = as_json

    def format(self, record: logging.LogRecord) -> str:
        fields = getattr(record, "fields", {})
        message = record.getMessage()
        if self.as_json:
            line = {
                "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
                "level": record.levelname.lower(),
                "logger": record.name,
                "event": message,
                **fields,
            }
            if record.exc_info:
                line["exception"] = self.formatException(record.exc_info)
            return json.dumps(line)
        text = " ".join([self.formatTime(record), record.levelname, record.name, message])
        text += "".join(f" {k}={v}" for k, v in fields.items())
        return text + ("\n" + self.formatException(record.exc_info) if record.exc_info else "")


def formatter(fmt: str) -> logging.Formatter:
    """The formatter of `fmt`: 'json' (one object a line) or 'text'."""
    if fmt not in ("json", "text"):
        raise ValueError("log format must be 'json' or 'text'")
    return _Formatter(fmt == "json")


class _Stderr(logging.StreamHandler):
    """Writes to whatever `sys.stderr` is when a record is emitted, not to the stream it was when the
    handler was made: a process that swaps stderr (a test runner's capture, an embedding application)
    would otherwise leave a server thread writing to a closed stream."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self) -> TextIO:
        return sys.stderr

    @stream.setter
    def stream(self, _: object) -> None:
        pass


def configure(fmt: str = "text", level: int = logging.INFO) -> None:
    """Send the process's logs to stderr in `fmt`."""
    handler = _Stderr()
    handler.setFormatter(formatter(fmt))
    logging.basicConfig(level=level, handlers=[handler], force=True)
