"""``treadle.weft.evolve``: the WEFT system-evolution loop's deterministic parts (seed: WEFT 4.1, 5.1).

- :mod:`~treadle.weft.evolve.certify`: atomic-task certification by execution (three baselines),
  near-duplicate pruning, tool coverage.
- :mod:`~treadle.weft.evolve.compose`: cross-server composition (ranking, DAG with entity bindings,
  progressive grounding into a resettable initial snapshot) and the multi-server runner.
- :mod:`~treadle.weft.evolve.attribute`: deterministic failure attribution (policy / environment /
  task / evaluator); :mod:`~treadle.weft.evolve.faults`: the fault-injection suite.
- :mod:`~treadle.weft.evolve.filtering`: RL task filtering by judge/executable correlation.
"""
