"""What a fine-tuning task is: its data, model head, loss and scoring.

Each task module (task_table.py lists them) builds its `Task` from a fine-tuning config with
`make_task`, and a `Prediction` of new inputs with `prediction`; `finetune.py` trains and
evaluates any `Task` the same way, `predict.py` runs any `Prediction`. Losses return sums and
counts (`train_state.Loss`), so padded rows and uneven batches average exactly. The
heads ('sequence', 'token', 'span') say what a prediction step returns per row.
"""

import dataclasses
from typing import Any, Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from bert_jax import objectives

# Model inputs of every task, in the order the models take them.
INPUTS = ('input_ids', 'input_mask', 'segment_ids')

# Heads of fine-tuning (model.py): our parameter group -> its (Hugging Face, Google) names, the
# latter those of the original's run_classifier.py (its output layer has no scope) and
# run_squad.py.
HEAD_NAMES = {'classifier': ('classifier', ''), 'qa_outputs': ('qa_outputs', 'cls/squad')}


@dataclasses.dataclass
class EvalSet:
  """A dev or test set: model inputs (+ `index`), and what to do with per-row outputs."""
  name: str
  features: dict[str, np.ndarray]
  # Outputs of every row in `index` order -> (metrics or None, writer(out_dir) or None).
  evaluate: Callable[[list[np.ndarray]], tuple[dict | None, Callable[[str], None] | None]]


@dataclasses.dataclass
class Prediction:
  """New inputs of `bert-jax predict`: model inputs (+ `index`), and what to do with outputs."""
  input_format: str  # The format read.
  examples: int
  model: nn.Module
  head: str
  features: dict[str, np.ndarray]
  # (Outputs of every row in `index` order, output path) -> (metrics, None when the input has
  # no labels; {name: path} of the files written beside the output).
  finish: Callable[[list[np.ndarray], str], tuple[dict | None, dict[str, str]]]


@dataclasses.dataclass
class Task:
  kind: str  # A key of task_table.KINDS, the task's module.
  head: str  # 'sequence', 'token', 'span': what the prediction step returns per row.
  # Named after the transformers class of the same head, which a Hugging Face export names.
  model: nn.Module
  loss_fn: Callable
  label_keys: tuple[str, ...]
  train: dict[str, np.ndarray]
  dev: list[EvalSet]
  test: list[EvalSet]
  main_metric: str
  metric_names: tuple[str, ...]
  info: dict


def apply(model: nn.Module, variables: dict[str, Any], batch: dict[str, jax.Array],
          deterministic: bool, rngs: dict[str, jax.Array] | None = None):
  """A task model on a batch's `INPUTS`, applied to `variables` (a training step's
  `train_state.model_variables`, or {'params': params})."""
  return model.apply(variables, *(batch[k] for k in INPUTS), deterministic=deterministic,
                     rngs=rngs)


def init_fn(model: nn.Module) -> Callable[[jax.Array], dict[str, Any]]:
  """rng -> the variables of a task model (boxed parameters, and FP8 scales when it has
  them), for `train_state.abstract_state`."""
  ids = jnp.zeros((1, 8), jnp.int32)
  return lambda rng: model.init({'params': rng}, ids, ids, ids, deterministic=True)


def train_apply(model: nn.Module):
  """A task model in training mode (dropout on), as `train_state.step` applies it."""
  return lambda variables, batch, rng: apply(model, variables, batch, False, {'dropout': rng})


def predict_step(params: Any, batch: dict[str, jax.Array], *, model: nn.Module,
                 head: str) -> dict[str, jax.Array]:
  """Outputs per row: logits [B, C] ('sequence'), tag ids [B, L] ('token'), or start and end
  logits [B, 2, L] ('span'); with the row's index and weight."""
  outputs = apply(model, {'params': params}, batch, True)
  if head == 'span':
    outputs = jnp.stack(outputs, axis=1)
  elif head == 'token':
    outputs = jnp.argmax(outputs, axis=-1).astype(jnp.int32)
  return {'outputs': outputs, 'index': batch['index'], 'weight': batch['weight']}


def subset(features: dict, keys: Sequence[str], index_key: str | None = None) -> dict:
  out = {k: features[k] for k in keys}
  n = len(features['input_ids'])
  out['index'] = (np.asarray(features[index_key], np.int32) if index_key
                  else np.arange(n, dtype=np.int32))
  return out


def rate_counts(batch: dict[str, jax.Array]) -> tuple[jax.Array, jax.Array]:
  """(sequences, real tokens) of a batch, for the rates in metrics.jsonl: its rows of weight
  1, each of a multiple-choice row's choices a sequence of its own, and their non-padding
  tokens (`train_state.with_rate_counts`)."""
  shape = batch['input_ids'].shape
  weight = batch['weight'].astype(jnp.float32)
  sequences = jnp.sum(weight) * float(np.prod(shape[1:-1]))
  mask = batch['input_mask'].astype(jnp.float32).reshape(shape[0], -1)
  return sequences, jnp.sum(mask * weight[:, None])


# ---------------------------------------------------------------------------------------------
# Losses, in the convention of every objective and task (`train_state.Loss`): (sums, counts,
# metrics); the logged 'loss' is the normalized training loss, as in pre-training.
# ---------------------------------------------------------------------------------------------


def classification_loss(logits, batch):
  """Cross-entropy of each row's label, over the real rows (weight 1)."""
  w = batch['weight']
  n = jnp.sum(w)
  total = jnp.sum(objectives.nll(logits, batch['label']) * w)
  correct = jnp.sum((jnp.argmax(logits, -1) == batch['label']) * w)
  return {'classification': total}, {'classification': n}, {'accuracy': (correct, n)}


def regression_loss(logits, batch):
  """Squared error of each row's score (STS-B), over the real rows."""
  w = batch['weight']
  n = jnp.sum(w)
  se = jnp.sum(jnp.square(logits[:, 0] - batch['label']) * w)
  return {'regression': se}, {'regression': n}, {}


def token_loss(logits, batch):
  """Cross-entropy on labelled positions (first word pieces); -1 labels are ignored."""
  w = (batch['labels'] >= 0) * batch['weight'][:, None]
  n = jnp.sum(w)
  total = jnp.sum(objectives.nll(logits, batch['labels']) * w)
  correct = jnp.sum((jnp.argmax(logits, -1) == batch['labels']) * w)
  return {'token': total}, {'token': n}, {'accuracy': (correct, n)}


def span_loss(outputs, batch):
  """Mean of the start and end cross-entropies over the window's real tokens.

  Padding positions are masked out of the softmax, so a window's loss does not depend on the
  bucket it was batched in.
  """
  start, end = outputs
  valid = batch['input_mask'].astype(bool)
  very_negative = jnp.finfo(jnp.float32).min
  start = jnp.where(valid, start.astype(jnp.float32), very_negative)
  end = jnp.where(valid, end.astype(jnp.float32), very_negative)
  w = batch['weight']
  n = jnp.sum(w)
  total = jnp.sum((objectives.nll(start, batch['start_positions']) +
                   objectives.nll(end, batch['end_positions'])) * w) / 2
  return {'span': total}, {'span': n}, {}
