"""Per-role model configuration (pydantic), loadable from TOML / YAML / JSON and ``role.field=value``
overrides (CLI flags).

A config names one :class:`RoleConfig` per role (``policy``, ``judge``, ``user_sim``...). Sampling
settings default to ``None`` (= the server's default) and are merged by an explicit
:meth:`Sampling.merged`. The API key is never part of the config: ``api_key_env`` names the
environment variable that holds it.
"""
from __future__ import annotations

import json
import os
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from treadle.untrusted import register_secret

__all__ = ["Sampling", "Prices", "RoleConfig", "LLMConfig", "UsageLimits", "ConfigError", "SAMPLING_FIELDS"]


def _brief(err: ValidationError) -> str:
    """One line per pydantic error, ``roles.x.field: message (got value)``, joined by ``; ``."""
    parts = []
    for e in err.errors():
        loc = ".".join(str(x) for x in e["loc"]) or "(top level)"
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = "unknown field"
        parts.append(f"{loc}: {msg}" if e["type"] == "missing" or "got " in msg else f"{loc}: {msg} (got {e['input']!r})")
    return "; ".join(parts)


class ConfigError(ValueError):
    """A model config file or override is malformed (the message names the file/field and what was expected)."""


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Sampling(_Frozen):
    """Sampling parameters sent with each request; ``None`` leaves the server's default."""

    temperature: float | None = Field(None, ge=0, description="Softmax temperature (0 = greedy).")
    top_p: float | None = Field(None, gt=0, le=1, description="Nucleus sampling mass.")
    max_tokens: int | None = Field(None, ge=1, description="Most tokens generated per sample.")
    stop: list[str] | None = Field(None, description="Stop strings.")
    seed: int | None = Field(None, description="Base seed; sample i of a group is sent seed + i.")
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logprobs: int | None = Field(None, ge=0, le=20,
                                 description="Top-k logprobs per generated token (kept on the result when returned).")
    extra_body: dict[str, Any] | None = Field(
        None, description="Server-specific request fields (e.g. vLLM's {'top_k': 20, 'return_token_ids': true}).")

    def merged(self, overrides: "Sampling | dict | None") -> "Sampling":
        """These settings with the non-None fields of ``overrides`` on top (``extra_body`` dicts merged)."""
        if overrides is None:
            return self
        over = overrides if isinstance(overrides, Sampling) else Sampling(**overrides)
        data = self.model_dump()
        for k, v in over.model_dump().items():
            if v is None:
                continue
            data[k] = {**(data[k] or {}), **v} if k == "extra_body" else v
        return Sampling(**data)


SAMPLING_FIELDS = tuple(Sampling.model_fields)


class Prices(_Frozen):
    """Prices in US dollars per million tokens (for the ledger's cost column)."""

    input_per_million: float = Field(0.0, ge=0, description="USD per 1e6 prompt tokens.")
    output_per_million: float = Field(0.0, ge=0, description="USD per 1e6 completion tokens.")

    def cost(self, tokens_in: int, tokens_out: int) -> float:
        """USD for one call."""
        return (tokens_in * self.input_per_million + tokens_out * self.output_per_million) / 1e6


class UsageLimits(_Frozen):
    """Budgets of one :class:`~treadle.llm.LLMClient`, checked BEFORE each live call (cache hits and recorded
    replays are free and always allowed). ``None`` = unlimited."""

    max_calls: int | None = Field(None, ge=0, description="Live calls (each retry attempt is part of its call).")
    max_tokens: int | None = Field(None, ge=0, description="Prompt + completion tokens of live calls.")
    max_cost_usd: float | None = Field(None, ge=0, description="Cost of live calls, from the roles' prices.")


class RoleConfig(_Frozen):
    """How one role talks to its model endpoint (OpenAI-compatible: vLLM, SGLang, ``transformers serve``,
    hosted APIs)."""

    model: str = Field(
        description="Model name as the endpoint knows it (for `transformers serve`: the path it serves).")
    base_url: str = Field("http://127.0.0.1:8000/v1", description="Endpoint root, ending in /v1.")
    api_key_env: str | None = Field(
        None,
        description="Name of the environment variable holding the API key; None -> a placeholder key (local servers).")
    sampling: Sampling = Field(default_factory=Sampling, description="Default sampling parameters of the role.")
    timeout_s: float = Field(60.0, gt=0, description="Per-attempt timeout, seconds.")
    max_retries: int = Field(3, ge=0, le=20, description="Retries on connection errors, timeouts, 429 and 5xx.")
    backoff_s: float = Field(0.5, ge=0, description="First backoff delay, seconds (doubles per retry, full jitter).")
    backoff_max_s: float = Field(30.0, ge=0, description="Cap of one backoff delay (and of an honoured Retry-After).")
    max_concurrency: int = Field(
        16, ge=1, description="Requests in flight to this base_url at once (shared by roles on it).")
    prices: Prices | None = Field(None, description="Optional prices; cost is 0 without them.")
    structured_mode: Literal["json_schema", "json_object", "prompt"] = Field(
        "json_schema", description="How `structured` asks for JSON: response_format json_schema, json_object, or "
                                   "only the prompt (for servers that support neither); extraction is tolerant "
                                   "in all modes.")
    max_repairs: int = Field(2, ge=0, le=10, description="Re-asks after an output that does not validate.")

    @field_validator("base_url")
    @classmethod
    def _url(cls, v: str) -> str:
        if not v.startswith(("http://", "https://")):
            raise ValueError(f"base_url must start with http:// or https://, got {v!r}")
        return v.rstrip("/")

    def api_key(self) -> str:
        """The key from ``api_key_env`` (raises :class:`ConfigError` if that variable is unset)."""
        if self.api_key_env is None:
            return "EMPTY"
        key = os.environ.get(self.api_key_env)
        if not key:
            raise ConfigError(f"environment variable {self.api_key_env} (api_key_env of model {self.model!r}) "
                              f"is not set")
        register_secret(key)  # masked in every message from now on, whatever the variable's name
        return key


class LLMConfig(_Frozen):
    """Every role's :class:`RoleConfig`. File layout (TOML shown; YAML/JSON the same tree)::

        [roles.policy]
        model = "Qwen/Qwen3-8B"
        base_url = "http://127.0.0.1:8000/v1"
        sampling = { temperature = 1.0, max_tokens = 1024 }
    """

    schema_version: Literal[1] = 1
    roles: dict[str, RoleConfig] = Field(description="Role name -> its endpoint and settings.")

    def role(self, name: str) -> RoleConfig:
        """The config of ``name`` (raises :class:`ConfigError` naming the known roles)."""
        try:
            return self.roles[name]
        except KeyError:
            raise ConfigError(f"unknown role {name!r}; the config defines {sorted(self.roles)}") from None

    @classmethod
    def single(cls, model: str, base_url: str = "http://127.0.0.1:8000/v1", *, roles=("default",),
               **fields) -> "LLMConfig":
        """One endpoint for the given roles (convenience for scripts and tests); raises :class:`ConfigError`
        on an invalid field (e.g. a ``base_url`` that is not http(s))."""
        try:
            rc = RoleConfig(model=model, base_url=base_url, **fields)
        except ValidationError as err:
            raise ConfigError(f"invalid model config: {_brief(err)}") from None
        return cls(roles={r: rc for r in roles})

    @classmethod
    def from_dict(cls, data: dict, *, source: str = "config") -> "LLMConfig":
        try:
            return cls.model_validate(data)
        except ValidationError as err:
            raise ConfigError(f"{source}: invalid model config: {_brief(err)}") from None

    @classmethod
    def load(cls, path: str | os.PathLike) -> "LLMConfig":
        """Read a ``.toml``, ``.yaml``/``.yml`` or ``.json`` file (raises :class:`ConfigError` on a missing file,
        an unknown suffix, a parse error or an invalid field)."""
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"model config file not found: {p}")
        try:
            text = p.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            raise ConfigError(f"{p}: cannot read: {err}") from None
        try:
            if p.suffix == ".toml":
                data = tomllib.loads(text)
            elif p.suffix in (".yaml", ".yml"):
                import yaml

                data = yaml.safe_load(text)
            elif p.suffix == ".json":
                data = json.loads(text)
            else:
                raise ConfigError(f"{p}: model config must be .toml, .yaml, .yml or .json, got {p.suffix!r}")
        except (tomllib.TOMLDecodeError, json.JSONDecodeError) as err:
            raise ConfigError(f"{p}: cannot parse: {err}") from None
        except Exception as err:  # yaml.YAMLError without importing yaml eagerly
            if type(err).__module__.startswith("yaml"):
                raise ConfigError(f"{p}: cannot parse: {err}") from None
            raise
        if not isinstance(data, dict):
            raise ConfigError(f"{p}: expected a mapping with a 'roles' table, got {type(data).__name__}")
        return cls.from_dict(data, source=str(p))

    def with_overrides(self, overrides: list[str] | tuple[str, ...]) -> "LLMConfig":
        """Apply ``role.field=value`` / ``role.sampling.field=value`` strings (values parsed as JSON, else kept
        as strings); ``*.field=value`` sets the field on every role. Raises :class:`ConfigError`."""
        data = self.model_dump()
        for item in overrides:
            path, sep, raw = item.partition("=")
            parts = path.strip().split(".")
            if not sep or len(parts) < 2 or not all(parts):
                raise ConfigError(f"override {item!r}: expected role.field=value "
                                  f"(e.g. policy.sampling.temperature=0.7)")
            try:
                value = json.loads(raw)
            except json.JSONDecodeError:
                value = raw
            names = list(data["roles"]) if parts[0] == "*" else [parts[0]]
            for name in names:
                node = data["roles"].setdefault(name, {})
                for key in parts[1:-1]:
                    if node.get(key) is None:
                        node[key] = {}
                    node = node[key]
                    if not isinstance(node, dict):
                        raise ConfigError(f"override {item!r}: {key!r} is not a table")
                node[parts[-1]] = value
        return LLMConfig.from_dict(data, source="overrides " + " ".join(overrides))
