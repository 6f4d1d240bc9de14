"""The plain decodes one step hands to the next: the scheduler's common case, without a loop per request.

In steady decoding, a step's plain decodes (scheduler_output.DecodeBatch) are the next step's too: the same
requests in the same order, each one position further, each feeding the token it just sampled. The
scheduler's `update` keeps them (`CarriedDecodes`) as it applies the step's tokens, and the next `schedule`
starts from them: their ids are copied as a whole list, their positions advanced by one list
comprehension, and only the decodes that reach their block table's `fast_limit` (one in `block_size`
steps) call the KV cache manager. The per-request loop that checks each running request is a decode,
looks its block table up and appends four fields remains for whatever is not carried: requests that
joined (a prompt's last chunk, a resumed request), and everything after a decode the cache could not
hold.

The carry is only a shortcut. It is used for as many of its requests as still lead the running ones in
the same order (compared by identity, a C loop over pointers): a request removed from the running ones (a
stop string, an abort) ends it there, and the general loop goes on from that point. It is dropped by
anything that could make one of them something other than a plain decode before the next step: proposals
about to be set (`Scheduler.max_spec_tokens`), a request `update` skipped. Block tables and their
`fast_limit`s are read afresh each step, so a table the manager changed is seen as it is.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import compress, count, islice
from operator import attrgetter, ge, is_not
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable

    from tokenfleet.runtime.engine.kv_cache.block_table import RequestBlocks
    from tokenfleet.runtime.engine.request import Request
    from tokenfleet.runtime.engine.scheduler_output import DecodeBatch

_fast_limit = attrgetter("fast_limit")
_block_ids = attrgetter("block_ids")


@dataclass(slots=True)
class CarriedDecodes:
    """A step's plain decodes after `update` applied them, column-wise: request `requests[i]` (id
    `request_ids[i]`, block table `tables[i]`) was fed at `start_pos[i]` and sampled `token_ids[i]`."""

    requests: list[Request]
    request_ids: list[str]
    tables: list[RequestBlocks]
    start_pos: list[int]
    token_ids: list[int]

    def kept(self, keep: list[bool]) -> CarriedDecodes:
        """The decodes whose `keep` is true (the others finished in the step)."""
        return CarriedDecodes(
            list(compress(self.requests, keep)),
            list(compress(self.request_ids, keep)),
            list(compress(self.tables, keep)),
            list(compress(self.start_pos, keep)),
            list(compress(self.token_ids, keep)),
        )

    def schedule(
        self,
        running: list[Request],
        allocate: Callable[[Request, int], object | None],
        decodes: DecodeBatch,
        decoding: list[Request],
        tables: list[RequestBlocks],
    ) -> int:
        """Schedule these decodes again, one position further, into the empty `decodes` (their requests to
        `decoding`, their tables to `tables`); how many. Only those still leading `running` in the same order
        are: the first that is not ends the carry (0 when none is).

        They fit the step's token budget: they fitted the last step's, which is the same, and come first
        in this one. A decode that reaches its table's `fast_limit` gets its slot from `allocate` first, in
        order; at the first that cannot, scheduling stops before it (a failed allocation changes nothing),
        and the scheduler's general path takes it from there, preempting.
        """
        requests = self.requests
        n = len(requests)
        if running[:n] != requests:  # identity (Request has no __eq__): one pointer compare each
            # Some left (a stop string, an abort) or others sit between them: keep what still leads.
            n = next(compress(count(), map(is_not, running, requests)), min(n, len(running)))
        starts = [start + 1 for start in islice(self.start_pos, n)]
        carried = self.tables[:n]
        for i in compress(count(), map(ge, starts, map(_fast_limit, carried))):
            if allocate(requests[i], 1) is None:
                n = i
                del starts[n:], carried[n:]
                break
        decodes.request_ids.extend(islice(self.request_ids, n))
        decodes.token_ids.extend(islice(self.token_ids, n))
        decodes.start_pos.extend(starts)
        decodes.block_ids.extend(map(_block_ids, carried))
        decoding.extend(islice(requests, n))
        tables.extend(carried)
        return n
