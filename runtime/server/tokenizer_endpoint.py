"""`GET /v1/tokenizer`: the tokenizer this pod serves with, for routers (wire type: openai/tokenizer_wire.py).

Built once from the engine's tokenizer object — whatever it was loaded from (an HF directory, a GGUF file's
metadata) — so a router tokenizes exactly as the pod does; `/load` reports the same digest.
"""

from __future__ import annotations

from aiohttp import web
from tokenfleet.runtime.openai.tokenizer_wire import TokenizerPayload
from tokenfleet.runtime.server.state import STATE_KEY, ServerState


def tokenizer_payload(model: str, tokenizer) -> TokenizerPayload:
    """The wire payload of a `runtime.model.Tokenizer`."""
    return TokenizerPayload(
        model=model,
        tokenizer_json=tokenizer.backend.to_str(),
        eos_token_ids=tuple(sorted(tokenizer.eos_token_ids)),
        bos_token=tokenizer.bos_token,
        eos_token=tokenizer.eos_token,
        chat_template=tokenizer.chat_template,
    ).with_digest()


def served_tokenizer(state: ServerState) -> TokenizerPayload | None:
    """The payload of the loaded engine's tokenizer (cached on the state), None before it is loaded or
    when the engine has none to offer."""
    if state.tokenizer is None and state.engine is not None:
        tok = getattr(state.engine, "tokenizer", None)
        if tok is not None and hasattr(tok, "backend"):
            state.tokenizer = tokenizer_payload(state.model_name, tok)
    return state.tokenizer  # type: ignore[return-value]


async def tokenizer_endpoint(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    state.require_engine()  # 503 while loading or draining
    payload = served_tokenizer(state)
    if payload is None:
        return web.json_response(
            {"error": {"message": "this engine exposes no tokenizer", "type": "not_found_error",
                       "param": None, "code": "no_tokenizer"}},
            status=404,
        )  # fmt: skip
    return web.Response(text=payload.model_dump_json(), content_type="application/json")
