"""What a group of requests will cost the engine thread: a model fitted on measured passes, not an average.

A group's time is a fixed cost per pass plus a cost per unit of work (``Planner.work``'s token-equivalents: tokens
through the weights and attention entries at their FLOP cost; a state's prefill included when it is not cached):

    seconds = per_pass * passes + per_work * work

fitted by least squares of the *relative* error over a window of recent groups (every size weighs the same: a
request of 12 tokens is predicted as well as one of 4,000), both coefficients kept non-negative. So large requests
cannot inflate a small request's estimate, as an average of whole pass times did (four 4.8 s requests pushed a
12-token request's estimate past its 1 s deadline). The warm-up's passes of several sizes (``seed``) stay in every
fit beside the window: a window of same-size groups alone cannot tell the two costs apart.

The model knows how wrong it is: every group's actual / predicted ratio is kept over the same window, and
admission asks for the ratio's high quantile (``pessimistic``): a request whose pessimistic time does not fit its
deadline is refused up front instead of being answered late. "No retry can help" (413) is kept for a request whose
*optimistic* time (the low quantile) exceeds its whole budget. ``error_p90`` (the p90 of |predicted - actual| /
actual) is exported in ``/metrics``.
"""

from __future__ import annotations

import collections
import threading

import numpy as np

WINDOW = 64  # groups the fit and the error quantiles are taken over
HIGH, LOW = 0.9, 0.1  # quantiles of actual / predicted for admission (pessimistic) and for "never fits" (optimistic)
MIN_SPREAD = 1.15  # the pessimistic factor is at least this (and the optimistic at most its inverse) while few
# groups are measured: a fresh model is not trusted to the percent


class CostModel:
    """``seconds(passes, work)``: a fitted per-pass and per-work cost, with the spread of its errors. Thread-safe
    (the engine thread measures, the event loop predicts)."""

    def __init__(self, window: int = WINDOW):
        self._seen: collections.deque = collections.deque(maxlen=window)  # (passes, work, seconds)
        self._anchors: list = []  # the warm-up's groups of several sizes: in every fit
        self._ratios: collections.deque = collections.deque(maxlen=window)  # actual / predicted, before each refit
        self._lock = threading.Lock()
        self._coef = (0.0, 0.0)  # (per_pass, per_work): one tuple, read whole by the event loop
        self.listener = None  # called (predicted, actual) for every measured group with a prediction (the metrics)

    @property
    def per_pass(self) -> float:
        return self._coef[0]

    @property
    def per_work(self) -> float:
        return self._coef[1]

    def seconds(self, passes: float, work: float) -> float:
        """The predicted seconds of ``passes`` passes holding ``work`` token-equivalents (0 before anything was
        measured: nothing is refused for time then)."""
        per_pass, per_work = self._coef
        return per_pass * passes + per_work * work

    def spread(self) -> float:
        """The high quantile of actual / predicted: a prediction times it is what admission weighs against a
        deadline."""
        return self._quantile(HIGH, MIN_SPREAD)

    def pessimistic(self, passes: float, work: float) -> float:
        """The prediction times :meth:`spread`."""
        return self.seconds(passes, work) * self.spread()

    def optimistic(self, passes: float, work: float) -> float:
        """The prediction times the low quantile: a request is surely too slow for its budget above it."""
        return self.seconds(passes, work) * self._quantile(LOW, 1.0 / MIN_SPREAD)

    def seed(self, passes: float, work: float, seconds: float) -> None:
        """A warm-up group: kept in every fit (the window may later hold one size only), its error not counted (the
        fit is still forming)."""
        if seconds > 0 and passes > 0:
            with self._lock:
                self._anchors.append((float(passes), float(work), float(seconds)))
                self._coef = _fit([*self._anchors, *self._seen])

    def measured(self, passes: float, work: float, seconds: float) -> None:
        """Fold one group's measured time in: its error against the prediction, then the refit."""
        if seconds <= 0 or passes <= 0:
            return
        with self._lock:
            predicted = self.seconds(passes, work)
            if predicted > 0:
                self._ratios.append(seconds / predicted)
            self._seen.append((float(passes), float(work), float(seconds)))
            self._coef = _fit([*self._anchors, *self._seen])
        if predicted > 0 and self.listener is not None:
            self.listener(predicted, seconds)

    def error_p90(self) -> float | None:
        """The p90 of |predicted - actual| / actual over the window (None before two groups)."""
        with self._lock:
            ratios = np.array(self._ratios)
        if ratios.size < 2:
            return None
        return float(np.quantile(np.abs(1.0 / ratios - 1.0), 0.9))

    def _quantile(self, q: float, bound: float) -> float:
        """The q-quantile of actual / predicted, never inside ``bound`` (above it for a high quantile, below it for
        a low one) while fewer than half the window is measured."""
        with self._lock:
            ratios = np.array(self._ratios)
        value = float(np.quantile(ratios, q)) if ratios.size else bound
        if ratios.size < (self._ratios.maxlen or WINDOW) // 2:
            value = max(value, bound) if q >= 0.5 else min(value, bound)
        return value


def _fit(rows) -> tuple[float, float]:
    """(per_pass, per_work) >= 0 minimising the relative squared error of ``per_pass * p + per_work * w`` against
    the seconds of ``rows`` (p, w, s). Where the unconstrained optimum has a negative coefficient, the best fit with
    that coefficient at 0 (the two-variable non-negative least squares)."""
    data = np.array(rows, dtype=np.float64)  # [n, 3]
    x = data[:, :2] / data[:, 2:3]  # each row divided by its seconds: relative error
    y = np.ones(len(data))
    if len(data) >= 2 and np.linalg.matrix_rank(x) == 2:
        coef, *_ = np.linalg.lstsq(x, y, rcond=None)
        if coef.min() >= 0:
            return float(coef[0]), float(coef[1])
    single = [float(x[:, k] @ y / (x[:, k] @ x[:, k])) if x[:, k].any() else 0.0 for k in (0, 1)]
    residual = [np.sum((x[:, k] * c - y) ** 2) for k, c in enumerate(single)]
    return (single[0], 0.0) if residual[0] <= residual[1] else (0.0, single[1])
