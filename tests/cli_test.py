"""The `bert-jax` entry point as users run it: from any directory, with neither the current
directory nor the checkout on sys.path (the console script's situation)."""

import importlib.util
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

from bert_jax import cli
from bert_jax import run_lock
from bert_jax import start_up
from bert_jax import config_files
from bert_jax.errors import UserError
import processes

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run_main(tmp_path, args):
  """cli.main(args) in a fresh interpreter that can import bert_jax but not `configs`."""
  site = tmp_path / 'site'
  site.mkdir()
  os.symlink(os.path.join(_ROOT, 'bert_jax'), site / 'bert_jax')
  env = dict(os.environ, PYTHONPATH=str(site))
  code = f'from bert_jax import cli; cli.main({["bert-jax"] + args!r})'
  # 300 s ran out at a load of 8 on 2 cores (TensorFlow and libtpu load before the flag check).
  return subprocess.run([sys.executable, '-c', code], cwd=tmp_path, env=env,
                        capture_output=True, text=True, timeout=900)


_USER_CONFIG = """
from bert_jax import defaults


def get_config(size='mini'):
  config = defaults.pretrain()
  config.model.size = size
  print('user config:', config.model.size)
  return config
"""


# An override's error, given only once its --config has loaded (a config not found is another).
_NOT_A_NUMBER = 'error: flag --config.train.steps=ten: invalid literal'


@pytest.mark.parametrize('config_args', [[], ['--config=bert_base.py'],
                                         ['--config', 'configs/bert_large.py'],
                                         ['--config=USER:small']])
def test_configs_load_from_any_directory(tmp_path, config_args):
  # The default --config (no flag), a shipped name, both flag spellings and a user's own file
  # outside the checkout (which builds on bert_jax.defaults) load the same way. An override that
  # is not a number then stops the command: it is parsed against the loaded config, before
  # TensorFlow and JAX are imported (a fraction of a second, not the 5 s of CPU they take).
  if config_args[-1:] == ['configs/bert_large.py']:
    config_args = ['--config', os.path.join(_ROOT, 'configs', 'bert_large.py')]
  user = config_args == ['--config=USER:small']
  if user:
    (tmp_path / 'elsewhere').mkdir()
    (tmp_path / 'elsewhere' / 'my_config.py').write_text(_USER_CONFIG)
    config_args = [f'--config={tmp_path / "elsewhere" / "my_config.py"}:small']
  proc = _run_main(tmp_path, ['pretrain'] + config_args + ['--config.train.steps=ten'])
  assert "No module named" not in proc.stderr, proc.stderr[-3000:]
  assert _NOT_A_NUMBER in proc.stderr, proc.stderr[-3000:]
  assert ('user config: small' in proc.stdout) == user, proc.stdout


def test_an_installed_wheel_finds_its_shipped_configs_in_any_scheme(tmp_path):
  """A wheel installed outside sys.prefix (pip --user on a TPU VM, --prefix) puts the configs
  under that scheme's share/; `--config=NAME` must find them there."""
  source = tmp_path / 'source'
  for name in ('setup.cfg', 'pyproject.toml', 'README.md'):
    (source / name).parent.mkdir(exist_ok=True)
    shutil.copy(os.path.join(_ROOT, name), source / name)
  for folder in ('bert_jax', 'configs'):
    shutil.copytree(os.path.join(_ROOT, folder), source / folder,
                    ignore=shutil.ignore_patterns('__pycache__'))
  pip = [sys.executable, '-m', 'pip', '--disable-pip-version-check', '-q']
  subprocess.run(pip + ['wheel', '--no-deps', '--no-build-isolation', '-w', str(tmp_path / 'dist'),
                        str(source)], check=True, capture_output=True, timeout=300)
  wheel, = (tmp_path / 'dist').glob('bert_jax-*.whl')
  prefix = tmp_path / 'prefix'
  # --ignore-installed: without it pip would first uninstall this environment's bert_jax (the
  # one the other tests and the notebooks' kernels import).
  subprocess.run(pip + ['install', '--no-deps', '--no-index', '--ignore-installed',
                        f'--prefix={prefix}', str(wheel)],
                 check=True, capture_output=True, timeout=300)
  site_packages, = prefix.glob('lib/python*/site-packages')
  code = ('from bert_jax import cli, config_files; print(cli.__file__); '
          'print(config_files.configs_dir()); '
          "cli.main(['bert-jax', 'pretrain', '--config=bert_base', '--config.train.steps=ten'])")
  proc = subprocess.run([sys.executable, '-c', code], cwd=tmp_path, capture_output=True,
                        text=True, timeout=300, env=dict(os.environ, PYTHONPATH=str(site_packages)))
  module, configs = proc.stdout.splitlines()[:2]
  assert module.startswith(str(site_packages)), proc.stdout
  assert configs == str(prefix / 'share' / 'bert_jax' / 'configs'), proc.stdout
  assert _NOT_A_NUMBER in proc.stderr, proc.stderr[-3000:]  # bert_base.py loaded.


def test_load_config_reads_a_user_file_anywhere(tmp_path):
  path = tmp_path / 'my_config.py'
  path.write_text(_USER_CONFIG)
  config = config_files.load_config(str(path), {'train.steps': 7, 'train.warmup_steps': 1})
  assert (config.model.size, config.train.steps) == ('mini', 7)
  assert config_files.load_config(f'{path}:large').model.size == 'large'
  # The same keys as the shipped default: a user's file starts from the package's defaults.
  assert config.to_dict().keys() == config_files.load_config('default').to_dict().keys()


def test_config_names_resolve_to_the_shipped_files():
  assert config_files.resolve_config_path('smoke') == os.path.join(config_files.configs_dir(),
                                                                   'smoke.py')
  assert config_files.resolve_config_path('finetune_glue:mrpc').endswith('finetune_glue.py:mrpc')
  with pytest.raises(UserError, match='--config=nope.py: no such file'):
    config_files.resolve_config_path('nope.py')


# ---- User mistakes end in one message and exit status 2; bugs keep their traceback ----------


def _cli(args, env=None, cwd=_ROOT, fork=True):
  """`python -m bert_jax.cli ARGS` as a user runs it (this checkout, CPU): forked from a server
  that imported what it imports (tests/forkserver.py), or (`fork=False`) a fresh interpreter,
  for an `env` that sets a variable read at import (a server of its own would cost as much)."""
  variables = dict(os.environ, PYTHONPATH=_ROOT, JAX_PLATFORMS='cpu')
  variables.pop('BERT_JAX_TRACEBACK', None)
  variables.update(env or {})
  python = processes.python(variables) if fork else [sys.executable]
  return subprocess.run(python + ['-m', 'bert_jax.cli'] + args, cwd=cwd, env=variables,
                        capture_output=True, text=True, timeout=600)


# An info line of absl's format, and the module that wrote it.
_INFO_LINE = re.compile(r'^I\d{4} [\d:.]+ +\d+ (\w+)\.py:\d+\] ')
_OUR_MODULES = {name[:-3] for name in os.listdir(os.path.join(_ROOT, 'bert_jax'))
                if name.endswith('.py')}
# TensorFlow's start-up notes, which the CLI holds back.
_START_UP_NOTES = ('absl::InitializeLog', 'cudart_stub', 'oneDNN', 'cuda_platform',
                   'cpu_feature_guard')


def _assert_user_error(proc, command, *fragments):
  """Exit status 2, no traceback, and the last line of stderr is the one message. Above it no
  TensorFlow start-up notes and no other library's info lines (warnings may stand there)."""
  lines = proc.stderr.strip().splitlines()
  last = lines[-1] if lines else ''
  assert proc.returncode == 2, proc.stderr[-3000:]
  assert 'Traceback' not in proc.stderr, proc.stderr[-3000:]
  assert last.startswith(f'bert-jax {command}: error: '), proc.stderr[-3000:]
  for line in lines[:-1]:
    assert not any(note in line for note in _START_UP_NOTES), line
    info = _INFO_LINE.match(line)
    assert not info or info.group(1) in _OUR_MODULES, line
  for fragment in fragments:
    assert fragment in last, (fragment, last)
  return last


@pytest.mark.parametrize('args, fragments', [
    (['pretrain', '--config.train.setps=3'],
     ['--config.train.setps:', 'no key config.train.setps', 'did you mean --config.train.steps?']),
    (['finetune', '--config=finetune_glue:mrpc', '--config.trian.epochs=1'],
     ['no key config.trian', 'did you mean --config.train?']),
    (['finetune', '--config.init_checkpoint=/ckpt'],
     ['--config.init_checkpoint:', 'is now config.train.init_checkpoint']),
    # Fine-tuning's task keys, now in config.task; the task's name where a group is now.
    (['finetune', '--config=finetune_squad', '--config.doc_stride=64'],
     ['--config.doc_stride: config.doc_stride is now config.task.doc_stride',
      '--config.task.doc_stride=...']),
    (['finetune', '--config=finetune_glue:mrpc', '--config.task=sst2'],
     ['--config.task: config.task is now config.task.name', '--config.task.name=...']),
    (['pretrain', '--config=finetune_ner'],
     ['--config is a fine-tuning config (run it with `bert-jax finetune`), not a pre-training']),
    (['data', '--config=no_such_config'],
     ['--config=no_such_config: no such file', 'shipped names: bert_base']),
    (['pretrain', '--config.train.steps=ten'], ['--config.train.steps=ten']),
    (['pretrain', '--workdri=/tmp/x'], ["Unknown command line flag 'workdri'", 'workdir']),
    (['convert', '--output=/tmp/x'], ['missing required flag(s): --input']),
    (['features', '--input=a', '--output=b.jsonl'], ['--init_checkpoint']),
    (['vocab', '--input=a'], ['--output']),
    (['predict', '--workdir=/no/such/run', '--input=a.tsv', '--output=b.jsonl'],
     ['--workdir=/no/such/run has no task.json: not a bert_jax fine-tuning workdir']),
    (['predict', '--workdir=w', '--input=a', '--output=b', '--input_format=xml'],
     ['--input_format', 'xml']),
    (['compile', '--topology=v5e'], ["--topology='v5e': expected GENERATION:SHAPE"]),
    (['data', '--config.data.max_seq_length=1024'],
     ['data.max_seq_length=1024 exceeds model.max_position_embeddings=512']),
    (['data', '--stats=-1'], ['flag --stats=-1: -1 is not a non-negative integer']),  # It hung.
])
def test_flag_and_config_mistakes_are_one_message(args, fragments):
  _assert_user_error(_cli(args), args[0], *fragments)


def test_a_run_refused_once_it_holds_a_new_workdir_leaves_nothing_behind(tmp_path):
  """A pre-training run whose input is refused after it took its new workdir's lock (a scheme
  no reader has) ends as one line, and the folders it made are gone again: the command line
  is recorded in the workdir only as the run's loop starts (it left command.txt behind)."""
  workdir = tmp_path / 'new' / 'run'
  proc = _cli(['pretrain', f'--workdir={workdir}', '--config=smoke',
               '--config.data.input=s3://bucket/corpus.txt'])
  _assert_user_error(proc, 'pretrain', 's3://bucket/corpus.txt: paths starting s3:// are not '
                     'supported')
  assert os.listdir(tmp_path) == []


# cli.main with the named packages made unimportable (an import of one raises ImportError).
_WITHOUT_PACKAGES = """
import sys
for name in sys.argv[1].split(','):
  sys.modules[name] = None
from bert_jax import cli
cli.main(['bert-jax'] + sys.argv[2:])
"""


@pytest.mark.parametrize('blocked, args, fragment', [
    ('tensorflow,jax', ['pretrain', '--workdir=FILE'], '--workdir=FILE is a file, not a folder'),
    ('tensorflow,jax', ['finetune', '--workdir=FILE'], '--workdir=FILE is a file, not a folder'),
    ('tensorflow,jax', ['data', '--workdir=FILE'], '--workdir=FILE is a file, not a folder'),
    ('tensorflow,jax', ['predict', '--workdir=w', '--input=a', '--output=b',
                        '--input_format=xml'], '--input_format=xml'),
    ('tensorflow', ['compile', '--topology=v5e'], "--topology='v5e': expected"),  # After JAX.
    ('tensorflow,jax', ['eval', '--config=finetune_glue', '--checkpoint=FILE'],
     "--config is a fine-tuning config (run it with `bert-jax finetune`), not a pre-training"),
    ('tensorflow,jax', ['finetune', '--config=smoke'],
     "--config is a pre-training config (run it with `bert-jax pretrain`), not a fine-tuning"),
], ids=['pretrain', 'finetune', 'data', 'predict', 'compile', 'eval_kind', 'finetune_kind'])
def test_mistakes_found_before_tensorflow_and_jax_load(tmp_path, blocked, args, fragment):
  # Each mistake is found without the packages it does not need (about 5 s of CPU to load):
  # an import of one would end in a traceback here.
  path = tmp_path / 'a_file'
  path.write_text('')
  args = [a.replace('FILE', str(path)) for a in args]
  proc = subprocess.run([sys.executable, '-c', _WITHOUT_PACKAGES, blocked] + args, cwd=_ROOT,
                        env=dict(os.environ, PYTHONPATH=_ROOT, JAX_PLATFORMS='cpu'),
                        capture_output=True, text=True, timeout=300)
  _assert_user_error(proc, args[0], fragment.replace('FILE', str(path)))


def test_start_up_freezes_the_loaded_modules_and_skips_kerass_optional_imports(tmp_path):
  """After its start-up (TensorFlow and JAX loaded), a command has moved the objects alive then
  into the collector's permanent generation (gc.freeze): its full collections skip them. When
  `cli.main(argv)` returns (here: exits, status 2), they are the collector's again, for a
  process that goes on; the program (`main()`) leaves them frozen to its exit. The start-up did
  not load what Keras imports when installed and no command uses
  (start_up.UNUSED_BY_TENSORFLOWS_IMPORT: IPython, matplotlib, pandas; the test extra
  installs them), and each can be imported after it (pandas by `datasets`)."""
  unused = start_up.UNUSED_BY_TENSORFLOWS_IMPORT
  assert all(importlib.util.find_spec(m) for m in unused)  # Else this checks nothing.
  script = ('import gc, importlib, sys\n'
            'from bert_jax import cli, start_up\n'
            'start = start_up.start\n'
            'def counted(*args, **kwargs):\n'
            '  start(*args, **kwargs)\n'
            '  print("frozen", gc.get_freeze_count(), flush=True)\n'
            '  assert "keras" in sys.modules and "jax" in sys.modules\n'
            '  print("loaded", [m for m in start_up.UNUSED_BY_TENSORFLOWS_IMPORT\n'
            '                   if m in sys.modules], flush=True)\n'
            'start_up.start = counted\n'
            'try:\n'
            '  cli.main(["bert-jax"] + sys.argv[1:])\n'
            'finally:\n'
            '  print("after main", gc.get_freeze_count(), flush=True)\n'
            '  for m in start_up.UNUSED_BY_TENSORFLOWS_IMPORT:\n'
            '    importlib.import_module(m)\n'
            '  print("imported after", flush=True)\n')
  # fill-mask on a missing checkpoint: status 2 after the start-up.
  run = lambda code: subprocess.run(
      [sys.executable, '-c', code, 'fill-mask', f'--checkpoint={tmp_path / "missing"}',
       'a [MASK] b'], cwd=_ROOT, env=dict(os.environ, PYTHONPATH=_ROOT, JAX_PLATFORMS='cpu'),
      capture_output=True, text=True, timeout=300)
  proc = run(script)
  frozen = re.search(r'^frozen (\d+)$', proc.stdout, re.M)
  assert frozen and int(frozen.group(1)) > 100_000, proc.stdout + proc.stderr[-3000:]
  assert re.search(r'^loaded \[\]$', proc.stdout, re.M), proc.stdout
  assert re.search(r'^after main 0$', proc.stdout, re.M), proc.stdout
  assert re.search(r'^imported after$', proc.stdout, re.M), proc.stdout + proc.stderr[-3000:]
  assert proc.returncode == 2, proc.stderr[-3000:]  # The missing checkpoint, after start-up.
  # As the program (`python -m bert_jax.cli`, as the entry point runs it: `main()`), the process
  # ends with the command: they stay frozen through the interpreter's exit, whose collections
  # then skip them.
  program = ('import atexit, gc, runpy\n'
             'atexit.register(lambda: print("at exit", gc.get_freeze_count(), flush=True))\n'
             'runpy.run_module("bert_jax.cli", run_name="__main__", alter_sys=True)\n')
  proc = run(program)
  assert proc.returncode == 2, proc.stderr[-3000:]
  at_exit = re.search(r'^at exit (\d+)$', proc.stdout, re.M)
  assert at_exit and int(at_exit.group(1)) > 100_000, proc.stdout + proc.stderr[-3000:]


def test_unknown_command_suggests_the_closest():
  proc = _cli(['pretrian'])
  assert proc.returncode == 2
  assert "unknown command 'pretrian' (did you mean 'pretrain'?)" in proc.stderr


def test_exit_statuses_are_listed_in_the_help():
  proc = _cli(['--help'])
  assert proc.returncode == 0
  for status, meaning in [(0, 'finished'), (2, 'a mistake'), (1, 'a bug'), (143, 'stopped by')]:
    assert re.search(rf'^  {status} +{meaning}', proc.stdout, re.M), proc.stdout


def _catches(pid, signum):
  """Whether process `pid` has a handler for `signum` (/proc's SigCgt mask)."""
  with open(f'/proc/{pid}/status') as f:
    mask = next(line for line in f if line.startswith('SigCgt:')).split()[1]
  return bool(int(mask, 16) >> (signum - 1) & 1)


@pytest.mark.parametrize('signum, cause', [(signal.SIGINT, 'Ctrl-C'), (signal.SIGTERM, 'SIGTERM')])
@pytest.mark.parametrize('when', ['imports', 'run'])
def test_a_signal_during_start_up_is_one_line_and_status_143(tmp_path, signum, cause, when):
  """Ctrl-C or SIGTERM as soon as the command listens for it (it then imports its libraries),
  or once the run has taken its workdir's lock (reading input, initializing): one line on
  stdout, no traceback, status 143 (errors.EXIT_PREEMPTED), whichever part of start-up it
  lands in."""
  variables = dict(os.environ, PYTHONPATH=_ROOT, JAX_PLATFORMS='cpu')
  workdir = tmp_path / 'run'
  proc = subprocess.Popen([sys.executable, '-m', 'bert_jax.cli', 'pretrain',
                           f'--workdir={workdir}'], cwd=_ROOT, env=variables,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  deadline = time.time() + 240
  # Python catches SIGINT from its start (KeyboardInterrupt); SIGTERM only once bert-jax does.
  ready = ((lambda: _catches(proc.pid, signal.SIGTERM)) if when == 'imports' else
           (lambda: os.path.exists(workdir / run_lock.LOCK_FILE)))
  while proc.poll() is None and time.time() < deadline and not ready():
    time.sleep(0.01)
  proc.send_signal(signum)
  out, err = proc.communicate(timeout=120)
  assert proc.returncode == 143, err[-3000:]
  line = out.strip().splitlines()[-1]
  assert line.startswith(f'bert-jax pretrain: stopped by {cause}'), out
  assert ('before the first step' in line) == (when == 'run'), line
  assert 'Traceback' not in err and 'KeyboardInterrupt' not in err, err[-3000:]


def test_default_workdir_and_cache_never_shadow_the_package(tmp_path, monkeypatch):
  # Python started in the folder that holds them puts that folder first on sys.path: a folder
  # named bert_jax there would be imported instead of the package (issue 34: /tmp/bert_jax).
  from bert_jax import fileio, sample_corpus  # pylint: disable=g-import-not-at-top
  monkeypatch.delenv('BERT_JAX_CACHE', raising=False)
  # The folder that holds a default workdir (/tmp's child), and the cache (~/.cache's child).
  for folder in (os.path.dirname(fileio.default_workdir('smoke')),
                 sample_corpus.default_cache_dir()):
    shadow = tmp_path / os.path.basename(folder)
    shadow.mkdir(exist_ok=True)
    (shadow / '__init__.py').write_text('raise ImportError("the folder, not the package")\n')
  site = tmp_path.parent / (tmp_path.name + '_site')
  site.mkdir()
  os.symlink(os.path.join(_ROOT, 'bert_jax'), site / 'bert_jax')
  proc = subprocess.run([sys.executable, '-c', 'import bert_jax; print(bert_jax.__file__)'],
                        cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(site)),
                        capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr
  assert proc.stdout.startswith(str(site)), proc.stdout


@pytest.mark.parametrize('how', ['flag', 'env'])
def test_traceback_flag_and_environment_show_the_traceback(how):
  args = ['pretrain', '--config.train.setps=3'] + (['--traceback'] if how == 'flag' else [])
  proc = _cli(args, env={'BERT_JAX_TRACEBACK': '1'} if how == 'env' else None)
  assert proc.returncode == 2
  assert 'Traceback (most recent call last)' in proc.stderr
  assert proc.stderr.strip().splitlines()[-1].startswith('bert-jax pretrain: error: ')


def test_a_bug_keeps_its_traceback_and_status_1(tmp_path):
  # A config file that fails is code going wrong, not a setting: the traceback shows where.
  config = tmp_path / 'broken.py'
  config.write_text('def get_config():\n  raise RuntimeError("broken on purpose")\n')
  proc = _cli(['data', f'--config={config}'])
  assert proc.returncode == 1, proc.stderr[-3000:]
  assert 'Traceback (most recent call last)' in proc.stderr
  assert 'RuntimeError: broken on purpose' in proc.stderr
  assert 'bert-jax data: error:' not in proc.stderr


@pytest.fixture(scope='module')
def files(tmp_path_factory):
  """A tiny bert_jax checkpoint, vocabularies good and bad, and task files with one bad line."""
  import jax  # pylint: disable=g-import-not-at-top
  from bert_jax import convert  # pylint: disable=g-import-not-at-top
  from bert_jax import model as model_lib  # pylint: disable=g-import-not-at-top
  root = tmp_path_factory.mktemp('cli_errors')
  words = ['the', 'movie', 'was', 'good', 'bad', 'plot', '.']
  vocab = root / 'vocab.txt'
  vocab.write_text('\n'.join(['[PAD]', '[UNK]', '[CLS]', '[SEP]', '[MASK]'] + words) + '\n')
  config = model_lib.BertConfig(vocab_size=12, hidden_size=32, num_hidden_layers=2,
                                num_attention_heads=4, intermediate_size=64,
                                max_position_embeddings=512)
  ckpt = str(root / 'ckpt')
  convert.export_bert_jax(config, model_lib.init_params(config, jax.random.key(0)), ckpt,
                          vocab_file=str(vocab), lower_case=True)
  (root / 'big_vocab.txt').write_text(vocab.read_text() + 'story\nactors\n')
  (root / 'no_mask.txt').write_text('[PAD]\n[UNK]\n[CLS]\n[SEP]\nthe\n')
  (root / 'binary.txt').write_bytes(b'[PAD]\n[UNK]\n\xff\xfe\x00\x01\n')
  (root / 'empty.txt').write_text('')
  (root / 'SST-2').mkdir()
  (root / 'SST-2' / 'dev.tsv').write_text('sentence\tlabel\nthe movie was good\t1\n')
  (root / 'SST-2' / 'train.tsv').write_text(
      'sentence\tlabel\nthe movie was good\t1\nthe plot was bad\t0\textra\n')
  (root / 'squad').mkdir()
  (root / 'squad' / 'train-v1.1.json').write_text('{"data": [\n  {"title": "x",,}\n]}\n')
  (root / 'conll').mkdir()
  (root / 'conll' / 'train.txt').write_text('the DT B-NP O\nmovie NN I-NP\n')
  return root, ckpt


def test_start_up_lines_are_held_back_as_a_user_runs_the_commands(files, tmp_path):
  """With the test extra installed (libtpu, JAX's CUDA plugin, TensorFlow) and the commands run
  as a user runs them (the installed entry point, none of conftest's variables): a command that
  runs JAX (fill-mask) and a packed `compile` (TensorFlow, then libtpu's topology) print none of
  their start-up lines: TensorFlow's oneDNN and cuInit notes, libtpu's block with its
  INVALID_ARGUMENT line. --traceback and --verbosity=1 show them (start_up.start)."""
  _, ckpt = files
  env = processes.user_env(str(tmp_path))
  # libtpu starts (and prints its block) even while another process holds its lock
  # (/tmp/libtpu_lockfile: another test's compile); JAX would skip it quietly then.
  env['ALLOW_MULTIPLE_LIBTPU_LOAD'] = '1'
  run = lambda args: subprocess.run(['bert-jax'] + args, cwd=tmp_path, env=env,
                                    capture_output=True, text=True, timeout=600)
  fill_mask = ['fill-mask', f'--checkpoint={ckpt}', '--top_k=2', 'the [MASK] was good .']
  quiet = run(fill_mask)
  processes.check_console('fill-mask', quiet, ('"predictions"',))
  compiled = run(['compile', '--config=smoke', '--topology=v5e:2x2', '--config.train.phases=',
                  '--config.train.batch_size=8', '--config.data.packing=true'])
  processes.check_console('compile', compiled, ('tiny on v5e:2x2', 'roofline bound'))
  for flag in ('--traceback', '--verbosity=1'):
    shown = run(fill_mask + [flag])
    assert shown.returncode == 0, shown.stderr[-3000:]
    assert shown.stdout == quiet.stdout
    # libtpu's note on a machine without a TPU. (TensorFlow's oneDNN note is not made at all:
    # the CLI turns TensorFlow's oneDNN kernels off, TF_ENABLE_ONEDNN_OPTS=0.)
    assert 'TPU_WORKER_HOSTNAMES' in shown.stderr, (flag, shown.stderr[-3000:])
    assert 'oneDNN' not in shown.stderr, (flag, shown.stderr[-3000:])


def _finetune(config, files, *args):
  root, ckpt = files
  return _cli(['finetune', f'--config={config}', f'--config.train.init_checkpoint={ckpt}',
               f'--workdir={root}/finetune_{len(args)}_{config.replace(":", "_")}'] + list(args))


def test_malformed_glue_file_is_named_with_its_line(files):
  proc = _finetune('finetune_glue:sst2', files, f'--config.task.data_dir={files[0]}')
  _assert_user_error(proc, 'finetune', 'SST-2/train.tsv:3: expected 2 tab-separated columns, '
                     'got 3')


def test_malformed_squad_file_is_named_with_its_line(files):
  proc = _finetune('finetune_squad:v1', files, f'--config.task.data_dir={files[0]}/squad')
  _assert_user_error(proc, 'finetune', 'train-v1.1.json:2:', 'not valid JSON')


def test_malformed_conll_file_is_named_with_its_line(files):
  proc = _finetune('finetune_ner', files, f'--config.task.data_dir={files[0]}/conll')
  _assert_user_error(proc, 'finetune', 'conll/train.txt:2: 3 columns where earlier lines have 4')


def test_vocabulary_larger_than_the_checkpoint_is_refused(files):
  proc = _finetune('finetune_glue:sst2', files, f'--config.task.data_dir={files[0]}',
                   f'--config.data.vocab_file={files[0]}/big_vocab.txt')
  _assert_user_error(proc, 'finetune', 'big_vocab.txt has 14 tokens but '
                     'config.train.init_checkpoint=',
                     'use the vocabulary the checkpoint was trained with')


@pytest.mark.parametrize('vocab, fragments', [
    ('no_mask.txt', ["lacks special tokens ['[MASK]']", 'each on a line of its own']),
    ('binary.txt', ['binary.txt:3: not UTF-8 text']),
    ('missing.txt', ['Vocabulary file not found']),
])
def test_unusable_vocabularies_are_named(files, vocab, fragments):
  proc = _cli(['data', f'--config.data.vocab_file={files[0]}/{vocab}'])
  _assert_user_error(proc, 'data', *fragments)


def test_inputs_that_match_nothing_or_hold_no_text(files):
  root, _ = files
  proc = _cli(['data', f'--config.data.input={root}/nothing-*.txt',
               f'--config.data.vocab_file={root}/vocab.txt'])
  _assert_user_error(proc, 'data', "data.input: '", "nothing-*.txt' matches no file")
  proc = _cli(['pretrain', f'--config.data.input={root}/empty.txt', f'--workdir={root}/empty'])
  _assert_user_error(proc, 'pretrain', "data.input='", 'has no text to train a vocabulary on')
  proc = _cli(['vocab', f'--input={root}/empty.txt', f'--output={root}/v.txt'])
  _assert_user_error(proc, 'vocab', 'No text in')


def test_meshes_and_batches_that_do_not_divide(files):
  root, _ = files
  # 4 divides the batches (3 would not: refused where the config loads, inputs_test.py).
  proc = _cli(['pretrain', '--config.mesh.data=4', f'--workdir={root}/mesh',
               f'--config.data.vocab_file={root}/vocab.txt'])
  _assert_user_error(proc, 'pretrain', "mesh {'data': 4, 'fsdp': 1, 'tensor': 1} needs 4 devices")
  proc = _cli(['pretrain', '--config.train.batch_size=6', f'--workdir={root}/batch',
               f'--config.data.vocab_file={root}/vocab.txt'],
              env={'XLA_FLAGS': '--xla_force_host_platform_device_count=4'})
  _assert_user_error(proc, 'pretrain', 'train.batch_size=6', '4 data-parallel shards')


@pytest.mark.parametrize('platforms', ['gpu', 'tpu'])
def test_a_platform_this_machine_lacks_is_one_line(files, platforms):
  """JAX_PLATFORMS=gpu (or tpu) on a machine without one: one line naming the setting, not two
  tracebacks (one naming ROCm, one advising `sudo rm` of libtpu's lock file)."""
  _, ckpt = files
  proc = _cli(['fill-mask', f'--checkpoint={ckpt}', 'the [MASK] was good'],
              env={'JAX_PLATFORMS': platforms}, fork=False)
  kind = platforms.upper()
  _assert_user_error(proc, 'fill-mask', f'error: JAX_PLATFORMS={platforms}: JAX could not start '
                     f'a {kind} backend: this machine has no usable {kind}',
                     'unset JAX_PLATFORMS')
  assert 'sudo' not in proc.stderr and 'rocm' not in proc.stderr.lower()


def test_checkpoints_that_do_not_match(files):
  root, ckpt = files
  proc = _cli(['pretrain', f'--config.train.init_checkpoint={ckpt}', f'--workdir={root}/init',
               f'--config.data.vocab_file={ckpt}/vocab.txt'])
  _assert_user_error(proc, 'pretrain', f'train.init_checkpoint={ckpt}: hidden_size=32 but the '
                     'model config has 128')
  proc = _cli(['convert', f'--input={root}/nowhere', f'--output={root}/out'])
  _assert_user_error(proc, 'convert', f'{root}/nowhere: no such directory or TF checkpoint')
  proc = _cli(['features', f'--init_checkpoint={ckpt}', f'--input={root}/nowhere.txt',
               f'--output={root}/f.jsonl'])
  _assert_user_error(proc, 'features', '--input: ', 'nowhere.txt: no such file')


@pytest.mark.parametrize('body, fragment', [
    ('def get_config(:\n  pass\n', 'mine.py:1: invalid syntax'),
    ('from bert_jax.errors import UserError\ndef get_config():\n'
     '  raise UserError("task foo: unknown")\n', 'error: task foo: unknown'),
    ('from bert_jax import defaults\ndef get_config():\n  c = defaults.pretrain()\n'
     '  c.train.stepz = 4\n  return c\n', "mine.py:4: c.train.stepz = 4: no key 'stepz'"),
])
def test_mistakes_in_a_config_file_are_one_message(tmp_path, body, fragment):
  (tmp_path / 'mine.py').write_text(body)
  last = _assert_user_error(_cli(['data', f'--config={tmp_path}/mine.py']), 'data')
  assert fragment in last
