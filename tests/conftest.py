"""Shared test setup.

Triton kernels run under the interpreter on machines without CUDA. TRITON_INTERPRET must be set before any
module holding @triton.jit is imported, so it is set here, at collection start.
"""

from __future__ import annotations

import os
import shutil

if not os.environ.get("CUDA_VISIBLE_DEVICES") and shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")
