"""Orbax checkpoints of a training run, and where a run starts from.

Layout of a workdir:
  config.json                  the run's full ConfigDict
  bert_config.json, vocab.txt  the model (so the workdir loads like a converted checkpoint)
  checkpoints/<step>/          Orbax items: params, opt_state, meta (step, phase, seed), and
                               fp8_meta (FP8 scales and amax histories) when
                               model.matmul_precision='fp8'
  data_state/<step>/process_<i>.*   each process's tf.data iterator position at that step
  compilation_cache/           JAX's compiled programs, so a rerun does not compile again
                               (`checkpoint.compilation_cache_dir`, `use_compilation_cache`)

Resume order (written down once, here, and followed by both drivers through `restore_or_init`):
the latest *complete* checkpoint in the workdir (Orbax only lists steps whose save was committed,
so an interrupted save is never picked up) -> the checkpoint named by `train.init_checkpoint`
(pre-training: the whole model where it has it; fine-tuning: the encoder, with a fresh head) ->
a fresh initialization.

The data state of step S is written synchronously *before* the (asynchronous) Orbax save of S
starts, so every committed checkpoint has its data state; leftovers of uncommitted steps are
removed when the manager cleans up.

A committed checkpoint that cannot be read back (truncated or corrupt files) is named in a
warning, moved aside to `<step>.corrupt`, and the one before it is used; one whose shapes do not
match the config is an error (never a partial load). A save that fails (a full disk) is removed
and named in the error; the checkpoints before it stay usable. A save that Cloud Storage fails
past the retries ends the run with one line naming the object (`gcs.outage`): its step folder
there has no `commit_success.txt` and is never resumed from. With several processes, a failure
in one process's part of a save stops them all at the same point with the same status: each
process publishes the outcome of its writes in jax.distributed's key-value store before Orbax's
barriers (`_exchange`), process 0 that of its commit (`_CommitOutcome`), and the others stop
naming it (`SaveFailedElsewhere`).

Every path goes through `tf.io.gfile`, so a workdir on Cloud Storage (gs://...) works like a
local one (Orbax handles its own paths).
"""

import asyncio
import contextlib
import itertools
import json
import logging as std_logging
import os
import re
import threading
import time
from typing import Any, Callable, Iterator

import jax
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from jax.experimental.compilation_cache import compilation_cache as jax_cache

from bert_jax import defaults
from bert_jax import fileio
from bert_jax import gcs
from bert_jax import model as model_lib
from bert_jax.errors import Outage
from bert_jax.errors import UserError

CHECKPOINT_DIR = 'checkpoints'
DATA_STATE_DIR = 'data_state'
# The item of `TrainState.fp8_meta` (model.matmul_precision='fp8'): run state, like opt_state,
# that resumes exactly and is never exported as weights.
FP8_META = 'fp8_meta'
# orbax.checkpoint's COMMIT_SUCCESS_FILE (in a private module).
_GCS_COMMIT_FILE = 'commit_success.txt'


def _registry(replica_parallel: bool):
  """Orbax's type handlers, whose tensorstore requests to Cloud Storage retry on the run's
  budget (`_bounded`); without replica-parallel saving when not `replica_parallel`: that
  compiles a slicing program per distinct parameter shape on the first save (tens of seconds on
  CPU) and gains nothing for a few saves of a small model. The files are the same either way."""
  scalar = _bounded(ocp.type_handlers.ScalarHandler)()
  return ocp.type_handlers.create_type_handler_registry(
      (jax.Array, _bounded(ocp.type_handlers.ArrayHandler)(
          use_replica_parallel=replica_parallel)),
      (np.ndarray, _bounded(ocp.type_handlers.NumpyHandler)()),
      (int, scalar), (float, scalar), (np.number, scalar))


def _bounded(handler: type) -> type:
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


def make_manager(workdir: str, keep: int | None, async_save: bool = True,
                 replica_parallel: bool = True) -> ocp.CheckpointManager:
  """The manager of `<workdir>/checkpoints`: items params, opt_state, fp8_meta (Orbax
  PyTrees; fp8_meta only in the checkpoints of FP8 runs), meta (JSON). `keep`: how many recent
  steps are kept (None: all; the caller deletes). `async_save=False`: its `save` returns once
  the save is committed (Orbax's asynchronous checkpointer either way: with several processes,
  only its commit can be agreed on, `_CommitOutcome`)."""
  commit = _CommitOutcome() if jax.process_count() > 1 else None
  options = ocp.CheckpointManagerOptions(
      max_to_keep=keep, create=True, enable_async_checkpointing=True,
      async_options=ocp.AsyncOptions(barrier_sync_fn=commit.barrier) if commit else None)
  registry = _registry(replica_parallel)
  handlers = {'params': _agreeing(ocp.PyTreeCheckpointHandler(type_handler_registry=registry)),
              'opt_state': _agreeing(
                  ocp.PyTreeCheckpointHandler(type_handler_registry=registry)),
              FP8_META: _agreeing(ocp.PyTreeCheckpointHandler(type_handler_registry=registry)),
              'meta': _agreeing(ocp.JsonCheckpointHandler())}
  manager = _Manager(os.path.join(workdir, CHECKPOINT_DIR), options=options,
                     item_handlers=handlers)
  manager.waits = not async_save
  if commit:
    commit.hook(manager)
  return manager


class _Manager(ocp.CheckpointManager):
  """Orbax's CheckpointManager, whose `save` waits for the commit when `waits`."""

  waits = False
  committed: int | None = None  # The latest step known committed when a save began.

  def save(self, *args, **kwargs) -> bool:
    saved = super().save(*args, **kwargs)
    if self.waits:
      self.wait_until_finished()
    return saved


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
# commit's outcome, and the others read it before that barrier (`_CommitOutcome`). Not
# covered: the step folders, which process 0 creates at the start of a save (with Orbax's
# default, in the background) while the others' writes wait for them; a failure there still
# stops process 0 alone.

# The key-value store's prefix; the input positions and each item of each save are one exchange
# each, numbered in the order every process makes them (the same in every process).
_OUTCOME_KEY = 'bert_jax/checkpoint_outcome'
_exchanges = itertools.count()
# How long a process waits for another's outcome: Orbax's own bound on a save's background
# work (AsyncOptions.timeout_secs), which a slow process's writes (tensorstore retrying a
# request for up to ~15 min) must fit in anyway.
OUTCOME_TIMEOUT_S = 1200


class SaveFailedElsewhere(Exception):
  """Another process's `part` of this save failed (`report`: what `_report` says of its
  error); this process stops with it (`_save_failed` says which process and why)."""

  def __init__(self, process: int, report: dict[str, Any],
               part: str = 'part of the checkpoint save'):
    super().__init__(f'process {process}\'s {part} failed: {report["line"]}')
    self.process = process
    self.report = report
    self.part = part


def _report(error: BaseException) -> dict[str, Any]:
  """What the other processes need to stop with the same status and line as this one."""
  if isinstance(error, SaveFailedElsewhere):
    return error.report
  return dict(outage=gcs.failing_object(error), disk=_disk_error(error),
              line=(str(error).strip().splitlines() or [type(error).__name__])[0][:500])


def _exchange(number: int, error: BaseException | None, timeout_s: float) -> None:
  """Publishes this process's outcome of exchange `number` and reads the others'; raises this
  process's `error`, else a `SaveFailedElsewhere` for the first other process that failed."""
  from orbax.checkpoint import multihost  # pylint: disable=g-import-not-at-top
  client = multihost.get_jax_distributed_client()
  me, key = jax.process_index(), f'{_OUTCOME_KEY}/{number}'
  client.key_value_set(f'{key}/{me}', json.dumps(None if error is None else _report(error)))
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
  if (report := json.loads(value)) is not None:
    raise SaveFailedElsewhere(process, report, part)


# The key-value store's prefix of process 0's commits, numbered like the saves (of every
# manager, in the order every process makes them).
_COMMIT_KEY = 'bert_jax/checkpoint_commit'
_commits = itertools.count()
_COMMIT_PART = 'commit of the checkpoint save'
# What Orbax's asynchronous checkpointer calls the barrier after process 0's commit.
_AFTER_COMMIT_BARRIER = 'async_commit_complete'


class _CommitOutcome:
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
                         json.dumps(None if error is None else _report(error)))
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


def _agreeing(handler: Any) -> Any:
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


def _data_state_path(workdir: str, step: int) -> str:
  return os.path.join(workdir, DATA_STATE_DIR, str(step), f'process_{jax.process_index()}')


def save(manager: ocp.CheckpointManager, workdir: str, step: int, state: Any, meta: dict,
         data_iterator: Any | None = None) -> None:
  """Saves the train state (async) and this process's input position (sync, first).

  A failure of the previous (asynchronous) save surfaces here, as `wait_for_saves` raises it.
  With several processes, one whose input position could not be written stops them all here
  (`_exchange`).
  """
  wait_for_saves(manager, workdir)
  # Every save before this one is committed now: the step an outage's message names as intact
  # (`_save_failed` asks the failing store nothing more).
  manager.committed = manager.latest_step()
  _ORBAX_ERRORS.hold()
  try:
    if data_iterator is not None:
      error = None
      try:
        path = _data_state_path(workdir, step)
        fileio.gfile().makedirs(os.path.dirname(path))
        data_iterator.save(path)
      except Exception as e:  # pylint: disable=broad-except  (raised below, in every process)
        error = e
      if jax.process_count() > 1:
        # Each process writes its own: none goes on into Orbax's save (whose first barrier
        # waits for all) unless all did.
        _exchange(next(_exchanges), error, OUTCOME_TIMEOUT_S)
      elif error is not None:
        raise error
    items = dict(params=ocp.args.PyTreeSave(state.params),
                 opt_state=ocp.args.PyTreeSave(state.opt_state),
                 meta=ocp.args.JsonSave(dict(meta, step=int(step))))
    if getattr(state, 'fp8_meta', None) is not None:
      items[FP8_META] = ocp.args.PyTreeSave(state.fp8_meta)
    manager.save(step, force=True, args=ocp.args.Composite(**items))
  except Exception as e:  # pylint: disable=broad-except
    _save_failed(manager, workdir, e)
  _clean_data_states(manager, workdir, keep_step=step)


def check_saves(manager: ocp.CheckpointManager, workdir: str) -> None:
  """Raises as `wait_for_saves` if the pending (asynchronous) save has failed meanwhile, and
  returns at once otherwise: the loop checks at each log step, so that a save Cloud Storage
  fails ends the run within its retries, not at the next save (`checkpoint.every_steps` steps
  later). With several processes every process learns whether any failed, so that all stop at
  the same step."""
  error = None
  try:
    manager.check_for_errors()
  except Exception as e:  # pylint: disable=broad-except  (raised below)
    error = e
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
    failed = multihost_utils.process_allgather(np.int32(error is not None))
    if error is None and np.any(failed):
      wait_for_saves(manager, workdir)  # Its save failed too (`_exchange`): raised there.
  if error is not None:
    _save_failed(manager, workdir, error)


def wait_for_saves(manager: ocp.CheckpointManager, workdir: str) -> None:
  """Blocks until the pending save is committed; a failed one is removed and raised (a full
  disk as a UserError that names it and the checkpoint to resume from)."""
  try:
    manager.wait_until_finished()
  except Exception as e:  # pylint: disable=broad-except
    _save_failed(manager, workdir, e)
  _ORBAX_ERRORS.release(show=True)


class _HeldBackOrbaxErrors(std_logging.Filter):
  """Holds back the error lines Orbax logs while a save of ours is under way, until its outcome
  is known.

  A save that fails logs its error's traceback from three of Orbax's threads, and once more as
  `wait_until_finished` re-raises it: about 350 lines above the message. A storage problem (a
  full disk) is the user's to fix and ends as one line (`_save_failed`'s UserError), so they are
  dropped; with any other outcome they are logged as they were. Meanwhile Orbax's event loops
  end their tasks when closed (`_TaskEndingLoop`): the writes still under way when one fails
  would otherwise each print an uncatchable "Event loop is closed" traceback as they finish.
  """

  def __init__(self):
    super().__init__()
    self._held: list[std_logging.LogRecord] = []
    self._lock = threading.Lock()
    self._logger = std_logging.getLogger('absl')  # Orbax logs through absl.
    self._policy: asyncio.AbstractEventLoopPolicy | None = None

  def filter(self, record: std_logging.LogRecord) -> bool:
    if record.levelno < std_logging.ERROR or f'{os.sep}orbax{os.sep}' not in record.pathname:
      return True
    with self._lock:
      self._held.append(record)
    return False

  def hold(self) -> None:
    if self not in self._logger.filters:
      self._logger.addFilter(self)
      self._policy = asyncio.get_event_loop_policy()
      asyncio.set_event_loop_policy(_TaskEndingPolicy())

  def release(self, show: bool) -> None:
    """Stops holding back; logs what was held if `show`."""
    self._logger.removeFilter(self)
    if self._policy is not None:
      asyncio.set_event_loop_policy(self._policy)
      self._policy = None
    with self._lock:
      held, self._held = self._held, []
    for record in held if show else []:
      self._logger.handle(record)


_ORBAX_ERRORS = _HeldBackOrbaxErrors()


_disk_error = fileio.disk_error  # The cause of a save failure to fix on the storage side.


def _save_failed(manager: ocp.CheckpointManager, workdir: str, error: Exception) -> None:
  """Removes what failed saves left behind, then raises (a UserError for a storage problem)."""
  ckpt_dir = os.path.join(workdir, CHECKPOINT_DIR)
  elsewhere = _in_chain(error, SaveFailedElsewhere)
  report = elsewhere.report if elsewhere else _report(error)
  if report['outage'] is not None:
    # Cloud Storage past the retries: nothing to clean up there (a step folder without
    # commit_success.txt is never resumed from), and every request to it would wait out the
    # retries again before the run could end.
    _ORBAX_ERRORS.release(show=False)
    kept = getattr(manager, 'committed', None)
    intact = (f'the last complete checkpoint, step {kept},' if kept is not None
              else 'the last committed checkpoint')
    prefix = (f'stopped because process {elsewhere.process}\'s {elsewhere.part} failed: '
              if elsewhere else '')
    raise Outage(prefix + gcs.outage_message(*report['outage'], intact)) from error
  partial = []
  if jax.process_index() == 0 and fileio.gfile().isdir(ckpt_dir):
    for name in fileio.gfile().listdir(ckpt_dir):
      name = name.rstrip('/')
      if re.fullmatch(r'\d+\.orbax-checkpoint-tmp.*', name):
        partial.append(name)
        try:
          fileio.gfile().rmtree(os.path.join(ckpt_dir, name))
        except Exception as e:  # pylint: disable=broad-except  (the error below matters more)
          logging.warning('Could not remove the failed save %s: %s', name, e)
  manager.reload()
  kept = manager.latest_step()
  intact = (f'the last complete checkpoint, step {kept},' if kept is not None
            else 'every file written before')
  # Another process's part failed (`_exchange`): this one stops with the same status, saying
  # which process and why.
  prefix = (f'stopped because process {elsewhere.process}\'s {elsewhere.part} failed: '
            if elsewhere else '')
  cause = report['disk']
  _ORBAX_ERRORS.release(show=cause is None and not elsewhere)
  if cause is None:
    if elsewhere:
      raise RuntimeError(f'{prefix}{report["line"]} (its log has the traceback)') from error
    raise error
  failed = ', '.join(os.path.join(ckpt_dir, p) for p in partial) or 'the checkpoint being saved'
  raise UserError(
      f'{prefix}saving a checkpoint failed: {cause} ({failed}, removed). '
      + (f'The last complete checkpoint, step {kept}, is intact. ' if kept is not None else
         'No checkpoint was saved before it. ')
      + f'Free space in {workdir} (or fix its permissions) and rerun the same command to '
      f'resume. [{str(error).splitlines()[0][:300]}]') from error


def _in_chain(error: BaseException | None, kind: type) -> Any:
  """The first exception of type `kind` in `error`'s chain (its causes and contexts), or None."""
  seen = []
  while error is not None and error not in seen:
    if isinstance(error, kind):
      return error
    seen.append(error)
    error = error.__cause__ or error.__context__
  return None


def _clean_data_states(manager: ocp.CheckpointManager, workdir: str, keep_step: int) -> None:
  root = os.path.join(workdir, DATA_STATE_DIR)
  if jax.process_index() != 0 or not fileio.gfile().isdir(root):
    return
  live = set(manager.all_steps()) | {keep_step}
  for name in fileio.gfile().listdir(root):
    name = name.rstrip('/')  # gfile lists Cloud Storage folders with a trailing slash.
    if name.isdigit() and int(name) not in live and int(name) < keep_step:
      try:
        fileio.gfile().rmtree(os.path.join(root, name))
      except Exception as e:  # pylint: disable=broad-except  (a leftover is harmless)
        logging.warning('Could not remove %s: %s', os.path.join(root, name), e)


def latest_step(manager: ocp.CheckpointManager) -> int | None:
  return manager.latest_step()


def restore_or_init(manager: ocp.CheckpointManager, workdir: str, abstract_state: Any,
                    init: Callable[[], Any]) -> tuple[int | None, Any, dict]:
  """(step, state, meta): the latest checkpoint of the workdir that reads back whole
  (`restore_latest`: a corrupt one is moved aside, one of another shape is an error), else
  (None, init(), {}) where `init` makes the run's first state (from `train.init_checkpoint` or
  fresh)."""
  step, state, meta = restore_latest(manager, workdir, abstract_state)
  if step is None:
    return None, init(), {}
  logging.info('Resumed from step %d in %s', step, workdir)
  return step, state, meta


def restore_latest(manager: ocp.CheckpointManager, workdir: str, abstract_state: Any
                   ) -> tuple[int | None, Any, dict]:
  """(step, state, meta) of the latest checkpoint that reads back whole; (None, None, {}) if
  the workdir has none.

  A checkpoint whose files cannot be read (truncated, corrupt) is named in a warning, moved
  aside to `<step>.corrupt` (so that a later save of that step does not collide with it) and
  the previous one is tried. One that does not match the config is an error: its shapes say
  the config changed, not that the files broke.
  """
  ckpt_dir = os.path.join(workdir, CHECKPOINT_DIR)
  skipped = []
  for step in sorted(manager.all_steps(), reverse=True):
    try:
      with _reads_end_their_tasks():  # Its metadata reads, too.
        metadata = manager.item_metadata(step)['params']
      _check_shapes(metadata, abstract_state.params, os.path.join(ckpt_dir, str(step)))
      restored = _read(manager, step, abstract_state)
    except UserError:
      raise
    except Exception as e:  # pylint: disable=broad-except  (any unreadable file)
      logging.warning('Checkpoint %s cannot be read (%s: %s); moving it to %s.corrupt and '
                      'trying the one before it.', os.path.join(ckpt_dir, str(step)),
                      type(e).__name__, str(e).splitlines()[0][:300] if str(e) else '',
                      os.path.join(ckpt_dir, str(step)))
      skipped.append(step)
      _move_aside(ckpt_dir, step)
      continue
    if skipped:
      manager.reload()
      logging.warning('Resuming from step %d: checkpoints %s were unreadable', step, skipped)
    # Outside the files' catch-all: a device error here (out of memory, say) is not a
    # corrupt checkpoint, and must not move good ones aside.
    state, meta = _derived(restored, step, abstract_state)
    return step, state, meta
  if skipped:
    manager.reload()
    raise UserError(f'no checkpoint in {ckpt_dir} can be read: steps {skipped} are corrupt '
                    '(moved to <step>.corrupt). Delete the workdir\'s checkpoints/ to start '
                    'afresh, or restore them from a copy.')
  return None, None, {}


def _check_shapes(metadata: Any, abstract_params: Any, where: str) -> None:
  """UserError unless the checkpoint's parameters have the config's names and shapes."""
  saved = {jax.tree_util.keystr(p): tuple(m.shape) for p, m in
           jax.tree_util.tree_flatten_with_path(metadata, is_leaf=lambda m: hasattr(m, 'shape'))[0]}
  wanted = {jax.tree_util.keystr(p): tuple(a.shape) for p, a in
            jax.tree_util.tree_flatten_with_path(abstract_params)[0]}
  if saved == wanted:
    return
  differ = [f'{k} {saved[k]} vs {wanted[k]}' for k in sorted(saved.keys() & wanted.keys())
            if saved[k] != wanted[k]]
  only = sorted(saved.keys() ^ wanted.keys())
  example = differ[0] if differ else f'{only[0]} in only one of them'
  raise UserError(f'checkpoint {where} does not match the config (e.g. {example}; '
                  f'{len(differ)} shapes differ, {len(only)} tensors in only one): resume with '
                  'the config it was saved with (config.json in the workdir) or use another '
                  '--workdir')


def _move_aside(ckpt_dir: str, step: int) -> None:
  if jax.process_index() == 0:
    src = os.path.join(ckpt_dir, str(step))
    dst = f'{src}.corrupt'
    if fileio.gfile().exists(dst):
      dst = f'{src}.corrupt-{int(time.time())}'
    fileio.gfile().rename(src, dst)
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
    multihost_utils.sync_global_devices(f'bert_jax_move_aside_{step}')


# The cache directory this module last gave JAX; any other value was set by the user.
_cache_dir_set_here: str | None = None
# Programs that compile faster than this are not worth a file (and, on Cloud Storage, a
# request) each; the tiny CPU models' train steps still take longer.
_CACHE_MIN_COMPILE_SECONDS = 0.2


def use_compilation_cache(workdir: str, cache_dir: str) -> str | None:
  """Points JAX's persistent compilation cache at `checkpoint.compilation_cache_dir` (relative:
  inside the workdir; gs:// works; '' = none), so that a rerun loads its train and eval steps
  instead of compiling them again. A cache set outside bert_jax (JAX_COMPILATION_CACHE_DIR,
  `jax.config.update`) is kept: one cache shared by many runs. Returns the directory in use.
  """
  global _cache_dir_set_here
  current = jax.config.jax_compilation_cache_dir
  if current and current != _cache_dir_set_here:
    logging.info('Compilation cache: %s (set outside the config)', current)
    return current
  path = None
  if cache_dir:
    path = cache_dir if fileio.is_remote(cache_dir) else os.path.join(
        workdir, os.path.expanduser(cache_dir))
  if path != current:
    jax.config.update('jax_compilation_cache_dir', path)
    if path:
      jax.config.update('jax_persistent_cache_min_compile_time_secs',
                        _CACHE_MIN_COMPILE_SECONDS)
    jax_cache.reset_cache()  # JAX reads the directory once, at its first compile.
    _cache_dir_set_here = path
  if path:
    logging.info('Compilation cache: %s', path)
  return path


def _pytree_restore(abstract: Any) -> ocp.args.PyTreeRestore:
  return ocp.args.PyTreeRestore(
      abstract, restore_args=ocp.checkpoint_utils.construct_restore_args(abstract))


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
  """

  def call_soon_threadsafe(self, callback, *args, context=None):
    try:
      return super().call_soon_threadsafe(callback, *args, context=context)
    except RuntimeError:
      if self.is_closed():
        return None
      raise

  def close(self) -> None:
    pending = [task for task in asyncio.all_tasks(self) if not task.done()]
    for task in pending:
      task.cancel()
    if pending and not self.is_running():
      self.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
    super().close()


class _TaskEndingPolicy(asyncio.DefaultEventLoopPolicy):

  def new_event_loop(self) -> asyncio.AbstractEventLoop:
    return _TaskEndingLoop()


@contextlib.contextmanager
def _reads_end_their_tasks() -> Iterator[None]:
  """Event loops created inside (Orbax's, for a restore) end their tasks when closed."""
  previous = asyncio.get_event_loop_policy()
  asyncio.set_event_loop_policy(_TaskEndingPolicy())
  try:
    yield
  finally:
    asyncio.set_event_loop_policy(previous)


def restore(manager: ocp.CheckpointManager, step: int, abstract_state: Any) -> tuple[Any, dict]:
  """Restores params and optimizer state (and FP8 scales, `abstract_state.fp8_meta`) into the
  shardings of `abstract_state` (a `train_state.TrainState` of ShapeDtypeStructs, which derives
  the rest: `restored`).

  FP8 scales and histories are not weights: a run that turns model.matmul_precision='fp8' on
  resumes a checkpoint without them from the initial ones, and one that turns it off leaves
  them unread."""
  return _derived(_read(manager, step, abstract_state), step, abstract_state)


def _read(manager: ocp.CheckpointManager, step: int, abstract_state: Any) -> dict:
  """What checkpoint `step` holds of `abstract_state`, read (Orbax's Composite of items)."""
  items = dict(params=_pytree_restore(abstract_state.params),
               opt_state=_pytree_restore(abstract_state.opt_state),
               meta=ocp.args.JsonRestore())
  if (getattr(abstract_state, 'fp8_meta', None) is not None
      and _has_item(manager, step, FP8_META)):
    items[FP8_META] = _pytree_restore(abstract_state.fp8_meta)
  with _reads_end_their_tasks():
    return dict(manager.restore(step, args=ocp.args.Composite(**items)))


def _derived(restored: dict, step: int, abstract_state: Any) -> tuple[Any, dict]:
  """(state, meta) of a read checkpoint, with what a checkpoint does not hold computed on the
  devices: the compute copy (train_state.TrainState.restored) and fresh FP8 scales."""
  state = abstract_state.restored(params=restored['params'], opt_state=restored['opt_state'],
                                  step=restored['meta']['step'])
  abstract_fp8 = getattr(abstract_state, 'fp8_meta', None)
  if abstract_fp8 is not None:
    if FP8_META in restored:
      fp8_meta = restored[FP8_META]
    else:
      logging.warning('Checkpoint %d has no FP8 scales (saved without '
                      "model.matmul_precision='fp8'): they start afresh", step)
      fp8_meta = jax.jit(lambda: model_lib.initial_fp8_meta(abstract_fp8),
                         out_shardings=jax.tree.map(lambda a: a.sharding, abstract_fp8))()
    state = state.replace(fp8_meta=fp8_meta)
  return state, restored['meta']


def _has_item(manager: ocp.CheckpointManager, step: int, item: str) -> bool:
  """Whether checkpoint `step` holds `item`."""
  return fileio.gfile().isdir(os.path.join(str(manager.directory), str(step), item))


def restore_params(manager: ocp.CheckpointManager, step: int, abstract_params: Any) -> Any:
  """The parameters of `step` alone, into the shardings of `abstract_params`."""
  with _reads_end_their_tasks():
    return manager.restore(step, args=ocp.args.Composite(
        params=_pytree_restore(abstract_params)))['params']


def restore_data_state(workdir: str, step: int, data_iterator: Any) -> bool:
  """Restores this process's input position of `step`; False if none was saved."""
  path = _data_state_path(workdir, step)
  # tf.train.Checkpoint writes <path>.index and <path>.data-*; process_1 must not match
  # process_10's files.
  if not fileio.gfile().exists(path + '.index'):
    return False
  data_iterator.restore(path)
  return True


# What write_run_files and the loop write at the top of a workdir.
RUN_FILES = ('config.json', 'bert_config.json', 'vocab.txt', 'metrics.jsonl')


def write_run_files(workdir: str, config_json: str, bert_config: model_lib.BertConfig,
                    vocab_file: str | None, extra: dict[str, Any] | None = None) -> None:
  """config.json, bert_config.json, vocab.txt and `extra` ({file name: JSON value}) in the
  workdir (process 0 only)."""
  if jax.process_index() != 0:
    return
  fs = fileio.gfile()
  fs.makedirs(workdir)
  with fs.GFile(os.path.join(workdir, 'config.json'), 'w') as f:
    f.write(config_json)
  with fs.GFile(os.path.join(workdir, 'bert_config.json'), 'w') as f:
    f.write(bert_config.to_json_string())
  if vocab_file and fs.exists(vocab_file):
    dst = os.path.join(workdir, 'vocab.txt')
    same = lambda p: p if '://' in p else os.path.abspath(p)
    if same(vocab_file) != same(dst):
      fs.copy(vocab_file, dst, overwrite=True)
  for name, value in (extra or {}).items():
    fileio.write_json(os.path.join(workdir, name), value)


def load_pretrained_from_workdir(path: str, step: int | None = None
                                 ) -> tuple[model_lib.BertConfig, dict]:
  """(config, params) from the latest (or given) checkpoint of a training workdir, on the host.

  Parameters come back as float32 numpy arrays in the unscanned layout. `path` may be relative
  (Orbax reads absolute paths only: made absolute here).
  """
  path = fileio.workdir_path(path)
  config_path = os.path.join(path, 'bert_config.json')
  if not fileio.gfile().exists(config_path):
    raise UserError(f'{path} has no bert_config.json: not a bert_jax training workdir')
  try:
    config = model_lib.BertConfig.from_dict(json.loads(fileio.read_user_text(config_path)),
                                            source=config_path)
  except json.JSONDecodeError as e:
    raise UserError(f'{config_path}: not valid JSON: {e}') from e
  ckpt_dir = os.path.join(path, CHECKPOINT_DIR)
  # Read-only, said in full (Orbax warns of each option it has to turn off itself).
  manager = ocp.CheckpointManager(ckpt_dir, item_names=('params', 'opt_state', 'meta'),
                                  options=ocp.CheckpointManagerOptions(
                                      read_only=True, save_interval_steps=0, create=False))
  step = manager.latest_step() if step is None else step
  if step is None:
    raise UserError(f'{ckpt_dir} holds no complete checkpoint')
  try:
    metadata = manager.item_metadata(step)['params']
    sharding = jax.sharding.SingleDeviceSharding(jax.local_devices(backend='cpu')[0])
    abstract = jax.tree.map(
        lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=sharding), metadata,
        is_leaf=lambda m: hasattr(m, 'shape'))
    restored = manager.restore(step, args=ocp.args.Composite(
        params=ocp.args.StandardRestore(abstract)))
  except Exception as e:  # pylint: disable=broad-except  (re-raised unless files are missing)
    reason = _damage(e)
    if reason is None:
      raise  # Not the files (Cloud Storage failing, a bug): its own message or traceback.
    raise UserError(f'{ckpt_dir}/{step}: damaged or incomplete checkpoint ({reason}); move '
                    'that folder aside to use an earlier step') from e
  params = jax.tree.map(lambda x: np.asarray(x, np.float32), restored['params'])
  manager.close()
  params = dict(params)
  if 'bert' in params:
    params = model_lib.unstack_layers(params, config.num_hidden_layers)
  logging.info('Loaded step %d of %s', step, ckpt_dir)
  return config, params


# What Orbax and TensorStore say of a checkpoint's file that is missing or cut short.
_DAMAGE_SIGNS = ('does not exist', 'NOT_FOUND', 'DATA_LOSS', 'Encountered error while reading')


def _damage(error: BaseException) -> str | None:
  """Why a checkpoint step cannot be read when its files are missing or cut short (a step
  folder copied or deleted in part), else None: only then is it "damaged"."""
  if gcs.failing_object(error) is not None:
    return None  # Cloud Storage failing past the retries: the files may be whole.
  if isinstance(error, KeyError) and 'params' in str(error):
    return 'it holds no params'
  if isinstance(error, FileNotFoundError) or any(s in str(error) for s in _DAMAGE_SIGNS):
    return (str(error).splitlines() or [type(error).__name__])[0][:300]
  return None


def checkpoint_steps(workdir: str) -> list[int]:
  """Committed checkpoint steps of a workdir (ascending)."""
  d = os.path.join(workdir, CHECKPOINT_DIR)
  if not fileio.gfile().isdir(d):
    return []
  steps = sorted(int(n.rstrip('/')) for n in fileio.gfile().listdir(d)
                 if re.fullmatch(r'\d+/?', n))
  if d.startswith('gs://'):
    # On Cloud Storage Orbax writes a step in place (no rename) and commits it by writing this
    # file last: a step folder without it is a save that was cut short.
    steps = [s for s in steps
             if fileio.gfile().exists(os.path.join(d, str(s), _GCS_COMMIT_FILE))]
  return steps


def read_run_config(workdir: str) -> dict | None:
  p = os.path.join(workdir, 'config.json')
  if not fileio.gfile().exists(p):
    return None
  with fileio.gfile().GFile(p) as f:
    return json.load(f)


def check_workdir_kind(workdir: str, fine_tuning: bool) -> None:
  """Refuses a workdir whose config.json is another kind of run's (a pre-training run's for
  `bert-jax finetune`, a fine-tuning run's for `pretrain`), before anything is written there:
  its checkpoints could never resume this run, and its record would be overwritten."""
  record = read_run_config(workdir)
  if not isinstance(record, dict):
    return
  record = defaults.saved_config(record)  # Its config.kind (a record from before: guessed).
  if (record['kind'] == 'finetune') == fine_tuning:
    return
  if fine_tuning:
    raise UserError(f'--workdir={workdir} holds a pre-training run (its config.json has no '
                    'task): fine-tune into another --workdir; to start from that run, set '
                    f'--config.train.init_checkpoint={workdir}')
  raise UserError(f'--workdir={workdir} holds a fine-tuning run ({record["task"]["name"]}, its '
                  'config.json): pre-train into another --workdir')
