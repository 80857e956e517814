"""Build and install treadle.

The Python package lives in ``python/treadle`` and the Triton kernels in ``triton_kernels`` (installed
as ``treadle.triton_kernels``, so it never clashes with other distributions' ``triton_kernels``).
``csrc/`` is built into the extension module ``treadle._C`` by CMake (Ninja generator).

Environment flags:
  TREADLE_SKIP_EXTENSION=1   install the pure-Python package only (every op then uses its reference)
  TREADLE_CUDA=0|1|auto      CUDA kernels: never / always (fails without nvcc + CUDA torch) / when both
                             a CUDA toolkit and a CUDA build of torch are present (default: auto)
  TREADLE_CUDA_ARCHS="90"    CMAKE_CUDA_ARCHITECTURES for the CUDA build (default: "80;90")
  MAX_JOBS=N                 parallel compile jobs (default: the number of CPUs)

torch must be importable at build time: install with ``pip install --no-build-isolation``.
"""
import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


def _version() -> str:
    ns: dict = {}
    exec((ROOT / "python" / "treadle" / "_version.py").read_text(), ns)
    return ns["__version__"]


def _want_cuda() -> bool:
    flag = os.environ.get("TREADLE_CUDA", "auto").lower()
    if flag in ("0", "off", "false", "no"):
        return False
    import torch

    have = torch.version.cuda is not None and shutil.which("nvcc") is not None
    if flag in ("1", "on", "true", "yes", "force"):
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
        args = [
            "cmake", str(ROOT), "-G", "Ninja",
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
        subprocess.check_call(["cmake", "--build", ".", "--parallel", jobs], cwd=build_dir)


ext_modules = [] if os.environ.get("TREADLE_SKIP_EXTENSION") == "1" else [CMakeExtension("treadle._C")]

setup(
    name="treadle",
    version=_version(),
    description="Fused kernels and training-side machinery for LLM post-training",
    python_requires=">=3.10",
    package_dir={"treadle": "python/treadle", "treadle.triton_kernels": "triton_kernels"},
    packages=["treadle", "treadle.triton_kernels"]
    + [
        "treadle." + str(p.relative_to(ROOT / "python" / "treadle")).replace(os.sep, ".")
        for p in sorted((ROOT / "python" / "treadle").rglob("*"))
        if p.is_dir() and (p / "__init__.py").exists()
    ],
    ext_modules=ext_modules,
    cmdclass={"build_ext": CMakeBuild},
    install_requires=[
        "torch>=2.11,<2.15",
        "numpy",
        "typer>=0.12",
        "rich>=13",
        "tqdm",
    ],
    extras_require={
        "triton": ["triton>=3.6,<3.10"],
        "test": ["pytest>=8", "pytest-benchmark>=4", "hypothesis>=6", "triton>=3.6,<3.10"],
        "adapters": ["trl>=0.20", "transformers>=4.57"],
    },
    entry_points={"console_scripts": ["treadle=treadle.cli:main"]},
    zip_safe=False,
)
