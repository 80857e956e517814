"""Per-role config: the same tree from TOML, YAML and JSON; overrides; clear errors on bad input."""
import json

import pytest
import yaml

from treadle.llm import ConfigError, LLMConfig, Prices, RoleConfig, Sampling

TREE = {"roles": {
    "policy": {"model": "Qwen/Qwen3-8B", "base_url": "http://127.0.0.1:8000/v1",
               "sampling": {"temperature": 1.0, "max_tokens": 1024, "seed": 7}, "max_concurrency": 64},
    "judge": {"model": "gpt-x", "base_url": "https://api.example.com/v1/", "api_key_env": "EXAMPLE_API_KEY",
              "timeout_s": 120, "max_retries": 5, "prices": {"input_per_million": 1.25, "output_per_million": 10}},
}}
TOML = """
[roles.policy]
model = "Qwen/Qwen3-8B"
base_url = "http://127.0.0.1:8000/v1"
max_concurrency = 64
sampling = { temperature = 1.0, max_tokens = 1024, seed = 7 }

[roles.judge]
model = "gpt-x"
base_url = "https://api.example.com/v1/"
api_key_env = "EXAMPLE_API_KEY"
timeout_s = 120
max_retries = 5
prices = { input_per_million = 1.25, output_per_million = 10 }
"""


def test_same_config_from_toml_yaml_json(tmp_path):
    (tmp_path / "c.toml").write_text(TOML)
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(TREE))
    (tmp_path / "c.json").write_text(json.dumps(TREE))
    cfgs = [LLMConfig.load(tmp_path / f"c.{ext}") for ext in ("toml", "yaml", "json")]
    assert cfgs[0] == cfgs[1] == cfgs[2]
    j = cfgs[0].role("judge")
    assert j.base_url == "https://api.example.com/v1"
    assert j.prices == Prices(input_per_million=1.25, output_per_million=10)
    assert cfgs[0].role("policy").sampling == Sampling(temperature=1.0, max_tokens=1024, seed=7)
    assert LLMConfig.model_validate_json(cfgs[0].model_dump_json()) == cfgs[0]  # round trip (run folders)


def test_overrides():
    cfg = LLMConfig.from_dict(TREE).with_overrides(
        ["policy.sampling.temperature=0.6", "judge.model=gpt-y", "*.timeout_s=30", "policy.sampling.stop=[\"\\n\"]"])
    assert cfg.role("policy").sampling.temperature == 0.6 and cfg.role("policy").sampling.max_tokens == 1024
    assert cfg.role("policy").sampling.stop == ["\n"]
    assert cfg.role("judge").model == "gpt-y"
    assert cfg.role("judge").timeout_s == cfg.role("policy").timeout_s == 30
    new = LLMConfig.from_dict(TREE).with_overrides(["solver.model=tiny", "solver.sampling.max_tokens=8"])
    assert new.role("solver") == RoleConfig(model="tiny", sampling=Sampling(max_tokens=8))


def test_sampling_merge_is_explicit():
    base = Sampling(temperature=1.0, max_tokens=16, extra_body={"top_k": 20})
    m = base.merged({"max_tokens": 4, "extra_body": {"min_p": 0.1}})
    assert m == Sampling(temperature=1.0, max_tokens=4, extra_body={"top_k": 20, "min_p": 0.1})
    assert base.merged(None) is base


@pytest.mark.parametrize("text,suffix,match", [
    ("[roles.p]\nmodel = 1\n", "toml", "model"),
    ("[roles.p]\nmodel = 'm'\ntemperature = 1\n", "toml", "temperature"),  # sampling field at the wrong level
    ("[roles.p]\nmodel = 'm'\nbase_url = 'localhost:8000'\n", "toml", "http://"),
    ("[roles.p]\nmodel = 'm'\nsampling = { top_p = 2 }\n", "toml", "top_p"),
    ("roles = [", "toml", "cannot parse"),
    ("roles: [1, 2", "yaml", "cannot parse"),
    ("[1, 2]", "json", "expected a mapping"),
    ("{}", "ini", "must be .toml"),
])
def test_bad_files_raise_config_error(tmp_path, text, suffix, match):
    p = tmp_path / f"c.{suffix}"
    p.write_text(text)
    with pytest.raises(ConfigError, match=match):
        LLMConfig.load(p)


def test_missing_file_and_unknown_role(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        LLMConfig.load(tmp_path / "nope.toml")
    with pytest.raises(ConfigError, match=r"unknown role 'critic'.*\['judge', 'policy'\]"):
        LLMConfig.from_dict(TREE).role("critic")


@pytest.mark.parametrize("item", ["policy.model", "model=x", "policy..model=x", "policy.model.name=x"])
def test_bad_overrides(item):
    with pytest.raises(ConfigError):
        LLMConfig.from_dict(TREE).with_overrides([item])


def test_config_is_frozen():
    cfg = LLMConfig.from_dict(TREE)
    with pytest.raises(Exception):
        cfg.role("policy").model = "x"
