"""TextEvents: a stream's plain-text events from a pre-serialised envelope, byte for byte pydantic's."""

from __future__ import annotations

import pytest
from tokenfleet.runtime.openai.protocol import (
    ChatChunkChoice,
    ChatCompletionChunk,
    CompletionChoice,
    CompletionResponse,
    DeltaMessage,
)
from tokenfleet.runtime.server import sse

TEXTS = [" Paris", "", 'a "quoted" \\ back\\slash', "line\nbreak\ttab\r", "\x00\x01\x1f\x7f", "é😀中文",
         "\u2028\u2029", "</script>", "\ufffd"]  # fmt: skip


def chat(model: str):
    def build(index: int, text: str) -> ChatCompletionChunk:
        choice = ChatChunkChoice(index=index, delta=DeltaMessage(content=text))
        return ChatCompletionChunk(id="chatcmpl-1", created=1733, model=model, choices=[choice])

    return build


def completion(model: str):
    def build(index: int, text: str) -> CompletionResponse:
        return CompletionResponse(
            id="cmpl-1", created=1733, model=model, choices=[CompletionChoice(index=index, text=text)]
        )

    return build


@pytest.mark.parametrize("make", [chat, completion])
@pytest.mark.parametrize("model", ["tiny", 'we"ird\\model\x00', "\x00tokenfleet-text\x00"])
def test_events_are_pydantics_bytes(make, model):
    # The last model name holds the text's marker: the envelope cannot be split, every event is built whole.
    build = make(model)
    events = sse.TextEvents(build)
    for index in (0, 3, 0):
        for text in TEXTS:
            assert events.event(index, text) == sse.event(build(index, text)), (index, text)
