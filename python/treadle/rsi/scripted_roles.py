"""Programmatic stand-ins for the Director, generator and Meta LLM roles of math rounds, answering as an
OpenAI-compatible endpoint (:class:`treadle.llm.fake_endpoint.FakeEndpoint`), so that ``treadle rsi llm``
runs end to end offline with only the *solver* a real model (e.g. the tiny model behind ``treadle llm
serve``): the way to measure a difficulty curve with a real solver where no LLM generator is at hand.

They read exactly what the real roles are sent and answer in the same schemas:

- Director (like the offline rule-based one): Revise after an invalid task, Verify a pending task, Finish
  once the solver's accuracy on the verified task is at or below the workflow's ``target_accuracy``, else
  Extend with the library's skills in turn (starting at the round's index) until ``max_extends``;
- generator: rewrites ``Compute E.`` by the skill's name (``add_term``: one more operation with a new
  operand; ``widen_digits``: one operand gets one more digit; ``nest``: one operand becomes a
  parenthesised sum equal to it; any other skill: ``add_term`` then ``nest``), the reference answer
  computed with sympy; other problem shapes are answered with prose (an invalid output, as a weak model
  would give);
- Meta: an induced skill named after the failed task (``induced_<hash>``), and post-batch edits that widen
  the workflow (``max_extends`` + 1), then add a skill.

Every choice is seeded by a hash of the request, so a run is reproducible and its cache is reusable.
"""
from __future__ import annotations

import hashlib
import json
import random
import re

import sympy

from treadle.llm.fake_endpoint import FakeEndpoint

__all__ = ["ROLE_MODELS", "rewrite", "scripted_endpoint", "scripted_reply"]

#: model names the endpoint answers for (one per role)
ROLE_MODELS = ("scripted-director", "scripted-generator", "scripted-meta")
_COMPUTE = re.compile(r"^Compute (?P<e>[^ ]+)\.$")
_INT = re.compile(r"\d+")


def _rng(*parts) -> random.Random:
    return random.Random(hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).digest())


def _pick_int(e: str, r: random.Random) -> re.Match | None:
    nums = list(_INT.finditer(e))
    return r.choice(nums) if nums else None


def rewrite(expr: str, skill: str, r: random.Random) -> str:
    """``expr`` rewritten by the scripted generator for ``skill`` (see the module docstring)."""
    if skill == "add_term":
        op = r.choice("+-*")
        return f"({expr}){op}{r.randint(2, 9)}" if op == "*" else f"{expr}{op}{r.randint(1, 9)}"
    m = _pick_int(expr, r)
    if m is None:
        return f"({expr})+{r.randint(1, 9)}"
    n = int(m.group())
    if skill == "widen_digits":
        new = str(n * 10 + r.randint(1, 9))
    elif skill == "nest":
        a = r.randint(1, 9)
        new = f"({n - a}+{a})" if n - a >= 0 else f"({n + a}-{a})"
    else:
        return rewrite(rewrite(expr, "add_term", r), "nest", r)
    return expr[:m.start()] + new + expr[m.end():]


def _director(req: dict) -> str:
    d = json.loads(req["messages"][-1]["content"].split("\n")[0])
    st, lib = d["state"], [s["name"] for s in d["library"]]
    if st["last_invalid"]:
        return json.dumps({"step": "revise", "reason": "the last task was invalid"})
    if st["pending_unverified"]:
        return json.dumps({"step": "verify", "reason": "check the new task"})
    acc, target = st.get("last_accuracy"), d["workflow"].get("target_accuracy", 0.25)
    if acc is not None and acc <= target:
        return json.dumps({"step": "finish", "reason": f"hard enough (accuracy {acc} <= {target})"})
    if st["extends"] < st["max_extends"] and lib:
        skill = lib[(st["round"] + st["extends"]) % len(lib)]
        return json.dumps({"step": "extend", "skill": skill, "reason": "harder"})
    return json.dumps({"step": "finish", "reason": "budget used"})


def _generator(req: dict) -> str:
    d = json.loads(req["messages"][-1]["content"])
    m = _COMPUTE.match(d["task"]["problem"])
    if m is None:
        return "I can only rewrite 'Compute E.' problems."
    new = rewrite(m.group("e"), d["skill"]["name"], _rng(d["task"]["problem"], d["skill"]["name"]))
    return json.dumps({"problem": f"Compute {new}.", "answer": str(sympy.sympify(new))})


def _meta(req: dict) -> str:
    d = json.loads(req["messages"][-1]["content"])
    if "failed_task" in d:  # online skill induction
        h = hashlib.sha256(d["failed_task"].encode()).hexdigest()[:8]
        return json.dumps({"name": f"induced_{h}", "intent": "one more operation around a nested operand",
                           "method": ["add one operation with a new operand", "nest one operand"],
                           "tool_hint": "sympy"})
    h = d["harness"]
    if len(h["earlier_rejections"]) % 2 == 0 and h["workflow"]["max_extends"] < 8:
        return json.dumps({"op": "edit_workflow", "workflow": {"max_extends": h["workflow"]["max_extends"] + 1,
                                                               "max_steps": max(h["workflow"]["max_steps"], 12)}})
    names = {s["name"] for s in h["skills"]}
    name = next(n for n in ("add_term", "nest", "widen_digits", "add_term_2", "nest_2", "add_term_3") if n not in names)
    return json.dumps({"op": "add_skill", "skill": {"name": name, "intent": "one more construction step",
                                                    "method": [name.rsplit("_", 1)[0].replace("_", " ")],
                                                    "tool_hint": "sympy"}})


def scripted_reply(req: dict) -> str | int:
    """The reply to one chat request by model name (``ROLE_MODELS``); 404 for another model."""
    return {"scripted-director": _director, "scripted-generator": _generator,
            "scripted-meta": _meta}.get(req.get("model"), lambda _: 404)(req)


def scripted_endpoint() -> FakeEndpoint:
    """A running endpoint serving the scripted roles on 127.0.0.1 (``.base_url``; ``.close()`` it)."""
    return FakeEndpoint(models=ROLE_MODELS, responder=scripted_reply)
