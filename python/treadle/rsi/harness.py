"""The RSI harness ``H = (skill library, role prompts, workflow, Verify/Revise positions)`` as frozen,
versioned pydantic records (seed: RSI section 3.2; DESIGN.md "RSI").

The verifier is *not* part of the harness: it lives in :mod:`treadle.rsi.verifier`, carries its own
version, and nothing in the loop can edit it. A harness serialises to JSON (:meth:`Harness.to_json`)
and two versions compare with :func:`diff` (one readable line per changed field / skill).
"""
from __future__ import annotations

import hashlib
import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

__all__ = ["SCHEMA_VERSION", "Harness", "Provenance", "RolePrompts", "Skill", "Workflow", "diff"]

SCHEMA_VERSION = 1


class _Record(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Provenance(_Record):
    """Where a skill came from and by what evidence it was admitted."""

    source: Literal["initial", "online_failure", "post_batch", "llm"] = "initial"
    """``initial`` (H_0), ``online_failure`` (induced from a solver failure on a valid task), ``post_batch``
    (added by a dH proposal), ``llm`` (written by an LLM Meta agent)."""
    failure_task: str | None = None
    """Key of the task whose solver failure produced the skill (online skills only)."""
    round: int | None = None
    """Round (0-based) in which the skill was admitted."""
    evidence: dict[str, float] = Field(default_factory=dict)
    """Admission evidence, e.g. ``applicability`` (share of probe seeds it applies to validly),
    ``accuracy_before`` / ``accuracy_after`` (fixed-solver accuracy on the probes)."""


class Skill(_Record):
    """One construction skill: a reusable way of making a task harder (never an answer).

    ``method`` is backend-specific: for the offline math backend it is a sequence of primitive
    transformation names (``"add_term"``, ``"nest"``, ...) applied in order; for an LLM generator it
    is free text placed into the generator prompt.
    """

    name: str
    """Unique name inside the library."""
    intent: str
    """What the skill is for, in words."""
    method: tuple[str, ...]
    """How to apply it (offline: primitive transformation names, applied left to right)."""
    difficulty_effect: float = 0.0
    """Measured change of fixed-solver accuracy when the skill is applied (negative = harder)."""
    tool_hint: str = ""
    """Which tool the generator should use (offline: ``sympy``)."""
    provenance: Provenance = Field(default_factory=Provenance)
    """Where the skill came from."""

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not v or not v.strip():
            raise ValueError("Skill.name must be a non-empty string")
        return v

    @field_validator("method")
    @classmethod
    def _method(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        if not v:
            raise ValueError("Skill.method must name at least one step")
        return v


class RolePrompts(_Record):
    """Prompts of the LLM roles (unused by the offline rule-based agents, but versioned with H)."""

    generator: str = "Rewrite the task so that it needs the skill below, keeping one exact answer."
    director: str = "Choose the next step: extend, revise, verify or finish."
    meta: str = "Propose one edit to the harness that makes tasks harder without making them invalid."
    solver: str = "Solve the problem. End with the final answer only."


class Workflow(_Record):
    """How a round runs for one seed chain."""

    max_steps: int = Field(6, ge=1, le=64)
    """Budget of Director steps per seed chain per round (Extend + Revise + Verify)."""
    max_extends: int = Field(2, ge=1, le=32)
    """At most this many Extend steps per seed chain per round."""
    verify_every: int = Field(1, ge=1, le=32)
    """Verify position: a Verify step after every ``verify_every`` Extend steps (and before Finish)."""
    revise_on_invalid: bool = True
    """Revise position: a Revise step right after a Verify that found the task invalid."""
    target_accuracy: float = Field(0.0, ge=0.0, le=1.0)
    """Finish early when the fixed solver's accuracy on a verified task is at or below this."""


class Harness(_Record):
    """``H = (skill library, role prompts, workflow, Verify/Revise positions)``; frozen and versioned.

    ``version`` is a counter bumped by every accepted change (:meth:`evolve`); ``parent`` is the
    version it came from. :attr:`digest` hashes the content (not the version), so equal content is
    recognisable across runs.
    """

    schema_version: int = SCHEMA_VERSION
    """Record layout version."""
    version: int = 0
    """Harness version (0 = H_0)."""
    parent: int | None = None
    """Version this one was derived from."""
    skills: tuple[Skill, ...] = ()
    """The skill library, in admission order."""
    prompts: RolePrompts = Field(default_factory=RolePrompts)
    """Role prompts."""
    workflow: Workflow = Field(default_factory=Workflow)
    """Workflow and Verify/Revise positions."""

    @model_validator(mode="after")
    def _unique(self) -> Harness:
        names = [s.name for s in self.skills]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"skill names must be unique in a harness, duplicated: {dup}")
        return self

    @property
    def digest(self) -> str:
        """sha256 (16 hex) of the content without ``version``/``parent``."""
        body = self.model_dump(mode="json", exclude={"version", "parent"})
        return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:16]

    def skill(self, name: str) -> Skill:
        """The skill called ``name``; KeyError naming the library if absent."""
        for s in self.skills:
            if s.name == name:
                return s
        raise KeyError(f"no skill {name!r} in harness v{self.version}; have {[s.name for s in self.skills]}")

    def evolve(self, **changes) -> Harness:
        """A new version with ``changes`` (fields of Harness) applied, ``parent`` = this version."""
        data = self.model_dump()
        data.update({k: (v.model_dump() if isinstance(v, BaseModel) else
                         [s.model_dump() if isinstance(s, BaseModel) else s for s in v] if k == "skills" else v)
                     for k, v in changes.items()})
        data["parent"], data["version"] = self.version, self.version + 1
        return Harness.model_validate(data)

    def with_skill(self, skill: Skill) -> Harness:
        """A new version with ``skill`` appended (ValueError if the name is taken)."""
        if any(s.name == skill.name for s in self.skills):
            raise ValueError(f"skill {skill.name!r} is already in harness v{self.version}")
        return self.evolve(skills=(*self.skills, skill))

    def to_json(self) -> str:
        """Canonical JSON (sorted keys, indented)."""
        return json.dumps(self.model_dump(mode="json"), sort_keys=True, indent=1)

    @classmethod
    def from_json(cls, text: str) -> Harness:
        """Inverse of :meth:`to_json`; pydantic ValidationError on a malformed record."""
        return cls.model_validate_json(text)


def diff(old: Harness, new: Harness) -> list[str]:
    """Readable differences from ``old`` to ``new``: ``+ skill``, ``- skill``, ``~ skill.field``,
    ``~ workflow.field``, ``~ prompts.role`` lines (empty when the content is equal)."""
    a, b = {s.name: s for s in old.skills}, {s.name: s for s in new.skills}
    out = [f"- skill {n}" for n in sorted(a.keys() - b.keys())]
    for n in [s.name for s in new.skills if s.name not in a]:
        out.append(f"+ skill {n}: {' > '.join(b[n].method)} (effect {b[n].difficulty_effect:+.3f})")
    for n in [s.name for s in new.skills if s.name in a]:
        for f in Skill.model_fields:
            va, vb = getattr(a[n], f), getattr(b[n], f)
            if va != vb:
                out.append(f"~ skill {n}.{f}: {_short(va)} -> {_short(vb)}")
    for part in ("workflow", "prompts"):
        pa, pb = getattr(old, part), getattr(new, part)
        for f in type(pa).model_fields:
            if getattr(pa, f) != getattr(pb, f):
                out.append(f"~ {part}.{f}: {_short(getattr(pa, f))} -> {_short(getattr(pb, f))}")
    return out


def _short(v) -> str:
    if isinstance(v, BaseModel):
        v = v.model_dump(mode="json")
    s = json.dumps(v, sort_keys=True) if not isinstance(v, str) else repr(v)
    return s if len(s) <= 80 else s[:77] + "..."
