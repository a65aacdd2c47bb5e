"""PyTorch references that one stack computes and another compares against.

The reference tests compare bert_jax with transformers' PyTorch BERT. Where torch is not
installed (the current stack of .ci/run: the registry's torch for Python 3.12 is the CUDA
build), they compare against what the same test recorded on a stack that has torch.

`BERT_JAX_TORCH_REFERENCES` names a folder. With torch installed, a reference is computed
and, when the variable is set, also written there as NAME.npz: its outputs, the files it
wrote (checkpoints) and a hash of the test module that made it. Without torch, a set variable
means the reference is read from there, and a missing or stale recording fails the test; with
the variable unset, the test is skipped.
"""

import hashlib
import importlib.util
import inspect
import os
from typing import Callable

import numpy as np
import pytest

ENV = 'BERT_JAX_TORCH_REFERENCES'
# Decided once: some tests hide torch (sys.modules['torch'] = None) to test readers without it.
HAVE_TORCH = importlib.util.find_spec('torch') is not None
_FILE, _OUT, _META = 'file:', 'out:', 'meta:'


def reference(name: str, folder, make: Callable[[str], dict]) -> dict[str, np.ndarray]:
  """`make(folder)`'s outputs, computed with torch or read from a recording.

  Args:
    name: unique among all references (the recording's file name).
    folder: an empty folder for the files `make` writes; a recording's files are put there.
    make: imports torch, may write files into `folder`, returns a dict of arrays.

  Returns:
    The dict `make` returned, as numpy arrays.
  """
  folder = str(folder)
  os.makedirs(folder, exist_ok=True)
  root = os.environ.get(ENV)
  path = os.path.join(root, f'{name}.npz') if root else None
  digest = _digest(make)
  if HAVE_TORCH:
    outputs = {k: np.asarray(v) for k, v in make(folder).items()}
    if path:
      _write(path, folder, outputs, digest)
    return outputs
  if not path:
    pytest.skip(f'torch is not installed and {ENV} names no recorded references')
  if not os.path.exists(path):
    pytest.fail(f'{path}: no recorded torch reference {name!r}; record it by running this test '
                f'where torch is installed, with {ENV}={root}', pytrace=False)
  return _read(path, folder, digest)


def _digest(make: Callable) -> str:
  """Hash of the file that defines `make`: a recording made by other test code is stale."""
  with open(inspect.getsourcefile(make), 'rb') as f:
    return hashlib.sha256(f.read()).hexdigest()


def _write(path: str, folder: str, outputs: dict, digest: str) -> None:
  arrays = {_OUT + k: v for k, v in outputs.items()}
  for parent, _, names in os.walk(folder):
    for n in names:
      full = os.path.join(parent, n)
      with open(full, 'rb') as f:
        arrays[_FILE + os.path.relpath(full, folder)] = np.frombuffer(f.read(), np.uint8)
  arrays[_META + 'digest'] = np.array(digest)
  # Written whole, then renamed: test workers may record the same reference at once.
  tmp = f'{path}.{os.getpid()}.tmp'
  with open(tmp, 'wb') as f:
    np.savez(f, **arrays)
  os.replace(tmp, path)


def _read(path: str, folder: str, digest: str) -> dict[str, np.ndarray]:
  with np.load(path, allow_pickle=False) as data:
    recorded = {k: data[k] for k in data.files}
  if str(recorded[_META + 'digest']) != digest:
    pytest.fail(f'{path} was recorded by another version of this test module: record it again '
                f'where torch is installed', pytrace=False)
  for key, value in recorded.items():
    if key.startswith(_FILE):
      full = os.path.join(folder, key[len(_FILE):])
      os.makedirs(os.path.dirname(full), exist_ok=True)
      with open(full, 'wb') as f:
        f.write(value.tobytes())
  return {k[len(_OUT):]: v for k, v in recorded.items() if k.startswith(_OUT)}
