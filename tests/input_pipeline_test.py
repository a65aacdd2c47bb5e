"""Tests of bert_jax.input_pipeline on corpora and vocabularies made here.

Most corpora are "marker" corpora: every token of sentence s of document d is the word
`{prefix}{d}s{s}`, so the ids of an example say where each token came from, and pair structure,
sharding and held-out splits can be checked from the batches alone.
"""

import gzip
import os
import random
import re

import ml_collections
import numpy as np
import pytest
import tensorflow as tf
import tensorflow_datasets as tfds

from bert_jax import config_checks
from bert_jax import defaults
from bert_jax import documents
from bert_jax import input_pipeline
from bert_jax import packing
from bert_jax import tables
from bert_jax import tokenization
from bert_jax import vocab
from bert_jax.errors import UserError

import records

SPECIALS = ['[PAD]', '[UNK]', '[CLS]', '[SEP]', '[MASK]']
PAD, UNK, CLS, SEP, MASK = range(5)
# Word pieces for whole-word masking: 'abcdef' -> ab ##cd ##ef, 'ijkl' -> ij ##kl.
PIECES = ['ab', '##cd', '##ef', 'gh', 'ij', '##kl']
PIECE_WORDS = ['abcdef', 'abcd', 'ab', 'gh', 'ijkl', 'ij']
_MARKER = re.compile(r'([a-z])(\d+)s(\d+)$')


def _write(path, prefix, docs, first_doc=0):
  with open(path, 'w') as f:
    for d, lengths in enumerate(docs, first_doc):
      for s, n in enumerate(lengths):
        f.write(' '.join([f'{prefix}{d}s{s}'] * n) + '\n')
      f.write('\n')


def _doc_text(prefix, d, lengths):
  return '\n'.join(' '.join([f'{prefix}{d}s{s}'] * n) for s, n in enumerate(lengths))


class Corpora:
  """Corpora and one vocabulary for the whole module (built once: tokenizers are slow)."""

  def __init__(self, root):
    rng = random.Random(0)
    self.root = root
    self.docs = {}
    # Regular: 1-8 sentences of 1-14 tokens.
    self.docs['r'] = [[rng.randint(1, 14) for _ in range(rng.randint(1, 8))]
                      for _ in range(400)]
    # Short: mostly one sentence, some two to four; 1-20 tokens.
    self.docs['s'] = [[rng.randint(1, 20) for _ in range(rng.choice([1] * 12 + [2] * 5 +
                                                                     [3, 4, 4]))]
                      for _ in range(1500)]
    # Held-out checks: enough documents that some hash to the held-out share.
    self.docs['h'] = [[rng.randint(1, 10) for _ in range(rng.randint(1, 5))]
                      for _ in range(700)]
    self.files = {}
    for prefix, docs in self.docs.items():
      self.files[prefix] = os.path.join(root, f'{prefix}.txt')
      _write(self.files[prefix], prefix, docs)
    # The regular corpus again, in four files (one gzipped) for file sharding.
    quarter = len(self.docs['r']) // 4
    self.split_files = []
    for i in range(4):
      path = os.path.join(root, 'split', f'part{i}.txt')
      os.makedirs(os.path.dirname(path), exist_ok=True)
      _write(path, 'r', self.docs['r'][i * quarter:(i + 1) * quarter], first_doc=i * quarter)
      if i == 3:
        with open(path, 'rb') as f, gzip.open(path + '.gz', 'wb') as g:
          g.write(f.read())
        os.remove(path)
        path += '.gz'
      self.split_files.append(path)
    # Whole words of several pieces.
    self.files['w'] = os.path.join(root, 'w.txt')
    with open(self.files['w'], 'w') as f:
      for _ in range(300):
        for _ in range(rng.randint(1, 5)):
          f.write(' '.join(rng.choice(PIECE_WORDS) for _ in range(rng.randint(1, 12))) + '\n')
        f.write('\n')
    words = [f'{p}{d}s{s}' for p, docs in self.docs.items() for d, lengths in enumerate(docs)
             for s in range(len(lengths))]
    self.vocab_file = os.path.join(root, 'vocab.txt')
    with open(self.vocab_file, 'w') as f:
      f.write('\n'.join(SPECIALS + PIECES + words) + '\n')
    self.vocab = SPECIALS + PIECES + words
    self.tokenizer = tokenization.load_tokenizer(self.vocab_file)
    self.where = {}  # id -> (prefix, doc, sentence)
    for i, w in enumerate(self.vocab):
      m = _MARKER.match(w)
      if m:
        self.where[i] = (m.group(1), int(m.group(2)), int(m.group(3)))

  def config(self, **overrides) -> ml_collections.ConfigDict:
    data = defaults.pretrain().data
    data.vocab_file = self.vocab_file
    data.input = self.files['r']
    data.shuffle_buffer = 500
    for k, v in overrides.items():
      data[k] = v
    return data


@pytest.fixture(scope='module')
def corpora(tmp_path_factory):
  return Corpora(str(tmp_path_factory.mktemp('corpora')))


def _batches(ds, n):
  return [b for _, b in zip(range(n), ds.as_numpy_iterator())]


def _concat(batches):
  return {k: np.concatenate([b[k] for b in batches]) for k in batches[0]}


def _originals(b):
  """input_ids with the masked positions restored to their original ids."""
  ids = b['input_ids'].copy()
  rows, cols = np.nonzero(b['masked_lm_weights'] > 0)
  ids[rows, b['masked_lm_positions'][rows, cols]] = b['masked_lm_ids'][rows, cols]
  return ids


def _segments(ids, length):
  seq = list(ids[:length])
  assert seq[0] == CLS and seq[-1] == SEP and seq.count(SEP) == 2, seq
  first = seq.index(SEP)
  return seq[1:first], seq[first + 1:-1]


def _check_pairs(corpora, b, seq_len):
  """Checks the NSP structure of every example; returns statistics."""
  ids = _originals(b)
  stats = dict(examples=0, not_next=0, split_sentence=0)
  for row in range(len(ids)):
    length = int(b['input_mask'][row].sum())
    np.testing.assert_array_equal(b['input_mask'][row, :length], 1)
    a, bb = _segments(ids[row], length)
    np.testing.assert_array_equal(b['segment_ids'][row, :len(a) + 2], 0)
    np.testing.assert_array_equal(b['segment_ids'][row, len(a) + 2:length], 1)
    sides = []
    for side in (a, bb):
      marks = [corpora.where[t] for t in side]
      prefix, doc = marks[0][:2]
      assert all(m[:2] == (prefix, doc) for m in marks), 'a segment spans documents'
      sentences = [m[2] for m in marks]
      assert sentences == sorted(sentences) and sentences[-1] - sentences[0] + 1 == len(
          set(sentences)), 'a segment is not consecutive sentences'
      full = corpora.docs[prefix][doc]
      counts = {s: sentences.count(s) for s in set(sentences)}
      for s in counts:
        if s not in (sentences[0], sentences[-1]):
          assert counts[s] == full[s], 'an inner sentence is incomplete'
      sides.append((prefix, doc, sentences, counts, full))
    (pa, da, sa, ca, full), (pb, db, sb, cb, _) = sides
    truncated = len(a) + len(bb) == seq_len - 3
    label = int(b['next_sentence_labels'][row])
    stats['examples'] += 1
    stats['not_next'] += label
    if label == 0:
      assert (pa, da) == (pb, db) and sb[0] >= sa[-1], 'IsNext B does not follow A'
      if sb[0] == sa[-1]:  # One sentence split into A and B.
        stats['split_sentence'] += 1
        assert ca[sa[-1]] + cb[sb[0]] <= full[sa[-1]]
        if not truncated:
          assert ca[sa[-1]] + cb[sb[0]] == full[sa[-1]] and len(set(sa + sb)) == 1
      elif not truncated:
        assert sb[0] == sa[-1] + 1 and ca[sa[-1]] == full[sa[-1]] and cb[sb[0]] == full[sb[0]]
    else:
      assert (pa, da) != (pb, db), 'NotNext B comes from the same document'
  return stats


def _check_masking(b, max_predictions):
  ids = _originals(b)
  weights = b['masked_lm_weights'] > 0
  rows, cols = np.nonzero(weights)
  positions = b['masked_lm_positions'][rows, cols]
  originals = b['masked_lm_ids'][rows, cols]
  now = b['input_ids'][rows, positions]
  assert not np.isin(originals, [PAD, CLS, SEP, MASK]).any(), 'a special token was masked'
  eligible = (b['input_mask'] > 0) & ~np.isin(ids, [PAD, CLS, SEP, MASK])
  per_row = weights.sum(1)
  expected = np.minimum(max_predictions,
                        np.maximum(1, np.round(eligible.sum(1) * 0.15))).astype(int)
  np.testing.assert_array_equal(per_row, expected)
  return dict(masked=weights.sum() / eligible.sum(), mask=np.mean(now == MASK),
              kept=np.mean(now == originals),
              random=np.mean((now != MASK) & (now != originals)))


def test_shapes_dtypes_and_nsp_statistics(corpora):
  data = corpora.config()
  ds = input_pipeline.make_pretraining_dataset(data, batch_size=250, seq_len=64,
                                               max_predictions=20, train=True)
  spec = ds.element_spec
  assert set(spec) == set(input_pipeline.FEATURES)
  for k in ('input_ids', 'input_mask', 'segment_ids'):
    assert spec[k].shape == (250, 64) and spec[k].dtype == tf.int32
  for k in ('masked_lm_positions', 'masked_lm_ids'):
    assert spec[k].shape == (250, 20) and spec[k].dtype == tf.int32
  assert spec['masked_lm_weights'].dtype == tf.float32
  assert spec['next_sentence_labels'].shape == (250,)
  b = _concat(_batches(ds, 40))
  stats = _check_pairs(corpora, b, 64)
  assert stats['examples'] == 10_000
  assert abs(stats['not_next'] / stats['examples'] - 0.5) < 0.03
  m = _check_masking(b, 20)
  assert abs(m['masked'] - 0.15) < 0.01
  assert abs(m['mask'] - 0.8) < 0.02 and abs(m['kept'] - 0.1) < 0.02
  assert abs(m['random'] - 0.1) < 0.02
  lengths = b['input_mask'].sum(1)
  assert lengths.min() >= 5 and lengths.max() == 64


def test_not_next_share_on_short_documents(corpora):
  data = corpora.config(input=corpora.files['s'])
  ds = input_pipeline.make_pretraining_dataset(data, batch_size=500, seq_len=48,
                                               max_predictions=12, train=True)
  b = _concat(_batches(ds, 20))
  stats = _check_pairs(corpora, b, 48)
  assert abs(stats['not_next'] / stats['examples'] - 0.5) < 0.03
  # The original would force NotNext on these one-sentence chunks; here they are split.
  assert stats['split_sentence'] > 0.2 * stats['examples']


def test_determinism_and_seeds(corpora):
  data = corpora.config()

  def first(seed=None, train=True, n=3, **kw):
    ds = input_pipeline.make_pretraining_dataset(data, batch_size=16, seq_len=32,
                                                 max_predictions=5, train=train, seed=seed, **kw)
    return _batches(ds, n)

  a, b, c = first(), first(), first(seed=1)
  assert all(np.array_equal(x[k], y[k]) for x, y in zip(a, b) for k in x)
  assert not all(np.array_equal(x['input_ids'], y['input_ids']) for x, y in zip(a, c))


def test_epochs_differ_and_eval_is_one_deterministic_padded_pass(corpora):
  # One 40-document file as evaluation input: small enough to see its end.
  path = os.path.join(corpora.root, 'eval.txt')
  _write(path, 'r', corpora.docs['r'][:40])
  data = corpora.config(eval_input=path)
  make = lambda: input_pipeline.make_pretraining_dataset(  # pylint: disable=g-long-lambda
      data, batch_size=7, seq_len=32, max_predictions=5, train=False)
  first, second = list(make().as_numpy_iterator()), list(make().as_numpy_iterator())
  assert len(first) == len(second) and len(first) > 2
  assert all(np.array_equal(x[k], y[k]) for x, y in zip(first, second) for k in x)
  every = _concat(first)
  real = every['input_mask'][:, 0] == 1
  assert real.sum() > len(real) - 7 and not real[0] is False
  padding = ~real
  assert np.all(every['input_mask'][padding] == 0) and np.all(
      every['masked_lm_weights'][padding] == 0)
  docs = {corpora.where[t][1] for t in _originals(every)[real].ravel() if t in corpora.where}
  assert docs == set(range(40))  # Every document of the pass.
  _check_pairs(corpora, {k: v[real] for k, v in every.items()}, 32)


def test_held_out_documents(corpora):
  prefix, docs = 'h', corpora.docs['h']
  ids = tf.strings.to_hash_bucket_fast(
      [_doc_text(prefix, d, lengths) for d, lengths in enumerate(docs)], 2**62).numpy()
  held_out = set(np.nonzero(ids % 100 == 0)[0].tolist())
  assert held_out
  data = corpora.config(input=corpora.files['h'])
  found = {}
  for train in (True, False):
    ds = input_pipeline.make_pretraining_dataset(data, batch_size=8, seq_len=32,
                                                 max_predictions=5, train=train)
    b = _concat(_batches(ds, 60 if train else 10_000))
    original = _originals(b)[b['input_mask'][:, 0] == 1]
    found[train] = {corpora.where[t][1] for t in original.ravel() if t in corpora.where}
  assert found[False] == held_out
  assert not found[True] & held_out and len(found[True]) > 200


def test_process_shards_are_disjoint(corpora):
  for inputs in (','.join(corpora.split_files), corpora.files['r']):
    data = corpora.config(input=inputs)
    seen = []
    for index in range(2):
      ds = input_pipeline.make_pretraining_dataset(
          data, batch_size=64, seq_len=32, max_predictions=5, train=True,
          process_index=index, process_count=2)
      b = _concat(_batches(ds, 12))
      seen.append({corpora.where[t][1] for t in _originals(b).ravel() if t in corpora.where})
    assert not seen[0] & seen[1], inputs
    assert len(seen[0] | seen[1]) > 250 and min(map(len, seen)) > 100


def test_iterator_save_and_restore(corpora, tmp_path):
  # Four files (one gzipped): file shuffles, interleaving and document grouping are restored
  # too.
  data = corpora.config(input=','.join(corpora.split_files), shuffle_buffer=100)
  make = lambda: input_pipeline.make_pretraining_dataset(  # pylint: disable=g-long-lambda
      data, batch_size=8, seq_len=32, max_predictions=5, train=True)
  it = input_pipeline.make_iterator(make())
  for _ in range(23):
    next(it)
  it.save(str(tmp_path / 'data_state'))
  expected = [next(it) for _ in range(60)]  # Crosses an epoch: buffers refill, masks re-drawn.
  restored = input_pipeline.make_iterator(make())
  restored.restore(str(tmp_path / 'data_state'))
  got = [next(restored) for _ in range(60)]
  for x, y in zip(expected, got):
    for k in x:
      np.testing.assert_array_equal(x[k], y[k])
  assert isinstance(got[0]['input_ids'], np.ndarray)


def test_whole_word_masking(corpora):
  data = corpora.config(input=corpora.files['w'], whole_word_masking=True)
  ds = input_pipeline.make_pretraining_dataset(data, batch_size=64, seq_len=32,
                                               max_predictions=8, train=True)
  b = _concat(_batches(ds, 10))
  ids = _originals(b)
  continuation = corpora.tokenizer.is_continuation
  masked_words = 0
  for row in range(len(ids)):
    n = int(b['masked_lm_weights'][row].sum())
    masked = set(b['masked_lm_positions'][row, :n].tolist())
    length = int(b['input_mask'][row].sum())
    word = []
    for p in range(length + 1):
      if p < length and ids[row, p] > MASK and continuation[ids[row, p]] and word:
        word.append(p)
        continue
      if word:
        hit = masked & set(word)
        assert not hit or hit == set(word), 'part of a word was masked'
        masked_words += bool(hit) and len(word) > 1
      word = [p] if p < length and ids[row, p] > MASK else []
  assert masked_words > 50


def test_sentence_order_prediction(corpora):
  data = corpora.config(objective='sop')
  ds = input_pipeline.make_pretraining_dataset(data, batch_size=250, seq_len=32,
                                               max_predictions=5, train=True)
  b = _concat(_batches(ds, 8))
  ids = _originals(b)
  for row in range(len(ids)):
    a, bb = _segments(ids[row], int(b['input_mask'][row].sum()))
    wa, wb = corpora.where[a[0]], corpora.where[bb[0]]
    assert wa[:2] == wb[:2]
    first_a, first_b = wa[2], wb[2]
    if b['next_sentence_labels'][row] == 0:
      assert first_a <= first_b
    else:
      assert first_a >= first_b
  assert abs(b['next_sentence_labels'].mean() - 0.5) < 0.05


def test_mlm_only_packs_full_sequences(corpora):
  data = corpora.config(objective='none')
  ds = input_pipeline.make_pretraining_dataset(data, batch_size=128, seq_len=48,
                                               max_predictions=8, train=True)
  b = _concat(_batches(ds, 5))
  assert np.all(b['segment_ids'] == 0) and np.all(b['next_sentence_labels'] == 0)
  ids = _originals(b)
  lengths = b['input_mask'].sum(1)
  assert lengths.mean() > 40  # Packed: little padding.
  for row in range(len(ids)):
    seq = ids[row, :lengths[row]]
    assert seq[0] == CLS and seq[-1] == SEP
    previous = None
    for t in seq[1:]:
      if t == SEP:
        previous = None  # A document boundary.
        continue
      where = corpora.where[t]
      if previous is not None:  # Within a document: sentences in order.
        assert where[:2] == previous[:2] and where[2] >= previous[2]
      previous = where


def test_tfrecords(tmp_path):
  path = str(tmp_path / 'data.tfrecord')
  rng = np.random.RandomState(0)
  written = []
  for _ in range(10):
    f = {k: rng.randint(0, 50, 16) for k in ('input_ids', 'input_mask', 'segment_ids')}
    f.update({k: rng.randint(0, 50, 3) for k in ('masked_lm_positions', 'masked_lm_ids')})
    f['next_sentence_labels'] = rng.randint(0, 2, 1)
    f['masked_lm_weights'] = np.array([1.0, 1.0, 0.0], np.float32)
    written.append(f)
  records.write_pretraining_records(path, written)
  data = defaults.pretrain().data
  data.input = str(tmp_path / '*.tfrecord')
  data.eval_input = path
  data.vocab_file = ''
  batches = list(input_pipeline.make_pretraining_dataset(
      data, batch_size=4, seq_len=16, max_predictions=3, train=False).as_numpy_iterator())
  assert len(batches) == 3
  got = _concat(batches)
  for k in input_pipeline.FEATURES:
    expected = np.stack([f[k] for f in written])
    if k == 'next_sentence_labels':
      expected = expected[:, 0]
    np.testing.assert_array_equal(got[k][:10], expected)
    assert got[k].dtype == (np.float32 if k == 'masked_lm_weights' else np.int32)
    assert not got[k][10:].any()  # Padding examples.
  train = input_pipeline.make_pretraining_dataset(data, batch_size=4, seq_len=16,
                                                  max_predictions=3, train=True)
  assert len(_batches(train, 5)) == 5  # Endless.
  with pytest.raises(ValueError, match=r"data\.tfrecord: feature 'input_ids' has 16 values"):
    input_pipeline.make_pretraining_dataset(data, batch_size=4, seq_len=32, max_predictions=3,
                                            train=False)
  with pytest.raises(ValueError, match="feature 'masked_lm_positions'.*max_predictions"):
    input_pipeline.make_pretraining_dataset(data, batch_size=4, seq_len=16, max_predictions=5,
                                            train=False)


class BertJaxTestArticles(tfds.core.GeneratorBasedBuilder):
  """A tiny TFDS text dataset: 60 articles of marker sentences."""
  VERSION = tfds.core.Version('1.0.0')

  def _info(self):
    return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict(
        {'title': tfds.features.Text(), 'text': tfds.features.Text()}))

  def _split_generators(self, dl_manager):
    del dl_manager
    return {'train': self._generate_examples()}

  def _generate_examples(self):
    for d in range(60):
      # Sentence breaks after '.', '?' and '!' and at newlines; not inside 'x.y'.
      text = f'r{d}s0 r{d}s0. r{d}s1 x.y r{d}s1?  r{d}s2!\nr{d}s3\n\n r{d}s4 r{d}s4'
      yield d, {'title': f'doc {d}', 'text': text}


def test_tfds_input(corpora, tmp_path):
  builder = BertJaxTestArticles(data_dir=str(tmp_path))
  builder.download_and_prepare()
  data = corpora.config(input='tfds:bert_jax_test_articles', eval_input='')
  data.tfds_data_dir = str(tmp_path)
  ds = input_pipeline.make_pretraining_dataset(data, batch_size=32, seq_len=32,
                                               max_predictions=5, train=True)
  b = _concat(_batches(ds, 5))
  ids = _originals(b)
  sentences = set()
  for row in range(len(ids)):
    a, bb = _segments(ids[row], int(b['input_mask'][row].sum()))
    for side in (a, bb):
      marks = {corpora.where[t][:2] for t in side if t in corpora.where}
      assert len(marks) <= 1  # One article per segment ('.' alone is [UNK]).
      sentences |= {corpora.where[t][2] for t in side if t in corpora.where}
  assert sentences == {0, 1, 2, 3, 4}
  data.tfds_text_key = 'body'
  with pytest.raises(ValueError, match="tfds_text_key='body'.*'text'"):
    input_pipeline.make_pretraining_dataset(data, batch_size=4, seq_len=32, max_predictions=5,
                                            train=True)


def test_bad_inputs(corpora, tmp_path):
  def make(data, seq_len=32, max_predictions=5, train=True):
    return input_pipeline.make_pretraining_dataset(
        data, batch_size=4, seq_len=seq_len, max_predictions=max_predictions, train=train)

  # A pattern that matches nothing.
  with pytest.raises(UserError, match=r'nothing-\*\.txt'):
    make(corpora.config(input=f'{corpora.files["r"]},{tmp_path}/nothing-*.txt'))
  # An empty corpus: blank lines only.
  empty = tmp_path / 'empty.txt'
  empty.write_text('\n  \n\n\t\n')
  with pytest.raises(ValueError, match='no documents in data.input.*empty.txt'):
    make(corpora.config(input=str(empty)))
  # Held-out share of a tiny corpus is empty.
  tiny = tmp_path / 'tiny.txt'
  tiny.write_text('r0s0 r0s0\n\nr1s0\n')
  with pytest.raises(ValueError, match='held-out.*data.eval_input'):
    make(corpora.config(input=str(tiny)), train=False)
  # One document: NotNext is impossible; SOP swaps within a document, so one is enough.
  with pytest.raises(UserError, match="one_doc.txt'.* holds a single document: objective 'nsp'"):
    make(corpora.config(input=_one_doc(tmp_path)))
  assert _batches(make(corpora.config(input=_one_doc(tmp_path), objective='sop')), 1)
  # Settings: checked where a config loads (config_checks); a direct caller meets an assert,
  # or for a choice the one check of it (config_checks.check_choice).
  with pytest.raises(AssertionError, match=r'\(7, 5, 4\)'):
    make(corpora.config(), seq_len=7)
  with pytest.raises(AssertionError, match=r'\(32, 33, 4\)'):
    make(corpora.config(), max_predictions=33)
  with pytest.raises(UserError, match="data.objective='mlm': expected one of"):
    make(corpora.config(objective='mlm'))
  # A vocabulary without the special tokens.
  bad_vocab = tmp_path / 'bad_vocab.txt'
  bad_vocab.write_text('\n'.join(['[PAD]', '[UNK]'] + corpora.vocab[5:]) + '\n')
  with pytest.raises(ValueError, match=r"lacks special tokens \['\[CLS\]'"):
    make(corpora.config(vocab_file=str(bad_vocab)))


def _one_doc(tmp_path):
  path = tmp_path / 'one_doc.txt'
  path.write_text('r0s0 r0s0\nr0s1\nr0s2 r0s2 r0s2\n')
  return str(path)


def test_awkward_text_works(corpora, tmp_path):
  path = tmp_path / 'awkward.txt'
  with open(path, 'wb') as f:
    for d in range(30):
      f.write(f'r{d}s0 r{d}s0 \xff\xfe r{d}s0\n'.encode('latin-1'))  # Not UTF-8.
      f.write(b'r%ds1 \xc3\x28 r%ds1\r\n' % (d, d))
      if d == 3:
        f.write(b'r3s2' * 25_000 + b'\n')  # One 100,000-character word: [UNK].
      if d == 5:
        f.write(b' '.join([b'r5s2'] * 20_000) + b'\n')  # A 100,000-character sentence.
      f.write(b'\n')
  data = corpora.config(input=str(path))
  for objective in ('nsp', 'none'):
    data.objective = objective
    b = _concat(_batches(input_pipeline.make_pretraining_dataset(
        data, batch_size=16, seq_len=32, max_predictions=5, train=True), 20))
    assert b['input_ids'].shape == (320, 32)
    original = _originals(b)
    assert set(np.unique(original)) <= set(corpora.where) | {PAD, UNK, CLS, SEP}
    assert (original == corpora.vocab.index('r5s2')).any()


def test_inputs_gzip_globs_and_lists(corpora):
  spec = f'{corpora.split_files[3]},{os.path.dirname(corpora.split_files[0])}/part[01].txt'
  ds = input_pipeline.make_pretraining_dataset(corpora.config(input=spec), batch_size=64,
                                               seq_len=32, max_predictions=5, train=True)
  b = _concat(_batches(ds, 20))
  docs = {corpora.where[t][1] for t in _originals(b).ravel() if t in corpora.where}
  quarter = len(corpora.docs['r']) // 4
  assert {d // quarter for d in docs} == {0, 1, 3}


def test_resolve_vocab_trains_once(corpora, tmp_path):
  data = corpora.config(input=corpora.files['w'], vocab_file='', vocab_size=40)
  path = input_pipeline.resolve_vocab(data, str(tmp_path))
  assert path == str(tmp_path / 'vocab.txt')
  mtime = os.path.getmtime(path)
  assert input_pipeline.resolve_vocab(data, str(tmp_path)) == path
  assert os.path.getmtime(path) == mtime
  assert 11 < tokenization.load_tokenizer(path).vocab_size <= 40
  assert input_pipeline.resolve_vocab(corpora.config(), None) == corpora.vocab_file


# ---------------------------------------------------------------------------------------------
# Packed rows (data.packing)
# ---------------------------------------------------------------------------------------------


def _unpack(b, seq_len, max_predictions):
  """Packed rows -> the unpacked features of their sequences, one row each, in row order."""
  out = {k: [] for k in input_pipeline.FEATURES}
  for r in range(len(b['input_ids'])):
    for slot in range(int(b['sequence_ids'][r].max())):
      cols = np.nonzero(b['sequence_ids'][r] == slot + 1)[0]
      start, length = cols[0], len(cols)
      assert np.all(np.diff(cols) == 1) and b['next_sentence_positions'][r, slot] == start
      np.testing.assert_array_equal(b['position_ids'][r, cols], np.arange(length))
      pad = lambda x, n, fill=0: np.concatenate([x, np.full(n - len(x), fill, x.dtype)])
      out['input_ids'].append(pad(b['input_ids'][r, cols], seq_len, PAD))
      out['input_mask'].append(pad(np.ones(length, np.int32), seq_len))
      out['segment_ids'].append(pad(b['segment_ids'][r, cols], seq_len))
      mine = (b['masked_lm_weights'][r] > 0) & np.isin(b['masked_lm_positions'][r], cols)
      out['masked_lm_positions'].append(pad(b['masked_lm_positions'][r, mine] - start,
                                            max_predictions))
      out['masked_lm_ids'].append(pad(b['masked_lm_ids'][r, mine], max_predictions))
      out['masked_lm_weights'].append(pad(b['masked_lm_weights'][r, mine], max_predictions))
      out['next_sentence_labels'].append(b['next_sentence_labels'][r, slot])
    assert (b['next_sentence_weights'][r] == (np.arange(b['next_sentence_weights'].shape[1])
                                              < b['sequence_ids'][r].max())).all()
  return {k: np.stack(v) for k, v in out.items()}


def test_packed_rows_hold_whole_pairs_each_masked_on_its_own(corpora):
  data = corpora.config(packing=True, packing_max_sequences=6)
  ds = input_pipeline.make_pretraining_dataset(data, batch_size=50, seq_len=64,
                                               max_predictions=10, train=True)
  spec = ds.element_spec
  assert set(spec) == set(packing.PACKED_FEATURES)
  width = packing.predictions_per_row(10, 6, 64)
  assert width == 13 and spec['masked_lm_ids'].shape == (50, width)
  assert spec['next_sentence_labels'].shape == (50, 6)
  b = _concat(_batches(ds, 20))
  unpacked = _unpack(b, 64, 10)
  stats = _check_pairs(corpora, unpacked, 64)
  assert abs(stats['not_next'] / stats['examples'] - 0.5) < 0.04
  m = _check_masking(unpacked, 10)  # Per sequence: the 15% rule and the 10-prediction cap.
  assert abs(m['masked'] - 0.15) < 0.01 and abs(m['mask'] - 0.8) < 0.03
  sequences_per_row = len(unpacked['input_ids']) / len(b['input_ids'])
  assert sequences_per_row > 1.3
  assert b['input_mask'].mean() > 0.97  # Unpacked, these rows are about 30% padding.


def test_packed_mlm_only_keeps_documents_apart(corpora):
  data = corpora.config(objective='none', packing=True)
  ds = input_pipeline.make_pretraining_dataset(data, batch_size=32, seq_len=48,
                                               max_predictions=8, train=True)
  unpacked = _unpack(_concat(_batches(ds, 4)), 48, 8)
  ids = _originals(unpacked)
  lengths = unpacked['input_mask'].sum(1)
  ends_document = 0
  for row in range(len(ids)):
    seq = ids[row, :lengths[row]]
    assert seq[0] == CLS and seq[-1] == SEP and SEP not in seq[1:-1]
    marks = [corpora.where[t] for t in seq[1:-1]]
    assert len({m[:2] for m in marks}) == 1, 'a sequence spans documents'
    prefix, doc = marks[0][:2]
    # A sequence ends with its document's last sentence, or is full (46 tokens + 2).
    if marks[-1][2] == len(corpora.docs[prefix][doc]) - 1:
      ends_document += 1
    else:
      assert lengths[row] >= 48 - 14, 'a sequence stopped early inside its document'
  assert ends_document > 0.5 * len(ids)


def test_packed_evaluation_holds_every_sequence_of_the_pass(corpora):
  path = os.path.join(corpora.root, 'eval.txt')
  _write(path, 'r', corpora.docs['r'][:40])

  def sequences(**kw):
    data = corpora.config(eval_input=path, **kw)
    batches = list(input_pipeline.make_pretraining_dataset(
        data, batch_size=7, seq_len=32, max_predictions=5, train=False).as_numpy_iterator())
    b = _concat(batches)
    if kw:
      real = b['input_mask'].any(1)
      assert not real[-1] or real.all()  # Padding rows only at the end.
      assert not b['masked_lm_weights'][~real].any()
      assert not b['next_sentence_weights'][~real].any()
      b = _unpack(b, 32, 5)
    found = sorted(tuple(row[row != PAD]) for row in _originals(b))
    return found, len(batches)

  packed, packed_batches = sequences(packing=True, packing_window=25)
  unpacked, unpacked_batches = sequences()
  assert packed == [s for s in unpacked if s]  # The same sequences, none lost or doubled.
  assert packed_batches < unpacked_batches


def test_packed_iterator_save_and_restore(corpora, tmp_path):
  data = corpora.config(shuffle_buffer=100, packing=True, packing_window=30)
  make = lambda: input_pipeline.make_pretraining_dataset(  # pylint: disable=g-long-lambda
      data, batch_size=8, seq_len=32, max_predictions=5, train=True)
  it = input_pipeline.make_iterator(make())
  for _ in range(13):
    next(it)
  it.save(str(tmp_path / 'data_state'))
  expected = [next(it) for _ in range(40)]
  restored = input_pipeline.make_iterator(make())
  restored.restore(str(tmp_path / 'data_state'))
  for x, y in zip(expected, (next(restored) for _ in range(40))):
    for k in x:
      np.testing.assert_array_equal(x[k], y[k])


def test_packed_tfrecords_keep_their_static_masks(tmp_path):
  path = str(tmp_path / 'data.tfrecord')
  rng = np.random.RandomState(1)
  written = []
  for i in range(30):
    length = rng.randint(5, 17)
    written.append({
        'input_ids': np.r_[CLS, 1000 * i + np.arange(1, length - 1), SEP,
                           np.zeros(16 - length, int)],
        'input_mask': np.r_[np.ones(length, int), np.zeros(16 - length, int)],
        'segment_ids': np.zeros(16, int), 'masked_lm_positions': np.array([1, 2, 0]),
        'masked_lm_ids': np.array([7, 8, 0]), 'next_sentence_labels': [i % 2],
        'masked_lm_weights': np.array([1.0, 1.0, 0.0], np.float32)})
  records.write_pretraining_records(path, written)
  data = defaults.pretrain().data
  data.input = data.eval_input = path
  data.vocab_file = ''
  data.packing = True
  b = _concat(list(input_pipeline.make_pretraining_dataset(
      data, batch_size=4, seq_len=16, max_predictions=3, train=False).as_numpy_iterator()))
  unpacked = _unpack(b, 16, 3)
  assert len(unpacked['input_ids']) == 30 and len(b['input_ids']) < 30
  order = np.argsort(unpacked['input_ids'][:, 1])
  for k in input_pipeline.FEATURES:
    expected = np.stack([f[k] for f in written])
    if k == 'next_sentence_labels':
      expected = expected[:, 0]
    np.testing.assert_array_equal(unpacked[k][order], expected)


def test_packing_keys_are_checked():
  """Where a config loads (config_checks, issue 40: each check once), not in the pipeline."""
  for key in ('packing_max_sequences', 'packing_window'):
    config = defaults.pretrain()
    config.data.packing = True
    config.data[key] = 0
    with pytest.raises(UserError, match=f'data.{key}=0: must be an integer >= 1'):
      config_checks.check_config(config)


def _training_input(data, batch_size, step, seq_len=32):
  fingerprint = input_pipeline.input_fingerprint(data, batch_size=batch_size, seq_len=seq_len,
                                                 max_predictions=5)
  make = lambda seed: input_pipeline.make_pretraining_dataset(  # pylint: disable=g-long-lambda
      data, batch_size=batch_size, seq_len=seq_len, max_predictions=5, train=True, seed=seed)
  return input_pipeline.TrainingInput(make, fingerprint, step, data.seed), make


def _assert_same(xs, ys):
  for x, y in zip(xs, ys, strict=True):
    for k in x:
      np.testing.assert_array_equal(x[k], y[k])


def test_a_saved_position_is_restored_only_for_the_input_it_was_made_for(corpora, tmp_path,
                                                                          caplog):
  # Resumed with the same input: exact. With another batch size, length or corpus: the input
  # restarts with a seed of (data.seed, step), said in a warning naming the key; never the old
  # corpus, never TensorFlow's "expected [16,64] but got [8,64]".
  data = corpora.config(shuffle_buffer=50)
  it, _ = _training_input(data, 8, 0)
  for _ in range(5):
    next(it)
  state = str(tmp_path / 'state')
  it.save(state)
  expected = [next(it) for _ in range(3)]
  same, _ = _training_input(data, 8, 5)
  same.restore(state)
  _assert_same([next(same) for _ in range(3)], expected)

  restarted = input_pipeline.restart_seed(data.seed, 5)
  cases = [(data, 4, 32, 'train.batch_size (8 -> 4)'),
           (data, 8, 48, 'data.max_seq_length (32 -> 48)'),
           (corpora.config(input=corpora.files['s'], shuffle_buffer=50), 8, 32,
            'data.input (1 of 1 files new or changed, 1 gone)')]
  for new_data, batch_size, seq_len, change in cases:
    caplog.clear()
    other, make = _training_input(new_data, batch_size, 5, seq_len)
    other.restore(state)
    assert f'Resuming at step 5 with {change} changed' in caplog.text
    got = [next(other) for _ in range(2)]
    assert got[0]['input_ids'].shape == (batch_size, seq_len)
    _assert_same(got, list(make(restarted).take(2).as_numpy_iterator()))
    if new_data is not data:  # Only the new corpus is read.
      ids = _originals(_concat(got)).ravel()
      assert {corpora.where[t][0] for t in ids if t in corpora.where} == {'s'}
    # The restarted input's own position resumes exactly, restart included.
    other.save(state + '_restarted')
    after = [next(other) for _ in range(2)]
    again, _ = _training_input(new_data, batch_size, 7, seq_len)
    again.restore(state + '_restarted')
    _assert_same([next(again) for _ in range(2)], after)


def _autograph_conversions(capsys, build) -> list[str]:
  """The functions AutoGraph converted while `build()` ran, as its log names them (at verbosity
  1, TensorFlow's public switch)."""
  capsys.readouterr()
  tf.autograph.set_verbosity(1, alsologtostdout=True)
  try:
    build()
  finally:
    tf.autograph.set_verbosity(int(os.environ.get('AUTOGRAPH_VERBOSITY', 0)))
  return re.findall(r'^Converted call: <(?:function|bound method) ([\w.<>]+)',
                    capsys.readouterr().out, re.M)


def test_autograph_rewrites_none_of_the_inputs_functions(corpora, tmp_path, capsys):
  """The input's tf.data functions are graphs as written (documents.as_written): AutoGraph's
  rewrite of them cost about 1.2 s of a CPU in every process that built an input (2026-12-03).
  Text files paired, masked and packed; TFRecords less the held-out share; Parquet tables; the
  word count that trains a vocabulary."""
  pa = pytest.importorskip('pyarrow')
  pq = pytest.importorskip('pyarrow.parquet')
  # The log is read as AutoGraph writes it: a function it does convert is named.
  def plus_one(x):
    return x + 1
  assert any(name.endswith('.plus_one') for name in _autograph_conversions(
      capsys, lambda: tf.data.Dataset.range(2).map(plus_one)))
  path = str(tmp_path / 'data.tfrecord')
  records.write_pretraining_records(path, [dict(
      input_ids=np.arange(16) + i, input_mask=np.ones(16, int), segment_ids=np.zeros(16, int),
      masked_lm_positions=np.array([1, 2, 0]), masked_lm_ids=np.array([7, 8, 0]),
      next_sentence_labels=[i % 2], masked_lm_weights=np.array([1.0, 1.0, 0.0], np.float32))
      for i in range(200)])
  records_data = defaults.pretrain().data
  records_data.input, records_data.eval_input, records_data.vocab_file = path, '', ''
  pq.write_table(pa.table({'text': ['a b c. d e f.'] * 4}), str(tmp_path / 'table.parquet'))

  def build():
    input_pipeline.make_pretraining_dataset(
        corpora.config(packing=True), batch_size=8, seq_len=32, max_predictions=5, train=True)
    input_pipeline.make_pretraining_dataset(
        records_data, batch_size=8, seq_len=16, max_predictions=3, train=True)
    documents.table_documents([str(tmp_path / 'table.parquet')], 'text')
    vocab.count_words(['A vocabulary is trained on words.'])

  converted = _autograph_conversions(capsys, build)
  modules = (documents, input_pipeline, tables, vocab)
  mine = [name for name in converted if any(name.split('.')[0] in vars(m) for m in modules)]
  assert not mine, converted
