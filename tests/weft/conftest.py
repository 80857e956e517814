"""Shared fixtures of the WEFT runtime tests."""
from pathlib import Path

import pytest

SERVERS = Path(__file__).parent / "servers"


@pytest.fixture
def servers_dir() -> Path:
    return SERVERS
