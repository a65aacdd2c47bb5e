"""Rotary position embeddings (Su et al., 2021, "RoFormer"), as ModernBERT and transformers apply
them: the query and key of every head are rotated by their token's position before attention, so
the attention scores depend only on how far apart two tokens are.

Each pair of dimensions (i, i + d/2) of a head of size d is rotated by position * theta^(-2i/d)
("rotate half": the halves of the head, not interleaved pairs, as in transformers' Llama and
ModernBERT, so that exported weights mean the same there). The angles are computed in float32
from integer positions and the rotation runs in float32; the result returns in the input dtype.

Nothing here is a parameter: the model keeps no position table, and a row may be as long as
memory allows (`max_position_embeddings` is then only what the model was trained for).
"""

import jax
import jax.numpy as jnp

Array = jax.Array


def angles(positions: Array, head_dim: int, theta: float | Array) -> tuple[Array, Array]:
  """(cos, sin) [B, T, d] of integer `positions` [B, T] for heads of `head_dim`; `theta` may be
  a traced scalar (scanned layers of two kinds)."""
  if head_dim % 2:
    raise ValueError(f'rotary embeddings need an even head size, got {head_dim}')
  exponents = jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim
  inv_freq = 1.0 / (jnp.asarray(theta, jnp.float32) ** exponents)
  freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, d/2]
  freqs = jnp.concatenate([freqs, freqs], axis=-1)
  return jnp.cos(freqs), jnp.sin(freqs)


def _rotate_half(x: Array) -> Array:
  half = x.shape[-1] // 2
  return jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def apply(x: Array, cos: Array, sin: Array) -> Array:
  """`x` [B, T, heads, d] rotated by (cos, sin) [B, T, d], in float32; returns x's dtype."""
  x32 = x.astype(jnp.float32)
  cos, sin = cos[:, :, None, :], sin[:, :, None, :]
  return (x32 * cos + _rotate_half(x32) * sin).astype(x.dtype)
