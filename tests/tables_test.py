"""Tables as corpora: Parquet files (local, gs://, hf://datasets/) and folders written by
`datasets.save_to_disk` give the documents that text files of the same text give, in bounded
pieces, and a training input over them resumes exactly, as over text files
(input_pipeline_test.test_iterator_save_and_restore)."""

import os
import random
import sys

import numpy as np
import pytest

from bert_jax import defaults
from bert_jax import documents
from bert_jax import fileio
from bert_jax import hub
from bert_jax import input_pipeline
from bert_jax import tables
from bert_jax.errors import UserError
import hub_server

pa = pytest.importorskip('pyarrow')
pq = pytest.importorskip('pyarrow.parquet')
datasets = pytest.importorskip('datasets')

SPECIALS = ['[PAD]', '[UNK]', '[CLS]', '[SEP]', '[MASK]']


class Corpus:
  """600 documents of 1-6 sentences of marker words (d12s3 = document 12, sentence 3), as one
  text file, as Parquet (two files of several row groups, with other columns and a null row
  beside them) and as a saved dataset (two shards), with a vocabulary of every word."""

  def __init__(self, root):
    rng = random.Random(0)
    self.root = root
    self.docs = [[' '.join([f'd{d}s{s}'] * rng.randint(1, 12)) for s in range(rng.randint(1, 6))]
                 for d in range(600)]
    texts = ['\n'.join(sentences) for sentences in self.docs]
    self.text_file = os.path.join(root, 'corpus.txt')
    with open(self.text_file, 'w') as f:
      f.write('\n\n'.join(texts) + '\n')
    os.makedirs(os.path.join(root, 'parquet'))
    self.parquet = []
    for part, rows in enumerate((texts[:300] + [None], texts[300:])):
      path = os.path.join(root, 'parquet', f'train-{part:05d}-of-00002.parquet')
      pq.write_table(pa.table({'id': list(range(len(rows))), 'content': rows}), path,
                     row_group_size=64)
      self.parquet.append(path)
    self.saved = os.path.join(root, 'saved')
    datasets.Dataset.from_dict({'content': texts}).save_to_disk(self.saved, num_shards=2)
    self.vocab_file = os.path.join(root, 'vocab.txt')
    with open(self.vocab_file, 'w') as f:
      f.write('\n'.join(SPECIALS + [f'd{d}s{s}' for d, doc in enumerate(self.docs)
                                    for s in range(len(doc))]) + '\n')

  def config(self, **overrides):
    data = defaults.pretrain().data
    data.vocab_file = self.vocab_file
    data.input = os.path.join(self.root, 'parquet', '*.parquet')
    data.text_column = 'content'
    data.shuffle_buffer = 100
    for k, v in overrides.items():
      data[k] = v
    return data


@pytest.fixture(scope='module')
def corpus(tmp_path_factory):
  return Corpus(str(tmp_path_factory.mktemp('tables')))


def _documents(ds) -> list[tuple[int, bytes]]:
  return sorted((int(d['id']), d['text']) for d in ds.as_numpy_iterator())


@pytest.fixture(scope='module')
def from_text(corpus):
  return _documents(documents.text_documents([corpus.text_file]))


def test_parquet_rows_are_the_documents_of_the_same_text(corpus, from_text):
  # The same documents, ids (hence the held-out share) and pieces as the text file's.
  assert documents.input_kind(corpus.config().input) == 'table'
  files = documents.resolve_files(corpus.config().input)
  assert files == corpus.parquet
  assert _documents(documents.table_documents(files, 'content')) == from_text
  held_out = _documents(documents.table_documents(files, 'content', holdout=True))
  assert held_out == _documents(documents.text_documents([corpus.text_file], holdout=True))
  assert 0 < len(held_out) < 30


def test_a_saved_dataset_folder_is_its_arrow_files(corpus, from_text):
  assert documents.input_kind(corpus.saved) == 'table'
  files = documents.resolve_files(corpus.saved)
  assert [os.path.basename(f) for f in files] == ['data-00000-of-00002.arrow',
                                                   'data-00001-of-00002.arrow']
  assert _documents(documents.table_documents(files, 'content')) == from_text


def test_processes_read_disjoint_shares(corpus, from_text):
  # Two files: one each. One file (the saved dataset's first shard): by document id.
  first_shard = documents.resolve_files(corpus.saved)[:1]
  for files in (corpus.parquet, first_shard):
    shares = [_documents(documents.table_documents(files, 'content', process_index=i,
                                                   process_count=2)) for i in range(2)]
    assert shares[0] and shares[1] and not set(shares[0]) & set(shares[1])
    if files == corpus.parquet:
      assert sorted(shares[0] + shares[1]) == from_text
    else:
      assert set(shares[0] + shares[1]) < set(from_text)


def test_a_long_row_is_read_in_bounded_pieces(tmp_path):
  # A 200 KB row of one "line" (no newline, no sentence end): cut into lines of at most
  # LINE_BYTES and pieces of PIECE_BYTES (+ one line), nothing lost; chunks stay small.
  words = [f'w{i}' for i in range(40_000)]
  row = ' '.join(words)
  path = str(tmp_path / 'long.parquet')
  pq.write_table(pa.table({'text': [row, 'a short one.']}), path)
  pieces = list(documents.table_documents([path], 'text').as_numpy_iterator())
  assert max(len(p['text']) for p in pieces) <= documents.PIECE_BYTES + documents.LINE_BYTES
  first = [p['text'].decode() for p in pieces if p['id'] == pieces[0]['id']]
  assert ' '.join(' '.join(p.split('\n')) for p in first) == row
  plan = tables.plan([path], 'text')
  assert plan.chunk_rows.max() * (len(row) // 2) <= 2 * tables.CHUNK_BYTES


@pytest.mark.parametrize('source', ['parquet', 'saved'])
def test_iterator_save_and_restore(corpus, tmp_path, source):
  # As for text files: two files interleaved and shuffled, the position mid-chunk and
  # mid-epoch, restored exactly, across an epoch's end.
  data = corpus.config(input=corpus.saved if source == 'saved' else corpus.config().input)
  make = lambda: input_pipeline.make_pretraining_dataset(  # pylint: disable=g-long-lambda
      data, batch_size=8, seq_len=32, max_predictions=5, train=True)
  it = input_pipeline.make_iterator(make())
  for _ in range(23):
    next(it)
  it.save(str(tmp_path / 'data_state'))
  expected = [next(it) for _ in range(100)]  # Past the end of the first epoch (~75 batches).
  restored = input_pipeline.make_iterator(make())
  restored.restore(str(tmp_path / 'data_state'))
  got = [next(restored) for _ in range(100)]
  for x, y in zip(expected, got, strict=True):
    for k in x:
      np.testing.assert_array_equal(x[k], y[k])


def test_the_fingerprint_names_the_files(corpus):
  files = documents.file_identities(corpus.config().input)
  assert [f[0] for f in files] == corpus.parquet
  assert files[0][1] == os.path.getsize(corpus.parquet[0])


@pytest.mark.parametrize('case, message', [
    ('column', r"data\.text_column='body' is not a column of .*train-00000-of-00002\.parquet: "
               r'its columns are id, content'),
    ('type', r"data\.text_column='id' of .*train-00000-of-00002\.parquet holds int64, not text"),
    ('damaged', r'data\.input: .*bad\.parquet is not a readable Parquet file'),
    ('dict', r'data\.input: .*saved_dict holds the splits test, train of a DatasetDict; name one '
             r'\(.*saved_dict/test\)'),
    ('mixed', r'mixes tables \(Parquet, Arrow, hf://datasets/\) with other files'),
], ids=['column', 'type', 'damaged', 'dict', 'mixed'])
def test_mistakes_are_one_line(corpus, tmp_path, case, message):
  data = corpus.config()
  if case == 'column':
    data.text_column = 'body'
  elif case == 'type':
    data.text_column = 'id'
  elif case == 'damaged':
    (tmp_path / 'bad.parquet').write_bytes(b'PAR1 not really')
    data.input = str(tmp_path / 'bad.parquet')
  elif case == 'dict':
    folder = str(tmp_path / 'saved_dict')
    ds = datasets.Dataset.from_dict({'content': ['a b.']})
    datasets.DatasetDict({'train': ds, 'test': ds}).save_to_disk(folder)
    data.input = folder
  else:
    data.input = f'{corpus.text_file},{corpus.parquet[0]}'
  with pytest.raises(UserError, match=message):
    documents.documents(data.input, 'data.input', data)


def test_gcs_parquet(corpus, from_text, gcs):
  remote = gcs.url('tables/train-00000.parquet')
  with open(corpus.parquet[1], 'rb') as f, fileio.gfile().GFile(remote, 'wb') as g:
    g.write(f.read())
  files = documents.resolve_files(gcs.url('tables/*.parquet'))
  assert files == [remote]
  assert (_documents(documents.table_documents(files, 'content')) ==
          _documents(documents.table_documents(corpus.parquet[1:], 'content')))


def test_hub_dataset_files(corpus, from_text, tmp_path, monkeypatch):
  """hf://datasets/ORG/NAME/GLOB.parquet: fetched into the Hub cache through huggingface_hub
  (from the fake Hub), read as the local files; the fingerprint names them by commit."""
  from huggingface_hub import constants  # pylint: disable=g-import-not-at-top
  with hub_server.HubServer() as server:
    files = {}
    for path in corpus.parquet:
      with open(path, 'rb') as f:
        files[f'data/{os.path.basename(path)}'] = f.read()
    sha = server.add_repo('bert-jax-test/corpus', {**files, 'README.md': b'a corpus'},
                          kind='dataset')
    monkeypatch.setattr(constants, 'ENDPOINT', server.url)
    monkeypatch.setattr(constants, 'HUGGINGFACE_CO_URL_TEMPLATE',
                        server.url + '/{repo_id}/resolve/{revision}/{filename}')
    monkeypatch.setattr(constants, 'HF_HUB_CACHE', str(tmp_path / 'hub'))
    monkeypatch.setattr(hub, '_DATASET_FILES', {})
    spec = 'hf://datasets/bert-jax-test/corpus/data/train-*.parquet'
    data = corpus.config(input=spec)
    assert documents.input_kind(spec) == 'table'
    docs, described = documents.documents(spec, 'data.input', data)
    assert _documents(docs) == from_text
    assert '2 files' in described
    assert [f[0] for f in documents.file_identities(spec)] == [
        f'hf://datasets/bert-jax-test/corpus@{sha}/data/{os.path.basename(p)}'
        for p in corpus.parquet]
    with pytest.raises(UserError, match=r'name the Parquet files in the dataset'):
      documents.resolve_files('hf://datasets/bert-jax-test/corpus')
    with pytest.raises(UserError, match=r'matches no file of the dataset bert-jax-test/corpus'):
      documents.resolve_files('hf://datasets/bert-jax-test/corpus/test-*.parquet')


def test_missing_extra_is_one_line(corpus, monkeypatch):
  monkeypatch.setitem(sys.modules, 'pyarrow.parquet', None)
  with pytest.raises(UserError, match=r'^Parquet corpora \(\*\.parquet\) need pyarrow, which is '
                                      r'not installed: pip install "bert_jax\[parquet\]"$'):
    tables.plan(corpus.parquet, 'content')


def test_bert_jax_vocab_reads_tables(corpus, tmp_path):
  from bert_jax import vocab as vocab_lib  # pylint: disable=g-import-not-at-top
  out = vocab_lib.run([corpus.config().input], str(tmp_path / 'vocab.txt'), 200,
                      text_column='content')
  with open(out) as f:
    tokens = f.read().split()
  # The pieces of the rows' marker words (d12s3): the text column's, nothing else's.
  assert {'d', '##s', '##s0', '##s1'} <= set(tokens) and len(tokens) == 200
  with pytest.raises(UserError, match=r"--text_column='text' is not a column"):
    vocab_lib.run([corpus.config().input], str(tmp_path / 'other.txt'), 200)
