"""What tests that start `bert-jax` subprocesses share: their environment (a test's, or a user's
shell with the installed entry point), what a successful command's console may hold, a free
port, and a race of processes for a workdir's lock."""

import atexit
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import sysconfig
import tempfile
from typing import Callable

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Every layer's Cloud Storage retries (TensorFlow's, tensorstore's, google-cloud-storage's:
# `gcs.retry_budget`) in the tests' processes: 4 retries, 0.1 s then 0.2 s apart, instead of 10
# from 1 s doubling to 32 s (about 3 minutes). tests/conftest.py sets them before TensorFlow is
# imported, which is when TensorFlow's file system reads them.
SHORT_GCS_RETRIES = {'GCS_RETRY_CONFIG_MAX_RETRIES': '4',
                     'GCS_RETRY_CONFIG_INIT_DELAY_TIME_US': '100000',
                     'GCS_RETRY_CONFIG_MAX_DELAY_TIME_US': '200000'}


def env(cache_dir: str, devices: int | None = None) -> dict[str, str]:
  """A subprocess's environment: this checkout importable, a persistent compilation cache that
  later subprocesses reuse, and (when given) `devices` fake CPU devices, set before jax is
  imported."""
  out = dict(os.environ)
  out['PYTHONPATH'] = os.pathsep.join([ROOT] + [p for p in [out.get('PYTHONPATH')] if p])
  out['JAX_COMPILATION_CACHE_DIR'] = cache_dir
  out['JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS'] = '0'
  if devices is not None:
    out['XLA_FLAGS'] = f'--xla_force_host_platform_device_count={devices}'
  return out


# Lines a successful command never prints: an error-level line (absl's or native code's E/F
# lines, Python's), a traceback, and the start-up lines of TensorFlow, libtpu and JAX's CUDA
# plugin that bert-jax holds back (start_up.start).
_ERROR_LINE = re.compile(r'^(?:[EF]\d{4} |ERROR\b|FATAL\b|CRITICAL\b|\S+: error: |'
                         r'Traceback \(most recent call last\))')
_HELD_BACK = ('oneDNN custom operations', 'cuInit', 'TPU_ACCELERATOR_TYPE',
              'TPU_WORKER_HOSTNAMES', 'Source Location Trace', 'absl::InitializeLog',
              'Logging before InitGoogle', 'cpu_feature_guard', 'Unable to register cu',
              'Jax plugin configuration error', 'INVALID_ARGUMENT')


def check_console(where: str, proc: subprocess.CompletedProcess, says: tuple[str, ...] = (),
                  ours: bool = True) -> None:
  """Asserts that a command succeeded as a user wants to see it: exit 0, no traceback, each of
  `says` printed, and for `ours` (bert-jax, this checkout's scripts) nothing at error level and
  none of the held-back start-up lines. Another program (TensorFlow's saved_model_cli, a
  `python3 -c` that imports TensorFlow) prints its libraries' start-up lines itself."""
  output = proc.stdout + proc.stderr
  bad = [line for line in output.splitlines()
         if line.startswith('Traceback (most recent call last)') or ours and (
             _ERROR_LINE.match(line) or any(noise in line for noise in _HELD_BACK))]
  missing = [s for s in says if s not in output]
  assert proc.returncode == 0 and not bad and not missing, (
      f'{where}: exit {proc.returncode}; lines a successful run does not print: {bad}; '
      f'missing: {missing}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}')


def entry_point() -> str:
  """The `bert-jax` console script installed for this interpreter (pip install -e .[test])."""
  path = shutil.which('bert-jax', path=sysconfig.get_path('scripts'))
  if path is None:
    pytest.fail(f'no bert-jax entry point in {sysconfig.get_path("scripts")}: install the '
                'checkout first (python3 -m pip install -e ".[test]")', pytrace=False)
  return path


# What tests/conftest.py sets for the tests' own processes; a user's shell has none of them.
CONFTEST_VARIABLES = ('JAX_PLATFORMS', 'TF_CPP_MIN_LOG_LEVEL', 'JAX_DISABLE_MOST_OPTIMIZATIONS',
                      'XLA_FLAGS') + tuple(SHORT_GCS_RETRIES)


def user_env(folder: str) -> dict[str, str]:
  """A user's shell: none of the tests' variables, the interpreter's scripts (`bert-jax`) and
  `python`/`python3` (in `folder`/bin) first on PATH, this checkout imported (PYTHONPATH: the
  entry point of another checkout's install runs this one's code). The sample corpus comes from
  the user's cache, as for the other tests (made once per Python)."""
  env = {k: v for k, v in os.environ.items() if k not in CONFTEST_VARIABLES}
  bin_dir = os.path.join(folder, 'bin')
  os.makedirs(bin_dir, exist_ok=True)
  for name in ('python', 'python3'):
    with open(os.path.join(bin_dir, name), 'w') as f:
      f.write(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} "$@"\n')
    os.chmod(os.path.join(bin_dir, name), 0o755)
  scripts = os.path.dirname(entry_point())
  env['PATH'] = os.pathsep.join([bin_dir, scripts, env.get('PATH', '')])
  env['PYTHONPATH'] = os.pathsep.join([ROOT] + [p for p in [env.get('PYTHONPATH')]
                                                          if p])
  return env


def communicate(proc: subprocess.Popen, timeout: float) -> tuple[str, str]:
  """`proc`'s (stdout, stderr) once it ends; past `timeout` seconds it is killed and the test
  fails with what it printed."""
  try:
    return proc.communicate(timeout=timeout)
  except subprocess.TimeoutExpired:
    proc.kill()
    out, err = proc.communicate()
    pytest.fail(f'subprocess timed out after {timeout}s\nstdout:\n{out}\nstderr:\n{err[-5000:]}')


def free_port() -> int:
  """A loopback port for a subprocess's coordinator (free now; bound by the first process)."""
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


# Takes the lock of a workdir in rounds: waits for <go>_<round> to appear (then, in some rounds,
# up to 5 or 30 ms more, so that the racers' requests overlap in some rounds and interleave in
# others), tries the lock, and prints `held <round>` (then holds it a while and releases it) or
# `refused <round> <message>`.
_LOCK_TAKER = '''
import errno, os, random, sys, time
from bert_jax import run_lock
from bert_jax.errors import UserError
workdir, go, rounds, hard_links = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] == '1'
if not hard_links:  # As on a Cloud Storage FUSE mount.
  def link(*args, **kwargs):
    raise OSError(errno.ENOTSUP, 'Operation not supported')
  os.link = link
print('ready', flush=True)
for r in range(rounds):
  while not os.path.exists(f'{go}_{r}'):
    time.sleep(0.0005)
  time.sleep(random.random() * (0, 0.005, 0.03)[r % 3])
  try:
    with run_lock.hold(workdir):
      print(f'held {r}', flush=True)
      # Held until every racer has answered (the test says so), however late the machine's load
      # starts one of them: a fixed hold let a racer started after it ended take the lock too.
      while not os.path.exists(f'{go}_{r}_answered'):
        time.sleep(0.0005)
    print(f'released {r}', flush=True)
  except UserError as e:
    print(f'refused {r} {e}', flush=True)
'''


def race_for_lock(workdir: str, folder: str, rounds: int = 6, racers: int = 3,
                  before_round: Callable[[int], None] = lambda r: None,
                  wrap: Callable[[list[str]], list[str]] = list, hard_links: bool = True
                  ) -> None:
  """`racers` processes race for the lock of `workdir`, released at the same moment, `rounds`
  times (`before_round(r)` prepares each round, e.g. leaves a stale lock); asserts that each
  round exactly one holds it and the others are refused naming the workdir. `wrap` wraps each
  process's argv (a network namespace); `hard_links=False` makes os.link fail in the racers, as
  on filesystems without hard links."""
  script, go = os.path.join(folder, 'lock_taker.py'), os.path.join(folder, 'go')
  with open(script, 'w') as f:
    f.write(_LOCK_TAKER)
  # Forks (`python`): a racer's first lock imports TensorFlow (fileio) and starts JAX's
  # backend, 3-4 s of CPU each that fresh racers spent in the first round.
  racer_env = env(os.path.join(folder, 'cache'))
  procs = [subprocess.Popen(wrap(python(racer_env, wrap) + [script, workdir, go, str(rounds),
                                                            str(int(hard_links))]), cwd=ROOT,
                            env=racer_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
           for _ in range(racers)]
  try:
    assert [p.stdout.readline().strip() for p in procs] == ['ready'] * racers
    for r in range(rounds):
      before_round(r)
      open(f'{go}_{r}', 'w').close()
      results = [p.stdout.readline().strip() for p in procs]
      held = [i for i, line in enumerate(results) if line == f'held {r}']
      assert len(held) == 1, (r, results)
      for i, line in enumerate(results):
        if i not in held:
          assert line.startswith(f'refused {r} --workdir={workdir}'), (r, line)
      open(f'{go}_{r}_answered', 'w').close()
      assert procs[held[0]].stdout.readline().strip() == f'released {r}'
    for p in procs:
      assert p.wait(60) == 0, p.stderr.read()[-3000:]
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
      p.communicate()


# ---- Forked interpreters (tests/forkserver.py) ------------------------------------------------

_FORKSERVER = os.path.join(ROOT, 'tests', 'forkserver.py')
_SERVERS: dict[tuple, tuple[subprocess.Popen, str]] = {}  # Most recently used last.
_MAX_SERVERS = 3  # Each holds about 0.9 GB of imported modules (most of it shared).
_RETIRED: list[tuple[subprocess.Popen, str]] = []  # Ending once their running forks end.


def python(env: dict[str, str], wrap: Callable[[list[str]], list[str]] = list) -> list[str]:
  """The argv prefix that runs `python` (`-m module`, `-c code` or a script, and its arguments)
  as a fork of a server that has imported TensorFlow, JAX and bert_jax (tests/forkserver.py),
  for a subprocess started with `env` (wrapped in `wrap`, e.g. a network namespace): where a
  test would put `[sys.executable]`. Its pid is the client's, not the program's."""
  import forkserver  # pylint: disable=g-import-not-at-top
  import_env = forkserver.import_environment(env)
  key = (tuple(sorted(import_env.items())), tuple(wrap(['python'])))
  if key in _SERVERS and _SERVERS[key][0].poll() is not None:  # Ended: its log says why.
    _RETIRED.append(_SERVERS.pop(key))
  if key in _SERVERS:
    _SERVERS[key] = _SERVERS.pop(key)
  else:
    while len(_SERVERS) >= _MAX_SERVERS:
      server, path = _SERVERS.pop(next(iter(_SERVERS)))
      server.terminate()  # It serves no new request, and ends after its running forks.
      _RETIRED.append((server, path))
    folder = tempfile.mkdtemp(prefix='forkserver')
    path = os.path.join(folder, 'socket')
    with open(os.path.join(folder, 'log'), 'w') as log:
      server = subprocess.Popen(wrap([sys.executable, _FORKSERVER, 'serve', path]), cwd=ROOT,
                                env=import_env, stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT)
    _SERVERS[key] = server, path
  return [sys.executable, _FORKSERVER, 'client', _SERVERS[key][1]]


@atexit.register
def _stop_servers() -> None:
  for server, path in list(_SERVERS.values()) + _RETIRED:
    server.kill()
    server.wait()
    shutil.rmtree(os.path.dirname(path), ignore_errors=True)
  _SERVERS.clear()
  _RETIRED.clear()
