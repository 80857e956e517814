"""Metric logging of treadle's training loops (STAIR training, SCALE Stage II) through the usual
``report_to`` setting of Hugging Face trainers: ``"tensorboard"``, ``"wandb"``, a list of them,
``"all"`` (every one installed) or ``"none"`` (the default). The run folder's JSONL log is always
written; these are extra sinks.

    reporter = Reporter(["tensorboard"], run_dir, config={"lr": 1e-3}, name="stair-train")
    reporter.log({"loss": 0.3}, step=1)
    reporter.close()
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

__all__ = ["REPORTERS", "installed_reporters", "resolve_report_to", "parse_report_to", "Reporter"]

# report_to name -> module that must be importable
REPORTERS = {"tensorboard": "tensorboard", "wandb": "wandb"}


def installed_reporters() -> list[str]:
    """The ``report_to`` names whose library is installed here."""
    return [name for name, module in REPORTERS.items() if importlib.util.find_spec(module) is not None]


def resolve_report_to(report_to) -> list[str]:
    """``report_to`` (None, ``"none"``, ``"all"``, a name, or a list of names) -> list of names.

    Raises:
        ValueError: an unknown name, or a named library that is not installed (says what to install).
    """
    if report_to is None:
        return []
    names = [report_to] if isinstance(report_to, str) else list(report_to)
    names = [n.strip() for n in names if n and n.strip()]
    if names in ([], ["none"]):
        return []
    if names == ["all"]:
        return installed_reporters()
    unknown = [n for n in names if n not in REPORTERS]
    if unknown:
        raise ValueError(f"unknown report_to {unknown}; expected 'none', 'all' or names from {sorted(REPORTERS)}")
    missing = [n for n in names if importlib.util.find_spec(REPORTERS[n]) is None]
    if missing:
        raise ValueError(f"report_to {missing} needs `pip install {' '.join(REPORTERS[n] for n in missing)}`")
    return names


def parse_report_to(text: str, flag: str = "--report-to") -> list[str]:
    """A CLI value (``"tensorboard,wandb"``, ``"all"``, ``"none"``) -> names; a usage error naming ``flag``."""
    import typer

    try:
        return resolve_report_to(text.split(","))
    except ValueError as err:
        raise typer.BadParameter(str(err), param_hint=flag) from None


class Reporter:
    """Sends scalar metrics to the chosen sinks (none: every call is a no-op).

    Args:
        report_to: see :func:`resolve_report_to`.
        run_dir: the run folder; TensorBoard events go to ``run_dir/tensorboard``, W&B files under
            ``run_dir/wandb``.
        config: the run's settings (W&B run config, TensorBoard hparams text).
        name: run name.
    """

    def __init__(self, report_to, run_dir=None, *, config: dict | None = None, name: str = "treadle"):
        self.names = resolve_report_to(report_to)
        self._tb = self._wandb = None
        base = Path(run_dir) if run_dir is not None else Path("runs") / name
        if "tensorboard" in self.names:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(base / "tensorboard"))
            if config:
                import json

                self._tb.add_text("config", "```\n" + json.dumps(config, indent=1, default=str) + "\n```", 0)
        if "wandb" in self.names:
            import wandb

            base.mkdir(parents=True, exist_ok=True)
            self._wandb = wandb.init(name=name, config=config or {}, dir=str(base), reinit=True)

    def log(self, metrics: dict, step: int) -> None:
        """Log the numeric entries of ``metrics`` at ``step``."""
        scalars = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if self._tb is not None:
            for k, v in scalars.items():
                self._tb.add_scalar(k, v, step)
        if self._wandb is not None:
            self._wandb.log(scalars, step=step)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
