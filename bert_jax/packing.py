"""Packing several pre-training sequences into each row of a batch, in tf.data graph ops.

After Krell et al. 2021, "Efficient Sequence Packing without Cross-contamination": complete
sequences (each its own `[CLS] A [SEP] B [SEP]`, masked on its own) share a row of seq_len
tokens, and per-token ids keep them apart:

  sequence_ids  0 = padding, k >= 1 = the k-th sequence of the row; the model attends a query
                to a key only when both ids are equal and nonzero (block-diagonal attention).
  position_ids  restart at 0 for every sequence, so each sees the positions it would alone.
  next_sentence_positions / _labels / _weights [R, S]: where each sequence's [CLS] is, its
                NSP/SOP label, and 1.0 for the real entries (0.0 for empty slots).

The packer runs online over a window of sequences (`pack`, one call per window): first-fit
decreasing, i.e. the window's sequences by decreasing length, each into the first row where
it fits. A row holds at most `seq_len` tokens, `max_sequences` sequences and
`predictions_per_row` masked-LM predictions; a sequence that fits no open row opens a new one,
so nothing is ever truncated or dropped. Only the last rows of a window are left part-full.
The rows of a window come out in a random order drawn from the given seed (a stateless draw:
the same window and seed give the same rows), so batches do not group rows by their fill.
"""

import tensorflow as tf

PACKED_FEATURES = ('input_ids', 'input_mask', 'segment_ids', 'position_ids', 'sequence_ids',
                   'masked_lm_positions', 'masked_lm_ids', 'masked_lm_weights',
                   'next_sentence_positions', 'next_sentence_labels', 'next_sentence_weights')


def predictions_per_row(max_predictions: int, max_sequences: int, seq_len: int) -> int:
  """Width of a packed row's masked_lm_* features.

  A sequence predicts min(max_predictions, max(1, round(15% of its eligible tokens))): rounding
  adds up to half a prediction per sequence on top of 15% of the row, which max_predictions
  (sized for one full-length sequence) already covers; so half a slot per sequence the row
  may hold. The packer never lets a row exceed it (a sequence goes to another row instead).
  """
  return min(seq_len, max_predictions + max_sequences // 2)


def first_fit(lengths: tf.Tensor, predictions: tf.Tensor, *, seq_len: int, max_sequences: int,
              max_predictions: int) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor, tf.Tensor]:
  """First-fit decreasing of sequences into rows.

  Args:
    lengths: [N] int32 tokens of each sequence (<= seq_len).
    predictions: [N] int32 masked-LM predictions of each sequence (<= max_predictions).
    seq_len, max_sequences, max_predictions: the capacities of a row.

  Returns:
    (row, slot, start, prediction_start) [N] int32 of each sequence: its row (rows are
    numbered 0..R-1 in the order they were opened, all used), its index among the row's
    sequences, its first token and its first masked-LM slot in the row.
  """
  n = tf.shape(lengths)[0]
  # Decreasing length; equal lengths keep their order (stable), so the result is
  # deterministic.
  order = tf.argsort(lengths, direction='DESCENDING', stable=True)
  sorted_length = tf.gather(lengths, order)
  sorted_predictions = tf.gather(predictions, order)

  def body(k, free, count, predictions_free, placed):
    length, needed = sorted_length[k], sorted_predictions[k]
    # A row never used is empty, and rows are opened in order: the first row that fits is an
    # open one when any open one fits, else the next empty one.
    fits = (free >= length) & (count < max_sequences) & (predictions_free >= needed)
    row = tf.argmax(tf.cast(fits, tf.int32), output_type=tf.int32)
    placed = placed.write(k, tf.stack([row, count[row], seq_len - free[row],
                                       max_predictions - predictions_free[row]]))
    one_hot = tf.one_hot(row, n, dtype=tf.int32)
    return (k + 1, free - one_hot * length, count + one_hot,
            predictions_free - one_hot * needed, placed)

  _, _, _, _, placed = tf.while_loop(
      lambda k, *_: k < n, body,
      (0, tf.fill([n], seq_len), tf.zeros([n], tf.int32), tf.fill([n], max_predictions),
       tf.TensorArray(tf.int32, size=n, element_shape=[4])))
  placed = tf.reshape(placed.stack(), [-1, 4])
  placed = tf.scatter_nd(order[:, None], placed, [n, 4])  # Back to the input order.
  return placed[:, 0], placed[:, 1], placed[:, 2], placed[:, 3]


def pack(features: dict[str, tf.Tensor], seed: tf.Tensor, *, seq_len: int, max_sequences: int,
         max_predictions: int, pad_id: int) -> dict[str, tf.Tensor]:
  """Packs a window of N unpacked sequences into R <= N rows.

  Args:
    features: the unpacked features of `input_pipeline.FEATURES`, [N, ...]: each sequence
      left-aligned in input_ids/input_mask/segment_ids [N, seq_len], its masked-LM targets in
      masked_lm_* [N, P] (P <= max_predictions; the real ones have weight > 0), its label in
      next_sentence_labels [N].
    seed: [2] stateless seed of the order of the rows.
    seq_len: tokens per row.
    max_sequences: S, sequences per row at most.
    max_predictions: masked-LM slots per row (`predictions_per_row`).
    pad_id: the id of padding tokens.

  Returns:
    `PACKED_FEATURES` (see the module docstring): [R, seq_len] int32 token features,
    masked_lm_* [R, max_predictions], next_sentence_* [R, S]; weights float32.
  """
  length = tf.reduce_sum(tf.cast(features['input_mask'] > 0, tf.int32), axis=1)
  real_prediction = features['masked_lm_weights'] > 0
  num_predictions = tf.reduce_sum(tf.cast(real_prediction, tf.int32), axis=1)
  row, slot, start, prediction_start = first_fit(
      length, num_predictions, seq_len=seq_len, max_sequences=max_sequences,
      max_predictions=max_predictions)
  num_rows = tf.reduce_max(tf.concat([row + 1, [0]], 0))
  # Rows in a random order: a random relabelling of 0..R-1.
  relabel = tf.argsort(tf.random.stateless_uniform([num_rows], seed))
  row = tf.gather(relabel, row)

  # Tokens: (sequence i, position p) -> (row[i], start[i] + p).
  token = tf.where(tf.range(seq_len)[None, :] < length[:, None])
  i, p = tf.cast(token[:, 0], tf.int32), tf.cast(token[:, 1], tf.int32)
  token_to = tf.stack([tf.gather(row, i), tf.gather(start, i) + p], 1)
  token_shape = tf.stack([num_rows, seq_len])
  sequence_ids = tf.scatter_nd(token_to, tf.gather(slot, i) + 1, token_shape)
  packed = {
      'input_ids': tf.where(sequence_ids > 0, tf.scatter_nd(
          token_to, tf.gather_nd(tf.cast(features['input_ids'], tf.int32), token), token_shape),
                            pad_id),
      'input_mask': tf.cast(sequence_ids > 0, tf.int32),
      'segment_ids': tf.scatter_nd(
          token_to, tf.gather_nd(tf.cast(features['segment_ids'], tf.int32), token), token_shape),
      'position_ids': tf.scatter_nd(token_to, p, token_shape),
      'sequence_ids': sequence_ids,
  }

  # Masked-LM targets: the real ones of sequence i go to slots prediction_start[i] + rank.
  target = tf.where(real_prediction)
  i = tf.cast(target[:, 0], tf.int32)
  rank = tf.gather_nd(tf.cumsum(tf.cast(real_prediction, tf.int32), axis=1) - 1, target)
  target_to = tf.stack([tf.gather(row, i), tf.gather(prediction_start, i) + rank], 1)
  target_shape = tf.stack([num_rows, max_predictions])
  positions = tf.gather_nd(tf.cast(features['masked_lm_positions'], tf.int32), target)
  for name, values in (
      ('masked_lm_positions', positions + tf.gather(start, i)),
      ('masked_lm_ids', tf.gather_nd(tf.cast(features['masked_lm_ids'], tf.int32), target)),
      ('masked_lm_weights', tf.gather_nd(tf.cast(features['masked_lm_weights'], tf.float32),
                                         target))):
    packed[name] = tf.scatter_nd(target_to, values, target_shape)

  # One NSP entry per sequence, at (row, slot).
  nsp_to = tf.stack([row, slot], 1)
  nsp_shape = tf.stack([num_rows, max_sequences])
  packed['next_sentence_positions'] = tf.scatter_nd(nsp_to, start, nsp_shape)
  packed['next_sentence_labels'] = tf.scatter_nd(
      nsp_to, tf.cast(features['next_sentence_labels'], tf.int32), nsp_shape)
  packed['next_sentence_weights'] = tf.scatter_nd(
      nsp_to, tf.ones_like(start, tf.float32), nsp_shape)
  return packed


def padding_row(seq_len: int, max_sequences: int, max_predictions: int,
                pad_id: int) -> dict[str, tf.Tensor]:
  """A packed row with no sequence: fills up the last evaluation batch, counts for nothing."""
  zeros = lambda n, dtype=tf.int32: tf.zeros([n], dtype)
  return {
      'input_ids': tf.fill([seq_len], pad_id), 'input_mask': zeros(seq_len),
      'segment_ids': zeros(seq_len), 'position_ids': zeros(seq_len),
      'sequence_ids': zeros(seq_len), 'masked_lm_positions': zeros(max_predictions),
      'masked_lm_ids': zeros(max_predictions),
      'masked_lm_weights': zeros(max_predictions, tf.float32),
      'next_sentence_positions': zeros(max_sequences),
      'next_sentence_labels': zeros(max_sequences),
      'next_sentence_weights': zeros(max_sequences, tf.float32),
  }
