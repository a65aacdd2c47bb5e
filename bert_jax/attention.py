"""Self-attention over packed rows: the math behind `model.SelfAttention`, one entry point.

A row of `sequence_ids` [B, T] says which packed sequence each token belongs to: 0 is padding,
k >= 1 the k-th sequence of the row. A query attends a key iff both carry the same nonzero id,
so attention is block-diagonal and never crosses from one packed sequence to another. An
unpacked batch is the special case `sequence_ids = input_mask`.

Padding queries (id 0) attend every real key of their row, as in the original BERT (whose mask
is over keys only): their outputs stay finite and, unpacked, equal the original's everywhere.
No loss reads them.
"""

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array


def block_diagonal_mask(sequence_ids: Array) -> Array:
  """[B, T] sequence ids -> [B, 1, T, T] bool: query t may attend key s."""
  q = sequence_ids[:, None, :, None]
  k = sequence_ids[:, None, None, :]
  return (k > 0) & ((q == k) | (q == 0))


def dot_product_attention(q: Array, k: Array, v: Array, sequence_ids: Array, *, impl: str,
                          probs_dropout: Callable[[Array], Array] | None = None) -> Array:
  """Softmax(q k^T / sqrt(d)) v within each packed sequence; q, k, v are [B, T, heads, d].

  `probs_dropout` (training with attention dropout) is applied to the attention
  probabilities.
  """
  mask = block_diagonal_mask(sequence_ids)
  if probs_dropout is not None:
    # jax.nn.dot_product_attention has no dropout: the same numerics, written out.
    logits = jnp.einsum('btnh,bsnh->bnts', q, k, preferred_element_type=jnp.float32)
    logits = logits / np.sqrt(q.shape[-1]).astype(np.float32)
    logits = jnp.where(mask, logits, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(logits, axis=-1)
    probs = probs_dropout(probs).astype(v.dtype)
    return jnp.einsum('bnts,bsnh->btnh', probs, v)
  return jax.nn.dot_product_attention(q, k, v, mask=mask, implementation=impl)
