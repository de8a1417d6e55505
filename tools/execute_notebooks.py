"""Executes the notebooks at full size and stores them with their outputs.

The docs site renders ``notebooks/*.ipynb`` as committed (mkdocs-jupyter with
``execute: false``), so the outputs the reader sees are the ones stored here.
After editing a notebook, run from the repository root::

  python tools/execute_notebooks.py                  # every notebook
  python tools/execute_notebooks.py notebooks/03_choosing_threshold.ipynb

Each notebook records the SHA-256 of its code cells in
``metadata.jaxclip.source_sha256``; ``tests/test_notebooks.py`` fails when a
code cell changed after the outputs were stored, and when a notebook grows
past 200 kB: figures are stored as 128-colour palette PNGs, which look the
same and take a third of the bytes.
"""

from __future__ import annotations

import base64
import hashlib
import io
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def source_sha256(nb) -> str:
  """Hash of the code cells' sources, in order: what the stored outputs came from."""
  h = hashlib.sha256()
  for cell in nb.cells:
    if cell.cell_type == "code":
      h.update(cell.source.encode())
      h.update(b"\0")
  return h.hexdigest()


def shrink_png(data: str) -> str:
  """A base64 PNG as a 128-colour palette PNG (matplotlib's figures use few colours)."""
  from PIL import Image

  image = Image.open(io.BytesIO(base64.b64decode(data))).convert("RGB")
  out = io.BytesIO()
  image.quantize(128, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE).save(
    out, format="png", optimize=True
  )
  return base64.b64encode(out.getvalue()).decode() + "\n"


def execute(path: Path, small: bool = False):
  """Runs ``path`` top to bottom in a fresh ``python3`` kernel; returns the notebook."""
  import nbclient
  import nbformat

  env = os.environ
  saved = {k: env.get(k) for k in ("JAXCLIP_NB_SMALL", "PYTHONPATH", "MPLBACKEND")}
  env.pop("JAXCLIP_NB_SMALL", None)
  if small:
    env["JAXCLIP_NB_SMALL"] = "1"
  env["PYTHONPATH"] = os.pathsep.join(
    [str(ROOT)] + [p for p in (saved["PYTHONPATH"] or "").split(os.pathsep) if p]
  )
  env.pop("MPLBACKEND", None)
  try:
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(
      nb,
      timeout=900,
      kernel_name="python3",
      record_timing=False,
      resources={"metadata": {"path": str(path.parent)}},
    )
    client.execute()
  finally:
    for k, v in saved.items():
      if v is None:
        env.pop(k, None)
      else:
        env[k] = v
  return nb


def main(argv: list[str]) -> None:
  import nbformat

  paths = [Path(a) for a in argv] or sorted((ROOT / "notebooks").glob("*.ipynb"))
  for path in paths:
    nb = execute(path)
    for cell in nb.cells:
      for output in cell.get("outputs", []):
        if "image/png" in output.get("data", {}):
          output.data["image/png"] = shrink_png(output.data["image/png"])
    # Only what the page shows: no kernel-version noise in the metadata.
    nb.metadata = {
      "kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
      "language_info": {"name": "python"},
      "jaxclip": {"source_sha256": source_sha256(nb)},
    }
    nbformat.write(nb, path)
    print(f"{path}: {path.stat().st_size / 1000:.0f} kB")


if __name__ == "__main__":
  main(sys.argv[1:])
