"""Shared helpers of the rollout tests: the shop environment in a runtime."""
import anyio
import pytest

from treadle.weft.rollouts.batch import shop_env
from treadle.weft.runtime import Runtime


@pytest.fixture
def with_shop():
    """``with_shop(fn)``: run ``await fn(rt, env)`` inside a fresh runtime with the shop registered."""
    def run(fn):
        async def main():
            async with Runtime() as rt:
                return await fn(rt, await shop_env(rt))
        return anyio.run(main)
    return run
