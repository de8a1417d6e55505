"""The convolution rule, and a convolution's kernel gradient taken tap by tap (issue #39).

Equinox and flax linen convolutions with stride, padding, dilation and
feature groups get the ``conv`` rule; an example's kernel gradient formed
tap by tap (``jaxclip/privacy/_conv_taps.py``) equals ``jax.vjp``'s in
every layout, ghost's sums and norms with it equal vmap's, and its program
lowers for GPU and TPU. Against ``method="vmap"`` at the median norm
(``tests.ghost_helpers.compare``).
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxclip
from jaxclip.privacy import _ghost
from jaxclip.privacy._ghost._jaxpr import _internals as _jax
from jaxclip.privacy._ghost._rules import _conv_taps, _scaling
from tests.ghost_helpers import compare as _compare


def test_conv_rule_with_stride_padding_dilation_and_feature_groups():
  import flax.linen as linen

  ks = jax.random.split(jax.random.key(0), 6)
  convs = [
    eqx.nn.Conv2d(4, 6, 3, stride=2, padding=1, groups=2, key=ks[0]),  # kernel gradient
    eqx.nn.Conv2d(6, 8, (3, 2), dilation=(2, 1), padding=((2, 1), (0, 1)), key=ks[1]),
    eqx.nn.Conv2d(8, 8, 3, stride=2, key=ks[2]),
  ]  # 4 positions: the Gram form
  params, static = eqx.partition(convs, eqx.is_inexact_array)

  def loss(p, image):
    h = image
    for conv in eqx.combine(p, static):
      h = jnp.tanh(conv(h))
    return jnp.sum(jnp.sin(h))

  images = jax.random.normal(ks[3], (8, 4, 9, 9))
  _compare(loss, params, images, batch_argnums=1, rtol=1e-4)
  plan = jaxclip.ghost_plan(loss, params, images, batch_argnums=1)
  assert [leaf.rule for leaf in plan.leaves] == ["conv", "instantiate"] * 3

  class Net(linen.Module):  # NHWC, "SAME" padding, kernel dilation, depthwise-style groups
    @linen.compact
    def __call__(self, x):
      x = linen.GroupNorm(num_groups=2)(linen.Conv(8, (3, 3), strides=2, padding="SAME")(x))
      x = linen.Conv(8, (3, 3), feature_group_count=4, kernel_dilation=2, padding="VALID")(
        jax.nn.relu(x)
      )
      return jnp.sum(x**2)

  net = Net()
  xs = jax.random.normal(ks[4], (8, 12, 12, 4))
  params = net.init(ks[5], xs[0])["params"]
  loss = lambda p, x: net.apply({"params": p}, x)
  _compare(loss, params, xs, batch_argnums=1, rtol=1e-4)
  rules = jaxclip.ghost_plan(loss, params, xs, batch_argnums=1).rules
  assert rules["['Conv_0']['kernel']"] == rules["['Conv_1']['kernel']"] == "conv"


@pytest.mark.parametrize(
  "lhs_shape, rhs_shape, dn, kwargs, fits",
  [  # the zoo CNN's first layer (patches larger than the input), NCHW dilated, 1-D, 1 x 1
    (
      (1, 10, 10, 3),
      (3, 3, 3, 16),
      ("NHWC", "HWIO", "NHWC"),
      dict(strides=(2, 2), pad=((0, 1),) * 2),
      True,
    ),
    (
      (1, 2, 6, 5),
      (3, 2, 2, 3),
      ("NCHW", "OIHW", "NCHW"),
      dict(strides=(1, 2), pad=((1, 0), (2, -1)), lhs_dil=(2, 1), rhs_dil=(1, 2)),
      False,
    ),
    ((2, 7, 3), (3, 3, 2), ("NWC", "WIO", "NWC"), dict(strides=(1,), pad=((1, 1),)), False),
    (
      (1, 6, 6, 4),
      (1, 1, 4, 5),
      ("NHWC", "HWIO", "NHWC"),
      dict(strides=(2, 2), pad=((0, 0),) * 2),
      True,
    ),
  ],
)
def test_conv_kernel_gradient_tap_by_tap_equals_the_vjp(lhs_shape, rhs_shape, dn, kwargs, fits):
  """Issue #39 (the CNN's memory): an accumulated convolution's per-example kernel gradient
  taken tap by tap, in any layout, equals ``jax.vjp``'s; a NaN in one example's output
  gradient reaches no other example (the zeros that order the work are shared by the
  examples)."""

  def conv(x, k):
    return jax.lax.conv_general_dilated(
      x,
      k,
      kwargs["strides"],
      kwargs["pad"],
      kwargs.get("lhs_dil"),
      kwargs.get("rhs_dil"),
      dimension_numbers=dn,
      precision=jax.lax.Precision.HIGHEST,
    )

  n = 3
  kx, kk, kg = jax.random.split(jax.random.key(0), 3)
  xs = jax.random.normal(kx, (n, *lhs_shape))
  k = jax.random.normal(kk, rhs_shape)
  (eqn,) = jax.make_jaxpr(conv)(xs[0], k).eqns
  parts = _jax.conv_parts(eqn)
  assert _conv_taps.patches_fit(eqn, parts) == fits  # the others: here for their layouts
  gs = jax.random.normal(kg, (n, *eqn.outvars[0].aval.shape))
  gs = gs.at[0].set(gs[0].at[(0,) * gs[0].ndim].set(jnp.nan))
  got = jax.jit(jax.vmap(lambda x, g: _conv_taps.kernel_gradient(parts, k, x, g)))(xs, gs)
  ref = jax.vmap(lambda x, g: jax.vjp(lambda k: conv(x, k), k)[1](g)[0])(xs, gs)
  assert got.shape == (n, *rhs_shape)
  assert np.isnan(np.asarray(got[0])).any()
  np.testing.assert_allclose(got[1:], ref[1:], rtol=1e-5, atol=1e-5)


def _strided_conv_loss(p, x, y):
  h = jax.lax.conv_general_dilated(
    x[None], p["k"], (2, 2), ((0, 1), (0, 1)), dimension_numbers=("NHWC", "HWIO", "NHWC")
  )
  h = jax.nn.relu(h + p["b"])
  return jnp.sum((h.reshape(-1) @ p["w"] - y) ** 2)


def _strided_conv_problem():
  """The CNN's first layer at a small size: params, images, targets."""
  keys = jax.random.split(jax.random.key(1), 4)
  params = {
    "k": 0.3 * jax.random.normal(keys[0], (3, 3, 3, 16)),
    "b": jnp.zeros(16),
    "w": 0.1 * jax.random.normal(keys[1], (8 * 8 * 16, 2)),
  }
  x = jax.random.normal(keys[2], (6, 16, 16, 3))
  y = jax.random.normal(keys[3], (6, 2))
  return params, x, y


def test_strided_conv_whose_kernel_gradient_is_taken_tap_by_tap_matches_vmap():
  """The kernel's per-example gradient is formed in the backward pass, tap by tap
  (:func:`test_conv_kernel_gradient_tap_by_tap_equals_the_vjp`), and ghost's sums and norms
  equal vmap's."""
  params, x, y = _strided_conv_problem()
  traced = _ghost.trace(_strided_conv_loss, params, [x, y], [0, 1], has_aux=False)
  inputs = _ghost.inputs_for(traced, None)
  (u,) = [u for u, s in enumerate(traced.plan.sites) if s.name == "conv_general_dilated"]
  assert u in inputs.accumulated
  assert _conv_taps.patches_fit(traced.plan.sites[u].eqn, _jax.conv_parts(traced.plan.sites[u].eqn))
  _compare(_strided_conv_loss, params, x, y, batch_argnums=(1, 2))


@pytest.mark.hlo
@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_tap_by_tap_conv_gradient_lowers_for_gpu_and_tpu(platform, monkeypatch):
  # The zero that orders the taps (a custom_vmap) lowers for every platform, and the
  # program carries none of the kernel's XLA:CPU workarounds. The Gram form's two-stage sum
  # keeps its barrier on every platform (its rounding bound counts the stages): left out here.
  monkeypatch.setattr(_scaling, "staged", lambda x: x)
  params, x, y = _strided_conv_problem()
  fn = jaxclip.per_example_clipped_grad(
    _strided_conv_loss, 1.0, batch_argnums=(1, 2), method="ghost"
  )
  text = jax.export.export(jax.jit(fn), platforms=(platform,))(params, x, y).mlir_module()
  assert "stablehlo.optimization_barrier" not in text
  assert "stablehlo.convolution" in text
