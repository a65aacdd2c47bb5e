"""Experiment trackers beside TensorBoard: Weights & Biases, and any clu MetricWriter.

`log.writers` (comma separated) says where a run's curves go, besides metrics.jsonl:

  tensorboard      events files in the workdir (clu's SummaryWriter): the default.
  wandb            Weights & Biases (the `wandb` extra). One W&B run per workdir: its id is made
                   at the run's first start and kept in the workdir (WANDB_RUN_FILE), so a rerun
                   after a preemption resumes into the same W&B run (`resume='allow'`). The
                   project is log.wandb_project ('' = WANDB_PROJECT, else wandb's default);
                   everything else (WANDB_MODE=offline, WANDB_ENTITY, WANDB_API_KEY, WANDB_DIR)
                   is read by wandb as usual. Local workdirs keep wandb's files in WORKDIR/wandb.
  MODULE:NAME      any clu `metric_writers.MetricWriter`: NAME(workdir) made from the importable
                   MODULE (a class or a function), e.g. `my_lab.writers:MLflowWriter`.

Every writer gets the same tags (`train/<name>`, `eval/<name>`, `eval/<set>/<name>`, as
`monitor.MetricsLog` names them) at the same steps, and the run's config as its
hyperparameters; only process 0 makes any (`monitor.MetricsLog`). clu's writers import
TensorFlow, so this module is imported where the run's log is made, not at start-up.
"""

import json
import os
import secrets
from typing import Any, Mapping

from clu import metric_writers

from bert_jax import config_checks
from bert_jax import errors
from bert_jax import fileio
from bert_jax.errors import UserError

# The W&B run this workdir logs to: {"id": ..., "project": ...}.
WANDB_RUN_FILE = 'wandb_run.json'


class WandbWriter(metric_writers.MetricWriter):
  """clu's MetricWriter protocol onto a W&B run: scalars, hyperparameters (the run's config),
  images, texts, histograms; the step is bert_jax's step."""

  def __init__(self, workdir: str, project: str = '', config: Mapping[str, Any] | None = None):
    wandb = errors.require('wandb', 'wandb', 'log.writers=wandb (Weights & Biases)')
    self._wandb = wandb
    record = os.path.join(workdir, WANDB_RUN_FILE)
    if fileio.exists(record):  # A rerun: the same W&B run.
      run_id = fileio.read_json(record)['id']
    else:
      run_id = secrets.token_hex(6)  # W&B run ids must be new per project: not the path.
      fileio.write_json(record, {'id': run_id, 'project': project or None})
    try:
      self.run = wandb.init(
          id=run_id, resume='allow', project=project or None,
          name=os.path.basename(workdir.rstrip('/')) or None,
          dir=None if fileio.is_remote(workdir) else workdir, config=dict(config or {}))
    except wandb.errors.Error as e:  # No API key, no network, a project it may not write ...
      first = str(e).strip().split('\n')[0]
      raise UserError(f'log.writers=wandb: W&B refused the run ({first}); log in (`wandb '
                      'login`, WANDB_API_KEY) or log offline (WANDB_MODE=offline)') from e
    self.run_id = run_id

  def write_summaries(self, step: int, values: Mapping[str, Any],
                      metadata: Mapping[str, Any] | None = None) -> None:
    del metadata
    self.run.log({k: _plain(v) for k, v in values.items()}, step=int(step))

  def write_scalars(self, step: int, scalars: Mapping[str, Any]) -> None:
    self.run.log({k: _plain(v) for k, v in scalars.items()}, step=int(step))

  def write_images(self, step: int, images: Mapping[str, Any]) -> None:
    self.run.log({k: self._wandb.Image(v) for k, v in images.items()}, step=int(step))

  def write_videos(self, step: int, videos: Mapping[str, Any]) -> None:
    self.run.log({k: self._wandb.Video(v) for k, v in videos.items()}, step=int(step))

  def write_audios(self, step: int, audios: Mapping[str, Any], *, sample_rate: int) -> None:
    self.run.log({k: self._wandb.Audio(v, sample_rate=sample_rate) for k, v in audios.items()},
                 step=int(step))

  def write_texts(self, step: int, texts: Mapping[str, str]) -> None:
    self.run.log({k: self._wandb.Html(f'<pre>{v}</pre>') for k, v in texts.items()},
                 step=int(step))

  def write_histograms(self, step: int, arrays: Mapping[str, Any],
                       num_buckets: Mapping[str, int] | None = None) -> None:
    self.run.log({k: self._wandb.Histogram(v, num_bins=(num_buckets or {}).get(k, 64))
                  for k, v in arrays.items()}, step=int(step))

  def write_hparams(self, hparams: Mapping[str, Any]) -> None:
    self.run.config.update(dict(hparams), allow_val_change=True)

  def flush(self) -> None:
    pass  # wandb sends in the background; finish() waits for it.

  def close(self) -> None:
    self.run.finish()


def _plain(value: Any) -> Any:
  """NumPy and JAX scalars as Python numbers (W&B's JSON)."""
  return value.item() if hasattr(value, 'item') and getattr(value, 'ndim', 0) == 0 else value


def _custom(name: str, workdir: str) -> metric_writers.MetricWriter:
  import importlib  # pylint: disable=g-import-not-at-top
  module, attr = name.split(':', 1)
  try:
    factory = getattr(importlib.import_module(module), attr)
  except (ImportError, AttributeError) as e:
    raise UserError(f'log.writers: {name}: cannot import {attr} from {module} ({e})') from e
  writer = factory(workdir)
  if not isinstance(writer, metric_writers.MetricWriter):
    raise UserError(f'log.writers: {name}({workdir!r}) gave a {type(writer).__name__}, not a '
                    'clu.metric_writers.MetricWriter')
  return writer


def parse(writers: str) -> list[str]:
  """log.writers -> its writer names (`config_checks.writer_names`)."""
  return config_checks.writer_names(writers)


def make(names: list[str], workdir: str, config: Mapping[str, Any] | None = None,
         wandb_project: str = '') -> list[metric_writers.MetricWriter]:
  """The writers other than TensorBoard's (`monitor.MetricsLog` writes those), each given the
  config as hyperparameters."""
  writers = []
  for name in names:
    if name == 'tensorboard':
      continue
    if name == 'wandb':
      writers.append(WandbWriter(workdir, wandb_project, config))
    else:
      writer = _custom(name, workdir)
      if config:
        writer.write_hparams(flatten(config))
      writers.append(writer)
  return writers


def flatten(tree: Mapping[str, Any], prefix: str = '') -> dict[str, Any]:
  """{'train': {'steps': 3}} -> {'train.steps': 3}; lists and other values as JSON text."""
  out = {}
  for key, value in tree.items():
    if isinstance(value, Mapping):
      out.update(flatten(value, f'{prefix}{key}.'))
    elif isinstance(value, (bool, int, float, str)) or value is None:
      out[prefix + key] = value
    else:
      out[prefix + key] = json.dumps(value, default=str)
  return out
