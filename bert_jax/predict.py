"""A fine-tuned model on new inputs: `bert-jax predict --workdir=FINETUNED --input --output`.

The workdir says what it is (task.json, config.json, tokenizer_config.json) and holds the best
epoch's weights. What each task reads and writes is its module's `prediction` (task_table.py
lists them; README, "Using a model from the command line"), for example GLUE: a TSV in the
layout of the task's dev or test file, or JSONL -> JSONL with each row's label and
probabilities; SQuAD: SQuAD JSON -> {question id: answer}; NER: CoNLL or text -> CoNLL.

An input with labels (GLUE labels, SQuAD answers, CoNLL tags, ...) is also scored, with the same
features, batches, decoding and metrics as `finetune` scores its dev set, in the dtype the run
evaluated in: on the task's dev file the metrics are those the run reported for its best epoch
(exactly on the kind of machine the run evaluated on, where XLA computes the same logits; the
model runs on one device with XLA attention).
"""

import functools
from typing import Any

import jax
import ml_collections

from bert_jax import batching
from bert_jax import defaults
from bert_jax import fileio
from bert_jax import model as model_lib
from bert_jax import pretrained
from bert_jax import tasks
from bert_jax.errors import UserError


def predict(workdir: str, input_path: str, output_path: str, batch_size: int = 0,
            input_format: str = 'auto') -> dict[str, Any]:
  """Writes the predictions of `input_path` to `output_path` (see the module docstring).

  Args:
    workdir: a finished `bert-jax finetune` workdir.
    input_path, output_path: local or gs:// files.
    batch_size: examples (SQuAD: windows) per batch; 0 = the run's eval.batch_size, the
      batches its dev predictions were made in.
    input_format: 'auto' or one of the task's predict formats (task_table.KINDS).

  Returns:
    {'task', 'input_format' (as read), 'examples', 'output'} (+ 'files': the other files
    written), and 'metrics' for an input with labels.
  """
  from bert_jax import task_table  # pylint: disable=g-import-not-at-top
  fileio.hide_accelerators_from_tf()
  task_path = f'{workdir}/task.json'
  if fileio.isdir(workdir):
    fileio.check_readable_dir(workdir, '--workdir')  # Else its files would look missing.
  if not fileio.exists(task_path):
    raise UserError(f'--workdir={workdir} has no task.json: not a bert_jax fine-tuning workdir')
  if not fileio.exists(f'{workdir}/metrics.json'):
    raise UserError(f'--workdir={workdir} has no metrics.json: its fine-tuning run has not '
                    'finished (rerun its `bert-jax finetune` command to finish it)')
  info = fileio.read_json(task_path)
  # The run's config, in today's keys (a workdir of an earlier bert_jax: its task keys moved).
  run = ml_collections.ConfigDict(defaults.saved_config(fileio.read_json(f'{workdir}/config.json')))
  kind = info['kind']
  module = task_table.module(kind)
  if fileio.isdir(input_path):
    raise UserError(f'--input={input_path} is a directory; name a file')
  if not fileio.isfile(input_path):
    raise UserError(f'--input={input_path}: {fileio.missing(input_path)}')
  fileio.check_output_file(output_path, '--output')  # Before the work, not after it.
  # SQuAD's n-best answers and null odds go beside --output: no input may be any of them.
  for path in [output_path] + [module.beside_output(output_path, name)
                               for name in task_table.KINDS[kind].beside_output]:
    what = f'--output={output_path}' + ('' if path == output_path else f' (and {path} beside it)')
    inputs = [(f'the input --input={input_path}', input_path)] + [
        (f'{workdir}/{name.rstrip("/")}, a file of the run in --workdir={workdir}',
         f'{workdir}/{name.rstrip("/")}') for name in fileio.gfile().listdir(workdir)]
    for shown, other in inputs:
      if fileio.same_path(path, other):
        raise UserError(f'{what} is {shown}: writing it would replace it; name another --output')
  if batch_size < 0:
    raise UserError(f'--batch_size={batch_size} must be positive (or 0: the run\'s '
                    'eval.batch_size)')
  batch_size = batch_size or int(run.eval.batch_size)
  formats = task_table.KINDS[kind].predict_formats
  if input_format != 'auto' and input_format not in formats:
    raise UserError(f'--input_format={input_format} does not fit a {kind} model: expected auto '
                    f'or one of {", ".join(formats)}')
  bert_config, params, tok, _, lower_case = pretrained.load_checkpoint(workdir, flag='--workdir')
  # The dtype the run evaluated in (workdirs written before task.json recorded it: the config's,
  # resolved here); XLA attention, which runs anywhere.
  dtype = (info['compute_dtype'] if 'compute_dtype' in info
           else model_lib.resolve_dtype(run.model.dtype))
  bert_config = bert_config.replace(dtype=dtype, scan_layers=False, attention_impl='xla')
  prediction = module.prediction(input_path, input_format, tok, bert_config, info, run,
                                 lower_case)

  step = jax.jit(functools.partial(tasks.predict_step, model=prediction.model,
                                   head=prediction.head))
  params = jax.device_put(params)
  rows = batching.predict_rows(lambda batch: step(params, batch), prediction.features,
                               batch_size, batching.parse_buckets(run.data.buckets))
  result: dict[str, Any] = {'task': info['task'], 'input_format': prediction.input_format,
                            'examples': prediction.examples, 'output': output_path}
  scores, files = prediction.finish(rows, output_path)
  if files:
    result['files'] = files
  if scores is not None:
    result['metrics'] = fileio.json_safe(scores)
  return result
