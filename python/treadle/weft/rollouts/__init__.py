"""``treadle.weft.rollouts``: tasks and environments -> SFT trajectories (seed: WEFT section 4.1).

Layers (execute -> build -> batch), each module named for what it holds:

- :mod:`~.registry`: decorator registries of the components (views, harnesses, policies).
- :mod:`~.tasks`: rollout tasks (atomic tasks, dependencies, disclosure levels, checkpoints).
- :mod:`~.views`: ``agentic`` and ``simuser`` (rule-based offline user simulator).
- :mod:`~.harnesses`: ``react``, ``hermes``, ``native`` (one tolerant parser each).
- :mod:`~.policies`: ``llm`` (a :mod:`treadle.llm` role) and ``replay`` (gold calls, seeded perturbations).
- :mod:`~.records`: frozen records (policy outputs, steps, turn attempts, trajectories).
- :mod:`~.rollout`: one turn; prefix-preserving and end-to-end rejection sampling (execute layer).
- :mod:`~.batch`: config, component building, concurrent resumable batches into a run folder.
- :mod:`~.tokens`: token-level SFT samples (chat template with tools, loss mask, budgets).
- :mod:`~.metrics`: acceptance, accepted trajectories per policy call, tool-call error rates, rewards.
- :mod:`~.cli` (``treadle weft sample``), :mod:`~.demo` (demo section).
"""
