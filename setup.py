"""Build the compiled extension ``treadle._C``; the package metadata is in ``pyproject.toml``.

The Python package lives in ``python/treadle`` and the Triton kernels in ``triton_kernels`` (installed
as ``treadle.triton_kernels``, so it never clashes with other distributions' ``triton_kernels``).
``csrc/`` is built into ``treadle._C`` by CMake (Ninja generator) against the torch that is importable
at build time -- the installed one only with ``pip install --no-build-isolation .`` (as flash-attention
documents): under pip's default build isolation the build sees no torch.

Without torch, cmake, ninja or a C++ compiler at build time, the install is pure Python (one warning;
every op then runs its Triton or PyTorch-reference backend, see ``treadle.backends()``).

Environment flags:
  TREADLE_SKIP_EXTENSION=1     install the pure-Python package only
  TREADLE_REQUIRE_EXTENSION=1  fail instead of falling back to a pure-Python install
  TREADLE_CUDA=0|1|auto        CUDA kernels: never / always (fails without nvcc + CUDA torch) / when both
                               a CUDA toolkit and a CUDA build of torch are present (default: auto)
  TREADLE_CUDA_ARCHS="90"      CMAKE_CUDA_ARCHITECTURES for the CUDA build (default: "80;90")
  MAX_JOBS=N                   parallel compile jobs (default: the number of CPUs)
"""
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
_TRUE = ("1", "on", "true", "yes")


def _compiler() -> str | None:
    cxx = os.environ.get("CXX")
    if cxx:
        return shutil.which(cxx.split()[0])
    return next((shutil.which(c) for c in ("c++", "g++", "clang++") if shutil.which(c)), None)


def _tool(name: str) -> str | None:
    """Absolute path of cmake/ninja: on PATH, beside this interpreter (a venv's bin/, not necessarily on
    PATH when pip is run as .venv/bin/pip), or from the pip packages of the same name."""
    found = shutil.which(name) or shutil.which(name, path=str(Path(sys.executable).parent))
    if found is None:
        try:
            mod = __import__(name)
            found = shutil.which(name, path=str(getattr(mod, "CMAKE_BIN_DIR", getattr(mod, "BIN_DIR", ""))))
        except ImportError:
            pass
    return found


def extension_plan() -> tuple[bool, str]:
    """(build treadle._C?, why not). Cheap: nothing is imported."""
    if os.environ.get("TREADLE_SKIP_EXTENSION", "").lower() in _TRUE:
        return False, "TREADLE_SKIP_EXTENSION=1 is set"
    if importlib.util.find_spec("torch") is None:
        return False, ("torch is not importable at build time (pip's build isolation hides the installed torch; "
                       "use `pip install --no-build-isolation .`)")
    missing = [t for t in ("cmake", "ninja") if _tool(t) is None]
    if missing:
        return False, f"{' and '.join(missing)} not found (pip install cmake ninja)"
    if _compiler() is None:
        return False, "no C++ compiler found (c++, g++, clang++ or $CXX)"
    return True, ""


BUILD_EXTENSION, WHY_NOT = extension_plan()
if not BUILD_EXTENSION and os.environ.get("TREADLE_REQUIRE_EXTENSION", "").lower() in _TRUE:
    raise RuntimeError(f"TREADLE_REQUIRE_EXTENSION=1 but treadle._C cannot be built: {WHY_NOT}")


def _want_cuda() -> bool:
    flag = os.environ.get("TREADLE_CUDA", "auto").lower()
    if flag in ("0", "off", "false", "no"):
        return False
    import torch

    have = torch.version.cuda is not None and shutil.which("nvcc") is not None
    if flag in _TRUE + ("force",):
        if not have:
            raise RuntimeError(
                "TREADLE_CUDA=1 but the CUDA build is impossible: it needs nvcc on PATH "
                f"(found: {shutil.which('nvcc')}) and a CUDA build of torch (torch.version.cuda="
                f"{torch.version.cuda})"
            )
        return True
    return have


class CMakeExtension(Extension):
    def __init__(self, name: str):
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    def build_extension(self, ext: Extension) -> None:
        import torch

        out_dir = Path(self.get_ext_fullpath(ext.name)).resolve().parent
        build_dir = Path(self.build_temp).resolve() / "cmake"
        build_dir.mkdir(parents=True, exist_ok=True)
        cuda = _want_cuda()
        cmake = _tool("cmake")
        args = [
            cmake, str(ROOT), "-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={_tool('ninja')}",
            f"-DCMAKE_BUILD_TYPE={os.environ.get('TREADLE_BUILD_TYPE', 'Release')}",
            f"-DCMAKE_PREFIX_PATH={torch.utils.cmake_prefix_path}",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={out_dir}",
            f"-DTREADLE_WITH_CUDA={'ON' if cuda else 'OFF'}",
        ]
        if cuda:
            args.append(f"-DCMAKE_CUDA_ARCHITECTURES={os.environ.get('TREADLE_CUDA_ARCHS', '80;90')}")
        jobs = os.environ.get("MAX_JOBS", str(os.cpu_count() or 1))
        subprocess.check_call(args, cwd=build_dir)
        subprocess.check_call([cmake, "--build", ".", "--parallel", jobs], cwd=build_dir)


class BuildPy(build_py):
    """build_py that says, once per build, when the install will be pure Python."""

    def run(self) -> None:
        if not BUILD_EXTENSION:
            sys.stderr.write(
                f"WARNING: treadle is being installed WITHOUT its compiled extension treadle._C: {WHY_NOT}. "
                "Every op will use its Triton or PyTorch-reference backend (treadle.backends() says which). "
                "For the C++/CUDA kernels: pip install --no-build-isolation . "
                "(needs torch, cmake, ninja and a C++ compiler).\n")
        super().run()


setup(
    package_dir={"treadle": "python/treadle", "treadle.triton_kernels": "triton_kernels"},
    packages=find_packages(where="python", include=["treadle", "treadle.*"])
    + ["treadle.triton_kernels" + ("." + p if p else "") for p in [""] + find_packages(where="triton_kernels")],
    ext_modules=[CMakeExtension("treadle._C")] if BUILD_EXTENSION else [],
    cmdclass={"build_ext": CMakeBuild, "build_py": BuildPy},
    zip_safe=False,
)
