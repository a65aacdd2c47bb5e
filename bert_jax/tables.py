"""Corpora in tables: Parquet files and Hugging Face datasets' Arrow files, read in chunks of rows.

A row is a document, its text in one column (data.text_column); `documents.py` splits it into
sentences and pieces as it does a TFDS article. This module plans and reads the rows:

  *.parquet                Parquet files, local or any tf.io.gfile path (gs://), read with pyarrow
                           (the `parquet` extra); hf://datasets/... names resolve to Parquet files
                           in the Hub cache (`hub.dataset_files`).
  a saved dataset folder   what `datasets.Dataset.save_to_disk` wrote (dataset_info.json,
                           state.json, data-*.arrow): its Arrow files, memory-mapped by
                           `datasets.Dataset.from_file` (the `datasets` extra); *.arrow files too.

Exact resume: a chunk is a run of rows of one Parquet row group (or of one Arrow file), and the
tf.data graph iterates over chunk indices (`Plan.texts`: a Dataset.range per file), each read by
a NumPy function of the index alone. A saved iterator position (which chunk comes next, and the
pieces of the current one not yet consumed) therefore means the same rows after a restore, as a
text file's line position does. The reader keeps each row group's Parquet reader open between
consecutive chunks, so a pass reads every row group once; after a restore it skips to the chunk.

Memory: a chunk holds about CHUNK_BYTES of text (its row count from the file's metadata: the
column's uncompressed size per row of the row group), and at most MAX_CHUNK_ROWS rows, so what a
chunk costs is bounded like a batch of TFDS articles; Arrow files are memory-mapped.
"""

import dataclasses
import io
import os
import threading

import numpy as np
import tensorflow as tf

from bert_jax import errors
from bert_jax import fileio
from bert_jax.errors import UserError

CHUNK_BYTES = 1 << 20
MAX_CHUNK_ROWS = 256


def is_table_file(path: str) -> bool:
  return path.endswith('.parquet') or path.endswith('.arrow')


def is_saved_dataset(path: str) -> bool:
  """Whether `path` is a folder `datasets.save_to_disk` wrote (a Dataset or a DatasetDict)."""
  return (not fileio.is_remote(path) and os.path.isdir(path) and
          (os.path.isfile(os.path.join(path, 'state.json')) or
           os.path.isfile(os.path.join(path, 'dataset_dict.json'))))


def _pyarrow():
  return errors.require('pyarrow.parquet', 'parquet', 'Parquet corpora (*.parquet)')


def _datasets():
  return errors.require('datasets', 'datasets', 'Hugging Face datasets saved with save_to_disk')


def saved_dataset_files(folder: str, flag: str) -> list[str]:
  """The Arrow files of a dataset folder `save_to_disk` wrote, in its order."""
  if os.path.isfile(os.path.join(folder, 'dataset_dict.json')):
    splits = sorted(d for d in os.listdir(folder) if os.path.isdir(os.path.join(folder, d)))
    raise UserError(f'{flag}: {folder} holds the splits {", ".join(splits)} of a DatasetDict; '
                    f'name one ({os.path.join(folder, splits[0] if splits else "train")})')
  dataset = _datasets().load_from_disk(folder)
  return [f['filename'] for f in dataset.cache_files]


def _open_parquet(path: str):
  pq = _pyarrow()
  if not fileio.is_remote(path):
    return pq.ParquetFile(path)
  import pyarrow as pa  # pylint: disable=g-import-not-at-top
  # Any tf.io.gfile file system (gs://), as text inputs are read: reads of byte ranges.
  return pq.ParquetFile(pa.PythonFile(_SeekableGFile(fileio.gfile().GFile(path, 'rb')), 'r'))


class _SeekableGFile(io.RawIOBase):
  """A tf.io.gfile file as the binary file object pyarrow wraps (GFile lacks `closed`,
  `readinto` and friends)."""

  def __init__(self, f):
    super().__init__()
    self._f = f

  def readable(self) -> bool:
    return True

  def seekable(self) -> bool:
    return True

  def readinto(self, buffer) -> int:
    data = self._f.read(len(buffer))
    buffer[:len(data)] = data
    return len(data)

  def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
    self._f.seek(offset, whence)
    return self._f.tell()

  def tell(self) -> int:
    return self._f.tell()

  def close(self) -> None:
    self._f.close()
    super().close()


def _text_field(schema, column: str, path: str, setting: str):
  import pyarrow as pa  # pylint: disable=g-import-not-at-top
  if column not in schema.names:
    raise UserError(f'{setting}text_column={column!r} is not a column of {path}: its columns are '
                    f'{", ".join(schema.names)}')
  kind = schema.field(column).type
  if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or
          pa.types.is_string_view(kind)):
    raise UserError(f'{setting}text_column={column!r} of {path} holds {kind}, not text')


@dataclasses.dataclass
class Plan:
  """Every chunk of a list of table files: chunk i is rows [start, start + rows) of row group
  `group` of file `file`; file f's chunks are [file_begin[f], file_end[f])."""
  files: list[str]
  column: str
  chunk_file: np.ndarray
  chunk_group: np.ndarray
  chunk_start: np.ndarray
  chunk_rows: np.ndarray
  file_begin: np.ndarray
  file_end: np.ndarray

  def texts(self, file_index: tf.Tensor) -> tf.data.Dataset:
    """The texts of file `file_index`'s rows, a [rows] tf.string batch per chunk, in order."""
    reader = _Reader(self)
    begin = tf.gather(tf.constant(self.file_begin), file_index)
    end = tf.gather(tf.constant(self.file_end), file_index)

    @tf.autograph.experimental.do_not_convert  # Graph as written (documents.as_written).
    def read(i):
      texts = tf.numpy_function(reader.read, [i], tf.string, stateful=False)
      return tf.ensure_shape(texts, [None])

    return tf.data.Dataset.range(begin, end).map(read)


def _chunks_of(rows: int, size: int) -> list[tuple[int, int]]:
  """(start, rows) of the chunks of `rows` rows of `size` bytes of text in all."""
  per_chunk = int(np.clip(CHUNK_BYTES * rows // max(size, 1), 1, MAX_CHUNK_ROWS))
  return [(start, min(per_chunk, rows - start)) for start in range(0, rows, per_chunk)]


def plan(files: list[str], column: str, setting: str = 'data.') -> Plan:
  """The chunks of `files` (Parquet or Arrow), from their metadata; a missing or non-text
  column is a UserError naming `setting`text_column and the file."""
  chunk_file, chunk_group, chunk_start, chunk_rows, begin, end = [], [], [], [], [], []
  for f, path in enumerate(files):
    begin.append(len(chunk_file))
    if path.endswith('.arrow'):
      table = _datasets().Dataset.from_file(path).data
      _text_field(table.schema, column, path, setting)
      groups = [(table.num_rows, table.column(column).nbytes)]
    else:
      _pyarrow()  # A missing extra is its own line, not a damaged file.
      try:
        parquet = _open_parquet(path)
      except Exception as e:  # pyarrow raises ArrowInvalid, OSError, ... for a damaged file.
        raise UserError(f'{setting}input: {path} is not a readable Parquet file ({e})') from e
      _text_field(parquet.schema_arrow, column, path, setting)
      meta = parquet.metadata
      leaf = next(i for i in range(meta.num_columns)
                  if meta.schema.column(i).path.split('.')[0] == column)
      groups = [(meta.row_group(g).num_rows, meta.row_group(g).column(leaf).total_uncompressed_size)
                for g in range(meta.num_row_groups)]
    for g, (rows, size) in enumerate(groups):
      for start, n in _chunks_of(rows, size):
        chunk_file.append(f)
        chunk_group.append(g)
        chunk_start.append(start)
        chunk_rows.append(n)
    end.append(len(chunk_file))
  as_array = lambda x: np.asarray(x, np.int64)
  return Plan(list(files), column, *map(as_array, (chunk_file, chunk_group, chunk_start,
                                                    chunk_rows, begin, end)))


class _GroupCursor:
  """Rows of one Parquet row group, handed out in order, `take(n)` at a time."""

  def __init__(self, path: str, group: int, column: str, batch_rows: int):
    self._batches = _open_parquet(path).iter_batches(
        batch_size=batch_rows, row_groups=[group], columns=[column], use_threads=False)
    self._pending = []
    self.position = 0

  def take(self, n: int):
    import pyarrow as pa  # pylint: disable=g-import-not-at-top
    out, have = [], 0
    while have < n:
      if not self._pending:
        self._pending = [next(self._batches).column(0)]
      piece = self._pending.pop()
      used = min(n - have, len(piece))
      out.append(piece.slice(0, used))
      if used < len(piece):
        self._pending.append(piece.slice(used))
      have += used
    self.position += n
    return pa.chunked_array(out)


class _Reader:
  """Reads chunk i of a plan: its rows' texts as bytes (a missing value is '')."""

  def __init__(self, plan_: Plan):
    self._plan = plan_
    self._lock = threading.Lock()
    self._cursors: dict[tuple[int, int], _GroupCursor] = {}
    self._arrow: dict[int, object] = {}

  def read(self, i) -> np.ndarray:
    import pyarrow as pa  # pylint: disable=g-import-not-at-top
    import pyarrow.compute as pc  # pylint: disable=g-import-not-at-top
    p = self._plan
    f, g, start, n = (int(x[i]) for x in (p.chunk_file, p.chunk_group, p.chunk_start,
                                          p.chunk_rows))
    path = p.files[f]
    with self._lock:
      if path.endswith('.arrow'):
        if f not in self._arrow:
          self._arrow[f] = _datasets().Dataset.from_file(path).data
        texts = self._arrow[f].slice(start, n).column(p.column)
      else:
        cursor = self._cursors.pop((f, g), None)
        if cursor is None or cursor.position != start:  # The first chunk, or after a restore.
          cursor = _GroupCursor(path, g, p.column, n)
          if start:
            cursor.take(start)
        texts = cursor.take(n)
        if not (i + 1 < len(p.chunk_file) and p.chunk_file[i + 1] == f and
                p.chunk_group[i + 1] == g):
          cursor = None  # The group's last chunk: its reader is closed.
        if cursor is not None:
          self._cursors[(f, g)] = cursor
    texts = pc.fill_null(texts.cast(pa.large_string()), '').cast(pa.large_binary())
    return np.asarray(texts.to_numpy(zero_copy_only=False), dtype=object)
