"""Tests for bert_jax.swag: SWAG's CSV and the JSONL layout, choice features, parity with
transformers' BertForMultipleChoice (logits, loss, exported weights), and fine-tuning and
`bert-jax predict` end to end on a set the test makes."""

import json
import os
import random
import re

import jax
import numpy as np
import pytest
import safetensors.numpy

from bert_jax import config_files
from bert_jax import convert
from bert_jax import finetune
from bert_jax import model as model_lib
from bert_jax import predict
from bert_jax import pretrained
from bert_jax import swag
from bert_jax import tasks
from bert_jax import tokenization
from bert_jax.errors import UserError
from tolerance import assert_close
import torch_reference

# Runs of many steps: compiled with XLA's optimizations (conftest.xla_optimizations).
OPTIMIZE_XLA = True
POSITIVE = ['good', 'great', 'fine', 'nice', 'happy', 'superb']
NEGATIVE = ['bad', 'awful', 'poor', 'sad', 'dull', 'ugly']
FILLER = ['the', 'a', 'man', 'woman', 'dog', 'walks', 'runs', 'then', 'and', 'it', 'is', 'was']
VOCAB = ['[PAD]', '[UNK]', '[CLS]', '[SEP]', '[MASK]', ',', '.'] + POSITIVE + NEGATIVE + FILLER
HEADER = 'video-id,fold-ind,startphrase,sent1,sent2,gold-source,ending0,ending1,ending2,ending3'


@pytest.fixture(scope='module')
def tok(tmp_path_factory):
  path = tmp_path_factory.mktemp('vocab') / 'vocab.txt'
  path.write_text('\n'.join(VOCAB) + '\n')
  return tokenization.load_tokenizer(str(path), lower_case=True)


def _write(path, text):
  os.makedirs(os.path.dirname(str(path)), exist_ok=True)
  with open(path, 'w', encoding='utf-8') as f:
    f.write(text)
  return str(path)


def test_read_swag_csv_with_quotes_and_an_unlabelled_test_file(tmp_path):
  labelled = _write(tmp_path / 'val.csv', HEADER + ',label\n'
                    'v1,3,"A man walks, then",A man walks,then,gold,"runs, fast",stops,sits,'
                    'naps,0\n'
                    'v2,4,x,"A dog\nbarks",It,gen,runs,walks,"says ""hi""",sleeps,2\n')
  examples = swag.read_csv(labelled)
  assert [e.context for e in examples] == ['A man walks', 'A dog\nbarks']
  assert examples[0].start == 'then' and examples[0].endings[0] == 'runs, fast'
  assert examples[1].endings[2] == 'says "hi"' and [e.label for e in examples] == [0, 2]
  test = _write(tmp_path / 'test.csv', HEADER + '\nv3,1,x,One,two,gen,a,b,c,d\n')
  (example,) = swag.read_csv(test)
  assert example.label is None and example.endings == ('a', 'b', 'c', 'd')
  assert swag.read_file(test, 'auto')[1] == 'csv'


@pytest.mark.parametrize('name,text,message', [
    ('a.csv', 'sent1,sent2,ending0\n', "header (line 1) has no column 'ending1'"),
    ('b.csv', 'sent1,sent2,ending0,ending1,label\nx,y,a,b,2\n',
     r'b.csv:2: label 2 is not a choice: expected 0 to 1'),
    ('c.csv', 'sent1,sent2,ending0,ending1,label\nx,y,a,b,1\nx,y,a,b\n',
     'c.csv:3: 4 columns where the header has 5'),
    ('d.csv', 'sent1,sent2,ending0,ending1\n', r'd.csv: no examples'),
    ('e.jsonl', '{"context": "x", "endings": ["a", "b"]}\n\n{"context": "y", "endings": '
     '["a", "b", "c"]}\n', 'e.jsonl:3: 3 endings where earlier lines have 2'),
    ('f.jsonl', '{"context": "x", "endings": ["a"]}\n', 'f.jsonl:1: "endings" must be a list '
     'of 2 or more strings'),
    ('g.jsonl', '{"context": "x", "endings": ["a", "b"], "label": true}\n',
     'g.jsonl:1: label True is not a choice'),
    ('h.jsonl', '["x"]\n', 'h.jsonl:1: expected a JSON object, got list'),
    # A misspelt ending column would leave that choice out: 3-way instead of 4-way.
    ('i.csv', 'sent1,sent2,ending0,ending1,ending2,ending_3,label\nx,y,a,b,c,d,3\n',
     "i.csv: header (line 1) has column 'ending_3' besides ending0..ending2"),
])
def test_bad_files_name_the_file_and_line(tmp_path, name, text, message):
  with pytest.raises(UserError, match=re.escape(message)):
    swag.read_file(_write(tmp_path / name, text))


def test_jsonl_of_any_number_of_choices(tmp_path, tok):
  path = _write(tmp_path / 'x.jsonl', json.dumps(
      {'id': 'q1', 'context': 'The man', 'start': 'walks', 'endings': ['fine', 'bad', 'sad'],
       'label': 2}) + '\n')
  examples, input_format = swag.read_file(path)
  assert input_format == 'jsonl' and examples[0].guid == 'q1' and examples[0].label == 2
  features = swag.convert_examples(examples, tok, 8)
  assert features['input_ids'].shape == (1, 3, 8)
  np.testing.assert_array_equal(features['label'], [2])


def test_each_choice_is_context_then_start_and_ending(tok):
  example = swag.Example('0', 'the man walks', 'then it', ('runs', 'is dull and sad'), 1)
  features = swag.convert_examples([example], tok, 10)
  ids = features['input_ids'][0]
  words = lambda row: [VOCAB[i] for i in row if i]
  assert words(ids[0]) == ['[CLS]', 'the', 'man', 'walks', '[SEP]', 'then', 'it', 'runs',
                           '[SEP]']
  np.testing.assert_array_equal(features['segment_ids'][0, 0], [0] * 5 + [1] * 4 + [0])
  # Too long: the longer side loses tokens from its end, as the original truncates pairs.
  assert words(ids[1]) == ['[CLS]', 'the', 'man', 'walks', '[SEP]', 'then', 'it', 'is',
                           'dull', '[SEP]']
  np.testing.assert_array_equal(features['input_mask'].sum(-1), [[9, 10]])


# ---------------------------------------------------------------------------------------------
# Parity with transformers' BertForMultipleChoice
# ---------------------------------------------------------------------------------------------

HF_CONFIG = dict(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                 intermediate_size=37, max_position_embeddings=40, type_vocab_size=2,
                 hidden_act='gelu')
# The same bound as tests/parity_test.py: a few ulps of the activations' scale.
RELATIVE_TOLERANCE = 5e-6


def _choice_batch():
  """Two examples of four choices, of different lengths (padding inside the batch)."""
  rng = np.random.RandomState(0)
  lengths = np.array([[12, 9, 7, 12], [5, 11, 6, 8]])
  mask = (np.arange(12) < lengths[..., None]).astype(np.int64)
  ids = rng.randint(1, HF_CONFIG['vocab_size'], mask.shape) * mask
  segments = (np.arange(12) >= 4) * mask
  return ids, mask, segments, np.array([1, 3])


@pytest.fixture(scope='module')
def hf_multiple_choice(tmp_path_factory):
  """transformers' BertForMultipleChoice (every weight random): its logits and loss on
  `_choice_batch()` and its checkpoint."""

  def make(folder):
    import torch  # pylint: disable=g-import-not-at-top
    import transformers  # pylint: disable=g-import-not-at-top
    torch.manual_seed(7)
    config = transformers.BertConfig(**HF_CONFIG, attn_implementation='eager')
    hf = transformers.BertForMultipleChoice(config).eval()
    with torch.no_grad():
      for name, p in hf.named_parameters():
        noise = 0.2 * torch.randn(p.shape)
        p.copy_(1.0 + noise if name.endswith('LayerNorm.weight') else noise)
    hf.save_pretrained(folder)
    ids, mask, segments, labels = _choice_batch()
    with torch.no_grad():
      out = hf(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
               token_type_ids=torch.tensor(segments), labels=torch.tensor(labels))
    return dict(logits=out.logits.numpy(), loss=out.loss.numpy())

  folder = tmp_path_factory.mktemp('hf_multiple_choice')
  return torch_reference.reference('swag_multiple_choice', folder, make), str(folder)


def test_logits_and_loss_match_transformers(hf_multiple_choice):
  theirs, folder = hf_multiple_choice
  config, params = pretrained.load_pretrained(folder)
  assert set(params) == {'bert', 'classifier'}
  ids, mask, segments, labels = _choice_batch()
  logits = swag.BertForMultipleChoice(config).apply({'params': params}, ids, mask, segments)
  assert logits.shape == (2, 4)
  logits_diff = assert_close(logits, theirs['logits'], RELATIVE_TOLERANCE,
                             what='multiple-choice logits')
  sums, counts, _ = tasks.classification_loss(
      logits, {'label': labels, 'weight': np.ones(2, np.float32)})
  loss = sums['classification'] / counts['classification']
  loss_diff = assert_close(loss, theirs['loss'], RELATIVE_TOLERANCE, what='multiple-choice loss')
  print(f'\nparity multiple choice: logits {logits_diff:.3g}, loss {loss_diff:.3g} of the largest '
        '|value|')


def test_exported_weights_are_the_checkpoints_exactly(hf_multiple_choice, tmp_path):
  _, folder = hf_multiple_choice
  config, params = pretrained.load_pretrained(folder)
  out = str(tmp_path / 'export')
  convert.export_hf(config, params, out)
  theirs = safetensors.numpy.load_file(os.path.join(folder, 'model.safetensors'))
  ours = safetensors.numpy.load_file(os.path.join(out, 'model.safetensors'))
  assert sorted(ours) == sorted(theirs)
  for name, value in theirs.items():
    np.testing.assert_array_equal(ours[name], value, err_msg=name)


# ---------------------------------------------------------------------------------------------
# Fine-tuning and predict, end to end
# ---------------------------------------------------------------------------------------------


def _rows(rng, n, labelled=True):
  """SWAG CSV rows whose right ending is the one with a word of POSITIVE in it."""
  rows = []
  for i in range(n):
    label = rng.randrange(4)
    endings = [' '.join(rng.sample(FILLER, rng.randint(1, 6)) +
                        [rng.choice(POSITIVE if c == label else NEGATIVE)]) for c in range(4)]
    context = ' '.join(rng.sample(FILLER, rng.randint(2, 8)))
    rows.append(f'v{i},0,x,{context},then it,gen,' + ','.join(endings) +
                (f',{label}' if labelled else ''))
  return rows


def test_swag_finetunes_and_predicts_the_chosen_ending(tok, tmp_path):
  tiny = model_lib.BertConfig(vocab_size=len(VOCAB), hidden_size=64, num_hidden_layers=2,
                              num_attention_heads=4, intermediate_size=128,
                              max_position_embeddings=64)
  init = str(tmp_path / 'init')
  vocab = _write(tmp_path / 'vocab.txt', '\n'.join(VOCAB) + '\n')
  convert.export_bert_jax(tiny, model_lib.init_params(tiny, jax.random.key(0)), init,
                          vocab_file=vocab, lower_case=True)
  rng = random.Random(0)
  data_dir = str(tmp_path / 'swag')
  _write(os.path.join(data_dir, 'train.csv'), '\n'.join([HEADER + ',label'] + _rows(rng, 96)))
  _write(os.path.join(data_dir, 'val.csv'), '\n'.join([HEADER + ',label'] + _rows(rng, 32)))
  _write(os.path.join(data_dir, 'test.csv'), '\n'.join([HEADER] + _rows(rng, 8, False)))
  config = config_files.load_config('finetune_swag.py', {
      'train.init_checkpoint': init, 'task.data_dir': data_dir, 'data.max_seq_length': 24,
      'data.buckets': (16, 24), 'train.learning_rate': 2e-3, 'train.epochs': 3,
      'eval.batch_size': 32, 'eval.predict_test': True, 'log.progress': False,
      # No dropout: its random bits double the step's compile time (GLUE's test trains with it).
      'model.hidden_dropout_prob': 0.0, 'model.attention_probs_dropout_prob': 0.0})
  assert (config.train.batch_size, config.data.max_seq_length) == (16, 24)
  workdir = str(tmp_path / 'run')
  result = finetune.finetune(config, workdir)
  print(f'\nSWAG-like dev accuracy: {result["score"]}')

  assert result['main_metric'] == 'accuracy' and result['dev']['examples'] == 32
  assert result['score'] == result['dev']['accuracy'] >= 0.75  # Chance: 0.25.
  with open(os.path.join(workdir, 'predictions', 'dev.jsonl')) as f:
    dev_lines = [json.loads(line) for line in f]
  examples = swag.read_csv(os.path.join(data_dir, 'val.csv'))
  assert len(dev_lines) == 32
  assert np.mean([l['label'] == e.label for l, e in zip(dev_lines, examples)]) == result['score']
  assert all(l['ending'] == e.endings[l['label']] for l, e in zip(dev_lines, examples))
  assert all(abs(sum(l['probabilities']) - 1) < 1e-5 for l in dev_lines)
  with open(os.path.join(workdir, 'predictions', 'test.jsonl')) as f:
    assert len(f.read().splitlines()) == 8

  # `bert-jax predict` on the dev file: the run's choices and score; on the same examples as
  # JSONL without labels, the same choices and no score.
  output = str(tmp_path / 'dev_out.jsonl')
  summary = predict.predict(workdir, os.path.join(data_dir, 'val.csv'), output)
  assert summary['input_format'] == 'csv' and summary['metrics'] == result['dev']
  with open(output) as f:
    assert [json.loads(line) for line in f] == dev_lines
  jsonl = _write(tmp_path / 'new.jsonl', ''.join(json.dumps(
      {'context': e.context, 'start': e.start, 'endings': list(e.endings)}) + '\n'
      for e in examples))
  again = predict.predict(workdir, jsonl, str(tmp_path / 'new_out.jsonl'), batch_size=5)
  assert 'metrics' not in again and again['input_format'] == 'jsonl'
  with open(again['output']) as f:
    assert [json.loads(line)['ending'] for line in f] == [l['ending'] for l in dev_lines]
  with pytest.raises(UserError, match='--input_format=conll does not fit a swag model'):
    predict.predict(workdir, jsonl, output, input_format='conll')

  # `bert-jax convert --format=hf` of the run: transformers' class for it, the same weights.
  exported = str(tmp_path / 'hf')
  convert.convert(workdir, exported, 'hf')
  with open(os.path.join(exported, 'config.json')) as f:
    assert json.load(f)['architectures'] == ['BertForMultipleChoice']
  _, reloaded = pretrained.load_pretrained(exported)
  _, params = pretrained.load_pretrained(workdir)
  np.testing.assert_array_equal(reloaded['classifier']['kernel'], params['classifier']['kernel'])
