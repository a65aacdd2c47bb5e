"""Tests of bert_jax.packing: every sequence lands whole, once, within the row's caps."""

import numpy as np
import pytest
import tensorflow as tf

from bert_jax import packing

CLS, SEP, PAD = 2, 3, 0


def _sequences(rng, n, seq_len, max_predictions):
  """n unpacked sequences of random lengths with unique token ids and masked-LM targets."""
  lengths = np.where(rng.rand(n) < 0.3, rng.randint(4, seq_len + 1, n),
                     rng.randint(4, max(5, seq_len // 4), n))
  ids = np.full((n, seq_len), PAD, np.int32)
  mask = np.zeros((n, seq_len), np.int32)
  segments = np.zeros((n, seq_len), np.int32)
  positions = np.zeros((n, max_predictions), np.int32)
  targets = np.zeros((n, max_predictions), np.int32)
  weights = np.zeros((n, max_predictions), np.float32)
  next_id = 10
  for i, length in enumerate(lengths):
    ids[i, :length] = np.arange(next_id, next_id + length)
    next_id += length
    ids[i, 0] = CLS
    mask[i, :length] = 1
    segments[i, rng.randint(1, length):length] = 1
    count = min(max_predictions, max(1, round(0.15 * (length - 1))))
    chosen = np.sort(rng.choice(np.arange(1, length), count, replace=False))
    positions[i, :count] = chosen
    targets[i, :count] = ids[i, chosen] + 100_000
    weights[i, :count] = 1.0
  return dict(input_ids=ids, input_mask=mask, segment_ids=segments,
              masked_lm_positions=positions, masked_lm_ids=targets,
              masked_lm_weights=weights,
              next_sentence_labels=rng.randint(0, 2, n).astype(np.int32))


def _pack(features, seed=(1, 2), **kw):
  out = packing.pack({k: tf.constant(v) for k, v in features.items()},
                     tf.constant(seed, tf.int64), pad_id=PAD, **kw)
  return {k: v.numpy() for k, v in out.items()}


@pytest.mark.parametrize('seq_len,max_sequences,slack', [(64, 4, 1.3), (128, 16, 1.05)])
def test_every_sequence_lands_whole_once_within_the_caps(seq_len, max_sequences, slack):
  rng = np.random.RandomState(seq_len)
  max_predictions = seq_len // 6
  features = _sequences(rng, 300, seq_len, max_predictions)
  row_predictions = packing.predictions_per_row(max_predictions, max_sequences, seq_len)
  rows = _pack(features, seq_len=seq_len, max_sequences=max_sequences,
               max_predictions=row_predictions)
  num_rows = len(rows['input_ids'])
  assert rows['input_ids'].shape == (num_rows, seq_len)
  assert rows['masked_lm_ids'].shape == (num_rows, row_predictions)
  assert rows['next_sentence_labels'].shape == (num_rows, max_sequences)
  assert (rows['input_mask'] == (rows['sequence_ids'] > 0)).all()
  assert (rows['input_ids'][rows['input_mask'] == 0] == PAD).all()

  # Each input sequence is found by its [CLS]-free, unique token ids.
  where = {}
  for r in range(num_rows):
    for slot in range(int(rows['sequence_ids'][r].max())):
      cols = np.nonzero(rows['sequence_ids'][r] == slot + 1)[0]
      assert cols.size and np.all(np.diff(cols) == 1), 'a sequence is not contiguous'
      assert rows['next_sentence_weights'][r, slot] == 1.0
      assert rows['next_sentence_positions'][r, slot] == cols[0]
      where[int(rows['input_ids'][r, cols[1]]) - 1] = (r, slot, cols[0])
    assert (rows['next_sentence_weights'][r, rows['sequence_ids'][r].max():] == 0).all()
  assert len(where) == 300, 'a sequence was lost or duplicated'
  lengths = features['input_mask'].sum(1)
  predictions = []
  for i, length in enumerate(lengths):
    r, slot, start = where[int(features['input_ids'][i, 1]) - 1]
    span = slice(start, start + length)
    np.testing.assert_array_equal(rows['input_ids'][r, span], features['input_ids'][i, :length])
    np.testing.assert_array_equal(rows['segment_ids'][r, span],
                                  features['segment_ids'][i, :length])
    np.testing.assert_array_equal(rows['position_ids'][r, span], np.arange(length))
    assert rows['next_sentence_labels'][r, slot] == features['next_sentence_labels'][i]
    real = features['masked_lm_weights'][i] > 0
    predictions.append(set(zip([r] * real.sum(), features['masked_lm_positions'][i, real] + start,
                               features['masked_lm_ids'][i, real])))
  got = rows['masked_lm_weights'] > 0
  packed_predictions = set(zip(np.nonzero(got)[0], rows['masked_lm_positions'][got],
                               rows['masked_lm_ids'][got]))
  assert packed_predictions == set().union(*predictions)
  assert got.sum() == sum(len(p) for p in predictions)
  assert rows['masked_lm_weights'][got].min() == 1.0
  # Masked positions ascend in every row, as unpacked ones do.
  for r in range(num_rows):
    assert np.all(np.diff(rows['masked_lm_positions'][r, got[r]]) > 0)
  # Caps hold, and first-fit decreasing packs well: close to the least number of rows (with
  # a cap of 4 sequences, long ones leave gaps that short ones may not fill).
  assert (rows['sequence_ids'].max(1) <= max_sequences).all()
  assert got.sum(1).max() <= row_predictions
  lower_bound = max(np.ceil(lengths.sum() / seq_len), np.ceil(len(lengths) / max_sequences))
  assert num_rows <= lower_bound * slack + 1, (num_rows, lower_bound)


def test_caps_on_sequences_and_predictions_open_new_rows():
  rng = np.random.RandomState(0)
  features = _sequences(rng, 40, 32, 8)
  features['input_mask'][:] = 0
  features['input_mask'][:, :4] = 1  # 40 sequences of 4 tokens: 8 would fit a row.
  features['masked_lm_weights'][:] = 0.0
  rows = _pack(features, seq_len=32, max_sequences=3, max_predictions=8)
  assert sorted(rows['sequence_ids'].max(1).tolist()) == [1] + [3] * 13
  features['masked_lm_positions'][:, :3] = [1, 2, 3]
  features['masked_lm_weights'][:, :3] = 1.0  # 3 predictions each: 2 sequences per row.
  rows = _pack(features, seq_len=32, max_sequences=8, max_predictions=8)
  assert len(rows['input_ids']) == 20
  assert (rows['masked_lm_weights'].sum(1) == 6).all()


def test_deterministic_for_a_seed_and_rows_shuffled():
  rng = np.random.RandomState(3)
  features = _sequences(rng, 200, 64, 10)
  kw = dict(seq_len=64, max_sequences=8, max_predictions=14)
  a, b, c = _pack(features, **kw), _pack(features, **kw), _pack(features, seed=(5, 6), **kw)
  assert all(np.array_equal(a[k], b[k]) for k in a)
  assert not np.array_equal(a['input_ids'], c['input_ids'])
  # The same rows, in another order.
  assert sorted(map(tuple, a['input_ids'])) == sorted(map(tuple, c['input_ids']))
  # First-fit decreasing would put the longest sequences in the first rows; shuffled, the
  # row fill does not decrease along the window.
  fill = a['input_mask'].sum(1)
  assert not np.all(np.diff(fill) <= 0)


def test_padding_row_is_empty():
  row = packing.padding_row(16, 4, 6, PAD)
  assert {k: tuple(v.shape) for k, v in row.items()} == {
      'input_ids': (16,), 'input_mask': (16,), 'segment_ids': (16,), 'position_ids': (16,),
      'sequence_ids': (16,), 'masked_lm_positions': (6,), 'masked_lm_ids': (6,),
      'masked_lm_weights': (6,), 'next_sentence_positions': (4,),
      'next_sentence_labels': (4,), 'next_sentence_weights': (4,)}
  assert set(row) == set(packing.PACKED_FEATURES)
  assert all(float(tf.reduce_sum(tf.cast(v, tf.float32))) == 0 for v in row.values())
