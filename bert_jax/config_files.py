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
import importlib.util
import inspect
import os
import re
import sys
import traceback
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
    if os.path.isdir(path.split(':')[0]):  # Not a shipped name either: the folder was meant.
      raise UserError(f'--config={path} is a directory; name a config file (.py) in it')
    shipped_names = sorted(f[:-3] for f in os.listdir(os.path.dirname(shipped))
                           if f.endswith('.py') and not f.startswith('_'))
    raise UserError(f'--config={path}: no such file (nor {shipped}); give the path of a config '
                    f'file or one of the shipped names: {", ".join(shipped_names)}')
  return shipped + (':' + arg if arg else '')


def _where_in(path: str, error: BaseException) -> str:
  """'PATH:LINE: the line' of the innermost frame of `error` in the config file at `path`."""
  frames = [f for f in traceback.extract_tb(error.__traceback__)
            if os.path.realpath(f.filename) == os.path.realpath(path)]
  if not frames:
    return path
  return f'{path}:{frames[-1].lineno}: {(frames[-1].line or "").strip()}'


def _locked_key_error(error: BaseException, path: str) -> UserError | None:
  """The UserError of a config file that sets a key its (locked) base config does not have,
  or a value where the base has a group of keys (`config.task = 'mrpc'`, now config.task.name).
  """
  text = str(error.args[0]) if error.args else ''
  group = re.match(r"Could not override field '([^']+)' \(reference\)", text)
  if group and group.group(1) in defaults.MOVED_KEYS:
    return UserError(f'{_where_in(path, error)}: {defaults.moved_key_message(group.group(1))}')
  found = re.search(r'Key "([^"]+)" does not exist and cannot be added since the config is '
                    r'locked', text)
  if not found:
    return None
  key = found.group(1)
  close = re.search(r'Did you mean "([^"]+)" instead of', text)
  if key in defaults.MOVED_KEYS:
    hint = f'{defaults.moved_key_message(key)}, if this is fine-tuning'
  elif close:
    hint = f'did you mean {close.group(1)}?'
  else:
    hint = 'the base config has no such key'
  return UserError(f'{_where_in(path, error)}: no key {key!r}: {hint} (a key of your own '
                   'goes inside `with config.unlocked():`)')


def _run_get_config(path: str, arg: str | None) -> Any:
  """get_config(arg) of the Python file at `path`: what the file returns, with the mistakes a
  config file can hold (not Python, no get_config, a key its base lacks) as UserErrors naming
  the file and line. An error raised by a library it calls keeps its traceback."""
  if os.path.isdir(path):
    raise UserError(f'--config={path} is a directory; name a config file (.py) in it')
  if not os.access(path, os.R_OK):
    raise UserError(f'--config={path} cannot be read (permission denied)')
  module_name = f'bert_jax_config_{abs(hash(os.path.realpath(path)))}'
  spec = importlib.util.spec_from_file_location(module_name, path)
  if spec is None or spec.loader is None:
    raise UserError(f'--config={path}: not a Python file (a config file is a .py file with '
                    'get_config())')
  module = importlib.util.module_from_spec(spec)
  try:
    spec.loader.exec_module(module)
  except SyntaxError as e:
    raise UserError(f'{e.filename}:{e.lineno}: {e.msg}: {(e.text or "").strip()}') from e
  except (AttributeError, KeyError, TypeError) as e:
    raise _locked_key_error(e, path) or e
  get_config = getattr(module, 'get_config', None)
  if not callable(get_config):
    raise UserError(f'--config={path} defines no get_config(): a config file defines '
                    'get_config(arg=None) returning an ml_collections.ConfigDict (e.g. '
                    'defaults.pretrain() with your changes; see configs/smoke.py)')
  try:
    params = inspect.signature(get_config).parameters
  except (TypeError, ValueError):
    params = None
  if arg is not None and params is not None and not params:
    raise UserError(f'--config={path}:{arg}: its get_config() takes no argument; drop '
                    f"':{arg}'")
  try:
    config = get_config() if arg is None else get_config(arg)
  except (AttributeError, KeyError, TypeError) as e:
    raise _locked_key_error(e, path) or e
  if not isinstance(config, ml_collections.ConfigDict):
    what = 'None (no return statement?)' if config is None else f'a {type(config).__name__}'
    raise UserError(f'--config={path}: get_config() returned {what}; it returns an '
                    'ml_collections.ConfigDict (e.g. defaults.pretrain() with your changes)')
  return config


def file_parser():
  """The parser of `--config=PATH[:ARG]`: loads the file (or a shipped name) and locks the
  config, so that a misspelt key is an error, in the file as on the command line."""
  # The module that defines DEFINE_config_file; its package does not re-export the parser.
  from ml_collections.config_flags import config_flags  # pylint: disable=g-import-not-at-top

  class Parser(config_flags.ConfigFileFlagParser):

    def parse(self, path):
      # ml_collections' own parse rewraps every ValueError with a traceback in its message and
      # loads the file with importlib's deprecated load_module().
      file, sep, arg = resolve_config_path(path).partition(':')
      if not file:
        raise UserError('--config is empty: name a config file or a shipped config')
      config = _run_get_config(file, arg if sep else None)
      config.lock()
      return config
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
  fine_tuning = config.get('kind') == 'finetune'
  if fine_tuning and key in defaults.MOVED_KEYS and isinstance(config.get(key),
                                                                 ml_collections.ConfigDict):
    # A value for what is now a group (--config.task=mrpc): ml_collections would say that it
    # failed to parse 'mrpc' as a ConfigDict.
    raise UserError(f'{flag}: {defaults.moved_key_message(key)}')
  node, parts = config, key.split('.')
  for i, part in enumerate(parts):
    if isinstance(node, ml_collections.ConfigDict) and part in node:
      node = node[part]
      continue
    where = '.'.join(['config'] + parts[:i])
    if not isinstance(node, ml_collections.ConfigDict):
      raise UserError(f'{flag}: {where} is a value ({node!r}), not a group of keys; '
                      f'set it with --{where}=VALUE')
    if i == 0 and key in defaults.MOVED_KEYS and fine_tuning:
      raise UserError(f'{flag}: {defaults.moved_key_message(key)}')
    keys = sorted(node.keys())
    close = difflib.get_close_matches(part, keys, n=1)
    hint = (f'did you mean --{where}.{close[0]}?' if close else
            f'the keys of {where} are: {", ".join(keys)}')
    raise UserError(f'{flag}: the config ({path}) has no key {where}.{part}; {hint}')
