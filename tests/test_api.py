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
