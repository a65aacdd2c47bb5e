"""Float comparisons that hold on any CPU.

XLA's CPU kernels add up dot products and reductions in an order that depends on the vector
width (AVX2 or AVX-512) and on how the work is split over threads. Two correct float32
computations of one value then differ by a few ulps of the largest terms summed, so by an
amount that scales with the quantity, not by a fixed number: an absolute tolerance that fits one
machine's rounding fails on the next (1.1e-6 against a bound of 1e-6 on an AVX-512 machine).
The bounds here are fractions of the quantity's scale, or of how far an update moved a
parameter, and stay orders of magnitude below what a real bug changes.
"""

import numpy as np

F32_EPS = float(np.finfo(np.float32).eps)  # 1.19e-7


def _max_abs(x) -> float:
  x = np.asarray(x, np.float64)
  return float(np.abs(x).max()) if x.size else 0.0


def assert_close(actual, expected, rel: float, *, scale: float | None = None,
                 plus: float = 0.0, what: str = '') -> float:
  """Elementwise |actual - expected| <= rel * scale + plus; returns the error / scale ratio.

  `scale` defaults to max |expected| (at least 1e-30); `plus` is for a known absolute term
  such as the rounding of values written as decimals.
  """
  actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
  assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
  scale = max(_max_abs(expected) if scale is None else scale, 1e-30)
  err = _max_abs(actual - expected)
  assert err <= rel * scale + plus, (
      f'{what}: max abs error {err:.3g} > {rel:g} x scale {scale:.3g}'
      + (f' + {plus:g}' if plus else ''))
  return err / scale


def assert_moved_close(actual, expected, start, rel: float, what: str = '') -> float:
  """Two updates of the same `start` agree to `rel` of how far `expected` moved it.

  Optimizer steps move parameters by about the learning rate whatever their size, so the
  movement, not the parameter, is the scale that rounding differences live on.
  """
  moved = _max_abs(np.asarray(expected, np.float64) - np.asarray(start, np.float64))
  assert moved > 0, f'{what}: did not move'
  return assert_close(actual, expected, rel, scale=moved, plus=_ulps(expected), what=what)


def _ulps(x, n: int = 4) -> float:
  """n float32 ulps of the largest |x|: storing an updated parameter rounds it to one."""
  return n * F32_EPS * _max_abs(x)


def assert_trees_moved_close(actual, expected, start, rel: float) -> float:
  """Leaves of two updated parameter trees agree to `rel` of the optimizer's step size.

  The step size is the largest movement of any leaf of `expected`. Per leaf it would not do:
  parameters whose exact gradient is 0 (the attention key bias) move only by rounding noise.
  Each leaf may also differ by a few ulps of its own size (a LayerNorm scale near 1 rounds to
  1.2e-7, a quarter of a 5e-4 step).
  """
  flat = lambda tree: [np.asarray(x, np.float64) for x in tree]
  actual, expected, start = flat(actual), flat(expected), flat(start)
  step = max(_max_abs(e - s) for e, s in zip(expected, start))
  assert step > 0, 'no parameter moved'
  return max(assert_close(a, e, rel, scale=step, plus=_ulps(e), what=f'leaf {i}')
             for i, (a, e) in enumerate(zip(actual, expected)))
