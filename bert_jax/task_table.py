"""The fine-tuning tasks: one table from a kind of task to the module that implements it.

KINDS maps each kind to its module, `bert_jax.<kind>`, with what can be known of it without
importing it (which would load TensorFlow): the config.task.name values it takes, for errors,
and the formats `bert-jax predict --input_format` reads. Each module's docstring says its data,
head, loss and outputs; its config in configs/ sets config.task.name and adds the task's own keys
to config.task. Modules are imported when a task is
built, as big_vision picks its models by name.

`finetune`, `predict`, the command line and tests/imports_test.py reach a task only through
here. Every task module has the same parts:

  accepts(task)                  whether config.task.name is one of its tasks
  make_task(config, tok, bert_config, lower_case) -> tasks.Task
                                 reader, features, model (head) and loss; dev and test sets
                                 with their decoding, scores and output files
  prediction(input_path, input_format, tok, bert_config, info, run, lower_case)
      -> tasks.Prediction        `bert-jax predict`: reader, features, model, and the decoding,
                                 output files and scores of new inputs (info: the run's
                                 task.json; run: its config)

Adding a task: a module with these parts, an entry in KINDS, a test, and a config in configs/ that
starts from `defaults.finetune(task)` and adds the task's own keys to `config.task` inside
`with config.unlocked():` (the defaults are locked, so that a misspelt key is an error).
"""

from __future__ import annotations

import dataclasses
import importlib
import types
from typing import TYPE_CHECKING

import ml_collections

from bert_jax.errors import UserError

if TYPE_CHECKING:  # Types only: the table loads no JAX (`bert-jax predict` defines its flags).
  from bert_jax import model as model_lib
  from bert_jax import tasks


@dataclasses.dataclass(frozen=True)
class Kind:
  description: str  # The config.task.name values the module accepts, for errors.
  predict_formats: tuple[str, ...]  # What `bert-jax predict` reads besides 'auto'.
  # Files `bert-jax predict` may write beside --output, by name (<module>.beside_output).
  beside_output: tuple[str, ...] = ()


KINDS = {
    'glue': Kind('a GLUE task', ('tsv', 'jsonl')),
    'squad': Kind('squad_v1, squad_v2', ('squad',), ('nbest', 'null_odds')),
    'ner': Kind('ner', ('conll', 'text')),
    'swag': Kind('swag (or multiple_choice)', ('csv', 'jsonl')),
}


def module(kind: str) -> types.ModuleType:
  """The module of a kind of task (a key of KINDS)."""
  return importlib.import_module(f'bert_jax.{kind}')


def predict_formats() -> tuple[str, ...]:
  """Every format `bert-jax predict` reads, 'auto' (by the task and the file) first."""
  formats = ['auto']
  for kind in KINDS.values():
    formats.extend(f for f in kind.predict_formats if f not in formats)
  return tuple(formats)


def kind_of(task: str) -> str:
  """The kind of config.task.name: a key of KINDS (an unknown name is an error)."""
  for kind in KINDS:
    if module(kind).accepts(task):
      return kind
  descriptions = [kind.description for kind in KINDS.values()]
  raise UserError(f'config.task.name={task!r}: expected {", ".join(descriptions[:-1])} or '
                  f'{descriptions[-1]}')


def make_task(config: ml_collections.ConfigDict, tok, bert_config: model_lib.BertConfig,
              lower_case: bool) -> tasks.Task:
  """The task's data (tokenized), model, loss and scoring from a fine-tuning config."""
  task = module(kind_of(config.task.name)).make_task(config, tok, bert_config, lower_case)
  if config.eval.main_metric:
    if config.eval.main_metric not in task.metric_names:
      raise UserError(f'config.eval.main_metric={config.eval.main_metric!r} is not a metric of '
                      f'{config.task.name}: {list(task.metric_names)}')
    task.main_metric = config.eval.main_metric
  return task
