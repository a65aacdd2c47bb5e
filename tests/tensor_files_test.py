"""Readers of tensor files that know nothing of BERT: PyTorch archives without torch,
safetensors with bfloat16. The files are written by torch, or where it is not installed come
from a recording (tests/torch_reference.py)."""

import collections
import os
import pickle
import sys
import zipfile

import numpy as np
import pytest

from bert_jax import tensor_files
import torch_reference


def test_torch_reader_dtypes_and_views(tmp_path, monkeypatch):

  def make(folder):
    import torch  # pylint: disable=g-import-not-at-top
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    state = collections.OrderedDict(
        transposed=base.t(), sliced=base[1:3, 2:5], scalar=torch.tensor(2.5),
        half=torch.linspace(-2, 2, 7, dtype=torch.float16),
        bf16=torch.linspace(-1, 3, 9).bfloat16()[3:], ints=torch.arange(5),
        empty=torch.zeros(0, 3))
    torch.save(state, os.path.join(folder, 'state.bin'))
    return {k: (v.float() if v.is_floating_point() else v).numpy().copy()
            for k, v in state.items()}

  expected = torch_reference.reference('torch_archive_views', tmp_path, make)
  monkeypatch.setitem(sys.modules, 'torch', None)
  loaded = tensor_files.read_torch(str(tmp_path / 'state.bin'))
  assert sorted(loaded) == sorted(expected)
  for k, x in loaded.items():
    assert x.shape == expected[k].shape, k
    np.testing.assert_array_equal(x.astype(expected[k].dtype), expected[k], err_msg=k)
  assert loaded['half'].dtype == np.float16 and loaded['ints'].dtype == np.int64


def test_torch_reader_refuses_other_objects(tmp_path):
  path = str(tmp_path / 'evil.bin')
  with zipfile.ZipFile(path, 'w') as z:
    z.writestr('archive/data.pkl', pickle.dumps({'a': collections.Counter('ab')}, protocol=2))
  with pytest.raises(ValueError, match=r'refusing to load collections\.Counter'):
    tensor_files.read_torch(path)


def test_bfloat16_safetensors(tmp_path):

  def make(folder):
    import safetensors.torch  # pylint: disable=g-import-not-at-top
    import torch  # pylint: disable=g-import-not-at-top
    x = torch.linspace(-3, 3, 12).reshape(3, 4).bfloat16()
    safetensors.torch.save_file({'x': x, 'y': torch.ones(2)},
                                os.path.join(folder, 'bf16.safetensors'))
    return {'x': x.float().numpy()}

  x = torch_reference.reference('bfloat16_safetensors', tmp_path, make)['x']
  loaded = tensor_files.read_safetensors(str(tmp_path / 'bf16.safetensors'))
  np.testing.assert_array_equal(loaded['x'].astype(np.float32), x)
  np.testing.assert_array_equal(loaded['y'], np.ones(2, np.float32))
