"""Backend choice on CUDA: a device that cannot run fp4fuse's kernels says so, once per device.

The capability query and Triton's availability are replaced (they describe the machine; nothing
computes through them), so the choice logic runs on this CPU machine."""
from __future__ import annotations

import logging

import pytest
import torch

from fp4fuse.ops import backend
from fp4fuse.ops.backend import Backend


@pytest.fixture
def machine(monkeypatch):
    """Describe a CUDA machine: ``machine(capability, triton=...)``; the per-device cache is
    cleared before and after."""
    monkeypatch.delenv(backend.ENV_BACKEND, raising=False)
    monkeypatch.setattr(backend, "_flashinfer_available", lambda: False)
    backend.device_backend.cache_clear()

    def describe(capability: tuple[int, int], triton: bool = True) -> None:
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: capability)
        monkeypatch.setattr(backend, "_triton_available", lambda: triton)
        backend.device_backend.cache_clear()

    yield describe
    backend.device_backend.cache_clear()


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == backend.__name__ and r.levelno == logging.WARNING]


def test_below_sm80_warns_once_per_device(machine, caplog):
    machine((7, 5))
    with caplog.at_level(logging.WARNING, logger=backend.__name__):
        assert [backend.cuda_backend(i) for i in (0, 0, 1, 0, 1)] == [Backend.REFERENCE] * 5
    messages = _warnings(caplog)
    assert len(messages) == 2, messages
    assert "CUDA device 0" in messages[0] and "CUDA device 1" in messages[1]
    assert all("compute capability 7.5 is below 8.0" in m and "reference" in m for m in messages)


def test_no_triton_warns(machine, caplog):
    machine((9, 0), triton=False)
    with caplog.at_level(logging.WARNING, logger=backend.__name__):
        assert backend.cuda_backend(0) is Backend.REFERENCE
    (message,) = _warnings(caplog)
    assert "Triton is not installed" in message


def test_supported_or_forced_backend_does_not_warn(machine, monkeypatch, caplog):
    with caplog.at_level(logging.WARNING, logger=backend.__name__):
        machine((9, 0))
        assert backend.cuda_backend(0) is Backend.TRITON
        machine((8, 0))
        assert backend.cuda_backend(0) is Backend.TRITON
        machine((7, 0))
        monkeypatch.setenv(backend.ENV_BACKEND, "reference")
        assert backend.cuda_backend(0) is Backend.REFERENCE
        assert backend.backend_for(torch.ones(3)) is Backend.REFERENCE  # CPU tensors: the reference, silently
    assert _warnings(caplog) == []


def test_the_backend_variable_is_read_on_every_call(machine, monkeypatch):
    """``FusionPass.uuid`` reads ``FP4FUSE_BACKEND`` whenever Inductor asks for a cache key, so the
    kernels a compile picks must follow the variable too: a process that changes it between two
    compiles (an A/B run) gets the backend the second key names, not the first one's."""
    machine((9, 0))
    assert backend.cuda_backend(0) is Backend.TRITON
    monkeypatch.setenv(backend.ENV_BACKEND, "reference")
    assert backend.cuda_backend(0) is Backend.REFERENCE
    monkeypatch.delenv(backend.ENV_BACKEND)
    assert backend.cuda_backend(0) is Backend.TRITON
