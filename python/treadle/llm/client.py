"""The async client every model call in treadle goes through: cache -> concurrency limit -> backend,
with retries (exponential backoff, full jitter, ``Retry-After`` honoured) on connection errors,
timeouts, 429 and 5xx only, and one ledger line per call.

Single calls (:meth:`LLMClient.chat`, :meth:`complete`) raise :class:`LLMCallError` carrying a
:class:`Failure`; batch helpers (:meth:`gather`, :meth:`sample`) and :meth:`structured` return the
:class:`Failure` record in place, so one bad call never cancels its siblings.
"""
from __future__ import annotations

import asyncio
import email.utils
import math
import os
import random
import time
from collections.abc import Awaitable, Iterable, Sequence
from typing import Any

from pydantic import BaseModel

from treadle.llm.backends import Backend, BadResponseError, EndpointError, OpenAIBackend, Recorder
from treadle.llm.cache import Cache, CacheMode, request_key
from treadle.llm.config import LLMConfig, RoleConfig, Sampling, UsageLimits
from treadle.llm.ledger import Ledger
from treadle.llm.parse import parse_response
from treadle.llm.records import ChatResult, Failure, FailureKind, LLMCallError, StructuredResult
from treadle.llm.structured import extract_and_validate, response_format, schema_instruction
from treadle.untrusted import clip, mask_secrets

__all__ = ["LLMClient"]


def _retry_after(err) -> float | None:
    """Seconds an endpoint's ``Retry-After`` asks for (a number or an HTTP date), or None when absent or not a
    usable value (garbage, NaN, a date without a zone): a hostile header never raises."""
    resp = getattr(err, "response", None)
    try:
        value = resp.headers.get("retry-after") if resp is not None else None
    except Exception:  # noqa: BLE001 -- headers of a hostile reply
        return None
    if not value or not isinstance(value, str) or len(value) > 100:
        return None
    try:
        secs = float(value)
    except ValueError:
        try:
            parsed = email.utils.parsedate_to_datetime(value)
            secs = parsed.timestamp() - time.time()
        except (TypeError, ValueError, OverflowError, IndexError):
            return None
    return max(0.0, secs) if math.isfinite(secs) else None


def classify(err: BaseException) -> tuple[FailureKind, int | None]:
    """Map an exception from a backend to a :class:`FailureKind` (and the HTTP status, if any)."""
    import openai

    if isinstance(err, BadResponseError):
        return FailureKind.bad_response, None
    if isinstance(err, (openai.APITimeoutError, asyncio.TimeoutError)):
        return FailureKind.timeout, None
    if isinstance(err, openai.APIConnectionError):
        return FailureKind.connection, None
    if isinstance(err, openai.APIStatusError):
        s = err.status_code
        if s == 429:
            return FailureKind.rate_limited, s
        if s >= 500:
            return FailureKind.server_error, s
        if s in (401, 403):
            return FailureKind.auth, s
        return FailureKind.bad_request, s
    if isinstance(err, openai.APIResponseValidationError):
        return FailureKind.bad_response, None
    raise err


def _message(err: BaseException, cfg: RoleConfig) -> str:
    """What failed, for humans; the role's API key is masked even when the server echoes it back."""
    body = getattr(err, "body", None)
    detail = body if isinstance(body, (str, dict)) and body else err
    try:
        detail = str(detail)
    except (ValueError, RecursionError):  # a body too deep or with too long an int to print
        detail = f"({type(body).__name__} body not printable)"
    key = os.environ.get(cfg.api_key_env) if cfg.api_key_env else None
    if key:
        detail = detail.replace(key, "***")
    # masked before it is cut: a key straddling the cut would otherwise leave its head in the message
    return f"{type(err).__name__} from {cfg.base_url} (model {cfg.model!r}): {clip(detail, 300)}"


class LLMClient:
    """One client for all roles of an :class:`LLMConfig`.

    Args:
        config: the roles (model, endpoint, sampling, retries, concurrency, prices).
        cache: a :class:`Cache`, a path for one, or None (no cache).
        ledger: a :class:`Ledger`, a path for one, or None (no accounting).
        cache_mode: ``use`` / ``refresh`` / ``off``; default the cache's own mode.
        backend: where requests go (default :class:`OpenAIBackend`; :class:`RecordedBackend` for fixtures).
        record_to: also append every live response to this JSONL fixture file (for :class:`RecordedBackend`;
            record with ``cache_mode="refresh"`` or ``"off"``: a cache hit has no raw response to record).
        limits: :class:`UsageLimits` (calls, tokens, cost of live calls), checked before each live call; a call
            over budget is not sent and fails with kind ``budget_exhausted``. ``usage`` holds what was spent.
            Calls are counted when sent (exact under concurrency); tokens and cost when answered, so calls
            already in flight may overshoot a token or cost budget by their own size.

    Use it inside one event loop (``async with LLMClient(...) as llm:``); concurrency per ``base_url`` is
    bounded by the smallest ``max_concurrency`` of the roles on it.
    """

    def __init__(self, config: LLMConfig, *, cache: Cache | str | os.PathLike | None = None,
                 ledger: Ledger | str | os.PathLike | None = None, cache_mode: CacheMode | None = None,
                 backend: Backend | None = None, record_to: str | os.PathLike | None = None,
                 limits: UsageLimits | None = None):
        if not isinstance(config, LLMConfig):
            raise TypeError(f"config must be an LLMConfig, got {type(config).__name__}")
        self.config = config
        self._owns_cache = cache is not None and not isinstance(cache, Cache)
        self._owns_ledger = ledger is not None and not isinstance(ledger, Ledger)
        if cache_mode is not None and cache_mode not in ("use", "refresh", "off"):
            raise ValueError(f"cache_mode must be 'use', 'refresh' or 'off', got {cache_mode!r}")
        if limits is not None and not isinstance(limits, UsageLimits):
            raise TypeError(f"limits must be a UsageLimits, got {type(limits).__name__}")
        # the ledger first: it writes nothing until a call, so a bad ledger path fails before a cache file is made
        self.ledger = ledger if isinstance(ledger, Ledger) or ledger is None else Ledger(ledger)
        self.cache = cache if isinstance(cache, Cache) or cache is None else Cache(cache)
        self.cache_mode: CacheMode = cache_mode or (self.cache.mode if self.cache is not None else "off")
        self.backend = backend or OpenAIBackend()
        self.recorder = Recorder(record_to) if record_to is not None else None
        per_url: dict[str, int] = {}
        for rc in config.roles.values():
            per_url[rc.base_url] = min(per_url.get(rc.base_url, rc.max_concurrency), rc.max_concurrency)
        self._concurrency = per_url
        self._sems: dict[str, asyncio.Semaphore] = {}
        self._probed: set[tuple[str, str]] = set()
        self.limits = limits or UsageLimits()
        self.usage = {"calls": 0, "tokens": 0, "cost_usd": 0.0}
        """Live usage of this client so far: calls sent, tokens (in + out), cost in USD."""

    async def __aenter__(self) -> "LLMClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the backend's connections, and the cache / ledger this client opened from paths."""
        await self.backend.aclose()
        if self.ledger is not None and self._owns_ledger:
            self.ledger.close()
        if self.cache is not None and self._owns_cache:
            self.cache.close()

    # ---------------------------------------------------------------- requests
    def _sem(self, base_url: str) -> asyncio.Semaphore:
        s = self._sems.get(base_url)
        if s is None:
            s = self._sems[base_url] = asyncio.Semaphore(self._concurrency[base_url])
        return s

    @staticmethod
    def _sampling_fields(s: Sampling, sample_index: int) -> dict:
        out: dict[str, Any] = {}
        for k in ("temperature", "top_p", "max_tokens", "stop", "presence_penalty", "frequency_penalty"):
            v = getattr(s, k)
            if v is not None:
                out[k] = v
        if s.seed is not None:
            out["seed"] = s.seed + sample_index
        out.update(s.extra_body or {})
        return out

    def build_chat(self, messages: Sequence[dict], *, role: str = "default", tools: Sequence[dict] | None = None,
                   tool_choice: str | dict | None = None, sampling: Sampling | dict | None = None,
                   response_format: dict | None = None, sample_index: int = 0) -> tuple[RoleConfig, dict, str]:
        """``(role config, wire payload, cache key)`` of a chat request (no I/O; raises on bad input)."""
        cfg = self.config.role(role)
        if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
            raise ValueError(f"messages must be a non-empty list of {{'role', 'content'}} dicts, got {messages!r:.80}")
        for m in messages:
            if not isinstance(m, dict) or "role" not in m:
                raise ValueError(f"each message must be a dict with a 'role' key, got {m!r:.80}")
        if not isinstance(sample_index, int) or sample_index < 0:
            raise ValueError(f"sample_index must be an int >= 0, got {sample_index!r}")
        s = cfg.sampling.merged(sampling)
        payload: dict[str, Any] = {"model": cfg.model, "messages": list(messages),
                                   **self._sampling_fields(s, sample_index)}
        if tools:
            payload["tools"] = list(tools)
        if tool_choice is not None:
            payload["tool_choice"] = tool_choice
        if response_format is not None:
            payload["response_format"] = response_format
        if s.logprobs is not None:
            payload["logprobs"] = True
            if s.logprobs:
                payload["top_logprobs"] = s.logprobs
        return cfg, payload, request_key(payload, kind="chat", sample_index=sample_index)

    def build_completion(self, prompt: str, *, role: str = "default", sampling: Sampling | dict | None = None,
                         sample_index: int = 0) -> tuple[RoleConfig, dict, str]:
        """``(role config, wire payload, cache key)`` of a text-completion request."""
        cfg = self.config.role(role)
        if not isinstance(prompt, str):
            raise TypeError(f"prompt must be a str, got {type(prompt).__name__}")
        if not isinstance(sample_index, int) or sample_index < 0:
            raise ValueError(f"sample_index must be an int >= 0, got {sample_index!r}")
        s = cfg.sampling.merged(sampling)
        payload: dict[str, Any] = {"model": cfg.model, "prompt": prompt, **self._sampling_fields(s, sample_index)}
        if s.logprobs is not None:
            payload["logprobs"] = s.logprobs
        return cfg, payload, request_key(payload, kind="completion", sample_index=sample_index)

    async def _run(self, kind: str, role: str, tag: str, cfg: RoleConfig, payload: dict, key: str,
                   sample_index: int, judge=None) -> ChatResult | Failure:
        """One request through cache, budget, retries and the ledger. ``judge(result)``, when given, returns the
        :class:`FailureKind` the caller will return for this reply (e.g. ``invalid_output`` for the last
        structured reply that did not validate), or None: the reply's ledger line then says ``ok=False`` with
        that kind, so the ledger's failures count what the caller got."""
        if self.cache is not None and self.cache_mode == "use":
            hit = self.cache.get(key)
            if hit is not None:
                self._account(role, tag, kind, key, hit, cfg, attempts=1, failed=judge(hit) if judge else None)
                return hit
        over = self._over_budget()
        if over:
            failure = Failure.of(FailureKind.budget_exhausted, f"{over}; the call was not sent", role, key=key,
                                 attempts=0)
            self._account(role, tag, kind, key, failure, cfg, attempts=0)
            return failure
        self.usage["calls"] += 1  # counted when sent, so concurrent calls cannot all pass a max_calls check
        attempts = 0
        t_start = time.perf_counter()
        while True:
            attempts += 1
            t0 = time.perf_counter()
            try:
                async with self._sem(cfg.base_url):
                    t0 = time.perf_counter()
                    # timeout_s bounds the whole attempt: a reply trickled byte by byte resets the HTTP
                    # client's read timeout on every byte, never this deadline
                    data = await asyncio.wait_for(self.backend.send(cfg, kind, payload, key), cfg.timeout_s)
                result = parse_response(data, kind=kind, model=cfg.model, key=key, sample_index=sample_index,
                                        latency_s=time.perf_counter() - t0, recorded=self.backend.recorded)
            except Exception as err:  # noqa: BLE001 -- classify re-raises what is not a call failure
                fk, status = classify(err)
                if fk.retryable and attempts <= cfg.max_retries:
                    delay = random.uniform(0, min(cfg.backoff_max_s, cfg.backoff_s * 2 ** (attempts - 1)))
                    ra = _retry_after(err)
                    if ra is not None:
                        delay = min(max(delay, ra), cfg.backoff_max_s)
                    await asyncio.sleep(delay)
                    continue
                failure = Failure.of(fk, _message(err, cfg), role, key=key, status_code=status, attempts=attempts)
                self._account(role, tag, kind, key, failure, cfg, attempts=attempts,
                              latency_s=time.perf_counter() - t_start)
                return failure
            if self.recorder is not None and not self.backend.recorded:
                self.recorder.add(key, kind, payload, data)
            if self.cache is not None and self.cache_mode != "off":
                self.cache.put(result)
            self._account(role, tag, kind, key, result, cfg, attempts=attempts,
                          failed=judge(result) if judge else None)
            return result

    def _over_budget(self) -> str | None:
        lim, u = self.limits, self.usage
        if lim.max_calls is not None and u["calls"] >= lim.max_calls:
            return f"UsageLimits.max_calls={lim.max_calls} reached"
        if lim.max_tokens is not None and u["tokens"] >= lim.max_tokens:
            return f"UsageLimits.max_tokens={lim.max_tokens} reached ({u['tokens']} spent)"
        if lim.max_cost_usd is not None and u["cost_usd"] >= lim.max_cost_usd:
            return f"UsageLimits.max_cost_usd={lim.max_cost_usd} reached ({u['cost_usd']:.6f} spent)"
        return None

    def _account(self, role, tag, kind, key, outcome, cfg: RoleConfig, *, attempts: int,
                 latency_s: float | None = None, failed: FailureKind | None = None):
        if isinstance(outcome, ChatResult) and not outcome.cached and not outcome.recorded:
            self.usage["tokens"] += outcome.usage.prompt_tokens + outcome.usage.completion_tokens
            if cfg.prices:
                self.usage["cost_usd"] += cfg.prices.cost(outcome.usage.prompt_tokens,
                                                          outcome.usage.completion_tokens)
        if self.ledger is None:
            return
        if isinstance(outcome, Failure):
            self.ledger.record(role=role, tag=tag, model=cfg.model, kind=kind, key=key, tokens_in=0, tokens_out=0,
                               latency_s=latency_s or 0.0, cache_hit=False, recorded=self.backend.recorded,
                               cost_usd=0.0, ok=False, failure=outcome.kind.value, attempts=attempts)
            return
        paid = not outcome.cached and not outcome.recorded
        tin = outcome.usage.prompt_tokens if paid else 0
        tout = outcome.usage.completion_tokens if paid else 0
        cost = cfg.prices.cost(tin, tout) if cfg.prices else 0.0
        self.ledger.record(role=role, tag=tag, model=cfg.model, kind=kind, key=key, tokens_in=tin, tokens_out=tout,
                           latency_s=outcome.latency_s, cache_hit=outcome.cached, recorded=outcome.recorded,
                           cost_usd=cost, ok=failed is None, failure=failed.value if failed is not None else None,
                           attempts=attempts)

    # ---------------------------------------------------------------- public calls
    async def chat(self, messages: Sequence[dict], *, role: str = "default", tag: str = "",
                   tools: Sequence[dict] | None = None, tool_choice: str | dict | None = None,
                   sampling: Sampling | dict | None = None, response_format: dict | None = None,
                   sample_index: int = 0) -> ChatResult:
        """One chat completion.

        Args:
            messages: OpenAI chat messages (``[{"role": "user", "content": "..."}, ...]``; tool results as
                ``{"role": "tool", "tool_call_id": ..., "content": ...}``).
            role: config role to use; tag: operator tag for the ledger.
            tools: OpenAI tool specs (``{"type": "function", "function": {name, description, parameters}}``).
            tool_choice: ``"auto"``, ``"none"``, ``"required"`` or a named function.
            sampling: per-call overrides of the role's :class:`Sampling`.
            response_format: OpenAI ``response_format`` (JSON mode / schema), passed through.
            sample_index: index of this sample in its group (part of the cache key; seed + index is sent).

        Returns:
            :class:`ChatResult` (``finish_reason`` always set; ``cached`` / ``recorded`` flags).

        Raises:
            LLMCallError: the call failed after retries (``.failure`` says why and whose fault).
            ValueError / ConfigError: malformed messages or unknown role (before any I/O).
        """
        cfg, payload, key = self.build_chat(messages, role=role, tools=tools, tool_choice=tool_choice,
                                            sampling=sampling, response_format=response_format,
                                            sample_index=sample_index)
        out = await self._run("chat", role, tag, cfg, payload, key, sample_index)
        if isinstance(out, Failure):
            raise LLMCallError(out)
        return out

    async def complete(self, prompt: str, *, role: str = "default", tag: str = "",
                       sampling: Sampling | dict | None = None, sample_index: int = 0) -> ChatResult:
        """One text completion of ``prompt`` (``/v1/completions``); same contract as :meth:`chat`."""
        cfg, payload, key = self.build_completion(prompt, role=role, sampling=sampling, sample_index=sample_index)
        out = await self._run("completion", role, tag, cfg, payload, key, sample_index)
        if isinstance(out, Failure):
            raise LLMCallError(out)
        return out

    async def sample(self, messages: Sequence[dict], n: int, **kw) -> list[ChatResult | Failure]:
        """``n`` samples of one chat request (sample indices 0..n-1: n distinct cache entries and seeds);
        failures are returned in place. ``kw`` as for :meth:`chat` (without ``sample_index``)."""
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"n must be an int >= 1, got {n!r}")
        return await self.gather([self.chat(messages, sample_index=i, **kw) for i in range(n)])

    async def structured(self, messages: Sequence[dict], schema: type[BaseModel], *, role: str = "default",
                         tag: str = "", sampling: Sampling | dict | None = None, sample_index: int = 0,
                         max_repairs: int | None = None) -> StructuredResult | Failure:
        """Ask for JSON validating against the pydantic model ``schema``.

        Uses the role's ``structured_mode`` (response_format ``json_schema`` / ``json_object``, or the
        prompt only), extracts JSON tolerantly (bare, fenced or embedded in prose), validates, and on
        failure re-asks with the validation error at most ``max_repairs`` times (default: the role's).

        Returns:
            :class:`StructuredResult` (``.value`` is a ``schema`` instance), or a :class:`Failure` of kind
            ``invalid_output`` (never validated; ``last_output`` holds the last reply) or a provider kind.
        """
        if not (isinstance(schema, type) and issubclass(schema, BaseModel)):
            raise TypeError(f"schema must be a pydantic BaseModel subclass, got {schema!r}")
        cfg = self.config.role(role)
        repairs = cfg.max_repairs if max_repairs is None else max_repairs
        if not isinstance(repairs, int) or repairs < 0:
            raise ValueError(f"max_repairs must be an int >= 0, got {max_repairs!r}")
        msgs = [{"role": "system", "content": schema_instruction(schema)}, *messages]
        rf = response_format(schema, cfg.structured_mode)
        last = ""
        for attempt in range(1, repairs + 2):
            cfg_, payload, key = self.build_chat(msgs, role=role, sampling=sampling, response_format=rf,
                                                 sample_index=sample_index)
            checked: dict = {}

            def judge(result: ChatResult, final: bool = attempt == repairs + 1, checked: dict = checked):
                # validated before the ledger line is written: the final reply that does not validate is the
                # structured call's invalid_output failure, and its line says so (earlier ones led to a repair)
                checked["v"] = extract_and_validate(result.text, schema)
                return FailureKind.invalid_output if final and checked["v"][0] is None else None

            out = await self._run("chat", role, tag, cfg_, payload, key, sample_index, judge=judge)
            if isinstance(out, Failure):
                return out
            value, error = checked["v"]
            if value is not None:
                return StructuredResult(value=value, result=out, attempts=attempt)
            last = out.text
            msgs = [*msgs, {"role": "assistant", "content": out.text},
                    {"role": "user",
                     "content": f"That reply did not validate: {error}\nReply again with only the JSON object."}]
        return Failure.of(FailureKind.invalid_output,
                          f"no reply validated as {schema.__name__} in {repairs + 1} attempts",
                          role, key=key, attempts=repairs + 1, last_output=last)

    async def gather(self, calls: Iterable[Awaitable], *, probe: Iterable[str] = ()) -> list:
        """Await ``calls`` concurrently (each already bounded by its endpoint's limit); an :class:`LLMCallError`
        becomes its :class:`Failure` in place. Roles in ``probe`` are checked first with :meth:`probe`: on
        :class:`EndpointError` no call is started."""
        calls = list(calls)
        try:
            for r in probe:
                await self.probe(r)
        except BaseException:
            for c in calls:
                if asyncio.iscoroutine(c):
                    c.close()
            raise

        async def one(aw):
            try:
                return await aw
            except LLMCallError as err:
                return err.failure

        return list(await asyncio.gather(*(one(c) for c in calls)))

    async def probe(self, role: str = "default") -> None:
        """One cheap request to ``role``'s endpoint (model list, else a one-token call); raises
        :class:`EndpointError` with a clear message for an unreachable URL, an unknown model or a rejected
        key. Done once per (base URL, model) per client."""
        cfg = self.config.role(role)
        k = (cfg.base_url, cfg.model)
        if k in self._probed:
            return
        try:
            await asyncio.wait_for(self.backend.probe(cfg), 2 * cfg.timeout_s + 1)
        except asyncio.TimeoutError:
            raise EndpointError(f"{cfg.base_url} (model {cfg.model!r}) did not answer a probe within "
                                f"{2 * cfg.timeout_s + 1:g} s") from None
        except EndpointError as err:
            raise EndpointError(mask_secrets(err)) from None
        self._probed.add(k)
