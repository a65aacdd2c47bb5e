"""The MLP's bias + exact GELU, gelu(x + b): XLA vs the Pallas kernels (`model.gelu_impl`).

  python3 benchmarks/gelu.py                         # GPU: [256*128, 3072] and [64*512, 4096]
  python3 benchmarks/gelu.py --rows=37 --cols=300 --iters=1   # CPU: a check only

Times the forward and forward+backward (dx and the bias gradient) of `activations.bias_gelu`
for impl='xla' and impl='pallas', each jitted, the median of --iters runs after a warm-up
(each run includes its launch), and reports ms, TB/s over the bytes the fused kernels must
move (forward: read x, write y; backward: read x and dy, write dx), and the largest difference
of each output from the xla path and of the forward from jax.nn.gelu in float32.
--tiles sweeps the Pallas kernels' tiling, ROWS:COLS:BWD_ROWS (elements per load, and the
backward's rows per program; e.g. 4:1024:64,2:1024:64,8:512:64); one JSON line per
(shape, dtype, impl, tiling), then a summary line with the best tiling of each shape.
Needs no TensorFlow. Off a GPU the Pallas kernels run in interpret mode: the differences are
checked, timings mean nothing.
"""

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # pylint: disable=g-import-not-at-top
import jax.numpy as jnp
import numpy as np

from bert_jax import activations  # pylint: disable=g-import-not-at-top
from layernorm import median_seconds  # pylint: disable=g-import-not-at-top  (this folder)


def parse_args(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0], allow_abbrev=False)
  parser.add_argument('--rows', default='32768', help='comma-separated rows (tokens)')
  parser.add_argument('--cols', default='3072,4096',
                      help='comma-separated widths (intermediate sizes), paired with --rows '
                           '(one row count serves every width)')
  parser.add_argument('--dtypes', default='bfloat16,float32')
  parser.add_argument('--iters', type=int, default=20, help='timed runs (median reported)')
  parser.add_argument('--tiles', default='',
                      help='ROWS:COLS:BWD_ROWS tilings of the Pallas kernels to sweep, comma-'
                           'separated (default: the module\'s own, activations._TILE_ROWS, '
                           '_TILE_COLS, _BWD_ROWS)')
  return parser.parse_args(argv)


def _max_abs(a, b) -> float:
  return float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))


def run_case(rows: int, cols: int, dtype: str, iters: int, tilings) -> list[dict]:
  """One JSON row per implementation (and tiling) at [rows, cols] in `dtype`."""
  k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
  x = (3 * jax.random.normal(k1, (rows, cols))).astype(dtype)  # y = x + b spans the tails.
  bias = jax.random.normal(k2, (cols,)).astype(dtype)
  dy = jax.random.normal(k3, (rows, cols)).astype(dtype)
  size = jnp.dtype(dtype).itemsize * rows * cols
  exact = jax.nn.gelu(x.astype(jnp.float32) + bias.astype(jnp.float32), approximate=False)
  # pylint: disable-next=protected-access
  defaults = activations._TILE_ROWS, activations._TILE_COLS, activations._BWD_ROWS
  results, reference = [], None
  for impl, tiling in [('xla', None)] + [('pallas', t) for t in tilings]:
    if tiling:
      # pylint: disable-next=protected-access
      activations._TILE_ROWS, activations._TILE_COLS, activations._BWD_ROWS = tiling
    try:
      def f(x, bias, impl=impl):
        return activations.bias_gelu(x, bias, impl=impl)

      fwd = jax.jit(f)
      fwd_bwd = jax.jit(lambda x, b, f=f: jax.vjp(f, x, b)[1](dy) + (f(x, b),))
      out = fwd_bwd(x, bias)
      t_fwd = median_seconds(fwd, (x, bias), iters)
      t_all = median_seconds(fwd_bwd, (x, bias), iters)
    finally:
      # pylint: disable-next=protected-access
      activations._TILE_ROWS, activations._TILE_COLS, activations._BWD_ROWS = defaults
    r = dict(impl=impl, rows=rows, cols=cols, dtype=dtype, fwd_ms=1e3 * t_fwd,
             fwd_bwd_ms=1e3 * t_all, fwd_tbps=2 * size / t_fwd / 1e12,
             bwd_tbps=3 * size / (t_all - t_fwd) / 1e12 if t_all > t_fwd else None,
             fwd_max_abs_vs_exact_f32=_max_abs(out[2], exact))
    if impl == 'xla':
      reference = out
    else:
      r['tiles'] = ':'.join(str(v) for v in (tiling or defaults))
      dbias_scale = float(jnp.max(jnp.abs(reference[1].astype(jnp.float32))))
      r['max_abs_diff_vs_xla'] = dict(
          y=_max_abs(out[2], reference[2]), dx=_max_abs(out[0], reference[0]),
          dbias_relative=_max_abs(out[1], reference[1]) / max(dbias_scale, 1e-30))
    results.append(r)
  return results


def main(argv=None):
  args = parse_args(argv)
  rows = [int(r) for r in args.rows.split(',')]
  cols = [int(c) for c in args.cols.split(',')]
  if len(rows) == 1:
    rows = rows * len(cols)
  if len(rows) != len(cols):
    sys.exit(f'--rows: {len(rows)} row counts for {len(cols)} widths (--cols)')
  tilings = [tuple(int(v) for v in t.split(':')) for t in args.tiles.split(',') if t] or [None]
  if any(t and len(t) != 3 for t in tilings):
    sys.exit(f'--tiles={args.tiles}: expected ROWS:COLS:BWD_ROWS, comma-separated')
  summary = dict(backend=jax.default_backend(), device=jax.devices()[0].device_kind,
                 jax=jax.__version__, pallas_interpreted=jax.default_backend() != 'gpu',
                 cases=[])
  for n, c in zip(rows, cols):
    for dtype in args.dtypes.split(','):
      xla, *pallas = run_case(n, c, dtype, args.iters, tilings)
      for r in [xla] + pallas:
        print(json.dumps(r), flush=True)
      best = min(pallas, key=lambda r: r['fwd_bwd_ms'])
      summary['cases'].append(dict(
          rows=n, cols=c, dtype=dtype, xla_fwd_ms=xla['fwd_ms'],
          xla_fwd_bwd_ms=xla['fwd_bwd_ms'], pallas_fwd_ms=best['fwd_ms'],
          pallas_fwd_bwd_ms=best['fwd_bwd_ms'], best_tiles=best['tiles'],
          max_abs_diff_vs_xla=best['max_abs_diff_vs_xla']))
  print(json.dumps(summary), flush=True)


if __name__ == '__main__':
  main()
