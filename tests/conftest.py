import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

FAKE_WORLD_SIZE = 2


def pytest_configure(config):
    """pyproject.toml gives every test a time limit (``timeout``); without pytest-timeout pytest
    ignores it silently and a hung collective hangs the run, so its absence is an error."""
    if not config.pluginmanager.hasplugin("timeout"):
        raise pytest.UsageError("pytest-timeout is not installed, so the per-test time limit in pyproject.toml "
                                "would be ignored: pip install -e '.[test]'")


def pytest_collection_modifyitems(config, items):
    has_cuda = torch.cuda.is_available()
    n_gpus = torch.cuda.device_count() if has_cuda else 0
    skip_cuda = pytest.mark.skip(reason="needs a CUDA GPU")
    skip_multi = pytest.mark.skip(reason="needs 2 or more CUDA GPUs")
    for item in items:
        if "cuda" in item.keywords and not has_cuda:
            item.add_marker(skip_cuda)
        if "multigpu" in item.keywords and n_gpus < 2:
            item.add_marker(skip_multi)


@pytest.fixture(scope="module")
def fake_group():
    """A 2-rank fake process group for tracing and compiling graphs with collectives in this
    process (no real ranks). Yields the group's name."""
    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=FAKE_WORLD_SIZE)
    assert dist.get_world_size() == FAKE_WORLD_SIZE
    yield dist.group.WORLD.group_name
    if owned:
        dist.destroy_process_group()


@pytest.fixture(scope="session")
def rank_inductor_cache(tmp_path_factory) -> str:
    """One Inductor cache directory (``TORCHINDUCTOR_CACHE_DIR``) for the compiling ranks that the e2e
    tests and the demo test spawn, as ranks on one host share one: Inductor's precompiled header
    (several seconds of g++ in a fresh directory) is built once per session, not once per module.
    FX graphs are not shared between tests: each test compiles its own model (the FX graph cache key
    covers the graph, FusionPass.uuid() the configuration) and asserts what its passes did."""
    return str(tmp_path_factory.mktemp("inductor_cache"))
