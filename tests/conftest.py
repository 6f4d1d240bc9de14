"""Shared test setup (runs before any test module imports torch or triton).

- Triton kernels run under the interpreter on machines without CUDA. TRITON_INTERPRET must be set before any
  module holding @triton.jit is imported.
- One intra-op thread per process: several tests run real runtime processes side by side (server, router
  pods, the e2e local pod) next to the test process, and oversubscribed OpenMP threads spin-wait — measured
  here up to 8x slower than one thread each. Child processes inherit the setting.
"""

from __future__ import annotations

import os
import shutil

if not os.environ.get("CUDA_VISIBLE_DEVICES") and shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
