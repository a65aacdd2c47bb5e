"""Paths and writes of every file the package reads and writes (fileio.py)."""

import errno
import io
import os

import pytest

from bert_jax import fileio
from bert_jax.errors import UserError


class _FullDisk(io.BytesIO):
  """A file on a disk that fills up after `room` bytes."""

  def __init__(self, path: str, room: int):
    super().__init__()
    self.path, self.room = path, room

  def write(self, data):
    if self.tell() + len(data) > self.room:
      with open(self.path, 'wb') as f:  # What got out before the disk filled.
        f.write(self.getvalue() + bytes(data[:self.room - self.tell()]))
      raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return super().write(data)


def test_a_write_is_whole_or_nothing_and_a_full_disk_is_one_line(tmp_path, monkeypatch):
  path = tmp_path / 'out' / 'vocab.txt'
  fileio.write_text(str(path), 'old\n')  # Makes the folder.
  assert path.read_text() == 'old\n'
  real_open = open
  monkeypatch.setattr(fileio, 'open', lambda p, mode='r', *a, **k: (
      _FullDisk(p, 3) if 'w' in mode else real_open(p, mode, *a, **k)), raising=False)
  with pytest.raises(UserError, match=rf'^{path}: cannot be written \(No space left on '
                     r'device\); nothing was written there'):
    fileio.write_text(str(path), 'new text, longer than the room left\n')
  # The file as it was, and no half-written temporary file beside it.
  assert path.read_text() == 'old\n'
  assert os.listdir(path.parent) == ['vocab.txt']
  monkeypatch.undo()
  fileio.write_json(str(path.parent / 'x.json'), {'a': 1})
  assert fileio.read_json(str(path.parent / 'x.json')) == {'a': 1}
  assert sorted(os.listdir(path.parent)) == ['vocab.txt', 'x.json']


def test_a_bug_in_a_write_keeps_its_error(tmp_path, monkeypatch):
  monkeypatch.setattr(fileio, 'open', lambda *a, **k: 1 / 0, raising=False)
  with pytest.raises(ZeroDivisionError):
    fileio.write_text(str(tmp_path / 'x.txt'), 'x')


@pytest.mark.parametrize('path', ['s3://bucket/corpus.txt', 'http://example.com/x',
                                  'hdfs://namenode/run'])
def test_paths_of_an_unsupported_scheme_are_one_line(path):
  with pytest.raises(UserError, match=rf'^{path}: paths starting \w+:// are not supported; '
                     'use a local path or gs://'):
    fileio.exists(path)


def test_the_supported_schemes():
  assert fileio.SCHEMES == ('gs', 'ram')
  assert fileio.is_remote('gs://bucket/run') and fileio.is_remote('ram://x/y')
  assert not fileio.is_remote('/tmp/run') and not fileio.is_remote('run')
