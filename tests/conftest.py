"""Test session setup: Triton kernels run under the interpreter on CPU; everything is seeded."""
import os
import random

os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede any @triton.jit decoration
# Wide rich/typer output, so messages that carry a path (whose length depends on where the repo is
# cloned) are never wrapped across lines in CLI tests.
os.environ["COLUMNS"] = "400"
os.environ["TERMINAL_WIDTH"] = "400"

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(autouse=True)
def _seed():
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    yield


def pytest_configure(config):
    config.addinivalue_line("markers", "treadle_requires(op, backend): the test runs this backend of this op")
    config.addinivalue_line("markers", "treadle_missing(reason): a required backend is missing under CI (fails)")
    from treadle.testing import FALLBACK_WARNING, in_ci

    if in_ci():
        # CI builds the extension and installs Triton: an op falling back to its reference there
        # (one UserWarning from treadle.dispatch) is a failure, not a slower green run.
        config.addinivalue_line("filterwarnings", f"error:{FALLBACK_WARNING}")


def pytest_runtest_setup(item):
    for mark in item.iter_markers("treadle_missing"):
        pytest.fail(f"{mark.kwargs['reason']} (CI is set: a missing backend fails instead of skipping)",
                    pytrace=False)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def one_thread():
    """torch on one CPU thread for the test: tiny models' GEMMs are far faster without OpenMP spinning
    on a shared 2-core machine. Use with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def cli_env(tmp_path, monkeypatch):
    """A CLI test's environment: ``$TREADLE_CACHE`` in the test's tmp folder (never the user's cache),
    ``$TREADLE_MODEL`` unset, 300 columns (no wrapped error lines). Use with
    ``pytestmark = pytest.mark.usefixtures("cli_env")``."""
    monkeypatch.setenv("TREADLE_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("TREADLE_MODEL", raising=False)
    monkeypatch.setenv("COLUMNS", "300")


@pytest.fixture(scope="module")
def tok():
    """The embedded character-level chat tokenizer (built locally, no download)."""
    from treadle.models import build_tokenizer

    return build_tokenizer()


@pytest.fixture(scope="session")
def local_ray():
    """One local Ray instance (2 CPUs) for every Ray test of the session (tests/rsi, tests/weft): started by
    the first test that needs it, shut down when the session ends (Ray's start-up is the slow part of
    those tests). Skips when Ray (the ``ray`` extra) is not installed."""
    ray = pytest.importorskip("ray")
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    if started:
        ray.shutdown()
