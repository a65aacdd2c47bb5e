"""Streams of documents for pre-training: text files, TFDS articles, tables, the sample corpus.

A document is one tf.string, its sentences joined by '\\n', with an int64 id: a 62-bit hash of
its text (`document_ids`). The id decides the held-out evaluation share (id % 100 == 0) and,
when a process has no whole files of its own, which process reads the document, so both
splits are stable across epochs, file orders and process layouts.

Text files hold one sentence a line and a blank line between documents (the original format);
.gz files are decompressed. Lines are read in blocks and grouped by a `scan` that carries the
unfinished document, so no document spans two files and nothing leaves the tf.data graph.
Invalid UTF-8 becomes U+FFFD instead of failing; a local file that looks binary (a NUL byte
in its first 64 KB), or whose lines end with CR alone, is refused at start-up (`check_text`).

Memory is bounded by the config, not by the text: a document is streamed in pieces of whole
lines (a new piece at every PIECE_BYTES of its text; all carry the document's id) and a line
longer than LINE_BYTES is cut into several, so a book or a file without newlines costs what a
batch of ordinary documents does. The reader still holds one raw line (TextLineDataset) while
it is cut.

Tables (`tables.py`: Parquet files, local, gs:// or hf://datasets/...; a folder that
`datasets.save_to_disk` wrote) hold a document per row, in the column data.text_column; each is
split into sentences and pieces as a TFDS article is (`split_into_sentences`, `_in_pieces`).
"""

import difflib
import fnmatch
import functools
import gzip
import os
import re
import zlib

import ml_collections
import tensorflow as tf

from bert_jax import fileio
from bert_jax import hub
from bert_jax import sample_corpus
from bert_jax import tables
from bert_jax.errors import UserError

# One document in HOLDOUT_MODULUS (by id) is held out for evaluation.
HOLDOUT_MODULUS = 100
# Lines grouped into documents per step of a file's reader: per-element tf.data overhead is
# paid per block, not per line.
LINES_PER_READ = 1024
# A document is streamed in pieces of its lines, a new piece starting at every PIECE_BYTES of
# its text: what tokenizing and pairing a batch of documents holds is bounded by the config
# (data.docs_per_batch pieces), not by document length (a book is hundreds of KB).
PIECE_BYTES = 1 << 13
# A line longer than this (tables, code, CJK text, a file without newlines) is cut into lines
# of at most this many bytes before pairing, at whitespace where it can be.
LINE_BYTES = 1 << 12
_CUT_LOOKBACK = 256
_ID_BUCKETS = 2**62
# A sentence ends at . ! ? (and closing quotes or brackets) followed by whitespace.
_SENTENCE_BREAK = r'([.!?][\"\'\)\]\x{201D}\x{2019}\x{00BB}]*)[ \t\r\f\v]+'
# The input's tf.data functions are written as graphs (tf.cond and tf.where, no Python control
# flow over tensors), so AutoGraph's rewrite of each function tf.data is given (parsing its
# module's source) only costs time: about 1.2 s of a CPU in every process that builds an input.
as_written = tf.autograph.experimental.do_not_convert


def input_kind(spec: str) -> str:
  """'sample', 'tfds', 'tfrecord' (every path names *.tfrecord*), 'table' (every path names
  *.parquet or *.arrow files, Hub dataset files or a saved dataset folder) or 'text'."""
  if spec == 'sample':
    return 'sample'
  if spec.startswith('tfds:'):
    return 'tfds'
  patterns = _split_spec(spec)
  if all(re.search(r'\.tfrecords?(\b|$)', p) for p in patterns):
    return 'tfrecord'
  table = [hub.is_hub(p) or tables.is_table_file(p) or tables.is_saved_dataset(p)
           for p in patterns]
  if all(table):
    return 'table'
  if any(table):
    raise UserError(f'{spec!r} mixes tables (Parquet, Arrow, hf://datasets/) with other files; '
                    'give one kind')
  return 'text'


def _split_spec(spec: str) -> list[str]:
  """The paths or globs of a comma-separated spec, with a leading ~ expanded as --workdir's is
  (the shell leaves `--config.data.input=~/x` as it is)."""
  return [os.path.expanduser(p.strip()) for p in spec.split(',') if p.strip()]


def check_not_matched(spec: str, flag: str, written: list[str]) -> None:
  """Refuses an input spec whose paths or globs match a file a run writes (`written`: the
  workdir's vocab.txt, config.json, ...): the next run would read its own output as data."""
  for pattern in _split_spec(spec):
    if input_kind(pattern) == 'tfds' or hub.is_hub(pattern):
      continue
    for path in written:
      if fileio.is_remote(pattern) != fileio.is_remote(path):
        continue
      full = pattern if fileio.is_remote(pattern) else os.path.abspath(pattern)
      target = path if fileio.is_remote(path) else os.path.abspath(path)
      # As a glob matches: part by part ('*' does not cross '/').
      parts, pattern_parts = target.split('/'), full.split('/')
      if len(parts) == len(pattern_parts) and all(
          fnmatch.fnmatchcase(p, q) for p, q in zip(parts, pattern_parts)):
        raise UserError(f'{flag}: {pattern!r} also matches {path}, which this run writes: its '
                        'next read would take it as data; use a --workdir outside the input '
                        'folder')


def expand_files(spec: str, flag: str = 'data.input') -> list[str]:
  """Files of comma-separated paths or globs, each pattern sorted; errors name the pattern."""
  patterns = _split_spec(spec)
  if not patterns:
    raise UserError(f'{flag} is empty')
  text = input_kind(spec) == 'text'
  files = []
  for pattern in patterns:
    if hub.is_hub(pattern):  # Parquet files of a Hub dataset, fetched into the Hub cache.
      files += [path for path, _ in hub.dataset_files(pattern, flag)]
      continue
    if tables.is_saved_dataset(pattern):
      files += tables.saved_dataset_files(pattern, flag)
      continue
    fileio.check_bucket(pattern, flag)
    # A file that exists as written is that file, though its name has glob characters
    # ('[', ']', '*', '?'): 'run[1].txt' would otherwise match only 'run1.txt'.
    matched = [pattern] if tf.io.gfile.exists(pattern) else sorted(tf.io.gfile.glob(pattern))
    if not matched:
      raise UserError(f'{flag}: {pattern!r} matches no file')
    for path in matched:
      if tf.io.gfile.isdir(path):
        raise UserError(f'{flag}: {path} is a directory; name the files in it (for example '
                        f'{path.rstrip("/")}/*.txt)')
      fileio.check_readable(path, flag)  # Not in tf.data's first batch, as a traceback.
      if path.endswith('.gz'):
        check_gzip(path, flag)
      if text:
        check_text(path, flag)
    files += matched
  return files


_SNIFF_BYTES = 1 << 16


def check_text(path: str, flag: str) -> None:
  """Raises a UserError naming the file if a local text input looks binary: a NUL byte in its
  first 64 KB (decompressed for .gz), which text has not. Invalid UTF-8 alone is text in another
  encoding, read with U+FFFD in place of the bad bytes."""
  if fileio.is_remote(path):
    return  # A request per file at start-up; tf.data reads it anyway.
  with open(path, 'rb') as raw:
    head = (gzip.GzipFile(fileobj=raw).read(_SNIFF_BYTES) if path.endswith('.gz')
            else raw.read(_SNIFF_BYTES))
  if b'\0' not in head:
    # TextLineDataset drops every CR: CR-only line ends (classic Mac OS) would run a whole
    # file into one line, and its documents into one.
    if re.search(b'\r(?!\n)', head[:-1]) and b'\n' not in head:
      raise UserError(f'{flag}: {path} ends its lines with CR alone (classic Mac OS), which '
                      f"reads as one line; convert them to LF: tr '\\r' '\\n' < {path} > {path}.lf")
    return
  if head[:2] in (b'\xff\xfe', b'\xfe\xff'):
    raise UserError(f'{flag}: {path} is UTF-16 text: save it as UTF-8')
  raise UserError(f'{flag}: {path} looks binary, not text (a NUL byte at byte '
                  f'{head.index(0)}{" of its decompressed data" if path.endswith(".gz") else ""}'
                  '); give text files (a sentence a line), TFRecords (*.tfrecord) or tfds:NAME')


# Gzip files already read to their end in this process: (path, size, mtime) -> None.
_GZIP_CHECKED: set[tuple[str, int, int]] = set()


class _Trickle:
  """A binary file read as it is up to byte `slow_from`, then a byte per read of compressed
  data (gzip's small header and trailer reads are served whole): a decompressor reading through
  it fails with `tell()` just past the byte that it cannot decode."""

  def __init__(self, f, slow_from: int):
    self._f, self._slow_from, self._pos = f, slow_from, 0

  def read(self, size: int = -1) -> bytes:
    if self._pos >= self._slow_from:
      size = 1 if size < 0 or size > 16 else size
    elif size < 0 or self._pos + size > self._slow_from:
      size = self._slow_from - self._pos
    data = self._f.read(size)
    self._pos += len(data)
    return data

  def tell(self) -> int:
    return self._pos


def _read_gzip(raw) -> None:
  with gzip.GzipFile(fileobj=raw, mode='rb') as f:
    while f.read(1 << 22):
      pass


def check_gzip(path: str, flag: str) -> None:
  """Reads a .gz file to its end: a damaged or truncated one is a UserError naming the file
  and the byte where decompression fails.

  tf.data's GZIP reader stops at the damage without an error (training would silently run on
  part of the corpus), so every .gz input is decompressed once at start-up (and remembered).
  """
  stat = tf.io.gfile.stat(path)
  key = (path, stat.length, stat.mtime_nsec)
  if key in _GZIP_CHECKED:
    return
  with tf.io.gfile.GFile(path, 'rb') as raw:
    try:
      _read_gzip(raw)
    except (EOFError, gzip.BadGzipFile, zlib.error) as e:
      if isinstance(e, EOFError):
        problem = (f'is truncated: its compressed data stops unfinished at byte {stat.length}, '
                   'the end of the file')
      elif isinstance(e, gzip.BadGzipFile) and raw.tell() <= 10:
        problem = 'is not gzip data, though its name ends in .gz'
      else:
        # The fast read failed somewhere in its last buffer: read again, a byte at a time
        # from well before it, to name the byte.
        with tf.io.gfile.GFile(path, 'rb') as again:
          trickle = _Trickle(again, max(0, raw.tell() - (1 << 20)))
          try:
            _read_gzip(trickle)
          except (EOFError, gzip.BadGzipFile, zlib.error):
            pass
        if 'CRC check failed' in str(e) or 'incorrect data check' in str(e):
          # Deflate data damaged in a way that still decodes shows only at the checksum.
          problem = (f'is damaged: the gzip member that ends at compressed byte '
                     f'{trickle.tell()} (of {stat.length}) does not match its checksum')
        else:
          problem = f'is damaged at compressed byte {trickle.tell() - 1} of {stat.length} ({e})'
      raise UserError(f'{flag}: {path} {problem}; copy it again, or decompress what is left '
                      '(tf.data would silently stop at the damage)') from e
  _GZIP_CHECKED.add(key)


def resolve_files(spec: str, flag: str = 'data.input') -> list[str]:
  """expand_files, with 'sample' standing for the built-in corpus."""
  if spec == 'sample':
    return [sample_corpus.sample_corpus_path()]
  return expand_files(spec, flag)


def file_identities(spec: str, flag: str = 'data.input') -> list[list]:
  """[name, size, modification time] of each file of an input: what a saved input position
  is valid for. A Hub dataset's files are named by their commit (hf://datasets/ORG/NAME@COMMIT/
  PATH, time 0): the same files wherever the Hub cache puts them."""
  out = []
  for pattern in ([spec] if spec == 'sample' else _split_spec(spec)):
    if hub.is_hub(pattern):
      out += [[name, int(os.path.getsize(path)), 0]
              for path, name in hub.dataset_files(pattern, flag)]
      continue
    for path in resolve_files(pattern, flag):
      stat = tf.io.gfile.stat(path)
      out.append([path, int(stat.length), int(stat.mtime_nsec)])
  return out


def fix_utf8(text: tf.Tensor) -> tf.Tensor:
  """Invalid UTF-8 becomes U+FFFD (which the tokenizer's clean-up drops), never an error."""
  # Checking is ~10x cheaper than transcoding, and nearly all text is valid.
  valid = tf.reduce_all(tf.strings.regex_full_match(text, '(?s).*'))
  return tf.cond(valid, lambda: text, lambda: tf.strings.unicode_transcode(
      text, 'UTF-8', 'UTF-8', errors='replace', replace_control_characters=False))


def document_ids(texts: tf.Tensor) -> tf.Tensor:
  """The int64 id of each text: a hash, so equal texts are the same document."""
  return tf.strings.to_hash_bucket_fast(texts, _ID_BUCKETS)


def held_out(ids: tf.Tensor) -> tf.Tensor:
  return tf.equal(ids % HOLDOUT_MODULUS, 0)


def selector(holdout: bool | None, shard: tuple[int, int] | None = None):
  """keep(ids) -> bool: the held-out share (True), the rest (False) or all (None); and, with
  shard=(index, count), only process `index`'s share."""
  def keep(ids):
    selected = tf.ones_like(ids, tf.bool)
    if holdout is not None:
      selected &= tf.equal(held_out(ids), holdout)
    if shard is not None:
      index, count = shard
      # Bits above those of the held-out test, so both splits stay independent.
      selected &= tf.equal((ids // 1024) % count, index)
    return selected
  return keep


def _select(texts: tf.Tensor, keep) -> dict[str, tf.Tensor]:
  """Documents [N] -> {'text', 'id', 'cut'} of those `keep` accepts (vectorized: no per-doc
  call)."""
  return _select_pieces(texts, document_ids(texts), tf.zeros_like(texts, tf.int64), keep)


def _select_pieces(texts: tf.Tensor, ids: tf.Tensor, cut: tf.Tensor,
                   keep) -> dict[str, tf.Tensor]:
  selected = keep(ids) & tf.not_equal(texts, '')
  return {'text': tf.boolean_mask(texts, selected), 'id': tf.boolean_mask(ids, selected),
          'cut': tf.boolean_mask(cut, selected)}


def _cut_line(line: tf.Tensor) -> tf.Tensor:
  """A line of more than LINE_BYTES bytes -> lines of at most LINE_BYTES, each cut after the
  last whitespace of the _CUT_LOOKBACK bytes before its limit, or else before a character;
  whitespace at the cuts is dropped. Substrings of the scalar line: nothing is copied whole."""
  length = tf.strings.length(line)
  # Cuts move back by at most _CUT_LOOKBACK, so limits this far apart keep lines in bounds.
  step = LINE_BYTES - _CUT_LOOKBACK
  limits = tf.range(1, (length + step - 1) // step) * step
  window = tf.io.decode_raw(
      tf.strings.substr(line, limits - _CUT_LOOKBACK, tf.fill(tf.shape(limits), _CUT_LOOKBACK)),
      tf.uint8, fixed_length=_CUT_LOOKBACK)
  window = tf.reshape(tf.cast(window, tf.int32), [-1, _CUT_LOOKBACK])
  position = tf.range(_CUT_LOOKBACK)[None, :]
  space = (tf.equal(window, 32) | ((window >= 9) & (window <= 13)))
  last_space = tf.reduce_max(tf.where(space, position, -1), axis=1)
  # UTF-8 continuation bytes are 10xxxxxx; any other byte starts a character.
  starts_char = tf.not_equal(tf.bitwise.bitwise_and(window, 0xC0), 0x80)
  last_start = tf.reduce_max(tf.where(starts_char, position, 0), axis=1)
  cuts = limits - _CUT_LOOKBACK + tf.where(last_space >= 0, last_space + 1, last_start)
  begin = tf.concat([[0], cuts], 0)
  end = tf.concat([cuts, [length]], 0)
  return tf.strings.strip(tf.strings.substr(line, begin, end - begin))


def _split_lines(lines: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor, tf.Tensor]:
  """Lines read by TextLineDataset -> (lines, blank, cut, source): stripped, blank marked,
  and each line longer than LINE_BYTES cut into several (`_cut_line`); `cut` marks the first
  of the lines that each line cut became, `source` is the index of the line each came from."""
  lines = tf.strings.strip(fix_utf8(lines))  # A line of spaces is blank, as originally.
  long = tf.strings.length(lines) > LINE_BYTES
  long_index = tf.cast(tf.where(long)[:, 0], tf.int32)
  pieces = tf.map_fn(_cut_line, tf.boolean_mask(lines, long),
                     fn_output_signature=tf.RaggedTensorSpec([None], tf.string, 0, tf.int32))
  counts = tf.tensor_scatter_nd_update(tf.ones_like(long, tf.int32), long_index[:, None],
                                       pieces.row_lengths())
  begin = tf.cumsum(counts, exclusive=True)
  # Where each short line and each piece of a long line goes among the lines cut.
  target = tf.concat([tf.boolean_mask(begin, ~long),
                      (tf.gather(begin, long_index)[:, None] + tf.ragged.range(
                          pieces.row_lengths())).flat_values], 0)
  order = tf.math.invert_permutation(target)
  texts = tf.gather(tf.concat([tf.boolean_mask(lines, ~long), pieces.flat_values], 0), order)
  from_long = tf.repeat(long, counts)
  first_of_cut = tf.scatter_nd(tf.gather(begin, long_index)[:, None],
                               tf.ones_like(long_index, tf.int64), tf.shape(texts, tf.int32))
  blank = tf.equal(texts, '')
  # A piece that was only whitespace is dropped, not taken for a blank line (a line cut
  # never begins with one: it was stripped).
  kept = ~(from_long & blank)
  source = tf.repeat(tf.range(tf.size(counts)), counts)
  return tuple(tf.boolean_mask(t, kept) for t in (texts, blank, first_of_cut, source))


# The state of `_group_lines`' scan: (unfinished piece, its offset, its document's id, its cut
# lines).
_PIECE_STATE = (tf.TensorSpec([], tf.string), tf.TensorSpec([], tf.int64),
                tf.TensorSpec([], tf.int64), tf.TensorSpec([], tf.int64))


# A cached tf.function with a fixed signature for each selection, traced without AutoGraph (no
# Python control flow on tensors): traced by tf.data with each build, it took most of a text
# input's build (0.5 s of CPU); a build now takes 0.07 s once its selection was traced (0.6 s).
# The traced graph holds PIECE_BYTES, LINE_BYTES and _CUT_LOOKBACK as they were at its trace.
@functools.lru_cache(maxsize=16)
def _group_lines(holdout: bool | None, shard: tuple[int, int] | None):
  keep = selector(holdout, shard)

  @tf.function(autograph=False,
               input_signature=[_PIECE_STATE, tf.TensorSpec([None], tf.string)])
  def step(state, lines: tf.Tensor):
    """(unfinished piece, next lines) -> (unfinished piece, finished and kept pieces).

    The state is the unfinished piece's text, its byte offset in its document, the
    document's id (-1 until its first piece is finished) and how many cut lines it holds. A
    document's pieces are its lines whose offset falls in [k * PIECE_BYTES, (k + 1) *
    PIECE_BYTES): the same pieces whatever the read blocks are.
    """
    partial, partial_offset, partial_id, partial_cut = state
    lines, blank, cut, _ = _split_lines(lines)
    document_of_line = tf.cumsum(tf.cast(blank, tf.int32))
    last_document = document_of_line[-1]
    texts = tf.concat([[partial], tf.boolean_mask(lines, ~blank)], 0)
    document = tf.concat([[0], tf.boolean_mask(document_of_line, ~blank)], 0)
    cut = tf.concat([[partial_cut], tf.boolean_mask(cut, ~blank)], 0)
    size = tf.cast(tf.strings.length(texts), tf.int64) + 1  # With its '\n'.
    size = tf.concat([[tf.where(tf.equal(partial, ''), tf.constant(0, tf.int64), size[0])],
                      size[1:]], 0)
    num_documents = last_document + 1
    # Byte offset of each text in its document.
    running = tf.cumsum(size, exclusive=True)
    index = tf.range(tf.shape(texts)[0])
    first = tf.math.unsorted_segment_min(index, document, num_documents)
    offset = running - tf.gather(running, tf.gather(first, document))
    offset += tf.where(tf.equal(document, 0), partial_offset, 0)
    piece = offset // PIECE_BYTES
    starts = tf.concat([[True], tf.not_equal(document[1:], document[:-1]) |
                        tf.not_equal(piece[1:], piece[:-1])], 0)
    group = tf.cumsum(tf.cast(starts, tf.int32)) - 1
    num_groups = group[-1] + 1
    non_empty = tf.not_equal(texts, '')
    pieces = tf.strings.unsorted_segment_join(
        tf.boolean_mask(texts, non_empty), tf.boolean_mask(group, non_empty), num_groups,
        separator='\n')
    group_document = tf.math.unsorted_segment_max(document, group, num_groups)
    group_offset = tf.math.unsorted_segment_min(offset, group, num_groups)
    group_cut = tf.math.unsorted_segment_sum(cut, group, num_groups)
    # A document's id is the hash of its first piece (all of it, for most documents).
    first_group = tf.math.unsorted_segment_min(group, document, num_documents)
    known = tf.not_equal(partial_id, -1)
    ids = document_ids(tf.gather(pieces, tf.minimum(first_group, num_groups - 1)))  # Empty: any.
    ids = tf.tensor_scatter_nd_update(ids, [[0]], [tf.where(known, partial_id, ids[0])])
    piece_ids = tf.gather(ids, group_document)
    carried = tf.equal(group_document[-1], last_document)
    finished = num_groups - tf.cast(carried, tf.int32)
    first_is_carried = (tf.equal(tf.gather(first_group, last_document), num_groups - 1)
                        & ~(tf.equal(last_document, 0) & known))
    next_state = (
        tf.where(carried, pieces[-1], ''),
        tf.where(carried, group_offset[-1], tf.constant(0, tf.int64)),
        tf.where(carried & ~first_is_carried, tf.gather(ids, last_document),
                 tf.constant(-1, tf.int64)),
        tf.where(carried, group_cut[-1], tf.constant(0, tf.int64)))
    return next_state, _select_pieces(pieces[:finished], piece_ids[:finished],
                                      group_cut[:finished], keep)
  return step


def _text_file_reader(holdout: bool | None, shard: tuple[int, int] | None):
  @as_written
  def read(path: tf.Tensor) -> tf.data.Dataset:
    """Documents of one text file, in file order, in pieces."""
    compression = tf.where(tf.strings.regex_full_match(path, r'.*\.gz'), 'GZIP', '')
    lines = tf.data.TextLineDataset(path, compression_type=compression)
    lines = lines.concatenate(tf.data.Dataset.from_tensors(tf.constant('')))  # Ends the last.
    initial = (tf.constant(''), tf.constant(0, tf.int64), tf.constant(-1, tf.int64),
               tf.constant(0, tf.int64))
    return lines.batch(LINES_PER_READ).scan(initial, _group_lines(holdout, shard)).unbatch()
  return read


def text_documents(files: list[str], *, holdout: bool | None = None, shuffle_files: bool = False,
                   seed: int = 0, process_index: int = 0,
                   process_count: int = 1) -> tf.data.Dataset:
  """One pass over the documents of this process's share of `files`: {'text', 'id'}.

  Process i of n reads files i::n; with fewer files than processes, every process reads all
  files and keeps the documents whose id falls to it.
  """
  by_document = len(files) < process_count
  if not by_document:
    files = files[process_index::process_count]
  shard = (process_index, process_count) if by_document else None
  ds = tf.data.Dataset.from_tensor_slices(files)
  if shuffle_files and len(files) > 1:
    ds = ds.shuffle(len(files), seed=seed, reshuffle_each_iteration=True)
  return ds.interleave(_text_file_reader(holdout, shard), cycle_length=min(len(files), 16),
                       num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)


def split_into_sentences(text: tf.Tensor) -> tf.Tensor:
  """An article -> its sentences joined by '\\n': breaks after . ! ? + space, and at newlines."""
  text = tf.strings.regex_replace(fix_utf8(text), _SENTENCE_BREAK, '\\1\n')
  text = tf.strings.regex_replace(text, r'\s*\n\s*', '\n')
  return tf.strings.strip(text)


def parse_tfds(spec: str) -> tuple[str, str]:
  """'tfds:NAME[/CONFIG][:SPLIT]' -> (NAME[/CONFIG], SPLIT or 'train')."""
  name, _, split = spec[len('tfds:'):].partition(':')
  if not name:
    raise UserError(f'{spec!r}: expected tfds:NAME[/CONFIG][:SPLIT]')
  return name, split or 'train'


def tfds_documents(spec: str, data: ml_collections.ConfigDict, *, holdout: bool | None = None,
                   shuffle_files: bool = False, seed: int = 0, process_index: int = 0,
                   process_count: int = 1, setting: str = 'data.') -> tf.data.Dataset:
  """One pass over the articles of a TFDS split (feature data.tfds_text_key), as documents.

  Processes read disjoint even sub-splits; data.tfds_data_dir is the TFDS data_dir ('' = default).
  Errors name the settings as `setting` + key: config keys (`data.`), or `--` for the flags of
  `bert-jax vocab`.
  """
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  name, split = parse_tfds(spec)
  try:
    builder = tfds.builder(name, data_dir=data.tfds_data_dir or None)
  except tfds.core.registered.DatasetNotFoundError as e:
    close = difflib.get_close_matches(name.split('/')[0], tfds.list_builders(), n=1)
    raise UserError(f'{spec!r}: TFDS has no dataset {name!r}'
                    + (f' (did you mean {close[0]!r}?)' if close else '')) from e
  if not builder.is_prepared():
    raise UserError(f'{spec!r}: TFDS dataset {name} is not prepared in '
                    f'{data.tfds_data_dir or "the default TFDS data_dir"} (bert_jax never '
                    f'downloads): prepare it with `tfds build`, or set {setting}tfds_data_dir '
                    'to where it is')
  key = data.tfds_text_key
  features = builder.info.features
  if key not in features:
    raise UserError(f'{setting}tfds_text_key={key!r} is not a feature of {name}: '
                    f'{sorted(features.keys())}')
  if process_count > 1:
    split = tfds.even_splits(split, n=process_count, drop_remainder=False)[process_index]
  read_config = tfds.ReadConfig(shuffle_seed=seed, shuffle_reshuffle_each_iteration=True,
                                try_autocache=False)
  ds = builder.as_dataset(split=split, shuffle_files=shuffle_files, read_config=read_config)
  keep = selector(holdout)
  return ds.batch(256).map(
      as_written(lambda ex: _in_pieces(_select(split_into_sentences(ex[key]), keep))),
      num_parallel_calls=tf.data.AUTOTUNE, deterministic=True).unbatch()


def table_documents(files: list[str], column: str, *, holdout: bool | None = None,
                    shuffle_files: bool = False, seed: int = 0, process_index: int = 0,
                    process_count: int = 1, setting: str = 'data.') -> tf.data.Dataset:
  """One pass over the rows of tables (`tables.py`), a document each (text in `column`), as
  text_documents reads files: process i of n reads files i::n (with fewer files than
  processes, all of them, keeping the documents whose id falls to it), files interleaved."""
  by_document = len(files) < process_count
  if not by_document:
    files = files[process_index::process_count]
  keep = selector(holdout, (process_index, process_count) if by_document else None)
  chunks = tables.plan(files, column, setting)
  ds = tf.data.Dataset.range(len(files))
  if shuffle_files and len(files) > 1:
    ds = ds.shuffle(len(files), seed=seed, reshuffle_each_iteration=True)

  @as_written
  def read(file_index):
    return chunks.texts(file_index).map(
        as_written(lambda texts: _in_pieces(_select(split_into_sentences(texts), keep)))
    ).unbatch()

  return ds.interleave(read, cycle_length=min(len(files), 16),
                       num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)


def _in_pieces(docs: dict[str, tf.Tensor]) -> dict[str, tf.Tensor]:
  """Whole documents {'text', 'id', 'cut'} [N] -> their pieces, as text files give them
  (long lines cut, a new piece every PIECE_BYTES of a document), each with its document's id."""
  lines = tf.strings.split(docs['text'], '\n')
  texts, _, cut, source = _split_lines(lines.flat_values)
  document = tf.gather(tf.cast(lines.value_rowids(), tf.int32), source)
  size = tf.cast(tf.strings.length(texts), tf.int64) + 1
  running = tf.cumsum(size, exclusive=True)
  num_documents = tf.shape(docs['id'])[0]
  first = tf.math.unsorted_segment_min(tf.range(tf.shape(texts)[0]), document, num_documents)
  piece = (running - tf.gather(running, tf.gather(first, document))) // PIECE_BYTES
  starts = tf.concat([[True], tf.not_equal(document[1:], document[:-1]) |
                      tf.not_equal(piece[1:], piece[:-1])], 0)[:tf.shape(texts)[0]]
  group = tf.cumsum(tf.cast(starts, tf.int32)) - 1
  num_groups = tf.reduce_sum(tf.cast(starts, tf.int32))
  non_empty = tf.not_equal(texts, '')
  return {
      'text': tf.strings.unsorted_segment_join(
          tf.boolean_mask(texts, non_empty), tf.boolean_mask(group, non_empty), num_groups,
          separator='\n'),
      'id': tf.gather(docs['id'], tf.math.unsorted_segment_max(document, group, num_groups)),
      'cut': tf.math.unsorted_segment_sum(cut, group, num_groups),
  }


def documents(spec: str, flag: str, data: ml_collections.ConfigDict,
              **kwargs) -> tuple[tf.data.Dataset, str]:
  """(one pass over the documents of a text, sample or tfds input, its description)."""
  if input_kind(spec) == 'tfds':
    return tfds_documents(spec, data, **kwargs), f'{flag}={spec!r}'
  files = resolve_files(spec, flag)
  shown = files if len(files) <= 5 else files[:5] + ['...']
  described = f'{flag}={spec!r} ({len(files)} files: {shown})'
  if input_kind(spec) == 'table':
    return table_documents(files, data.text_column, **kwargs), described
  return text_documents(files, **kwargs), described


def require_element(ds: tf.data.Dataset, message: str) -> None:
  """Reads one element eagerly: an empty input fails here, not as a silent empty stream."""
  for _ in ds.take(1):
    return
  raise UserError(message)


# How many pieces (`PIECE_BYTES` of text each) `count_documents` reads at most: 16 MB.
LOOK_PIECES = 2048
# How much text `summarize` reads: the first 16 MB of an input (all of the sample corpus).
LOOK_BYTES = 16 << 20


def count_documents(ds: tf.data.Dataset, at_most: int = 2) -> tuple[int, bool]:
  """(distinct documents among the first LOOK_PIECES pieces of a stream, up to `at_most`;
  whether the stream ended within them): a bounded look at the start of an input."""
  seen = set()
  read = 0
  for batch in ds.take(LOOK_PIECES).batch(64).as_numpy_iterator():
    seen.update(batch['id'].tolist())
    read += len(batch['id'])
    if len(seen) >= at_most:
      return at_most, False
  return len(seen), read < LOOK_PIECES


def summarize(ds: tf.data.Dataset, at_most_bytes: int = LOOK_BYTES) -> dict[str, int]:
  """Counts over the first `at_most_bytes` of text of a document stream (whole pieces: the one
  that reaches it is the last): pieces, documents, the documents longer than a piece (streamed
  in several), the lines cut (over LINE_BYTES) and the bytes read."""
  pieces_of: dict[int, int] = {}
  cut = size = 0
  for batch in ds.batch(256).as_numpy_iterator():
    for i, text, piece_cut in zip(batch['id'].tolist(), batch['text'], batch['cut'].tolist()):
      if size >= at_most_bytes:
        break
      pieces_of[i] = pieces_of.get(i, 0) + 1
      cut += int(piece_cut)
      size += len(text)
    if size >= at_most_bytes:
      break
  return {'pieces': sum(pieces_of.values()), 'documents': len(pieces_of),
          'documents_in_pieces': sum(n > 1 for n in pieces_of.values()), 'lines_cut': cut,
          'bytes': size}


def text_lines(spec: str, data: ml_collections.ConfigDict, setting: str = 'data.'):
  """Python iterator over the sentences of an input (to train a vocabulary on); errors name
  the TFDS settings as `setting` + key (see tfds_documents)."""
  if input_kind(spec) == 'tfds':
    ds = tfds_documents(spec, data, setting=setting)
  elif input_kind(spec) == 'table':
    ds = table_documents(resolve_files(spec), data.text_column, setting=setting)
  else:
    ds = text_documents(resolve_files(spec))
  for doc in ds.as_numpy_iterator():
    yield from doc['text'].decode('utf-8', 'replace').split('\n')
