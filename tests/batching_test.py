"""Batches of multiple-choice examples ([N, C, L] features): choices stay together, the longest
choice picks the bucket, and padded examples never give attention an all-masked row. (The
batching of [N, L] features is tested with GLUE's, tests/glue_test.py.)"""

import numpy as np

from bert_jax import batching


def _choice_features(n, choices, length, seed=0):
  rng = np.random.default_rng(seed)
  lengths = rng.integers(3, length + 1, (n, choices))
  mask = (np.arange(length) < lengths[..., None]).astype(np.int32)
  ids = rng.integers(5, 100, (n, choices, length)).astype(np.int32) * mask
  return {'input_ids': ids, 'input_mask': mask, 'segment_ids': np.zeros_like(ids),
          'label': rng.integers(0, choices, n).astype(np.int32),
          'example_index': np.arange(n, dtype=np.int32)}


def test_choices_stay_together_and_the_longest_picks_the_bucket():
  features = _choice_features(300, 4, 64)
  seen = []
  for batch in batching.bucket_batches(features, 16, (16, 32, 64), shuffle=True, seed=1,
                                       window_batches=3):
    idx = batch['example_index']
    size = batch['input_ids'].shape[2]
    assert batch['input_ids'].shape[:2] == (len(idx), 4) and batch['label'].shape == (len(idx),)
    longest = features['input_mask'][idx].sum(-1).max()
    assert size == min(b for b in (16, 32, 64) if b >= longest)
    # Nothing real was cut, and each row is its example's, choices in order.
    np.testing.assert_array_equal(batch['input_ids'],
                                  features['input_ids'][idx][:, :, :size])
    np.testing.assert_array_equal(batch['input_mask'].sum(-1),
                                  features['input_mask'][idx].sum(-1))
    seen.extend(idx.tolist())
  assert sorted(seen) == list(range(300))


def test_padded_examples_and_shapes_of_choice_batches():
  features = _choice_features(21, 3, 32)
  planned = list(batching.batches(features, 8, (16, 32)))
  last = planned[-1]
  assert last['input_ids'].shape[:2] == (8, 3)
  np.testing.assert_array_equal(last['weight'], [1] * 5 + [0] * 3)
  # Every choice of a padded example is a lone [CLS]-sized sequence.
  np.testing.assert_array_equal(last['input_mask'][5:].sum(-1), np.ones((3, 3)))
  shapes = batching.batch_shapes(features, 8, (16, 32))
  assert sorted({b['input_ids'].shape for b in planned}) == sorted(
      s['input_ids'].shape for s in shapes)
  assert all(s['label'].shape == (8,) and s['input_mask'].shape[:2] == (8, 3) for s in shapes)
  report = batching.padding_savings(features, 8, (16, 32))
  assert report['fixed_tokens'] == 21 * 3 * 32
  assert report['real_tokens'] == features['input_mask'].sum() <= report['bucketed_tokens']
