"""The frame both drivers (train.py, finetune.py) run in: what comes before a run's setup, how
its loop ends, and the loop's schedules.

- `entered`: the config checked (as where it was loaded: one changed in Python since, in a
  notebook, is refused the same way), the workdir resolved, SIGTERM heard from here on, the
  workdir's lock held (one run at a time), TensorFlow kept off the accelerators, a workdir of
  the other kind of run refused, and the compilation cache pointed at the workdir's.
- `closing`: the command line recorded as the loop starts (publish.COMMAND_LINE); however the
  loop ends (finished, stopped, failed), the progress bar closed, the last save waited for (a
  failed one ends the run as one line), the checkpoint manager and the metrics log closed, and
  the pushes of checkpoint.push_to_hub waited for (not in a preemption notice).
- `itstime`: whether a step is due for something done every n steps (big_vision's `itstime`).
"""

import contextlib
from typing import Any, Callable, Iterator

import jax
import ml_collections

from bert_jax import checkpoint as ckpt_lib
from bert_jax import config_checks
from bert_jax import fileio
from bert_jax import monitor
from bert_jax import publish
from bert_jax import run_files
from bert_jax import run_lock


@contextlib.contextmanager
def entered(config: ml_collections.ConfigDict, workdir: str, kind: str,
            before_lock: Callable[[str], None] = lambda workdir: None
            ) -> Iterator[tuple[str, monitor.Preemption]]:
  """(the resolved workdir, the run's `monitor.Preemption`) inside the entry of a `kind` run
  ('pretrain' or 'finetune'); `before_lock(workdir)`: the driver's own refusals, made before
  the workdir's lock is taken."""
  config_checks.check_config(config, kind=kind)
  workdir = fileio.workdir_path(workdir)
  before_lock(workdir)
  # From the start, before the lock: SIGTERM during start-up is heard too.
  with monitor.Preemption() as preemption, run_lock.hold(workdir):
    preemption.check()
    fileio.hide_accelerators_from_tf()
    run_files.check_workdir_kind(workdir, fine_tuning=kind == 'finetune')
    run_files.use_compilation_cache(workdir, config.checkpoint.compilation_cache_dir)
    yield workdir, preemption


@contextlib.contextmanager
def closing(steps: monitor.Steps, manager: Any, workdir: str, log: monitor.MetricsLog,
            pusher: publish.Pusher | None = None,
            preemption: monitor.Preemption | None = None) -> Iterator[None]:
  """The end of a run's loop, however it ends: `steps`' progress bar closed, the last save of
  `manager` (Orbax's CheckpointManager) waited for (`checkpoint.wait_for_saves`: a failed one
  as one line), the manager and the metrics `log` closed; then `pusher`'s pushes waited for
  (they wait for their saves' commits), except once `preemption` was requested: its notice is
  seconds, an upload may be minutes. The command line (publish.COMMAND_LINE) is recorded in
  the workdir first, for a pushed model card: here, past every refusal of the driver's, a
  refused run leaves the workdir as it was (and a new one not at all)."""
  if publish.COMMAND_LINE is not None and jax.process_index() == 0:
    publish.record_command(workdir, publish.COMMAND_LINE)
  try:
    yield
  finally:
    steps.close()
    try:
      ckpt_lib.wait_for_saves(manager, workdir)
      manager.close()
      log.close()
    finally:
      if pusher:
        pusher.close(wait=not (preemption and preemption.requested))


def itstime(step: int, every: int, *also: int) -> bool:
  """Whether `step` (the number of steps done) is due for something done every `every` steps
  (0: never) and at each step of `also` (the last step of the run, of an epoch)."""
  return (every > 0 and step % every == 0) or step in also
