"""Tensor files that know nothing of BERT: safetensors, PyTorch pickles, sharded indexes.

Each reader returns {tensor name: numpy array} and reports a file it cannot read as a
`UserError` naming the file. `pretrained.py` maps the names onto BERT's parameters.

- `read_safetensors`: safetensors, bfloat16 included (through ml_dtypes).
- `read_torch`: a `torch.save` zip archive, without torch: an unpickler that rebuilds tensors
  as strided views of their storages and refuses every other class; a legacy (pre-zip) file
  needs torch.
- `read_sharded`: the shards of a `*.index.json` (weight_map), each read with a reader above.
"""

import collections
import json
import os
import pickle
import struct
import zipfile

import ml_dtypes
import numpy as np
import safetensors.numpy

from bert_jax.errors import UserError


def preview(names, n: int = 8) -> str:
  """Up to `n` of `names`, sorted, for a message (with how many more there are)."""
  names = sorted(names)
  more = f' (and {len(names) - n} more)' if len(names) > n else ''
  return ', '.join(names[:n]) + more


_SAFETENSORS_DTYPES = {
    'F64': np.float64, 'F32': np.float32, 'F16': np.float16, 'BF16': ml_dtypes.bfloat16,
    'I64': np.int64, 'I32': np.int32, 'I16': np.int16, 'I8': np.int8, 'U8': np.uint8,
    'BOOL': np.bool_}


def read_safetensors(path: str) -> dict[str, np.ndarray]:
  try:
    return safetensors.numpy.load_file(path)
  except TypeError:
    pass  # numpy has no bfloat16: read the (simple) format ourselves, with ml_dtypes.
  except Exception as e:  # SafetensorError and friends.
    raise UserError(f'{path}: not a readable safetensors file: {e}') from e
  with open(path, 'rb') as f:
    (header_len,) = struct.unpack('<Q', f.read(8))
    header = json.loads(f.read(header_len))
    data = f.read()
  out = {}
  for name, info in header.items():
    if name != '__metadata__':
      if info['dtype'] not in _SAFETENSORS_DTYPES:
        raise UserError(f'{path}: tensor {name!r} has unsupported dtype {info["dtype"]}')
      begin, end = info['data_offsets']
      dtype = np.dtype(_SAFETENSORS_DTYPES[info['dtype']]).newbyteorder('<')
      out[name] = np.frombuffer(data[begin:end], dtype).reshape(info['shape']).copy()
  return out


# PyTorch storage classes -> element types. A storage is a flat buffer; tensors are views of it.
_TORCH_STORAGES = {
    'DoubleStorage': np.float64, 'FloatStorage': np.float32, 'HalfStorage': np.float16,
    'BFloat16Storage': ml_dtypes.bfloat16, 'LongStorage': np.int64, 'IntStorage': np.int32,
    'ShortStorage': np.int16, 'CharStorage': np.int8, 'ByteStorage': np.uint8,
    'BoolStorage': np.bool_, 'UntypedStorage': np.uint8}


class _StorageType:

  def __init__(self, dtype):
    self.dtype = np.dtype(dtype)


def _rebuild_tensor(storage: np.ndarray, offset: int, size, stride, *unused) -> np.ndarray:
  """torch._utils._rebuild_tensor_v2: a strided view of a storage, copied out."""
  size, stride = tuple(size), tuple(stride)
  if len(size) != len(stride) or min(stride, default=0) < 0 or offset < 0:
    raise pickle.UnpicklingError(f'bad tensor layout: size {size}, stride {stride}')
  if 0 in size:
    return np.zeros(size, storage.dtype)
  # as_strided does not check bounds: a corrupt file must not read past the buffer.
  if offset + sum((n - 1) * s for n, s in zip(size, stride)) >= storage.size:
    raise pickle.UnpicklingError(f'tensor view (offset {offset}, size {size}, stride {stride}) '
                                 f'exceeds its storage of {storage.size} elements')
  item = storage.itemsize
  return np.lib.stride_tricks.as_strided(
      storage[offset:], size, [s * item for s in stride], writeable=False).copy()


def _rebuild_parameter(data: np.ndarray, *unused) -> np.ndarray:
  return data


class _TorchUnpickler(pickle.Unpickler):
  """Rebuilds the tensors of a torch.save zip archive as numpy arrays; refuses anything else."""

  def __init__(self, file, archive: zipfile.ZipFile, root: str, big_endian: bool, source: str):
    super().__init__(file)
    self._archive, self._root, self._big_endian, self._source = (archive, root, big_endian,
                                                                 source)
    self._storages = {}

  def find_class(self, module, name):
    if (module, name) == ('collections', 'OrderedDict'):
      return collections.OrderedDict
    if module == 'torch._utils' and name in ('_rebuild_tensor_v2', '_rebuild_tensor'):
      return _rebuild_tensor
    if module == 'torch._utils' and name == '_rebuild_parameter':
      return _rebuild_parameter
    if module == 'torch' and name in _TORCH_STORAGES:
      return _StorageType(_TORCH_STORAGES[name])
    raise pickle.UnpicklingError(
        f'{self._source}: refusing to load {module}.{name}: only tensors are read from PyTorch '
        'files (save a plain state dict, or convert the checkpoint to safetensors)')

  def persistent_load(self, pid):
    if not (isinstance(pid, tuple) and len(pid) >= 5 and pid[0] == 'storage' and
            isinstance(pid[1], _StorageType)):
      raise pickle.UnpicklingError(f'{self._source}: unknown persistent id {pid!r:.80}')
    _, storage_type, key, _, numel = pid[:5]
    dtype = storage_type.dtype
    if (key, dtype) not in self._storages:
      try:
        data = self._archive.read(f'{self._root}/data/{key}')
      except KeyError as e:
        raise pickle.UnpicklingError(f'{self._source}: storage {key} is missing') from e
      array = np.frombuffer(data, dtype.newbyteorder('>') if self._big_endian else dtype)
      if array.size < numel:
        raise pickle.UnpicklingError(f'{self._source}: storage {key} holds {array.size} '
                                     f'elements, {numel} expected')
      self._storages[(key, dtype)] = array.astype(dtype, copy=False)
    return self._storages[(key, dtype)]


def read_torch(path: str) -> dict[str, np.ndarray]:
  """A PyTorch state dict file as numpy arrays, without torch when it is the zip format."""
  if not zipfile.is_zipfile(path):
    return _read_torch_legacy(path)
  with zipfile.ZipFile(path) as archive:
    pickles = [n for n in archive.namelist() if n.endswith('data.pkl')]
    if len(pickles) != 1:
      raise UserError(f'{path}: not a torch.save archive (found {len(pickles)} data.pkl)')
    root = os.path.dirname(pickles[0])
    byteorder = f'{root}/byteorder'
    big_endian = (byteorder in archive.namelist() and
                  archive.read(byteorder).strip() == b'big')
    with archive.open(pickles[0]) as f:
      try:
        state = _TorchUnpickler(f, archive, root, big_endian, path).load()
      except (pickle.UnpicklingError, EOFError, ValueError, TypeError) as e:
        raise UserError(f'{path}: cannot read PyTorch file: {e}') from e
  if not isinstance(state, dict) or not all(isinstance(v, np.ndarray) for v in state.values()):
    raise UserError(f'{path}: does not hold a state dict of tensors')
  return dict(state)


def _read_torch_legacy(path: str) -> dict[str, np.ndarray]:
  try:
    import torch  # pylint: disable=g-import-not-at-top
  except ImportError:
    torch = None
  if torch is None:
    raise UserError(f'{path} is a legacy (pre-zip) PyTorch file, which needs torch to read; '
                    'install torch or convert it to model.safetensors')
  state = torch.load(path, map_location='cpu', weights_only=True)
  return {k: (v.float() if v.is_floating_point() else v).numpy() for k, v in state.items()}


def read_sharded(index_file: str, read) -> dict[str, np.ndarray]:
  try:
    with open(index_file, encoding='utf-8') as f:
      index = json.load(f)
  except (json.JSONDecodeError, UnicodeDecodeError) as e:  # Cut short in a download, say.
    raise UserError(f'{index_file}: not valid JSON ({e}); download it again') from None
  weight_map = index.get('weight_map') if isinstance(index, dict) else None
  if not isinstance(weight_map, dict):
    raise UserError(f'{index_file}: no weight_map')
  tensors = {}
  for shard in sorted(set(weight_map.values())):
    part = read(os.path.join(os.path.dirname(index_file), shard))
    twice = set(part) & set(tensors)
    if twice:
      raise UserError(f'{index_file}: tensors in more than one shard: {preview(twice)}')
    tensors.update(part)
  missing = set(weight_map) - set(tensors)
  if missing:
    raise UserError(f'{index_file}: tensors listed but not in their shards: '
                    f'{preview(missing)}')
  return tensors
