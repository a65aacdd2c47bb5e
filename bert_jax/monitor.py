"""What a training run reports and listens to: metrics, progress, preemption.

- `summarize`: the (sum, count) pairs of steps or batches as averages.
- `with_rates`: a log row's rates, counted one way in pre-training and fine-tuning.
- `Chrono`: the loop's clock: steps (and what they carry) per second, input wait, and the time
  that is not training (compiles, saves, evaluations) kept out.
- `MetricsLog`: metrics.jsonl + the writers of log.writers (TensorBoard by default, W&B, any
  clu MetricWriter: `trackers.py`) on process 0, one tag scheme for every run and writer:
  `train/<name>` for training metrics, `eval/<name>` for evaluations (a run with several
  evaluation sets: `eval/<set>/<name>`).
- `InFlight`: bounds how far the host runs ahead of the device (one step).
- `progress`: the tqdm bar of the loop.
- `Steps`: a loop's steps since its last log row (their metrics, checked for divergence), with
  its `InFlight`, bar and `Chrono`.
- `Preemption`: SIGTERM and Ctrl-C as a flag the loop polls, so it saves before exiting
  (`Preempted`); before the first step (nothing new to save) it stops the run at once. It owns
  the run's whole preemption state: whether a notice came, and whether the loop stops.
"""

import collections
import contextlib
import json
import os
import signal
import threading
import time
from typing import Any, Callable, Iterator

import jax
import numpy as np
from absl import logging

from bert_jax import fileio
from bert_jax import gcs
from bert_jax.errors import EXIT_PREEMPTED
from bert_jax.errors import Preempted
from bert_jax.errors import UserError

METRICS_FILE = 'metrics.jsonl'


# A training loss this large has diverged though it is finite: a uniform guess over BERT's
# 30,522 tokens scores 10.3 nats, and the weights that score 1e4 do not come back (seen: 6.1e9,
# with an infinite gradient norm, the step before the loss was NaN).
DIVERGED_LOSS = 1e4


def divergence(metrics: list[dict[str, Any]], first_step: int) -> str | None:
  """'loss is L (gradient norm G) at step S' of the first of these steps' metrics (host values;
  the first is step `first_step`) whose loss or gradient norm is not finite, or whose loss
  passes DIVERGED_LOSS; None when none did. The weights after such a step are not worth
  keeping: an infinite gradient norm makes them NaN even when the loss was still finite."""
  def value(v):
    if v is None:
      return None
    return float(v[0]) / max(float(v[1]), 1e-9) if isinstance(v, (tuple, list)) else float(v)
  for i, m in enumerate(metrics):
    loss, norm = value(m.get('loss')), value(m.get('grad_norm'))
    if (loss is not None and (not np.isfinite(loss) or loss > DIVERGED_LOSS)) or (
        norm is not None and not np.isfinite(norm)):
      norm_text = '' if norm is None else f' (gradient norm {norm:.4g})'
      return f'loss is {loss:.4g}{norm_text} at step {first_step + i}'
  return None


def summarize(metrics: list[dict[str, Any]]) -> dict[str, float]:
  """Averages of a run of steps' or batches' metrics (host values): (sum, count) pairs are
  summed and divided, so padded rows and uneven batches count exactly; plain scalars are
  averaged."""
  out = {}
  for key in metrics[0]:
    vals = [m[key] for m in metrics]
    if isinstance(vals[0], (tuple, list)):
      total = sum(float(v[0]) for v in vals)
      count = sum(float(v[1]) for v in vals)
      out[key] = total / max(count, 1e-9)
    else:
      out[key] = float(np.mean([float(v) for v in vals]))
  return out


def with_rates(summary: dict[str, float], steps_per_second: float,
               batch_size: int) -> dict[str, float]:
  """A log row's summary with its rates in place of the per-row counts of its steps
  (`train_state.with_rate_counts`): steps, sequences (packed rows: each of theirs; a
  multiple-choice row: each choice), token slots and real (non-padding) tokens per second, for
  global batches of `batch_size` rows."""
  rows_per_second = steps_per_second * batch_size
  summary.update(
      steps_per_second=steps_per_second,
      sequences_per_second=summary.pop('sequences_per_row') * rows_per_second,
      tokens_per_second=summary.pop('tokens_per_row') * rows_per_second,
      real_tokens_per_second=summary.pop('real_tokens_per_row') * rows_per_second)
  return summary


class Chrono:
  """The training loop's clock (after big_vision's `utils.Chrono`): one per loop, in place of
  hand-kept timers.

  A period runs from one `report` to the next. `report` gives its steps per second and the
  share of its time spent waiting for input; time inside `excluded()` (and the steps it names:
  a segment's first, compiling step) is left out, unless the period holds nothing else. What
  the steps processed is counted on the device (`with_rates`).
  """

  def __init__(self, step: int):
    self._restart(step)

  def _restart(self, step: int) -> None:
    self._start, self._step = time.time(), step
    self._wait = self._excluded = 0.0
    self._excluded_steps = 0

  @contextlib.contextmanager
  def waiting(self) -> Iterator[None]:
    """Time spent waiting for the input pipeline."""
    start = time.time()
    yield
    self._wait += time.time() - start

  @contextlib.contextmanager
  def excluded(self, steps: int = 0) -> Iterator[None]:
    """Time (and `steps`) that are not training throughput: compiles, saves, evaluations."""
    start = time.time()
    yield
    self._excluded += time.time() - start
    self._excluded_steps += steps

  def report(self, step: int) -> dict[str, float]:
    """The period's steps_per_second and input_wait_fraction; starts the next period."""
    elapsed, steps = time.time() - self._start, step - self._step
    if steps > self._excluded_steps:
      elapsed, steps = elapsed - self._excluded, steps - self._excluded_steps
    elapsed = max(elapsed, 1e-9)
    rates = dict(steps_per_second=steps / elapsed, input_wait_fraction=self._wait / elapsed)
    self._restart(step)
    return rates


# On Cloud Storage, TensorBoard scalars are held back and written this many rows at a time.
EVENTS_BATCH_ROWS = 100


class MetricsLog:
  """metrics.jsonl + TensorBoard (clu) + the other writers of `config.log.writers`
  (`trackers.make`: W&B, clu MetricWriters) on process 0; nothing elsewhere. TensorBoard only
  if log.writers names it (the default); the others get the config as hyperparameters.

  A jsonl row is {step, **extra, **scalars} (scalars without their tag prefix).

  On a gs:// workdir every write must cost the same however long the run: an object cannot be
  appended to, and TensorFlow uploads an events file whole at every flush (every ~10 scalars).
  So rows are composed onto metrics.jsonl (gcs.append), and TensorBoard scalars are written
  EVENTS_BATCH_ROWS rows at a time, each batch into an events file of its own (TensorBoard
  reads every events file of the folder), and at `close`.
  """

  def __init__(self, workdir: str, config=None):
    from clu import metric_writers  # pylint: disable=g-import-not-at-top  (TensorFlow)
    from bert_jax import trackers  # pylint: disable=g-import-not-at-top  (clu: TensorFlow)
    self.active = jax.process_index() == 0
    self.workdir = workdir
    names = trackers.parse(config.log.writers if config is not None else 'tensorboard')
    self.tensorboard = 'tensorboard' in names
    self.batched = gcs.is_gcs(workdir)
    self.writer = metric_writers.create_default_writer(
        workdir, just_logging=not (self.active and self.tensorboard) or self.batched,
        asynchronous=False)
    self.others = trackers.make(
        names, workdir, config.to_dict() if config is not None else None,
        config.log.wandb_project if config is not None else '') if self.active else []
    self.path = os.path.join(workdir, METRICS_FILE)
    self._pending: list[tuple[int, dict[str, Any]]] = []

  def train(self, step: int, scalars: dict[str, Any], **extra) -> None:
    self._write(step, scalars, 'train/', extra)

  def eval(self, step: int, scalars: dict[str, Any], eval_set: str = '', **extra) -> None:
    self._write(step, scalars, f'eval/{eval_set}/' if eval_set else 'eval/', extra)

  def _write(self, step: int, scalars: dict[str, Any], prefix: str, extra: dict) -> None:
    if not self.active:
      return
    tagged = {prefix + k: v for k, v in scalars.items() if v is not None}
    self.writer.write_scalars(step, tagged)  # Only logs them when batched.
    for writer in self.others:
      writer.write_scalars(step, tagged)
    line = json.dumps(dict(step=step, **extra, **scalars)) + '\n'
    if not self.batched:
      with fileio.gfile().GFile(self.path, 'a') as f:
        f.write(line)
      return
    gcs.append(self.path, line.encode())
    if self.tensorboard:
      self._pending.append((step, tagged))
    if len(self._pending) >= EVENTS_BATCH_ROWS:
      self._write_events()

  def _write_events(self) -> None:
    """The held-back scalars, into a new events file: one upload."""
    if not self._pending:
      return
    tf = fileio.tensorflow()
    writer = tf.summary.create_file_writer(self.workdir, max_queue=10**6, flush_millis=10**9)
    with writer.as_default():
      for step, tagged in self._pending:
        for tag, value in tagged.items():
          tf.summary.scalar(tag, value, step=step)
    writer.close()
    self._pending = []

  def close(self) -> None:
    if self.active and self.batched:
      self._write_events()
    self.writer.flush()
    self.writer.close()
    for writer in self.others:
      writer.close()
    self.others = []


def truncate_metrics(workdir: str, after_step: int | None) -> None:
  """Drops rows of metrics.jsonl past `after_step` (all of them for None): a resumed run
  writes those steps again, and its log must read like an uninterrupted run's."""
  path = os.path.join(workdir, METRICS_FILE)
  fs = fileio.gfile()
  if jax.process_index() != 0 or not fs.exists(path):
    return
  with fs.GFile(path) as f:
    lines = f.read().splitlines()
  kept = [line for line in lines
          if after_step is not None and line.strip() and json.loads(line)['step'] <= after_step]
  if len(kept) != len(lines):
    with fs.GFile(path, 'w') as f:
      f.write(''.join(line + '\n' for line in kept))


class InFlight:
  """At most `limit` dispatched steps not yet computed: the host runs that far ahead, no more.

  JAX returns from a step as soon as it is dispatched. A loop that reads no result until its
  next log line queues every step up to it, and whatever then needs the state (the save after
  SIGTERM) waits for all of them: 33 queued steps took 8 minutes on a loaded CPU. `add` waits
  for the oldest step past the limit, so with the default of one the next batch is read and
  its step dispatched while the device runs the current one, and a stop costs one step more.
  `add` and `drain` return how many steps they saw complete: a progress bar counts those.
  """

  def __init__(self, limit: int = 1):
    self.limit = limit
    self._pending: collections.deque[Any] = collections.deque()

  def add(self, outputs: Any) -> int:
    """Adds a dispatched step's outputs; waits until no more than `limit` are not done."""
    self._pending.append(outputs)
    done = 0
    while len(self._pending) > self.limit:
      jax.block_until_ready(self._pending.popleft())
      done += 1
    return done

  def drain(self) -> int:
    """Waits for every step added; how many there were."""
    done = len(self._pending)
    while self._pending:
      jax.block_until_ready(self._pending.popleft())
    return done


def progress(total: int, initial: int, enabled: bool):
  """The loop's progress bar (steps); a no-op when not `enabled`."""
  import tqdm  # pylint: disable=g-import-not-at-top  (only a driver needs it)
  return tqdm.tqdm(total=total, initial=initial, disable=not enabled, unit='step',
                   dynamic_ncols=True, mininterval=1.0, smoothing=0.1)


class Steps:
  """A training loop's steps since its last log row, as the loop runs them.

  Their metrics stay on the device until a log row (`summary`) or a save (`check`) reads them;
  the host runs at most one step ahead of the device (`InFlight`), so a stop (SIGTERM) waits
  for one step, not for every step dispatched since the last log row. The progress bar (`bar`)
  and the rates count computed steps; `chrono` is the loop's clock.
  """

  def __init__(self, step: int, total: int, show_progress: bool):
    self.bar = progress(total, step, show_progress)
    self.chrono = Chrono(step)
    self._in_flight = InFlight()
    self._metrics: list[Any] = []

  def add(self, metrics: dict[str, Any]) -> None:
    """A dispatched step's metrics."""
    self._metrics.append(metrics)
    self.bar.update(self._in_flight.add(metrics))

  def drain(self) -> None:
    """Waits for every dispatched step."""
    self.bar.update(self._in_flight.drain())

  def check(self, step: int, advice: str, saving: bool = False) -> list[dict[str, Any]]:
    """The host values of the steps since the last `summary` (`step` the last of them); a
    UserError naming the first that diverged (`divergence`), with `advice`: weights after such
    a step are never logged as fine nor saved."""
    self.drain()
    host = jax.device_get(self._metrics) if self._metrics else []
    diverged = divergence(host, step - len(host) + 1)
    if diverged:
      raise UserError(f'{diverged}: stopping{" without saving it" if saving else ""}; {advice}')
    return host

  def summary(self, step: int, advice: str) -> dict[str, float]:
    """The averages (`summarize`) of the steps since the last summary, checked; the next
    summary starts after `step`."""
    host = self.check(step, advice)
    self._metrics = []
    return summarize(host)

  def close(self) -> None:
    self.bar.close()


class Preemption:
  """Turns SIGTERM and Ctrl-C (SIGINT) into a flag the loop polls, so it can save before exiting.

  Spot VMs get about 30 s between SIGTERM and the kill. Before a run's first step (input
  start-up, restore, compiles) there is nothing new to save: `check` and `wait` then stop the
  run at once with `Preempted`, even in the middle of a compile that would outlast the notice.
  After it, the loop saves where it is and raises `stopped(step)`. A second Ctrl-C stops the
  process at once (the last committed checkpoint is where a rerun resumes).

  With several processes, jax.distributed's preemption service catches SIGTERM instead and
  makes every process stop at the same step: ask `stop_now(step, manager)`. The flag stays
  unset there (one process alone must not stop early).

  Two states: `requested`, set by the signal whenever it comes, and `stopping`, the loop's
  decision to stop at its current step, taken only where the loop asks (`stop_now` after a
  step, `cut_short` between the batches of an evaluation, which is dropped then: the notice is
  too short to finish one).
  """

  SIGNALS = (signal.SIGTERM, signal.SIGINT)

  def __init__(self):
    self.requested = False
    self.stopping = False
    self.cause = ''  # What stopped the run, for its message.
    self._previous: dict[int, Any] = {}
    if jax.process_count() > 1:
      # A local flag would send the signalled process alone into the collective save while the
      # others enter the next train step.
      return
    if threading.current_thread() is threading.main_thread():
      for signum in self.SIGNALS:
        self._previous[signum] = signal.signal(signum, self._handle)

  def _handle(self, signum, frame):
    del frame
    if self.requested and signum == signal.SIGINT:
      print('\nCtrl-C again: stopping at once; a rerun resumes from the last complete '
            'checkpoint.', flush=True)
      os._exit(EXIT_PREEMPTED)  # pylint: disable=protected-access
    name = 'Ctrl-C' if signum == signal.SIGINT else signal.Signals(signum).name
    logging.warning('%s received: stopping (with a checkpoint if there is anything new to '
                    'save%s).', name, '; Ctrl-C again to stop at once' if name == 'Ctrl-C' else '')
    self.requested, self.cause = True, self.cause or name

  def check(self) -> None:
    """Raises Preempted if SIGTERM came (call it where nothing new would be saved)."""
    if self.requested:
      raise Preempted(f'stopped by {self.cause} before the first step: nothing new to save '
                      'since the last checkpoint; rerun the same command to resume')

  def stopped(self, step: int, saved: bool = True) -> Preempted:
    """The Preempted to raise once the loop stopped (and saved, if `saved`) at `step`."""
    what = f'saved step {step}' if saved else f'stopped at step {step}'
    return Preempted(f'stopped by {self.cause or "a preemption notice"}: {what}; rerun the '
                     'same command to resume')

  def wait(self, fn: Callable[[], Any]) -> Any:
    """fn() on a worker thread while this one waits for it or for SIGTERM (`check`).

    Python runs signal handlers only between the main thread's bytecodes, never inside a
    compile. Stopped by SIGTERM, the worker is left to finish on its own: an XLA compile cut
    short by the interpreter's exit aborts the process, so the CLI ends with `start_up.exit_now`.
    """
    result: list[Any] = []
    error: list[BaseException] = []

    def work():
      try:
        result.append(fn())
      except BaseException as e:  # pylint: disable=broad-except  (raised in the caller)
        error.append(e)

    worker = threading.Thread(target=work, name='bert_jax_startup', daemon=True)
    worker.start()
    while worker.is_alive():
      self.check()
      worker.join(0.05)
    self.check()
    if error:
      raise error[0]
    return result[0]

  def stop_now(self, step: int, manager) -> bool:
    """Whether the run must save and stop after `step` (every process agrees): `stopping`."""
    if not self.requested and manager.reached_preemption(step):
      self.requested, self.cause = True, 'a preemption notice (jax.distributed)'
    self.stopping = self.stopping or self.requested
    return self.stopping

  def cut_short(self) -> bool:
    """Whether work that can be dropped and redone (an evaluation) must stop now; the loop
    then stops at its current step (`stopping`)."""
    self.stopping = self.stopping or self.requested
    return self.requested

  def restore(self) -> None:
    for signum, previous in self._previous.items():
      signal.signal(signum, previous)
    self._previous = {}

  def __enter__(self) -> 'Preemption':
    return self

  def __exit__(self, *exc) -> None:
    self.restore()
