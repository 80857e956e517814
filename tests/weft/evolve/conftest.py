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


def _synth_script():
    """``synth_script.py`` (the recorded library synthesis: docs, artefacts, fixture path, builders), loaded once."""
    import importlib.util
    import sys
    from pathlib import Path

    name = "_weft_evolve_synth_script"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).parent / "synth_script.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        sys.modules[name] = mod
    return sys.modules[name]


@pytest.fixture(scope="session")
def S():
    """The synthesis script module (:mod:`synth_script`): ``DOCS``, ``DESIGN``, ``BROKEN``, ``FIXED``, builders."""
    return _synth_script()


@pytest.fixture(scope="session")
def sandbox():
    """Skips the test when this machine has no sandbox (generated code never runs unsandboxed)."""
    try:
        from treadle.sandbox import isolation_mode

        return isolation_mode()
    except Exception as err:  # noqa: BLE001
        pytest.skip(f"no sandbox here: {err}")


@pytest.fixture(scope="session")
def recorded_synthesis(S, sandbox):
    """The recorded synthesis run (its broken first backend localised and repaired), accepted by execution."""
    res = S.recorded_synthesis()
    assert res.accepted and res.backend.source == S.FIXED
    return res
