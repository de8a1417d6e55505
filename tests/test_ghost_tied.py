"""Ghost norms of an embedding table tied to an output head.

A table read by a lookup and, transposed, by an output head gets both rules
and their cross term; one whose rows are contracted otherwise is
instantiated. In a two-pass (rematerialised) plan the head's own term is
taken in the backward pass, at the head (``Forward``'s ``early``), in
float32 and in bfloat16 (against a float64 reference); a table read inside a
rematerialised scan takes no early term and is instantiated. Each against
``method="vmap"`` at the median norm (``tests.ghost_helpers.compare``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxclip
from jaxclip.privacy import _ghost
from tests.ghost_helpers import compare as _compare
from tests.ghost_helpers import plan as _plan


@pytest.mark.parametrize("head", ["transposed", "einsum", "contract_rows"])
@pytest.mark.parametrize("lookup", ["index", "take_fill"])
def test_tied_table_cross_term_or_exact_fallback(head, lookup):
  table = jax.random.normal(jax.random.key(0), (11, 6))
  proj = jax.random.normal(jax.random.key(1), (6, 6))

  def loss(p, ids):
    e = p["e"][ids] if lookup == "index" else jnp.take(p["e"], ids, axis=0, fill_value=0)
    h = jnp.tanh(e @ p["w"])
    if head == "transposed":
      logits = h @ p["e"].T
    elif head == "einsum":
      logits = jnp.einsum("td,nd->tn", h, p["e"])
    else:  # contracts the table's rows: not a tied head, instantiated instead
      logits = jnp.einsum("tn,nd->td", jax.nn.one_hot(ids, 11), p["e"]) @ h.T
    return jnp.sum(jax.nn.log_softmax(logits)[:, 0])

  hi = 13  # two ids out of range
  ids = jax.random.randint(jax.random.key(2), (12, 7), 0, hi).at[:, 1].set(3)
  params = {"e": table, "w": proj}
  _compare(loss, params, ids)
  plan = _plan(loss, params, ids[0])
  assert len(plan.tied) == (head != "contract_rows")


def _tied_lm(where):
  """A tied lookup and head around a rematerialised block: a two-pass plan.

  ``where``: ``"outside"``, the lookup and head outside the block (the scan
  GPT's layout); ``"inside"``, the whole loss rematerialised; ``"scan"``, a
  rematerialised scan over positions reading the table at both ends of each
  step, then the block on its outputs.
  """
  block = jax.checkpoint(lambda h, w: jnp.tanh(h @ w))

  def loss(p, tokens):
    x, y = tokens[:-1], tokens[1:]
    if where == "scan":

      @jax.checkpoint
      def step(h, xy):
        h = jnp.tanh(p["e"][xy[0]] + h @ p["w"])
        return h, jax.nn.log_softmax(h @ p["e"].T)[xy[1]]

      h0 = jnp.zeros(p["w"].shape[0], p["w"].dtype)
      hs, lp = jax.lax.scan(step, h0, (x, y))
      return -jnp.mean(lp) + jnp.mean(block(hs, p["v"]) ** 2)  # a rematerialised dot rule
    h = block(p["e"][x], p["w"])  # lookup
    logits = h @ p["e"].T  # tied head
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], axis=1))

  if where == "inside":
    return jax.checkpoint(loss)
  return loss


def _tied_lm_problem(batch=12, vocab=23, width=8, length=7, scan=False):
  ks = jax.random.split(jax.random.key(7), 4)
  params = {
    "e": jax.random.normal(ks[0], (vocab, width)),
    "w": jax.random.normal(ks[1], (width, width)) / np.sqrt(width),
  }
  if scan:
    params["v"] = jax.random.normal(ks[3], (width, 3)) / np.sqrt(width)
  tokens = jax.random.randint(ks[2], (batch, length + 1), 0, vocab).at[:, 2].set(5)
  return params, tokens


def _early_plan(loss, params, tokens):
  """The traced plan, its tied pairs and early heads, and the ``Inputs`` the capture gets."""
  traced = _ghost.trace(loss, params, [tokens], [0], has_aux=False)
  return traced.plan, _ghost.early_heads(traced.plan), _ghost.inputs_for(traced, None)


@pytest.mark.parametrize("where", ["outside", "inside"])
def test_two_pass_tied_head_takes_its_own_term_in_the_backward_pass(where):
  # In a two-pass plan the tied head's own squared norm is taken at the head in the
  # backward pass (Forward's ``early``), its cross term with the lookup from the records.
  params, tokens = _tied_lm_problem()
  loss = _tied_lm(where)
  _compare(loss, params, tokens)
  plan, early, inputs = _early_plan(loss, params, tokens)
  assert plan.two_pass and len(plan.tied) == 1
  ((_, head),) = plan.tied
  assert early == [head] and set(inputs.early) == {head[0]}
  assert jaxclip.ghost_plan(loss, params, tokens).rules["['e']"] == "tied"


def test_rematerialised_tied_head_in_bfloat16_within_its_rounding_of_float64():
  # In bfloat16 the rematerialised model keeps one pass (a second, weighted pass would round
  # each example's weighted output gradients to bfloat16): the head's term and the cross term
  # both come from the records, book-kept in float32.
  params, tokens = _tied_lm_problem(batch=16)
  loss = _tied_lm("outside")
  assert _early_plan(loss, params, tokens)[0].two_pass  # float32: two passes
  half = jax.tree.map(lambda p: p.astype(jnp.bfloat16), params)
  plan, early, _ = _early_plan(loss, half, tokens)
  assert not plan.two_pass and plan.held_in_half and not early and len(plan.tied) == 1
  assert jaxclip.ghost_plan(loss, half, tokens).passes_note is not None
  with jax.enable_x64(True):
    wide = jax.tree.map(lambda p: np.asarray(p, np.float64), half)  # the same values
    fn = lambda c: jaxclip.per_example_clipped_grad(loss, c, return_norms=True)
    norms = np.asarray(jax.jit(fn(1.0))(wide, tokens)[2])
    # The clip between the two norms with the widest relative gap, some norms on each side.
    ranked = np.sort(norms)
    gaps = ranked[1:] / ranked[:-1]
    j = 2 + int(np.argmax(gaps[2:-2]))
    assert gaps[j] > 1.05, ranked  # wider than bfloat16's error of a norm
    clip = float(np.sqrt(ranked[j] * ranked[j + 1]))
    ref = jax.jit(fn(clip))(wide, tokens)
  ghost = jaxclip.per_example_clipped_grad(loss, clip, method="ghost", return_norms=True)
  got = jax.jit(ghost)(half, tokens)
  assert int(got[1]) == int(ref[1]) == len(norms) - j - 1
  np.testing.assert_allclose(np.asarray(got[2], np.float64), np.asarray(ref[2]), rtol=2e-2)
  for a, e in zip(jax.tree.leaves(got[0]), jax.tree.leaves(ref[0]), strict=True):
    assert a.dtype == jnp.float32  # summed in float32
    a, e = np.asarray(a, np.float64), np.asarray(e)
    np.testing.assert_allclose(a, e, rtol=0, atol=2e-2 * np.max(np.abs(e)))


def test_tied_table_read_inside_a_remat_scan_has_no_early_head():
  # A term per scan iteration is not the norm of the table the iterations share: the
  # table is instantiated, and no head's term is taken early.
  params, tokens = _tied_lm_problem(scan=True)
  loss = _tied_lm("scan")
  _compare(loss, params, tokens, rtol=1e-4)
  plan, early, inputs = _early_plan(loss, params, tokens)
  assert plan.two_pass and plan.tied == () and early == [] and not inputs.early
  rules = jaxclip.ghost_plan(loss, params, tokens).rules
  assert rules["['e']"] == "instantiate" and rules["['v']"] == "dot"
