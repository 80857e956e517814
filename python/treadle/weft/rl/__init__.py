"""WEFT RL (issue 15): a tiny tool-using policy, atomic-turn GRPO groups from forked state, training.

- :mod:`.vocab`: the character tokenizer of the math model plus tool-call tokens (Hermes harness).
- :mod:`.worlds`: shop worlds with drawn entities and the task templates (train / held-out split).
- :mod:`.gold`: gold turns played through the runtime (real tool outputs, turn-start states).
- :mod:`.sampling`: G candidate segments of one atomic turn from a forked state, verdict and flags.
- :mod:`.sft`: ``treadle model train-tiny --task tools`` (SFT on gold trajectories, cached).
- :mod:`.groups`: group records, keys, advantages through ``treadle.ops.grpo_advantages``, hand-off rows.
- :mod:`.train`: GRPO on the tiny tool policy, atomic-turn vs trajectory grouping.
"""
