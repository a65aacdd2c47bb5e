"""Config files: finding them, loading them, and naming the key a mistaken override meant.

A config file is a Python file with `get_config(arg=None)` returning a ConfigDict; it imports
only the installed package (`from bert_jax import defaults`), so a shipped config, a file given
by path and a user's own file anywhere on disk load the same way, without sys.path being
rewritten. Shipped configs are also found by name ('smoke', 'finetune_glue:mrpc'), from a
checkout or an installed wheel.

  config = config_files.load_config('finetune_glue:mrpc', {'train.learning_rate': 3e-5})

The command line (`cli.py`), notebooks, tests, benchmarks and configs that build on a sibling
all load files through here.
"""

import difflib
import importlib.metadata
import os
import sys
import warnings
from typing import Any

import ml_collections

from bert_jax import config_checks
from bert_jax import defaults
from bert_jax.errors import UserError


def configs_dir() -> str:
  """The configs/ folder of a checkout (or editable install), else the copy installed with the
  package: share/bert_jax/configs of whichever scheme pip installed it in (the system, a venv,
  --user as on TPU VMs, --prefix), which the distribution's file list records."""
  here = os.path.dirname(os.path.realpath(__file__))
  candidates = [os.path.join(os.path.dirname(here), 'configs')]
  try:
    candidates += [os.path.dirname(os.path.realpath(f.locate()))
                   for f in importlib.metadata.files('bert_jax') or ()
                   if f.name == 'default.py' and f.parent.name == 'configs']
  except importlib.metadata.PackageNotFoundError:
    pass  # Imported from a checkout on PYTHONPATH, not installed.
  candidates.append(os.path.join(sys.prefix, 'share', 'bert_jax', 'configs'))
  for candidate in candidates:
    if os.path.isdir(candidate):
      return candidate
  raise UserError('cannot find the bert_jax configs/ folder (neither in the checkout nor '
                  'installed with the package under share/bert_jax/configs): pass '
                  '--config=PATH to a config file')


def resolve_config_path(path: str) -> str:
  """A config path as given, or a name of the shipped configs ('smoke', 'bert_base.py').

  Only a file is taken as given: a folder named like a shipped config (`smoke`, the workdir
  `bert-jax pretrain` makes, when the command runs in /tmp/bert-jax) leaves the name to it."""
  if os.path.isfile(path.split(':')[0]):
    return path
  name, _, arg = path.partition(':')
  name = os.path.basename(name)
  shipped = os.path.join(configs_dir(), name if name.endswith('.py') else name + '.py')
  if not os.path.exists(shipped):
    shipped_names = sorted(f[:-3] for f in os.listdir(os.path.dirname(shipped))
                           if f.endswith('.py') and not f.startswith('_'))
    raise UserError(f'--config={path}: no such file (nor {shipped}); give the path of a config '
                    f'file or one of the shipped names: {", ".join(shipped_names)}')
  return shipped + (':' + arg if arg else '')


def file_parser():
  """ml_collections' parser of config files (what `--config=PATH[:ARG]` uses), which also takes
  the shipped names and locks the config, so that a misspelt key is an error."""
  # The module that defines DEFINE_config_file; its package does not re-export the parser.
  from ml_collections.config_flags import config_flags  # pylint: disable=g-import-not-at-top

  class Parser(config_flags.ConfigFileFlagParser):

    def parse(self, path):
      with warnings.catch_warnings():
        # ml_collections loads the file with importlib's deprecated load_module(): its
        # warning, not the user's, and nothing a user can act on.
        warnings.filterwarnings('ignore', r'the load_module\(\) method is deprecated',
                                DeprecationWarning)
        return super().parse(resolve_config_path(path))
  return Parser(name='config', lock_config=True)


def load_config(path: str, overrides: dict[str, Any] | None = None
                ) -> ml_collections.ConfigDict:
  """Loads a config file (as the CLI does: a path or a shipped name, with ':arg') and applies
  {'train.steps': 10, ...} overrides; an override of a key the config lacks is a UserError that
  names the closest key (or the key's new place)."""
  config = file_parser().parse(path)
  for key, value in (overrides or {}).items():
    check_key(config, key, path, flag=f'override {key!r}')
    node = config
    *parents, leaf = key.split('.')
    for p in parents:
      node = node[p]
    node[leaf] = value
  config_checks.check_config(config)  # Every numeric key's range, before any work.
  return config


def check_key(config: ml_collections.ConfigDict, key: str, path: str, flag: str) -> None:
  """Raises a UserError unless `key` ('train.steps') is a key of `config` (loaded from `path`).

  The message names `flag` (how the user wrote the key), where a key of fine-tuning moved to
  (`defaults.MOVED_KEYS`), or else the closest key ("did you mean") and the keys that exist.
  """
  node, parts = config, key.split('.')
  for i, part in enumerate(parts):
    if isinstance(node, ml_collections.ConfigDict) and part in node:
      node = node[part]
      continue
    where = '.'.join(['config'] + parts[:i])
    if not isinstance(node, ml_collections.ConfigDict):
      raise UserError(f'{flag}: {where} is a value ({node!r}), not a group of keys; '
                      f'set it with --{where}=VALUE')
    if i == 0 and key in defaults.MOVED_KEYS and 'task' in config:
      raise UserError(f'{flag}: config.{key} is now config.{defaults.MOVED_KEYS[key]} (the '
                      f'place pre-training has it): set --config.{defaults.MOVED_KEYS[key]}')
    keys = sorted(node.keys())
    close = difflib.get_close_matches(part, keys, n=1)
    hint = (f'did you mean --{where}.{close[0]}?' if close else
            f'the keys of {where} are: {", ".join(keys)}')
    raise UserError(f'{flag}: the config ({path}) has no key {where}.{part}; {hint}')
