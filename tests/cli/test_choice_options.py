"""Every option of every ``treadle`` command that takes one of a fixed set of values (a ``Literal`` or an
``Enum``): a bad value is one line naming the flag, the value given and every allowed value, exit 2,
without pydantic's "Value error, " prefix (typer checks such choices through pydantic)."""
import enum
import importlib
import typing

import pytest
import typer
from typer.testing import CliRunner

from treadle.cli import _areas, app

runner = CliRunner()


def _choices(annotation) -> list[str] | None:
    if typing.get_origin(annotation) is typing.Literal:
        return [str(v) for v in typing.get_args(annotation)]
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return [str(m.value) for m in annotation]
    if typing.get_origin(annotation) in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        for arg in typing.get_args(annotation):
            got = _choices(arg)
            if got:
                return got
    return None


def _choice_options() -> list[tuple[list[str], str, list[str]]]:
    found = []
    for area, (module, _) in _areas().items():
        group = typer.main.get_command(importlib.import_module(module).app)
        for name, cmd in getattr(group, "commands", {}).items():
            for p in cmd.params:
                desc = getattr(p, "type_descriptor", None)
                choices = _choices(getattr(desc, "annotation", None))
                if choices and p.param_type_name == "option" and not p.hidden:
                    found.append(([area, name], p.opts[0], choices))
    return found


OPTIONS = _choice_options()


def test_the_scan_finds_the_choice_options():
    flags = {(tuple(cmd), flag) for cmd, flag, _ in OPTIONS}
    assert {(("weft", "bfcl"), "--category"), (("scale", "sweep"), "--metric"), (("stair", "train"), "--kind")} <= flags


@pytest.mark.parametrize("cmd,flag,choices", OPTIONS, ids=[f"{' '.join(c)} {f}" for c, f, _ in OPTIONS])
def test_bad_choice_is_one_line_naming_flag_and_allowed_values(cmd, flag, choices):
    res = runner.invoke(app, [*cmd, flag, "no-such-value"])
    assert res.exit_code == 2, res.output
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error: "), res.output
    line = lines[0]
    assert f"'{flag}'" in line and "'no-such-value'" in line and "Value error" not in line, line
    assert all(repr(c) in line for c in choices), line
