"""Files wherever `tf.io.gfile` reaches: local paths, Cloud Storage (gs://), TensorFlow's ram://.

Every path helper of the package lives here: task data, predictions, run files, JSON results and
checkpoint folders go through it, so a workdir or data folder on a bucket works like a local
one. Local paths are answered by `os` where that is enough (no TensorFlow import); TensorFlow is
imported on first use, with accelerators hidden from it.
"""

import functools
import glob as glob_lib
import json
import os
from typing import Any

import numpy as np

from bert_jax import gcs
from bert_jax.errors import UserError


@functools.cache
def tensorflow():
  """TensorFlow, imported once, never taking accelerator memory from JAX."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  for kind in ('GPU', 'TPU'):
    try:
      tf.config.set_visible_devices([], kind)
    except (RuntimeError, ValueError):
      pass  # Devices were initialized already (by an earlier user), or no such kind.
  return tf


def gfile():
  """`tf.io.gfile`: local paths and gs:// alike."""
  return tensorflow().io.gfile


def is_remote(path: str) -> bool:
  """Whether `path` names another filesystem (gs://, ram://, ...) than the local one."""
  return '://' in path


def workdir_path(path: str) -> str:
  """A workdir as runs use it: local paths absolute (with ~ expanded), gs:// and other
  filesystems' paths as given."""
  return path if is_remote(path) else os.path.abspath(os.path.expanduser(path))


def exists(path: str) -> bool:
  return gfile().exists(path) if is_remote(path) else os.path.exists(path)


def isdir(path: str) -> bool:
  return gfile().isdir(path) if is_remote(path) else os.path.isdir(path)


def isfile(path: str) -> bool:
  return exists(path) and not isdir(path)


def glob(pattern: str) -> list[str]:
  """Sorted matches of `pattern`."""
  return sorted(gfile().glob(pattern) if is_remote(pattern) else glob_lib.glob(pattern))


def read_text(path: str, encoding: str = 'utf-8') -> str:
  """The whole file, decoded (`utf-8-sig` drops a byte-order mark); newlines kept as they are."""
  with (gfile().GFile(path, 'rb') if is_remote(path) else open(path, 'rb')) as f:
    return f.read().decode(encoding)


def write_text(path: str, text: str) -> None:
  """Writes `text` (UTF-8), making the folder first."""
  folder = path.rsplit('/', 1)[0] if '/' in path else ''
  if folder:
    gfile().makedirs(folder)
  with gfile().GFile(path, 'wb') as f:
    f.write(text.encode('utf-8'))


def write_json(path: str, value: Any) -> None:
  """`value` as indented JSON, replacing `path` whole (a reader never sees half a file)."""
  tmp = path + '.tmp'
  with gfile().GFile(tmp, 'w') as f:
    f.write(json.dumps(value, indent=2) + '\n')
  gfile().rename(tmp, path, overwrite=True)


def read_json(path: str) -> Any:
  with gfile().GFile(path) as f:
    return json.load(f)


def json_safe(d: Any) -> Any:
  """`d` (nested dicts of numbers) with NumPy scalars as Python numbers, for JSON."""
  if isinstance(d, dict):
    return {k: json_safe(v) for k, v in d.items()}
  if isinstance(d, (np.integer, np.floating)):
    return d.item()
  return d


def make_dirs(path: str, flag: str) -> None:
  """Makes the folder `path` (and its parents); a file in the way, a path that cannot be made or
  a local folder that cannot be written is a UserError naming `flag` (`--workdir`)."""
  tf = tensorflow()
  if gcs.is_gcs(path):
    gcs.check_access(path, flag)  # A missing bucket or permission: one line, not a traceback.
  if isfile(path):
    raise UserError(f'{flag}={path} is a file, not a folder: name a folder (it is created if '
                    'missing)')
  try:
    gfile().makedirs(path)
  except tf.errors.OpError as e:
    raise UserError(f'{flag}={path}: cannot create this folder ({e.message})') from e
  if '://' not in path and not os.access(path, os.W_OK | os.X_OK):
    raise UserError(f'{flag}={path}: this folder is not writable by this user')
