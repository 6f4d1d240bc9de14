"""ToolCallStream: a streamed output split into content deltas and tool calls as each one completes.

Text before the parser's start marker streams as content at once, except a tail that could still be the
beginning of the marker; after the marker nothing streams as content, and each call is emitted when it
closes. At the end, a region that does not parse as calls after all is released as content.
"""

from __future__ import annotations

from tokenfleet.runtime.openai.tool_parsers import ParsedCall, ToolParser


class ToolCallStream:
    def __init__(self, parser: ToolParser, parallel: bool = True):
        self._parser = parser
        self._parallel = parallel
        self._text = ""
        self._emitted = 0  # characters of _text already sent as content
        self._start: int | None = None
        self.calls: list[ParsedCall] = []

    def feed(self, delta: str) -> tuple[str, list[ParsedCall]]:
        self._text += delta
        if self._start is None:
            self._start = self._parser.find_start(self._text)
        # Text before the marker is safe to send, except a tail that may still become the marker.
        safe = len(self._text) - self._parser.holdback(self._text) if self._start is None else self._start
        content = self._text[self._emitted : safe] if safe > self._emitted else ""
        self._emitted = max(self._emitted, safe)
        if self._start is None:
            return content, []
        return content, self._new(self._parser.complete_calls(self._text[self._start :]))

    def finish(self) -> tuple[str, list[ParsedCall]]:
        if self._start is not None:
            result = self._parser.parse(self._text)
            if result.calls:
                return "", self._new(list(result.calls))
        rest = self._text[self._emitted :]
        self._emitted = len(self._text)
        return rest, []

    def _new(self, calls: list[ParsedCall]) -> list[ParsedCall]:
        limit = len(calls) if self._parallel else min(1, len(calls))
        new = calls[len(self.calls) : limit]
        self.calls.extend(new)
        return new
