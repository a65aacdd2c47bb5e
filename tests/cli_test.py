"""The `bert-jax` entry point as users run it: from any directory, with neither the current
directory nor the checkout on sys.path (the console script's situation)."""

import os
import subprocess
import sys

import pytest

from bert_jax import cli

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run_main(tmp_path, args):
  """cli.main(args) in a fresh interpreter that can import bert_jax but not `configs`."""
  site = tmp_path / 'site'
  site.mkdir()
  os.symlink(os.path.join(_ROOT, 'bert_jax'), site / 'bert_jax')
  env = dict(os.environ, PYTHONPATH=str(site))
  code = f'from bert_jax import cli; cli.main({["bert-jax"] + args!r})'
  return subprocess.run([sys.executable, '-c', code], cwd=tmp_path, env=env,
                        capture_output=True, text=True, timeout=300)


_USER_CONFIG = """
from bert_jax import defaults


def get_config(size='mini'):
  config = defaults.pretrain()
  config.model.size = size
  print('user config:', config.model.size)
  return config
"""


@pytest.mark.parametrize('config_args', [[], ['--config=bert_base.py'],
                                         ['--config', 'configs/bert_large.py'],
                                         ['--config=USER:small']])
def test_configs_load_from_any_directory(tmp_path, config_args):
  # The default --config (no flag), a shipped name, both flag spellings and a user's own file
  # outside the checkout (which builds on bert_jax.defaults) load the same way. A bad
  # --topology then stops the command after flag parsing.
  if config_args[-1:] == ['configs/bert_large.py']:
    config_args = ['--config', os.path.join(_ROOT, 'configs', 'bert_large.py')]
  user = config_args == ['--config=USER:small']
  if user:
    (tmp_path / 'elsewhere').mkdir()
    (tmp_path / 'elsewhere' / 'my_config.py').write_text(_USER_CONFIG)
    config_args = [f'--config={tmp_path / "elsewhere" / "my_config.py"}:small']
  proc = _run_main(tmp_path, ['compile', '--topology=v9:2x2'] + config_args)
  assert "No module named" not in proc.stderr, proc.stderr[-3000:]
  assert "--topology='v9:2x2': expected GENERATION:SHAPE" in proc.stderr, proc.stderr[-3000:]
  assert ('user config: small' in proc.stdout) == user, proc.stdout


def test_load_config_reads_a_user_file_anywhere(tmp_path):
  path = tmp_path / 'my_config.py'
  path.write_text(_USER_CONFIG)
  config = cli.load_config(str(path), {'train.steps': 7})
  assert (config.model.size, config.train.steps) == ('mini', 7)
  assert cli.load_config(f'{path}:large').model.size == 'large'
  # The same keys as the shipped default: a user's file starts from the package's defaults.
  assert config.to_dict().keys() == cli.load_config('default').to_dict().keys()


def test_config_names_resolve_to_the_shipped_files():
  assert cli.resolve_config_path('smoke') == os.path.join(cli.configs_dir(), 'smoke.py')
  assert cli.resolve_config_path('finetune_glue:mrpc').endswith('finetune_glue.py:mrpc')
  with pytest.raises(FileNotFoundError, match='--config=nope.py: no such file'):
    cli.resolve_config_path('nope.py')
