"""Workdir files through tf.io.gfile: a non-local filesystem (TensorFlow's ram://) stands in for
Cloud Storage, which the machines that run these tests cannot reach."""

import json
import os

import pytest
import tensorflow as tf
from clu import data as clu_data

from bert_jax import checkpoint
from bert_jax import fileio
from bert_jax import model as model_lib


class _Manager:
  """The one CheckpointManager method the data-state cleanup reads."""

  def __init__(self, steps):
    self.steps = steps

  def all_steps(self):
    return self.steps


def _iterator():
  ds = tf.data.Dataset.range(100).map(lambda x: {'x': x})
  return clu_data.TfDatasetIterator(ds, checkpoint=True)


def test_data_state_on_a_non_local_filesystem():
  workdir = 'ram://bert_jax_test/run'
  it = _iterator()
  for _ in range(7):
    next(it)
  for step in (10, 20):
    path = checkpoint._data_state_path(workdir, step)
    fileio.gfile().makedirs(os.path.dirname(path))
    it.save(path)
  resumed = _iterator()
  assert checkpoint.restore_data_state(workdir, 20, resumed)
  assert int(next(resumed)['x']) == 7
  assert not checkpoint.restore_data_state(workdir, 30, _iterator())
  # Step 10 is no longer a committed checkpoint: its data state goes.
  checkpoint._clean_data_states(_Manager([20]), workdir, keep_step=20)
  assert sorted(fileio.gfile().listdir(os.path.join(workdir, 'data_state'))) == ['20']


def test_process_1_does_not_take_process_10s_state(monkeypatch):
  workdir = 'ram://bert_jax_test/many'
  it = _iterator()
  monkeypatch.setattr(checkpoint.jax, 'process_index', lambda: 10)
  path = checkpoint._data_state_path(workdir, 5)
  fileio.gfile().makedirs(os.path.dirname(path))
  it.save(path)
  monkeypatch.setattr(checkpoint.jax, 'process_index', lambda: 1)
  assert not checkpoint.restore_data_state(workdir, 5, _iterator())


def test_run_files_on_a_non_local_filesystem(tmp_path):
  vocab = tmp_path / 'vocab.txt'
  vocab.write_text('[PAD]\n[UNK]\n')
  workdir = 'ram://bert_jax_test/files'
  config = model_lib.BertConfig(vocab_size=2, hidden_size=8, num_hidden_layers=1,
                                num_attention_heads=2, intermediate_size=16)
  checkpoint.write_run_files(workdir, '{"a": 1}', config, str(vocab))
  fs = fileio.gfile()
  assert json.loads(fs.GFile(os.path.join(workdir, 'config.json')).read()) == {'a': 1}
  written = json.loads(fs.GFile(os.path.join(workdir, 'bert_config.json')).read())
  assert written == config.to_original_dict()
  assert fs.GFile(os.path.join(workdir, 'vocab.txt')).read() == '[PAD]\n[UNK]\n'


def _sharded_state(step):
  """A small train state spread over the 8 test devices, and its abstract state."""
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from bert_jax import train_state  # pylint: disable=g-import-not-at-top
  mesh = jax.sharding.Mesh(np.array(jax.devices()), ('data',))
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec('data'))
  rng = np.random.default_rng(step)
  tree = {name: jax.device_put(rng.normal(size=(64, 32)).astype(np.float32), sharding)
          for name in ('a', 'b', 'c')}
  state = train_state.TrainState(step=np.int32(step), params=tree, opt_state=dict(tree))
  spec = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
  abstract = train_state.TrainState(step=np.int32(0), params=jax.tree.map(spec, tree),
                                    opt_state=jax.tree.map(spec, tree))
  return state, abstract


# The reads a failed restore abandons end quietly (they used to print "Event loop is closed" or
# "coroutine ... was never awaited" after the test, as an exception nobody could catch).
@pytest.mark.filterwarnings('error::pytest.PytestUnraisableExceptionWarning')
def test_restore_or_init_moves_a_corrupt_checkpoint_aside(tmp_path):
  """Both drivers resume through restore_or_init: a checkpoint whose files are cut short is
  moved aside and the one before it restored; with no checkpoint, init() makes the state."""
  import glob  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  workdir = str(tmp_path / 'run')
  manager = checkpoint.make_manager(workdir, keep=None, async_save=False,
                                    replica_parallel=False)
  for step in (1, 2):
    state, abstract = _sharded_state(step)
    checkpoint.save(manager, workdir, step, state, {'seed': step})
  for path in glob.glob(os.path.join(workdir, 'checkpoints', '2', 'params', '**', 'd', '*'),
                        recursive=True):
    with open(path, 'r+b') as f:  # Every data file cut in half.
      f.truncate(os.path.getsize(path) // 2)
  step, restored, meta = checkpoint.restore_or_init(
      manager, workdir, abstract, init=lambda: pytest.fail('there is a checkpoint to resume'))
  expected, _ = _sharded_state(1)
  assert (step, meta['seed']) == (1, 1)
  for name, value in expected.params.items():
    np.testing.assert_array_equal(restored.params[name], value)
  assert os.path.isdir(os.path.join(workdir, 'checkpoints', '2.corrupt'))
  manager.close()

  empty = str(tmp_path / 'empty')
  manager = checkpoint.make_manager(empty, keep=None, async_save=False, replica_parallel=False)
  assert checkpoint.restore_or_init(manager, empty, abstract, init=lambda: 'fresh') == (
      None, 'fresh', {})
  manager.close()


def test_the_reads_of_a_failed_restore_end_in_their_event_loop():
  """Orbax runs a restore's reads as tasks of an event loop it closes without ending them:
  when one array cannot be read, the others' reads stay suspended until the garbage collector
  closes them, and Orbax's reader turns that into an exception no one can catch (pytest's
  PytestUnraisableExceptionWarning). Restores end them, cancelled inside their loop."""
  import asyncio  # pylint: disable=g-import-not-at-top
  from orbax.checkpoint._src import asyncio_utils  # pylint: disable=g-import-not-at-top
  ended = []

  async def read(i):  # As Orbax's _read_array_index_and_device_put handles its end.
    try:
      await asyncio.sleep(0 if i == 0 else 600)
      raise OSError('the file is cut short')
    except BaseException as e:  # pylint: disable=broad-except
      ended.append(type(e).__name__)
      raise RuntimeError('read failed') from e

  async def restore():
    await asyncio.gather(*(read(i) for i in range(3)))

  with checkpoint._reads_end_their_tasks(), pytest.raises(RuntimeError, match='read failed'):
    asyncio_utils.run_sync(restore())
  assert sorted(ended) == ['CancelledError', 'CancelledError', 'OSError']


class _KeyValueStore:
  """jax.distributed's key-value store (what `checkpoint._exchange` uses of it)."""

  def __init__(self):
    self.values = {}

  def key_value_set(self, key, value):
    assert key not in self.values, key  # The client refuses to overwrite.
    self.values[key] = value

  def blocking_key_value_get(self, key, timeout_ms):
    if key not in self.values:
      raise RuntimeError(f'DEADLINE_EXCEEDED: {key} not set in {timeout_ms} ms')
    return self.values[key]

  def key_value_delete(self, key):
    del self.values[key]


class _Written:
  """An Orbax commit future of writes that succeeded or failed with `error`."""

  def __init__(self, error=None):
    self.error = error

  def result(self, timeout=None):
    del timeout
    if self.error:
      raise self.error


class _Committed:
  """The CheckpointManager methods `_save_failed` calls: step 4 is committed (`committed`: as
  `checkpoint.save` records it before each save)."""

  committed = 4

  def reload(self):
    pass

  def latest_step(self):
    return 4


def test_a_part_failed_in_one_process_stops_every_process_with_its_status_and_line(
    monkeypatch, tmp_path):
  """Three processes: process 2's writes of an item fail, 1's and 0's succeed. Each publishes
  its outcome before Orbax's barriers; process 0 reads the others' and stops with the status
  process 2 has (an outage: Outage, exit 143; a full disk: UserError, exit 2; anything else a
  bug), in one line naming process 2 and what failed."""
  from orbax.checkpoint import multihost
  store = _KeyValueStore()
  monkeypatch.setattr(multihost, 'get_jax_distributed_client', lambda: store)
  monkeypatch.setattr(checkpoint.jax, 'process_count', lambda: 3)
  outage = ValueError('ABORTED: Error writing "gs://b/run/checkpoints/8/params/ocdbt.process_2/'
                      'd/0a1b": All 4 retry attempts failed: {\\"error\\": {\\"message\\": '
                      '\\"Backend Error\\"}}')
  full = OSError(28, 'No space left on device')
  bug = KeyError('params')
  for number, failure in enumerate((outage, full, bug)):
    for process, error in ((2, failure), (1, None), (0, None)):
      monkeypatch.setattr(checkpoint.jax, 'process_index', lambda p=process: p)
      agreed = checkpoint._Agreed(number, [_Written(), _Written(error)])
      if process == 1:  # It would wait for process 0: its outcome is published alone here.
        store.key_value_set(f'{checkpoint._OUTCOME_KEY}/{number}/1', 'null')
        continue
      with pytest.raises(Exception) as raised:
        agreed.result()
      if process == 2:
        assert raised.value is error  # Its own error, published first.
    assert isinstance(raised.value, checkpoint.SaveFailedElsewhere)
    assert raised.value.process == 2
    with pytest.raises(Exception) as stopped:
      checkpoint._save_failed(_Committed(), str(tmp_path), raised.value)
    line = str(stopped.value)
    assert line.startswith("stopped because process 2's part of the checkpoint save failed: ")
    if failure is outage:
      assert isinstance(stopped.value, checkpoint.Outage)
      assert line.endswith(
          'gs://b/run/checkpoints/8/params/ocdbt.process_2/d/0a1b: Cloud Storage kept failing '
          '(Backend Error) past the retries (README: Cloud Storage); the last complete '
          'checkpoint, step 4, is intact: rerun the same command to resume once Cloud Storage '
          'answers')
    elif failure is full:
      assert isinstance(stopped.value, checkpoint.UserError)
      assert 'No space left on device' in line and 'step 4, is intact' in line
    else:
      assert type(stopped.value) is RuntimeError and "'params'" in line
    assert '\n' not in line

  # Once every process has read an exchange, each deletes its own key of the one before.
  for process in (2, 1):
    store.key_value_set(f'{checkpoint._OUTCOME_KEY}/3/{process}', 'null')
  monkeypatch.setattr(checkpoint.jax, 'process_index', lambda: 0)
  checkpoint._Agreed(3, [_Written()]).result()
  assert f'{checkpoint._OUTCOME_KEY}/2/0' not in store.values
  assert f'{checkpoint._OUTCOME_KEY}/2/1' in store.values
  # A process that never publishes: a TimeoutError naming it, after OUTCOME_TIMEOUT_S.
  store.key_value_set(f'{checkpoint._OUTCOME_KEY}/4/1', 'null')
  with pytest.raises(TimeoutError, match='process 2 did not finish its part'):
    checkpoint._Agreed(4, [_Written()]).result()


class UnavailableError(Exception):
  """TensorFlow's error for Cloud Storage failing past its file system's retries (by name)."""


def _outage_at(path):
  """(the error of an upload of `path` failing past the retries, the one line it stops with)."""
  error = UnavailableError(f'Error executing an HTTP request: HTTP response code 503 with body '
                           f'\'{{"error": {{"message": "Backend Error"}}}}\' when uploading {path}')
  return error, (f'{path}: Cloud Storage kept failing (Backend Error) past the retries (README: '
                 'Cloud Storage); the last complete checkpoint, step 4, is intact: rerun the same '
                 'command to resume once Cloud Storage answers')


class _Manager2(_Committed):
  """A CheckpointManager with step 4 committed, whose `save` must not be reached."""

  def wait_until_finished(self):
    pass

  def save(self, *args, **kwargs):
    raise AssertionError('Orbax\'s save started though a process had failed')


class _Position:
  """A data iterator whose `save` fails with `error` (if any)."""

  def __init__(self, error=None):
    self.error = error

  def save(self, path):
    del path
    if self.error:
      raise self.error


def test_an_input_position_one_process_cannot_write_stops_every_process_before_orbax(
    monkeypatch, tmp_path):
  """Each process writes its own input position before Orbax's save, whose first barrier waits
  for every process: process 1's write fails past the retries, so neither goes on into it, and
  both stop with 143's one line (process 0 naming process 1)."""
  from orbax.checkpoint import multihost
  store = _KeyValueStore()
  monkeypatch.setattr(multihost, 'get_jax_distributed_client', lambda: store)
  monkeypatch.setattr(checkpoint.jax, 'process_count', lambda: 2)
  path = 'gs://b/run/data_state/8/process_1.index'
  error, line = _outage_at(path)
  lines = {}
  for process, failure in ((1, error), (0, None)):
    monkeypatch.setattr(checkpoint.jax, 'process_index', lambda p=process: p)
    monkeypatch.setattr(checkpoint, '_exchanges', iter([5]))  # Each process's count.
    with pytest.raises(checkpoint.Outage) as stopped:
      checkpoint.save(_Manager2(), str(tmp_path), 8, None, {}, _Position(failure))
    lines[process] = str(stopped.value)
  assert lines == {1: line, 0: f"stopped because process 1's part of the checkpoint save "
                                f'failed: {line}'}


class _Checkpointer:
  """Orbax's AsyncCheckpointer as `_CommitOutcome.hook` uses it: its commit callbacks fail with
  `error` (if any), as process 0's commit would."""

  def __init__(self, error=None):
    self.error = error

  def _make_on_commit_callback(self, *args):
    del args

    def callback():
      if self.error:
        raise self.error

    return callback


class _Manager3:
  def __init__(self, error=None):
    self._checkpointer = _Checkpointer(error)


def test_a_commit_process_0_cannot_write_stops_every_process_before_orbaxs_last_barrier(
    monkeypatch, tmp_path):
  """Process 0 alone commits a save (the step's metadata, the merge of the processes' files,
  commit_success.txt) between Orbax's last two barriers. Its commit fails past the retries: the
  other process, in Orbax's own background save thread, stops before the barrier process 0
  never reaches, with 143's one line naming process 0 and the object; the next save's commit
  goes through and its barrier is reached."""
  from orbax.checkpoint import multihost
  from etils import epath
  from orbax.checkpoint._src.checkpointers import async_checkpointer
  store = _KeyValueStore()
  monkeypatch.setattr(multihost, 'get_jax_distributed_client', lambda: store)
  monkeypatch.setattr(checkpoint.jax, 'process_count', lambda: 2)
  path = 'gs://b/run/checkpoints/8/commit_success.txt'
  error, line = _outage_at(path)
  outcomes = {p: checkpoint._CommitOutcome() for p in (0, 1)}
  barriers = []
  outcomes[1]._barrier = lambda key, timeout_ms: barriers.append(key)
  for save, failure in enumerate((error, None)):
    # Each process makes the save's commit callback (Orbax, on the main thread); process 0 runs
    # it, and the other goes through Orbax's background thread after its writes.
    callbacks = {}
    for process, manager in ((0, _Manager3(failure)), (1, _Manager3())):
      monkeypatch.setattr(checkpoint, '_commits', iter([save]))  # Each process's count.
      outcomes[process].hook(manager)
      callbacks[process] = manager._checkpointer._make_on_commit_callback('tmpdir', None, 0.0)
    monkeypatch.setattr(checkpoint.jax, 'process_index', lambda: 0)
    if failure:
      with pytest.raises(UnavailableError):
        callbacks[0]()
    else:
      callbacks[0]()
      assert f'{checkpoint._COMMIT_KEY}/0' not in store.values  # Read by all: dropped.
    monkeypatch.setattr(checkpoint.jax, 'process_index', lambda: 1)
    monkeypatch.setattr(multihost, 'process_index', lambda: 1)
    barriers.clear()
    background = lambda: async_checkpointer._background_wait_for_commit_futures(  # pylint: disable=protected-access
        epath.Path(os.path.dirname(path)), [], callbacks[1],
        barrier_sync_key_prefix='', timeout_secs=1200,
        sync_fn=lambda key, timeout_ms: outcomes[1].barrier(key=key, timeout_ms=timeout_ms),
        primary_host=0)
    if failure:
      with pytest.raises(checkpoint.SaveFailedElsewhere) as raised:
        background()
      assert len(barriers) == 1 and 'async_write_complete' in barriers[0]
      with pytest.raises(checkpoint.Outage) as stopped:
        checkpoint._save_failed(_Committed(), str(tmp_path), raised.value)
      assert str(stopped.value) == (
          f"stopped because process 0's commit of the checkpoint save failed: {line}")
    else:
      background()
      assert len(barriers) == 2 and 'async_commit_complete' in barriers[1]
  # Process 0 never answering: a TimeoutError naming it, within the barrier's time.
  manager = _Manager3()
  monkeypatch.setattr(checkpoint, '_commits', iter([2]))
  outcomes[1].hook(manager)
  manager._checkpointer._make_on_commit_callback('tmpdir', None, 0.0)
  with pytest.raises(TimeoutError, match='process 0 did not finish its commit'):
    outcomes[1].barrier(key='async_commit_complete', timeout_ms=1000)


@pytest.fixture(scope='module')
def pretrained(tmp_path_factory):
  """A tiny pre-training workdir (`workdirs.training_workdir`) and its parameters."""
  import jax  # pylint: disable=g-import-not-at-top
  import workdirs  # pylint: disable=g-import-not-at-top
  root = tmp_path_factory.mktemp('pretrained')
  vocab = root / 'vocab.txt'
  vocab.write_text('\n'.join(['[PAD]', '[UNK]', '[CLS]', '[SEP]', '[MASK]', 'the', 'a']) + '\n')
  config = model_lib.BertConfig(vocab_size=7, hidden_size=16, num_hidden_layers=2,
                                num_attention_heads=2, intermediate_size=32,
                                max_position_embeddings=32)
  params = model_lib.init_params(config, jax.random.key(0))
  return workdirs.training_workdir(str(root / 'w' / 'base'), config, params, str(vocab)), params


def test_a_workdir_named_by_a_relative_path_loads(pretrained, monkeypatch):
  """Orbax takes absolute paths only: `--checkpoint=w/base` (any command that loads a
  workdir: convert, features, fill-mask, predict, train.init_checkpoint) is made absolute."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  from bert_jax import convert  # pylint: disable=g-import-not-at-top
  workdir, params = pretrained
  monkeypatch.chdir(os.path.dirname(os.path.dirname(workdir)))
  config, loaded = checkpoint.load_pretrained_from_workdir('w/base')
  assert config.num_hidden_layers == 2
  np.testing.assert_array_equal(
      loaded['bert']['embeddings']['word_embeddings']['embedding'],
      params['bert']['embeddings']['word_embeddings']['embedding'])
  monkeypatch.chdir(os.path.dirname(workdir))
  _, _, tok, vocab, lower_case = convert.load_checkpoint('./base', flag='--checkpoint')
  assert (tok.vocab_size, vocab, lower_case) == (7, './base/vocab.txt', True)


def test_only_a_checkpoint_with_files_missing_is_called_damaged(pretrained, tmp_path,
                                                                monkeypatch):
  """The advice to move a step folder aside is for a step whose files are missing or cut
  short; any other failure keeps its own error (never the advice to set a good one aside)."""
  import shutil  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  from bert_jax.errors import UserError  # pylint: disable=g-import-not-at-top
  workdir = str(tmp_path / 'copy')
  shutil.copytree(pretrained[0], workdir)
  step = os.path.join(workdir, 'checkpoints', '1')
  with monkeypatch.context() as patch:
    patch.setattr(ocp.CheckpointManager, 'restore',
                  lambda *a, **k: (_ for _ in ()).throw(RuntimeError('a bug')))
    with pytest.raises(RuntimeError, match='^a bug$'):
      checkpoint.load_pretrained_from_workdir(workdir)
  os.remove(os.path.join(step, 'params', '_METADATA'))
  with pytest.raises(UserError, match=rf'^{step}: damaged or incomplete checkpoint \(.*_METADATA'
                     r'.* does not exist.*\); move that folder aside to use an earlier step'):
    checkpoint.load_pretrained_from_workdir(workdir)
  shutil.rmtree(os.path.join(step, 'params'))
  with pytest.raises(UserError, match=r'damaged or incomplete checkpoint \(it holds no params\)'):
    checkpoint.load_pretrained_from_workdir(workdir)
