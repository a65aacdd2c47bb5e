"""The input surface as tables: every kind of path a user gives x the ways it can be wrong,
every numeric config key x values out of its range, and keys that do not fit together. Each row
either works or is one UserError naming the path or key (README, "Troubleshooting"); a new input
or key is one more row.

Rows call the functions the commands call, in-process; a few `bert-jax` subprocesses at the end
prove the end-to-end promise (one line on stderr, exit status 2, before step 1). Unreadable and
unwritable paths: root reads and writes anything, so as root those rows run with the effective
user and group ids of `nobody` (`_as_a_user`), in a folder `nobody` may enter.

`python3 tests/inputs_test.py` prints every row and the first line it prints now (Markdown).
"""

import contextlib
import gzip
import json
import os
import pathlib
import re
import shutil
import subprocess
import tempfile

import ml_collections
import numpy as np
import pytest
import tensorflow as tf

import processes
import records

from bert_jax import cli
from bert_jax import config_files
from bert_jax import config_checks
from bert_jax import defaults
from bert_jax import documents
from bert_jax import errors
from bert_jax import features
from bert_jax import fileio
from bert_jax import glue
from bert_jax import input_inspect
from bert_jax import input_pipeline
from bert_jax import ner
from bert_jax import squad
from bert_jax import swag
from bert_jax import tokenization
from bert_jax import train
from bert_jax import vocab as vocab_lib
from bert_jax.errors import UserError

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SPECIALS = ['[PAD]', '[UNK]', '[CLS]', '[SEP]', '[MASK]']
WORDS = [f'w{i}' for i in range(40)]
_AS_ROOT = hasattr(os, 'geteuid') and os.geteuid() == 0


def _corpus_text(docs: int, crlf: bool = False) -> bytes:
  end = '\r\n' if crlf else '\n'
  lines = []
  for d in range(docs):
    lines += [' '.join(WORDS[(d + s + k) % 40] for k in range(6)) for s in range(4)] + ['']
  return end.join(lines).encode()


def _gzip(text: bytes) -> bytes:
  return gzip.compress(text)


def _half(data: bytes) -> bytes:
  return data[:len(data) // 2]


def _damage(data: bytes, at: float = 0.5) -> bytes:
  start = int(len(data) * at)
  return data[:start] + bytes(b ^ 0x5A for b in data[start:start + 16]) + data[start + 16:]


@contextlib.contextmanager
def _as_a_user():
  """Runs the block with the permissions of an ordinary user: as root, the effective ids of
  `nobody` (the real ids stay root's, so they can be restored); as anyone else, as they are."""
  if not _AS_ROOT:
    yield
    return
  os.setegid(65534)
  os.seteuid(65534)
  try:
    yield
  finally:
    os.seteuid(0)
    os.setegid(0)


@pytest.fixture
def open_dir():
  """A folder that `nobody` may enter (pytest's tmp_path is root's alone)."""
  path = tempfile.mkdtemp(prefix='bert_jax_inputs_')
  os.chmod(path, 0o755)
  yield path
  for folder, dirs, _ in os.walk(path):
    for d in dirs:
      os.chmod(os.path.join(folder, d), 0o755)
  shutil.rmtree(path)


def _outcome(read) -> str:
  """'ok', or the UserError's message; anything else (a bug) propagates."""
  try:
    read()
  except UserError as e:
    return str(e)
  return 'ok'


# ---- Path kinds x inputs ----------------------------------------------------------------------

# name -> how to make it at `path` (None: leave it missing).
_MAKERS = {
    'missing': None,
    'directory': lambda p: os.makedirs(p),
    'empty': lambda p: open(p, 'wb').close(),
    'binary': lambda p: open(p, 'wb').write(bytes(range(256)) * 4),
    'utf16': lambda p: open(p, 'wb').write(_corpus_text(30).decode().encode('utf-16')),
    'binary_gz': lambda p: open(p, 'wb').write(_gzip(bytes(range(256)) * 4)),
    'not_utf8': lambda p: open(p, 'wb').write(_corpus_text(30).replace(b'w1 ', b'\xff\xfe ')),
    'bom': lambda p: open(p, 'wb').write(b'\xef\xbb\xbf' + _corpus_text(30)),
    'crlf': lambda p: open(p, 'wb').write(_corpus_text(30, crlf=True)),
    'gz': lambda p: open(p, 'wb').write(_gzip(_corpus_text(30))),
    'truncated_gz': lambda p: open(p, 'wb').write(_half(_gzip(_corpus_text(300)))),
    'damaged_gz': lambda p: open(p, 'wb').write(_damage(_gzip(_corpus_text(300)))),
    # Damage that still decodes, seen only by the checksum at the end.
    'damaged_crc_gz': lambda p: open(p, 'wb').write(_damage(_gzip(_corpus_text(300)), 0.9)),
    'not_gzip_gz': lambda p: open(p, 'wb').write(_corpus_text(30)),
    'fifo': os.mkfifo,
    'unreadable': lambda p: (open(p, 'wb').write(_corpus_text(30)), os.chmod(p, 0)),
}


def _make(tmp_path, kind: str, suffix: str = '.txt') -> str:
  path = str(tmp_path / f'{kind}{".gz" if kind.endswith("gz") else suffix}')
  if _MAKERS[kind] is not None:
    _MAKERS[kind](path)
  return path


def _corpus_files(path):
  return documents.expand_files(path, 'data.input')


def _read_corpus_lines(path):
  return list(vocab_lib.read_files(vocab_lib.expand_patterns([path])))


# (kind, expected): 'ok' or a fragment of the UserError, which must also name the path.
CORPUS_ROWS = [
    ('missing', 'matches no file'),
    ('directory', 'is a directory; name the files in it'),
    ('empty', 'ok'),  # Refused later, by the pipeline's "no documents" (input_pipeline_test).
    ('binary', 'looks binary, not text (a NUL byte at byte 0)'),
    ('utf16', 'is UTF-16 text: save it as UTF-8'),
    ('binary_gz', 'looks binary, not text (a NUL byte at byte 0 of its decompressed data)'),
    ('not_utf8', 'ok'),  # Invalid UTF-8 becomes U+FFFD, as documents.py promises.
    ('bom', 'ok'),
    ('crlf', 'ok'),
    ('gz', 'ok'),
    ('truncated_gz', 'is truncated: its compressed data stops unfinished at byte'),
    ('damaged_gz', 'is damaged at compressed byte'),
    ('damaged_crc_gz', 'does not match its checksum'),
    ('not_gzip_gz', 'is not gzip data, though its name ends in .gz'),
    ('fifo', 'is not a regular file'),
    ('unreadable', 'cannot be read (Permission denied)'),
]


@pytest.mark.parametrize('reader', [_corpus_files, _read_corpus_lines],
                         ids=['data.input', 'vocab --input'])
@pytest.mark.parametrize('kind, expected', CORPUS_ROWS, ids=[r[0] for r in CORPUS_ROWS])
def test_corpus_paths(open_dir, reader, kind, expected):
  path = _make(pathlib.Path(open_dir), kind)
  with _as_a_user() if kind == 'unreadable' else contextlib.nullcontext():
    outcome = _outcome(lambda: reader(path))
  if expected == 'ok':
    assert outcome == 'ok', outcome
  else:
    assert expected in outcome and os.path.basename(path) in outcome, outcome


def test_documents_of_bom_crlf_and_gz_corpora_are_the_same(tmp_path):
  def texts(path):
    ds = documents.text_documents(documents.expand_files(path))
    return [d['text'] for d in ds.as_numpy_iterator()]
  plain = texts(_make(tmp_path, 'crlf', '.x'))  # Made before the others: distinct names.
  assert len(plain) == 30
  assert texts(_make(tmp_path, 'gz')) == plain
  bom = texts(_make(tmp_path, 'bom'))
  assert bom[1:] == plain[1:]
  assert bom[0].lstrip('\ufeff'.encode()) == plain[0]


def test_a_truncated_gz_is_refused_before_tf_data_reads_half_of_it(tmp_path):
  path = _make(tmp_path, 'truncated_gz')
  # tf.data alone stops quietly at the damage: this is what the start-up check prevents.
  lines = tf.data.TextLineDataset(path, compression_type='GZIP')
  try:
    count = sum(1 for _ in lines)
  except tf.errors.OpError:
    count = None
  assert count is None or count < 300 * 5
  with pytest.raises(UserError, match=r'truncated_gz.gz is truncated: .* at byte \d+'):
    documents.expand_files(path)


def test_damage_in_a_gz_is_named_where_it_is(tmp_path):
  data = _gzip(_corpus_text(300))
  start = len(data) // 2
  path = tmp_path / 'damaged.gz'
  path.write_bytes(_damage(data))
  with pytest.raises(UserError, match=r'damaged.gz is damaged at compressed byte (\d+) of') as e:
    documents.check_gzip(str(path), 'data.input')
  assert start <= int(e.value.args[0].split('byte ')[1].split()[0]) < start + 16
  # Damage that still decodes shows at the checksum, which ends the member: that byte.
  path.write_bytes(_damage(data, 0.9))
  with pytest.raises(UserError, match=rf'the gzip member that ends at compressed byte '
                     rf'{len(data)} \(of {len(data)}\) does not match its checksum'):
    documents.check_gzip(str(path), 'data.input')
  # Two members, the second damaged: the byte counts from the file's start.
  path.write_bytes(data + _damage(data))
  with pytest.raises(UserError, match=r'damaged at compressed byte (\d+) of') as e:
    documents.check_gzip(str(path), 'data.input')
  assert len(data) + start <= int(e.value.args[0].split('byte ')[1].split()[0])
  assert int(e.value.args[0].split('byte ')[1].split()[0]) < len(data) + start + 16


def _vocab_bytes(crlf=False):
  end = '\r\n' if crlf else '\n'
  return (end.join(SPECIALS + WORDS) + end).encode()


VOCAB_MAKERS = {
    'missing': None,
    'directory': lambda p: os.makedirs(p),
    'empty': lambda p: open(p, 'wb').close(),
    'binary': lambda p: open(p, 'wb').write(b'[PAD]\n\xff\xfe\x00\x01\n'),
    'bom': lambda p: open(p, 'wb').write(b'\xef\xbb\xbf' + _vocab_bytes()),
    'crlf': lambda p: open(p, 'wb').write(_vocab_bytes(crlf=True)),
    'no_specials': lambda p: open(p, 'wb').write(('\n'.join(WORDS) + '\n').encode()),
}
VOCAB_ROWS = [
    ('missing', 'Vocabulary file not found'),
    ('directory', 'is a directory'),
    ('empty', 'is empty: a BERT vocab.txt has one token a line'),
    ('binary', 'not UTF-8 text'),
    ('bom', 'ok'),
    ('crlf', 'ok'),
    ('no_specials', 'lacks special tokens'),
]


@pytest.mark.parametrize('kind, expected', VOCAB_ROWS, ids=[r[0] for r in VOCAB_ROWS])
def test_vocabulary_paths(tmp_path, kind, expected):
  path = str(tmp_path / 'vocab.txt')
  if VOCAB_MAKERS[kind] is not None:
    VOCAB_MAKERS[kind](path)
  if expected == 'ok':
    assert tokenization.load_vocab(path) == SPECIALS + WORDS
    return
  with pytest.raises(UserError) as e:
    tokenization.load_vocab(path)
  assert expected in str(e.value) and path in str(e.value), str(e.value)


def _records(path: str, cut=None) -> None:
  rng = np.random.RandomState(0)
  records.write_pretraining_records(path, [dict(
      input_ids=rng.randint(5, 40, 32), input_mask=np.ones(32, int),
      segment_ids=np.zeros(32, int), masked_lm_positions=np.arange(5),
      masked_lm_ids=np.full(5, 7), masked_lm_weights=np.ones(5), next_sentence_labels=[0])
      for _ in range(20)])
  if cut is not None:
    with open(path, 'rb') as f:
      data = f.read()
    with open(path, 'wb') as f:
      f.write(cut(data))


# TFRecords of create_pretraining_data.py (data.input, data.eval_input, data.phase_inputs): the
# rest of the corpus rows above apply to them too (they are expanded by the same function).
TFRECORD_ROWS = [
    ('whole', lambda p: _records(p), 'ok'),
    # Cut inside a record (a cut between two records leaves a shorter, valid file).
    ('truncated', lambda p: _records(p, lambda d: d[:len(d) // 2 + 7]),
     'is truncated or not a TFRecord file: the record at byte'),
    ('last_byte_missing', lambda p: _records(p, lambda d: d[:-1]), 'is truncated'),
    ('text_named_tfrecord', lambda p: open(p, 'wb').write(_corpus_text(3)),
     'is truncated or not a TFRecord file'),
    ('other_lengths', lambda p: _records(p), "feature 'input_ids' has 32 values, but seq_len "
     'asks for 64'),
]


def _tfrecord_outcome(root: str, kind: str) -> tuple[str, str]:
  make, _ = next((m, e) for k, m, e in TFRECORD_ROWS if k == kind)
  path = os.path.join(root, f'{kind}.tfrecord')
  make(path)
  seq_len = 64 if kind == 'other_lengths' else 32
  return path, _outcome(lambda: input_pipeline.check_tfrecord(path, seq_len, 5,
                                                              'data.eval_input'))


@pytest.mark.parametrize('kind, expected', [(k, e) for k, _, e in TFRECORD_ROWS],
                         ids=[k for k, _, _ in TFRECORD_ROWS])
def test_tfrecord_paths(tmp_path, kind, expected):
  path, outcome = _tfrecord_outcome(str(tmp_path), kind)
  if expected == 'ok':
    assert outcome == 'ok', outcome
  else:
    assert expected in outcome and path in outcome, outcome
    assert outcome.startswith(f'data.eval_input: {path}'), outcome


def test_a_damaged_tfrecord_is_named_by_the_key_that_gave_it(tmp_path):
  whole, cut = str(tmp_path / 'train.tfrecord'), str(tmp_path / 'eval.tfrecord')
  _records(whole)
  _records(cut, lambda d: d[:-1])
  vocab = tmp_path / 'vocab.txt'
  vocab.write_bytes(_vocab_bytes())
  data = defaults.pretrain().data
  data.input, data.eval_input, data.vocab_file = whole, cut, str(vocab)
  with pytest.raises(UserError, match=rf'^data.eval_input: {cut} is truncated'):
    input_pipeline.make_pretraining_dataset(data, batch_size=2, seq_len=32, max_predictions=5,
                                            train=False)
  data.input = cut
  with pytest.raises(UserError, match=rf'^data.input: {cut} is truncated'):
    input_pipeline.make_pretraining_dataset(data, batch_size=2, seq_len=32, max_predictions=5,
                                            train=True)


def _lock(path: str) -> None:
  from bert_jax import run_lock  # pylint: disable=g-import-not-at-top
  with run_lock.hold(path):
    pass


def _data_workdir(path: str) -> None:
  data = defaults.pretrain().data
  data.vocab_file, data.input = '', path + '_no_corpus/*.txt'
  input_pipeline.resolve_vocab(data, path)


# surface -> (the call, what an 'ok' row stops at, or None: it returns).
WORKDIR_SURFACES = {
    '--workdir (pretrain, finetune; the run lock)': (_lock, None),
    'data --workdir (a trained vocab.txt goes there)': (_data_workdir, 'matches no file'),
}
WORKDIR_ROWS = [(surface, kind, expected) for surface in WORKDIR_SURFACES
                for kind, expected in [
                    ('new', 'ok'), ('existing', 'ok'), ('a_file', 'is a file, not a folder'),
                    ('under_a_file', 'is a file, so no folder can be made there'),
                    ('unwritable', 'not writable')]]


def _workdir_outcome(root: str, surface: str, kind: str) -> tuple[str, str]:
  path = os.path.join(root, 'work')
  if kind == 'existing':
    os.makedirs(path)
  elif kind == 'a_file':
    open(path, 'w').close()
  elif kind == 'under_a_file':
    open(path, 'w').close()
    path += '/run'
  elif kind == 'unwritable':
    os.makedirs(path, mode=0o555)
  with _as_a_user() if kind == 'unwritable' else contextlib.nullcontext():
    return path, _outcome(lambda: WORKDIR_SURFACES[surface][0](path))


@pytest.mark.parametrize('surface, kind, expected', WORKDIR_ROWS,
                         ids=[f'{s.split(" ")[0].strip("-")}-{k}' for s, k, _ in WORKDIR_ROWS])
def test_workdir_paths(open_dir, surface, kind, expected):
  path, outcome = _workdir_outcome(open_dir, surface, kind)
  next_check = WORKDIR_SURFACES[surface][1]
  if expected == 'ok':
    assert (next_check in outcome) if next_check else outcome == 'ok', outcome
  else:
    assert f'--workdir={path}' in outcome and expected in outcome, outcome


# ---- Every other path a user gives x what can be wrong with it ---------------------------------
#
# A surface is a path the user names and the function its command reads it with (in-process:
# the call the command makes). Each kind of path either works (BOM, CRLF: read exactly as the
# plain file) or is one UserError naming the path. 'unreadable' and 'unwritable' rows run with
# the effective ids of `nobody` when the tests run as root (`_as_a_user`).

_GLUE_TSV = (b'Quality\t#1 ID\t#2 ID\t#1 String\t#2 String\n'
             b'1\t1\t2\tThe cat sat.\tA cat sat.\n0\t3\t4\tIt rained.\tThe sun shone.\n')
_SQUAD_JSON = json.dumps({'version': '1.1', 'data': [{'title': 't', 'paragraphs': [{
    'context': 'The cat sat on the mat.', 'qas': [{
        'id': 'q1', 'question': 'Where did the cat sit?',
        'answers': [{'text': 'on the mat', 'answer_start': 12}]}]}]}]}, indent=1).encode()
_CONLL = (b'-DOCSTART- -X- O O\n\nEU NNP B-NP B-ORG\nrejects VBZ B-VP O\n'
          b'German JJ B-NP B-MISC\n\nPeter NNP B-NP B-PER\n')

# surface -> (where its file lies under the test's folder, a valid file's bytes, the read).
FILE_SURFACES = {
    'config.task.data_dir (GLUE MRPC/train.tsv)':
        ('glue/MRPC/train.tsv', _GLUE_TSV,
         lambda path: glue.read_task('mrpc', path.rsplit('/MRPC/', 1)[0], 'train')),
    'predict --input (GLUE .tsv)': ('dev.tsv', _GLUE_TSV, lambda p: glue.read_file('mrpc', p)),
    'predict --input (GLUE .jsonl)':
        ('in.jsonl', b'{"text_a": "The cat sat.", "text_b": "A cat sat."}\n{"text_a": "Rain."}\n',
         glue.read_jsonl),
    'config.task.train_file / predict_file, predict --input (SQuAD)':
        ('train.json', _SQUAD_JSON, lambda p: squad.read_squad(p, is_training=True)),
    'config.task.data_dir (CoNLL train.txt)': ('ner/train.txt', _CONLL, ner.read_conll),
    'predict --input (NER text or CoNLL)':
        ('in.txt', b'EU rejects German call.\nPeter Blackburn\n',
         lambda p: ner.read_sentences(p)[0]),
    'features --input': ('in.txt', b'The cat sat. ||| A cat sat.\n\nIt rained.\n',
                         features.read_input),
    'data.vocab_file, --vocab_file': ('vocab.txt', _vocab_bytes(), tokenization.load_vocab),
    'config.task.data_dir, predict --input (SWAG .csv)':
        ('swag/train.csv', b'sent1,sent2,ending0,ending1,label\nA man,He,"sits, then",runs,0\n'
         b'A dog,It,barks,naps,1\n', swag.read_csv),
    'config.task.data_dir, predict --input (multiple choice .jsonl)':
        ('swag/train.jsonl', b'{"context": "A man", "endings": ["sits", "runs"]}\n'
         b'{"context": "A dog", "endings": ["barks", "naps"], "label": 1}\n', swag.read_jsonl),
}

# What every file surface answers, unless FILE_EXCEPTIONS says otherwise.
FILE_KINDS = {
    'missing': 'no such file',
    'dangling_symlink': 'no such file (a symbolic link to PATH.gone, which does not exist)',
    'symlink_loop': 'no such file (a symbolic link that loops: Too many levels of symbolic links)',
    'directory': 'is a directory',
    'fifo': 'is not a regular file',
    'empty': None,  # Each reader's own words: FILE_EXCEPTIONS.
    'binary': 'not UTF-8 text',
    'not_utf8': ':2: not UTF-8 text (byte',
    'bom': 'ok',
    'crlf': 'ok',
    'unreadable': 'cannot be read (Permission denied)',
}
FILE_EXCEPTIONS = {
    ('config.task.data_dir (GLUE MRPC/train.tsv)', 'missing'): 'no file',
    ('config.task.data_dir (GLUE MRPC/train.tsv)', 'dangling_symlink'): 'no file',
    ('config.task.data_dir (GLUE MRPC/train.tsv)', 'symlink_loop'): 'no file',
    ('config.task.data_dir (GLUE MRPC/train.tsv)', 'empty'): 'empty file (expected a header line)',
    ('predict --input (GLUE .tsv)', 'empty'): 'empty file (expected a header line)',
    ('predict --input (GLUE .jsonl)', 'empty'): 'no examples',
    ('config.task.train_file / predict_file, predict --input (SQuAD)', 'empty'): 'not valid JSON',
    ('config.task.data_dir (CoNLL train.txt)', 'empty'): 'no sentences',
    ('predict --input (NER text or CoNLL)', 'empty'): 'no sentences',
    ('features --input', 'empty'): '--input: PATH: no text (the file is empty)',
    ('data.vocab_file, --vocab_file', 'missing'): 'Vocabulary file not found',
    ('data.vocab_file, --vocab_file', 'dangling_symlink'):
        'Vocabulary file not found: PATH (a symbolic link to PATH.gone, which does not exist)',
    ('data.vocab_file, --vocab_file', 'symlink_loop'):
        'Vocabulary file not found: PATH (a symbolic link that loops',
    ('data.vocab_file, --vocab_file', 'empty'): 'is empty: a BERT vocab.txt',
    ('config.task.data_dir, predict --input (SWAG .csv)', 'empty'): 'empty file (expected a header',
    ('config.task.data_dir, predict --input (multiple choice .jsonl)', 'empty'): 'no examples',
}
FILE_ROWS = [(surface, kind, FILE_EXCEPTIONS.get((surface, kind), expected))
             for surface in FILE_SURFACES for kind, expected in FILE_KINDS.items()]


def _not_utf8(data: bytes) -> bytes:
  lines = data.split(b'\n')
  lines[1] = lines[1][:4] + b'\xff' + lines[1][4:]
  return b'\n'.join(lines)


def _make_file(path: str, kind: str, valid: bytes) -> None:
  os.makedirs(os.path.dirname(path), exist_ok=True)
  if kind == 'missing':
    return
  if kind == 'dangling_symlink':
    os.symlink(path + '.gone', path)
  elif kind == 'symlink_loop':
    os.symlink(path + '.other', path)
    os.symlink(path, path + '.other')
  elif kind == 'directory':
    os.makedirs(path)
  elif kind == 'fifo':
    os.mkfifo(path)
  else:
    data = {'empty': b'', 'binary': bytes(range(256)) * 4, 'not_utf8': _not_utf8(valid),
            'bom': b'\xef\xbb\xbf' + valid, 'crlf': valid.replace(b'\n', b'\r\n')
            }.get(kind, valid)
    with open(path, 'wb') as f:
      f.write(data)
    if kind == 'unreadable':
      os.chmod(path, 0)


def _file_outcome(root: str, surface: str, kind: str) -> tuple[str, str]:
  """(the path made, what reading it gave)."""
  where, valid, read = FILE_SURFACES[surface]
  path = os.path.join(root, kind, where)
  _make_file(path, kind, valid)
  if kind in ('bom', 'crlf'):
    plain = os.path.join(root, 'plain', where)
    _make_file(plain, 'plain', valid)
    if read(path) != read(plain):
      return path, f'reads differently from the same file without {kind}'
    return path, 'ok'
  with _as_a_user() if kind == 'unreadable' else contextlib.nullcontext():
    return path, _outcome(lambda: read(path))


@pytest.mark.parametrize('surface, kind, expected', FILE_ROWS,
                         ids=[f'{re.sub(r"[^a-zA-Z.]+", "_", s)}-{k}' for s, k, _ in FILE_ROWS])
def test_file_paths(open_dir, surface, kind, expected):
  path, outcome = _file_outcome(open_dir, surface, kind)
  if expected == 'ok':
    assert outcome == 'ok', outcome
  else:  # PATH in an expectation stands for the path.
    assert expected.replace('PATH', path) in outcome and path in outcome, outcome


def _checkpoint_kinds():
  cfg = dict(vocab_size=50, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
             intermediate_size=16, hidden_act='gelu', hidden_dropout_prob=0.1,
             attention_probs_dropout_prob=0.1, max_position_embeddings=32, type_vocab_size=2)
  def files(**named):
    def make(path):
      os.makedirs(path)
      for name, data in named.items():
        name = os.path.join(path, name.replace('__', '/'))  # a__b: file b in folder a.
        os.makedirs(os.path.dirname(name), exist_ok=True)
        if data is not None:
          with open(name, 'wb') as f:
            f.write(data)
    return make
  config = json.dumps(cfg).encode()
  return {
      'missing': (lambda p: None, 'no such directory or TF checkpoint'),
      'a_file': (lambda p: open(p, 'wb').write(b'weights'), 'is a file, not a checkpoint'),
      'empty_directory': (files(), 'not a checkpoint directory; expected'),
      'unrelated_files': (files(**{'notes.txt': b'x'}), 'it holds notes.txt'),
      'unreadable': (files(**{'bert_jax.json': b'{}'}), 'cannot be read (Permission denied)'),
      'hf_binary_config': (files(**{'config.json': bytes(range(256)),
                                    'model.safetensors': b'\0' * 64}), 'not UTF-8 text'),
      'hf_config_not_json': (files(**{'config.json': b'{"vocab', 'model.safetensors': b''}),
                             'not valid JSON'),
      'hf_truncated_weights': (files(**{'config.json': config, 'model.safetensors': b'\0' * 4}),
                               'not a readable safetensors file'),
      'hf_binary_weights': (files(**{'config.json': config,
                                     'model.safetensors': bytes(range(256)) * 4}),
                            'not a readable safetensors file'),
      'google_damaged_index': (files(**{'bert_config.json': config,
                                        'bert_model.ckpt.index': bytes(range(256)) * 4}),
                               'cannot read TF checkpoint'),
      'bert_jax_empty_params': (files(**{'bert_jax.json': b'{}', 'bert_config.json': config,
                                         'params__x': None}),
                                'damaged or incomplete checkpoint'),
      'workdir_empty_step': (files(**{'bert_config.json': config, 'checkpoints__7__x': None}),
                             'damaged or incomplete checkpoint (it holds no params)'),
      'workdir_without_config': (files(**{'checkpoints__x': None}), 'has no bert_config.json'),
  }


CHECKPOINT_KINDS = _checkpoint_kinds()


def _checkpoint_outcome(root: str, kind: str) -> tuple[str, str]:
  from bert_jax import pretrained  # pylint: disable=g-import-not-at-top
  make, _ = CHECKPOINT_KINDS[kind]
  path = os.path.join(root, kind)
  make(path)
  if kind == 'unreadable':
    os.chmod(path, 0)
  with _as_a_user() if kind == 'unreadable' else contextlib.nullcontext():
    return path, _outcome(lambda: pretrained.load_checkpoint(path, flag='--init_checkpoint'))


@pytest.mark.parametrize('kind', list(CHECKPOINT_KINDS))
def test_checkpoint_paths(open_dir, kind):
  """train.init_checkpoint, --init_checkpoint, --checkpoint, convert --input: one loader."""
  path, outcome = _checkpoint_outcome(open_dir, kind)
  assert CHECKPOINT_KINDS[kind][1] in outcome and path in outcome, outcome


def _data_dir_outcome(root: str, task: str, kind: str) -> tuple[str, str]:
  """config.task.data_dir of GLUE, NER and SWAG fine-tuning, as make_task reads it (no weights)."""
  from bert_jax import task_table  # pylint: disable=g-import-not-at-top
  config = config_files.load_config(task)
  path = os.path.join(root, 'data')
  if kind == 'a_file':
    open(path, 'w').close()
  elif kind in ('empty_folder', 'unreadable'):
    os.makedirs(path)
  if kind == 'unreadable':
    os.chmod(path, 0)
  config.task.data_dir = path
  with _as_a_user() if kind == 'unreadable' else contextlib.nullcontext():
    return path, _outcome(lambda: task_table.make_task(config, None, None, True))


DATA_DIR_ROWS = [
    (task, kind, expected)
    for task, empty in (('finetune_glue:mrpc', 'GLUE mrpc dev: no file'),
                        ('finetune_ner', 'no training file (train.txt)'),
                        ('finetune_swag', 'no train file (train.csv or train.jsonl)'))
    for kind, expected in (('missing', ': no such folder'), ('a_file', 'is a file, not a folder'),
                           ('unreadable', 'cannot be read (Permission denied)'),
                           ('empty_folder', empty))]


@pytest.mark.parametrize('task, kind, expected', DATA_DIR_ROWS,
                         ids=[f'{t.split(":")[0]}-{k}' for t, k, _ in DATA_DIR_ROWS])
def test_data_dir_paths(open_dir, task, kind, expected):
  path, outcome = _data_dir_outcome(open_dir, task, kind)
  assert expected in outcome and path in outcome, outcome


# Output paths: the command is called with everything else right but a missing checkpoint or
# input, checked after the output: 'ok' rows stop there (proving the output passed its check
# before any work), the others at the output, naming it. Each function prepares the rest in
# `root` and returns the call.
def _predict_output(root: str, kind: str = 'glue', source: str = 'in.jsonl'):
  from bert_jax import predict  # pylint: disable=g-import-not-at-top
  workdir = os.path.join(root, 'finetuned')  # Says what it is, holds no weights.
  os.makedirs(workdir, exist_ok=True)
  task = {'glue': 'mrpc', 'squad': 'squad_v1'}[kind]
  for name, value in (('task.json', {'kind': kind, 'task': task}), ('metrics.json', {}),
                      ('config.json', {'eval': {'batch_size': 8}})):
    fileio.write_json(os.path.join(workdir, name), value)
  with open(os.path.join(root, source), 'w') as f:
    f.write('{"text_a": "a"}\n')
  return lambda path: predict.predict(workdir, os.path.join(root, source), path)


def _features_output(root: str):
  with open(os.path.join(root, 'in.txt'), 'w') as f:
    f.write('a text\n')
  return lambda path: features.extract_features(os.path.join(root, 'no_checkpoint'),
                                                os.path.join(root, 'in.txt'), path)


def _vocab_output(root: str):
  return lambda path: vocab_lib.run([os.path.join(root, 'no_corpus', '*.txt')], path, 100)


def _convert_output(root: str):
  from bert_jax import convert  # pylint: disable=g-import-not-at-top
  return lambda path: convert.convert(os.path.join(root, 'no_checkpoint'), path)


@pytest.mark.parametrize('case, expected', [
    ('input_is_a_directory', '--input=$DIR/in.jsonl is a directory; name a file'),
    ('input_missing', '--input=$DIR/in.jsonl: no such file'),
    ('workdir_unreadable', '--workdir: $DIR/finetuned: cannot be read (Permission denied)'),
    ('workdir_is_a_file', '--workdir=$DIR/finetuned has no task.json: not a bert_jax'),
])
def test_predict_names_its_input_and_workdir(open_dir, case, expected):
  run = _predict_output(open_dir)
  workdir, source = os.path.join(open_dir, 'finetuned'), os.path.join(open_dir, 'in.jsonl')
  if case == 'input_is_a_directory':
    os.remove(source)
    os.makedirs(source)
  elif case == 'input_missing':
    os.remove(source)
  elif case == 'workdir_unreadable':
    os.chmod(workdir, 0)
  else:
    shutil.rmtree(workdir)
    open(workdir, 'w').close()
  with _as_a_user() if case == 'workdir_unreadable' else contextlib.nullcontext():
    outcome = _outcome(lambda: run(os.path.join(open_dir, 'out.jsonl')))
  assert expected.replace('$DIR', open_dir) in outcome, outcome


# surface -> (file name, the call, what an 'ok' row stops at).
OUTPUT_SURFACES = {
    'predict --output': ('out.jsonl', _predict_output, 'not a checkpoint directory'),
    'features --output': ('out.jsonl', _features_output, 'no such directory or TF checkpoint'),
    'vocab --output': ('vocab.txt', _vocab_output, 'matches no file'),
    'convert --output (a folder)': ('out', _convert_output, 'no such directory or TF checkpoint'),
}
OUTPUT_ROWS = [
    (surface, kind, expected)
    for surface in OUTPUT_SURFACES
    for kind, expected in [
        ('new', 'ok'), ('in_a_new_folder', 'ok'),
        ('existing', 'is not empty' if surface.startswith('convert') else 'ok'),
        ('directory' if not surface.startswith('convert') else 'a_file',
         'is a directory' if not surface.startswith('convert') else 'is a file, not a folder'),
        ('under_a_file', 'is a file, so no folder can be made there'),
        ('in_an_unwritable_folder', 'is not writable by this user')]]


def _output_outcome(root: str, surface: str, kind: str) -> tuple[str, str]:
  name, call, _ = OUTPUT_SURFACES[surface]
  path = os.path.join(root, 'outputs', name)
  os.makedirs(os.path.dirname(path))
  if kind == 'in_a_new_folder':
    path = os.path.join(root, 'outputs', 'new', name)
  elif kind == 'existing':
    if name == 'out':  # A folder with a file in it.
      os.makedirs(path)
    with open(path + ('/old' if name == 'out' else ''), 'w') as f:
      f.write('old')
  elif kind == 'directory':
    os.makedirs(path)
  elif kind == 'a_file':
    open(path, 'w').close()
  elif kind == 'under_a_file':
    open(os.path.join(root, 'outputs', 'file'), 'w').close()
    path = os.path.join(root, 'outputs', 'file', name)
  elif kind == 'in_an_unwritable_folder':
    os.chmod(os.path.dirname(path), 0o555)
  run = call(root)
  with _as_a_user() if kind == 'in_an_unwritable_folder' else contextlib.nullcontext():
    return path, _outcome(lambda: run(path))


@pytest.mark.parametrize('surface, kind, expected', OUTPUT_ROWS,
                         ids=[f'{s.split(" ")[0]}-{k}' for s, k, _ in OUTPUT_ROWS])
def test_output_paths(open_dir, surface, kind, expected):
  path, outcome = _output_outcome(open_dir, surface, kind)
  if expected == 'ok':
    assert OUTPUT_SURFACES[surface][2] in outcome and path not in outcome, outcome
  else:
    assert expected in outcome and path in outcome, outcome


# Outputs that are inputs: however the path is written (relative, a symlink, a hard link, a
# glob's match), a command never writes over what it reads. A workdir of another kind of run
# is refused before anything is written to it.
def _corpus(root: str) -> str:
  path = os.path.join(root, 'corpus.txt')
  with open(path, 'wb') as f:
    f.write(_corpus_text(30))
  return path


def _vocab_over(how: str):
  def run(root: str) -> tuple[str, str]:
    corpus = _corpus(root)
    output, inputs = corpus, [corpus]
    kind = 'wordpiece'
    if how == 'sentencepiece':  # --output=corpus writes corpus.model and corpus.vocab.
      corpus = os.path.join(root, 'corpus.vocab')
      os.rename(os.path.join(root, 'corpus.txt'), corpus)
      output, inputs, kind = os.path.join(root, 'corpus'), [corpus], 'sentencepiece'
    elif how == 'relative':
      output = os.path.relpath(corpus)
    elif how == 'symlink':
      output = os.path.join(root, 'link.txt')
      os.symlink(corpus, output)
    elif how == 'hard_link':
      output = os.path.join(root, 'hard.txt')
      os.link(corpus, output)
    elif how == 'glob':
      inputs = [os.path.join(root, '*.txt')]
    return corpus, _outcome(lambda: vocab_lib.run(inputs, output, 100, kind=kind))
  return run


def _predict_over(name: str):
  def run(root: str) -> tuple[str, str]:
    if name == 'nbest':  # SQuAD writes pred.nbest.json beside --output=pred.json.
      call = _predict_output(root, 'squad', 'pred.nbest.json')
      return os.path.join(root, 'pred.nbest.json'), _outcome(
          lambda: call(os.path.join(root, 'pred.json')))
    call = _predict_output(root)
    path = os.path.join(root, 'in.jsonl' if name == 'input' else 'finetuned/config.json')
    return path, _outcome(lambda: call(path))
  return run


def _features_over(what: str):
  def run(root: str) -> tuple[str, str]:
    path = os.path.join(root, 'in.jsonl')
    with open(path, 'w') as f:
      f.write('a text\n')
    checkpoint = os.path.join(root, 'checkpoint')  # Its files, no weights: refused before them.
    os.makedirs(checkpoint)
    open(os.path.join(checkpoint, 'vocab.txt'), 'w').close()
    output = path if what == 'input' else os.path.join(checkpoint, 'vocab.txt')
    return output, _outcome(lambda: features.extract_features(checkpoint, path, output))
  return run


def _convert_over(root: str) -> tuple[str, str]:
  from bert_jax import convert  # pylint: disable=g-import-not-at-top
  checkpoint = os.path.join(root, 'checkpoint')
  os.makedirs(checkpoint)
  open(os.path.join(checkpoint, 'bert_config.json'), 'w').close()
  return checkpoint, _outcome(lambda: convert.convert(checkpoint, checkpoint))


def _run_in_workdir_of(kind: str, command: str):
  def run(root: str) -> tuple[str, str]:
    from bert_jax import finetune  # pylint: disable=g-import-not-at-top
    workdir = os.path.join(root, 'work')
    os.makedirs(os.path.join(workdir, 'checkpoints'))
    record = {'task': 'mrpc'} if kind == 'fine-tuning' else {'model': {'size': 'tiny'}}
    if kind == 'sweep':  # A sweep's folder: sweep.json and lr_<rate>/, no config.json.
      record = {'task': 'mrpc', 'best_learning_rate': 5e-5}
      fileio.write_json(os.path.join(workdir, 'sweep.json'), record)
      before = sorted(os.listdir(workdir))
      outcome = _outcome(lambda: finetune.finetune(
          config_files.load_config('finetune_glue:mrpc'), workdir))
      if sorted(os.listdir(workdir)) != before:
        outcome = f'{sorted(set(os.listdir(workdir)) - set(before))} written; {outcome}'
      return workdir, outcome
    fileio.write_json(os.path.join(workdir, 'config.json'), record)
    glue = config_files.load_config('finetune_glue:mrpc')
    if command == 'pretrain':
      call = lambda: train.train_and_evaluate(config_files.load_config('smoke'), workdir)
    elif command == 'finetune':
      call = lambda: finetune.finetune(glue, workdir)
    else:
      call = lambda: finetune.sweep(glue, workdir)
    before = sorted(os.listdir(workdir))
    outcome = _outcome(call)
    if fileio.read_json(os.path.join(workdir, 'config.json')) != record:
      outcome = f'config.json rewritten; {outcome}'
    if sorted(os.listdir(workdir)) != before:
      outcome = f'{sorted(set(os.listdir(workdir)) - set(before))} written; {outcome}'
    return workdir, outcome
  return run


def _workdir_in_the_input_glob(command: str):
  def run(root: str) -> tuple[str, str]:
    _corpus(root)
    config = config_files.load_config('smoke', {'data.input': os.path.join(root, '*.txt')})
    if command == 'pretrain':
      call = lambda: train.train_and_evaluate(config, root)
    else:
      call = lambda: input_pipeline.resolve_vocab(config.data, root)
    outcome = _outcome(call)
    if os.path.exists(os.path.join(root, 'vocab.txt')):
      outcome = f'vocab.txt written; {outcome}'
    return os.path.join(root, '*.txt'), outcome
  return run


# case -> (what it does in a folder -> (the input at stake, outcome), what it prints).
OVER_AN_INPUT_ROWS = {
    'vocab --output = --input': (_vocab_over('same'),
                                 '--output=PATH is the input --input=PATH: writing it would '
                                 'replace the input'),
    'vocab --output = --input, relative': (_vocab_over('relative'), 'is the input --input=PATH'),
    'vocab --output = a symlink to --input': (_vocab_over('symlink'),
                                              'is the input --input=PATH, the same file'),
    'vocab --output = a hard link to --input': (_vocab_over('hard_link'),
                                                'is the input --input=PATH, the same file'),
    'vocab --output matched by the --input glob': (_vocab_over('glob'),
                                                   'is the input --input=PATH'),
    'predict --output = --input': (_predict_over('input'), '--output=PATH is the input --input'),
    "predict --output = the workdir's config.json": (
        _predict_over('workdir'),
        '--output=PATH is PATH, a file of the run in --workdir=ROOT/finetuned: writing it would '
        'replace it'),
    'vocab --kind=sentencepiece --output = the prefix of --input (its .vocab)': (
        _vocab_over('sentencepiece'), 'is the input --input=PATH'),
    "predict --output whose SQuAD n-best file beside it is --input": (
        _predict_over('nbest'),
        '--output=ROOT/pred.json (and PATH beside it) is the input --input=PATH: writing it '
        'would replace it'),
    'features --output = --input': (_features_over('input'),
                                    '--output=PATH is the input --input'),
    "features --output = the checkpoint's vocab.txt": (
        _features_over('checkpoint'),
        '--output=PATH: the name must end in .jsonl, .npz or .npy'),  # No checkpoint file does.
    'convert --output = --input (a folder, never written into unless empty)': (
        _convert_over, '--output=PATH: output directory exists and is not empty'),
    'pretrain --workdir where data.input=*.txt would read its vocab.txt': (
        _workdir_in_the_input_glob('pretrain'),
        "data.input: 'PATH' also matches ROOT/vocab.txt, which this run writes: its next read "
        'would take it as data; use a --workdir outside the input folder'),
    'data --workdir where data.input=*.txt would read its vocab.txt': (
        _workdir_in_the_input_glob('data'), "data.input: 'PATH' also matches ROOT/vocab.txt"),
    'pretrain --workdir of a fine-tuning run': (
        _run_in_workdir_of('fine-tuning', 'pretrain'),
        '--workdir=PATH holds a fine-tuning run (mrpc, its config.json): pre-train into another'),
    'finetune --workdir of a pre-training run': (
        _run_in_workdir_of('pre-training', 'finetune'),
        '--workdir=PATH holds a pre-training run (its config.json has no task): fine-tune into '
        'another --workdir; to start from that run, set --config.train.init_checkpoint=PATH'),
    'finetune --sweep --workdir of a pre-training run': (
        _run_in_workdir_of('pre-training', 'sweep'),
        '--workdir=PATH holds a pre-training run (its config.json has no task): fine-tune into '
        'another --workdir'),
    'finetune --workdir of a --sweep (sweep.json, lr_<rate>/)': (
        _run_in_workdir_of('sweep', 'finetune'),
        '--workdir=PATH holds a --sweep (its sweep.json): fine-tune into another --workdir'),
    'finetune --sweep --workdir of a single fine-tuning run': (
        _run_in_workdir_of('fine-tuning', 'sweep'),
        '--workdir=PATH holds a single fine-tuning run (its config.json): sweep into another'),
}


@pytest.mark.parametrize('case', list(OVER_AN_INPUT_ROWS))
def test_an_output_is_never_an_input(open_dir, case):
  run, expected = OVER_AN_INPUT_ROWS[case]
  path, outcome = run(open_dir)
  assert expected.replace('PATH', path).replace('ROOT', open_dir) in outcome, outcome
  assert 'rewritten' not in outcome and 'written;' not in outcome


# ---- Keys x bad values ------------------------------------------------------------------------

# (config, key, bad value): each must be refused with a message naming --config.KEY=VALUE.
_P, _F, _S = 'smoke', 'finetune_glue:mrpc', 'finetune_squad'
KEY_ROWS = [
    (_P, 'train.learning_rate', -1e-3), (_P, 'train.learning_rate', 0.0),
    (_F, 'train.learning_rate', float('nan')),
    (_P, 'train.weight_decay', -0.01), (_P, 'train.max_grad_norm', -1.0),
    (_P, 'train.warmup_steps', -1), (_F, 'train.warmup_proportion', 1.0),
    (_P, 'train.steps', 0), (_P, 'train.stop_at_step', -5), (_F, 'train.epochs', 0),
    (_P, 'train.batch_size', 0), (_F, 'train.batch_size', -32),
    (_P, 'train.grad_accum_steps', 0), (_F, 'train.length_sort_window', 0),
    (_P, 'train.beta1', 1.0), (_P, 'train.beta2', -0.1), (_P, 'train.eps', 0.0),
    (_P, 'train.seed', -1),
    (_P, 'model.hidden_dropout_prob', 1.0), (_F, 'model.attention_probs_dropout_prob', -0.1),
    (_P, 'model.vocab_size', -1), (_P, 'model.max_position_embeddings', 0),
    (_P, 'model.type_vocab_size', -1), (_P, 'model.intermediate_size', -1),
    (_P, 'model.rope_theta', 0.0), (_P, 'model.local_rope_theta', -1.0),
    (_P, 'model.local_attention_window', -2), (_P, 'model.global_attention_every', -1),
    (_P, 'data.masked_lm_prob', 0.0), (_P, 'data.masked_lm_prob', 1.0),
    (_P, 'data.short_seq_prob', 1.5), (_P, 'data.max_seq_length', 4),
    (_P, 'data.max_predictions_per_seq', 0), (_P, 'data.vocab_size', 0),
    (_P, 'data.packing_max_sequences', 0), (_P, 'data.packing_window', 0),
    (_P, 'data.shuffle_buffer', 0), (_P, 'data.docs_per_batch', 0), (_P, 'data.seed', -1),
    (_F, 'data.max_seq_length', 0), (_S, 'task.doc_stride', 0), (_S, 'task.max_query_length', 0),
    (_S, 'task.max_answer_length', 0), (_S, 'task.n_best_size', 0),
    (_P, 'mesh.data', 0), (_P, 'mesh.fsdp', -2), (_F, 'mesh.tensor', 0),
    (_P, 'checkpoint.every_steps', 0), (_F, 'checkpoint.every_steps', -1),
    (_P, 'checkpoint.keep', 0), (_P, 'checkpoint.push_every_steps', -1),
    (_F, 'checkpoint.push_every_steps', -2),
    (_P, 'eval.every_steps', 0), (_P, 'eval.steps', 0), (_P, 'eval.batch_size', 0),
    (_F, 'eval.batch_size', 0), (_P, 'log.every_steps', 0),
]


@pytest.mark.parametrize('config, key, value', KEY_ROWS,
                         ids=[f'{c.split(":")[0]}-{k}={v}' for c, k, v in KEY_ROWS])
def test_numeric_keys_out_of_range(config, key, value):
  with pytest.raises(UserError) as e:
    config_files.load_config(config, {key: value})
  assert str(e.value).startswith(f'--config.{key}={value!r}: must'), str(e.value)


@pytest.mark.parametrize('config, key, value', [
    (_F, 'checkpoint.every_steps', 0),  # Fine-tuning: only after each epoch.
    (_P, 'train.max_grad_norm', 0.0),  # No clipping.
    (_P, 'mesh.data', -1), (_P, 'model.attention_probs_dropout_prob', 0.0),
    (_P, 'train.warmup_steps', 0), (_P, 'model.vocab_size', 0),
    (_P, 'model.type_vocab_size', 0), (_P, 'model.intermediate_size', 0),
])
def test_edge_values_that_mean_something_are_accepted(config, key, value):
  config_files.load_config(config, {key: value})


_SHIPPED = ['smoke', 'default', 'bert_base', 'bert_large', 'bert_base_tpu_speed',
            'lamb_large_batch', 'finetune_glue:mrpc', 'finetune_squad', 'finetune_ner',
            'continue_pretraining']


def _numeric_keys(node, prefix=''):
  for k, v in node.items():
    if isinstance(v, ml_collections.ConfigDict):
      yield from _numeric_keys(v, f'{prefix}{k}.')
    elif isinstance(v, (int, float)) and not isinstance(v, bool):
      yield f'{prefix}{k}'


def test_every_numeric_key_of_every_shipped_config_has_a_row():
  # A new numeric key needs its range in config_checks.RANGES (and a row in KEY_ROWS).
  exempt = {'task.null_score_diff_threshold'}  # Any real number is a threshold.
  missing = set()
  for name in _SHIPPED:
    config = config_files.load_config(name)  # And each shipped config passes its own checks.
    missing |= set(_numeric_keys(config)) - set(config_checks.RANGES) - exempt
  assert not missing, f'keys without a range in config_checks.RANGES: {sorted(missing)}'
  assert set(config_checks.RANGES) <= {k for _, k, _ in KEY_ROWS}, \
      set(config_checks.RANGES) - {k for _, k, _ in KEY_ROWS}


# (config, overrides, what the message says): keys that are each in range but do not fit
# together; the message names every key involved.
CROSS_ROWS = [
    (_P, {'data.max_predictions_per_seq': 65},
     'data.max_predictions_per_seq=65 exceeds data.max_seq_length=64'),
    (_P, {'data.max_seq_length': 1024}, 'data.max_seq_length=1024 exceeds '
     'model.max_position_embeddings=512'),
    (_P, {'train.warmup_steps': 301}, 'train.warmup_steps=301 must lie in [0, train.steps=300]'),
    (_P, {'train.stop_at_step': 301}, 'train.stop_at_step=301 must lie in [1, train.steps=300]'),
    (_P, {'train.batch_size': 30, 'train.grad_accum_steps': 4},
     'train.batch_size=30 does not divide by train.grad_accum_steps=4'),
    (_F, {'train.batch_size': 30, 'train.grad_accum_steps': 4},
     'train.batch_size=30 does not divide by train.grad_accum_steps=4'),
    (_P, {'mesh.data': -1, 'mesh.fsdp': -1}, 'only one of mesh.data/fsdp/tensor may be -1'),
    (_P, {'mesh.data': 2, 'mesh.fsdp': 2, 'train.batch_size': 32, 'train.grad_accum_steps': 16},
     'micro-batch 2 (train.batch_size / train.grad_accum_steps) does not divide over 4 '
     'data-parallel shards (mesh.data=2 x mesh.fsdp=2)'),
    (_P, {'mesh.data': 4, 'eval.batch_size': 6},
     'eval.batch_size=6 must divide over the 4 data-parallel shards (mesh.data=4 x mesh.fsdp=1)'),
    (_F, {'mesh.data': 4, 'eval.batch_size': 6}, 'eval.batch_size=6 must divide over the 4'),
    (_P, {'train.phases': '0.5:64:10,0.6:128:20'}, 'train.phases fractions sum to 1.1, not 1'),
    (_P, {'train.phases': '0.5:64:10,0.5:128'}, "'0.5:128' is not fraction:seq_len:"),
    (_P, {'train.phases': '0.5:64:100,0.5:128:20'}, '1 <= max_predictions <= seq_len'),
    (_P, {'train.phases': '0.5:64:10,0.5:1024:20'},
     'train.phases: seq_len 1024 exceeds model.max_position_embeddings=512'),
    (_P, {'train.phases': '0.5:64:10,0.5:128:20', 'data.phase_inputs': 'a.tfrecord'},
     'data.phase_inputs has 1 entries separated by ";", train.phases has 2 phases'),
    (_P, {'train.phases': '0.5:64:10,0.5:128:20', 'data.phase_eval_inputs': 'a;b;c'},
     'data.phase_eval_inputs has 3 entries'),
    (_P, {'model.attention_impl': 'splash', 'model.attention_probs_dropout_prob': 0.0},
     "model.attention_impl='splash' needs sequence lengths that are multiples of 128; "
     'data.max_seq_length / train.phases give [64]'),
]


@pytest.mark.parametrize('config, overrides, expected', CROSS_ROWS,
                         ids=[f'{c.split(":")[0]}-{",".join(o)}' for c, o, _ in CROSS_ROWS])
def test_keys_that_do_not_fit_together(config, overrides, expected):
  outcome = _outcome(lambda: config_files.load_config(config, overrides))
  assert expected in outcome, outcome


@pytest.mark.parametrize('config, overrides', [
    (_P, {'data.max_predictions_per_seq': 64, 'train.warmup_steps': 300,
          'train.stop_at_step': 300}),
    (_P, {'mesh.data': 2, 'mesh.fsdp': 2, 'train.batch_size': 32, 'train.grad_accum_steps': 8,
          'eval.batch_size': 8}),
    (_P, {'train.phases': '0.5:64:10,0.5:128:20', 'data.phase_inputs': ';b.tfrecord'}),
    (_P, {'model.attention_impl': 'splash', 'data.max_seq_length': 128,
          'model.attention_probs_dropout_prob': 0.0}),
])
def test_keys_that_fit_together_at_their_limits_are_accepted(config, overrides):
  config_files.load_config(config, overrides)


# (config, categorical key, a value it does not take, what it prints): refused where the config
# loads, with the choices (it was a traceback, or came 10-28 s in, after JAX and the inputs).
CHOICE_ROWS = [
    (_P, 'model.dtype', 'fp16', "--config.model.dtype='fp16': expected one of auto, float32, "
     'bfloat16, float16'),
    (_F, 'model.dtype', 'bf16', "expected one of auto, float32, bfloat16, float16 (did you mean "
     "'bfloat16'?)"),
    (_P, 'model.size', 'bert-base', "--config.model.size='bert-base': expected one of tiny, "
     'mini, small, medium, base, large or L{2..12}_H{128,256,512,768}'),
    (_P, 'model.remat_policy', 'dot', "(did you mean 'dots'?)"),
    (_P, 'model.attention_impl', 'flash', "--config.model.attention_impl='flash': expected one "
     'of xla, cudnn, splash'),
    # A value that was removed says so and names its replacement (REMOVED_CHOICES).
    (_F, 'model.attention_impl', 'cudnn_varlen', "--config.model.attention_impl='cudnn_varlen' "
     "was removed: cuDNN's packed layout was slower than 'cudnn' at 128 and at 512 tokens on an "
     'H200 (README, "Attention"); use --config.model.attention_impl=cudnn'),
    (_P, 'data.objective', 'NSP', "--config.data.objective='NSP': expected one of nsp, sop, "
     'none'),
    (_P, 'train.optimizer', 'adam', "(did you mean 'adamw'?)"),
    (_F, 'train.decay', 'cosine', "--config.train.decay='cosine': expected one of linear, "
     'constant'),
    (_P, 'train.rng_impl', 'threefry', "(did you mean 'threefry2x32'?)"),
    (_F, 'task.data_source', 'csv', "--config.task.data_source='csv': expected one of tsv, "
     'tfds'),
]


@pytest.mark.parametrize('config, key, value, expected', CHOICE_ROWS,
                         ids=[f'{c.split(":")[0]}-{k}' for c, k, _, _ in CHOICE_ROWS])
def test_categorical_keys_take_only_their_values(config, key, value, expected):
  assert expected in _outcome(lambda: config_files.load_config(config, {key: value}))


# ---- Errors raised inside tf.data, and statistics that cannot be honest -----------------------


@pytest.fixture(scope='module')
def vocab_file(tmp_path_factory):
  path = tmp_path_factory.mktemp('vocab') / 'vocab.txt'
  path.write_bytes(_vocab_bytes())
  return str(path)


def _data(vocab_file, corpus, **overrides):
  data = defaults.pretrain().data
  data.vocab_file = vocab_file
  data.input = corpus
  data.shuffle_buffer = 10
  data.update(overrides)
  return data


def test_a_single_document_is_refused_before_the_first_batch(tmp_path, vocab_file):
  # Found at start-up by a bounded look, named by key and file: not inside tf.data, where it
  # stopped a running job with TensorFlow's lines and no name. A book-length document (many
  # pieces, documents.PIECE_BYTES each) is still one.
  one, book = tmp_path / 'one.txt', tmp_path / 'book.txt'
  one.write_bytes(_corpus_text(1))
  book.write_bytes(_corpus_text(1) * 1000)
  assert book.stat().st_size > 4 * documents.PIECE_BYTES
  for path in (one, book):
    for run in (lambda: input_inspect.compute_stats(_data(vocab_file, str(path)), 1, 4),
                lambda: input_inspect.show_examples(_data(vocab_file, str(path)), 2)):
      with pytest.raises(UserError, match=rf"^data.input='{path}' \(1 files: .*\) holds a "
                         "single document: objective 'nsp' needs at least two"):
        run()
  for objective in ('sop', 'none'):
    input_inspect.compute_stats(_data(vocab_file, str(book), objective=objective), 1, 4)
  assert errors.from_tensorflow(tf.errors.InvalidArgumentError(None, None, 'a bug')) is None
  assert cli.user_error_message(tf.errors.InvalidArgumentError(None, None, 'a bug')) is None


def test_a_long_document_beside_short_ones_makes_not_next_pairs(tmp_path, vocab_file):
  # Pieces of one book often fill a batch alone (their NotNext draws are dropped); the share
  # of NotNext stays near one half over the stream.
  corpus = tmp_path / 'books.txt'
  corpus.write_bytes(_corpus_text(1) * 1000 + b'\n' + _corpus_text(30))  # A 72 KB book.
  stats = input_inspect.compute_stats(_data(vocab_file, str(corpus)), 10, 32)
  assert 0.3 < stats['next_sentence_fraction'] < 0.6, stats
  assert stats['input']['documents_in_pieces'] == 1, stats  # The statistics say so.
  assert stats['input']['lines_cut'] == 0 and stats['input']['bytes'] > 2 * 8192, stats


def _eval_batches(data, batch_size=8):
  ds = input_pipeline.make_pretraining_dataset(data, batch_size=batch_size, seq_len=32,
                                               max_predictions=5, train=False)
  return list(ds.as_numpy_iterator())


@pytest.mark.parametrize('packing', [False, True])
def test_evaluation_without_not_next_pairs_is_refused(tmp_path, vocab_file, packing):
  one, many = tmp_path / 'one.txt', tmp_path / 'many.txt'
  one.write_bytes(_corpus_text(1) * 1)
  many.write_bytes(_corpus_text(40))
  # Long documents: one gives many IsNext pairs and no NotNext one.
  one.write_bytes(b'\n'.join([b' '.join(WORDS[(s + k) % 40].encode() for k in range(6))
                              for s in range(120)]) + b'\n')
  data = _data(vocab_file, str(many), eval_input=str(one), packing=packing)
  batches = _eval_batches(data)
  with pytest.raises(UserError, match=r"data.eval_input='.*one.txt': 0% of its \d+ evaluation "
                     'pairs are NotNext'):
    train.check_label_share(batches, data)
  data = _data(vocab_file, str(many), eval_input=str(many), packing=packing)
  train.check_label_share(_eval_batches(data), data)


def test_label_share_tolerance_follows_the_number_of_examples():
  data = defaults.pretrain().data
  def batch(labels):
    labels = np.asarray(labels, np.int32)
    return {'next_sentence_labels': labels, 'input_mask': np.ones((len(labels), 4), np.int32)}
  train.check_label_share([batch([1] * 7 + [0] * 3)], data)  # 10 examples: 70% is chance.
  with pytest.raises(UserError, match='70% of its 1000'):
    train.check_label_share([batch([1] * 700 + [0] * 300)], data)
  train.check_label_share([batch([1] * 530 + [0] * 470)], data)


# ---- End to end: one line on stderr, exit status 2 ---------------------------------------------


def _cli(args, cwd):
  env = dict(os.environ, PYTHONPATH=_ROOT, JAX_PLATFORMS='cpu')
  env.pop('BERT_JAX_TRACEBACK', None)
  return subprocess.run(processes.python(env) + ['-m', 'bert_jax.cli'] + args, cwd=cwd, env=env,
                        capture_output=True, text=True, timeout=600)


# `bert-jax CMD --help` as the console script runs it: `__main__` is the script, not cli.py
# (absl's own help listed `__main__`'s flags: none).
HELP_ROWS = [
    (['pretrain', '--help'], ['--config:', '--workdir:', '--coordinator_address:',
                              '--config.a.b=value overrides a key']),
    (['vocab', '--helpshort'], ['--input:', '--output:', '--vocab_size:', '--kind:']),
    (['fill-mask', '-h'], ['--checkpoint:', '--top_k:', '--[no]table:']),
]


@pytest.mark.parametrize('args, fragments', HELP_ROWS, ids=[a[0] for a, _ in HELP_ROWS])
def test_help_lists_the_commands_flags(tmp_path, args, fragments):
  env = dict(os.environ, PYTHONPATH=_ROOT, JAX_PLATFORMS='cpu')
  proc = subprocess.run(processes.python(env) + [  # Forked: as a fresh interpreter runs it.
      '-c', 'import sys; from bert_jax import cli; cli.main(["bert-jax"] + sys.argv[1:])'] + args,
      cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert proc.stdout.startswith(f'usage: bert-jax {args[0]} [--flags]'), proc.stdout
  for fragment in fragments:
    assert fragment in proc.stdout, (fragment, proc.stdout)


def _one_line(proc, command, *fragments):
  assert proc.returncode == 2, proc.stderr[-3000:]
  assert 'Traceback' not in proc.stderr, proc.stderr[-3000:]
  last = proc.stderr.strip().splitlines()[-1]
  assert last.startswith(f'bert-jax {command}: error: '), proc.stderr[-3000:]
  for fragment in fragments:
    assert fragment in last, (fragment, last)


def test_end_to_end_mistakes_are_one_line_and_status_2(tmp_path, vocab_file):
  one = tmp_path / 'one.txt'
  one.write_bytes(_corpus_text(1))
  # Found before the first step, by key and file, without TensorFlow's lines.
  for command in ('data', 'pretrain'):
    proc = _cli([command, f'--config.data.input={one}', f'--config.data.vocab_file={vocab_file}',
                 f'--workdir={tmp_path}/one_{command}'] + ['--stats=2'] * (command == 'data'),
                tmp_path)
    _one_line(proc, command, f"data.input='{one}'", 'holds a single document')
    assert '{{node' not in proc.stderr and 'step' not in proc.stderr.lower(), proc.stderr[-3000:]
  workdir_file = tmp_path / 'a_file'
  workdir_file.write_text('')
  _one_line(_cli(['pretrain', f'--workdir={workdir_file}',
                  f'--config.data.vocab_file={vocab_file}'], tmp_path),
            'pretrain', f'--workdir={workdir_file} is a file')
  _one_line(_cli(['data', f'--workdir={workdir_file}'], tmp_path),  # Its vocab.txt goes there.
            'data', f'--workdir={workdir_file} is a file')
  _one_line(_cli(['pretrain', '--config.train.learning_rate=-1e-3',
                  f'--workdir={tmp_path}/w'], tmp_path),
            'pretrain', '--config.train.learning_rate=-0.001: must be a number > 0')
  truncated = _make(tmp_path, 'truncated_gz')
  _one_line(_cli(['vocab', f'--input={truncated}', f'--output={tmp_path}/v.txt'], tmp_path),
            'vocab', f'--input: {truncated} is truncated')


def test_a_misspelt_task_is_refused_before_the_checkpoint_loads(tmp_path):
  from bert_jax import finetune  # pylint: disable=g-import-not-at-top
  config = config_files.load_config(_F, {'task.name': 'mrcp',
                                         'train.init_checkpoint': str(tmp_path / 'nowhere')})
  with pytest.raises(UserError, match=r"config.task.name='mrcp': expected a GLUE task"):
    finetune.finetune(config, str(tmp_path / 'w'))
  assert not os.path.exists(tmp_path / 'w')


@pytest.mark.parametrize('text, fragment', [
    ('the [MASK] ' * 450, '... (4,950 characters) is'),
    ('no mask ' * 600, '... (4,800 characters) has no [MASK]'),
    ('a short [MASK]', "'a short [MASK]' is"),
], ids=['long_with_masks', 'long_without_a_mask', 'short'])
def test_messages_quote_a_short_excerpt_of_long_texts(text, fragment, vocab_file):
  from bert_jax import fill_mask  # pylint: disable=g-import-not-at-top
  tok = tokenization.load_tokenizer(vocab_file)
  with pytest.raises(UserError) as e:
    fill_mask.encode_masked(tok, text, max_seq_length=4)
  assert fragment in str(e.value) and len(str(e.value)) < 250, str(e.value)


# ---- Names with glob characters: a file that exists as written is that file ---------------------


def _bracket_outcome(root: str, case: str) -> str:
  from bert_jax import pretrained  # pylint: disable=g-import-not-at-top
  for name in ('corpus[1].txt', 'corpus1.txt'):
    with open(os.path.join(root, name), 'wb') as f:
      f.write(_corpus_text(30))
  if case == 'data.input=corpus[1].txt':
    return str(_corpus_files(os.path.join(root, 'corpus[1].txt')))
  if case == 'vocab --input=corpus[1].txt':
    return str(vocab_lib.expand_patterns([os.path.join(root, 'corpus[1].txt')]))
  if case == 'data.input=corpus[0-9].txt (a glob)':
    return str(_corpus_files(os.path.join(root, 'corpus[0-9].txt')))
  # A Google checkpoint folder, beside 'ckpt1' with two checkpoints, which the name read as a
  # glob would match ("several TF checkpoints"). Remote: ram://, TensorFlow's in-memory
  # filesystem, which globs as gs:// does (fnmatch, where '[1]' is a class); named per test.
  base = f'ram://{os.path.basename(root)}' if 'ram://' in case else root
  for name, files in (('ckpt[1]', ['model.ckpt-5.index']),
                      ('ckpt1', ['model.ckpt-5.index', 'model.ckpt-6.index'])):
    fileio.gfile().makedirs(f'{base}/{name}')
    for file in ['bert_config.json'] + files:
      with fileio.gfile().GFile(f'{base}/{name}/{file}', 'w') as f:
        f.write('{}')  # An empty GFile is never made.
  folder = f'{base}/ckpt[1]'
  return str(pretrained.read_metadata(folder)['format'])


# case -> what it reads (ROOT: the folder).
BRACKET_ROWS = {
    'data.input=corpus[1].txt': "['ROOT/corpus[1].txt']",
    'vocab --input=corpus[1].txt': "['ROOT/corpus[1].txt']",
    'data.input=corpus[0-9].txt (a glob)': "['ROOT/corpus1.txt']",
    'convert --input=ckpt[1] (a Google checkpoint folder)': 'google',
    'convert --input=ram://.../ckpt[1] (remote, as gs://)': 'google',
}


@pytest.mark.parametrize('case', list(BRACKET_ROWS))
def test_a_name_with_brackets_is_that_file(open_dir, case):
  assert _bracket_outcome(open_dir, case) == BRACKET_ROWS[case].replace('ROOT', open_dir)


# ---- CoNLL tags outside the label list: the file, its line and where the list came from -------


def _conll_tag_outcome(root: str, case: str) -> tuple[str, str]:
  from bert_jax import task_table  # pylint: disable=g-import-not-at-top
  config = config_files.load_config('finetune_ner')
  config.task.data_dir = root
  dev = b'-DOCSTART- -X- O O\n\nPeter NNP B-NP B-PER\nsaid VBD B-VP O\n'
  if case == 'a train.txt tag outside config.task.label_list':
    config.task.label_list = ('O', 'B-PER', 'I-PER', 'B-MISC', 'I-MISC')
    path = os.path.join(root, 'train.txt')
  else:
    dev += b'\nBerlin NNP B-NP B-CITY\n'
    path = os.path.join(root, 'valid.txt')
  with open(os.path.join(root, 'train.txt'), 'wb') as f:
    f.write(_CONLL)
  with open(os.path.join(root, 'valid.txt'), 'wb') as f:
    f.write(dev)
  return path, _outcome(lambda: task_table.make_task(config, None, None, True))


CONLL_TAG_ROWS = {
    'a train.txt tag outside config.task.label_list':
        "PATH:3: tag 'B-ORG' is not in config.task.label_list (O, B-PER, I-PER, B-MISC, I-MISC): "
        'fix the tag, or set --config.task.label_list to every tag of the data',
    'a valid.txt tag outside the tags of train.txt':
        "PATH:6: tag 'B-CITY' is not in the tags of ROOT/train.txt, the label list while "
        'config.task.label_list is empty (O, B-PER, I-PER, B-ORG, I-ORG, B-LOC, I-LOC, B-MISC, '
        'I-MISC): fix the tag',
}


@pytest.mark.parametrize('case', list(CONLL_TAG_ROWS))
def test_a_tag_outside_the_label_list_names_file_and_line(open_dir, case):
  path, outcome = _conll_tag_outcome(open_dir, case)
  assert CONLL_TAG_ROWS[case].replace('PATH', path).replace('ROOT', open_dir) in outcome, outcome


# ---- Out of device memory: which key to lower ----------------------------------------------------


@pytest.mark.parametrize('command, advice', [
    ('pretrain', 'lower train.batch_size (or raise train.grad_accum_steps'),
    ('features', 'lower --batch_size or --max_seq_length'),
])
def test_out_of_memory_names_the_key_to_lower(monkeypatch, capsys, command, advice):
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  def allocate_too_much(name, args):  # XLA's own RESOURCE_EXHAUSTED, raised where a step runs.
    del name, args
    jnp.ones((2**43,), jnp.uint8).block_until_ready()
  monkeypatch.setattr(cli, '_run_command', allocate_too_much)
  with pytest.raises(SystemExit) as exit_status:
    cli.main(['bert-jax', command])
  assert exit_status.value.code == 2
  last = capsys.readouterr().err.strip().splitlines()[-1]
  assert last.startswith(f'bert-jax {command}: error: out of memory: the device could not '
                         'allocate 8.0 TiB (8,796,093,022,208 bytes): '), last
  assert last.endswith(advice) or advice in last, last


def test_cloud_storage_out_of_reach_is_one_line(tmp_path, monkeypatch):
  """convert --output=gs://... with nothing answering: the access check's retries end in a
  line naming the flag, not the client's RetryError two minutes later."""
  from bert_jax import convert  # pylint: disable=g-import-not-at-top
  from bert_jax import gcs  # pylint: disable=g-import-not-at-top
  monkeypatch.setenv('STORAGE_EMULATOR_HOST', 'http://127.0.0.1:1')  # Refuses connections.
  monkeypatch.setattr(gcs, 'CHECK_DEADLINE_S', 1.0)
  gcs.client.cache_clear()
  try:
    outcome = _outcome(lambda: convert.convert(str(tmp_path / 'ckpt'), 'gs://bucket/out'))
  finally:
    gcs.client.cache_clear()
  assert outcome.startswith('--output=gs://bucket/out: Cloud Storage cannot be reached '
                            '(Connection refused; retried for 1 s)'), outcome


# ---- The cache folder (the sample corpus, vocabularies trained without a workdir) -------------


def _cache_outcome(root: str, case: str, monkeypatch) -> tuple[str, str]:
  from bert_jax import sample_corpus  # pylint: disable=g-import-not-at-top
  monkeypatch.delenv('BERT_JAX_CACHE', raising=False)
  if case == 'read-only HOME':
    home = os.path.join(root, 'home')
    os.makedirs(home, mode=0o555)
    os.chmod(home, 0o555)
    monkeypatch.setenv('HOME', home)
    path = os.path.join(home, '.cache', 'bert-jax')
  else:
    path = os.path.join(root, 'cache')
    open(path, 'w').close()
    if case == 'BERT_JAX_CACHE under a file':
      path = os.path.join(path, 'sub')
    monkeypatch.setenv('BERT_JAX_CACHE', path)
  with _as_a_user() if case == 'read-only HOME' else contextlib.nullcontext():
    return path, _outcome(sample_corpus.sample_corpus_path)


CACHE_ROWS = {
    'BERT_JAX_CACHE a file': 'BERT_JAX_CACHE=PATH: cannot make this folder (a file is in the '
                             'way); set BERT_JAX_CACHE to a folder this user can write',
    'BERT_JAX_CACHE under a file': 'BERT_JAX_CACHE=PATH: cannot make this folder (a file is in '
                                   'the way)',
    'read-only HOME': 'the cache folder PATH: cannot make this folder (Permission denied); set '
                      'BERT_JAX_CACHE',
}


@pytest.mark.parametrize('case', list(CACHE_ROWS))
def test_a_cache_folder_that_cannot_be_made(open_dir, case, monkeypatch):
  path, outcome = _cache_outcome(open_dir, case, monkeypatch)
  assert CACHE_ROWS[case].replace('PATH', path) in outcome, outcome


# ---- Rows skipped as broken: a few are skipped, most of a file is a mistake --------------------


def _qqp(rows: int, malformed: int) -> bytes:
  lines = ['id\tqid1\tqid2\tquestion1\tquestion2\tis_duplicate']
  lines += [f'{i}\t1\t2\tQ{i}?\tP{i}?\t{i % 2}' if i >= malformed else f'{i}\tbroken row'
            for i in range(rows)]
  return ('\n'.join(lines) + '\n').encode()


def _squad(questions: int, off: int) -> bytes:
  qas = [{'id': f'q{i}', 'question': 'Where?',
          'answers': [{'text': 'on the mat', 'answer_start': 12 if i >= off else 3}]}
         for i in range(questions)]
  return json.dumps({'version': '1.1', 'data': [{'title': 't', 'paragraphs': [
      {'context': 'The cat sat on the mat.', 'qas': qas}]}]}).encode()


# case -> (file name, its bytes, the read, what it prints).
SKIPPED_ROWS = {
    'glue_qqp_1_of_200_malformed': ('QQP/train.tsv', _qqp(200, 1),
                                    lambda p: glue.read_task('qqp', '', 'train', path=p), 'ok'),
    'glue_qqp_2_of_200_malformed': ('QQP/train.tsv', _qqp(200, 2),
                                    lambda p: glue.read_task('qqp', '', 'train', path=p), 'ok'),
    'glue_qqp_90%_malformed': ('QQP/train.tsv', _qqp(100, 90),
                               lambda p: glue.read_task('qqp', '', 'train', path=p),
                               'PATH: 90 of 100 rows have the wrong number of columns (expected '
                               '6) (90%, more than the 1% skipped as broken): line 2, line 3,'),
    'glue_skip_malformed_on_a_broken_file': (
        'RTE/train.tsv', _qqp(10, 5),
        lambda p: glue.read_task('qqp', '', 'train', path=p, skip_malformed=True),
        'PATH: 5 of 10 rows have the wrong number of columns'),
    'squad_1_of_3_answers_off': ('train.json', _squad(3, 1),
                                 lambda p: squad.read_squad(p, is_training=True), 'ok'),
    'squad_every_answer_start_off': ('train.json', _squad(40, 40),
                                     lambda p: squad.read_squad(p, is_training=True),
                                     'PATH: 40 of 40 questions have no answer at their '
                                     'answer_start (100%, more than the 1% skipped as broken): '
                                     'q0 (data[0].paragraphs[0].qas[0]), q1'),
    'squad_every_answer_start_off_for_prediction': (
        'dev.json', _squad(3, 3), lambda p: squad.read_squad(p, is_training=False), 'ok'),
}


def _skipped_outcome(root: str, case: str) -> tuple[str, str]:
  name, data, read, _ = SKIPPED_ROWS[case]
  path = os.path.join(root, name)
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, 'wb') as f:
    f.write(data)
  return path, _outcome(lambda: read(path))


@pytest.mark.parametrize('case', list(SKIPPED_ROWS))
def test_skipping_most_of_a_file_is_refused(open_dir, case):
  path, outcome = _skipped_outcome(open_dir, case)
  expected = SKIPPED_ROWS[case][3]
  if expected == 'ok':
    assert outcome == 'ok', outcome
  else:
    assert expected.replace('PATH', path) in outcome, outcome


# ---- Steps that diverged: never kept as the last good checkpoint ------------------------------

# case -> (the metrics of steps 5, 6, ...; what the check says, None: nothing diverged).
DIVERGENCE_ROWS = {
    'fine': ([{'loss': 7.2, 'grad_norm': 1.5}, {'loss': 7.1, 'grad_norm': 1.4}], None),
    'loss_nan': ([{'loss': 7.2, 'grad_norm': 1.5}, {'loss': float('nan'), 'grad_norm': 1.4}],
                 'loss is nan (gradient norm 1.4) at step 6'),
    'loss_finite_but_absurd_grad_norm_inf': (
        [{'loss': 6.1e9, 'grad_norm': float('inf')}, {'loss': float('nan'), 'grad_norm': 0.0}],
        'loss is 6.1e+09 (gradient norm inf) at step 5'),
    'loss_fine_grad_norm_nan': ([{'loss': 7.0, 'grad_norm': float('nan')}],
                                'loss is 7 (gradient norm nan) at step 5'),
    'loss_absurd': ([{'loss': 2e4, 'grad_norm': 3.0}], 'loss is 2e+04 (gradient norm 3) at step 5'),
    'loss_inf_as_sum_and_count': ([{'loss': (float('inf'), 8.0)}], 'loss is inf at step 5'),
}


@pytest.mark.parametrize('case', list(DIVERGENCE_ROWS))
def test_a_diverged_step_is_named(case):
  from bert_jax import monitor  # pylint: disable=g-import-not-at-top
  metrics, expected = DIVERGENCE_ROWS[case]
  assert monitor.divergence(metrics, 5) == expected


# Pre-training from a checkpoint, and `bert-jax eval`, take data.lower_case (uncased by default):
# a checkpoint that records the other casing is refused; one guessed so is a warning.
# (layout, vocab, record, data.lower_case, what the check says)
CASING_CHECK_ROWS = [
    ('hf', 'cased', ('tokenizer_config.json', {'do_lower_case': False}), True,
     "train.init_checkpoint=PATH is cased (PATH/tokenizer_config.json do_lower_case), but "
     'data.lower_case=True: set --config.data.lower_case=False'),
    ('pretraining_workdir', 'uncased', ('config.json', {'data': {'lower_case': True}}), False,
     'train.init_checkpoint=PATH is uncased (PATH/config.json data.lower_case), but '
     'data.lower_case=False: set --config.data.lower_case=True'),
    ('google', 'cased', None, True, 'ok'),  # A guess: a warning.
    ('hf', 'uncased', ('tokenizer_config.json', {'do_lower_case': True}), True, 'ok'),
]


def _casing_check_outcome(root, layout, vocab, record, lower_case) -> tuple[str, str]:
  from bert_jax import pretrained  # pylint: disable=g-import-not-at-top
  path = _casing_checkpoint(root, layout, vocab, record)
  return path, _outcome(lambda: pretrained.check_casing(path, lower_case, 'train.init_checkpoint'))


@pytest.mark.parametrize('layout, vocab, record, lower_case, expected', CASING_CHECK_ROWS,
                         ids=[f'{r[0]}-{r[1]}-{r[3]}' for r in CASING_CHECK_ROWS])
def test_a_checkpoint_is_fed_text_cased_as_it_records(open_dir, layout, vocab, record,
                                                      lower_case, expected):
  path, outcome = _casing_check_outcome(open_dir, layout, vocab, record, lower_case)
  assert outcome == expected.replace('PATH', path), outcome


# ---- Config files: every mistake one line naming the file (and line) --------------------------

# case -> (the file's text, or a shipped name; what loading it prints).
CONFIG_FILE_ROWS = {
    'misspelt_key': ('from bert_jax import defaults\ndef get_config():\n'
                     '  c = defaults.pretrain()\n  c.train.stepz = 4\n  return c\n',
                     "PATH:4: c.train.stepz = 4: no key 'stepz': did you mean steps?"),
    'misspelt_group': ('from bert_jax import defaults\ndef get_config():\n'
                       '  c = defaults.pretrain()\n  c.trian = 4\n  return c\n',
                       "PATH:4: c.trian = 4: no key 'trian': did you mean train?"),
    'old_fine_tuning_key': ("from bert_jax import defaults\ndef get_config():\n"
                            "  c = defaults.finetune('mrpc')\n  c.lower_case = True\n"
                            "  return c\n", 'config.lower_case is now config.data.lower_case'),
    'no_get_config': ('X = 1\n', '--config=PATH defines no get_config()'),
    'returns_a_dict': ('def get_config():\n  return {"train": {"steps": 3}}\n',
                       '--config=PATH: get_config() returned a dict; it returns an '
                       'ml_collections.ConfigDict'),
    'returns_none': ('def get_config():\n  pass\n',
                     '--config=PATH: get_config() returned None (no return statement?)'),
    'not_python': ('def get_config(:\n', 'PATH:1: invalid syntax'),
    'an_argument_it_does_not_take': ('from bert_jax import defaults\ndef get_config():\n'
                                     '  return defaults.pretrain()\n:v2',
                                     "get_config() takes no argument; drop ':v2'"),
    'a_directory': (None, '--config=PATH is a directory'),
    'shipped_variant_misspelt': ('finetune_squad:v3',
                                 '--config=finetune_squad:v3: no such version; expected one of '
                                 'v1, v2'),
    'shipped_phase_misspelt': ('lamb_large_batch:phase3',
                               '--config=lamb_large_batch:phase3: no such phase'),
}


def _config_file_outcome(root: str, case: str) -> tuple[str, str]:
  text, _ = CONFIG_FILE_ROWS[case]
  path = os.path.join(root, 'my_config.py')
  if text is None:
    os.makedirs(path)
    arg = ''
  elif text.endswith('.py') or '\n' not in text:  # A shipped name.
    return text, _outcome(lambda: config_files.load_config(text))
  else:
    text, _, arg = text.partition('\n:')
    with open(path, 'w') as f:
      f.write(text)
  return path, _outcome(lambda: config_files.load_config(path + (f':{arg}' if arg else '')))


@pytest.mark.parametrize('case', list(CONFIG_FILE_ROWS))
def test_config_file_mistakes(open_dir, case):
  path, outcome = _config_file_outcome(open_dir, case)
  assert CONFIG_FILE_ROWS[case][1].replace('PATH', path) in outcome, outcome


# ---- Casing: the checkpoint's own record first, then its word pieces ---------------------------
#
# A wrong guess is silent: an uncased model read as cased turns "The" into [UNK]. What a
# checkpoint records (tokenizer_config.json do_lower_case, a training workdir's config.json
# data.lower_case) decides; only without a record are its word pieces counted, and a handful of
# odd symbols ('ℝ', which Google's uncased vocabulary holds, or 'Ⅰ') do not make it cased.

_LOWER_PIECES = [f'{w}{i}' for i in range(4) for w in ('the', 'quick', 'brown', 'fox', 'jump',
                                                      '##s', '##ed', 'over', 'lazy', 'dog')]
_LOWER_PIECES += [f'word{i}' for i in range(160)]
CASING_VOCABS = {
    'uncased': _LOWER_PIECES,
    'uncased_with_ℝ': _LOWER_PIECES + ['ℝ', '##ℝ', 'ℕ'],
    # Two pieces in 200 that lower-casing changes: odd symbols, not a cased vocabulary.
    'uncased_with_Ⅰ_Ω': _LOWER_PIECES + ['Ⅰ', '##Ω'],
    'cased': _LOWER_PIECES + [w.capitalize() for w in _LOWER_PIECES[:40]],
}
# layout -> the files that make it one (vocab.txt comes from the row).
_CASING_LAYOUTS = {
    'google': {'bert_config.json': '{}', 'bert_model.ckpt.index': ''},
    'hf': {'config.json': '{}', 'model.safetensors': ''},
    'pretraining_workdir': {'bert_config.json': '{}', 'checkpoints/1/x': ''},
    'finetuning_workdir': {'bert_config.json': '{}', 'checkpoints/1/x': ''},
}
# (layout, vocab, record, expected): record is a file's JSON, or None.
CASING_ROWS = [
    ('google', 'uncased', None, 'uncased: guessed from the word pieces of PATH/vocab.txt'),
    ('google', 'uncased_with_ℝ', None, 'uncased: guessed'),
    ('hf', 'uncased_with_ℝ', None, 'uncased: guessed'),
    ('google', 'uncased_with_Ⅰ_Ω', None, 'uncased: guessed'),
    ('google', 'cased', None, 'cased: guessed'),
    ('hf', 'cased', ('tokenizer_config.json', {'do_lower_case': True}),
     'uncased: PATH/tokenizer_config.json do_lower_case'),
    ('hf', 'uncased', ('tokenizer_config.json', {'do_lower_case': False}),
     'cased: PATH/tokenizer_config.json do_lower_case'),
    ('hf', 'cased', ('tokenizer_config.json', {'tokenizer_class': 'BertTokenizer'}),
     'cased: guessed'),
    ('pretraining_workdir', 'cased', ('config.json', {'data': {'lower_case': True}}),
     'uncased: PATH/config.json data.lower_case'),
    ('pretraining_workdir', 'uncased_with_ℝ', ('config.json', {'data': {'lower_case': False}}),
     'cased: PATH/config.json data.lower_case'),
    ('pretraining_workdir', 'uncased_with_ℝ', ('config.json', {'data': {}}), 'uncased: guessed'),
    ('finetuning_workdir', 'uncased', ('tokenizer_config.json', {'do_lower_case': False}),
     'cased: PATH/tokenizer_config.json do_lower_case'),
]


def _casing_checkpoint(root: str, layout: str, vocab: str, record) -> str:
  path = os.path.join(root, layout)
  vocab_text = '\n'.join(SPECIALS + CASING_VOCABS[vocab])
  files = dict(_CASING_LAYOUTS[layout], **{'vocab.txt': vocab_text})
  if record:
    files[record[0]] = json.dumps(record[1])
  for name, text in files.items():
    os.makedirs(os.path.dirname(os.path.join(path, name)), exist_ok=True)
    with open(os.path.join(path, name), 'w') as f:
      f.write(text)
  return path


def _casing_outcome(root: str, layout: str, vocab: str, record) -> tuple[str, str]:
  """(the checkpoint made, 'cased|uncased: where that came from')."""
  from bert_jax import pretrained  # pylint: disable=g-import-not-at-top
  path = _casing_checkpoint(root, layout, vocab, record)
  meta = pretrained.read_metadata(path)
  return path, f'{"uncased" if meta["lower_case"] else "cased"}: {meta["lower_case_from"]}'


@pytest.mark.parametrize('layout, vocab, record, expected', CASING_ROWS,
                         ids=[f'{l}-{v}-{r[0] if r else "no_record"}'
                              for l, v, r, _ in CASING_ROWS])
def test_casing_comes_from_the_record_before_the_word_pieces(open_dir, layout, vocab, record,
                                                            expected):
  path, outcome = _casing_outcome(open_dir, layout, vocab, record)
  assert outcome.startswith(expected.replace('PATH', path)), outcome


# ---- The table of what was tried and what each prints ------------------------------------------


def _first_line(text: str, root: str) -> str:
  return text.replace(root, '$DIR').split('\n', 1)[0].replace('|', '\\|')


def table() -> str:
  """Every row of the path and key tables above and the first line it prints now, as Markdown
  (`python3 tests/inputs_test.py`): the note that issue 21 asks for, regenerated, not copied."""
  base = tempfile.mkdtemp(prefix='bert_jax_inputs_')
  os.chmod(base, 0o755)
  lines = ['| Input | Case | Prints (first line; "ok": read, or passed the check) |',
           '|---|---|---|']
  count = iter(range(10**6))

  def root():
    path = os.path.join(base, str(next(count)))
    os.makedirs(path, mode=0o755)
    return path

  def row(surface, case, outcome_of):
    where = root()
    try:
      outcome = outcome_of(where)
    except Exception as e:  # pylint: disable=broad-except  (a bug: shown as one)
      outcome = f'BUG {type(e).__name__}: {e}'
    lines.append(f'| {surface} | {case} | {_first_line(outcome, where)} |')

  def corpus(reader, kind):
    def run(where):
      path = _make(pathlib.Path(where), kind)
      with _as_a_user() if kind == 'unreadable' else contextlib.nullcontext():
        return _outcome(lambda: reader(path))
    return run

  try:
    for name, reader in (('data.input', _corpus_files), ('vocab --input', _read_corpus_lines)):
      for kind, _ in CORPUS_ROWS:
        row(name, kind, corpus(reader, kind))
    for kind, _, _ in TFRECORD_ROWS:
      row('data.input (TFRecords)', kind, lambda where, k=kind: _tfrecord_outcome(where, k)[1])
    for surface, kind, _ in FILE_ROWS:
      row(surface, kind, lambda where, s=surface, k=kind: _file_outcome(where, s, k)[1])
    for task, kind, _ in DATA_DIR_ROWS:
      row(f'config.task.data_dir ({task})', kind,
          lambda where, t=task, k=kind: _data_dir_outcome(where, t, k)[1])
    for kind in CHECKPOINT_KINDS:
      row('train.init_checkpoint, --init_checkpoint, --checkpoint, convert --input', kind,
          lambda where, k=kind: _checkpoint_outcome(where, k)[1])
    for surface, kind, _ in OUTPUT_ROWS:
      row(surface, kind, lambda where, s=surface, k=kind: _output_outcome(where, s, k)[1])
    for case, (run, _) in OVER_AN_INPUT_ROWS.items():
      row('outputs and workdirs x inputs', case, lambda where, r=run: r(where)[1])
    for surface, kind, _ in WORKDIR_ROWS:
      row(surface, kind, lambda where, s=surface, k=kind: _workdir_outcome(where, s, k)[1])
    def cache(where, case):
      with pytest.MonkeyPatch.context() as patch:
        return _cache_outcome(where, case, patch)[1]
    for case in CACHE_ROWS:
      row('the cache folder (BERT_JAX_CACHE, ~/.cache/bert-jax)', case,
          lambda where, c=case: cache(where, c))
    for case in CONLL_TAG_ROWS:
      row('config.task.data_dir (CoNLL)', case,
          lambda where, c=case: _conll_tag_outcome(where, c)[1])
    for case in BRACKET_ROWS:
      row('file names with [ ]', case,
          lambda where, c=case: _outcome(lambda: _bracket_outcome(where, c)))
    for case, (metrics, _) in DIVERGENCE_ROWS.items():
      from bert_jax import monitor  # pylint: disable=g-import-not-at-top
      row('training steps 5, 6, ... (the check before a log or checkpoint)', case,
          lambda where, m=metrics: str(monitor.divergence(m, 5) or 'ok'))
    for case in SKIPPED_ROWS:
      row('config.task.data_dir, train_file (rows skipped)', case,
          lambda where, c=case: _skipped_outcome(where, c)[1])
    for layout, vocab, record, lower_case, _ in CASING_CHECK_ROWS:
      row(f'train.init_checkpoint / eval --checkpoint (a {layout}, vocab {vocab})',
          f'{record[0] + " " + json.dumps(record[1]) if record else "no record"}, '
          f'data.lower_case={lower_case}', lambda where, r=(layout, vocab, record, lower_case):
          _casing_check_outcome(where, *r)[1])
    for case in CONFIG_FILE_ROWS:
      row('--config', case, lambda where, c=case: _config_file_outcome(where, c)[1])
    for layout, vocab, record, _ in CASING_ROWS:
      said = f'{record[0]} {json.dumps(record[1])}' if record else 'no record'
      row(f'casing of a {layout}', f'vocab {vocab}, {said}',
          lambda where, l=layout, v=vocab, r=record: _casing_outcome(where, l, v, r)[1])
    for config, key, value in KEY_ROWS:
      row(f'--config={config}', f'{key}={value!r}', lambda where, c=config, k=key, v=value:
          _outcome(lambda: config_files.load_config(c, {k: v})))
    for config, key, value, _ in CHOICE_ROWS:
      row(f'--config={config}', f'{key}={value!r}', lambda where, c=config, k=key, v=value:
          _outcome(lambda: config_files.load_config(c, {k: v})))
    for config, overrides, _ in CROSS_ROWS:
      row(f'--config={config}', ' '.join(f'{k}={v!r}' for k, v in overrides.items()),
          lambda where, c=config, o=overrides: _outcome(lambda: config_files.load_config(c, o)))
  finally:
    for folder, dirs, _ in os.walk(base):
      for d in dirs:
        os.chmod(os.path.join(folder, d), 0o755)
    shutil.rmtree(base)
  return '\n'.join(lines)


if __name__ == '__main__':
  print(table())
