"""Builds the documentation site strictly and checks every public name is in it."""

from __future__ import annotations

import inspect
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import jaxclip
from tests.helpers import device_env

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
  names = [f"jaxclip.{n}" for n in jaxclip.__all__ if n not in ("ops", "platform")]
  names += [f"jaxclip.platform.{n}" for n in jaxclip.platform.__all__]
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


def test_every_link_in_the_readme_resolves():
  """Files it links are committed; its ``#anchors`` are headings of the README (GitHub's slugs)."""
  readme = (ROOT / "README.md").read_text()
  code_free = re.sub(r"^```.*?^```", "", readme, flags=re.MULTILINE | re.DOTALL)
  slugs = {
    re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
    for heading in re.findall(r"^#+ (.+)$", code_free, re.MULTILINE)
  }
  links = re.findall(r"\]\(([^)\s]+)\)", code_free)
  assert any(link.startswith("docs/") for link in links)
  for link in links:
    if re.match(r"[a-z]+:", link):
      continue
    path, _, anchor = link.partition("#")
    if path:
      assert (ROOT / path).is_file(), f"README.md links {link}, which is not committed"
    else:
      assert anchor in slugs, f"README.md links #{anchor}, which is no heading of it"


def test_every_public_function_has_a_doctest_example():
  """Their examples run under ``pytest --doctest-modules jaxclip``."""
  without = []
  for name in public_names():
    obj = eval(name, {"jaxclip": jaxclip})  # noqa: S307 - names from __all__
    if inspect.isfunction(obj) and ">>>" not in (inspect.getdoc(obj) or ""):
      without.append(name)
  assert not without, f"public functions without an Examples: doctest: {without}"


# Runs the README's Python blocks in order in one namespace, as a reader pasting them would,
# and prints what each block printed, as a JSON list.
_RUN_BLOCKS = """
import contextlib, io, json, sys
namespace, printed = {"__name__": "__main__"}, []
for i, block in enumerate(json.load(open(sys.argv[1]))):
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    exec(compile(block, f"README.md, python block {i + 1}", "exec"), namespace)
  printed.append(out.getvalue())
print(json.dumps(printed))
"""


def test_every_python_block_in_the_readme_runs_and_prints_what_it_says(tmp_path):
  readme = (ROOT / "README.md").read_text()
  blocks = re.findall(r"^```python\n(.*?)^```", readme, re.MULTILINE | re.DOTALL)
  recipes = {
    "chain": "jaxclip.skip_nonfinite(optax.chain(",
    "nnx": "nnx.Optimizer(",
    "equinox": "eqx.filter_jit",
    "multisteps": "jaxclip.skip_bad_microbatches()",
    "schedule": "optax.inject_hyperparams(jaxclip.clip_by_global_norm)",
    "dp": "jaxclip.DPSGD(",
    "sharded": "AxisType.Explicit",
  }
  where = {name: [i for i, b in enumerate(blocks) if code in b] for name, code in recipes.items()}
  assert all(len(found) == 1 for found in where.values()), where
  (tmp_path / "blocks.json").write_text(json.dumps(blocks))
  (tmp_path / "run.py").write_text(_RUN_BLOCKS)
  done = subprocess.run(
    [sys.executable, "run.py", "blocks.json"],
    cwd=tmp_path,  # outside the repository: jaxclip comes from PYTHONPATH
    env=device_env(8),  # the sharded recipe runs on 8 devices
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert done.returncode == 0, done.stderr[-4000:]
  printed = json.loads(done.stdout.splitlines()[-1])
  out = {name: printed[found[0]] for name, found in where.items()}
  assert float(printed[0]) > 1.0  # the quick example's pre-clip norm: it clipped
  assert out["chain"].split()[-1] == "0"  # no step skipped
  assert out["multisteps"].split()[0] == "2"  # the NaN microbatch did not count
  # linear_schedule(5, 1, 1000) at the last of three steps (count 2): 5 - 4 * 2 / 1000
  assert abs(float(out["schedule"]) - 4.992) < 1e-5
  assert "('data', None)" in out["sharded"]  # the update keeps the parameter's sharding
  sigma, eps = map(float, out["dp"].split())  # the noise for epsilon = 1, one step's epsilon
  assert sigma > 1.0 and 0.0 < eps < 0.2
