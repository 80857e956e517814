"""Rollout tasks (dependency order, cycles, disclosure) and views (same task semantics in every view)."""
import pytest

from treadle.weft.rollouts.policies import ReplayPolicy
from treadle.weft.rollouts.records import PolicyOutput
from treadle.weft.rollouts.registry import VIEWS
from treadle.weft.rollouts.rollout import Setup, prefix_rollout
from treadle.weft.rollouts.tasks import AtomicTask, DependencyCycleError, RolloutTask, from_shop
from treadle.weft.rollouts.harnesses import HermesHarness
from treadle.weft.runtime.verify import CheckpointSpec


def _atomic(name, deps=(), request="do it", details=()):
    return AtomicTask(name=name, request=request, details=details, depends_on=deps,
                      checkpoint=CheckpointSpec(name=name, gold_calls=[]))


def test_dependency_order_is_topological_and_stable():
    t = RolloutTask(name="t", env="shop", atomic=(_atomic("c", ("a", "b")), _atomic("b", ("a",)), _atomic("a"),
                                                   _atomic("d")))
    assert [a.name for a in t.ordered()] == ["a", "d", "b", "c"]


@pytest.mark.parametrize("atomic, match", [
    ((_atomic("a", ("b",)), _atomic("b", ("a",))), "cycle"),
    ((_atomic("a", ("a",)),), "cycle"),
    ((_atomic("a", ("zz",)),), "unknown"),
    ((_atomic("a"), _atomic("a")), "duplicate"),
])
def test_bad_dependencies_raise(atomic, match):
    with pytest.raises(DependencyCycleError, match=match):
        RolloutTask(name="t", env="shop", atomic=atomic).ordered()


def test_disclosure_levels_are_structured():
    a = _atomic("a", request="I'm ada@example.com, order 2 MUG please", details=("ada@example.com", "MUG"))
    assert a.disclose("full") == a.request
    assert a.disclose("vague") == "I'm [ask me], order 2 [ask me] please"
    assert a.disclose("partial") == "I'm ada@example.com, order 2 [ask me] please"
    assert a.disclose("vague", extra=1) == a.disclose("partial")
    with pytest.raises(ValueError, match="disclosure level"):
        a.disclose("most")
    shop = {a.name: a for t in from_shop() for a in t.atomic}
    assert shop["ada-1-lookup"].details == ("ada@example.com",)  # literal of the gold call found in the text


class Spy:
    """Gold replay that records what each view shows it."""

    name = "spy"

    def __init__(self):
        self.inner, self.seen = ReplayPolicy(), []

    def args(self):
        return {}

    async def act(self, messages, tools, harness, ctx):
        self.seen.append((ctx.atomic.name, ctx.atomic.checkpoint, [t["function"]["name"] for t in tools],
                          ctx.atomic.depends_on))
        return await self.inner.act(messages, tools, harness, ctx)


def test_views_keep_goals_dependencies_state_checks_and_tools(with_shop):
    async def go(rt, env):
        out = {}
        for view in ("agentic", "simuser"):
            spy = Spy()
            trs = [await prefix_rollout(rt, env, t, 1, Setup(VIEWS.build(view), HermesHarness(), spy))
                   for t in from_shop(disclosure="vague")]
            out[view] = (spy.seen, [tr.rewards for tr in trs], [tr.tools for tr in trs],
                         [m for tr in trs for m in tr.messages if m["role"] == "user"])
        return out
    out = with_shop(go)
    a, s = out["agentic"], out["simuser"]
    assert a[0] == s[0]                        # goals, checkpoints (completion conditions), deps, tools per step
    assert a[1] == s[1] == [(1, 1, 1, 1), (1, 1)]  # same initial state and checks: gold passes everywhere
    assert a[2] == s[2]
    assert a[3] != s[3]                        # only what the model is told differs
    assert "[ask me]" in s[3][0]["content"] and "1. Hi, I'm ada@example.com" in a[3][0]["content"]


class Asker:
    """Asks a question and never calls a tool."""

    name = "asker"

    def args(self):
        return {}

    async def act(self, messages, tools, harness, ctx):
        return PolicyOutput(text="Which e-mail address is yours?")


def test_simuser_reveals_on_question_and_caps_a_stalled_exchange(with_shop):
    task = from_shop(disclosure="vague")[0].model_copy(update={"atomic": from_shop()[0].atomic[:1]})

    async def go(rt, env):
        return await prefix_rollout(rt, env, task, 1, Setup(VIEWS.build("simuser", max_exchanges=2), HermesHarness(),
                                                            Asker()))
    tr = with_shop(go)
    att = tr.attempts[0]
    users = [m["content"] for m in att.messages if m["role"] == "user"]
    assert users == ["Hi, I'm [ask me]. What have I ordered so far?",
                     "Hi, I'm ada@example.com. What have I ordered so far?"]
    assert att.r == 0 and att.policy_calls == 2 and att.stalled and not tr.accepted  # completion from state/checks, not chat


def test_view_args_validated():
    with pytest.raises(ValueError, match="max_exchanges"):
        VIEWS.build("simuser", max_exchanges=0)
    with pytest.raises(TypeError, match="view 'agentic'"):
        VIEWS.build("agentic", persona="x")


def test_harnesses_keep_goals_dependencies_state_checks_and_tools(with_shop):
    from treadle.weft.rollouts.registry import HARNESSES

    names = ("hermes", "react", "native", "openclaw")
    assert set(names) <= set(HARNESSES.names())

    async def go(rt, env):
        out = {}
        for name in names:
            spy = Spy()
            trs = [await prefix_rollout(rt, env, t, 1, Setup(VIEWS.build("agentic"), HARNESSES.build(name), spy))
                   for t in from_shop()]
            out[name] = (spy.seen, [tr.rewards for tr in trs], [tr.tools for tr in trs],
                         [tr.messages[0]["content"] for tr in trs])
        return out
    out = with_shop(go)
    for name in names[1:]:
        assert out[name][:3] == out["hermes"][:3]  # same goals, checks, dependencies, tools, verdicts
    assert len({out[n][3][0] for n in names}) == 4  # only how the model is wired differs (system text)
