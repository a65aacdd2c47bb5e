"""`bert-jax export --format=savedmodel` of every kind of run, checked against `bert-jax predict`
(and the features and fill-mask commands): tiny runs made once for the module, each exported,
then the exports reloaded and run in a fresh process where JAX and bert_jax cannot be imported."""

import csv
import io
import json
import os
import random
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest

from bert_jax import config_files
from bert_jax import convert
from bert_jax import errors
from bert_jax import export
from bert_jax import features as features_lib
from bert_jax import fill_mask as fill_mask_lib
from bert_jax import finetune
from bert_jax import glue
from bert_jax import model as model_lib
from bert_jax import ner
from bert_jax import predict
from bert_jax import squad
from bert_jax import swag
from bert_jax import tokenization
from bert_jax import train
import processes

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORDS = ['good', 'great', 'fine', 'bad', 'awful', 'dull', 'the', 'a', 'movie', 'plot', 'was',
         'very', 'and', 'it', 'man', 'walks', 'runs', 'then', 'who', 'made', 'by', '?', '.', ',',
         'alice', 'bob', 'carol', 'dave', '##s', '##ing', 'un', '##real', 'café', 'naïve']
VOCAB = ['[PAD]', '[UNK]', '[CLS]', '[SEP]', '[MASK]'] + WORDS + [f'w{i}' for i in range(12)]
TINY = model_lib.BertConfig(vocab_size=len(VOCAB), hidden_size=32, num_hidden_layers=2,
                            num_attention_heads=4, intermediate_size=64,
                            max_position_embeddings=64)
# Every run: one short epoch, no dropout (its random bits double a step's compile time; the
# runs only have to finish, their exports are checked against their own predictions).
_RUN = {'train.epochs': 1, 'train.batch_size': 8, 'eval.batch_size': 8, 'log.progress': False,
        'model.hidden_dropout_prob': 0.0, 'model.attention_probs_dropout_prob': 0.0,
        'train.learning_rate': 1e-3}


def _write(path, text):
  os.makedirs(os.path.dirname(str(path)), exist_ok=True)
  with open(path, 'w', encoding='utf-8') as f:
    f.write(text)
  return str(path)


def _sentence(rng, n=None):
  """Words with some the vocabulary splits (pieces), cuts short (unknown) or cases."""
  words = [rng.choice(WORDS[:26] + ['Good', 'MOVIE', 'unreal', 'Café', 'xyz', 'walking'])
           for _ in range(n or rng.choice([2, 5, 9, 30]))]
  return ' '.join(words)


def make_runs(root: str) -> dict[str, str]:
  """Tiny fine-tuning runs of every kind of task (GLUE SST-2 and the STS-B regression, SQuAD
  v1.1 and v2.0, NER, SWAG) and a pre-training run, in `root`; {name: workdir}."""
  rng = random.Random(0)
  vocab = _write(os.path.join(root, 'vocab.txt'), '\n'.join(VOCAB) + '\n')
  init = os.path.join(root, 'init')
  convert.export_bert_jax(TINY, model_lib.init_params(TINY, jax.random.key(0)), init,
                          vocab_file=vocab, lower_case=True)
  runs = {}

  def finetune_run(name, config_file, data, **overrides):
    config = config_files.load_config(config_file, dict(
        _RUN, **{'train.init_checkpoint': init, **data}, **overrides))
    runs[name] = os.path.join(root, name)
    finetune.finetune(config, runs[name])

  glue_dir = os.path.join(root, 'glue')
  _write(os.path.join(glue_dir, 'SST-2', 'train.tsv'), 'sentence\tlabel\n' + ''.join(
      f'{_sentence(rng)}\t{rng.randint(0, 1)}\n' for _ in range(16)))
  _write(os.path.join(glue_dir, 'SST-2', 'dev.tsv'), 'sentence\tlabel\n' + ''.join(
      f'{_sentence(rng)}\t{rng.randint(0, 1)}\n' for _ in range(24)))
  header = 'index\tgenre\tfilename\tyear\told_index\tsource1\tsource2\tsentence1\tsentence2\tscore'
  for split, n in (('train', 16), ('dev', 24)):
    _write(os.path.join(glue_dir, 'STS-B', f'{split}.tsv'), header + '\n' + ''.join(
        f'{i}\tg\tf\t2012\t{i}\ts\ts\t{_sentence(rng)}\t{_sentence(rng)}\t{rng.uniform(0, 5):.3f}\n'
        for i in range(n)))
  glue_data = {'task.data_dir': glue_dir, 'data.max_seq_length': 32,
               'data.buckets': (16, 32)}
  finetune_run('sst2', 'finetune_glue.py:sst2', glue_data)
  finetune_run('stsb', 'finetune_glue.py:stsb', glue_data)

  swag_dir = os.path.join(root, 'swag')
  header = ['sent1', 'sent2', 'ending0', 'ending1', 'ending2', 'ending3', 'label']
  for name, n in (('train.csv', 16), ('val.csv', 12)):
    out = io.StringIO()
    csv.writer(out).writerows([header] + [
        [_sentence(rng), _sentence(rng, 2)] + [_sentence(rng, rng.randint(1, 6)) for _ in range(4)]
        + [rng.randint(0, 3)] for _ in range(n)])
    _write(os.path.join(swag_dir, name), out.getvalue())
  finetune_run('swag', 'finetune_swag.py', {'task.data_dir': swag_dir, 'data.max_seq_length': 24,
                                            'data.buckets': (16, 24)})

  conll_dir = os.path.join(root, 'conll')
  for name, n in (('train.txt', 12), ('valid.txt', 10)):
    lines = ['-DOCSTART- -X- -X- O', '']
    for _ in range(n):
      for word in _sentence(rng, rng.choice([3, 8, 14])).split():
        tag = rng.choice(['O', 'O', 'B-PER', 'I-PER', 'B-ORG'])
        lines.append(f'{word} X X {tag}')
      lines.append('')
    _write(os.path.join(conll_dir, name), '\n'.join(lines) + '\n')
  # 16 tokens: sentences of 14 words with pieces need a second window.
  finetune_run('ner', 'finetune_ner.py', {'task.data_dir': conll_dir,
                                          'data.max_seq_length': 16, 'data.buckets': ()})

  squad_dir = os.path.join(root, 'squad')
  for version in ('v1.1', 'v2.0'):
    for split, n in (('train', 12), ('dev', 10)):
      paragraphs = []
      for i in range(n):
        who = rng.choice(['alice', 'bob', 'Carol', 'dave'])
        context = (f'{_sentence(rng, rng.choice([4, 40]))} the movie  was made by {who} , '
                   f'and\tthe Plot was dull .')
        qa = {'id': f'{split}{i}', 'question': rng.choice(['who made the movie ?',
                                                            'Who made the plot ?'])}
        impossible = version == 'v2.0' and i % 3 == 0
        if impossible:
          qa.update(is_impossible=True, answers=[])
        else:
          qa['answers'] = [{'text': who, 'answer_start': context.index(f'by {who}') + 3}]
        paragraphs.append({'context': context, 'qas': [qa]})
      _write(os.path.join(squad_dir, f'{split}-{version}.json'), json.dumps(
          {'version': version, 'data': [{'title': 't', 'paragraphs': paragraphs}]}))
  squad_data = {'task.data_dir': squad_dir, 'data.max_seq_length': 48,
                'data.buckets': (32, 48), 'task.doc_stride': 16, 'task.max_query_length': 12}
  finetune_run('squad_v1', 'finetune_squad.py:v1', squad_data)
  # The same weights read as a SQuAD 2.0 model (as tests/finetune_test.py does): its decoding
  # and outputs without a second run.
  runs['squad_v2'] = os.path.join(root, 'squad_v2')
  shutil.copytree(runs['squad_v1'], runs['squad_v2'])
  task = os.path.join(runs['squad_v2'], 'task.json')
  with open(task) as f:
    info = json.load(f)
  with open(task, 'w') as f:
    json.dump(dict(info, version_2=True, task='squad_v2.0'), f)

  pretrain = config_files.load_config('smoke.py', {
      'data.vocab_file': vocab, 'data.lower_case': True, 'data.max_seq_length': 32,
      'train.steps': 2,
      'train.warmup_steps': 0, 'train.batch_size': 8, 'eval.batch_size': 8, 'eval.steps': 1,
      'log.progress': False})
  runs['pretraining'] = os.path.join(root, 'pretraining')
  train.train_and_evaluate(pretrain, runs['pretraining'])
  return runs


def test_the_model_runs_in_tensorflow_as_in_jax():
  """The model as a TensorFlow function (jax.export, then XlaCallModule at TensorFlow's
  StableHLO version): any batch and length, the logits JAX computes with training's GELU. The
  route whose artifacts change with jax's version, so the current stack runs this too."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  config = TINY.replace(portable_gelu=True)
  model = model_lib.BertForSequenceClassification(config, num_labels=3)
  params = model_lib.init_params(TINY, jax.random.key(1),
                                 model_lib.BertForSequenceClassification, num_labels=3)
  module = tf.Module()
  call = export._tf_model(module, lambda p, *x: model.apply({'params': p}, *x), params,
                          ['(b, l)'] * 3, TINY.max_position_embeddings)
  training = model_lib.BertForSequenceClassification(TINY, num_labels=3)
  rng = np.random.RandomState(0)
  for rows, length in ((1, 5), (6, 17)):
    ids = rng.randint(1, TINY.vocab_size, (rows, length)).astype(np.int32)
    mask = (np.arange(length) < rng.randint(1, length + 1, (rows, 1))).astype(np.int32)
    segments = np.zeros_like(ids)
    served = call(tf.constant(ids), tf.constant(mask), tf.constant(segments)).numpy()
    expected = training.apply({'params': params}, ids, mask, segments)
    np.testing.assert_allclose(served, expected, atol=1e-6)
  assert {v.name for v in module.variables} and len(module.variables) == len(
      jax.tree.leaves(params))


# Texts for the tokenizer: cased and accented words, pieces, unknown words, punctuation, CJK,
# control characters and odd spaces.
TRICKY = ['Good MOVIE, naïve Café!', 'unreal walking\u00a0w1\tw2', '中文 and dull...',
          'a\x00b\u200bc', '', '   ', 'Ünreal "plot"?', 'w' + 'x' * 150]


@pytest.fixture(scope='module')
def runs(tmp_path_factory):
  return make_runs(str(tmp_path_factory.mktemp('runs')))


@pytest.fixture(scope='module')
def exports(runs, tmp_path_factory):
  """Each run exported, and a bfloat16 twin of SST-2's (its task.json says it evaluated so)."""
  root = tmp_path_factory.mktemp('exports')
  bf16 = str(root / 'sst2_bf16_run')
  shutil.copytree(runs['sst2'], bf16)
  info = json.load(open(os.path.join(bf16, 'task.json')))
  json.dump(dict(info, compute_dtype='bfloat16'), open(os.path.join(bf16, 'task.json'), 'w'))
  runs = dict(runs, sst2_bf16=bf16)
  out = {}
  for name, workdir in runs.items():
    out[name] = str(root / name)
    result = export.export(workdir, out[name])
    assert result['output'] == out[name] and 'serving_default' in result['signatures']
  return runs, out


def _dev_inputs(runs):
  """Each task's dev examples (the files `make_runs` wrote) as the serving inputs."""
  root = os.path.dirname(runs['sst2'])
  sst2 = glue.read_task('sst2', os.path.join(root, 'glue'), 'dev')
  stsb = glue.read_task('stsb', os.path.join(root, 'glue'), 'dev')
  swag_dev = swag.read_csv(os.path.join(root, 'swag', 'val.csv'))
  conll = ner.read_conll(os.path.join(root, 'conll', 'valid.txt'))
  squad_dev = {v: squad.read_squad(os.path.join(root, 'squad', f'dev-{v}.json'), False)
               for v in ('v1.1', 'v2.0')}
  return {'sst2': sst2, 'stsb': stsb, 'swag': swag_dev, 'ner': conll, 'squad': squad_dev}


def _contexts(path):
  with open(path) as f:
    data = json.load(f)
  return {q['id']: (q['question'], p['context']) for a in data['data'] for p in a['paragraphs']
          for q in p['qas']}


@pytest.fixture(scope='module')
def served(exports, tmp_path_factory):
  """Every signature called in one fresh process with TensorFlow only (serving_client.py)."""
  runs, out = exports
  dev = _dev_inputs(runs)
  root = os.path.dirname(runs['sst2'])
  requests = {
      'sst2': (out['sst2'], 'serving_default', {'text_a': [e.text_a for e in dev['sst2']]}),
      'sst2_bf16': (out['sst2_bf16'], 'serving_default',
                    {'text_a': [e.text_a for e in dev['sst2']]}),
      'sst2_encode': (out['sst2'], 'encode', {'text_a': [e.text_a for e in dev['sst2']]}),
      'stsb': (out['stsb'], 'serving_default', {'text_a': [e.text_a for e in dev['stsb']],
                                                'text_b': [e.text_b for e in dev['stsb']]}),
      'stsb_encode': (out['stsb'], 'encode', {'text_a': [e.text_a for e in dev['stsb']],
                                              'text_b': [e.text_b for e in dev['stsb']]}),
      'swag': (out['swag'], 'serving_default', {
          'context': [e.context for e in dev['swag']], 'start': [e.start for e in dev['swag']],
          'endings': [list(e.endings) for e in dev['swag']]}),
      'swag_encode': (out['swag'], 'encode', {
          'context': [e.context for e in dev['swag']], 'start': [e.start for e in dev['swag']],
          'endings': [list(e.endings) for e in dev['swag']]}),
      'ner_words': (out['ner'], 'tag_words', {'words': [
          s.words + [''] * (max(len(t.words) for t in dev['ner']) - len(s.words))
          for s in dev['ner']]}),
      'ner_text': (out['ner'], 'serving_default', {'text': [' '.join(s.words)
                                                           for s in dev['ner']]}),
      'ner_encode': (out['ner'], 'encode', {'text': [' '.join(s.words) for s in dev['ner']]}),
      'tokenize': (out['sst2'], 'tokenize', {'text': TRICKY}),
      'features': (out['pretraining'], 'features', {'text_a': FEATURE_TEXTS}),
      'features_pair': (out['pretraining'], 'features_pair', {
          'text_a': FEATURE_TEXTS, 'text_b': FEATURE_TEXTS[::-1]}),
      'fill_mask': (out['pretraining'], 'fill_mask', {'text': MASKED_TEXTS}),
  }
  for version, name in (('v1.1', 'squad_v1'), ('v2.0', 'squad_v2')):
    pairs = _contexts(os.path.join(root, 'squad', f'dev-{version}.json'))
    ids = sorted(pairs)
    inputs = {'question': [pairs[i][0] for i in ids], 'context': [pairs[i][1] for i in ids]}
    requests[name] = (out[name], 'serving_default', inputs)
    requests[f'{name}_encode'] = (out[name], 'encode', inputs)
  folder = tmp_path_factory.mktemp('client')
  with open(folder / 'requests.json', 'w') as f:
    json.dump([{'export': e, 'signature': s, 'inputs': i} for e, s, i in requests.values()], f)
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  site = os.path.dirname(os.path.dirname(tf.__file__))
  proc = subprocess.run(
      [sys.executable, '-I', '-S', os.path.join(REPO, 'tests', 'serving_client.py'),
       str(folder / 'requests.json'), str(folder / 'results.json'), site],
      capture_output=True, text=True, timeout=900, cwd=str(folder))
  assert proc.returncode == 0, proc.stderr[-3000:]
  with open(folder / 'results.json') as f:
    results = json.load(f)
  return runs, dev, results, dict(zip(requests, results['outputs']))


FEATURE_TEXTS = ['the movie was good', 'Who made the plot ?', 'w1 ' * 200, 'café']
MASKED_TEXTS = ['the [MASK] was good .', '[MASK] made the [MASK] ?', 'no mask here']


def test_the_serving_process_had_tensorflow_only(served):
  _, _, results, _ = served
  assert all(error and 'blocked' in error for error in results['blocked'].values()), results
  assert results['loaded'] == []


def _predict(workdir, input_path, tmp_path, name):
  output = str(tmp_path / name)
  summary = predict.predict(workdir, input_path, output)
  return summary, output


def test_glue_labels_and_probabilities_equal_predicts(served, tmp_path):
  runs, dev, _, out = served
  root = os.path.dirname(runs['sst2'])
  for name, tolerance in (('sst2', 1e-5), ('sst2_bf16', 2e-2)):
    _, output = _predict(runs[name], os.path.join(root, 'glue', 'SST-2', 'dev.tsv'), tmp_path,
                         f'{name}.jsonl')
    with open(output) as f:
      rows = [json.loads(line) for line in f]
    probs = np.array([[r['probabilities'][l] for l in ('0', '1')] for r in rows])
    served_probs = np.array(out[name]['probabilities'])
    np.testing.assert_allclose(served_probs, probs, atol=tolerance)
    # Labels are the same wherever the two are not within the tolerance of a tie (float32:
    # every row of this run; bfloat16 rounds its 0.5 +- 0.02 probabilities to that).
    clear = np.abs(probs[:, 0] - 0.5) > tolerance
    assert clear.all() or name == 'sst2_bf16'
    assert ([l for l, c in zip(out[name]['label'], clear) if c]
            == [r['label'] for r, c in zip(rows, clear) if c])
    assert out[name]['label_id'] == [int(l) for l in out[name]['label']]
  _, output = _predict(runs['stsb'], os.path.join(root, 'glue', 'STS-B', 'dev.tsv'), tmp_path,
                       'stsb.jsonl')
  with open(output) as f:
    scores = [json.loads(line)['score'] for line in f]
  np.testing.assert_allclose(out['stsb']['score'], scores, atol=1e-5)


def test_the_exported_tokenizer_is_the_training_pipelines(served):
  runs, dev, _, out = served
  tok = tokenization.load_tokenizer(os.path.join(runs['sst2'], 'vocab.txt'), lower_case=True)
  expected = tok.encode(TRICKY)
  assert [row[:n] for row, n in zip(out['tokenize']['token_ids'], out['tokenize']['lengths'])
          ] == expected
  assert out['tokenize']['tokens'][0][:out['tokenize']['lengths'][0]] == tok.decode(expected[0])
  # The model inputs each task packs: its features, token for token.
  for name, features in (
      ('sst2_encode', glue.convert_examples(dev['sst2'], tok, 32, ['0', '1'])),
      ('stsb_encode', glue.convert_examples(dev['stsb'], tok, 32, None)),
      ('swag_encode', swag.convert_examples(dev['swag'], tok, 24))):
    for key in ('input_ids', 'input_mask', 'segment_ids'):
      served_array = np.array(out[name][key])
      length = served_array.shape[-1]
      np.testing.assert_array_equal(served_array, features[key][..., :length])
      assert not features['input_mask'][..., length:].any()


def test_swag_choices_equal_predicts(served, tmp_path):
  runs, dev, _, out = served
  root = os.path.dirname(runs['sst2'])
  _, output = _predict(runs['swag'], os.path.join(root, 'swag', 'val.csv'), tmp_path,
                       'swag.jsonl')
  with open(output) as f:
    rows = [json.loads(line) for line in f]
  assert out['swag']['label'] == [r['label'] for r in rows]
  assert out['swag']['ending'] == [r['ending'] for r in rows]
  np.testing.assert_allclose(out['swag']['probabilities'], [r['probabilities'] for r in rows],
                             atol=1e-5)


def _conll_tags(path):
  with open(path) as f:
    blocks = f.read().strip().split('\n\n')
  return [[line.split()[-1] for line in block.splitlines()] for block in blocks]


def test_ner_tags_every_word_as_predict(served, tmp_path):
  runs, dev, _, out = served
  root = os.path.dirname(runs['sst2'])
  _, output = _predict(runs['ner'], os.path.join(root, 'conll', 'valid.txt'), tmp_path,
                       'ner.conll')
  expected = _conll_tags(output)
  sentences = dev['ner']
  assert any(len(s.words) > 8 for s in sentences)  # Some need a second window.
  for name in ('ner_words', 'ner_text'):
    result = out[name]
    assert result['num_words'] == [len(s.words) for s in sentences]
    assert [w[:n] for w, n in zip(result['words'], result['num_words'])] == [
        s.words for s in sentences]
    assert [t[:n] for t, n in zip(result['tags'], result['num_words'])] == expected
  tok = tokenization.load_tokenizer(os.path.join(runs['ner'], 'vocab.txt'), lower_case=True)
  labels = json.load(open(os.path.join(runs['ner'], 'task.json')))['labels']
  features = ner.convert_sentences(sentences, tok, 16, labels)
  encoded = out['ner_encode']
  length = np.array(encoded['input_ids']).shape[1]
  np.testing.assert_array_equal(encoded['input_ids'], features['input_ids'][:, :length])
  first_pieces = np.argwhere(features['word_index'] >= 0)
  assert sorted(zip(encoded['word_window'], encoded['word_position'])) == sorted(
      map(tuple, first_pieces.tolist()))


@pytest.mark.parametrize('name,version', [('squad_v1', 'v1.1'), ('squad_v2', 'v2.0')])
def test_squad_answers_spans_and_nbest_equal_predicts(served, tmp_path, name, version):
  runs, dev, _, out = served
  root = os.path.dirname(runs['sst2'])
  dev_file = os.path.join(root, 'squad', f'dev-{version}.json')
  summary, output = _predict(runs[name], dev_file, tmp_path, f'{name}.json')
  with open(output) as f:
    answers = json.load(f)
  with open(summary['files']['nbest']) as f:
    nbest = json.load(f)
  ids = sorted(answers)
  result = out[name]
  assert result['answer'] == [answers[i] for i in ids]
  pairs = _contexts(dev_file)
  for row, qid in enumerate(ids):
    listed = [t for t, p in zip(result['nbest_text'][row], result['nbest_probability'][row])
              if p > 0]
    assert listed == [n['text'] for n in nbest[qid]]
    np.testing.assert_allclose(result['nbest_probability'][row][:len(listed)],
                               [n['probability'] for n in nbest[qid]], atol=1e-6)
    np.testing.assert_allclose(result['nbest_start_logit'][row][:len(listed)],
                               [n['start_logit'] for n in nbest[qid]], atol=1e-6)
    start, end = result['answer_start'][row], result['answer_end'][row]
    if answers[qid]:
      # The span of the context the answer was read from (whitespace as the context has it).
      assert ' '.join(pairs[qid][1][start:end].split()) == answers[qid]
    else:
      assert (start, end) == (-1, -1)
  if version == 'v2.0':
    with open(summary['files']['null_odds']) as f:
      odds = json.load(f)
    np.testing.assert_allclose(result['null_odds'], [odds[i] for i in ids], atol=1e-6)
  # The windows: squad.convert_examples' rows, token for token.
  tok = tokenization.load_tokenizer(os.path.join(runs[name], 'vocab.txt'), lower_case=True)
  examples = [next(e for e in dev['squad'][version] if e.qas_id == i) for i in ids]
  features = squad.convert_examples(examples, tok, 48, 16, 12)
  encoded = out[f'{name}_encode']
  length = np.array(encoded['input_ids']).shape[1]
  assert encoded['example'] == features['example_index'].tolist()
  for key in ('input_ids', 'segment_ids', 'token_to_orig', 'token_is_max_context'):
    np.testing.assert_array_equal(encoded[key], features[key][:, :length])


def test_features_and_fill_mask_equal_the_commands(served, tmp_path):
  runs, _, _, out = served
  text = _write(tmp_path / 'lines.txt', '\n'.join(FEATURE_TEXTS) + '\n')
  output = str(tmp_path / 'features.npz')
  features_lib.extract_features(runs['pretraining'], text, output)
  expected = np.load(output)
  result = out['features']
  assert result['lengths'] == expected['lengths'].tolist()
  assert result['truncated'] == expected['truncated'].tolist() == [False, False, True, False]
  length = np.array(result['features']).shape[1]
  np.testing.assert_allclose(result['features'], expected['features'][:, :length], atol=1e-5)
  np.testing.assert_allclose(result['cls'], expected['cls'], atol=1e-5)
  np.testing.assert_allclose(result['mean'], expected['mean'], atol=1e-5)
  assert [t[:n] for t, n in zip(result['tokens'], result['lengths'])] == [
      list(t[:n]) for t, n in zip(expected['tokens'], expected['lengths'])]
  pairs = _write(tmp_path / 'pairs.txt', ''.join(
      f'{a} ||| {b}\n' for a, b in zip(FEATURE_TEXTS, FEATURE_TEXTS[::-1])))
  features_lib.extract_features(runs['pretraining'], pairs, str(tmp_path / 'pairs.npz'))
  np.testing.assert_allclose(out['features_pair']['cls'],
                             np.load(str(tmp_path / 'pairs.npz'))['cls'], atol=1e-5)

  masks = fill_mask_lib.fill_mask(runs['pretraining'], MASKED_TEXTS[:2], top_k=5)
  result = out['fill_mask']
  assert result['num_masks'] == [1, 2, 0]
  for row, expected in enumerate(masks):
    for m, mask in enumerate(expected['masks']):
      assert result['positions'][row][m] == mask['position']
      assert result['token_ids'][row][m] == [p['token_id'] for p in mask['predictions']]
      assert result['tokens'][row][m] == [p['token'] for p in mask['predictions']]
      np.testing.assert_allclose(result['probabilities'][row][m],
                                 [p['probability'] for p in mask['predictions']], atol=1e-6)


def _cli(*args):
  """`bert-jax export`, forked (tests/forkserver.py) as a fresh interpreter would run it."""
  env = dict(os.environ, PYTHONPATH=REPO)
  return subprocess.run(processes.python(env) + ['-m', 'bert_jax.cli', 'export', *args],
                        cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


def test_bad_input_gets_one_line(runs, exports, tmp_path, monkeypatch):
  _, out = exports
  # A fine-tuning run that has not finished: no metrics.json (and the same through the CLI:
  # one line, exit 2).
  unfinished = str(tmp_path / 'unfinished')
  shutil.copytree(runs['sst2'], unfinished)
  os.remove(os.path.join(unfinished, 'metrics.json'))
  proc = _cli(f'--workdir={unfinished}', f'--output={tmp_path / "x"}')
  assert proc.returncode == 2, proc.stderr[-2000:]
  lines = proc.stderr.strip().splitlines()
  assert len(lines) == 1 and 'has no metrics.json: its fine-tuning run has not finished' in lines[0]
  # A pre-training run stopped before train.steps.
  stopped = str(tmp_path / 'stopped')
  shutil.copytree(runs['pretraining'], stopped)
  config = json.load(open(os.path.join(stopped, 'config.json')))
  config['train']['steps'] = 5
  json.dump(config, open(os.path.join(stopped, 'config.json'), 'w'))
  with pytest.raises(errors.UserError, match=r'pre-training run has not finished \(its last '
                     r'checkpoint is step 2 of train\.steps=5'):
    export.export(stopped, str(tmp_path / 'y'))
  with pytest.raises(errors.UserError, match='has no config.json: not a bert_jax training'):
    export.export(str(tmp_path), str(tmp_path / 'y'))
  with pytest.raises(errors.UserError, match=r'--format=onnx: expected savedmodel'):
    export.export(runs['sst2'], str(tmp_path / 'y'), 'onnx')
  # An output that exists and is not an export; a file; the workdir itself.
  _write(tmp_path / 'taken' / 'notes.txt', 'mine')
  with pytest.raises(errors.UserError, match=r'exists and is not a bert_jax export'):
    export.export(runs['sst2'], str(tmp_path / 'taken'))
  assert os.listdir(tmp_path / 'taken') == ['notes.txt']
  with pytest.raises(errors.UserError, match=r'is a file, not an export'):
    export.export(runs['sst2'], str(tmp_path / 'taken' / 'notes.txt'))
  with pytest.raises(errors.UserError, match=r'is the --workdir'):
    export.export(runs['sst2'], runs['sst2'])
  # A kind of task the format has no serving signature for.
  from bert_jax import task_table  # pylint: disable=g-import-not-at-top
  odd = str(tmp_path / 'odd')
  shutil.copytree(runs['sst2'], odd)
  info = json.load(open(os.path.join(odd, 'task.json')))
  json.dump(dict(info, kind='ranking', task='msmarco'), open(os.path.join(odd, 'task.json'), 'w'))
  monkeypatch.setitem(task_table.KINDS, 'ranking', task_table.Kind('msmarco', ('jsonl',)))
  with pytest.raises(errors.UserError, match=r'holds a ranking model \(msmarco\): '
                     r'--format=savedmodel serves glue, ner, pretraining, squad, swag runs'):
    export.export(odd, str(tmp_path / 'z'))


def test_an_earlier_export_is_replaced(exports, tmp_path):
  runs, out = exports
  folder = str(tmp_path / 'again')
  shutil.copytree(out['stsb'], folder)
  export.export(runs['sst2'], folder)
  with open(os.path.join(folder, export.MARKER)) as f:
    meta = json.load(f)
  assert meta['task'] == 'sst2' and meta['labels'] == ['0', '1']
  assert set(meta['signatures']['serving_default']['outputs']) == {
      'label', 'label_id', 'probabilities', 'logits'}


def test_onnx_recipe_and_the_serving_benchmark(exports, served, tmp_path):
  """README "Serving"'s ONNX recipe on SST-2's run (where torch, onnx and onnxruntime are: the
  floor stack) gives the SavedModel's logits on its token ids; benchmarks/serving.py measures
  the three ways of serving that run."""
  torch = pytest.importorskip('torch')
  onnxruntime = pytest.importorskip('onnxruntime')
  pytest.importorskip('onnx')
  import transformers  # pylint: disable=g-import-not-at-top
  runs, _, _, out = served
  hf = str(tmp_path / 'hf')
  convert.convert(runs['sst2'], hf, 'hf')
  model = transformers.AutoModelForSequenceClassification.from_pretrained(hf).eval()
  ids = torch.ones(1, 8, dtype=torch.long)
  names = ['input_ids', 'attention_mask', 'token_type_ids']
  torch.onnx.export(model, (ids, ids, ids), str(tmp_path / 'sst2.onnx'), dynamo=False,
                    input_names=names, output_names=['logits'],
                    dynamic_axes={n: {0: 'batch', 1: 'length'} for n in names})
  session = onnxruntime.InferenceSession(str(tmp_path / 'sst2.onnx'))
  encoded = out['sst2_encode']
  logits, = session.run(None, {
      'input_ids': np.array(encoded['input_ids'], np.int64),
      'attention_mask': np.array(encoded['input_mask'], np.int64),
      'token_type_ids': np.array(encoded['segment_ids'], np.int64)})
  np.testing.assert_allclose(logits, out['sst2']['logits'], atol=1e-5)

  proc = subprocess.run(
      [sys.executable, os.path.join(REPO, 'benchmarks', 'serving.py'), '--examples=8',
       '--batch_sizes=4', '--threads=1', f'--workdir={runs["sst2"]}',
       f'--export={exports[1]["sst2"]}',
       f'--hf={hf}'], capture_output=True, text=True, timeout=900, cwd=str(tmp_path))
  assert proc.returncode == 0, proc.stderr[-3000:]
  result = json.loads(proc.stdout.strip().splitlines()[-1])
  assert {(r['system'], r['batch_size']) for r in result['results']} == {
      ('savedmodel', 4), ('predict', 4), ('transformers', 4)}
  assert all(r['examples_per_second'] > 0 for r in result['results'])
