"""Tests of bert_jax.pairing: sentence pairs and packed sequences on hand-made documents."""

import random

import numpy as np
import pytest
import tensorflow as tf

from bert_jax import pairing

PAD, CLS, SEP = 0, 2, 3


def _documents(lengths, start_id=10):
  """Documents whose tokens count up from start_id: [[sentence lengths] per document]."""
  docs, next_id = [], start_id
  for doc in lengths:
    sentences = []
    for n in doc:
      sentences.append(list(range(next_id, next_id + n)))
      next_id += n
    docs.append(sentences)
  return docs


def _ragged(docs):
  return tf.ragged.constant(docs, dtype=tf.int32, ragged_rank=2, inner_shape=())


def _pairs(docs, ids=None, seed=(1, 2), seq_len=32, objective='nsp', short_seq_prob=0.1):
  ids = tf.constant(ids if ids is not None else list(range(len(docs))), tf.int64)
  out = pairing.make_pairs(_ragged(docs), ids, tf.constant(seed, tf.int64), seq_len=seq_len,
                           short_seq_prob=short_seq_prob, objective=objective, cls_id=CLS,
                           sep_id=SEP, pad_id=PAD)
  return {k: v.numpy() for k, v in out.items()}


def _split(ids, length):
  seq = list(ids[:length])
  first = seq.index(SEP)
  assert seq[0] == CLS and seq[-1] == SEP
  return seq[1:first], seq[first + 1:-1]


def _truncate_reference(a, b, max_tokens):
  """The original truncate_seq_pair, counting removals per side."""
  removed_a = removed_b = 0
  while a + b > max_tokens:
    if a > b:
      a, removed_a = a - 1, removed_a + 1
    else:
      b, removed_b = b - 1, removed_b + 1
  return removed_a, removed_b


def test_truncation_counts_match_the_original_loop():
  cases = [(a, b, m) for a in range(0, 40, 3) for b in range(0, 40, 5) for m in (5, 13, 29, 61)]
  a, b, m = zip(*cases)
  for max_tokens in set(m):
    sel = [i for i, x in enumerate(m) if x == max_tokens]
    got_a, got_b = pairing.truncation_counts(tf.constant([a[i] for i in sel]),
                                             tf.constant([b[i] for i in sel]), max_tokens)
    for i, ra, rb in zip(sel, got_a.numpy(), got_b.numpy()):
      assert (ra, rb) == _truncate_reference(a[i], b[i], max_tokens), cases[i]


def test_pairs_are_consecutive_text_or_another_document():
  rng = random.Random(0)
  lengths = [[rng.randint(1, 9) for _ in range(rng.randint(1, 7))] for _ in range(40)]
  docs = _documents(lengths)
  token_doc = {t: d for d, doc in enumerate(docs) for s in doc for t in s}
  labels = []
  for seed in range(20):
    out = _pairs(docs, seed=(seed, 0), seq_len=24)
    assert out['input_ids'].shape[1] == 24
    for ids, length, num_a, label in zip(out['input_ids'], out['length'], out['num_a'],
                                         out['next_sentence_labels']):
      a, b = _split(ids, length)
      assert len(a) >= 1 and len(b) >= 1 and len(a) + len(b) <= 21
      assert num_a == len(a) + 2 and np.all(ids[length:] == PAD)
      # Each side is one run of consecutive tokens of one document.
      for side in (a, b):
        assert side == list(range(side[0], side[0] + len(side)))
        assert len({token_doc[t] for t in side}) == 1
      if label == 0:
        assert token_doc[a[0]] == token_doc[b[0]] and b[0] > a[-1]
      else:
        assert token_doc[a[0]] != token_doc[b[0]]
      labels.append(label)
  assert 0.4 < np.mean(labels) < 0.6


def test_untruncated_is_next_pairs_are_adjacent():
  docs = _documents([[3, 4, 2, 5], [2, 2, 2, 2, 2], [6], [1, 1, 1]])
  for seed in range(30):
    out = _pairs(docs, seed=(seed, 7), seq_len=64)
    for ids, length, label in zip(out['input_ids'], out['length'], out['next_sentence_labels']):
      a, b = _split(ids, length)
      if label == 0:  # Nothing is truncated at this length: B follows A directly.
        assert b[0] == a[-1] + 1


def test_single_sentence_documents_split_for_is_next():
  # Every chunk is a single sentence: IsNext pairs must split it, NotNext draws elsewhere.
  docs = _documents([[8]] * 30)
  labels = []
  for seed in range(40):
    out = _pairs(docs, seed=(seed, 1), seq_len=32)
    assert len(out['length']) == 30  # One example per document.
    for ids, length, label in zip(out['input_ids'], out['length'], out['next_sentence_labels']):
      a, b = _split(ids, length)
      if label == 0:
        assert len(a) + len(b) == 8 and b[0] == a[-1] + 1
      labels.append(label)
  assert abs(np.mean(labels) - 0.5) < 0.05


def test_one_token_documents_are_dropped():
  docs = _documents([[1], [1], [5, 5]])
  out = _pairs(docs, seq_len=16)
  for ids, length in zip(out['input_ids'], out['length']):
    a, b = _split(ids, length)
    assert len(a) + len(b) >= 2


def test_one_document_repeated_raises():
  docs = _documents([[4, 4, 4]]) * 4
  with pytest.raises(tf.errors.InvalidArgumentError, match='at least two different documents'):
    _pairs(docs, ids=[7, 7, 7, 7])


def test_batch_of_one_document_drops_not_next():
  docs = _documents([[4, 4, 4, 4, 4]])
  for seed in range(10):
    out = _pairs(docs, seed=(seed, 3), seq_len=16)
    assert np.all(out['next_sentence_labels'] == 0)


def test_empty_batch_and_empty_documents():
  out = pairing.make_pairs(
      tf.RaggedTensor.from_row_lengths(
          tf.RaggedTensor.from_row_lengths(tf.zeros([0], tf.int32), tf.zeros([0], tf.int64)),
          tf.zeros([2], tf.int64)),
      tf.constant([1, 2], tf.int64), tf.constant([0, 0], tf.int64), seq_len=16,
      short_seq_prob=0.1, objective='nsp', cls_id=CLS, sep_id=SEP, pad_id=PAD)
  assert out['input_ids'].shape == (0, 16)


def test_long_sentence_is_truncated():
  docs = _documents([[5000], [3, 3]])
  out = _pairs(docs, seq_len=16)
  assert np.all(out['length'] <= 16)


def test_sop_pairs_are_in_order_or_swapped():
  rng = random.Random(1)
  docs = _documents([[rng.randint(1, 6) for _ in range(rng.randint(1, 6))] for _ in range(30)])
  token_doc = {t: d for d, doc in enumerate(docs) for s in doc for t in s}
  labels = []
  for seed in range(10):
    out = _pairs(docs, seed=(seed, 5), seq_len=24, objective='sop')
    for ids, length, label in zip(out['input_ids'], out['length'], out['next_sentence_labels']):
      a, b = _split(ids, length)
      assert token_doc[a[0]] == token_doc[b[0]]
      assert (b[0] > a[-1]) if label == 0 else (a[0] > b[-1])
      labels.append(label)
  assert 0.4 < np.mean(labels) < 0.6


def test_deterministic_for_a_seed():
  docs = _documents([[3, 5, 2], [4, 4], [7, 1, 1, 2]])
  a, b, c = _pairs(docs, seed=(3, 4)), _pairs(docs, seed=(3, 4)), _pairs(docs, seed=(5, 4))
  assert all(np.array_equal(a[k], b[k]) for k in a)
  assert any(a[k].shape != c[k].shape or not np.array_equal(a[k], c[k]) for k in a)


def test_pack_sequences():
  rng = random.Random(2)
  lengths = [[rng.randint(1, 12) for _ in range(rng.randint(1, 5))] for _ in range(20)]
  lengths[3] = [40]  # Longer than a sequence: cut into pieces.
  docs = _documents(lengths)
  stream = []  # All tokens with a [SEP] after each document.
  for doc in docs:
    stream += [t for s in doc for t in s] + [SEP]
  sentence_starts = {s[0] for doc in docs for s in doc}
  out = pairing.pack_sequences(_ragged(docs), seq_len=16, cls_id=CLS, sep_id=SEP, pad_id=PAD)
  out = {k: v.numpy() for k, v in out.items()}
  pos = 0
  long_sentence = set(docs[3][0])
  for ids, length in zip(out['input_ids'], out['length']):
    seq = list(ids[:length])
    assert seq[0] == CLS and seq[-1] == SEP and length <= 16
    assert np.all(ids[length:] == PAD)
    # A sequence starts at a sentence boundary, unless it continues the cut long sentence.
    assert seq[1] in sentence_starts or seq[1] in long_sentence
    content = seq[1:]
    if stream[pos:pos + len(content)] == content:
      pos += len(content)  # It ended with a document's [SEP].
    else:  # The packer closed it with a [SEP] of its own.
      assert stream[pos:pos + len(content) - 1] == content[:-1]
      pos += len(content) - 1
  assert pos == len(stream)
  assert np.all(out['num_a'] == out['length']) and np.all(out['next_sentence_labels'] == 0)
  # Greedy packing of sentences of <= 12 tokens into 14 slots leaves little padding.
  assert np.mean(out['length']) > 9
