"""What may import what: the benchmarks stand on their own (issue #49).

``workloads/`` (the trees, models and transforms both run on) sits below
``tests/`` and ``benchmarks/``; ``benchmarks/`` imports nothing from
``tests/`` and its modules import one another without a cycle. Read from
the sources (every ``import``, at any depth), not by importing them. No
module of ``jaxclip/``, ``benchmarks/`` or ``workloads/`` is over 400 lines.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests import helpers

ROOT = Path(__file__).resolve().parents[1]


def _imported(path: Path, modules: frozenset[str] = frozenset()) -> set[str]:
  """Every module ``path`` imports, anywhere in it (``from a import b``: ``a.b`` where that is
  one of ``modules``, else ``a`` and ``a.b``)."""
  names = set()
  for node in ast.walk(ast.parse(path.read_text(), str(path))):
    if isinstance(node, ast.Import):
      names.update(alias.name for alias in node.names)
    elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
      subs = {f"{node.module}.{alias.name}" for alias in node.names}
      names.update(subs)
      if not subs <= modules:
        names.add(node.module)
  return names


def _modules(package: str) -> dict[str, Path]:
  """``{dotted name: path}`` of the modules of ``package``, its subpackages' included."""
  base = ROOT.joinpath(*package.split("."))
  out = {}
  for p in sorted(base.rglob("*.py")):
    parts = [package, *p.relative_to(base).with_suffix("").parts]
    out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
  return out


def _graph(package: str) -> dict[str, set[str]]:
  """``{module: the modules of package it imports}``."""
  modules = _modules(package)
  return {
    name: {
      m for m in _imported(path, frozenset(modules)) if m in modules and m not in (name, package)
    }
    for name, path in modules.items()
  }


def test_the_cycle_finder_finds_a_cycle():
  # The check below could not fail if this found nothing: benchmarks.ghost and benchmarks._peers
  # imported each other until the GPT's cases moved to benchmarks._ghost_cases.
  assert helpers.import_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
  imported = {"ghost": {"_peers"}, "_peers": {"ghost", "_cases"}, "_cases": set()}
  assert helpers.import_cycle(imported) == ["_peers", "ghost", "_peers"]
  assert helpers.import_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_benchmarks_and_workloads_import_nothing_from_tests():
  offenders = {
    f"{path.relative_to(ROOT)}: {sorted(m for m in _imported(path) if m.split('.')[0] == 'tests')}"
    for package in ("benchmarks", "workloads")
    for path in _modules(package).values()
    if any(m.split(".")[0] == "tests" for m in _imported(path))
  }
  assert not offenders, offenders


def test_workloads_import_neither_tests_nor_benchmarks():
  for path in _modules("workloads").values():
    assert not {m.split(".")[0] for m in _imported(path)} & {"tests", "benchmarks"}, path


def test_benchmark_modules_import_one_another_without_a_cycle():
  graph = _graph("benchmarks")
  assert "benchmarks._peers" in graph and "benchmarks._ghost_cases" in graph["benchmarks._peers"]
  cycle = helpers.import_cycle(graph)
  assert not cycle, " -> ".join(cycle)


MAX_LINES = 400


def test_no_module_is_over_400_lines():
  """A module longer than :data:`MAX_LINES` is split into modules of one purpose each
  (issue #49): its models, its timing, its report."""
  long = {
    f"{path.relative_to(ROOT)}": lines
    for package in ("jaxclip", "benchmarks", "workloads")
    for path in _modules(package).values()
    if (lines := len(path.read_text().splitlines())) > MAX_LINES
  }
  assert "jaxclip.privacy._ghost._types" in _modules("jaxclip")  # subpackages are read too
  assert not long, "\n".join(f"{name}: {lines} lines" for name, lines in sorted(long.items()))


def _dotted(node: ast.AST) -> str | None:
  """``a.b.c`` for an attribute chain on a name, else ``None``."""
  parts = []
  while isinstance(node, ast.Attribute):
    parts.append(node.attr)
    node = node.value
  if not isinstance(node, ast.Name):
    return None
  return ".".join([node.id, *reversed(parts)])


def _private_jaxclip_names(path: Path) -> set[str]:
  """The private jaxclip names ``path`` imports or reads (``jaxclip._kernel``, ``jaxclip.x._y``)."""
  used = set(_imported(path))
  used.update(
    name
    for node in ast.walk(ast.parse(path.read_text(), str(path)))
    if isinstance(node, ast.Attribute) and (name := _dotted(node))
  )
  private = [p for p in (name.split(".") for name in used) if p[0] == "jaxclip"]
  return {
    ".".join(parts)
    for parts in private
    if any(p.startswith("_") and not p.endswith("__") for p in parts[1:])  # (not __all__)
  }


def test_the_private_name_finder_finds_private_names(tmp_path):
  # The check below could not fail if this found nothing.
  source = tmp_path / "bench.py"
  source.write_text(
    "import jaxclip\nfrom jaxclip._kernel import _platform\nfrom jaxclip.transforms import _x\n"
    "def f():\n  import jaxclip._kernel._numerics\n  return jaxclip.transforms._per_tensor.y\n"
    "jaxclip.platform.without('grouped_parts'), jaxclip.__all__\n"
  )
  assert _private_jaxclip_names(source) == {
    "jaxclip._kernel",
    "jaxclip._kernel._platform",
    "jaxclip.transforms._x",
    "jaxclip._kernel._numerics",
    "jaxclip.transforms._per_tensor",
    "jaxclip.transforms._per_tensor.y",
  }


def test_benchmarks_and_workloads_use_only_public_jaxclip_names():
  """They measure what users run, through the public API (issue #49): a trick is switched off
  by ``jaxclip.platform.without``, not by patching the kernel's private modules."""
  offenders = {
    f"{path.relative_to(ROOT)}: {sorted(names)}"
    for package in ("benchmarks", "workloads")
    for path in _modules(package).values()
    if (names := _private_jaxclip_names(path))
  }
  assert not offenders, offenders


def test_the_chain_finder_finds_the_longest_chain():
  graph = {"a": {"b", "d"}, "b": {"c"}, "c": set(), "d": set()}
  assert helpers.longest_import_chain(graph) == ["a", "b", "c"]
  assert helpers.longest_import_chain({"a": set()}) == ["a"]


def test_the_ghost_engine_imports_at_most_eight_deep():
  """No chain of imports among ``jaxclip/privacy/``'s modules is longer than 8 (issue #49),
  and nothing outside the engine's folder, ``jaxclip/privacy/_ghost/``, imports one of its
  modules: its ``__init__`` is the way in.

  The engine's shared records (sites, boundaries, groups, what the capture
  gives) live in ``_ghost/_types``, which imports none of its steps, so a
  step that only names a record does not import the step that makes it
  (planning does not import execution). It was 10 when the engine was
  flat: ``_dpsgd -> _per_example -> _ghost -> _ghost_book -> _ghost_rules ->
  _ghost_instantiate -> _ghost_capture -> _ghost_walk -> _ghost_sites ->
  _jax_internals``.
  """
  graph = _graph("jaxclip.privacy")
  del graph["jaxclip.privacy"]  # the package's __init__: its public names
  assert "jaxclip.privacy._ghost._types" in graph, sorted(graph)
  # The engine's way in: nothing outside jaxclip/privacy/_ghost/ imports one of its modules.
  inside = "jaxclip.privacy._ghost"
  reach_in = {
    name: sorted(m for m in imports if m.startswith(inside + "."))
    for name, imports in graph.items()
    if not (name == inside or name.startswith(inside + "."))
  }
  assert not {k: v for k, v in reach_in.items() if v}, reach_in
  assert not graph["jaxclip.privacy._ghost._types"], graph["jaxclip.privacy._ghost._types"]
  chain = helpers.longest_import_chain(graph)
  assert len(chain) <= 8, " -> ".join(chain)
