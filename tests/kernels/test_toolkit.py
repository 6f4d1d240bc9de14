"""The kernel toolkit's decisions a user can see: when the interpreter counts as on, and what it accepts."""

from __future__ import annotations

import pytest
import torch
from tokenfleet.kernels._utils import interpreter_active
from tokenfleet.kernels.cache_ops import write_kv_cache


@pytest.mark.parametrize(
    ("value", "active"),
    [
        ("1", True),
        ("true", True),
        ("TRUE", True),
        ("On", True),
        ("0", False),
        ("", False),
        ("off", False),
        ("2", False),
    ],
)
def test_interpreter_flag_means_what_it_means_to_triton(monkeypatch, value, active):
    # Triton reads TRITON_INTERPRET as a boolean: 1/true/on in any case (3.7 adds yes/y); "2" is off.
    monkeypatch.setenv("TRITON_INTERPRET", value)
    assert interpreter_active() is active


def test_cpu_tensors_are_refused_outside_the_interpreter(monkeypatch):
    key = torch.zeros(2, 1, 16)
    cache = torch.zeros(4, 16, 1, 16)
    slots = torch.tensor([0, 1])
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="CPU tensor"):
        write_kv_cache(key, key, cache, cache, slots)
