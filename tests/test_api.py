"""The public API: every name exported, documented and runnable."""

from __future__ import annotations

import inspect

import jaxclip
from jaxclip import ops


def test_all_names_exist_and_are_unique():
  assert len(set(jaxclip.__all__)) == len(jaxclip.__all__)
  for name in jaxclip.__all__:
    assert hasattr(jaxclip, name), name
  for name in ops.__all__:
    assert hasattr(ops, name), name


def test_every_public_name_has_a_docstring_with_an_example():
  for module, names in ((jaxclip, jaxclip.__all__), (ops, ops.__all__)):
    for name in names:
      obj = getattr(module, name)
      doc = inspect.getdoc(obj) or ""
      assert doc.strip(), f"{name} has no docstring"
      if inspect.isfunction(obj):
        assert ">>>" in doc, f"{name} has no runnable example"
        assert "Args:" in doc or not inspect.signature(obj).parameters, name
        assert "Returns:" in doc, name


def test_every_public_name_is_in_the_readme_table():
  import pathlib

  readme = (pathlib.Path(__file__).parents[1] / "README.md").read_text()
  for name in jaxclip.__all__:
    if name != "ops":
      assert f"`{name}" in readme, f"{name} missing from README"
  for name in ops.__all__:
    assert f"`ops.{name}(" in readme, f"ops.{name} missing from README"


def test_version_and_typed_marker():
  import pathlib

  assert isinstance(jaxclip.__version__, str) and jaxclip.__version__.count(".") == 2
  assert (pathlib.Path(jaxclip.__file__).parent / "py.typed").exists()


def _jaxclip_imports(path, package_dir):
  """``(module, imported jaxclip module, at top level?)`` for each import in ``path``."""
  import ast

  tree = ast.parse(path.read_text(), filename=str(path))
  modules = {p.stem for p in package_dir.glob("*.py")}
  top_level = {id(node) for node in tree.body}
  found = []
  for node in ast.walk(tree):
    names = []
    if isinstance(node, ast.Import):
      names = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom):
      if node.level:  # relative: from . import x / from ._x import y
        names = [node.module or ""] if node.module else [a.name for a in node.names]
        names = [f"jaxclip.{n}" for n in names]
      elif node.module == "jaxclip":
        names = [f"jaxclip.{a.name}" for a in node.names]
      else:
        names = [node.module or ""]
    for name in names:
      parts = name.split(".")
      if parts[0] == "jaxclip" and len(parts) > 1 and parts[1] in modules:
        found.append((path.stem, parts[1], id(node) in top_level))
  return found


def test_import_graph_is_layered():
  """jaxclip's modules import each other at top level only, and without a cycle.

  The layers: backend workarounds (``_backends``) -> norm math
  (``_numerics``) -> collectives (``_distributed``) -> ops (``_ops``) ->
  transforms, adaptive and per-example modules. A function-level import is
  how a cycle hides, so there is none.
  """
  import pathlib

  package_dir = pathlib.Path(jaxclip.__file__).parent
  edges = [e for p in sorted(package_dir.glob("*.py")) for e in _jaxclip_imports(p, package_dir)]
  hidden = [(a, b) for a, b, top in edges if not top]
  assert not hidden, f"function-level imports of jaxclip modules: {hidden}"
  graph = {}
  for a, b, _ in edges:
    graph.setdefault(a, set()).add(b)

  def visit(node, stack):
    assert node not in stack, f"import cycle: {' -> '.join([*stack, node])}"
    for nxt in sorted(graph.get(node, ())):
      visit(nxt, [*stack, node])

  for node in sorted(graph):
    visit(node, [])
  assert not graph.get("_backends"), graph.get("_backends")
  assert graph["_numerics"] == {"_backends"}
  assert graph["_distributed"] == {"_numerics"}
  assert "_distributed" in graph["_ops"]
