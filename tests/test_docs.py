"""Builds the documentation site strictly and checks every public name is in it."""

from __future__ import annotations

import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import jaxclip

pytest.importorskip("mkdocs")
pytest.importorskip("mkdocstrings")
pytest.importorskip("mkdocs_jupyter")

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def site(tmp_path_factory):
  out = tmp_path_factory.mktemp("site")
  env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
  result = subprocess.run(
    [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert result.returncode == 0, result.stdout + result.stderr
  return out


def public_names():
  names = [f"jaxclip.{n}" for n in jaxclip.__all__ if n != "ops"]
  return names + [f"jaxclip.ops.{n}" for n in jaxclip.ops.__all__]


def test_every_public_name_has_an_entry_on_the_api_page(site):
  page = (site / "api" / "index.html").read_text()
  missing = [name for name in public_names() if f'id="{name}"' not in page]
  assert not missing, f"not on the API page: {missing}"


def test_api_page_renders_the_docstrings(site):
  page = (site / "api" / "index.html").read_text()
  # reST leftovers are converted: roles, math blocks, links.
  assert ":func:" not in page and ".. math::" not in page
  assert '<a href="https://arxiv.org/abs/1211.5063">' in page
  # An example from a docstring made it onto the page.
  assert "pre_clip_norm" in page


def test_notebooks_are_rendered_with_their_stored_outputs(site):
  for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
    page = site / "notebooks" / path.stem / "index.html"
    assert page.exists(), path.name
    text = page.read_text()
    assert "What this notebook teaches" in text
    assert 'class="jp-InputArea' in text  # the code cells are on the page
    # and their outputs, figures included, as committed (the build executes nothing)
    assert re.search(r'class="[^"]*\bjp-OutputArea-output\b', text), path.name
    assert re.search(r'<img[^>]+src="data:image/png;base64,', text), f"{path.name}: no figure"


def test_every_image_the_readme_shows_is_committed():
  readme = (ROOT / "README.md").read_text()
  targets = re.findall(r"!\[[^\]]*\]\(([^)\s]+)", readme) + re.findall(
    r'<img[^>]+src="([^"]+)"', readme
  )
  assert "docs/images/exploding_gradients.png" in targets  # the main job's figure
  for target in targets:
    assert not re.match(r"[a-z]+:", target), f"{target}: link a file in the repository"
    assert (ROOT / target).is_file(), f"README.md shows {target}, which is not committed"


def test_every_public_function_has_a_doctest_example():
  """Their examples run under ``pytest --doctest-modules jaxclip``."""
  without = []
  for name in public_names():
    obj = eval(name, {"jaxclip": jaxclip})  # noqa: S307 - names from __all__
    if inspect.isfunction(obj) and ">>>" not in (inspect.getdoc(obj) or ""):
      without.append(name)
  assert not without, f"public functions without an Examples: doctest: {without}"
