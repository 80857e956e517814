"""WEFT on TRL: a WEFT environment for ``trl.GRPOTrainer(environment_factory=...)``, its dataset, and
atomic-turn GRPO as a small :class:`~treadle.grpo.trl_trainer.TreadleGRPOTrainer` subclass.

Seed: WEFT 4.1 (atomic-turn GRPO). TRL owns the loop (sampling with transformers or vLLM, its multi-turn tool
loop, the loss, accelerate / DeepSpeed / FSDP); treadle contributes the environment, the grouping and the
advantages:

- :class:`WeftBackend`: one WEFT :class:`~treadle.weft.runtime.Runtime` per process, on an event loop of its own
  (an ``anyio`` blocking portal), so that TRL's synchronous environment methods can drive the async runtime.
  It plays each episode's gold turns once and keeps one base session per atomic-turn start.
- :func:`weft_environment`: the environment class. Each instance holds a fork of a turn start's base session
  (copy-on-write); ``reset(**row)`` forks the row's start state; its public methods are the MCP server's tools,
  with typed signatures and docstrings generated from the tools' JSON schemas (TRL renders them with
  ``apply_chat_template(tools=...)`` and calls them by name); arguments outside a schema come back as the
  runtime's typed ``invalid_args`` error text, which the policy sees. ``get_reward()`` is the atomic task's
  verdict from the runtime's verification, or None for an environment failure (TRL turns it into NaN, which the
  trainer leaves out of the group).
- :func:`weft_turn_dataset`: one row per atomic-turn start (history + the turn's request as ``prompt``, the
  state reference as ``weft_split`` / ``weft_episode`` / ``weft_turn``). TRL repeats each row
  ``num_generations`` times: the G generations of a row are that turn's candidates from the same forked state.
- :class:`treadle.weft.rl.trl_trainer.WeftGRPOTrainer` (its own module: it imports TRL): flagged turns (repetition, interface violation,
  malformed call, truncated, step cap: the flags of :mod:`treadle.weft.rl.sampling`) get ``min(A, 0)``;
  environment failures are left out of the group statistics and their tokens out of the loss (and its
  normaliser); a truncated segment scores 0.

``use_vllm=True`` in the ``GRPOConfig`` is TRL's own switch (generation in vLLM, colocated or on a server);
nothing here depends on the generation backend. On CPU the tests run transformers generation.

Trajectory grouping (the ablation baseline, whole-task reward ``R = mean_k r_k``): :class:`WeftTrajectory`
(``weft_environment(grouping="trajectory")``) with :func:`weft_turn_dataset` ``(whole_tasks=True)``: one row
per task start; TRL's tool loop plays each turn, and the trainer appends the user's next request after a
turn's reply and runs the tool loop again (:meth:`~treadle.weft.rl.trl_trainer.WeftGRPOTrainer._tool_call_loop`),
all in the one forked session; the G generations of a row are G whole trajectories of that task.
"""
from __future__ import annotations

import functools
import inspect
import json
import threading
import typing
from typing import Any

__all__ = ["WeftBackend", "WeftRollout", "WeftTrajectory", "GROUPINGS", "WeftRowError", "ROW_COLUMNS", "weft_environment", "weft_turn_dataset",
           "default_backend", "tool_method", "check_weft_trl_config"]

ROW_COLUMNS = ("weft_split", "weft_episode", "weft_turn")
"""The state reference of a dataset row (train/held-out split, episode seed, atomic-turn index)."""

_JSON_TYPES = {"string": str, "integer": int, "number": float, "boolean": bool, "object": dict, "null": type(None)}
_INTERFACE = frozenset({"invalid_args", "unknown_tool"})
_ENV_ERRORS = frozenset({"crash", "timeout", "infrastructure"})


class WeftRowError(ValueError):
    """A dataset row that names no WEFT turn start, or one that does not exist (bad split, seed or turn)."""


def _py_type(schema: dict) -> Any:
    """A Python type hint for a JSON schema (what ``transformers.get_json_schema`` turns back into a schema)."""
    if not isinstance(schema, dict):
        return str
    if "anyOf" in schema or "oneOf" in schema:
        opts = [_py_type(s) for s in schema.get("anyOf", schema.get("oneOf", []))]
        return typing.Union[tuple(opts)] if opts else str
    if "$ref" in schema:
        return dict
    kind = schema.get("type")
    if kind == "array":
        items = schema.get("items")
        return list[_py_type(items)] if isinstance(items, dict) and items else list
    return _JSON_TYPES.get(kind, str)


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def tool_method(spec: dict):
    """A method ``f(self, **arguments)`` for the runtime tool ``spec`` (``name``, ``description``,
    ``input_schema``), with a typed ``__signature__``, annotations and a Google-style docstring generated from
    the schema (required parameters first, optional ones default None). The call goes to ``self._call(name,
    arguments)`` with exactly the arguments the policy wrote (the runtime checks them against the schema)."""
    name = spec["name"]
    schema = spec.get("input_schema") or {}
    props = schema.get("properties") or {}
    required = set(schema.get("required") or ())

    def method(self, **arguments):
        return self._call(name, arguments)

    P = inspect.Parameter
    params = [P("self", P.POSITIONAL_OR_KEYWORD)]
    annotations: dict[str, Any] = {}
    order = sorted(props, key=lambda k: k not in required)
    lines = []
    for k in order:
        if not k.isidentifier():
            continue
        hint = _py_type(props[k])
        annotations[k] = hint
        params.append(P(k, P.POSITIONAL_OR_KEYWORD, annotation=hint, **({} if k in required else {"default": None})))
        desc = props[k].get("description") or props[k].get("title") or k
        lines.append(f"    {k}: {_one_line(desc)}")
    annotations["return"] = str
    method.__name__ = method.__qualname__ = name
    method.__signature__ = inspect.Signature(params, return_annotation=str)
    method.__annotations__ = annotations
    doc = _one_line(spec.get("description") or name)
    method.__doc__ = doc + ("\n\nArgs:\n" + "\n".join(lines) if lines else "") + "\n\nReturns:\n    The tool's output."
    return method


class WeftBackend:
    """One WEFT runtime (with the shop server registered) on a background event loop, shared by every
    environment instance of a process. Plays gold episodes once and keeps one base session per turn start.

    ``close()`` ends the runtime (every session); it also runs at interpreter exit."""

    def __init__(self):
        import atexit

        from anyio.from_thread import start_blocking_portal

        from treadle.weft.envs import shop
        from treadle.weft.runtime import Runtime

        self._lock = threading.Lock()
        self._portal_cm = start_blocking_portal()
        self.portal = self._portal_cm.__enter__()
        try:
            self._rt_cm = self.portal.wrap_async_context_manager(Runtime())
            self.rt = self._rt_cm.__enter__()
            self.server_hash = self.rt.register(shop)
        except BaseException:
            self._portal_cm.__exit__(None, None, None)
            raise
        self._golds: dict[tuple[str, int], Any] = {}
        self._bases: dict[tuple[str, int, int], str] = {}
        self._tools: list[dict] | None = None
        self.closed = False
        atexit.register(self.close)

    def run(self, fn, *args):
        """``await fn(*args)`` on the runtime's loop, from this (synchronous) thread."""
        if self.closed:
            raise RuntimeError("the WEFT backend is closed")
        return self.portal.call(fn, *args)

    def tools(self) -> list[dict]:
        """The server's tool definitions (``name``, ``description``, ``input_schema``)."""
        if self._tools is None:
            from treadle.weft.rl.worlds import draw_episode

            async def listed():
                sid = await self.rt.create_session(self.server_hash, draw_episode(0).snapshot())
                try:
                    return await self.rt.list_tools(sid)
                finally:
                    await self.rt.close(sid)

            self._tools = self.run(listed)
        return self._tools

    @staticmethod
    def reference(row: dict) -> tuple[str, int, int]:
        """``(split, episode seed, turn)`` of a row.

        Raises:
            WeftRowError: a missing or ill-typed column, an unknown split, a negative seed, a turn the
                episode does not have.
        """
        from treadle.weft.rl.worlds import SPLITS, TEMPLATES, draw_episode

        missing = [c for c in ROW_COLUMNS if c not in row or row[c] is None]
        if missing:
            raise WeftRowError(f"the row names no WEFT turn start: columns {missing} are missing (build rows with "
                               f"weft_turn_dataset; GRPOConfig(remove_unused_columns=False) keeps them)")
        split, seed, turn = row["weft_split"], row["weft_episode"], row["weft_turn"]
        if split not in SPLITS:
            raise WeftRowError(f"weft_split must be one of {SPLITS}, got {split!r}")
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise WeftRowError(f"weft_episode must be an int >= 0, got {seed!r}")
        n = len(draw_episode(seed, split, TEMPLATES[seed % len(TEMPLATES)]).task.atomic)
        if isinstance(turn, bool) or not isinstance(turn, int) or not 0 <= turn < n:
            raise WeftRowError(f"weft_turn must be an int in 0..{n - 1} (episode {seed} of {split!r} has {n} "
                               f"atomic turns), got {turn!r}")
        return split, seed, turn

    def gold(self, split: str, seed: int):
        """The :class:`~treadle.weft.rl.gold.GoldEpisode` of an episode (played once, then cached)."""
        from treadle.weft.rl.gold import play_gold
        from treadle.weft.rl.worlds import TEMPLATES, draw_episode
        from treadle.weft.rollouts.harnesses import HermesHarness

        key = (split, seed)
        with self._lock:
            if key not in self._golds:
                ep = draw_episode(seed, split, TEMPLATES[seed % len(TEMPLATES)])
                self._golds[key] = self.run(functools.partial(play_gold, self.rt, self.server_hash, ep,
                                                              HermesHarness(), verify=False))
            return self._golds[key]

    def start(self, row: dict):
        """The :class:`~treadle.weft.rl.gold.TurnStart` a row references (:meth:`reference`)."""
        split, seed, turn = self.reference(row)
        return self.gold(split, seed).starts[turn]

    def fork(self, row: dict) -> tuple[Any, str]:
        """``(turn start, session id)``: a fresh copy-on-write fork of the row's start state."""
        split, seed, turn = self.reference(row)
        ts = self.gold(split, seed).starts[turn]
        key = (split, seed, turn)
        with self._lock:
            if key not in self._bases:
                self._bases[key] = self.run(self.rt.create_session, self.server_hash, ts.snapshot)
            base = self._bases[key]
        return ts, self.run(self.rt.fork, base)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            self._rt_cm.__exit__(None, None, None)
        finally:
            self._portal_cm.__exit__(None, None, None)


_DEFAULT: WeftBackend | None = None


def default_backend() -> WeftBackend:
    """The process's shared :class:`WeftBackend` (created on first use)."""
    global _DEFAULT
    if _DEFAULT is None or _DEFAULT.closed:
        _DEFAULT = WeftBackend()
    return _DEFAULT


class WeftRollout:
    """One rollout of an atomic turn: the forked session, the turn start, the outcomes, the flags (the state
    behind TRL's environment instances and verl's per-trajectory tool sessions)."""

    backend: WeftBackend

    def __init__(self):
        self._sid: str | None = None
        self._start = None
        self.outcomes: list = []
        self.flags: set[str] = set()
        self.env_failure: str | None = None
        self._seen: set = set()

    def reset(self, **row) -> None:
        """Fork the row's start state (closing the previous fork); the prompt is the row's own ``prompt``.

        Raises:
            WeftRowError: the row names no turn start, or one that does not exist.
        """
        self._close()
        self.outcomes, self.flags, self.env_failure, self._seen = [], set(), None, set()
        self._start, self._sid = self.backend.fork(row)
        return None

    def _close(self) -> None:
        if self._sid is not None:
            sid, self._sid = self._sid, None
            try:
                self.backend.run(self.backend.rt.close, sid)
            except Exception:  # noqa: BLE001,S110  (a crashed fork has nothing left to close)
                pass

    def _call(self, name: str, arguments: dict) -> str:
        from treadle.weft.rl.gold import tool_text

        if self._sid is None:
            return "Error (environment): no episode (reset was not called)"
        if self.env_failure is not None:
            return f"Error (environment): {self.env_failure}"
        sig = (name, json.dumps(arguments, sort_keys=True, default=str))
        if sig in self._seen:
            self.flags.add("repetition")
        self._seen.add(sig)
        try:
            outcome = self.backend.run(self.backend.rt.call_tool, self._sid, name, arguments)
        except Exception as err:  # noqa: BLE001  (the environment failed, not the policy)
            self.env_failure = f"{name}: {type(err).__name__}: {err}"[:500]
            return f"Error (environment): {self.env_failure}"
        self.outcomes.append(outcome)
        kind = outcome.error_kind.value if outcome.error_kind else None
        if kind in _INTERFACE:
            self.flags.add("interface_violation")
        if kind in _ENV_ERRORS:
            self.env_failure = f"{name}: {kind}: {outcome.text[:300]}"
        return tool_text(outcome)

    def get_reward(self) -> float | None:
        """The atomic task's verdict (0 or 1) of this rollout; None for an environment failure (a crash,
        timeout or infrastructure error of a tool, or a checkpoint that fails for non-policy reasons)."""
        if self._sid is None or self.env_failure is not None:
            return None
        try:
            v = self.backend.run(functools.partial(self.backend.rt.verify_turn, self._sid, self._start.snapshot,
                                                   self._start.atomic.checkpoint, self.outcomes, replay_check=False))
        except Exception as err:  # noqa: BLE001
            self.env_failure = f"verify: {type(err).__name__}: {err}"[:500]
            return None
        if v.r == 0 and not v.policy_failure:
            self.env_failure = "checkpoint: " + "; ".join(v.details)[:500]
            return None
        return float(v.r)


class WeftTrajectory(WeftRollout):
    """One whole-task rollout (trajectory grouping, the WEFT 4.1 ablation baseline): the row's start state is
    forked once, and every atomic turn from the row's turn to the episode's last is played in that session,
    each from the policy's own history and state.

    The trainer ends a turn with :meth:`_end_turn` (a private method: TRL never offers it as a tool); it
    verifies the turn against its checkpoint (from the state at the turn's start, which is the state the
    policy's earlier turns left) and returns the next turn's user request, or None when the task is over.
    ``get_reward()`` is the whole-task reward ``R = mean_k r_k`` over the episode's turns from the row's start
    (turns never reached score 0), or None for an environment failure. A checkpoint that cannot be judged
    because an earlier turn of the trajectory failed (its gold calls assume the gold state) is the policy's
    failure (``r = 0``), not the environment's."""

    def reset(self, **row) -> None:
        """Fork the row's start state and play from its turn (:meth:`WeftRollout.reset`).

        Raises:
            WeftRowError: the row names no turn start, or one that does not exist.
        """
        super().reset(**row)
        order = self._start.episode.task.ordered()
        self._order, self._turn, self._turn_snapshot = order, self._start.turn, self._start.snapshot
        self._open, self.turn_rewards = True, []
        return None

    def _verdict(self, truncated: bool) -> int | None:
        """The current turn's verdict (0 or 1), or None for an environment failure (recorded)."""
        if self.env_failure is not None:
            return None
        try:
            v = self.backend.run(functools.partial(self.backend.rt.verify_turn, self._sid, self._turn_snapshot,
                                                   self._order[self._turn].checkpoint, self.outcomes,
                                                   replay_check=False))
        except Exception as err:  # noqa: BLE001
            self.env_failure = f"verify: {type(err).__name__}: {err}"[:500]
            return None
        if v.r == 0 and not v.policy_failure and not any(r == 0 for r in self.turn_rewards):
            self.env_failure = "checkpoint: " + "; ".join(v.details)[:500]
            return None
        return 0 if truncated else int(v.r)

    def _end_turn(self, truncated: bool = False) -> str | None:
        """End the current turn (``truncated``: its last generation ran out of tokens: ``r = 0``); the next
        turn's user request, or None (the task is over, or the environment failed)."""
        if self._sid is None or not self._open:
            return None
        r = self._verdict(truncated)
        if r is None:
            self._open = False
            return None
        self.turn_rewards.append(r)
        if self._turn + 1 >= len(self._order):
            self._open = False
            return None
        try:
            self._turn_snapshot = self.backend.run(self.backend.rt.snapshot, self._sid)
        except Exception as err:  # noqa: BLE001  (a crashed session has no state to continue from)
            self.env_failure, self._open = f"snapshot: {type(err).__name__}: {err}"[:500], False
            return None
        self._turn += 1
        self.outcomes, self._seen = [], set()
        return self._order[self._turn].request

    def get_reward(self) -> float | None:
        """``R = mean_k r_k`` over the episode's turns from the row's start; None for an environment failure.
        A turn still open is ended first (untruncated); the turns never reached count 0."""
        if self._sid is None:
            return None
        if self._open:
            self._open = False
            r = self._verdict(False)
            if r is not None:
                self.turn_rewards.append(r)
        if self.env_failure is not None:
            return None
        return sum(self.turn_rewards) / (len(self._order) - self._start.turn)


GROUPINGS = {"atomic": WeftRollout, "trajectory": WeftTrajectory}
"""The environment base class of each grouping."""


def weft_environment(backend: WeftBackend | None = None, grouping: str = "atomic") -> type:
    """The environment class for ``GRPOTrainer(environment_factory=...)``: ``reset(**row)``, ``get_reward()``
    and one method per tool of the shop server (:func:`tool_method`), bound to ``backend`` (default: the
    process's :func:`default_backend`). ``grouping``: ``atomic`` (one atomic turn per rollout, its verdict;
    :class:`WeftRollout`) or ``trajectory`` (the whole task from the row's turn, ``R = mean_k r_k``;
    :class:`WeftTrajectory`, whose turns :class:`~treadle.weft.rl.trl_trainer.WeftGRPOTrainer` chains).

    Raises:
        ValueError: an unknown grouping.
    """
    if grouping not in GROUPINGS:
        raise ValueError(f"grouping must be one of {sorted(GROUPINGS)}, got {grouping!r}")
    be = backend if backend is not None else default_backend()
    members: dict[str, Any] = {"backend": be, "__doc__": "A WEFT shop rollout: a forked session, its tools as methods."}
    for spec in be.tools():
        if spec["name"].isidentifier() and not spec["name"].startswith("_") and spec["name"] not in ("reset",
                                                                                                   "get_reward"):
            members[spec["name"]] = tool_method(spec)
    return type("WeftEnvironment" if grouping == "atomic" else "WeftTaskEnvironment", (GROUPINGS[grouping],), members)


def weft_turn_dataset(episodes: int, split: str = "train", *, start: int = 0, backend: WeftBackend | None = None,
                      whole_tasks: bool = False):
    """A ``datasets.Dataset`` with one row per atomic-turn start of ``episodes`` shop episodes (seeds
    ``start ..``): ``prompt`` (the messages before the turn's reply: gold history + the turn's request) and
    the state reference (:data:`ROW_COLUMNS`). ``whole_tasks``: one row per episode, its first turn's start
    (trajectory grouping: the rollout plays the whole task from there).

    Raises:
        ValueError: ``episodes < 1`` or a bad split.
    """
    from datasets import Dataset

    from treadle.weft.rl.worlds import SPLITS

    if not isinstance(episodes, int) or episodes < 1:
        raise ValueError(f"episodes must be an int >= 1, got {episodes!r}")
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    be = backend if backend is not None else default_backend()
    rows: dict[str, list] = {"prompt": [], **{c: [] for c in ROW_COLUMNS}}
    for seed in range(start, start + episodes):
        starts = be.gold(split, seed).starts
        for ts in starts[:1] if whole_tasks else starts:
            rows["prompt"].append([dict(m) for m in ts.messages])
            rows["weft_split"].append(split)
            rows["weft_episode"].append(seed)
            rows["weft_turn"].append(ts.turn)
    return Dataset.from_dict(rows)


def check_weft_trl_config(args, processing_class, train_dataset) -> None:
    """What TRL would silently misread for WEFT, as one clear error before training.

    Raises:
        ValueError: ``remove_unused_columns=True`` (the rows' state reference would never reach ``reset``);
            ``num_generations < 2``; ``multi_objective_aggregation`` other than ``sum_then_normalize``; a
            tokenizer with no response parser (TRL would never see a tool call) or a chat template without
            tool support; a dataset row that names no turn start or one that does not exist.
    """
    if getattr(args, "remove_unused_columns", False):
        raise ValueError("WEFT rows carry their start state in columns (weft_split, weft_episode, weft_turn): set "
                         "GRPOConfig(remove_unused_columns=False)")
    if args.num_generations is None or args.num_generations < 2:
        raise ValueError(f"num_generations must be >= 2 (a group of one has no baseline), got {args.num_generations}")
    if getattr(args, "multi_objective_aggregation", "sum_then_normalize") != "sum_then_normalize":
        raise ValueError("WEFT atomic-turn GRPO supports multi_objective_aggregation='sum_then_normalize' only")
    tok = getattr(processing_class, "tokenizer", processing_class)
    if getattr(tok, "response_template", None) is None and getattr(tok, "response_schema", None) is None:
        raise ValueError("the tokenizer has no response_template: TRL could not parse the policy's tool calls "
                         "(for the tiny tool policy: treadle.weft.rl.vocab.with_tool_calling(tokenizer))")
    from trl.chat_template_utils import supports_tool_calling

    if not supports_tool_calling(processing_class):
        raise ValueError("the chat template cannot render tool calls and tool messages (TRL's tool loop needs it)")
    if train_dataset is not None:
        cols = set(getattr(train_dataset, "column_names", None) or ())
        if not {"prompt", *ROW_COLUMNS} <= cols:
            raise WeftRowError(f"the dataset needs the columns prompt and {list(ROW_COLUMNS)} (weft_turn_dataset), "
                               f"has {sorted(cols)}")
        for i in range(len(train_dataset)):
            try:
                WeftBackend.reference(train_dataset[i])
            except WeftRowError as err:
                raise WeftRowError(f"dataset row {i}: {err}") from None


def _truncated(ids, eos_ids, pad_id) -> bool:
    return bool(ids) and ids[-1] not in (*eos_ids, pad_id)
