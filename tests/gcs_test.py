"""Every gs:// path of bert_jax against a Cloud Storage server on loopback (tests/gcs_server.py).

The corpus, its vocabulary, the workdirs and the fine-tuning data all live in the test bucket;
`bert-jax` subprocesses run in the server's network namespace (nothing leaves loopback). Runs are
a tiny BERT (2 layers, width 128, batch 8, sequences of 32) on a slice of the sample corpus, all
on one schedule so that a persistent compilation cache lets later runs skip their compiles.
"""

import json
import os
import re
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from bert_jax import checkpoint as ckpt_lib
from bert_jax import config_files
from bert_jax import errors
from bert_jax import fileio
from bert_jax import gcs as gcs_lib
from bert_jax import input_pipeline
from bert_jax import monitor
from bert_jax import pretraining
from bert_jax import run_lock
from bert_jax import run_files
from bert_jax import sample_corpus
from bert_jax import train
from bert_jax import vocab as vocab_lib
import gcs_server
import processes
import records
# The same tiny run as train_test's (its schedule; runs stop early with train.stop_at_step).
from train_test import TINY, TOTAL_STEPS

# The runs save every SAVE_EVERY steps and stop at REFERENCE_STEPS: two checkpoints, the last
# one the run's final save (where the outages of the tests below strike).
SAVE_EVERY = 2
REFERENCE_STEPS = 2 * SAVE_EVERY


@pytest.fixture(scope='module')
def cache(tmp_path_factory):
  return str(tmp_path_factory.mktemp('jax_cache'))


@pytest.fixture(scope='module')
def data(gcs):
  """A slice of the sample corpus (train and held-out text) and its 1,000-token vocabulary, in
  the bucket; the vocabulary is trained straight into it."""
  with open(sample_corpus.sample_corpus_path(), encoding='utf-8') as f:
    lines = f.read().splitlines()[:6000]
  train_text, eval_text = '\n'.join(lines[:5000]) + '\n', '\n'.join(lines[5000:]) + '\n'
  paths = {'input': gcs.url('corpus/train.txt'), 'eval_input': gcs.url('corpus/eval.txt'),
           'vocab_file': gcs.url('corpus/vocab.txt')}
  fileio.write_text(paths['input'], train_text)
  fileio.write_text(paths['eval_input'], eval_text)
  vocab_lib.train_wordpiece(train_text.splitlines(), paths['vocab_file'], 1000)
  return paths


def _overrides(data, **extra):
  values = dict(TINY, **{'checkpoint.every_steps': SAVE_EVERY},
                **{f'data.{k}': v for k, v in data.items()})
  values.update({k.replace('__', '.'): v for k, v in extra.items()})
  return values


def _flags(overrides):
  return [f'--config.{k}={v}' for k, v in overrides.items()]


# Runs `bert-jax pretrain` held after the logged training row of step BERT_JAX_TEST_HOLD_STEP
# until the file BERT_JAX_TEST_GO exists: the test acts (a SIGTERM, an outage) while the run
# waits, then lets it go on, so what it does lands before the next step however loaded the
# machine. (8 s of sleep after steps 2 and 3 did this before: 16 s of each such run.)
_HELD_AFTER_A_STEP = '''
import os, sys, time
from bert_jax import cli, monitor
train = monitor.MetricsLog.train
hold, go = int(os.environ['BERT_JAX_TEST_HOLD_STEP']), os.environ['BERT_JAX_TEST_GO']
def held_train(self, step, *args, **kwargs):
  train(self, step, *args, **kwargs)
  if step == hold:
    deadline = time.time() + 600  # A safety net: each test lets go, or kills the run.
    while not os.path.exists(go) and time.time() < deadline:
      time.sleep(0.05)
monitor.MetricsLog.train = held_train
cli.main(['bert-jax', 'pretrain'] + sys.argv[1:])
'''


def _env(cache, env=None):
  """A `bert-jax` subprocess's environment, with `env`'s variables set (None: unset). One CPU
  device, not the suite's 8: none of these runs is about sharding (the pair of processes has
  its own), and on one device the tiny model compiles and steps faster."""
  return {k: v for k, v in dict(processes.env(cache, devices=1), **(env or {})).items()
          if v is not None}


def _pretrain(gcs, cache, workdir, overrides, script=None, env=None):
  """`bert-jax pretrain` (or `script` with the same flags) in the server's namespace."""
  env = _env(cache, env)
  argv = processes.python(env, gcs.command) + ([script] if script else ['-m', 'bert_jax.cli',
                                                                        'pretrain'])
  return subprocess.Popen(gcs.command(argv + [f'--workdir={workdir}'] + _flags(overrides)),
                          cwd=processes.ROOT, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)


def _held_pretrain(gcs, cache, workdir, overrides, folder, step, env=None):
  """`_pretrain` held after step `step`'s logged row (_HELD_AFTER_A_STEP): (the process, a
  function that lets it go on)."""
  os.makedirs(folder, exist_ok=True)
  script, go = os.path.join(folder, 'held_after_a_step.py'), os.path.join(folder, f'go_{step}')
  with open(script, 'w') as f:
    f.write(_HELD_AFTER_A_STEP)
  proc = _pretrain(gcs, cache, workdir, overrides, script=script, env=dict(
      env or {}, BERT_JAX_TEST_HOLD_STEP=str(step), BERT_JAX_TEST_GO=go))
  return proc, lambda: open(go, 'w').close()


def _read_text(path):
  """The whole object, read through tf.io.gfile."""
  with fileio.gfile().GFile(path, 'rb') as f:
    return f.read().decode('utf-8')


def _rows(workdir):
  """(train rows, held-out rows) of a workdir's metrics.jsonl."""
  path = os.path.join(workdir, monitor.METRICS_FILE)
  if not fileio.exists(path):
    return [], []
  rows = [json.loads(line) for line in _read_text(path).splitlines() if line.strip()]
  held_out = [r.get('eval') or 'split' in r for r in rows]  # Pre-training's, fine-tuning's.
  return ([r for r, h in zip(rows, held_out) if not h], [r for r, h in zip(rows, held_out) if h])


def _losses(workdir):
  steps = [r['step'] for r in _rows(workdir)[0]]
  assert len(steps) == len(set(steps)), f'a step was logged twice: {steps}'
  return {r['step']: r['loss'] for r in _rows(workdir)[0]}


@pytest.fixture(scope='module')
def reference(gcs, cache, data):
  """An uninterrupted `bert-jax pretrain` to REFERENCE_STEPS on a gs:// workdir, with its
  corpus and vocabulary read from the bucket."""
  workdir = gcs.url('reference')
  proc = _pretrain(gcs, cache, workdir, _overrides(data, train__stop_at_step=REFERENCE_STEPS))
  out, err = processes.communicate(proc, 600)
  assert proc.returncode == 0, err[-5000:]
  return workdir, out


def test_pretrain_writes_its_workdir_to_the_bucket(reference):
  workdir, out = reference
  assert f'step {REFERENCE_STEPS}/{TOTAL_STEPS} in {workdir}' in out
  train_rows, eval_rows = _rows(workdir)
  assert [r['step'] for r in train_rows] == list(range(1, REFERENCE_STEPS + 1))
  assert all(np.isfinite(r['loss']) for r in train_rows)
  assert [r['step'] for r in eval_rows] == [REFERENCE_STEPS]
  assert run_files.checkpoint_steps(workdir) == [SAVE_EVERY, REFERENCE_STEPS]
  assert fileio.glob(os.path.join(workdir, ckpt_lib.DATA_STATE_DIR, str(REFERENCE_STEPS), '*'))
  assert fileio.glob(os.path.join(workdir, 'events.out.tfevents.*'))
  config = fileio.read_json(os.path.join(workdir, 'config.json'))
  assert config['data']['input'].startswith('gs://')
  for name in ('bert_config.json', 'vocab.txt'):
    assert fileio.exists(os.path.join(workdir, name)), name
  assert not fileio.exists(os.path.join(workdir, run_lock.LOCK_FILE))  # Released at the end.
  config, params = run_files.load_pretrained_from_workdir(workdir)
  assert config.num_hidden_layers == 2


# The short retries of the tests' processes (tests/conftest.py), named where a test relies on
# them.
_SHORT_RETRIES = processes.SHORT_GCS_RETRIES


def _down_after(gcs, proc, trigger, prefix, timeout=1500):
  """Once the run `proc` has made a request for the object `trigger` (or once `trigger()`, a
  callable, is true), every object under `prefix` answers 503 (Cloud Storage down for that
  workdir); when that happened."""
  deadline = time.time() + timeout
  while time.time() < deadline and proc.poll() is None:
    if (trigger() if callable(trigger) else
        any(trigger in q['object'] for q in gcs.requests())):
      gcs.inject([dict(object=prefix, status=503)])
      return time.time()
    time.sleep(0.2)
  proc.kill()
  out, err = proc.communicate()
  what = f'request for {trigger}' if isinstance(trigger, str) else 'trigger of the outage'
  pytest.fail(f'no {what} (returncode {proc.returncode}):\n{err[-5000:]}')


# The longest a run may take to end once its workdir's store is down, with the retries of
# _SHORT_RETRIES (each request gives up within a second): the README's bound with the default
# budget is 3 x 191 s, plus a step and the time to leave; on a loaded 2-core machine a step of
# the tiny model, an evaluation or a save takes up to tens of seconds.
_DOWN_BOUND_S = 120


def _assert_ended_by_the_outage(command, workdir, step, proc, err, seconds):
  """A rerun that resumed from `step` and met its workdir's store down (`_down_after`) ended as
  the README says: status 143 within _DOWN_BOUND_S, one line naming an object of the workdir,
  no traceback, `step` still the last committed."""
  assert proc.returncode == errors.EXIT_PREEMPTED, err[-5000:]
  assert f'Resumed from step {step}' in err, err[-5000:]
  assert re.fullmatch(
      rf'bert-jax {command}: error: {re.escape(workdir)}/\S+: Cloud Storage kept failing '
      r'\(Backend Error\) past the retries \(README: Cloud Storage\); the last (complete '
      r'checkpoint, step \d+,|committed checkpoint) is intact: rerun the same command to resume '
      'once Cloud Storage answers', err.strip().splitlines()[-1]), err[-3000:]
  assert 'Traceback' not in err, err[-5000:]
  assert seconds < _DOWN_BOUND_S, (seconds, err[-3000:])
  assert run_files.checkpoint_steps(workdir) == [step]


def _next_batches_from_data_state(workdir, overrides, count=2):
  """The `count` training batches after the tf.data position saved at step SAVE_EVERY in
  `workdir` (None: from the start), restored into the run's pipeline as the run builds it
  for a position saved without a restart (a corrupt file fails the restore), as lists."""
  config = config_files.load_config('smoke', overrides)
  phase = pretraining.parse_phases(config)[0]
  it = input_pipeline.make_iterator(train._dataset(  # pylint: disable=protected-access
      config.data.vocab_file, config.train.batch_size, phase, True))
  if workdir is not None:
    it.restore(os.path.join(workdir, ckpt_lib.DATA_STATE_DIR, str(SAVE_EVERY), 'process_0'))
  return [{k: v.tolist() for k, v in next(it).items()} for _ in range(count)]


def test_pretraining_through_faults_and_outages_at_a_save_logs_the_clean_losses(
    gcs, cache, data, reference, tmp_path):
  """The proxy answers 503 and 429 (single and in bursts) and resets connections halfway through
  uploads, on every layer's objects: tensorstore's checkpoint arrays, Orbax's metadata, the lock
  and metrics.jsonl (google-cloud-storage), TensorBoard's events and config.json (TensorFlow).
  Each layer retries. Meanwhile the arrays of the 2nd checkpoint (step 4) answer only 503, past
  tensorstore's retries (shortened here): the run ends with one line naming the folder and
  EXIT_PREEMPTED, step 2 committed and step 4 not.

  Then a rerun without the faults (held after step 3 until the outage has begun) resumes from
  step 2, and once it has logged step 3 the whole checkpoint folder answers only 503 (step 4's
  arrays and metadata, while metrics.jsonl and the rest answer): it
  ends within _DOWN_BOUND_S with one line naming an object of the workdir and EXIT_PREEMPTED,
  step 2 still the last committed. Every layer retries on the budget of GCS_RETRY_CONFIG_*:
  before, tensorstore retried a checkpoint's arrays for about 15 minutes, and an asynchronous
  save's failure surfaced only at the next save (a run whose checkpoint folder failed had not
  ended after 300 s).

  The last rerun, through the same faults as the first run and on the same short retries,
  resumes from step 2: the log holds exactly the losses of the clean reference run, and the
  same checkpoints."""
  workdir = gcs.url('faults')
  rules = [dict(object='faults/checkpoints/', status=503, every=25, burst=2),
           dict(object='faults/checkpoints/', method='POST', status='reset', every=40, limit=2),
           dict(object='faults/data_state/', status=429, every=10, limit=3),
           dict(object='faults/metrics.jsonl', status=429, every=6, burst=2),
           dict(object='faults/metrics.jsonl', path='/compose', status='lost', limit=1),
           dict(object='faults/events.out.tfevents', status=503, limit=2),
           dict(object='faults/run.lock', status=503, limit=1),
           dict(object='faults/config.json', method='POST', status='reset', limit=1)]
  outage = f'faults/checkpoints/{REFERENCE_STEPS}/params/ocdbt.process_0/'

  def faults_met(faulted):
    """Adds the faults met since the log's reset: their statuses by object (its first word)."""
    for q in gcs.requests():
      if q['status'] in (0, 429, 503) or q['status'] < 0:
        faulted.setdefault(q['object'].split('/')[1].split('.')[0], set()).add(q['status'])
    return faulted
  overrides = _overrides(data, train__stop_at_step=REFERENCE_STEPS)
  gcs.reset_log()
  gcs.inject([dict(object=outage, status=503)] + rules)
  try:
    proc = _pretrain(gcs, cache, workdir, overrides, env=_SHORT_RETRIES)
    _, err = processes.communicate(proc, 400)
  finally:
    gcs.inject([])
  assert proc.returncode == errors.EXIT_PREEMPTED, err[-5000:]
  assert err.strip().splitlines()[-1] == (
      f'bert-jax pretrain: error: gs://{gcs_server.BUCKET}/{outage}: Cloud Storage kept failing '
      '(Backend Error) past the retries (README: Cloud Storage); the last complete checkpoint, '
      f'step {SAVE_EVERY}, is intact: rerun the same command to resume once Cloud Storage '
      'answers')
  assert 'Traceback' not in err, err[-5000:]
  # Step 4's folder is there, uncommitted.
  assert run_files.checkpoint_steps(workdir) == [SAVE_EVERY]
  assert fileio.exists(os.path.join(workdir, ckpt_lib.CHECKPOINT_DIR, str(REFERENCE_STEPS)))
  # Step 2's input position, written through 429s, is the clean run's: restored, it gives the
  # same next batches. (Not its bytes: they hold the prefetch and parallel-map buffers as
  # filled at the save, which depends on timing.)
  restored = _next_batches_from_data_state(workdir, overrides)
  assert restored == _next_batches_from_data_state(reference[0], overrides)
  assert restored != _next_batches_from_data_state(None, overrides)  # The restore moved it.
  written, clean = (fileio.read_json(os.path.join(
      w, ckpt_lib.DATA_STATE_DIR, str(SAVE_EVERY), 'process_0.input.json'))
                    for w in (workdir, reference[0]))
  assert written == clean and written['restarted_at'] is None, (written, clean)
  faulted = faults_met({})  # Those of the first run and of the last (not the outage between).

  # Once a rerun (without the faults) has resumed from step 2 and logged step 3 (after it cut
  # back the first run's rows 3 and 4), the whole checkpoint folder is down.
  gcs.reset_log()
  try:
    proc, let_go = _held_pretrain(gcs, cache, workdir, overrides, str(tmp_path), SAVE_EVERY + 1,
                                  env=_SHORT_RETRIES)
    down = _down_after(gcs, proc, lambda: [r['step'] for r in _rows(workdir)[0]][-1:] == [
        SAVE_EVERY + 1], 'faults/checkpoints/')
    let_go()
    _, err = processes.communicate(proc, 900)
    ended = time.time()
  finally:
    gcs.inject([])
  _assert_ended_by_the_outage('pretrain', workdir, SAVE_EVERY, proc, err, ended - down)

  gcs.reset_log()
  gcs.inject(rules)
  try:  # The faults come at most 2 in a row: the short retries see them through.
    proc = _pretrain(gcs, cache, workdir, overrides, env=_SHORT_RETRIES)
    _, err = processes.communicate(proc, 400)
  finally:
    gcs.inject([])
  assert proc.returncode == 0, err[-5000:]
  assert f'Resumed from step {SAVE_EVERY}' in err, err[-5000:]
  faulted = faults_met(faulted)
  assert faulted.keys() >= {'checkpoints', 'data_state', 'metrics', 'events', 'run',
                            'config'}, faulted
  assert 0 in faulted['checkpoints'] and -200 in faulted['metrics'], faulted
  assert sorted(_losses(workdir)) == list(range(1, REFERENCE_STEPS + 1))
  assert _losses(workdir) == _losses(reference[0])
  assert run_files.checkpoint_steps(workdir) == run_files.checkpoint_steps(reference[0])

def _pretrain_pair(gcs, cache, workdir, overrides, script=None, env=None):
  """`bert-jax pretrain` (or `script` with the same flags) as processes 0 and 1 of two (2 CPU
  devices each, jax.distributed on loopback), in the server's namespace. gRPC (jax.distributed)
  would send its requests to the coordinator through https_proxy, the proxy of the server."""
  port = processes.free_port()
  env = dict(processes.env(cache, devices=2), no_grpc_proxy='127.0.0.1', **(env or {}))
  argv = processes.python(env, gcs.command) + ([script] if script else ['-m', 'bert_jax.cli',
                                                                        'pretrain'])
  return [subprocess.Popen(
      gcs.command(argv + [f'--workdir={workdir}', f'--coordinator_address=127.0.0.1:{port}',
                          '--num_processes=2', f'--process_id={i}'] + _flags(overrides)),
      cwd=processes.ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
      for i in range(2)]


def _ends(procs, timeout):
  """(stdout, stderr) of each process, and when each ended (time.time())."""
  ended, deadline = [None] * len(procs), time.time() + timeout
  while None in ended and time.time() < deadline:
    for i, p in enumerate(procs):
      if ended[i] is None and p.poll() is not None:
        ended[i] = time.time()
    time.sleep(0.2)
  return [processes.communicate(p, 1) for p in procs], ended


def test_an_outage_in_one_process_of_two_stops_both_with_one_line_and_143(gcs, cache, data,
                                                                       tmp_path):
  """Two processes on a gs:// workdir. First step 4's folder, which process 0 alone checks and
  makes on its main thread while process 1 waits in Orbax's barrier after it, meets 503s past
  the retries; then, on the rerun, process 1's arrays of step 4 (its own OCDBT folder) do, while
  process 0's writes succeed. Each time both stop within a bound, with EXIT_PREEMPTED (so a
  scheduler reruns the job) and one line each: the failed process names the object, the other
  says which process's part failed and names it too. (Before the processes agreed on each
  part, both ran 7 minutes waiting in two different barriers of Orbax's at the arrays, and both
  aborted after 5 minutes at the folder.) Step 2 stays committed, and the last rerun of both
  resumes from it."""
  workdir = gcs.url('pair')
  folder = f'pair/checkpoints/{REFERENCE_STEPS}'
  overrides = _overrides(data, train__stop_at_step=REFERENCE_STEPS)
  for fault, failed, part in ((dict(object=folder, method='GET'), 0, 'start'),
                              (dict(object=f'{folder}/params/ocdbt.process_1/'), 1, 'part')):
    gcs.inject([dict(fault, status=503)])
    try:
      pair = _pretrain_pair(gcs, cache, workdir, overrides, env=_SHORT_RETRIES)
      results, ended = _ends(pair, 500)
    finally:
      gcs.inject([])
    for i, (p, (_, err)) in enumerate(zip(pair, results)):
      assert p.returncode == errors.EXIT_PREEMPTED, f'process {i}:\n{err[-5000:]}'
      assert 'Traceback' not in err, f'process {i}:\n{err[-5000:]}'
    assert abs(ended[0] - ended[1]) < 60, ended
    line = (f'gs://{gcs_server.BUCKET}/{fault["object"]}: Cloud Storage kept failing (Backend '
            f'Error) past the retries (README: Cloud Storage); the last complete checkpoint, '
            f'step {SAVE_EVERY}, is intact: rerun the same command to resume once Cloud Storage '
            'answers')
    assert results[failed][1].strip().splitlines()[-1] == f'bert-jax pretrain: error: {line}'
    assert results[1 - failed][1].strip().splitlines()[-1] == (
        f'bert-jax pretrain: error: stopped because process {failed}\'s {part} of the '
        f'checkpoint save failed: {line}')
    assert run_files.checkpoint_steps(workdir) == [SAVE_EVERY]

  pair = _pretrain_pair(gcs, cache, workdir, overrides)
  results, _ = _ends(pair, 400)
  for i, (p, (_, err)) in enumerate(zip(pair, results)):
    assert p.returncode == 0, f'process {i}:\n{err[-5000:]}'
    assert f'Resumed from step {SAVE_EVERY}' in err, f'process {i}:\n{err[-5000:]}'
  assert sorted(_losses(workdir)) == list(range(1, REFERENCE_STEPS + 1))
  assert run_files.checkpoint_steps(workdir) == [SAVE_EVERY, REFERENCE_STEPS]


# Runs `bert-jax pretrain`, SIGKILLed as Orbax is about to commit step BERT_JAX_TEST_KILL_AT. On
# Cloud Storage Orbax writes a step in place and commits it by writing commit_success.txt last.
_KILLED_AT_COMMIT = '''
import os, signal, sys
from orbax.checkpoint._src.path import atomicity
from bert_jax import cli
step = os.environ['BERT_JAX_TEST_KILL_AT']
for cls in (atomicity.CommitFileTemporaryPath, atomicity.AtomicRenameTemporaryPath):
  def patch(cls=cls, finalize=cls.finalize):
    async def finalize_or_die(self, *args, **kwargs):
      if self._final_path.name == step:
        os.kill(os.getpid(), signal.SIGKILL)
      return await finalize(self, *args, **kwargs)
    cls.finalize = finalize_or_die
  patch()
cli.main(['bert-jax', 'pretrain'] + sys.argv[1:])
'''


def test_sigterm_and_sigkill_mid_save_then_rerun_log_the_uninterrupted_losses(
    gcs, cache, data, reference, tmp_path):
  """On a gs:// workdir: SIGTERM mid-run saves where it stops (the lock is in the bucket while
  it runs); a rerun SIGKILLed while step 4 is being committed leaves step 4 uncommitted; the
  next rerun resumes from the last complete checkpoint. The log ends up with exactly the
  reference run's losses, each step once."""
  workdir = gcs.url('interrupted')
  overrides = _overrides(data, checkpoint__every_steps=1000)
  # This workdir's runs keep their compiled steps in its gs:// compilation cache (the default
  # checkpoint.compilation_cache_dir), not in the suite's local one.
  own_cache = {'JAX_COMPILATION_CACHE_DIR': None,
               'JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS': None, 'JAX_LOG_COMPILES': '1'}
  proc, let_go = _held_pretrain(gcs, cache, workdir, overrides, str(tmp_path), 2, env=own_cache)
  try:
    deadline = time.time() + 400
    while len(_rows(workdir)[0]) < 2 and proc.poll() is None and time.time() < deadline:
      time.sleep(0.2)
    assert proc.poll() is None, 'the run ended before it could be interrupted'
    assert fileio.exists(os.path.join(workdir, run_lock.LOCK_FILE))
    proc.send_signal(signal.SIGTERM)
    let_go()
  except BaseException:
    proc.kill()
    raise
  out, err = processes.communicate(proc, 200)
  assert proc.returncode == errors.EXIT_PREEMPTED, err[-5000:]
  stopped = max(_losses(workdir))
  assert run_files.checkpoint_steps(workdir) == [stopped]
  assert stopped < REFERENCE_STEPS, f'the signal landed too late to test a resume ({stopped})'
  cached = [os.path.basename(p)
            for p in fileio.glob(os.path.join(workdir, 'compilation_cache', '*'))]
  assert any(e.startswith('jit_step-') for e in cached), cached

  script = tmp_path / 'killed_at_commit.py'
  script.write_text(_KILLED_AT_COMMIT)
  proc = _pretrain(gcs, cache, workdir, _overrides(data, train__stop_at_step=REFERENCE_STEPS),
                   script=str(script), env={'BERT_JAX_TEST_KILL_AT': str(REFERENCE_STEPS)})
  _, err = processes.communicate(proc, 400)
  assert proc.returncode == -signal.SIGKILL, err[-5000:]
  committed = run_files.checkpoint_steps(workdir)
  assert REFERENCE_STEPS not in committed and max(committed) >= stopped
  assert fileio.exists(os.path.join(workdir, ckpt_lib.CHECKPOINT_DIR, str(REFERENCE_STEPS)))

  proc = _pretrain(gcs, cache, workdir, _overrides(data, train__stop_at_step=REFERENCE_STEPS),
                   env=own_cache)
  _, err = processes.communicate(proc, 400)
  assert proc.returncode == 0, err[-5000:]
  assert 'Taking over the stale lock' in err
  assert "Persistent compilation cache hit for 'jit_step'" in err  # Read back from gs://.
  assert _losses(workdir) == _losses(reference[0])
  assert run_files.checkpoint_steps(workdir)[-1] == REFERENCE_STEPS


def test_pretrainings_metrics_or_input_position_down_past_the_retries_end_the_run(
    gcs, cache, data, tmp_path):
  """From the commit of step 2 on (the run held after step 3 until the fault has begun), only
  metrics.jsonl answers 503 in one run, only data_state/ (the input positions, written as each
  save starts) in another: each ends within _DOWN_BOUND_S with exit status 143 and one line
  naming an object there, and step 2 stays the committed checkpoint."""
  for name, prefix in (('metrics_down', 'metrics.jsonl'), ('position_down', 'data_state/')):
    workdir = gcs.url(name)
    overrides = _overrides(data, train__stop_at_step=REFERENCE_STEPS)
    gcs.reset_log()
    try:
      proc, let_go = _held_pretrain(gcs, cache, workdir, overrides, str(tmp_path / name),
                                    SAVE_EVERY + 1, env=_SHORT_RETRIES)
      down = _down_after(gcs, proc, f'{name}/checkpoints/{SAVE_EVERY}/commit_success.txt',
                         f'{name}/{prefix}')
      let_go()
      _, err = processes.communicate(proc, 900)
      ended = time.time()
    finally:
      gcs.inject([])
    assert proc.returncode == errors.EXIT_PREEMPTED, err[-5000:]
    assert re.fullmatch(
        rf'bert-jax pretrain: error: gs://{gcs_server.BUCKET}/{name}/{re.escape(prefix)}\S*: '
        r'Cloud Storage kept failing \(Backend Error\) past the retries \(README: Cloud '
        rf'Storage\); the last (complete checkpoint, step {SAVE_EVERY},|committed checkpoint) is '
        'intact: rerun the same command to resume once Cloud Storage answers',
        err.strip().splitlines()[-1]), err[-3000:]
    assert 'Traceback' not in err, err[-5000:]
    assert ended - down < _DOWN_BOUND_S, (ended - down, err[-3000:])
    assert run_files.checkpoint_steps(workdir) == [SAVE_EVERY]


def test_runs_started_at_once_on_a_gs_workdir_one_takes_the_lock(gcs, tmp_path):
  """Three processes race for the lock of one gs:// workdir, released at the same moment, over
  several rounds: each round exactly one holds it and the others are refused, whether the lock
  was free or left stale by a dead run on another host (then each racer tries to replace the
  same generation, and only one replacement succeeds)."""
  workdir = gcs.url('race')
  path = os.path.join(workdir, run_lock.LOCK_FILE)
  stale = json.dumps(dict(pid=1, host='elsewhere', started='then', heartbeat=0.0, token='x'))

  def before_round(r):
    if r % 2:
      assert gcs_lib.create_if_absent(path, stale.encode()) is not None

  processes.race_for_lock(workdir, str(tmp_path), before_round=before_round, wrap=gcs.command)
  assert gcs_lib.read(path) is None


def _cost(requests, name):
  """(requests, bytes sent and received) of the requests that name the object `name`."""
  hits = [q for q in requests if name in q['object']]
  return len(hits), sum(q['sent'] + q['received'] for q in hits)


def test_a_logged_step_costs_the_same_however_long_the_run(gcs, monkeypatch):
  """An object cannot be appended to: metrics.jsonl's rows are composed onto it server-side,
  and TensorBoard's scalars go out monitor.EVENTS_BATCH_ROWS rows at a time (30 here, 100 in a
  run) into events files of their own. The 90th row costs the requests and bytes of the 2nd
  (rewriting the file whole, it would cost over ten times the bytes), each batch of events those
  of the first, and both read back whole."""
  monkeypatch.setattr(monitor, 'EVENTS_BATCH_ROWS', 30)
  workdir = gcs.url('cost')
  log = monitor.MetricsLog(workdir)
  row = {k: 0.123456789 for k in ('loss', 'mlm_loss', 'mlm_accuracy', 'nsp_loss',
                                  'nsp_accuracy', 'learning_rate', 'grad_norm',
                                  'steps_per_second', 'tokens_per_second')}
  rows, events = [], []
  for step in range(1, 3 * monitor.EVENTS_BATCH_ROWS + 1):
    gcs.reset_log()
    log.train(step, row)
    rows.append(_cost(gcs.requests(), monitor.METRICS_FILE))
    events.append(_cost(gcs.requests(), 'tfevents'))
  log.close()
  early, late = rows[1:11], rows[-10:]
  assert {c[0] for c in early} == {c[0] for c in late} == {3}, (early, late)
  assert max(c[1] for c in late) < 1.1 * min(c[1] for c in early), (early, late)
  batches = [c for c in events if c[0]]
  assert len(batches) == 3 and max(c[1] for c in batches) < 1.1 * min(c[1] for c in batches)
  assert [r['step'] for r in _rows(workdir)[0]] == list(range(1, len(rows) + 1))
  tf = fileio.tensorflow()
  logged = sorted(e.step for path in fileio.glob(os.path.join(workdir, 'events.out.tfevents.*'))
                  for e in tf.compat.v1.train.summary_iterator(path)
                  for v in e.summary.value if v.tag == 'train/loss')
  assert logged == list(range(1, len(rows) + 1))


# A command's process: TensorFlow checks a file's size, google-cloud-storage appends to it (as
# metrics.jsonl's rows are), TensorFlow reads it.
_READ_AFTER_APPEND = """
import sys
from bert_jax import fileio, gcs
read_text = lambda path: fileio.gfile().GFile(path, 'rb').read().decode('utf-8')
path = sys.argv[1]
gcs.append(path, b'row 1\\n')
assert fileio.exists(path) and read_text(path) == 'row 1\\n'
gcs.append(path, b'row 2\\n')
print(repr(read_text(path)))
"""


def test_a_read_after_another_clients_append_is_whole(gcs, tmp_path):
  """TensorFlow's file system trusts a size it stat-ed for 5 s (GCS_STAT_CACHE_MAX_AGE): a read
  of an object appended to meanwhile by google-cloud-storage came back cut at the old size,
  without an error. Importing bert_jax turns that cache off."""
  env = {k: v for k, v in processes.env(str(tmp_path)).items() if k != 'GCS_STAT_CACHE_MAX_AGE'}
  proc = subprocess.run(gcs.command([sys.executable, '-c', _READ_AFTER_APPEND,
                                     gcs.url('appended.jsonl')]),
                        cwd=processes.ROOT, env=env, capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert proc.stdout.strip() == repr('row 1\nrow 2\n')


def test_appends_survive_429_503_a_reset_and_a_lost_answer(gcs):
  """Every request of an append (the part's upload, the compose, the part's delete) meets a 503
  or 429 burst, a connection reset halfway through its body, or (the compose) a lost answer
  after the server did it: the rows end up in the file once each, in order, and no part is
  left behind."""
  path = gcs.url('faulty/metrics.jsonl')
  rules = [dict(object='faulty/metrics.jsonl.part-', method='POST', status=503, every=3, burst=2),
           dict(object='faulty/metrics.jsonl.part-', method='DELETE', status=429, every=4),
           dict(object='faulty/metrics.jsonl', path='/compose', status='lost', every=5),
           dict(object='faulty/metrics.jsonl', path='/compose', status='reset', every=7),
           dict(object='faulty/metrics.jsonl', status=503, limit=1)]  # The first create.
  gcs.inject(rules)
  gcs.reset_log()
  try:
    for row in range(8):
      gcs_lib.append(path, f'row {row}\n'.encode())
  finally:
    gcs.inject([])
  faults = [q['status'] for q in gcs.requests() if q['status'] in (0, 429, 503) or
            q['status'] < 0]
  assert {0, 429, 503, -200} <= set(faults), faults
  assert _read_text(path) == ''.join(f'row {row}\n' for row in range(8))
  assert [os.path.basename(p) for p in fileio.glob(gcs.url('faulty/*'))] == ['metrics.jsonl']


def test_an_append_after_the_object_was_cut_back_goes_onto_what_is_there(gcs):
  """A resumed run cuts metrics.jsonl back through TensorFlow between two appends of this
  process: the next rows go onto the cut-back file, once each."""
  path = gcs.url('cut/metrics.jsonl')
  for row in range(3):
    gcs_lib.append(path, f'row {row}\n'.encode())
  with fileio.gfile().GFile(path, 'w') as f:
    f.write('row 0\n')
  gcs_lib.append(path, b'row 1 again\n')
  gcs_lib.append(path, b'row 2 again\n')
  assert _read_text(path) == 'row 0\nrow 1 again\nrow 2 again\n'


def test_the_default_retry_budget_is_the_one_the_readme_bounds_an_outage_by(monkeypatch):
  """The README: a run whose store stays down ends "within 10 minutes with the defaults (3 x
  191 s ...)": TensorFlow's defaults, 10 retries 1 s doubling to 32 s, for every client."""
  for name in gcs_lib._TF_RETRY_DEFAULTS:  # pylint: disable=protected-access
    monkeypatch.delenv(name, raising=False)
  assert gcs_lib.retry_budget() == (10, 1.0, 32.0)
  assert gcs_lib.retry_seconds() == 191 and 3 * gcs_lib.retry_seconds() < 600
  assert gcs_lib.tensorstore_retries() == {'max_retries': 10, 'initial_delay': '1.0s',
                                           'max_delay': '32.0s'}


def test_an_outage_past_the_retries_is_one_line_naming_the_object(gcs, monkeypatch):
  """Every compose onto one object answers 503: the append gives up at the end of the retry
  budget (`gcs.retry_budget`, shortened here from 10 retries 1 s doubling to 32 s), and the
  `bert-jax` command's line names the object; the rows before the outage are intact."""
  from bert_jax import cli  # pylint: disable=g-import-not-at-top
  for name, value in _SHORT_RETRIES.items():
    monkeypatch.setenv(name, value)
  path = gcs.url('outage/metrics.jsonl')
  gcs_lib.append(path, b'row 1\n')
  gcs_lib.append(path, b'row 2\n')
  # The compose failing, then the part's upload (its URL names no object: google-cloud-storage's
  # RetryError did not either, and the run ended in its traceback): named as the object either
  # way. (A row as long as a run's: the test server finds the name in the first half of the
  # body.)
  for fault in (dict(object='outage/metrics.jsonl', path='/compose'),
                dict(object='outage/metrics.jsonl.part-', method='POST')):
    gcs.inject([dict(fault, status=503)])
    try:
      with pytest.raises(Exception) as failed:
        gcs_lib.append(path, b'row 3 ' + b'.' * 300 + b'\n')
    finally:
      gcs.inject([])
    assert cli.user_error_message(failed.value) == (
        f'{path}: Cloud Storage kept failing (Backend Error) past the retries (README: Cloud '
        'Storage); the last committed checkpoint is intact: rerun the same command to resume '
        'once Cloud Storage answers')
    assert _read_text(path) == 'row 1\nrow 2\n'
    assert [os.path.basename(p) for p in fileio.glob(gcs.url('outage/*'))] == ['metrics.jsonl']
  # TensorFlow's file system past its retries (GCS_RETRY_CONFIG_MAX_RETRIES), as Orbax's
  # mkdir of a step met it: an AbortedError, not an UnavailableError.
  folder = gcs.url('run/checkpoints/8/')
  tf_error = fileio.tensorflow().errors.AbortedError(None, None, (
      'All 1 retry attempts failed. The last failure: Error executing an HTTP request: HTTP '
      'response code 503 with body \'{"error": {"code": 503, "message": "Backend Error"}}\'\n'
      f'\t when uploading {folder}'))
  assert cli.user_error_message(tf_error).startswith(
      f'{folder}: Cloud Storage kept failing (Backend Error) past the retries')
  # tensorstore past its gcs_request_retries, as an Orbax save of a step's arrays met it (the
  # response's body quoted with its quotes escaped).
  arrays = gcs.url('run/checkpoints/8/params/ocdbt.process_0/')
  body = '{\\"error\\": {\\"code\\": 503, \\"message\\": \\"Backend Error\\"}}'
  ts_error = ValueError(
      f'ABORTED: Error reading "nsp.kernel/.zarray" in OCDBT database at {arrays}: Error '
      f'reading {arrays}manifest.ocdbt: All 32 retry attempts failed: Backend Error '
      f"[http_response_code='503'] [http_response_body='{body}']")
  assert cli.user_error_message(ts_error).startswith(
      f'{arrays}: Cloud Storage kept failing (Backend Error) past the retries')


def test_a_lock_heartbeat_on_gs_is_one_conditional_upload(gcs, monkeypatch):
  monkeypatch.setattr(run_lock, '_LOCK_HEARTBEAT_SECONDS', 0.3)
  workdir = gcs.url('heartbeat')
  with run_lock.hold(workdir):
    gcs.reset_log()
    time.sleep(1.6)
    beats = [q for q in gcs.requests() if run_lock.LOCK_FILE in q['object']]
    holder = json.loads(_read_text(os.path.join(workdir, run_lock.LOCK_FILE)))
  assert len(beats) >= 3 and {q['method'] for q in beats} == {'POST'}, beats
  assert all('ifGenerationMatch=' in q['query'] for q in beats), beats
  assert time.time() - holder['heartbeat'] < 1
  # Asked of the server: TensorFlow's GCS filesystem caches what it stat-ed for 5 s.
  assert gcs_lib.read(os.path.join(workdir, run_lock.LOCK_FILE)) is None


def _same_params(a, b, atol=0.0):
  flat_a, flat_b = (jax.tree_util.tree_leaves_with_path(t) for t in (a, b))
  assert [p for p, _ in flat_a] == [p for p, _ in flat_b]
  for (path, x), (_, y) in zip(flat_a, flat_b):
    np.testing.assert_allclose(x, y, rtol=0 if not atol else 1e-6, atol=atol,
                               err_msg=jax.tree_util.keystr(path))


def test_init_checkpoint_on_gs_and_tfrecords_on_gs(gcs, cache, data, reference):
  """train.init_checkpoint naming a gs:// pre-training workdir, and the same weights converted
  into a Google TF checkpoint on gs://; the corpus as TFRecords on gs://. With a learning rate
  of 1e-30 (a step that moves nothing but zeros) the run's weights are the initial
  checkpoint's."""
  from bert_jax import convert  # pylint: disable=g-import-not-at-top
  rng = np.random.RandomState(0)
  inputs = {}
  for split, n in (('train', 40), ('eval', 8)):
    inputs[split] = gcs.url(f'records/{split}.tfrecord')
    records.write_pretraining_records(inputs[split], [dict(
        input_ids=rng.randint(5, 1000, 32), input_mask=np.ones(32, int),
        segment_ids=(np.arange(32) >= 16).astype(int),
        masked_lm_positions=np.sort(rng.choice(np.arange(1, 32), 5, False)),
        masked_lm_ids=rng.randint(5, 1000, 5), next_sentence_labels=rng.randint(0, 2, 1),
        masked_lm_weights=np.ones(5)) for _ in range(n)])
  google = gcs.url('google_ckpt')
  convert.convert(reference[0], google, 'google')
  reference_params = run_files.load_pretrained_from_workdir(reference[0])[1]
  for name, init in (('from_workdir', reference[0]), ('from_google', google)):
    workdir = gcs.url(name)
    config = config_files.load_config('smoke', _overrides(
        dict(data, input=inputs['train'], eval_input=inputs['eval']), train__stop_at_step=1,
        train__learning_rate=1e-30, train__init_checkpoint=init,
        checkpoint__compilation_cache_dir=cache))  # The second run loads the first's steps.
    train.train_and_evaluate(config, workdir)
    assert [r['step'] for r in _rows(workdir)[0]] == [1]
    _same_params(run_files.load_pretrained_from_workdir(workdir)[1], reference_params, 1e-28)


def test_finetune_and_the_commands_that_read_from_gs(gcs, cache, data, reference, monkeypatch,
                                                     tmp_path, caplog, capsys):
  """Fine-tuning with its workdir, task data and initial checkpoint on gs://: a SIGTERM and a
  rerun, both through 429s, 503s, resets and a lost answer, end as an uninterrupted clean run
  (the same metrics, the same losses). Between them a `bert-jax finetune` rerun meets its whole
  workdir down past the retries (shortened here) from the first request of its save on: it
  ends within _DOWN_BOUND_S with one line naming an object of the workdir and exit status 143,
  step 2 intact, and the last rerun resumes from it. Then predict, eval, features, fill-mask and
  convert read their checkpoints and inputs from gs:// (predict and convert write there
  too)."""
  from bert_jax import convert, features, fill_mask, finetune, predict, pretrained  # pylint: disable=g-import-not-at-top
  rng = np.random.RandomState(1)
  words = _read_text(data['input']).split()[:400]
  data_dir = gcs.url('glue')
  for split, n in (('train', 32), ('dev', 16)):
    rows = [f'{" ".join(rng.choice(words, 6))}\t{rng.randint(0, 2)}' for _ in range(n)]
    fileio.write_text(f'{data_dir}/SST-2/{split}.tsv', 'sentence\tlabel\n' + '\n'.join(rows) +
                      '\n')
  # The four runs share one local compilation cache (not each workdir's in the bucket): the
  # later three load the first's compiled steps.
  settings = {
      'train.init_checkpoint': reference[0], 'task.data_dir': data_dir,
      'data.max_seq_length': 32, 'data.buckets': (), 'train.batch_size': 8,
      'eval.batch_size': 16, 'train.epochs': 1, 'checkpoint.every_steps': 2,
      'log.every_steps': 1, 'log.progress': False, 'checkpoint.compilation_cache_dir': cache}
  config = config_files.load_config('finetune_glue.py:sst2', settings)
  full = finetune.finetune(config, gcs.url('sst2_full'))

  log_train = monitor.MetricsLog.train

  def train_then_sigterm(self, step, scalars, **extra):
    log_train(self, step, scalars, **extra)
    if step == 2:
      signal.raise_signal(signal.SIGTERM)
  monkeypatch.setattr(monitor.MetricsLog, 'train', train_then_sigterm)
  workdir = gcs.url('sst2')
  # The SIGTERM run and the last rerun meet a few percent of 503s and 429s on every object of
  # the workdir, connection resets halfway through uploads and a lost answer to a compose, at
  # most 2 in a row: the short retries see them through (TensorFlow's since its import,
  # tests/conftest.py; google-cloud-storage and tensorstore read them at each request).
  for name, value in _SHORT_RETRIES.items():
    monkeypatch.setenv(name, value)
  faults = [dict(object='sst2/', method='POST', status='reset', every=40, limit=3),
            dict(object='sst2/metrics.jsonl', path='/compose', status='lost', limit=1),
            dict(object='sst2/', status=503, every=25),
            dict(object='sst2/', status=429, every=35, burst=2)]
  faulted = set()  # The statuses of the faults that the SIGTERM run and the last rerun met.
  gcs.inject(faults)
  gcs.reset_log()
  try:
    with pytest.raises(errors.Preempted, match='saved step 2'):
      finetune.finetune(config, workdir)
  finally:
    gcs.inject([])
  faulted |= {q['status'] for q in gcs.requests() if q['object'].startswith('sst2/')}
  assert run_files.checkpoint_steps(workdir) == [2]
  monkeypatch.setattr(monitor.MetricsLog, 'train', log_train)

  # In between, a `bert-jax finetune` rerun (its saves wait for their commit) resumes from step
  # 2 and meets the store down at the save of step 4 (the end of the epoch), from its first
  # request (the step's folder) on: every object of the workdir (metrics.jsonl, events, the
  # lock, the checkpoints) answers 503. Made in Orbax's background, a failed folder left the
  # item writes waiting for its signal past the bound (and their timeout's traceback was the
  # last line).
  env = dict(processes.env(cache), **_SHORT_RETRIES)
  argv = processes.python(env, gcs.command) + [
      '-m', 'bert_jax.cli', 'finetune', '--config=finetune_glue:sst2', f'--workdir={workdir}'
  ] + _flags(dict(settings, **{'data.buckets': '()'}))
  gcs.reset_log()
  try:
    gcs.inject([dict(object='sst2/checkpoints/4', status=503)])
    proc = subprocess.Popen(gcs.command(argv), cwd=processes.ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    down = _down_after(gcs, proc, 'sst2/checkpoints/4', 'sst2/')
    _, err = processes.communicate(proc, 900)
    ended = time.time()
  finally:
    gcs.inject([])
  _assert_ended_by_the_outage('finetune', workdir, 2, proc, err, ended - down)

  capsys.readouterr()  # What the runs before printed.
  gcs.inject(faults)
  gcs.reset_log()
  try:
    with caplog.at_level('INFO', logger='absl'):  # Whatever absl's verbosity.
      assert finetune.finetune(config, workdir) == full
  finally:
    gcs.inject([])
  assert f'Resumed from step 2 in {workdir}' in caplog.text
  assert 'bert_jax finetune sst2: best epoch' in capsys.readouterr().out
  faulted |= {q['status'] for q in gcs.requests() if q['object'].startswith('sst2/')}
  assert {0, 429, 503, -200} <= faulted, faulted
  assert _losses(workdir) == _losses(gcs.url('sst2_full'))

  texts = gcs.url('use/texts.txt')
  fileio.write_text(texts, 'the module returns a list\nan object of the class\n')
  fileio.write_text(gcs.url('use/predict.jsonl'),
                    '{"text_a": "the module returns a list"}\n{"text_a": "an object"}\n')
  predict.predict(workdir, gcs.url('use/predict.jsonl'), gcs.url('use/predictions.jsonl'))
  assert len(_read_text(gcs.url('use/predictions.jsonl')).splitlines()) == 2

  evaluated = train.evaluate_checkpoint(
      config_files.load_config('smoke', _overrides(data, train__stop_at_step=REFERENCE_STEPS)),
      reference[0])
  last = _rows(reference[0])[1][-1]
  for key in ('mlm_loss', 'nsp_loss'):
    assert abs(evaluated[key] - last[key]) < 1e-5, (evaluated, last)

  out = str(tmp_path / 'features.jsonl')  # Its outputs are local files.
  features.extract_features(reference[0], texts, out, layers=(-1,))
  assert len(_read_text(out).splitlines()) == 2

  filled = fill_mask.fill_mask(reference[0], ['the [MASK] returns a list'], top_k=3)
  assert len(filled[0]['masks'][0]['predictions']) == 3

  exported = gcs.url('use/bert_jax')  # Hugging Face directories are read from local disk only.
  convert.convert(reference[0], exported, 'bert_jax')
  _same_params(pretrained.load_pretrained(exported)[1],
               pretrained.load_pretrained(reference[0])[1])
  assert pretrained.read_metadata(exported)['format'] == 'bert_jax'


def test_a_bucket_that_does_not_exist_is_one_line_before_anything_runs(gcs, data, cache):
  proc = _pretrain(gcs, cache, 'gs://no-such-bucket/run', _overrides(data))
  out, err = processes.communicate(proc, 300)
  assert proc.returncode == 2, err[-3000:]
  assert err.strip().splitlines()[-1] == (
      'bert-jax pretrain: error: --workdir=gs://no-such-bucket/run: the bucket '
      'gs://no-such-bucket does not exist; create it (`gcloud storage buckets create '
      'gs://no-such-bucket`) or fix the name')
  assert 'Traceback' not in err and 'Model tiny' not in err


def test_no_credentials_is_one_line_naming_the_path(gcs, tmp_path):
  """Without a test server's settings, google-cloud-storage looks for credentials; there are
  none in the namespace (no metadata server either)."""
  env = {k: v for k, v in processes.env(str(tmp_path)).items()
         if k not in ('STORAGE_EMULATOR_HOST', 'GOOGLE_AUTH_TOKEN_FOR_TESTING')}
  env.update(HOME=str(tmp_path), CLOUDSDK_CONFIG=str(tmp_path / 'gcloud'))
  code = ('from bert_jax import gcs, errors\n'
          'try:\n'
          f'  gcs.check_access({gcs.url("run")!r}, "--workdir")\n'
          'except errors.UserError as e:\n'
          '  print(e)\n')
  proc = subprocess.run(gcs.command([sys.executable, '-c', code]), cwd=processes.ROOT, env=env,
                        capture_output=True, text=True, timeout=120)
  assert proc.stdout.startswith(f'--workdir={gcs.url("run")}: no Google credentials'), (
      proc.stdout + proc.stderr[-3000:])
  assert 'gcloud auth application-default login' in proc.stdout


def test_a_missing_permission_is_one_line_naming_the_key_and_the_role(gcs, data, cache,
                                                                     tmp_path):
  """The proxy refuses requests as Cloud Storage does when IAM denies them (403 and its JSON
  message): no role at all on one bucket, read-only on another. A workdir, corpus, held-out text,
  vocabulary or initial checkpoint there stops `bert-jax pretrain` with one line naming the key,
  the bucket and the role to grant, before the model is built."""
  forbidden, read_only = (f'gs://{b}' for b in (gcs_server.FORBIDDEN_BUCKET,
                                                gcs_server.READ_ONLY_BUCKET))
  local = str(tmp_path / 'run{}')
  cases = [  # (workdir, overrides, the key the line names, its bucket, read or write)
      (f'{forbidden}/run', {}, '--workdir', forbidden, 'write to'),
      (f'{read_only}/run', {}, '--workdir', read_only, 'write to'),
      (local.format(1), {'data.input': f'{forbidden}/corpus/*.txt'}, 'data.input', forbidden,
       'read'),
      (local.format(2), {'data.eval_input': f'{forbidden}/eval.txt'}, 'data.eval_input',
       forbidden, 'read'),
      (local.format(3), {'data.vocab_file': f'{forbidden}/vocab.txt'}, 'data.vocab_file',
       forbidden, 'read'),
      (local.format(4), {'train.init_checkpoint': f'{forbidden}/bert'}, 'train.init_checkpoint',
       forbidden, 'read')]
  procs = [_pretrain(gcs, cache, workdir, _overrides(data, **{k.replace('.', '__'): v
                                                             for k, v in extra.items()}))
           for workdir, extra, *_ in cases]  # At once: each stops within seconds.
  for proc, (workdir, extra, key, bucket, access) in zip(procs, cases):
    out, err = processes.communicate(proc, 300)
    value = workdir if key == '--workdir' else extra[key]
    role = 'objectAdmin' if access == 'write to' else 'objectViewer'
    assert proc.returncode == 2, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert re.fullmatch(
        rf'bert-jax pretrain: error: (.*: )?{re.escape(key)}={re.escape(value)}: no permission '
        rf'to {access} {bucket} \(ci@\S+ does not have storage\.objects\.\w+ access .*\); '
        rf'grant this machine\'s account roles/storage\.{role} on the bucket .*', last), last
    assert 'Traceback' not in err and 'Model tiny' not in err


def test_a_refusal_no_check_named_is_still_one_line_naming_the_path(gcs, monkeypatch):
  """Past the checks, whatever meets a 403 first (TensorFlow's file system, google-cloud-storage,
  a fine-tuning data_dir or a workdir read by the commands that use a model) becomes the same
  one line (`cli.user_error_message`), naming the object's path."""
  from bert_jax import cli  # pylint: disable=g-import-not-at-top
  forbidden = f'gs://{gcs_server.FORBIDDEN_BUCKET}'
  with pytest.raises(Exception) as tf_error:
    _read_text(f'{forbidden}/data/train.tsv')
  with pytest.raises(Exception) as client_error:
    gcs_lib.read(f'{forbidden}/run/run.lock')
  with pytest.raises(Exception) as upload_error:
    fileio.write_text(f'gs://{gcs_server.READ_ONLY_BUCKET}/out/predictions.jsonl', 'x')
  with pytest.raises(Exception) as client_upload_error:
    gcs_lib.create_if_absent(f'gs://{gcs_server.READ_ONLY_BUCKET}/run/run.lock', b'{}')
  messages = [cli.user_error_message(e.value) for e in (tf_error, client_error, upload_error,
                                                        client_upload_error)]
  assert messages[0].startswith(f'{forbidden}/data/train.tsv: no permission to read {forbidden} '
                                '(ci@'), messages[0]
  assert messages[1].startswith(f'{forbidden}: no permission to read {forbidden} (ci@')
  # Its folder first (a folder marker object).
  assert messages[2].startswith(f'gs://{gcs_server.READ_ONLY_BUCKET}/out/: no permission to '
                                'write to'), messages[2]
  assert messages[3].startswith(f'gs://{gcs_server.READ_ONLY_BUCKET}: no permission to write '
                                'to'), messages[3]
  for flag, check in (('data.data_dir', fileio.check_input_dir),
                      ('--workdir', fileio.check_readable_dir)):
    with pytest.raises(errors.UserError, match=re.escape(
        f'{flag}={forbidden}/glue: no permission to read {forbidden} (')):
      check(f'{forbidden}/glue', flag)
  # A loaded machine (the suite at load 8 on 2 cores) answers slowly: past the access check's
  # retry deadline, a refusal is still a refusal, not 'cannot be reached'.
  monkeypatch.setattr(gcs_lib, 'CHECK_DEADLINE_S', 0.5)
  gcs.inject([dict(path=gcs_server.FORBIDDEN_BUCKET, status='slow', seconds=1.5)])
  try:
    with pytest.raises(errors.UserError, match=re.escape(
        f'data.data_dir={forbidden}/glue: no permission to read {forbidden} (')):
      fileio.check_input_dir(f'{forbidden}/glue', 'data.data_dir')
  finally:
    gcs.inject([])
  local = PermissionError(13, 'Permission denied', '/root/secret.txt')
  assert cli.user_error_message(local) is None  # Not Cloud Storage's: a bug until named.
