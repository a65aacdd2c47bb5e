"""BERT pre-training input: text, TFDS or TFRecords -> batches of masked sequences, in tf.data.

The whole pipeline is tf.data graph ops (no py_function, no generators), so an iterator's
position, shuffle buffers included, can be saved and restored exactly (`make_iterator`).

Text path, per process:
  documents (`documents.py`: files i::n of n processes, blank-line separated, held-out share
  by document hash) -> [train: repeat, shuffle (data.shuffle_buffer documents)]
  -> batches of data.docs_per_batch documents -> tokenize (`tokenization.load_tokenizer`)
  -> sentence pairs or packed sequences (`pairing.py`) -> [train: shuffle (data.shuffle_buffer
  examples)] -> batches -> dynamic masking (`masking.py`) -> the original feature dict.

Randomness is stateless: each document batch and each final batch gets a seed from
(seed, process_index, its running index), and the running index counts on across epochs, so
every epoch has new pairs and new masks while a given seed always gives the same stream.

TFRecords of the original create_pretraining_data.py (`*.tfrecord*`) are read as they are
(static masks); `tfds:NAME[/CONFIG][:SPLIT]` reads articles of a TFDS text feature and splits
them into sentences; `sample` is the built-in corpus of `sample_corpus.py`. When
data.eval_input is empty, one document (or record) in 100, chosen by hash, is held out:
evaluation reads only those, training never does.

Evaluation (train=False) is one deterministic pass; the last batch is filled up with padding
examples (input_mask all 0, masked_lm_weights all 0, next_sentence_labels 0): weight
per-example metrics such as NSP accuracy by input_mask[:, 0].
"""

import functools
import hashlib
import json
import os
from typing import Any, Callable

from absl import logging
import ml_collections
import numpy as np
import tensorflow as tf

from bert_jax import documents
from bert_jax import fileio
from bert_jax import masking
from bert_jax import objectives
from bert_jax import packing
from bert_jax import pairing
from bert_jax import sample_corpus
from bert_jax import tokenization
from bert_jax.errors import UserError

FEATURES = tuple(objectives.RECORD_FEATURES)
# How many characters of text a vocabulary is trained on at most (data.vocab_file empty).
_VOCAB_TRAINING_CHARS = 200_000_000


# ---------------------------------------------------------------------------------------------
# Examples from documents
# ---------------------------------------------------------------------------------------------


def _tokenize_documents(tokenizer, texts: tf.Tensor) -> tf.RaggedTensor:
  """Documents [N] -> int32 RaggedTensor [N, sentences, tokens], empty sentences removed."""
  sentences = tf.strings.split(texts, '\n')
  tokens = tokenizer.tokenize(sentences.flat_values)
  tokens = tf.RaggedTensor.from_row_splits(
      tf.cast(tokens.flat_values, tf.int32), tf.cast(tokens.row_splits, tf.int64),
      validate=False)
  non_empty = tokens.row_lengths() > 0
  sentence_counts = tf.math.unsorted_segment_sum(
      tf.cast(non_empty, tf.int64), sentences.value_rowids(), sentences.nrows())
  kept = tf.ragged.boolean_mask(tokens, non_empty)
  return tf.RaggedTensor.from_row_lengths(kept, sentence_counts, validate=False)


def load_tokenizer(vocab_file: str, lower_case: bool):
  """`tokenization.load_tokenizer`, cached until the file changes (a pipeline built again
  reuses it, and the per-batch functions' traced graphs with it)."""
  return _cached_tokenizer(vocab_file, _version(vocab_file), lower_case)


def _version(path: str) -> tuple[int, int]:
  """Changes when the file does, so caches keyed by it never serve a stale vocabulary."""
  try:
    stat = tf.io.gfile.stat(path)
  except tf.errors.OpError:  # Missing, a symbolic link that loops, unreadable: the tokenizer
    return (0, 0)            # that reads it next names the file and what is wrong with it.
  return (stat.mtime_nsec, stat.length)


@functools.lru_cache(maxsize=8)
def _cached_tokenizer(vocab_file: str, version: tuple[int, int], lower_case: bool):
  del version  # Part of the cache key only.
  return tokenization.load_tokenizer(vocab_file, lower_case=lower_case)


# The per-batch functions are cached tf.functions with fixed signatures, so building another
# dataset with the same settings (train and eval, tests) reuses their traced graphs.
@functools.lru_cache(maxsize=32)
def _pair_function(vocab_file: str, version: tuple[int, int], lower_case: bool, objective: str,
                   seq_len: int, short_seq_prob: float, cross_documents: bool):
  """(seed, batch index, texts [N], ids [N]) -> examples of a batch of documents."""
  tokenizer = _cached_tokenizer(vocab_file, version, lower_case)
  specials = dict(cls_id=tokenizer.cls_id, sep_id=tokenizer.sep_id, pad_id=tokenizer.pad_id)

  @tf.function(autograph=False, input_signature=[
      tf.TensorSpec([2], tf.int64), tf.TensorSpec([], tf.int64), tf.TensorSpec([None], tf.string),
      tf.TensorSpec([None], tf.int64)])
  def fn(seed, index, texts, ids):
    doc_tokens = _tokenize_documents(tokenizer, texts)
    if objective == 'none':
      return pairing.pack_sequences(doc_tokens, seq_len=seq_len,
                                    cross_documents=cross_documents, **specials)
    # No in-graph check for a single document: a batch of pieces of one long document is
    # normal (its NotNext draws are dropped); a one-document input is refused at start-up
    # (`_check_other_documents`).
    return pairing.make_pairs(
        doc_tokens, ids, tf.random.experimental.stateless_fold_in(seed, index),
        seq_len=seq_len, short_seq_prob=short_seq_prob, objective=objective,
        check_documents=False, **specials)
  return fn


@functools.lru_cache(maxsize=32)
def _mask_function(vocab_file: str, version: tuple[int, int], lower_case: bool, seq_len: int,
                   max_predictions: int, masked_lm_prob: float, whole_word: bool):
  """(seed, batch index, examples) -> the features of a batch, freshly masked."""
  tokenizer = _cached_tokenizer(vocab_file, version, lower_case)
  specials = (tokenizer.pad_id, tokenizer.cls_id, tokenizer.sep_id, tokenizer.mask_id)
  replacements = masking.replacement_table(tokenizer.vocab_size, tokenizer.special_ids)
  continuation = tokenizer.is_continuation if whole_word else None
  vector = tf.TensorSpec([None], tf.int32)

  @tf.function(autograph=False, input_signature=[
      tf.TensorSpec([2], tf.int64), tf.TensorSpec([], tf.int64),
      tf.TensorSpec([None, seq_len], tf.int32), vector, vector, vector])
  def fn(seed, index, input_ids, num_a, length, labels):
    masked = masking.mask_tokens(
        input_ids, tf.random.experimental.stateless_fold_in(seed, index),
        max_predictions=max_predictions, masked_lm_prob=masked_lm_prob,
        mask_id=tokenizer.mask_id, ineligible_ids=specials, replacement_ids=replacements,
        is_continuation=continuation)
    position = tf.range(seq_len)[None, :]
    input_mask = position < length[:, None]
    segment_ids = (position >= num_a[:, None]) & input_mask
    return {
        'input_ids': masked['input_ids'],
        'input_mask': tf.cast(input_mask, tf.int32),
        'segment_ids': tf.cast(segment_ids, tf.int32),
        'masked_lm_positions': masked['masked_lm_positions'],
        'masked_lm_ids': masked['masked_lm_ids'],
        'masked_lm_weights': masked['masked_lm_weights'],
        'next_sentence_labels': labels,
    }
  return fn


def _pad_to_batches(ds: tf.data.Dataset, batch_size: int, padding: dict) -> tf.data.Dataset:
  """Fixed-size batches of a finite stream; the last one is filled with `padding` examples."""
  if batch_size > 1:
    ds = ds.concatenate(tf.data.Dataset.from_tensors(padding).repeat(batch_size - 1))
  return ds.batch(batch_size, drop_remainder=True)


def _seed_tensor(seed: int, process_index: int, purpose: int) -> tf.Tensor:
  """The stateless seed of one kind of draw (pairs, masks) on one process."""
  return tf.constant([seed, process_index * 1000 + purpose], tf.int64)


def _shuffle_seed(seed: int, process_index: int, purpose: int) -> int:
  """Seed of one shuffle (files, documents, examples) on one process: each draws its own."""
  key = f'{seed}/{process_index}/{purpose}'.encode()
  return int.from_bytes(hashlib.sha256(key).digest()[:7], 'little')


def _text_dataset(data, *, batch_size, seq_len, max_predictions, train, process_index,
                  process_count, seed, vocab_file, docs_per_batch):
  objective = data.objective
  spec, flag = (data.input, 'data.input')
  holdout = None
  if train:
    holdout = False if not data.eval_input else None
  elif data.eval_input:
    spec, flag = data.eval_input, 'data.eval_input'
  else:
    holdout = True
  docs, described = documents.documents(
      spec, flag, data, holdout=holdout, shuffle_files=train,
      seed=_shuffle_seed(seed, process_index, 0),
      process_index=process_index, process_count=process_count)
  share = f' (process {process_index} of {process_count})' if process_count > 1 else ''
  what = (f'held-out documents (1 in {documents.HOLDOUT_MODULUS} by hash)' if holdout
          else 'documents')
  if train and objectives.get(objective).other_documents:
    _check_other_documents(docs, objective, described + share)
  else:
    documents.require_element(docs, f'no {what} in {described}{share}' +
                              ('; set data.eval_input' if holdout else ''))

  tokenizer = load_tokenizer(vocab_file, data.lower_case)
  if train:
    docs = docs.repeat().shuffle(data.shuffle_buffer,
                                 seed=_shuffle_seed(seed, process_index, 1))
  version = _version(vocab_file)
  pair = _pair_function(vocab_file, version, data.lower_case, objective, seq_len,
                        float(data.short_seq_prob), not data.packing)
  pair_seed = _seed_tensor(seed, process_index, 1)
  examples = docs.batch(docs_per_batch).enumerate().map(
      documents.as_written(lambda i, docs: pair(pair_seed, i, docs['text'], docs['id'])),
      num_parallel_calls=tf.data.AUTOTUNE, deterministic=True).unbatch()
  if train:
    examples = examples.shuffle(data.shuffle_buffer,
                                seed=_shuffle_seed(seed, process_index, 2))
  mask = _mask_function(vocab_file, version, data.lower_case, seq_len, max_predictions,
                        float(data.masked_lm_prob), bool(data.whole_word_masking))
  mask_seed = _seed_tensor(seed, process_index, 2)

  def masked(batches):
    return batches.enumerate().map(
        documents.as_written(lambda i, b: mask(mask_seed, i, b['input_ids'], b['num_a'],
                                               b['length'], b['next_sentence_labels'])),
        num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)

  if data.packing:
    # Each sequence is masked on its own, then windows of them are packed into rows.
    windows = masked(examples.batch(int(data.packing_window)))
    return _packed_batches(windows, data, batch_size=batch_size, seq_len=seq_len,
                           max_predictions=max_predictions, train=train, seed=seed,
                           process_index=process_index, pad_id=tokenizer.pad_id)
  if train:
    batches = examples.batch(batch_size, drop_remainder=True)
  else:
    padding = {'input_ids': tf.fill([seq_len], tokenizer.pad_id), 'num_a': 0, 'length': 0,
               'next_sentence_labels': 0}
    batches = _pad_to_batches(examples, batch_size, padding)
  return masked(batches)


def _check_other_documents(docs: tf.data.Dataset, objective: str, described: str) -> None:
  """Refuses, before the first step, a training input of one document for an objective whose
  pairs draw from another one (NotNext): found inside tf.data it would stop a running job with
  TensorFlow's lines and without naming the input. A bounded look (documents.LOOK_PIECES
  pieces) sees a second document of any real corpus; past it, NotNext pairs come from the
  batches that hold several documents, which is said in a warning."""
  count, ended = documents.count_documents(docs)
  if not count:
    raise UserError(f'no documents in {described}')
  if count > 1:
    return
  if ended:
    raise UserError(f'{described} holds a single document: objective {objective!r} needs at '
                    'least two for NotNext pairs; add documents (blank lines separate them), or '
                    'set data.objective to sop or none')
  logging.warning('The first %d MB of %s are one document: NotNext pairs are made only in '
                  'batches that also hold other documents', documents.LOOK_PIECES *
                  documents.PIECE_BYTES >> 20, described)


@functools.lru_cache(maxsize=32)
def _pack_function(seq_len: int, max_predictions: int, max_sequences: int, pad_id: int):
  """(seed, window index, unpacked features [N, ...]) -> packed rows [R, ...]."""
  row_predictions = packing.predictions_per_row(max_predictions, max_sequences, seq_len)
  tokens = tf.TensorSpec([None, seq_len], tf.int32)
  targets = tf.TensorSpec([None, max_predictions], tf.int32)

  @tf.function(autograph=False, input_signature=[
      tf.TensorSpec([2], tf.int64), tf.TensorSpec([], tf.int64),
      dict(input_ids=tokens, input_mask=tokens, segment_ids=tokens, masked_lm_positions=targets,
           masked_lm_ids=targets,
           masked_lm_weights=tf.TensorSpec([None, max_predictions], tf.float32),
           next_sentence_labels=tf.TensorSpec([None], tf.int32))])
  def fn(seed, index, features):
    return packing.pack(features, tf.random.experimental.stateless_fold_in(seed, index),
                        seq_len=seq_len, max_sequences=max_sequences,
                        max_predictions=row_predictions, pad_id=pad_id)
  return fn


def _packed_batches(windows: tf.data.Dataset, data, *, batch_size, seq_len, max_predictions,
                    train, seed, process_index, pad_id) -> tf.data.Dataset:
  """Windows of unpacked, masked sequences -> batches of packed rows (`packing.py`)."""
  max_sequences = int(data.packing_max_sequences)
  pack = _pack_function(seq_len, max_predictions, max_sequences, pad_id)
  pack_seed = _seed_tensor(seed, process_index, 3)
  rows = windows.enumerate().map(documents.as_written(lambda i, w: pack(pack_seed, i, w)),
                                 num_parallel_calls=tf.data.AUTOTUNE,
                                 deterministic=True).unbatch()
  if train:
    return rows.batch(batch_size, drop_remainder=True)
  padding = packing.padding_row(
      seq_len, max_sequences,
      packing.predictions_per_row(max_predictions, max_sequences, seq_len), pad_id)
  return _pad_to_batches(rows, batch_size, padding)


# ---------------------------------------------------------------------------------------------
# TFRecords of create_pretraining_data.py
# ---------------------------------------------------------------------------------------------


def _record_spec(seq_len: int, max_predictions: int) -> dict[str, tuple[int, tf.DType]]:
  """{feature: (length, dtype)} of a record (`objectives.RECORD_FEATURES`)."""
  lengths = {'seq_len': seq_len, 'max_predictions': max_predictions, 1: 1}
  return {name: (lengths[length], tf.as_dtype(dtype))
          for name, (length, dtype) in objectives.RECORD_FEATURES.items()}


def _compression(path: str) -> str:
  return 'GZIP' if path.endswith('.gz') else ''


def check_record_framing(path: str, flag: str) -> None:
  """Walks the length headers of a local, uncompressed TFRecord file to its end, seeking over
  the records: a file cut short (or not TFRecords at all) is a UserError naming `flag` (the key
  that gave the file), the file and the byte where its last record breaks off. tf.data would
  raise a DataLossError naming neither, at that record, mid-run. (.gz files are read to their
  end by documents.check_gzip; a remote file would cost a request per record, so it is left to
  tf.data.)"""
  if fileio.is_remote(path) or _compression(path):
    return
  size = os.path.getsize(path)
  offset = 0
  with open(path, 'rb') as f:
    while offset < size:
      header = f.read(12)  # uint64 length, uint32 masked CRC of the length.
      end = offset + 12 + (int.from_bytes(header[:8], 'little') + 4 if len(header) == 12 else 0)
      if len(header) < 12 or end > size:
        raise UserError(f'{flag}: {path} is truncated or not a TFRecord file: the record at byte '
                        f'{offset} ends past the end of the file ({size:,} bytes); copy it '
                        'again, or write the records again')
      offset = end
      f.seek(offset)


def check_tfrecord(path: str, seq_len: int, max_predictions: int, flag: str) -> None:
  """A UserError naming `flag`, the file and the feature if its first record does not fit, or
  the file is cut short (`check_record_framing`)."""
  check_record_framing(path, flag)
  for record in tf.data.TFRecordDataset(path, _compression(path)).take(1):
    example = tf.train.Example.FromString(record.numpy())
    for name, (size, dtype) in _record_spec(seq_len, max_predictions).items():
      if name not in example.features.feature:
        raise UserError(f'{flag}: {path}: the records have no feature {name!r}; expected the '
                        f'features of create_pretraining_data.py: {list(FEATURES)}')
      feature = example.features.feature[name]
      values = (feature.float_list.value if dtype == tf.float32 else feature.int64_list.value)
      if len(values) != size:
        setting = 'seq_len' if size == seq_len and 'masked' not in name else 'max_predictions'
        if name == 'next_sentence_labels':
          setting = 'one label per example'
        raise UserError(f'{flag}: {path}: feature {name!r} has {len(values)} values, but '
                        f'{setting} asks for {size}')


def _zero_record(seq_len: int, max_predictions: int) -> bytes:
  """A serialized example of zeros: the padding of the last evaluation batch."""
  feature = {}
  for name, (size, dtype) in _record_spec(seq_len, max_predictions).items():
    if dtype == tf.float32:
      feature[name] = tf.train.Feature(float_list=tf.train.FloatList(value=[0.0] * size))
    else:
      feature[name] = tf.train.Feature(int64_list=tf.train.Int64List(value=[0] * size))
  return tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString()


def _tfrecord_dataset(data, *, batch_size, seq_len, max_predictions, train, process_index,
                      process_count, seed):
  spec, flag, holdout = data.input, 'data.input', None
  if not train and data.eval_input:
    spec, flag = data.eval_input, 'data.eval_input'
  elif not data.eval_input:
    holdout = not train
  files = documents.expand_files(spec, flag)
  by_record = len(files) < process_count
  if not by_record:
    files = files[process_index::process_count]
  for path in files:
    check_tfrecord(path, seq_len, max_predictions, flag)
  ds = tf.data.Dataset.from_tensor_slices(files)
  if train and len(files) > 1:
    ds = ds.shuffle(len(files), seed=_shuffle_seed(seed, process_index, 0),
                    reshuffle_each_iteration=True)
  ds = ds.interleave(
      documents.as_written(lambda f: tf.data.TFRecordDataset(
          f, tf.where(tf.strings.regex_full_match(f, r'.*\.gz'), 'GZIP', ''))),
      cycle_length=min(len(files), 16), num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
  if holdout is not None or by_record and process_count > 1:
    # Records are selected like documents, by a hash of their bytes; in blocks, since a
    # per-record filter call costs more than the hash.
    keep = documents.selector(holdout, (process_index, process_count) if by_record else None)
    ds = ds.batch(1024).map(
        documents.as_written(lambda r: tf.boolean_mask(r, keep(documents.document_ids(r)))))
    ds = ds.unbatch()
  what = 'held-out records (1 in 100 by hash)' if holdout else 'records'
  documents.require_element(ds, f'no {what} in {flag}={spec!r} ({files})' +
                            ('; set data.eval_input' if holdout else ''))
  features = {name: tf.io.FixedLenFeature([size], dtype)
              for name, (size, dtype) in _record_spec(seq_len, max_predictions).items()}

  @documents.as_written
  def parse(records):
    parsed = tf.io.parse_example(records, features)
    out = {k: tf.cast(v, tf.float32 if k == 'masked_lm_weights' else tf.int32)
           for k, v in parsed.items()}
    out['next_sentence_labels'] = out['next_sentence_labels'][:, 0]
    return out

  if train:
    ds = ds.repeat().shuffle(data.shuffle_buffer, seed=_shuffle_seed(seed, process_index, 1))
  if data.packing:
    # The records' sequences and static masks, packed a window at a time.
    windows = ds.batch(int(data.packing_window)).map(
        parse, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    return _packed_batches(windows, data, batch_size=batch_size, seq_len=seq_len,
                           max_predictions=max_predictions, train=train, seed=seed,
                           process_index=process_index, pad_id=0)
  if train:
    ds = ds.batch(batch_size, drop_remainder=True)
  else:
    ds = _pad_to_batches(ds, batch_size, tf.constant(_zero_record(seq_len, max_predictions)))
  return ds.map(parse, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)


# ---------------------------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------------------------


def make_pretraining_dataset(data: ml_collections.ConfigDict, *, batch_size: int, seq_len: int,
                             max_predictions: int, train: bool, process_index: int = 0,
                             process_count: int = 1, seed: int | None = None,
                             vocab_file: str | None = None) -> tf.data.Dataset:
  """Batches of pre-training examples for this process.

  Args:
    data: the `config.data` ConfigDict (see configs/default.py).
    batch_size: examples per batch on this process.
    seq_len: sequence length (padded).
    max_predictions: width of the masked_lm_* features.
    train: True: endless, shuffled, new pairs and masks every epoch. False: one deterministic
      pass over the evaluation data, the last batch filled with padding examples.
    process_index, process_count: this process's share of the data.
    seed: overrides data.seed.
    vocab_file: overrides `resolve_vocab(data, None)`.

  Returns:
    A dataset of dicts: input_ids, input_mask, segment_ids [B, seq_len] int32,
    masked_lm_positions, masked_lm_ids [B, max_predictions] int32, masked_lm_weights
    [B, max_predictions] float32, next_sentence_labels [B] int32. With data.packing, B rows
    of several sequences each (`packing.PACKED_FEATURES`): also position_ids and sequence_ids
    [B, seq_len], masked_lm_* [B, packing.predictions_per_row(...)], and
    next_sentence_positions, next_sentence_labels (int32) and next_sentence_weights (float32)
    [B, data.packing_max_sequences].
  """
  fileio.hide_accelerators_from_tf()
  # The config's keys and phases are checked where it loads (config_checks).
  assert seq_len >= 8 and 1 <= max_predictions <= seq_len and batch_size >= 1, (
      seq_len, max_predictions, batch_size)
  if not 0 <= process_index < process_count:
    raise ValueError(f'process_index={process_index} is not in [0, {process_count})')
  seed = int(data.seed if seed is None else seed)
  common = dict(batch_size=batch_size, seq_len=seq_len, max_predictions=max_predictions,
                train=train, process_index=process_index, process_count=process_count,
                seed=seed)
  inputs = [data.input] + ([data.eval_input] if data.eval_input else [])
  kinds = {documents.input_kind(s) for s in inputs}
  if 'tfrecord' in kinds:
    if kinds != {'tfrecord'}:
      raise UserError(f'data.input={data.input!r} and data.eval_input={data.eval_input!r} '
                      'mix TFRecords and text')
    ds = _tfrecord_dataset(data, **common)
  else:
    ds = _text_dataset(data, vocab_file=vocab_file or resolve_vocab(data, None),
                       docs_per_batch=int(data.docs_per_batch),
                       **common)
  options = tf.data.Options()
  options.deterministic = True
  # Iterator checkpoints refuse function calls holding stateful ops, and the tokenizer's ragged
  # validation Asserts make ours look stateful. Nothing in the pipeline has state outside
  # tf.data (randomness is stateless), which the save/restore test checks.
  options.experimental_external_state_policy = tf.data.experimental.ExternalStatePolicy.IGNORE
  return ds.prefetch(tf.data.AUTOTUNE).with_options(options)


def make_iterator(ds: tf.data.Dataset):
  """An iterator of numpy dicts with `save(path)` / `restore(path)` of its exact position."""
  from clu import data as clu_data  # pylint: disable=g-import-not-at-top
  return clu_data.TfDatasetIterator(ds, checkpoint=True)


def input_fingerprint(data: ml_collections.ConfigDict, *, batch_size: int, seq_len: int,
                      max_predictions: int, process_count: int = 1) -> dict[str, Any]:
  """What a training input position is valid for, by the key that sets it: the files of
  data.input with their sizes and modification times, and every setting that shapes the
  stream or its buffers (batch size per process, sequence length, objective, ...)."""
  if documents.input_kind(data.input) == 'tfds':
    files = data.input  # A prepared TFDS split does not change under a name.
  else:
    files = documents.file_identities(data.input)
  return {
      'data.input': files,
      'data.eval_input': bool(data.eval_input),  # Empty: training skips the held-out share.
      'train.batch_size': int(batch_size) * int(process_count),
      'data.max_seq_length': int(seq_len),
      'data.max_predictions_per_seq': int(max_predictions),
      'data.objective': str(data.objective),
      'data.packing': [bool(data.packing), int(data.packing_window),
                       int(data.packing_max_sequences)],
      'data.docs_per_batch': int(data.docs_per_batch),
      'data.shuffle_buffer': int(data.shuffle_buffer),
      'data.seed': int(data.seed),
      'processes': int(process_count),
  }


def restart_seed(seed: int, step: int) -> int:
  """The data seed of an input restarted at `step`: not the first step's stream again."""
  key = f'{seed}/restart/{step}'.encode()
  return int.from_bytes(hashlib.sha256(key).digest()[:4], 'little') >> 1


class TrainingInput:
  """A training input's iterator whose saved position says what it was made for.

  `save(path)` writes the tf.data position and, beside it (`path`.input.json), the
  `input_fingerprint` and the step where the input last restarted. `restore(path)` restores the
  position when the fingerprint matches. When it does not (a new corpus, batch size, length,
  objective, ... on resume), the old position means nothing in the new stream (and TensorFlow
  would refuse buffers of another shape with a traceback), so the input restarts, as a phase
  switch starts its own: from the start of the corpus, shuffled with `restart_seed(data.seed,
  step)` so that the model does not see the first steps' stream again. A warning names every
  key that changed. Exact resumes of that run still work: the restart step is saved too.
  """

  def __init__(self, make_dataset: Callable[[int | None], tf.data.Dataset],
               fingerprint: dict[str, Any], step: int, seed: int):
    """make_dataset(seed or None for data.seed); `step`: where this run starts."""
    self._make, self._fingerprint, self._step, self._seed = make_dataset, fingerprint, step, seed
    self._restarted_at = None
    self._it = make_iterator(make_dataset(None))

  def __iter__(self):
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    return next(self._it)

  def save(self, path: str) -> None:
    self._it.save(path)
    fileio.write_json(path + '.input.json', {'fingerprint': self._fingerprint,
                                             'restarted_at': self._restarted_at})

  def restore(self, path: str) -> None:
    if not tf.io.gfile.exists(path + '.input.json'):
      self._it.restore(path)  # A position saved before fingerprints were: as it was.
      return
    saved = fileio.read_json(path + '.input.json')
    now = json.loads(json.dumps(self._fingerprint))  # Tuples as lists, as saved.
    if saved['fingerprint'] == now:
      if saved['restarted_at'] is not None:
        self._restart(saved['restarted_at'])
      self._it.restore(path)
      return
    changed = [f'{key} ({_change(saved["fingerprint"].get(key), value)})'
               for key, value in now.items() if saved['fingerprint'].get(key) != value]
    logging.warning('Resuming at step %d with %s changed since the input position was saved: '
                    'the input restarts from the start of data.input, shuffled anew', self._step,
                    ', '.join(changed))
    self._restart(self._step)

  def _restart(self, step: int) -> None:
    self._restarted_at = step
    self._it = make_iterator(self._make(restart_seed(self._seed, step)))


def _change(old: Any, new: Any) -> str:
  if isinstance(new, list) and new and isinstance(new[0], list):  # Files.
    old_files = {tuple(f) for f in old or []}
    new_files = {tuple(f) for f in new}
    return (f'{len(new_files - old_files)} of {len(new_files)} files new or changed, '
            f'{len(old_files - new_files)} gone')
  return f'{old} -> {new}'


def check_vocab_given(data: ml_collections.ConfigDict, where: str = '') -> None:
  """Raises unless data.vocab_file is set where data.input or data.eval_input is TFRecords."""
  if data.vocab_file:
    return
  for spec in (data.input, data.eval_input):
    if spec and documents.input_kind(spec) == 'tfrecord':
      raise UserError(f'data.vocab_file is required with TFRecord input ({where}{spec!r}): the '
                      'ids in the records belong to the vocabulary that made them')


def resolve_vocab(data: ml_collections.ConfigDict, workdir: str | None) -> str:
  """data.vocab_file, or a WordPiece vocab trained on data.input (cached) when it is empty.

  The trained vocab goes to workdir/vocab.txt, or without a workdir to the cache directory
  (sample_corpus.default_cache_dir()) under a name derived from the input and settings. It is
  written atomically, so processes training it side by side never see a partial file.
  """
  if data.vocab_file:
    fileio.check_bucket(data.vocab_file, 'data.vocab_file')
    return data.vocab_file
  check_vocab_given(data)
  if workdir:
    fileio.check_output_dir(workdir, '--workdir')  # A file there: one line, not a traceback.
    path = os.path.join(workdir, 'vocab.txt')
    documents.check_not_matched(data.input, 'data.input', [path])
  else:
    key = json.dumps([data.input, int(data.vocab_size), bool(data.lower_case)])
    path = os.path.join(sample_corpus.default_cache_dir(),
                        f'vocab_{hashlib.sha256(key.encode()).hexdigest()[:16]}.txt')
  if tf.io.gfile.exists(path):
    return path
  if not workdir:
    sample_corpus.make_cache_dir()
  from bert_jax import vocab as vocab_lib  # pylint: disable=g-import-not-at-top
  if documents.input_kind(data.input) != 'tfds':
    documents.resolve_files(data.input)  # A pattern that matches nothing fails before training.
  texts = documents.text_lines(data.input, data)
  logging.info('Training a %d-token WordPiece vocabulary on %s into %s', data.vocab_size,
               data.input, path)
  tmp = f'{path}.tmp-{os.getpid()}'
  try:
    vocab_lib.train_wordpiece(_capped(texts, _VOCAB_TRAINING_CHARS), tmp, int(data.vocab_size),
                              lower_case=data.lower_case)
  except vocab_lib.EmptyInputError as e:
    raise UserError(f'data.input={data.input!r} has no text to train a vocabulary on (its files '
                    'are empty or blank); point it at a corpus: one sentence a line, a blank line '
                    'between documents') from e
  tf.io.gfile.rename(tmp, path, overwrite=True)
  return path


def _capped(texts, max_chars: int):
  total = 0
  for text in texts:
    yield text
    total += len(text)
    if total >= max_chars:
      logging.info('Vocabulary trained on the first %d characters of the input', total)
      return
