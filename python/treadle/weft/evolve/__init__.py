"""``treadle.weft.evolve``: the WEFT system-evolution loop's deterministic parts (seed: WEFT 4.1, 5.1).

- :mod:`~treadle.weft.evolve.certify`: atomic-task certification by execution (three baselines),
  near-duplicate pruning, tool coverage.
- :mod:`~treadle.weft.evolve.compose`: cross-server composition (ranking, DAG with entity bindings,
  progressive grounding into a resettable initial snapshot) and the multi-server runner;
  :mod:`~treadle.weft.evolve.composed_env` runs a composed task through the rollouts layer.
- :mod:`~treadle.weft.evolve.loop`: attribution and revision rounds (``treadle weft evolve``, offline
  drill in :mod:`~treadle.weft.evolve.drill`); :mod:`~treadle.weft.evolve.revise`: revision of the blamed
  component by LLM roles, accepted only when it passes its validation; :mod:`~treadle.weft.evolve.harness_revise`:
  a blamed harness restored or quarantined and its failures re-run under a healthy one;
  :mod:`~treadle.weft.evolve.doc_judge`: tool documentation against behaviour, by an LLM judge whose claims are
  accepted only when execution confirms them.
- :mod:`~treadle.weft.evolve.attribute`: deterministic failure attribution (policy / environment /
  task / harness / evaluator) and verifier generation from reference evidence, with the checks off the
  reference's path in :mod:`~treadle.weft.evolve.attribute_more`, :mod:`~treadle.weft.evolve.probes`
  (tool contracts, off-path inputs, harness formats), :mod:`~treadle.weft.evolve.task_checks` (derivable
  gold values, consistent requests, the request's party) and :mod:`~treadle.weft.evolve.text_checks`
  (free text by meaning, negative controls); :mod:`~treadle.weft.evolve.faults`,
  :mod:`~treadle.weft.evolve.faults_bfcl` and :mod:`~treadle.weft.evolve.faults_composed`: the fault
  catalogue; :mod:`~treadle.weft.evolve.faults_heldout`: the held-apart fault set, and
  :mod:`~treadle.weft.evolve.drill_report`: each measured apart, BFCL's catalogue in its own table
  (``treadle weft evolve --drill``).
- :mod:`~treadle.weft.evolve.reverify`: stored rollouts re-scored with a revised verifier.
- :mod:`~treadle.weft.evolve.filtering`: RL task filtering by judge/executable correlation;
  :mod:`~treadle.weft.evolve.judge`: task rubrics and the rubric-guided LLM judge (``treadle weft judge``).
- :mod:`~treadle.weft.evolve.synth`: environment synthesis with LLM roles, validated by execution in
  the sandbox (:mod:`~treadle.weft.evolve.synth_validate`), revised where the fault lies.
"""
