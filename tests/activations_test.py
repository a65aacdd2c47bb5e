"""bias_gelu: the paper's exact GELU of x + b, forward and gradients, keeping only x and b.

The Pallas kernels run in interpret mode here (CPU): the same kernel code a GPU lowers through
Triton, masked rows and columns included.
"""

import math

import jax
from jax import export
import jax.numpy as jnp
import numpy as np
import pytest

from bert_jax import activations


def _reference(x, b):
  return jax.nn.gelu(x + b, approximate=False)


def _inputs(dtype, shape=(3, 5, 64)):
  rng = np.random.RandomState(0)
  # Spread wide enough to reach both tails (gelu -> 0 and gelu -> y) and the curved middle.
  x = rng.randn(*shape).astype(np.float32) * 3.0
  b = rng.randn(shape[-1]).astype(np.float32)
  g = rng.randn(*shape).astype(np.float32)
  return (jnp.asarray(x, dtype), jnp.asarray(b, dtype), jnp.asarray(g, dtype))


def test_bias_gelu_matches_jax_exact_gelu_forward_and_gradients_float32():
  x, b, g = _inputs(jnp.float32)
  out, vjp = jax.vjp(activations.bias_gelu, x, b)
  ref, ref_vjp = jax.vjp(_reference, x, b)
  np.testing.assert_allclose(out, ref, rtol=1e-6, atol=1e-6)
  for got, want in zip(vjp(g), ref_vjp(g)):
    assert got.shape == want.shape and got.dtype == want.dtype
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  # Compiled (as in the step), the same to float32 rounding.
  np.testing.assert_allclose(jax.jit(activations.bias_gelu)(x, b), ref, rtol=1e-6, atol=1e-6)


def test_bias_gelu_bfloat16_is_the_float32_result_rounded():
  x, b, g = _inputs(jnp.bfloat16)
  out, vjp = jax.vjp(activations.bias_gelu, x, b)
  assert out.dtype == jnp.bfloat16
  f32 = lambda t: t.astype(jnp.float32)
  ref, ref_vjp = jax.vjp(_reference, f32(x), f32(b))
  np.testing.assert_allclose(f32(out), ref, rtol=2 ** -8, atol=1e-2)
  dx, db = vjp(g)
  rdx, rdb = ref_vjp(f32(g))
  assert dx.dtype == db.dtype == jnp.bfloat16
  np.testing.assert_allclose(f32(dx), rdx, rtol=2 ** -7, atol=1e-2)
  # The bias gradient sums 15 rows in float32 before one rounding.
  np.testing.assert_allclose(f32(db), rdb, rtol=2 ** -7, atol=2e-2)


def test_bias_gelu_keeps_only_the_matmul_output_and_the_bias_for_backward():
  x, b, _ = _inputs(jnp.bfloat16)
  _, vjp = jax.vjp(activations.bias_gelu, x, b)
  saved = jax.tree_util.tree_leaves(vjp)
  assert sorted((a.shape, a.dtype) for a in saved) == sorted([(x.shape, x.dtype),
                                                              (b.shape, b.dtype)]), saved
  # jax.nn.gelu keeps more than its input (the reference this replaces).
  _, ref_vjp = jax.vjp(_reference, x, b)
  assert sum(a.size for a in jax.tree_util.tree_leaves(ref_vjp)) > x.size + b.size


@pytest.mark.parametrize('shape', [(7, 16), (2, 3, 4, 8)])
def test_bias_gelu_bias_gradient_sums_every_leading_axis(shape):
  x, b, g = _inputs(jnp.float32, shape)
  _, vjp = jax.vjp(activations.bias_gelu, x, b)
  _, ref_vjp = jax.vjp(_reference, x, b)
  np.testing.assert_allclose(vjp(g)[1], ref_vjp(g)[1], rtol=1e-5, atol=1e-5)


def test_portable_erf_is_lax_erf_in_core_operations():
  x = jnp.concatenate([jnp.linspace(-6.0, 6.0, 4001), jnp.array([0.0, -0.0, 1e-8, 30.0])])
  np.testing.assert_allclose(activations.portable_erf(x), jax.lax.erf(x), rtol=0, atol=5e-7)
  x, b, _ = _inputs(jnp.float32)
  np.testing.assert_allclose(activations.portable_bias_gelu(x, b),
                             activations.bias_gelu(x, b), rtol=2e-6, atol=2e-6)
  # What TensorFlow's XlaCallModule cannot read (export.py): a CHLO composite.
  lowered = export.export(jax.jit(activations.portable_bias_gelu))(x, b).mlir_module()
  assert 'composite' not in lowered
  assert 'composite' in export.export(jax.jit(jax.lax.erf))(x).mlir_module()


def _exact64(y):
  """gelu and gelu' in float64 (math.erf): the ground truth."""
  y = np.asarray(y, np.float64)
  cdf = 0.5 * (1.0 + np.vectorize(math.erf)(y / math.sqrt(2.0)))
  return y * cdf, cdf + y * np.exp(-0.5 * y * y) / math.sqrt(2.0 * math.pi)


def test_the_kernels_body_is_exact_gelu_to_float32_rounding():
  """Abramowitz & Stegun's Phi (activations.phi_and_density): forward within 7e-7 and
  gradient within 4e-7 of float64 everywhere (jnp's float32 erf GELU: 6e-7); and rounded to
  bfloat16, the forward is the correctly rounded exact GELU wherever |gelu| >= 4e-3
  (y >= -3), within one bfloat16 step of it down to y = -5 (|gelu| < 4e-3, where the tail's
  relative error grows)."""
  y = np.linspace(-12.0, 12.0, 240_001).astype(np.float32)
  want, want_grad = _exact64(y)
  got = np.asarray(activations.gelu_fast(jnp.asarray(y)), np.float64)
  got_grad = np.asarray(activations.gelu_fast_grad(jnp.asarray(y)), np.float64)
  assert np.max(np.abs(got - want)) < 7e-7
  assert np.max(np.abs(got_grad - want_grad)) < 4e-7
  yb = np.asarray(jnp.asarray(y, jnp.bfloat16).astype(jnp.float32))
  as_bits = lambda v: np.asarray(jnp.asarray(v, jnp.bfloat16).view(jnp.int16), np.int64)
  steps = np.abs(as_bits(_exact64(yb)[0].astype(np.float32)) -
                 as_bits(activations.gelu_fast(jnp.asarray(yb))))
  assert steps[yb >= -3].max() == 0
  assert steps[yb >= -5].max() <= 1
  # The tanh form of the original BERT's modeling.py is 700x further off (4.7e-4).
  tanh = np.asarray(jax.nn.gelu(jnp.asarray(y), approximate=True), np.float64)
  assert np.max(np.abs(tanh - want)) > 4e-4


@pytest.mark.parametrize('shape', [(2, 37, 40), (130, 1100)])
def test_pallas_matches_xla_forward_and_gradients(shape):
  """Rows past a tile and past a backward program (130 > 64, 74 = 2 x 37), columns past a
  tile (1100 > 1024) and below one (40): the bias gradient is the sum of several programs'
  partials."""
  x, b, g = _inputs(jnp.float32, shape)
  outs = {}
  for impl in ('xla', 'pallas'):
    f = lambda x, b, impl=impl: activations.bias_gelu(x, b, impl=impl)
    y, vjp = jax.vjp(f, x, b)
    outs[impl] = (y,) + vjp(g)
  for name, a, b_ in zip(('y', 'dx', 'dbias'), outs['xla'], outs['pallas']):
    assert a.shape == b_.shape and a.dtype == b_.dtype, name
    tol = 1e-5 if name == 'dbias' else 2e-6
    np.testing.assert_allclose(np.asarray(b_), np.asarray(a), rtol=tol, atol=tol, err_msg=name)


def test_pallas_bfloat16_in_and_out():
  x, b, g = _inputs(jnp.bfloat16, (3, 70, 64))
  out, vjp = jax.vjp(lambda x, b: activations.bias_gelu(x, b, impl='pallas'), x, b)
  ref, ref_vjp = jax.vjp(lambda x, b: activations.bias_gelu(x, b, impl='xla'), x, b)
  assert out.dtype == jnp.bfloat16
  f32 = lambda t: np.asarray(t, np.float32)
  # At most one bfloat16 step apart (y = x + b is float32: a rounding boundary can fall
  # between the two float32 results).
  np.testing.assert_allclose(f32(out), f32(ref), rtol=2 ** -7, atol=1e-5)
  for got, want in zip(vjp(g), ref_vjp(g)):
    assert got.dtype == want.dtype == jnp.bfloat16
    np.testing.assert_allclose(f32(got), f32(want), rtol=2 ** -7, atol=2e-2)


def test_pallas_keeps_only_the_matmul_output_and_the_bias_for_backward():
  x, b, _ = _inputs(jnp.bfloat16)
  _, vjp = jax.vjp(lambda x, b: activations.bias_gelu(x, b, impl='pallas'), x, b)
  saved = [a for a in jax.tree_util.tree_leaves(vjp) if a.size > 1]
  assert sorted((a.shape, a.dtype) for a in saved) == sorted([(x.shape, x.dtype),
                                                              (b.shape, jnp.float32)]), saved


def test_pallas_is_one_kernel_each_way_and_xla_none():
  """('auto' is resolved before this function: model_test.py's
  test_auto_resolves_for_the_platform_in_one_place.)"""
  x, b, g = _inputs(jnp.float32)
  for impl, calls in (('xla', 0), ('pallas', 2)):
    fwd_bwd = lambda x, b, impl=impl: jax.vjp(
        lambda x, b: activations.bias_gelu(x, b, impl=impl), x, b)[1](g)
    assert str(jax.make_jaxpr(fwd_bwd)(x, b)).count('pallas_call') == calls, impl


def test_pallas_on_a_mesh_runs_per_device_and_sums_the_bias_gradient():
  """Under a data x fsdp x tensor mesh the kernels run per device (shard_map): rows split
  over data and fsdp, columns over tensor ('act_mlp'), the bias gradient summed over the
  devices' rows."""
  from bert_jax import config_files  # pylint: disable=g-import-not-at-top
  from bert_jax import sharding as sharding_lib  # pylint: disable=g-import-not-at-top
  x, b, g = _inputs(jnp.float32, (4, 6, 40))

  def run(impl):
    f = lambda x, b: activations.bias_gelu(x, b, impl=impl,
                                           axes=('batch', 'length', 'act_mlp'))
    y, vjp = jax.vjp(f, x, b)
    return (y,) + vjp(g)

  reference = jax.jit(lambda: run('xla'))()
  config = config_files.load_config('configs/smoke.py', {'mesh.data': 2, 'mesh.fsdp': 2,
                                                         'mesh.tensor': 2})
  mesh = sharding_lib.make_mesh(config.mesh, jax.devices()[:8])
  with sharding_lib.activate(mesh, sharding_lib.rules_from_config(config.mesh)):
    jaxpr = str(jax.make_jaxpr(lambda: run('pallas'))())
    out = jax.jit(lambda: run('pallas'))()
  assert 'shard_map' in jaxpr and 'pallas_call' in jaxpr
  for a, b_ in zip(reference, out):
    np.testing.assert_allclose(np.asarray(b_), np.asarray(a), rtol=1e-5, atol=1e-5)
