"""The fine-tuning tasks: one table from a kind of task to the module that implements it.

  kind   config.task (configs/)                module    head      loss (tasks.py)    predict
  glue   cola, sst2, mrpc, stsb, qqp, mnli,    glue.py   sequence  classification,    tsv, jsonl
         qnli, rte, wnli (finetune_glue.py)                        regression (STS-B)
  squad  squad_v1, squad_v2                    squad.py  span      span               squad
         (finetune_squad.py)
  ner    ner (finetune_ner.py)                 ner.py    token     token              conll, text

`finetune` and `predict` reach a task only through here. Every task module has the same parts:

  DESCRIPTION, PREDICT_FORMATS   its config.task names for errors; the formats `bert-jax
                                 predict --input_format` reads (besides 'auto')
  accepts(task)                  whether config.task names one of its tasks
  make_task(config, tok, bert_config, lower_case) -> tasks.Task
                                 reader, features, model (head) and loss; dev and test sets
                                 with their decoding, scores and output files
  prediction(input_path, input_format, tok, bert_config, info, run, lower_case)
      -> tasks.Prediction        `bert-jax predict`: reader, features, model, and the decoding,
                                 output files and scores of new inputs (info: the run's
                                 task.json; run: its config)

Adding a task: a module with these parts, an entry in KINDS, and a config in configs/ that
starts from `defaults.finetune(task)` and adds the task's own keys inside
`with config.unlocked():` (the defaults are locked, so that a misspelt key is an error). A new
predict format also goes into `cli.INPUT_FORMATS`, which --help reads without loading the tasks.
"""

import ml_collections

from bert_jax import glue
from bert_jax import model as model_lib
from bert_jax import ner
from bert_jax import squad
from bert_jax import tasks
from bert_jax.errors import UserError

KINDS = {'glue': glue, 'squad': squad, 'ner': ner}


def kind_of(task: str) -> str:
  """The kind of config.task: a key of KINDS (an unknown name is an error)."""
  for kind, module in KINDS.items():
    if module.accepts(task):
      return kind
  descriptions = [module.DESCRIPTION for module in KINDS.values()]
  raise UserError(f'config.task={task!r}: expected {", ".join(descriptions[:-1])} or '
                  f'{descriptions[-1]}')


def make_task(config: ml_collections.ConfigDict, tok, bert_config: model_lib.BertConfig,
              lower_case: bool) -> tasks.Task:
  """The task's data (tokenized), model, loss and scoring from a fine-tuning config."""
  task = KINDS[kind_of(config.task)].make_task(config, tok, bert_config, lower_case)
  if config.eval.main_metric:
    if config.eval.main_metric not in task.metric_names:
      raise UserError(f'config.eval.main_metric={config.eval.main_metric!r} is not a metric of '
                      f'{config.task}: {list(task.metric_names)}')
    task.main_metric = config.eval.main_metric
  return task
