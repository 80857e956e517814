"""WEFT RL: a tiny tool-using policy, atomic-turn GRPO groups from forked state, training on TRL or verl.

- :mod:`.vocab`: the character tokenizer of the math model plus tool-call tokens (Hermes harness), its
  tool-calling chat template and response parser.
- :mod:`.worlds`: shop worlds with drawn entities and the task templates (train / held-out split).
- :mod:`.gold`: gold turns played through the runtime (real tool outputs, turn-start states).
- :mod:`.sampling`: G candidate segments of one atomic turn from a forked state, verdict and flags.
- :mod:`.sft`: ``treadle model train-tiny --task tools`` (SFT on gold trajectories, cached).
- :mod:`.groups`: group records, keys, advantages through ``treadle.ops.grpo_advantages``, hand-off rows.
- :mod:`.trl_env`: the WEFT environments for ``trl.GRPOTrainer(environment_factory=...)`` (atomic turns and
  whole tasks) and their dataset; :mod:`.trl_trainer`: ``WeftGRPOTrainer`` (atomic-turn and trajectory
  groups); :mod:`.trl_run`: ``treadle weft train``; :mod:`.config`: its settings.
- :mod:`.heldout`: held-out evaluation (sampled per-turn and whole-task success).
- :mod:`.verl_tool`: a ``verl`` ``BaseTool`` serving the shop per trajectory, its tool config and rows;
  :mod:`.verl_reward`: the agent loop that hands each trajectory's verdict to verl's reward manager, the
  ``compute_score`` it calls, and the configs a verl run points at.
"""
