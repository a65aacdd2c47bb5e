"""Tests for bert_jax.glue on tiny files laid out like download_glue_data.py's output."""

import logging
import os
import string

import numpy as np
import pytest

from bert_jax import batching
from bert_jax import glue
from bert_jax import tokenization
from bert_jax.errors import UserError

_WORDS = ['the', 'cat', 'dog', 'sat', 'on', 'mat', 'is', 'a', 'not', 'good', 'movie']


@pytest.fixture(scope='module')
def tok(tmp_path_factory):
  # Every lower-case ASCII word tokenizes (single letters and ## letters), so texts need no
  # real vocabulary.
  vocab = (['[PAD]', '[UNK]', '[CLS]', '[SEP]', '[MASK]'] + list(string.punctuation) +
           list(string.ascii_lowercase) + ['##' + c for c in string.ascii_lowercase] +
           list(string.digits) + ['##' + c for c in string.digits] +
           [w for w in _WORDS if len(w) > 1])
  path = tmp_path_factory.mktemp('vocab') / 'vocab.txt'
  path.write_text('\n'.join(vocab) + '\n')
  return tokenization.load_tokenizer(str(path), lower_case=True)


def _write(root, relpath, lines, bom=False):
  path = os.path.join(root, relpath)
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, 'w', encoding='utf-8-sig' if bom else 'utf-8') as f:
    f.write(''.join(line + '\n' for line in lines))
  return path


def _mnli_row(i, a, b, label=None, dev=False):
  parses = ['(x)'] * 4
  row = [str(i), '31193', f'{i}n', 'fiction'] + parses + [a, b]
  if label is not None:
    row += [label] * (5 if dev else 1) + [label]
  return '\t'.join(row)


_MNLI_HEADER = ('index\tpromptID\tpairID\tgenre\tsentence1_binary_parse\t'
                'sentence2_binary_parse\tsentence1_parse\tsentence2_parse\tsentence1\t'
                'sentence2')


@pytest.fixture
def glue_dir(tmp_path):
  root = str(tmp_path)
  _write(root, 'CoLA/train.tsv', ['gj04\t1\t\tThe cat sat.', 'gj04\t0\t*\tCat the sat.'])
  _write(root, 'CoLA/dev.tsv', ['gj04\t1\t\tA dog sat.'])
  _write(root, 'CoLA/test.tsv', ['index\tsentence', '0\tThe dog sat.', '1\tSat dog.'])
  _write(root, 'SST-2/train.tsv', ['sentence\tlabel', 'a good movie \t1', 'not good \t0'])
  _write(root, 'SST-2/test.tsv', ['index\tsentence', '0\tgood'])
  mrpc = 'Quality\t#1 ID\t#2 ID\t#1 String\t#2 String'
  _write(root, 'MRPC/train.tsv', [mrpc, '1\t702876\t702977\tThe cat sat.\tA cat sat.'], bom=True)
  _write(root, 'MRPC/test.tsv', ['index\t#1 ID\t#2 ID\t#1 String\t#2 String',
                                 '0\t1089874\t1089925\tThe "dog".\tA dog.'])
  sts = 'index\tgenre\tfilename\tyear\told_index\tsource1\tsource2\tsentence1\tsentence2'
  _write(root, 'STS-B/train.tsv', [sts + '\tscore',
                                   '0\tmain-captions\tMSRvid\t2012test\t0001\tnone\tnone\t'
                                   'A cat sat.\tThe cat sat.\t4.750'])
  _write(root, 'STS-B/test.tsv', [sts, '0\tmain-news\theadlines\t2015\t0001\tnone\tnone\tA.\tB.'])
  _write(root, 'QQP/train.tsv', [
      'id\tqid1\tqid2\tquestion1\tquestion2\tis_duplicate',
      '0\t1\t2\tIs the cat good?\tIs a cat good?\t1',
      '1\t3\t4\tbroken row with a newline',  # Malformed, as in the released file.
      '2\t5\t6\tWhat is a mat?\tWhat is a dog?\t0'])
  _write(root, 'QQP/test.tsv', ['id\tquestion1\tquestion2', '0\tWhy?\tHow?'])
  _write(root, 'MNLI/train.tsv', [_MNLI_HEADER + '\tlabel1\tgold_label',
                                  _mnli_row(0, 'The cat sat.', 'A cat sat.', 'entailment')])
  dev_header = _MNLI_HEADER + '\tlabel1\tlabel2\tlabel3\tlabel4\tlabel5\tgold_label'
  _write(root, 'MNLI/dev_matched.tsv', [dev_header, _mnli_row(0, 'A.', 'B.', 'neutral', True)])
  _write(root, 'MNLI/dev_mismatched.tsv', [dev_header,
                                           _mnli_row(0, 'C.', 'D.', 'contradiction', True)])
  _write(root, 'MNLI/test_matched.tsv', [_MNLI_HEADER, _mnli_row(0, 'E.', 'F.')])
  _write(root, 'MNLI/test_mismatched.tsv', [_MNLI_HEADER, _mnli_row(0, 'G.', 'H.')])
  _write(root, 'QNLI/dev.tsv', ['index\tquestion\tsentence\tlabel',
                                '0\tWho sat?\tThe cat sat.\tentailment'])
  _write(root, 'RTE/train.tsv', ['index\tsentence1\tsentence2\tlabel',
                                 '0\tThe cat sat.\tA dog sat.\tnot_entailment'])
  _write(root, 'WNLI/train.tsv', ['index\tsentence1\tsentence2\tlabel', '0\tIt sat.\tA sat.\t1'])
  _write(root, 'diagnostic/diagnostic.tsv', ['index\tsentence1\tsentence2', '0\tA.\tB.'])
  return root


def test_reads_every_task_layout(glue_dir, caplog):
  cola = glue.read_task('cola', glue_dir, 'train')
  assert [(e.text_a, e.text_b, e.label) for e in cola] == [('The cat sat.', None, '1'),
                                                           ('Cat the sat.', None, '0')]
  assert glue.read_task('CoLA', glue_dir, 'test')[1] == glue.Example('test-1', 'Sat dog.', None,
                                                                     None)
  assert glue.read_task('SST-2', glue_dir, 'train')[0].text_a == 'a good movie '
  mrpc = glue.read_task('mrpc', glue_dir, 'train')[0]  # Header with a byte-order mark.
  assert (mrpc.text_a, mrpc.text_b, mrpc.label) == ('The cat sat.', 'A cat sat.', '1')
  assert glue.read_task('mrpc', glue_dir, 'test')[0].text_a == 'The "dog".'  # Quotes literal.
  assert glue.read_task('sts-b', glue_dir, 'train')[0].label == pytest.approx(4.75)
  assert glue.read_task('stsb', glue_dir, 'test')[0].label is None
  with caplog.at_level(logging.WARNING):
    qqp = glue.read_task('qqp', glue_dir, 'train')
  assert [e.label for e in qqp] == ['1', '0'] and [e.guid for e in qqp] == ['train-0', 'train-2']
  assert 'skipped 1 malformed rows' in caplog.text and 'lines [3]' in caplog.text
  assert glue.read_task('mnli', glue_dir, 'train')[0].label == 'entailment'
  assert glue.read_task('mnli', glue_dir, 'dev')[0].label == 'neutral'  # 'dev' = matched.
  assert glue.read_task('mnli', glue_dir, 'dev_mismatched')[0].label == 'contradiction'
  assert glue.read_task('mnli', glue_dir, 'test_mismatched')[0].text_a == 'G.'
  assert glue.read_task('qnli', glue_dir, 'validation')[0].text_b == 'The cat sat.'
  assert glue.read_task('rte', glue_dir, 'train')[0].label == 'not_entailment'
  assert glue.read_task('wnli', glue_dir, 'train')[0].label == '1'
  assert glue.read_task('ax', glue_dir, 'test')[0].text_b == 'B.'


def test_task_info_labels():
  assert glue.task_info('mnli') == (['contradiction', 'entailment', 'neutral'], ('accuracy',))
  assert glue.task_info('rte')[0] == ['entailment', 'not_entailment']
  assert glue.task_info('qnli')[0] == ['entailment', 'not_entailment']
  for task in ('mrpc', 'qqp', 'sst2', 'cola', 'wnli'):
    assert glue.task_info(task)[0] == ['0', '1']
  assert glue.task_info('stsb') == (None, ('pearson', 'spearman', 'pearson_and_spearman'))


def test_bad_input_errors_name_file_and_line(glue_dir):
  with pytest.raises(UserError, match=r'QNLI/train.tsv'):
    glue.read_task('qnli', glue_dir, 'train')
  with pytest.raises(ValueError, match='no split'):
    glue.read_task('rte', glue_dir, 'dev_matched')
  _write(glue_dir, 'RTE/dev.tsv', [])
  with pytest.raises(ValueError, match=r'RTE/dev.tsv: empty file'):
    glue.read_task('rte', glue_dir, 'dev')
  _write(glue_dir, 'RTE/dev.tsv', ['index\tsentence1\tsentence2\tlabel'])
  with pytest.raises(ValueError, match=r'RTE/dev.tsv: no examples'):
    glue.read_task('rte', glue_dir, 'dev')
  _write(glue_dir, 'RTE/dev.tsv', ['index\tsentence1\tsentence2\tlabel', '0\ta\tb\tentailment',
                                   '1\ta\tb\tmaybe'])
  with pytest.raises(ValueError, match=r"RTE/dev.tsv:3: unknown label 'maybe'"):
    glue.read_task('rte', glue_dir, 'dev')
  _write(glue_dir, 'RTE/dev.tsv', ['index\tsentence1\tsentence2\tlabel', '0\ta\tentailment'])
  with pytest.raises(ValueError, match=r'RTE/dev.tsv:2: expected 4 tab-separated columns'):
    glue.read_task('rte', glue_dir, 'dev')
  assert glue.read_task('rte', glue_dir, 'train', skip_malformed=True)
  _write(glue_dir, 'RTE/dev.tsv', ['index\tpremise\tsentence2\tlabel', '0\ta\tb\tentailment'])
  with pytest.raises(ValueError, match=r"RTE/dev.tsv: header \(line 1\) has no column "
                     "'sentence1'"):
    glue.read_task('rte', glue_dir, 'dev')
  _write(glue_dir, 'STS-B/dev.tsv', ['index\tsentence1\tsentence2\tscore', '0\ta\tb\thigh'])
  with pytest.raises(ValueError, match=r"STS-B/dev.tsv:2: score 'high'"):
    glue.read_task('stsb', glue_dir, 'dev')
  with pytest.raises(ValueError, match='unknown GLUE task'):
    glue.read_task('squad', glue_dir, 'train')


def test_convert_pair_layout_and_padding(tok):
  examples = [glue.Example('x', 'The cat sat.', 'A dog.', 'entailment'),
              glue.Example('y', 'Good', None, None)]
  f = glue.convert_examples(examples, tok, 12, ['entailment', 'not_entailment'])
  assert tok.decode(f['input_ids'][0]) == ['[CLS]', 'the', 'cat', 'sat', '.', '[SEP]', 'a',
                                           'dog', '.', '[SEP]', '[PAD]', '[PAD]']
  np.testing.assert_array_equal(f['segment_ids'][0], [0] * 6 + [1] * 4 + [0] * 2)
  np.testing.assert_array_equal(f['input_mask'][0], [1] * 10 + [0] * 2)
  assert tok.decode(f['input_ids'][1][:4]) == ['[CLS]', 'good', '[SEP]', '[PAD]']
  np.testing.assert_array_equal(f['label'], [0, -1])
  assert f['label'].dtype == np.int32 and f['input_ids'].dtype == np.int32
  np.testing.assert_array_equal(f['example_index'], [0, 1])
  reg = glue.convert_examples([glue.Example('z', 'a', 'b', 3.2),
                               glue.Example('t', 'a', 'b', None)], tok, 8, None)
  assert reg['label'].dtype == np.float32 and reg['label'][0] == pytest.approx(3.2)
  assert np.isnan(reg['label'][1])
  with pytest.raises(ValueError, match="label 'maybe'"):
    glue.convert_examples([glue.Example('w', 'a', 'b', 'maybe')], tok, 8, ['0', '1'])


def test_truncation_pops_the_longer_side_from_the_end(tok, caplog):
  # 'a'..'j' are ten one-piece tokens; 'k l m n' four. Budget 12 - 3 = 9: a keeps five.
  example = glue.Example('t', 'a b c d e f g h i j', 'k l m n', '1')
  with caplog.at_level(logging.WARNING):
    f = glue.convert_examples([example], tok, 12, ['0', '1'])
  assert tok.decode(f['input_ids'][0]) == ['[CLS]', 'a', 'b', 'c', 'd', 'e', '[SEP]', 'k', 'l',
                                           'm', 'n', '[SEP]']
  assert 'truncated 1 of 1 examples' in caplog.text
  a, b = list('abcdefg'), list('xyz')
  assert glue.truncate_seq_pair(a, b, 6) and (a, b) == (list('abc'), list('xyz'))
  a, b = list('ab'), list('xyz')
  assert not glue.truncate_seq_pair(a, b, 6)
  a, b = list('ab'), list('vwxyz')  # Ties pop from b (the original pops b when not a > b).
  assert glue.truncate_seq_pair(a, b, 4) and (a, b) == (list('ab'), list('vw'))


def _random_features(n, seq_len, seed=0):
  rng = np.random.default_rng(seed)
  lengths = np.minimum(rng.geometric(1 / 20, n) + 2, seq_len)  # Mostly short, a long tail.
  mask = (np.arange(seq_len)[None] < lengths[:, None]).astype(np.int32)
  return {'input_ids': mask * 7, 'input_mask': mask, 'segment_ids': np.zeros_like(mask),
          'label': rng.integers(0, 3, n).astype(np.int32),
          'example_index': np.arange(n, dtype=np.int32), 'notes': ['kept out'] * n}


def test_bucket_batches_cover_every_example_once_at_the_smallest_bucket():
  features = _random_features(1000, 128)
  seen = []
  shapes = set()
  for batch in batching.bucket_batches(features, 32, (32, 64, 128), shuffle=True, seed=3,
                                   window_batches=4):
    assert 'notes' not in batch
    length = batch['input_ids'].shape[1]
    real = features['input_mask'][batch['example_index']].sum(1)
    # The smallest bucket holding the batch's longest example, and nothing real was cut.
    assert length == min(b for b in (32, 64, 128) if b >= real.max())
    np.testing.assert_array_equal(batch['input_mask'].sum(1), real)
    np.testing.assert_array_equal(batch['label'], features['label'][batch['example_index']])
    seen.extend(batch['example_index'].tolist())
    shapes.add(batch['input_ids'].shape)
  assert sorted(seen) == list(range(1000))
  assert {s[1] for s in shapes} == {32, 64, 128}
  assert len([s for s in shapes if s[0] != 32]) <= 1  # Only the last batch is short.


def test_bucket_batches_shuffle_is_seeded_and_drop_remainder():
  features = _random_features(200, 64)

  def order(**kw):
    return np.concatenate([b['example_index'] for b in batching.bucket_batches(features, 16, **kw)])

  np.testing.assert_array_equal(order(shuffle=True, seed=1), order(shuffle=True, seed=1))
  assert not np.array_equal(order(shuffle=True, seed=1), order(shuffle=True, seed=2))
  # Without shuffling, the order is deterministic and each window is sorted by length.
  plain = order(shuffle=False, window_batches=100)
  lengths = features['input_mask'].sum(1)[plain]
  assert np.all(np.diff(lengths) >= 0)
  dropped = list(batching.bucket_batches(features, 16, shuffle=True, drop_remainder=True))
  assert all(len(b['label']) == 16 for b in dropped) and len(dropped) == 200 // 16


def test_window_of_one_batch_keeps_batches_uniform_draws():
  """Sorting by length within windows makes a batch's labels follow its lengths; a window of
  one batch draws each batch uniformly, whatever correlates with length."""
  features = _random_features(3200, 128)
  features['label'] = (features['input_mask'].sum(1) > 20).astype(np.int32)  # Long = 1.
  base_rate = features['label'].mean()

  def label_shares(window):
    return np.array([b['label'].mean() for b in batching.bucket_batches(
        features, 32, shuffle=True, seed=5, window_batches=window)])

  sorted_shares, uniform_shares = label_shares(50), label_shares(1)
  # Sorted: almost every batch holds one label only. Uniform: binomial spread around the rate.
  assert np.mean((sorted_shares == 0) | (sorted_shares == 1)) > 0.9
  assert np.mean((uniform_shares == 0) | (uniform_shares == 1)) < 0.05
  binomial_std = np.sqrt(base_rate * (1 - base_rate) / 32)
  assert np.std(uniform_shares) < 1.5 * binomial_std < np.std(sorted_shares)
  # Still bucketed: no batch is longer than the bucket its longest row needs.
  report = batching.padding_savings(features, 32, window_batches=1)
  assert report['bucketed_tokens'] < report['fixed_tokens']
  assert report['bucketed_tokens'] > batching.padding_savings(features, 32)['bucketed_tokens']


def test_padding_savings_report():
  features = _random_features(2000, 128)
  report = batching.padding_savings(features, 32)
  real = int(features['input_mask'].sum())
  assert report['real_tokens'] == real and report['fixed_tokens'] == 2000 * 128
  assert real <= report['bucketed_tokens'] < report['fixed_tokens']
  assert report['bucketed_pad_share'] < report['fixed_pad_share']
  assert report['tokens_saved_share'] == pytest.approx(
      1 - report['bucketed_tokens'] / report['fixed_tokens'])


def test_write_predictions_submission_files(tmp_path):
  out = str(tmp_path / 'sub')
  path = glue.write_predictions('mnli', np.array([[0.1, 2.0, 0.3], [3.0, 0.0, 0.0]]), out,
                                split='test_mismatched')
  assert os.path.basename(path) == 'MNLI-mm.tsv'
  assert open(path).read() == 'index\tprediction\n0\tentailment\n1\tcontradiction\n'
  assert os.path.basename(glue.write_predictions('MNLI-m', [2], out)) == 'MNLI-m.tsv'
  path = glue.write_predictions('sts-b', [4.12345, 0.5], out)
  assert open(path).read() == 'index\tprediction\n0\t4.123\n1\t0.500\n'
  path = glue.write_predictions('rte', ['not_entailment'], out, indices=[7])
  assert open(path).read() == 'index\tprediction\n7\tnot_entailment\n'
  assert os.path.basename(glue.write_predictions('ax', [1], out)) == 'AX.tsv'
  names = {glue.write_predictions(t, [1], out).split(os.sep)[-1]
           for t in ('cola', 'sst2', 'mrpc', 'qqp', 'qnli', 'wnli')}
  assert names == {'CoLA.tsv', 'SST-2.tsv', 'MRPC.tsv', 'QQP.tsv', 'QNLI.tsv', 'WNLI.tsv'}
  with pytest.raises(ValueError, match=r'label ids must be in \[0, 2\)'):
    glue.write_predictions('rte', [2], out)
  with pytest.raises(ValueError, match='not in'):
    glue.write_predictions('rte', ['maybe'], out)
  # Dev predictions (fine-tuning's best epoch) in the same layout, named after the split.
  path = glue.write_predictions('mnli', [0, 2], out, split='dev_mismatched', indices=[3, 4])
  assert os.path.basename(path) == 'dev_mismatched.tsv'
  assert open(path).read() == 'index\tprediction\n3\tcontradiction\n4\tneutral\n'
  assert os.path.basename(glue.write_predictions('mrpc', [1], out, split='dev')) == 'dev.tsv'


def test_read_tfds_maps_labels_by_name():
  tfds = pytest.importorskip('tensorflow_datasets')
  with tfds.testing.mock_data(num_examples=6):
    examples = glue.read_tfds('mnli', 'dev_mismatched')
    raw = list(tfds.as_numpy(tfds.load('glue/mnli', split='validation_mismatched',
                                       download=False)))
    names = tfds.builder('glue/mnli').info.features['label'].names
    stsb = glue.read_tfds('stsb', 'train')
    sst = glue.read_tfds('sst2', 'test')
  assert len(examples) == 6
  # TFDS numbers MNLI labels entailment/neutral/contradiction; strings must follow the names.
  assert [e.label for e in examples] == [names[int(r['label'])] for r in raw]
  assert [e.text_a for e in examples] == [r['premise'].decode() for r in raw]
  assert all(isinstance(e.label, float) for e in stsb)
  assert all(e.label is None and e.text_b is None for e in sst)
