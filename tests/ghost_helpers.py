"""Helpers of the ghost engine's tests, ``tests/test_ghost_*.py``: a file a rule or stage.

* ``test_ghost_models.py``: ghost against vmap on each kind of model;
* ``test_ghost_rules.py``: the ``dot`` and lookup rules, and the exact fallback;
* ``test_ghost_tied.py``: an embedding table tied to an output head;
* ``test_ghost_conv.py``: the convolution rule and the tap-by-tap kernel gradient;
* ``test_ghost_cancel.py``: every rule on generated examples whose rows cancel
  (``tests/ghost_cancel.py``, ``tests/ghost_cancel_cases.py``);
* ``test_ghost_scan.py``: ``lax.scan`` and rematerialised (two-pass) plans;
* ``test_ghost_plan.py``: ``ghost_plan``'s report and ``method="auto"``'s choice;
* ``test_ghost_options.py``: ``per_example_clipped_grad``'s arguments, dtypes and refusals;
* ``test_ghost_multi_device.py``: 8 devices;
* ``test_ghost_internals.py``: the engine's reading of JAX internals;
* ``test_ghost_zoo.py``: the zoo's models.

:func:`compare` runs ghost (or ``"auto"``) against vmap at the median norm, so that some
examples are clipped and some are not; :func:`plan` is the engine's static plan of one
example's loss; :func:`gpt_loss` is a GPT-like model with a tied head. The test files bind
them to private names (``_compare``, ``_plan``, ``_gpt_params``, ``_tokens``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import jaxclip
from jaxclip.privacy import _ghost
from jaxclip.privacy._ghost import _planning
from jaxclip.privacy._ghost._jaxpr import _walk


def compare(
  loss_fn, params, *args, rtol=2e-5, atol=1e-6, method_="ghost", variants=({},), **kwargs
):
  """Runs ``method_`` and vmap at the median norm; returns ``(got, ref)`` of the last variant.

  Each of ``variants`` overrides ``kwargs`` (and ``loss_fn``) on the ``method_`` side only: one
  compiled vmap reference checks a loss with and without remat, or with and without microbatches.
  """

  @jax.jit  # the reference, compiled once: the clip is traced
  def vmap(clip, *a):
    return jaxclip.per_example_clipped_grad(loss_fn, clip, return_norms=True, **kwargs)(*a)

  norms = vmap(1.0, params, *args)[2]
  clip = float(np.median(np.asarray(norms)))
  ref = vmap(clip, params, *args)
  n = norms.shape[0]
  assert 0 < int(ref[1]) < n, (int(ref[1]), n)  # some clipped, some not
  for variant in variants:
    options = dict(kwargs, **variant)
    fn = options.pop("loss_fn", loss_fn)
    got = jax.jit(
      jaxclip.per_example_clipped_grad(fn, clip, method=method_, return_norms=True, **options)
    )(params, *args)
    assert int(got[1]) == int(ref[1]), variant
    np.testing.assert_allclose(np.asarray(got[2]), np.asarray(ref[2]), rtol=rtol, atol=atol)
    assert jax.tree.structure(got[0]) == jax.tree.structure(ref[0])
    for a, e in zip(jax.tree.leaves(got[0]), jax.tree.leaves(ref[0]), strict=True):
      assert a.shape == e.shape and a.dtype == e.dtype
      scale = float(np.max(np.abs(np.asarray(e, np.float32)))) or 1.0
      np.testing.assert_allclose(
        np.asarray(a, np.float32), np.asarray(e, np.float32), rtol=rtol, atol=atol + rtol * scale
      )
  return got, ref


def plan(loss_fn, params, *example):
  leaves, tree = jax.tree.flatten(params)
  closed = jax.make_jaxpr(lambda ls, *xs: loss_fn(jax.tree.unflatten(tree, ls), *xs))(
    leaves, *example
  )
  infos = _ghost.input_infos([x.ndim for x in leaves], [True] * len(example))
  sites, _ = _walk.analysis(closed, infos)
  return _ghost.make_plan(sites, len(leaves), half=_planning.computes_in_half(closed))


V, D, L, H, T = 40, 16, 2, 2, 8


def gpt_params(seed=0):
  ks = iter(jax.random.split(jax.random.key(seed), 32))
  n = lambda *s: 0.3 * jax.random.normal(next(ks), s)
  p = {"wte": n(V, D), "wpe": n(T, D), "lnf_s": 1 + n(D), "lnf_b": n(D)}
  for i in range(L):
    p[f"{i}"] = {
      "ln1_s": 1 + n(D),
      "ln1_b": n(D),
      "qkv": n(D, 3 * D),
      "qkv_b": n(3 * D),
      "proj": n(D, D),
      "ln2_s": 1 + n(D),
      "ln2_b": n(D),
      "fc": n(D, 4 * D),
      "fc_b": n(4 * D),
      "out": n(4 * D, D),
    }
  return p


def _ln(x, s, b):
  m = x.mean(-1, keepdims=True)
  v = ((x - m) ** 2).mean(-1, keepdims=True)
  return (x - m) * jax.lax.rsqrt(v + 1e-5) * s + b


def gpt_loss(p, tokens):
  """Next-token loss of one sequence: embedding, pre-LN causal attention, MLP, tied head."""
  x, y = tokens[:-1], tokens[1:]
  t = x.shape[0]
  h = p["wte"][x] + p["wpe"][:t]
  mask = jnp.tril(jnp.ones((t, t), bool))
  for i in range(L):
    b = p[f"{i}"]
    q, k, v = jnp.split(
      (_ln(h, b["ln1_s"], b["ln1_b"]) @ b["qkv"] + b["qkv_b"]).reshape(t, 3, H, D // H), 3, axis=1
    )
    att = jnp.einsum("thd,shd->hts", q[:, 0], k[:, 0]) / np.sqrt(D // H)
    att = jax.nn.softmax(jnp.where(mask, att, -1e9), axis=-1)
    h = h + jnp.einsum("hts,shd->thd", att, v[:, 0]).reshape(t, D) @ b["proj"]
    m = jax.nn.gelu(_ln(h, b["ln2_s"], b["ln2_b"]) @ b["fc"] + b["fc_b"])
    h = h + m @ b["out"]
  logits = _ln(h, p["lnf_s"], p["lnf_b"]) @ p["wte"].T  # tied output head
  return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], axis=1))


def gpt_tokens(batch, seed=1, vocab=V):
  return jax.random.randint(jax.random.key(seed), (batch, T + 1), 0, vocab)
