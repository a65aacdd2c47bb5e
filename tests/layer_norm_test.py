"""The fused sub-layer end against its jnp reference, and the 8-bit dropout masks.

The Pallas kernels run in interpret mode here (CPU): the same kernel code a GPU lowers through
Triton, masked lanes and rows included.
"""

import jax
from jax import test_util
import jax.numpy as jnp
import numpy as np
import pytest

from bert_jax import layer_norm


def _inputs(rows, hidden, dtype, seed=0):
  k = jax.random.split(jax.random.key(seed), 7)
  x = jax.random.normal(k[0], (2, rows, hidden), dtype)
  residual = jax.random.normal(k[1], (2, rows, hidden), dtype)
  bias = 0.5 * jax.random.normal(k[2], (hidden,), jnp.float32)
  scale = 1.0 + 0.3 * jax.random.normal(k[3], (hidden,), jnp.float32)
  beta = 0.3 * jax.random.normal(k[4], (hidden,), jnp.float32)
  seed = layer_norm.dropout_seed(k[5])
  dy = jax.random.normal(k[6], x.shape, dtype)
  return x, residual, bias, scale, beta, seed, dy


def _mask_bytes(seed, shape):
  """The dropout bytes of the whole array of `shape` (rows: the flattened leading axes)."""
  rows = np.arange(int(np.prod(shape[:-1])), dtype=np.uint32)[:, None]
  cols = np.arange(shape[-1], dtype=np.uint32)[None, :]
  return np.asarray(layer_norm.mask_bytes(seed[0], seed[1], jnp.asarray(rows),
                                          jnp.asarray(cols))).reshape(shape)


def _ln_ref64(x, residual, bias, scale, beta, keep_mult, eps):
  """The formula in float64 numpy: the ground truth both implementations approximate."""
  z = np.asarray(x, np.float64) + (0 if bias is None else np.asarray(bias, np.float64))
  h = z * keep_mult + np.asarray(residual, np.float64)
  mean = h.mean(-1, keepdims=True)
  var = ((h - mean) ** 2).mean(-1, keepdims=True)
  return (h - mean) / np.sqrt(var + eps) * np.asarray(scale, np.float64) + np.asarray(
      beta, np.float64)


@pytest.mark.parametrize('rows, hidden, rate, with_bias', [
    (7, 24, 0.1, True),     # Odd rows (the last kernel program partly empty); H not 2^k.
    (33, 64, 0.1, False),   # No bias (as the embeddings would call it).
    (5, 48, 0.0, True),     # Rate 0: no mask at all.
])
def test_pallas_matches_xla_forward_and_every_gradient(rows, hidden, rate, with_bias):
  x, residual, bias, scale, beta, seed, dy = _inputs(rows, hidden, jnp.float32)
  bias = bias if with_bias else None
  outs = {}
  for impl in ('xla', 'pallas'):
    def f(x, residual, bias, scale, beta, impl=impl):
      return layer_norm.residual_layer_norm(x, residual, bias, scale, beta, seed, rate=rate,
                                            eps=1e-12, impl=impl)
    y, vjp = jax.vjp(f, x, residual, bias, scale, beta)
    outs[impl] = (y,) + vjp(dy)
  names = ('y', 'dx', 'dresidual', 'dbias', 'dscale', 'dbeta')
  for name, a, b in zip(names, outs['xla'], outs['pallas']):
    if a is None:
      assert b is None, name
      continue
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=2e-5, atol=2e-5, err_msg=name)
  # And both are the formula: the forward against float64.
  t = layer_norm.keep_threshold(rate)
  mult = np.where(_mask_bytes(seed, x.shape) >= t, 256 / (256 - t), 0.0) if t else 1.0
  np.testing.assert_allclose(np.asarray(outs['pallas'][0]),
                             _ln_ref64(x, residual, bias, scale, beta, mult, 1e-12),
                             rtol=1e-5, atol=1e-5)


def test_dropped_elements_get_no_gradient_and_kept_ones_are_scaled():
  x, residual, bias, scale, beta, seed, dy = _inputs(9, 32, jnp.float32, seed=3)
  rate = 0.25
  t = layer_norm.keep_threshold(rate)
  dropped = _mask_bytes(seed, x.shape) < t
  assert 0 < dropped.sum() < dropped.size
  for impl in ('xla', 'pallas'):
    f = lambda x, r: layer_norm.residual_layer_norm(x, r, bias, scale, beta, seed, rate=rate,
                                                    impl=impl)
    _, vjp = jax.vjp(f, x, residual)
    dx, dr = (np.asarray(g) for g in vjp(dy))
    assert np.all(dx[dropped] == 0), impl
    np.testing.assert_allclose(dx[~dropped], dr[~dropped] * 256 / (256 - t), rtol=1e-5, atol=1e-6,
                               err_msg=impl)


def test_check_grads_of_the_pallas_kernel():
  x, residual, bias, scale, beta, seed, _ = _inputs(5, 24, jnp.float32, seed=1)
  f = lambda x, r, b, s, be: layer_norm.residual_layer_norm(x, r, b, s, be, seed, rate=0.1,
                                                            impl='pallas')
  test_util.check_grads(f, (x, residual, bias, scale, beta), order=1, modes=['rev'],
                            atol=1e-2, rtol=1e-2, eps=1e-3)


def test_bfloat16_in_and_out_with_float32_statistics():
  """bf16 in and out: the kernel sums in float32, the xla path in bf16 (as flax's layers did;
  cheaper in XLA); both within bf16 rounding of the float32 formula, statistics in float32."""
  x, residual, bias, scale, beta, seed, dy = _inputs(11, 40, jnp.bfloat16, seed=2)
  outs = {}
  for impl in ('xla', 'pallas'):
    f = lambda x, r, b, impl=impl: layer_norm.residual_layer_norm(
        x, r, b, scale, beta, seed, rate=0.1, impl=impl)
    y, vjp = jax.vjp(f, x, residual, bias)
    outs[impl] = (y,) + vjp(dy)
    assert [o.dtype for o in outs[impl]] == [jnp.bfloat16] * 3 + [jnp.float32], impl
  up = lambda a: a.astype(jnp.float32)
  f32 = lambda x, r, b: layer_norm.residual_layer_norm(
      x, r, b, scale, beta, seed, rate=0.1, impl='xla')
  y, vjp = jax.vjp(f32, up(x), up(residual), up(bias))
  ref = (y,) + vjp(up(dy))
  # One bf16 rounding of the output (pallas); up to three more of the sum's terms (xla).
  for impl, tol in (('pallas', 1e-2), ('xla', 4e-2)):
    for a, b in zip(outs[impl], ref):
      np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                 rtol=tol, atol=tol, err_msg=impl)


def test_pallas_is_one_pallas_call_and_xla_none():
  """('auto' is resolved before this layer: model_test.py's
  test_auto_resolves_for_the_platform_in_one_place.)"""
  x, residual, bias, scale, beta, seed, _ = _inputs(3, 8, jnp.float32)
  jaxpr = str(jax.make_jaxpr(lambda *a: layer_norm.residual_layer_norm(
      *a, seed, rate=0.1, impl='xla'))(x, residual, bias, scale, beta))
  assert 'pallas_call' not in jaxpr
  jaxpr = str(jax.make_jaxpr(lambda *a: layer_norm.residual_layer_norm(
      *a, seed, rate=0.1, impl='pallas'))(x, residual, bias, scale, beta))
  assert 'pallas_call' in jaxpr


def test_dropout_masks_rate_and_independence():
  """The hashed masks (layer_norm.mask_bytes): the rate, neighbours along rows and columns
  uncorrelated, another seed another mask, and the seed from a key of any implementation."""
  seed = layer_norm.dropout_seed(jax.random.key(0))
  assert seed.shape == (2,) and seed.dtype == jnp.uint32
  byte = _mask_bytes(seed, (64, 513))
  assert byte.min() >= 0 and byte.max() < 256
  t = layer_norm.keep_threshold(0.1)
  assert t == 26  # The rate applied: 26 / 256.
  dropped = byte < t
  # Binomial: 32,832 draws at p = 0.1016, standard deviation 0.0017.
  assert abs(dropped.mean() - 26 / 256) < 0.006
  assert abs(np.corrcoef(dropped[:, :-1].ravel(), dropped[:, 1:].ravel())[0, 1]) < 0.03
  assert abs(np.corrcoef(dropped[:-1].ravel(), dropped[1:].ravel())[0, 1]) < 0.03
  # The bytes are uniform: each of 16 bins of 16 values holds 1/16 of them.
  counts = np.bincount(byte.ravel() // 16, minlength=16) / byte.size
  assert np.all(np.abs(counts - 1 / 16) < 0.006), counts
  other = _mask_bytes(layer_norm.dropout_seed(jax.random.key(1)), (64, 513))
  assert (other != byte).mean() > 0.9


@pytest.mark.parametrize('impl', ['threefry2x32', 'rbg', 'unsafe_rbg'])
def test_every_key_gives_its_own_dropout_seed(impl):
  """The seeds of keys folded as the steps and flax's modules fold them differ from each other
  and from 0, for every train.rng_impl. (An 'rbg' key's two halves are equal: their xor, which
  dropout_seed took before, was 0 for every key, so every step and layer of a one-device run
  drew the same masks.) unsafe_rbg folds commutatively, folding 1 twice undoes it (jax.random's
  documented trade-off), so its keys here are seeded apart."""
  base = jax.random.fold_in(jax.random.key(0, impl=impl), 1)
  keys = ([jax.random.key(i, impl=impl) for i in range(12)] if impl == 'unsafe_rbg' else
          [jax.random.fold_in(jax.random.fold_in(base, step), module)
           for step in range(4) for module in range(3)])
  seeds = [tuple(np.asarray(layer_norm.dropout_seed(k)).tolist()) for k in keys]
  assert all(len(s) == 2 for s in seeds) and (0, 0) not in seeds, seeds
  assert len(set(seeds)) == len(seeds), seeds
  if impl == 'threefry2x32':  # A threefry key's seed is the key: masks as before.
    np.testing.assert_array_equal(layer_norm.dropout_seed(keys[0]), jax.random.key_data(keys[0]))
  with pytest.raises(ValueError, match='3 words cannot seed dropout'):
    layer_norm.dropout_seed(jnp.zeros(3, jnp.uint32))


def test_dropout_multiplies_and_keeps_the_expectation():
  x = jnp.ones((256, 256), jnp.bfloat16)
  seed = layer_norm.dropout_seed(jax.random.key(0))
  y = np.asarray(layer_norm.dropout(x, seed, 0.1), np.float32)
  assert set(np.unique(y).tolist()) == {0.0, float(jnp.bfloat16(256 / 230))}
  assert abs(y.mean() - 1.0) < 0.01
  np.testing.assert_array_equal(y == 0, _mask_bytes(seed, x.shape) < 26)
  assert layer_norm.dropout(x, seed, 0.0) is x
  with pytest.raises(ValueError, match='dropout rate'):
    layer_norm.keep_threshold(1.0)


def test_pallas_on_a_mesh_runs_per_device_and_sums_the_parameter_gradients():
  """Under a data x fsdp x tensor mesh the kernels run per device on their rows (shard_map),
  and the bias/scale/beta gradients are the sums over every device's rows."""
  from bert_jax import config_files  # pylint: disable=g-import-not-at-top
  from bert_jax import sharding as sharding_lib  # pylint: disable=g-import-not-at-top
  x, residual, bias, scale, beta, seed, dy = _inputs(6, 24, jnp.float32, seed=5)
  x, residual, dy = (jnp.concatenate([a, a[::-1] * 0.5]) for a in (x, residual, dy))

  def run(impl):
    def f(x, residual, bias, scale, beta):
      return layer_norm.residual_layer_norm(x, residual, bias, scale, beta, seed, rate=0.1,
                                            impl=impl)
    y, vjp = jax.vjp(f, x, residual, bias, scale, beta)
    return (y,) + vjp(dy)

  reference = jax.jit(lambda: run('xla'))()
  config = config_files.load_config('configs/smoke.py', {'mesh.data': 2, 'mesh.fsdp': 2,
                                                         'mesh.tensor': 2})
  mesh = sharding_lib.make_mesh(config.mesh, jax.devices()[:8])
  with sharding_lib.activate(mesh, sharding_lib.rules_from_config(config.mesh)):
    jaxpr = str(jax.make_jaxpr(lambda: run('pallas'))())
    out = jax.jit(lambda: run('pallas'))()
  assert 'shard_map' in jaxpr and 'pallas_call' in jaxpr
  for a, b in zip(reference, out):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=2e-5, atol=2e-5)


def test_residual_copy_takes_both_gradients_into_the_backward_kernel():
  """residual_copy=True returns y twice; the gradients of the two copies are added inside the
  backward kernel (it reads both): the same gradients as one output whose gradient is their
  sum, and a copy nothing reads costs no zeros tensor (a symbolic zero: one dy read)."""
  x, residual, bias, scale, beta, seed, dy = _inputs(9, 40, jnp.float32, seed=3)
  dy2 = jnp.flip(dy, axis=1) * 0.7

  def grads(impl, copy, cotangent):
    def f(x, residual, bias, scale, beta):
      return layer_norm.residual_layer_norm(x, residual, bias, scale, beta, seed, rate=0.1,
                                            impl=impl, residual_copy=copy)
    out, vjp = jax.vjp(f, x, residual, bias, scale, beta)
    return out, vjp(cotangent)

  (y, y_copy), both = grads('pallas', True, (dy, dy2))
  assert y is y_copy or np.array_equal(np.asarray(y), np.asarray(y_copy))
  _, summed = grads('xla', False, dy + dy2)
  _, xla_both = grads('xla', True, (dy, dy2))
  for a, b, c in zip(summed, both, xla_both):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(np.asarray(c), np.asarray(a), rtol=2e-5, atol=2e-5)

  def second_unused(x, residual, bias, scale, beta):
    return layer_norm.residual_layer_norm(x, residual, bias, scale, beta, seed, rate=0.1,
                                          impl='pallas', residual_copy=True)[0]
  _, vjp = jax.vjp(second_unused, x, residual, bias, scale, beta)
  _, single = grads('xla', False, dy)
  for a, b in zip(single, vjp(dy)):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=2e-5, atol=2e-5)
  # The backward kernel's inputs: one dy when the copy is unused, two when both are, and no
  # add of the two outside it.
  def backward_call(f, cotangent):
    jaxpr = jax.make_jaxpr(lambda *a: jax.vjp(f, *a)[1](cotangent))(
        x, residual, bias, scale, beta)
    # (The forward's call is there too: the backward's is the one with dx, dr, partials.)
    calls = [e for e in jaxpr.eqns if e.primitive.name == 'pallas_call' and len(e.outvars) == 3]
    assert len(calls) == 1 and not any(e.primitive.name == 'add_any' for e in jaxpr.eqns)
    return calls[0]
  both_call = backward_call(lambda *a: layer_norm.residual_layer_norm(
      *a, seed, rate=0.1, impl='pallas', residual_copy=True), (dy, dy2))
  assert len(both_call.invars) == len(backward_call(second_unused, dy).invars) + 1


def test_pallas_quantizing_for_fp8_matmuls_on_a_mesh_is_the_one_device_result():
  """The kernels' FP8 outputs (fp8_out: the output quantized, amaxes by blocks; fp8_grad: dx
  quantized into the channel's carrier, its amax into the slot's; each by its scale in a
  table) per device under a data x fsdp x tensor mesh: the blocks' amaxes side by side, the
  same values as on one device, and those of flax's quantizing."""
  from bert_jax import config_files  # pylint: disable=g-import-not-at-top
  from bert_jax import fp8  # pylint: disable=g-import-not-at-top
  from bert_jax import sharding as sharding_lib  # pylint: disable=g-import-not-at-top
  x, residual, bias, scale, beta, seed, dy = _inputs(24, 40, jnp.bfloat16, seed=6)
  x, residual, dy = (jnp.concatenate([a, a[::-1] * 0.5] * 2) for a in (x, residual, dy))
  # The kernels read their scales from a table in place, each at its index.
  table = jnp.asarray([1.0, 0.01, 3.0, 0.0002, 5.0], jnp.float32)
  out_scale, grad_scale = table[1:2], table[3:4]
  carrier = jnp.zeros(x.shape, jnp.float8_e5m2)
  slot = jnp.zeros((1, fp8.FP8_AMAX_ROWS), jnp.float32)

  def run():
    def f(x, residual, carrier, slot):
      y, copy, qy, parts = layer_norm.residual_layer_norm(
          x, residual, bias, scale, beta, seed, rate=0.1, impl='pallas', residual_copy=True,
          fp8_grad=(table, 3, carrier, slot), fp8_out=(table, 1, jnp.float8_e4m3fn))
      return y, copy, qy, jnp.max(parts)
    out, vjp = jax.vjp(f, x, residual, carrier, slot)
    dx, dr, q_dx, amaxes = vjp((dy, dy * 0.5, jnp.zeros_like(out[2]), jnp.zeros(())))
    return out + (dx, dr, q_dx, jnp.max(amaxes))

  one = jax.jit(run)()
  config = config_files.load_config('configs/smoke.py', {'mesh.data': 2, 'mesh.fsdp': 2,
                                                         'mesh.tensor': 2})
  mesh = sharding_lib.make_mesh(config.mesh, jax.devices()[:8])
  with sharding_lib.activate(mesh, sharding_lib.rules_from_config(config.mesh)):
    jaxpr = str(jax.make_jaxpr(run)())
    many = jax.jit(run)()
  assert 'shard_map' in jaxpr and 'pallas_call' in jaxpr
  names = ('y', 'copy', 'quantized y', 'amax of y', 'dx', 'd residual', 'quantized dx',
           'amax of dx')
  for name, a, b in zip(names, one, many):
    assert a.dtype == b.dtype, (name, a.dtype, b.dtype)
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                  err_msg=name)
  # The quantized copies are the outputs quantized as flax quantizes them; the channel's dx
  # is the one a bf16 dx would be, and x itself gets none.
  y, _, qy, y_amax, dx, _, q_dx, dx_amax = one
  from flax.linen import fp8_ops  # pylint: disable=g-import-not-at-top
  np.testing.assert_array_equal(
      np.asarray(qy, np.float32),
      np.asarray(fp8_ops.quantize(y, jnp.float8_e4m3fn, out_scale, jnp.bfloat16), np.float32))
  assert float(y_amax) == float(jnp.max(jnp.abs(y.astype(jnp.float32))))
  assert not np.any(np.asarray(dx, np.float32)) and float(dx_amax) > 0
  _, vjp = jax.vjp(lambda x, r: layer_norm.residual_layer_norm(
      x, r, bias, scale, beta, seed, rate=0.1, impl='pallas', residual_copy=True), x, residual)
  plain_dx = vjp((dy, dy * 0.5))[0]
  np.testing.assert_array_equal(
      np.asarray(q_dx, np.float32),
      np.asarray(fp8_ops.quantize(plain_dx, jnp.float8_e5m2, grad_scale, jnp.bfloat16),
                 np.float32))
  assert float(dx_amax) == float(jnp.max(jnp.abs(plain_dx.astype(jnp.float32))))


def test_fp8_quantizing_is_refused_by_the_xla_implementation():
  """The FP8 gradient channel and output take the Pallas kernels; with 'xla' the channel would
  leave its matmul zero gradients, so asking for either is an error (not an assert that
  `python -O` drops)."""
  x, residual, bias, scale, beta, seed, _ = _inputs(4, 16, jnp.bfloat16)
  table = jnp.ones((3,), jnp.float32)
  for kw in (dict(fp8_out=(table, 0, jnp.float8_e4m3fn)),
             dict(fp8_grad=(table, 2, jnp.zeros(x.shape, jnp.float8_e5m2), table[:1]))):
    with pytest.raises(ValueError, match="only with impl='pallas'"):
      layer_norm.residual_layer_norm(x, residual, bias, scale, beta, seed, rate=0.1,
                                     impl='xla', **kw)
  with pytest.raises(ValueError, match='not a 1-D table holding it'):
    layer_norm.residual_layer_norm(x, residual, bias, scale, beta, seed, rate=0.1,
                                   impl='pallas', fp8_out=(table, 3, jnp.float8_e4m3fn))
