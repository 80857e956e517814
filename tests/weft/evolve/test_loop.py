"""The evolution loop on the offline drill: only blamed components are revised, the error rate falls, then stops."""
import logging

import anyio
import pytest
from typer.testing import CliRunner

from treadle.cli import app
from treadle.weft.evolve.attribute import Blame
from treadle.weft.evolve.drill import ENV_BUG, EVALUATOR_DEFECT, TASK_DEFECT, drill_system
from treadle.weft.evolve.loop import evolve, run_round
from treadle.weft.runtime import Runtime

RATES = {"wrong_argument": 0.15}


@pytest.fixture(scope="module")
def rounds_and_digests():
    logging.getLogger("treadle.weft.tools").setLevel(logging.CRITICAL)

    async def main():
        async with Runtime() as rt:
            system = await drill_system(rt)
            first = system.digests()
            rounds = await evolve(rt, system, rates=RATES, max_rounds=5, k=2)
            return rounds, first, system.digests(), system
    return anyio.run(main)


def test_each_injected_fault_is_blamed_and_only_it_is_revised(rounds_and_digests):
    rounds, first, last, system = rounds_and_digests
    r1 = rounds[0]
    blame = {a.checkpoint: a.blame for a in r1.attributions}
    assert blame[TASK_DEFECT] == Blame.task and blame[EVALUATOR_DEFECT] == Blame.evaluator
    assert blame["shop-ship-order"] == Blame.environment  # get_order crashes under it
    composed = ["composed:ada-cycle/edges:crm:crm-resolve", "composed:ada-unbound-text/calls:crm:crm-credit"]
    assert r1.blamed == r1.revised == ["backend:shop", *composed, f"task:{TASK_DEFECT}",
                                       f"verifier:{EVALUATOR_DEFECT}"]
    rules = {a.checkpoint: (a.blame, a.rule) for a in r1.attributions if a.checkpoint.startswith("ada-")}
    assert rules == {"ada-unbound-text/crm:crm-credit": (Blame.task, "composed_binding"),
                     "ada-cycle/crm:crm-resolve": (Blame.task, "composed_edge")}
    assert r1.revalidated["composed:ada-cycle"] and r1.revalidated["composed:ada-unbound-text"]
    assert [s.version for s in system.composed] == [2, 2]
    assert all(r.untouched_ok for r in rounds)
    changed = sorted(c for c in first if first[c] != last[c])
    assert changed == r1.revised  # nothing else changed over all rounds
    assert all(r1.revalidated.values()) and "shop-place-order" in r1.revalidated  # every shop task re-validated
    assert "crm-credit" not in r1.revalidated  # untouched components are not re-validated
    assert ENV_BUG not in system.sources["shop"] and system.sources["shop"] == system.certified["shop"]


def test_error_rate_falls_then_the_loop_stops(rounds_and_digests):
    rounds = rounds_and_digests[0]
    rates = [r.error_rate for r in rounds]
    assert rates[1] < rates[0] and rates[-1] >= rates[-2] and len(rounds) == 3
    later = [a.blame for r in rounds[1:] for a in r.attributions]
    assert later and set(later) == {Blame.policy}  # what remains is the policy's, and it revises nothing
    assert rounds[1].revised == [] and rounds[0].passed < rounds[1].passed == rounds[0].tasks - len(rounds[1].attributions)


def test_a_clean_policy_on_a_repaired_system_fails_nothing():
    async def main():
        async with Runtime() as rt:
            system = await drill_system(rt)
            await run_round(rt, system, 1, rates=RATES)
            return await run_round(rt, system, 2, rates={})
    r = anyio.run(main)
    assert r.error_rate == 0 and r.passed == r.tasks and not r.attributions


def test_cli_bad_rate_and_budget(tmp_path):
    for args in (["--rate", "wrong_argument"], ["--rate", "melt=0.1"], ["--rate", "wrong_argument=1.5"]):
        res = CliRunner().invoke(app, ["weft", "evolve", "--out", str(tmp_path / "o"), *args])
        assert res.exit_code == 2 and "--rate" in res.output, res.output
    with pytest.raises(ValueError, match="max_rounds"):
        anyio.run(lambda: evolve(None, None, rates={}, max_rounds=0))
    assert not (tmp_path / "o").exists()


def test_cli_with_an_llm_reviser_records_rejected_answers_and_goes_on(fake, tmp_path):
    """``--llm-config``: the blamed task state and verifier go to the LLM; answers that are not the JSON asked for
    are printed and recorded in rounds.jsonl, the components stay as they were, the rounds still run."""
    import json

    from treadle.llm.fake_endpoint import FAKE_MODEL

    fake.responder = lambda req: "I would add the missing customer."
    cfg = tmp_path / "llm.toml"
    cfg.write_text("".join(f'[roles.{r}]\nmodel = "{FAKE_MODEL}"\nbase_url = "{fake.base_url}"\nmax_retries = 0\n'
                           for r in ("grounder", "verifier")))
    out = tmp_path / "o"
    res = CliRunner().invoke(app, ["weft", "evolve", "--out", str(out), "--llm-config", str(cfg), "--max-rounds", "2",
                                   "--revise-attempts", "1"])
    assert res.exit_code == 0, res.output
    assert f"round 1: task:{TASK_DEFECT} (grounder, answer 1): rejected: malformed answer" in res.output
    assert f"round 1: verifier:{EVALUATOR_DEFECT} (verifier, answer 1): rejected: malformed answer" in res.output
    rounds = [json.loads(x) for x in (out / "rounds.jsonl").read_text().splitlines()]
    # the native backend restored and the composed faults repaired deterministically; the rest left as it was
    assert rounds[0]["revised"] == ["backend:shop", "composed:ada-cycle/edges:crm:crm-resolve",
                                    "composed:ada-unbound-text/calls:crm:crm-credit"]
    assert f"task:{TASK_DEFECT}" in rounds[1]["blamed"]  # so it is blamed again
    assert len(fake.requests) == 4 and (out / "llm_ledger.jsonl").is_file()


def test_cli_llm_config_without_the_roles(tmp_path):
    cfg = tmp_path / "llm.toml"
    cfg.write_text('[roles.policy]\nmodel = "m"\nbase_url = "http://127.0.0.1:9/v1"\n')
    res = CliRunner().invoke(app, ["weft", "evolve", "--out", str(tmp_path / "o"), "--llm-config", str(cfg)])
    assert res.exit_code == 2 and res.output.startswith("Error: --llm-config: no role(s) ['grounder', 'verifier']")
    assert not (tmp_path / "o").exists()
