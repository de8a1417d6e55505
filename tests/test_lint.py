"""ruff, as CI and the pre-commit hooks run it: lint and format checks over the whole project.

The version is pinned in the test extra (pyproject.toml) and in
.pre-commit-config.yaml; the configuration is pyproject.toml's ``[tool.ruff]``.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _ruff(*args):
  return subprocess.run(
    [sys.executable, "-m", "ruff", *args, "--no-cache", "."],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=120,
    check=False,
  )


def test_ruff_is_the_pinned_version():
  test_extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
    "optional-dependencies"
  ]["test"]
  (pin,) = [r.split("==")[1] for r in test_extra if r.startswith("ruff==")]
  hooks = (ROOT / ".pre-commit-config.yaml").read_text()
  assert re.search(
    rf"repo: https://github.com/astral-sh/ruff-pre-commit\s+rev: v{re.escape(pin)}\s", hooks
  ), f".pre-commit-config.yaml does not run ruff {pin}"
  for hook in ("ruff-check", "ruff-format"):
    assert f"id: {hook}" in hooks, hook
  version = subprocess.run(
    [sys.executable, "-m", "ruff", "--version"], capture_output=True, text=True, check=True
  ).stdout.split()
  assert version == ["ruff", pin], f"installed {version}, the test extra pins ruff=={pin}"


def test_ruff_check_finds_nothing():
  done = _ruff("check", "--output-format", "concise")
  assert done.returncode == 0, done.stdout + done.stderr


def test_ruff_format_changes_nothing():
  done = _ruff("format", "--check")
  assert done.returncode == 0, done.stdout + done.stderr
