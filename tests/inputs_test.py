"""The input surface as tables: every kind of path a user gives x the ways it can be wrong, and
every numeric config key x values out of its range. Each row either works or is one UserError
naming the path or key (README, "Troubleshooting"); a new input or key is one more row.

Rows call the checking functions in-process; a few `bert-jax` subprocesses at the end prove the
end-to-end promise (one line on stderr, exit status 2, before step 1).
"""

import gzip
import os
import subprocess
import sys

import ml_collections
import numpy as np
import pytest
import tensorflow as tf

from bert_jax import cli
from bert_jax import config_files
from bert_jax import config_checks
from bert_jax import defaults
from bert_jax import documents
from bert_jax import errors
from bert_jax import fileio
from bert_jax import input_pipeline
from bert_jax import pairing
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


def _damage(data: bytes) -> bytes:
  middle = len(data) // 2
  return data[:middle] + bytes(b ^ 0x5A for b in data[middle:middle + 16]) + data[middle + 16:]


# ---- Path kinds x inputs ----------------------------------------------------------------------

# name -> how to make it at `path` (None: leave it missing).
_MAKERS = {
    'missing': None,
    'directory': lambda p: os.makedirs(p),
    'empty': lambda p: open(p, 'wb').close(),
    'binary': lambda p: open(p, 'wb').write(bytes(range(256)) * 4),
    'not_utf8': lambda p: open(p, 'wb').write(_corpus_text(30).replace(b'w1 ', b'\xff\xfe ')),
    'bom': lambda p: open(p, 'wb').write(b'\xef\xbb\xbf' + _corpus_text(30)),
    'crlf': lambda p: open(p, 'wb').write(_corpus_text(30, crlf=True)),
    'gz': lambda p: open(p, 'wb').write(_gzip(_corpus_text(30))),
    'truncated_gz': lambda p: open(p, 'wb').write(_half(_gzip(_corpus_text(300)))),
    'damaged_gz': lambda p: open(p, 'wb').write(_damage(_gzip(_corpus_text(300)))),
    'not_gzip_gz': lambda p: open(p, 'wb').write(_corpus_text(30)),
}


def _make(tmp_path, kind: str, suffix: str = '.txt') -> str:
  path = str(tmp_path / f'{kind}{".gz" if kind.endswith("gz") else suffix}')
  if _MAKERS[kind] is not None:
    _MAKERS[kind](path)
  return path


def _corpus_files(path):
  return documents.expand_files(path, 'data.input')


def _read_corpus_lines(path):
  return list(vocab_lib.read_lines([path]))


# (kind, expected): 'ok' or a fragment of the UserError, which must also name the path.
CORPUS_ROWS = [
    ('missing', 'matches no file'),
    ('directory', 'is a directory; name the files in it'),
    ('empty', 'ok'),  # Refused later, by the pipeline's "no documents" (input_pipeline_test).
    ('binary', 'ok'),  # Invalid UTF-8 becomes U+FFFD, as documents.py promises.
    ('not_utf8', 'ok'),
    ('bom', 'ok'),
    ('crlf', 'ok'),
    ('gz', 'ok'),
    ('truncated_gz', 'is truncated: its compressed data stops unfinished at byte'),
    ('damaged_gz', 'is damaged near compressed byte'),
    ('not_gzip_gz', 'is not gzip data, though its name ends in .gz'),
]


@pytest.mark.parametrize('reader', [_corpus_files, _read_corpus_lines],
                         ids=['data.input', 'vocab --input'])
@pytest.mark.parametrize('kind, expected', CORPUS_ROWS, ids=[r[0] for r in CORPUS_ROWS])
def test_corpus_paths(tmp_path, reader, kind, expected):
  path = _make(tmp_path, kind)
  if expected == 'ok':
    reader(path)
    return
  with pytest.raises(UserError) as e:
    reader(path)
  assert expected in str(e.value) and os.path.basename(path) in str(e.value), str(e.value)


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
    ('empty', 'lacks special tokens'),
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


WORKDIR_ROWS = [
    ('new', 'ok'),
    ('existing', 'ok'),
    ('file', 'is a file, not a folder'),
    ('under_a_file', 'cannot create this folder'),
    ('unwritable', 'not writable'),
]


@pytest.mark.parametrize('kind, expected', WORKDIR_ROWS, ids=[r[0] for r in WORKDIR_ROWS])
def test_workdir_paths(tmp_path, kind, expected):
  path = str(tmp_path / 'work')
  if kind == 'existing':
    os.makedirs(path)
  elif kind == 'file':
    open(path, 'w').close()
  elif kind == 'under_a_file':
    open(path, 'w').close()
    path += '/run'
  elif kind == 'unwritable':
    if _AS_ROOT:
      pytest.skip('root writes anywhere')
    os.makedirs(path, mode=0o500)
  if expected == 'ok':
    fileio.make_dirs(path, '--workdir')
    assert os.path.isdir(path)
    return
  with pytest.raises(UserError, match=f'--workdir={path}') as e:
    fileio.make_dirs(path, '--workdir')
  assert expected in str(e.value)


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
    (_P, 'model.type_vocab_size', 0),
    (_P, 'data.masked_lm_prob', 0.0), (_P, 'data.masked_lm_prob', 1.0),
    (_P, 'data.short_seq_prob', 1.5), (_P, 'data.max_seq_length', 4),
    (_P, 'data.max_predictions_per_seq', 0), (_P, 'data.vocab_size', 0),
    (_P, 'data.packing_max_sequences', 0), (_P, 'data.packing_window', 0),
    (_P, 'data.shuffle_buffer', 0), (_P, 'data.docs_per_batch', 0), (_P, 'data.seed', -1),
    (_F, 'data.max_seq_length', 0), (_S, 'doc_stride', 0), (_S, 'max_query_length', 0),
    (_S, 'max_answer_length', 0), (_S, 'n_best_size', 0),
    (_P, 'mesh.data', 0), (_P, 'mesh.fsdp', -2), (_F, 'mesh.tensor', 0),
    (_P, 'checkpoint.every_steps', 0), (_F, 'checkpoint.every_steps', -1),
    (_P, 'checkpoint.keep', 0),
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
])
def test_edge_values_that_mean_something_are_accepted(config, key, value):
  config_files.load_config(config, {key: value})


_SHIPPED = ['smoke', 'default', 'bert_base', 'bert_large', 'bert_base_tpu_speed',
            'lamb_large_batch', 'finetune_glue:mrpc', 'finetune_squad', 'finetune_ner']


def _numeric_keys(node, prefix=''):
  for k, v in node.items():
    if isinstance(v, ml_collections.ConfigDict):
      yield from _numeric_keys(v, f'{prefix}{k}.')
    elif isinstance(v, (int, float)) and not isinstance(v, bool):
      yield f'{prefix}{k}'


def test_every_numeric_key_of_every_shipped_config_has_a_row():
  # A new numeric key needs its range in config_checks.RANGES (and a row in KEY_ROWS).
  exempt = {'null_score_diff_threshold'}  # Any real number is a threshold.
  missing = set()
  for name in _SHIPPED:
    config = config_files.load_config(name)  # And each shipped config passes its own checks.
    missing |= set(_numeric_keys(config)) - set(config_checks.RANGES) - exempt
  assert not missing, f'keys without a range in config_checks.RANGES: {sorted(missing)}'
  assert set(config_checks.RANGES) <= {k for _, k, _ in KEY_ROWS}, \
      set(config_checks.RANGES) - {k for _, k, _ in KEY_ROWS}


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


def test_a_single_document_is_the_pipelines_own_user_error(tmp_path, vocab_file):
  one = tmp_path / 'one.txt'
  one.write_bytes(_corpus_text(1))
  for run in (lambda: input_pipeline.compute_stats(_data(vocab_file, str(one)), 1, 4),
              lambda: input_pipeline.show_examples(_data(vocab_file, str(one)), 2)):
    with pytest.raises(tf.errors.InvalidArgumentError) as e:
      run()
    carried = errors.from_tensorflow(e.value)
    assert isinstance(carried, UserError)
    assert str(carried) == pairing.NOT_ENOUGH_DOCUMENTS[len(errors.IN_GRAPH_MARK):]
    assert cli.user_error_message(e.value) == str(carried)
  assert errors.from_tensorflow(tf.errors.InvalidArgumentError(None, None, 'a bug')) is None
  assert cli.user_error_message(tf.errors.InvalidArgumentError(None, None, 'a bug')) is None


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
  return subprocess.run([sys.executable, '-m', 'bert_jax.cli'] + args, cwd=cwd, env=env,
                        capture_output=True, text=True, timeout=600)


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
  _one_line(_cli(['data', '--stats=2', f'--config.data.input={one}',
                  f'--config.data.vocab_file={vocab_file}'], tmp_path),
            'data', 'needs at least two different documents')
  workdir_file = tmp_path / 'a_file'
  workdir_file.write_text('')
  _one_line(_cli(['pretrain', f'--workdir={workdir_file}',
                  f'--config.data.vocab_file={vocab_file}'], tmp_path),
            'pretrain', f'--workdir={workdir_file} is a file')
  _one_line(_cli(['pretrain', '--config.train.learning_rate=-1e-3',
                  f'--workdir={tmp_path}/w'], tmp_path),
            'pretrain', '--config.train.learning_rate=-0.001: must be a number > 0')
  truncated = _make(tmp_path, 'truncated_gz')
  _one_line(_cli(['vocab', f'--input={truncated}', f'--output={tmp_path}/v.txt'], tmp_path),
            'vocab', f'--input: {truncated} is truncated')


def test_a_misspelt_task_is_refused_before_the_checkpoint_loads(tmp_path):
  from bert_jax import finetune  # pylint: disable=g-import-not-at-top
  config = config_files.load_config(_F, {'task': 'mrcp', 'train.init_checkpoint': str(tmp_path / 'nowhere')})
  with pytest.raises(UserError, match=r"config.task='mrcp': expected a GLUE task"):
    finetune.finetune(config, str(tmp_path / 'w'))
  assert not os.path.exists(tmp_path / 'w')


@pytest.mark.parametrize('text, fragment', [
    ('the [MASK] ' * 450, '... (4,950 characters) is'),
    ('no mask ' * 600, '... (4,800 characters) has no [MASK]'),
    ('a short [MASK]', "'a short [MASK]' is"),
])
def test_messages_quote_a_short_excerpt_of_long_texts(text, fragment, vocab_file):
  from bert_jax import fill_mask  # pylint: disable=g-import-not-at-top
  tok = tokenization.load_tokenizer(vocab_file)
  with pytest.raises(UserError) as e:
    fill_mask.encode_masked(tok, text, max_seq_length=4)
  assert fragment in str(e.value) and len(str(e.value)) < 250, str(e.value)
