"""Read ``bench/results/`` into the docs' Benchmarks page.

Layout: one folder per measurement session, named ``<cpu|gpu|...>-<YYYY-MM-DD>``; each holds Markdown
pages (``*.md``) and the raw files they were made from (JSON, logs, PNG). Every page opens with a
front-matter block naming what produced it::

    ---
    title: GRPO advantages vs peers (CPU)
    command: treadle bench --report
    device: Intel Xeon, 2 cores, no GPU
    date: 2026-12-01
    ---

``render`` returns the page text and the PNG files it shows; ``check`` lists pages that lack a field,
so a result without its command, device or date cannot reach the docs.
"""
from __future__ import annotations

import pathlib
import re

FIELDS = ("title", "command", "device", "date")
_FRONT = re.compile(r"\A---\n(.*?)\n---\n", re.S)
_IMG = re.compile(r"!\[([^\]]*)\]\(([^)\s]+\.png)\)")


def parse(path: pathlib.Path) -> tuple[dict[str, str], str]:
    """Front-matter fields and the body of one results page."""
    text = path.read_text(encoding="utf-8")
    m = _FRONT.match(text)
    if not m:
        return {}, text
    meta = {}
    for line in m.group(1).splitlines():
        key, sep, value = line.partition(":")
        if sep:
            meta[key.strip()] = value.strip()
    return meta, text[m.end():]


def pages(results: pathlib.Path) -> list[pathlib.Path]:
    """Every results page, newest folder first, pages in name order."""
    folders = sorted((p for p in results.iterdir() if p.is_dir()), key=lambda p: (p.name.split("-", 1)[-1], p.name),
                     reverse=True)
    return [md for folder in folders for md in sorted(folder.glob("*.md"))]


def check(results: pathlib.Path) -> list[str]:
    """Pages missing a front-matter field, as ``"<path>: missing <field>"`` lines."""
    problems = []
    for md in pages(results):
        meta, _ = parse(md)
        problems += [f"{md.relative_to(results)}: missing {f}" for f in FIELDS if not meta.get(f)]
    return problems


def _demote(body: str) -> str:
    # the page's own headings sit under the section heading that names the page
    return re.sub(r"^(#{1,4}) ", lambda m: "#" * (len(m.group(1)) + 2) + " ", body, flags=re.M)


def render(results: pathlib.Path) -> tuple[str, dict[str, bytes]]:
    """The Benchmarks page and the images it links (name -> bytes)."""
    images: dict[str, bytes] = {}
    out = ["# Benchmarks", "",
           "Generated from `bench/results/` when the docs are built. Each section names the command that",
           "produced it, the device and the date; the raw files sit beside each page in its folder.",
           "Ratios compare treadle with a named peer measured in the same run.", ""]
    current = None
    for md in pages(results):
        folder = md.parent.name
        if folder != current:
            out += [f"## `{folder}`", ""]
            current = folder
        meta, body = parse(md)
        out += [f"### {meta.get('title', md.stem)}", "",
                f"- command: `{meta.get('command', '?')}`",
                f"- device: {meta.get('device', '?')}",
                f"- date: {meta.get('date', '?')}",
                f"- source: `bench/results/{folder}/{md.name}`", ""]

        def _image(m: re.Match, folder: str = folder, base: pathlib.Path = md.parent) -> str:
            src = (base / m.group(2)).resolve()
            if not src.is_file():
                return m.group(0)
            name = f"{folder}-{src.name}"
            images[name] = src.read_bytes()
            return f"![{m.group(1)}](bench-images/{name})"

        out += [_IMG.sub(_image, _demote(body)).rstrip(), ""]
    return "\n".join(out) + "\n", images
