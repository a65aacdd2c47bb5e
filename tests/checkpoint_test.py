"""Workdir files through tf.io.gfile: a non-local filesystem (TensorFlow's ram://) stands in for
Cloud Storage, which the machines that run these tests cannot reach."""

import json
import os
import re
import socket
import subprocess
import time

import pytest
import tensorflow as tf
from clu import data as clu_data

from bert_jax import checkpoint
from bert_jax import fileio
from bert_jax import model as model_lib
from bert_jax.errors import UserError
import processes


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


def _lock_record(**fields):
  return json.dumps(dict(dict(pid=1, host='elsewhere', started='then', heartbeat=0.0,
                              token='x'), **fields))


@pytest.mark.parametrize('where', ['local', 'ram'])
def test_workdir_lock_refuses_a_live_run_and_takes_over_a_dead_one(tmp_path, where):
  """One run per workdir, locally and on a non-local filesystem (no exclusive create there)."""
  workdir = str(tmp_path / 'w') if where == 'local' else f'ram://{tmp_path}/w'
  path = os.path.join(workdir, checkpoint.LOCK_FILE)
  tf.io.gfile.makedirs(workdir)
  live = subprocess.Popen(['sleep', '60'])
  dead = subprocess.Popen(['true'])
  dead.wait()
  host = socket.gethostname()
  try:
    for holder, refused in [
        (_lock_record(pid=live.pid, host=host), True),       # A live process here.
        (_lock_record(heartbeat=time.time()), True),         # Another host, fresh heartbeat.
        (_lock_record(pid=dead.pid, host=host), False),      # Its process is gone.
        (_lock_record(heartbeat=time.time() - 3600), False)]:  # Another host, silent an hour.
      if tf.io.gfile.exists(path):
        tf.io.gfile.remove(path)  # ram:// does not always replace a file written over.
      with tf.io.gfile.GFile(path, 'w') as f:
        f.write(holder)
      if refused:
        with pytest.raises(UserError, match=f'--workdir={workdir} is in use by another run'):
          with checkpoint.workdir_lock(workdir):
            pass
        assert tf.io.gfile.exists(path)  # The holder's lock stays.
      else:
        with checkpoint.workdir_lock(workdir):
          with tf.io.gfile.GFile(path) as f:
            assert json.loads(f.read())['pid'] == os.getpid()
        assert not tf.io.gfile.exists(path)  # Released at the end.
  finally:
    live.kill()
    live.wait()


def test_an_empty_local_lock_is_left_alone_while_young(tmp_path):
  """Without hard links a lock is created empty and then written: an empty lock younger than
  _LOCK_WRITE_SECONDS may be another run's being written, so it is not taken over; an older one
  is a run that died there."""
  workdir = str(tmp_path / 'w')
  os.makedirs(workdir)
  path = os.path.join(workdir, checkpoint.LOCK_FILE)
  open(path, 'w').close()
  with pytest.raises(UserError, match=re.escape(
      f'--workdir={workdir}: could not take the lock {path} (another run starts?)')):
    with checkpoint.workdir_lock(workdir):
      pass
  assert os.path.getsize(path) == 0
  old = time.time() - checkpoint._LOCK_WRITE_SECONDS - 1  # pylint: disable=protected-access
  os.utime(path, (old, old))
  with checkpoint.workdir_lock(workdir):
    assert json.loads(open(path).read())['pid'] == os.getpid()
  assert not os.path.exists(path)


def test_a_stale_lock_is_taken_over_where_the_workdir_cannot_be_flocked(tmp_path, monkeypatch):
  """On NFS, flock of a folder fails (EBADF): the stale lock is still taken over."""
  import errno  # pylint: disable=g-import-not-at-top
  import fcntl  # pylint: disable=g-import-not-at-top

  def refused(*args):
    raise OSError(errno.EBADF, 'Bad file descriptor')

  monkeypatch.setattr(fcntl, 'flock', refused)
  workdir = str(tmp_path / 'w')
  os.makedirs(workdir)
  path = os.path.join(workdir, checkpoint.LOCK_FILE)
  with open(path, 'w') as f:
    f.write(_lock_record(heartbeat=time.time() - 3600))
  with checkpoint.workdir_lock(workdir):
    assert json.loads(open(path).read())['pid'] == os.getpid()


@pytest.mark.parametrize('hard_links', [True, False])
def test_runs_started_at_once_on_a_local_workdir_one_takes_the_lock(tmp_path, hard_links):
  """Three processes race for a local workdir's lock over several rounds: each round exactly one
  holds it, whether the lock was free or left stale by a dead process on this host (only the
  racer that still finds the stale lock under the workdir's flock replaces it), and whether the
  filesystem has hard links (the lock appears whole) or not (O_EXCL, then its contents)."""
  workdir = str(tmp_path / 'w')
  os.makedirs(workdir)
  path = os.path.join(workdir, checkpoint.LOCK_FILE)
  dead = subprocess.Popen(['true'])
  dead.wait()

  def before_round(r):
    if r % 2:
      with open(path, 'w') as f:
        f.write(_lock_record(pid=dead.pid, host=socket.gethostname()))

  processes.race_for_lock(workdir, str(tmp_path), before_round=before_round,
                          hard_links=hard_links)
  assert os.listdir(workdir) == []  # Released, and no temporary lock file left.


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
