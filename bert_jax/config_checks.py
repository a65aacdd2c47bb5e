"""The valid range of every numeric config key, checked once where a config is loaded.

`RANGES` is the table: key -> (test, what the value must be). A key that a config does not
have (pre-training versus fine-tuning, a task's own keys) is skipped, so one table serves every
job. A value out of range is a UserError naming the key as the user sets it
(`--config.train.learning_rate=-0.001: must be > 0`), before any data or model is built;
adding a key is one more row here and one more row in tests/inputs_test.py.
"""

import math
from typing import Any, Callable

import ml_collections

from bert_jax.errors import UserError

Check = tuple[Callable[[Any, ml_collections.ConfigDict], bool], str]


def _number(value) -> bool:
  return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _integer(value) -> bool:
  return _number(value) and float(value) == int(value)


def positive() -> Check:
  return (lambda v, c: _number(v) and v > 0), 'must be a number > 0'


def at_least(low: int) -> Check:
  return (lambda v, c: _integer(v) and v >= low), f'must be an integer >= {low}'


def fraction(*, open_low: bool = False, open_high: bool = False) -> Check:
  """A number in [0, 1], with either end excluded."""
  def test(v, c):
    return (_number(v) and (v > 0 if open_low else v >= 0) and
            (v < 1 if open_high else v <= 1))
  return test, f'must lie in {"(" if open_low else "["}0, 1{")" if open_high else "]"}'


def non_negative() -> Check:
  return (lambda v, c: _number(v) and v >= 0), 'must be a number >= 0'


def mesh_size() -> Check:
  return (lambda v, c: _integer(v) and (v >= 1 or v == -1)), \
      'must be a positive integer, or -1 for "all remaining devices"'


def _every_steps(v, c) -> bool:
  # Fine-tuning saves after each epoch anyway (0 = only then); pre-training needs a period.
  return _integer(v) and v >= (0 if 'task' in c else 1)


RANGES: dict[str, Check] = {
    # Model.
    'model.vocab_size': at_least(0),  # 0 = from the vocabulary file.
    'model.max_position_embeddings': at_least(1),
    'model.type_vocab_size': at_least(1),
    'model.hidden_dropout_prob': fraction(open_high=True),
    'model.attention_probs_dropout_prob': fraction(open_high=True),
    # Pre-training input.
    'data.vocab_size': at_least(8),
    'data.max_seq_length': at_least(8),  # [CLS] A [SEP] B [SEP] with room for words.
    'data.max_predictions_per_seq': at_least(1),
    'data.masked_lm_prob': fraction(open_low=True, open_high=True),
    'data.short_seq_prob': fraction(),
    'data.packing_max_sequences': at_least(1),
    'data.packing_window': at_least(1),
    'data.shuffle_buffer': at_least(1),
    'data.docs_per_batch': at_least(1),
    'data.seed': at_least(0),
    # Fine-tuning input.
    'max_query_length': at_least(1),
    'doc_stride': at_least(1),
    'max_answer_length': at_least(1),
    'n_best_size': at_least(1),
    # Optimization.
    'train.steps': at_least(1),
    'train.epochs': positive(),
    'train.stop_at_step': at_least(0),
    'train.batch_size': at_least(1),
    'train.grad_accum_steps': at_least(1),
    'train.length_sort_window': at_least(1),
    'train.learning_rate': positive(),
    'train.warmup_steps': at_least(0),
    'train.warmup_proportion': fraction(open_high=True),
    'train.beta1': fraction(open_high=True),
    'train.beta2': fraction(open_high=True),
    'train.eps': positive(),
    'train.weight_decay': non_negative(),
    'train.max_grad_norm': non_negative(),  # 0 = no clipping.
    'train.seed': at_least(0),
    # Mesh.
    'mesh.data': mesh_size(),
    'mesh.fsdp': mesh_size(),
    'mesh.tensor': mesh_size(),
    # Checkpoints, evaluation, logging.
    'checkpoint.every_steps': (_every_steps, 'must be an integer >= 1 (fine-tuning: >= 0, '
                               '0 = only after each epoch)'),
    'checkpoint.keep': at_least(1),
    'eval.every_steps': at_least(1),
    'eval.steps': at_least(1),
    'eval.batch_size': at_least(1),
    'log.every_steps': at_least(1),
}


def _lookup(config: ml_collections.ConfigDict, key: str):
  node = config
  for part in key.split('.'):
    if not isinstance(node, ml_collections.ConfigDict) or part not in node:
      return False, None
    node = node[part]
  return True, node


def check_config(config: ml_collections.ConfigDict) -> None:
  """Raises a UserError naming the first key of RANGES whose value is out of its range."""
  for key, (test, wording) in RANGES.items():
    present, value = _lookup(config, key)
    if present and not test(value, config):
      raise UserError(f'--config.{key}={value!r}: {wording}')
