"""Slices of a request's tokens without building `prompt + output` (which copies the whole sequence).

The scheduler and the KV manager touch a few tokens of hundreds of requests every step; concatenating
each sequence to read one token would make a step cost O(total tokens) instead of O(requests).
"""

from __future__ import annotations

from tokenfleet.runtime.engine.request import Request


def token_slice(request: Request, start: int, end: int) -> list[int]:
    """`request.all_token_ids[start:end]` for 0 <= start <= end <= num_tokens, copying only the slice."""
    prompt = request.prompt_token_ids
    num_prompt = len(prompt)
    if end <= num_prompt:
        return prompt[start:end]
    output = request.output_token_ids
    if start >= num_prompt:
        return output[start - num_prompt : end - num_prompt]
    return prompt[start:] + output[: end - num_prompt]
