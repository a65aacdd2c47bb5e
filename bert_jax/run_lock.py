"""One run at a time per workdir: `hold(workdir)` holds `<workdir>/run.lock` for a run.

Process 0 writes the lock (pid, host, start time, a heartbeat rewritten every minute) and
refuses a second run while the holder is alive; it is created exclusively (a hard link of a
complete file; O_EXCL without hard links; on Cloud Storage create-if-absent), and a stale one
(a killed run) is replaced only as it was read (locally under an flock of the workdir, on Cloud
Storage with a generation precondition), so two runs started together cannot both take it.
Both drivers hold it for their whole run; writing it is also the check that the workdir is
writable. Every path goes through `fileio` / `gcs` (local, gs://, other tf.io.gfile systems).
"""

import contextlib
import errno
import fcntl
import json
import os
import socket
import threading
import time
from typing import Iterator
import uuid

from absl import logging
import jax
import numpy as np

from bert_jax import fileio
from bert_jax import gcs
from bert_jax.errors import UserError

LOCK_FILE = 'run.lock'
# A lock whose holder runs on another host is stale when its heartbeat is older than this.
LOCK_STALE_SECONDS = 300
_LOCK_HEARTBEAT_SECONDS = 60


def _read_lock(path: str) -> tuple[dict | None, int | None]:
  """(record, generation): the lock's holder (None: no lock, or half written / unreadable) and,
  on Cloud Storage, the object's generation (None when there is no object)."""
  if gcs.is_gcs(path):
    got = gcs.read(path)
    if got is None:
      return None, None
    try:
      return json.loads(got[0] or b'null'), got[1]
    except ValueError:
      return None, got[1]
  try:
    with fileio.gfile().GFile(path) as f:
      return json.loads(f.read() or 'null'), None
  except Exception:  # pylint: disable=broad-except  (gone meanwhile, or half written)
    return None, None


def _holder_alive(holder: dict) -> bool:
  if holder.get('host') == socket.gethostname():
    pid = int(holder.get('pid', -1))
    if pid == os.getpid():
      return False  # An earlier run in this very process that did not release it.
    try:
      os.kill(pid, 0)
    except ProcessLookupError:
      return False
    except PermissionError:
      return True  # Alive, another user's.
    return True
  return time.time() - float(holder.get('heartbeat', 0)) < LOCK_STALE_SECONDS


def _create_lock(path: str, record: dict) -> int | None:
  """Writes the lock if there is none, atomically where the filesystem can: locally a complete
  file hard-linked into place (a reader never sees it half written), on Cloud Storage a
  generation precondition (create-if-absent). Its generation on Cloud Storage, 0 elsewhere; None
  if another run's lock is there."""
  text = json.dumps(record)
  if gcs.is_gcs(path):
    return gcs.create_if_absent(path, text.encode())
  if not fileio.is_remote(path):
    tmp = f'{path}.{record["token"]}'
    with open(tmp, 'w') as f:
      f.write(text)
    try:
      os.link(tmp, path)  # Fails if the lock exists: the exclusive create.
    except FileExistsError:
      return None
    except OSError as e:
      if e.errno not in _NO_HARD_LINKS:
        raise
      return _create_exclusive(path, text)
    finally:
      os.remove(tmp)
    return 0
  # Other filesystems (ram://) have no exclusive create: write, then read back who won.
  fileio.write_json(path, record)
  return 0 if (_read_lock(path)[0] or {}).get('token') == record['token'] else None


# What link() says on filesystems without hard links (Cloud Storage FUSE mounts, some others).
_NO_HARD_LINKS = (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS)
# An unreadable local lock younger than this may be one being written (_create_exclusive).
_LOCK_WRITE_SECONDS = 10


def _create_exclusive(path: str, text: str) -> int | None:
  """O_EXCL, then the contents: where there are no hard links. A reader can see the lock empty
  for a moment; `_take_over` leaves a young unreadable lock alone."""
  try:
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
  except FileExistsError:
    return None
  with os.fdopen(fd, 'w') as f:
    f.write(text)
  return 0


def _take_over(path: str, stale: dict | None, generation: int | None,
               record: dict) -> int | None:
  """Replaces the stale lock as it was read (`stale`; on Cloud Storage its `generation`) with
  `record`, so that of several runs taking over the same stale lock exactly one gets it: on
  Cloud Storage a single upload conditional on that generation; locally, under an flock of the
  workdir, a removal only if the lock is still the stale one, then the exclusive create. As
  `_create_lock`."""
  if gcs.is_gcs(path):
    if generation is None:
      return _create_lock(path, record)
    return gcs.replace_if_generation(path, json.dumps(record).encode(), generation)
  if not fileio.is_remote(path):
    fd = os.open(os.path.dirname(path), os.O_RDONLY)
    try:
      try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # Released with the descriptor.
      except OSError:
        # NFS emulates flock with byte-range locks, which need a file open for writing, never a
        # folder (flock(2)): taken over unserialised there.
        pass
      with contextlib.suppress(FileNotFoundError):
        if stale is None and time.time() - os.path.getmtime(path) < _LOCK_WRITE_SECONDS:
          return None  # Perhaps another run's lock, being written.
      if _read_lock(path)[0] == stale:
        with contextlib.suppress(FileNotFoundError):
          os.remove(path)
      return _create_lock(path, record)
    finally:
      os.close(fd)
  _remove_lock(path, generation)
  return _create_lock(path, record)


def _remove_lock(path: str, generation: int | None) -> None:
  """Removes a lock; on Cloud Storage only the `generation` read, so that a lock another
  starter wrote meanwhile stays."""
  try:
    if gcs.is_gcs(path):
      if generation is not None:
        gcs.delete_if_generation(path, generation)
    else:
      fileio.gfile().remove(path)
  except Exception:  # pylint: disable=broad-except  (another starter removed it)
    pass


@contextlib.contextmanager
def hold(workdir: str) -> Iterator[None]:
  """Holds `<workdir>/run.lock` for the duration of a run; refuses if a live run holds it.

  Process 0 takes it (all processes learn the outcome); the holder is alive when it is a live
  pid on this host, or, on another host, when its heartbeat (rewritten every minute) is younger
  than LOCK_STALE_SECONDS. A stale lock (a killed run) is taken over with a warning. Taking it
  is an exclusive create (a hard link; on Cloud Storage create-if-absent), and taking over a
  stale one replaces exactly the lock that was read (`_take_over`), so of two runs started at
  the same moment one is refused, whether the lock was free or stale; on Cloud Storage the
  heartbeat and the release, too, only touch the generation this run wrote. Writing the lock is
  also the check that the workdir is writable.
  """
  path = os.path.join(workdir, LOCK_FILE)
  token = uuid.uuid4().hex
  refusal = ''
  generation = None
  # The local folders this run makes (the workdir and parents that are missing): a run refused
  # before it wrote anything there removes them again, leaving no empty workdir behind.
  made = []
  if jax.process_index() == 0 and not fileio.is_remote(workdir):
    folder = os.path.abspath(workdir)
    while not os.path.exists(folder):
      made.append(folder)
      folder = os.path.dirname(folder)
  if jax.process_index() == 0:
    fileio.make_dirs(workdir, '--workdir')
    record = dict(pid=os.getpid(), host=socket.gethostname(), token=token,
                  started=time.strftime('%Y-%m-%d %H:%M:%S %Z'), heartbeat=time.time())
    for _ in range(3):
      holder, held = _read_lock(path)
      if holder is not None and _holder_alive(holder):
        refusal = (f'--workdir={workdir} is in use by another run (pid {holder.get("pid")} on '
                   f'{holder.get("host")}, started {holder.get("started")}; lock file {path}). '
                   'Wait for it to end or stop it, or use another --workdir; if no such run is '
                   f'alive, delete {path}.')
        break
      stale = holder is not None or held is not None or (
          not gcs.is_gcs(path) and fileio.gfile().exists(path))  # Unreadable: stale too.
      try:
        if stale:
          logging.warning('Taking over the stale lock %s of a run that is gone: %s', path,
                          holder)
          generation = _take_over(path, holder, held, record)
        else:
          generation = _create_lock(path, record)
      except Exception as e:  # pylint: disable=broad-except
        raise UserError(f'--workdir={workdir} is not writable ({path}: {e}); choose a '
                        'directory this job can write to') from e
      if generation is not None:
        break
    else:
      refusal = f'--workdir={workdir}: could not take the lock {path} (another run starts?)'
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
    refused = int(multihost_utils.broadcast_one_to_all(np.int32(bool(refusal))))
    if refused and not refusal:
      refusal = f'--workdir={workdir} is in use by another run (see process 0\'s message)'
  if refusal:
    _remove_if_empty(made)
    raise UserError(refusal)

  stop = threading.Event()

  def heartbeat():
    nonlocal generation
    while not stop.wait(_LOCK_HEARTBEAT_SECONDS):
      record['heartbeat'] = time.time()
      try:
        if gcs.is_gcs(path):
          # One conditional upload a minute: the lock is replaced only if it is still ours.
          new = gcs.replace_if_generation(path, json.dumps(record).encode(), generation)
          if new is None:
            logging.warning('The lock %s was taken over by another run', path)
            return
          generation = new
        elif (_read_lock(path)[0] or {}).get('token') == token:
          fileio.write_json(path, record)  # Replaced whole: a reader never sees half a lock.
      except Exception as e:  # pylint: disable=broad-except  (retried next time)
        logging.warning('Could not refresh %s: %s', path, e)

  beat = None
  if jax.process_index() == 0:
    beat = threading.Thread(target=heartbeat, name='bert_jax_lock_heartbeat', daemon=True)
    beat.start()
  failed = False
  try:
    yield
  except BaseException:
    failed = True
    raise
  finally:
    stop.set()
    if beat is not None:
      beat.join()
      if gcs.is_gcs(path):
        _remove_lock(path, generation)
      elif (_read_lock(path)[0] or {}).get('token') == token:
        fileio.gfile().remove(path)
    if failed:
      _remove_if_empty(made)


def _remove_if_empty(folders: list[str]) -> None:
  """Removes the local `folders` (deepest first) that hold nothing, up to the first that
  holds something."""
  for folder in folders:
    try:
      os.rmdir(folder)  # Only an empty folder.
    except OSError:
      return
