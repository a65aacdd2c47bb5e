"""Orbax checkpoints of a training run, and where a run starts from.

A workdir's checkpoints (its other files, and its committed steps as the commands that do not
train read them: `run_files.py`; its lock: `run_lock.py`):
  checkpoints/<step>/               Orbax items: params, opt_state, meta (step, phase, seed),
                                    and one per saved extra of the train state
                                    (`state_extras.py`: fp8_scales, FP8 scales and amax
                                    histories, when model.matmul_precision='fp8')
  data_state/<step>/process_<i>.*   each process's tf.data iterator position at that step

Resume order, followed by both drivers through `restore_or_init`:
  1. the latest *complete* checkpoint in the workdir that reads back whole. Orbax lists only
     steps whose save was committed, so an interrupted save is never picked up; one whose files
     cannot be read (truncated, corrupt) is named in a warning, moved aside to
     `<step>.corrupt`, and the one before it is tried; one whose shapes do not match the config
     is an error (never a partial load);
  2. the checkpoint named by `train.init_checkpoint` (pre-training: the whole model where it has
     it; fine-tuning: the encoder, with a fresh head): the driver's `init`;
  3. a fresh initialization: the driver's `init`.

Saving: the data state of step S is written synchronously *before* the (asynchronous) Orbax
save of S starts, so every committed checkpoint has its data state; leftovers of uncommitted
steps are removed as the manager cleans up. A save that fails (a full disk) is removed and named
in one line (`_save_failed`); the checkpoints before it stay usable. One that Cloud Storage fails
past the retries ends the run with one line naming the object (`gcs.outage`): its step folder
there has no commit_success.txt and is never resumed from. With several processes, a failure in
one process's part of a save stops them all at the same point with the same status
(`orbax_hooks`: the outcomes agreed through jax.distributed's key-value store).

Every path goes through `tf.io.gfile`, so a workdir on Cloud Storage (gs://...) works like a
local one (Orbax handles its own paths).
"""

import os
import re
import time
from typing import Any, Callable, Iterable

import jax
import numpy as np
import orbax.checkpoint as ocp
from absl import logging

from bert_jax import fileio
from bert_jax import gcs
from bert_jax import orbax_hooks
from bert_jax.errors import Outage
from bert_jax.errors import UserError

CHECKPOINT_DIR = 'checkpoints'
DATA_STATE_DIR = 'data_state'


def _registry(replica_parallel: bool):
  """Orbax's type handlers, whose tensorstore requests to Cloud Storage retry on the run's
  budget (`orbax_hooks.bounded_retries`); with `replica_parallel`, each replica of a replicated
  array copies and writes a slice of it. The files are the same either way."""
  scalar = orbax_hooks.bounded_retries(ocp.type_handlers.ScalarHandler)()
  return ocp.type_handlers.create_type_handler_registry(
      (jax.Array, orbax_hooks.bounded_retries(ocp.type_handlers.ArrayHandler)(
          use_replica_parallel=replica_parallel)),
      (np.ndarray, orbax_hooks.bounded_retries(ocp.type_handlers.NumpyHandler)()),
      (int, scalar), (float, scalar), (np.number, scalar))


def make_manager(workdir: str, keep: int | None, async_save: bool = True,
                 replica_parallel: bool | None = None, extras: Iterable[str] = ()
                 ) -> ocp.CheckpointManager:
  """The manager of `<workdir>/checkpoints`: items params, opt_state and `extras` (Orbax
  PyTrees: the items of the train state's saved extras, `state_extras.saved_names()`, which a
  checkpoint holds when its state has them), meta (JSON). `keep`: how many recent steps are
  kept (None: all; the caller deletes). `async_save=False`: its `save` returns once the save
  is committed (Orbax's asynchronous checkpointer either way: with several processes, only its
  commit can be agreed on, `orbax_hooks.CommitOutcome`). `replica_parallel` (None: on, except
  for one CPU process, whose replicas share one memory and disk: slicing there only compiles a
  program per shape and replica at the first save, 5 s of a tiny model's run)."""
  commit = orbax_hooks.CommitOutcome() if jax.process_count() > 1 else None
  # The step's folders are made before `save` returns, not in Orbax's background: made there, a
  # failure (Cloud Storage down at that moment) never sends the signal the item writes wait for,
  # and a save that waits for its commit (fine-tuning's) sat out their timeout (~8 min) and ended
  # in its traceback. Made here, it raises from `save`, as one line (`_save_failed`; with several
  # processes, in every process: `orbax_hooks.start_agreed`).
  options = ocp.CheckpointManagerOptions(
      max_to_keep=keep, create=True, enable_async_checkpointing=True,
      async_options=ocp.AsyncOptions(barrier_sync_fn=commit.barrier if commit else None,
                                     create_directories_asynchronously=False))
  if replica_parallel is None:
    replica_parallel = jax.process_count() > 1 or jax.default_backend() != 'cpu'
  registry = _registry(replica_parallel)
  trees = ('params', 'opt_state', *extras)
  handlers = {name: orbax_hooks.agreeing(
      ocp.PyTreeCheckpointHandler(type_handler_registry=registry)) for name in trees}
  handlers['meta'] = orbax_hooks.agreeing(ocp.JsonCheckpointHandler())
  manager = _Manager(os.path.join(workdir, CHECKPOINT_DIR), options=options,
                     item_handlers=handlers)
  manager.waits = not async_save
  manager.extras = frozenset(trees[2:])
  if commit:
    commit.hook(manager)
  return manager


class _Manager(ocp.CheckpointManager):
  """Orbax's CheckpointManager, whose `save` waits for the commit when `waits`; `extras`: the
  items of the saved extras it has handlers for."""

  waits = False
  committed: int | None = None  # The latest step known committed when a save began.
  extras = frozenset()
  writers = ()  # The threads the latest save started, for `_save_failed` to wait for.

  def save(self, *args, **kwargs) -> bool:
    with orbax_hooks.writer_threads() as self.writers, orbax_hooks.start_agreed():
      saved = super().save(*args, **kwargs)
    if self.waits:
      self.wait_until_finished()
    return saved


def _data_state_path(workdir: str, step: int) -> str:
  return os.path.join(workdir, DATA_STATE_DIR, str(step), f'process_{jax.process_index()}')


def save(manager: ocp.CheckpointManager, workdir: str, step: int, state: Any, meta: dict,
         data_iterator: Any | None = None) -> None:
  """Saves the train state (async) and this process's input position (sync, first).

  A failure of the previous (asynchronous) save surfaces here, as `wait_for_saves` raises it.
  With several processes, one whose input position could not be written stops them all here
  (`orbax_hooks.agree`).
  """
  wait_for_saves(manager, workdir)
  # Every save before this one is committed, its writes ended (none for `_save_failed` to wait
  # for): the step an outage's message names as intact (it asks the failing store no more).
  manager.writers, manager.committed = (), manager.latest_step()
  orbax_hooks.ORBAX_ERRORS.hold()
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
        orbax_hooks.agree(error)
      elif error is not None:
        raise error
    items = dict(params=ocp.args.PyTreeSave(state.params),
                 opt_state=ocp.args.PyTreeSave(state.opt_state),
                 meta=ocp.args.JsonSave(dict(meta, step=int(step))))
    for name, value in state.saved_extras().items():
      if name not in manager.extras:  # A bug: make_manager(extras=...) names every one.
        raise ValueError(f'the checkpoint manager has no item {name!r}: make it with '
                         'extras=state_extras.saved_names()')
      items[name] = ocp.args.PyTreeSave(value)
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
      wait_for_saves(manager, workdir)  # Its save failed too (`orbax_hooks`): raised there.
  if error is not None:
    _save_failed(manager, workdir, error)


def wait_for_saves(manager: ocp.CheckpointManager, workdir: str) -> None:
  """Blocks until the pending save is committed; a failed one is removed and raised (a full
  disk as a UserError that names it and the checkpoint to resume from)."""
  try:
    manager.wait_until_finished()
  except Exception as e:  # pylint: disable=broad-except
    _save_failed(manager, workdir, e)
  orbax_hooks.ORBAX_ERRORS.release(show=True)


def _save_failed(manager: ocp.CheckpointManager, workdir: str, error: Exception) -> None:
  """Removes what failed saves left behind, then raises (a UserError for a storage problem)."""
  ckpt_dir = os.path.join(workdir, CHECKPOINT_DIR)
  elsewhere = orbax_hooks.failed_elsewhere(error)
  report = elsewhere.report if elsewhere else orbax_hooks.report(error)
  # Another process's part failed (`orbax_hooks`): this one stops with the same status, saying
  # which process and why.
  prefix = (f'stopped because process {elsewhere.process}\'s {elsewhere.part} failed: '
            if elsewhere else '')
  if report['outage'] is not None:
    # Cloud Storage past the retries: nothing to clean up there (a step folder without
    # commit_success.txt is never resumed from), and every request to it would wait out the
    # retries again before the run could end.
    orbax_hooks.ORBAX_ERRORS.release(show=False)
    kept = getattr(manager, 'committed', None)
    intact = (f'the last complete checkpoint, step {kept},' if kept is not None
              else 'the last committed checkpoint')
    raise Outage(prefix + gcs.outage_message(*report['outage'], intact)) from error
  orbax_hooks.join_writers(getattr(manager, 'writers', ()))
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
  cause = report['disk']
  orbax_hooks.ORBAX_ERRORS.release(show=cause is None and not elsewhere)
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
      with orbax_hooks.reads_end_their_tasks():  # Its metadata reads, too.
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


def _pytree_restore(abstract: Any) -> ocp.args.PyTreeRestore:
  return ocp.args.PyTreeRestore(
      abstract, restore_args=ocp.checkpoint_utils.construct_restore_args(abstract))


def restore(manager: ocp.CheckpointManager, step: int, abstract_state: Any) -> tuple[Any, dict]:
  """Restores params, optimizer state and the saved extras (`saved_extras()`) into the
  shardings of `abstract_state` (a `train_state.TrainState` of ShapeDtypeStructs, which
  computes the rest: `restored`).

  A saved extra that the checkpoint lacks (FP8 scales, saved with model.matmul_precision='fp8'
  off) starts afresh; one the checkpoint holds and the state has not is left unread."""
  return _derived(_read(manager, step, abstract_state), step, abstract_state)


def _read(manager: ocp.CheckpointManager, step: int, abstract_state: Any) -> dict:
  """What checkpoint `step` holds of `abstract_state`, read (Orbax's Composite of items)."""
  items = dict(params=_pytree_restore(abstract_state.params),
               opt_state=_pytree_restore(abstract_state.opt_state),
               meta=ocp.args.JsonRestore())
  for name, abstract in abstract_state.saved_extras().items():
    if _has_item(manager, step, name):
      items[name] = _pytree_restore(abstract)
  with orbax_hooks.reads_end_their_tasks():
    return dict(manager.restore(step, args=ocp.args.Composite(**items)))


def _derived(restored: dict, step: int, abstract_state: Any) -> tuple[Any, dict]:
  """(state, meta) of a read checkpoint, with what a checkpoint does not hold computed on the
  devices (`TrainState.restored`: derived extras, saved ones it lacks)."""
  saved = {name: restored[name] for name in abstract_state.saved_extras() if name in restored}
  state = abstract_state.restored(restored['meta']['step'], restored['params'],
                                  restored['opt_state'], saved)
  return state, restored['meta']


def _has_item(manager: ocp.CheckpointManager, step: int, item: str) -> bool:
  """Whether checkpoint `step` holds `item`."""
  return fileio.gfile().isdir(os.path.join(str(manager.directory), str(step), item))


def restore_params(manager: ocp.CheckpointManager, step: int, abstract_params: Any) -> Any:
  """The parameters of `step` alone, into the shardings of `abstract_params`."""
  with orbax_hooks.reads_end_their_tasks():
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
