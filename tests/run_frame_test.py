"""The frame both drivers run in (run_frame.py): the entry's order (the config checked first, the
driver's refusals before the lock, the lock held inside), the close that runs however the loop
ends, and the schedules (`itstime`). The drivers' own tests run whole runs through it."""

import os

import pytest

from bert_jax import config_files
from bert_jax import run_frame
from bert_jax import run_lock
from bert_jax.errors import UserError


def test_itstime_is_every_n_steps_and_at_the_given_steps():
  assert [s for s in range(1, 11) if run_frame.itstime(s, 4)] == [4, 8]
  assert [s for s in range(1, 11) if run_frame.itstime(s, 4, 10)] == [4, 8, 10]
  assert [s for s in range(1, 11) if run_frame.itstime(s, 4, 6, 10)] == [4, 6, 8, 10]
  assert [s for s in range(1, 11) if run_frame.itstime(s, 0, 10)] == [10]  # 0: never.
  assert not any(run_frame.itstime(s, 0) for s in range(1, 11))


def test_the_entry_checks_the_config_then_refuses_then_locks(tmp_path):
  config = config_files.load_config('smoke', {'checkpoint.compilation_cache_dir': ''})
  workdir = str(tmp_path / 'run')
  with pytest.raises(UserError, match='train.steps'):
    bad = config.copy_and_resolve_references()
    bad.train.steps = 0
    with run_frame.entered(bad, workdir, 'pretrain', before_lock=lambda w: pytest.fail(w)):
      pass

  def refuse(resolved):
    assert resolved == os.path.abspath(workdir)
    raise UserError('refused')

  with pytest.raises(UserError, match='refused'):
    with run_frame.entered(config, workdir, 'pretrain', before_lock=refuse):
      pytest.fail('entered after a refusal')
  assert not os.path.exists(os.path.join(workdir, run_lock.LOCK_FILE))
  with run_frame.entered(config, workdir, 'pretrain') as (resolved, preemption):
    assert resolved == workdir and not preemption.stopping
    assert os.path.exists(os.path.join(workdir, run_lock.LOCK_FILE))
  assert not os.path.exists(os.path.join(workdir, run_lock.LOCK_FILE))
  # A workdir of the other kind is refused inside the lock.
  with open(os.path.join(workdir, 'config.json'), 'w') as f:
    f.write(config.to_json_best_effort())
  with pytest.raises(UserError, match='holds a pre-training run'):
    with run_frame.entered(config_files.load_config('finetune_glue.py:sst2'), workdir,
                           'finetune'):
      pass


class _Closed:
  """The progress bar, checkpoint manager and metrics log of a loop, recording their ends."""

  def __init__(self, calls):
    self.calls = calls

  def close(self):
    self.calls.append(f'{type(self).__name__}.close')

  def wait_until_finished(self):
    self.calls.append('wait for the last save')


class Steps(_Closed):
  pass


class Manager(_Closed):
  pass


class Log(_Closed):
  pass


@pytest.mark.parametrize('fails', [False, True])
def test_the_close_waits_for_the_last_save_and_closes_however_the_loop_ends(tmp_path, fails):
  calls = []
  with pytest.raises(RuntimeError) if fails else _nothing():
    with run_frame.closing(Steps(calls), Manager(calls), str(tmp_path), Log(calls)):
      calls.append('loop')
      if fails:
        raise RuntimeError('the loop failed')
  assert calls == ['loop', 'Steps.close', 'wait for the last save', 'Manager.close',
                   'Log.close']


class _nothing:

  def __enter__(self):
    return self

  def __exit__(self, *args):
    return False
