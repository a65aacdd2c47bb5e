"""tests/forkserver.py: a forked `python` is the test's process as a fresh interpreter would be
(arguments, directory, environment, streams, exit status, signals, death), and its console at
start-up is a fresh `bert-jax`'s."""

import json
import os
import signal
import subprocess
import sys
import time

import processes

_ENV = dict(processes.env('unused-cache'), JAX_DISABLE_MOST_OPTIMIZATIONS='1',
            JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS='2.5', BERT_JAX_SOMETHING='late')
_REPORT = '''
import json, os, sys, jax
print(json.dumps(dict(
    argv=sys.argv, cwd=os.getcwd(), path0=sys.path[0], parent=os.getppid(),
    late=os.environ.get('BERT_JAX_SOMETHING'), onednn=os.environ.get('TF_ENABLE_ONEDNN_OPTS'),
    cache=jax.config.jax_compilation_cache_dir,
    min_time=jax.config.jax_persistent_cache_min_compile_time_secs,
    stdin=sys.stdin.read())))
sys.stderr.write('to stderr\\n')
sys.exit(int(sys.argv[1]))
'''


def _run(args, env=_ENV, **kwargs):
  return subprocess.run(processes.python(env) + args, env=env, capture_output=True, text=True,
                        timeout=300, **kwargs)


def test_a_fork_gets_the_requests_arguments_directory_environment_and_streams(tmp_path):
  proc = _run(['-c', _REPORT, '3', 'x'], cwd=str(tmp_path), input='from stdin')
  assert proc.returncode == 3, proc.stderr[-3000:]
  assert proc.stderr.endswith('to stderr\n')
  report = json.loads(proc.stdout)
  assert report['argv'] == ['-c', '3', 'x'] and report['cwd'] == str(tmp_path)
  assert report['path0'] == '' and report['parent'] != os.getpid()  # Forked by the server.
  # A late variable, JAX's settings as JAX reads them, and what bert_jax's import sets.
  assert report['late'] == 'late' and report['onednn'] == '0'
  assert report['cache'] == 'unused-cache' and report['min_time'] == 2.5
  assert report['stdin'] == 'from stdin'

  script = tmp_path / 'script.py'
  script.write_text(_REPORT)
  proc = _run([str(script), '0'], cwd=processes.ROOT, input='')
  report = json.loads(proc.stdout)
  assert proc.returncode == 0 and report['argv'] == [str(script), '0']
  assert report['path0'] == str(tmp_path)


def test_another_environment_at_import_gets_a_server_of_its_own(tmp_path):
  env = dict(_ENV, TF_CPP_MIN_LOG_LEVEL='1')
  proc = _run(['-c', 'import os; print(os.environ["TF_CPP_MIN_LOG_LEVEL"], os.getppid())'],
              env=env)
  level, parent = proc.stdout.split()
  assert proc.returncode == 0 and level == '1' and int(parent) != os.getpid()
  other = _run(['-c', 'import os; print(os.getppid())'])
  assert int(other.stdout) != int(parent)  # Each environment's server forks its own.


def _signalled(code, signum):
  """The exit status of `code` run forked, sent `signum` once it prints 'ready'."""
  proc = subprocess.Popen(processes.python(_ENV) + ['-c', code], env=_ENV,
                          stdout=subprocess.PIPE, text=True)
  try:
    assert proc.stdout.readline() == 'ready\n'
    proc.send_signal(signum)
    return proc.wait(60)
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.wait()


# Sleeps in short slices: a signal that lands just before a long sleep waits for its end (in a
# fresh interpreter too).
_READY = 'print("ready", flush=True)\nwhile True:\n  time.sleep(0.05)\n'


def test_signals_reach_the_fork_and_its_death_is_the_clients():
  exit_on = 'import signal, sys, time\nsignal.signal(signal.SIG{}, lambda *a: sys.exit({}))\n'
  assert _signalled(exit_on.format('TERM', 143) + _READY, signal.SIGTERM) == 143
  # A program's own handler gets the signal even where the client ignores it (as a background
  # job of a script ignores SIGINT): so would a fresh interpreter's.
  assert _signalled(exit_on.format('INT', 130) + _READY, signal.SIGINT) == 130

  # Killed by a signal: the client is killed by the same one.
  proc = subprocess.Popen(processes.python(_ENV) + ['-c', 'import os, signal; os.kill('
                                                    'os.getpid(), signal.SIGKILL)'], env=_ENV)
  assert proc.wait(60) == -signal.SIGKILL

  # Each signal handled as by a fresh interpreter started here: ignored where this process
  # ignores it (a background job of a script ignores SIGINT and SIGQUIT), else as Python sets it.
  code = ('import signal; print([str(signal.getsignal(s)) for s in (signal.SIGHUP, '
          'signal.SIGINT, signal.SIGQUIT, signal.SIGTERM, signal.SIGUSR1)])')
  fresh = subprocess.run([sys.executable, '-c', code], env=_ENV, capture_output=True, text=True,
                         timeout=60)
  assert _run(['-c', code]).stdout == fresh.stdout != ''
  if signal.getsignal(signal.SIGINT) != signal.SIG_IGN:  # Uncaught: KeyboardInterrupt's end.
    assert _signalled('import time\n' + _READY, signal.SIGINT) == -signal.SIGINT


def test_a_killed_client_takes_its_fork_with_it():
  proc = subprocess.Popen(processes.python(_ENV) + [
      '-c', 'import os, time; print(os.getpid(), flush=True); time.sleep(600)'], env=_ENV,
                          stdout=subprocess.PIPE, text=True)
  fork = int(proc.stdout.readline())
  proc.kill()
  assert proc.wait(60) == -signal.SIGKILL
  deadline = time.time() + 10
  while os.path.exists(f'/proc/{fork}') and time.time() < deadline:
    time.sleep(0.01)
  assert not os.path.exists(f'/proc/{fork}'), 'the fork outlived its client'


def test_a_forked_command_says_what_a_fresh_one_says(tmp_path):
  """A user's mistake found after absl's app.run started: one line on stderr, status 2. The
  server imports TensorFlow before app.run, where TensorFlow queues a call that starts its
  device platforms (their notes, unheld, above the line) unless the server drops it."""
  afile = tmp_path / 'afile'
  afile.write_text('')
  args = ['-m', 'bert_jax.cli', 'pretrain', f'--workdir={afile}']
  forked = _run(args, cwd=processes.ROOT)
  fresh = subprocess.run([sys.executable] + args, env=_ENV, capture_output=True, text=True,
                         timeout=300, cwd=processes.ROOT)
  assert (forked.returncode, forked.stdout, forked.stderr) == (
      fresh.returncode, fresh.stdout, fresh.stderr) == (
          2, '', f'bert-jax pretrain: error: --workdir={afile} is a file, not a folder: name a '
          'folder (it is created if missing)\n')
