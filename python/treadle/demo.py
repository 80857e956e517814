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
]


def run_demo(sections: str, run_dir: Path, *, quick: bool, console) -> None:
    """Run the chosen sections (``"all"`` or comma-separated names).

    Raises:
        ValueError: an unknown section name (the message lists the known ones).
    """
    known = [name for name, _ in SECTIONS]
    chosen = known if sections == "all" else [s.strip() for s in sections.split(",") if s.strip()]
    unknown = [s for s in chosen if s not in known]
    if unknown:
        raise ValueError(f"unknown demo section(s) {unknown}; known: {known}")
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
