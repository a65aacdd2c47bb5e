"""Loading config files in Python, and the keys of fine-tuning that moved to pre-training's places.

(Loading from any directory, user files and shipped names: cli_test.py, as the command runs it.)
"""

import os
import warnings

import ml_collections
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
    # No key at its old place ('task', once the task's name, is now the task's group).
    assert not set(defaults.MOVED_KEYS) - {'task'} & set(config), name
    assert isinstance(config.task, ml_collections.ConfigDict), name
    defaults.check_moved_keys(config)
  assert 'tfds_data_dir' in config_files.load_config('finetune_glue:mrpc').data


@pytest.mark.parametrize('old', sorted(defaults.MOVED_KEYS))
def test_an_old_fine_tuning_key_names_its_new_place(old):
  new = defaults.MOVED_KEYS[old]
  with pytest.raises(UserError, match=rf'config\.{old} is now config\.{new}'):
    config_files.load_config('finetune_glue:mrpc', {old: 'x'})
  # A config built in Python (a config file written for an earlier bert_jax) that still sets
  # the key: loading it (and the fine-tuning driver) refuses it rather than ignore the setting.
  # (`task` is a group now: ml_collections refuses a name there; a config file's is below.)
  config = defaults.finetune('mrpc')
  if old != 'task':
    with config.unlocked():
      config[old] = 'x'
    with pytest.raises(UserError, match=rf'config\.{old} is now config\.{new}'):
      defaults.check_moved_keys(config)
  defaults.check_moved_keys(defaults.finetune('mrpc'))


@pytest.mark.parametrize('line', ["config.task = 'mrpc'", "config.doc_stride = 64",
                                  "config.data_dir = '/data/glue'"])
def test_a_config_file_of_an_earlier_bert_jax_names_the_new_place(tmp_path, line):
  path = tmp_path / 'old.py'
  path.write_text('from bert_jax import defaults\n\n\ndef get_config():\n'
                  "  config = defaults.finetune('squad_v1')\n"
                  f'  with config.unlocked():\n    {line}\n  return config\n')
  old = line.split('.')[1].split(' ')[0]
  with pytest.raises(UserError) as e:
    config_files.load_config(str(path))
  assert str(e.value).startswith(f'{path}:7: ' if old == 'task' else 'config.'), str(e.value)
  assert f'config.{old} is now config.task.{"name" if old == "task" else old} ' in str(e.value)
  assert '\n' not in str(e.value)


def test_the_config_kind_is_explicit(tmp_path):
  assert (defaults.pretrain().kind, defaults.finetune('mrpc').kind) == ('pretrain', 'finetune')
  assert config_files.load_config('finetune_squad:v1').kind == 'finetune'
  # A config built by hand, not from the defaults: one line saying what it lacks.
  path = tmp_path / 'by_hand.py'
  path.write_text('import ml_collections\n\n\ndef get_config():\n'
                  "  return ml_collections.ConfigDict({'task': 'mrpc', 'train': {'steps': 3}})\n")
  with pytest.raises(UserError, match=r"^the config has no key 'kind' \('pretrain' or "
                     r"'finetune'\): start a config file from defaults\.pretrain\(\)"):
    config_files.load_config(str(path))
  with pytest.raises(UserError, match=r"--config.kind='train': expected one of pretrain, "):
    config_files.load_config('smoke', {'kind': 'train'})
  # Fine-tuning's checkpoint period may be 0 by its kind, not by the keys it has.
  assert config_files.load_config('finetune_ner', {'checkpoint.every_steps': 0})
  with pytest.raises(UserError, match=r'--config.checkpoint.every_steps=0: must be'):
    config_files.load_config('smoke', {'checkpoint.every_steps': 0})


def test_each_job_refuses_the_others_config(tmp_path):
  from bert_jax import finetune  # pylint: disable=g-import-not-at-top
  from bert_jax import train  # pylint: disable=g-import-not-at-top
  with pytest.raises(UserError, match=r'^--config is a fine-tuning config \(run it with '
                     r'`bert-jax finetune`\), not a pre-training config'):
    train.train_and_evaluate(config_files.load_config('finetune_ner'), str(tmp_path / 'a'))
  with pytest.raises(UserError, match=r'^--config is a pre-training config \(run it with '
                     r'`bert-jax pretrain`\), not a fine-tuning config'):
    finetune.finetune(config_files.load_config('smoke'), str(tmp_path / 'b'))
  assert not os.listdir(tmp_path)  # Refused before the workdir was made.


def test_a_saved_run_config_of_an_earlier_bert_jax_reads_in_todays_keys():
  old = {'task': 'squad_v1', 'data_dir': '/d', 'doc_stride': 64, 'n_best_size': 5,
         'data': {'max_seq_length': 384}, 'train': {'epochs': 2}}
  assert defaults.saved_config(old) == {
      'kind': 'finetune', 'task': {'name': 'squad_v1', 'data_dir': '/d', 'doc_stride': 64,
                                   'n_best_size': 5},
      'data': {'max_seq_length': 384}, 'train': {'epochs': 2}}
  assert defaults.saved_config({'model': {'size': 'tiny'}})['kind'] == 'pretrain'
  today = defaults.finetune('mrpc').to_dict()
  assert defaults.saved_config(today) == today


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


def _config_file(tmp_path, body: str) -> str:
  path = tmp_path / 'my_config.py'
  path.write_text('from bert_jax import defaults\n\n\n' + body)
  return str(path)


def test_a_misspelt_key_inside_a_config_file_names_its_line(tmp_path):
  path = _config_file(tmp_path, 'def get_config():\n  c = defaults.pretrain()\n'
                      '  c.train.stepz = 4\n  return c\n')
  with pytest.raises(UserError, match=rf"^{path}:6: c.train.stepz = 4: no key 'stepz': did "
                     'you mean steps'):
    config_files.load_config(path)
  # A fine-tuning key at its old place names the new one.
  path = _config_file(tmp_path, "def get_config():\n  c = defaults.finetune('mrpc')\n"
                      "  c.vocab_file = 'v.txt'\n  return c\n")
  with pytest.raises(UserError, match=r'config\.vocab_file is now config\.data\.vocab_file'):
    config_files.load_config(path)


def test_a_config_files_own_keys_go_inside_unlocked(tmp_path):
  path = _config_file(tmp_path, 'def get_config(steps):\n  c = defaults.pretrain()\n'
                      '  c.train.steps = int(steps)\n  with c.unlocked():\n'
                      '    c.my_note = "x"\n  return c\n')
  config = config_files.load_config(path + ':70000')
  assert config.train.steps == 70000 and config.my_note == 'x'
  with pytest.raises(AttributeError):  # Locked again once loaded: overrides are checked.
    config.train.stepz = 1


def test_the_choices_checked_at_load_are_the_modules_own():
  """Each key's values are defined once, in config_checks (which imports no JAX): the modules
  that branch on them use those very lists, and a value outside them fails where the config
  loads."""
  from bert_jax import activations  # pylint: disable=g-import-not-at-top
  from bert_jax import attention  # pylint: disable=g-import-not-at-top
  from bert_jax import config_checks  # pylint: disable=g-import-not-at-top
  from bert_jax import layer_norm  # pylint: disable=g-import-not-at-top
  from bert_jax import layers  # pylint: disable=g-import-not-at-top
  from bert_jax import model  # pylint: disable=g-import-not-at-top
  from bert_jax import objectives  # pylint: disable=g-import-not-at-top
  from bert_jax import train_state  # pylint: disable=g-import-not-at-top
  choices = config_checks.CHOICES
  assert model.SIZES is config_checks.MODEL_SIZES
  assert set(choices['model.size']) == set(model.SIZES)
  assert attention.IMPLEMENTATIONS is choices['model.attention_impl']
  # The kernels: every value but 'auto', which model.resolve turns into one of them.
  assert set(choices['model.layer_norm_impl']) == set(layer_norm.IMPLEMENTATIONS) | {'auto'}
  assert set(choices['model.gelu_impl']) == set(activations.IMPLEMENTATIONS) | {'auto'}
  assert model.MATMUL_PRECISIONS is choices['model.matmul_precision']
  assert set(choices['model.remat_policy']) == set(layers.REMAT_POLICIES)
  assert model.POSITION_EMBEDDINGS is choices['model.position_embedding_type']
  assert set(choices['model.mlp']) == set(model.MLPS)
  assert set(choices['data.objective']) == set(objectives.OBJECTIVES)
  assert train_state.RNG_IMPLS is choices['train.rng_impl']
  # A removed value (said so where it loads) belongs to a key that has choices, and is not one.
  for key, removed in config_checks.REMOVED_CHOICES.items():
    assert key in choices and not set(removed) & set(choices[key]), key
  for dtype in choices['model.dtype']:
    model.BertConfig(dtype=model.resolve_dtype(dtype))  # Each one a dtype the model takes.
  for key in ('model.size', 'model.dtype', 'model.matmul_precision', 'train.optimizer',
              'task.data_source'):
    config = 'finetune_glue:mrpc' if key == 'task.data_source' else 'smoke'
    with pytest.raises(UserError, match=rf"--config\.{key}='x': expected one of "):
      config_files.load_config(config, {key: 'x'})


def test_a_folder_named_like_a_shipped_config_leaves_the_name_to_it(tmp_path, monkeypatch):
  # `bert-jax eval --config=smoke` run in /tmp/bert-jax, beside pretrain's workdir `smoke`.
  (tmp_path / 'smoke').mkdir()
  monkeypatch.chdir(tmp_path)
  assert config_files.resolve_config_path('smoke') == os.path.join(
      config_files.configs_dir(), 'smoke.py')
  assert config_files.load_config('smoke').model.size == (
      config_files.load_config(os.path.join(config_files.configs_dir(), 'smoke.py')).model.size)
