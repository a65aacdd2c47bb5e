"""The shipped pre-training configs: every run checkpoints and evaluates before it ends."""

import pytest

from bert_jax import config_files

PRETRAINING = ['default.py', 'bert_base.py', 'bert_large.py', 'bert_base_tpu_speed.py',
               'smoke.py', 'lamb_large_batch.py:phase1', 'lamb_large_batch.py:phase2',
               'continue_pretraining.py', 'modern.py', 'modern.py:tiny']


@pytest.mark.parametrize('name', PRETRAINING)
def test_checkpoints_and_evaluations_happen_within_the_run(name):
  config = config_files.load_config('configs/' + name)
  steps = config.train.steps
  # At least two checkpoints per run, so that a preemption-free crash loses a fraction of it.
  assert config.checkpoint.every_steps <= steps // 2, name
  assert config.eval.every_steps <= steps, name
  assert config.log.every_steps <= config.checkpoint.every_steps, name


def _keys(config, prefix=''):
  out = set()
  for key, value in config.items():
    out.add(prefix + key)
    if hasattr(value, 'items'):
      out |= _keys(value, prefix + key + '.')
  return out


def test_the_code_reads_only_keys_the_config_defines():
  """Every `config.a.b` / `data.x` / `train.y` the pre-training code reads is a default key,
  and none is read with `.get` (a key that could not be set from the command line)."""
  import os  # pylint: disable=g-import-not-at-top
  import re  # pylint: disable=g-import-not-at-top
  root = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'bert_jax')
  defined = _keys(config_files.load_config('configs/default.py'))
  read, gets = set(), []
  for module in ('train.py', 'input_pipeline.py', 'documents.py', 'optim.py', 'sharding.py',
                 'aot.py', 'cli.py', 'checkpoint.py', 'train_state.py', 'monitor.py',
                 'tables.py', 'trackers.py', 'publish.py'):
    with open(os.path.join(root, module)) as f:
      source = f.read()
    for section in ('model', 'data', 'train', 'mesh', 'checkpoint', 'eval', 'log'):
      for key in re.findall(rf'\bconfig\.{section}\.(\w+)\b', source):
        read.add(f'{section}.{key}')
    for key in re.findall(r'\bdata\.(\w+)\b', source):
      if key not in ('Dataset', 'Options', 'AUTOTUNE', 'experimental', 'TFRecordDataset',
                     'TextLineDataset'):
        read.add(f'data.{key}')
    gets += [(module, g) for g in re.findall(r'\b(?:config|data|train_config)(?:\.\w+)*\.get\(',
                                             source)]
  methods = {'copy_and_resolve_references', 'to_json_best_effort', 'lock', 'get', 'items'}
  undefined = {k for k in read if k not in defined and k.split('.')[-1] not in methods}
  assert not undefined, f'read by the code but not in bert_jax/defaults.py: {sorted(undefined)}'
  assert not gets, f'config keys read with .get (cannot be set on the command line): {gets}'


def test_multi_host_settings_are_flags_not_keys():
  # The launch decides the process layout (--coordinator_address etc.); no config key pretends.
  assert 'distributed' not in config_files.load_config('configs/default.py')
