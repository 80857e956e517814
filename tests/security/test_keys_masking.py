"""API keys never leave through endpoint text: call failures (message, ``LLMCallError``, the ledger), probes
(``LLMClient.probe`` and ``treadle llm probe``), a rollout policy's error (what ``trajectories.jsonl`` stores)
and logs. The endpoint here echoes the key back in every way it can, at every position relative to the
truncation of the message."""
import asyncio
import json
import logging

import pytest
from typer.testing import CliRunner

from treadle.llm import EndpointError, LLMCallError, LLMClient, LLMConfig
from treadle.llm.fake_endpoint import FAKE_MODEL, FakeEndpoint, Step
from treadle.llm.records import Failure, FailureKind
from treadle.untrusted import clip, mask_secrets

KEY = "trdl" + "Q7x9" * 12  # no "sk-" shape: only the resolved key itself can mask it
ENV = "TREADLE_TEST_PROVIDER_CRED"  # a name that does not say "key"
MSG = [{"role": "user", "content": "hi"}]


def _no_key_part(text: str) -> None:
    """Not the key, nor any 10-character piece of it (a key cut in half leaks its other half)."""
    assert KEY not in text
    for i in range(0, len(KEY) - 10):
        assert KEY[i:i + 10] not in text, (KEY[i:i + 10], text)


@pytest.fixture
def key_env(monkeypatch):
    monkeypatch.setenv(ENV, KEY)


@pytest.fixture
def fake():
    ep = FakeEndpoint()
    yield ep
    ep.close()


def _cfg(fake, **kw):
    kw.setdefault("backoff_s", 0.01)
    kw.setdefault("timeout_s", 5.0)
    return LLMConfig.single(FAKE_MODEL, fake.base_url, api_key_env=ENV, **kw)


@pytest.mark.parametrize("pad", [0, 150, 230, 250, 270, 290, 310])
def test_call_failure_masks_before_truncating(key_env, fake, tmp_path, pad):
    fake.script = [Step(400, {"error": {"message": "x" * pad + " your key " + KEY + " is bad"}})]

    async def go():
        async with LLMClient(_cfg(fake, max_retries=0), ledger=tmp_path / "l.jsonl") as llm:
            return await llm.chat(MSG)

    with pytest.raises(LLMCallError) as ei:
        asyncio.run(go())
    _no_key_part(str(ei.value))
    _no_key_part(ei.value.failure.model_dump_json())
    _no_key_part((tmp_path / "l.jsonl").read_text())


def test_a_garbage_2xx_body_echoing_the_key_is_masked(key_env, fake):
    fake.script = [Step(200, "<html>" + "y" * 190 + KEY + "</html>")]

    async def go():
        async with LLMClient(_cfg(fake, max_retries=0)) as llm:
            return (await llm.gather([llm.chat(MSG)]))[0]

    f = asyncio.run(go())
    assert isinstance(f, Failure) and f.kind == FailureKind.bad_response
    _no_key_part(f.message)


def test_probe_messages_built_from_the_endpoint_answer_are_masked(key_env):
    # the model list names the key; then a server without /models refuses the one-token probe quoting it
    for models, script in (([KEY, "other"], []), (None, [Step(400, {"error": {"message": "bad " + KEY}})])):
        ep = FakeEndpoint(models=models)
        ep.script = list(script)
        try:
            async def go():
                async with LLMClient(_cfg(ep)) as llm:
                    await llm.probe()

            with pytest.raises(EndpointError) as ei:
                asyncio.run(go())
            _no_key_part(str(ei.value))
        finally:
            ep.close()


def test_cli_probe_output_is_masked(key_env, tmp_path):
    from treadle.llm.cli import app

    ep = FakeEndpoint(models=None)
    ep.script = [Step(403, {"error": {"message": "key " + KEY + " is not allowed"}})]
    cfg = tmp_path / "m.json"
    cfg.write_text(json.dumps({"roles": {"default": {"model": FAKE_MODEL, "base_url": ep.base_url,
                                                      "api_key_env": ENV, "timeout_s": 5}}}))
    try:
        res = CliRunner().invoke(app, ["probe", "--config", str(cfg)])
    finally:
        ep.close()
    assert res.exit_code == 1, res.output
    _no_key_part(res.output)


def test_rollout_policy_error_is_masked(key_env, fake):
    from treadle.weft.rollouts.policies import LLMPolicy

    fake.script = [Step(400, {"error": {"message": "z" * 250 + KEY}})]

    async def go():
        cfg = LLMConfig.single(FAKE_MODEL, fake.base_url, roles=("policy",), api_key_env=ENV, max_retries=0,
                               timeout_s=5.0)
        async with LLMClient(cfg) as llm:
            class Ctx:
                attempt = 0
            return await LLMPolicy(llm).act(MSG, [], None, Ctx())

    out = asyncio.run(go())
    assert out.finish_reason == "error"
    _no_key_part(out.model_dump_json())


def test_nothing_logged_carries_the_key(key_env, fake, caplog):
    fake.script = [Step(500, {"error": {"message": KEY}})] * 2
    caplog.set_level(logging.DEBUG)

    async def go():
        async with LLMClient(_cfg(fake, max_retries=1)) as llm:
            return (await llm.gather([llm.chat(MSG)]))[0]

    f = asyncio.run(go())
    _no_key_part(f.message)
    _no_key_part(caplog.text)


def test_one_masking_function_masks_then_truncates(key_env, monkeypatch):
    from treadle.untrusted import register_secret

    register_secret(KEY)
    text = "a" * 95 + KEY
    assert clip(text, 100).startswith("a" * 95) and KEY[:5] not in clip(text, 100)
    assert mask_secrets("Authorization: Bearer abcdef0123456789") == "Authorization: ***"
    assert mask_secrets("sk-" + "A" * 30) == "***"
    monkeypatch.setenv("SOME_SERVICE_TOKEN", "tok-" + "b" * 20)
    assert mask_secrets("tok-" + "b" * 20 + "!") == "***!"
    # a Failure built anywhere masks its message and last output at construction
    f = Failure.of(FailureKind.invalid_output, "said " + KEY, "r", last_output=KEY)
    assert KEY not in f.message and f.last_output == "***"
