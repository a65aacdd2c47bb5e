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


@pytest.mark.parametrize('config_args', [[], ['--config=bert_base.py'],
                                         ['--config', 'configs/bert_large.py']])
def test_configs_import_their_base_from_any_directory(tmp_path, config_args):
  # The shipped configs import `configs.default`; the default --config (no flag) and both
  # flag spellings must load. A bad --topology then stops the command after flag parsing.
  if config_args[-1:] == ['configs/bert_large.py']:
    config_args = ['--config', os.path.join(_ROOT, 'configs', 'bert_large.py')]
  proc = _run_main(tmp_path, ['compile', '--topology=v9:2x2'] + config_args)
  assert "No module named 'configs'" not in proc.stderr, proc.stderr[-3000:]
  assert "--topology='v9:2x2': expected GENERATION:SHAPE" in proc.stderr, proc.stderr[-3000:]


def test_config_names_resolve_to_the_shipped_files():
  assert cli.resolve_config_path('smoke') == os.path.join(cli.configs_dir(), 'smoke.py')
  assert cli.resolve_config_path('finetune_glue:mrpc').endswith('finetune_glue.py:mrpc')
  with pytest.raises(FileNotFoundError, match='--config=nope.py: no such file'):
    cli.resolve_config_path('nope.py')
