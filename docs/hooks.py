"""mkdocs hooks: notebooks from notebooks/, an API page from ``__all__``, reST roles.

* ``on_files`` adds ``notebooks/*.ipynb`` (outside ``docs/``) before
  mkdocs-jupyter turns notebooks into pages; they are rendered with the
  outputs stored in them (``tools/execute_notebooks.py``), not executed. It
  also adds ``benchmarks/results/*.png``, which the docs pages show.
* ``on_page_markdown`` fills ``api.md``'s placeholder with one mkdocstrings
  block per name in ``jaxclip.__all__``, ``jaxclip.ops.__all__`` and
  ``jaxclip.platform.__all__``, grouped by
  the private module that defines it (its docstring's first line is the
  heading), so names added later are documented without editing the docs.
* ``on_page_content`` renders what the optax-style docstrings write in reST:
  ``:func:`x``` roles, ``.. math::`` blocks, ``:math:`` roles and
  ``Title <url>`_`` links.
"""

from __future__ import annotations

import html
import importlib
import inspect
import re
from pathlib import Path

from mkdocs.plugins import event_priority
from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[1]
PLACEHOLDER = "<!-- jaxclip-api -->"
MODULE_ORDER = (
  "jaxclip.transforms._fixed",
  "jaxclip.transforms._keras",
  "jaxclip.transforms._unitwise",
  "jaxclip.transforms._autoclip",
  "jaxclip.transforms._zclip",
  "jaxclip.transforms._adaptive",
  "jaxclip.skipping._spike",
  "jaxclip.skipping._rules",
  "jaxclip.skipping._accumulation",
  "jaxclip.transforms._record",
  "jaxclip.transforms._threshold",
)


@event_priority(100)  # before mkdocs-jupyter's on_files
def on_files(files, config):
  for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
    files.append(
      File(
        f"notebooks/{path.name}",
        src_dir=str(ROOT),
        dest_dir=config["site_dir"],
        use_directory_urls=config["use_directory_urls"],
      )
    )
  # The benchmarks' figures (outside docs/ too), shown by the performance and privacy pages.
  for path in sorted((ROOT / "benchmarks" / "results").glob("*.png")):
    files.append(
      File(
        f"benchmarks/results/{path.name}",
        src_dir=str(ROOT),
        dest_dir=config["site_dir"],
        use_directory_urls=config["use_directory_urls"],
      )
    )
  return files


def api_markdown() -> str:
  jaxclip = importlib.import_module("jaxclip")
  groups: dict[str, list[str]] = {}
  for name in jaxclip.__all__:
    if name in ("ops", "platform"):
      continue
    module = getattr(getattr(jaxclip, name), "__module__", "jaxclip")
    groups.setdefault(module, []).append(name)
  order = [m for m in MODULE_ORDER if m in groups] + sorted(set(groups) - set(MODULE_ORDER))
  out = []
  for module in order:
    doc = inspect.getdoc(importlib.import_module(module)) or module
    out.append(f"## {doc.splitlines()[0].rstrip('.')}\n")
    # Functions first, then the state and result classes they return.
    names = sorted(groups[module], key=lambda n: inspect.isclass(getattr(jaxclip, n)))
    out += [f"::: jaxclip.{name}\n" for name in names]
  out.append("## `jaxclip.ops`: TensorFlow-style pure functions\n")
  out += [f"::: jaxclip.ops.{name}\n" for name in jaxclip.ops.__all__]
  out.append("## `jaxclip.platform`: the kernel's compile-time tricks, and their switch\n")
  out += [f"::: jaxclip.platform.{name}\n" for name in jaxclip.platform.__all__]
  return "\n".join(out)


def on_page_markdown(markdown, page, config, files):
  if PLACEHOLDER in markdown:
    markdown = markdown.replace(PLACEHOLDER, api_markdown())
  return markdown


_ROLE = re.compile(r":(?:func|class|mod|meth|attr|data|obj):(<code>)")
_MATH_ROLE = re.compile(r":math:<code>(.*?)</code>", re.S)
# A ``.. math::`` body indented by 4 becomes a code block, by 2 a paragraph.
_MATH_BLOCK = re.compile(
  r"<p>\.\. math::</p>\s*(?:<pre><code>(.*?)</code></pre>|<p>(.*?)</p>)", re.S
)
_LINK = re.compile(r"<code>([^<]*?)\s*&lt;(https?://[^&\s]+)&gt;</code>_")


def on_page_content(content, page, config, files):
  content = _ROLE.sub(r"\1", content)
  content = _MATH_ROLE.sub(lambda m: f'<span class="arithmatex">\\({m.group(1)}\\)</span>', content)
  content = _MATH_BLOCK.sub(
    lambda m: f'<div class="arithmatex">\\[{(m.group(1) or m.group(2)).strip()}\\]</div>', content
  )
  content = _LINK.sub(lambda m: f'<a href="{m.group(2)}">{html.unescape(m.group(1))}</a>', content)
  return content
