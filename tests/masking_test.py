"""Tests of bert_jax.masking: counts, positions, 80/10/10, whole words, determinism."""

import numpy as np
import pytest
import tensorflow as tf

from bert_jax import masking

PAD, UNK, CLS, SEP, MASK = range(5)
SPECIALS = (PAD, UNK, CLS, SEP, MASK)
VOCAB = 1000
REPLACEMENTS = masking.replacement_table(VOCAB, SPECIALS)


def _batch(rows=512, length=64, seed=0):
  """[CLS] a [SEP] b [SEP] then padding, random lengths; ids >= 5 (UNK sometimes)."""
  rng = np.random.RandomState(seed)
  ids = np.full((rows, length), PAD, np.int32)
  for r in range(rows):
    n = rng.randint(5, length + 1)
    ids[r, :n] = rng.randint(5, VOCAB, n)
    ids[r, rng.randint(0, n, 2)] = UNK
    ids[r, 0], ids[r, n - 1] = CLS, SEP
    ids[r, rng.randint(2, n - 2)] = SEP
  return ids


def _mask(ids, seed=(1, 2), max_predictions=20, prob=0.15, continuation=None):
  out = masking.mask_tokens(tf.constant(ids), tf.constant(seed, tf.int64),
                            max_predictions=max_predictions, masked_lm_prob=prob,
                            mask_id=MASK, ineligible_ids=(PAD, CLS, SEP, MASK),
                            replacement_ids=REPLACEMENTS, is_continuation=continuation)
  return {k: v.numpy() for k, v in out.items()}


def _check_common(ids, out, max_predictions, prob):
  """Properties every masking must have; returns the replacement kinds."""
  kinds = {'mask': 0, 'kept': 0, 'random': 0}
  for r in range(len(ids)):
    weights = out['masked_lm_weights'][r]
    n = int(weights.sum())
    assert np.all(weights[:n] == 1) and np.all(weights[n:] == 0)
    positions = out['masked_lm_positions'][r]
    assert np.all(np.diff(positions[:n]) > 0) and np.all(positions[n:] == 0)
    assert np.all(out['masked_lm_ids'][r, n:] == 0)
    eligible = ~np.isin(ids[r], (PAD, CLS, SEP, MASK))
    assert eligible[positions[:n]].all(), 'a special token was masked'
    np.testing.assert_array_equal(out['masked_lm_ids'][r, :n], ids[r, positions[:n]])
    limit = min(max_predictions, max(1, round(eligible.sum() * prob)), eligible.sum())
    assert n <= limit
    changed = np.ones(ids.shape[1], bool)
    changed[positions[:n]] = False
    np.testing.assert_array_equal(out['input_ids'][r][changed], ids[r][changed])
    for new, old in zip(out['input_ids'][r, positions[:n]], ids[r, positions[:n]]):
      if new == MASK:
        kinds['mask'] += 1
      elif new == old:
        kinds['kept'] += 1
      else:
        assert new not in SPECIALS
        kinds['random'] += 1
  return kinds


def test_counts_positions_and_replacements():
  ids = _batch(rows=1500)
  out = _mask(ids)
  kinds = _check_common(ids, out, 20, 0.15)
  for r in range(len(ids)):
    eligible = ~np.isin(ids[r], (PAD, CLS, SEP, MASK))
    assert out['masked_lm_weights'][r].sum() == min(20, max(1, round(eligible.sum() * 0.15)))
  total = sum(kinds.values())
  assert total > 6000
  assert abs(kinds['mask'] / total - 0.8) < 0.02
  assert abs(kinds['kept'] / total - 0.1) < 0.02
  assert abs(kinds['random'] / total - 0.1) < 0.02


def test_positions_are_uniform():
  ids = np.full((4000, 16), 7, np.int32)
  ids[:, 0], ids[:, -1] = CLS, SEP
  out = _mask(ids, max_predictions=4, prob=0.15)
  counts = np.bincount(out['masked_lm_positions'][out['masked_lm_weights'] > 0], minlength=16)
  assert counts[0] == 0 and counts[15] == 0
  expected = 4000 * 2 / 14  # round(14 * 0.15) = 2 per row.
  assert np.all(np.abs(counts[1:15] / expected - 1) < 0.1)


def test_max_predictions_caps():
  ids = _batch(rows=64, length=64)
  ids = ids[(ids > MASK).sum(1) >= 6]  # Rows where half the eligible tokens exceed 3.
  out = _mask(ids, max_predictions=3, prob=0.5)
  _check_common(ids, out, 3, 0.5)
  assert np.all(out['masked_lm_weights'].sum(1) == 3)


def test_padding_rows_and_determinism():
  ids = _batch(rows=8)
  ids[3] = PAD
  a, b, c = _mask(ids, seed=(4, 4)), _mask(ids, seed=(4, 4)), _mask(ids, seed=(4, 5))
  assert a['masked_lm_weights'][3].sum() == 0 and np.all(a['input_ids'][3] == PAD)
  assert all(np.array_equal(a[k], b[k]) for k in a)
  assert not np.array_equal(a['masked_lm_positions'], c['masked_lm_positions'])


def test_rejects_max_predictions_above_length():
  with pytest.raises(ValueError, match='max_predictions'):
    _mask(_batch(rows=2, length=16), max_predictions=17)


def test_whole_word_masking():
  rng = np.random.RandomState(3)
  continuation = np.zeros(VOCAB, bool)
  continuation[500:] = True  # Ids >= 500 are '##' pieces.
  ids = _batch(rows=300, length=48, seed=1)
  for r in range(len(ids)):  # Turn some tokens into continuations of the word before.
    for p in range(2, 47):
      if ids[r, p] >= 5 and ids[r, p - 1] >= 5 and rng.rand() < 0.4:
        ids[r, p] = rng.randint(500, VOCAB)
      elif ids[r, p] >= 500:
        ids[r, p] = rng.randint(5, 500)
  out = _mask(ids, max_predictions=12, prob=0.2, continuation=continuation)
  _check_common(ids, out, 12, 0.2)
  multi_piece_masked = 0
  for r in range(len(ids)):
    eligible = ~np.isin(ids[r], (PAD, CLS, SEP, MASK))
    words, word = [], None
    for p in range(ids.shape[1]):
      if not eligible[p]:
        word = None
      elif continuation[ids[r, p]] and word is not None:
        word.append(p)
      else:
        word = [p]
        words.append(word)
    n = int(out['masked_lm_weights'][r].sum())
    masked = set(out['masked_lm_positions'][r, :n].tolist())
    limit = min(12, max(1, round(eligible.sum() * 0.2)))
    for word in words:
      hit = masked & set(word)
      assert not hit or hit == set(word), 'part of a word was masked'
      multi_piece_masked += len(word) > 1 and bool(hit)
      # The original skips a word that does not fit and tries the next: no unmasked word
      # could still have been added.
      assert hit or len(word) > limit - n
  assert multi_piece_masked > 100
