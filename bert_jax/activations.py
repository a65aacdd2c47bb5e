"""Bias + exact GELU as one differentiable function that keeps only its input for backward.

The MLP's `gelu(x @ W + b)` written with `jax.nn.gelu(approximate=False)` keeps three
[tokens, intermediate] tensors for the backward pass (x @ W + b, and erfc's pieces), and XLA
expands `erfc` into a long polynomial: on an H200 the GELU forward of BERT-base/128 was
compute-bound (333 us per layer; issue 30). `bias_gelu` is the paper's exact GELU,
0.5 y (1 + erf(y / sqrt(2))) with y = x + b, written with `lax.erf`, under a `custom_vjp` whose
residuals are only the matmul output x and the bias: the backward recomputes y and
gelu'(y) = Phi(y) + y phi(y) from them. Both directions compute in float32 (as the LayerNorm
statistics do) and return the input's dtype.

`portable_erf` is `lax.erf` written with StableHLO's core operations (export.py): the served
model computes the same GELU.
"""

import functools
import math

import jax
import jax.numpy as jnp

Array = jax.Array

_SQRT_HALF = 1.0 / math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


def _gelu(y: Array) -> Array:
  return 0.5 * y * (1.0 + jax.lax.erf(y * _SQRT_HALF))


@jax.custom_vjp
def bias_gelu(x: Array, bias: Array) -> Array:
  """gelu(x + bias), exact (erf); bias broadcasts over x's leading axes."""
  with jax.named_scope('bias_gelu'):
    return _gelu(x.astype(jnp.float32) + bias.astype(jnp.float32)).astype(x.dtype)


def _bias_gelu_fwd(x: Array, bias: Array):
  return bias_gelu(x, bias), (x, bias)


def _bias_gelu_bwd(residuals, g: Array):
  x, bias = residuals
  with jax.named_scope('bias_gelu_bwd'):
    y = x.astype(jnp.float32) + bias.astype(jnp.float32)
    cdf = 0.5 * (1.0 + jax.lax.erf(y * _SQRT_HALF))
    pdf = _INV_SQRT_2PI * jnp.exp(-0.5 * jnp.square(y))
    dy = g.astype(jnp.float32) * (cdf + y * pdf)
    # The bias broadcast over every leading axis of x: its gradient sums them, in float32.
    dbias = jnp.sum(dy, axis=tuple(range(dy.ndim - bias.ndim)))
    return dy.astype(x.dtype), dbias.astype(bias.dtype)


bias_gelu.defvjp(_bias_gelu_fwd, _bias_gelu_bwd)


# XLA's float32 erf, the decomposition of CHLO's erf: x P(x^2) / Q(x^2) on x clamped to [-4, 4],
# clamped to [-1, 1]; P and Q's coefficients from the highest power down.
_ERF_P = (-2.72614237e-10, 2.77068146e-08, -2.10102394e-06, -5.69250624e-05, -7.34990637e-04,
          -2.95460000e-03, -1.60960332e-02)
_ERF_Q = (-1.45660715e-05, -2.13374049e-04, -1.68282702e-03, -7.37332925e-03, -1.42647391e-02)


def portable_erf(x: Array) -> Array:
  """`lax.erf` of float32 as XLA computes it, in StableHLO's core operations only.

  jax lowers `lax.erf` and `lax.erfc` to CHLO composites (jax 0.12 every CHLO operation),
  which TensorFlow 2.21's XlaCallModule cannot read or cannot refine to a batch's shape: a
  SavedModel's GELU (export.py) is this.
  """
  x = jax.lax.clamp(-4.0, x.astype(jnp.float32), 4.0)
  t = x * x
  p = functools.reduce(lambda acc, c: acc * t + c, _ERF_P[2:], _ERF_P[0] * t + _ERF_P[1])
  q = functools.reduce(lambda acc, c: acc * t + c, _ERF_Q[2:], _ERF_Q[0] * t + _ERF_Q[1])
  return jax.lax.clamp(-1.0, x * p / q, 1.0)


def portable_bias_gelu(x: Array, bias: Array) -> Array:
  """`bias_gelu` with `portable_erf`, for inference (no custom gradient)."""
  y = x.astype(jnp.float32) + bias.astype(jnp.float32)
  return (0.5 * y * (1.0 + portable_erf(y * _SQRT_HALF))).astype(x.dtype)
