"""What a run reports: summaries of (sum, count) pairs, and the loop's clock."""

import pytest

from bert_jax import monitor


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
    chrono.count(sequences=8, tokens=256)
  with chrono.excluded():  # A save.
    clock.now += 3
  rates = chrono.report(step=15)
  assert rates['steps_per_second'] == pytest.approx(4 / 2.0)
  assert rates['input_wait_fraction'] == pytest.approx(0.4 / 2.0)
  assert rates['sequences_per_second'] == pytest.approx(32 / 2.0)
  assert rates['tokens_per_second'] == pytest.approx(1024 / 2.0)
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
