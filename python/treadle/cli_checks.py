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

__all__ = ["field_check", "build_config", "config_class", "given", "refuse_ignored", "model_problem", "env_model_error"]


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


#: files that hold a tokenizer's chat template besides ``tokenizer_config.json``'s ``chat_template`` key
_CHAT_TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")


def _has_chat_template(p) -> bool:
    import json

    if any((p / name).is_file() for name in _CHAT_TEMPLATE_FILES) or (p / "additional_chat_templates").is_dir():
        return True
    try:
        return bool(json.loads((p / "tokenizer_config.json").read_text()).get("chat_template"))
    except (OSError, ValueError, AttributeError):
        return False


def model_problem(path, *, chat_template: bool = True, needs=()) -> str | None:
    """What makes the checkpoint folder ``path`` unusable, as one line, or None when it looks usable.

    Cheap: nothing is trained and no weights are loaded. Checks that the folder exists and is a complete
    checkpoint (treadle's completion marker and SHA-256s, else the safetensors files' lengths), that it is a
    causal LM (``config.json``), that it has tokenizer files (and a chat template when ``chat_template``),
    and each ``(what, check)`` of ``needs``: ``check(model)`` on the model built from its config on the
    ``meta`` device (no memory, no weights); an exception it raises is the problem, prefixed by ``what``
    (e.g. ``("section stair", stair_check)``).
    """
    from pathlib import Path

    from treadle.models.tiny import (MARKER, TOKENIZER_FILES, CheckpointError, check_checkpoint, check_weight_files,
                                     has_tokenizer_files)

    p = Path(path).expanduser()
    try:
        check_checkpoint(p)
    except (CheckpointError, FileNotFoundError) as err:
        return str(err)
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    try:
        cfg = AutoConfig.from_pretrained(p)
    except (OSError, ValueError, KeyError, TypeError) as err:
        return f"{p} is not a loadable Hugging Face model config: {err}"
    if cfg.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return (f"{p} holds a {cfg.model_type!r} model ({type(cfg).__name__}), which is not a causal LM "
                f"(AutoModelForCausalLM cannot load it)")
    if not (p / MARKER).exists():  # a foreign checkpoint: weights present and not cut short (treadle's: SHA-256)
        try:
            check_weight_files(p)
        except CheckpointError as err:
            return str(err)
    if not has_tokenizer_files(p):
        return (f"{p} has no tokenizer files (none of {', '.join(TOKENIZER_FILES)}); save the model's tokenizer "
                f"into the folder (tokenizer.save_pretrained)")
    if chat_template and not _has_chat_template(p):
        return (f"{p}: its tokenizer has no chat template; treadle's prompts are chat turns, so give a chat/instruct "
                f"checkpoint (or add a chat_template to its tokenizer_config.json)")
    if needs:
        import torch
        from transformers import AutoModelForCausalLM

        try:
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(cfg)
        except Exception as err:  # noqa: BLE001 -- any failure to build it is this checkpoint's problem
            return f"{p}: cannot build its {cfg.model_type!r} model from config.json: {err}"
        for what, check in needs:
            try:
                check(model)
            except (ValueError, TypeError) as err:  # UnsupportedModelError is a ValueError
                return f"{what} cannot use it: {err}"
    return None


def env_model_error(var: str = "TREADLE_MODEL", *, chat_template: bool = True, needs=(), hint: str = ""):
    """The one-line usage error (exit 2) for an unusable checkpoint named by ``$var`` (see
    :func:`model_problem`), or None when ``$var`` is unset or usable. Raise it before any work::

        err = env_model_error(needs=[("section stair", stair_check)])
        if err is not None:
            raise err

    ``hint`` (e.g. "or leave out the stair section") is appended to the message.
    """
    import os

    from treadle.cli_runs import usage_error

    value = os.environ.get(var)
    if not value:
        return None
    problem = model_problem(value, chat_template=chat_template, needs=needs)
    if problem is None:
        return None
    return usage_error(f"${var} {value!r}: {problem}; fix it or unset ${var}{hint}")
