"""The documentation/behaviour judge: an LLM (a scripted fake endpoint) claims that a tool's documentation and its
behaviour disagree, and its claim is accepted only when an execution check confirms it; a lying judge is refuted;
offline the loop's attribution says ``undecided`` where only the judge could decide; hostile answers are typed
failures with keys masked."""
import json
import logging

import anyio
import pytest

from treadle.llm import LLMClient
from treadle.llm.fake_endpoint import FAKE_MODEL, Step, chat_reply
from treadle.weft.evolve.attribute import Blame, generate_verifier, record_evidence
from treadle.weft.evolve.certify import play
from treadle.weft.evolve.doc_judge import (MAX_ANSWER, DocClaim, check_claim, doc_statements, judge_tools,
                                           unit_confusions)
from treadle.weft.evolve.loop import TaskSlot, attribute_failure
from treadle.weft.rollouts.tasks import AtomicTask
from treadle.weft.runtime import Runtime
from treadle.weft.runtime.callparse import parse_call
from treadle.weft.runtime.object_state import snapshot_from_object
from treadle.weft.runtime.verify import CheckpointSpec

logging.getLogger("treadle.weft.tools").setLevel(logging.CRITICAL)

SOURCE = (__import__("pathlib").Path(__file__).parents[1] / "servers" / "thermo_obj.py").read_text()
DOC_SAYS_F = SOURCE.replace('description="target temperature in degrees Celsius"',
                            'description="target temperature in degrees Fahrenheit"')
NO_OFFSET = SOURCE.replace("celsius * 1.8 + 32}", "celsius * 1.8}")
READ_WRITES = SOURCE.replace('    return {"celsius": t.rooms[room]}',
                             '    t.thermostat -= 1\n    return {"celsius": t.rooms[room]}')
SET_21 = parse_call("set_thermostat(temperature=21)")
FOLLOWS_F = parse_call("set_thermostat(temperature=69.8)")  # 21 C written in Fahrenheit


def _said(obj):
    return Step(body=chat_reply(obj if isinstance(obj, str) else json.dumps(obj), FAKE_MODEL))


def _start():
    from importlib import util

    spec = util.spec_from_file_location("_thermo_obj_for_start", __import__("pathlib").Path(__file__).parents[1]
                                        / "servers" / "thermo_obj.py")
    mod = util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return snapshot_from_object(mod.Thermo())


UNITS_CLAIM = {"tool": "set_thermostat", "kind": "scale", "documented": "target temperature in degrees Fahrenheit",
               "observed": "stores the number as given, in Celsius", "source": "arg:temperature",
               "target": "state:thermostat", "factor": 1, "offset": 0, "documented_factor": 0.5556,
               "documented_offset": -17.78}
LIE = {"tool": "set_thermostat", "kind": "scale", "documented": "target temperature in degrees Celsius",
       "observed": "stores Fahrenheit", "source": "arg:temperature", "target": "state:thermostat", "factor": 1.8,
       "offset": 32}


async def _failure(rt, source, policy_calls, client=None):
    """A task certified on the healthy thermostat, played now on ``source``; the loop's attribution of the failure."""
    healthy, now = rt.register(SOURCE), rt.register(source)
    start = _start()
    task = AtomicTask(name="thermo-21", request="Set the thermostat to 21 degrees Celsius.",
                      checkpoint=CheckpointSpec(name="thermo-21", gold_calls=[SET_21]))
    ev = await record_evidence(rt, healthy, start, task.name, [SET_21])
    spec = generate_verifier(task.checkpoint, start, ev)
    slot = TaskSlot(env="thermo", task=task, start=start, spec=spec, evidence=ev, certified_start=start)
    outs, verdict = await play(rt, now, start, spec, policy_calls)
    assert verdict.r == 0
    return await attribute_failure(rt, slot, now, outs, verdict, doc_client=client)


def _with_client(fake_config, fn, *roles):
    async def main():
        async with Runtime() as rt, LLMClient(fake_config(*(roles or ("doc_judge",)))) as client:
            return await fn(rt, client)
    return anyio.run(main)


def test_statements_the_contract_does_not_encode_are_found():
    tools = {"set_thermostat": {"name": "set_thermostat", "description": "Set it.", "contract": {"writes": ["t"]},
                                "input_schema": {"properties": {"temperature": {"description": "in degrees Celsius"}}}},
             "issue_credit": {"name": "issue_credit", "description": "A credit.", "contract": {
                 "writes": ["credits"], "args_to_state": {"amount_cents": "credits.amount_cents"}},
                 "input_schema": {"properties": {"amount_cents": {"description": "store credit in cents"}}}}}
    [s] = doc_statements(tools["set_thermostat"])
    assert (s.arg, s.kind, s.covered) == ("temperature", "units", False)
    assert [x.covered for x in doc_statements(tools["issue_credit"])] == [True]  # mapped by the contract
    assert unit_confusions([FOLLOWS_F], [SET_21], tools) and not unit_confusions(
        [parse_call("set_thermostat(temperature=22)")], [SET_21], tools)
    assert not unit_confusions([parse_call('issue_credit(amount_cents=120000)')],
                               [parse_call('issue_credit(amount_cents=1200)')], tools)


def test_offline_a_unit_confusion_on_prose_units_is_undecided_never_policy():
    async def main():
        async with Runtime() as rt:
            return (await _failure(rt, DOC_SAYS_F, [FOLLOWS_F]),
                    await _failure(rt, SOURCE, [parse_call("set_thermostat(temperature=22)")]))
    confused, plain = anyio.run(main)
    assert (confused.blame, confused.rule) == (Blame.undecided, "doc_behaviour_undecided")
    assert "doc_judge" in confused.detail and "Celsius -> Fahrenheit" in confused.detail
    assert plain.blame == Blame.policy  # a wrong value that is no unit conversion is the policy's


def test_a_confirmed_claim_blames_the_environment(fake, fake_config):
    fake.script = [_said({"claims": [UNITS_CLAIM], "reason": "the tool stores Celsius"})]
    att = _with_client(fake_config, lambda rt, c: _failure(rt, DOC_SAYS_F, [FOLLOWS_F], c))
    assert (att.blame, att.rule) == (Blame.environment, "doc_behaviour")
    [checked] = att.llm["checked"]
    assert checked["confirmed"] and "temperature=42" in checked["evidence"]  # probed with a second known input
    asked = json.loads(fake.bodies[0]["messages"][1]["content"])
    assert {t["name"] for t in asked["tools"]} == {"set_thermostat"}
    assert asked["observed"]["policy"][0]["state_change"]  # the judge sees what the calls did


def test_a_lying_judge_is_refuted_by_execution(fake, fake_config):
    fabricated = {**UNITS_CLAIM, "documented": "temperature in kelvin"}
    fake.script = [_said({"claims": [LIE, fabricated], "reason": "trust me"})]
    att = _with_client(fake_config, lambda rt, c: _failure(rt, SOURCE, [FOLLOWS_F], c))
    assert att.blame == Blame.policy  # the policy converted a Celsius request to Fahrenheit on a healthy tool
    lie, made_up = att.llm["checked"]
    assert not lie["confirmed"] and "claimed 69.8" in lie["evidence"]
    assert not made_up["confirmed"] and "not in set_thermostat's documentation" in made_up["evidence"]


@pytest.mark.parametrize("source,claim,confirmed", [
    (NO_OFFSET, {"tool": "to_fahrenheit", "kind": "scale", "documented": "F = C * 1.8 + 32", "source": "arg:celsius",
                 "target": "result:fahrenheit", "factor": 1.8, "documented_factor": 1.8, "documented_offset": 32}, True),
    (SOURCE, {"tool": "to_fahrenheit", "kind": "scale", "documented": "F = C * 1.8 + 32", "source": "arg:celsius",
              "target": "result:fahrenheit", "factor": 1.8, "documented_factor": 1.8, "documented_offset": 32}, False),
    (READ_WRITES, {"tool": "read_temperature", "kind": "writes_state", "documented": "read-only"}, True),
    (SOURCE, {"tool": "read_temperature", "kind": "writes_state", "documented": "read-only"}, False),
    (READ_WRITES, {"tool": "read_temperature", "kind": "direction", "documented": "does not change anything",
                   "target": "state:thermostat", "direction": "decrease"}, True),
    (READ_WRITES, {"tool": "read_temperature", "kind": "direction", "documented": "does not change anything",
                   "target": "state:thermostat", "direction": "increase"}, False),
    (SOURCE, {"tool": "set_thermostat", "kind": "no_effect", "documented": "target temperature"}, False),
])
def test_each_claim_kind_is_checked_by_execution(source, claim, confirmed):
    calls = [parse_call("to_fahrenheit(celsius=100)"), parse_call('read_temperature(room="kitchen")'), SET_21]

    async def main():
        async with Runtime() as rt:
            h = rt.register(source)
            tools = {t["name"]: t for t in rt.registry.spec(h).tools}
            return await check_claim(rt, h, _start(), DocClaim(**claim), tools, [calls])
    got = anyio.run(main)
    assert got.confirmed is confirmed, got.evidence


@pytest.mark.parametrize("step,error", [
    (Step(body=chat_reply("x" * (MAX_ANSWER + 1), FAKE_MODEL)), "over the"),
    (Step(body=chat_reply("the docs look wrong to me", FAKE_MODEL)), "malformed answer"),
    (Step(body=chat_reply(json.dumps({"claims": [{"tool": "set_thermostat", "kind": "melt", "documented": "x"}]}),
                          FAKE_MODEL)), "malformed answer"),
    (Step(body=chat_reply("[" * 100_000, FAKE_MODEL)), "over the"),
    (Step(body=chat_reply("[" * 5_000 + "]" * 5_000, FAKE_MODEL)), "malformed answer"),
    (Step(delay=2.0, body=chat_reply("{}", FAKE_MODEL)), "call failed: timeout"),
    (Step(status=500, body={"error": "boom"}), "call failed: server_error"),
    (Step(status=400, body={"error": "bad key sk-live-abcdefghijklmnopqrstuvwx"}), "call failed: bad_request"),
])
def test_hostile_answers_are_typed_failures_with_keys_masked(fake, fake_config, step, error):
    fake.script = [step]
    fake_config = (lambda *roles, f=fake_config: f(*roles, timeout_s=0.5))

    async def go(rt, client):
        h = rt.register(DOC_SAYS_F)
        tools = {t["name"]: t for t in rt.registry.spec(h).tools}
        return await judge_tools(client, rt, h, _start(), {"reference": [SET_21], "policy": [FOLLOWS_F]}, tools)
    j = _with_client(fake_config, go)
    assert error in j.error and not j.checked
    assert "sk-live-abcdefghijklmnopqrstuvwx" not in j.model_dump_json()


def test_a_failed_judge_leaves_a_unit_confusion_undecided_and_a_missing_role_is_offline(fake, fake_config):
    fake.script = [Step(status=500, body={"error": "down"})]
    att = _with_client(fake_config, lambda rt, c: _failure(rt, DOC_SAYS_F, [FOLLOWS_F], c))
    assert (att.blame, att.rule) == (Blame.undecided, "doc_behaviour_undecided") and "server_error" in att.detail
    other = _with_client(fake_config, lambda rt, c: _failure(rt, DOC_SAYS_F, [FOLLOWS_F], c), "judge")
    assert other.blame == Blame.undecided and other.llm is None  # no doc_judge role: nothing asked
