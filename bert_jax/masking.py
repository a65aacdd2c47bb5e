"""Dynamic masked-LM masking in TensorFlow graph ops, vectorized over a batch of sequences.

The rules are the original `create_pretraining_data.py` ones, drawn afresh whenever a batch
is built (so a sequence seen twice gets two different masks):

- Eligible tokens are all but the special ones given in `ineligible_ids` ([CLS], [SEP],
  [PAD], [MASK]); [UNK] stays eligible, as in the original.
- num_to_predict = min(max_predictions, max(1, round(eligible * masked_lm_prob))), and never
  more than the eligible tokens (0 for an all-padding row).
- Positions are drawn uniformly without replacement, or, with whole-word masking, whole words
  (a piece plus the '##' pieces that follow it) are taken in random order and a word that
  would overflow num_to_predict is skipped while smaller later words may still fit (the
  original's `continue`).
- Each chosen token becomes [MASK] with probability 0.8, stays itself with 0.1 and becomes a
  uniformly drawn id with 0.1. Unlike the original, the random id never is a special token
  (`replacement_ids` lists the allowed ones): putting [CLS] or [PAD] mid-sentence teaches
  nothing.
- masked_lm_positions ascend; masked_lm_ids are the original ids; padding slots have
  position 0, id 0 and weight 0.0.
"""

from typing import Sequence

import numpy as np
import tensorflow as tf

from bert_jax.errors import UserError


def replacement_table(vocab_size: int, special_ids: Sequence[int]) -> np.ndarray:
  """The ids a masked token may be replaced with: the whole vocabulary minus `special_ids`."""
  allowed = np.setdiff1d(np.arange(vocab_size, dtype=np.int32),
                         np.asarray(list(special_ids), np.int32))
  if allowed.size == 0:
    raise UserError(f'a vocabulary of {vocab_size} ids has no non-special token')
  return allowed


def mask_tokens(input_ids: tf.Tensor, seed: tf.Tensor, *, max_predictions: int,
                masked_lm_prob: float, mask_id: int, ineligible_ids: Sequence[int],
                replacement_ids: np.ndarray,
                is_continuation: np.ndarray | None = None) -> dict[str, tf.Tensor]:
  """Masks a batch: `input_ids` [B, L] int32 -> the masked ids and the MLM targets.

  Args:
    input_ids: [B, L] int32 token ids, padded.
    seed: [2] int stateless seed; the same seed gives the same masks.
    max_predictions: P, the width of the masked_lm_* outputs.
    masked_lm_prob: share of eligible tokens to mask.
    mask_id: the [MASK] id.
    ineligible_ids: ids that are never masked ([CLS], [SEP], [PAD], [MASK]).
    replacement_ids: ids a random replacement is drawn from (see `replacement_table`).
    is_continuation: bool [vocab_size], True for '##' pieces; given, masks whole words.

  Returns:
    input_ids [B, L], masked_lm_positions [B, P], masked_lm_ids [B, P] (int32) and
    masked_lm_weights [B, P] (float32).
  """
  ids = tf.convert_to_tensor(input_ids, tf.int32)
  length = ids.shape[1]
  if length is None:
    raise ValueError('mask_tokens needs a static sequence length')
  if max_predictions > length:
    raise ValueError(f'max_predictions={max_predictions} exceeds the sequence length {length}')
  seed = tf.convert_to_tensor(seed)
  select_seed, replace_seed, pick_seed = (
      tf.random.experimental.stateless_fold_in(seed, i) for i in range(3))

  eligible = tf.ones_like(ids, tf.bool)
  for special in ineligible_ids:
    eligible &= ids != special
  num_eligible = tf.reduce_sum(tf.cast(eligible, tf.int32), axis=1)
  # float64 and round-half-to-even: exactly Python's round(n * masked_lm_prob).
  num_to_predict = tf.cast(tf.round(tf.cast(num_eligible, tf.float64) * masked_lm_prob),
                           tf.int32)
  num_to_predict = tf.minimum(max_predictions, tf.maximum(1, num_to_predict))
  num_to_predict = tf.minimum(num_to_predict, num_eligible)

  if is_continuation is None:
    positions, valid = _choose_tokens(eligible, num_to_predict, select_seed, max_predictions)
  else:
    positions, valid = _choose_words(ids, eligible, num_to_predict, select_seed, max_predictions,
                                     is_continuation)

  original = tf.gather(ids, positions, batch_dims=1)
  draws = tf.random.stateless_uniform(tf.concat([tf.shape(positions), [2]], 0), replace_seed)
  to_mask = draws[..., 0] < 0.8
  keep = ~to_mask & (draws[..., 1] < 0.5)
  table = tf.constant(replacement_ids, tf.int32)
  random_ids = tf.gather(table, tf.random.stateless_uniform(
      tf.shape(positions), pick_seed, 0, len(replacement_ids), tf.int32))
  new_ids = tf.where(to_mask, mask_id, tf.where(keep, original, random_ids))

  rows = tf.broadcast_to(tf.range(tf.shape(ids)[0])[:, None], tf.shape(positions))
  scatter_at = tf.boolean_mask(tf.stack([rows, positions], -1), valid)
  masked = tf.tensor_scatter_nd_update(ids, scatter_at, tf.boolean_mask(new_ids, valid))
  return {
      'input_ids': masked,
      'masked_lm_positions': tf.where(valid, positions, 0),
      'masked_lm_ids': tf.where(valid, original, 0),
      'masked_lm_weights': tf.cast(valid, tf.float32),
  }


def _choose_tokens(eligible, num_to_predict, seed, max_predictions):
  """Uniform positions without replacement, ascending, padded: ([B, P] int32, valid [B, P])."""
  length = eligible.shape[1]
  scores = tf.random.stateless_uniform(tf.shape(eligible), seed)
  # Ineligible positions score below every eligible one and are cut by num_to_predict anyway.
  scores = tf.where(eligible, scores, -1.0)
  _, top = tf.math.top_k(scores, k=max_predictions, sorted=True)
  chosen = tf.range(max_predictions)[None, :] < num_to_predict[:, None]
  positions = tf.sort(tf.where(chosen, top, length), axis=1)
  valid = positions < length
  return tf.where(valid, positions, 0), valid


def _choose_words(ids, eligible, num_to_predict, seed, max_predictions, is_continuation):
  """Whole-word selection (the original's greedy skip), as ascending token positions."""
  batch = tf.shape(ids)[0]
  length = ids.shape[1]
  continuation = tf.gather(tf.constant(np.asarray(is_continuation, bool)), ids) & eligible
  previous_eligible = tf.pad(eligible[:, :-1], [[0, 0], [1, 0]])
  # A '##' piece right after [CLS]/[SEP] (front truncation can cause it) starts its own word.
  starts = eligible & ~(continuation & previous_eligible)
  word_of_token = tf.cumsum(tf.cast(starts, tf.int32), axis=1) - 1
  num_words = tf.reduce_sum(tf.cast(starts, tf.int32), axis=1)

  rows = tf.range(batch)[:, None]
  segment = tf.where(eligible, rows * length + word_of_token, batch * length)
  word_length = tf.math.unsorted_segment_sum(
      tf.ones([batch * length], tf.int32), tf.reshape(segment, [-1]), batch * length + 1)
  word_length = tf.reshape(word_length[:-1], [batch, length])

  scores = tf.random.stateless_uniform([batch, length], seed)
  scores = tf.where(tf.range(length)[None, :] < num_words[:, None], scores, -1.0)
  order = tf.argsort(scores, axis=1, direction='DESCENDING', stable=True)
  sorted_length = tf.gather(word_length, order, batch_dims=1)

  # Words in random order: take one if it still fits. Stops once every row is full.
  def cond(k, count, taken):
    del taken
    return (k < length) & tf.reduce_any((count < num_to_predict) & (k < num_words))

  def body(k, count, taken):
    size = sorted_length[:, k]
    fits = (size > 0) & (count + size <= num_to_predict)
    taken |= fits[:, None] & tf.equal(tf.range(length), k)[None, :]
    return k + 1, count + tf.where(fits, size, 0), taken

  _, _, taken_sorted = tf.while_loop(
      cond, body, (0, tf.zeros([batch], tf.int32), tf.zeros([batch, length], tf.bool)))
  taken_words = tf.tensor_scatter_nd_update(
      tf.zeros([batch, length], tf.bool),
      tf.reshape(tf.stack([tf.broadcast_to(rows, [batch, length]), order], -1), [-1, 2]),
      tf.reshape(taken_sorted, [-1]))
  selected = eligible & tf.gather(taken_words, tf.maximum(word_of_token, 0), batch_dims=1)

  # The first P selected positions in ascending order: top_k of (L - position).
  score = tf.where(selected, length - tf.range(length)[None, :], -1)
  top_score, positions = tf.math.top_k(score, k=max_predictions, sorted=True)
  valid = top_score > 0
  return tf.where(valid, positions, 0), valid
