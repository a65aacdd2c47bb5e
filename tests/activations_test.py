"""bias_gelu: the paper's exact GELU of x + b, forward and gradients, keeping only x and b."""

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
