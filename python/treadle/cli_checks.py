"""Ranges and choices of CLI options taken from the pydantic config they fill, so that typer names the
flag itself (``Error: Invalid value for '--L': Input should be less than 0, got 0.0``, exit 2) and the
range is written once, on the config field.

    L: float = typer.Option(-2.0, "--L", callback=field_check("treadle.scale.training:ScaleTrainConfig", "L"))

The config class is imported when the option is checked (while the command line is parsed, before
any work), not when the CLI module is imported. :func:`build_config` builds a config from options
and turns a :class:`pydantic.ValidationError` into a usage error naming the flag of the failing field
(from the field's location, not from the message's wording).
"""
from __future__ import annotations

import importlib
from functools import lru_cache

import typer

__all__ = ["field_check", "build_config", "config_class"]


def config_class(target: str):
    """``"package.module:Class"`` -> the class."""
    module, name = target.split(":")
    return getattr(importlib.import_module(module), name)


@lru_cache(maxsize=None)
def _adapter(target: str, field: str):
    from typing import Annotated

    from pydantic import TypeAdapter

    cls = config_class(target)
    fields = getattr(cls, "__pydantic_fields__", None) or getattr(cls, "model_fields", None)
    if fields is None:
        return None  # not a pydantic config: checked by building it (see field_check)
    info = fields[field]
    return TypeAdapter(Annotated[(info.annotation, *info.metadata)] if info.metadata else info.annotation)


def _first_error(err) -> tuple[tuple, str]:
    e = err.errors(include_url=False)[0]
    msg = e["msg"].removeprefix("Value error, ")
    return tuple(e.get("loc") or ()), msg


def field_check(target: str, field: str):
    """A typer option callback that validates the value against ``target``'s field ``field`` (its
    type, ``Field`` range and ``Literal`` choices); None (option not given) passes.

    Raises (when the option is parsed):
        typer.BadParameter: the value is out of the field's range or choices (typer names the flag).
    """
    from pydantic import ValidationError

    def check(value):
        if value is None:
            return value
        adapter = _adapter(target, field)
        try:
            if adapter is not None:
                adapter.validate_python(value)
            else:  # a plain dataclass validating in __post_init__: build one with this value
                config_class(target)(**{field: value})
        except ValidationError as err:
            raise typer.BadParameter(f"{_first_error(err)[1]}, got {value!r}") from None
        except (ValueError, TypeError) as err:
            raise typer.BadParameter(" ".join(str(err).split())) from None
        return value

    return check


def build_config(cls, flags: dict[str, str], /, **values):
    """``cls(**values)`` (None values left out, so the config's defaults apply); a validation error
    becomes a usage error naming the flag of the first failing field (``flags[field]``, else
    ``--field-name``).

    Raises:
        typer.BadParameter: the config refuses the values (exit 2).
    """
    from pydantic import ValidationError

    kw = {k: v for k, v in values.items() if v is not None}
    try:
        return cls(**kw)
    except ValidationError as err:
        if not err.errors():
            raise typer.BadParameter(str(err)) from None
        loc, msg = _first_error(err)
        field = str(loc[0]) if loc else ""
        hint = flags.get(field, "--" + field.replace("_", "-")) if field else None
        raise typer.BadParameter(msg, param_hint=hint) from None
    except (ValueError, TypeError) as err:  # a config that is not (yet) pydantic
        raise typer.BadParameter(" ".join(str(err).split())) from None


def given(ctx, name: str) -> bool:
    """Whether the user set option ``name`` (command line or environment), not left at its default."""
    source = ctx.get_parameter_source(name)
    return source is not None and source.name in ("COMMANDLINE", "ENVIRONMENT", "PROMPT")


def refuse_ignored(ctx, rules) -> None:
    """Options the command would ignore are errors: for each ``(name, flag, applies, why)`` in ``rules``,
    a user-set option whose ``applies`` is False is a usage error naming ``flag`` (``why`` says when it
    applies).

    Raises:
        typer.BadParameter: the first ignored option.
    """
    for name, flag, applies, why in rules:
        if given(ctx, name) and not applies:
            raise typer.BadParameter(f"ignored here: it applies {why}", param_hint=flag)
