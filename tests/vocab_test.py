"""Tests for bert_jax.vocab: deterministic WordPiece and SentencePiece."""

import gzip
import random

import pytest
import tensorflow as tf
import tensorflow_datasets as tfds

from bert_jax import tokenization
from bert_jax import vocab
from bert_jax.errors import UserError


def _corpus(num_lines=400, seed=0):
  """Zipf-like English-looking text with accents, punctuation and CJK."""
  rng = random.Random(seed)
  stems = ['token', 'model', 'train', 'piece', 'word', 'learn', 'text', 'data',
           'read', 'write', 'café', 'naïve', 'Straße', 'ΣΟΦΟΣ', '中文', 'run']
  suffixes = ['', 's', 'ing', 'ed', 'er', 'ers', 'ly', 'ness', 'able']
  lines = []
  for i in range(num_lines):
    words = []
    for _ in range(rng.randrange(3, 15)):
      stem = stems[min(int(rng.paretovariate(1.0)) - 1, len(stems) - 1)]
      word = stem + rng.choice(suffixes)
      words.append(word.capitalize() if rng.random() < 0.2 else word)
    lines.append(' '.join(words) + rng.choice(['.', '!', '?', ',', '...']))
    if i % 10 == 9:
      lines.append('')  # Document boundary.
  return lines


def _write(path, lines, compress=False):
  data = ''.join(line + '\n' for line in lines).encode('utf-8')
  with open(path, 'wb') as f:
    f.write(gzip.compress(data, mtime=0) if compress else data)
  return str(path)


def _read(path):
  with open(path, encoding='utf-8') as f:
    return f.read().splitlines()


def test_reserved_layout_and_unused_slots(tmp_path):
  out = vocab.train_wordpiece(_corpus(), str(tmp_path / 'v.txt'),
                              vocab_size=200, num_unused=5)
  tokens = _read(out)
  assert tokens[:10] == ['[PAD]', '[unused0]', '[unused1]', '[unused2]',
                         '[unused3]', '[unused4]', '[UNK]', '[CLS]', '[SEP]',
                         '[MASK]']
  assert len(tokens) == 200
  assert len(set(tokens)) == len(tokens)
  tok = tokenization.WordPieceTokenizer(out)
  assert (tok.pad_id, tok.unk_id, tok.mask_id) == (0, 6, 9)


def test_training_is_deterministic(tmp_path):
  lines = _corpus()
  a = vocab.train_wordpiece(lines, str(tmp_path / 'a.txt'), vocab_size=150)
  b = vocab.train_wordpiece(list(lines), str(tmp_path / 'b.txt'),
                            vocab_size=150)
  assert _read(a) == _read(b)
  c = vocab.train_wordpiece(_corpus(seed=1), str(tmp_path / 'c.txt'),
                            vocab_size=150)
  assert _read(a) != _read(c)


@pytest.mark.parametrize('lower_case', [True, False])
def test_covers_every_character_and_learns_pieces(tmp_path, lower_case):
  lines = _corpus()
  out = vocab.train_wordpiece(lines, str(tmp_path / 'v.txt'), vocab_size=120,
                              lower_case=lower_case)
  tokens = _read(out)
  tok = tokenization.WordPieceTokenizer(out, lower_case=lower_case)
  words = tokenization.split_words(tf.constant(lines), lower_case)
  chars = {c for w in words.flat_values.numpy() for c in w.decode()}
  first_chars = {w.decode()[0] for w in words.flat_values.numpy()}
  for c in chars:
    assert c in tokens or '##' + c in tokens, c
  assert first_chars <= set(tokens)
  ids = tok.tokenize(tf.constant(lines)).flat_values.numpy()
  assert tok.unk_id not in ids
  # Merged pieces, both word-initial and continuations, and fewer tokens than
  # characters.
  assert any(len(t) > 1 and not t.startswith('[') and not t.startswith('##')
             for t in tokens)
  assert any(t.startswith('##') and len(t) > 3 for t in tokens)
  assert len(ids) < 0.5 * sum(len(w) for w in words.flat_values.numpy())
  if lower_case:
    assert not any(t != t.lower() for t in tokens if not t.startswith('['))
  else:
    assert 'S' in tokens or 'Σ' in tokens


def test_rare_characters_give_way_when_the_vocab_is_small(tmp_path):
  lines = ['abcdefghij ' * 20] + [chr(0x4E00 + i) for i in range(300)]
  out = vocab.train_wordpiece(lines, str(tmp_path / 'v.txt'), vocab_size=100)
  tokens = _read(out)
  assert len(tokens) <= 100
  assert 'a' in tokens and '##b' in tokens


def test_small_corpus_gives_smaller_vocab(tmp_path):
  out = vocab.train_wordpiece(['ab ab ab'], str(tmp_path / 'v.txt'),
                              vocab_size=1000)
  tokens = _read(out)
  assert tokens == ['[PAD]', '[UNK]', '[CLS]', '[SEP]', '[MASK]', 'a', '##b',
                    'ab']


def test_learned_pieces_are_bounded():
  def longest(pieces):
    return max(len(p.removeprefix('##')) for p in pieces)

  counts = {'x' * 80: 1000, 'y' * 30: 10}
  assert longest(vocab.learn_wordpieces(counts, 500)) > 10
  assert longest(vocab.learn_wordpieces(counts, 500, max_piece_chars=10)) <= 10


def test_read_lines_files_gz_and_chunks(tmp_path, monkeypatch):
  lines = _corpus(50)
  _write(tmp_path / 'a.txt', lines)
  _write(tmp_path / 'b.txt.gz', lines, compress=True)
  monkeypatch.setattr(vocab, '_CHUNK_BYTES', 7)  # Splits inside 'é', '中'.
  got = list(vocab.read_files(vocab.expand_patterns([str(tmp_path / '*.txt'),
                                                     str(tmp_path / '*.gz')])))
  assert got == lines + lines


def test_run_from_files(tmp_path):
  _write(tmp_path / 'part-0.txt.gz', _corpus(200), compress=True)
  _write(tmp_path / 'part-1.txt', _corpus(200, seed=1))
  out = vocab.run([str(tmp_path / 'part-*')], str(tmp_path / 'out/vocab.txt'),
                  vocab_size=150, num_unused=2)
  tokens = _read(out)
  assert len(tokens) == 150 and tokens[1] == '[unused0]'
  assert out == str(tmp_path / 'out/vocab.txt')


class BertJaxVocabArticles(tfds.core.GeneratorBasedBuilder):
  """A TFDS text dataset of the test corpus, ten lines per article."""
  VERSION = tfds.core.Version('1.0.0')

  def _info(self):
    return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict(
        {'body': tfds.features.Text()}))

  def _split_generators(self, dl_manager):
    del dl_manager
    return {'train': self._generate_examples()}

  def _generate_examples(self):
    lines = [line for line in _corpus(400) if line]
    for i in range(0, len(lines), 10):
      yield i, {'body': ' '.join(lines[i:i + 10])}


def test_run_from_tfds_and_files_together(tmp_path):
  BertJaxVocabArticles(data_dir=str(tmp_path / 'tfds')).download_and_prepare()
  _write(tmp_path / 'extra.txt', ['zyzzyva zyzzyva zyzzyva'] * 50)
  out = vocab.run(['tfds:bert_jax_vocab_articles', str(tmp_path / 'extra.txt')],
                  str(tmp_path / 'vocab.txt'), vocab_size=150, tfds_text_key='body',
                  tfds_data_dir=str(tmp_path / 'tfds'))
  tokens = _read(out)
  assert len(tokens) == 150
  assert 'token' in tokens and 'zyzzyva' in tokens  # From the articles and from the file.
  # `bert-jax vocab` has flags, not config keys: its errors name the flags.
  with pytest.raises(UserError, match="^--tfds_text_key='text' is not a feature"):
    vocab.run(['tfds:bert_jax_vocab_articles'], str(tmp_path / 'v.txt'), 150,
              tfds_data_dir=str(tmp_path / 'tfds'))
  with pytest.raises(UserError, match='or set --tfds_data_dir to where it is$'):
    vocab.run(['tfds:bert_jax_vocab_articles'], str(tmp_path / 'v.txt'), 150,
              tfds_text_key='body', tfds_data_dir=str(tmp_path / 'empty_tfds'))


def test_errors(tmp_path):
  with pytest.raises(UserError, match='missing-.*txt'):
    vocab.run([str(tmp_path / 'missing-*.txt')], str(tmp_path / 'v.txt'), 100)
  empty = _write(tmp_path / 'empty.txt', ['', '  ', ''])
  with pytest.raises(ValueError, match='empty.txt'):
    vocab.run([empty], str(tmp_path / 'v.txt'), 100)
  with pytest.raises(ValueError, match='empty.txt'):
    vocab.run([empty], str(tmp_path / 'sp'), 100, kind='sentencepiece')
  with pytest.raises(ValueError, match='vocab_size=5'):
    vocab.train_wordpiece(['a b'], str(tmp_path / 'v.txt'), vocab_size=5)
  with pytest.raises(ValueError, match='kind'):
    vocab.run([empty], str(tmp_path / 'v.txt'), 100, kind='bpe')
  with pytest.raises(ValueError, match='model_type'):
    vocab.train_sentencepiece(['a'], str(tmp_path / 'sp'), 100,
                              model_type='char')


@pytest.mark.parametrize('model_type', ['unigram', 'bpe'])
def test_sentencepiece_specials_and_determinism(tmp_path, model_type):
  lines = _corpus()
  a = vocab.train_sentencepiece(lines, str(tmp_path / 'a'), vocab_size=120,
                                model_type=model_type)
  b = vocab.train_sentencepiece(lines, str(tmp_path / 'b'), vocab_size=120,
                                model_type=model_type)
  assert a == str(tmp_path / 'a.model')
  with open(a, 'rb') as fa, open(b, 'rb') as fb:
    assert fa.read() == fb.read()
  tok = tokenization.load_tokenizer(a)
  assert tok.special_ids == [0, 1, 2, 3, 4]
  assert tok.vocab[:5] == ['[PAD]', '[UNK]', '[CLS]', '[SEP]', '[MASK]']
  assert tok.vocab_size == 120
  # Lower-casing is the model's own normalization.
  assert tok.encode(['Token MODEL']) == tok.encode(['token model'])


def test_sentencepiece_cased_and_run(tmp_path):
  _write(tmp_path / 'in.txt', _corpus())
  path = vocab.run([str(tmp_path / 'in.txt')], str(tmp_path / 'sp.model'),
                   vocab_size=120, kind='sentencepiece', lower_case=False)
  assert path == str(tmp_path / 'sp.model')
  tok = tokenization.load_tokenizer(path)
  assert tok.encode(['Token MODEL']) != tok.encode(['token model'])


def test_sentencepiece_larger_than_the_corpus_allows_gives_a_smaller_model(tmp_path, caplog):
  # As WordPiece does; SentencePiece's own hard limit raised "Vocabulary size too high".
  _write(tmp_path / 'in.txt', _corpus())
  with caplog.at_level('WARNING'):
    path = vocab.run([str(tmp_path / 'in.txt')], str(tmp_path / 'sp'), vocab_size=32000,
                     kind='sentencepiece')
  size = tokenization.load_tokenizer(path).vocab_size
  assert 120 < size < 32000
  assert f'only enough pieces for a vocabulary of {size} tokens (asked for 32000)' in caplog.text
