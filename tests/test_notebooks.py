"""Executes every notebook in notebooks/ at small sizes (JAXCLIP_NB_SMALL=1)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def test_the_four_notebooks_exist():
  assert [p.name for p in NOTEBOOKS] == [
    "01_which_clip.ipynb",
    "02_exploding_gradients.ipynb",
    "03_choosing_threshold.ipynb",
    "04_flax_and_equinox.ipynb",
  ]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_is_committed_clean_and_opens_with_what_it_teaches(path):
  nb = nbformat.read(path, as_version=4)
  nbformat.validate(nb)
  first = nb.cells[0]
  assert first.cell_type == "markdown"
  assert first.source.startswith("# ") and "What this notebook teaches" in first.source
  for cell in nb.cells:
    if cell.cell_type == "code":
      assert cell.outputs == [] and cell.execution_count is None, (
        f"{path.name} is committed with outputs; clear them"
      )


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_executes(path, monkeypatch):
  # The kernel inherits this environment: small sizes and
  # the checkout on the path.
  monkeypatch.setenv("JAXCLIP_NB_SMALL", "1")
  monkeypatch.setenv(
    "PYTHONPATH",
    os.pathsep.join(
      [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    ),
  )
  nb = nbformat.read(path, as_version=4)
  start = time.perf_counter()
  client = nbclient.NotebookClient(
    nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}
  )
  client.execute()
  elapsed = time.perf_counter() - start
  errors = [
    o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"
  ]
  assert not errors
  # Every code cell ran, and the ones that draw produced an image.
  code = [c for c in nb.cells if c.cell_type == "code"]
  assert all(c.execution_count is not None for c in code)
  drawing = [c for c in code if "plt.show()" in c.source]
  for cell in drawing:
    assert any("image/png" in o.get("data", {}) for o in cell.outputs), cell.source[:60]
  assert elapsed < 60, f"{path.name} took {elapsed:.0f}s at small size"
