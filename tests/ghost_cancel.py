"""The check of ``tests/test_ghost_cancel.py``: generated examples whose rows cancel
(``tests/ghost_cancel_cases.py``) through the ghost rules.

:func:`run` adds each generated example to ``N`` ordinary ones and measures
the engine's norm read against the exact norm (products exact in float64,
summed by ``math.fsum``) and the released sum's move in float64,
``|sum(D + {x}) - sum(D)|`` against the clip; :func:`forms` names the rule and
form each configuration reaches, from the engine's own plan; :func:`report`
(``python -m tests.ghost_cancel``) tabulates a search.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

import jaxclip
from jaxclip.privacy._ghost import _rules
from jaxclip.privacy._ghost._jaxpr import _internals as _jax
from jaxclip.privacy._ghost._rules import _conv_taps, _lookup
from jaxclip.privacy._ghost._rules._conv import conv_dims
from jaxclip.privacy._ghost._rules._scaling import gram_is_cheaper
from tests.ghost_cancel_cases import CONFIGS, DTYPES, Model
from tests.ghost_helpers import plan as ghost_plan

C = 1.0  # the clip
N = 6  # the ordinary examples of D
# A finite read below the exact norm by more than this (relative) is an under-read; the move
# of the released sum is allowed C (1 + TOL) + TOL |sum(D)| (tests/test_dp_adversarial.py).
TOL = 1e-4


def forms(model: Model, dtype: str) -> list[str]:
  """The rule and form each parameter leaf gets, from the engine's own plan."""
  rng = np.random.default_rng(0)
  example = [_as(x, dtype) for x in model.ordinary(rng, dtype)]
  p = ghost_plan(model.loss, model.params(dtype), *example)
  out = []
  for u, k, rule in p.ghost:
    out.append(("probed " if u in p.probed else "") + _form(p.sites[u], k, rule, u in p.probed))
  for (gu, gk), (du, dk) in p.tied:
    head = _form(p.sites[du], dk, "dot", probed=True)  # its norm is the dot rule's, always
    out.append(f"tied {_form(p.sites[gu], gk, 'lookup')} + {head}")
  return out + ["instantiate"] * len(p.instantiated)


def _form(site, k, rule, probed=False):
  r = _rules.get(rule)
  if not probed and r.accumulates(site, k):
    eqn = site.eqn
    taps = rule == "conv" and _conv_taps.patches_fit(eqn, _jax.conv_parts(eqn))
    return f"{rule} backward" + (" taps" if taps else "")
  if rule == "dot":
    _, _, t, c, f = r._dims(site, k)
    return "dot gram" if t > 1 and gram_is_cheaper(t, c, f) else "dot formed"
  if rule == "conv":
    _, positions, taps, outs = conv_dims(site)
    return "conv gram" if gram_is_cheaper(positions, taps, outs) else "conv formed"
  if rule == "lookup":
    table, width, t = r._dims(site)
    if _lookup.lookup_gram_is_cheaper(t, table):
      return "lookup gram"
    return "lookup sums" if t < table else "lookup table"
  return f"{rule} formed"


def _as(x, dtype):
  return jnp.asarray(x) if x.dtype.kind == "i" else jnp.asarray(x, jnp.dtype(dtype))


# ----------------------------------------------------------------------------
# The check
# ----------------------------------------------------------------------------


class Case(NamedTuple):
  true: float  # the exact norm of the example's gradient
  read: float  # the engine's norm
  move: float  # |sum(D + {x}) - sum(D)| in float64
  allowed: float  # what the move may be


def run(name: str, dtype: str, cases: int, seed: int = 0, method: str = "ghost") -> list[Case]:
  """Each of ``cases`` generated examples of configuration ``name``, added to ``N`` ordinary
  ones (:class:`Case`)."""
  model = CONFIGS[name]()
  rng = np.random.default_rng([seed, len(name), sum(map(ord, name + dtype))])
  examples = [model.ordinary(rng, dtype) for _ in range(N)]
  examples += [model.adversarial(rng, dtype) for _ in range(cases)]
  batch = [_as(np.stack(xs), dtype) for xs in zip(*examples, strict=True)]
  params = model.params(dtype)
  fn = jaxclip.per_example_clipped_grad(model.loss, C, method=method, return_norms=True)
  fn = jax.jit(fn)
  total = N + cases
  mask = lambda *extra: jnp.asarray([i < N or i in extra for i in range(total)])
  reads = np.asarray(fn(params, *batch, example_mask=mask(*range(N, total)))[2], np.float64)
  flat = lambda out: np.concatenate(
    [np.ravel(np.asarray(x, np.float64)) for x in jax.tree.leaves(out[0])]
  )
  base = flat(fn(params, *batch, example_mask=mask()))
  out = []
  for j in range(N, total):
    moved = float(np.linalg.norm(flat(fn(params, *batch, example_mask=mask(j))) - base))
    true = float(np.linalg.norm(model.truth(*examples[j])))
    # D + {x} and D have one shape (x masked out of D): their sums round alike but for x's.
    allowed = C * (1 + TOL) + TOL * float(np.linalg.norm(base))
    out.append(Case(true, float(reads[j]), moved, allowed))
  return out


def under_read(case: Case) -> bool:
  """A finite read below the exact norm beyond the tolerance (NaN or inf: dropped, safe)."""
  return bool(np.isfinite(case.read) and case.read < case.true * (1 - TOL))


def consistent(forms_: list[str]) -> bool:
  """Whether every norm is that of the very gradient the released sum adds (formed in the
  backward pass in float32, or instantiated): its read may be below the exact norm, as
  ``method="vmap"``'s may (the gradient is formed with rounding), but never below the
  released gradient's."""
  return all(" backward" in f or f == "instantiate" for f in forms_)


def failures(cases: list[Case], reads_released: bool = False) -> list[str]:
  """Each case whose read is below its exact norm (unless ``reads_released``, see
  :func:`consistent`) or whose released sum moved beyond the clip."""
  bad = []
  for i, c in enumerate(cases):
    if under_read(c) and not reads_released:
      bad.append(f"case {i}: read {c.read:.6g} < exact {c.true:.6g}")
    if not c.move <= c.allowed:
      bad.append(f"case {i}: sum moved {c.move:.6g} > {c.allowed:.6g}")
  return bad


def report(names=None, dtypes=DTYPES, cases: int = 48, seed: int = 1) -> str:
  """A table of the search: per configuration and dtype, the rule's form, the cases that
  under-read (and the worst exact / read), that moved the sum beyond the clip (and the worst
  move / C) and that were dropped (a non-finite read). ``python -m tests.ghost_cancel``."""
  lines = [
    "config | dtype | form | under-read | worst exact/read | moved > C | worst move/C | dropped"
  ]
  for name in names or CONFIGS:
    for dtype in dtypes:
      got = run(name, dtype, cases, seed)
      under = [c for c in got if under_read(c)]
      moved = [c for c in got if not c.move <= c.allowed]
      worst = max((c.true / max(c.read, 1e-300) for c in under), default=float("nan"))
      step = max((c.move / C for c in moved), default=float("nan"))
      dropped = sum(not np.isfinite(c.read) for c in got)
      form = ", ".join(forms(CONFIGS[name](), dtype))
      lines.append(
        f"{name} | {dtype} | {form} | {len(under)}/{len(got)} | {worst:.4g} | "
        f"{len(moved)}/{len(got)} | {step:.4g} | {dropped}"
      )
  return "\n".join(lines)


if __name__ == "__main__":
  print(report())
