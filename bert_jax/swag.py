"""SWAG and other multiple-choice sets: each choice scored on its own, a softmax over the choices.

SWAG (Zellers et al., 2018; BERT paper section 4.4) gives a context sentence and four possible
continuations. Each choice is one sequence, '[CLS] context [SEP] start ending [SEP]' (start: the
second sentence's opening words, which every ending continues), the pooled output of each gets
one score from a dense layer, and a softmax over the example's choices is trained with
cross-entropy: transformers' `BertForMultipleChoice`, whose weights (`bert.*`, `classifier.*`)
load and export under the same names. An example's choices stay together in one batch, as
[N, C, L] features that `batching` cuts to the bucket of the longest choice; the model runs them
as N*C rows of the encoder's batch.

Data (config.task.data_dir): SWAG's release, `train.csv`, `val.csv`, `test.csv` (columns `sent1`,
`sent2`, `ending0`..`ending3`, `label`; the test file has no labels), or JSONL for any n-way
choice set, `train.jsonl`, `dev.jsonl` (or `val.jsonl`), `test.jsonl`, one example per line:
{"context": "...", "start": "...", "endings": ["...", ...], "label": 0} ("start" and "label"
optional; every example of a file has the same number of endings). Scores: accuracy. Outputs
(`predictions/<set>.jsonl`, `bert-jax predict`): per example its index, the chosen ending
(`label`: its position; `ending`: its text) and every choice's probability.
"""

import csv
import dataclasses
import io
import json
import os
from typing import Sequence

from absl import logging
import jax
import ml_collections
import numpy as np

from bert_jax import batching
from bert_jax import fileio
from bert_jax import glue
from bert_jax import model as model_lib
from bert_jax import tasks
from bert_jax.errors import UserError


@dataclasses.dataclass(frozen=True)
class Example:
  """One multiple-choice example; `label` is the right ending's position (None: unknown)."""
  guid: str
  context: str
  start: str
  endings: tuple[str, ...]
  label: int | None


class BertForMultipleChoice(model_lib.BertForSequenceClassification):
  """[B, C, L] inputs -> [B, C] scores: every choice is a row of the encoder's batch, and the
  sequence classifier with one output scores it (transformers' `BertForMultipleChoice`)."""
  num_labels: int = 1

  def __call__(self, input_ids, input_mask, segment_ids, deterministic: bool = True):
    rows = lambda x: x.reshape(-1, x.shape[-1])
    scores = super().__call__(rows(input_ids), rows(input_mask), rows(segment_ids),
                              deterministic)
    return scores.reshape(input_ids.shape[:-1])


# ---------------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------------


def _label(value, choices: int, where: str) -> int:
  """The position of the right ending: an int (JSON) or digits (CSV) in [0, choices)."""
  if isinstance(value, str) and value.strip().isdigit():
    value = int(value)
  if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < choices:
    raise UserError(f'{where}: label {value!r} is not a choice: expected 0 to {choices - 1}')
  return value


def read_csv(path: str) -> list[Example]:
  """Examples of a SWAG CSV file: a header with `sent1`, `sent2`, `ending0`, `ending1`, ...
  and, in labelled files, `label` (an empty label reads as unknown)."""
  text = fileio.read_user_text(path)
  rows = csv.reader(io.StringIO(text, newline=''))
  header = next(rows, None)
  if not header:
    raise UserError(f'{path}: empty file (expected a header line: sent1,sent2,ending0,...)')
  missing = [c for c in ('sent1', 'sent2', 'ending0', 'ending1') if c not in header]
  if missing:
    raise UserError(f'{path}: header (line 1) has no column {missing[0]!r}; it has {header}')
  endings = []
  while f'ending{len(endings)}' in header:
    endings.append(header.index(f'ending{len(endings)}'))
  # A misspelt or out-of-sequence ending column ('ending_3', 'Ending3', 'ending5' after
  # ending3) would silently drop that choice, and the task would train with fewer.
  stray = [c for c in header if 'ending' in c.lower() and header.index(c) not in endings]
  if stray:
    raise UserError(f'{path}: header (line 1) has column {stray[0]!r} besides '
                    f'ending0..ending{len(endings) - 1}: name the choices ending0, ending1, ... '
                    'in sequence (otherwise that choice is left out)')
  sent1, sent2 = header.index('sent1'), header.index('sent2')
  label = header.index('label') if 'label' in header else None
  examples = []
  for row in rows:
    where = f'{path}:{rows.line_num}'
    if not row:
      continue
    if len(row) != len(header):
      raise UserError(f'{where}: {len(row)} columns where the header has {len(header)}')
    value = row[label] if label is not None else ''
    examples.append(Example(
        f'{len(examples)}', row[sent1], row[sent2], tuple(row[i] for i in endings),
        _label(value, len(endings), where) if value != '' else None))
  if not examples:
    raise UserError(f'{path}: no examples (the file has a header only)')
  logging.info('%s: %d examples of %d choices', path, len(examples), len(endings))
  return examples


def read_jsonl(path: str) -> list[Example]:
  """Examples of a JSONL file: {"context", "endings": [...], "start" (optional), "label"
  (optional)} per line, every line with the same number of endings (2 or more)."""
  examples, choices = [], None
  for number, row in fileio.read_jsonl_objects(path):
    where = f'{path}:{number}'
    context, start, endings = row.get('context'), row.get('start', ''), row.get('endings')
    if not isinstance(context, str) or not isinstance(start, str):
      raise UserError(f'{where}: "context" (and "start", if given) must be strings')
    if (not isinstance(endings, list) or len(endings) < 2
        or not all(isinstance(e, str) for e in endings)):
      raise UserError(f'{where}: "endings" must be a list of 2 or more strings')
    if choices is None:
      choices = len(endings)
    elif len(endings) != choices:
      raise UserError(f'{where}: {len(endings)} endings where earlier lines have {choices}')
    label = row.get('label')
    examples.append(Example(str(row.get('id', len(examples))), context, start, tuple(endings),
                            None if label is None else _label(label, choices, where)))
  if not examples:
    raise UserError(f'{path}: no examples')
  logging.info('%s: %d examples of %d choices', path, len(examples), choices)
  return examples


def read_file(path: str, input_format: str = 'auto') -> tuple[list[Example], str]:
  """Examples and the format read: 'csv' (SWAG's), 'jsonl', or 'auto' (by the .jsonl suffix)."""
  if input_format == 'auto':
    input_format = 'jsonl' if path.endswith('.jsonl') else 'csv'
  return (read_jsonl(path) if input_format == 'jsonl' else read_csv(path)), input_format


# ---------------------------------------------------------------------------------------------
# Features and outputs
# ---------------------------------------------------------------------------------------------


def convert_examples(examples: Sequence[Example], tok,
                     max_seq_length: int) -> dict[str, np.ndarray]:
  """'[CLS] context [SEP] start ending [SEP]' per choice, truncated as the original truncates
  pairs (the longer side first). Returns int32 input_ids, input_mask, segment_ids [N, C, L],
  label [N] (-1: unknown) and example_index [N]."""
  if not examples:
    raise ValueError('convert_examples: no examples')
  if max_seq_length < 4:
    raise UserError(f'max_seq_length={max_seq_length} leaves no room for text')
  n, choices = len(examples), len(examples[0].endings)
  contexts = batching.encode_in_chunks(tok, [e.context for e in examples])
  seconds = batching.encode_in_chunks(
      tok, [f'{e.start} {ending}'.strip() for e in examples for ending in e.endings])
  input_ids = np.full((n, choices, max_seq_length), tok.pad_id, np.int32)
  segment_ids = np.zeros((n, choices, max_seq_length), np.int32)
  input_mask = np.zeros((n, choices, max_seq_length), np.int32)
  num_truncated = 0
  for i, example in enumerate(examples):
    if len(example.endings) != choices:
      raise ValueError(f'example {example.guid}: {len(example.endings)} choices, the first '
                       f'has {choices}')
    for c in range(choices):
      ids, segs, cut = glue.pack_pair(contexts[i], seconds[i * choices + c], tok,
                                      max_seq_length)
      num_truncated += cut
      input_ids[i, c, :len(ids)] = ids
      segment_ids[i, c, :len(ids)] = segs
      input_mask[i, c, :len(ids)] = 1
  if num_truncated:
    logging.warning('Multiple-choice features: truncated %d of %d sequences to '
                    'max_seq_length=%d', num_truncated, n * choices, max_seq_length)
  labels = np.array([-1 if e.label is None else e.label for e in examples], np.int32)
  return {'input_ids': input_ids, 'input_mask': input_mask, 'segment_ids': segment_ids,
          'label': labels, 'example_index': np.arange(n, dtype=np.int32)}


def choose(examples: Sequence[Example], rows: Sequence[np.ndarray]
           ) -> tuple[list[dict], dict | None]:
  """Every example's chosen ending and choice probabilities from its scores `rows` [C], and
  accuracy when every example has a label (else None)."""
  scores = np.stack(rows).astype(np.float32)
  probs = np.asarray(jax.nn.softmax(scores, axis=-1))
  chosen = scores.argmax(-1)
  lines = [{'index': i, 'id': e.guid, 'label': int(k), 'ending': e.endings[k],
            'probabilities': [float(p) for p in q]}
           for i, (e, k, q) in enumerate(zip(examples, chosen, probs))]
  if any(e.label is None for e in examples):
    return lines, None
  gold = np.array([e.label for e in examples])
  return lines, {'accuracy': float(np.mean(chosen == gold)), 'examples': len(examples)}


def write_jsonl(path: str, lines: Sequence[dict]) -> None:
  fileio.write_text(path, ''.join(json.dumps(line) + '\n' for line in lines))


# ---------------------------------------------------------------------------------------------
# The fine-tuning task
# ---------------------------------------------------------------------------------------------

# config.task.name values: SWAG, and any other set in SWAG's or the JSONL layout.
_NAMES = ('swag', 'multiple_choice')


def accepts(task: str) -> bool:
  """Whether config.task.name names this task."""
  return task.lower().replace('-', '_') in _NAMES


def _split_file(data_dir: str, split: str) -> str:
  """The file of a split: SWAG's CSV or JSONL (dev: val.* as SWAG names it, or dev.*)."""
  stems = ('val', 'dev') if split == 'dev' else (split,)
  names = [f'{stem}.{ext}' for ext in ('csv', 'jsonl') for stem in stems]
  found = [n for n in names if fileio.isfile(os.path.join(data_dir, n))]
  if len(found) > 1:
    raise UserError(f'config.task.data_dir={data_dir}: {" and ".join(found)} are both {split} '
                    'files; keep one')
  if not found:
    raise UserError(f'config.task.data_dir={data_dir}: no {split} file ({" or ".join(names)})')
  return os.path.join(data_dir, found[0])


def make_task(config: ml_collections.ConfigDict, tok, bert_config: model_lib.BertConfig,
              lower_case: bool) -> tasks.Task:
  """The multiple-choice task of `config` (finetune_swag.py's keys): accuracy on dev."""
  del lower_case  # The tokenizer's.
  if not config.task.data_dir:
    raise UserError('config.task.data_dir is empty: the folder of train.csv, val.csv, test.csv '
                    '(or train.jsonl, dev.jsonl, test.jsonl)')
  fileio.check_input_dir(config.task.data_dir, 'config.task.data_dir')
  max_seq_length = config.data.max_seq_length

  def read(split, labelled):
    path = _split_file(config.task.data_dir, split)
    examples, _ = read_file(path)
    unlabelled = next((e for e in examples if e.label is None), None)
    if labelled and unlabelled:
      raise UserError(f'{path}: example {unlabelled.guid} has no label; every {split} example '
                      'needs one')
    return examples

  def eval_set(name, labelled):
    examples = read(name, labelled)
    features = convert_examples(examples, tok, max_seq_length)

    def evaluate(rows):
      lines, scores = choose(examples, rows)
      return scores, lambda d: write_jsonl(os.path.join(d, f'{name}.jsonl'), lines)
    return tasks.EvalSet(name, tasks.subset(features, tasks.INPUTS), evaluate)

  train_examples = read('train', labelled=True)
  dev = [eval_set('dev', labelled=True)]  # Its accuracy picks the best epoch.
  test = [eval_set('test', labelled=False)] if config.eval.predict_test else []
  train = convert_examples(train_examples, tok, max_seq_length)
  return tasks.Task(
      kind='swag', head='sequence', model=BertForMultipleChoice(bert_config),
      loss_fn=tasks.classification_loss, label_keys=('label',),
      train=tasks.subset(train, tasks.INPUTS + ('label',)), dev=dev, test=test,
      main_metric='accuracy', metric_names=('accuracy',),
      info={'task': config.task.name, 'choices': len(train_examples[0].endings)})


def prediction(input_path: str, input_format: str, tok, bert_config: model_lib.BertConfig,
               info: dict, run: ml_collections.ConfigDict, lower_case: bool) -> tasks.Prediction:
  """`bert-jax predict` on SWAG CSV or JSONL (`read_file`; any number of choices): JSONL out,
  each example's chosen ending and choice probabilities; accuracy when every row has a label."""
  del run, lower_case
  examples, input_format = read_file(input_path, input_format)
  features = convert_examples(examples, tok, int(info['max_seq_length']))

  def finish(rows, output_path):
    lines, scores = choose(examples, rows)
    write_jsonl(output_path, lines)
    return scores, {}
  return tasks.Prediction(input_format, len(examples), BertForMultipleChoice(bert_config),
                          'sequence', tasks.subset(features, tasks.INPUTS), finish)
