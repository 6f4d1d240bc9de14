"""LogitsBuffer: on the CPU, a step's logits written into one tensor kept from step to step.

PyTorch's CPU allocator is the C library's `malloc`, which serves a block above its mmap threshold (glibc's
grows with use but stops at 32 MiB) with fresh pages from the kernel and unmaps them when it is freed. A
decode step's fp32 logits [rows, vocab] cross it at 171 rows of a 49k vocabulary or 66 of Llama 3's 128k,
and then every step faults in the pages it writes: tiny model, 256 streams, 2 torch threads, a step took
~40 ms with the logits allocated and ~24 ms written into a kept buffer (the LM head's matmul alone 31 ->
15 ms). On a GPU the caching allocator already keeps such blocks, so the buffer is for the CPU only, and
only for logits that large: below the threshold `malloc` reuses freed memory by itself.
"""

from __future__ import annotations

import torch

# glibc's largest mmap threshold (DEFAULT_MMAP_THRESHOLD_MAX on 64-bit): blocks above it are always mapped.
_MMAP_THRESHOLD_MAX = 32 * 2**20


class LogitsBuffer:
    def __init__(self, max_rows: int, enabled: bool):
        self.enabled = enabled  # on the CPU, for a model that writes its logits into a given tensor
        self.max_rows = max_rows  # a decode step's rows (max_num_seqs); larger steps allocate as before
        self._buffer: torch.Tensor | None = None

    def take(self, rows: int, vocab: int) -> torch.Tensor | None:
        """An fp32 [rows, vocab] tensor to write this step's logits into (valid until the next `take`), or
        None where allocating is as cheap: not on the CPU, small, or more rows than a decode step has."""
        if not self.enabled or rows > self.max_rows or rows * vocab * 4 <= _MMAP_THRESHOLD_MAX:
            return None
        buffer = self._buffer
        if buffer is None or buffer.shape[0] < rows or buffer.shape[1] != vocab:
            # Room for the whole decode batch at once: growing it step by step would fault pages in again.
            buffer = self._buffer = torch.empty((self.max_rows, vocab), dtype=torch.float32)
        return buffer[:rows]

    def release(self) -> None:
        self._buffer = None
