"""mkdocs hook: the Benchmarks page is generated from ``bench/results/`` at build time.

Nothing on that page is typed by hand: every results folder contributes its pages, each of which
names the command that produced it, the device and the date (``docs/benchresults.py`` parses and
checks them; ``tests/docs`` runs the same check without building the site).
"""
from __future__ import annotations

import pathlib
import sys

from mkdocs.structure.files import File

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "docs"))

import benchresults  # noqa: E402  (the docs folder is not a package)


def on_files(files, config):
    page, images = benchresults.render(ROOT / "bench" / "results")
    files.append(File.generated(config, "benchmarks.md", content=page))
    for name, data in images.items():
        files.append(File.generated(config, f"bench-images/{name}", content=data))
    return files
