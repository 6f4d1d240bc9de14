"""Rank 0's handle on the tensor-parallel workers: start-up, the per-step broadcast, health, shutdown.

Rank 0 is the serving process itself: it keeps the scheduler, the asyncio server and shard 0 of the model.
`TPWorkers.start` spawns ranks 1 .. N-1 (torch.multiprocessing, spawn: a fresh interpreter that inherits
no sockets or threads) from a supervisor thread that lives as long as the workers, so their parent-death
signal (see worker.py) fires exactly when rank 0 goes away. Start-up fails fast and with the worker's own
message when a shard cannot load. Then, each step, rank 0 sends the SchedulerOutput (with the host KV tier's copies
queued since the last step, see host_kv.py) down every worker's pipe before running its own shard
(`broadcast`); all ranks meet in the forward's collectives (gloo on
CPU, NCCL on CUDA), on loopback.

The same pipes carry a pod's KV blocks under prefill/decode disaggregation (`read_kv` / `write_kv`, driven
by kv_shards.py): the only messages a worker answers, always between two steps.

Failure: the supervisor watches the workers' process sentinels. When one exits unasked, the engine is
dead: `check()` raises EngineDeadError naming the worker (the server's /health fails, the engine loop
fails every in-flight request with it), and the surviving workers are stopped, so no process is left
behind. A rank 0 blocked in a collective with a dead peer gets an error from gloo/NCCL (a closed
connection), or at worst the collective timeout; a hung worker is caught the same way. `stop()` (SIGTERM
drain, shutdown) sends every worker None, then escalates to SIGTERM and SIGKILL.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
from collections.abc import Sequence
from multiprocessing.connection import Connection, wait

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from tokenfleet.runtime.config import ModelConfig, RuntimeConfig
from tokenfleet.runtime.engine.cpu_threads import cpu_thread_budget
from tokenfleet.runtime.engine.kv_cache.kv_connector import KVTransferError
from tokenfleet.runtime.engine.parallel.host_kv import HostKVOp
from tokenfleet.runtime.engine.parallel.support import SHARDED_DRAFTS
from tokenfleet.runtime.engine.parallel.worker import init_process_group, worker_main
from tokenfleet.runtime.engine.scheduler_output import SchedulerOutput
from tokenfleet.runtime.engine.spec_decode.proposer import ProposalInput
from tokenfleet.runtime.errors import ConfigError, EngineDeadError

logger = logging.getLogger(__name__)

_STOP_GRACE_S = 5.0


def rank_device(model: ModelConfig, rank: int) -> torch.device:
    """CUDA: device `rank` (one GPU per rank); otherwise the CPU."""
    if model.device == "cuda" or (model.device == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", rank)
    return torch.device("cpu")


def threads_per_rank(size: int) -> int:
    """CPU ranks split the process's thread budget (cpu_threads.py) instead of each taking every core."""
    return max(1, cpu_thread_budget() // size)


def collective_timeout_s(config: RuntimeConfig) -> float:
    """How long a collective may wait for a peer before it fails (a hung worker): past the health stall."""
    return max(60.0, 2 * config.server.health_stall_seconds)


def check_devices(config: RuntimeConfig) -> None:
    size = config.parallel.tensor_parallel_size
    if rank_device(config.model, 0).type == "cuda" and torch.cuda.device_count() < size:
        raise ConfigError(
            f"tensor_parallel_size {size} needs {size} CUDA devices; {torch.cuda.device_count()} visible"
        )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TPWorkers:
    def __init__(self, config: RuntimeConfig):
        self.size = config.parallel.tensor_parallel_size
        self._config = config
        self._init_method = f"tcp://127.0.0.1:{_free_port()}"
        self._procs: list[mp.Process] = []
        self._conns: list[Connection] = []
        self._stopping = threading.Event()
        self._spawned = threading.Event()
        self._spawn_error: BaseException | None = None
        self._wake_r, self._wake_w = os.pipe()  # wakes the supervisor out of wait() on stop()
        self.dead: str | None = None
        self._joined = False  # rank 0 is in the process group
        self._shards_draft = config.speculative.method in SHARDED_DRAFTS  # else rank 0 alone drafts
        self._host_ops: list[HostKVOp] = []  # rank 0's host-tier operations, sent with the next step
        self._supervisor = threading.Thread(
            target=self._supervise, name="tokenfleet-tp-supervisor", daemon=True
        )

    # ---- start-up ------------------------------------------------------------------------------------

    @classmethod
    def start(cls, config: RuntimeConfig) -> TPWorkers:
        """Spawn ranks 1 .. N-1; they load their shards while the caller loads shard 0."""
        check_devices(config)
        workers = cls(config)
        workers._supervisor.start()
        workers._spawned.wait()
        if workers._spawn_error is not None:
            raise workers._spawn_error
        return workers

    def _spawn(self) -> None:
        ctx = mp.get_context("spawn")
        config_json = self._config.model_dump_json()
        for rank in range(1, self.size):
            parent, child = ctx.Pipe(duplex=True)
            proc = ctx.Process(
                target=worker_main,
                args=(rank, self.size, self._init_method, config_json, child, os.getpid()),
                name=f"tokenfleet-tp-{rank}",
                daemon=True,
            )
            proc.start()
            child.close()
            self._procs.append(proc)
            self._conns.append(parent)

    def join(self, num_blocks: int, device: torch.device) -> int:
        """Wait for every shard, agree on the KV block count (the smallest), and join the process group."""
        pending = dict(enumerate(self._conns, start=1))
        while pending:
            ready = wait([*pending.values(), *(self._procs[r - 1].sentinel for r in pending)])
            for rank, conn in list(pending.items()):
                proc = self._procs[rank - 1]
                if conn in ready:
                    try:
                        kind, value = conn.recv()
                    except EOFError:
                        proc.join(1)
                        kind, value = "error", f"exited with code {proc.exitcode}"
                    if kind == "error":
                        self.stop()
                        raise ConfigError(f"tensor-parallel worker {rank} failed to start: {value}")
                    num_blocks = min(num_blocks, int(value))
                    del pending[rank]
                elif proc.sentinel in ready:
                    self.stop()
                    raise ConfigError(
                        f"tensor-parallel worker {rank} exited during start-up ({proc.exitcode})"
                    )
        for conn in self._conns:
            conn.send(("start", num_blocks))
        backend = "nccl" if device.type == "cuda" else "gloo"
        init_process_group(self._init_method, 0, self.size, backend, collective_timeout_s(self._config))
        self._joined = True
        logger.info("tensor parallel: %d ranks (%s), %d KV blocks each", self.size, backend, num_blocks)
        return num_blocks

    # ---- serving -------------------------------------------------------------------------------------

    def queue_host_kv(self, op: HostKVOp) -> None:
        """A host KV tier operation rank 0 has run on its shard: the workers replay it before the next step."""
        self._host_ops.append(op)

    def broadcast(self, output: SchedulerOutput) -> None:
        """Hand one step (and the host KV copies queued since the last) to every worker, before rank 0 runs
        its own shard."""
        self._send(("step", output))

    def broadcast_proposals(self, batch: Sequence[ProposalInput]) -> None:
        """Hand a self-draft to every worker (the draft is the sharded target's first layers: its forwards
        are collectives too). Only what drafting reads travels: not the requests' whole token lists.
        A separate draft model runs on rank 0 alone: nothing to send."""
        if not self._shards_draft:
            return
        compact = [
            ProposalInput(
                p.request_id, (), (p.last_token_id,), p.num_computed_tokens, p.num_spec, tuple(p.block_ids)
            )
            for p in batch
        ]
        self._send(("propose", compact))

    def load_lora(self, slot: int, parts: Sequence[object]) -> None:
        """Worker r loads `parts[r - 1]` (its part of a LoRA adapter) into device slot `slot`; the pipe's order
        puts it before the next step that may use the slot."""
        self._send_each("lora_load", [(slot, part) for part in parts])

    def read_kv(self, block_ids: Sequence[int]) -> list[list[bytes]]:
        """Each worker's shard of these device blocks (kv_cache/kv_connector.read_blocks on its own cache),
        per rank 1 .. N-1. The host KV copies queued so far run first, as before a step."""
        ids = tuple(block_ids)
        self._send_each("kv_read", [ids] * len(self._conns))
        return [self._reply(rank, "kv_read") for rank in range(1, self.size)]

    def write_kv(self, block_ids: Sequence[int], shards: Sequence[Sequence[bytes]]) -> None:
        """Write `shards[r - 1]` (one payload per block) into these device blocks of rank r; returns once
        every worker has written (a worker that cannot raises KVTransferError here, the engine lives on)."""
        ids = tuple(block_ids)
        self._send_each("kv_write", [(ids, tuple(s)) for s in shards])
        for rank in range(1, self.size):
            self._reply(rank, "kv_write")

    def _reply(self, rank: int, what: str):
        conn = self._conns[rank - 1]
        try:
            if not conn.poll(collective_timeout_s(self._config)):
                raise EngineDeadError(f"tensor-parallel worker {rank} did not answer {what} (hung)")
            kind, value = conn.recv()
        except (EOFError, OSError) as e:
            self.check()
            raise EngineDeadError(f"tensor-parallel worker {rank} is gone ({what}): {e!r}") from e
        if kind == "error":
            raise KVTransferError(f"tensor-parallel worker {rank} failed {what}: {value}")
        return value

    def _send(self, work: tuple[str, object]) -> None:
        self._send_each(work[0], [work[1]] * len(self._conns))

    def _send_each(self, kind: str, works: Sequence[object]) -> None:
        """Send worker r `(kind, works[r - 1], host KV operations queued since the last message)`."""
        self.check()
        ops = tuple(self._host_ops)
        self._host_ops.clear()
        try:
            for conn, work in zip(self._conns, works, strict=True):
                conn.send((kind, work, ops))
        except OSError as e:  # a broken pipe: the worker is gone
            raise EngineDeadError(self.dead or f"a tensor-parallel worker is gone: {e!r}") from e

    def check(self) -> None:
        """Raise EngineDeadError when a worker has died (or the workers were stopped)."""
        if self.dead is not None:
            raise EngineDeadError(self.dead)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs if p.pid is not None]

    # ---- supervision and shutdown --------------------------------------------------------------------

    def _supervise(self) -> None:
        try:
            self._spawn()
        except BaseException as e:  # reported by start()
            self._spawn_error = e
            self._spawned.set()
            return
        self._spawned.set()
        sentinels = {p.sentinel: rank for rank, p in enumerate(self._procs, start=1)}
        ready = wait([*sentinels, self._wake_r])
        if not self._stopping.is_set():
            rank = next(sentinels[s] for s in ready if s in sentinels)
            proc = self._procs[rank - 1]
            proc.join(1)
            self.dead = (
                f"tensor-parallel worker {rank} (pid {proc.pid}) exited unexpectedly "
                f"(exit code {proc.exitcode}); the engine cannot run without it"
            )
            logger.error("%s", self.dead)
            self._stop_all()
        # Returning ends this thread: any worker still alive gets its parent-death signal.

    def stop(self) -> None:
        """Stop every worker (idempotent): ask, then terminate, then kill."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        if self.dead is None:
            self.dead = "the engine has shut down"
        self._stop_all()
        os.write(self._wake_w, b"x")
        if self._supervisor.is_alive() and threading.current_thread() is not self._supervisor:
            self._supervisor.join(_STOP_GRACE_S)
        if self._joined:  # rank 0's side of the process group: a later engine in this process makes its own
            self._joined = False
            dist.destroy_process_group()

    def _stop_all(self) -> None:
        for conn in self._conns:
            with contextlib.suppress(OSError):  # already closed, or the worker is gone
                conn.send(None)
        for proc in self._procs:
            proc.join(_STOP_GRACE_S)
            if proc.is_alive():
                proc.terminate()
                proc.join(_STOP_GRACE_S)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self._conns:
            conn.close()
