"""The package users install: the sdist and the wheel, installed outside the repository.

The rest of the suite imports jaxclip from the checkout (an editable install),
so a module the wheel leaves out would go unnoticed there. Here the sdist is
built from a copy of the checkout and the wheel from the sdist (as
``python -m build`` does, offline: no build isolation), once for the module.
The wheel is installed into a fresh virtual environment outside the
repository; the dependencies come from the running environment through a
``.pth`` file (paths only, so its editable jaxclip cannot come with them), and
the checks run there, from a folder outside the repository.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tomllib
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement

import jaxclip

ROOT = Path(__file__).resolve().parents[1]
# What a checkout holds besides the sources (.gitignore): build outputs, caches, venvs (and
# every .venv-* folder: .ci/run's legs make .venv-newest and .venv-py3.12 beside .venv).
_OUTPUTS = {
  ROOT: {
    ".git",
    ".venv",
    "venv",
    "build",
    "dist",
    "site",
    ".pytest_cache",
    ".hypothesis",
  },
  ROOT / "examples": {"output"},
}
_CACHES = shutil.ignore_patterns("__pycache__", "*.egg-info", ".ipynb_checkpoints", ".ruff_cache")


def _not_sources(folder, names):
  venvs = {n for n in names if n.startswith(".venv-")} if Path(folder) == ROOT else set()
  return set(_CACHES(folder, names)) | (_OUTPUTS.get(Path(folder), set()) & set(names)) | venvs


def _run(cmd, **kwargs):
  done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False, **kwargs)
  command = " ".join(map(str, cmd))
  assert done.returncode == 0, f"{command}\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
  return done.stdout


def _source_files():
  """The package's files in the checkout, relative to the repository root."""
  files = {
    p.relative_to(ROOT).as_posix()
    for p in (ROOT / "jaxclip").rglob("*.py")
    if "__pycache__" not in p.parts
  }
  return files | {"jaxclip/py.typed"}


def _module_names():
  names = set()
  for path in _source_files():
    if path.endswith(".py"):
      parts = path[: -len(".py")].split("/")
      names.add(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
  return names


def readme_quick_example() -> str:
  readme = (ROOT / "README.md").read_text()
  found = re.search(
    r"^#+ Quick example\s*$.*?^```python\n(.*?)^```",
    readme,
    re.MULTILINE | re.DOTALL | re.IGNORECASE,
  )
  assert found, "README.md has no ```python block under a 'Quick example' heading"
  return found.group(1)


@pytest.fixture(scope="module")
def dists(tmp_path_factory):
  """``(sdist, wheel)`` paths, built once from a copy of the checkout."""
  tmp = tmp_path_factory.mktemp("dists")
  src = tmp / "src"
  shutil.copytree(ROOT, src, ignore=_not_sources)
  out = tmp / "dist"
  # Without isolation nothing is downloaded: the build backend (setuptools>=77)
  # and build come from the test extra (`pip install -e ".[test]"`).
  requires = tomllib.loads((ROOT / "pyproject.toml").read_text())["build-system"]["requires"]
  for req in map(Requirement, [*requires, "build"]):
    try:
      have = importlib.metadata.version(req.name)
    except importlib.metadata.PackageNotFoundError:
      have = None
    assert have is not None and req.specifier.contains(have, prereleases=True), (
      f"building offline needs {req} (have {have}): pip install -e '.[test]'"
    )
  _run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(src)])
  (sdist,) = out.glob("jaxclip-*.tar.gz")
  (wheel,) = out.glob("jaxclip-*.whl")
  return sdist, wheel


def test_sdist_and_wheel_ship_every_module_the_license_and_py_typed(dists):
  sdist, wheel = dists
  version = jaxclip.__version__
  assert wheel.name == f"jaxclip-{version}-py3-none-any.whl"
  source = _source_files()
  license_text = (ROOT / "LICENSE").read_text()
  assert "Apache License" in license_text and "Version 2.0, January 2004" in license_text

  with zipfile.ZipFile(wheel) as whl:
    names = set(whl.namelist())
    info = f"jaxclip-{version}.dist-info"
    assert not source - names, f"left out of the wheel: {sorted(source - names)}"
    shipped = {n for n in names if not n.startswith(info + "/")}
    assert shipped == source, f"in the wheel, not in jaxclip/: {sorted(shipped - source)}"
    assert whl.read(f"{info}/licenses/LICENSE").decode() == license_text
    metadata = whl.read(f"{info}/METADATA").decode()
  assert "License-Expression: Apache-2.0" in metadata
  assert "License-File: LICENSE" in metadata
  assert f"Version: {version}" in metadata

  with tarfile.open(sdist) as tar:
    top = f"jaxclip-{version}/"
    names = {n[len(top) :] for n in tar.getnames() if n.startswith(top)}
    assert not source - names, f"left out of the sdist: {sorted(source - names)}"
    assert {"LICENSE", "README.md", "pyproject.toml"} <= names
    assert tar.extractfile(top + "LICENSE").read().decode() == license_text


_CHECK = """
import contextlib, importlib, importlib.metadata, io, json, pkgutil, sys
import jaxclip
missing = [n for n in jaxclip.__all__ if not hasattr(jaxclip, n)]
missing += ["ops." + n for n in jaxclip.ops.__all__ if not hasattr(jaxclip.ops, n)]
modules = ["jaxclip"] + [m.name for m in pkgutil.walk_packages(jaxclip.__path__, "jaxclip.")]
for name in modules:
  importlib.import_module(name)
example = open(sys.argv[1]).read()
printed = io.StringIO()
with contextlib.redirect_stdout(printed):
  exec(compile(example, "README.md (quick example)", "exec"), {"__name__": "__main__"})
dist = importlib.metadata.distribution("jaxclip")
print(json.dumps({
    "prefix": sys.prefix, "file": jaxclip.__file__, "version": jaxclip.__version__,
    "dist_version": dist.version, "dist_path": str(dist.locate_file("jaxclip/__init__.py")),
    "counts": [len(jaxclip.__all__), len(jaxclip.ops.__all__)], "missing": missing,
    "modules": modules, "example": printed.getvalue()}))
"""


def test_the_installed_wheel_imports_every_public_name_and_runs_the_quick_example(dists, tmp_path):
  _, wheel = dists
  venv = tmp_path / "venv"
  _run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
  python = venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
  env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
  env["PIP_ROOT_USER_ACTION"] = "ignore"
  _run(
    [
      sys.executable,
      "-m",
      "pip",
      "--python",
      str(python),
      "install",
      "--no-deps",
      "--no-index",
      "--disable-pip-version-check",
      "--quiet",
      str(wheel),
    ],
    env=env,
  )
  site = Path(
    _run(
      [str(python), "-I", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]
    ).strip()
  )
  # The running environment's packages, as plain paths after the venv's own
  # site-packages: a .pth line that is a path adds that folder and runs none of
  # the .pth files in it (the editable install's finder among them). Source
  # checkouts (this one) are left out, not a .venv inside it (CI's); the
  # asserts below check where jaxclip came from.
  deps = [
    p
    for p in map(Path, sys.path)
    if p.is_absolute() and p.is_dir() and not (p / "pyproject.toml").exists()
  ]
  (site / "_jaxclip_test_deps.pth").write_text("".join(f"{p}\n" for p in deps))

  work = tmp_path / "work"  # the checks run here, outside the repository
  work.mkdir()
  (work / "check.py").write_text(_CHECK)
  example = readme_quick_example()
  (work / "example.py").write_text(example)
  result = json.loads(_run([str(python), "-I", "check.py", "example.py"], cwd=work, env=env))

  assert Path(result["prefix"]).resolve() == venv.resolve()
  installed = Path(result["file"]).resolve()
  assert installed.is_relative_to(venv.resolve()), f"jaxclip imported from {installed}"
  assert Path(result["dist_path"]).resolve() == installed
  assert result["version"] == result["dist_version"] == jaxclip.__version__
  assert result["missing"] == [], f"not importable from the wheel: {result['missing']}"
  assert result["counts"] == [len(jaxclip.__all__), len(jaxclip.ops.__all__)]
  assert set(result["modules"]) == _module_names()

  # The quick example prints the same from the wheel as from the checkout.
  printed = io.StringIO()
  with contextlib.redirect_stdout(printed):
    exec(compile(example, "README.md (quick example)", "exec"), {"__name__": "__main__"})
  assert result["example"] == printed.getvalue()
  assert float(result["example"]) > 1.0  # the pre-clip norm of a gradient it clips


def test_the_changelog_has_a_section_for_this_version():
  """Sections newest first; none above ``jaxclip.__version__``'s is released (dated)."""
  sections = re.findall(
    r"^## \[(\d+)\.(\d+)\.(\d+)\] - (Unreleased|\d{4}-\d{2}-\d{2})$",
    (ROOT / "CHANGELOG.md").read_text(),
    re.MULTILINE,
  )
  versions = [tuple(map(int, s[:3])) for s in sections]
  assert versions == sorted(versions, reverse=True) and len(set(versions)) == len(versions)
  current = tuple(map(int, jaxclip.__version__.split(".")))
  assert current in versions, f"CHANGELOG.md has no section for {jaxclip.__version__}"
  newer = [s for s in sections[: versions.index(current)] if s[3] != "Unreleased"]
  assert not newer, f"released after {jaxclip.__version__}: {newer}"
