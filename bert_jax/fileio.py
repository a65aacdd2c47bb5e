"""Files wherever `tf.io.gfile` reaches: local paths, Cloud Storage (gs://), TensorFlow's ram://.

Every path helper of the package lives here: task data, predictions, run files, JSON results and
checkpoint folders go through it, so a workdir or data folder on a bucket works like a local
one. Local paths are answered by `os` where that is enough (no TensorFlow import); TensorFlow is
imported on first use, with accelerators hidden from it.
"""

import errno
import functools
import glob as glob_lib
import json
import os
from typing import Any, Iterator

import numpy as np

from bert_jax import gcs
from bert_jax.errors import UserError

# Effective ids: what open() will be allowed (os.access checks the real ids by default).
_EFFECTIVE = os.access in os.supports_effective_ids


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


def hide_accelerators_from_tf() -> None:
  """Keeps TensorFlow (tf.data, tf.io.gfile) off GPUs and TPUs, so it never takes device memory
  from JAX: done once, as TensorFlow is imported here. Call it before TensorFlow first touches
  a device (a module that imports TensorFlow itself does not hide them)."""
  tensorflow()


def gfile():
  """`tf.io.gfile`: local paths and gs:// alike."""
  return tensorflow().io.gfile


# Where runs go when no --workdir is given. The hyphen keeps it from being imported as a
# module: Python started in /tmp would import a folder /tmp/bert_jax instead of the package
# (the cache, sample_corpus.default_cache_dir, is named alike).
DEFAULT_WORKDIR_ROOT = '/tmp/bert-jax'


def default_workdir(name: str) -> str:
  """The workdir of a run given no --workdir: DEFAULT_WORKDIR_ROOT/<name>."""
  return os.path.join(DEFAULT_WORKDIR_ROOT, name)


# The URL schemes a path may have (besides none: a local path), each read and written through
# tf.io.gfile: Cloud Storage, and TensorFlow's in-memory filesystem (tests). The one place that
# lists them: any other (s3://, http://) is refused by `is_remote`, which every path meets.
SCHEMES = ('gs', 'ram')


def is_remote(path: str) -> bool:
  """Whether `path` names another filesystem (gs://, ram://) than the local one; a UserError
  naming `path` for a scheme not in SCHEMES, which TensorFlow would meet with a traceback."""
  if '://' not in path:
    return False
  scheme = path.split('://', 1)[0]
  if scheme not in SCHEMES:
    raise UserError(f'{path}: paths starting {scheme}:// are not supported; use a local path '
                    f'or {", ".join(s + "://" for s in SCHEMES if s != "ram")} (copy the files '
                    'there first)')
  return True


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


def escape_glob(path: str) -> str:
  """`path` as a glob pattern that matches it alone: a folder named 'ckpt[1]' stays literal.
  Remote globs too: TensorFlow matches gs:// names with fnmatch, where '[1]' is a class."""
  return glob_lib.escape(path)


def glob(pattern: str) -> list[str]:
  """Sorted matches of `pattern`."""
  return sorted(gfile().glob(pattern) if is_remote(pattern) else glob_lib.glob(pattern))


def missing(path: str) -> str:
  """Why `path`, which does not exist, is missing: 'no such file', and for a symbolic link what
  is wrong with it (a loop, or the target it names)."""
  if is_remote(path) or not os.path.islink(path):
    return 'no such file'
  try:
    os.stat(path)
  except OSError as e:
    if e.errno == errno.ELOOP:
      return f'no such file (a symbolic link that loops: {e.strerror})'
  return f'no such file (a symbolic link to {os.readlink(path)}, which does not exist)'


def read_user_text(path: str, flag: str = '') -> str:
  """A text file the user named (`flag`: how, e.g. '--input'), decoded from UTF-8 with or
  without a byte-order mark; newlines kept as they are (readers accept CRLF).

  A missing path, a folder, a file that cannot be read or is not UTF-8 text is a UserError
  naming the flag, the path and, for bad bytes, the line and byte offset: one line instead of a
  traceback from deep inside a reader.
  """
  where = f'{flag}: {path}' if flag else path
  if not exists(path):
    raise UserError(f'{where}: {missing(path)}')
  if isdir(path):
    raise UserError(f'{where} is a directory; name a file')
  if not is_remote(path) and not os.path.isfile(path):
    # A named pipe or a device: reading it could wait forever or never end.
    raise UserError(f'{where} is not a regular file')
  try:
    with (gfile().GFile(path, 'rb') if is_remote(path) else open(path, 'rb')) as f:
      data = f.read()
  except OSError as e:
    raise UserError(f'{where}: cannot be read ({e.strerror or e})') from None
  except tensorflow().errors.OpError as e:
    raise UserError(f'{where}: cannot be read ({e.message})') from None
  try:
    return data.decode('utf-8-sig')
  except UnicodeDecodeError as e:
    line = data[:e.start].count(b'\n') + 1
    raise UserError(f'{where}:{line}: not UTF-8 text (byte {e.start} is '
                    f'0x{data[e.start]:02x}); save it as UTF-8') from None


def read_jsonl_objects(path: str) -> Iterator[tuple[int, dict]]:
  """(1-based line number, object) of every non-blank line of a JSONL file the user named; a
  line that is not a JSON object is a UserError naming the file and line."""
  for number, line in enumerate(read_user_text(path).split('\n'), 1):
    if not line.strip():
      continue
    try:
      row = json.loads(line)
    except json.JSONDecodeError as e:
      raise UserError(f'{path}:{number}: not valid JSON: {e.msg}') from None
    if not isinstance(row, dict):
      raise UserError(f'{path}:{number}: expected a JSON object, got {type(row).__name__}')
    yield number, row


def check_bucket(path: str, flag: str, write: bool = False) -> None:
  """On Cloud Storage, raises a UserError naming `flag` if `path`'s bucket does not exist or this
  machine may not read it (`write`: write to it); nothing for other paths. Before the work, so
  that a missing permission is one line, not a traceback from whichever read meets it first."""
  if gcs.is_gcs(path):
    gcs.check_access(path, flag, write)


def check_readable(path: str, flag: str) -> None:
  """Raises a UserError naming `flag` if the local file `path` is not a regular file (a named
  pipe would block a reader) or cannot be opened for reading, or if this machine may not read
  its bucket. Other remote paths show on reading."""
  if is_remote(path):
    check_bucket(path, flag)
    return
  if not os.path.isfile(path):
    raise UserError(f'{flag}: {path} is not a regular file')
  try:
    open(path, 'rb').close()  # pylint: disable=consider-using-with
  except OSError as e:
    raise UserError(f'{flag}: {path} cannot be read ({e.strerror or e})') from None


def check_readable_dir(path: str, flag: str = '') -> None:
  """Raises a UserError naming `flag` and `path` if this user cannot list and enter the local
  folder `path`, or may not read its bucket."""
  check_bucket(path, flag)
  if not is_remote(path) and not os.access(path, os.R_OK | os.X_OK, effective_ids=_EFFECTIVE):
    raise UserError(f'{f"{flag}: " if flag else ""}{path}: cannot be read (Permission denied)')


def check_input_dir(path: str, flag: str) -> None:
  """Raises a UserError naming `flag` if the folder `path` is missing, is a file or (locally)
  cannot be read: the one line a folder of inputs (config.task.data_dir) gets, before its files'."""
  check_bucket(path, flag)
  if not exists(path):
    raise UserError(f'{flag}={path}: no such folder')
  if not isdir(path):
    raise UserError(f'{flag}={path} is a file, not a folder: name the folder that holds the '
                    'files')
  check_readable_dir(path, flag)


def check_output_file(path: str, flag: str) -> None:
  """Raises a UserError naming `flag` if `path` cannot become a file: it is a folder, a file
  stands where a parent folder should, or (locally) the folder that would hold it is not
  writable. Called before the work whose result goes there, not after it."""
  if isdir(path):
    raise UserError(f'{flag}={path} is a directory; name a file to write')
  _check_parents(path, flag)


def check_output_dir(path: str, flag: str) -> None:
  """Raises a UserError naming `flag` if `path` cannot become a folder (a file is there, or in
  the place of a parent, or the nearest existing parent is not writable)."""
  if isfile(path):
    raise UserError(f'{flag}={path} is a file, not a folder: name a folder (it is created if '
                    'missing)')
  if isdir(path):
    if not is_remote(path) and not _writable(path):
      raise UserError(f'{flag}={path}: this folder is not writable by this user')
    return
  _check_parents(path, flag)


def same_path(a: str, b: str) -> bool:
  """Whether `a` and `b` name one file or folder: local paths compared resolved (relative
  paths, symlinks, `..`) and, when both exist, by inode (hard links); remote ones as written,
  less a trailing '/'."""
  if is_remote(a) or is_remote(b):
    return a.rstrip('/') == b.rstrip('/')
  if os.path.realpath(a) == os.path.realpath(b):
    return True
  try:
    return os.path.samefile(a, b)
  except OSError:  # One of them does not exist (yet): then they differ.
    return False


def check_not_an_input(output: str, flag: str, inputs: dict[str, list[str] | str]) -> None:
  """Raises a UserError naming both flags if the file `output` is one of `inputs` ({flag: its
  file or files}): writing it would replace what the command reads. Before any work."""
  for input_flag, paths in inputs.items():
    for path in [paths] if isinstance(paths, str) else paths:
      if path and same_path(output, path):
        shown = path if path == output else f'{path}, the same file'
        raise UserError(f'{flag}={output} is the input {input_flag}={shown}: writing it would '
                        f'replace the input; name another {flag}')


def _writable(folder: str) -> bool:
  return os.access(folder, os.W_OK | os.X_OK, effective_ids=_EFFECTIVE)


def _check_parents(path: str, flag: str) -> None:
  if is_remote(path):
    return  # Buckets have no folders to be in the way; permissions show on the first write.
  parent = os.path.dirname(os.path.abspath(path))
  while not os.path.exists(parent):
    parent = os.path.dirname(parent)
  if not os.path.isdir(parent):
    raise UserError(f'{flag}={path}: {parent} is a file, so no folder can be made there')
  if not _writable(parent):
    raise UserError(f'{flag}={path}: {parent} is not writable by this user')


# Errors of a write that the user fixes on the storage side, and how they read.
DISK_ERRORS = {errno.ENOSPC: 'No space left on device', errno.EDQUOT: 'Disk quota exceeded',
               errno.EROFS: 'Read-only file system', errno.EACCES: 'Permission denied',
               errno.EFBIG: 'File too large'}


def disk_error(error: BaseException | None) -> str | None:
  """The cause of a failed write that the user must fix on the storage side (a full disk, a
  read-only one), anywhere in `error`'s chain, else None."""
  while error is not None:
    if isinstance(error, OSError) and error.errno in DISK_ERRORS:
      return DISK_ERRORS[error.errno]
    # TensorStore and TensorFlow report OS errors in their message ("... No space left on
    # device [os_error_code='28']").
    for text in DISK_ERRORS.values():
      if text in str(error):
        return text
    error = error.__cause__ or error.__context__
  return None


def write_bytes(path: str, data: bytes) -> None:
  """Writes `data` to `path` whole or not at all, making the folder first.

  Locally (and on other filesystems with a rename) into a temporary file beside it, renamed
  over `path` once complete: a full disk leaves no truncated file that a later run would take
  for a whole one. A Cloud Storage object appears only once its upload completes. A write that
  fails for a storage reason (`disk_error`) is a UserError naming the file and the cause.
  """
  folder = path.rsplit('/', 1)[0] if '/' in path else ''
  tmp = path if gcs.is_gcs(path) else f'{path}.tmp-{os.getpid()}'
  try:
    if folder:
      gfile().makedirs(folder)
    if is_remote(path):
      with gfile().GFile(tmp, 'wb') as f:
        f.write(data)
      if tmp != path:
        gfile().rename(tmp, path, overwrite=True)
    else:
      with open(tmp, 'wb') as f:
        f.write(data)
      os.replace(tmp, path)
  except Exception as e:
    cause = disk_error(e)
    if tmp != path:
      try:
        if exists(tmp):
          gfile().remove(tmp) if is_remote(tmp) else os.remove(tmp)
      except Exception:  # pylint: disable=broad-except  (the error below matters more)
        pass
    if cause is None:
      raise
    raise UserError(f'{path}: cannot be written ({cause}); nothing was written there: free '
                    'space (or fix its permissions) and rerun') from e


def write_text(path: str, text: str) -> None:
  """Writes `text` (UTF-8) whole or not at all (`write_bytes`)."""
  write_bytes(path, text.encode('utf-8'))


def write_json(path: str, value: Any) -> None:
  """`value` as indented JSON, replacing `path` whole (a reader never sees half a file)."""
  write_text(path, json.dumps(value, indent=2) + '\n')


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
  check_bucket(path, flag, write=True)
  if isfile(path):
    raise UserError(f'{flag}={path} is a file, not a folder: name a folder (it is created if '
                    'missing)')
  if not isdir(path):
    _check_parents(path, flag)
  try:
    gfile().makedirs(path)
  except tf.errors.PermissionDeniedError as e:
    if gcs.is_gcs(path):  # A bucket it may read but not write (roles/storage.objectViewer).
      raise gcs.no_permission(path, flag, e, write=True) from e
    raise UserError(f'{flag}={path}: cannot create this folder ({e.message})') from e
  except tf.errors.OpError as e:
    raise UserError(f'{flag}={path}: cannot create this folder ({e.message})') from e
  if not is_remote(path) and not _writable(path):
    raise UserError(f'{flag}={path}: this folder is not writable by this user')
