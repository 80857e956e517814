"""Installing treadle like any training library: sdist -> wheel -> fresh venv that reuses the CPU torch.

The slow tests build from a clean copy of the source tree (no .venv, build/ or in-tree _C*.so), the way
`python -m build` does (sdist first, the wheel from the unpacked sdist), install the wheel into a new venv
whose only view of torch and the other dependencies is a .pth line pointing at this interpreter's
site-packages, and run tests/install/check_installed.py there: every public module imports, declared
dependencies are satisfied, one op per CPU backend agrees with the reference, `treadle --help` works.
"""
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHECK = Path(__file__).with_name("check_installed.py")
VERSION = {}
exec((ROOT / "python" / "treadle" / "_version.py").read_text(), VERSION)  # noqa: S102 - our own file
WARNING = "WARNING: treadle is being installed WITHOUT its compiled extension treadle._C"
_IGNORE = shutil.ignore_patterns(".git", ".venv", "build", "dist", "*.so", "__pycache__", "*.egg-info", "runs",
                                 ".pytest_cache", ".hypothesis", ".benchmarks", ".gl", ".whl")


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TREADLE_SKIP_EXTENSION")}
    env.update(PYTHONNOUSERSITE="1", MAX_JOBS=os.environ.get("MAX_JOBS", "2"), **extra)
    return env


# commands run from an empty folder: a checkout's own `build/` folder (setuptools', `make mutate`'s) would
# otherwise shadow the `build` package for `python -m build`
_NEUTRAL_CWD = Path(tempfile.mkdtemp(prefix="treadle-install-cwd-"))


def _run(cmd, cwd=None, env=None, timeout=1800) -> subprocess.CompletedProcess:
    res = subprocess.run([str(c) for c in cmd], cwd=cwd or _NEUTRAL_CWD, env=env or _env(), capture_output=True, text=True,
                         timeout=timeout)
    assert res.returncode == 0, f"{cmd} failed ({res.returncode}):\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    return res


def _source_copy(dest: Path) -> Path:
    shutil.copytree(ROOT, dest, ignore=_IGNORE)
    return dest


def _fresh_venv(path: Path) -> Path:
    """A new venv without pip whose site-packages reaches this interpreter's packages (torch...) via a .pth."""
    _run([sys.executable, "-m", "venv", "--without-pip", path])
    py = path / "bin" / "python"
    purelib = Path(_run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip())
    (purelib / "_treadle_test_base.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return py


def _install_and_check(tmp: Path, wheel: Path, mode: str) -> dict:
    py = _fresh_venv(tmp / "venv")
    # pip of this interpreter installs into the new venv; --ignore-installed: the .pth makes the developer's
    # own (editable) treadle visible, which must be neither reused nor uninstalled
    _run([sys.executable, "-m", "pip", "--python", py, "install", "--no-deps", "--no-index", "--ignore-installed",
          "--no-warn-script-location", wheel])
    res = subprocess.run([str(py), str(CHECK), mode, VERSION["__version__"]], cwd=tmp,
                         env=_env(TRITON_INTERPRET="1"), capture_output=True, text=True, timeout=1200)
    report = json.loads(res.stdout.strip().splitlines()[-1]) if res.stdout.strip() else {}
    assert res.returncode == 0 and report.get("failures") == [], f"{report}\n{res.stderr[-3000:]}"
    return report


@pytest.mark.slow
def test_sdist_wheel_and_install_with_extension(tmp_path):
    src = _source_copy(tmp_path / "src")
    dist = tmp_path / "dist"
    # `python -m build`: the sdist, then the wheel from the unpacked sdist; --no-isolation builds against
    # the installed torch (the documented way for the C++ extension)
    res = _run([sys.executable, "-m", "build", "--no-isolation", "--outdir", dist, src],
               env=_env(TREADLE_REQUIRE_EXTENSION="1"))
    assert WARNING not in res.stdout + res.stderr
    (sdist,) = dist.glob("treadle-*.tar.gz")
    (wheel,) = dist.glob("treadle-*.whl")
    names = tarfile.open(sdist).getnames()
    top = f"treadle-{VERSION['__version__']}"
    for need in ("CMakeLists.txt", "LICENSE", "pyproject.toml", "setup.py", "csrc/module.cpp",
                 "triton_kernels/__init__.py", "python/treadle/__init__.py"):
        assert f"{top}/{need}" in names, need
    assert not any(n.endswith(".so") for n in names)
    inside = zipfile.ZipFile(wheel).namelist()
    assert any(n.startswith("treadle/_C") and n.endswith(".so") for n in inside)
    assert "treadle/triton_kernels/grpo.py" in inside and "treadle/weft/envs/bfcl.py" in inside
    assert any(n.endswith("licenses/LICENSE") for n in inside)
    assert not wheel.name.endswith("-none-any.whl")
    report = _install_and_check(tmp_path, wheel, "with-extension")
    assert report["backends_ran"] == {"reference": True, "cpp": True, "triton": True}
    assert report["extension"] is True


@pytest.mark.slow
def test_plain_pip_install_without_torch_at_build_time_is_pure_python(tmp_path):
    """`pip install .` with pip's default build isolation: the build sees no torch, so the result is a
    pure-Python wheel, and the build says so in one warning."""
    src = _source_copy(tmp_path / "src")
    out = tmp_path / "wheels"
    res = _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-v", "--wheel-dir", out, src])
    log = res.stdout + res.stderr
    assert log.count(WARNING) == 1, log[-3000:]
    assert "torch is not importable at build time" in log
    (wheel,) = out.glob("treadle-*.whl")
    assert wheel.name.endswith("-py3-none-any.whl")
    assert not any("_C" in n and n.endswith(".so") for n in zipfile.ZipFile(wheel).namelist())
    report = _install_and_check(tmp_path, wheel, "pure")
    assert report["backends_ran"] == {"reference": True, "cpp": False, "triton": True}


def test_no_compiler_falls_back_with_one_warning(tmp_path):
    """No C++ compiler at build time: the package still builds (pure Python) and says why, once."""
    res = _run([sys.executable, str(ROOT / "setup.py"), "-q", "build_py", "--build-lib", tmp_path / "lib"], cwd=ROOT,
               env=_env(CXX="no-such-compiler-xyz"))
    assert res.stderr.count(WARNING) == 1 and "no C++ compiler found" in res.stderr
    assert (tmp_path / "lib" / "treadle" / "triton_kernels" / "grpo.py").exists()
    assert (tmp_path / "lib" / "treadle" / "weft" / "envs" / "bfcl.py").exists()


def test_require_extension_refuses_a_pure_python_build():
    res = subprocess.run([sys.executable, str(ROOT / "setup.py"), "--version"], cwd=ROOT, capture_output=True,
                         text=True, env=_env(TREADLE_SKIP_EXTENSION="1", TREADLE_REQUIRE_EXTENSION="1"), timeout=300)
    assert res.returncode != 0
    assert "TREADLE_REQUIRE_EXTENSION=1 but treadle._C cannot be built: TREADLE_SKIP_EXTENSION=1 is set" in res.stderr


def test_version_is_read_without_executing_code():
    """pyproject's dynamic version is the attr of _version.py (setuptools reads it statically)."""
    text = (ROOT / "pyproject.toml").read_text()
    assert 'version = { attr = "treadle._version.__version__" }' in text
    assert "exec(" not in (ROOT / "setup.py").read_text()
