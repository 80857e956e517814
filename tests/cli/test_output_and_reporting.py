"""What our commands print (no 80-column wrapping or tqdm stream on a pipe; third-party noise silenced) and
the report_to sinks."""
import subprocess
import sys

import pytest

from treadle.reporting import Reporter, installed_reporters, resolve_report_to


def test_console_on_a_pipe_does_not_wrap_at_80_columns():
    code = ("from treadle.cli_output import make_console, progress_enabled, PIPE_WIDTH\n"
            "c = make_console()\nassert c.width == PIPE_WIDTH, c.width\nassert not progress_enabled(True)\n"
            "c.print('x' * 150)\n")
    env = {k: v for k, v in __import__("os").environ.items() if k != "COLUMNS"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "x" * 150  # one line


def test_quiet_third_party_silences_hf_progress_logs_and_deprecation_warnings():
    code = ("import warnings, logging\nfrom treadle.cli_output import quiet_third_party\nquiet_third_party()\n"
            "import transformers\nfrom transformers.utils import logging as hf\n"
            "quiet_third_party()\n"
            "assert hf.get_verbosity() == logging.ERROR and not hf.is_progress_bar_enabled()\n"
            "import peft\n"
            "with warnings.catch_warnings(record=True) as w:\n"
            "    warnings.warn_explicit('old', FutureWarning, 'peft/x.py', 1, module='peft.x')\n"
            "    warnings.warn_explicit('old', UserWarning, 'transformers/y.py', 1, module='transformers.y')\n"
            "assert not w, [str(x.message) for x in w]\n")
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith(("TRANSFORMERS_", "HF_HUB_"))}
    env.pop("PYTHONWARNINGS", None)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr


def test_report_to_values():
    assert resolve_report_to(None) == [] and resolve_report_to("none") == [] and resolve_report_to(["none"]) == []
    assert resolve_report_to("all") == installed_reporters()
    with pytest.raises(ValueError, match="unknown report_to"):
        resolve_report_to("mlflow2")
    for name in ("tensorboard", "wandb"):
        if name not in installed_reporters():
            with pytest.raises(ValueError, match="pip install"):
                resolve_report_to(name)
    Reporter("none").log({"loss": 1.0}, 0)  # no sinks: a no-op


def test_tensorboard_events_when_installed(tmp_path):
    pytest.importorskip("tensorboard")
    rep = Reporter("tensorboard", tmp_path, config={"lr": 1.0}, name="t")
    rep.log({"train/loss": 0.5, "flag": True, "text": "x"}, 1)
    rep.close()
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
