"""The public API: every name exported, documented and runnable."""

from __future__ import annotations

import inspect

import jaxclip
from jaxclip import ops, platform
from tests import helpers


def test_all_names_exist_and_are_unique():
  assert len(set(jaxclip.__all__)) == len(jaxclip.__all__)
  for name in jaxclip.__all__:
    assert hasattr(jaxclip, name), name
  for module in (ops, platform):
    for name in module.__all__:
      assert hasattr(module, name), name


def test_every_public_name_has_a_docstring_with_an_example():
  for module in (jaxclip, ops, platform):
    for name in module.__all__:
      obj = getattr(module, name)
      doc = inspect.getdoc(obj) or ""
      if not callable(obj) and not inspect.ismodule(obj):  # a constant: in its module's docstring
        doc = f"{name}" if f":data:`{name}`" in (inspect.getdoc(module) or "") else ""
      assert doc.strip(), f"{name} has no docstring"
      if inspect.isfunction(obj):
        assert ">>>" in doc, f"{name} has no runnable example"
        assert "Args:" in doc or not inspect.signature(obj).parameters, name
        assert "Returns:" in doc, name


def test_every_public_name_is_in_the_readme_table():
  import pathlib

  readme = (pathlib.Path(__file__).parents[1] / "README.md").read_text()
  for name in jaxclip.__all__:
    if name not in ("ops", "platform"):
      assert f"`{name}" in readme, f"{name} missing from README"
  for name in ops.__all__:
    assert f"`ops.{name}(" in readme, f"ops.{name} missing from README"
  for name in platform.__all__:
    assert f"`jaxclip.platform.{name}" in readme, f"platform.{name} missing from README"


def test_version_and_typed_marker():
  import pathlib

  assert isinstance(jaxclip.__version__, str) and jaxclip.__version__.count(".") == 2
  assert (pathlib.Path(jaxclip.__file__).parent / "py.typed").exists()


def _jaxclip_imports(path, package_dir):
  """``(module, imported module, at top level?)`` for each jaxclip import in ``path``.

  Modules are named relative to the package: ``"ops"``, ``"_kernel._numerics"``,
  ``"transforms"`` (a subpackage's ``__init__``).
  """
  import ast

  tree = ast.parse(path.read_text(), filename=str(path))
  top_level = {id(node) for node in tree.body}
  found = []
  for node in ast.walk(tree):
    names = []
    if isinstance(node, ast.Import):
      names = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom):
      assert not node.level, f"{path}: relative import"
      if node.module == "jaxclip" or (node.module or "").split(".")[-1] in _SUBPACKAGES:
        names = [f"{node.module}.{a.name}" for a in node.names]
      else:
        names = [node.module or ""]
    for name in names:
      parts = name.split(".")
      if parts[0] == "jaxclip" and len(parts) > 1:
        found.append((_module_name(path, package_dir), ".".join(parts[1:]), id(node) in top_level))
  return found


_SUBPACKAGES = ("_kernel", "transforms", "skipping", "privacy", "_ghost", "_jaxpr", "_rules")
# The layers, from the norm kernel up; imports run downward only.
_RANK = {"_kernel": 0, "ops": 1, "platform": 1, "transforms": 2, "skipping": 3, "privacy": 3, "": 4}


def _module_name(path, package_dir):
  rel = path.relative_to(package_dir).with_suffix("")
  parts = [p for p in rel.parts if p != "__init__"]
  return ".".join(parts)


def _layer(module):
  return module.split(".")[0] if module.split(".")[0] in _RANK else ""


def test_import_graph_is_layered():
  """jaxclip's modules import each other at top level only, downward, without a cycle.

  The layers: the norm kernel (``_kernel``: the type aliases of ``_typing`` and the symbolic
  shapes of ``_shapes``, which import nothing of jaxclip -> ``_validation`` and ``_sharding``
  -> the ``_platform`` folder -> the ``_numerics`` folder -> ``_reduction``) -> ``ops``
  (TensorFlow's family) -> ``transforms`` -> ``skipping`` and ``privacy``, which do not import
  each other -> the package's ``__init__``. A function-level import is how a cycle hides, so
  there is none.
  """
  import pathlib

  package_dir = pathlib.Path(jaxclip.__file__).parent
  files = sorted(package_dir.rglob("*.py"))
  folders = {"jaxclip", "_platform", "_numerics", "_ghost", "_jaxpr", "_rules", *_SUBPACKAGES}
  assert {p.parent.name for p in files} == folders, files
  edges = [e for p in files for e in _jaxclip_imports(p, package_dir)]
  hidden = [(a, b) for a, b, top in edges if not top]
  assert not hidden, f"function-level imports of jaxclip modules: {hidden}"
  graph = {}
  for a, b, _ in edges:
    graph.setdefault(a, set()).add(b)
    la, lb = _layer(a), _layer(b)
    assert _RANK[lb] < _RANK[la] or la == lb, f"{a} imports {b}: an import climbing up or across"

  cycle = helpers.import_cycle(graph)
  assert not cycle, f"import cycle: {' -> '.join(cycle)}"
  floor = {"_kernel._typing", "_kernel._shapes"}  # importing nothing of jaxclip
  assert not any(graph.get(m) for m in floor), {m: graph.get(m) for m in floor}
  for bottom in ("_kernel._validation", "_kernel._sharding"):  # the floor at most
    assert graph.get(bottom, set()) <= floor, (bottom, graph[bottom])
  for name in (m for m in graph if m.startswith("_kernel._platform")):  # the XLA:CPU room
    outside = {m for m in graph[name] if not m.startswith("_kernel._platform.")}
    allowed = {"_kernel._sharding", "_kernel._shapes", "_kernel._typing", "_kernel._validation"}
    assert outside <= allowed, (name, outside)
  kernel = {"_kernel._platform", "_kernel._sharding", "_kernel._validation", *floor}
  rooms = {  # the norm kernel's math, a room per idea
    _module_name(p, package_dir) for p in files if p.parent.name == "_numerics"
  } - {"_kernel._numerics"}
  assert graph["_kernel._numerics"] == rooms, graph["_kernel._numerics"]  # it re-exports them
  for name in rooms:
    outside = {m for m in graph.get(name, set()) if not m.startswith("_kernel._numerics.")}
    assert outside <= kernel, (name, outside)
  assert "_kernel._platform" in set().union(*(graph.get(m, set()) for m in rooms))
  assert "_kernel._numerics" in graph["_kernel._reduction"]
  assert "_kernel._reduction" in graph["ops"]
