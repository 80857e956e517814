"""``treadle.llm``: one client for every model call (OpenAI-compatible endpoints, local checkpoints),
with an on-disk response cache, a cost ledger, recorded fixtures and a real local server.

Knows nothing of WEFT or RSI; they call it. The public surface:

- :class:`LLMConfig` / :class:`RoleConfig` / :class:`Sampling` / :class:`Prices`: per-role settings
  (model, base URL, key variable, sampling, timeout, retries, concurrency, prices), from TOML/YAML/JSON
  (:meth:`LLMConfig.load`) and ``role.field=value`` overrides (:meth:`LLMConfig.with_overrides`);
  :class:`UsageLimits` (calls / tokens / cost budgets, checked before each live call).
- :class:`LLMClient`: async ``chat``, ``complete``, ``sample`` (n samples), ``structured`` (pydantic
  output with repair re-asks), ``gather`` (batch; failures returned in place), ``probe`` (fail fast).
- :class:`ChatResult` (text, tool_calls, finish_reason, usage, token ids / logprobs if returned,
  ``cached``, ``recorded``), :class:`StructuredResult`, :class:`Failure` (+ :class:`FailureKind`),
  :class:`LLMCallError`, :class:`EndpointError`.
- :class:`Cache` (SQLite WAL, content-addressed, JSON entries), :class:`Ledger` (append-only JSONL,
  totals per role and tag).
- :class:`RecordedBackend` (replay by request hash; fails on anything unrecorded).
- :func:`local_server`: ``transformers serve`` on 127.0.0.1 over a local checkpoint (CLI:
  ``treadle llm serve``).

Example::

    import asyncio
    from treadle.llm import LLMClient, LLMConfig, local_server

    async def main(base_url, model):
        cfg = LLMConfig.single(model, base_url, roles=("policy",), sampling={"max_tokens": 16})
        async with LLMClient(cfg, cache="runs/x/llm_cache.sqlite", ledger="runs/x/llm_ledger.jsonl") as llm:
            r = await llm.chat([{"role": "user", "content": "2+2="}], role="policy", tag="demo")
            print(r.text, r.finish_reason, r.usage)

    with local_server() as srv:            # the embedded tiny model
        asyncio.run(main(srv.base_url, srv.model))
"""
from treadle.llm.backends import (BadResponseError, EndpointError, OpenAIBackend, RecordedBackend, Recorder,
                                  UnrecordedRequestError)
from treadle.llm.cache import Cache, CacheError, request_key
from treadle.llm.client import LLMClient
from treadle.llm.config import ConfigError, LLMConfig, Prices, RoleConfig, Sampling, UsageLimits
from treadle.llm.ledger import Ledger, LedgerError, LedgerRecord, Totals, read_ledger, totals
from treadle.llm.records import (ChatResult, Failure, FailureKind, LLMCallError, StructuredResult, TokenLogprob,
                                 ToolCall, Usage)
from treadle.llm.server import LocalServer, ServerStartError, local_server

__all__ = ["LLMConfig", "RoleConfig", "Sampling", "Prices", "UsageLimits", "ConfigError", "CacheError", "LedgerError", "LLMClient", "ChatResult",
           "ToolCall", "Usage", "TokenLogprob", "StructuredResult", "Failure", "FailureKind", "LLMCallError",
           "EndpointError", "BadResponseError", "Cache", "request_key", "Ledger", "LedgerRecord", "Totals",
           "read_ledger", "totals", "OpenAIBackend", "RecordedBackend", "Recorder", "UnrecordedRequestError",
           "local_server", "LocalServer", "ServerStartError"]
