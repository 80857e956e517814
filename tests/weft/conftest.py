"""Shared fixtures of the WEFT tests: the servers folder, and the shared fake OpenAI-compatible endpoint
(:mod:`treadle.llm.fake_endpoint`, a real HTTP server on 127.0.0.1) with a config factory for it."""
from pathlib import Path

import pytest

SERVERS = Path(__file__).parent / "servers"


@pytest.fixture
def servers_dir() -> Path:
    return SERVERS


@pytest.fixture
def fake():
    """A fresh :class:`~treadle.llm.fake_endpoint.FakeEndpoint` (``script``, ``responder``, ``requests``)."""
    from treadle.llm.fake_endpoint import FakeEndpoint

    with FakeEndpoint() as ep:
        yield ep


@pytest.fixture
def fake_config(fake):
    """``fake_config(*roles, **role_fields)``: an LLMConfig whose roles all use the fake endpoint (no retries,
    fast back-off, 5 s timeout unless given)."""
    from treadle.llm import LLMConfig
    from treadle.llm.fake_endpoint import FAKE_MODEL

    def make(*roles, **fields):
        fields = {"max_retries": 0, "backoff_s": 0.01, "timeout_s": 5.0, **fields}
        return LLMConfig.single(FAKE_MODEL, fake.base_url, roles=roles or ("default",), **fields)

    return make
