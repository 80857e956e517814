"""Environment synthesis with LLM roles, validated by execution and revised where the fault lies (seed: WEFT 4.1).

Order of the roles (the one the strongest public synthesisers converged on): the **designer** turns
tool documentation and a business requirement into business tasks first, then shared entities and
tools with contracts (reads, writes, returns); the **schema** role writes SQLite DDL and seed rows;
the **backend** role writes one Python function per tool; the **checker** writes normal and boundary
validation calls with expected returns and read-back queries. Every role is an OpenAI-compatible
endpoint through :class:`treadle.llm.LLMClient` and answers one JSON object.

Validation runs in the sandbox (:mod:`~treadle.weft.evolve.synth_validate`); each failure is
localised to one stage and only the first blamed stage (schema, then contract, then backend, then
checks) is asked again, with the failures, for at most ``max_rounds`` rounds. Artefacts of other
stages are kept verbatim (a revision never touches an unblamed component). A role answer that is not
the JSON asked for, or a failed call, is recorded against its stage and re-asked within the same
budget; nothing accepted earlier is lost.
"""
from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from treadle.weft.evolve.synth_validate import Backend, Checks, Design, Failure, Schema, Stage, validate
from treadle.untrusted import fenced_blocks, loads_json

ROLES = ("designer", "schema", "backend", "checker")
_MODELS = {Stage.design: Design, Stage.contract: Design, Stage.schema: Schema, Stage.backend: Backend,
           Stage.checks: Checks}
_ROLE_OF = {Stage.design: "designer", Stage.contract: "designer", Stage.schema: "schema", Stage.backend: "backend",
            Stage.checks: "checker"}


class SynthRound(BaseModel):
    """One validation round: failures found and the stage then revised (None when accepted or out of budget)."""

    model_config = ConfigDict(extra="forbid")
    round: int
    failures: list[Failure]
    revised: Stage | None = None
    facts: dict[str, Any] = Field(default_factory=dict)


class SynthResult(BaseModel):
    """The synthesised environment (the last version of each artefact), the rounds, and the verdict."""

    model_config = ConfigDict(extra="forbid")
    accepted: bool
    design: Design | None = None
    schema_: Schema | None = Field(None, alias="schema")
    backend: Backend | None = None
    checks: Checks | None = None
    rounds: list[SynthRound] = Field(default_factory=list)
    role_failures: list[Failure] = Field(default_factory=list, description="malformed or failed role answers")
    revisions: dict[str, int] = Field(default_factory=dict, description="answers accepted per stage")


def _json_of(text: str) -> Any:
    """The JSON of a model's answer (its first fenced block, else the whole text): linear, bounded nesting;
    raises :class:`~treadle.untrusted.UntrustedInputError` (a ``ValueError``)."""
    blocks = fenced_blocks(text)
    return loads_json(blocks[0] if blocks else text, duplicates=True, what="the answer's JSON")


def _prompt(stage: Stage, context: dict[str, Any], failures: list[Failure] | None) -> list[dict[str, str]]:
    schema = _MODELS[stage].model_json_schema()
    ask = {Stage.design: "Design the environment: list business tasks first, then shared entities, then tools "
                         "with contracts (reads/writes are table names).",
           Stage.contract: "Revise the tool contracts (reads/writes) so they match the schema and the backend.",
           Stage.schema: "Write the SQLite DDL and seed rows for this design.",
           Stage.backend: "Write the Python backend: one function def <tool>(db, **params) per tool, db a "
                          "sqlite3.Connection; raise ValueError for a request that must fail.",
           Stage.checks: "Write validation calls: normal calls that must succeed and boundary calls that must fail, "
                         "with expected returns and read-back queries of the state."}[stage]
    body = {"task": ask, "answer_json_schema": schema, **context}
    if failures:
        body["validation_failures"] = [f.detail for f in failures]
    return [{"role": "system", "content": "You build tool environments. Answer with one JSON object only."},
            {"role": "user", "content": json.dumps(body, sort_keys=True, default=str)}]


async def _ask(client: Any, stage: Stage, context: dict[str, Any], failures: list[Failure] | None,
               result: SynthResult, attempts: int) -> BaseModel | None:
    from treadle.llm import LLMCallError

    for k in range(attempts):
        try:
            r = await client.chat(_prompt(stage, context, failures), role=_ROLE_OF[stage], tag="weft-synth",
                                  sample_index=k)
        except LLMCallError as err:
            result.role_failures.append(Failure(stage=stage, detail=f"{_ROLE_OF[stage]} call failed: "
                                                                    f"{err.failure.kind.value}: {err.failure.message}"))
            continue
        try:
            value = _MODELS[stage].model_validate(_json_of(r.text))
        except (ValueError, ValidationError) as err:
            result.role_failures.append(Failure(stage=stage, detail=f"{_ROLE_OF[stage]} answer is not the JSON asked "
                                                                    f"for: {str(err).splitlines()[0][:200]}"))
            continue
        result.revisions[stage.value] = result.revisions.get(stage.value, 0) + 1
        return value
    return None


_PRIORITY = (Stage.schema, Stage.contract, Stage.backend, Stage.checks)


async def synthesize(client: Any, docs: str, requirement: str, *, max_rounds: int = 3, attempts: int = 2,
                     limits: Any = None) -> SynthResult:
    """Synthesise one environment from tool documentation and a business requirement (see the module docstring).

    Raises:
        ValueError: empty ``docs`` / ``requirement`` or a budget < 1 (before any call).
        treadle.sandbox.SandboxUnavailableError: no sandbox here (generated code never runs unsandboxed).
    """
    if not isinstance(docs, str) or not docs.strip():
        raise ValueError("docs must be non-empty tool documentation text")
    if not isinstance(requirement, str) or not requirement.strip():
        raise ValueError("requirement must be a non-empty business requirement")
    if max_rounds < 1 or attempts < 1:
        raise ValueError(f"max_rounds and attempts must be >= 1, got {max_rounds}, {attempts}")
    res = SynthResult(accepted=False)
    res.design = await _ask(client, Stage.design, {"tool_docs": docs, "requirement": requirement}, None, res, attempts)
    if res.design is None:
        return res
    ctx = {"design": res.design.model_dump()}
    res.schema_ = await _ask(client, Stage.schema, ctx, None, res, attempts)
    if res.schema_ is None:
        return res
    ctx = {"design": res.design.model_dump(), "schema": res.schema_.model_dump()}
    res.backend = await _ask(client, Stage.backend, ctx, None, res, attempts)
    res.checks = await _ask(client, Stage.checks, ctx, None, res, attempts)
    if res.backend is None or res.checks is None:
        return res
    for rnd in range(1, max_rounds + 1):
        failures, facts = validate(res.design, res.schema_, res.backend, res.checks, limits=limits)
        if not failures:
            res.rounds.append(SynthRound(round=rnd, failures=[], facts=facts))
            res.accepted = True
            return res
        blamed = next(s for s in _PRIORITY if any(f.stage == s for f in failures))
        mine = [f for f in failures if f.stage == blamed]
        res.rounds.append(SynthRound(round=rnd, failures=failures, revised=blamed if rnd < max_rounds else None,
                                     facts=facts))
        if rnd == max_rounds:
            break
        ctx = {"design": res.design.model_dump(), "schema": res.schema_.model_dump(),
               "current": {Stage.backend: res.backend, Stage.checks: res.checks, Stage.schema: res.schema_,
                           Stage.contract: res.design}[blamed].model_dump()}
        new = await _ask(client, blamed, ctx, mine, res, attempts)
        if new is None:
            continue  # the old artefact stays; the next round re-validates it
        if blamed == Stage.schema:
            res.schema_ = new
        elif blamed == Stage.contract:
            res.design = new
        elif blamed == Stage.backend:
            res.backend = new
        else:
            res.checks = new
    return res
