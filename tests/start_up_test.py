"""Tests of bert_jax.start_up: what a command starts before it runs. The start-up as users run
it (its freeze, its held-back lines, signals during it) is cli_test.py's; runs of
jax.distributed across real processes are train_test.py's and finetune_test.py's (here, only how
its processes leave)."""

import os
import subprocess
import sys

import jax
import pytest

from bert_jax import start_up
from bert_jax.errors import UserError
import processes


@pytest.fixture
def initialize_calls(monkeypatch):
  """jax.distributed.initialize's calls and jax.config's updates, recorded instead of made, on
  a machine that is no TPU VM (no /dev/accel0) nor SLURM job."""
  calls = []
  monkeypatch.setattr(jax.distributed, 'initialize', lambda **kwargs: calls.append(kwargs))
  monkeypatch.setattr(jax.config, 'update', lambda *args: calls.append(args))
  monkeypatch.setattr(jax, 'process_count', lambda: 2)
  for name in ('SLURM_NTASKS', 'TPU_WORKER_HOSTNAMES'):
    monkeypatch.delenv(name, raising=False)
  exists = os.path.exists
  monkeypatch.setattr(os.path, 'exists', lambda p: p != '/dev/accel0' and exists(p))
  return calls


def test_distributed_starts_only_for_one_process_of_several(initialize_calls, monkeypatch):
  start_up.initialize_distributed()  # One process: nothing says otherwise.
  assert not initialize_calls
  start_up.initialize_distributed(mode='on')  # The launcher's environment says how many.
  assert initialize_calls == [{}]
  monkeypatch.setenv('SLURM_NTASKS', '1')
  start_up.initialize_distributed()
  monkeypatch.setenv('SLURM_NTASKS', '4')
  start_up.initialize_distributed()
  start_up.initialize_distributed(mode='off')  # Off wins over SLURM and a coordinator.
  start_up.initialize_distributed('host:1234', 2, 0, mode='off')
  monkeypatch.setenv('TPU_WORKER_HOSTNAMES', 'a,b')
  monkeypatch.delenv('SLURM_NTASKS')
  start_up.initialize_distributed()
  assert initialize_calls == [{}, {}, {}]


def test_a_coordinator_needs_the_process_count_and_index(initialize_calls, monkeypatch):
  monkeypatch.setenv('JAX_PLATFORMS', 'cpu')
  with pytest.raises(UserError, match=r'--coordinator_address=host:1234 needs --num_processes '
                     r'\(got 0\) and --process_id \(got -1\) too'):
    start_up.initialize_distributed('host:1234')
  with pytest.raises(UserError, match=r'\(got 2\) and --process_id \(got -1\)'):
    start_up.initialize_distributed('host:1234', 2)
  assert not initialize_calls
  start_up.initialize_distributed('host:1234', 2, 1)
  # On CPUs (conftest's JAX_PLATFORMS=cpu) the processes' collectives go over gloo.
  assert initialize_calls == [('jax_cpu_collectives_implementation', 'gloo'),
                              dict(coordinator_address='host:1234', num_processes=2,
                                   process_id=1)]


@pytest.fixture
def modules(tmp_path, monkeypatch):
  """Writes importable modules {name}.py (VALUE = 1); each is unloaded after the test."""
  monkeypatch.syspath_prepend(str(tmp_path))
  names = []

  def write(*new):
    for name in new:
      (tmp_path / f'{name}.py').write_text('VALUE = 1\n')
    names.extend(new)
  yield write
  for name in names:
    sys.modules.pop(name, None)


def test_unused_imports_are_blocked_inside_only(modules, monkeypatch):
  """Inside, a module not loaded yet imports as if not installed (Keras then skips it); one
  already loaded stays; afterwards the blocked one imports as usual."""
  modules('unused_by_tf_a', 'unused_by_tf_b')
  import unused_by_tf_b  # pylint: disable=g-import-not-at-top,import-error,unused-import
  monkeypatch.setattr(start_up, 'UNUSED_BY_TENSORFLOWS_IMPORT',
                      ('unused_by_tf_a', 'unused_by_tf_b'))
  with start_up.without_unused_imports():
    with pytest.raises(ImportError):
      import unused_by_tf_a  # pylint: disable=g-import-not-at-top,import-error,unused-import
    assert sys.modules['unused_by_tf_b'].VALUE == 1
  import unused_by_tf_a  # pylint: disable=g-import-not-at-top,import-error,reimported
  assert unused_by_tf_a.VALUE == 1


def test_unused_imports_stay_blocked_nowhere_after_an_error(modules, monkeypatch):
  modules('unused_by_tf_c')
  monkeypatch.setattr(start_up, 'UNUSED_BY_TENSORFLOWS_IMPORT', ('unused_by_tf_c',))
  with pytest.raises(RuntimeError, match='in the block'):
    with start_up.without_unused_imports():
      raise RuntimeError('in the block')
  import unused_by_tf_c  # pylint: disable=g-import-not-at-top,import-error
  assert unused_by_tf_c.VALUE == 1


_EXIT_AFTER = """
import sys, time
from bert_jax import start_up
process_id, port = int(sys.argv[1]), sys.argv[2]
start_up.initialize_distributed(f'127.0.0.1:{port}', 2, process_id)
time.sleep(3 * process_id)  # Process 0 (the coordination service's) leaves first.
start_up.exit_now(143)
"""


def test_exit_now_waits_for_the_other_processes(tmp_path):
  """A preempted multi-process run leaves with `exit_now`. Process 0 may get there first, and
  its coordination service must not stop under process 1, still closing its run: that process
  would abort (status -6), as it did in a CI run of the two-process test of train_test.py."""
  port = processes.free_port()
  env = processes.env(str(tmp_path / 'jax_cache'))
  pair = [subprocess.Popen(processes.python(env) + ['-c', _EXIT_AFTER, str(i), str(port)],
                           cwd=processes.ROOT, env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True) for i in range(2)]
  try:
    outputs = [processes.communicate(p, 120) for p in pair]
  finally:
    for p in pair:
      p.kill()
  for i, (p, (_, err)) in enumerate(zip(pair, outputs)):
    assert p.returncode == 143, f'process {i}: exit {p.returncode}\n{err[-3000:]}'


def test_exit_now_leaves_with_its_status_when_the_shutdown_fails(monkeypatch, caplog):
  """A peer already gone can fail the shutdown: the process still leaves at once, with its
  status, and says why the shutdown did not finish."""
  class Left(Exception):
    pass

  def shutdown():
    raise RuntimeError('the coordination service is unavailable')

  def leave(status):
    exits.append(status)
    raise Left

  exits = []
  monkeypatch.setattr(jax.distributed, 'is_initialized', lambda: True)
  monkeypatch.setattr(jax.distributed, 'shutdown', shutdown)
  monkeypatch.setattr(os, '_exit', leave)
  with pytest.raises(Left), caplog.at_level('WARNING', logger='absl'):
    start_up.exit_now(143)
  assert exits == [143]
  assert 'did not shut down cleanly: the coordination service is unavailable' in caplog.text
