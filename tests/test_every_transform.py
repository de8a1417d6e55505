"""Checks generated from ``jaxclip.__all__``: every transform, including ones added later.

Every public factory of an optax ``GradientTransformation`` is built from the
small table of ``workloads/every.py`` (only where a required argument exists); a new public
function that is neither in the table, nor buildable with no arguments, nor
listed as not being a transform factory fails :func:`test_the_table_builds_every_factory`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax
import pytest

import jaxclip
from workloads import every, trees

NOT_TRANSFORMS, REQUIRED = every.NOT_TRANSFORMS, every.REQUIRED
FACTORIES = every.factories()
build = every.build


def test_the_table_builds_every_factory():
  assert len(FACTORIES) >= 15
  for name in FACTORIES:
    tx = build(name)
    assert isinstance(tx, optax.GradientTransformation), name
  assert set(REQUIRED) <= set(FACTORIES)


@functools.cache
def _tree(leaves: int) -> dict:
  """``leaves`` float32 leaves of mixed 1-D and 2-D shapes, as shapes only (nothing is run)."""
  shapes = trees.many_leaf_shapes(leaves, mixed=True)
  return {k: jax.ShapeDtypeStruct(v, jnp.float32) for k, v in shapes.items()}


def _jaxpr_eqns(tx: optax.GradientTransformation, leaves: int) -> int:
  """Equations in the jaxpr of ``tx.update`` on ``leaves`` leaves of mixed shapes (traced only)."""
  tree = _tree(leaves)
  jaxpr = jax.make_jaxpr(tx.update)(tree, jax.eval_shape(tx.init, tree), tree)
  return every.count_eqns(jaxpr.jaxpr)


# The benchmark (python -m benchmarks --only transforms, benchmarks/results/compile.md)
# times the XLA compiles at 400 and 5,000 leaves; this test bounds what cannot
# flake at the 400 leaves: op counts, which grow with the square of
# the leaf count when something per leaf reads a value made from every leaf
# (the way AdaGC once took minutes at 400 leaves).
# At most this many times the jaxpr of adam's own update, chained. (jax 0.10.0
# traces jnp.stack of n scalars as n + 1 equations, 0.10.1 on as one `stack`:
# adaptive_norm_scale is 5.13x adam there, 4.84x on jax 0.10.2.)
# The overflow rescue of per-leaf norms (issue #51) is written per leaf for
# platforms other than CPU (no stacks or segments there; one lax.cond per tree,
# measured on an H200 in benchmarks/results/gpu.md), and a jaxpr holds every platform's
# branch: adaptive_norm_scale reads 15.6x, adagc 14.9x, record_norms 11.4x.
_JAXPR_BOUND = 16
# Four times the leaves at most this many times the ops (linear, with slack: on
# jax 0.10.2 every factory reads 3.06-3.98x from 100 to 400 leaves, dp_noise the most).
_GROWTH_BOUND = 4.25


def test_every_transform_chained_with_adam_stays_linear_in_the_leaves():
  """``chain(t, adam).update``'s jaxpr equations on 100 and 400 leaves of mixed shapes.

  Traced from shapes only, so cheap enough for every factory. What XLA's
  fusion copies into every leaf's kernel does not show in a jaxpr: the
  benchmark's compile table times that (an XLA compile of every factory
  at 400 leaves costs minutes on a 2-core machine, too much for the suite).
  """
  # A chain's jaxpr is its parts' jaxprs in turn: chain(t, adam)'s equations are t's plus
  # adam's, so adam is traced once.
  adam = {n: _jaxpr_eqns(optax.adam(1e-3), n) for n in (100, 400)}
  heavy, superlinear = {}, {}
  for name in FACTORIES:
    small, large = (_jaxpr_eqns(build(name), n) + adam[n] for n in (100, 400))
    if large > _JAXPR_BOUND * adam[400]:
      heavy[name] = f"{large / adam[400]:.2f}x adam's {adam[400]} jaxpr equations"
    if large > _GROWTH_BOUND * small:
      superlinear[name] = f"jaxpr {small} -> {large} equations from 100 to 400 leaves"
  assert not heavy, heavy
  assert not superlinear, superlinear


@pytest.mark.parametrize("container", [tuple, list])
def test_every_state_keeps_its_structure_under_scan(container):
  """The state of ``init(tuple)`` stays a scan carry when the updates come as a list.

  As optax's own transforms do: the state's structure is that of init's
  params, whatever container the updates come in.
  """
  other = list if container is tuple else tuple
  params = container([jnp.ones((2, 3)), jnp.full(4, 2.0)])
  grads = jnp.stack([jnp.ones(6), jnp.full(6, 3.0)])
  broken = {}
  for name in FACTORIES:
    tx = build(name)
    init = tx.init(params)

    def body(state, g, tx=tx):
      updates = other([g.reshape(2, 3), g[:4]])
      out, state = tx.update(updates, state, updates)
      return state, jax.tree.leaves(out)

    try:
      state, _ = jax.lax.scan(body, init, grads)
    except TypeError as e:
      broken[name] = str(e).splitlines()[0]
      continue
    assert jax.tree.structure(state) == jax.tree.structure(init), name
  assert not broken, broken


# ---------------------------------------------------------------- bad inputs

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from jaxclip import ops  # noqa: E402

FUZZ = settings(max_examples=12, deadline=None)
_BAD_LEAVES = st.sampled_from(["hello", b"bytes", object(), {1, 2}, "1.0"])


def _keeps_per_leaf_state(tx: optax.GradientTransformation) -> bool:
  """Whether ``tx``'s state grows with the params' leaves (so it knows their paths).

  By the state's entries: a per-leaf statistic may be one vector (``LeafStats``).
  """

  def entries(params):
    return sum(jnp.size(x) for x in jax.tree.leaves(tx.init(params)))

  return entries({"w": jnp.ones(3), "b": jnp.ones(2)}) > entries({"w": jnp.ones(3)})


def _names_leaf(error: Exception, where: str) -> bool:
  return where in str(error)


@pytest.mark.parametrize("name", FACTORIES)
@FUZZ
@given(bad=_BAD_LEAVES)
def test_a_leaf_that_is_no_number_is_refused_naming_its_path(name, bad):
  tx = build(name)
  good = {"w": jnp.ones(3)}
  with pytest.raises(TypeError) as e:
    tx.update({"w": jnp.ones(3), "bad": bad}, tx.init(good), good)
  # Refused before tracing, by a check that names the leaf (not a raw dtype error).
  assert _names_leaf(e.value, "['bad']") or "state" in str(e.value), (name, str(e.value))


@pytest.mark.parametrize("name", FACTORIES)
def test_updates_of_another_structure_than_init_are_refused_or_harmless(name):
  """Fewer, more or renamed leaves than init had.

  A transform whose state has one entry per leaf must refuse them, naming
  the path; any other one must treat the updates as they come.
  """
  tx = build(name)
  params = {"w": jnp.ones(3), "b": jnp.full(2, 2.0)}
  state = tx.init(params)
  cases = {
    "['b']": {"w": jnp.ones(3)},  # fewer
    "['c']": {"w": jnp.ones(3), "b": jnp.ones(2), "c": jnp.ones(2)},  # more
    "['c'] ": {"w": jnp.ones(3), "c": jnp.ones(2)},
  }  # renamed
  per_leaf = _keeps_per_leaf_state(tx)
  for where, updates in cases.items():
    if per_leaf and not (name == "record_norms" and where == "['b']"):
      with pytest.raises(ValueError, match=__import__("re").escape(where.strip())):
        tx.update(updates, state, updates)
    else:
      out, _ = tx.update(updates, state, updates)
      assert jax.tree.structure(out) == jax.tree.structure(updates), (name, where)


@pytest.mark.parametrize("name", FACTORIES)
def test_complex_leaves_are_clipped_or_refused(name):
  tx = build(name)
  tree = {"w": jnp.array([3 + 4j, 0j], jnp.complex64)}
  try:
    out, _ = tx.update(tree, tx.init(tree), tree)
  except TypeError as e:
    assert "['w']" in str(e) or "complex" in str(e), (name, str(e))
  else:
    assert out["w"].dtype == jnp.complex64 and bool(jnp.all(jnp.isfinite(out["w"]))), name


@FUZZ
@given(
  shape=st.lists(st.integers(1, 3), min_size=1, max_size=2),
  bad=st.one_of(_BAD_LEAVES, st.sampled_from([1 + 2j, True])),
)
def test_ops_refuse_bad_leaves_and_a_use_norm_that_is_no_real_scalar(shape, bad):
  tree = {"w": jnp.ones(3), "bad": bad}
  for fn, args in (
    (ops.global_norm, ()),
    (ops.clip_by_global_norm, (1.0,)),
    (ops.clip_by_norm, (1.0,)),
    (ops.clip_by_average_norm, (1.0,)),
    (ops.clip_by_value, (-1.0, 1.0)),
  ):
    if isinstance(bad, (complex, bool)):
      continue
    with pytest.raises(TypeError, match=r"\['bad'\]"):
      fn(tree, *args)
  with pytest.raises(ValueError, match="use_norm"):
    ops.clip_by_global_norm([jnp.ones(3)], 1.0, use_norm=jnp.ones(shape))
  if isinstance(bad, (str, bytes, complex)):
    with pytest.raises(TypeError, match="use_norm"):
      ops.clip_by_global_norm([jnp.ones(3)], 1.0, use_norm=bad)


@pytest.mark.parametrize("method", ["vmap", "ghost"])
def test_a_loss_that_is_no_real_scalar_is_refused_under_both_methods(method):
  params, x = {"w": jnp.ones(3)}, jnp.ones((4, 3))
  losses = {
    "float32[3]": lambda p, x: p["w"] * x,
    "int32[]": lambda p, x: jnp.sum(p["w"] * x).astype(jnp.int32),
  }
  for shown, loss in losses.items():
    with pytest.raises(
      ValueError, match=r"loss_fn to return a real scalar.*" + __import__("re").escape(shown)
    ):
      jaxclip.per_example_clipped_grad(loss, 1.0, batch_argnums=1, method=method)(params, x)


# ------------------------------------------------- hyperparameters, checked once

from jaxclip._kernel import _validation  # noqa: E402

# Every check of a hyperparameter (the leaves' and the state's are update's own).
_CHECKS = [
  (_validation, fn)
  for fn in ("check_hparam", "check_bounds", "check_scalar", "check_size", "check_ord", "check_key")
]


@pytest.mark.parametrize("name", FACTORIES)
def test_hyperparameters_are_checked_when_built_not_on_every_update(name, monkeypatch):
  """A transform checks its hyperparameters in its factory; ``update`` checks none again.

  (The ``ops`` functions check theirs on every call: they have no factory.)
  """
  tx = build(name)
  params = {"w": jnp.ones((2, 3)), "b": jnp.full(3, 2.0)}
  state = tx.init(params)
  calls: list[str] = []
  for module, fn in _CHECKS:
    real = getattr(module, fn)
    monkeypatch.setattr(
      module, fn, lambda *a, _fn=fn, _real=real, **k: (calls.append(_fn), _real(*a, **k))[1]
    )
  jax.make_jaxpr(tx.update)(params, state, params)  # the checks run as update is traced
  assert not calls, f"{name}'s update checked {sorted(set(calls))} again"


def test_the_ops_still_check_their_arguments_on_every_call():
  tree = {"w": jnp.array([3.0, 4.0])}
  with pytest.raises(ValueError, match="clip_norm must be non-negative"):
    ops.clip_by_norm(tree, -1.0)
  with pytest.raises(ValueError, match="clip_norm must be non-negative"):
    ops.clip_by_average_norm(tree, -1.0)
  with pytest.raises(ValueError, match="clip_norm must be non-negative"):
    ops.clip_by_global_norm(tree, -1.0)
  with pytest.raises(ValueError, match="must not exceed"):
    ops.clip_by_value(tree, 2.0, 1.0)


class _Compiles:
  """Counts XLA compiles (jax's backend-compile events) while it is entered."""

  _EVENT = "/jax/core/compile/backend_compile_duration"

  def __enter__(self):
    self.count = 0
    jax.monitoring.register_event_duration_secs_listener(self._listen)
    return self

  def _listen(self, event, duration, **kwargs):
    del duration, kwargs
    if event == self._EVENT:
      self.count += 1

  def __exit__(self, *exc):
    jax.monitoring.unregister_event_duration_listener(self._listen)


def _eager_calls():
  """``(name, call)`` for every transform's ``update``, every op and the per-example and unitwise
  functions, each called eagerly (no jit)."""
  grads = {"w": jnp.full((4, 3), 0.5), "b": jnp.full((3,), 2.0), "s": jnp.float32(3.0)}
  calls = []
  for name in FACTORIES:
    tx = build(name)
    state = tx.init(grads)
    calls.append((name, functools.partial(tx.update, grads, state, grads)))
  for name in ops.__all__:
    args = (-1.0, 1.0) if name == "clip_by_value" else () if name == "global_norm" else (1.0,)
    calls.append((f"ops.{name}", functools.partial(getattr(ops, name), grads, *args)))
  per_example = {"w": jnp.full((5, 4, 3), 0.5), "b": jnp.full((5, 3), 2.0)}  # 5 examples
  w_norm = jaxclip.unitwise_norm(grads["w"])
  for name in ("per_example_global_norm_clip", "per_example_layer_norm_clip"):
    calls.append((name, functools.partial(getattr(jaxclip, name), per_example, 1.0)))
  calls.append(("unitwise_norm", functools.partial(jaxclip.unitwise_norm, grads["w"])))
  unitwise_clip = functools.partial(jaxclip.unitwise_clip, w_norm, 0.1 * w_norm, grads["w"])
  calls.append(("unitwise_clip", unitwise_clip))
  return calls


def test_every_transform_and_op_called_eagerly_compiles_nothing_the_second_time():
  """Called eagerly, an ``update`` (or an op) compiles on its first call only.

  jax compiles each primitive the first time it sees its shapes, and reuses it
  after. A ``lax.cond`` called eagerly is compiled at every call (its branches
  are traced anew): the overflow rescue's made every eager call of a per-leaf or
  global norm compile, about half a second each on XLA:CPU, against optax's 2 ms.
  """
  recompiled = {}
  for name, call in _eager_calls():
    jax.block_until_ready(call())
    with _Compiles() as compiles:
      jax.block_until_ready(call())
    if compiles.count:
      recompiled[name] = compiles.count
  assert not recompiled, f"compiled again on a second eager call (compiles): {recompiled}"
