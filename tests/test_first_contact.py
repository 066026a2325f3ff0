"""No warning from fp4fuse's own pattern tracing (what a new user sees first)."""
from __future__ import annotations

import warnings

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from fp4fuse.config import FusionConfig
from fp4fuse.passes.sequence_parallel import SequenceParallelismPass
from fp4fuse.patterns.base import aot_trace
from test_sp_patterns import three_layers, torch_functional_norm

# a 2-rank fake process group (tests/conftest.py): graphs with collectives trace without ranks
pytestmark = pytest.mark.usefixtures("fake_group")


# --------------------------------------------------------------------------- warnings


@pytest.fixture
def torch_warns_every_time():
    """TORCH_WARN_ONCE warns every time (so a warning seen earlier in the process still shows)."""
    before = torch._C._get_warnAlways()
    torch._C._set_warnAlways(True)
    yield
    torch._C._set_warnAlways(before)


def test_no_warning_from_fp4fuse_tracing_a_bf16_model_with_fp32_norm_weights(torch_warns_every_time):
    """F.rms_norm with bf16 activations and fp32 weights: tracing the model itself warns (the
    user's call), fp4fuse's pattern registration and replacement tracing must not."""
    with FakeTensorMode():
        args = [torch.empty(8, 64, dtype=torch.bfloat16) for _ in range(3)] + [torch.empty(64) for _ in range(3)]
    with warnings.catch_warnings(record=True) as user_side:
        warnings.simplefilter("always")
        gm = aot_trace(three_layers(torch_functional_norm), args)
    assert any("Mismatch dtype between input and weight" in str(w.message) for w in user_side)

    sp = SequenceParallelismPass(FusionConfig(enable_sequence_parallelism=True))
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        sp(gm.graph)
    assert {k: v for k, v in sp.match_counts.items() if ".torch_functional" in k} == {
        "sequence_parallel.first.torch_functional": 1, "sequence_parallel.middle.torch_functional": 1,
        "sequence_parallel.last.torch_functional": 1}
