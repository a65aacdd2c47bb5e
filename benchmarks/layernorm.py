"""The post-LN sub-layer end, LayerNorm(residual + dropout(x + bias)): XLA vs the Pallas kernel.

  python3 benchmarks/layernorm.py                      # GPU: [256*128, 768] and [.., 1024] bf16
  python3 benchmarks/layernorm.py --rows=63 --hidden=24,64 --iters=2   # CPU: a check only

Times forward and forward+backward (dx, d residual, d bias, d scale, d beta) of
`layer_norm.residual_layer_norm` with dropout 0.1 for impl='xla' and impl='pallas', each jitted,
the median of --iters runs after a warm-up, and reports ms, GB/s (the bytes the fused kernels
must move: forward reads x, residual and writes y; backward reads x, residual, dy and writes
dx, d residual; the dropout mask is hashed from a seed in the kernels) and the largest absolute
difference of every output from the xla path. --rows_per_program sweeps the kernels' tiling, FWD:BWD[:TILE] (forward rows per
program, backward rows per program, backward rows per loop step; e.g. 4:64:4,2:32:2,8:128:8);
one JSON line per (hidden, impl, tiling), then a summary line with the best.
Needs no TensorFlow.
Off a GPU the Pallas kernel runs in interpret mode: the differences are checked, timings mean
nothing.
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

from bert_jax import layer_norm  # pylint: disable=g-import-not-at-top


def parse_args(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0], allow_abbrev=False)
  parser.add_argument('--rows', type=int, default=256 * 128, help='rows (tokens)')
  parser.add_argument('--hidden', default='768,1024', help='comma-separated hidden sizes')
  parser.add_argument('--rate', type=float, default=0.1, help='dropout rate')
  parser.add_argument('--dtype', default='bfloat16', choices=['bfloat16', 'float32'])
  parser.add_argument('--iters', type=int, default=50, help='timed runs (median reported)')
  parser.add_argument('--rows_per_program', default='8:128:8',
                      help='FWD:BWD[:TILE] rows each Pallas forward and backward program '
                           'handles (and the backward rows per loop step), comma-separated to '
                           'sweep (the module default: layer_norm._FWD_ROWS, _BWD_ROWS, '
                           '_BWD_TILE)')
  return parser.parse_args(argv)


def median_seconds(fn, args, iters: int) -> float:
  """Median wall time of `iters` calls of jitted `fn(*args)` after a compiling warm-up
  (benchmarks/gelu.py times with it too)."""
  jax.block_until_ready(fn(*args))  # Compile and warm up.
  times = []
  for _ in range(iters):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return float(np.median(times))


def run_case(rows, hidden, rate, dtype, iters, tilings):
  keys = jax.random.split(jax.random.key(0), 6)
  x = jax.random.normal(keys[0], (1, rows, hidden), dtype)
  residual = jax.random.normal(keys[1], (1, rows, hidden), dtype)
  bias = 0.1 * jax.random.normal(keys[2], (hidden,), jnp.float32)
  scale = 1.0 + 0.1 * jax.random.normal(keys[3], (hidden,), jnp.float32)
  beta = 0.1 * jax.random.normal(keys[4], (hidden,), jnp.float32)
  seed = layer_norm.dropout_seed(keys[5])
  dy = jax.random.normal(jax.random.key(1), x.shape, dtype)
  size = jnp.dtype(dtype).itemsize * rows * hidden
  fwd_bytes = 3 * size
  bwd_bytes = 5 * size + fwd_bytes  # fwd+bwd moves both.
  results, outputs = [], {}
  # pylint: disable-next=protected-access
  defaults = layer_norm._FWD_ROWS, layer_norm._BWD_ROWS, layer_norm._BWD_TILE
  runs = [('xla', None)] + [('pallas', t) for t in tilings]
  for impl, tiling in runs:
    if tiling:
      # pylint: disable-next=protected-access
      layer_norm._FWD_ROWS, layer_norm._BWD_ROWS, layer_norm._BWD_TILE = (
          tiling + defaults[len(tiling):])
    def f(x, residual, bias, scale, beta, impl=impl):
      return layer_norm.residual_layer_norm(x, residual, bias, scale, beta, seed, rate=rate,
                                            impl=impl)

    fwd = jax.jit(f)
    fwd_bwd = jax.jit(lambda *a, f=f: jax.vjp(f, *a)[1](dy) + (f(*a),))
    args = (x, residual, bias, scale, beta)
    out = fwd_bwd(*args)
    t_fwd, t_all = median_seconds(fwd, args, iters), median_seconds(fwd_bwd, args, iters)
    r = dict(impl=impl, rows=rows, hidden=hidden, dtype=dtype, rate=rate,
             fwd_ms=1e3 * t_fwd, fwd_bwd_ms=1e3 * t_all,
             fwd_gbps=fwd_bytes / t_fwd / 1e9, fwd_bwd_gbps=bwd_bytes / t_all / 1e9)
    if impl == 'xla':
      outputs = out
    else:
      r['rows_per_program'] = ':'.join(str(v) for v in tiling)
      names = ('dx', 'dresidual', 'dbias', 'dscale', 'dbeta', 'y')
      r['max_abs_diff_vs_xla'] = {
          n: float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))
          for n, a, b in zip(names, outputs, out)}
    results.append(r)
  # pylint: disable-next=protected-access
  layer_norm._FWD_ROWS, layer_norm._BWD_ROWS, layer_norm._BWD_TILE = defaults
  return results


def main(argv=None):
  args = parse_args(argv)
  summary = dict(backend=jax.default_backend(), device=jax.devices()[0].device_kind,
                 jax=jax.__version__,
                 pallas_interpreted=jax.default_backend() != 'gpu', cases=[])
  tilings = [tuple(int(v) for v in t.split(':')) for t in args.rows_per_program.split(',')]
  for hidden in [int(h) for h in args.hidden.split(',')]:
    xla, *pallas = run_case(args.rows, hidden, args.rate, args.dtype, args.iters, tilings)
    for r in [xla] + pallas:
      print(json.dumps(r), flush=True)
    best = min(pallas, key=lambda r: r['fwd_bwd_ms'])
    summary['cases'].append(dict(
        hidden=hidden, xla_fwd_bwd_ms=xla['fwd_bwd_ms'], pallas_fwd_bwd_ms=best['fwd_bwd_ms'],
        best_rows_per_program=best['rows_per_program'],
        speedup_fwd=xla['fwd_ms'] / best['fwd_ms'],
        speedup_fwd_bwd=xla['fwd_bwd_ms'] / best['fwd_bwd_ms'],
        max_abs_diff_vs_xla=max((p['max_abs_diff_vs_xla'] for p in pallas),
                                key=lambda d: max(d.values()))))
  print(json.dumps(summary), flush=True)


if __name__ == '__main__':
  main()
