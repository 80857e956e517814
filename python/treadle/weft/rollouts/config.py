"""The build layer: a batch's components by name (``{name, args}``) and environments by name -> objects.

:class:`SampleConfig` is what a run folder stores as ``config.json``; :func:`build_setup` turns it into the
view, harness and policy of one rollout (every error before any rollout), :func:`env_builder` an
environment name into its async builder. The batch layer (:mod:`treadle.weft.rollouts.batch`) and the Ray
driver (:mod:`treadle.weft.rollouts.ray_driver`) both build from here.
"""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from treadle.weft.rollouts import harnesses as _h, openclaw as _o, policies as _p, views as _v  # noqa: F401  (registration)
from treadle.weft.rollouts.registry import HARNESSES, POLICIES, VIEWS
from treadle.weft.rollouts.rollout import METHODS, Env, Setup


class Component(BaseModel):
    """A registered component as stored in the run folder: ``{name, args}``."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str
    args: dict[str, Any] = Field(default_factory=dict)


class SampleConfig(BaseModel):
    """One rejection-sampling batch: components, methods, retry budgets ``ks``, seed, concurrency."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    view: Component = Component(name="agentic")
    harness: Component = Component(name="hermes")
    policy: Component = Component(name="replay")
    methods: tuple[str, ...] = ("prefix",)
    ks: tuple[int, ...] = (1,)
    seed: int = 0
    max_steps: int = Field(8, description="Model calls per attempt of one turn (cap).")
    concurrency: int = Field(4, description="Rollouts in flight at once.")

    @field_validator("ks")
    @classmethod
    def _ks(cls, v: tuple[int, ...]) -> tuple[int, ...]:
        if not v or any(not isinstance(k, int) or k < 1 for k in v):
            raise ValueError(f"every k (attempts per turn / per task) must be an int >= 1, got {list(v)}")
        return v

    @field_validator("methods")
    @classmethod
    def _methods(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        bad = [m for m in v if m not in METHODS]
        if not v or bad:
            raise ValueError(f"methods must be some of {list(METHODS)}, got {list(v)}")
        return v

    @field_validator("max_steps", "concurrency")
    @classmethod
    def _positive(cls, v: int) -> int:
        if v < 1:
            raise ValueError(f"must be >= 1, got {v}")
        return v


def build_setup(cfg: SampleConfig, *, client: Any = None) -> Setup:
    """Components from names (UnknownComponentError / TypeError / ValueError before any rollout)."""
    vargs = dict(cfg.view.args)
    if getattr(VIEWS.get(cfg.view.name), "needs_client", False):
        if client is None:
            raise ValueError(f"the {cfg.view.name} view needs an LLMClient (CLI: --llm-config)")
        vargs["client"] = client
    view = VIEWS.build(cfg.view.name, **vargs)
    harness = HARNESSES.build(cfg.harness.name, **cfg.harness.args)
    pargs = dict(cfg.policy.args)
    if cfg.policy.name == "llm":
        if client is None:
            raise ValueError("the llm policy needs an LLMClient (CLI: --llm-config)")
        pargs["client"] = client
    policy = POLICIES.build(cfg.policy.name, **pargs)
    return Setup(view=view, harness=harness, policy=policy, max_steps=cfg.max_steps, seed=cfg.seed)


async def shop_env(rt: Any) -> Env:
    """Register the shop server and read its tools."""
    from treadle.weft.envs import shop
    from treadle.weft.rollouts.sessions import env_of

    return await env_of(rt, shop, shop.initial_snapshot())


ENVS = {"shop": shop_env}
"""Fixed environments by name; ``bfcl:<category>:<entry id>`` names resolve through :func:`env_builder`."""


def env_builder(name: str) -> Any:
    """The async ``builder(rt) -> Env`` of an environment name. Raises ValueError for an unknown name."""
    if name in ENVS:
        return ENVS[name]
    if name.startswith("bfcl:"):
        from treadle.weft.rollouts.bfcl_tasks import bfcl_env

        return lambda rt: bfcl_env(rt, name)
    raise ValueError(f"unknown env {name!r}; expected one of {sorted(ENVS)} or 'bfcl:<category>:<entry id>'")
