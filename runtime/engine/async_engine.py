"""AsyncEngine: the HTTP server's view of the engine.

Model steps run on one worker thread (torch releases the GIL), so the event loop keeps serving HTTP while
the model computes. That thread is the only one that touches the EngineCore (scheduler, KV cache,
requests); the event loop talks to it through a command inbox, and outputs come back through
`loop.call_soon_threadsafe` into one asyncio.Queue per request.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from tokenfleet.runtime.config import RuntimeConfig
from tokenfleet.runtime.engine.drain_rate import DrainRate
from tokenfleet.runtime.engine.engine_core import EngineCore
from tokenfleet.runtime.engine.outputs import EngineStats, RequestDelta
from tokenfleet.runtime.engine.request import ResumeFrom
from tokenfleet.runtime.engine.sampling_params import SamplingParams
from tokenfleet.runtime.errors import EngineDeadError, ModelNotFound, Overloaded

logger = logging.getLogger(__name__)

_IDLE_WAIT_S = 0.5


@dataclass(frozen=True, slots=True)
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int
    cache_salt: str | None
    arrival_time: float
    resume: ResumeFrom | None = None
    tenant: str | None = None
    lora_name: str | None = None


@dataclass(frozen=True, slots=True)
class _Abort:
    request_id: str
    done: asyncio.Future | None = None


@dataclass(frozen=True, slots=True)
class _Call:
    """Run `fn(core)` on the engine thread (configuration changes, test hooks) and return its result."""

    fn: object
    done: asyncio.Future = field(default=None)  # type: ignore[assignment]


class _Stop:
    pass


class AsyncEngine:
    def __init__(self, core: EngineCore):
        self.core = core
        self.config: RuntimeConfig = core.config
        self.tokenizer = core.tokenizer
        self.model_name = core.model_name
        self.max_model_len = core.max_model_len
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._queues: dict[str, asyncio.Queue] = {}
        self._futures: set[asyncio.Future] = set()  # pending abort()/call() replies (event-loop thread)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._dead: BaseException | None = None
        self._stats: EngineStats = core.stats()
        self._submitted = 0  # adds sent (event-loop thread writes)
        self._ingested = 0  # adds taken in (engine thread writes)
        self._busy_since: float | None = None  # when the current unfinished work was last making progress
        self._last_progress = time.monotonic()
        self._drain = DrainRate()  # completions seen on the event loop, for Retry-After on a 429

    @classmethod
    def from_config(cls, config: RuntimeConfig) -> AsyncEngine:
        core = EngineCore(config)
        core.prefill_pins()  # before any client request: the first ones already hit the pinned prefixes
        return cls(core)

    # ---- lifecycle ---------------------------------------------------------------------------------

    async def start(self) -> None:
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="tokenfleet-engine", daemon=True)
        self._thread.start()

    async def shutdown(self) -> None:
        if self._thread is None:
            return
        self._inbox.put(_Stop())
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join)
        self._thread = None
        self.core.shutdown()  # tensor-parallel workers

    @property
    def started(self) -> bool:
        return self._thread is not None and self._dead is None

    # ---- requests ----------------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        cache_salt: str | None = None,
        resume: ResumeFrom | None = None,
        tenant: str | None = None,
        lora_name: str | None = None,
    ) -> AsyncIterator[RequestDelta]:
        """Validate and enqueue now (errors raise here); iterate the result for the output deltas.
        `resume` continues a stream begun elsewhere (see ResumeFrom); `tenant`: whose fair share it
        counts against (`scheduler.fair_share`)."""
        if self._dead is not None:
            raise EngineDeadError(f"the engine loop has died: {self._dead!r}")
        if self._thread is None:
            raise EngineDeadError("the engine has not been started")
        if request_id in self._queues:
            raise ValueError(f"duplicate request id {request_id!r}")
        self.core.check_admission(prompt_token_ids, params)  # the scheduler's check, before queueing
        if lora_name is not None and (self.core.lora is None or not self.core.lora.is_known(lora_name)):
            raise ModelNotFound(lora_name)  # unloaded since the server looked the name up
        waiting = self._stats.num_waiting + (self._submitted - self._ingested)
        if waiting >= self.config.scheduler.max_waiting:
            raise Overloaded(
                f"the waiting queue is full ({waiting} requests waiting)",
                retry_after=self._drain.retry_after(waiting),
            )
        q: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = q
        self._submitted += 1
        self._inbox.put(
            _Add(
                request_id,
                list(prompt_token_ids),
                params,
                priority,
                cache_salt,
                time.monotonic(),
                resume,
                tenant,
                lora_name,
            )
        )
        return self._stream(request_id, q)

    async def _stream(self, request_id: str, q: asyncio.Queue) -> AsyncIterator[RequestDelta]:
        finished = False
        try:
            while True:
                item = await q.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._queues.pop(request_id, None)
            if not finished:  # the consumer went away (disconnect, cancellation): free its KV now
                self._inbox.put(_Abort(request_id))

    async def abort(self, request_id: str) -> None:
        """Abort a request; returns once the engine thread has freed its KV blocks."""
        if self._thread is None or self._dead is not None:
            return
        done = self._future()
        self._inbox.put(_Abort(request_id, done))
        await done

    async def call(self, fn):
        """Run `fn(core)` on the engine thread between steps; returns its result."""
        if self._dead is not None:
            raise EngineDeadError(f"the engine loop has died: {self._dead!r}")
        if self._thread is None:
            raise EngineDeadError("the engine is not running")
        done = self._future()
        self._inbox.put(_Call(fn, done))
        return await done

    async def sleep(self, level: int) -> dict[str, int]:
        """Sleep mode on the engine thread (EngineCore.sleep); the caller has drained the requests."""
        return await self.call(lambda core: core.sleep(level))

    async def wake_up(self, tags: list[str] | None = None) -> None:
        await self.call(lambda core: core.wake_up(tags))

    @property
    def sleep_level(self) -> int:
        return self.core.sleep_level

    def _future(self) -> asyncio.Future:
        fut = asyncio.get_running_loop().create_future()
        self._futures.add(fut)
        fut.add_done_callback(self._futures.discard)
        return fut

    # ---- health and stats --------------------------------------------------------------------------

    def check_health(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"the engine loop has died: {self._dead!r}")
        self.core.check_health()  # a dead tensor-parallel worker
        if self._thread is None or not self._thread.is_alive():
            raise EngineDeadError("the engine loop is not running")
        busy_since = self._busy_since
        stall = self.config.server.health_stall_seconds
        if busy_since is not None and time.monotonic() - busy_since > stall:
            raise EngineDeadError(
                f"the engine has made no progress for more than {stall:.0f}s with work queued"
            )

    def stats(self) -> EngineStats:
        return self._stats

    async def compile_grammar(self, spec) -> None:
        """Compile (and cache) a structured-output grammar in a worker thread, off the event loop, so the
        engine thread finds it compiled when the request arrives. Raises InvalidRequest for a bad spec."""
        if spec is not None:
            await asyncio.get_running_loop().run_in_executor(None, self.core.grammars.compile, spec)

    # ---- the engine thread ------------------------------------------------------------------------

    def _run(self) -> None:
        core = self.core
        try:
            while True:
                block = not core.has_unfinished()
                commands = []
                try:
                    commands.append(
                        self._inbox.get(timeout=_IDLE_WAIT_S) if block else self._inbox.get_nowait()
                    )
                    while True:
                        commands.append(self._inbox.get_nowait())
                except queue.Empty:
                    pass
                outputs: list[RequestDelta] = []
                for cmd in commands:
                    if isinstance(cmd, _Stop):
                        self._fail_all(EngineDeadError("the engine is shutting down"))
                        return
                    self._handle(cmd, outputs)
                if core.has_unfinished():
                    if self._busy_since is None:
                        self._busy_since = time.monotonic()
                    outputs.extend(core.step())
                    self._busy_since = time.monotonic() if core.has_unfinished() else None
                else:
                    self._busy_since = None
                self._stats = core.stats()
                if outputs:
                    self._deliver(outputs)
                core.check_health()  # a worker that died while the engine was idle ends the loop too
        except BaseException as e:  # the loop is dead: every waiter must hear it, /health must say it
            logger.exception("engine loop died")
            self._dead = e
            self._fail_all(EngineDeadError(f"the engine loop has died: {e!r}"))

    def _handle(self, cmd, outputs: list[RequestDelta]) -> None:
        core = self.core
        if isinstance(cmd, _Add):
            self._ingested += 1
            try:
                core.add_request(
                    cmd.request_id,
                    cmd.prompt_token_ids,
                    cmd.params,
                    cmd.priority,
                    cmd.cache_salt,
                    cmd.arrival_time,
                    cmd.resume,
                    cmd.tenant,
                    cmd.lora_name,
                )
            except Exception as e:  # validated up front; this is a rare race (e.g. a duplicate id)
                self._post(cmd.request_id, e)
        elif isinstance(cmd, _Abort):
            out = core.abort(cmd.request_id)
            if out is not None:
                outputs.append(out)
            if cmd.done is not None:
                self._resolve(cmd.done, None)
        elif isinstance(cmd, _Call):
            try:
                self._resolve(cmd.done, cmd.fn(core))
            except Exception as e:
                self._resolve(cmd.done, e, error=True)

    def _deliver(self, outputs: list[RequestDelta]) -> None:
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._deliver_on_loop, outputs)

    def _deliver_on_loop(self, outputs: list[RequestDelta]) -> None:
        if num_finished := sum(out.finished for out in outputs):
            self._drain.record(time.monotonic(), num_finished)
        for out in outputs:
            q = self._queues.get(out.request_id)
            if q is not None:
                q.put_nowait(out)

    def _post(self, request_id: str, item) -> None:
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._deliver_item_on_loop, request_id, item)

    def _deliver_item_on_loop(self, request_id: str, item) -> None:
        q = self._queues.get(request_id)
        if q is not None:
            q.put_nowait(item)

    def _resolve(self, fut: asyncio.Future, value, error: bool = False) -> None:
        assert self._loop is not None

        def done() -> None:
            if not fut.done():
                fut.set_exception(value) if error else fut.set_result(value)

        self._loop.call_soon_threadsafe(done)

    def _fail_all(self, error: BaseException) -> None:
        if self._loop is None:
            return

        def fail() -> None:
            for q in self._queues.values():
                q.put_nowait(error)
            for fut in list(self._futures):  # abort()/call() waiters must not hang on a dead loop
                if not fut.done():
                    fut.set_exception(error)

        with contextlib.suppress(RuntimeError):  # the event loop may already be closed
            self._loop.call_soon_threadsafe(fail)
