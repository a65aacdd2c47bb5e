"""Tests of bert_jax.input_inspect: decoded examples and statistics of the pre-training input,
on input_pipeline_test.py's marker corpora."""

import pytest

from bert_jax import input_inspect

import input_pipeline_test


@pytest.fixture(scope='module')
def corpora(tmp_path_factory):
  return input_pipeline_test.Corpora(str(tmp_path_factory.mktemp('corpora')))


def test_show_examples_and_stats(corpora):
  data = corpora.config()
  text = input_inspect.show_examples(data, num=4, seq_len=32, max_predictions=5)
  assert text.count('example ') == 4 and '[MASK→' in text
  assert 'IsNext' in text or 'NotNext' in text
  stats = input_inspect.compute_stats(data, num_batches=5, batch_size=64, seq_len=32,
                                      max_predictions=5)
  assert stats['examples'] == 320
  for key in ('next_sentence_fraction', 'masked_fraction', 'mask_token_fraction',
              'random_token_fraction', 'kept_fraction', 'padding_fraction'):
    assert 0 <= stats[key] <= 1, key
  assert abs(stats['mask_token_fraction'] + stats['random_token_fraction'] +
             stats['kept_fraction'] - 1) < 1e-6
  assert stats['tokens_per_second'] > 0


def test_packed_examples_and_stats(corpora):
  data = corpora.config(packing=True, packing_max_sequences=4)
  text = input_inspect.show_examples(data, num=8, seq_len=32, max_predictions=5)
  assert text.count('row ') == 8 and 'sequence 2:' in text and '[MASK→' in text
  stats = input_inspect.compute_stats(data, num_batches=5, batch_size=64, seq_len=32,
                                      max_predictions=5)
  unpacked = input_inspect.compute_stats(corpora.config(), num_batches=5, batch_size=64,
                                         seq_len=32, max_predictions=5)
  assert stats['examples'] > 1.15 * 320 and unpacked['examples'] == 320
  assert stats['padding_fraction'] < 0.06 < 0.2 < unpacked['padding_fraction']
  assert stats['sequences_per_row'] == stats['examples'] / 320
  assert unpacked['sequences_per_row'] == 1.0 and 'rows_at_sequence_cap' not in unpacked
  assert 0 <= stats['rows_at_sequence_cap'] < 0.5
  # Computed over sequences: the same shares as unpacked.
  for key in ('next_sentence_fraction', 'masked_fraction', 'mask_token_fraction'):
    assert abs(stats[key] - unpacked[key]) < 0.06, key
  assert abs(stats['mean_length'] - unpacked['mean_length']) < 2
