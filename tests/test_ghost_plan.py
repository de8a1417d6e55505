"""What ``jaxclip.ghost_plan`` reports, and ``method="auto"``'s choice.

``ghost_plan`` names each leaf's rule, the reason a leaf is instantiated and
its floats, and takes unused leaves, ``keep_batch_dim`` and ``has_aux`` as
``per_example_clipped_grad`` does. ``method="ghost"`` keeps its rules where
per-example gradients would cost less; ``"auto"``'s cost model chooses by the
platform the program is lowered for, and runs as ``"vmap"`` where the rules
kept would not pay (``measure=False`` here: what it measures is
``test_ghost_measured.py``'s).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import jaxclip
from jaxclip.privacy import _measured
from tests.ghost_helpers import D, L, gpt_loss
from tests.ghost_helpers import compare as _compare
from tests.ghost_helpers import gpt_params as _gpt_params
from tests.ghost_helpers import gpt_tokens as _tokens


def test_ghost_keeps_its_rules_where_per_example_gradients_cost_less():
  # 64 rows of an 8 x 4 weight: the dot rule forms A^T G per example (as vmap
  # does); "ghost" keeps it (the user's choice), "auto" on CPU takes vmap's program.
  w = jax.random.normal(jax.random.key(0), (8, 4))
  long = lambda w, x: jnp.sum(jnp.sin(x @ w))
  xs = jax.random.normal(jax.random.key(1), (6, 64, 8))
  assert jaxclip.ghost_plan(long, w, xs, batch_argnums=1).rules == {"": "dot"}
  auto = jaxclip.ghost_plan(
    long, w, xs, batch_argnums=1, method="auto", platform="cpu", measure=False
  )
  assert (
    auto.rules == {"": "instantiate"} and "the loss runs as method='vmap'" in auto.leaves[0].reason
  )
  assert "auto on cpu" in auto.leaves[0].reason and "(method='auto' on cpu)" in str(auto)
  _compare(long, w, xs, batch_argnums=1)
  for method in ("ghost", "auto"):  # 2 rows of a 64 x 64 weight: the Gram form, on every platform
    for platform in ("cpu", "gpu"):
      short = jaxclip.ghost_plan(
        long,
        jnp.ones((64, 64)),
        jnp.ones((6, 2, 64)),
        batch_argnums=1,
        method=method,
        platform=platform,
        measure=False,
      )
      assert short.rules == {"": "dot"}, (method, platform)


def _auto_problem():
  # 64 rows through an 8 x 4 weight (its per-example gradient costs fewer flops and
  # floats than its rule), then their mean through a 4 x 5 head (its rule costs less
  # of both). On CPU the rules kept still cost more than 0.9x the per-example
  # gradients' flops: vmap's program. Elsewhere (memory first): the head's rule.
  ks = jax.random.split(jax.random.key(3), 3)
  p = {"w1": jax.random.normal(ks[0], (8, 4)), "w2": jax.random.normal(ks[1], (4, 5))}
  xs = jax.random.normal(ks[2], (6, 64, 8))
  return (lambda p, x: jnp.sum(jnp.sin(jnp.mean(jnp.tanh(x @ p["w1"]), 0) @ p["w2"]))), p, xs


def test_auto_chooses_by_the_platform_the_program_is_lowered_for(monkeypatch):
  # The cost model's plans (the measured pick, which replaces this CPU's, is in
  # test_ghost_measured.py): nothing timed.
  monkeypatch.setattr(
    _measured, "measure", lambda *a: _measured.Measured("cpu", None, "not timed here")
  )
  loss, p, xs = _auto_problem()
  cpu = jaxclip.ghost_plan(loss, p, xs, method="auto", platform="cpu", measure=False)
  gpu = jaxclip.ghost_plan(loss, p, xs, method="auto", platform="gpu")
  assert cpu.rules == {"['w1']": "instantiate", "['w2']": "instantiate"}, cpu
  assert "the loss runs as method='vmap'" in cpu.leaves[1].reason
  assert gpu.rules == {"['w1']": "instantiate", "['w2']": "dot"}, gpu
  assert "auto on gpu" in gpu.leaves[0].reason and "floats per example" in gpu.leaves[0].reason
  _compare(loss, p, xs, method_="auto")  # both plans staged; this CPU runs vmap's program
  fn = jax.jit(jaxclip.per_example_clipped_grad(loss, 1.0, method="auto", return_norms=True))
  head = "tensor<6x4x5xf32>"  # the head's per-example gradients: vmap's program, not the rule's
  texts = {k: jax.export.export(fn, platforms=(k,))(p, xs).mlir_module() for k in ("cpu", "cuda")}
  assert head in texts["cpu"] and head not in texts["cuda"]


def test_ghost_plan_names_each_leaf_rule_reason_and_floats():
  params, tokens = _gpt_params(), _tokens(4)
  plan = jaxclip.ghost_plan(gpt_loss, params, tokens, batch_argnums=1)
  paths = [jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
  assert [leaf.path for leaf in plan.leaves] == paths
  rules = plan.rules
  assert rules["['wte']"] == "tied"
  assert all(
    rules[f"['{i}']['{n}']"] == "dot" for i in range(L) for n in ("qkv", "proj", "fc", "out")
  )
  leaf = plan.leaves[paths.index("['0']['ln1_s']")]  # a layer norm's scale: its own rule
  assert (leaf.rule, leaf.floats, leaf.shape, leaf.reason) == ("scale", D, (D,), None)
  leaf = plan.leaves[paths.index("['0']['ln1_b']")]  # its bias: none
  assert (leaf.rule, leaf.floats, leaf.shape) == ("instantiate", D, (D,))
  assert "used by `add`" in leaf.reason
  assert all((leaf.reason is None) == (leaf.rule != "instantiate") for leaf in plan.leaves)
  sizes = {leaf.path: leaf.floats for leaf in plan.leaves}
  fallen = sum(sizes[p] for p, r in rules.items() if r == "instantiate")
  assert plan.fallback_share == pytest.approx(fallen / sum(sizes.values()))
  assert 0 < plan.fallback_share < 0.2
  text = str(plan)
  assert "['0']['qkv']" in text and "instantiated" in text.splitlines()[-1]
  # Unused leaves, keep_batch_dim and has_aux are taken as per_example_clipped_grad takes them.
  loss = lambda p, x: (jnp.sum(x[0] @ p["w"]), x)
  plan = jaxclip.ghost_plan(
    loss,
    {"w": jnp.ones((3, 2)), "v": jnp.ones(4)},
    jnp.ones((5, 3)),
    batch_argnums=1,
    keep_batch_dim=True,
    has_aux=True,
  )
  assert plan.rules == {"['v']": "unused", "['w']": "dot"} and plan.fallback_share == 0


@pytest.mark.parametrize(("t", "c", "f", "form"), [(2, 64, 64, "dot:gram"), (64, 8, 4, "dot")])
def test_ghost_plan_reports_each_rules_flops_by_form(t, c, f, form):
  # The dot rule's Gram form costs T^2 (C + F) flops per example, the gradient formed
  # from a and g T C F: the cheaper is taken and reported, beside the gradient's T C F.
  loss = lambda w, x: jnp.sum(jnp.sin(x @ w))
  plan = jaxclip.ghost_plan(loss, jnp.ones((c, f)), jnp.ones((3, t, c)), batch_argnums=1)
  (leaf,) = plan.leaves
  norm = t * t * (c + f) if form == "dot:gram" else t * c * f
  assert leaf.norm_flops == ((form, norm),) and leaf.grad_flops == (("dot", t * c * f),)
  assert (leaf.site_calls, leaf.grad_writes) == (1, c * f)


@pytest.mark.parametrize("stacked", [False, True])
def test_ghost_plan_counts_a_scans_site_calls_and_the_gradients_writes(stacked):
  # A weight every step of a 5-step scan reads is written to 5 times per example
  # under vmap; one stacked over the steps, once.
  steps, d = 5, 4

  def loss(w, xs):
    def step(h, inp):
      wi, x = inp if stacked else (w, inp)
      return jnp.tanh(h @ wi + x), None

    return jnp.sum(jax.lax.scan(step, jnp.zeros(d), (w, xs) if stacked else xs)[0])

  w = jnp.full((steps, d, d) if stacked else (d, d), 0.1)
  (leaf,) = jaxclip.ghost_plan(loss, w, jnp.ones((3, steps, d)), batch_argnums=1).leaves
  assert leaf.rule == "dot" and leaf.site_calls == steps
  assert leaf.grad_writes == (w.size if stacked else steps * w.size)


def test_auto_says_why_each_leaf_keeps_its_rule():
  params, tokens = _gpt_params(), _tokens(4)
  for platform, weighed in (("cpu", "flops per example"), ("gpu", "floats per example")):
    plan = jaxclip.ghost_plan(
      gpt_loss, params, tokens, batch_argnums=1, method="auto", platform=platform, measure=False
    )
    ghost = jaxclip.ghost_plan(gpt_loss, params, tokens, batch_argnums=1)
    for leaf, g in zip(plan.leaves, ghost.leaves, strict=True):
      assert leaf.reason, leaf  # every leaf says why
      if leaf.rule != "instantiate":
        assert leaf.reason.startswith(f"auto on {platform}: its {leaf.rule} rule"), leaf
        assert weighed in leaf.reason, leaf
      elif g.rule == "instantiate":  # no rule at all: the reason ghost gives
        assert leaf.reason == g.reason, leaf
