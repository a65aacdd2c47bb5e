"""The shipped pre-training configs: every run checkpoints and evaluates before it ends."""

import pytest

from bert_jax import cli

PRETRAINING = ['default.py', 'bert_base.py', 'bert_large.py', 'smoke.py',
               'lamb_large_batch.py:phase1', 'lamb_large_batch.py:phase2']


@pytest.mark.parametrize('name', PRETRAINING)
def test_checkpoints_and_evaluations_happen_within_the_run(name):
  config = cli.load_config('configs/' + name)
  steps = config.train.steps
  # At least two checkpoints per run, so that a preemption-free crash loses a fraction of it.
  assert config.checkpoint.every_steps <= steps // 2, name
  assert config.eval.every_steps <= steps, name
  assert config.log.every_steps <= config.checkpoint.every_steps, name
