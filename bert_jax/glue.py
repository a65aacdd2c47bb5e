"""GLUE: read the official TSV files (or TFDS `glue/*`), encode pairs, bucket batches, write
leaderboard submissions.

The data layout is that of GLUE's `download_glue_data.py` (`<data_dir>/CoLA/train.tsv`, ...,
`<data_dir>/diagnostic/diagnostic.tsv`). Label lists are the ones of the original
run_classifier.py (and GLUE's for the tasks it does not cover); STS-B is a regression.

Features are fixed-length int32 numpy arrays `input_ids`, `input_mask`, `segment_ids` [N, L],
`label` [N] and `example_index` [N]; `batching.bucket_batches` cuts each batch to the smallest
length bucket that holds it, since most GLUE sentences are far shorter than 128 tokens.
"""

import dataclasses
import json
import os
from typing import Iterator, Sequence

from absl import logging
import jax
import ml_collections
import numpy as np

from bert_jax import batching
from bert_jax import errors
from bert_jax import fileio
from bert_jax import metrics
from bert_jax import model as model_lib
from bert_jax import tasks
from bert_jax.errors import UserError

# ---------------------------------------------------------------------------------------------
# Tasks
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Example:
  """One GLUE example; `label` is a label string, a float (STS-B) or None (test sets)."""
  guid: str
  text_a: str
  text_b: str | None
  label: str | float | None


@dataclasses.dataclass(frozen=True)
class _Task:
  directory: str
  labels: tuple[str, ...] | None  # None: regression.
  files: dict[str, str]  # split -> file name inside `directory`.
  # Column names (header files) or positions (headerless CoLA train/dev).
  text_a: str | int
  text_b: str | int | None
  label: str | int
  test_text_a: str | None = None  # When the test file names its columns differently.
  test_text_b: str | None = None
  headerless_splits: tuple[str, ...] = ()
  headerless_columns: int = 0
  skip_malformed: bool = False  # QQP's released files have broken rows.
  submission: dict[str, str] = dataclasses.field(default_factory=dict)  # split -> file.


_BINARY = ('0', '1')
_NLI3 = ('contradiction', 'entailment', 'neutral')
_NLI2 = ('entailment', 'not_entailment')
_STANDARD = {'train': 'train.tsv', 'dev': 'dev.tsv', 'test': 'test.tsv'}

TASKS = {
    'cola': _Task('CoLA', _BINARY, _STANDARD, 3, None, 1, test_text_a='sentence',
                  headerless_splits=('train', 'dev'), headerless_columns=4,
                  submission={'test': 'CoLA.tsv'}),
    'sst2': _Task('SST-2', _BINARY, _STANDARD, 'sentence', None, 'label',
                  submission={'test': 'SST-2.tsv'}),
    'mrpc': _Task('MRPC', _BINARY, _STANDARD, '#1 String', '#2 String', 'Quality',
                  submission={'test': 'MRPC.tsv'}),
    'stsb': _Task('STS-B', None, _STANDARD, 'sentence1', 'sentence2', 'score',
                  submission={'test': 'STS-B.tsv'}),
    'qqp': _Task('QQP', _BINARY, _STANDARD, 'question1', 'question2', 'is_duplicate',
                 skip_malformed=True, submission={'test': 'QQP.tsv'}),
    'mnli': _Task('MNLI', _NLI3,
                  {'train': 'train.tsv', 'dev_matched': 'dev_matched.tsv',
                   'dev_mismatched': 'dev_mismatched.tsv', 'test_matched': 'test_matched.tsv',
                   'test_mismatched': 'test_mismatched.tsv'},
                  'sentence1', 'sentence2', 'gold_label',
                  submission={'test_matched': 'MNLI-m.tsv', 'test_mismatched': 'MNLI-mm.tsv'}),
    'qnli': _Task('QNLI', _NLI2, _STANDARD, 'question', 'sentence', 'label',
                  submission={'test': 'QNLI.tsv'}),
    'rte': _Task('RTE', _NLI2, _STANDARD, 'sentence1', 'sentence2', 'label',
                 submission={'test': 'RTE.tsv'}),
    'wnli': _Task('WNLI', _BINARY, _STANDARD, 'sentence1', 'sentence2', 'label',
                  submission={'test': 'WNLI.tsv'}),
    # The diagnostic set: test only, scored with an MNLI model.
    'ax': _Task('diagnostic', _NLI3, {'test': 'diagnostic.tsv'}, 'sentence1', 'sentence2',
                'label', submission={'test': 'AX.tsv'}),
}

_SPLIT_ALIASES = {'validation': 'dev', 'eval': 'dev',
                  'validation_matched': 'dev_matched', 'validation_mismatched': 'dev_mismatched'}


def _task(task: str) -> tuple[str, _Task]:
  name = metrics.canonical_task(task)
  if name in ('mnli_matched', 'mnli_mismatched'):
    name = 'mnli'
  return name, TASKS[name]


def _split(name: str, spec: _Task, split: str) -> str:
  split = _SPLIT_ALIASES.get(split, split)
  if name == 'mnli' and split in ('dev', 'test'):
    split += '_matched'  # The leaderboard's headline MNLI number is the matched one.
  if split not in spec.files:
    raise UserError(f'GLUE task {name!r} has no split {split!r}; known: {sorted(spec.files)}')
  return split


def task_info(task: str) -> tuple[list[str] | None, tuple[str, ...]]:
  """(label list, None for the STS-B regression; names of the task's GLUE metrics)."""
  _, spec = _task(task)
  return (list(spec.labels) if spec.labels else None), metrics.glue_metric_names(task)


def has_pairs(task: str) -> bool:
  """Whether the task's examples are pairs of texts (MRPC, MNLI, ...) or single sentences."""
  return _task(task)[1].text_b is not None


# ---------------------------------------------------------------------------------------------
# Reading the TSV files
# ---------------------------------------------------------------------------------------------


def _read_rows(path: str) -> Iterator[tuple[int, list[str]]]:
  """(1-based line number, tab-separated fields); quotes are literal, as GLUE's files need."""
  # read_user_text drops a byte-order mark (MRPC's header starts with one). Rows end at '\n' (and
  # CRLF): a stray '\r' inside a sentence must not end the row.
  for number, line in enumerate(fileio.read_user_text(path).split('\n'), 1):
    line = line.rstrip('\r')
    if line:
      yield number, line.split('\t')


def _column(header: list[str], name: str, path: str) -> int:
  if name not in header:
    raise UserError(f'{path}: header (line 1) has no column {name!r}; it has {header}')
  return header.index(name)


def read_task(task: str, data_dir: str, split: str,
              skip_malformed: bool | None = None, path: str | None = None) -> list[Example]:
  """Examples of one split from the official files.

  Args:
    task: 'cola', 'sst2' ('SST-2'), 'mrpc', 'stsb', 'qqp', 'mnli', 'qnli', 'rte', 'wnli', 'ax'.
    data_dir: the GLUE root (holding CoLA/, SST-2/, ..., diagnostic/).
    split: 'train', 'dev', 'test'; MNLI: 'dev_matched', 'dev_mismatched', 'test_matched',
      'test_mismatched' ('dev'/'test' mean matched).
    skip_malformed: skip rows with the wrong number of columns (counted and logged) instead of
      raising; by default only for QQP, whose released files have such rows.
    path: read this file (laid out as the split's official file) instead of data_dir's.
  """
  name, spec = _task(task)
  split = _split(name, spec, split)
  path = path or os.path.join(data_dir, spec.directory, spec.files[split])
  if not fileio.exists(path):
    raise UserError(f'GLUE {name} {split}: no file {path} (expected the layout of '
                    f'download_glue_data.py: <data_dir>/{spec.directory}/'
                    f'{spec.files[split]})')
  skip = spec.skip_malformed if skip_malformed is None else skip_malformed
  is_test = split.startswith('test')
  rows = _read_rows(path)
  if split in spec.headerless_splits:
    n_columns = spec.headerless_columns
    a, b, label = spec.text_a, spec.text_b, spec.label
    row_id = None
  else:
    try:
      _, header = next(rows)
    except StopIteration:
      raise UserError(f'{path}: empty file (expected a header line)') from None
    n_columns = len(header)
    a = _column(header, (spec.test_text_a if is_test and spec.test_text_a else spec.text_a), path)
    b = None if spec.text_b is None else _column(header, spec.text_b, path)
    label = None if is_test else _column(header, spec.label, path)
    row_id = next((header.index(c) for c in ('index', 'id') if c in header), None)

  examples, skipped = [], []
  for number, row in rows:
    if len(row) != n_columns:
      if skip:
        skipped.append(number)
        continue
      raise UserError(f'{path}:{number}: expected {n_columns} tab-separated columns, got '
                      f'{len(row)}: fix or delete that line')
    value = None
    if label is not None:
      value = row[label]
      if spec.labels is None:
        try:
          value = float(value)
        except ValueError:
          raise UserError(f'{path}:{number}: score {value!r} is not a number') from None
      elif value not in spec.labels:
        raise UserError(f'{path}:{number}: unknown label {value!r} for {name}; expected one of '
                        f'{list(spec.labels)}')
    guid = f'{split}-{row[row_id] if row_id is not None else len(examples)}'
    examples.append(Example(guid, row[a], None if b is None else row[b], value))
  errors.check_skipped(path, [f'line {n}' for n in skipped], len(skipped) + len(examples),
                       f'rows have the wrong number of columns (expected {n_columns})',
                       'fix or delete those lines, or check that this is the right file')
  if skipped:
    logging.warning('%s: skipped %d malformed rows (wrong number of columns), lines %s%s',
                    path, len(skipped), skipped[:10], ' ...' if len(skipped) > 10 else '')
  if not examples:
    raise UserError(f'{path}: no examples (file has no data rows'
                    f'{f", {len(skipped)} malformed rows skipped" if skipped else ""})')
  logging.info('%s: %d examples', path, len(examples))
  return examples


def read_file(task: str, path: str) -> list[Example]:
  """Examples of a TSV file in the layout of the task's dev file (with labels) or test file
  (without); which one is told by its header (CoLA's dev file has none: labelled)."""
  name, spec = _task(task)
  first = fileio.read_user_text(path).split('\n', 1)[0].rstrip('\r').split('\t')
  dev = [s for s in spec.files if s.startswith('dev')][0]
  test = [s for s in spec.files if s.startswith('test')][0]
  labelled = dev in spec.headerless_splits or (isinstance(spec.label, str)
                                               and spec.label in first)
  return read_task(name, '', dev if labelled else test, path=path)


# TFDS feature names of the two texts, and split names.
_TFDS_TEXTS = {
    'cola': ('sentence', None), 'sst2': ('sentence', None), 'mrpc': ('sentence1', 'sentence2'),
    'qqp': ('question1', 'question2'), 'stsb': ('sentence1', 'sentence2'),
    'mnli': ('premise', 'hypothesis'), 'qnli': ('question', 'sentence'),
    'rte': ('sentence1', 'sentence2'), 'wnli': ('sentence1', 'sentence2'),
    'ax': ('premise', 'hypothesis'),
}
_TFDS_SPLITS = {'dev': 'validation', 'dev_matched': 'validation_matched',
                'dev_mismatched': 'validation_mismatched'}


def read_tfds(task: str, split: str, data_dir: str | None = None) -> list[Example]:
  """Examples from the prepared TFDS dataset `glue/<task>` (never downloads).

  TFDS numbers labels in its own order (MNLI: entailment, neutral, contradiction); they are
  mapped to label strings by name, so `convert_examples` with `task_info`'s list is correct.
  """
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top

  name, spec = _task(task)
  split = _split(name, spec, split)
  builder = tfds.builder(f'glue/{name}', data_dir=data_dir)
  label_names = None if spec.labels is None else builder.info.features['label'].names
  ds = tfds.load(f'glue/{name}', split=_TFDS_SPLITS.get(split, split), data_dir=data_dir,
                 download=False, shuffle_files=False)
  key_a, key_b = _TFDS_TEXTS[name]
  examples = []
  for row in tfds.as_numpy(ds):
    label = None
    if not split.startswith('test'):
      if spec.labels is None:
        label = float(row['label'])
      else:
        label = label_names[int(row['label'])]
        if label not in spec.labels:
          raise UserError(f'TFDS glue/{name}: label {label!r} not in {list(spec.labels)}')
    examples.append(Example(
        f'{split}-{int(row["idx"])}', row[key_a].decode('utf-8'),
        None if key_b is None else row[key_b].decode('utf-8'), label))
  if not examples:
    raise UserError(f'TFDS glue/{name} split {split!r} is empty')
  return examples


# ---------------------------------------------------------------------------------------------
# Features
# ---------------------------------------------------------------------------------------------


def truncate_seq_pair(tokens_a: list, tokens_b: list, max_length: int) -> bool:
  """Pops from the end of the longer list until both fit; True if anything was cut.

  Cutting the longer one a token at a time keeps more of the shorter text, which usually
  carries as much information per token (the original BERT rule).
  """
  truncated = False
  while len(tokens_a) + len(tokens_b) > max_length:
    longer = tokens_a if len(tokens_a) > len(tokens_b) else tokens_b
    longer.pop()
    truncated = True
  return truncated


def pack_pair(ids_a: list[int], ids_b: list[int] | None, tok, max_seq_length: int
              ) -> tuple[list[int], list[int], bool]:
  """'[CLS] A [SEP] B [SEP]' token ids and segment ids, truncated to fit; (ids, segs, cut)."""
  ids_a = list(ids_a)
  if ids_b is None:
    cut = len(ids_a) > max_seq_length - 2
    ids_a = ids_a[:max_seq_length - 2]
    return [tok.cls_id] + ids_a + [tok.sep_id], [0] * (len(ids_a) + 2), cut
  ids_b = list(ids_b)
  cut = truncate_seq_pair(ids_a, ids_b, max_seq_length - 3)
  ids = [tok.cls_id] + ids_a + [tok.sep_id] + ids_b + [tok.sep_id]
  return ids, [0] * (len(ids_a) + 2) + [1] * (len(ids_b) + 1), cut


def convert_examples(examples: Sequence[Example], tok, max_seq_length: int,
                     label_list: Sequence[str] | None) -> dict[str, np.ndarray]:
  """Tokenizes, packs and pads; labels become ids (float32 scores when label_list is None).

  Test examples (label None) get label -1 (NaN for regression). Returns input_ids, input_mask,
  segment_ids [N, max_seq_length] int32, label [N], example_index [N] int32.
  """
  if not examples:
    raise ValueError('convert_examples: no examples')
  has_pairs = any(e.text_b is not None for e in examples)
  if max_seq_length < (3 if has_pairs else 2) + 1:
    raise UserError(f'max_seq_length={max_seq_length} leaves no room for text')
  label_map = None if label_list is None else {l: i for i, l in enumerate(label_list)}
  n = len(examples)
  encoded_a = batching.encode_in_chunks(tok, [e.text_a for e in examples])
  pair_indices = [i for i, e in enumerate(examples) if e.text_b is not None]
  encoded_b = dict(zip(pair_indices,
                       batching.encode_in_chunks(tok, [examples[i].text_b for i in pair_indices])))

  input_ids = np.full((n, max_seq_length), tok.pad_id, np.int32)
  segment_ids = np.zeros((n, max_seq_length), np.int32)
  input_mask = np.zeros((n, max_seq_length), np.int32)
  labels = np.zeros(n, np.float32 if label_map is None else np.int32)
  num_truncated = 0
  for i, example in enumerate(examples):
    ids, segs, cut = pack_pair(encoded_a[i], encoded_b.get(i), tok, max_seq_length)
    num_truncated += cut
    input_ids[i, :len(ids)] = ids
    segment_ids[i, :len(ids)] = segs
    input_mask[i, :len(ids)] = 1
    if example.label is None:
      labels[i] = -1 if label_map is not None else np.nan
    elif label_map is None:
      labels[i] = float(example.label)
    else:
      if example.label not in label_map:
        raise ValueError(f'example {example.guid}: label {example.label!r} not in {label_list}')
      labels[i] = label_map[example.label]
  if num_truncated:
    logging.warning('GLUE features: truncated %d of %d examples to max_seq_length=%d',
                    num_truncated, n, max_seq_length)
  return {'input_ids': input_ids, 'input_mask': input_mask, 'segment_ids': segment_ids,
          'label': labels, 'example_index': np.arange(n, dtype=np.int32)}


# ---------------------------------------------------------------------------------------------
# Submission files
# ---------------------------------------------------------------------------------------------


def write_predictions(task: str, predictions, output_dir: str, split: str = 'test',
                      indices: Sequence[int] | None = None) -> str:
  """Writes a GLUE leaderboard file (`CoLA.tsv`, ..., `MNLI-m.tsv`, `AX.tsv`), or for a dev
  split `<split>.tsv` in the same layout (`dev.tsv`, MNLI's `dev_matched.tsv`); returns its path.

  Args:
    task: the task; 'mnli-m'/'mnli-mm' (or task 'mnli' with split 'test_matched'/
      'test_mismatched') pick the MNLI file.
    predictions: label ids [N], logits [N, C], label strings, or scores (STS-B), in test-file
      order.
    output_dir: created if missing.
    split: the test split (MNLI: 'test_matched' or 'test_mismatched'), or a dev split.
    indices: the test file's index of each prediction; default 0..N-1 (GLUE's test indices).
  """
  canonical = metrics.canonical_task(task)
  name, spec = _task(task)
  if canonical == 'mnli_mismatched':
    split = 'test_mismatched'
  split = _split(name, spec, split)
  if split not in spec.submission and not split.startswith('dev'):
    raise ValueError(f'no GLUE submission file for {name} split {split!r}')
  if spec.labels is None:
    values = np.asarray(predictions, np.float64).reshape(-1)
    lines = [f'{v:.3f}' for v in values]
  elif len(predictions) and isinstance(predictions[0], str):
    lines = list(predictions)
    bad = [p for p in lines if p not in spec.labels]
    if bad:
      raise ValueError(f'{name}: predicted labels {sorted(set(bad))} not in {list(spec.labels)}')
  else:
    ids = np.asarray(predictions)
    ids = ids.argmax(-1) if ids.ndim == 2 else ids.astype(np.int64)
    if ids.size and (ids.min() < 0 or ids.max() >= len(spec.labels)):
      raise ValueError(f'{name}: label ids must be in [0, {len(spec.labels)})')
    lines = [spec.labels[i] for i in ids]
  if not lines:
    raise ValueError(f'{name}: no predictions to write')
  indices = range(len(lines)) if indices is None else list(indices)
  if len(indices) != len(lines):
    raise ValueError(f'{len(indices)} indices for {len(lines)} predictions')
  path = os.path.join(output_dir, spec.submission.get(split, f'{split}.tsv'))
  fileio.write_text(path, 'index\tprediction\n' + ''.join(
      f'{i}\t{p}\n' for i, p in zip(indices, lines)))
  return path


# ---------------------------------------------------------------------------------------------
# The fine-tuning task
# ---------------------------------------------------------------------------------------------


# The headline metric of each task in the paper (others: accuracy).
MAIN_METRIC = {'cola': 'mcc', 'stsb': 'spearman', 'mrpc': 'f1', 'qqp': 'f1'}


def accepts(task: str) -> bool:
  """Whether config.task.name names a GLUE task."""
  try:
    metrics.canonical_task(task)
  except ValueError:
    return False
  return True


def make_task(config: ml_collections.ConfigDict, tok, bert_config: model_lib.BertConfig,
              lower_case: bool) -> tasks.Task:
  """The GLUE task `config.task.name` (finetune_glue.py's keys): data, classifier, loss, scoring."""
  del lower_case  # The tokenizer's.
  name = metrics.canonical_task(config.task.name)
  if name in ('mnli_matched', 'mnli_mismatched'):
    name = 'mnli'
  if name == 'ax':
    raise UserError("config.task.name='ax' is test-only: fine-tune 'mnli' with "
                    'config.eval.predict_test=True, which also writes AX.tsv')
  label_list, metric_names = task_info(name)
  # task.data_source: 'tsv' or 'tfds' (config_checks.CHOICES, checked where the config loads).
  if config.task.data_source == 'tsv':
    if not config.task.data_dir:
      raise UserError('config.task.data_dir is empty: the GLUE root (holding CoLA/, MRPC/, ...)')
    fileio.check_input_dir(config.task.data_dir, 'config.task.data_dir')
    read = lambda task, split: read_task(task, config.task.data_dir, split)
  else:
    read = lambda task, split: read_tfds(task, split, config.data.tfds_data_dir or None)

  def convert_split(task, split):
    return convert_examples(read(task, split), tok, config.data.max_seq_length,
                            label_list)

  regression = label_list is None

  def file_indices(examples):
    ids = [e.guid.split('-', 1)[1] for e in examples]
    return [int(i) for i in ids] if all(i.isdigit() for i in ids) else None

  def dev_set(split, metric_task):
    examples = read(name, split)
    feats = convert_examples(examples, tok, config.data.max_seq_length, label_list)
    labels, indices = feats['label'], file_indices(examples)

    def evaluate(rows):
      out = np.stack(rows)
      preds = out[:, 0] if regression else out
      # The best epoch's dev predictions (predictions/dev.tsv), for an error analysis.
      return (metrics.glue_metrics(metric_task, preds, labels),
              lambda d: write_predictions(name, preds, d, split, indices))
    return tasks.EvalSet(split, tasks.subset(feats, tasks.INPUTS), evaluate)

  def test_set(task, split):
    examples = read(task, split)
    feats = convert_examples(examples, tok, config.data.max_seq_length, label_list)
    indices = file_indices(examples)

    def evaluate(rows):
      out = np.stack(rows)
      preds = out[:, 0] if regression else out
      return None, lambda d: write_predictions(task, preds, d, split, indices)
    return tasks.EvalSet(f'{task}_{split}' if task == 'ax' else split,
                         tasks.subset(feats, tasks.INPUTS), evaluate)

  if name == 'mnli':
    dev = [dev_set('dev_matched', 'mnli'), dev_set('dev_mismatched', 'mnli_mismatched')]
  else:
    dev = [dev_set('dev', name)]
  test = []
  if config.eval.predict_test:
    splits = ['test_matched', 'test_mismatched'] if name == 'mnli' else ['test']
    test = [test_set(name, s) for s in splits]
    diagnostic = os.path.join(config.task.data_dir, 'diagnostic', 'diagnostic.tsv')
    if name == 'mnli' and (config.task.data_source == 'tfds' or fileio.exists(diagnostic)):
      test.append(test_set('ax', 'test'))
  num_labels = 1 if regression else len(label_list)
  train = convert_split(name, 'train')
  return tasks.Task(
      kind='glue', head='sequence',
      model=model_lib.BertForSequenceClassification(bert_config, num_labels=num_labels),
      loss_fn=tasks.regression_loss if regression else tasks.classification_loss,
      label_keys=('label',),
      train=tasks.subset(train, tasks.INPUTS + ('label',)), dev=dev, test=test,
      main_metric=MAIN_METRIC.get(name, 'accuracy'), metric_names=metric_names,
      info={'task': name, 'labels': label_list})


# ---------------------------------------------------------------------------------------------
# New inputs (`bert-jax predict`)
# ---------------------------------------------------------------------------------------------


def read_jsonl(path: str) -> list[Example]:
  """Unlabelled examples of a JSONL file: {"text_a", "text_b"} per line (also "sentence",
  "sentence1", "question" for the first text and "sentence2" for the second)."""
  examples = []
  for number, row in fileio.read_jsonl_objects(path):
    a = next((row[k] for k in ('text_a', 'sentence', 'sentence1', 'question') if k in row), None)
    if not isinstance(a, str):
      raise UserError(f'{path}:{number}: no "text_a" (or "sentence", "sentence1") string')
    b = next((row[k] for k in ('text_b', 'sentence2') if k in row), None)
    examples.append(Example(f'input-{len(examples)}', a, b, None))
  if not examples:
    raise UserError(f'{path}: no examples')
  return examples


def prediction(input_path: str, input_format: str, tok, bert_config: model_lib.BertConfig,
               info: dict, run: ml_collections.ConfigDict, lower_case: bool) -> tasks.Prediction:
  """`bert-jax predict` on a TSV in the layout of the task's dev or test file, or JSONL
  (`read_jsonl`; 'auto': by the .jsonl suffix): JSONL out, a row's label and every label's
  probability (STS-B: its score); GLUE's metrics when every row has a label."""
  del run, lower_case
  if input_format == 'auto':
    input_format = 'jsonl' if input_path.endswith('.jsonl') else 'tsv'
  examples = (read_jsonl(input_path) if input_format == 'jsonl'
              else read_file(info['task'], input_path))
  labels = info['labels']
  features = convert_examples(examples, tok, int(info['max_seq_length']), labels)
  regression = labels is None

  def finish(rows, output_path):
    logits = np.stack(rows)
    if regression:
      lines = [{'index': i, 'score': float(s)} for i, s in enumerate(logits[:, 0])]
    else:
      probs = np.asarray(jax.nn.softmax(logits.astype(np.float32), axis=-1))
      lines = [{'index': i, 'label': labels[int(np.argmax(p))],
                'probabilities': {l: float(q) for l, q in zip(labels, p)}}
               for i, p in enumerate(probs)]
    fileio.write_text(output_path, ''.join(json.dumps(l) + '\n' for l in lines))
    scores = None
    if all(e.label is not None for e in examples):
      scores = metrics.glue_metrics(info['task'], logits[:, 0] if regression else logits,
                                    features['label'])
    return scores, {}
  model = model_lib.BertForSequenceClassification(
      bert_config, num_labels=1 if regression else len(labels))
  return tasks.Prediction(input_format, len(examples), model, 'sequence',
                          tasks.subset(features, tasks.INPUTS), finish)
