"""Where bert_jax reaches inside Orbax, asyncio and logging: one outcome per save across
processes, event loops that end their tasks, Orbax's error lines held back until a save's outcome
is known.

Every hook into another library's internals lives here, each with the reason no public API does
its job; `tests/orbax_hooks_test.py` fails when an internal one relies on is renamed or gone (an
Orbax upgrade would otherwise disable it silently):
  - `CommitOutcome.hook` wraps the commit callbacks that Orbax's asynchronous checkpointer makes
    per save (`CheckpointManager._checkpointer._make_on_commit_callback`). Orbax's public hooks
    see only part of process 0's commit: `AsyncOptions.post_finalization_callback` runs after
    the step metadata and the handlers' finalize (the OCDBT merge) but before commit_success.txt
    or the rename, and not at all when an earlier part fails; `AsyncOptions.barrier_sync_fn`
    is called after a commit that succeeded only. Neither can tell the other processes that a
    commit failed, and with what error.
  - `CommitOutcome.barrier` (Orbax's public `AsyncOptions.barrier_sync_fn`) knows the barrier
    after the commit by its key, `_AFTER_COMMIT_BARRIER`, a name inside Orbax's background save.
  - `start_agreed` ends the barriers of Orbax's save (`orbax.checkpoint.multihost`'s
    `sync_global_processes`: jax's public `multihost_utils.sync_global_devices`, whose
    documented check of the barrier's name it relies on) by meeting them under another name:
    Orbax's barriers have no timeout and no way to be left.
  - `agreeing` replaces a handler's `async_save` (a public method of the handler interface) on
    the instance. A subclass would be the documented way, but Orbax pairs a handler with its
    CheckpointArgs by exact class (`checkpoint_args.get_registered_args_cls`): a subclass needs
    args classes of its own, registered process-wide (`ocp.args.register_with_handler`).
  - `reads_end_their_tasks` and `ORBAX_ERRORS` swap the process-wide asyncio event-loop policy
    (public asyncio API) because Orbax makes its own event loops (`asyncio_utils.run_sync`) and
    offers no way to give it one.
  - `ORBAX_ERRORS` filters the records Orbax logs through absl's logger, told apart by the path
    of the file that logs them: Orbax has no option to keep a failed save's tracebacks quiet.
  - `bounded_retries` subclasses Orbax's type handlers (`ocp.type_handlers`, a public
    interface) to give each parameter's tensorstore context (`ParamInfo.ts_context`) the run's
    Cloud Storage retry budget: Orbax builds the contexts of a save or restore itself and takes
    none from its caller. (Type handlers are found by the Python type they are registered for,
    not by class, so a subclass is enough here.)
  - The key-value store is jax.distributed's, reached through Orbax's
    `multihost.get_jax_distributed_client` (JAX has no public accessor).
"""

import asyncio
import contextlib
import itertools
import json
import logging as std_logging
import os
import threading
import time
from typing import Any, Callable, Iterable, Iterator

import jax
import orbax.checkpoint as ocp
from absl import logging

from bert_jax import fileio
from bert_jax import gcs

# ---- Several processes: one outcome per save ------------------------------------------------
#
# Each process writes its own shards of a save (and process 0 the metadata). When one process's
# writes fail (Cloud Storage past the retries, a full disk), the processes part ways inside
# Orbax: that one waits in the barrier of its clean-up, the others in the barrier after the
# writes, each up to Orbax's timeout (20 min), and they end with statuses that need not agree:
# a scheduler would not read the job as "rerun to resume" (launch/ reruns it when every process
# exits 143). So every process, once its writes (its input position, then its part of each
# item) are done or failed, publishes the outcome in jax.distributed's key-value store and
# reads every other process's before going on to Orbax's barriers: all continue, or all fail
# (the others with `SaveFailedElsewhere`) at the same point and leave the save together.
# After the barrier that follows the writes, process 0 alone commits the save (the step's
# metadata, the merge of the processes' OCDBT files, commit_success.txt) while the others go
# to Orbax's last barrier, which process 0 never reaches if its commit fails: it publishes the
# commit's outcome, and the others read it before that barrier (`CommitOutcome`). Before the
# writes, on the main thread, process 0 alone checks and makes the save's folders while the
# others wait in Orbax's barrier after them (`start_agreed`).

# The key-value store's prefix; the input positions and each item of each save are one exchange
# each, numbered in the order every process makes them (the same in every process).
_OUTCOME_KEY = 'bert_jax/checkpoint_outcome'
_exchanges = itertools.count()
# How long a process waits for another's outcome: Orbax's own bound on a save's background
# work (AsyncOptions.timeout_secs), which a slow process's writes (tensorstore retrying a
# request for up to ~15 min) must fit in anyway.
OUTCOME_TIMEOUT_S = 1200


class SaveFailedElsewhere(Exception):
  """Another process's `part` of this save failed (`report`: what `report` says of its
  error); this process stops with it (`checkpoint._save_failed` says which process and why)."""

  def __init__(self, process: int, report: dict[str, Any],
               part: str = 'part of the checkpoint save'):
    super().__init__(f'process {process}\'s {part} failed: {report["line"]}')
    self.process = process
    self.report = report
    self.part = part


def report(error: BaseException) -> dict[str, Any]:
  """What the other processes need to stop with the same status and line as this one."""
  if isinstance(error, SaveFailedElsewhere):
    return error.report
  return dict(outage=gcs.failing_object(error), disk=_disk_error(error),
              line=(str(error).strip().splitlines() or [type(error).__name__])[0][:500])


def agree(error: BaseException | None) -> None:
  """This process's outcome of its part of a save that is not Orbax's (its input position),
  exchanged with every other process's: raises `error`, else a `SaveFailedElsewhere` for the
  first other process whose part failed."""
  _exchange(next(_exchanges), error, OUTCOME_TIMEOUT_S)


def failed_elsewhere(error: BaseException | None) -> SaveFailedElsewhere | None:
  """The `SaveFailedElsewhere` in `error`'s chain (its causes and contexts), or None."""
  seen = []
  while error is not None and error not in seen:
    if isinstance(error, SaveFailedElsewhere):
      return error
    seen.append(error)
    error = error.__cause__ or error.__context__
  return None


def _exchange(number: int, error: BaseException | None, timeout_s: float) -> None:
  """Publishes this process's outcome of exchange `number` and reads the others'; raises this
  process's `error`, else a `SaveFailedElsewhere` for the first other process that failed."""
  from orbax.checkpoint import multihost  # pylint: disable=g-import-not-at-top
  client = multihost.get_jax_distributed_client()
  me, key = jax.process_index(), f'{_OUTCOME_KEY}/{number}'
  client.key_value_set(f'{key}/{me}', json.dumps(None if error is None else report(error)))
  if error is not None:
    raise error
  for other in range(jax.process_count()):
    if other != me:
      _read_outcome(client, f'{key}/{other}', other, 'part of the checkpoint save', timeout_s)
  if number:
    # Every process has read it: none posts exchange `number` before reading all of the one
    # before.
    client.key_value_delete(f'{_OUTCOME_KEY}/{number - 1}/{me}')


def _read_outcome(client: Any, key: str, process: int, part: str, timeout_s: float) -> None:
  """Waits for `process`'s outcome of its `part` of a save under `key`; raises a
  `SaveFailedElsewhere` if it failed."""
  try:
    value = client.blocking_key_value_get(key, max(int(timeout_s * 1000), 1))
  except Exception as e:  # pylint: disable=broad-except  (jax's DEADLINE_EXCEEDED)
    raise TimeoutError(f'process {process} did not finish its {part} in {timeout_s:.0f} '
                       's') from e
  if (outcome := json.loads(value)) is not None:
    raise SaveFailedElsewhere(process, outcome, part)


# The key-value store's prefix of process 0's commits, numbered like the saves (of every
# manager, in the order every process makes them).
_COMMIT_KEY = 'bert_jax/checkpoint_commit'
_commits = itertools.count()
_COMMIT_PART = 'commit of the checkpoint save'
# What Orbax's asynchronous checkpointer calls the barrier after process 0's commit.
_AFTER_COMMIT_BARRIER = 'async_commit_complete'


class CommitOutcome:
  """Process 0's commit of a save, agreed on by every process.

  Orbax's background thread of a save, in every process: its writes (`_Agreed`), a barrier,
  then (process 0 alone) the commit callback, then a barrier (`_AFTER_COMMIT_BARRIER`). Process
  0's callback publishes its outcome (`hook`) and the others read it before that last barrier
  (`barrier`, Orbax's `barrier_sync_fn`), so that a commit that fails stops them all with
  `SaveFailedElsewhere` where their save's failures surface, instead of leaving them in a
  barrier that process 0 never reaches.
  """

  def __init__(self):
    self._pending: int | None = None  # The save whose commit is under way (one at a time).
    self._barrier: Callable[..., None] | None = None

  def hook(self, manager: ocp.CheckpointManager) -> None:
    """Wraps the commit callbacks of `manager`'s checkpointer (made once per save, in every
    process, on the main thread before the save's writes; run by process 0 alone)."""
    checkpointer = manager._checkpointer  # pylint: disable=protected-access
    make = checkpointer._make_on_commit_callback  # pylint: disable=protected-access

    def make_agreed(*args, **kwargs) -> Callable[[], None]:
      callback = make(*args, **kwargs)
      number = self._pending = next(_commits)

      def agreed() -> None:
        error = None
        try:
          callback()
        except Exception as e:  # pylint: disable=broad-except  (raised below, after publishing)
          error = e
        self.publish(number, error)
        if error is not None:
          raise error

      return agreed

    checkpointer._make_on_commit_callback = make_agreed  # pylint: disable=protected-access

  def publish(self, number: int, error: BaseException | None) -> None:
    """Process 0: publishes the outcome of commit `number` (and drops the one before, which
    every process read before the barrier that ended it)."""
    from orbax.checkpoint import multihost  # pylint: disable=g-import-not-at-top
    client = multihost.get_jax_distributed_client()
    client.key_value_set(f'{_COMMIT_KEY}/{number}',
                         json.dumps(None if error is None else report(error)))
    if number:
      client.key_value_delete(f'{_COMMIT_KEY}/{number - 1}')

  def barrier(self, *, key: str, timeout_ms: int) -> None:
    """Orbax's barrier `key`; before the one after the commit, the others than process 0 read
    the commit's outcome (within the barrier's own time)."""
    if (_AFTER_COMMIT_BARRIER in key and jax.process_index() != 0
        and self._pending is not None):
      from orbax.checkpoint import multihost  # pylint: disable=g-import-not-at-top
      _read_outcome(multihost.get_jax_distributed_client(), f'{_COMMIT_KEY}/{self._pending}',
                    0, _COMMIT_PART, timeout_ms / 1000)
    if self._barrier is None:
      from orbax.checkpoint import multihost  # pylint: disable=g-import-not-at-top
      self._barrier = multihost.get_barrier_sync_fn()
    self._barrier(key=key, timeout_ms=timeout_ms)


# The key-value store's prefix of the failures of a save's start, numbered like the saves (of
# every manager, in the order every process makes them).
_START_KEY = 'bert_jax/checkpoint_start'
_saves = itertools.count()
_START_PART = 'start of the checkpoint save'


@contextlib.contextmanager
def start_agreed() -> Iterator[None]:
  """Around each of Orbax's saves, in every process: the start of the save (before its writes
  go to the background) agreed on by every process when there are several.

  Orbax's save starts on the main thread, where process 0 alone checks and makes the step's
  folders (the item folders in a helper thread the main thread waits for), between barriers
  that every process passes: jax's `sync_global_devices`, one allgather of the barrier's
  name, with no timeout. When that fails, process 0 stops there and the others wait in the
  next barrier (both runs ended in aborts from jax.distributed's shutdown, 5 min later). So a
  process whose start fails with a storage problem (the only failure there that is not a bug)
  publishes it, then meets the others in a barrier of its own name: `sync_global_devices`
  compares the names, and the barrier ends at once in every process with its mismatch error;
  each of the others then reads who failed and why, and stops with `SaveFailedElsewhere`.
  Nothing of a save's storage runs on the main thread after its last barrier, so the others
  are in (or on their way to) one; should they not reach one (killed, or in a key-value
  barrier of Orbax's), the failed process stops after `RELEASE_TIMEOUT_S` all the same.
  """
  number = next(_saves)
  try:
    yield
  except Exception as e:  # pylint: disable=broad-except  (raised, or what stops it instead)
    if jax.process_count() == 1 or (stop := _start_failed(number, e)) is e:
      raise
    raise stop from e


# How long a process whose save failed to start waits for the others to meet its barrier:
# Orbax's own bound on its barriers.
RELEASE_TIMEOUT_S = 300


def _start_failed(number: int, error: BaseException) -> BaseException:
  """What this process stops with, the start of save `number` having raised `error`: `error`
  itself if it is a storage problem here (published, and the others' barrier ended), a
  `SaveFailedElsewhere` if another process's start failed so, else `error`."""
  if failed_elsewhere(error) is not None:
    return error  # An earlier save's, agreed on already (every process has it).
  from orbax.checkpoint import multihost  # pylint: disable=g-import-not-at-top
  client, me = multihost.get_jax_distributed_client(), jax.process_index()
  outcome = report(error)
  if outcome['outage'] is not None or outcome['disk'] is not None:
    # Published before the barrier: the others read it once theirs ends.
    client.key_value_set(f'{_START_KEY}/{number}/{me}', json.dumps(outcome))
    _release(f'bert_jax: save {number} failed to start')
    return error
  for other in range(jax.process_count()):
    if other == me:
      continue
    try:
      value = client.key_value_try_get(f'{_START_KEY}/{number}/{other}')
    except Exception as e:  # pylint: disable=broad-except  (jax's NOT_FOUND: it did not fail)
      if 'NOT_FOUND' not in str(e):
        raise
      continue
    return SaveFailedElsewhere(other, json.loads(value), _START_PART)
  return error


def _release(name: str) -> None:
  """Meets the other processes in a barrier named `name` (the same in every process whose
  start failed: where all did, it passes), within RELEASE_TIMEOUT_S."""
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top

  def meet():
    try:
      multihost_utils.sync_global_devices(name)
    except AssertionError:  # The others were in (or reached) a barrier of Orbax's.
      pass

  thread = threading.Thread(target=meet, name='bert_jax_release', daemon=True)
  thread.start()
  thread.join(RELEASE_TIMEOUT_S)
  if thread.is_alive():
    logging.warning('The other processes did not reach a barrier within %d s of this one\'s '
                    'failed checkpoint save; stopping without them.', RELEASE_TIMEOUT_S)


class _Agreed:
  """An Orbax commit future for this process's writes of one item, whose result is every
  process's (`_exchange`). `error`: the item's save failed before it had futures."""

  def __init__(self, number: int, futures: list[Any], error: BaseException | None = None):
    self._number, self._futures, self._error = number, futures, error

  def result(self, timeout: float | None = None) -> None:
    start, error = time.time(), self._error
    if error is None:
      try:
        for f in self._futures:
          f.result(timeout=None if timeout is None else max(timeout - time.time() + start, 0))
      except Exception as e:  # pylint: disable=broad-except  (given to the other processes)
        error = e
    waited = time.time() - start
    _exchange(self._number, error, max(OUTCOME_TIMEOUT_S - waited, 1) if timeout is None
              else max(timeout - waited, 1))

  def cancel(self) -> None:
    for f in self._futures:
      f.cancel()


def agreeing(handler: Any) -> Any:
  """Orbax's `handler`, whose saves end with every process's outcome when there are several
  (`_Agreed`). (Its class stays Orbax's: Orbax finds handlers by class.)"""
  save = handler.async_save

  async def async_save(*args, **kwargs):
    if jax.process_count() == 1:
      return await save(*args, **kwargs)
    # Numbered before the first await: Orbax saves the items concurrently.
    number = next(_exchanges)
    try:
      futures = await save(*args, **kwargs)
    except Exception as e:  # pylint: disable=broad-except  (raised by its future, everywhere)
      return [_Agreed(number, [], e)]
    return [_Agreed(number, list(futures or []))]

  handler.async_save = async_save
  return handler


class _HeldBackOrbaxErrors(std_logging.Filter):
  """Holds back the error lines Orbax logs while a save of ours is under way, until its outcome
  is known.

  A save that fails logs its error's traceback from three of Orbax's threads, and once more as
  `wait_until_finished` re-raises it: about 350 lines above the message. A storage problem (a
  full disk) is the user's to fix and ends as one line (`checkpoint._save_failed`'s UserError),
  so they are dropped, and so are the ones Orbax logs after it: a failed save's other writes (each
  its own thread, `_SignalingThread`) go on after the first failure ends the save, and fail and
  log in turn while `join_writers` waits for them, or later still when they outlast it (and on
  Cloud Storage past the retries, where nothing waits for them). With any other outcome they are
  logged as they were. Meanwhile Orbax's
  event loops end their tasks when closed (`_TaskEndingLoop`): the writes still under way when
  one fails would otherwise each print an uncatchable "Event loop is closed" traceback as they
  finish.
  """

  def __init__(self):
    super().__init__()
    self._held: list[std_logging.LogRecord] = []
    self._lock = threading.Lock()
    self._logger = std_logging.getLogger('absl')  # Orbax logs through absl.
    self._policy: asyncio.AbstractEventLoopPolicy | None = None
    self._dropping = False

  def filter(self, record: std_logging.LogRecord) -> bool:
    if record.levelno < std_logging.ERROR or f'{os.sep}orbax{os.sep}' not in record.pathname:
      return True
    with self._lock:
      if not self._dropping:
        self._held.append(record)
    return False

  def hold(self) -> None:
    with self._lock:
      self._dropping = False
    if self not in self._logger.filters:
      self._logger.addFilter(self)
    if self._policy is None:
      self._policy = asyncio.get_event_loop_policy()
      asyncio.set_event_loop_policy(_TaskEndingPolicy())

  def release(self, show: bool) -> None:
    """Stops holding back: logs what was held if `show`; else drops it and every error line
    Orbax logs from now until the next `hold` (the failed save's writes still under way)."""
    if self._policy is not None:
      asyncio.set_event_loop_policy(self._policy)
      self._policy = None
    with self._lock:
      held, self._held = self._held, []
      self._dropping = not show
    if show:
      self._logger.removeFilter(self)
      for record in held:
        self._logger.handle(record)


ORBAX_ERRORS = _HeldBackOrbaxErrors()


_disk_error = fileio.disk_error  # The cause of a save failure to fix on the storage side.


def bounded_retries(handler: type) -> type:
  """Orbax's type handler class `handler`, whose reads and writes give tensorstore the run's
  Cloud Storage retry budget (`gcs.tensorstore_retries`, TensorFlow's): with tensorstore's own
  (about 15 min for one request) a store that keeps failing held a run for as long. Orbax
  builds each save's tensorstore context itself and takes none from its caller: each parameter's
  (`ParamInfo.ts_context`) becomes a child of it that adds the budget."""
  import tensorstore as ts  # pylint: disable=g-import-not-at-top

  def bounded(infos):
    children = {}
    for info in infos:
      parent = info.ts_context
      if id(parent) not in children:
        spec = ts.Context.Spec({'gcs_request_retries': gcs.tensorstore_retries()})
        children[id(parent)] = (ts.Context(spec, parent) if parent is not None
                                else ts.Context(spec))
      info.ts_context = children[id(parent)]
    return infos

  class Bounded(handler):

    async def serialize(self, values, infos, args=None):
      return await super().serialize(values, bounded(infos), args)

    async def deserialize(self, infos, args=None):
      return await super().deserialize(bounded(infos), args)

    async def metadata(self, infos):
      return await super().metadata(bounded(infos))

  Bounded.__name__ = Bounded.__qualname__ = handler.__name__
  return Bounded


class _TaskEndingLoop(asyncio.SelectorEventLoop):
  """An event loop that ends the tasks still pending when it is closed, as asyncio.run does.

  Orbax runs a restore in a new event loop (`asyncio_utils.run_sync`) and closes it without
  ending its tasks: when one array of a checkpoint cannot be read, the reads of the others are
  left suspended, and whenever the garbage collector later closes them, Orbax's reader turns
  that into an exception nobody can catch ("Exception ignored in: <coroutine object
  _read_array_index_and_device_put>"). Cancelled here instead, they end inside their loop. A
  read that tensorstore finishes after that still hands its result to the loop from its own
  thread; with nothing left to wait for it, the result is dropped rather than raised there
  ("Event loop is closed", which no one could catch either). The same holds for the writes of a
  save that fails (a full disk), whose loops are made here too (`_HeldBackOrbaxErrors`).

  Before it closes, the loop also runs the callbacks already queued: a task that ended in the
  round in which the loop stopped has its done-callbacks queued, not run. When it is one of a
  failed save's writes (Orbax's asyncio.gather of an item's arrays, whose first failure ends
  the loop), its callback is the gather's, which retrieves its exception; dropped, the task
  printed "Task exception was never retrieved" and the full-disk traceback once collected,
  often at exit, after the run's one line (1 of 38 full-disk runs on a loaded CPU).
  """

  def call_soon_threadsafe(self, callback, *args, context=None):
    try:
      return super().call_soon_threadsafe(callback, *args, context=context)
    except RuntimeError:
      if self.is_closed():
        return None
      raise

  def close(self) -> None:
    if not self.is_running() and not self.is_closed():
      pending = [task for task in asyncio.all_tasks(self) if not task.done()]
      for task in pending:
        task.cancel()
      if pending:
        self.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
      # The callbacks queued before (of tasks done in the round the loop stopped in) run
      # first, in the task's first round; asyncio has no public way to ask whether any are
      # queued, and a round costs microseconds.
      self.run_until_complete(asyncio.sleep(0))
    super().close()


class _TaskEndingPolicy(asyncio.DefaultEventLoopPolicy):

  def new_event_loop(self) -> asyncio.AbstractEventLoop:
    return _TaskEndingLoop()


@contextlib.contextmanager
def reads_end_their_tasks() -> Iterator[None]:
  """Event loops created inside (Orbax's, for a restore) end their tasks when closed."""
  previous = asyncio.get_event_loop_policy()
  asyncio.set_event_loop_policy(_TaskEndingPolicy())
  try:
    yield
  finally:
    asyncio.set_event_loop_policy(previous)


def _is_orbax_thread(thread: threading.Thread) -> bool:
  # Orbax's writes run in threads of its own class (`_SignalingThread`, a threading.Thread);
  # daemon or not (inside a running event loop they inherit its thread's flag). Thread-pool
  # workers and other libraries' threads are plain threading.Threads: never waited for.
  return type(thread).__module__.split('.')[0] == 'orbax'


@contextlib.contextmanager
def writer_threads() -> Iterator[list[threading.Thread]]:
  """Collects Orbax's threads started inside the block (a save's: each item's writes run in
  one of their own) and still running at its end, for `join_writers`."""
  before = set(threading.enumerate())
  started = []
  try:
    yield started
  finally:
    started.extend(t for t in threading.enumerate() if t not in before and _is_orbax_thread(t))


# How long a failed save's other writes get to end. On a full disk each fails at its next write.
WRITERS_TIMEOUT_S = 60
# The key-value store's prefix where each process says its writes of a failed save ended.
_WRITES_ENDED_KEY = 'bert_jax/failed_save_writes_ended'
_writes_ended = itertools.count()


def join_writers(threads: Iterable[threading.Thread]) -> None:
  """Waits for a failed save's writer `threads` (`writer_threads`), and with several processes
  process 0 (which removes the save's folder) for every process's, at most WRITERS_TIMEOUT_S in
  all: Orbax ends a save at its first failed write while the others go on, and tensorstore makes
  the folders it writes to, so a write that ends after the failed save's folder was removed
  makes it again (CI saw `8.orbax-checkpoint-tmp` come back after a full disk)."""
  deadline = time.monotonic() + WRITERS_TIMEOUT_S
  threads = [t for t in threads if t is not threading.current_thread()]
  for thread in threads:
    try:
      thread.join(max(0., deadline - time.monotonic()))
    except Exception:  # pylint: disable=broad-except
      pass  # Orbax's writer threads raise their own failure from `join`: this save's, known.
  if alive := [t.name for t in threads if t.is_alive()]:
    logging.warning('%d write(s) of the failed save still run after %d s (%s): its folder may '
                    'come back; a later run ignores it (never committed).', len(alive),
                    WRITERS_TIMEOUT_S, ', '.join(alive))
  if jax.process_count() == 1:
    return
  from orbax.checkpoint import multihost  # pylint: disable=g-import-not-at-top
  client = multihost.get_jax_distributed_client()
  me, key = jax.process_index(), f'{_WRITES_ENDED_KEY}/{next(_writes_ended)}'
  client.key_value_set(f'{key}/{me}', json.dumps(not alive))
  if me != 0:
    return
  for other in range(1, jax.process_count()):
    try:
      ended = json.loads(client.blocking_key_value_get(
          f'{key}/{other}', max(int((deadline - time.monotonic()) * 1000), 1)))
    except Exception:  # pylint: disable=broad-except  (jax's DEADLINE_EXCEEDED)
      ended = False
    if not ended:
      logging.warning('Process %d\'s writes of the failed save did not end within %d s: its '
                      'folder may come back; a later run ignores it (never committed).', other,
                      WRITERS_TIMEOUT_S)
