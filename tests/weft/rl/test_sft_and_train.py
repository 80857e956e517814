"""The tiny tool policy (quick setting) and the GRPO loop: structure, caching, same rollout budget."""
import json

import anyio
import pytest

from treadle.weft.rl.sft import ToolTrainConfig, load_tool_model, train_tool_policy
from treadle.weft.rl.config import WeftTrainConfig
from treadle.weft.rl.worlds import TEMPLATES, draw_episode, episodes


def test_heldout_split_has_unseen_customers_products_and_amounts():
    train, held = episodes(60, "train"), episodes(60, "heldout")

    def facts(eps):
        names, skus, qtys = set(), set(), set()
        for e in eps:
            for line in e.seed_sql.splitlines():
                if line.startswith("INSERT INTO customers"):
                    names |= {p.split("'")[1] for p in line.split("), (")}
                if line.startswith("INSERT INTO products"):
                    skus |= {p.split("'")[1] for p in line.split("), (")}
            for a in e.task.atomic:
                for c in a.checkpoint.gold_calls:
                    for it in c.arguments.get("items", []):
                        qtys.add(it["qty"])
        return names, skus, qtys

    (n1, s1, q1), (n2, s2, q2) = facts(train), facts(held)
    assert n1 and n2 and not (n1 & n2)
    assert s1 and s2 and not (s1 & s2)
    assert q1 and q2 and not (q1 & q2)
    assert {e.template for e in held} == set(TEMPLATES)
    assert draw_episode(3, "heldout").seed_sql == draw_episode(3, "heldout").seed_sql
    with pytest.raises(ValueError, match="split"):
        draw_episode(0, "test")
    with pytest.raises(ValueError, match="template"):
        draw_episode(0, "train", "refund")


def test_every_template_gold_passes_its_checkpoints(in_shop):
    async def fn(rt, h, golds):
        return golds

    golds = in_shop(fn, n=6, split="train")  # play_gold verifies every turn (GoldError otherwise)
    assert all(len(g.starts) == 2 for g in golds)


def test_quick_tool_policy_is_cached_and_loadable(tmp_path):
    cfg = ToolTrainConfig.quick()
    res = train_tool_policy(cfg, tmp_path / "m", progress=False)
    assert res.seconds > 0 and 0 <= res.accuracy["turn_success_sampled"] <= 1
    assert res.accuracy["turns"] == 2 * cfg.eval_episodes and res.accuracy["cpu_seconds"] > 0
    again = train_tool_policy(cfg, tmp_path / "m", progress=False)
    assert again.seconds == 0.0 and again.accuracy == res.accuracy
    model, tok = load_tool_model(tmp_path / "m", train_if_missing=False)
    assert len(tok) == model.config.vocab_size
    with pytest.raises(TypeError, match="ToolTrainConfig"):
        train_tool_policy({"steps": 1}, tmp_path / "n")
    with pytest.raises(ValueError):
        ToolTrainConfig(hidden_size=30, num_heads=4)


@pytest.mark.parametrize("kw", [{"G": 1}, {"turns_per_step": 3}, {"grouping": "turn"}, {"steps": 0}])
def test_train_config_rejects_bad_values(kw):
    with pytest.raises(ValueError):
        WeftTrainConfig(**kw)


def test_cached_tool_policy_is_retrained_when_config_or_recipe_changes(tmp_path, monkeypatch):
    """The default cache slot is keyed by the whole config AND the data recipe (tokenizer, drawn worlds):
    an unchanged recipe reuses the checkpoint, another config or another recipe retrains it."""
    import treadle.weft.rl.sft as sft

    monkeypatch.setenv("TREADLE_CACHE", str(tmp_path))
    cfg = ToolTrainConfig.quick(eval_episodes=1)
    load_tool_model(None, config=cfg, name="slot")
    marker = tmp_path / "slot" / "treadle_checkpoint.json"
    assert json.loads((tmp_path / "slot" / sft.RECIPE_FILE).read_text())["fingerprint"] == sft.recipe_fingerprint(cfg)
    first = marker.stat().st_mtime_ns
    load_tool_model(None, config=cfg, name="slot")
    assert marker.stat().st_mtime_ns == first  # same config and recipe: reused
    monkeypatch.setattr(sft, "recipe_fingerprint", lambda c, n=24: "another-recipe")
    load_tool_model(None, config=cfg, name="slot")
    second = marker.stat().st_mtime_ns
    assert second != first  # same config, other data: retrained
    assert json.loads((tmp_path / "slot" / sft.RECIPE_FILE).read_text())["fingerprint"] == "another-recipe"
    load_tool_model(None, config=ToolTrainConfig.quick(eval_episodes=1, steps=7), name="slot")
    assert marker.stat().st_mtime_ns != second  # other config: retrained


def test_recipe_fingerprint_depends_on_the_drawn_worlds():
    import treadle.weft.rl.sft as sft

    a = sft.recipe_fingerprint(ToolTrainConfig.quick())
    assert a == sft.recipe_fingerprint(ToolTrainConfig.quick()) and len(a) == 16
    assert a != sft.recipe_fingerprint(ToolTrainConfig.quick(seed=1))  # other train worlds
