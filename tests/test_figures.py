"""Every committed figure is no older than the code and data that drew it.

A script saving a figure writes ``<figure>.json`` beside it (``tools/figure_record.py``):
the SHA-256 of its generating inputs (the scripts that compute and draw it and the data
file it plots; not ``jaxclip/``) and of the figure, and the commit it was made at.
CONTRIBUTING.md's figure table says how to regenerate each one.
"""

from __future__ import annotations

import json
from pathlib import Path

from tools.figure_record import ROOT, record_path, sha256, stale, write_record


def committed_figures() -> list[Path]:
  return sorted([*(ROOT / "docs").rglob("*.png"), *(ROOT / "benchmarks" / "results").glob("*.png")])


def test_every_committed_figure_is_no_older_than_its_inputs():
  figures = committed_figures()
  names = {f.relative_to(ROOT).as_posix() for f in figures}
  assert "docs/images/exploding_gradients.png" in names  # the README's figure
  out_of_date = []
  for figure in figures:
    name = figure.relative_to(ROOT).as_posix()
    problems = stale(figure)
    if problems:
      path = record_path(figure)
      command = (
        json.loads(path.read_text())["command"]
        if path.is_file()
        else "the command in CONTRIBUTING.md's figure table"
      )
      out_of_date.append(f"{name}: {'; '.join(problems)}; regenerate it with `{command}`")
  assert not out_of_date, "\n".join(out_of_date)


def test_a_record_notices_a_changed_input_and_a_changed_figure(tmp_path):
  script, data, figure = tmp_path / "plot.py", tmp_path / "data.json", tmp_path / "fig.png"
  script.write_text("print('draw')\n")
  data.write_text("[1, 2]\n")
  figure.write_bytes(b"\x89PNG one")
  path = write_record(figure, [script, data], "python plot.py")
  record = json.loads(path.read_text())
  assert path == tmp_path / "fig.png.json"
  assert record["command"] == "python plot.py"
  assert record["inputs"] == {str(data): sha256(data), str(script): sha256(script)}
  assert len(record["commit"]) == 40 or record["commit"] == "unknown"
  assert stale(figure) == []

  data.write_text("[1, 3]\n")
  assert stale(figure) == [f"input {data} changed after the figure was made"]
  write_record(figure, [script, data], "python plot.py")
  figure.write_bytes(b"\x89PNG two")
  assert stale(figure) == ["the figure changed after its record was written"]
  script.unlink()
  assert f"input {script} is gone" in stale(figure)
  path.unlink()
  assert stale(figure) == [f"no record {path}"]
