"""Shared fixtures: the shop and CRM certified and bundled for composition (built once per module)."""
import anyio
import pytest

from treadle.weft.envs import crm, crm_tasks, shop, shop_atomic
from treadle.weft.evolve.certify import certify_server
from treadle.weft.evolve.compose import ServerBundle


async def make_bundles(rt):
    """Register shop and CRM in ``rt``, certify their candidates, return the bundles (shop first)."""
    out = []
    for mod, cands in ((shop, shop_atomic.candidates()), (crm, crm_tasks.candidates())):
        h = rt.register(mod)
        rep = await certify_server(rt, h, mod.initial_snapshot(), cands)
        out.append(ServerBundle(name=mod.server.name, server_hash=h, snapshot=mod.initial_snapshot(),
                                tools=rt.registry.spec(h).tools, kept=list(rep.kept)))
    return out


@pytest.fixture(scope="module")
def bundles():
    from treadle.weft.runtime import Runtime

    async def main():
        async with Runtime() as rt:
            return await make_bundles(rt)
    return anyio.run(main)
