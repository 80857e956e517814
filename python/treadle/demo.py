"""``treadle demo``: the main job on embedded defaults, as a list of sections.

Each section is a function ``(run_dir: Path, quick: bool, console) -> None`` in its own area's
module; this file only orders them. Later areas append to :data:`SECTIONS`.
"""
from __future__ import annotations

import importlib
from pathlib import Path

# (name, "module:function"), run in this order.
SECTIONS: list[tuple[str, str]] = [
    ("grpo-op", "treadle.grpo.demo:advantage_table"),
    ("grpo-train", "treadle.grpo.train_demo:run"),
    ("weft-shop", "treadle.weft.demo:run"),
    ("stair", "treadle.stair.demo:run"),
    ("scale", "treadle.scale.demo:run"),
    ("weft-rollouts", "treadle.weft.rollouts.demo:run"),
    ("weft-rl", "treadle.weft.rl.demo:run"),
    ("rsi", "treadle.rsi.demo:run"),
    ("weft-evolve", "treadle.weft.evolve.demo:run"),
]


def _stair_check(model) -> None:
    """What the stair section needs of a model: a STAIR architecture with softmax layers to control."""
    from treadle.stair.controller import default_layers

    default_layers(model)  # raises UnsupportedModelError naming the supported architectures


def _scale_check(model) -> None:
    """What the scale section needs of a model: nn.Linear modules for LoRA (Stage I ``all-linear``)."""
    from treadle.scale.sft import linear_targets

    linear_targets(model)


#: sections that load the model named by $TREADLE_MODEL: name -> (whether they do under --quick, a check of
#: the architecture they need or None). Under --quick stair, scale and rsi use the quick tiny model instead.
MODEL_SECTIONS: dict[str, tuple[bool, object]] = {
    "grpo-train": (True, None),
    "stair": (False, _stair_check),
    "scale": (False, _scale_check),
    "rsi": (False, None),
}


def check_env_model(chosen: list[str], *, quick: bool):
    """The one-line usage error for a ``$TREADLE_MODEL`` that a chosen section would fail on (missing, an
    incomplete checkpoint, not a causal LM, no tokenizer or chat template, an architecture a section does not
    support), or None. Runs before any section, so nothing is trained or written first."""
    users = [n for n in chosen if n in MODEL_SECTIONS and (MODEL_SECTIONS[n][0] or not quick)]
    if not users:
        return None
    from treadle.cli_checks import env_model_error

    needs = [(f"section {n}", MODEL_SECTIONS[n][1]) for n in users if MODEL_SECTIONS[n][1] is not None]
    return env_model_error(needs=needs, hint=f" (it is used by section(s) {', '.join(users)}; --sections picks others)")


def resolve_sections(sections: str) -> list[str]:
    """Names chosen by ``sections`` (``"all"`` or comma-separated).

    Raises:
        ValueError: an unknown or empty section list (the message lists the known ones), or a section
            given twice.
    """
    known = [name for name, _ in SECTIONS]
    chosen = known if sections == "all" else [s.strip() for s in sections.split(",") if s.strip()]
    unknown = [s for s in chosen if s not in known]
    if unknown or not chosen:
        raise ValueError(f"unknown demo section(s) {unknown or [sections]}; known: {known}")
    twice = sorted({s for s in chosen if chosen.count(s) > 1})
    if twice:  # each section writes one sub-folder: a repeat would redo it over its own results
        raise ValueError(f"demo section(s) {twice} given twice; give each once")
    return chosen


def run_demo(sections: str, run_dir: Path, *, quick: bool, console) -> None:
    """Run the chosen sections in order; each writes under ``run_dir/<section>``.

    Raises:
        ValueError: an unknown section name, before any section runs.
    """
    chosen = resolve_sections(sections)
    for name, target in SECTIONS:
        if name not in chosen:
            continue
        module, func = target.split(":")
        try:
            fn = getattr(importlib.import_module(module), func)
        except ModuleNotFoundError as err:
            if sections == "all" and err.name == module:
                continue  # section not built yet
            raise
        console.rule(f"[bold]treadle demo: {name}")
        fn(Path(run_dir) / name, quick, console)
