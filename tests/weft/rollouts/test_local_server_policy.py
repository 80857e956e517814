"""The embedded tiny model served by ``transformers serve`` (treadle.llm's local server) as the rollout
policy, through the library and the CLI. It mostly fails: every failure must be recorded per attempt and
reported in the metrics (0 accepted), never hidden and never a crashed batch."""
import asyncio
import json

import pytest


@pytest.mark.slow
def test_tiny_model_through_the_local_server(tmp_path):
    from typer.testing import CliRunner

    from treadle.llm import LLMClient, LLMConfig, local_server
    from treadle.llm.tiny_checkpoint import save_untrained_checkpoint
    from treadle.weft.rollouts.batch import Component, SampleConfig, sample_async
    from treadle.weft.rollouts.cli import app
    from treadle.weft.rollouts.metrics import summarize
    from treadle.weft.rollouts.tasks import from_shop

    path, _ = save_untrained_checkpoint(tmp_path / "tiny")
    with local_server(path, startup_timeout_s=300) as srv:
        cfg = LLMConfig.single(srv.model, srv.base_url, roles=("policy",), timeout_s=120, max_retries=0,
                               sampling={"max_tokens": 8, "temperature": 0.0})

        async def go():
            async with LLMClient(cfg) as client:
                return await sample_async(tmp_path / "run", from_shop()[1:], SampleConfig(
                    policy=Component(name="llm"), harness=Component(name="hermes"), max_steps=2), client=client)
        (t,) = asyncio.run(go())
        endpoint_failed = t.attempts[-1].steps[-1].output.finish_reason == "error"  # infrastructure, redone on rerun
        assert (t.failure is not None) == endpoint_failed and not t.accepted and t.reward == 0.0  # recorded
        a = t.attempts[0]
        assert a.r == 0 and a.policy_calls >= 1 and a.reasons  # why it failed is on the attempt
        for st in a.steps:
            assert st.output.finish_reason in ("stop", "length", "error")
            if st.output.finish_reason == "length":
                assert a.truncated and "finish_reason_length" in a.reasons
        (row,) = summarize([t])
        assert row["accepted"] == 0 and row["policy"] == f"llm:{srv.model}" and row["policy_calls"] >= 1

        toml = tmp_path / "m.toml"
        toml.write_text(f'[roles.policy]\nmodel = "{srv.model}"\nbase_url = "{srv.base_url}"\ntimeout_s = 120\n'
                        '[roles.policy.sampling]\nmax_tokens = 8\ntemperature = 0.0\n')
        out = tmp_path / "cli"
        r = CliRunner().invoke(app, ["sample", str(out), "--policy", "llm", "--llm-config", str(toml), "--k", "1",
                                     "--method", "prefix"])
        assert r.exit_code == 0, r.output
        rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        assert [x["accepted"] for x in rows] == [0] and rows[0]["trajectories"] == 2  # reported, not hidden
        assert "0 accepted trajectories" in r.output
        assert (out / "llm_ledger.jsonl").stat().st_size > 0
