"""Loading config files in Python, and the keys of fine-tuning that moved to pre-training's places.

(Loading from any directory, user files and shipped names: cli_test.py, as the command runs it.)
"""

import os
import warnings

import pytest

from bert_jax import config_files
from bert_jax import defaults
from bert_jax.errors import UserError


def test_fine_tuning_reads_shared_settings_where_pre_training_does():
  pretrain = config_files.load_config('smoke')
  for name in ('finetune_glue:mrpc', 'finetune_squad:v1', 'finetune_ner'):
    config = config_files.load_config(name)
    for key in ('train.init_checkpoint', 'data.vocab_file', 'data.lower_case',
                'data.max_seq_length', 'train.optimizer', 'train.learning_rate',
                'train.weight_decay', 'train.max_grad_norm', 'train.seed'):
      section, leaf = key.split('.')
      assert leaf in config[section] and leaf in pretrain[section], (name, key)
    assert not set(defaults.MOVED_KEYS) & set(config), name
  assert 'tfds_data_dir' in config_files.load_config('finetune_glue:mrpc').data


@pytest.mark.parametrize('old', sorted(defaults.MOVED_KEYS))
def test_an_old_fine_tuning_key_names_its_new_place(old):
  new = defaults.MOVED_KEYS[old]
  with pytest.raises(UserError, match=rf'config\.{old} is now config\.{new}'):
    config_files.load_config('finetune_glue:mrpc', {old: 'x'})
  # A config built in Python (a config file written for an earlier bert_jax) that still sets
  # the key: the fine-tuning driver refuses it rather than ignore the setting.
  config = defaults.finetune('mrpc')
  config[old] = 'x'
  with pytest.raises(UserError, match=rf'config\.{old} is now config\.{new}'):
    defaults.check_moved_keys(config)
  defaults.check_moved_keys(defaults.finetune('mrpc'))


def test_a_misspelt_override_names_the_closest_key():
  with pytest.raises(UserError, match=r'no key config\.train\.setps; did you mean '
                     r'--config\.train\.steps\?'):
    config_files.load_config('smoke', {'train.setps': 3})
  # Pre-training never had these keys at the top level: no 'moved' hint there.
  with pytest.raises(UserError, match=r'has no key config\.vocab_file'):
    config_files.load_config('smoke', {'vocab_file': 'x'})


def test_loading_a_config_warns_of_nothing():
  """ml_collections reads the file with importlib's deprecated load_module(); that warning is
  its own and must not reach a user who runs with warnings as errors."""
  with warnings.catch_warnings():
    warnings.simplefilter('error')
    assert config_files.load_config('smoke').model.size == 'tiny'


def test_a_folder_named_like_a_shipped_config_leaves_the_name_to_it(tmp_path, monkeypatch):
  # `bert-jax eval --config=smoke` run in /tmp/bert-jax, beside pretrain's workdir `smoke`.
  (tmp_path / 'smoke').mkdir()
  monkeypatch.chdir(tmp_path)
  assert config_files.resolve_config_path('smoke') == os.path.join(
      config_files.configs_dir(), 'smoke.py')
  assert config_files.load_config('smoke').model.size == (
      config_files.load_config(os.path.join(config_files.configs_dir(), 'smoke.py')).model.size)
