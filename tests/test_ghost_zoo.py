"""Ghost norms on the zoo of library-built models (``workloads/zoo/``).

For each model (flax linen ``nn.scan(nn.remat(Block))`` GPT and Conv +
GroupNorm ResNet, flax nnx stacked-and-scanned Llama, equinox ViT with a
``Conv2d`` patch embedding and ``filter_vmap``-stacked blocks under
``lax.scan``, plain JAX stacked layers under ``lax.scan`` or a Python loop,
a flax linen ``nn.RNN(nn.LSTMCell)``, an ALBERT-style GPT whose one block
``nn.scan`` applies at every layer, and a small CNN):

* ``method="ghost"`` equals ``method="vmap"``: the clipped sums, the number of
  examples clipped and the per-example norms, at the median norm so that some
  examples are clipped and some are not;
* every parameter leaf gets the rule issue #25 asks for, read from
  :func:`jaxclip.ghost_plan`: dense, attention and embedding weights a ghost
  rule (``"dot"``, ``"lookup"``, ``"tied"``) also inside a scan (sliced per
  iteration or read by every iteration), convolution kernels ``"conv"``,
  normalisation scales ``"scale"`` (issue #49), only biases and position
  tables added as a bias instantiated, and at most 10% of the floats at the
  benchmark size. A leaf
  that silently falls back fails here.

``method="ghost"`` applies every rule whatever it costs (issue #39). A third
test reads ``method="auto"``'s cost model's plan on CPU: each leaf keeps the ghost plan's
rule or is instantiated with the costs that chose it, or the whole loss takes
``method="vmap"``'s program, reported as such (whether the choice pays is
measured by ``python -m benchmarks.ghost --zoo``).

The benchmark (``python -m benchmarks.ghost --zoo``) builds the same models.
"""

from __future__ import annotations

import re

import jax
import numpy as np
import pytest

import jaxclip
from jaxclip.privacy import _ghost
from workloads import zoo

BATCH = 8
# Path patterns (searched in ``jax.tree_util.keystr`` of each leaf) and the rule
# their leaves must get; the first pattern that matches a path decides.
_NORM_SCALES = (r"\['scale'\]|norm\d?\.weight", "scale")  # layer, RMS and group norms'
_BIASES = (r"\['bias'\]|norm\d?\.bias|\.bias$", "instantiate")
EXPECTED = {
  "linen_scan_gpt": [
    (r"\['Embed_0'\]\['embedding'\]", "tied"),  # lookup + Embed.attend head
    (r"\['pos'\]", "instantiate"),  # added to the embeddings, as a bias
    _NORM_SCALES,
    _BIASES,
    (r"\['kernel'\]", "dot"),
  ],  # Dense and attention kernels, in the scan
  "linen_resnet": [
    (r"Conv_\d\'\]\['kernel'\]", "conv"),
    _NORM_SCALES,
    _BIASES,
    (r"\['Dense_0'\]\['kernel'\]", "dot"),
  ],
  "nnx_llama": [
    (r"\['embed'\]\['embedding'\]", "lookup"),
    _NORM_SCALES,
    _BIASES,
    (r"\['kernel'\]", "dot"),
  ],  # the head, and the blocks' Linears in the scan
  "eqx_vit": [
    (r"^\.patch\.weight$", "conv"),
    (r"^\.pos$", "instantiate"),
    _NORM_SCALES,
    _BIASES,
    (r"(_proj|fc\d|head)\.weight$", "dot"),
  ],
  "jax_scan_mlp": [
    (r"\['embed'\]", "lookup"),
    (r"\['scale'\]", "scale"),
    (r"\['b_in'\]", "instantiate"),
    (r"\['(w_in|w_out|head)'\]", "dot"),
  ],
}
EXPECTED["linen_lstm"] = [  # the cell's weights: the dot rule over every step
  (r"\['Embed_0'\]\['embedding'\]", "lookup"),
  _NORM_SCALES,
  _BIASES,
  (r"\['kernel'\]", "dot"),
]
EXPECTED["linen_shared_gpt"] = [  # one block read by every layer: the dot rule over layers
  (r"\['Embed_0'\]\['embedding'\]", "lookup"),
  (r"\['pos'\]", "lookup"),  # pos[jnp.arange(T)]: fixed ids
  _NORM_SCALES,
  _BIASES,
  (r"\['kernel'\]", "dot"),
]
EXPECTED["linen_cnn"] = [
  (r"Conv_\d\'\]\['kernel'\]", "conv"),
  _NORM_SCALES,
  _BIASES,
  (r"\['Dense_0'\]\['kernel'\]", "dot"),
]
# The models that rematerialise their layers: ghost takes two backward passes.
REMATERIALISED = frozenset({"linen_scan_gpt"})
EXPECTED["jax_loop_mlp"] = EXPECTED["jax_scan_mlp"]  # disjoint static slices: the rules add
MAX_FALLBACK_SHARE = 0.10


def _expected_rules(name: str, params) -> dict[str, str]:
  rules = {}
  for keypath, _ in jax.tree_util.tree_flatten_with_path(params)[0]:
    path = jax.tree_util.keystr(keypath)
    matches = [rule for pattern, rule in EXPECTED[name] if re.search(pattern, path)]
    assert matches, f"{name}: no expected rule for {path}"  # the table covers every leaf
    rules[path] = matches[0]
  return rules


def _clipped_grad_fn(model: zoo.Model, method: str):
  """``f(clip, params, x, y)``, compiled once: the clip is traced."""

  def fn(clip, params, x, y):
    return jaxclip.per_example_clipped_grad(
      model.loss_fn, clip, batch_argnums=(1, 2), method=method, return_norms=True
    )(params, x, y)

  x, y = model.make_batch(BATCH, 1)
  # Tests are compile-bound: XLA's backend optimisations do not change the results.
  return jax.jit(fn).lower(1.0, model.params, x, y).compile(zoo.CHEAP_COMPILE)


@pytest.mark.parametrize("name", list(zoo.MODELS))
def test_ghost_equals_vmap_on_the_zoo_model(name):
  model = zoo.build(name, "tiny")
  x, y = model.make_batch(BATCH, 1)
  vmap = _clipped_grad_fn(model, "vmap")
  norms = np.asarray(vmap(1.0, model.params, x, y)[2])
  clip = float(np.median(norms))
  ref = vmap(clip, model.params, x, y)
  got = _clipped_grad_fn(model, "ghost")(clip, model.params, x, y)
  assert 0 < int(ref[1]) < BATCH, (int(ref[1]), norms)  # some clipped, some not
  assert int(got[1]) == int(ref[1])
  np.testing.assert_allclose(np.asarray(got[2]), np.asarray(ref[2]), rtol=1e-4)
  np.testing.assert_allclose(np.asarray(ref[2]), norms, rtol=1e-6)  # norms are pre-clip
  assert jax.tree.structure(got[0]) == jax.tree.structure(ref[0])
  paths = [jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_flatten_with_path(ref[0])[0]]
  # Rounding is relative to the whole sum: attention's key bias has a zero gradient.
  scale = max(float(np.max(np.abs(np.asarray(e)))) for e in jax.tree.leaves(ref[0]))
  for path, a, e in zip(paths, jax.tree.leaves(got[0]), jax.tree.leaves(ref[0]), strict=True):
    assert a.shape == e.shape and a.dtype == e.dtype, path
    np.testing.assert_allclose(
      np.asarray(a), np.asarray(e), rtol=1e-4, atol=1e-5 * scale, err_msg=path
    )


def test_the_lstm_records_one_output_gradient_per_gate_and_one_bias_row_per_example():
  """``nn.LSTMCell``'s gate ``dense_i(x) + dense_h(h)`` (a bias in ``dense_h``): the two
  dense sites' outputs meet through sums, so one of them records the gate's output gradient
  for both; each bias, read by every step, is tapped once per example (issue #39's memory)."""
  model = zoo.build("linen_lstm", "tiny")
  traced = _ghost.trace(model.loss_fn, model.params, model.make_batch(2, 0), [0, 1], has_aux=False)
  sites, plan = traced.plan.sites, traced.plan
  gates = [u for u, s in enumerate(sites) if s.stack and s.name == "dot_general"]
  biases = [u for u in plan.tapped if sites[u].stack]
  assert len(gates) == 8 and len(biases) == 4
  assert all(sites[u].summed for u in biases)
  inputs = _ghost.inputs_for(traced, None)
  assert not inputs.accumulated  # at this size the Gram form is cheaper: a and g are kept
  borrowed = dict(inputs.borrowed)
  assert len(borrowed) == 4 and set(borrowed) | set(borrowed.values()) == set(gates)


@pytest.mark.parametrize("size", zoo.SIZES)
@pytest.mark.parametrize("name", list(zoo.MODELS))
def test_every_leaf_gets_the_rule_the_issue_asks_for(name, size):
  model = zoo.build(name, size)
  x, y = model.make_batch(2, 0)
  plan = jaxclip.ghost_plan(model.loss_fn, model.params, x, y, batch_argnums=(1, 2))
  want = _expected_rules(name, model.params)
  assert [leaf.path for leaf in plan.leaves] == list(want)
  wrong = {p: (plan.rules[p], want[p]) for p in want if plan.rules[p] != want[p]}
  assert not wrong, (
    f"{name} ({size}): leaves with another rule than asked for, "
    f"path: (got, want):\n" + "\n".join(f"  {p}: {r}" for p, r in wrong.items()) + f"\n{plan}"
  )
  sizes = [leaf.size for leaf in jax.tree.leaves(model.params)]
  assert [leaf.floats for leaf in plan.leaves] == sizes
  for leaf in plan.leaves:
    assert (leaf.reason is None) == (leaf.rule != "instantiate"), leaf
  fallback = sum(
    n for leaf, n in zip(plan.leaves, sizes, strict=True) if leaf.rule == "instantiate"
  )
  assert plan.fallback_share == pytest.approx(fallback / sum(sizes))
  text = str(plan)
  assert all(leaf.path in text for leaf in plan.leaves), text
  # Two passes where the model rematerialises its layers (nn.scan(nn.remat)).
  assert plan.passes == (2 if name in REMATERIALISED else 1), (name, plan.passes)
  if size == "bench":
    assert plan.fallback_share <= MAX_FALLBACK_SHARE, f"{name}: {plan.fallback_share:.1%}\n{plan}"


@pytest.mark.parametrize("platform", ["cpu", "gpu"])
@pytest.mark.parametrize("name", list(zoo.MODELS))
def test_auto_keeps_or_instantiates_each_rule_or_takes_vmap_visibly(name, platform):
  model = zoo.build(name, "bench")
  x, y = model.make_batch(2, 0)
  plan = jaxclip.ghost_plan(
    model.loss_fn,
    model.params,
    x,
    y,
    batch_argnums=(1, 2),
    method="auto",
    platform=platform,
    measure=False,
  )
  want = _expected_rules(name, model.params)
  if all(leaf.rule == "instantiate" for leaf in plan.leaves):
    assert all(f"auto on {platform}" in leaf.reason for leaf in plan.leaves), plan
    assert all("the loss runs as method='vmap'" in leaf.reason for leaf in plan.leaves), plan
    return
  for leaf in plan.leaves:  # on CPU ghost's plan; elsewhere a rule or a leaf's per-example gradient
    if leaf.rule == "instantiate" and want[leaf.path] != "instantiate":
      assert platform != "cpu", leaf
      assert leaf.reason.startswith("auto on gpu:") and "floats per example" in leaf.reason, leaf
    else:
      assert leaf.rule == want[leaf.path], leaf


def test_ghost_equals_vmap_in_padded_microbatches_through_a_scan():
  # The per-iteration rules and the book-keeping inside the chunks' scan, with a
  # padded last chunk (8 examples in chunks of 3).
  model = zoo.build("jax_scan_mlp", "tiny")
  x, y = model.make_batch(BATCH, 2)

  def fn(method):
    def clipped(clip, params, x, y):
      return jaxclip.per_example_clipped_grad(
        model.loss_fn,
        clip,
        batch_argnums=(1, 2),
        method=method,
        microbatch_size=3,
        return_norms=True,
      )(params, x, y)

    return jax.jit(clipped).lower(1.0, model.params, x, y).compile(zoo.CHEAP_COMPILE)

  vmap = fn("vmap")
  clip = float(np.median(np.asarray(vmap(1.0, model.params, x, y)[2])))
  ref, got = vmap(clip, model.params, x, y), fn("ghost")(clip, model.params, x, y)
  assert 0 < int(ref[1]) < BATCH and int(got[1]) == int(ref[1])
  np.testing.assert_allclose(np.asarray(got[2]), np.asarray(ref[2]), rtol=1e-4)
  for a, e in zip(jax.tree.leaves(got[0]), jax.tree.leaves(ref[0]), strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=1e-4, atol=1e-6)
