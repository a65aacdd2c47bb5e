"""Pushing to the Hub (a fake Hub on loopback, tests/hub_server.py, through huggingface_hub's own
commit code): checkpoint.push_to_hub pushes every N steps in the background as tagged commits,
never blocks a step, counts a step only once pushed, and a failed push is a warning; `bert-jax
convert --format=hf --push_to_hub` pushes an export with its model card; what was pushed pulls
back (hf://) as the same weights and loads in transformers."""

import json
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from bert_jax import config_files
from bert_jax import hub
from bert_jax import model as model_lib
from bert_jax import pretrained
from bert_jax import publish
from bert_jax import sample_corpus
from bert_jax import train
from bert_jax import vocab as vocab_lib
import hub_server

pytest.importorskip('huggingface_hub')

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = {
    'model.size': 'tiny', 'data.max_seq_length': 32, 'data.max_predictions_per_seq': 5,
    'data.shuffle_buffer': 50, 'train.steps': 6, 'train.batch_size': 8,
    'train.warmup_steps': 1, 'checkpoint.every_steps': 2, 'eval.every_steps': 1000,
    'eval.steps': 1, 'eval.batch_size': 8, 'log.every_steps': 1, 'log.progress': False,
}


@pytest.fixture(scope='module')
def server(tmp_path_factory):
  """The fake Hub, with huggingface_hub pointed at it (HF_ENDPOINT's constants, as set at
  import) and a Hub cache of the module's own."""
  from huggingface_hub import constants  # pylint: disable=g-import-not-at-top
  with hub_server.HubServer() as hub_, pytest.MonkeyPatch.context() as patch:
    patch.setattr(constants, 'ENDPOINT', hub_.url)
    patch.setattr(constants, 'HUGGINGFACE_CO_URL_TEMPLATE',
                  hub_.url + '/{repo_id}/resolve/{revision}/{filename}')
    patch.setattr(constants, 'HF_HUB_CACHE', str(tmp_path_factory.mktemp('hf_cache')))
    patch.setattr(hub, '_FOLDERS', {})
    patch.setenv('HF_TOKEN', hub_server.TOKEN)
    yield hub_


class _Warnings:
  """absl's warnings during a block (the pusher warns from its thread)."""

  def __init__(self):
    import logging  # pylint: disable=g-import-not-at-top
    self.lines, self._logging = [], logging
    self._handler = logging.Handler(logging.WARNING)
    self._handler.emit = lambda record: self.lines.append(record.getMessage())

  def __enter__(self):
    self._logging.getLogger('absl').addHandler(self._handler)
    return self

  def __exit__(self, *exc):
    self._logging.getLogger('absl').removeHandler(self._handler)


@pytest.fixture(scope='module')
def run(server, tmp_path_factory):
  """A 6-step pre-training run that pushes every 2 steps; the first push fails (the Hub
  refuses its commit), the others land."""
  root = tmp_path_factory.mktemp('run')
  with open(sample_corpus.sample_corpus_path(), encoding='utf-8') as f:
    lines = f.read().splitlines()[:3500]
  corpus, held_out = root / 'corpus.txt', root / 'held_out.txt'
  corpus.write_text('\n'.join(lines[:3000]) + '\n')
  held_out.write_text('\n'.join(lines[3000:]) + '\n')
  vocab = vocab_lib.train_wordpiece(lines, str(root / 'vocab.txt'), 500)
  config = config_files.load_config('smoke', dict(
      TINY, **{'data.input': str(corpus), 'data.eval_input': str(held_out),
               'data.vocab_file': vocab,
               'checkpoint.push_to_hub': 'bert-jax-test/run', 'checkpoint.push_every_steps': 2}))
  workdir = str(root / 'workdir')
  server.fail_commits, server.fail_status = 1, 403  # A 5xx would be retried for 31 s first.
  with _Warnings() as warnings:
    train.train_and_evaluate(config, workdir)
  return {'workdir': workdir, 'warnings': warnings.lines, 'config': config}


def test_a_run_pushes_tagged_steps_and_counts_only_what_landed(server, run):
  repo = server.repos[('model', 'bert-jax-test/run')]
  assert server.failed_commits == 1
  assert sorted(repo.tags) == ['step-4', 'step-6']
  assert [m for _, m in repo.log] == ['initial commit', 'Step 4', 'Step 6']
  with open(os.path.join(run['workdir'], publish.PUSHES_FILE)) as f:
    record = json.load(f)
  assert record['repo'] == 'bert-jax-test/run'
  assert sorted(record['steps']) == ['4', '6']
  assert record['steps']['4'] == repo.tags['step-4']
  failed = [w for w in run['warnings'] if w.startswith('Pushing step 2 to the Hub')]
  assert len(failed) == 1 and 'the run goes on, and step 2 does not count as pushed' in failed[0]
  # Each tag holds its own step: pulled by name, the weights of that step of the workdir.
  for step in (4, 6):
    _, pulled = pretrained.load_pretrained(f'hf://bert-jax-test/run@step-{step}')
    _, saved = pretrained.load_pretrained(run['workdir'], step=step)
    _assert_same(pulled, saved)
  files = repo.commits[repo.branches['main']]
  assert {'config.json', 'model.safetensors', 'vocab.txt', 'tokenizer_config.json',
          'README.md'} <= set(files)
  assert b'at step 6' in files['README.md']


@pytest.fixture
def kept_record(run):
  """The run's WORKDIR/hub_pushes.json as it was, after a test pushing from its workdir to another
  repository (which records its own pushes there)."""
  path = os.path.join(run['workdir'], publish.PUSHES_FILE)
  with open(path, encoding='utf-8') as f:
    before = f.read()
  yield
  with open(path, 'w', encoding='utf-8') as f:
    f.write(before)


def test_a_push_never_blocks_the_step(server, run, kept_record):
  """`saved` returns at once while the Hub holds the commit; `close` waits for it."""
  gate = threading.Event()
  original = hub_server.Repo.commit

  def held(repo, branch, files, message):
    if message.startswith('Step'):
      gate.wait(60)
    return original(repo, branch, files, message)

  hub_server.Repo.commit = held
  try:
    pusher = publish.Pusher(run['workdir'], 'bert-jax-test/held', every_steps=2)
    assert not pusher.pushed  # The run's record is of another repository.
    start = time.monotonic()
    pusher.saved(4)
    pusher.saved(5)  # Not a push step.
    assert time.monotonic() - start < 0.5
    time.sleep(1.0)
    assert not pusher.pushed  # In flight: not counted.
    gate.set()
    pusher.close()
  finally:
    hub_server.Repo.commit = original
  assert sorted(pusher.pushed) == [4]
  assert sorted(server.repos[('model', 'bert-jax-test/held')].tags) == ['step-4']


def _assert_same(a, b):
  flat_a, flat_b = pretrained.flatten(a), pretrained.flatten(b)
  assert sorted(flat_a) == sorted(flat_b)
  for path, x in flat_a.items():
    np.testing.assert_array_equal(x, flat_b[path], err_msg=path)


def test_convert_push_to_hub_round_trip(server, run, tmp_path):
  """`bert-jax convert --format=hf --push_to_hub=ORG/NAME` (the command, against the fake Hub):
  the export with its model card (config, metrics, the command that trained it) and tokenizer
  files; pulled back by name it is the workdir's weights, and transformers loads it with the
  tokenizer and outputs of bert_jax."""
  workdir = run['workdir']
  publish.record_command(workdir, ['pretrain', f'--workdir={workdir}', '--config=smoke'])
  env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS='cpu', HF_ENDPOINT=server.url,
             HF_TOKEN=hub_server.TOKEN, HF_HOME=str(tmp_path / 'hf_home'))
  proc = subprocess.run(
      [sys.executable, '-m', 'bert_jax.cli', 'convert', f'--input={workdir}', '--format=hf',
       '--push_to_hub=bert-jax-test/exported'], env=env, capture_output=True, text=True,
      timeout=600, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert 'Pushed' in proc.stdout and 'hf://bert-jax-test/exported' in proc.stdout
  repo = server.repos[('model', 'bert-jax-test/exported')]
  files = repo.commits[repo.branches['main']]
  card = files['README.md'].decode()
  assert 'library_name: transformers' in card and 'pipeline_tag: fill-mask' in card
  assert f'bert-jax pretrain --workdir={workdir} --config=smoke' in card
  assert '"push_to_hub": "bert-jax-test/run"' in card  # The run's config.
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    last_loss = [row for row in map(json.loads, f) if not row.get('eval')][-1]['loss']
  assert f'| loss | {last_loss:.6g} |' in card
  assert json.loads(files['tokenizer_config.json'])['do_lower_case'] is True

  folder = hub.checkpoint_folder('hf://bert-jax-test/exported', '--checkpoint')
  config, pulled = pretrained.load_pretrained(folder)
  _assert_same(pulled, pretrained.load_pretrained(workdir)[1])

  torch = pytest.importorskip('torch')
  import transformers  # pylint: disable=g-import-not-at-top
  tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
  model = transformers.AutoModelForPreTraining.from_pretrained(folder).eval()
  text = 'The interpreter reads a module and runs it.'
  from bert_jax import tokenization  # pylint: disable=g-import-not-at-top
  ours = tokenization.load_tokenizer(os.path.join(folder, 'vocab.txt'), lower_case=True)
  ids = tokenizer(text)['input_ids']
  assert ids == [ours.cls_id] + ours.encode([text])[0] + [ours.sep_id]
  with torch.no_grad():
    hf_out = model.bert(torch.tensor([ids])).last_hidden_state.numpy()
  jax_out, _ = model_lib.encode(config, pulled, np.array([ids]), np.ones((1, len(ids))),
                                np.zeros((1, len(ids)), np.int32))
  np.testing.assert_allclose(np.asarray(jax_out), hf_out, atol=2e-5, rtol=1e-4)


def test_the_model_card_of_a_step(run):
  """A push of step 4 while the run went on: that step's metrics, the run's config; the pipeline
  tag of the exported head; a malformed repository name is refused where the config loads."""
  card = publish.model_card('org/name', run['workdir'], 4, 'BertForTokenClassification')
  assert 'pipeline_tag: token-classification' in card and 'at step 4.' in card
  assert 'Last training row (step 4):' in card and '(step 6)' not in card
  assert '"push_every_steps": 2' in card
  with pytest.raises(Exception, match=r"--config\.checkpoint\.push_to_hub='no-org': expected "
                                      'ORG/NAME'):
    config_files.load_config('smoke', {'checkpoint.push_to_hub': 'no-org'})


def test_fine_tuning_pushes_its_steps_with_its_head(server, run, tmp_path):
  """checkpoint.push_to_hub in fine-tuning (GLUE MRPC, 3 steps from the run's weights): steps 2
  (push_every_steps) and 3 (the last) pushed with the classifier, as transformers'
  BertForSequenceClassification, with a text-classification card."""
  glue = tmp_path / 'glue' / 'MRPC'
  glue.mkdir(parents=True)
  words = 'the interpreter reads a module and runs its code line by line'.split()
  for split, n in (('train', 24), ('dev', 8)):
    rows = ['Quality\t#1 ID\t#2 ID\t#1 String\t#2 String']
    for i in range(n):
      a = ' '.join(words[i % 5:i % 5 + 6])
      rows.append(f'{i % 2}\t{i}\t{100 + i}\t{a}\t{a if i % 2 else " ".join(words[:4])}')
    (glue / f'{split}.tsv').write_text('\n'.join(rows) + '\n')
  from bert_jax import finetune  # pylint: disable=g-import-not-at-top
  config = config_files.load_config('finetune_glue:mrpc', {
      'train.init_checkpoint': run['workdir'], 'task.data_dir': str(tmp_path / 'glue'),
      'train.epochs': 1, 'data.max_seq_length': 32, 'train.batch_size': 8,
      'eval.batch_size': 8, 'log.progress': False, 'checkpoint.every_steps': 2,
      'checkpoint.push_to_hub': 'bert-jax-test/mrpc', 'checkpoint.push_every_steps': 2})
  finetune.finetune(config, str(tmp_path / 'mrpc'))
  repo = server.repos[('model', 'bert-jax-test/mrpc')]
  assert sorted(repo.tags) == ['step-2', 'step-3']
  files = repo.commits[repo.tags['step-3']]
  assert json.loads(files['config.json'])['architectures'] == ['BertForSequenceClassification']
  assert b'pipeline_tag: text-classification' in files['README.md']
  assert b'fine-tuned on mrpc' in files['README.md']
  _, pulled = pretrained.load_pretrained('hf://bert-jax-test/mrpc@step-3')
  assert 'classifier' in pulled


def test_a_sweep_does_not_push(tmp_path):
  from bert_jax import finetune  # pylint: disable=g-import-not-at-top
  config = config_files.load_config('finetune_glue:mrpc',
                                    {'checkpoint.push_to_hub': 'bert-jax-test/sweep'})
  with pytest.raises(Exception, match=r'--sweep with checkpoint\.push_to_hub=bert-jax-test/sweep: '
                                      'the runs of every rate would push into one repository'):
    finetune.sweep(config, str(tmp_path / 'sweep'))


def test_a_preempted_run_does_not_wait_for_its_pushes(server, run, kept_record):
  """close(wait=False), as a run stopping in a preemption notice does: it returns at once while
  the Hub holds the commit of step 4, with a warning naming the steps not pushed; nothing is
  counted then; the push in flight counts once it lands, the queued step 6 is never pushed."""
  gate, entered = threading.Event(), threading.Event()
  original = hub_server.Repo.commit

  def held(repo, branch, files, message):
    if message.startswith('Step'):
      entered.set()
      gate.wait(60)
    return original(repo, branch, files, message)

  hub_server.Repo.commit = held
  try:
    pusher = publish.Pusher(run['workdir'], 'bert-jax-test/preempted', every_steps=2)
    pusher.saved(4)
    pusher.saved(6)
    assert entered.wait(120)  # Step 4 is in the Hub's commit, step 6 queued.
    with _Warnings() as warnings:
      start = time.monotonic()
      pusher.close(wait=False)
      assert time.monotonic() - start < 0.5
    assert not pusher.pushed
    assert [w for w in warnings.lines if w.startswith('Not waiting for the pushes')] == [
        'Not waiting for the pushes to bert-jax-test/preempted of steps [4, 6] (the run is '
        'stopping): a step not on the Hub before the process ends does not count as pushed']
  finally:
    gate.set()
    hub_server.Repo.commit = original
  pusher._thread.join(60)  # pylint: disable=protected-access  (the test's process goes on)
  assert sorted(pusher.pushed) == [4]
  assert sorted(server.repos[('model', 'bert-jax-test/preempted')].tags) == ['step-4']
