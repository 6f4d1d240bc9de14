"""A request body -> the prompt's token ids -> the chained block hashes a pod would compute for it.

Exact matching needs exactly the pod's token ids, so the router goes through the server's own translation
(`openai.translate`: same chat-template rendering, same `add_special_tokens=False`) with the model's
tokenizer, and the engine's `block_hash` functions with the block size and hash extra the pod reports.
A body the pod would reject yields None: the router forwards it anyway so the pod answers with its 400.

Without a tokenizer (none configured or loadable) the router still gets cache affinity from the approximate
index, keyed on the prompt *text*: characters stand in for token ids, in blocks of `TEXT_BLOCK_CHARS`.
Those keys can never match a pod's events, so only the approximate index uses them.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from tokenfleet.runtime.engine.kv_cache.block_hash import BlockHash, block_hashes_for, with_adapter
from tokenfleet.runtime.errors import InvalidRequest
from tokenfleet.runtime.openai.protocol import ChatCompletionRequest, CompletionRequest
from tokenfleet.runtime.openai.translate import Tokenizer, chat_prompt, completion_prompts, parse_request

TEXT_BLOCK_CHARS = 64


def prompt_token_ids(path: str, body: bytes, tokenizer: Tokenizer) -> list[int] | None:
    """Token ids of the (first) prompt exactly as the pod will see them, or None if the pod would reject it."""
    try:
        if path.endswith("/chat/completions"):
            return chat_prompt(parse_request(ChatCompletionRequest, body), tokenizer).token_ids
        prompts = completion_prompts(parse_request(CompletionRequest, body), tokenizer)
        return prompts[0].token_ids  # n prompts in one body: they share the route, the first decides
    except (InvalidRequest, ValueError, TypeError, KeyError):
        return None


def prompt_text(payload: dict) -> str:
    """A canonical text of the prompt for the tokenizer-less approximate index."""
    if "messages" in payload:
        return json.dumps(payload.get("messages"), sort_keys=True, ensure_ascii=False)
    prompt = payload.get("prompt", "")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        prompt = prompt[0]
    return prompt if isinstance(prompt, str) else json.dumps(prompt)


def token_block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    hash_extra: tuple,
    cache_salt: str | None,
    adapter_key: str | None = None,
) -> list[BlockHash]:
    """The pod's block hashes of a prompt; `adapter_key`: the LoRA adapter it runs under, as the pod names it."""
    return block_hashes_for(token_ids, block_size, with_adapter(tuple(hash_extra), cache_salt, adapter_key))


def text_block_hashes(text: str, model: str, cache_salt: str | None) -> list[BlockHash]:
    return block_hashes_for([ord(c) for c in text], TEXT_BLOCK_CHARS, ("text", model, cache_salt))
