"""What a run reports: summaries of (sum, count) pairs, and the loop's clock."""

import signal

import numpy as np
import pytest

from bert_jax import errors
from bert_jax import monitor
from bert_jax import pretraining
from bert_jax import tasks
from bert_jax import train_state


class _Clock:

  def __init__(self):
    self.now = 100.0

  def __call__(self):
    return self.now


def test_summarize_divides_pairs_and_averages_scalars():
  rows = [{'loss': (6.0, 3.0), 'grad_norm': 1.0}, {'loss': (2.0, 1.0), 'grad_norm': 3.0}]
  assert monitor.summarize(rows) == {'loss': 2.0, 'grad_norm': 2.0}


def test_chrono_rates_leave_out_excluded_time_and_steps(monkeypatch):
  clock = _Clock()
  monkeypatch.setattr(monitor.time, 'time', clock)
  chrono = monitor.Chrono(step=10)
  with chrono.excluded(steps=1):  # A compiling first step: 5 s.
    clock.now += 5
  for _ in range(4):  # 4 steps of 0.5 s, each waiting 0.1 s for its batch.
    with chrono.waiting():
      clock.now += 0.1
    clock.now += 0.4
  with chrono.excluded():  # A save.
    clock.now += 3
  rates = chrono.report(step=15)
  assert rates['steps_per_second'] == pytest.approx(4 / 2.0)
  assert rates['input_wait_fraction'] == pytest.approx(0.4 / 2.0)
  # The next period starts at the report, with nothing excluded or counted.
  clock.now += 1
  assert chrono.report(step=16) == pytest.approx(
      {'steps_per_second': 1.0, 'input_wait_fraction': 0.0})


def test_chrono_of_a_period_that_only_compiled_counts_that_step(monkeypatch):
  clock = _Clock()
  monkeypatch.setattr(monitor.time, 'time', clock)
  chrono = monitor.Chrono(step=0)
  with chrono.excluded(steps=1):
    clock.now += 4
  assert chrono.report(step=1)['steps_per_second'] == pytest.approx(0.25)


def test_in_flight_waits_for_the_oldest_step_past_its_limit():
  """`InFlight(1)`: adding step N waits for step N-1 (never N), and says how many completed."""
  waited = []

  class Step:
    def __init__(self, n):
      self.n = n

    def block_until_ready(self):
      waited.append(self.n)
      return self

  in_flight = monitor.InFlight(1)
  assert in_flight.add(Step(1)) == 0 and waited == []
  assert in_flight.add(Step(2)) == 1 and waited == [1]
  assert in_flight.add(Step(3)) == 1 and waited == [1, 2]
  assert in_flight.drain() == 1 and waited == [1, 2, 3]
  assert in_flight.drain() == 0


def test_steps_summarize_since_the_last_row_and_name_a_diverged_step():
  """A summary averages the steps since the last one; a save's check of unlogged steps (kept
  for the next summary) names the first diverged step and that nothing was saved."""
  steps = monitor.Steps(step=10, total=20, show_progress=False)
  steps.add({'loss': 2.0})
  steps.add({'loss': 4.0})
  assert steps.summary(12, 'lower the rate') == {'loss': 3.0}
  steps.add({'loss': 1.0})
  steps.add({'loss': float('nan')})
  with pytest.raises(errors.UserError,
                     match=r'^loss is nan at step 14: stopping without saving it; lower it$'):
    steps.check(14, 'lower it', saving=True)
  with pytest.raises(errors.UserError, match=r'^loss is nan at step 14: stopping; lower it$'):
    steps.summary(14, 'lower it')
  steps.close()


def test_preemption_stops_the_loop_only_where_it_asks():
  """SIGTERM sets `requested` at once; the loop's `stopping` turns true only at its decision
  points: after a step (`stop_now`) or between evaluation batches (`cut_short`)."""

  class Manager:
    def reached_preemption(self, step):
      return False

  with monitor.Preemption() as preemption:
    assert not preemption.cut_short() and not preemption.stop_now(1, Manager())
    preemption._handle(signal.SIGTERM, None)  # pylint: disable=protected-access
    assert preemption.requested and not preemption.stopping
    assert preemption.cut_short() and preemption.stopping
  with monitor.Preemption() as preemption:
    preemption._handle(signal.SIGTERM, None)  # pylint: disable=protected-access
    assert preemption.stop_now(2, Manager()) and preemption.stopping
    assert str(preemption.stopped(2)) == ('stopped by SIGTERM: saved step 2; rerun the same '
                                          'command to resume')


def test_rates_count_sequences_and_real_tokens_one_way():
  """Both drivers count on the device and rate the same way: a multiple-choice row is one
  sequence per choice, padding rows (weight 0) count for nothing; a packed pre-training row
  counts its sequences."""
  mask = np.zeros((3, 4, 8), np.float32)  # 3 rows of 4 choices, 8 slots each.
  mask[:, :, :5] = 1
  swag = dict(input_ids=np.zeros((3, 4, 8), np.int32), input_mask=mask,
              weight=np.array([1, 1, 0], np.float32))
  loss = lambda outputs, batch: ({'x': 0.0}, {'x': 1.0}, {})
  _, _, counts = train_state.with_rate_counts(loss, tasks.rate_counts)(None, swag)
  summary = monitor.summarize([counts, counts])
  rates = monitor.with_rates(summary, steps_per_second=2.0, batch_size=3)
  assert rates == pytest.approx({'steps_per_second': 2.0, 'sequences_per_second': 8 * 2.0,
                                 'tokens_per_second': 3 * 32 * 2.0,
                                 'real_tokens_per_second': 2 * 4 * 5 * 2.0})
  packed = dict(input_ids=np.zeros((2, 16), np.int32), input_mask=np.ones((2, 16), np.int32),
                next_sentence_weights=np.array([[1, 1, 0], [1, 0, 0]], np.float32))
  assert [float(x) for x in pretraining.rate_counts(packed)] == [3.0, 32.0]
