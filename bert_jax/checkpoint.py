"""Orbax checkpoints of a training run, and where a run starts from.

Layout of a workdir:
  config.json                  the run's full ConfigDict
  bert_config.json, vocab.txt  the model (so the workdir loads like a converted checkpoint)
  checkpoints/<step>/          Orbax items: params, opt_state, meta (step, phase, seed)
  data_state/<step>/process_<i>.*   each process's tf.data iterator position at that step

Resume order (written down once, here): the latest *complete* checkpoint in the workdir (Orbax
only lists steps whose save was committed, so an interrupted save is never picked up) -> the
converted checkpoint named by `train.init_checkpoint` -> a fresh initialization.

The data state of step S is written synchronously *before* the (asynchronous) Orbax save of S
starts, so every committed checkpoint has its data state; leftovers of uncommitted steps are
removed when the manager cleans up.

Every path goes through `tf.io.gfile`, so a workdir on Cloud Storage (gs://...) works like a
local one (Orbax handles its own paths).
"""

import json
import os
import re
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from absl import logging

from bert_jax import fileio
from bert_jax import model as model_lib
from bert_jax.errors import UserError

CHECKPOINT_DIR = 'checkpoints'
DATA_STATE_DIR = 'data_state'


gfile = fileio.gfile


def workdir_path(path: str) -> str:
  """A workdir as runs use it: local paths absolute (with ~ expanded), gs:// and other
  filesystems' paths as given."""
  return path if '://' in path else os.path.abspath(os.path.expanduser(path))


def _registry(replica_parallel: bool):
  """Orbax's type handlers; without replica-parallel saving when not `replica_parallel`: that
  compiles a slicing program per distinct parameter shape on the first save (tens of seconds on
  CPU) and gains nothing for a few saves of a small model. The files are the same either way."""
  scalar = ocp.type_handlers.ScalarHandler()
  return ocp.type_handlers.create_type_handler_registry(
      (jax.Array, ocp.type_handlers.ArrayHandler(use_replica_parallel=replica_parallel)),
      (np.ndarray, ocp.type_handlers.NumpyHandler()),
      (int, scalar), (float, scalar), (np.number, scalar))


def make_manager(workdir: str, keep: int | None, async_save: bool = True,
                 replica_parallel: bool = True) -> ocp.CheckpointManager:
  """The manager of `<workdir>/checkpoints`: items params, opt_state (Orbax PyTrees), meta
  (JSON). `keep`: how many recent steps are kept (None: all; the caller deletes)."""
  options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                         enable_async_checkpointing=async_save)
  registry = _registry(replica_parallel)
  handlers = {'params': ocp.PyTreeCheckpointHandler(type_handler_registry=registry),
              'opt_state': ocp.PyTreeCheckpointHandler(type_handler_registry=registry),
              'meta': ocp.JsonCheckpointHandler()}
  return ocp.CheckpointManager(os.path.join(workdir, CHECKPOINT_DIR), options=options,
                               item_handlers=handlers)


def _data_state_path(workdir: str, step: int) -> str:
  return os.path.join(workdir, DATA_STATE_DIR, str(step), f'process_{jax.process_index()}')


def save(manager: ocp.CheckpointManager, workdir: str, step: int, state: Any, meta: dict,
         data_iterator: Any | None = None) -> None:
  """Saves the train state (async) and this process's input position (sync, first)."""
  if data_iterator is not None:
    path = _data_state_path(workdir, step)
    gfile().makedirs(os.path.dirname(path))
    data_iterator.save(path)
  manager.save(step, force=True, args=ocp.args.Composite(
      params=ocp.args.PyTreeSave(state.params),
      opt_state=ocp.args.PyTreeSave(state.opt_state),
      meta=ocp.args.JsonSave(dict(meta, step=int(step)))))
  _clean_data_states(manager, workdir, keep_step=step)


def _clean_data_states(manager: ocp.CheckpointManager, workdir: str, keep_step: int) -> None:
  root = os.path.join(workdir, DATA_STATE_DIR)
  if jax.process_index() != 0 or not gfile().isdir(root):
    return
  live = set(manager.all_steps()) | {keep_step}
  for name in gfile().listdir(root):
    name = name.rstrip('/')  # gfile lists Cloud Storage folders with a trailing slash.
    if name.isdigit() and int(name) not in live and int(name) < keep_step:
      try:
        gfile().rmtree(os.path.join(root, name))
      except Exception as e:  # pylint: disable=broad-except  (a leftover is harmless)
        logging.warning('Could not remove %s: %s', os.path.join(root, name), e)


def latest_step(manager: ocp.CheckpointManager) -> int | None:
  return manager.latest_step()


def _pytree_restore(abstract: Any) -> ocp.args.PyTreeRestore:
  return ocp.args.PyTreeRestore(
      abstract, restore_args=ocp.checkpoint_utils.construct_restore_args(abstract))


def restore(manager: ocp.CheckpointManager, step: int, abstract_state: Any) -> tuple[Any, dict]:
  """Restores params and optimizer state into the shardings of `abstract_state`."""
  restored = manager.restore(step, args=ocp.args.Composite(
      params=_pytree_restore(abstract_state.params),
      opt_state=_pytree_restore(abstract_state.opt_state),
      meta=ocp.args.JsonRestore()))
  state = abstract_state.replace(params=restored['params'], opt_state=restored['opt_state'],
                                 step=restored['meta']['step'])
  return state, restored['meta']


def restore_params(manager: ocp.CheckpointManager, step: int, abstract_params: Any) -> Any:
  """The parameters of `step` alone, into the shardings of `abstract_params`."""
  return manager.restore(step, args=ocp.args.Composite(
      params=_pytree_restore(abstract_params)))['params']


def restore_meta(manager: ocp.CheckpointManager, step: int) -> dict:
  return manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))['meta']


def restore_data_state(workdir: str, step: int, data_iterator: Any) -> bool:
  """Restores this process's input position of `step`; False if none was saved."""
  path = _data_state_path(workdir, step)
  # tf.train.Checkpoint writes <path>.index and <path>.data-*; process_1 must not match
  # process_10's files.
  if not gfile().exists(path + '.index'):
    return False
  data_iterator.restore(path)
  return True


def write_run_files(workdir: str, config_json: str, bert_config: model_lib.BertConfig,
                    vocab_file: str | None, extra: dict[str, Any] | None = None) -> None:
  """config.json, bert_config.json, vocab.txt and `extra` ({file name: JSON value}) in the
  workdir (process 0 only)."""
  if jax.process_index() != 0:
    return
  fs = gfile()
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
    write_json(os.path.join(workdir, name), value)


def write_json(path: str, value: Any) -> None:
  """`value` as indented JSON, replacing `path` whole (a reader never sees half a file)."""
  tmp = path + '.tmp'
  with gfile().GFile(tmp, 'w') as f:
    f.write(json.dumps(value, indent=2) + '\n')
  gfile().rename(tmp, path, overwrite=True)


def read_json(path: str) -> Any:
  with gfile().GFile(path) as f:
    return json.load(f)


def load_pretrained_from_workdir(path: str, step: int | None = None
                                 ) -> tuple[model_lib.BertConfig, dict]:
  """(config, params) from the latest (or given) checkpoint of a training workdir, on the host.

  Parameters come back as float32 numpy arrays in the unscanned layout.
  """
  config_path = os.path.join(path, 'bert_config.json')
  if not gfile().exists(config_path):
    raise UserError(f'{path} has no bert_config.json: not a bert_jax training workdir')
  with gfile().GFile(config_path) as f:
    try:
      config = model_lib.BertConfig.from_dict(json.load(f), source=config_path)
    except json.JSONDecodeError as e:
      raise UserError(f'{config_path}: not valid JSON: {e}') from e
  ckpt_dir = os.path.join(path, CHECKPOINT_DIR)
  manager = ocp.CheckpointManager(ckpt_dir, item_names=('params', 'opt_state', 'meta'),
                                  options=ocp.CheckpointManagerOptions(read_only=True))
  step = manager.latest_step() if step is None else step
  if step is None:
    raise UserError(f'{ckpt_dir} holds no complete checkpoint')
  metadata = manager.item_metadata(step)['params']
  sharding = jax.sharding.SingleDeviceSharding(jax.local_devices(backend='cpu')[0])
  abstract = jax.tree.map(
      lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=sharding), metadata,
      is_leaf=lambda m: hasattr(m, 'shape'))
  restored = manager.restore(step, args=ocp.args.Composite(
      params=ocp.args.StandardRestore(abstract)))
  params = jax.tree.map(lambda x: np.asarray(x, np.float32), restored['params'])
  manager.close()
  params = dict(params)
  if 'bert' in params:
    params = model_lib.unstack_layers(params, config.num_hidden_layers)
  logging.info('Loaded step %d of %s', step, ckpt_dir)
  return config, params


def checkpoint_steps(workdir: str) -> list[int]:
  """Committed checkpoint steps of a workdir (ascending)."""
  d = os.path.join(workdir, CHECKPOINT_DIR)
  if not gfile().isdir(d):
    return []
  return sorted(int(n.rstrip('/')) for n in gfile().listdir(d) if re.fullmatch(r'\d+/?', n))


def read_run_config(workdir: str) -> dict | None:
  p = os.path.join(workdir, 'config.json')
  if not gfile().exists(p):
    return None
  with gfile().GFile(p) as f:
    return json.load(f)
