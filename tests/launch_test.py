"""Tests for launch/: TPU commands in --dry_run, the relaunch loop against a fake gcloud, and
the GPU scripts with fake SLURM variables and fake scontrol/srun on PATH."""

import importlib.util
import json
import os
import re
import shlex
import stat
import subprocess
import sys
import textwrap

import pytest

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_LAUNCH = os.path.join(_ROOT, 'launch')


def _load_tpu():
  spec = importlib.util.spec_from_file_location('launch_tpu', os.path.join(_LAUNCH, 'tpu.py'))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


tpu = _load_tpu()


def _write_exe(path, text):
  with open(path, 'w') as f:
    f.write(textwrap.dedent(text).lstrip())
  os.chmod(path, os.stat(path).st_mode | stat.S_IXUSR)
  return str(path)


@pytest.fixture
def configs(tmp_path):
  """A config dir with a variant and its base, as the real configs/ has."""
  cfg_dir = tmp_path / 'configs'
  cfg_dir.mkdir()
  (cfg_dir / 'default.py').write_text('def get_config(): pass\n')
  (cfg_dir / 'bert_large.py').write_text('import default\n')
  (cfg_dir / 'notes.txt').write_text('not a config\n')
  return cfg_dir


@pytest.fixture(autouse=True, scope='module')
def no_real_gcloud(tmp_path_factory):
  """Puts a gcloud that always fails first on PATH: no test may reach the real one."""
  bin_dir = tmp_path_factory.mktemp('guard')
  _write_exe(bin_dir / 'gcloud', """
      #!/bin/bash
      echo "the real gcloud must not run in tests: $*" >&2; exit 97
      """)
  old_path = os.environ['PATH']
  os.environ['PATH'] = f'{bin_dir}:{old_path}'
  yield
  os.environ['PATH'] = old_path


def _dry_run(argv):
  """Runs launch/tpu.py as a program; returns its stdout split into argv lists and lines."""
  # --dry_run goes before any `--`, after which arguments belong to bert-jax.
  result = subprocess.run(
      [sys.executable, os.path.join(_LAUNCH, 'tpu.py'), argv[0], '--dry_run', *argv[1:]],
      capture_output=True, text=True, timeout=30, check=False)
  assert result.returncode == 0, result.stderr
  lines = result.stdout.splitlines()
  return [shlex.split(l) for l in lines if not l.startswith('#')], lines


def _find(commands, *words):
  """The commands that contain all `words` as arguments."""
  return [c for c in commands if all(w in c for w in words)]


V4 = ['--name=bert-large', '--zone=us-central2-b', '--accelerator_type=v4-32', '--capacity=spot']


# ---- Accelerator types ----------------------------------------------------------------------


@pytest.mark.parametrize('name,gcloud_name,hosts,runtime', [
    ('v4-8', 'v4-8', 1, 'tpu-ubuntu2204-base'),
    ('v4-32', 'v4-32', 4, 'tpu-ubuntu2204-base'),
    ('v4-4096', 'v4-4096', 512, 'tpu-ubuntu2204-base'),
    ('v5e-8', 'v5litepod-8', 1, 'v2-alpha-tpuv5-lite'),
    ('v5e-256', 'v5litepod-256', 64, 'v2-alpha-tpuv5-lite'),
    ('v5litepod-16', 'v5litepod-16', 4, 'v2-alpha-tpuv5-lite'),
    ('v5p-128', 'v5p-128', 16, 'v2-alpha-tpuv5'),
    ('v6e-64', 'v6e-64', 16, 'v2-alpha-tpuv6e'),
])
def test_accelerator_types(name, gcloud_name, hosts, runtime):
  normalized = tpu.normalize_accelerator_type(name)
  assert normalized == gcloud_name
  assert tpu.num_hosts(normalized) == hosts
  assert tpu.RUNTIME_VERSIONS[tpu.tpu_generation(normalized)] == runtime


@pytest.mark.parametrize('bad', ['v4-31', 'v4-8192', 'v5e-12', 'v6e-512', 'v3-8', 'tpu', ''])
def test_bad_accelerator_type_is_an_error_naming_the_flag(bad):
  with pytest.raises(tpu.LaunchError, match='--accelerator_type'):
    tpu.parse_args(['create', '--name=a', '--zone=us-central2-b', f'--accelerator_type={bad}'])


def test_bad_accelerator_type_cli_exit_status():
  result = subprocess.run(
      [sys.executable, os.path.join(_LAUNCH, 'tpu.py'), 'create', '--name=a',
       '--zone=us-central2-b', '--accelerator_type=v4-31', '--dry_run'],
      capture_output=True, text=True, timeout=30, check=False)
  assert result.returncode == 2
  assert '--accelerator_type' in result.stderr and "'v4-31'" in result.stderr
  assert result.stdout == ''  # Nothing printed as if it would run.


# ---- Validation -----------------------------------------------------------------------------


@pytest.mark.parametrize('argv,flag', [
    (['create', '--zone=us-central2-b', '--accelerator_type=v4-8'], '--name'),
    (['create', '--name=Bad_Name', '--zone=us-central2-b', '--accelerator_type=v4-8'],
     '--name'),
    (['create', '--name=a', '--accelerator_type=v4-8'], '--zone'),
    (['create', '--name=a', '--zone=uscentral', '--accelerator_type=v4-8'], '--zone'),
    (['create', '--name=a', '--zone=us-central2-b'], '--accelerator_type'),
    (['create', *V4[:3], '--capacity=preemptible'], '--capacity=preemptible'),
    (['create', *V4[:3], '--api=tpu-vm', '--capacity=best-effort'], '--capacity=best-effort'),
    (['run', *V4, '--workdir=gs://b/w'], '--config'),
    (['run', *V4, '--config=configs/x.py'], '--workdir'),
    (['run', *V4, '--config=configs/x.yaml', '--workdir=gs://b/w'], '--config'),
    (['run', *V4, '--config=c.py', '--workdir=gs://b/w', '--env=1BAD=x'], '--env'),
    (['run', *V4, '--config=c.py', '--workdir=gs://b/w', '--conf=x'], '--conf=x'),
    (['run', *V4, '--config=c.py', '--workdir=gs://b/w', '--config.x', '1'], '--config.x'),
    (['setup', *V4, '--config=/no/such/config.py'], '--config'),
    (['run', *V4, '--config=c.py', '--workdir=gs://b/w', '--max_restarts=-1'],
     '--max_restarts'),
])
def test_flag_errors_name_the_flag(argv, flag):
  with pytest.raises(tpu.LaunchError) as error:
    tpu.parse_args(argv)
  assert flag in str(error.value)


def test_local_workdir_on_multi_host_slice_is_an_error():
  with pytest.raises(tpu.LaunchError, match=r'--workdir must be a gs:// path.*4 hosts'):
    tpu.parse_args(['run', *V4, '--config=configs/x.py', '--workdir=/tmp/run'])
  with pytest.raises(tpu.LaunchError, match='gs://'):
    tpu.parse_args(['run', '--name=a', '--zone=us-west4-a', '--accelerator_type=v5e-16',
                    '--config=configs/x.py', '--workdir=/tmp/run'])
  # One host: a local workdir is fine.
  args = tpu.parse_args(['run', '--name=a', '--zone=us-central2-b', '--accelerator_type=v4-8',
                         '--config=configs/x.py', '--workdir=/tmp/run'])
  assert args.workdir == '/tmp/run'
  # But not for a relaunch: the new VM would not have it, so the rerun could not resume.
  for argv in (['watch'], ['run', '--relaunch']):
    with pytest.raises(tpu.LaunchError, match=r'--workdir must be a gs:// path with `watch`'):
      tpu.parse_args([*argv, '--name=a', '--zone=us-central2-b', '--accelerator_type=v4-8',
                      f'--config={_ROOT}/configs/smoke.py', '--workdir=/tmp/run',
                      '--install=bert_jax[tpu]'])
  # A mount every worker shares and that outlives the VMs (Filestore, gcsfuse) is fine for both.
  args = tpu.parse_args(['watch', *V4, f'--config={_ROOT}/configs/smoke.py',
                         '--workdir=/mnt/filestore/run', '--shared_workdir',
                         '--install=bert_jax[tpu]'])
  assert tpu.train_command(args)[3] == '--workdir=/mnt/filestore/run'
  assert '--shared_workdir' not in tpu.train_command(args)


def test_missing_wheel_is_an_error(configs):
  with pytest.raises(tpu.LaunchError, match='--install'):
    tpu.parse_args(['setup', *V4, f'--config={configs}/bert_large.py',
                    '--install=/no/such/bert_jax-0.1.0-py3-none-any.whl'])
  with pytest.raises(tpu.LaunchError, match='--install: directory'):
    tpu.parse_args(['setup', *V4, f'--config={configs}/bert_large.py', '--install=./no/such'])


# ---- v4-32 pod slice, spot queued resource --------------------------------------------------


def test_v4_32_queued_spot_create_and_delete():
  commands, lines = _dry_run(['create', *V4, '--project=my-proj'])
  create = commands[0]
  assert create[:6] == ['gcloud', 'compute', 'tpus', 'queued-resources', 'create', 'bert-large']
  for flag in ('--node-id=bert-large', '--accelerator-type=v4-32',
               '--runtime-version=tpu-ubuntu2204-base', '--zone=us-central2-b', '--spot',
               '--project=my-proj'):
    assert flag in create
  # Waits for the queued resource to become ACTIVE.
  assert _find(commands, 'describe', '--format=value(state.state)')
  assert any('ACTIVE' in l for l in lines if l.startswith('#'))

  commands, _ = _dry_run(['delete', *V4])
  assert commands == [['gcloud', 'compute', 'tpus', 'queued-resources', 'delete', 'bert-large',
                       '--zone=us-central2-b', '--force', '--quiet']]


def test_v4_32_setup_copies_configs_and_installs_on_all_workers(configs, tmp_path):
  wheel = tmp_path / 'bert_jax-0.1.0-py3-none-any.whl'
  wheel.write_bytes(b'PK')
  commands, _ = _dry_run(['setup', *V4, f'--config={configs}/bert_large.py', f'--install={wheel}'])
  assert commands and all('--worker=all' in c for c in commands)
  scps = _find(commands, 'scp')
  assert _find(scps, str(wheel), 'bert-large:bert_jax_run/dist/')
  config_scp = _find(scps, 'bert-large:bert_jax_run/configs/')[0]
  # The variant and the base it imports go; other files do not.
  assert str(configs / 'bert_large.py') in config_scp
  assert str(configs / 'default.py') in config_scp
  assert str(configs / 'notes.txt') not in config_scp
  install = _find(commands, 'ssh')[-1]
  remote = install[install.index('--command') + 1]
  assert "'dist/bert_jax-0.1.0-py3-none-any.whl[tpu]'" in remote
  assert '--force-reinstall --no-deps dist/bert_jax-0.1.0-py3-none-any.whl' in remote
  # The remote directories exist before anything is copied into them.
  assert 'mkdir -p' in commands[0][commands[0].index('--command') + 1]


def test_shipped_config_name_is_passed_on_and_nothing_is_copied(tmp_path):
  wheel = tmp_path / 'bert_jax-0.1.0-py3-none-any.whl'
  wheel.write_bytes(b'PK')
  argv = [*V4, '--mode=finetune', '--config=finetune_glue:mrpc', '--workdir=gs://b/mrpc',
          f'--install={wheel}']
  commands, _ = _dry_run(['setup', *argv])
  assert not _find(_find(commands, 'scp'), 'bert-large:bert_jax_run/configs/')
  assert tpu.train_command(tpu.parse_args(['run', *argv]))[:3] == [
      'bert-jax', 'finetune', '--config=finetune_glue:mrpc']
  with pytest.raises(tpu.LaunchError, match="'finetune_glu' is neither a config file nor a "
                     'shipped config'):
    tpu.parse_args(['run', *V4, '--config=finetune_glu', '--workdir=gs://b/w'])


def test_setup_from_checkout_builds_a_wheel_first(configs):
  commands, _ = _dry_run(['setup', *V4, f'--config={configs}/bert_large.py'])
  build = commands[0]
  assert build[1:4] == ['-m', 'pip', 'wheel'] and build[-1] == _ROOT
  expected = tpu.expected_wheel(_ROOT)
  assert os.path.dirname(expected) == tpu.wheel_dir()
  assert _find(commands, 'scp', expected)


def test_setup_with_pip_requirement(configs):
  spec = 'bert_jax[tpu] @ git+https://github.com/example/bert_jax@v0.1.0'
  commands, _ = _dry_run(['setup', *V4, f'--config={configs}/bert_large.py', f'--install={spec}'])
  assert len(_find(commands, 'scp')) == 1  # Only the configs are copied.
  remote = commands[-1][commands[-1].index('--command') + 1]
  assert shlex.split(remote.split('&&')[1]) == ['python3', '-m', 'pip', 'install', spec]


def test_v4_32_run_on_all_workers_with_overrides_and_log():
  commands, _ = _dry_run(['run', *V4, '--config=configs/bert_large.py:arg',
                          '--workdir=gs://bucket/bert_large', '--config.train.batch_size=1024',
                          '--env=LIBTPU_INIT_ARGS=--xla_tpu_x=1 --y', '--', '--alsologtostderr'])
  (ssh,) = commands
  assert ssh[:6] == ['gcloud', 'compute', 'tpus', 'tpu-vm', 'ssh', 'bert-large']
  assert '--worker=all' in ssh
  remote = ssh[ssh.index('--command') + 1]
  script, log = remote.rsplit(' | ', 1)
  assert log == 'tee -a logs/pretrain.log'
  steps = [s.strip() for s in script.split(' && ')]
  assert steps[0] == 'cd bert_jax_run'
  assert shlex.split(steps[-1]) == [
      'bert-jax', 'pretrain', '--config=configs/bert_large.py:arg',
      '--workdir=gs://bucket/bert_large', '--config.train.batch_size=1024',
      '--alsologtostderr', '2>&1']
  assert 'set -o pipefail' in steps
  assert "export LIBTPU_INIT_ARGS='--xla_tpu_x=1 --y'" in steps
  # Cloud TPU finds the other workers itself: no coordinator flags.
  assert '--coordinator_address' not in remote


def test_remote_run_script_is_valid_shell():
  args = tpu.parse_args(['run', *V4, '--config=configs/x.py', '--workdir=gs://b/w',
                         "--config.model.name=it's"])
  remote = tpu.run_commands(args)[0][-1]
  result = subprocess.run(['bash', '-n', '-c', remote], capture_output=True, text=True,
                          check=False)
  assert result.returncode == 0, result.stderr
  assert "--config.model.name=it's" in shlex.split(remote.split(' && ')[-1])


def test_v4_32_watch_dry_run_lists_relaunch_commands(configs):
  commands, lines = _dry_run(['watch', *V4, f'--config={configs}/bert_large.py',
                              '--workdir=gs://bucket/bert_large', '--max_restarts=7',
                              '--install=bert_jax[tpu]'])
  verbs = [c[4] if c[0] == 'gcloud' else c[0] for c in commands]
  # State check, run; then the relaunch: delete, create, wait, setup, run.
  assert verbs[:2] == ['describe', 'ssh']
  relaunch = verbs[2:]
  assert relaunch[:3] == ['delete', 'create', 'describe']
  assert relaunch[-1] == 'ssh' and 'scp' in relaunch
  assert commands[1] == commands[-1]  # The relaunch reruns the same training command.
  assert any('--max_restarts=7' in l for l in lines if l.startswith('#'))
  # `run --relaunch` is the same thing.
  same, _ = _dry_run(['run', '--relaunch', *V4, f'--config={configs}/bert_large.py',
                      '--workdir=gs://bucket/bert_large', '--max_restarts=7',
                      '--install=bert_jax[tpu]'])
  assert same == commands


# ---- v5e-256 --------------------------------------------------------------------------------


def test_v5e_256_uses_v5litepod_name_and_runtime():
  commands, _ = _dry_run(['create', '--name=bert-v5e', '--zone=us-west4-a',
                          '--accelerator_type=v5e-256', '--capacity=best-effort'])
  create = commands[0]
  assert create[:3] == ['gcloud', 'alpha', 'compute']  # --best-effort is alpha-only.
  assert '--accelerator-type=v5litepod-256' in create
  assert '--runtime-version=v2-alpha-tpuv5-lite' in create
  assert '--best-effort' in create

  commands, _ = _dry_run(['create', '--name=bert-v5e', '--zone=us-west4-a',
                          '--accelerator_type=v5e-256', '--api=tpu-vm',
                          '--capacity=preemptible', '--runtime_version=v2-custom',
                          '--create_flag=--network=my-net'])
  assert commands[0] == ['gcloud', 'compute', 'tpus', 'tpu-vm', 'create', 'bert-v5e',
                         '--accelerator-type=v5litepod-256', '--version=v2-custom',
                         '--zone=us-west4-a', '--preemptible', '--network=my-net']
  assert _find(commands, 'tpu-vm', 'describe', '--format=value(state)')


# ---- Relaunch loop against a fake gcloud ----------------------------------------------------


@pytest.fixture
def fake_gcloud(tmp_path):
  """A gcloud that keeps the TPU state in a file and is preempted during the first N runs."""
  state = tmp_path / 'state'
  calls = tmp_path / 'calls'
  runs = tmp_path / 'runs'
  script = f"""
      #!/bin/bash
      echo "$*" >> {calls}
      case "$*" in
        *" describe "*)
          if [[ ! -f {state} ]]; then echo "ERROR: NOT_FOUND" >&2; exit 1; fi
          cat {state}
          # A repair ends on the next look.
          if grep -q REPAIRING {state}; then echo ACTIVE > {state}; fi ;;
        *" create "*) echo ACTIVE > {state} ;;
        *" delete "*) rm -f {state} ;;
        *bert-jax*)
          n=$(( $(cat {runs} 2>/dev/null || echo 0) + 1 )); echo $n > {runs}
          if (( n <= ${{PREEMPTIONS:-0}} )); then echo SUSPENDED > {state}; exit 255; fi
          if (( n <= ${{REPAIRS:-0}} )); then echo REPAIRING > {state}; exit 255; fi
          if (( n <= ${{STOPS:-0}} )); then exit 143; fi
          exit ${{RUN_STATUS:-0}} ;;
      esac
      """
  return _write_exe(tmp_path / 'gcloud', script), state, calls


def _watch(gcloud, configs, *extra):
  argv = ['watch', *V4, f'--config={configs}/bert_large.py', '--workdir=gs://b/w',
          '--install=bert_jax[tpu]', '--poll_seconds=0', f'--gcloud={gcloud}', *extra]
  return tpu.main(argv, tpu.Shell(dry_run=False, sleep=lambda s: None))


def _verbs(calls):
  out = []
  for line in calls.read_text().splitlines():
    words = line.split()
    out.append('run' if 'bert-jax' in line else words[3])
  return out


def test_watch_recreates_after_preemption_and_resumes(fake_gcloud, configs, monkeypatch):
  gcloud, state, calls = fake_gcloud
  state.write_text('ACTIVE\n')
  monkeypatch.setenv('PREEMPTIONS', '2')
  assert _watch(gcloud, configs, '--max_restarts=3') == 0
  verbs = _verbs(calls)
  assert verbs.count('run') == 3
  assert verbs.count('delete') == 2 and verbs.count('create') == 2
  # Each relaunch: delete, create, then setup (ssh + scp + ssh) before the next run.
  second = verbs.index('run', verbs.index('run') + 1)
  between = verbs[verbs.index('run') + 1:second]
  assert between.index('delete') < between.index('create') < between.index('scp')
  assert between[-1] == 'ssh'  # pip install
  assert all('--workdir=gs://b/w' in l for l in calls.read_text().splitlines()
             if 'bert-jax' in l)


def test_watch_reruns_without_recreating_after_a_repair(fake_gcloud, configs, monkeypatch):
  gcloud, state, calls = fake_gcloud
  state.write_text('ACTIVE\n')
  monkeypatch.setenv('REPAIRS', '1')
  assert _watch(gcloud, configs) == 0
  verbs = _verbs(calls)
  assert verbs.count('run') == 2
  assert 'delete' not in verbs and 'create' not in verbs


def test_watch_reruns_a_run_stopped_by_sigterm_on_a_healthy_tpu(fake_gcloud, configs,
                                                                 monkeypatch):
  """Status 143 (errors.EXIT_PREEMPTED: SIGTERM, saved) with the TPU still ACTIVE, as after a
  maintenance event: the same TPU runs the command again, which resumes."""
  from bert_jax import errors  # pylint: disable=g-import-not-at-top
  assert tpu.PREEMPTED_STATUS == errors.EXIT_PREEMPTED
  gcloud, state, calls = fake_gcloud
  state.write_text('ACTIVE\n')
  monkeypatch.setenv('STOPS', '2')
  assert _watch(gcloud, configs, '--max_restarts=2') == 0
  verbs = _verbs(calls)
  assert verbs.count('run') == 3
  assert 'delete' not in verbs and 'create' not in verbs


def test_watch_gives_up_after_max_restarts(fake_gcloud, configs, monkeypatch, capsys):
  gcloud, state, calls = fake_gcloud
  state.write_text('ACTIVE\n')
  monkeypatch.setenv('PREEMPTIONS', '100')
  assert _watch(gcloud, configs, '--max_restarts=2') == 2
  assert _verbs(calls).count('run') == 3
  assert '--max_restarts=2' in capsys.readouterr().err


def test_watch_does_not_relaunch_a_failing_program(fake_gcloud, configs, monkeypatch, capsys):
  gcloud, state, calls = fake_gcloud
  state.write_text('ACTIVE\n')
  monkeypatch.setenv('RUN_STATUS', '1')
  assert _watch(gcloud, configs) == 2
  verbs = _verbs(calls)
  assert verbs.count('run') == 1 and 'delete' not in verbs
  assert 'healthy TPU' in capsys.readouterr().err


def test_watch_from_nothing_creates_and_sets_up_first(fake_gcloud, configs):
  gcloud, state, calls = fake_gcloud
  assert not state.exists()
  assert _watch(gcloud, configs) == 0
  verbs = _verbs(calls)
  assert 'delete' not in verbs
  assert verbs.index('create') < verbs.index('scp') < verbs.index('run')


# ---- A preempted fine-tuning run recovered for real, on Cloud Storage ------------------------


_FAKE_TPU_VM = r"""#!{python}
# A gcloud for one single-host TPU VM. The VM's disk is the folder {vm} (created with the TPU,
# wiped when it is deleted); Cloud Storage is the test's server (tests/gcs_server.py), which
# outlives the VM: `ssh` runs the remote command unchanged, with bash, in the server's network
# namespace. Installing the package puts the console script pip would install in ~/.local/bin.
# The first training run is preempted: once it has logged a step (its metrics.jsonl in the
# bucket), its bert-jax process gets SIGTERM (as a VM shutting down sends), and when it has
# exited the TPU is SUSPENDED and ssh exits 255.
import glob, json, os, re, shutil, signal, subprocess, sys, time
STATE, CALLS, VM, RUNS, NETNS = {state!r}, {calls!r}, {vm!r}, {runs!r}, {netns!r}


def read_gs(path):
  from google.cloud import storage
  bucket, name = path[len('gs://'):].split('/', 1)
  blob = storage.Client().bucket(bucket).get_blob(name)
  return blob.download_as_text() if blob else ''


args = sys.argv[1:]
with open(CALLS, 'a') as f:
  f.write(' '.join(args) + '\n')
verb = args[3]
if verb == 'describe':
  if not os.path.exists(STATE):
    sys.exit('ERROR: (gcloud) NOT_FOUND')
  print(open(STATE).read())
elif verb == 'create':
  os.makedirs(VM)
  open(STATE, 'w').write('ACTIVE')
elif verb == 'delete':
  os.remove(STATE)
  shutil.rmtree(VM)
elif verb == 'scp':
  files = [a for a in args[4:] if not a.startswith('--')]
  for source in files[:-1]:
    shutil.copy(source, os.path.join(VM, files[-1].split(':', 1)[1]))
elif verb == 'ssh':
  remote = args[args.index('--command') + 1]
  if 'pip install' in remote:
    os.makedirs(f'{{VM}}/.local/bin', exist_ok=True)
    with open(f'{{VM}}/.local/bin/bert-jax', 'w') as f:
      f.write('#!/bin/bash\necho $$ > "$HOME/bert-jax.pid"\n'
              'PYTHONPATH={repo} exec {python} -m bert_jax.cli "$@"\n')
    os.chmod(f'{{VM}}/.local/bin/bert-jax', 0o755)
    sys.exit(0)
  n = len(glob.glob(f'{{RUNS}}/*.log')) + 1 if 'bert-jax' in remote else 0
  log = open(f'{{RUNS}}/{{n}}.log' if n else os.devnull, 'w')
  proc = subprocess.Popen(NETNS + ['bash', '-c', remote], cwd=VM, env=dict(os.environ, HOME=VM),
                          stdout=log, stderr=subprocess.STDOUT)
  if n != 1:
    sys.exit(proc.wait())
  metrics = re.search(r'--workdir=(\S+)', remote).group(1) + '/metrics.jsonl'
  deadline = time.time() + 300
  while proc.poll() is None and time.time() < deadline and '"loss"' not in read_gs(metrics):
    time.sleep(0.05)
  if proc.poll() is None:  # Else it ended first: 1.status says so, and the test fails on it.
    os.kill(int(open(f'{{VM}}/bert-jax.pid').read()), signal.SIGTERM)
  json.dump(proc.wait(), open(f'{{RUNS}}/1.status', 'w'))
  open(STATE, 'w').write('SUSPENDED')
  sys.exit(255)
"""

_SST2_WORDS = {1: ['good', 'great', 'fine', 'nice'], 0: ['bad', 'awful', 'poor', 'sad'],
               None: ['the', 'movie', 'film', 'plot', 'was', 'very', 'quite', 'and', 'it']}


def _sst2(n, rng):
  """An SST-2 split of `n` rows (its text), a label word in each sentence."""
  lines = ['sentence\tlabel']
  for _ in range(n):
    label = rng.randint(0, 1)
    words = rng.choices(_SST2_WORDS[None], k=rng.randint(3, 12))
    words.insert(rng.randrange(len(words)), rng.choice(_SST2_WORDS[label]))
    lines.append(f'{" ".join(words)}\t{label}')
  return '\n'.join(lines) + '\n'


def test_watch_recovers_a_preempted_finetuning_run(gcs, tmp_path):
  """`watch --mode=finetune` from no TPU: create, set up, run; the run is preempted after its
  first logged step (SIGTERM: it saves and exits with 143; the TPU is SUSPENDED); watch deletes and
  recreates the TPU (a fresh disk), sets it up again and reruns, and the rerun resumes from the
  saved step and ends with exactly the metrics of an uninterrupted run, each step logged once.

  The commands are launch/tpu.py's own, run by bash on a fake VM (see _FAKE_TPU_VM); the
  workdir, initial checkpoint and task data are in the bucket of the test's Cloud Storage
  server. (Until 2026-12-03 a second copy of this test ran on a folder standing in for the
  bucket; this one asserts everything both did.)
  """
  # pylint: disable=g-import-not-at-top  (TensorFlow and JAX: only this test needs them)
  import random
  import jax
  from bert_jax import config_files
  from bert_jax import convert
  from bert_jax import fileio
  from bert_jax import finetune
  from bert_jax import model as model_lib
  vm, runs = tmp_path / 'vm', tmp_path / 'runs'
  runs.mkdir()
  vocab = ['[PAD]', '[UNK]', '[CLS]', '[SEP]', '[MASK]'] + sum(_SST2_WORDS.values(), [])
  (tmp_path / 'vocab.txt').write_text(''.join(w + '\n' for w in vocab))
  tiny = model_lib.BertConfig(vocab_size=len(vocab), hidden_size=32, num_hidden_layers=1,
                              num_attention_heads=2, intermediate_size=64,
                              max_position_embeddings=32)
  convert.export_bert_jax(tiny, model_lib.init_params(tiny, jax.random.key(0)),
                          gcs.url('watch/tiny'), vocab_file=str(tmp_path / 'vocab.txt'),
                          lower_case=True)
  rng = random.Random(0)
  for split, n in (('train', 64), ('dev', 32)):
    fileio.write_text(gcs.url(f'watch/glue/SST-2/{split}.tsv'), _sst2(n, rng))
  # 8 steps an epoch, 2 epochs; one sequence length: one compiled train step.
  overrides = {'train.init_checkpoint': gcs.url('watch/tiny'),
               'task.data_dir': gcs.url('watch/glue'), 'data.max_seq_length': 16,
               'data.buckets': '()', 'train.batch_size': 8, 'eval.batch_size': 32,
               'train.learning_rate': 3e-3, 'train.epochs': 2, 'log.every_steps': 1,
               'log.progress': False}
  reference = str(tmp_path / 'reference')
  expected = finetune.finetune(config_files.load_config(
      'finetune_glue.py:sst2', dict(overrides, **{'data.buckets': ()})), reference)

  state, calls = tmp_path / 'state', tmp_path / 'calls'
  gcloud = _write_exe(tmp_path / 'gcloud', _FAKE_TPU_VM.format(
      python=sys.executable, repo=_ROOT, state=str(state), calls=str(calls), vm=str(vm),
      runs=str(runs), netns=gcs.command([])))
  workdir = gcs.url('watch/sst2')
  status = tpu.main(
      ['watch', '--mode=finetune', '--name=ft', '--zone=us-central2-b', '--accelerator_type=v4-8',
       f'--config={_ROOT}/configs/finetune_glue.py:sst2', f'--workdir={workdir}',
       '--install=bert_jax[tpu]', '--poll_seconds=0', f'--gcloud={gcloud}'] +
      [f'--config.{k}={v}' for k, v in overrides.items()],
      tpu.Shell(dry_run=False, sleep=lambda s: None))
  first, second = (runs / '1.log').read_text(), (runs / '2.log').read_text()
  assert status == 0, second[-5000:]
  assert _verbs(calls).count('run') == 2 and _verbs(calls).count('delete') == 1
  assert 'bert-jax finetune --config=configs/finetune_glue.py:sst2' in calls.read_text()

  # The first run saved where SIGTERM stopped it, inside the run; the rerun resumed there.
  assert json.loads((runs / '1.status').read_text()) == 143, first[-5000:]
  stopped = re.search(r'stopped at step (\d+) of 16', first)
  assert stopped, first[-5000:]
  assert f'Resumed from step {stopped.group(1)} ' in second
  assert fileio.read_json(f'{workdir}/metrics.json') == expected
  rows, reference_rows = ([row for _, row in fileio.read_jsonl_objects(f'{w}/metrics.jsonl')]
                          for w in (workdir, reference))
  assert [r['step'] for r in rows if 'loss' in r] == list(range(1, 17))
  dev = lambda rows: [r for r in rows if r.get('split') == 'dev']
  assert dev(rows) == dev(reference_rows)
  assert [r['loss'] for r in rows if 'loss' in r] == [
      r['loss'] for r in reference_rows if 'loss' in r]


# ---- GPU: SLURM -----------------------------------------------------------------------------


@pytest.fixture
def slurm_env(tmp_path):
  """Fake SLURM: variables of a 2-node job and an scontrol that expands its node list."""
  bin_dir = tmp_path / 'bin'
  bin_dir.mkdir()
  _write_exe(bin_dir / 'scontrol', """
      #!/bin/bash
      [[ "$1 $2 $3" == "show hostnames gpu-[07-08]" ]] || { echo "bad args: $*" >&2; exit 1; }
      printf 'gpu-07\\ngpu-08\\n'
      """)
  env = dict(os.environ, PATH=f'{bin_dir}:{os.environ["PATH"]}', CONFIG='configs/bert_large.py',
             WORKDIR='/shared/runs/large', SLURM_JOB_NODELIST='gpu-[07-08]', SLURM_NNODES='2',
             SLURM_NTASKS='2', SLURM_JOB_ID='4242', SLURM_PROCID='0')
  env.pop('XLA_FLAGS', None)
  return env, bin_dir


def _sbatch(env, *args):
  return subprocess.run(['bash', os.path.join(_LAUNCH, 'gpu_slurm.sbatch'), *args], env=env,
                        capture_output=True, text=True, timeout=30, check=False)


def _task_commands(stdout):
  return [shlex.split(l.split(': ', 1)[1]) for l in stdout.splitlines()
          if l.startswith('# task ')]


def test_slurm_dry_run_two_nodes(slurm_env):
  env, _ = slurm_env
  result = _sbatch(dict(env, DRY_RUN='1'), '--config.train.batch_size=256')
  assert result.returncode == 0, result.stderr
  lines = result.stdout.splitlines()
  srun = shlex.split(next(l for l in lines if l.startswith('srun ')))
  assert '--ntasks-per-node=1' in srun and '--nodes=2' in srun
  tasks = _task_commands(result.stdout)
  assert len(tasks) == 2
  for rank, task in enumerate(tasks):
    assert task[:4] == ['bert-jax', 'pretrain', '--config=configs/bert_large.py',
                        '--workdir=/shared/runs/large']
    # The coordinator is the first node; the port follows the job id.
    assert '--coordinator_address=gpu-07:24242' in task
    assert '--num_processes=2' in task
    assert f'--process_id={rank}' in task
    assert '--config.train.batch_size=256' in task
  assert 'task 1 on gpu-08' in result.stdout
  xla = next(l for l in lines if l.startswith('export XLA_FLAGS='))
  assert '--xla_gpu_enable_latency_hiding_scheduler=true' in shlex.split(xla)[1]


def test_slurm_dry_run_without_scontrol_expands_the_node_list(slurm_env):
  # Away from the cluster (no scontrol), a dry run reads SLURM's host list syntax itself.
  env, bin_dir = slurm_env
  env = dict(env, PATH=env['PATH'].replace(f'{bin_dir}:', ''), DRY_RUN='1',
             SLURM_JOB_NODELIST='gpu-[07-08,11],login9,rack[9-10]b', SLURM_NNODES='6',
             SLURM_NTASKS='6')
  result = _sbatch(env)
  assert result.returncode == 0, result.stderr
  hosts = re.findall(r'^# task \d+ on (\S+):', result.stdout, re.M)
  assert hosts == ['gpu-07', 'gpu-08', 'gpu-11', 'login9', 'rack9b', 'rack10b']
  result = _sbatch(dict(env, SLURM_JOB_NODELIST='a[1-2]b[1]', SLURM_NNODES='2',
                        SLURM_NTASKS='2'))
  assert result.returncode == 2
  assert "SLURM_JOB_NODELIST='a[1-2]b[1]': without scontrol a dry run reads" in result.stderr
  result = _sbatch(dict(env, DRY_RUN='0'))  # A real launch needs SLURM's own answer.
  assert result.returncode == 2 and 'scontrol not found on PATH' in result.stderr


def test_slurm_header_one_task_per_node_eight_gpus():
  with open(os.path.join(_LAUNCH, 'gpu_slurm.sbatch')) as f:
    header = [l.split()[1] for l in f if l.startswith('#SBATCH')]
  assert '--ntasks-per-node=1' in header and '--gpus-per-node=8' in header
  assert any(h.startswith('--nodes=') for h in header)


def test_slurm_srun_gives_each_task_its_process_id(slurm_env, tmp_path):
  """Runs the real srun line with a fake srun that starts one local task per node."""
  env, bin_dir = slurm_env
  _write_exe(bin_dir / 'srun', """
      #!/bin/bash
      while [[ "$1" == --* ]]; do shift; done
      for i in 0 1; do SLURM_PROCID=$i "$@" || exit; done
      """)
  out = tmp_path / 'trainer_out'
  trainer = _write_exe(tmp_path / 'trainer', f"""
      #!/bin/bash
      echo "$XLA_FLAGS | $*" >> {out}
      """)
  result = _sbatch(dict(env, BERT_JAX=trainer, MODE='finetune', XLA_FLAGS='--xla_dump_to=/x'),
                   '--config.x=1')
  assert result.returncode == 0, result.stderr
  runs = out.read_text().splitlines()
  assert len(runs) == 2
  for rank, line in enumerate(runs):
    xla, argv = line.split(' | ')
    assert argv.split()[0] == 'finetune'
    assert argv.split()[-1] == f'--process_id={rank}'
    assert '--coordinator_address=gpu-07:24242' in argv.split()
    # Defaults first, the user's XLA_FLAGS last (so they win).
    assert xla.split()[0].startswith('--xla_gpu_') and xla.split()[-1] == '--xla_dump_to=/x'


@pytest.mark.parametrize('status, restarts, requeued, exit_status', [
    (143, 0, True, 143),  # Stopped by SIGTERM, saved: requeued.
    (143, 20, False, 143),  # ... unless MAX_REQUEUES (20) requeues are used up.
    (0, 0, False, 0),  # Finished.
    (2, 0, False, 2),  # A mistake: rerunning would fail again.
    (1, 0, False, 1),  # A bug.
    # Task 1 stopped with 143 and task 0 otherwise (as when only one process met a Cloud
    # Storage outage at a save, before the processes agreed on it: the other one failed in
    # Orbax's barrier): the job ends, not requeued. Hence every process must exit 143
    # (gcs_test::test_an_outage_in_one_process_of_two_stops_both_with_one_line_and_143).
    ((1, 143), 0, False, 1),
    ((134, 143), 0, False, 134),
])
def test_slurm_requeues_on_the_preemption_status_only(slurm_env, tmp_path, status, restarts,
                                                      requeued, exit_status):
  """The job requeues itself when bert-jax exits with errors.EXIT_PREEMPTED in every task, and
  ends with the trainer's status otherwise; srun is a fake that runs both tasks here. `status`:
  every task's, or (task 0's, task 1's)."""
  from bert_jax import errors  # pylint: disable=g-import-not-at-top
  env, bin_dir = slurm_env
  calls = tmp_path / 'scontrol_calls'
  _write_exe(bin_dir / 'scontrol', f"""
      #!/bin/bash
      echo "$*" >> {calls}
      [[ "$1" == requeue ]] && exit 0
      printf 'gpu-07\\ngpu-08\\n'
      """)
  _write_exe(bin_dir / 'srun', """
      #!/bin/bash
      while [[ "$1" == --* ]]; do shift; done
      rc=0
      for i in 0 1; do SLURM_PROCID=$i "$@" || rc=$?; done
      exit $rc
      """)
  statuses = status if isinstance(status, tuple) else (status, status)
  trainer = _write_exe(tmp_path / 'trainer', f"""
      #!/bin/bash
      statuses=({statuses[0]} {statuses[1]})
      last="${{@: -1}}"  # --process_id=N
      exit "${{statuses[${{last##*=}}]}}"
      """)
  result = _sbatch(dict(env, BERT_JAX=trainer, TMPDIR=str(tmp_path),
                        SLURM_RESTART_COUNT=str(restarts)))
  assert result.returncode == exit_status, result.stderr
  assert ('requeue 4242' in calls.read_text().splitlines()) == requeued, result.stderr
  if statuses == (errors.EXIT_PREEMPTED,) * 2 and not requeued:
    assert 'MAX_REQUEUES=20 requeues are used up' in result.stderr
  assert not list(tmp_path.glob('bert_jax_*.stopped'))


def test_slurm_header_requeues_and_warns_before_the_time_limit():
  with open(os.path.join(_LAUNCH, 'gpu_slurm.sbatch')) as f:
    text = f.read()
  header = [l.split()[1] for l in text.splitlines() if l.startswith('#SBATCH')]
  assert '--requeue' in header and '--signal=TERM@120' in header
  from bert_jax import errors  # pylint: disable=g-import-not-at-top
  assert f'PREEMPTED={errors.EXIT_PREEMPTED} ' in text


@pytest.mark.parametrize('change,message', [
    ({'CONFIG': ''}, 'CONFIG'),
    ({'WORKDIR': ''}, 'WORKDIR'),
    ({'SLURM_NTASKS': '16'}, '--ntasks-per-node=1'),
    ({'SLURM_NNODES': '3', 'SLURM_NTASKS': '3'}, 'expected 3'),
    ({'MODE': 'train'}, 'MODE'),
    ({'SLURM_JOB_NODELIST': ''}, 'sbatch'),
])
def test_slurm_errors(slurm_env, change, message):
  env, _ = slurm_env
  result = _sbatch(dict(env, DRY_RUN='1', **change))
  assert result.returncode == 2
  assert message in result.stderr and result.stdout == ''


# ---- GPU: one node --------------------------------------------------------------------------


def _node(*args, env=None):
  return subprocess.run(['bash', os.path.join(_LAUNCH, 'gpu_node.sh'), *args],
                        env=env or dict(os.environ), capture_output=True, text=True,
                        timeout=30, check=False)


def test_node_script_two_nodes_dry_run():
  for rank in (0, 1):
    result = _node('--coordinator', 'gpu-07:12345', '--num_nodes=2', f'--node_rank={rank}',
                   '--config=configs/bert_large.py', '--workdir', '/shared/runs/large',
                   '--config.train.batch_size=256', '--dry_run', '--', '--flag', 'a b')
    assert result.returncode == 0, result.stderr
    command = shlex.split(result.stdout.splitlines()[-1])
    assert command == [
        'bert-jax', 'pretrain', '--config=configs/bert_large.py',
        '--workdir=/shared/runs/large', '--coordinator_address=gpu-07:12345',
        '--num_processes=2', f'--process_id={rank}', '--config.train.batch_size=256',
        '--flag', 'a b']


def test_node_script_runs_the_trainer(tmp_path):
  out = tmp_path / 'argv'
  trainer = _write_exe(tmp_path / 'trainer', f"""
      #!/bin/bash
      printf '%s\\n' "$@" > {out}
      """)
  result = _node('--config=c.py', '--workdir=/w', '--mode=finetune',
                 env=dict(os.environ, BERT_JAX=trainer))
  assert result.returncode == 0, result.stderr
  # One node: no distributed flags.
  assert out.read_text().splitlines() == ['finetune', '--config=c.py', '--workdir=/w']


@pytest.mark.parametrize('args,message', [
    (['--workdir=/w'], '--config'),
    (['--config=c.py'], '--workdir'),
    (['--config=c.py', '--workdir=/w', '--num_nodes=2', '--node_rank=0'], '--coordinator'),
    (['--config=c.py', '--workdir=/w', '--num_nodes=2', '--node_rank=2',
      '--coordinator=h:1'], '--node_rank'),
    (['--config=c.py', '--workdir=/w', '--num_nodes=0'], '--num_nodes'),
    (['--config=c.py', '--workdir=/w', '--confg=x'], "'--confg=x'"),
    (['--config=c.py', '--workdir'], '--workdir needs a value'),
])
def test_node_script_errors(args, message):
  result = _node(*args, '--dry_run')
  assert result.returncode == 2
  assert message in result.stderr and result.stdout == ''


def _exported(stdout, name):
  line = next(l for l in stdout.splitlines() if l.startswith(f'export {name}='))
  return shlex.split(line)[1].split('=', 1)[1]


def test_default_gpu_xla_flags_are_known_to_xla(slurm_env):
  """XLA aborts on an unknown flag, so the defaults must parse in the installed jaxlib."""
  env, _ = slurm_env
  xla_flags = _exported(_sbatch(dict(env, DRY_RUN='1')).stdout, 'XLA_FLAGS')
  node_env = dict(os.environ)
  node_env.pop('XLA_FLAGS', None)
  assert _exported(_node('--config=c.py', '--workdir=/w', '--dry_run', env=node_env).stdout,
                   'XLA_FLAGS') == xla_flags
  assert len(xla_flags.split()) >= 2

  def xla_accepts(flags):
    return subprocess.run(
        [sys.executable, '-c', 'import jax; jax.numpy.ones(2).block_until_ready()'],
        env=dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS='cpu'), capture_output=True,
        timeout=60, check=False).returncode == 0

  assert xla_accepts(xla_flags)
  assert not xla_accepts(xla_flags + ' --xla_gpu_no_such_flag=true')  # The check can fail.


def test_empty_gpu_xla_flags_disables_the_defaults(slurm_env):
  env, _ = slurm_env
  assert _exported(_sbatch(dict(env, DRY_RUN='1', GPU_XLA_FLAGS='')).stdout, 'XLA_FLAGS') == ''


# ---- Kubernetes Job -------------------------------------------------------------------------


def _pod_failure_action(policy, container, exit_code):
  """What a Job's podFailurePolicy does with a pod whose `container` exited with `exit_code`
  (Kubernetes: the first rule that matches; none: the failure counts against backoffLimit)."""
  for rule in policy['rules']:
    on = rule.get('onExitCodes')
    if on and on.get('containerName', container) == container:
      if (exit_code in on['values']) == (on['operator'] == 'In'):
        return rule['action']
  return 'Count'


def test_kubernetes_job_retries_on_the_preemption_status_only():
  """launch/gpu_k8s_job.yaml: the rules of its podFailurePolicy applied to the statuses bert-jax
  exits with, and the pieces that must agree (process count, coordinator, Service, the rules'
  container). Checked as data (no cluster here to validate it against)."""
  import yaml  # pylint: disable=g-import-not-at-top
  from bert_jax import errors  # pylint: disable=g-import-not-at-top
  with open(os.path.join(_LAUNCH, 'gpu_k8s_job.yaml')) as f:
    service, job = list(yaml.safe_load_all(f))
  assert (service['kind'], job['kind'], job['apiVersion']) == ('Service', 'Job', 'batch/v1')
  spec, pod = job['spec'], job['spec']['template']['spec']
  container, = pod['containers']
  policy = spec['podFailurePolicy']
  name = container['name']
  assert _pod_failure_action(policy, name, errors.EXIT_PREEMPTED) == 'Ignore'
  assert _pod_failure_action(policy, name, errors.EXIT_USER_ERROR) == 'FailJob'
  assert _pod_failure_action(policy, name, errors.EXIT_BUG) == 'FailJob'
  assert _pod_failure_action(policy, name, 137) == 'Count'  # SIGKILL: a crash, counted.
  # Only when every pod stops with 143 are they all run again: one pod's 143 and another's 1
  # (the status a process had when it alone met a Cloud Storage outage at a save and the
  # others failed in Orbax's barrier) fails the Job. Every process exits 143 now
  # (gcs_test::test_an_outage_in_one_process_of_two_stops_both_with_one_line_and_143).
  assert [_pod_failure_action(policy, name, c) for c in (1, 143)] == ['FailJob', 'Ignore']
  # The API refuses 0 in an `In` rule (a finished container is not a failure).
  assert all(0 not in r['onExitCodes']['values'] for r in policy['rules'] if 'onExitCodes' in r)
  assert {'type': 'DisruptionTarget'} in sum(
      (r.get('onPodConditions', []) for r in policy['rules'] if r['action'] == 'Ignore'), [])
  assert pod['restartPolicy'] == 'Never'  # The API requires it with a podFailurePolicy.
  assert pod['terminationGracePeriodSeconds'] >= 30

  # One process per pod, all at once; pod 0 of the Indexed Job is the coordinator.
  args = container['args']
  flags = dict(a[2:].split('=', 1) for a in args if a.startswith('--'))
  assert spec['completionMode'] == 'Indexed'
  assert spec['completions'] == spec['parallelism'] == int(flags['num_processes'])
  port = service['spec']['ports'][0]['port']
  assert flags['coordinator_address'] == f'{job["metadata"]["name"]}-0.{pod["subdomain"]}:{port}'
  assert pod['subdomain'] == service['metadata']['name']
  assert service['spec']['clusterIP'] == 'None'
  assert service['spec']['selector'] == {'job-name': job['metadata']['name']}
  env = {e['name']: e for e in container['env']}
  assert flags['process_id'] == '$(PROCESS_ID)'
  assert env['PROCESS_ID']['valueFrom']['fieldRef']['fieldPath'] == (
      "metadata.annotations['batch.kubernetes.io/job-completion-index']")
  assert container['command'] == ['bert-jax'] and args[0] in ('pretrain', 'finetune')
  assert container['resources']['limits']['nvidia.com/gpu'] == 8
