"""Recorded torch references: what a stack without torch compares against."""

import os

import numpy as np
import pytest

import torch_reference


def _make(folder):
  os.makedirs(os.path.join(folder, 'sub'))
  with open(os.path.join(folder, 'sub', 'weights.bin'), 'wb') as f:
    f.write(bytes(range(256)) * 3)
  return {'logits': np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4),
          'ids': np.arange(5)}


def _record(tmp_path, monkeypatch):
  monkeypatch.setenv(torch_reference.ENV, str(tmp_path / 'refs'))
  (tmp_path / 'refs').mkdir()
  monkeypatch.setattr(torch_reference, 'HAVE_TORCH', True)
  return torch_reference.reference('example', tmp_path / 'recorded', _make)


def test_replay_gives_the_recorded_outputs_and_files(tmp_path, monkeypatch):
  recorded = _record(tmp_path, monkeypatch)
  monkeypatch.setattr(torch_reference, 'HAVE_TORCH', False)
  calls = []
  replayed = torch_reference.reference('example', tmp_path / 'replayed',
                                       lambda folder: calls.append(folder))
  assert not calls  # Not computed again.
  assert sorted(replayed) == sorted(recorded) == ['ids', 'logits']
  for k, x in recorded.items():
    assert replayed[k].dtype == x.dtype
    np.testing.assert_array_equal(replayed[k], x)
  assert ((tmp_path / 'replayed' / 'sub' / 'weights.bin').read_bytes() ==
          (tmp_path / 'recorded' / 'sub' / 'weights.bin').read_bytes())
  assert not [n for n in os.listdir(tmp_path / 'refs') if n != 'example.npz']


def test_without_torch_or_recording(tmp_path, monkeypatch):
  monkeypatch.setattr(torch_reference, 'HAVE_TORCH', False)
  monkeypatch.delenv(torch_reference.ENV, raising=False)
  with pytest.raises(pytest.skip.Exception, match='torch is not installed'):
    torch_reference.reference('example', tmp_path / 'a', _make)
  monkeypatch.setenv(torch_reference.ENV, str(tmp_path))
  with pytest.raises(pytest.fail.Exception, match=r"example\.npz: no recorded torch reference"):
    torch_reference.reference('example', tmp_path / 'b', _make)


def test_recording_of_other_test_code_is_stale(tmp_path, monkeypatch):
  _record(tmp_path, monkeypatch)
  monkeypatch.setattr(torch_reference, 'HAVE_TORCH', False)
  monkeypatch.setattr(torch_reference, '_digest', lambda make: 'edited')
  with pytest.raises(pytest.fail.Exception, match='another version of this test module'):
    torch_reference.reference('example', tmp_path / 'replayed', _make)
