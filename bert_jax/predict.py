"""A fine-tuned model on new inputs: `bert-jax predict --workdir=FINETUNED --input --output`.

The workdir says what it is (task.json, config.json, tokenizer_config.json) and holds the best
epoch's weights. Sentence-pair classification and regression (GLUE): the input is a TSV file
in the layout of the task's dev file (labels: metrics are reported) or test file, or JSONL of
{"text_a": ..., "text_b": ...} (also "sentence" / "sentence1" / "sentence2"); the output is
JSONL, one object per input row, with the label and every label's probability (STS-B: the
score).
"""

import json
from typing import Any

import jax
import numpy as np

from bert_jax import checkpoint as ckpt_lib
from bert_jax import fileio
from bert_jax import glue
from bert_jax import metrics
from bert_jax import model as model_lib
from bert_jax.errors import UserError


def _jsonl_examples(path: str) -> list[glue.Example]:
  examples = []
  for number, line in enumerate(fileio.read_text(path).split('\n'), 1):
    if not line.strip():
      continue
    try:
      row = json.loads(line)
    except json.JSONDecodeError as e:
      raise UserError(f'{path}:{number}: not valid JSON: {e.msg}') from None
    a = next((row[k] for k in ('text_a', 'sentence', 'sentence1', 'question') if k in row), None)
    if not isinstance(a, str):
      raise UserError(f'{path}:{number}: no "text_a" (or "sentence", "sentence1") string')
    b = next((row[k] for k in ('text_b', 'sentence2') if k in row), None)
    examples.append(glue.Example(f'input-{len(examples)}', a, b, None))
  if not examples:
    raise UserError(f'{path}: no examples')
  return examples


def predict(workdir: str, input_path: str, output_path: str, batch_size: int = 64
            ) -> dict[str, Any]:
  """Writes the predictions of `input_path` to `output_path`; returns {'examples', 'output'}
  and, for a labelled input, 'metrics' (computed as `finetune` does on dev)."""
  from bert_jax import finetune  # pylint: disable=g-import-not-at-top  (TensorFlow)
  task_path = f'{workdir}/task.json'
  if not fileio.exists(task_path):
    raise UserError(f'--workdir={workdir} has no task.json: not a bert_jax fine-tuning workdir')
  info = ckpt_lib.read_json(task_path)
  if info['kind'] != 'glue':
    raise UserError(f'--workdir={workdir} is a {info["kind"]} model; bert-jax predict handles '
                    'GLUE-style classification and regression models so far')
  if not fileio.exists(input_path):
    raise UserError(f'--input={input_path}: no such file')
  if batch_size < 1:
    raise UserError(f'--batch_size={batch_size} must be at least 1')
  config, params, tok, _, _ = finetune.load_checkpoint(workdir, flag='--workdir')
  labels = info['labels']
  if input_path.endswith('.jsonl'):
    examples = _jsonl_examples(input_path)
  else:
    examples = glue.read_file(info['task'], input_path)
  features = glue.convert_examples(examples, tok, int(info['max_seq_length']), labels)
  regression = labels is None
  model = model_lib.BertForSequenceClassification(
      config.replace(dtype='float32', scan_layers=False),
      num_labels=1 if regression else len(labels))
  apply = jax.jit(model.apply)
  outputs = []
  for start in range(0, len(examples), batch_size):
    rows = slice(start, start + batch_size)
    outputs.append(np.asarray(apply({'params': params}, features['input_ids'][rows],
                                    features['input_mask'][rows],
                                    features['segment_ids'][rows])))
  logits = np.concatenate(outputs)
  lines = []
  if regression:
    scores = logits[:, 0]
    lines = [{'index': i, 'score': float(s)} for i, s in enumerate(scores)]
  else:
    probs = np.asarray(jax.nn.softmax(logits, axis=-1))
    for i, p in enumerate(probs):
      lines.append({'index': i, 'label': labels[int(np.argmax(p))],
                    'probabilities': {l: float(q) for l, q in zip(labels, p)}})
  fileio.write_text(output_path, ''.join(json.dumps(l) + '\n' for l in lines))
  result: dict[str, Any] = {'examples': len(examples), 'output': output_path}
  if all(e.label is not None for e in examples):
    scores = metrics.glue_metrics(info['task'], logits[:, 0] if regression else logits,
                                  features['label'])
    result['metrics'] = {k: float(v) for k, v in scores.items()}
  return result
