"""The agreement of several processes on a save's outcome, and the hooks into Orbax, asyncio and
logging it takes (`bert_jax/orbax_hooks.py`); processes simulated in one, with jax.distributed's
key-value store stood in for."""

import os
import threading

import pytest

from bert_jax import checkpoint
from bert_jax import errors
from bert_jax import orbax_hooks


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

  with orbax_hooks.reads_end_their_tasks(), pytest.raises(RuntimeError, match='read failed'):
    asyncio_utils.run_sync(restore())
  assert sorted(ended) == ['CancelledError', 'CancelledError', 'OSError']


def test_the_writes_of_a_failed_save_that_end_as_their_loop_stops_are_retrieved():
  """A failed save's writes (tasks of an asyncio.gather in Orbax's event loop of an item) fail
  one after another on a full disk. Those that fail in the loop's last round, as the first
  failure stops it, are done when it closes, but the gather's callbacks that retrieve their
  exceptions had not run: with no other task left to end there, asyncio printed "Task
  exception was never retrieved" and a traceback for each once collected, after the run's one
  line (1 of 38 full-disk runs on a loaded CPU). Here the writes fail a round apart, n of
  them: for one n the last fails in that round, with none left."""
  import asyncio  # pylint: disable=g-import-not-at-top
  import gc  # pylint: disable=g-import-not-at-top
  from orbax.checkpoint._src import asyncio_utils  # pylint: disable=g-import-not-at-top
  unretrieved = []

  async def write(rounds):
    for _ in range(rounds):
      await asyncio.sleep(0)
    raise ValueError('RESOURCE_EXHAUSTED: No space left on device')

  async def save(n):
    asyncio.get_running_loop().set_exception_handler(
        lambda loop, context: unretrieved.append((n, context['message'])))
    await asyncio.gather(*(write(rounds) for rounds in range(n)))

  for n in range(1, 9):
    with orbax_hooks.reads_end_their_tasks(), pytest.raises(ValueError, match='No space'):
      asyncio_utils.run_sync(save(n))
  gc.collect()
  assert not unretrieved


class _KeyValueStore:
  """jax.distributed's key-value store (what `orbax_hooks._exchange` uses of it)."""

  def __init__(self):
    self.values = {}

  def key_value_set(self, key, value):
    assert key not in self.values, key  # The client refuses to overwrite.
    self.values[key] = value

  def blocking_key_value_get(self, key, timeout_ms):
    if key not in self.values:
      raise RuntimeError(f'DEADLINE_EXCEEDED: {key} not set in {timeout_ms} ms')
    return self.values[key]

  def key_value_try_get(self, key):
    if key not in self.values:
      raise RuntimeError(f'NOT_FOUND: Config key {key} not found')
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
  monkeypatch.setattr(orbax_hooks.jax, 'process_count', lambda: 3)
  outage = ValueError('ABORTED: Error writing "gs://b/run/checkpoints/8/params/ocdbt.process_2/'
                      'd/0a1b": All 4 retry attempts failed: {\\"error\\": {\\"message\\": '
                      '\\"Backend Error\\"}}')
  full = OSError(28, 'No space left on device')
  bug = KeyError('params')
  for number, failure in enumerate((outage, full, bug)):
    for process, error in ((2, failure), (1, None), (0, None)):
      monkeypatch.setattr(orbax_hooks.jax, 'process_index', lambda p=process: p)
      agreed = orbax_hooks._Agreed(number, [_Written(), _Written(error)])
      if process == 1:  # It would wait for process 0: its outcome is published alone here.
        store.key_value_set(f'{orbax_hooks._OUTCOME_KEY}/{number}/1', 'null')
        continue
      with pytest.raises(Exception) as raised:
        agreed.result()
      if process == 2:
        assert raised.value is error  # Its own error, published first.
    assert isinstance(raised.value, orbax_hooks.SaveFailedElsewhere)
    assert raised.value.process == 2
    with pytest.raises(Exception) as stopped:
      checkpoint._save_failed(_Committed(), str(tmp_path), raised.value)
    line = str(stopped.value)
    assert line.startswith("stopped because process 2's part of the checkpoint save failed: ")
    if failure is outage:
      assert isinstance(stopped.value, errors.Outage)
      assert line.endswith(
          'gs://b/run/checkpoints/8/params/ocdbt.process_2/d/0a1b: Cloud Storage kept failing '
          '(Backend Error) past the retries (README: Cloud Storage); the last complete '
          'checkpoint, step 4, is intact: rerun the same command to resume once Cloud Storage '
          'answers')
    elif failure is full:
      assert isinstance(stopped.value, errors.UserError)
      assert 'No space left on device' in line and 'step 4, is intact' in line
    else:
      assert type(stopped.value) is RuntimeError and "'params'" in line
    assert '\n' not in line

  # Once every process has read an exchange, each deletes its own key of the one before.
  for process in (2, 1):
    store.key_value_set(f'{orbax_hooks._OUTCOME_KEY}/3/{process}', 'null')
  monkeypatch.setattr(orbax_hooks.jax, 'process_index', lambda: 0)
  orbax_hooks._Agreed(3, [_Written()]).result()
  assert f'{orbax_hooks._OUTCOME_KEY}/2/0' not in store.values
  assert f'{orbax_hooks._OUTCOME_KEY}/2/1' in store.values
  # A process that never publishes: a TimeoutError naming it, after OUTCOME_TIMEOUT_S.
  store.key_value_set(f'{orbax_hooks._OUTCOME_KEY}/4/1', 'null')
  with pytest.raises(TimeoutError, match='process 2 did not finish its part'):
    orbax_hooks._Agreed(4, [_Written()]).result()


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
  monkeypatch.setattr(orbax_hooks.jax, 'process_count', lambda: 2)
  path = 'gs://b/run/data_state/8/process_1.index'
  error, line = _outage_at(path)
  lines = {}
  for process, failure in ((1, error), (0, None)):
    monkeypatch.setattr(orbax_hooks.jax, 'process_index', lambda p=process: p)
    monkeypatch.setattr(orbax_hooks, '_exchanges', iter([5]))  # Each process's count.
    with pytest.raises(errors.Outage) as stopped:
      checkpoint.save(_Manager2(), str(tmp_path), 8, None, {}, _Position(failure))
    lines[process] = str(stopped.value)
  assert lines == {1: line, 0: f"stopped because process 1's part of the checkpoint save "
                                f'failed: {line}'}


class _Checkpointer:
  """Orbax's AsyncCheckpointer as `CommitOutcome.hook` uses it: its commit callbacks fail with
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
  monkeypatch.setattr(orbax_hooks.jax, 'process_count', lambda: 2)
  path = 'gs://b/run/checkpoints/8/commit_success.txt'
  error, line = _outage_at(path)
  outcomes = {p: orbax_hooks.CommitOutcome() for p in (0, 1)}
  barriers = []
  outcomes[1]._barrier = lambda key, timeout_ms: barriers.append(key)
  for save, failure in enumerate((error, None)):
    # Each process makes the save's commit callback (Orbax, on the main thread); process 0 runs
    # it, and the other goes through Orbax's background thread after its writes.
    callbacks = {}
    for process, manager in ((0, _Manager3(failure)), (1, _Manager3())):
      monkeypatch.setattr(orbax_hooks, '_commits', iter([save]))  # Each process's count.
      outcomes[process].hook(manager)
      callbacks[process] = manager._checkpointer._make_on_commit_callback('tmpdir', None, 0.0)
    monkeypatch.setattr(orbax_hooks.jax, 'process_index', lambda: 0)
    if failure:
      with pytest.raises(UnavailableError):
        callbacks[0]()
    else:
      callbacks[0]()
      assert f'{orbax_hooks._COMMIT_KEY}/0' not in store.values  # Read by all: dropped.
    monkeypatch.setattr(orbax_hooks.jax, 'process_index', lambda: 1)
    monkeypatch.setattr(multihost, 'process_index', lambda: 1)
    barriers.clear()
    background = lambda: async_checkpointer._background_wait_for_commit_futures(  # pylint: disable=protected-access
        epath.Path(os.path.dirname(path)), [], callbacks[1],
        barrier_sync_key_prefix='', timeout_secs=1200,
        sync_fn=lambda key, timeout_ms: outcomes[1].barrier(key=key, timeout_ms=timeout_ms),
        primary_host=0)
    if failure:
      with pytest.raises(orbax_hooks.SaveFailedElsewhere) as raised:
        background()
      assert len(barriers) == 1 and 'async_write_complete' in barriers[0]
      with pytest.raises(errors.Outage) as stopped:
        checkpoint._save_failed(_Committed(), str(tmp_path), raised.value)
      assert str(stopped.value) == (
          f"stopped because process 0's commit of the checkpoint save failed: {line}")
    else:
      background()
      assert len(barriers) == 2 and 'async_commit_complete' in barriers[1]
  # Process 0 never answering: a TimeoutError naming it, within the barrier's time.
  manager = _Manager3()
  monkeypatch.setattr(orbax_hooks, '_commits', iter([2]))
  outcomes[1].hook(manager)
  manager._checkpointer._make_on_commit_callback('tmpdir', None, 0.0)
  with pytest.raises(TimeoutError, match='process 0 did not finish its commit'):
    outcomes[1].barrier(key='async_commit_complete', timeout_ms=1000)


def test_a_start_one_process_cannot_make_ends_the_others_barrier_and_stops_them_all(
    monkeypatch, tmp_path):
  """Process 0 alone checks and makes a save's folders on its main thread, while the others
  wait in Orbax's next barrier (jax's sync_global_devices, no timeout). Its check fails past the
  retries: it publishes that and meets them in a barrier of its own name, which ends theirs
  with sync_global_devices' name mismatch; it stops with 143's line naming the object, process
  1 naming process 0 and it. A bug is raised as it is, and ends no barrier."""
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  from orbax.checkpoint import multihost  # pylint: disable=g-import-not-at-top
  store, barriers = _KeyValueStore(), []
  monkeypatch.setattr(multihost, 'get_jax_distributed_client', lambda: store)
  monkeypatch.setattr(orbax_hooks.jax, 'process_count', lambda: 2)
  mismatch = AssertionError("sync_global_devices name mismatch ('create_tmp_directory:post')")

  def sync_global_devices(name):
    # The failure is published before the barrier: the others read it as theirs ends.
    number = name.split()[2]
    assert any(k.startswith(f'{orbax_hooks._START_KEY}/{number}/') for k in store.values)
    barriers.append(name)
    if blocked:
      threading.Event().wait(60)  # The others never reach a barrier.
    if not everyone_failed:
      raise AssertionError(f"sync_global_devices name mismatch ('{name}')")

  monkeypatch.setattr(multihost_utils, 'sync_global_devices', sync_global_devices)
  error, line = _outage_at('gs://b/run/checkpoints/8')

  def start(process, number, failure):
    """What process `process`'s save `number` raises when its start raises `failure`."""
    monkeypatch.setattr(orbax_hooks.jax, 'process_index', lambda: process)
    monkeypatch.setattr(orbax_hooks, '_saves', iter([number]))  # Each process's count.
    with pytest.raises(Exception) as raised:
      with orbax_hooks.start_agreed():
        raise failure
    return raised.value

  everyone_failed = blocked = False
  assert start(0, 3, error) is error
  assert barriers == ['bert_jax: save 3 failed to start']
  stopped = start(1, 3, mismatch)
  assert isinstance(stopped, orbax_hooks.SaveFailedElsewhere) and stopped.__cause__ is mismatch
  assert barriers == ['bert_jax: save 3 failed to start']  # Only the failed process meets them.
  for process, raised in ((0, error), (1, stopped)):
    monkeypatch.setattr(orbax_hooks.jax, 'process_index', lambda p=process: p)
    with pytest.raises(errors.Outage) as ended:
      checkpoint._save_failed(_Committed(), str(tmp_path), raised)
    assert str(ended.value) == line if process == 0 else (
        f"stopped because process 0's start of the checkpoint save failed: {line}")

  # A bug is raised as it is: nothing published, no barrier met; in the others too.
  bug = KeyError('meta')
  assert start(0, 4, bug) is bug and start(1, 4, mismatch) is mismatch
  assert len(barriers) == 1 and not any('/4/' in k for k in store.values)
  # Every process's start failed: their barriers of the same name pass.
  everyone_failed = True
  assert start(1, 5, error) is error and start(0, 5, error) is error
  assert barriers[1:] == ['bert_jax: save 5 failed to start'] * 2
  # An earlier save's failure agreed on already (in every process): raised as it is.
  elsewhere = orbax_hooks.SaveFailedElsewhere(1, orbax_hooks.report(error))
  assert start(0, 6, elsewhere) is elsewhere and len(barriers) == 3
  # The others never reaching a barrier: the failed process stops after RELEASE_TIMEOUT_S.
  monkeypatch.setattr(orbax_hooks, 'RELEASE_TIMEOUT_S', 0.5)
  everyone_failed = blocked = True
  assert start(0, 7, error) is error and len(barriers) == 4
  # One process: raised as it is.
  monkeypatch.setattr(orbax_hooks.jax, 'process_count', lambda: 1)
  assert start(0, 8, error) is error and len(barriers) == 4


# ---- The internals the hooks rely on, on the installed Orbax ---------------------------------
# Each test below fails when an Orbax upgrade renames, drops or stops calling what a hook of
# orbax_hooks.py relies on: the hook would otherwise be turned off without a word.


def test_orbax_makes_each_saves_commit_callback_through_the_hooked_method(tmp_path, monkeypatch):
  """`CommitOutcome.hook` replaces the checkpointer's `_make_on_commit_callback`: a real save
  goes through it, and its commit's outcome is published once, after the commit."""
  import itertools  # pylint: disable=g-import-not-at-top
  import threading  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  manager = ocp.CheckpointManager(
      str(tmp_path / 'checkpoints'), item_handlers={'meta': ocp.JsonCheckpointHandler()},
      options=ocp.CheckpointManagerOptions(enable_async_checkpointing=True))
  assert isinstance(manager._checkpointer, ocp.AsyncCheckpointer)  # pylint: disable=protected-access
  outcome = orbax_hooks.CommitOutcome()
  published = []
  monkeypatch.setattr(orbax_hooks, '_commits', itertools.count(7))
  monkeypatch.setattr(outcome, 'publish', lambda number, error: published.append(
      (number, error, threading.current_thread().name)))
  outcome.hook(manager)
  manager.save(1, args=ocp.args.Composite(meta=ocp.args.JsonSave({'a': 1})))
  manager.wait_until_finished()
  # Published once, by the commit in Orbax's background save thread.
  assert published == [(7, None, 'async_save')]
  manager.reload()
  assert manager.latest_step() == 1
  manager.close()


def test_orbax_saves_each_item_through_its_handlers_async_save(tmp_path):
  """`agreeing` replaces a handler's `async_save` on the instance: Orbax's save of the item
  calls that one."""
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  handler = ocp.JsonCheckpointHandler()
  original, calls = handler.async_save, []

  async def spy(*args, **kwargs):
    calls.append(True)
    return await original(*args, **kwargs)

  handler.async_save = spy
  manager = ocp.CheckpointManager(str(tmp_path / 'checkpoints'),
                                  item_handlers={'meta': orbax_hooks.agreeing(handler)})
  manager.save(1, args=ocp.args.Composite(meta=ocp.args.JsonSave({'a': 1})))
  manager.wait_until_finished()
  assert calls == [True]
  assert manager.restore(1, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))['meta'] == {
      'a': 1}
  manager.close()


def test_orbax_writes_each_item_in_a_thread_its_save_starts(tmp_path, monkeypatch):
  """`writer_threads` finds a failed save's writes, for `join_writers` to wait for, as threads
  of Orbax's own classes started inside Orbax's `save`: the arrays' and the JSON item's writes
  must stay such threads (as a shared pool's workers they would be missed, and a late write
  would make a removed folder again), and nothing else is taken for one."""
  import concurrent.futures  # pylint: disable=g-import-not-at-top
  import threading  # pylint: disable=g-import-not-at-top
  import types  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  started, start, saving = [], threading.Thread.start, []

  def spy(self):
    if saving:
      started.append(self)
    return start(self)

  save = ocp.CheckpointManager.save

  def spied_save(self, *args, **kwargs):
    saving.append(True)
    try:
      return save(self, *args, **kwargs)
    finally:
      saving.clear()

  monkeypatch.setattr(threading.Thread, 'start', spy)
  monkeypatch.setattr(ocp.CheckpointManager, 'save', spied_save)
  workdir = str(tmp_path)
  manager = checkpoint.make_manager(workdir, keep=None, replica_parallel=False)
  state = types.SimpleNamespace(params={'w': jnp.ones((4, 4))}, opt_state={'m': jnp.zeros(4)},
                                saved_extras=dict)
  checkpoint.save(manager, workdir, 1, state, {})
  checkpoint.wait_for_saves(manager, workdir)
  writers = {t.name for t in started if orbax_hooks._is_orbax_thread(t)}  # pylint: disable=protected-access
  assert {'array_type_handler', 'json_ch_save'} <= writers, [t.name for t in started]
  assert set(manager.writers) <= set(started), manager.writers
  assert manager.latest_step() == 1
  manager.close()

  with orbax_hooks.writer_threads() as found:
    pool = concurrent.futures.ThreadPoolExecutor(1)
    pool.submit(lambda: None).result()
    plain = threading.Thread(target=threading.Event().wait, args=(0.5,))
    plain.start()
  pool.shutdown()
  plain.join()
  assert found == []


def test_orbaxs_barriers_in_a_save_are_jaxs_sync_global_devices(tmp_path, monkeypatch):
  """`start_agreed` ends the barriers of Orbax's save with one of its own name: Orbax's save
  waits, before and after making its folders, in its `sync_global_processes` for every
  process, which is jax's `sync_global_devices`; that raises in every process when the
  processes' names differ."""
  import zlib  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  from orbax.checkpoint._src.multihost import multihost  # pylint: disable=g-import-not-at-top
  barriers, sync = [], multihost.sync_global_processes

  def spy(name, **kwargs):
    barriers.append((name.split(':')[-1] if 'create_tmp' in name else 'other',
                     kwargs.get('processes')))
    return sync(name, **kwargs)

  monkeypatch.setattr(multihost, 'sync_global_processes', spy)
  manager = checkpoint.make_manager(str(tmp_path), keep=None)
  manager.save(1, args=ocp.args.Composite(meta=ocp.args.JsonSave({'a': 1})))
  manager.wait_until_finished()
  manager.close()
  assert [b for b in barriers if b[0] != 'other'] == [('pre', None), ('post', None)] * 2
  assert {p for _, p in barriers} == {None}  # Every process's.
  # Orbax's barrier for every process, with several: jax's sync_global_devices.
  names = []
  monkeypatch.setattr(multihost, 'should_skip_process_sync', lambda *args, **kwargs: False)
  monkeypatch.setattr(multihost_utils, 'sync_global_devices', names.append)
  sync('create_tmp_directory:pre')
  assert len(names) == 1 and 'create_tmp_directory:pre' in names[0]
  # Two processes whose names differ (the other one's gathered beside this one's).
  monkeypatch.undo()
  monkeypatch.setattr(multihost_utils.jax, 'process_count', lambda: 2)
  monkeypatch.setattr(multihost_utils, 'process_allgather', lambda x, tiled=False: np.array(
      [zlib.crc32(b'mine'), zlib.crc32(b'theirs')], np.uint32))
  with pytest.raises(AssertionError, match='name mismatch'):
    multihost_utils.sync_global_devices('mine')


def test_orbaxs_background_save_has_the_barrier_after_the_commit(monkeypatch):
  """`CommitOutcome.barrier` knows the barrier after process 0's commit by its key: Orbax's
  background save calls its barriers, with those keys, around the commit."""
  from etils import epath  # pylint: disable=g-import-not-at-top
  from orbax.checkpoint._src.checkpointers import async_checkpointer  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(orbax_hooks.jax, 'process_count', lambda: 2)
  events = []
  async_checkpointer._background_wait_for_commit_futures(  # pylint: disable=protected-access
      epath.Path('/tmp/8'), [_Written()], lambda: events.append('commit'),
      barrier_sync_key_prefix='', timeout_secs=60,
      sync_fn=lambda key, timeout_ms: events.append(key), primary_host=0)
  assert len(events) == 3 and events[1] == 'commit', events
  assert orbax_hooks._AFTER_COMMIT_BARRIER in events[2]  # pylint: disable=protected-access
  assert orbax_hooks._AFTER_COMMIT_BARRIER not in events[0]  # pylint: disable=protected-access


def test_orbax_runs_its_reads_in_an_event_loop_of_the_policy():
  """`reads_end_their_tasks` (and `ORBAX_ERRORS.hold`) swap the event-loop policy: Orbax's
  `run_sync` makes its loops through it."""
  import asyncio  # pylint: disable=g-import-not-at-top
  from orbax.checkpoint._src import asyncio_utils  # pylint: disable=g-import-not-at-top

  async def loop_kind():
    return type(asyncio.get_running_loop()).__name__

  with orbax_hooks.reads_end_their_tasks():
    assert asyncio_utils.run_sync(loop_kind()) == '_TaskEndingLoop'
  orbax_hooks.ORBAX_ERRORS.hold()
  try:
    assert asyncio_utils.run_sync(loop_kind()) == '_TaskEndingLoop'
  finally:
    orbax_hooks.ORBAX_ERRORS.release(show=False)
  assert asyncio_utils.run_sync(loop_kind()) != '_TaskEndingLoop'


def test_orbaxs_error_lines_of_a_failed_save_are_held_back():
  """`ORBAX_ERRORS` tells Orbax's records by the file that logs them: the error Orbax's
  background save logs when its writes fail is held back, and shown or dropped on release; after
  a drop, the lines a failed save's other writes log later are dropped too, until the next hold;
  after a show, Orbax's error lines pass again."""
  import logging  # pylint: disable=g-import-not-at-top
  from etils import epath  # pylint: disable=g-import-not-at-top
  from orbax.checkpoint._src.checkpointers import async_checkpointer  # pylint: disable=g-import-not-at-top
  shown = []
  handler = logging.Handler(logging.ERROR)
  handler.emit = shown.append
  logging.getLogger('absl').addHandler(handler)
  try:
    background = async_checkpointer._AsyncManager(  # pylint: disable=protected-access
        barrier_sync_fn=lambda key, timeout_ms: None, timeout_secs=60)

    def fail():
      background._thread_func(epath.Path('/tmp/8'), [_Written(OSError(28, 'disk full'))],  # pylint: disable=protected-access
                               lambda: None)

    orbax_hooks.ORBAX_ERRORS.hold()
    fail()
    orbax_hooks.ORBAX_ERRORS.release(show=False)
    fail()  # A write of the failed save that fails after its outcome is known.
    assert not shown
    orbax_hooks.ORBAX_ERRORS.hold()
    fail()
    assert not shown
    orbax_hooks.ORBAX_ERRORS.release(show=True)
    assert len(shown) == 1 and 'Failed to run 1 Handler Commit' in shown[0].getMessage()
    fail()
    assert len(shown) == 2
  finally:
    logging.getLogger('absl').removeHandler(handler)


def test_the_key_value_store_is_reached_as_the_hooks_reach_it():
  """jax.distributed's key-value store, through Orbax's accessor, with the calls made."""
  from jax._src.lib import _jax  # pylint: disable=g-import-not-at-top
  from orbax.checkpoint import multihost  # pylint: disable=g-import-not-at-top
  assert callable(multihost.get_jax_distributed_client)
  assert callable(multihost.get_barrier_sync_fn)
  for method in ('key_value_set', 'blocking_key_value_get', 'key_value_try_get',
                 'key_value_delete'):
    assert callable(getattr(_jax.DistributedRuntimeClient, method)), method


def test_orbaxs_reads_and_writes_of_arrays_get_the_runs_retry_budget(tmp_path, monkeypatch):
  """`bounded_retries`: the type handlers of a checkpoint (`checkpoint._registry`) hand Orbax's
  own serialize, deserialize and metadata each parameter's tensorstore context as a child that
  holds `gcs.tensorstore_retries()`; Orbax passes it on as `ParamInfo.ts_context`."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  budget = {'max_retries': 3, 'initial_delay': '2s', 'max_delay': '5s'}  # None the default.
  monkeypatch.setattr(orbax_hooks.gcs, 'tensorstore_retries', lambda: budget)
  seen = []
  for method in ('serialize', 'deserialize', 'metadata'):
    original = getattr(ocp.type_handlers.NumpyHandler, method)

    async def spy(self, *args, _original=original, _method=method, **kwargs):
      infos = args[1] if _method == 'serialize' else args[0]
      seen.extend((_method, info.ts_context['gcs_request_retries'].to_json()) for info in infos)
      return await _original(self, *args, **kwargs)

    monkeypatch.setattr(ocp.type_handlers.NumpyHandler, method, spy)
  handler = ocp.PyTreeCheckpointHandler(type_handler_registry=checkpoint._registry(False))  # pylint: disable=protected-access
  manager = ocp.CheckpointManager(str(tmp_path / 'checkpoints'), item_handlers={'p': handler})
  manager.save(1, args=ocp.args.Composite(p=ocp.args.PyTreeSave({'w': np.arange(3.)})))
  manager.wait_until_finished()
  restored = manager.restore(1, args=ocp.args.Composite(p=ocp.args.PyTreeRestore(
      restore_args={'w': ocp.RestoreArgs(restore_type=np.ndarray)})))
  np.testing.assert_array_equal(restored['p']['w'], np.arange(3.))
  manager.close()
  assert {method for method, _ in seen} >= {'serialize', 'deserialize'}, seen
  assert all(resource == budget for _, resource in seen), seen
