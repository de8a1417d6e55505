"""The ghost engine's rule registry (issue #49): a rule is one file and one entry in ``RULES``.

Read from the package itself: every ``Rule`` that a file under
``jaxclip/privacy/_ghost/_rules/`` defines is registered (or is the base
rule), each declares its own matching, squared norm and costs, and the
planner names a leaf's rule by the registered name that ``ghost_plan``
reports.
"""

from __future__ import annotations

import importlib
import pkgutil

import jax.numpy as jnp

import jaxclip
from jaxclip.privacy._ghost import _rules
from jaxclip.privacy._ghost._rules._base import Rule
from jaxclip.privacy._ghost._rules._instantiate import INSTANTIATE


def _defined_rules() -> dict[str, list[Rule]]:
  """``{module: the Rule instances it defines}`` over every module of ``_rules``."""
  out = {}
  for info in pkgutil.iter_modules(_rules.__path__):
    module = importlib.import_module(f"{_rules.__name__}.{info.name}")
    found = [
      v
      for v in vars(module).values()
      if isinstance(v, Rule) and type(v).__module__ == module.__name__
    ]
    if found:
      out[info.name] = found
  return out


def test_every_rule_a_file_defines_is_registered_once():
  defined = _defined_rules()
  registered = [*_rules.RULES, INSTANTIATE]
  assert sorted(id(r) for rs in defined.values() for r in rs) == sorted(id(r) for r in registered)
  assert all(len(rs) == 1 for rs in defined.values()), defined  # one rule per file
  names = [r.name for r in registered]
  assert len(set(names)) == len(names), names
  assert all(_rules.get(r.name) is r for r in registered)


def test_each_registered_rule_declares_its_own_match_norm_and_costs():
  for rule in _rules.RULES:
    for method in ("matches", "sumsq", "cost", "work"):
      assert getattr(type(rule), method) is not getattr(Rule, method), (rule.name, method)


def test_no_rule_matching_gives_the_base_rule():
  assert _rules.rule_for(None, ("param",), 0) is INSTANTIATE
  assert INSTANTIATE.name == "instantiate"


def test_the_planner_names_each_leaf_by_its_registered_rule():
  def loss(p, x, ids):
    h = jnp.tanh(x @ p["w"] + p["emb"][ids].sum(0))
    return jnp.sum(h * p["s"]) ** 2

  params = {"w": jnp.ones((3, 4)), "emb": jnp.ones((5, 4)), "s": jnp.ones(4)}
  x, ids = jnp.ones((2, 3)), jnp.zeros((2, 2), jnp.int32)
  plan = jaxclip.ghost_plan(loss, params, x, ids)
  rules = {leaf.path: leaf.rule for leaf in plan.leaves}
  assert rules["['w']"] == "dot" and rules["['emb']"] == "lookup", rules
  reported = {rule.name for rule in _rules.RULES}
  assert {rules["['w']"], rules["['emb']"]} <= reported
