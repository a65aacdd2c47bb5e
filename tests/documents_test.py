"""Tests of bert_jax.documents: reading text files into documents, ids, splits, sentences."""

import gzip

import ml_collections
import numpy as np
import pytest
import tensorflow as tf

from bert_jax import documents
from bert_jax.errors import UserError


def _texts(ds):
  return [d['text'].decode() for d in ds.as_numpy_iterator()]


def _whole_documents(ds):
  """Texts of a stream of one file's pieces, a document's pieces joined again."""
  texts, last = [], None
  for d in ds.as_numpy_iterator():
    if d['id'] == last:
      texts[-1] += '\n' + d['text'].decode()
    else:
      texts.append(d['text'].decode())
    last = d['id']
  return texts


def _write_docs(path, docs, trailing_blank=True):
  text = '\n\n'.join('\n'.join(doc) for doc in docs) + ('\n\n' if trailing_blank else '')
  data = text.encode()
  if str(path).endswith('.gz'):
    data = gzip.compress(data)
  with open(path, 'wb') as f:
    f.write(data)


def test_documents_across_blocks_and_files(tmp_path):
  # Documents longer than a read block, blank lines of spaces, several blank lines in a row,
  # and a file without a final blank line: each document comes out whole (in pieces of
  # documents.PIECE_BYTES when longer), once, in order.
  rng = np.random.RandomState(0)
  first = [[f'doc{d} line{i}' for i in range(rng.choice([1, 3, 700, 1500]))] for d in range(9)]
  second = [[f'second{d} line{i}' for i in range(rng.randint(1, 4))] for d in range(5)]
  _write_docs(tmp_path / 'a.txt', first)
  _write_docs(tmp_path / 'b.txt.gz', second, trailing_blank=False)
  with open(tmp_path / 'c.txt', 'w') as f:
    f.write('\n  \n\nonly one\r\n  \t\n\n\nsecond doc\n')
  files = [str(tmp_path / n) for n in ('a.txt', 'b.txt.gz', 'c.txt')]
  got = []
  for path in files:
    got.append(_whole_documents(documents.text_documents([path])))
  assert got[0] == ['\n'.join(d) for d in first]
  assert got[1] == ['\n'.join(d) for d in second]
  assert got[2] == ['only one', 'second doc']
  together = _texts(documents.text_documents(files))
  assert sorted(together) == sorted(sum((_texts(documents.text_documents([p])) for p in files),
                                        []))


def test_invalid_utf8_is_replaced(tmp_path):
  path = tmp_path / 'bad.txt'
  path.write_bytes(b'good line\nbad \xff\xfe line \xc3\x28\n\nnext\n')
  texts = _texts(documents.text_documents([str(path)]))
  assert texts == ['good line\nbad \ufffd\ufffd line \ufffd(', 'next']


def test_ids_hold_out_and_shard(tmp_path):
  docs = [[f'document {d}', f'sentence {d}'] for d in range(3000)]
  _write_docs(tmp_path / 'docs.txt', docs)
  files = [str(tmp_path / 'docs.txt')]
  every = list(documents.text_documents(files).as_numpy_iterator())
  ids = np.array([d['id'] for d in every])
  expected = documents.document_ids(tf.constant([d['text'] for d in every])).numpy()
  np.testing.assert_array_equal(ids, expected)
  assert len(set(ids.tolist())) == 3000 and ids.min() >= 0
  held = set(_texts(documents.text_documents(files, holdout=True)))
  rest = set(_texts(documents.text_documents(files, holdout=False)))
  assert not held & rest and len(held | rest) == 3000 and 10 < len(held) < 60
  # One file, three processes: documents are dealt out by id, disjoint and complete.
  shares = [set(_texts(documents.text_documents(files, holdout=False, process_index=i,
                                                process_count=3))) for i in range(3)]
  assert sum(map(len, shares)) == len(rest) == len(set.union(*shares))
  assert min(map(len, shares)) > 900


def test_files_are_dealt_to_processes(tmp_path):
  files = []
  for i in range(5):
    files.append(str(tmp_path / f'{i}.txt'))
    _write_docs(files[-1], [[f'file {i} doc {d}'] for d in range(3)])
  shares = [_texts(documents.text_documents(files, process_index=p, process_count=2))
            for p in range(2)]
  assert {t.split()[1] for t in shares[0]} == {'0', '2', '4'}
  assert {t.split()[1] for t in shares[1]} == {'1', '3'}


def test_file_order_is_shuffled_per_epoch_deterministically(tmp_path):
  files = []
  for i in range(8):
    files.append(str(tmp_path / f'{i}.txt'))
    _write_docs(files[-1], [[f'file {i}']])
  make = lambda: documents.text_documents(files, shuffle_files=True, seed=3).repeat(3)
  first, second = _texts(make()), _texts(make())
  assert first == second
  epochs = [first[i * 8:(i + 1) * 8] for i in range(3)]
  assert all(sorted(e) == sorted(epochs[0]) for e in epochs)
  assert len({tuple(e) for e in epochs}) > 1


def test_expand_files_errors(tmp_path):
  (tmp_path / 'x.txt').write_text('a\n')
  assert documents.expand_files(f'{tmp_path}/x.txt, {tmp_path}/*.txt') == [
      str(tmp_path / 'x.txt')] * 2
  with pytest.raises(UserError, match=r"data.eval_input: '.*/y\*' matches no file"):
    documents.expand_files(f'{tmp_path}/x.txt,{tmp_path}/y*', 'data.eval_input')
  with pytest.raises(ValueError, match='data.input is empty'):
    documents.expand_files(' , ')


def test_a_leading_tilde_is_the_home_folder(tmp_path, monkeypatch):
  """As --workdir's: the shell leaves `--config.data.input=~/corpus.txt` as it is."""
  monkeypatch.setenv('HOME', str(tmp_path))
  (tmp_path / 'corpus.txt').write_text('a b.\n')
  assert documents.expand_files('~/corpus.txt, ~/*.txt') == [str(tmp_path / 'corpus.txt')] * 2
  assert list(documents.text_lines('~/corpus.txt', ml_collections.ConfigDict())) == ['a b.']


def test_input_kind():
  assert documents.input_kind('sample') == 'sample'
  assert documents.input_kind('tfds:wikipedia/20230601.en:train[:1%]') == 'tfds'
  assert documents.input_kind('a/*.tfrecord,b.tfrecord-00001-of-00002') == 'tfrecord'
  assert documents.input_kind('a.tfrecords.gz') == 'tfrecord'
  assert documents.input_kind('a/*.txt,b.tfrecord') == 'text'
  assert documents.parse_tfds('tfds:wikipedia/20230601.en') == ('wikipedia/20230601.en', 'train')
  assert documents.parse_tfds('tfds:c4:validation') == ('c4', 'validation')
  with pytest.raises(ValueError, match='tfds:NAME'):
    documents.parse_tfds('tfds::train')


def test_split_into_sentences():
  text = tf.constant('One two. Three "four?" Five! x.y 3.5 six\nseven\n\n  eight')
  got = documents.split_into_sentences(text).numpy().decode().split('\n')
  assert got == ['One two.', 'Three "four?"', 'Five!', 'x.y 3.5 six', 'seven', 'eight']


def test_require_element():
  documents.require_element(tf.data.Dataset.range(1), 'unused')
  with pytest.raises(ValueError, match='nothing here'):
    documents.require_element(tf.data.Dataset.range(0), 'nothing here')


def test_text_lines(tmp_path):
  _write_docs(tmp_path / 'a.txt', [['a b', 'c'], ['d']])
  data = ml_collections.ConfigDict({'tfds_text_key': 'text', 'tfds_data_dir': ''})
  assert list(documents.text_lines(str(tmp_path / 'a.txt'), data)) == ['a b', 'c', 'd']


def test_long_documents_come_in_pieces_of_whole_lines(tmp_path):
  # A book-length document streams as pieces: each starts at a PIECE_BYTES boundary of its
  # text, holds whole lines, and all pieces carry the document's id (the first piece's hash).
  rng = np.random.RandomState(1)
  book = [f'line {i} ' + 'w' * rng.randint(10, 900) for i in range(300)]
  short = ['a short document', 'of two lines']
  _write_docs(tmp_path / 'books.txt', [book, short, book[::-1]])
  got = list(documents.text_documents([str(tmp_path / 'books.txt')]).as_numpy_iterator())
  texts = [d['text'].decode() for d in got]
  ids = [int(d['id']) for d in got]
  text = '\n'.join(book)
  pieces = [t for t, i in zip(texts, ids) if i == ids[0]]
  assert '\n'.join(pieces) == text
  assert len(pieces) == (len(text) + documents.PIECE_BYTES - 1) // documents.PIECE_BYTES
  assert all(len(p) <= documents.PIECE_BYTES + 1000 for p in pieces)
  assert ids[0] == documents.document_ids(tf.constant([pieces[0]])).numpy()[0]
  assert texts[len(pieces)] == '\n'.join(short)
  assert ids[len(pieces)] == documents.document_ids(tf.constant(['\n'.join(short)])).numpy()[0]
  reversed_pieces = texts[len(pieces) + 1:]
  assert '\n'.join(reversed_pieces) == '\n'.join(book[::-1])
  assert len(set(ids[len(pieces) + 1:])) == 1 and ids[-1] != ids[0]
  # The same pieces whatever the read blocks are.
  old = documents.LINES_PER_READ
  try:
    documents.LINES_PER_READ = 7
    again = list(documents.text_documents([str(tmp_path / 'books.txt')]).as_numpy_iterator())
  finally:
    documents.LINES_PER_READ = old
  assert [d['text'].decode() for d in again] == texts
  assert [int(d['id']) for d in again] == ids


def test_long_lines_are_cut_at_whitespace_or_between_characters(tmp_path):
  words = ' '.join(f'word{i}' for i in range(3000))  # ~26 KB without a sentence end.
  cjk = '漢字かな' * 3000  # 36 KB of 3-byte characters, no whitespace.
  (tmp_path / 'long.txt').write_text(f'{words}\n{cjk}\n\nshort\n', encoding='utf-8')
  texts = _texts(documents.text_documents([str(tmp_path / 'long.txt')]))
  assert texts[-1] == 'short'
  lines = '\n'.join(texts[:-1]).split('\n')
  assert all(len(line.encode()) <= documents.LINE_BYTES for line in lines)
  word_lines = [line for line in lines if line.startswith('word')]
  assert ' '.join(word_lines) == words  # Cut only at spaces: no word is broken.
  assert ''.join(line for line in lines if not line.startswith('word')) == cjk
  assert '\ufffd' not in ''.join(lines)  # Never inside a character.


def test_crlf_reads_like_lf_and_cr_only_is_named(tmp_path):
  docs = [['first doc', 'its second line'], ['second doc'], ['third', 'doc']]
  text = '\n\n'.join('\n'.join(d) for d in docs) + '\n'
  (tmp_path / 'lf.txt').write_bytes(text.encode())
  (tmp_path / 'crlf.txt').write_bytes(text.replace('\n', '\r\n').encode())
  lf = _texts(documents.text_documents([str(tmp_path / 'lf.txt')]))
  assert lf == ['\n'.join(d) for d in docs]
  assert _texts(documents.text_documents([str(tmp_path / 'crlf.txt')])) == lf
  # TextLineDataset drops CRs: CR-only line ends (classic Mac OS) would make one line.
  for name, compress in (('cr.txt', bytes), ('cr.txt.gz', gzip.compress)):
    (tmp_path / name).write_bytes(compress(text.replace('\n', '\r').encode()))
    with pytest.raises(UserError, match=rf'^data.input: \S*{name} ends its lines with CR alone'):
      documents.expand_files(str(tmp_path / name))


def test_summarize_counts_pieces_documents_and_cut_lines(tmp_path):
  book = [f'line {i} ' + 'w' * 500 for i in range(100)]  # ~51 KB: 7 pieces.
  long_line = ' '.join(['word'] * 3000)  # 15 KB: cut in 4.
  _write_docs(tmp_path / 'c.txt', [book, ['short'], [long_line, 'x', long_line]])
  ds = documents.text_documents([str(tmp_path / 'c.txt')])
  assert sum(int(d['cut']) for d in ds.as_numpy_iterator()) == 2
  summary = documents.summarize(ds)
  assert summary['documents'] == 3 and summary['documents_in_pieces'] == 2
  assert summary['lines_cut'] == 2
  pieces = list(ds.as_numpy_iterator())
  assert summary['pieces'] == len(pieces)
  assert summary['bytes'] == sum(len(p['text']) for p in pieces)
  # It reads up to a number of bytes (the first 16 MB by default): the piece that reaches it
  # is the last one counted.
  first = len(pieces[0]['text'])
  assert documents.summarize(ds, at_most_bytes=first)['pieces'] == 1
  assert documents.summarize(ds, at_most_bytes=first + 1) == dict(
      pieces=2, documents=1, documents_in_pieces=1, lines_cut=0,
      bytes=first + len(pieces[1]['text']))


def test_tfds_articles_come_in_pieces_like_text_files():
  article = ' '.join(f'Sentence {i} of a book.' for i in range(2000))  # ~48 KB.
  table = 'cell ' * 3000  # One 15 KB line without a sentence end.
  docs = documents._select(documents.split_into_sentences(tf.constant([article, table, 'a'])),
                           documents.selector(None))
  pieces = {k: v.numpy() for k, v in documents._in_pieces(docs).items()}
  ids = docs['id'].numpy()
  texts = [t.decode() for t in pieces['text']]
  book = [t for t, i in zip(texts, pieces['id']) if i == ids[0]]
  assert '\n'.join(book) == docs['text'].numpy()[0].decode() and len(book) > 4
  assert all(len(t) <= documents.PIECE_BYTES + documents.LINE_BYTES for t in book)
  assert pieces['cut'].sum() == 1 and texts[-1] == 'a'
  assert ' '.join(t for t, i in zip(texts, pieces['id']) if i == ids[1]).split() == table.split()
