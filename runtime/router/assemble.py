"""A whole (non-streaming) response built from a stream, so non-streaming requests resume too.

A non-streaming request is one JSON object at the end: if its pod dies on the way there is nothing to
continue from. When it can be rebuilt exactly, the router lets the pod answer it as an annotated stream
with usage (`x-tokenfleet-resume: whole`), collects the events (across pods, when it had to continue it)
and answers with the object the pod would have sent: the same `id`, text, logprobs, finish reason and
usage. A pod that answers with JSON anyway is passed through as before; requests the router cannot rebuild
(several choices or prompts, tools) are forwarded whole.
"""

from __future__ import annotations

import json

from tokenfleet.runtime.openai.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionResponse,
    ChatLogprobs,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    Usage,
)


def can_assemble(path: str, payload: dict) -> bool:
    """Whether this non-streaming request can be streamed from the pod and rebuilt here."""
    if payload.get("n") not in (None, 1) or payload.get("tools"):
        return False
    if path.endswith("/chat/completions"):
        return True
    prompt = payload.get("prompt")
    # One prompt: a string or a list of token ids (a list of strings or of lists is several prompts).
    return isinstance(prompt, str) or (isinstance(prompt, list) and all(isinstance(t, int) for t in prompt))


class Assembler:
    """A sink for `resume.relay`: collects the client's events instead of writing them."""

    def __init__(self, chat: bool):
        self._chat = chat
        self._text: list[str] = []
        self._logprobs: list[dict] = []
        self._first: dict | None = None
        self._finish: str | None = None
        self._usage: dict | None = None
        self.error: dict | None = None

    async def write(self, data: bytes) -> None:
        for line in data.split(b"\n"):
            if not line.startswith(b"data: {"):
                continue
            event = json.loads(line[len(b"data: ") :])
            if "error" in event:
                self.error = event
                continue
            self._first = self._first or event
            if event.get("usage"):
                self._usage = event["usage"]
            for choice in event.get("choices") or []:
                self._add(choice)

    def _add(self, choice: dict) -> None:
        if self._chat:
            self._text.append((choice.get("delta") or {}).get("content") or "")
        else:
            self._text.append(choice.get("text") or "")
        if choice.get("logprobs"):
            self._logprobs.append(choice["logprobs"])
        if choice.get("finish_reason"):
            self._finish = choice["finish_reason"]

    def body(self) -> bytes:
        """The whole response, shaped as the pod shapes a non-streaming one."""
        assert self._first is not None
        first, text = self._first, "".join(self._text)
        usage = Usage.model_validate(self._usage) if self._usage else None
        if self._chat:
            lps = None
            if self._logprobs:
                lps = ChatLogprobs(content=[t for lp in self._logprobs for t in lp.get("content") or []])
            choice = ChatChoice(
                index=0, message=AssistantMessage(content=text), logprobs=lps, finish_reason=self._finish
            )
            resp = ChatCompletionResponse(
                id=first["id"], created=first["created"], model=first["model"], choices=[choice], usage=usage
            )
        else:
            clps = None
            if self._logprobs:
                merged: dict[str, list] = {
                    "tokens": [],
                    "token_logprobs": [],
                    "top_logprobs": [],
                    "text_offset": [],
                }
                for lp in self._logprobs:
                    for key, values in merged.items():
                        values.extend(lp.get(key) or [])
                clps = CompletionLogprobs(**merged)
            choice = CompletionChoice(index=0, text=text, logprobs=clps, finish_reason=self._finish)
            resp = CompletionResponse(
                id=first["id"], created=first["created"], model=first["model"], choices=[choice], usage=usage
            )
        return resp.model_dump_json().encode()

    @property
    def complete(self) -> bool:
        return self._first is not None and self.error is None
