"""A privacy accountant that records the DP-SGD steps that ran and resumes from a checkpoint."""

from __future__ import annotations

import math
from typing import Any

from jaxclip._kernel import _validation
from jaxclip.privacy import _dp_events

# The columns of the state: one entry per run of identical steps.
_COLUMNS = (
  "steps",
  "noise_multiplier",
  "sampling_rate",
  "count_stddev",
  "num_counts",
  "max_batch_size",
  "num_examples",
)


class PrivacyAccountant:
  r"""Records the DP-SGD steps that actually ran and reports their :math:`\varepsilon`.

  :func:`jaxclip.dp_epsilon` accounts for a run planned in advance; this
  records each step as it runs (or a chunk of identical steps), whatever
  changed between them: the noise multiplier :math:`\sigma`, the sampling
  rate :math:`q`, the quantile-adaptive clip norm's counts (``count_stddev``
  and ``num_counts``) and the truncation of the Poisson batch
  (``max_batch_size`` of ``num_examples``). :meth:`epsilon` composes them with
  ``dp_accounting`` as :func:`jaxclip.dp_epsilon` does, under the same
  ``accountant`` (``"pld"``: exact, truncation included; ``"rdp"``: the
  bound of :func:`jaxclip.dp_epsilon`).

  **Checkpoints.** :meth:`state_dict` is a dict of seven lists of Python
  numbers, one entry per run of identical steps (consecutive identical
  records are merged, so it stays small): save it with the model (JSON,
  pickle, or as a pytree with orbax), and :meth:`load_state_dict` resumes:
  the same :math:`\varepsilon`, and later steps add to it. It holds no key and
  nothing of the data.

  Args:
    delta: :math:`\delta \in (0, 1)` of the reported :math:`\varepsilon`.
    accountant: ``"pld"`` (default) or ``"rdp"``.

  Raises:
    ValueError: for a ``delta`` outside ``(0, 1)``, an unknown ``accountant``,
      or (in :meth:`record`) an argument outside its range.
    TypeError: for an argument that is not a number.

  Examples:
    >>> import json
    >>> import jaxclip
    >>> acc = jaxclip.PrivacyAccountant(1e-5)
    >>> acc.record(3.0, 0.02, steps=40)
    >>> acc.record(3.0, 0.02, steps=20)  # merged with the first: 60 identical steps
    >>> acc.steps, round(acc.epsilon(), 4) == round(jaxclip.dp_epsilon(3.0, 0.02, 60, 1e-5), 4)
    (60, True)
    >>> acc.record(2.0, 0.02, steps=10)  # the noise was lowered
    >>> saved = json.dumps(acc.state_dict())
    >>> resumed = jaxclip.PrivacyAccountant(1e-5).load_state_dict(json.loads(saved))
    >>> resumed.epsilon() == acc.epsilon(), resumed.steps
    (True, 70)

  References:
    Abadi et al., `Deep Learning with Differential Privacy
    <https://arxiv.org/abs/1607.00133>`_, 2016 (the moments accountant)

    Doroshenko et al., `Connect the Dots: Tighter Discrete Approximations of
    Privacy Loss Distributions <https://arxiv.org/abs/2207.04380>`_, 2022
  """

  def __init__(self, delta: float, *, accountant: str = "pld") -> None:
    _dp_events._check("PrivacyAccountant", 0.0, 0, delta, accountant, None)
    self.delta = float(delta)
    self.accountant = accountant
    self._runs: list[tuple[Any, ...]] = []

  def __repr__(self) -> str:
    return (
      f"PrivacyAccountant(delta={self.delta!r}, accountant={self.accountant!r}, "
      f"steps={self.steps}, runs={len(self._runs)})"
    )

  @property
  def steps(self) -> int:
    """The number of steps recorded."""
    return sum(run[0] for run in self._runs)

  def record(
    self,
    noise_multiplier: float,
    sampling_rate: float,
    *,
    steps: int = 1,
    count_stddev: float | None = None,
    num_counts: int = 1,
    max_batch_size: int | None = None,
    num_examples: int | None = None,
  ) -> None:
    """Records ``steps`` steps that ran with these settings (those of :func:`jaxclip.dp_epsilon`).

    Call it after the steps ran (a chunk of a ``lax.scan`` is ``steps=`` its
    length), with Python numbers: the values the steps used.
    """
    n, k, truncation = _dp_events._check(
      "PrivacyAccountant.record",
      sampling_rate,
      steps,
      self.delta,
      self.accountant,
      count_stddev,
      num_counts,
      max_batch_size,
      num_examples,
    )
    _validation.check_hparam(
      noise_multiplier, "noise_multiplier", lo=0, scalar=True, static=_dp_events._PYTHON
    )
    if n == 0:
      return
    run = (
      n,
      float(noise_multiplier),
      float(sampling_rate),
      0.0 if count_stddev is None else float(count_stddev),
      0 if count_stddev is None else k,
      0 if truncation is None else truncation.max_batch_size,
      0 if truncation is None else truncation.num_examples,
    )
    if self._runs and self._runs[-1][1:] == run[1:]:
      self._runs[-1] = (self._runs[-1][0] + n, *run[1:])
    else:
      self._runs.append(run)

  def epsilon(self, delta: float | None = None) -> float:
    r""":math:`\varepsilon` of every recorded step, at ``delta`` (default: the accountant's).

    Returns ``0.0`` before any step, ``inf`` if a step had no noise.
    """
    dp_accounting = _dp_events._dp_accounting("PrivacyAccountant.epsilon")
    d = self.delta if delta is None else delta
    _dp_events._check("PrivacyAccountant.epsilon", 0.0, 0, d, self.accountant, None)
    segments = []
    for steps, sigma, q, count, k, rows, size in self._runs:
      z = _dp_events._step_multiplier(sigma, count if k else None, max(k, 1))
      cut = _dp_events._Truncation(size, rows) if rows else None
      segments.append(_dp_events._Segment(z, q, steps, cut))
    return _dp_events._compose(dp_accounting, tuple(segments), float(d), self.accountant)

  def state_dict(self) -> dict[str, list[Any]]:
    """The record: a dict of seven lists of Python numbers, one entry per run of identical steps.

    ``num_counts`` is 0 where no count was released (``count_stddev`` is then
    unused), ``max_batch_size`` and ``num_examples`` are 0 where the batches
    were not truncated.
    """
    return {name: [run[i] for run in self._runs] for i, name in enumerate(_COLUMNS)}

  def load_state_dict(self, state: dict[str, Any]) -> PrivacyAccountant:
    """Replaces the record with a :meth:`state_dict` (e.g. from a checkpoint); returns ``self``.

    Raises:
      ValueError: for a state without these columns, or of columns of different lengths.
    """
    if not isinstance(state, dict) or set(state) != set(_COLUMNS):
      raise ValueError(
        f"PrivacyAccountant.load_state_dict needs a dict with the keys {_COLUMNS} (a "
        f"state_dict()), got {state!r:.200}."
      )
    columns = [list(state[name]) for name in _COLUMNS]
    if len({len(c) for c in columns}) != 1:
      raise ValueError(
        "PrivacyAccountant.load_state_dict: the state's columns differ in length: "
        f"{ {name: len(c) for name, c in zip(_COLUMNS, columns, strict=True)} }."
      )
    runs = []
    for steps, sigma, q, count, k, rows, size in zip(*columns, strict=True):
      run = (int(steps), float(sigma), float(q), float(count), int(k), int(rows), int(size))
      if run[0] < 0 or run[4] < 0 or min(run[5], run[6]) < 0 or math.isnan(sum(run[1:4])):
        raise ValueError(f"PrivacyAccountant.load_state_dict: a run out of range: {run}.")
      runs.append(run)
    self._runs = runs
    return self
