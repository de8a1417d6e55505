"""Provenance records of the committed figures: what drew each one.

A script that saves a figure calls :func:`write_record` beside it, which writes
``<figure>.json``: the command that made it, the SHA-256 of its *generating
inputs* (the script files whose code computes and draws it, and the data file
it is drawn from, if any) and of the figure itself, and the commit checked out
when it was made. ``tests/test_figures.py`` recomputes the hashes and fails,
naming the figure and its command, when an input changed after the figure was
saved. The package (``jaxclip/``) is not an input: a refactor that keeps the
library's behaviour would otherwise stale every figure, and the tests hold the
behaviour.

Scripts run from the repository root (``python examples/x.py``,
``python -m benchmarks.x``); an example imports this module after putting the
repository root on ``sys.path``.
"""

from __future__ import annotations

import hashlib
import io
import json
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def sha256(path: str | Path) -> str:
  return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def save_png(fig, out: str | Path, dpi: int = 100) -> None:
  """Saves a matplotlib figure as a 128-colour palette PNG, a third of the bytes of RGBA.

  Matplotlib's figures use few colours, so they look the same (the notebooks' figures are
  stored the same way, by ``tools/execute_notebooks.py``).

  Args:
    fig: a ``matplotlib.figure.Figure``.
    out: the PNG to write.
    dpi: its resolution.
  """
  from PIL import Image

  buffer = io.BytesIO()
  fig.savefig(buffer, format="png", dpi=dpi)
  image = Image.open(buffer).convert("RGB")
  palette = image.quantize(128, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE)
  palette.save(out, format="png", optimize=True)


def record_path(figure: str | Path) -> Path:
  """Where the record of ``figure`` lives: ``<figure>.json`` beside it."""
  figure = Path(figure)
  return figure.with_name(figure.name + ".json")


def _relative(path: str | Path) -> str:
  """``path`` relative to the repository root (as given if outside it)."""
  path = Path(path).resolve()
  return path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(path)


def commit() -> str:
  """The commit checked out (``git rev-parse HEAD``), or ``"unknown"`` outside git."""
  try:
    done = subprocess.run(
      ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=30
    )
  except (OSError, subprocess.SubprocessError):
    return "unknown"
  return done.stdout.strip() if done.returncode == 0 and done.stdout.strip() else "unknown"


def write_record(figure: str | Path, inputs: Iterable[str | Path], command: str) -> Path:
  """Writes ``<figure>.json`` for a figure just saved; returns its path.

  Args:
    figure: the saved figure.
    inputs: its generating inputs: script files and the data file it plots.
    command: the command that regenerates it, from the repository root.

  Returns:
    The path of the record.
  """
  figure = Path(figure)
  record = {
    "figure": _relative(figure),
    "command": command,
    "figure_sha256": sha256(figure),
    "inputs": {_relative(p): sha256(p) for p in sorted(map(Path, inputs))},
    "commit": commit(),
  }
  path = record_path(figure)
  path.write_text(json.dumps(record, indent=1) + "\n")
  return path


def stale(figure: str | Path) -> list[str]:
  """What no longer matches ``figure``'s record: empty when the figure is current.

  Args:
    figure: a figure inside the repository, with its record beside it.

  Returns:
    One line per problem: no record, the figure changed without its record,
    or an input changed, was removed or is missing.
  """
  figure = Path(figure)
  path = record_path(figure)
  if not path.is_file():
    return [f"no record {_relative(path)}"]
  record = json.loads(path.read_text())
  problems = []
  if record.get("figure") != _relative(figure):
    problems.append(f"the record names {record.get('figure')!r}")
  if record.get("figure_sha256") != sha256(figure):
    problems.append("the figure changed after its record was written")
  if not record.get("inputs"):
    problems.append("the record lists no inputs")
  for name, digest in sorted(record.get("inputs", {}).items()):
    source = ROOT / name
    if not source.is_file():
      problems.append(f"input {name} is gone")
    elif sha256(source) != digest:
      problems.append(f"input {name} changed after the figure was made")
  return problems


def package_sources(package: str) -> list[Path]:
  """The files of ``package``'s modules imported so far: a benchmark's generating scripts.

  Args:
    package: a package name, such as ``"benchmarks"``.

  Returns:
    The source files of ``package`` and of its imported submodules, sorted.
  """
  modules = [m for n, m in sys.modules.items() if n == package or n.startswith(package + ".")]
  return sorted({Path(m.__file__).resolve() for m in modules if getattr(m, "__file__", None)})
