"""A run's workdir as the rest of bert_jax sees it, beside its checkpoints (`checkpoint.py`) and
its lock (`run_lock.py`):

  config.json                  the run's full ConfigDict (`write_run_files`, `read_run_config`)
  bert_config.json, vocab.txt  the model, so that the workdir loads like a converted checkpoint
                               (`load_pretrained_from_workdir`)
  metrics.jsonl                the loop's rows (monitor.py)
  compilation_cache/           JAX's compiled programs, so a rerun does not compile again
                               (`checkpoint.compilation_cache_dir`, `use_compilation_cache`)
  checkpoints/                 read as the commands that do not train see them: its committed
                               steps (`checkpoint_steps`), a step's weights
                               (`load_pretrained_from_workdir`)

`check_workdir_kind` refuses a workdir that holds the other kind of run (pre-training or
fine-tuning) before anything is written there. Every path goes through `fileio` (local, gs://,
other tf.io.gfile systems).
"""

import json
import os
import re
from typing import Any

from absl import logging
from etils import epath
import jax
from jax.experimental.compilation_cache import compilation_cache as jax_cache
import numpy as np
import orbax.checkpoint as ocp

from bert_jax import checkpoint
from bert_jax import defaults
from bert_jax import fileio
from bert_jax import gcs
from bert_jax import model as model_lib
from bert_jax.errors import UserError

# What write_run_files and the loop write at the top of a workdir.
RUN_FILES = ('config.json', 'bert_config.json', 'vocab.txt', 'metrics.jsonl')
# The file whose presence commits a step folder on Cloud Storage (Orbax writes a step there in
# place, without a rename).
_GCS_COMMIT_FILE = ocp.path.atomicity_types.COMMIT_SUCCESS_FILE


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


def checkpoint_steps(workdir: str) -> list[int]:
  """Committed checkpoint steps of a workdir (ascending), read from its files: what a command
  that does not train (export, a Hub push, an evaluation) sees, without an Orbax manager."""
  d = os.path.join(workdir, checkpoint.CHECKPOINT_DIR)
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
  ckpt_dir = os.path.join(path, checkpoint.CHECKPOINT_DIR)
  steps = checkpoint_steps(path)
  if step is None:
    if not steps:
      raise UserError(f'{ckpt_dir} holds no complete checkpoint')
    step = steps[-1]
  elif step not in steps:
    raise UserError(f'{ckpt_dir} holds no complete checkpoint of step {step} (its steps: '
                    f'{", ".join(map(str, steps)) or "none"})')
  damaged = lambda reason: UserError(f'{ckpt_dir}/{step}: damaged or incomplete checkpoint '
                                     f'({reason}); move that folder aside to use an earlier step')
  item = os.path.join(ckpt_dir, str(step), 'params')
  if not fileio.isdir(item):
    raise damaged('it holds no params')
  # The params item alone, by its own handler: a manager over the whole step warns of every
  # other item it holds (optimizer state, FP8 scales), which it has no handler for.
  handler = ocp.StandardCheckpointHandler()
  try:
    metadata = handler.metadata(epath.Path(item))
    sharding = jax.sharding.SingleDeviceSharding(jax.local_devices(backend='cpu')[0])
    abstract = jax.tree.map(
        lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=sharding), metadata,
        is_leaf=lambda m: hasattr(m, 'shape'))
    restored = handler.restore(epath.Path(item), args=ocp.args.StandardRestore(abstract))
  except Exception as e:  # pylint: disable=broad-except  (re-raised unless files are missing)
    reason = _damage(e)
    if reason is None:
      raise  # Not the files (Cloud Storage failing, a bug): its own message or traceback.
    raise damaged(reason) from e
  finally:
    handler.close()
  params = jax.tree.map(lambda x: np.asarray(x, np.float32), restored)
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
  if isinstance(error, FileNotFoundError) or any(s in str(error) for s in _DAMAGE_SIGNS):
    return (str(error).splitlines() or [type(error).__name__])[0][:300]
  return None


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
