"""Each layout the ghost engine reads of JAX's jaxprs, read on the installed jax (issue #52).

:mod:`jaxclip.privacy._ghost._jaxpr._internals` is the one place that knows how JAX
spells its primitives and their parameters; each layout is behind one
accessor there. A JAX release that renames or reshapes one of them makes the
engine fall back to ``method="vmap"`` (still exact, but without its rules):
these tests make the change fail under a name instead. Each traces a small
known program (``jax.make_jaxpr``, nothing compiled) and checks what the
accessor reads of it against what the program is known to hold. The changes
met so far:

* jax 0.11 replaced ``lax.scan``'s ``num_consts``/``num_carry`` by a flat tree
  of three groups, ``ft_in`` (consts, carries, xs): :func:`_jax.scan_counts`;
* jax 0.11 made the bodies of ``jit``, ``scan`` and the custom derivatives
  ``Jaxpr`` s (constants hoisted among the inputs) where jax 0.10 had
  ``ClosedJaxpr`` s: :func:`_jax.closed`, through :func:`_jax.call_body` and
  :func:`_jax.scan_parts`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxclip.privacy._ghost._jaxpr import _internals as _jax


def _eqns(fn, *args):
  """The top-level equations of ``fn``'s jaxpr, by primitive name (the last of each name)."""
  return {_jax.name(e): e for e in jax.make_jaxpr(fn)(*args).eqns}


def _scan_of(fn, *args):
  (eqn,) = [e for e in jax.make_jaxpr(fn)(*args).eqns if _jax.is_scan(e)]
  return eqn


W, V = jnp.ones((3, 3)), jnp.full((3, 3), 0.5)
STACK, H0 = jnp.ones((4, 3, 3)), jnp.ones(3)


def _two_consts_two_carries(w, v, stack, h):
  def step(carry, layer):  # w and v are closed over: the scan's consts
    h, n = carry
    return (jnp.tanh(h @ layer @ w) @ v, n + 1.0), h

  return jax.lax.scan(step, (h, 0.0), stack, reverse=True, unroll=2)


def test_scan_counts_split_consts_carries_and_xs():
  eqn = _scan_of(_two_consts_two_carries, W, V, STACK, H0)
  assert len(eqn.invars) == 5  # w, v | h, n | stack
  assert _jax.scan_counts(eqn) == (2, 2)
  parts = _jax.scan_parts(eqn)
  assert parts is not None, eqn.params.keys()
  assert (parts.num_consts, parts.num_carry, parts.length) == (2, 2, 4)
  assert parts.reverse is True and parts.unroll == 2
  assert _jax.unreadable(eqn) is None


def test_scan_counts_with_no_consts_and_several_xs():
  def fn(h, xs, ys):
    return jax.lax.scan(lambda c, x: (c + x[0] * x[1], c), h, (xs, ys))

  eqn = _scan_of(fn, H0, jnp.ones((5, 3)), jnp.ones((5, 3)))
  assert _jax.scan_counts(eqn) == (0, 1)
  assert _jax.scan_parts(eqn).length == 5


def test_scan_body_is_a_closed_jaxpr_of_the_equations_inputs():
  eqn = _scan_of(_two_consts_two_carries, W, V, STACK, H0)
  body = _jax.scan_parts(eqn).body
  assert len(body.jaxpr.invars) == len(eqn.invars)
  assert len(body.jaxpr.outvars) == len(eqn.outvars)  # carries, then ys
  outs = jax.core.eval_jaxpr(body.jaxpr, body.consts, W, V, H0, 0.0, STACK[0])
  np.testing.assert_allclose(outs[0], jnp.tanh(H0 @ STACK[0] @ W) @ V, rtol=1e-6)


def test_a_scan_whose_layout_is_gone_is_unreadable(monkeypatch):
  eqn = _scan_of(_two_consts_two_carries, W, V, STACK, H0)
  monkeypatch.setattr(_jax, "_SCAN_COUNTS", ("num_consts_gone", "num_carry_gone"))
  monkeypatch.setattr(_jax, "_SCAN_FLAT_TREE", "ft_in_gone")
  assert _jax.scan_counts(eqn) is None and _jax.scan_parts(eqn) is None
  assert "cannot read the parameters of `scan`" in _jax.unreadable(eqn)


def test_call_body_reads_jit():
  eqns = _eqns(lambda w, x: jax.jit(lambda w, x: jnp.sin(x @ w))(w, x), W, H0)
  (eqn,) = [e for n, e in eqns.items() if n in _jax.CALLS]  # `jit` (`pjit` before jax 0.7)
  jaxpr, consts = _jax.call_body(eqn)
  assert [_jax.name(e) for e in jaxpr.eqns] == ["dot_general", "sin"] and consts == []
  assert not _jax.is_remat(eqn) and _jax.unreadable(eqn) is None


def test_call_body_and_options_of_checkpoint():
  policy = jax.checkpoint_policies.nothing_saveable
  fn = jax.checkpoint(lambda w, x: jnp.sin(x @ w), policy=policy, prevent_cse=False)
  (eqn,) = [e for n, e in _eqns(fn, W, H0).items() if n in _jax.CALLS]
  assert _jax.is_remat(eqn)
  assert _jax.remat_options(eqn) == {"prevent_cse": False, "policy": policy}
  jaxpr, _ = _jax.call_body(eqn)
  assert [_jax.name(e) for e in jaxpr.eqns] == ["dot_general", "sin"]


def test_custom_derivatives_are_known_and_applied_whole():
  @jax.custom_jvp
  def f(x):
    return jnp.sin(x)

  f.defjvp(lambda p, t: (f(p[0]), jnp.cos(p[0]) * t[0]))

  @jax.custom_vjp
  def g(x):
    return jnp.sin(x)

  g.defvjp(lambda x: (g(x), x), lambda x, c: (jnp.cos(x) * c,))
  for fn in (f, g):
    (eqn,) = [e for e in jax.make_jaxpr(fn)(H0).eqns if _jax.sub_jaxprs(e)]
    assert _jax.name(eqn) in _jax.OPAQUE and _jax.unreadable(eqn) is None, _jax.name(eqn)
    np.testing.assert_allclose(_jax.bind(eqn, [H0])[0], jnp.sin(H0), rtol=1e-6)


def test_closed_takes_either_kind_of_body():
  closed = jax.make_jaxpr(jnp.sin)(H0)
  assert _jax.closed(closed) is closed
  assert _jax.closed(closed.jaxpr).jaxpr is closed.jaxpr and _jax.closed(closed.jaxpr).consts == []
  assert _jax.closed("not a jaxpr") is None


_MATMUL = (((1,), (0,)), ((), ()))  # (contracting, batch) dimensions of a matrix product


@pytest.mark.parametrize(
  "fn, args, read, expected",
  [
    (lambda a, b: a @ b, (jnp.ones((2, 3)), W), _jax.dot_dimension_numbers, _MATMUL),
    (lambda a: a.T, (jnp.ones((2, 3)),), _jax.transpose_permutation, (1, 0)),
    (lambda a: jnp.squeeze(a, 1), (jnp.ones((2, 1, 3)),), _jax.squeeze_dimensions, (1,)),
  ],
  ids=["dot_general", "transpose", "squeeze"],
)
def test_first_order_parameters(fn, args, read, expected):
  (eqn,) = jax.make_jaxpr(fn)(*args).eqns
  got = read(eqn)
  assert got is not None, (_jax.name(eqn), eqn.params.keys())
  assert jax.tree.map(int, tuple(got)) == expected


def test_slice_gather_and_conv_parameters():
  (eqn,) = jax.make_jaxpr(lambda a: jax.lax.slice(a, (0, 1), (2, 3)))(jnp.ones((2, 3))).eqns
  start, limit, _ = _jax.slice_bounds(eqn)
  assert (tuple(start), tuple(limit)) == ((0, 1), (2, 3)) and _jax.is_view(eqn)
  gathers = [
    e
    for e in jax.make_jaxpr(lambda t, i: t[i])(jnp.ones((5, 3)), jnp.array([1, 4])).eqns
    if _jax.name(e) == _jax.GATHER
  ]
  parts = _jax.gather_parts(gathers[0])
  assert parts is not None and parts.slice_sizes == (1, 3) and isinstance(parts.mode, str)
  conv = jax.make_jaxpr(
    lambda x, k: jax.lax.conv_general_dilated(x, k, (2, 1), "SAME", rhs_dilation=(1, 2))
  )(jnp.ones((1, 2, 6, 6)), jnp.ones((4, 2, 3, 3)))
  (eqn,) = [e for e in conv.eqns if _jax.name(e) == _jax.CONV]
  parts = _jax.conv_parts(eqn)
  assert parts is not None and tuple(parts.window_strides) == (2, 1)
  assert tuple(parts.rhs_dilation) == (1, 2) and parts.feature_group_count == 1
