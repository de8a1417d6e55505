"""Per-layer clip norms and automatic clipping (``normalize=``), against a NumPy reference.

The reference takes every example's gradient with ``jax.vmap(jax.grad(...))``
(nothing of the library), then clips or normalises each group of leaves in
NumPy. Each case compiles one function per structure of ``l2_norm_clip`` and
per ``normalize is None``: the thresholds and ``gamma`` are traced, so every
value below shares those compiles. The multi-device check
(``spmd_axis_name``, ``axis_name``) is in ``tests/test_per_example.py``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxclip

B, T, V, D = 8, 3, 11, 4


def _params(seed=0):
  ks = iter(jax.random.split(jax.random.key(seed), 8))
  n = lambda *s: 0.7 * jax.random.normal(next(ks), s)
  return {
    "emb": n(V, D),  # a lookup
    "layer": {"w": n(D, D), "b": n(D)},  # a dot and a bias (its gradient taken in the backward)
    "mix": {"a": n(D, D), "b": n(D, D)},  # used as a + b: one param input, two groups below
    "head": n(D, 2),
  }


def loss(p, ids, y):
  h = p["emb"][ids]  # (T, D)
  h = jnp.tanh(h @ p["layer"]["w"] + p["layer"]["b"])
  h = jnp.tanh(h @ (p["mix"]["a"] + p["mix"]["b"]))
  return jnp.sum((h @ p["head"] - y) ** 2)


def _batch(seed=1):
  k1, k2 = jax.random.split(jax.random.key(seed))
  ids = jax.random.randint(k1, (B, T), 0, V).at[:, 1].set(3)  # repeated rows
  y = 2.0 * jax.random.normal(k2, (B, T, 2))
  return ids, y


# One threshold per group: "layer" covers two leaves (a prefix), "mix" splits a + b.
CLIP_TREE = {"emb": 1.0, "layer": 2.0, "mix": {"a": 0.5, "b": 3.0}, "head": 4.0}


def _groups_of(clip, params):
  """Each parameter leaf's group, as the list of leaf paths per clip leaf (NumPy side)."""
  if not isinstance(clip, dict):
    return [list(range(len(jax.tree.leaves(params))))], [clip]
  treedef = jax.tree.structure(clip)
  subs = treedef.flatten_up_to(params)
  groups, start = [], 0
  for sub in subs:
    count = len(jax.tree.leaves(sub))
    groups.append(list(range(start, start + count)))
    start += count
  return groups, jax.tree.leaves(clip)


_per_example_grads = jax.jit(jax.vmap(jax.grad(loss), in_axes=(None, 0, 0)))


def _reference(params, ids, y, clip, gamma=None, mask=None, group_size=1):
  """``(sum, counts, norms)`` in NumPy, per group; units of ``group_size`` examples."""
  grads = _per_example_grads(params, ids, y)
  leaves = [np.asarray(g, np.float64) for g in jax.tree.leaves(grads)]
  mask = np.ones(B, bool) if mask is None else np.asarray(mask)
  units = B // group_size
  # a unit's gradient: the sum of its real examples' gradients
  leaves = [
    (g * mask.reshape((-1,) + (1,) * (g.ndim - 1)))
    .reshape((units, group_size) + g.shape[1:])
    .sum(1)
    for g in leaves
  ]
  real = mask.reshape(units, group_size).any(1)
  groups, bounds = _groups_of(clip, params)
  weights, counts, norms = {}, [], []
  for members, c in zip(groups, bounds, strict=True):
    n = np.sqrt(sum(np.sum(leaves[i].reshape(units, -1) ** 2, 1) for i in members))
    if gamma is None:
      w = np.where(n > c, c / np.maximum(n, 1e-30), 1.0)
      counts.append(int(np.sum((w < 1) & real)))
    else:
      d = n + gamma
      w = np.where(d > 0, c / np.maximum(d, 1e-30), 0.0)
      counts.append(int(np.sum((d > c) & real)))
    w = np.where(real, w, 0.0)
    norms.append(np.where(real, n, 0.0))
    for i in members:
      weights[i] = w
  total = [
    np.sum(weights[i].reshape((-1,) + (1,) * (g.ndim - 1)) * g, 0) for i, g in enumerate(leaves)
  ]
  return total, counts, norms


CONFIGS = {  # scalar: also a scalar bound with normalize (its own compile)
  "plain": dict(scalar=True),
  # a padded last chunk; normalize only (clipping with a mask: the last config)
  "mask+microbatch+aux": dict(microbatch_size=3, mask=True, has_aux=True, clipped=False),
  "group+mask+microbatch": dict(group_size=2, microbatch_size=4, mask=True, scalar=True),
}


def _check(out, ref, clip_is_tree):
  total, count, norms = out
  ref_total, ref_counts, ref_norms = ref
  for a, e in zip(jax.tree.leaves(total), ref_total, strict=True):
    np.testing.assert_allclose(np.asarray(a), e, rtol=2e-5, atol=2e-5)
  if clip_is_tree:
    assert jax.tree.structure(count) == jax.tree.structure(CLIP_TREE)
    assert jax.tree.structure(norms) == jax.tree.structure(CLIP_TREE)
    assert [int(c) for c in jax.tree.leaves(count)] == ref_counts
    for a, e in zip(jax.tree.leaves(norms), ref_norms, strict=True):
      np.testing.assert_allclose(np.asarray(a), e, rtol=2e-5, atol=2e-5)
  else:
    assert int(count) == ref_counts[0] and jnp.shape(count) == ()
    np.testing.assert_allclose(np.asarray(norms), ref_norms[0], rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("method", ["vmap", "ghost"])
def test_per_layer_and_normalize_match_numpy(method, config):
  opts = dict(CONFIGS[config])
  mask = (
    np.array([True, False, True, True, True, True, False, True]) if opts.pop("mask", 0) else None
  )
  scalar, with_clipped = opts.pop("scalar", False), opts.pop("clipped", True)
  group_size = opts.get("group_size", 1)
  params = _params()
  ids, y = _batch()

  def loss_aux(p, ids, y):
    return loss(p, ids, y), {"y0": y[0, 0]}

  def make(normalize):
    @jax.jit
    def run(clip, gamma):
      fn = jaxclip.per_example_clipped_grad(
        loss_aux if opts.get("has_aux") else loss,
        clip,
        method=method,
        return_norms=True,
        normalize=None if normalize is None else gamma,
        **opts,
      )
      return fn(params, ids, y, example_mask=mask)

    def checked(clip, gamma):
      out = run(clip, gamma)
      if opts.get("has_aux"):  # each real example's aux, in the batch's order
        real = np.ones(B, bool) if mask is None else mask
        np.testing.assert_array_equal(np.asarray(out[3]["y0"])[real], np.asarray(y[real, 0, 0]))
      return out[:3]

    return checked

  clipped, normalised = make(None), make(0.0)
  scaled = {k: jax.tree.map(lambda c: c * 1.5, v) for k, v in CLIP_TREE.items()}
  for clip in (CLIP_TREE, scaled):
    ref = _reference(params, ids, y, clip, mask=mask, group_size=group_size)
    assert 0 < sum(ref[1]) < len(ref[1]) * (B // group_size)  # some clipped, not all
    if with_clipped:
      _check(clipped(clip, 0.0), ref, True)
    for gamma in (0.0, 0.05):
      ref = _reference(params, ids, y, clip, gamma, mask=mask, group_size=group_size)
      _check(normalised(clip, gamma), ref, True)
  # A scalar bound with normalize: one count and one norm per unit, as without it.
  for gamma in (0.0, 0.05) if scalar else ():
    ref = _reference(params, ids, y, 2.0, gamma, mask=mask, group_size=group_size)
    _check(normalised(2.0, gamma), ref, False)


def _scan_remat_problem():
  """Stacked layers under ``lax.scan`` (the dot rule per iteration), rematerialised or not."""
  ks = jax.random.split(jax.random.key(3), 4)
  params = {
    "stack": {
      "w": 0.6 * jax.random.normal(ks[0], (3, D, D)),
      "b": jax.random.normal(ks[1], (3, D)),
    },
    "head": jax.random.normal(ks[2], (D, 2)),
  }
  xs = jax.random.normal(ks[3], (B, T, D))
  return params, xs


def _scan_loss(remat):
  wrap = jax.checkpoint if remat else (lambda f: f)

  def fn(p, x):
    @wrap
    def layer(h, lw):
      return jnp.tanh(h @ lw["w"] + lw["b"]), None

    h, _ = jax.lax.scan(layer, x, p["stack"])
    return jnp.sum(jnp.sin(h @ p["head"]))

  return fn


def test_scan_and_two_pass_plans_weight_each_group():
  """Per-group weights through a scan's stacked weights, and through the second weighted
  backward pass of a rematerialised model (one pass per group)."""
  params, xs = _scan_remat_problem()
  losses = {remat: _scan_loss(remat) for remat in (False, True)}
  for remat, fn in losses.items():
    plan = jaxclip.ghost_plan(fn, params, xs, l2_norm_clip={"stack": 1.0, "head": 1.0})
    assert plan.passes == (2 if remat else 1)
    assert plan.sum_passes == (2 if remat else 1)  # a weighted backward pass per group
  clip = {"stack": 5.5, "head": 2.5}

  @jax.jit  # the reference and the four ghost runs in one program
  def run(clip, gamma):
    grads = jax.vmap(jax.grad(losses[False]), in_axes=(None, 0))(params, xs)
    refs = [jaxclip.per_example_global_norm_clip(grads, clip, normalize=n) for n in (None, gamma)]
    outs = {
      remat: [
        jaxclip.per_example_clipped_grad(
          fn, clip, method="ghost", normalize=n, return_norms=True, microbatch_size=5
        )(params, xs)
        for n in (None, gamma)
      ]
      for remat, fn in losses.items()
    }
    return grads, refs, outs

  grads, refs, outs = run(clip, 0.1)
  stack_norms = np.sqrt(
    sum(np.sum(np.asarray(g).reshape(B, -1) ** 2, 1) for g in jax.tree.leaves(grads["stack"]))
  )
  for remat in (False, True):
    for normalize, (total, count, norms), (ref_total, ref_count) in zip(
      (None, 0.1), outs[remat], refs, strict=True
    ):
      assert jax.tree.map(int, count) == jax.tree.map(int, ref_count)
      assert 0 < int(count["stack"]) < B or normalize is not None
      for a, e in zip(jax.tree.leaves(total), jax.tree.leaves(ref_total), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=2e-5, atol=2e-5)
      np.testing.assert_allclose(np.asarray(norms["stack"]), stack_norms, rtol=2e-5)


# ----------------------------------------------------------------------------
# Materialised per-example gradients (optax's DP clips)
# ----------------------------------------------------------------------------


def test_per_example_global_norm_clip_per_group_and_normalize():
  rng = np.random.default_rng(0)
  grads = {
    "a": jnp.asarray(rng.normal(size=(6, 3)), jnp.float32),
    "b": {"x": jnp.asarray(rng.normal(size=(6, 2, 2)), jnp.float32), "y": jnp.zeros((6, 1))},
  }
  clip = {"a": 1.0, "b": 0.7}  # "b" covers two leaves
  a, bx = np.asarray(grads["a"], np.float64), np.asarray(grads["b"]["x"], np.float64)
  na, nb = np.linalg.norm(a, axis=1), np.linalg.norm(bx.reshape(6, -1), axis=1)
  for normalize in (None, 0.0, 0.2):
    if normalize is None:
      wa, wb = np.minimum(1, 1.0 / na), np.minimum(1, 0.7 / nb)
      ca, cb = np.sum(na > 1.0), np.sum(nb > 0.7)
    else:
      wa, wb = 1.0 / (na + normalize), 0.7 / (nb + normalize)
      ca, cb = np.sum(na + normalize > 1.0), np.sum(nb + normalize > 0.7)
    total, count = jax.jit(
      lambda g, c, normalize=normalize: jaxclip.per_example_global_norm_clip(
        g, c, normalize=normalize
      )
    )(grads, clip)
    np.testing.assert_allclose(total["a"], wa @ a, rtol=1e-5)
    np.testing.assert_allclose(total["b"]["x"], np.einsum("b,bij->ij", wb, bx), rtol=1e-5)
    assert not np.any(np.asarray(total["b"]["y"]))
    assert (int(count["a"]), int(count["b"])) == (ca, cb)
  # A scalar bound: the result of a one-group tree, and a scalar count.
  total, count = jax.jit(jaxclip.per_example_global_norm_clip, static_argnames="normalize")(
    grads, 1.0, normalize=0.0
  )
  w = 1.0 / np.sqrt(na**2 + nb**2)
  np.testing.assert_allclose(total["a"], w @ a, rtol=1e-5)
  assert jnp.shape(count) == () and int(count) == 6


def test_per_example_global_norm_clip_per_group_sums_over_axis_name():
  """Two stand-in devices (``vmap`` with ``axis_name``) of 3 examples each give the whole
  batch's clipped sum and per-group counts on each."""
  rng = np.random.default_rng(2)
  grads = {"a": jnp.asarray(rng.normal(size=(6, 3)), jnp.float32), "b": jnp.ones((6, 2))}
  clip = {"a": 1.0, "b": 1.2}

  @jax.jit
  def both(grads):
    whole = jaxclip.per_example_global_norm_clip(grads, clip, normalize=0.1)
    split = jax.tree.map(lambda g: g.reshape((2, 3) + g.shape[1:]), grads)
    per_device = jax.vmap(
      lambda g: jaxclip.per_example_global_norm_clip(g, clip, axis_name="i", normalize=0.1),
      axis_name="i",
    )(split)
    return whole, per_device

  whole, per_device = both(grads)
  for d in range(2):
    for a, e in zip(jax.tree.leaves(per_device), jax.tree.leaves(whole), strict=True):
      np.testing.assert_allclose(np.asarray(a[d]), np.asarray(e), rtol=1e-6)
  assert int(whole[1]["b"]) == 6  # sqrt(2) + 0.1 > 1.2


def test_per_example_layer_norm_clip_normalize():
  rng = np.random.default_rng(1)
  grads = [jnp.asarray(rng.normal(size=(5, 4)), jnp.float32), jnp.zeros((5, 2))]
  total, count = jax.jit(jaxclip.per_example_layer_norm_clip, static_argnames="normalize")(
    grads, 2.0, normalize=0.1
  )
  g = np.asarray(grads[0], np.float64)
  bound = 2.0 / np.sqrt(2)  # uniform: C / sqrt(2 leaves)
  w = bound / (np.linalg.norm(g, axis=1) + 0.1)
  np.testing.assert_allclose(total[0], w @ g, rtol=1e-5)
  assert not np.any(np.asarray(total[1]))  # zero gradients stay zero
  assert int(count[0]) == int(np.sum(np.linalg.norm(g, axis=1) + 0.1 > bound))
  assert int(count[1]) == 0  # 0 + 0.1 is below the bound: scaled up, not down


# ----------------------------------------------------------------------------
# Edge cases and bad input
# ----------------------------------------------------------------------------


def _lin(w, x):
  return jnp.dot(w, x)  # gradient: the example itself


@pytest.mark.parametrize("method", ["vmap", "ghost"])
def test_normalize_edge_cases(method):
  """gamma = 0 at a zero gradient, C = 0, a tiny gradient, a non-finite one; gradients through
  the normalised sum are finite at zero."""
  # a tiny gradient is scaled up to norm C: under vmap even one whose float32 squares
  # underflow (its norm is computed scaled); ghost norms read a norm below ~1e-19 as 0 and
  # divide by at least a floor, so such an example contributes (nearly) nothing
  xs = jnp.array([[3.0, 4.0], [0.0, 0.0], [1e-10, 0.0], [1e-30, 0.0], [0.0, 0.5]])
  vmap = method == "vmap"

  @jax.jit
  def run(clip, w, xs):
    fn = jaxclip.per_example_clipped_grad(
      _lin, clip, method=method, normalize=0.0, return_num_nonfinite=True
    )
    return fn(w, xs)

  total, count, _ = run(2.0, jnp.zeros(2), xs)
  # each nonzero gradient scaled to norm 2; the zero one stays zero, not counted
  want = [1.2 + 2.0 + (2.0 if vmap else 0.0), 1.6 + 2.0]
  np.testing.assert_allclose(total, want, rtol=1e-6, atol=1e-6)
  assert int(count) == 1  # only [3, 4] (norm 5 > 2) is scaled down
  total, count, _ = run(0.0, jnp.zeros(2), xs)
  assert not np.any(np.asarray(total)) and int(count) == (4 if vmap else 3)
  total, _, num_nonfinite = run(2.0, jnp.zeros(2), xs.at[0, 0].set(jnp.nan))
  # a non-finite example contributes zero and is counted
  np.testing.assert_allclose(total, [2.0 + (2.0 if vmap else 0.0), 2.0], rtol=1e-6, atol=1e-6)
  assert int(num_nonfinite) == 1
  # the gradient of the normalised sum with respect to the data, at a zero example
  grad = jax.grad(lambda xs: jnp.sum(run(2.0, jnp.zeros(2), xs)[0]))(xs)
  assert np.all(np.isfinite(np.asarray(grad)))


@pytest.mark.parametrize(
  "clip,kwargs,match",
  [
    ({"w": 1.0, "extra": 1.0}, {}, "pytree prefix of the parameters"),
    ({"w": jnp.ones(2)}, {}, r"l2_norm_clip\['w'\]"),
    ({"w": -1.0}, {}, r"l2_norm_clip\['w'\]"),
    ({}, {}, "pytree of numbers"),
    (1.0, {"normalize": -0.1}, "normalize"),
    (float("inf"), {"normalize": 0.0}, "with normalize"),
  ],
)
def test_bad_clip_tree_and_normalize_are_refused(clip, kwargs, match):
  with pytest.raises(ValueError, match=match):
    fn = jaxclip.per_example_clipped_grad(_lin, clip, **kwargs)
    fn(
      {"w": jnp.zeros(2)}["w"] if not isinstance(clip, dict) else {"w": jnp.zeros(2)},
      jnp.ones((3, 2)),
    )


def test_ghost_plan_shows_an_input_that_mixes_clip_groups():
  params, (ids, y) = _params(), _batch()
  plan = jaxclip.ghost_plan(loss, params, ids, y, l2_norm_clip=CLIP_TREE)
  # one pull-back for the groups nothing mixes, one for each of mix.a and mix.b
  assert plan.sum_passes == 3 and "pulled back 3 times" in str(plan)
  reasons = {leaf.path: leaf.reason or "" for leaf in plan.leaves}
  assert "mixes clip groups" in reasons["['mix']['a']"]
  assert "mixes clip groups" in reasons["['mix']['b']"]
  assert not any("mixes" in r for p, r in reasons.items() if "mix" not in p)
  assert plan.rules["['layer']['w']"] == "dot"
  # one group for both: nothing mixes, one pull-back
  one = {**CLIP_TREE, "mix": 1.0}
  assert jaxclip.ghost_plan(loss, params, ids, y, l2_norm_clip=one).sum_passes == 1


@pytest.mark.parametrize("method", ["vmap", "ghost"])
def test_half_precision_leaves_sum_in_float32_and_norms_are_float32(method):
  params = {"w": jnp.array([0.5, -1.0, 2.0], jnp.bfloat16), "b": jnp.array(0.25, jnp.float16)}
  xs = jnp.array([[3.0, 4.0, 0.0], [0.0, 1.0, 0.0], [6.0, 8.0, 1.0]])

  def affine(p, x):  # gradients: x for w, 3 for b
    return jnp.dot(p["w"].astype(jnp.float32), x) + 3.0 * p["b"].astype(jnp.float32)

  clip = {"w": 2.0, "b": 1.0}
  fn = jaxclip.per_example_clipped_grad(
    affine, clip, method=method, normalize=0.01, return_norms=True
  )
  total, count, norms = jax.jit(fn)(params, xs)
  # float32 sums for bfloat16 and float16 leaves: the noise is added before any rounding
  assert total["w"].dtype == total["b"].dtype == jnp.float32
  assert norms["w"].dtype == norms["b"].dtype == jnp.float32
  x = np.asarray(xs, np.float64)
  nw = np.linalg.norm(x, axis=1)
  np.testing.assert_allclose(np.asarray(norms["w"]), nw, rtol=1e-6)
  np.testing.assert_allclose(np.asarray(total["w"], np.float32), (2.0 / (nw + 0.01)) @ x, rtol=1e-2)
  np.testing.assert_allclose(float(total["b"]), 3 * 3.0 / 3.01, rtol=1e-3)
  assert (int(count["w"]), int(count["b"])) == (2, 3)


def test_a_group_without_leaves_has_norm_zero_under_both_methods():
  params = {"a": jnp.ones(2), "z": None, "m": {}}  # "z" and "m": groups of no leaf
  xs = jnp.array([[3.0, 4.0], [0.0, 1.0]])
  clip = {"a": 1.0, "z": 2.0, "m": 0.5}
  for method in ("vmap", "ghost"):
    fn = jaxclip.per_example_clipped_grad(
      lambda p, x: jnp.dot(p["a"], x), clip, method=method, return_norms=True
    )
    total, count, norms = jax.jit(fn)(params, xs)
    np.testing.assert_allclose(total["a"], [0.6, 1.8], rtol=1e-6)
    assert (int(count["a"]), int(count["z"]), int(count["m"])) == (1, 0, 0)
    assert not np.any(np.asarray(norms["z"])) and not np.any(np.asarray(norms["m"]))


def test_float16_ghost_book_keeping_stays_in_range_with_normalize():
  """gamma = 0 weights a nearly-zero gradient by about 1e6: book-kept through float16 output
  gradients, that is scaled into float16's range and back (it overflowed to inf before)."""
  w = jnp.ones((2, 2), jnp.float16)
  xs = jnp.array([[1.0, 0.5], [1e-6, 0.0], [0.0, 2.0]], jnp.float16)
  f16_loss = lambda w, x: jnp.sum(x @ w).astype(jnp.float32)
  for clip in (1.0, {"w": 1.0}):
    params = w if not isinstance(clip, dict) else {"w": w}
    loss_fn = f16_loss if not isinstance(clip, dict) else (lambda p, x: f16_loss(p["w"], x))
    ref, got = (
      jax.jit(jaxclip.per_example_clipped_grad(loss_fn, clip, method=m, normalize=0.0))(params, xs)[
        0
      ]
      for m in ("vmap", "ghost")
    )
    for a, e in zip(jax.tree.leaves(got), jax.tree.leaves(ref), strict=True):
      assert a.dtype == jnp.float32 and np.all(np.isfinite(np.asarray(a, np.float32)))
      np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(e, np.float32), rtol=2e-3)
