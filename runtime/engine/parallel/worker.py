"""A tensor-parallel worker process (ranks 1 .. N-1): loads its shard, then runs every step it is sent.

Protocol over its pipe to rank 0 (pickled tuples):
  worker -> rank 0   ("ready", num_blocks) once its shard is loaded (the KV blocks its memory allows),
                     or ("error", message) when loading failed;
  rank 0 -> worker   ("start", num_blocks): the agreed block count (the smallest over the ranks); both
                     sides then join the process group; after that, each step as ("step", SchedulerOutput,
                     host KV operations to replay first) and each self-draft as ("propose", proposal
                     inputs, host KV operations); a disaggregated transfer's ("kv_read", block ids,
                     host KV operations) -> ("kv", this rank's payload per block) and ("kv_write",
                     (block ids, payloads), host KV operations) -> ("ok", None), either answered
                     ("error", message) instead when it fails; None to stop.
For a step the worker builds the same inputs as rank 0 from the same message (`prepare_inputs`) and runs
the same forward on its shard (all-reduces and the logits' all-gather are collectives every rank joins);
sampling happens on rank 0 only.

A worker never outlives rank 0: it asks the kernel for SIGKILL when the thread that started it dies
(prctl PR_SET_PDEATHSIG), and it exits when its pipe reports EOF (rank 0 closed it or died).
"""

from __future__ import annotations

import ctypes
import datetime
import logging
import os
import signal
import sys
from multiprocessing.connection import Connection

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int) -> None:
    """SIGKILL this process when its parent (the thread that spawned it) dies; exit now if it already has."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            logger.warning("prctl(PR_SET_PDEATHSIG) failed: errno %d", ctypes.get_errno())
    if os.getppid() != parent_pid:  # the parent died before the request above took effect
        os._exit(1)


def init_process_group(init_method: str, rank: int, size: int, backend: str, timeout_s: float) -> None:
    import torch.distributed as dist

    dist.init_process_group(
        backend,
        init_method=init_method,
        rank=rank,
        world_size=size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def move_kv(kind: str, work, kv_caches) -> tuple[str, object]:
    """A disaggregated transfer's part on this rank: read or write its shard of the given blocks."""
    from tokenfleet.runtime.engine.kv_cache.kv_connector import read_blocks, write_blocks

    try:
        if kind == "kv_read":
            return "kv", read_blocks(kv_caches, work)
        block_ids, payloads = work
        write_blocks(kv_caches, block_ids, payloads)
        return "ok", None
    except Exception as e:  # rank 0 refuses the transfer: the blocks are never indexed
        logger.exception("KV %s failed", kind)
        return "error", f"{type(e).__name__}: {e}"


def worker_main(
    rank: int, size: int, init_method: str, config_json: str, conn: Connection, parent_pid: int
) -> None:
    die_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: rank 0 coordinates
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s tp-worker-{rank} %(levelname)s %(message)s")
    import torch
    from tokenfleet.runtime.config import RuntimeConfig
    from tokenfleet.runtime.engine.model_runner import ModelRunner, kv_cache_dtype, num_kv_blocks
    from tokenfleet.runtime.engine.parallel.host_kv import HostKVReplica
    from tokenfleet.runtime.engine.parallel.support import SHARDED_DRAFTS
    from tokenfleet.runtime.engine.parallel.workers import collective_timeout_s, rank_device, threads_per_rank
    from tokenfleet.runtime.engine.spec_decode.proposer import build_proposer
    from tokenfleet.runtime.model.loader import load_model

    try:
        config = RuntimeConfig.model_validate_json(config_json)
        device = rank_device(config.model, rank)
        if device.type == "cpu":
            torch.set_num_threads(threads_per_rank(size))
        else:
            torch.cuda.set_device(device)
        loaded = load_model(config.model, device, tp_rank=rank, tp_size=size)
        num_blocks = num_kv_blocks(config.cache, loaded, device, kv_cache_dtype(config.cache, loaded))
    except Exception as e:  # reported to rank 0, which fails start-up with it
        conn.send(("error", f"{type(e).__name__}: {e}"))
        raise
    conn.send(("ready", num_blocks))
    try:
        start = conn.recv()  # ("start", the block count every rank uses), or None: start-up was abandoned
    except EOFError:
        return
    if start is None:
        return
    num_blocks = start[1]
    init_process_group(
        init_method, rank, size, "nccl" if device.type == "cuda" else "gloo", collective_timeout_s(config)
    )
    # A draft made of the sharded target's own layers runs on every rank (its forwards are collectives).
    proposer = (
        build_proposer(config.speculative, loaded, device)
        if config.speculative.method in SHARDED_DRAFTS
        else None
    )
    lora_slots = None
    if config.lora.enable:  # rank 0 sends this rank's part of each adapter when it fills a slot
        from tokenfleet.runtime.model.lora_slots import LoRASlots

        lora_slots = LoRASlots(
            loaded.model, config.lora.max_loras, config.lora.max_lora_rank, loaded.dtype, device
        )
        loaded.model.lora = lora_slots
    runner = ModelRunner(loaded, config.cache, device, num_blocks, proposer)
    host_kv = HostKVReplica()
    while True:
        try:
            message = conn.recv()
        except EOFError:  # rank 0 is gone
            break
        if message is None:
            break
        kind, work, host_ops = message
        host_kv.apply(host_ops, runner.kv_caches)
        if kind == "step":
            runner.forward(runner.prepare_inputs(work))
        elif (
            kind == "propose"
        ):  # the same argmax loop as rank 0 (the logits are all-gathered: same proposals)
            runner.propose(work)
        elif kind == "lora_load":
            lora_slots.load(*work)
        else:
            conn.send(move_kv(kind, work, runner.kv_caches))
    conn.close()
    import torch.distributed as dist

    dist.destroy_process_group()
