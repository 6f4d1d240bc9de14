"""Each backend's tokenizer, from its own pods (`GET /v1/tokenizer`), so exact routing works for any model.

A router tokenizes prompts exactly as the pods do only with the pods' tokenizer. A built-in model can be
loaded locally (`Backend.tokenizer` names the source); any other model — an HF directory or a GGUF file on
the pod's volume — is fetched from a pod of the backend: the payload (openai/tokenizer_wire.py) is the
tokenizer the pod runs, checked against its digest, built once per digest and shared by every backend
announcing that digest. Pods report the digest on `/load` (monitor.py keeps it on the endpoint), so a model
change is noticed within a probe interval and the tokenizer fetched again.

Until a backend has a tokenizer, routing uses the approximate index (text hashes): the state is logged once
per change and reported (`status`: ok / fetching / error, with the reason) on the router's /v1/config.
Failed fetches are retried with backoff (1 s doubling to 30 s); a pod that has just come up with a digest
is tried at once. A pod answering 404 predates the endpoint: the router then loads `backend.model` locally,
as before.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass

import aiohttp
from tokenfleet.runtime.openai.tokenizer_wire import TOKENIZER_PATH, TokenizerPayload
from tokenfleet.runtime.openai.translate import Tokenizer
from tokenfleet.runtime.router.config import Backend
from tokenfleet.runtime.router.endpoints import Endpoint

log = logging.getLogger(__name__)

FIRST_RETRY_S = 1.0
MAX_RETRY_S = 30.0
FETCH_TIMEOUT = aiohttp.ClientTimeout(total=30.0)


@dataclass(frozen=True, slots=True)
class TokenizerStatus:
    state: str  # ok | fetching | error
    source: str  # "pods" or "local:<source>"
    digest: str | None = None
    reason: str | None = None

    def to_json(self) -> dict:
        return {"state": self.state, "source": self.source, "digest": self.digest, "reason": self.reason}


def tokenizer_from_payload(payload: TokenizerPayload) -> Tokenizer:
    """The pod's tokenizer rebuilt from its wire payload (blocking: the caller runs it off the loop)."""
    import tokenizers
    from tokenfleet.runtime.model.tokenizer import Tokenizer as ModelTokenizer

    return ModelTokenizer(
        tokenizers.Tokenizer.from_str(payload.tokenizer_json),
        eos_token_ids=payload.eos_token_ids,
        bos_token=payload.bos_token,
        eos_token=payload.eos_token,
        chat_template=payload.chat_template,
    )


def announced_digest(endpoints: Iterable[Endpoint]) -> str | None:
    """The digest most of the backend's pods report (during a rollout, the model most of them serve)."""
    counts = collections.Counter(ep.tokenizer_digest for ep in endpoints if ep.tokenizer_digest)
    return counts.most_common(1)[0][0] if counts else None


def _parse(raw: bytes) -> TokenizerPayload:
    return TokenizerPayload.model_validate_json(raw).verified()


class FetchError(Exception):
    def __init__(self, state: str, reason: str):
        super().__init__(reason)
        self.state = state
        self.reason = reason


class Legacy(Exception):
    """The pod has no /v1/tokenizer (404)."""


Build = Callable[[Callable, object], Awaitable]  # runs a blocking call off the loop


class BackendTokenizer:
    """Keeps one backend's tokenizer in step with its pods for as long as `run()` runs."""

    def __init__(
        self,
        backend: Backend,
        session: aiohttp.ClientSession,
        endpoints: Callable[[], list[Endpoint]],
        built: dict[str, Tokenizer],  # digest -> tokenizer, shared by all backends
        on_tokenizer: Callable[[Tokenizer | None], None],
        local_loader: Callable[[str], Tokenizer | None] | None,
        off_loop: Build,
    ) -> None:
        self.backend = backend
        self._session = session
        self._endpoints = endpoints
        self._built = built
        self._on_tokenizer = on_tokenizer
        self._local = local_loader
        self._off_loop = off_loop
        self.status = TokenizerStatus("fetching", "pods", reason="not fetched yet")
        self.first_attempt = asyncio.Event()

    def _set(self, status: TokenizerStatus) -> None:
        if (status.state, status.reason, status.digest) != (
            self.status.state,
            self.status.reason,
            self.status.digest,
        ):
            if status.state == "ok":
                log.info(
                    "backend %s: tokenizer %s from %s: exact prefix routing on",
                    self.backend.name,
                    status.digest or "",
                    status.source,
                )
            else:
                log.warning(
                    "backend %s: no tokenizer yet (%s: %s): routing approximately",
                    self.backend.name,
                    status.state,
                    status.reason,
                )
        self.status = status

    async def run(self) -> None:
        try:
            if self.backend.tokenizer is not None:  # named explicitly: load it here, once
                await self._load_local(self.backend.tokenizer)
                return
            await self._follow_pods()
        finally:
            self.first_attempt.set()

    async def _load_local(self, source: str) -> None:
        if self._local is None:
            self._set(
                TokenizerStatus("error", f"local:{source}", reason="this router loads no local tokenizers")
            )
            return
        try:
            tok = await self._off_loop(self._local, source)
        except Exception as e:  # routing still works, with the approximate index only
            self._set(TokenizerStatus("error", f"local:{source}", reason=f"{type(e).__name__}: {e}"))
            return
        self._on_tokenizer(tok)
        self._set(TokenizerStatus("ok" if tok is not None else "error", f"local:{source}"))

    async def _follow_pods(self) -> None:
        held: str | None = None
        delay = FIRST_RETRY_S
        next_try = 0.0
        last_seen: str | None = None
        while True:
            eps = self._endpoints()
            announced = announced_digest(eps)
            now = time.monotonic()
            # A pod came up, or the model changed: try at once rather than after the backoff.
            news = announced is not None and announced not in (last_seen, held)
            due = held is None and now >= next_try
            stale = held is not None and announced is not None and announced != held
            if eps and (due or news or (stale and now >= next_try)):
                last_seen = announced
                try:
                    payload = await self._fetch(eps, announced)
                except Legacy:
                    await self._load_local(self.backend.model)
                    return
                except FetchError as e:
                    self._set(TokenizerStatus(e.state, "pods", held, e.reason))
                    next_try = time.monotonic() + delay
                    delay = min(delay * 2, MAX_RETRY_S)
                else:
                    tok = self._built.get(payload.digest)
                    if tok is None:
                        tok = await self._off_loop(tokenizer_from_payload, payload)
                        self._built[payload.digest] = tok
                    held = payload.digest
                    self._on_tokenizer(tok)
                    self._set(TokenizerStatus("ok", "pods", held))
                    delay = FIRST_RETRY_S
                self.first_attempt.set()
            elif not eps and held is None:
                self._set(TokenizerStatus("fetching", "pods", reason="no endpoint discovered yet"))
                self.first_attempt.set()  # nothing to try yet (a backend scaled to zero): do not hold anyone
            await asyncio.sleep(0.2)

    async def _fetch(self, eps: list[Endpoint], digest: str | None) -> TokenizerPayload:
        """From a pod announcing `digest` (any pod when None); the last failure's reason otherwise."""
        # Pods in rotation first: discovery also lists those still starting (or asleep), which may not answer.
        order = sorted(
            eps,
            key=lambda ep: (
                digest is not None and ep.tokenizer_digest != digest,
                not ep.health.ready,
                ep.url,
            ),
        )
        error = FetchError("fetching", "no pod answered")
        legacy = 0
        for ep in order:
            try:
                async with self._session.get(ep.url + TOKENIZER_PATH, timeout=FETCH_TIMEOUT) as r:
                    if r.status == 200:
                        # Megabytes of JSON to parse and hash: off the loop, like the build.
                        return await self._off_loop(_parse, await r.read())
                    if r.status == 404:
                        legacy += 1
                        continue
                    if r.status == 401:
                        error = FetchError(
                            "error", f"{ep.url} answered 401: the pod needs this router's internal key"
                        )
                    elif r.status == 503:
                        error = FetchError("fetching", f"{ep.url} is loading its model")
                    else:
                        error = FetchError("error", f"{ep.url} answered {r.status}")
            except (aiohttp.ClientError, TimeoutError, OSError) as e:
                error = FetchError("fetching", f"{ep.url} unreachable: {type(e).__name__}")
            except ValueError as e:  # malformed payload or digest mismatch
                error = FetchError("error", f"{ep.url}: bad tokenizer payload: {e}")
        if legacy and legacy == len(order):
            raise Legacy()
        raise error
