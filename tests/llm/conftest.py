"""Fixtures for treadle.llm tests: a scripted fake OpenAI-compatible endpoint (a real HTTP server on
127.0.0.1, http.server in a thread: the client's whole HTTP stack is exercised, nothing is mocked;
:mod:`treadle.llm.fake_endpoint`)."""
from __future__ import annotations

import signal

import pytest

# the fake endpoint lives in the package so RSI and WEFT tests share it (one copy): re-exported here
from treadle.llm.fake_endpoint import FAKE_MODEL, FakeEndpoint, Step, echo_completion  # noqa: F401


@pytest.fixture
def fake():
    ep = FakeEndpoint()
    yield ep
    ep.close()


@pytest.fixture
def make_config(fake):
    """``make_config(**role_fields)``: an LLMConfig with role 'default' (and 'judge') on the fake endpoint,
    fast retries."""
    from treadle.llm import LLMConfig

    def make(roles=("default",), **fields):
        fields.setdefault("backoff_s", 0.01)
        fields.setdefault("timeout_s", 5.0)
        return LLMConfig.single(FAKE_MODEL, fake.base_url, roles=roles, **fields)

    return make


def save_tiny_checkpoint(path):
    from treadle.llm.tiny_checkpoint import save_untrained_checkpoint

    return save_untrained_checkpoint(path)


@pytest.fixture(scope="session")
def tiny_server(tmp_path_factory):
    """One real `transformers serve` over a tiny untrained checkpoint for the whole session:
    ``(LocalServer, tokenizer)``."""
    from treadle.llm import local_server

    path, tok = save_tiny_checkpoint(tmp_path_factory.mktemp("tiny-llm"))
    with local_server(path, startup_timeout_s=300) as srv:
        yield srv, tok


def default_sigint() -> None:
    """``preexec_fn`` for children that a test interrupts with SIGINT (Ctrl-C): a shell that starts the
    test session in the background (``make test &`` in a script) makes the session ignore SIGINT, and an
    ignored signal is inherited across exec, so the child would never see the test's Ctrl-C."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])
