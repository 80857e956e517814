"""BFCL v4 multi-turn environments through the runtime (skipped unless `bfcl-eval` is installed:
``pip install --no-deps bfcl-eval``)."""
import copy
import os
import json

import anyio
import pytest

from treadle.testing import require_module

require_module("bfcl_eval")

from treadle.data.bfcl import missed_function_names  # noqa: E402
from treadle.weft.envs import bfcl  # noqa: E402
from treadle.weft.runtime.errors import ErrorKind  # noqa: E402
from treadle.weft.runtime import Runtime  # noqa: E402

QUICK = 3  # entries per category in the quick tests; the slow tests replay all 200


def _gold_policy(gold):
    return lambda k: gold[k]


def _replay(category, entries, policy_for=None, judging="cumulative"):
    entries_all, gold = bfcl.load_entries(category)

    async def main():
        async with Runtime(timeout_s=30) as rt:
            out = []
            for e in entries:
                g = gold[e["id"]]
                pol = policy_for(e, g) if policy_for else _gold_policy(g)
                out.append(await bfcl.run_entry(rt, e, g, pol, category=category, judging=judging))
            assert rt.sessions() == []  # agent and gold sessions are all closed
            return out
    return anyio.run(main)


def test_servers_register_with_converted_schemas():
    async def main():
        async with Runtime() as rt:
            for name in bfcl.CLASSES:
                h = bfcl.register_class(rt, name)
                assert bfcl.register_class(rt, name) == h
                spec = rt.registry.spec(h)
                assert spec.backend == "object" and spec.tools
                assert all(t["input_schema"]["type"] == "object" for t in spec.tools)
            fs = rt.registry.spec(bfcl.register_class(rt, "GorillaFileSystem"))
            # BFCL's file-system module imports subprocess; the math module sets mpmath's global precision
            assert fs.isolation == "isolated" and "process_access" in fs.report.kinds()
            math = rt.registry.spec(bfcl.register_class(rt, "MathAPI"))
            assert "global_write" in math.report.kinds()
            assert {"cd", "ls", "mv", "grep", "sort", "diff"} <= set(fs.tool_names)
            assert list(fs.tool("mv")["input_schema"]["properties"]) == ["source", "destination"]
    anyio.run(main)


@pytest.mark.parametrize("judging", bfcl.JUDGING)
@pytest.mark.parametrize("category", bfcl.CATEGORIES)
def test_gold_replay_passes_quick(category, judging):
    entries, _ = bfcl.load_entries(category)
    chosen = [e for e in entries if e["id"] not in bfcl.KNOWN_BAD_GOLD][:QUICK]
    before = copy.deepcopy(chosen)
    for res in _replay(category, chosen, judging=judging):
        assert res.reward == 1.0 and res.judging == judging, [(r.name, r.details[:2]) for r in res.results if r.r == 0]
    assert chosen == before  # the caller's entries (and their configs) are never modified or kept


# The full audit (every scored entry of every category under both judgings) replays 1,600 entries, about
# 15 minutes on 2 cores: `TREADLE_BFCL_FULL=1` runs it; by default each judging replays every 6th scored
# entry, the two judgings at different offsets (a third of each category's entries, every class involved).
FULL = os.environ.get("TREADLE_BFCL_FULL", "") == "1"


@pytest.mark.slow
@pytest.mark.parametrize("judging", bfcl.JUDGING)
@pytest.mark.parametrize("category", bfcl.CATEGORIES)
def test_gold_replay_passes_every_scored_entry(category, judging):
    entries, _ = bfcl.load_entries(category)
    scored = [e for e in entries if e["id"] not in bfcl.KNOWN_BAD_GOLD]
    if not FULL:
        scored = scored[bfcl.JUDGING.index(judging) * 3::6]
        assert {c for e in scored for c in e["involved_classes"]} == set(bfcl.CLASSES)
    failed = [(r.id, [x.name for x in r.results if x.r == 0]) for r in _replay(category, scored, judging=judging)
              if r.reward != 1.0]
    assert failed == []


def test_skipping_one_call_fails_exactly_that_turn():
    entries, gold = bfcl.load_entries("base")
    checked = 0
    for e in entries[:4]:
        g = gold[e["id"]]
        k = next(i for i, t in enumerate(g) if t)
        def policy_for(entry, gg, k=k):
            return lambda i: gg[i][:-1] if i == k else gg[i]
        res = _replay("base", [e], policy_for, judging="per_turn")[0]
        assert [r.r for r in res.results] == [0 if i == k else 1 for i in range(len(g))], e["id"]
        assert res.results[k].policy_failure
        assert res.reward == (len(g) - 1) / len(g)
        checked += 1
    assert checked == 4


def test_cumulative_judging_is_upstreams_rule():
    """Upstream (bfcl-eval's multi_turn_checker): gold replayed from the start, state compared after every
    turn with gold; a missed state change fails that turn AND every later turn that compares the state,
    and the entry scores 0."""
    entries, gold = bfcl.load_entries("base")
    e = next(x for x in entries if x["id"] == "multi_turn_base_0")
    g = gold[e["id"]]
    assert g[0][1] == "mkdir(dir_name='temp')"  # turn 0: cd document, mkdir temp, mv ...
    res = _replay("base", [e], lambda entry, gg: (lambda i: [c for c in gg[i] if "mkdir" not in c] if i == 0
                                                  else gg[i]))[0]
    assert res.judging == "cumulative" and res.reward == 0.0
    assert res.results[0].r == 0 and "state_mismatch" in [x.value for x in res.results[0].reasons]
    # the missing folder stays missing: every later turn with gold calls compares against the gold state
    assert all(r.r == 0 for r, gt in zip(res.results[1:], g[1:]) if gt)
    per_turn = _replay("base", [e], lambda entry, gg: (lambda i: [c for c in gg[i] if "mkdir" not in c] if i == 0
                                                       else gg[i]), judging="per_turn")[0]
    assert per_turn.results[0].r == 0 and per_turn.reward > 0  # WEFT's atomic turns forgive later turns


def test_cumulative_judging_credits_results_of_earlier_turns_and_needs_a_call():
    """Upstream's response check looks at the agent's results of ALL turns so far; a turn with gold calls
    and no agent call fails."""
    entries, gold = bfcl.load_entries("base")
    e = next(x for x in entries if x["id"] == "multi_turn_base_4")  # turn 0: ls(a=True), turn 1: sort(...)
    g = gold[e["id"]]
    assert g[0] == ["ls(a=True)"] and g[1] == ["sort(file_name='report.txt')"]
    # sort done on turn 0 already, turn 1 repeats ls (a read): turn 1's gold result was received earlier
    early = {0: ["ls(a=True)", "sort(file_name='report.txt')"], 1: ["ls(a=True)"]}
    res = _replay("base", [e], lambda entry, gg: (lambda i: early.get(i, gg[i])))[0]
    assert [r.r for r in res.results[:2]] == [1, 1]
    per_turn = _replay("base", [e], lambda entry, gg: (lambda i: early.get(i, gg[i])), judging="per_turn")[0]
    assert per_turn.results[1].r == 0  # WEFT's atomic turn wants the result within the turn
    res = _replay("base", [e], lambda entry, gg: (lambda i: [] if i == 1 else gg[i]))[0]
    assert res.results[1].r == 0 and "no call on a turn whose gold has calls" in res.results[1].details[0]
    assert res.reward == 0.0


def test_unknown_judging_is_refused_before_any_session():
    entries, gold = bfcl.load_entries("base")

    async def main():
        async with Runtime() as rt:
            with pytest.raises(ValueError, match="judging must be one of"):
                await bfcl.run_entry(rt, entries[0], gold[entries[0]["id"]], lambda k: [], judging="loose")
            assert rt.sessions() == []
    anyio.run(main)


def test_withheld_and_excluded_functions_are_unknown_tools():
    entries, gold = bfcl.load_entries("miss_func")
    e = next(x for x in entries if x["missed_function"])
    turn, names = next(iter(missed_function_names(e).items()))  # upstream's entries hold docs, not names
    g = gold[e["id"]]

    def policy(k):
        return [f"{names[0]}()"] if k == 0 else g[k]
    res = _replay("miss_func", [e], lambda entry, gg: policy)[0]
    first = res.outcomes[0][0]
    assert first["error_kind"] == ErrorKind.unknown_tool.value and int(turn) > 0
    assert res.results[0].r == 0


def test_concurrent_entries_do_not_leak():
    """Several entries of the same classes at once (one runtime): each sees only its own scenario."""
    entries, gold = bfcl.load_entries("base")
    chosen = entries[:4]

    async def main():
        async with Runtime(timeout_s=30) as rt:
            results = {}

            async def one(e):
                results[e["id"]] = await bfcl.run_entry(rt, e, gold[e["id"]], _gold_policy(gold[e["id"]]))
            async with anyio.create_task_group() as tg:
                for e in chosen:
                    tg.start_soon(one, e)
            return results
    results = anyio.run(main)
    assert all(r.reward == 1.0 for r in results.values()), {k: v.reward for k, v in results.items()}
    json.dumps([r.model_dump(mode="json") for r in results.values()])  # results are plain data


def test_cli_bfcl(tmp_path):
    from typer.testing import CliRunner

    from treadle.cli import app

    res = CliRunner().invoke(app, ["weft", "bfcl", "--category", "miss_param", "--limit", "2", "--run-dir",
                                   str(tmp_path)])
    assert res.exit_code == 0, res.output
    rows = [json.loads(x) for x in (tmp_path / "miss_param.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(r["R"] == 1.0 for r in rows)
    res = CliRunner().invoke(app, ["weft", "bfcl", "--category", "nope"])
    assert res.exit_code == 2


@pytest.mark.parametrize("judging", bfcl.JUDGING)
def test_interface_errors_keep_their_reason_when_a_turn_spans_several_servers(judging):
    """multi_turn_base_0 involves TwitterAPI (first: it records calls no class can take) and GorillaFileSystem
    (the turn's gold). A made-up tool and an unparseable call recorded by TwitterAPI's session, whose own
    part passes, plus a missed mkdir on the file system: the turn fails with state and response mismatch AND
    interface_error, the detail naming both bad calls."""
    entries, gold = bfcl.load_entries("base")
    e = next(x for x in entries if x["id"] == "multi_turn_base_0")
    assert e["involved_classes"][0] == "TwitterAPI" and all("(" in c for c in gold[e["id"]][0])
    turn0 = [c for c in gold[e["id"]][0] if "mkdir" not in c] + ["teleport(to='mars')", "this is (not a call"]
    res = _replay("base", [e], lambda entry, gg: (lambda i: turn0 if i == 0 else gg[i]), judging=judging)[0]
    first = res.results[0]
    assert first.r == 0 and [x.value for x in first.reasons] == ["state_mismatch", "response_mismatch", "interface_error"]
    assert [o["error_kind"] for o in res.outcomes[0][-2:]] == ["unknown_tool", "invalid_args"]
    assert [o["session_id"] for o in res.outcomes[0][-2:]] == [res.outcomes[0][-1]["session_id"]] * 2
    assert first.details[-1] == ("interface_error: 2 call(s) with invalid arguments or unknown tools: "
                                 "['teleport', '<unparsed>']")


def test_invalid_arguments_on_one_server_keep_their_reason_when_another_fails():
    """multi_turn_base_5 turn 2 goes to TwitterAPI; the agent also sends invalid arguments to the file system
    (whose own part passes) and never posts: interface_error stays with the failed turn."""
    entries, gold = bfcl.load_entries("base")
    e = next(x for x in entries if x["id"] == "multi_turn_base_5")
    g2 = gold[e["id"]][2]
    assert g2[0].startswith("authenticate_twitter") and g2[1].startswith("post_tweet")
    res = _replay("base", [e], lambda entry, gg: (lambda i: [g2[0], "ls(bogus=1)"] if i == 2 else gg[i]),
                  judging="per_turn")[0]
    assert [r.r for r in res.results] == [1, 1, 0, 1]
    assert res.outcomes[2][1]["error_kind"] == "invalid_args"
    assert res.results[2].reasons[-1].value == "interface_error"
    assert "state_mismatch" in [x.value for x in res.results[2].reasons]
    assert res.results[2].details[-1].endswith("['ls']")


@pytest.mark.parametrize("category", ["base", "miss_func"])
def test_a_left_out_gold_call_is_the_policys_failure_on_every_class(category):
    """Per-turn judging replays the gold twice from the agent's turn start to tell environment noise
    from the policy's mistakes. Classes that keep a generator (``random.Random``) or other objects
    without value equality must still replay as equal: leaving out one gold call of a turn is the
    policy's failure (never ``nondeterministic_environment``), on entries of every involved class."""
    entries, gold = bfcl.load_entries(category)
    picked, seen_classes = [], set()
    for e in entries:  # one entry per new class mix, with a turn of two or more gold calls
        g = gold[e["id"]]
        if any(len(t) >= 2 for t in g) and not set(e["involved_classes"]) <= seen_classes:
            picked.append(e)
            seen_classes |= set(e["involved_classes"])
    assert len(seen_classes) >= 6 and picked
    for e in picked:
        g = gold[e["id"]]
        k = next(i for i, t in enumerate(g) if len(t) >= 2)

        def policy_for(entry, gg, k=k):
            return lambda i: gg[i][1:] if i == k else gg[i]
        res = _replay(category, [e], policy_for, judging="per_turn")[0]
        r = res.results[k]
        assert r.r == 0 and r.policy_failure, (e["id"], r.reasons)
        assert "nondeterministic_environment" not in [x.value for x in r.reasons], (e["id"], r.details)
