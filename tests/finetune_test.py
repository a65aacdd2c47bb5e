"""End-to-end fine-tuning of a tiny randomly initialised BERT: GLUE (learns a task to >= 90%),
SQuAD, NER and the learning-rate sweep through the CLI, and the errors users meet first."""

import glob
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import pytest

from bert_jax import batching
from bert_jax import checkpoint as ckpt_lib
from bert_jax import config_files
from bert_jax import convert
from bert_jax import errors
from bert_jax import fileio
from bert_jax import finetune
from bert_jax import glue
from bert_jax import model as model_lib
from bert_jax import monitor
from bert_jax import ner
from bert_jax import predict
from bert_jax import pretrained
from bert_jax import publish
from bert_jax import run_files
from bert_jax import run_lock

import processes

# Runs of many steps: compiled with XLA's optimizations (conftest.xla_optimizations).
OPTIMIZE_XLA = True
# Many runs of one configuration in fresh workdirs (resumes, SIGTERMs): compiled once
# (conftest.compilation_cache).
pytestmark = pytest.mark.usefixtures('compilation_cache')
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
POSITIVE = ['good', 'great', 'fine', 'nice', 'happy', 'superb', 'lovely', 'brilliant']
NEGATIVE = ['bad', 'awful', 'poor', 'sad', 'terrible', 'dull', 'boring', 'ugly']
FILLER = ['the', 'an', 'movie', 'film', 'plot', 'was', 'very', 'quite', 'and', 'it', 'actors',
          'story', 'made', 'by', 'who', '?', '.']
NAMES = ['alice', 'bob', 'carol', 'dave', 'erin']
VOCAB = (['[PAD]', '[UNK]', '[CLS]', '[SEP]', '[MASK]'] + POSITIVE + NEGATIVE + FILLER + NAMES +
         [f'w{i}' for i in range(20)])
TINY = model_lib.BertConfig(vocab_size=len(VOCAB), hidden_size=64, num_hidden_layers=2,
                            num_attention_heads=4, intermediate_size=128,
                            max_position_embeddings=64)


def _write_lines(path, lines):
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, 'w', encoding='utf-8') as f:
    f.write(''.join(line + '\n' for line in lines))
  return str(path)


@pytest.fixture(scope='module')
def checkpoints(tmp_path_factory):
  """The same random tiny model as a Hugging Face directory and as a bert_jax checkpoint."""
  root = tmp_path_factory.mktemp('pretrained')
  vocab = _write_lines(str(root / 'vocab.txt'), VOCAB)
  params = model_lib.init_params(TINY, jax.random.key(0))
  hf, ours = str(root / 'hf'), str(root / 'bert_jax')
  convert.export_hf(TINY, params, hf, vocab_file=vocab, lower_case=True)
  convert.export_bert_jax(TINY, params, ours, vocab_file=vocab, lower_case=True)
  return {'hf': hf, 'bert_jax': ours}


def _sentence(rng, label):
  """Filler words plus one or two words of the label's set: the label is which set is used."""
  words = [rng.choice(FILLER[:12]) for _ in range(rng.choice([rng.randint(3, 8),
                                                              rng.randint(12, 22)]))]
  for _ in range(rng.randint(1, 2)):
    words.insert(rng.randrange(len(words) + 1), rng.choice(POSITIVE if label else NEGATIVE))
  return ' '.join(words)


@pytest.fixture(scope='module')
def glue_dir(tmp_path_factory):
  """SST-2 in the official layout: train.tsv/dev.tsv (sentence, label), test.tsv (index,
  sentence); `gold` holds the test labels the rule gives."""
  root = str(tmp_path_factory.mktemp('glue'))
  rng = random.Random(0)
  for split, n in (('train', 256), ('dev', 64)):
    rows = []
    for _ in range(n):
      label = rng.randint(0, 1)
      rows.append(f'{_sentence(rng, label)}\t{label}')
    _write_lines(os.path.join(root, 'SST-2', f'{split}.tsv'), ['sentence\tlabel'] + rows)
  gold = [rng.randint(0, 1) for _ in range(24)]
  _write_lines(os.path.join(root, 'SST-2', 'test.tsv'),
               ['index\tsentence'] + [f'{i}\t{_sentence(rng, g)}' for i, g in enumerate(gold)])
  return root, gold


def _glue_config(init_checkpoint, data_dir, **overrides):
  values = {'train.init_checkpoint': init_checkpoint, 'task.data_dir': data_dir,
            'data.max_seq_length': 32, 'data.buckets': (16, 32), 'train.batch_size': 16,
            'eval.batch_size': 32, 'log.progress': False}
  values.update(overrides)
  return config_files.load_config('finetune_glue.py:sst2', values)


def test_glue_learns_keeps_the_best_checkpoint_and_writes_submission(checkpoints, glue_dir,
                                                                     tmp_path, monkeypatch):
  data_dir, gold = glue_dir
  workdir = str(tmp_path / 'sst2')
  config = _glue_config(checkpoints['hf'], data_dir,
                        **{'eval.predict_test': True, 'train.learning_rate': 3e-3,
                           'train.epochs': 4})
  planned = []
  bucket_batches = batching.bucket_batches

  def spy(features, batch_size, buckets, shuffle=False, **kw):
    planned.append((shuffle, kw.get('window_batches', 50)))
    return bucket_batches(features, batch_size, buckets, shuffle=shuffle, **kw)

  monkeypatch.setattr(batching, 'bucket_batches', spy)
  result = finetune.finetune(config, workdir)
  # Training batches are uniform random draws by default, as in the recipe's reference
  # implementations (run_classifier.py, transformers' Trainer); evaluation may sort.
  assert {w for shuffled, w in planned if shuffled} == {1}

  assert result['task'] == 'sst2' and result['main_metric'] == 'accuracy'
  assert result['score'] >= 0.9, result
  with open(os.path.join(workdir, 'metrics.json')) as f:
    assert json.load(f) == result
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    log = [json.loads(line) for line in f]
  dev = [r for r in log if r.get('split') == 'dev']
  assert [r['epoch'] for r in dev] == [1, 2, 3, 4]
  assert result['score'] == max(r['accuracy'] for r in dev)
  assert result['epoch'] == next(r['epoch'] for r in dev if r['accuracy'] == result['score'])
  assert any(r.get('loss') for r in log)
  assert glob.glob(os.path.join(workdir, 'events.out.tfevents.*'))  # TensorBoard.

  # Only the best epoch's checkpoint is kept, and `bert-jax predict` on the dev file scores
  # what metrics.json says.
  assert os.listdir(os.path.join(workdir, 'checkpoints')) == [str(result['step'])]
  config_ft, params = pretrained.load_pretrained(workdir)
  assert set(params) == {'bert', 'classifier'}
  output = str(tmp_path / 'dev_predictions.jsonl')
  env = dict(os.environ, PYTHONPATH=REPO)
  cmd = processes.python(env) + [
      '-m', 'bert_jax.cli', 'predict', f'--workdir={workdir}',
      f'--input={os.path.join(data_dir, "SST-2", "dev.tsv")}', f'--output={output}']
  proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  summary = json.loads(proc.stdout.strip().splitlines()[-1])
  assert summary['metrics']['accuracy'] == result['score']
  with open(output) as f:
    rows = [json.loads(line) for line in f]
  labels = [e.label for e in glue.read_task('sst2', data_dir, 'dev')]
  assert len(rows) == len(labels) == summary['examples']
  assert np.mean([r['label'] == l for r, l in zip(rows, labels)]) == result['score']
  assert all(abs(sum(r['probabilities'].values()) - 1) < 1e-5 for r in rows)
  assert all(r['probabilities'][r['label']] == max(r['probabilities'].values()) for r in rows)
  # The same sentences as JSONL (no labels): the same predicted labels.
  texts = str(tmp_path / 'dev.jsonl')
  with open(texts, 'w') as f:
    f.writelines(json.dumps({'sentence': e.text_a}) + '\n'
                 for e in glue.read_task('sst2', data_dir, 'dev'))
  unlabelled = predict.predict(workdir, texts, str(tmp_path / 'jsonl_predictions.jsonl'))
  assert 'metrics' not in unlabelled
  with open(unlabelled['output']) as f:
    assert [json.loads(line)['label'] for line in f] == [r['label'] for r in rows]
  # The run wrote its best epoch's dev predictions too: the labels `predict` gives.
  with open(os.path.join(workdir, 'predictions', 'dev.tsv')) as f:
    lines = f.read().splitlines()
  assert lines[0] == 'index\tprediction'
  assert [line.split('\t') for line in lines[1:]] == [[str(i), r['label']]
                                                       for i, r in enumerate(rows)]

  # The test set in GLUE's submission format, scored by the rule that made it.
  with open(os.path.join(workdir, 'predictions', 'SST-2.tsv')) as f:
    lines = f.read().splitlines()
  assert lines[0] == 'index\tprediction'
  rows = [line.split('\t') for line in lines[1:]]
  assert [int(i) for i, _ in rows] == list(range(len(gold)))
  assert np.mean([int(p) == g for (_, p), g in zip(rows, gold)]) >= 0.9

  # Rerunning a finished run gives its result again, and trains nothing.
  assert finetune.finetune(config, workdir) == result
  assert os.listdir(os.path.join(workdir, 'checkpoints')) == [str(result['step'])]


def _dev_rows(workdir):
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    rows = [json.loads(line) for line in f]
  return [r for r in rows if r.get('split') == 'dev'], [r['step'] for r in rows if 'loss' in r]


def _losses(workdir):
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    return [row['loss'] for row in map(json.loads, f) if 'loss' in row]


def test_resume_and_sigterm_end_as_an_uninterrupted_run(checkpoints, tmp_path, monkeypatch,
                                                        caplog):
  """A run stopped inside an epoch (train.stop_at_step, or SIGTERM) saves where it stopped;
  rerunning the same call continues at that step and ends with exactly the metrics, best epoch
  and checkpoint of an uninterrupted run, as does one whose latest checkpoint is corrupt (it
  resumes from the one before). The task data lies on a non-local filesystem (TensorFlow's
  ram://, standing in for Cloud Storage)."""
  data_dir = 'ram://bert_jax_finetune_test/glue'
  rng = random.Random(3)
  for split, n in (('train', 64), ('dev', 32)):
    labels = [rng.randint(0, 1) for _ in range(n)]
    fileio.gfile().makedirs(f'{data_dir}/SST-2')
    with fileio.gfile().GFile(f'{data_dir}/SST-2/{split}.tsv', 'w') as f:
      f.write('sentence\tlabel\n' + ''.join(f'{_sentence(rng, l)}\t{l}\n' for l in labels))
  # 4 steps an epoch; a checkpoint every 3 steps as well as after each epoch. One length (no
  # buckets): one compiled step per run.
  settings = {'train.learning_rate': 3e-3, 'train.epochs': 2, 'checkpoint.every_steps': 3,
              'log.every_steps': 1, 'data.buckets': ()}
  full = finetune.finetune(_glue_config(checkpoints['bert_jax'], data_dir, **settings),
                           str(tmp_path / 'full'))
  full_dev, full_steps = _dev_rows(str(tmp_path / 'full'))
  assert [r['epoch'] for r in full_dev] == [1, 2] and full_steps == list(range(1, 9))

  # Stopped at step 6 (epoch 2): its checkpoint and the best epoch's so far are kept.
  stopped = str(tmp_path / 'stopped')
  assert finetune.finetune(_glue_config(checkpoints['bert_jax'], data_dir,
                                        **settings, **{'train.stop_at_step': 6}), stopped) is None
  assert run_files.checkpoint_steps(stopped) == [4, 6]
  assert _dev_rows(stopped)[1] == list(range(1, 7))
  # The same stopped run with step 6's largest array file cut in half: fine-tuning resumes
  # through restore_or_init as pre-training does, so step 6 is named, moved aside and the run
  # redoes steps 5-8 from step 4, ending as the uninterrupted run.
  corrupt = str(tmp_path / 'corrupt')
  shutil.copytree(stopped, corrupt)
  latest = os.path.join(corrupt, ckpt_lib.CHECKPOINT_DIR, '6')
  data_files = sorted(glob.glob(os.path.join(latest, 'params', '**', 'd', '*'), recursive=True),
                      key=os.path.getsize)
  with open(data_files[-1], 'r+b') as f:
    f.truncate(os.path.getsize(data_files[-1]) // 2)
  with caplog.at_level('WARNING'):
    assert finetune.finetune(_glue_config(checkpoints['bert_jax'], data_dir, **settings),
                             corrupt) == full
  assert any(f'Checkpoint {latest} cannot be read' in r.getMessage() for r in caplog.records)
  assert os.path.isdir(latest + '.corrupt')
  assert _dev_rows(corrupt) == (full_dev, full_steps)
  # Resumed with another data.max_seq_length: warned of, as pre-training warns (here it stops
  # again at once, at step 6).
  longer = str(tmp_path / 'longer')
  shutil.copytree(stopped, longer)
  caplog.clear()
  with caplog.at_level('WARNING'):
    assert finetune.finetune(_glue_config(
        checkpoints['bert_jax'], data_dir, **settings,
        **{'train.stop_at_step': 6, 'data.max_seq_length': 64}), longer) is None
  assert any(r.getMessage() == 'Resuming at step 6 with data.max_seq_length changed (32 -> 64) '
             'since its checkpoint was saved: the rest of the run trains and evaluates at the '
             'new length' for r in caplog.records), [r.getMessage() for r in caplog.records]
  resumed = finetune.finetune(_glue_config(checkpoints['bert_jax'], data_dir, **settings),
                              stopped)
  assert resumed == full
  assert run_files.checkpoint_steps(stopped) == [full['step']]
  assert _dev_rows(stopped) == (full_dev, full_steps)

  # SIGTERM after step 2 (epoch 1): the run saves step 2 and stops (Preempted); the rerun
  # finishes it.
  log_train = monitor.MetricsLog.train

  def train_then_sigterm(self, step, scalars, **extra):
    log_train(self, step, scalars, **extra)
    if step == 2:
      signal.raise_signal(signal.SIGTERM)
  monkeypatch.setattr(monitor.MetricsLog, 'train', train_then_sigterm)
  signalled = str(tmp_path / 'signalled')
  config = _glue_config(checkpoints['bert_jax'], data_dir, **settings)
  with pytest.raises(errors.Preempted, match='stopped by SIGTERM: saved step 2; rerun'):
    finetune.finetune(config, signalled)
  assert run_files.checkpoint_steps(signalled) == [2]
  monkeypatch.setattr(monitor.MetricsLog, 'train', log_train)
  assert finetune.finetune(config, signalled) == full
  assert _dev_rows(signalled) == (full_dev, full_steps)

  # SIGTERM as epoch 1's evaluation starts: the evaluation is dropped (the notice is too short
  # for a real dev set) and step 4 saved with it still to do; the rerun evaluates epoch 1
  # first and ends as the uninterrupted run.
  predict_rows = batching.predict_rows

  def sigterm_then_predict(*args, **kwargs):
    monkeypatch.setattr(batching, 'predict_rows', predict_rows)
    signal.raise_signal(signal.SIGTERM)
    return predict_rows(*args, **kwargs)
  monkeypatch.setattr(batching, 'predict_rows', sigterm_then_predict)
  in_eval = str(tmp_path / 'in_eval')
  with pytest.raises(errors.Preempted, match='stopped by SIGTERM: saved step 4; rerun'):
    finetune.finetune(config, in_eval)
  # Step 3 is kept until step 4's save is committed (at the next save, or at the end).
  assert run_files.checkpoint_steps(in_eval) == [3, 4]
  assert _dev_rows(in_eval) == ([], [1, 2, 3, 4])
  assert finetune.finetune(config, in_eval) == full
  assert _dev_rows(in_eval) == (full_dev, full_steps)



def test_fp8_finetuning_resumes_exactly_and_keeps_scales_out_of_the_weights(checkpoints,
                                                                             tmp_path):
  """model.matmul_precision='fp8' in fine-tuning: the pre-trained encoder gets fresh FP8
  scales, a run stopped at step 3 resumes to the uninterrupted run's metrics, losses and
  weights exactly, its checkpoints hold the scales beside the optimizer state, and what is
  kept as weights (the best epoch's params) holds none."""
  data_dir = str(tmp_path / 'glue')
  rng = random.Random(5)
  for split, n in (('train', 64), ('dev', 32)):
    _write_lines(os.path.join(data_dir, 'SST-2', f'{split}.tsv'), ['sentence\tlabel'] + [
        f'{_sentence(rng, l)}\t{l}' for l in (rng.randint(0, 1) for _ in range(n))])
  settings = {'train.learning_rate': 3e-3, 'train.epochs': 1, 'checkpoint.every_steps': 3,
              'log.every_steps': 1, 'data.buckets': (), 'model.matmul_precision': 'fp8'}
  full = finetune.finetune(_glue_config(checkpoints['bert_jax'], data_dir, **settings),
                           str(tmp_path / 'full'))
  stopped = str(tmp_path / 'stopped')
  finetune.finetune(_glue_config(checkpoints['bert_jax'], data_dir,
                                 **settings, **{'train.stop_at_step': 3}), stopped)
  step_dir = os.path.join(stopped, ckpt_lib.CHECKPOINT_DIR, '3')
  assert {'fp8_scales', 'meta', 'opt_state', 'params'} <= set(os.listdir(step_dir))
  assert finetune.finetune(_glue_config(checkpoints['bert_jax'], data_dir, **settings),
                           stopped) == full
  assert _losses(stopped) == _losses(str(tmp_path / 'full'))
  _, ours = pretrained.load_pretrained(str(tmp_path / 'full'))
  _, resumed = pretrained.load_pretrained(stopped)
  for (path, a), (_, b) in zip(jax.tree_util.tree_leaves_with_path(ours),
                               jax.tree_util.tree_leaves_with_path(resumed)):
    np.testing.assert_array_equal(a, b, err_msg=jax.tree_util.keystr(path))
  assert not [p for p, _ in jax.tree_util.tree_leaves_with_path(ours)
              if 'fp8' in jax.tree_util.keystr(p) or 'amax' in jax.tree_util.keystr(p)]

def test_sigterm_before_the_first_step_stops_at_once(checkpoints, tmp_path, monkeypatch):
  """SIGTERM while the task data is read, or while a step compiles (one that would take 10
  minutes), stops the run at once: nothing new to save, no checkpoint, the lock released."""
  data_dir = _write_sst2(str(tmp_path / 'glue'), seed=5)
  config = _glue_config(checkpoints['bert_jax'], data_dir)
  signalled_at = []

  def sigterm():
    signalled_at.append(time.time())
    signal.raise_signal(signal.SIGTERM)

  make_task = finetune.task_table.make_task

  def sigterm_then_make_task(*args, **kwargs):
    sigterm()
    return make_task(*args, **kwargs)
  monkeypatch.setattr(finetune.task_table, 'make_task', sigterm_then_make_task)
  reading = str(tmp_path / 'reading')
  with pytest.raises(errors.Preempted, match='before the first step'):
    finetune.finetune(config, reading)
  monkeypatch.setattr(finetune.task_table, 'make_task', make_task)
  assert run_files.checkpoint_steps(reading) == []

  released = threading.Event()

  def sigterm_then_endless_compile(self, *args, **kwargs):
    sigterm()
    released.wait(600)
    raise RuntimeError('this compile was abandoned')
  monkeypatch.setattr(jax.stages.Lowered, 'compile', sigterm_then_endless_compile)
  compiling = str(tmp_path / 'compiling')
  try:
    with pytest.raises(errors.Preempted, match='before the first step'):
      finetune.finetune(config, compiling)
    assert time.time() - signalled_at[-1] < 5
  finally:
    released.set()
  assert run_files.checkpoint_steps(compiling) == []
  for workdir in (reading, compiling):
    assert not os.path.exists(os.path.join(workdir, run_lock.LOCK_FILE))


def _write_sst2(data_dir, seed, sizes=(('train', 64), ('dev', 32))):
  """A small SST-2 (train and dev) in a local folder that subprocesses can read too."""
  rng = random.Random(seed)
  for split, n in sizes:
    labels = [rng.randint(0, 1) for _ in range(n)]
    _write_lines(os.path.join(data_dir, 'SST-2', f'{split}.tsv'),
                 ['sentence\tlabel'] + [f'{_sentence(rng, l)}\t{l}' for l in labels])
  return data_dir


def _finetune_processes(workdir, settings, cache_dir, num_processes=2, sigterm_last=False):
  """`bert-jax finetune` as `num_processes` processes of 2 fake CPU devices each, gloo
  collectives on loopback; waits for them and fails with their stderr if one fails.
  `sigterm_last`: SIGTERM to the last process once a training step is logged; every process
  must then exit with EXIT_PREEMPTED."""
  port = processes.free_port()
  flags = [f'--config.{k}={v}' for k, v in settings.items()]
  # Output goes to files: a process blocked on a full pipe would stall the collective steps of
  # the others while this test waits for one at a time.
  logs = [[open(f'{workdir}.{i}.{kind}', 'w+', encoding='utf-8') for kind in ('out', 'err')]
          for i in range(num_processes)]
  env = processes.env(cache_dir, devices=2)
  procs = [subprocess.Popen(
      processes.python(env) + [
          '-m', 'bert_jax.cli', 'finetune', '--config=finetune_glue:sst2', f'--workdir={workdir}',
          f'--coordinator_address=127.0.0.1:{port}', f'--num_processes={num_processes}',
          f'--process_id={i}'] + flags,
      cwd=REPO, env=env, stdout=out, stderr=err, text=True)
      for i, (out, err) in enumerate(logs)]

  def sigterm():
    while all(p.poll() is None for p in procs):
      if os.path.exists(os.path.join(workdir, 'metrics.jsonl')) and _losses(workdir):
        procs[-1].send_signal(signal.SIGTERM)
        return
      time.sleep(0.05)
  if sigterm_last:
    threading.Thread(target=sigterm, daemon=True).start()
  outputs, timed_out = [], False
  for proc, files in zip(procs, logs):
    try:
      proc.wait(timeout=300)
    except subprocess.TimeoutExpired:
      timed_out = True
      for p in procs:
        p.kill()
      proc.wait()
    for f in files:
      f.seek(0)
    outputs.append(tuple(f.read() for f in files))
    for f in files:
      f.close()
  if timed_out:
    pytest.fail('fine-tuning processes timed out:\n' + '\n'.join(e[-5000:] for _, e in outputs))
  for i, (proc, (_, err)) in enumerate(zip(procs, outputs)):
    expected = errors.EXIT_PREEMPTED if sigterm_last else 0
    assert proc.returncode == expected, f'process {i}:\n{err[-5000:]}'
  return [out for out, _ in outputs]


def test_two_processes_match_one_and_resume(checkpoints, tmp_path):
  """`bert-jax finetune` as two processes (2 CPU devices each, gloo on loopback) trains like one
  process on the same global batches: every process plans the same batches and feeds its own
  rows of them. The pair is first stopped by a SIGTERM to process 1 alone (as a scheduler may
  deliver it to one host): both processes must stop after the same step and save it, or one
  would enter the collective save while the other trains on. Resumed, the pair ends with the
  one-process run's losses, dev metrics and metrics.json.

  Dropout is on: its bits come from one key folded with the step, drawn for the global batch
  inside the jitted step, so they do not depend on how the batch is split over processes or
  devices (the reference runs on this process's 8 devices). Losses agree to float32
  reduction-order noise (rtol 1e-5; the two processes' rows swapped in the global batch, so
  meeting other dropout masks, moved them by about 1%); dev predictions are argmaxes of logits
  that agree to that noise, so the dev metrics agree exactly.
  """
  data_dir = _write_sst2(str(tmp_path / 'glue'), seed=4)
  # 4 steps an epoch, 2 epochs; one length (no buckets): one compiled train step.
  settings = {'train.init_checkpoint': checkpoints['bert_jax'], 'task.data_dir': data_dir,
              'data.max_seq_length': 32, 'data.buckets': '()', 'train.batch_size': 16,
              'eval.batch_size': 32, 'train.learning_rate': 3e-3, 'train.epochs': 2,
              'checkpoint.every_steps': 3, 'log.every_steps': 1, 'log.progress': False}
  one = str(tmp_path / 'one')
  expected = finetune.finetune(config_files.load_config(
      'finetune_glue.py:sst2', dict(settings, **{'data.buckets': ()})), one)

  two, cache = str(tmp_path / 'two'), str(tmp_path / 'jax_cache')
  outputs = _finetune_processes(two, settings, cache, sigterm_last=True)
  stopped = re.search(r'stopped at step (\d+) of 8', outputs[0])
  assert stopped, f'the run ended before it could be stopped:\n{outputs[0]}'
  assert not os.path.exists(os.path.join(two, 'metrics.json'))
  assert max(run_files.checkpoint_steps(two)) == int(stopped.group(1))
  outputs = _finetune_processes(two, settings, cache)
  assert 'best epoch' in outputs[0] and 'best epoch' not in outputs[1]  # Process 0 reports.

  with open(os.path.join(two, 'metrics.json')) as f:
    result = json.load(f)
  assert result == expected
  assert run_files.checkpoint_steps(two) == [expected['step']]
  dev_two, steps_two = _dev_rows(two)
  dev_one, steps_one = _dev_rows(one)
  assert steps_two == steps_one == list(range(1, 9))  # Each step logged once.
  assert dev_two == dev_one and [r['epoch'] for r in dev_one] == [1, 2]
  np.testing.assert_allclose(_losses(two), _losses(one), rtol=1e-5)


def test_squad_runs_end_to_end(checkpoints, tmp_path):
  rng = random.Random(1)
  paragraphs, qids = [], []
  for i in range(20):
    who = rng.choice(NAMES)
    # Some contexts are longer than one window (64 tokens, 32 apart).
    filler = ' '.join(rng.choice(FILLER[:12]) for _ in range(rng.choice([4, 60])))
    context = f'{filler} the movie was made by {who} and the plot was dull .'
    qids.append(f'q{i}')
    paragraphs.append({'context': context, 'qas': [{
        'id': f'q{i}', 'question': 'who made the movie ?',
        'answers': [{'text': who, 'answer_start': context.index(f'by {who}') + 3}]}]})
  data_dir = str(tmp_path / 'squad')
  os.makedirs(data_dir)
  for name, part in (('train-v1.1.json', paragraphs[:16]), ('dev-v1.1.json', paragraphs[16:])):
    with open(os.path.join(data_dir, name), 'w') as f:
      json.dump({'version': '1.1', 'data': [{'title': 't', 'paragraphs': part}]}, f)
  config = config_files.load_config('finetune_squad.py:v1', {
      'train.init_checkpoint': checkpoints['bert_jax'], 'task.data_dir': data_dir,
      'data.max_seq_length': 64,
      'data.buckets': (), 'task.doc_stride': 32, 'task.max_query_length': 16, 'train.epochs': 1,
      'train.batch_size': 8, 'eval.batch_size': 8, 'log.progress': False,
      # No dropout: its random bits double the step's compile time, and this run only has to
      # run (the GLUE test trains with dropout).
      'model.hidden_dropout_prob': 0.0, 'model.attention_probs_dropout_prob': 0.0})
  workdir = str(tmp_path / 'run')
  result = finetune.finetune(config, workdir)

  assert result['main_metric'] == 'f1' and set(result['dev']) >= {'exact', 'f1'}
  assert 0 <= result['score'] <= 100 and result['dev']['total'] == 4
  with open(os.path.join(workdir, 'metrics.json')) as f:
    assert json.load(f)['score'] == result['score']
  with open(os.path.join(workdir, 'predictions', 'predictions.json')) as f:
    predictions = json.load(f)
  assert sorted(predictions) == qids[16:]
  assert all(isinstance(p, str) for p in predictions.values())
  assert os.path.exists(os.path.join(workdir, 'predictions', 'nbest_predictions.json'))

  # `bert-jax predict` on the dev file: the run's answers and dev scores; on the same questions
  # without answers (new input), the same answers and no scores.
  dev_file = os.path.join(data_dir, 'dev-v1.1.json')
  output = str(tmp_path / 'answers.json')
  summary = predict.predict(workdir, dev_file, output)
  assert summary['examples'] == 4 and summary['metrics'] == result['dev']
  with open(output) as f:
    assert json.load(f) == predictions
  with open(summary['files']['nbest']) as f:
    nbest = json.load(f)
  assert [n[0]['text'] for n in map(nbest.get, qids[16:])] == [predictions[q] for q in qids[16:]]
  unanswered = {'version': '1.1', 'data': [{'title': 't', 'paragraphs': [
      dict(p, qas=[{'id': q['id'], 'question': q['question']} for q in p['qas']])
      for p in paragraphs[16:]]}]}
  new_input = str(tmp_path / 'questions.json')
  with open(new_input, 'w') as f:
    json.dump(unanswered, f)
  again = predict.predict(workdir, new_input, str(tmp_path / 'new_answers.json'), batch_size=3)
  assert 'metrics' not in again
  with open(again['output']) as f:
    assert json.load(f) == predictions
  with pytest.raises(errors.UserError, match='--input_format=conll does not fit a squad model'):
    predict.predict(workdir, new_input, output, input_format='conll')

  # A workdir of an earlier bert_jax (its config.json without config.kind, the task's keys at
  # the top level): read in today's keys, by predict and by a rerun of the finished run.
  old = str(tmp_path / 'run_old')
  shutil.copytree(workdir, old)
  record = fileio.read_json(os.path.join(old, 'config.json'))
  task = record.pop('task')
  assert record.pop('kind') == 'finetune' and task['doc_stride'] == 32
  fileio.write_json(os.path.join(old, 'config.json'), dict(record, task=task.pop('name'), **task))
  assert predict.predict(old, dev_file, str(tmp_path / 'old.json'))['metrics'] == result['dev']
  assert finetune.finetune(config, old)['score'] == result['score']

  # The transformers class of the head (what `convert --format=hf` names), from its module.
  assert fileio.read_json(os.path.join(workdir, 'task.json'))['hf_architecture'] == (
      'BertForQuestionAnswering')
  # The same weights read as a SQuAD 2.0 model: no-answer odds beside the answers, 2.0 metrics.
  v2 = str(tmp_path / 'run_v2')
  shutil.copytree(workdir, v2)
  fileio.write_json(os.path.join(v2, 'task.json'),
                      dict(fileio.read_json(os.path.join(v2, 'task.json')), version_2=True))
  summary = predict.predict(v2, dev_file, str(tmp_path / 'answers_v2.json'))
  with open(summary['files']['null_odds']) as f:
    assert sorted(json.load(f)) == qids[16:]
  assert summary['files']['null_odds'].endswith('answers_v2.null_odds.json')
  assert {'best_exact', 'best_f1'} <= set(summary['metrics'])


def _conll(rng, n):
  lines = ['-DOCSTART- -X- -X- O', '']
  for _ in range(n):
    for word in rng.sample(FILLER[:12], 3) + [rng.choice(NAMES), 'w1', 'w2', 'was', 'dull']:
      tag = ('B-PER' if word in NAMES else 'B-ORG' if word == 'w1' else
             'I-ORG' if word == 'w2' else 'O')
      lines.append(f'{word} X X {tag}')
    lines.append('')
  return lines


def test_ner_sweep_through_the_cli(checkpoints, tmp_path):
  """`bert-jax finetune --sweep`: one run per rate, each with dev/test CoNLL files, and the best
  rate reported."""
  rng = random.Random(2)
  data_dir = str(tmp_path / 'conll')
  for name, n in (('train.txt', 24), ('valid.txt', 6), ('test.txt', 5)):
    _write_lines(os.path.join(data_dir, name), _conll(rng, n))
  workdir = str(tmp_path / 'ner')
  env = dict(os.environ, PYTHONPATH=REPO)
  cmd = processes.python(env) + [
      '-m', 'bert_jax.cli', 'finetune', '--config=configs/finetune_ner.py',
      f'--config.train.init_checkpoint={checkpoints["bert_jax"]}',
      f'--config.task.data_dir={data_dir}', '--config.train.epochs=1',
      '--config.train.batch_size=8', '--config.data.max_seq_length=16',
      '--config.data.buckets=()', '--config.eval.predict_test=True', '--config.log.progress=False',
      '--config.model.hidden_dropout_prob=0', '--config.model.attention_probs_dropout_prob=0',
      f'--workdir={workdir}', '--sweep', '--learning_rates=1e-3,5e-4']
  proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  summary = json.loads(proc.stdout.strip().splitlines()[-1])

  with open(os.path.join(workdir, 'sweep.json')) as f:
    assert json.load(f) == summary
  assert set(summary['runs']) == {'0.001', '0.0005'}
  best = max(summary['runs'], key=lambda lr: summary['runs'][lr]['score'])
  assert summary['best_learning_rate'] == float(best)
  assert summary['best_score'] == summary['runs'][best]['score']
  assert f'best f1 {summary["best_score"]:.4f} at learning rate' in proc.stdout
  for lr in ('0.001', '0.0005'):
    run = os.path.join(workdir, f'lr_{lr}')
    with open(os.path.join(run, 'metrics.json')) as f:
      metrics = json.load(f)
    assert metrics['learning_rate'] == float(lr) and metrics['main_metric'] == 'f1'
    assert set(metrics) >= {'dev', 'test'} and 'precision' in metrics['test']
    for split, sentences in (('dev', 6), ('test', 5)):
      with open(os.path.join(run, 'predictions', f'{split}.conll')) as f:
        blocks = f.read().strip().split('\n\n')
      assert len(blocks) == sentences
      assert all(len(line.split()) == 3 for line in blocks[0].splitlines())  # word gold pred

  # `bert-jax predict` with the best run: on the dev file, the run's tags and dev scores; on the
  # same sentences as plain text (a sentence per line), the same tags.
  run = summary['best_workdir']
  with open(os.path.join(run, 'metrics.json')) as f:
    dev_scores = json.load(f)['dev']
  output = str(tmp_path / 'dev.conll')
  tagged = predict.predict(run, os.path.join(data_dir, 'valid.txt'), output)
  assert tagged['examples'] == 6 and tagged['metrics'] == dev_scores
  with open(output) as f, open(os.path.join(run, 'predictions', 'dev.conll')) as g:
    assert f.read() == g.read()
  sentences = [s.words for s in ner.read_conll(os.path.join(data_dir, 'valid.txt'))]
  text = _write_lines(str(tmp_path / 'dev.txt'), [' '.join(w) for w in sentences])
  plain = predict.predict(run, text, str(tmp_path / 'text.conll'))
  assert 'metrics' not in plain
  with open(plain['output']) as f:
    blocks = [b.splitlines() for b in f.read().strip().split('\n\n')]
  with open(output) as f:
    gold_blocks = [b.splitlines() for b in f.read().strip().split('\n\n')]
  assert [[l.split() for l in b] for b in blocks] == [
      [[l.split()[0], l.split()[2]] for l in b] for b in gold_blocks]


def test_length_sort_window_must_be_positive(checkpoints, glue_dir, tmp_path):
  # Loading the config refuses it (config_checks); one changed after loading meets finetune's
  # own check.
  with pytest.raises(errors.UserError, match=r'config\.train\.length_sort_window=0'):
    _glue_config(checkpoints['hf'], glue_dir[0], **{'train.length_sort_window': 0})
  config = _glue_config(checkpoints['hf'], glue_dir[0])
  config.train.length_sort_window = 0
  with pytest.raises(errors.UserError, match=r'config\.train\.length_sort_window=0'):
    finetune.finetune(config, str(tmp_path / 'run'))


def test_a_workdir_in_use_is_refused(checkpoints, glue_dir, tmp_path):
  # A live run (this process) holds the workdir: a second fine-tuning run there, which would
  # resume from and overwrite the same checkpoints, is refused before it loads anything.
  workdir = str(tmp_path / 'run')
  os.makedirs(workdir)
  lock = os.path.join(workdir, run_lock.LOCK_FILE)
  live = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])
  try:
    with open(lock, 'w') as f:
      json.dump(dict(pid=live.pid, host=socket.gethostname(), token='other',
                     started='earlier', heartbeat=time.time()), f)
    config = _glue_config(checkpoints['hf'], glue_dir[0])
    with pytest.raises(errors.UserError, match=rf'is in use by another run \(pid {live.pid} '):
      finetune.finetune(config, workdir)
    assert fileio.read_json(lock)['pid'] == live.pid  # The live run's lock stays.
  finally:
    live.kill()
    live.wait()
  assert not glob.glob(os.path.join(workdir, 'checkpoints', '*'))  # Nothing was written.


def test_vocab_that_does_not_match_the_checkpoint(checkpoints, glue_dir, tmp_path):
  data_dir, _ = glue_dir
  bigger = _write_lines(str(tmp_path / 'vocab.txt'), VOCAB + [f'extra{i}' for i in range(9)])
  config = _glue_config(checkpoints['bert_jax'], data_dir, **{'data.vocab_file': bigger})
  with pytest.raises(ValueError, match=rf'has {len(VOCAB) + 9} tokens but '
                     rf'config.train.init_checkpoint=.* has vocab_size {len(VOCAB)} .*use the '
                     'vocabulary the checkpoint was trained with'):
    finetune.finetune(config, str(tmp_path / 'a'))
  # A checkpoint folder whose own vocab.txt is not the model's.
  folder = str(tmp_path / 'ckpt')
  config_ = pretrained.load_pretrained(checkpoints['hf'])
  convert.export_hf(*config_, folder)
  _write_lines(os.path.join(folder, 'vocab.txt'), VOCAB + ['extra'])
  with pytest.raises(ValueError, match=rf'vocab.txt has {len(VOCAB) + 1} tokens but '
                     rf'vocab_size is {len(VOCAB)}'):
    finetune.finetune(_glue_config(folder, data_dir), str(tmp_path / 'b'))
  with pytest.raises(ValueError, match='init_checkpoint is empty'):
    finetune.finetune(_glue_config('', data_dir), str(tmp_path / 'c'))


def test_a_workdir_of_another_task_is_refused_and_another_length_warned(checkpoints, glue_dir,
                                                                       tmp_path, caplog,
                                                                       monkeypatch):
  """A finished MRPC run rerun with another task's config printed MRPC's score as the new
  task's, with exit status 0: refused, before anything is written (the command line too, as
  `bert-jax finetune` sets it). A finished (or resumed) run given another data.max_seq_length
  is warned of, as pre-training warns of a changed input."""
  monkeypatch.setattr(publish, 'COMMAND_LINE', ['finetune', '--config=finetune_glue:sst2'])
  workdir = str(tmp_path / 'run')
  os.makedirs(workdir)
  config_path, metrics_path = (os.path.join(workdir, name)
                               for name in ('config.json', 'metrics.json'))
  fileio.write_json(config_path, {'kind': 'finetune', 'task': {'name': 'mrpc'},
                                  'data': {'max_seq_length': 64}})
  best = {'task': 'mrpc', 'main_metric': 'f1', 'score': 0.8125, 'epoch': 1, 'step': 4}
  fileio.write_json(metrics_path, best)
  config = _glue_config(checkpoints['bert_jax'], glue_dir[0])  # SST-2's, length 32.
  with pytest.raises(errors.UserError, match=rf'^--workdir={workdir} holds a fine-tuning run of '
                     r'task mrpc \(its config.json\), not sst2: fine-tune sst2 into another '
                     '--workdir'):
    finetune.finetune(config, workdir)
  assert sorted(os.listdir(workdir)) == ['config.json', 'metrics.json']
  fileio.write_json(config_path, {'kind': 'finetune', 'task': {'name': 'sst2'},
                                  'data': {'max_seq_length': 64}})
  best = dict(best, task='sst2', main_metric='accuracy')
  fileio.write_json(metrics_path, best)
  with caplog.at_level('WARNING'):
    assert finetune.finetune(config, workdir) == best
  assert any(r.getMessage() == 'The run in this workdir had finished with data.max_seq_length '
             "changed (64 -> 32) since its checkpoint was saved: its result stands; this "
             "config's is not used" for r in caplog.records)


def test_bad_task_files_name_the_file_and_line(checkpoints, tmp_path):
  """Readers' errors reach the user before any training, naming what to fix."""
  glue_root = str(tmp_path / 'glue')
  _write_lines(os.path.join(glue_root, 'SST-2', 'train.tsv'), ['sentence\tlabel', 'good\t1'])
  _write_lines(os.path.join(glue_root, 'SST-2', 'dev.tsv'), ['sentence\tscore', 'good\t1'])
  with pytest.raises(ValueError, match=r"SST-2/dev.tsv: header \(line 1\) has no column "
                     r"'label'"):
    finetune.finetune(_glue_config(checkpoints['bert_jax'], glue_root), str(tmp_path / 'a'))
  _write_lines(os.path.join(glue_root, 'SST-2', 'dev.tsv'), ['sentence\tlabel', 'good\t1'])
  _write_lines(os.path.join(glue_root, 'SST-2', 'train.tsv'),
               ['sentence\tlabel', 'good\t1', 'bad movie'])
  with pytest.raises(ValueError, match=r'SST-2/train.tsv:3: expected 2 tab-separated columns'):
    finetune.finetune(_glue_config(checkpoints['bert_jax'], glue_root), str(tmp_path / 'b'))

  squad_dir = str(tmp_path / 'squad')
  _write_lines(os.path.join(squad_dir, 'train-v1.1.json'),
               ['{"data": [', '  {"title": "t" "paragraphs": []}', ']}'])
  squad_config = config_files.load_config('finetune_squad.py:v1', {
      'train.init_checkpoint': checkpoints['bert_jax'], 'task.data_dir': squad_dir,
      'data.max_seq_length': 64})
  with pytest.raises(ValueError, match=r'train-v1.1.json:2:17: not valid JSON'):
    finetune.finetune(squad_config, str(tmp_path / 'c'))
  _write_lines(os.path.join(squad_dir, 'train-v1.1.json'), [json.dumps({'data': [
      {'paragraphs': [{'context': 'a b', 'qas': [{'id': 'q1', 'answers': []}]}]}]})])
  with pytest.raises(ValueError, match=r"train-v1.1.json: data\[0\].paragraphs\[0\].qas\[0\]: "
                     r"missing key 'question'"):
    finetune.finetune(squad_config, str(tmp_path / 'd'))

  conll_dir = str(tmp_path / 'conll')
  _write_lines(os.path.join(conll_dir, 'train.txt'), ['alice B-PER', 'was O', 'dull'])
  ner_config = config_files.load_config('finetune_ner.py', {
      'train.init_checkpoint': checkpoints['bert_jax'], 'task.data_dir': conll_dir,
      'data.max_seq_length': 32})
  with pytest.raises(ValueError, match=r'train.txt:3: 1 columns where earlier lines have 2'):
    finetune.finetune(ner_config, str(tmp_path / 'e'))
  with pytest.raises(ValueError, match="config.task.name='squad': expected a GLUE task"):
    finetune.finetune(config_files.load_config('finetune_glue.py:squad', {
        'train.init_checkpoint': checkpoints['bert_jax'], 'data.max_seq_length': 32}),
        str(tmp_path / 'f'))


def test_predict_needs_a_finished_finetuning_workdir(checkpoints, tmp_path):
  data = _write_lines(str(tmp_path / 'input.jsonl'), ['{"text_a": "good"}'])
  for workdir, message in ((checkpoints['bert_jax'], 'has no task.json: not a bert_jax '
                            'fine-tuning workdir'), (str(tmp_path), 'has no metrics.json')):
    if workdir == str(tmp_path):
      fileio.write_json(str(tmp_path / 'task.json'), {'kind': 'glue'})
    with pytest.raises(errors.UserError, match=message):
      predict.predict(workdir, data, str(tmp_path / 'out.jsonl'))
