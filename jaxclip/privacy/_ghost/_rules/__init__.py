"""The ghost rules: the registry, and one file per rule.

Each rule is a :class:`~jaxclip.privacy._ghost._rules._base.Rule` in a file
of its own, declaring how it matches a site's param input, its squared norm,
its cost in flops and floats, and whether it accumulates in the backward
pass. :data:`RULES` registers them: the first that matches a site's param
input is that input's rule; none matching, the input is instantiated (the
base rule, :mod:`~jaxclip.privacy._ghost._rules._instantiate`). Adding a
rule is one new file and one entry in :data:`RULES`.

The rules:

* ``_dot``: a ``dot_general`` of a parameter and data (dense layers,
  attention projections, a scan's shared weight);
* ``_lookup``: an embedding table read at ids; ``_tied``: a table tied to an
  output head (both rules and their cross term);
* ``_conv``: a convolution's kernel; ``_conv_taps``: its per-example
  gradient tap by tap, where that is formed in the backward pass;
* ``_scale``: a layer norm's or RMS norm's scale, an elementwise product
  of a parameter and data;
* ``_instantiate``: the base rule, the per-example gradient formed through
  the sites.

Their arithmetic (overflow-safe squared norms, a rule over scan iterations)
is ``_scaling``'s.
"""

from __future__ import annotations

from typing import Any

from jaxclip.privacy._ghost._rules._base import Rule
from jaxclip.privacy._ghost._rules._conv import CONV
from jaxclip.privacy._ghost._rules._dot import DOT
from jaxclip.privacy._ghost._rules._instantiate import INSTANTIATE
from jaxclip.privacy._ghost._rules._lookup import LOOKUP
from jaxclip.privacy._ghost._rules._scale import SCALE
from jaxclip.privacy._ghost._types import PARAM, Site

# The registered rules, in the order they are tried.
RULES: tuple[Rule, ...] = (DOT, LOOKUP, CONV, SCALE)

_BY_NAME = {rule.name: rule for rule in (*RULES, INSTANTIATE)}


def get(name: str) -> Rule:
  """The rule called ``name`` (``"instantiate"``: the base rule)."""
  return _BY_NAME[name]


def rule_for(eqn: Any, roles: tuple[str, ...], pos: int) -> Rule:
  """The first registered rule that matches param input ``pos`` of ``eqn``, or the base rule."""
  return next((rule for rule in RULES if rule.matches(eqn, roles, pos)), INSTANTIATE)


def rules_of(site: Site) -> tuple[str, ...]:
  """The names of the rules of a site's param inputs, in order."""
  return tuple(
    rule_for(site.eqn, site.roles, p).name for p, r in enumerate(site.roles) if r == PARAM
  )
