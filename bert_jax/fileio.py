"""Files wherever `tf.io.gfile` reaches: local paths, Cloud Storage (gs://), TensorFlow's ram://.

Task data, predictions and run files go through here, so a fine-tuning workdir or data folder
on a bucket works like a local one. TensorFlow is imported on first use.
"""

import os

from bert_jax.errors import UserError


def gfile():
  """`tf.io.gfile`: local paths and gs:// alike."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  return tf.io.gfile


def exists(path: str) -> bool:
  return gfile().exists(path)


def isfile(path: str) -> bool:
  return gfile().exists(path) and not gfile().isdir(path)


def read_text(path: str, encoding: str = 'utf-8') -> str:
  """The whole file, decoded (`utf-8-sig` drops a byte-order mark); newlines kept as they are."""
  with gfile().GFile(path, 'rb') as f:
    return f.read().decode(encoding)


def write_text(path: str, text: str) -> None:
  """Writes `text` (UTF-8), making the folder first."""
  folder = path.rsplit('/', 1)[0] if '/' in path else ''
  if folder:
    gfile().makedirs(folder)
  with gfile().GFile(path, 'wb') as f:
    f.write(text.encode('utf-8'))


def make_dirs(path: str, flag: str) -> None:
  """Makes the folder `path` (and its parents); a file in the way, a path that cannot be made or
  a local folder that cannot be written is a UserError naming `flag` (`--workdir`)."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  if isfile(path):
    raise UserError(f'{flag}={path} is a file, not a folder: name a folder (it is created if '
                    'missing)')
  try:
    gfile().makedirs(path)
  except tf.errors.OpError as e:
    raise UserError(f'{flag}={path}: cannot create this folder ({e.message})') from e
  if '://' not in path and not os.access(path, os.W_OK | os.X_OK):
    raise UserError(f'{flag}={path}: this folder is not writable by this user')
