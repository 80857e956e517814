"""``treadle.weft.rollouts``: tasks and environments -> SFT trajectories (seed: WEFT section 4.1).

Layers (execute -> build -> batch), each module named for what it holds:

- :mod:`~.registry`: decorator registries of the components (views, harnesses, policies).
- :mod:`~.tasks`: rollout tasks (atomic tasks, dependencies, disclosure levels, checkpoints).
- :mod:`~.bfcl_tasks`: BFCL v4 multi-turn entries (single-class) as rollout tasks and environments.
- :mod:`~.views`: ``agentic``, ``simuser`` (rule-based offline user simulator) and ``simuser-llm``
  (an LLM persona through :mod:`treadle.llm`).
- :mod:`~.harnesses`: ``react``, ``hermes``, ``native`` (one tolerant parser each);
  :mod:`~.openclaw`: ``openclaw`` (OpenClaw's system prompt and workspace files, native calls).
- :mod:`~.policies`: ``llm`` (a :mod:`treadle.llm` role, e.g. the local server), ``hf`` (in process) and
  ``replay`` (gold calls, seeded perturbations).
- :mod:`~.records`: frozen records (policy outputs, steps, turn attempts, trajectories).
- :mod:`~.rollout`: one turn; prefix-preserving and end-to-end rejection sampling (execute layer).
- :mod:`~.batch`: config, component building, concurrent resumable batches into a run folder.
- :mod:`~.tokens`: token-level SFT samples (chat template with tools, loss mask, budgets, the policy's
  own token ids kept, split where the template re-renders a turn).
- :mod:`~.metrics`: acceptance, accepted trajectories per policy call, tool-call error rates, rewards.
- :mod:`~.cli` (``treadle weft sample``), :mod:`~.demo` (demo section).
"""
