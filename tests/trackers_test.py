"""log.writers: W&B (offline, its run files read back) and any clu MetricWriter get what
TensorBoard gets, the config, on process 0 only, and a rerun resumes the same W&B run. The end
to end check, a run stopped and resumed, is train_test.test_exact_resume."""

import os
import sys

import jax
import pytest
from clu import metric_writers

from bert_jax import config_files
from bert_jax import monitor
from bert_jax import trackers
from bert_jax.errors import UserError
import wandb_records

pytest.importorskip('wandb')


class RecordingWriter(metric_writers.MetricWriter):
  """A clu MetricWriter of the kind log.writers=MODULE:NAME takes: it records every call."""
  made: list['RecordingWriter'] = []

  def __init__(self, workdir):
    self.workdir, self.scalars, self.hparams, self.closed = workdir, [], {}, False
    RecordingWriter.made.append(self)

  def write_summaries(self, step, values, metadata=None):
    pass

  def write_scalars(self, step, scalars):
    self.scalars.append((step, dict(scalars)))

  def write_images(self, step, images):
    pass

  def write_videos(self, step, videos):
    pass

  def write_audios(self, step, audios, *, sample_rate):
    pass

  def write_texts(self, step, texts):
    pass

  def write_histograms(self, step, arrays, num_buckets=None):
    pass

  def write_hparams(self, hparams):
    self.hparams.update(hparams)

  def flush(self):
    pass

  def close(self):
    self.closed = True


def not_a_writer(workdir):
  return {'workdir': workdir}


def _config(writers, **overrides):
  return config_files.load_config('smoke', {'log.writers': writers, **overrides})


@pytest.fixture
def offline(monkeypatch):
  monkeypatch.setenv('WANDB_MODE', 'offline')
  monkeypatch.setenv('WANDB_SILENT', 'true')


def test_writers_are_checked_where_the_config_loads():
  with pytest.raises(UserError, match=r"--config\.log\.writers='tensorboard,wanb': 'wanb' is not "
                                      r"a writer \(did you mean 'wandb'\?\)"):
    _config('tensorboard,wanb')
  with pytest.raises(UserError, match='names a writer twice'):
    _config('wandb,wandb')
  assert trackers.parse(' tensorboard , my.module:Writer ') == ['tensorboard',
                                                                 'my.module:Writer']


def test_wandb_gets_the_tags_and_config_and_a_rerun_resumes_its_run(tmp_path, offline):
  workdir = str(tmp_path / 'run')
  os.makedirs(workdir)
  config = _config('wandb', **{'log.wandb_project': 'bert-jax-test', 'train.steps': 77})
  for first_step in (1, 3):  # A run, then its rerun after a preemption.
    log = monitor.MetricsLog(workdir, config)
    assert not log.tensorboard and [type(w) for w in log.others] == [trackers.WandbWriter]
    log.train(first_step, {'loss': 2.5 / first_step, 'mlm_accuracy': 0.25})
    log.eval(first_step + 1, {'mlm_accuracy': 0.5})
    log.close()
  runs = wandb_records.offline_runs(workdir)
  assert len({r.run_id for r in runs}) == 1 and len(runs) == 2
  assert runs[0].config['train']['steps'] == 77 and runs[0].project == 'bert-jax-test'
  history = [{k: v for k, v in row.items() if not k.startswith('_') or k == '_step'}
             for run in runs for row in run.history]
  assert history == [{'_step': 1, 'train/loss': 2.5, 'train/mlm_accuracy': 0.25},
                     {'_step': 2, 'eval/mlm_accuracy': 0.5},
                     {'_step': 3, 'train/loss': 2.5 / 3, 'train/mlm_accuracy': 0.25},
                     {'_step': 4, 'eval/mlm_accuracy': 0.5}]
  assert not [f for f in os.listdir(workdir) if f.startswith('events.out.tfevents')]


def test_a_clu_writer_by_name_gets_what_tensorboard_gets(tmp_path):
  RecordingWriter.made.clear()
  config = _config(f'tensorboard,{__name__}:RecordingWriter')
  log = monitor.MetricsLog(str(tmp_path), config)
  log.train(5, {'loss': 1.0, 'skipped': None})
  log.eval(5, {'accuracy': 0.5}, eval_set='dev')
  log.close()
  (writer,) = RecordingWriter.made
  assert writer.workdir == str(tmp_path) and writer.closed
  assert writer.scalars == [(5, {'train/loss': 1.0}), (5, {'eval/dev/accuracy': 0.5})]
  assert writer.hparams['train.steps'] == config.train.steps
  assert writer.hparams['log.writers'] == config.log.writers
  assert [f for f in os.listdir(tmp_path) if f.startswith('events.out.tfevents')]


def test_only_process_zero_writes(tmp_path, monkeypatch, offline):
  RecordingWriter.made.clear()
  monkeypatch.setattr(jax, 'process_index', lambda: 1)
  log = monitor.MetricsLog(str(tmp_path), _config(f'wandb,{__name__}:RecordingWriter'))
  log.train(1, {'loss': 1.0})
  log.close()
  assert not RecordingWriter.made and not log.others
  assert os.listdir(tmp_path) == []


@pytest.mark.parametrize('name, message', [
    ('no_such_module_xyz:Writer', r"log\.writers: no_such_module_xyz:Writer: cannot import "
                                  r"Writer from no_such_module_xyz"),
    (f'{__name__}:not_a_writer', r'gave a dict, not a clu\.metric_writers\.MetricWriter'),
])
def test_a_bad_writer_name_is_one_line(tmp_path, name, message):
  with pytest.raises(UserError, match=message):
    monitor.MetricsLog(str(tmp_path), _config(name))


def test_missing_extra_is_one_line(tmp_path, monkeypatch):
  monkeypatch.setitem(sys.modules, 'wandb', None)
  with pytest.raises(UserError, match=r'^log\.writers=wandb \(Weights & Biases\) need wandb, '
                                      r'which is not installed: pip install "bert_jax\[wandb\]"$'):
    monitor.MetricsLog(str(tmp_path), _config('wandb'))
