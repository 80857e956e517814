"""A green run means everything ran: every op's declared C++ and Triton backends are present where CI
runs (the extension is always built there and Triton runs under the interpreter), and the helpers
that skip locally fail under CI. Run locally, a missing backend is a skip that names it."""
import subprocess
import sys
import warnings

import pytest
import torch

import treadle
from treadle import _extension, dispatch
from treadle.testing import FALLBACK_WARNING, backend_missing, in_ci, require_backend, require_module, skip_or_fail

# ops that declare no kernel on purpose (the reference is the implementation); every other op must
# declare both a C++ CPU kernel and a Triton kernel
REFERENCE_ONLY = {"topk_entropy", "topk_entropy_from_hidden"}  # README: "PyTorch only"


def _ops():
    treadle.backends()  # imports treadle.ops, which registers every op
    return dispatch.registered()


def test_every_op_declares_cpp_and_triton_unless_reference_only():
    ops = _ops()
    assert {"gated_lora", "gated_lora_linear", "grpo_advantages", "stair_readout"} <= set(ops)
    for name, spec in ops.items():
        if name in REFERENCE_ONLY:  # what README and `treadle backends` say: no kernel is claimed
            assert spec.cpu == () and spec.gpu == (), f"{name} is documented as PyTorch only but declares {spec}"
            continue
        assert "cpp" in spec.cpu, f"{name} declares no C++ CPU kernel: {spec}"
        assert "triton" in spec.gpu + spec.cpu, f"{name} declares no Triton kernel: {spec}"


@pytest.mark.parametrize("op", sorted(set(_ops()) - REFERENCE_ONLY))
def test_every_declared_cpu_backend_is_available(op):
    spec = dispatch.registered()[op]
    missing = {b: why for b in (*spec.cpu, "triton") if (why := backend_missing(op, b, "cpu")) is not None}
    if missing:
        skip_or_fail(f"{op}: backends missing on CPU: {missing}")
    # and with nothing requested, a CPU tensor gets a kernel, never the reference
    assert dispatch.choose(op, "cpu")[0] in ("cpp", "triton")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("op", sorted(set(_ops()) - REFERENCE_ONLY))
def test_every_declared_gpu_backend_is_available(op):
    spec = dispatch.registered()[op]
    missing = {b: why for b in spec.gpu if (why := backend_missing(op, b, "cuda")) is not None}
    if missing:
        skip_or_fail(f"{op}: backends missing on CUDA: {missing}")


def test_extension_is_built():
    if not _extension.available():
        skip_or_fail(f"treadle._C is not importable: {_extension.status()}")
    for op in sorted(set(_ops()) - REFERENCE_ONLY):
        assert _extension.has_kernel(op, "CPU"), f"treadle._C has no CPU kernel for {op}"


# ---- the helpers themselves: skip locally, fail under CI -------------------------------------------


@pytest.mark.parametrize("value,expected", [("true", True), ("1", True), ("yes", True), ("TRUE", True),
                                            ("", False), ("0", False), ("false", False), ("no", False)])
def test_in_ci_reads_the_ci_variable(monkeypatch, value, expected):
    monkeypatch.setenv("CI", value)
    assert in_ci() is expected
    monkeypatch.delenv("CI")
    assert in_ci() is False


def test_skip_or_fail(monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="widget missing"):
        skip_or_fail("widget missing")
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="widget missing .*CI is set"):
        skip_or_fail("widget missing")


def test_backend_missing_says_why():
    assert backend_missing("grpo_advantages", "reference") is None
    why = backend_missing("grpo_advantages", "cuda", "cpu")
    assert why is not None and "grpo_advantages" in why and "cpu" in why
    with pytest.raises(KeyError, match="unknown treadle op"):
        backend_missing("no_such_op", "cpp")


def test_require_backend_marks(monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    present = require_backend("grpo_advantages", "reference")
    assert present.name == "treadle_requires" and present.kwargs == {"op": "grpo_advantages", "backend": "reference"}
    local = require_backend("grpo_advantages", "cuda", "cpu")  # never available for CPU tensors
    assert local.name == "skip" and "cuda backend of grpo_advantages" in local.kwargs["reason"]
    monkeypatch.setenv("CI", "true")
    ci = require_backend("grpo_advantages", "cuda", "cpu")
    assert ci.name == "treadle_missing" and "cuda backend of grpo_advantages" in ci.kwargs["reason"]


def test_require_module(monkeypatch):
    import json

    assert require_module("json") is json
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="'treadle_no_such_dep' is not installed"):
        require_module("treadle_no_such_dep")
    with pytest.raises(pytest.skip.Exception, match="'treadle_no_such_dep' is not installed .*'treadle_no_such_dep.sub'"):
        require_module("treadle_no_such_dep.sub")
    with pytest.raises(ModuleNotFoundError, match="json.no_such_sub"):  # package there, submodule not: an error
        require_module("json.no_such_sub")
    monkeypatch.setenv("CI", "1")
    with pytest.raises(pytest.fail.Exception, match="'treadle_no_such_dep' is not installed"):
        require_module("treadle_no_such_dep")


def test_require_module_does_not_hide_a_broken_import(monkeypatch, tmp_path):
    """An installed module whose own imports fail is an error, not a "not installed" skip."""
    (tmp_path / "treadle_broken_dep.py").write_text("import treadle_dep_of_broken_dep\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(ModuleNotFoundError, match="treadle_dep_of_broken_dep"):
        require_module("treadle_broken_dep")
    (tmp_path / "treadle_broken_dep2.py").write_text("raise RuntimeError('boom at import')\n")
    with pytest.raises(RuntimeError, match="boom at import"):
        require_module("treadle_broken_dep2")


_CI_PROBE = '''
import pytest
from treadle.testing import require_backend

@require_backend("grpo_advantages", "cuda", "cpu")
def test_probe():
    pass
'''


@pytest.mark.parametrize("ci,outcome", [("", "1 skipped"), ("true", "1 error")])  # fails in setup
def test_a_missing_backend_is_a_skip_locally_and_a_failure_under_ci(tmp_path, ci, outcome):
    """End to end through tests/conftest.py's hook, in a child pytest (the probe's backend, CUDA
    kernels for CPU tensors, never exists)."""
    import os
    from pathlib import Path

    probe_dir = tmp_path / "probe"
    probe_dir.mkdir()
    (probe_dir / "conftest.py").write_text((Path(__file__).parent / "conftest.py").read_text())
    (probe_dir / "test_probe.py").write_text(_CI_PROBE)
    env = dict(os.environ, CI=ci)
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", str(probe_dir)],
                         capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert outcome in out.stdout, out.stdout + out.stderr
    assert "cuda backend of grpo_advantages" in out.stdout


def _load_conftest():
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("_treadle_tests_conftest", Path(__file__).parent / "conftest.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class _Config:
    def __init__(self):
        self.lines = []

    def addinivalue_line(self, name, line):
        self.lines.append((name, line))


@pytest.mark.parametrize("ci", ["", "true"])
def test_fallback_warning_is_an_error_under_ci(monkeypatch, ci):
    """tests/conftest.py adds FALLBACK_WARNING as an error filter under CI only, and the filter
    matches the warning treadle.dispatch really gives when an op falls back to its reference."""
    monkeypatch.setenv("CI", ci)
    cfg = _Config()
    _load_conftest().pytest_configure(cfg)
    filters = [line for name, line in cfg.lines if name == "filterwarnings"]
    assert filters == ([f"error:{FALLBACK_WARNING}"] if ci else [])
    op = "test_backends_fallback_op1"
    monkeypatch.setitem(dispatch._REGISTRY, op, dispatch.OpSpec(op, ("cpp",), ("triton",)))
    monkeypatch.setattr(_extension, "has_kernel", lambda name, key: False)
    monkeypatch.setattr(dispatch, "_warned", set())
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    dispatch._choose.cache_clear()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            warnings.filterwarnings("error", message=FALLBACK_WARNING)
            with pytest.raises(UserWarning, match=f"^treadle: {op} falls back to the PyTorch reference: "):
                dispatch.resolve(op, "cpu")
    finally:
        dispatch._choose.cache_clear()
