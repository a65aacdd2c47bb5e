"""One run per workdir (run_lock.py): a live holder is refused, a dead one's lock taken over,
locally, on a non-local filesystem (TensorFlow's ram:// stands in for Cloud Storage; its own
lock tests are in gcs_test.py), without flock or hard links, and under a race of processes."""

import json
import os
import re
import socket
import subprocess
import time

import pytest
import tensorflow as tf

from bert_jax import run_lock
from bert_jax.errors import UserError
import processes


def _lock_record(**fields):
  return json.dumps(dict(dict(pid=1, host='elsewhere', started='then', heartbeat=0.0,
                              token='x'), **fields))


@pytest.mark.parametrize('where', ['local', 'ram'])
def test_workdir_lock_refuses_a_live_run_and_takes_over_a_dead_one(tmp_path, where):
  """One run per workdir, locally and on a non-local filesystem (no exclusive create there)."""
  workdir = str(tmp_path / 'w') if where == 'local' else f'ram://{tmp_path}/w'
  path = os.path.join(workdir, run_lock.LOCK_FILE)
  tf.io.gfile.makedirs(workdir)
  live = subprocess.Popen(['sleep', '60'])
  dead = subprocess.Popen(['true'])
  dead.wait()
  host = socket.gethostname()
  try:
    for holder, refused in [
        (_lock_record(pid=live.pid, host=host), True),       # A live process here.
        (_lock_record(heartbeat=time.time()), True),         # Another host, fresh heartbeat.
        (_lock_record(pid=dead.pid, host=host), False),      # Its process is gone.
        (_lock_record(heartbeat=time.time() - 3600), False)]:  # Another host, silent an hour.
      if tf.io.gfile.exists(path):
        tf.io.gfile.remove(path)  # ram:// does not always replace a file written over.
      with tf.io.gfile.GFile(path, 'w') as f:
        f.write(holder)
      if refused:
        with pytest.raises(UserError, match=f'--workdir={workdir} is in use by another run'):
          with run_lock.hold(workdir):
            pass
        assert tf.io.gfile.exists(path)  # The holder's lock stays.
      else:
        with run_lock.hold(workdir):
          with tf.io.gfile.GFile(path) as f:
            assert json.loads(f.read())['pid'] == os.getpid()
        assert not tf.io.gfile.exists(path)  # Released at the end.
  finally:
    live.kill()
    live.wait()


def test_an_empty_local_lock_is_left_alone_while_young(tmp_path):
  """Without hard links a lock is created empty and then written: an empty lock younger than
  _LOCK_WRITE_SECONDS may be another run's being written, so it is not taken over; an older one
  is a run that died there."""
  workdir = str(tmp_path / 'w')
  os.makedirs(workdir)
  path = os.path.join(workdir, run_lock.LOCK_FILE)
  open(path, 'w').close()
  with pytest.raises(UserError, match=re.escape(
      f'--workdir={workdir}: could not take the lock {path} (another run starts?)')):
    with run_lock.hold(workdir):
      pass
  assert os.path.getsize(path) == 0
  old = time.time() - run_lock._LOCK_WRITE_SECONDS - 1  # pylint: disable=protected-access
  os.utime(path, (old, old))
  with run_lock.hold(workdir):
    assert json.loads(open(path).read())['pid'] == os.getpid()
  assert not os.path.exists(path)


def test_a_stale_lock_is_taken_over_where_the_workdir_cannot_be_flocked(tmp_path, monkeypatch):
  """On NFS, flock of a folder fails (EBADF): the stale lock is still taken over."""
  import errno  # pylint: disable=g-import-not-at-top
  import fcntl  # pylint: disable=g-import-not-at-top

  def refused(*args):
    raise OSError(errno.EBADF, 'Bad file descriptor')

  monkeypatch.setattr(fcntl, 'flock', refused)
  workdir = str(tmp_path / 'w')
  os.makedirs(workdir)
  path = os.path.join(workdir, run_lock.LOCK_FILE)
  with open(path, 'w') as f:
    f.write(_lock_record(heartbeat=time.time() - 3600))
  with run_lock.hold(workdir):
    assert json.loads(open(path).read())['pid'] == os.getpid()


@pytest.mark.parametrize('hard_links', [True, False])
def test_runs_started_at_once_on_a_local_workdir_one_takes_the_lock(tmp_path, hard_links):
  """Three processes race for a local workdir's lock over several rounds: each round exactly one
  holds it, whether the lock was free or left stale by a dead process on this host (only the
  racer that still finds the stale lock under the workdir's flock replaces it), and whether the
  filesystem has hard links (the lock appears whole) or not (O_EXCL, then its contents)."""
  workdir = str(tmp_path / 'w')
  os.makedirs(workdir)
  path = os.path.join(workdir, run_lock.LOCK_FILE)
  dead = subprocess.Popen(['true'])
  dead.wait()

  def before_round(r):
    if r % 2:
      with open(path, 'w') as f:
        f.write(_lock_record(pid=dead.pid, host=socket.gethostname()))

  processes.race_for_lock(workdir, str(tmp_path), before_round=before_round,
                          hard_links=hard_links)
  assert os.listdir(workdir) == []  # Released, and no temporary lock file left.


def test_a_refused_run_leaves_no_empty_workdir_behind(tmp_path):
  """A run refused (any error) before it wrote anything leaves no folder it made; one that
  wrote something, or a workdir that was there before, stays."""
  workdir = tmp_path / 'runs' / 'a'
  with pytest.raises(UserError, match='refused'):
    with run_lock.hold(str(workdir)):
      raise UserError('refused')
  assert os.listdir(tmp_path) == []
  with pytest.raises(UserError, match='refused'):
    with run_lock.hold(str(workdir)):
      (workdir / 'vocab.txt').write_text('[PAD]\n')
      raise UserError('refused')
  assert os.listdir(workdir) == ['vocab.txt']
  (workdir / 'vocab.txt').unlink()
  with pytest.raises(UserError, match='refused'):
    with run_lock.hold(str(workdir)):  # There before: stays.
      raise UserError('refused')
  assert os.listdir(workdir) == []
  with run_lock.hold(str(tmp_path / 'b')):
    pass  # A run that ends well keeps its workdir, empty or not.
  assert os.path.isdir(tmp_path / 'b')
