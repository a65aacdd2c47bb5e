"""A fine-tuned model on new inputs: `bert-jax predict --workdir=FINETUNED --input --output`.

The workdir says what it is (task.json, config.json, tokenizer_config.json) and holds the best
epoch's weights. Inputs and outputs by task:

  GLUE (classification, regression): a TSV file in the layout of the task's dev or test file,
    or JSONL of {"text_a": ..., "text_b": ...} (also "sentence" / "sentence1" / "sentence2")
    -> JSONL, one object per input row: the label and every label's probability (STS-B: the
    score).
  SQuAD: a SQuAD-format JSON file -> JSON {question id: answer text} (the official evaluation
    script's input), and beside it <output>.nbest.json (the n best answers with probabilities)
    and, for SQuAD 2.0, <output>.null_odds.json (no-answer score minus best-span score).
  NER: CoNLL (a word per line, first column; blank lines between sentences; tags in the last
    column if any) or plain text (a sentence per non-blank line, split into words as BERT's
    basic tokenizer splits them: punctuation apart, so `U.S.` is 4 words) -> CoNLL: 'word gold
    predicted' lines (conlleval's input) for tagged input, 'word predicted' otherwise; a block
    per sentence (blank input lines have none).

An input with labels (GLUE labels, SQuAD answers, CoNLL tags) is also scored, with the same
features, batches, decoding and metrics as `finetune` scores its dev set, in the dtype the run
evaluated in: on the task's dev file the metrics are those the run reported for its best epoch
(exactly on the kind of machine the run evaluated on, where XLA computes the same logits; the
model runs on one device with XLA attention).
"""

import functools
import json
from typing import Any

import jax
import ml_collections
import numpy as np

from bert_jax import batching
from bert_jax import convert
from bert_jax import fileio
from bert_jax import glue
from bert_jax import metrics
from bert_jax import model as model_lib
from bert_jax import ner
from bert_jax import tasks
from bert_jax.errors import UserError

# What --input_format may be for each kind of model. 'auto' picks: GLUE: JSONL for a .jsonl
# file, else TSV; NER: by the content (ner.sniff_format).
FORMATS = {'glue': ('tsv', 'jsonl'), 'squad': ('squad',), 'ner': ('conll', 'text')}


def _jsonl_examples(path: str) -> list[glue.Example]:
  examples = []
  for number, line in enumerate(fileio.read_text(path).split('\n'), 1):
    if not line.strip():
      continue
    try:
      row = json.loads(line)
    except json.JSONDecodeError as e:
      raise UserError(f'{path}:{number}: not valid JSON: {e.msg}') from None
    if not isinstance(row, dict):
      raise UserError(f'{path}:{number}: expected a JSON object, got {type(row).__name__}')
    a = next((row[k] for k in ('text_a', 'sentence', 'sentence1', 'question') if k in row), None)
    if not isinstance(a, str):
      raise UserError(f'{path}:{number}: no "text_a" (or "sentence", "sentence1") string')
    b = next((row[k] for k in ('text_b', 'sentence2') if k in row), None)
    examples.append(glue.Example(f'input-{len(examples)}', a, b, None))
  if not examples:
    raise UserError(f'{path}: no examples')
  return examples


def _input_format(kind: str, input_path: str, requested: str) -> str:
  """The format to read; NER's 'auto' is decided by `ner.read_sentences` from the content."""
  allowed = FORMATS[kind]
  if requested == 'auto':
    if kind == 'glue':
      return 'jsonl' if input_path.endswith('.jsonl') else 'tsv'
    return 'auto' if kind == 'ner' else allowed[0]
  if requested not in allowed:
    raise UserError(f'--input_format={requested} does not fit a {kind} model: expected auto or '
                    f'one of {", ".join(allowed)}')
  return requested


def _beside(output_path: str, name: str) -> str:
  """<output without .json>.<name>.json: files that go with a SQuAD predictions file."""
  stem = output_path[:-len('.json')] if output_path.endswith('.json') else output_path
  return f'{stem}.{name}.json'


def predict(workdir: str, input_path: str, output_path: str, batch_size: int = 0,
            input_format: str = 'auto') -> dict[str, Any]:
  """Writes the predictions of `input_path` to `output_path` (see the module docstring).

  Args:
    workdir: a finished `bert-jax finetune` workdir.
    input_path, output_path: local or gs:// files.
    batch_size: examples (SQuAD: windows) per batch; 0 = the run's eval.batch_size, the
      batches its dev predictions were made in.
    input_format: 'auto' or one of FORMATS[kind].

  Returns:
    {'task', 'input_format' (as read), 'examples', 'output'} (+ 'files': the other files
    written), and 'metrics' for an input with labels.
  """
  from bert_jax import input_pipeline  # pylint: disable=g-import-not-at-top  (TensorFlow)
  from bert_jax import squad  # pylint: disable=g-import-not-at-top
  input_pipeline.hide_accelerators_from_tf()
  task_path = f'{workdir}/task.json'
  if not fileio.exists(task_path):
    raise UserError(f'--workdir={workdir} has no task.json: not a bert_jax fine-tuning workdir')
  if not fileio.exists(f'{workdir}/metrics.json'):
    raise UserError(f'--workdir={workdir} has no metrics.json: its fine-tuning run has not '
                    'finished (rerun its `bert-jax finetune` command to finish it)')
  info = fileio.read_json(task_path)
  run = ml_collections.ConfigDict(fileio.read_json(f'{workdir}/config.json'))
  kind = info['kind']
  if not fileio.isfile(input_path):
    raise UserError(f'--input={input_path}: no such file')
  if batch_size < 0:
    raise UserError(f'--batch_size={batch_size} must be positive (or 0: the run\'s '
                    'eval.batch_size)')
  batch_size = batch_size or int(run.eval.batch_size)
  input_format = _input_format(kind, input_path, input_format)
  bert_config, params, tok, _, lower_case = convert.load_checkpoint(workdir, flag='--workdir')
  # The dtype the run evaluated in (workdirs written before task.json recorded it: the config's,
  # resolved here); XLA attention, which runs anywhere.
  dtype = (info['compute_dtype'] if 'compute_dtype' in info
           else model_lib.resolve_dtype(run.model.dtype))
  bert_config = bert_config.replace(dtype=dtype, scan_layers=False, attention_impl='xla')
  max_seq_length = int(info['max_seq_length'])
  labels = info['labels'] if kind != 'squad' else None

  if kind == 'glue':
    examples = (_jsonl_examples(input_path) if input_format == 'jsonl'
                else glue.read_file(info['task'], input_path))
    features = glue.convert_examples(examples, tok, max_seq_length, labels)
    regression = labels is None
    model, head = model_lib.BertForSequenceClassification(
        bert_config, num_labels=1 if regression else len(labels)), 'sequence'
  elif kind == 'squad':
    examples = squad.read_squad(input_path, is_training=False)
    features = squad.convert_examples(
        examples, tok, max_seq_length=max_seq_length, doc_stride=run.doc_stride,
        max_query_length=run.max_query_length, is_training=False)
    model, head = model_lib.BertForQuestionAnswering(bert_config), 'span'
  else:
    examples, input_format = ner.read_sentences(input_path, input_format)
    features = ner.convert_sentences(examples, tok, max_seq_length, labels)
    model, head = model_lib.BertForTokenClassification(bert_config,
                                                       num_labels=len(labels)), 'token'

  step = jax.jit(functools.partial(tasks.predict_step, model=model, head=head))
  params = jax.device_put(params)
  index_key = None if kind == 'glue' else 'feature_index'
  rows = batching.predict_rows(lambda batch: step(params, batch),
                               tasks.subset(features, tasks.INPUTS, index_key),
                               batch_size, batching.parse_buckets(run.buckets))
  result: dict[str, Any] = {'task': info['task'], 'input_format': input_format,
                            'examples': len(examples), 'output': output_path}
  scores = None
  if kind == 'glue':
    logits = np.stack(rows)
    if regression:
      lines = [{'index': i, 'score': float(s)} for i, s in enumerate(logits[:, 0])]
    else:
      probs = np.asarray(jax.nn.softmax(logits.astype(np.float32), axis=-1))
      lines = [{'index': i, 'label': labels[int(np.argmax(p))],
                'probabilities': {l: float(q) for l, q in zip(labels, p)}}
               for i, p in enumerate(probs)]
    fileio.write_text(output_path, ''.join(json.dumps(l) + '\n' for l in lines))
    if all(e.label is not None for e in examples):
      scores = metrics.glue_metrics(info['task'], logits[:, 0] if regression else logits,
                                    features['label'])
  elif kind == 'squad':
    scores, answers, null_odds, nbest = squad.answers_and_scores(
        examples, features, rows, run, bool(info['version_2']), lower_case)
    fileio.write_text(output_path, json.dumps(answers, indent=2, ensure_ascii=False))
    files = {'nbest': _beside(output_path, 'nbest')}
    fileio.write_text(files['nbest'], json.dumps(nbest, indent=2, ensure_ascii=False))
    if null_odds is not None:
      files['null_odds'] = _beside(output_path, 'null_odds')
      fileio.write_text(files['null_odds'], json.dumps(null_odds, indent=2))
    result['files'] = files
  else:
    predicted, scores = ner.tags_and_scores(examples, features, rows, labels)
    ner.write_conll(output_path, examples, predicted)
  if scores is not None:
    result['metrics'] = fileio.json_safe(scores)
  return result
