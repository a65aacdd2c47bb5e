"""Fine-tuning on the tasks of task_table.py (GLUE, SQuAD v1.1/v2.0, NER, ...), the paper's recipe.

`finetune(config, workdir)` is setup, then loop, inside the frame both drivers share
(`run_frame`). `_setup`: mesh -> pre-trained encoder and tokenizer -> task data -> model &
optimizer -> abstract init & shardings -> init (pre-trained encoder, fresh head) -> steps,
compiled; it returns one `_Run`, which holds what the loop reads of the config. `_train`, the
loop: epochs (train, evaluate on dev, keep the best) -> test predictions; `monitor.Preemption`
decides where it stops.
`sweep` repeats it over the paper's learning rates.

Batches are cut to length buckets (`batching.bucket_batches`): short GLUE sentences do not pay
for 128 tokens, and the jitted step compiles once per bucket. Every global batch is planned the same
way on every process; each process feeds its own rows of it. Partial batches are padded with
rows of weight 0, so every example counts exactly once per epoch and shapes stay fixed.

Workdir:
  config.json, bert_config.json, vocab.txt, tokenizer_config.json, task.json
  checkpoints/<step>/  train states (checkpoint.py's layout: params, opt_state, meta = the best
                       epoch so far): during a run the latest and the best epoch's; after it
                       only the best epoch's, so the workdir loads with
                       `pretrained.load_pretrained` like a pre-training workdir, head included
  metrics.jsonl + TensorBoard events   training metrics and each epoch's dev metrics
  metrics.json         the best epoch's dev metrics (what `finetune` returns); marks the run
                       finished
  predictions/         the best epoch's dev predictions: SQuAD predictions.json (+ null_odds.json),
                       NER CoNLL files, SWAG dev.jsonl, GLUE dev.tsv (MNLI: dev_matched.tsv,
                       dev_mismatched.tsv) in the leaderboard's layout; with
                       config.eval.predict_test, the test sets' (GLUE: the leaderboard's
                       CoLA.tsv, ...)
Resume: rerunning the same call continues from the latest checkpoint that reads back whole
(saved every checkpoint.every_steps, after each epoch's evaluation and on SIGTERM;
`checkpoint.restore_or_init`, pre-training's resume order) at its step inside its epoch, and
ends as an uninterrupted run would; a finished workdir returns its metrics.json.
Every path goes through tf.io.gfile (local or gs://).
"""

import copy
import dataclasses
import functools
import itertools
import math
import os
from typing import Any, Callable, Sequence

from absl import logging
import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec as P

from bert_jax import attention
from bert_jax import batching
from bert_jax import checkpoint as ckpt_lib
from bert_jax import defaults
from bert_jax import fileio
from bert_jax import model as model_lib
from bert_jax import monitor
from bert_jax import optim
from bert_jax import pretrained
from bert_jax import publish
from bert_jax import run_files
from bert_jax import run_frame
from bert_jax import sharding as sharding_lib
from bert_jax import state_extras
from bert_jax import task_table
from bert_jax import tasks
from bert_jax import train_state as state_lib
from bert_jax.errors import UserError

PREDICTIONS_DIR = 'predictions'

# ---------------------------------------------------------------------------------------------
# Initialization
# ---------------------------------------------------------------------------------------------


def init_head(abstract_params: dict, shardings: dict, initializer_range: float,
              seed: int) -> dict:
  """Fresh task-head parameters (everything but 'bert'), sharded: kernels truncated normal
  with stddev `initializer_range`, biases zero, as the model's dense layers initialize.

  Only the head is built: initializing the whole model just to discard its encoder would
  compile and run BERT's initializers for nothing.
  """
  heads = {k: v for k, v in abstract_params.items() if k != 'bert'}
  kernel_init = nn.initializers.truncated_normal(initializer_range)

  def make(rng):
    leaves, treedef = jax.tree_util.tree_flatten_with_path(heads)
    out = []
    for i, (path, leaf) in enumerate(leaves):
      name = getattr(path[-1], 'key', None)
      if name == 'kernel':
        out.append(kernel_init(jax.random.fold_in(rng, i), leaf.shape, leaf.dtype))
      elif name == 'bias':
        out.append(jnp.zeros(leaf.shape, leaf.dtype))
      else:
        raise ValueError(f'no initializer for head parameter {jax.tree_util.keystr(path)}')
    return jax.tree_util.tree_unflatten(treedef, out)

  return jax.jit(make, out_shardings={k: shardings[k] for k in heads})(jax.random.key(seed))


def _check_same_tree(loaded: Any, abstract: Any, path: str) -> None:
  want = {jax.tree_util.keystr(k): v.shape
          for k, v in jax.tree_util.tree_leaves_with_path(abstract)}
  have = {jax.tree_util.keystr(k): np.shape(v)
          for k, v in jax.tree_util.tree_leaves_with_path(loaded)}
  if want != have:
    diff = sorted(set(want.items()) ^ set(have.items()))[:6]
    raise UserError(f'init_checkpoint={path}: its encoder does not match the model; '
                    f'differing (name, shape): {diff}')


# ---------------------------------------------------------------------------------------------
# Files
# ---------------------------------------------------------------------------------------------


def _scalars(d: dict) -> dict[str, float]:
  return {k: float(v) for k, v in d.items()
          if isinstance(v, (int, float, np.number)) and not isinstance(v, bool)}


def _run_files(workdir: str, config_json: str, bert_config: model_lib.BertConfig,
               vocab_file: str, lower_case: bool, task: tasks.Task, **task_record) -> None:
  """Makes the workdir a loadable checkpoint folder (with its vocab and casing) + the config
  (`config_json`) + task.json (the task's info and `task_record`)."""
  run_files.write_run_files(
      workdir, config_json, bert_config, vocab_file, extra={
          'tokenizer_config.json': {'do_lower_case': lower_case,
                                    'tokenizer_class': 'BertTokenizer'},
          # The head's module is named after the transformers class it exports as.
          'task.json': dict(task.info, kind=task.kind, main_metric=task.main_metric,
                            hf_architecture=type(task.model).__name__, **task_record)})


# ---------------------------------------------------------------------------------------------
# The driver
# ---------------------------------------------------------------------------------------------


def finetune(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any] | None:
  """Fine-tunes `config.train.init_checkpoint` on `config.task`; returns the best epoch's metrics.

  The result (also in <workdir>/metrics.json): task, main_metric, score (the main metric on the
  first dev set), epoch, step, learning_rate, and one dict of metrics per dev set ('dev'; MNLI:
  'dev_matched' and 'dev_mismatched'), plus 'test' for NER with predict_test. None when the run
  stopped at train.stop_at_step with a checkpoint to resume from: the same call continues it.
  SIGTERM or Ctrl-C stops it with `errors.Preempted`, after saving where it is (before the first
  step, with nothing new to save, at once). One run at a time per workdir, as in pre-training: a
  second one is refused while this one holds the workdir's lock.
  """

  def refuse(workdir: str) -> None:
    task_table.kind_of(config.task.name)  # A misspelt task fails before the checkpoint.
    if fileio.exists(os.path.join(workdir, 'sweep.json')):
      raise UserError(f'--workdir={workdir} holds a --sweep (its sweep.json): fine-tune into '
                      'another --workdir, or rerun the sweep with --sweep')

  with run_frame.entered(config, workdir, 'finetune', before_lock=refuse) as (workdir,
                                                                             preemption):
    recorded = _recorded_run(workdir, config)
    metrics_path = os.path.join(workdir, 'metrics.json')
    if fileio.exists(metrics_path):
      _warn_changed_length(recorded, config, 'The run in this workdir had finished',
                           'its result stands; this config\'s is not used')
      return _finished(workdir, metrics_path)
    fileio.gfile().makedirs(workdir)
    run = _setup(config, workdir, preemption)
    if not _train(run, preemption):
      return None
    # metrics.json marks the run finished; then only the best epoch's checkpoint is kept.
    if run.is_main:
      fileio.write_json(metrics_path, run.best)
    return _finished(workdir, metrics_path, fresh=True)


@dataclasses.dataclass(kw_only=True)
class _Run:
  """One fine-tuning run as `_setup` makes it, ready for its first step, with what the loop
  reads of the config decoded; the loop advances `state`, `step`, `best` and `eval_pending`."""
  workdir: str
  task_name: str  # task.name
  task: tasks.Task
  mesh: jax.sharding.Mesh
  rules: Any
  batch_sharding: NamedSharding
  buckets: tuple[int, ...]
  sort_window: int
  batch_size: int  # train.batch_size
  eval_batch_size: int  # eval.batch_size
  seed: int  # train.seed: each epoch's batch plan (`_epoch_seed`), kept in the checkpoints.
  learning_rate: float  # train.learning_rate, the peak.
  log_every: int  # log.every_steps
  checkpoint_every: int  # checkpoint.every_steps (0: at the epochs' ends only)
  progress: bool  # log.progress: a progress bar (process 0).
  steps_per_epoch: int
  total_steps: int
  stop_at: int
  schedule: Callable[[int], Any]
  manager: Any  # Orbax's CheckpointManager.
  abstract: state_lib.TrainState
  train_step: Callable  # (state, batch) -> (state, metrics), state donated.
  predict_step: Callable  # (params, batch) -> `tasks.predict_step`'s outputs.
  log: monitor.MetricsLog
  pusher: publish.Pusher | None  # checkpoint.push_to_hub's (process 0).
  state: state_lib.TrainState
  step: int
  # The best epoch so far (what metrics.json will hold), kept in every checkpoint's meta.
  best: dict[str, Any] | None
  # SIGTERM cut short the evaluation of the epoch that ends at `step`: its rerun evaluates
  # first. Kept in the checkpoint's meta as well.
  eval_pending: bool

  @property
  def is_main(self) -> bool:
    return jax.process_index() == 0

  @property
  def predictions_dir(self) -> str:
    return os.path.join(self.workdir, PREDICTIONS_DIR)


def _setup(config: ml_collections.ConfigDict, workdir: str,
           preemption: monitor.Preemption) -> _Run:
  """Mesh, pre-trained encoder, task data, optimizer, state (restored, or the encoder with a
  fresh head), steps compiled for every shape the run meets, run files and metrics log."""
  batch_size, eval_batch_size = int(config.train.batch_size), int(config.eval.batch_size)
  seed, init_checkpoint = int(config.train.seed), config.train.init_checkpoint
  max_seq_length = int(config.data.max_seq_length)

  # ---- Mesh ----------------------------------------------------------------------------------
  mesh = sharding_lib.make_mesh(config.mesh)
  rules = sharding_lib.rules_from_config(config.mesh)
  sharding_lib.check_batch_size(batch_size, mesh)
  sharding_lib.check_batch_size(eval_batch_size, mesh, 'eval.batch_size')
  state_lib.check_accumulation(batch_size, config.train.grad_accum_steps, mesh)

  # ---- Pre-trained encoder, tokenizer and task data ------------------------------------------
  pre_config, pre_params, tok, vocab_file, lower_case = pretrained.load_checkpoint(
      init_checkpoint, config.data.vocab_file, config.data.lower_case,
      config.model.scan_layers, flag='config.train.init_checkpoint')
  bert_config = _model_config(config.model, max_seq_length, pre_config)
  task = task_table.make_task(config, tok, bert_config, lower_case)
  buckets = batching.parse_buckets(config.data.buckets)
  sort_window = int(config.train.length_sort_window)  # >= 1 (config_checks).
  # The checkpoint's local attention meets the configured kernel here (a config from scratch
  # meets it where it loads).
  attention.check_config(config.model.attention_impl,
                         config.model.attention_probs_dropout_prob, jax.default_backend(),
                         tuple(buckets or ()) + (max_seq_length,),
                         local_window=bert_config.local_attention_window,
                         scanned_kinds=bert_config.scan_layers and any(
                             bert_config.is_local_layer(i) != bert_config.is_local_layer(0)
                             for i in range(bert_config.num_hidden_layers)))
  _log_padding(config.task.name, task.train, batch_size, buckets, sort_window, max_seq_length)
  preemption.check()

  # ---- Model and optimizer -------------------------------------------------------------------
  steps_per_epoch = math.ceil(len(task.train['input_ids']) / batch_size)
  total_steps = steps_per_epoch * int(config.train.epochs)
  stop_at = int(config.train.stop_at_step) or total_steps
  if not 0 < stop_at <= total_steps:
    raise UserError(f'config.train.stop_at_step={config.train.stop_at_step} must lie in '
                    f'[1, {total_steps}] ({config.train.epochs} epochs x {steps_per_epoch} '
                    'steps; 0 = run to the end)')
  warmup_steps = int(config.train.warmup_proportion * total_steps)
  tx, schedule = optim.make_optimizer(config.train, total_steps, warmup_steps)

  # ---- Abstract init and shardings -----------------------------------------------------------
  abstract, shardings, _ = state_lib.abstract_state(tasks.init_fn(task.model), tx, mesh,
                                                    rules)
  _check_same_tree(pre_params['bert'], abstract.params['bert'], init_checkpoint)

  # ---- Restore, or init: pre-trained encoder, fresh head --------------------------------------
  # Every save keeps the train state (for resume) and, in `meta`, the best epoch so far, whose
  # step is kept too; once the run ends only the best epoch's checkpoint stays.
  manager = ckpt_lib.make_manager(workdir, keep=None, async_save=False, replica_parallel=False,
                                  extras=state_extras.saved_names())

  def init() -> state_lib.TrainState:
    params = init_head(abstract.params, shardings.params, bert_config.initializer_range, seed)
    params['bert'] = state_lib.put_sharded(pre_params['bert'], shardings.params['bert'])
    ignored = sorted(set(pre_params) - {'bert'})
    logging.info('Encoder from %s; fresh head %s%s', init_checkpoint,
                 sorted(set(params) - {'bert'}),
                 f'; the checkpoint\'s heads {ignored} are not used' if ignored else '')
    with sharding_lib.activate(mesh, rules):
      return state_lib.state_from_params(params, tx, abstract)

  # A fresh head compiles its initializers: SIGTERM does not wait for them.
  recorded = _recorded_run(workdir, config)  # Before _run_files replaces it.
  start, state, meta = ckpt_lib.restore_or_init(manager, workdir, abstract,
                                                lambda: preemption.wait(init))
  preemption.check()
  if start is not None:
    _warn_changed_length(recorded, config, f'Resuming at step {start}',
                         'the rest of the run trains and evaluates at the new length')
  # Only now, with the checkpoint found to match: a refused run leaves the workdir's record as
  # it was.
  _run_files(workdir, config.to_json_best_effort(indent=2), pre_config, vocab_file, lower_case,
             task, max_seq_length=config.data.max_seq_length, init_checkpoint=init_checkpoint,
             # What dev was evaluated in: `predict` reproduces it.
             compute_dtype=model_lib.resolve_dtype(config.model.dtype))
  step = int(state.step)

  # ---- Steps, and every shape the run trains and predicts compiled before its first step -----
  batch_sharding = sharding_lib.batch_sharding(mesh)
  train_step = state_lib.jit_step(
      tasks.train_apply(task.model), state_lib.with_rate_counts(task.loss_fn, tasks.rate_counts),
      tx, mesh, rules, shardings, state_lib.dropout_rng(config.train, mesh),
      config.train.grad_accum_steps)
  predict_step = jax.jit(functools.partial(tasks.predict_step, model=task.model,
                                           head=task.head),
                         in_shardings=(shardings.params, batch_sharding),
                         out_shardings=NamedSharding(mesh, P()))
  train_shapes, predict_shapes = _batch_shapes(
      task, range(step // steps_per_epoch + 1, math.ceil(stop_at / steps_per_epoch) + 1),
      batch_size=batch_size, eval_batch_size=eval_batch_size, seed=seed, buckets=buckets,
      sort_window=sort_window, with_test=stop_at == total_steps)
  spec = lambda shape: {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=batch_sharding)
                        for k, v in shape.items()}
  preemption.wait(lambda: state_lib.compile_ahead(
      [(train_step.jitted, (abstract, spec(s))) for s in train_shapes] +
      [(predict_step, (abstract.params, spec(s))) for s in predict_shapes], mesh, rules,
      f'the train step for {len(train_shapes)} length bucket(s) and the prediction step for '
      f'{len(predict_shapes)}'))

  # ---- Logs ----------------------------------------------------------------------------------
  # Rows past the checkpoint are from an attempt that did not save them: written again below.
  monitor.truncate_metrics(workdir, start)
  logging.info('%s: %d epochs x %d steps of %d sequences, peak lr %g, %d warmup steps',
               config.task.name, config.train.epochs, steps_per_epoch, batch_size,
               config.train.learning_rate, warmup_steps)
  return _Run(workdir=workdir, task_name=config.task.name, task=task, mesh=mesh, rules=rules,
              batch_sharding=batch_sharding, buckets=buckets, sort_window=sort_window,
              batch_size=batch_size, eval_batch_size=eval_batch_size, seed=seed,
              learning_rate=float(config.train.learning_rate),
              log_every=int(config.log.every_steps),
              checkpoint_every=int(config.checkpoint.every_steps),
              progress=bool(config.log.progress), steps_per_epoch=steps_per_epoch,
              total_steps=total_steps, stop_at=stop_at, schedule=schedule, manager=manager,
              abstract=abstract, train_step=train_step, predict_step=predict_step,
              log=monitor.MetricsLog(workdir, config), pusher=publish.make_pusher(config, workdir),
              state=state, step=step, best=meta.get('best'),
              eval_pending=bool(meta.get('eval_pending')))


# ---------------------------------------------------------------------------------------------
# The loop
# ---------------------------------------------------------------------------------------------


def _train(run: _Run, preemption: monitor.Preemption) -> bool:
  """Epochs of steps, each ended by its evaluation on dev (the best epoch is kept), then the
  test predictions; whether the run finished (False: stopped at train.stop_at_step)."""
  steps = monitor.Steps(run.step, run.total_steps, run.is_main and run.progress)
  state_lib.wait_for_processes('the first step')
  with run_frame.closing(steps, run.manager, run.workdir, run.log, run.pusher, preemption):
    if run.eval_pending:  # Stopped inside the evaluation of the epoch that ends here.
      # Its checkpoint stays as it is: later saves carry the new best.
      _end_epoch(run, steps, preemption, run.step // run.steps_per_epoch, saved=True)
    while run.step < run.stop_at and not preemption.stopping:
      epoch = run.step // run.steps_per_epoch + 1
      _train_epoch(run, steps, preemption, epoch)
      if run.step == epoch * run.steps_per_epoch:
        _end_epoch(run, steps, preemption, epoch)
        preemption.stop_now(run.step, run.manager)
      elif preemption.stopping or run.step == run.stop_at:
        _save(run, steps)  # Inside an epoch: saved where it stopped, to resume there.

    if run.step < run.total_steps or run.eval_pending:
      logging.warning('Stopped at step %d of %d; rerun the same command to resume.', run.step,
                      run.total_steps)
      if run.is_main:
        print(f'\nbert_jax finetune {run.task_name}: stopped at step {run.step} of '
              f'{run.total_steps} (epoch {run.step // run.steps_per_epoch + 1}); rerun the '
              f'same command to resume from {run.workdir}', flush=True)
      if preemption.requested:
        raise preemption.stopped(run.step)
      return False
    if run.task.test and not _predict_test(run, preemption):
      raise preemption.stopped(run.step)
  return True


def _train_epoch(run: _Run, steps: monitor.Steps, preemption: monitor.Preemption,
                 epoch: int) -> None:
  """Trains `epoch` from `run.step` to its end, train.stop_at_step or a stop (`stop_now`),
  with a checkpoint every checkpoint.every_steps and a log row every log.every_steps."""
  epoch_end = epoch * run.steps_per_epoch
  # The epoch's batches are planned from its seed alone, so a resumed run skips exactly the
  # ones it had trained on.
  plan = batching.batches(run.task.train, run.batch_size, run.buckets, shuffle=True,
                          seed=_epoch_seed(run.seed, epoch), window_batches=run.sort_window)
  for batch in itertools.islice(plan, run.step - (epoch - 1) * run.steps_per_epoch, None):
    run.state, metrics = run.train_step(run.state, _to_device(run, batch))
    run.step += 1
    steps.add(metrics)
    if run_frame.itstime(run.step, run.log_every, epoch_end, run.stop_at):
      summary = steps.summary(run.step, 'lower config.train.learning_rate')
      summary.update(epoch=epoch, learning_rate=float(run.schedule(run.step - 1)))
      summary = monitor.with_rates(summary, steps.chrono.report(run.step)['steps_per_second'],
                                   run.batch_size)
      run.log.train(run.step, summary)
      steps.bar.set_postfix(loss=f'{summary["loss"]:.4f}')
    if (preemption.stop_now(run.step, run.manager) or run.step == epoch_end
        or run.step == run.stop_at):
      return
    if run_frame.itstime(run.step, run.checkpoint_every):
      _save(run, steps)


def _end_epoch(run: _Run, steps: monitor.Steps, preemption: monitor.Preemption, epoch: int,
               saved: bool = False) -> None:
  """Evaluates on every dev set, keeps the epoch if it is the best and saves (unless `saved`:
  this step's checkpoint is there). SIGTERM between two evaluation batches drops the
  evaluation: the state is saved with it still to do (`eval_pending`)."""
  task = run.task
  with steps.chrono.excluded():
    evaluated = []
    for eval_set in task.dev:
      rows = _predict(run, preemption, run.state.params, eval_set)
      if rows is None:
        logging.warning('Evaluation of epoch %d stopped by SIGTERM: saving step %d, the rerun '
                        'evaluates it', epoch, run.step)
        run.eval_pending = True
        if not saved:
          _save(run, steps)
        return
      evaluated.append((eval_set, *eval_set.evaluate(rows)))
    run.eval_pending = False
    results, writers = {}, {}
    for eval_set, scores, writers[eval_set.name] in evaluated:
      results[eval_set.name] = fileio.json_safe(scores)
      run.log.eval(run.step, _scalars(scores), eval_set.name, split=eval_set.name, epoch=epoch)
    score = float(results[task.dev[0].name][task.main_metric])
    logging.info('Epoch %d (step %d): %s', epoch, run.step,
                 {n: _scalars(r) for n, r in results.items()})
    steps.bar.set_postfix(**{task.main_metric: f'{score:.4f}'})
    # A NaN score (e.g. the correlation of constant predictions) never counts as best.
    if run.best is None or score > run.best['score'] or math.isnan(run.best['score']):
      run.best = dict(task=run.task_name, main_metric=task.main_metric, score=score,
                      epoch=epoch, step=run.step, learning_rate=run.learning_rate, **results)
      if run.is_main:
        for write in writers.values():
          if write:
            write(run.predictions_dir)
    if not saved:
      _save(run, steps)


def _save(run: _Run, steps: monitor.Steps) -> None:
  """Saves the state at `run.step`, with the best epoch so far. Kept: this step (to resume
  from), the best epoch's (its weights are the result) and, until this step's save is
  committed (`save` waits for it), the latest committed one: a save that fails (Cloud Storage
  down, a full disk) leaves a step to resume from."""
  # The steps since the last log row were not checked yet (the log checks its own): a
  # diverged step's weights are never kept.
  steps.check(run.step, 'lower config.train.learning_rate', saving=True)
  ckpt_lib.save(run.manager, run.workdir, run.step, run.state,
                dict(best=run.best, seed=run.seed, eval_pending=run.eval_pending))
  if run.pusher:  # In the background, once the save is committed.
    run.pusher.saved(run.step, last=run.step == run.stop_at)
  kept = run.manager.all_steps()
  committed = max((old for old in kept if old != run.step), default=None)
  for old in kept:
    if old not in (run.step, committed) and (run.best is None or old != run.best['step']):
      run.manager.delete(old)


def _to_device(run: _Run, batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
  """The global batch from this process's rows of it."""
  return sharding_lib.make_global_batch(batching.local_rows(batch), run.batch_sharding)


def _predict(run: _Run, preemption: monitor.Preemption, params: Any,
             eval_set: tasks.EvalSet) -> list[np.ndarray] | None:
  """Every row's prediction; None when SIGTERM came between two batches (`cut_short`: the
  notice is too short to finish)."""

  class CutShort(Exception):
    pass

  def predict_batch(batch):
    if preemption.cut_short():
      raise CutShort()
    return run.predict_step(params, _to_device(run, batch))

  try:
    with sharding_lib.activate(run.mesh, run.rules):
      return batching.predict_rows(predict_batch, eval_set.features, run.eval_batch_size,
                                   run.buckets)
  except CutShort:
    return None


def _predict_test(run: _Run, preemption: monitor.Preemption) -> bool:
  """Predicts each test set with the best epoch's weights, writes the predictions and adds
  the scores of a labelled set to `run.best`; False when SIGTERM stopped it."""
  best = run.best
  params = run.state.params
  if best['step'] != run.step:
    params = ckpt_lib.restore_params(run.manager, best['step'], run.abstract.params)
  for eval_set in run.task.test:
    rows = _predict(run, preemption, params, eval_set)
    if rows is None:
      logging.warning('Test predictions stopped by SIGTERM; rerun the same command to make them.')
      return False
    scores, write = eval_set.evaluate(rows)
    if scores is not None:
      best[eval_set.name] = fileio.json_safe(scores)
      run.log.eval(best['step'], _scalars(scores), eval_set.name, split=eval_set.name,
                   epoch=best['epoch'])
    if write and run.is_main:
      write(run.predictions_dir)
  logging.info('Test predictions in %s', run.predictions_dir)
  return True


def _epoch_seed(seed: int, epoch: int) -> int:
  """The seed of an epoch's batch plan (from train.seed): a resumed run plans the same
  batches."""
  return seed * 1_000_003 + epoch


def _batch_shapes(task: tasks.Task, epochs: range, *, batch_size: int, eval_batch_size: int,
                  seed: int, buckets: tuple[int, ...], sort_window: int, with_test: bool
                  ) -> tuple[list[dict], list[dict]]:
  """Every batch shape the train step meets in `epochs`, and every one the prediction step
  meets on dev (and test, `with_test`): each compiles before the first step."""
  train_shapes = batching.batch_shapes(
      task.train, batch_size, buckets, window_batches=sort_window,
      seeds=[_epoch_seed(seed, e) for e in epochs])
  predict_shapes = {}
  for eval_set in task.dev + (task.test if with_test else []):
    for shape in batching.batch_shapes(eval_set.features, eval_batch_size, buckets):
      predict_shapes[str(shape)] = shape
  return train_shapes, list(predict_shapes.values())


def _model_config(model: ml_collections.ConfigDict, max_seq_length: int,
                  pre_config: model_lib.BertConfig) -> model_lib.BertConfig:
  """The checkpoint's BertConfig, run as `model` (config.model) says (dtype, dropout, layout,
  kernel)."""
  if pre_config.max_length and max_seq_length > pre_config.max_length:
    raise UserError(f'config.data.max_seq_length={max_seq_length} exceeds the '
                    'checkpoint\'s max_position_embeddings='
                    f'{pre_config.max_position_embeddings}')
  return model_lib.config_from(model, checkpoint=pre_config)


def _log_padding(task_name: str, train_features: dict[str, np.ndarray], batch_size: int,
                 buckets: tuple[int, ...] | None, sort_window: int,
                 max_seq_length: int) -> None:
  """Logs what the length buckets save of the tokens of fixed-length batches."""
  savings = batching.padding_savings(train_features, batch_size,
                                     buckets or (max_seq_length,), window_batches=sort_window)
  logging.info('%s: %d training sequences; length buckets %s process %.0f%% of the tokens of '
               'fixed %d-token batches', task_name, len(train_features['input_ids']),
               buckets, 100 * (1 - savings['tokens_saved_share']), max_seq_length)


def _recorded_run(workdir: str, config: ml_collections.ConfigDict) -> dict[str, Any] | None:
  """The workdir's config.json (in today's keys), after refusing one of another task: its
  checkpoints hold another head, and a finished one would report the other task's score."""
  record = run_files.read_run_config(workdir)
  if not isinstance(record, dict):
    return None
  record = defaults.saved_config(record)
  task = record.get('task', {}).get('name')
  if task and task != config.task.name:
    raise UserError(f'--workdir={workdir} holds a fine-tuning run of task {task} (its '
                    f'config.json), not {config.task.name}: fine-tune {config.task.name} into '
                    'another --workdir')
  return record


def _warn_changed_length(record: dict[str, Any] | None, config: ml_collections.ConfigDict,
                         when: str, consequence: str) -> None:
  """Warns, as pre-training does, when the run in the workdir was made with another
  data.max_seq_length than `config` (its examples were cut to another length)."""
  saved = (record or {}).get('data', {}).get('max_seq_length')
  if saved is not None and int(saved) != int(config.data.max_seq_length):
    logging.warning('%s with data.max_seq_length changed (%s -> %s) since its checkpoint was '
                    'saved: %s', when, saved, config.data.max_seq_length, consequence)


def _finished(workdir: str, metrics_path: str, fresh: bool = False) -> dict[str, Any]:
  """The result of a finished run; drops every checkpoint but the best epoch's (a rerun after
  a stop between metrics.json and that clean-up finishes it)."""
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices('bert_jax finetune: metrics.json written')
  best = fileio.read_json(metrics_path)
  manager = ckpt_lib.make_manager(workdir, keep=None, async_save=False, replica_parallel=False)
  for step in manager.all_steps():
    if step != best['step']:
      manager.delete(step)
  manager.close()
  if jax.process_index() == 0:
    print(f'\nbert_jax finetune {best["task"]}: best epoch {best["epoch"]}, '
          f'{best["main_metric"]} {best["score"]:.4f}'
          + ('' if fresh else ' (the run had finished already)') + '\n'
          f'  workdir:      {workdir}\n'
          f'  metrics:      {metrics_path}\n'
          f'  TensorBoard:  tensorboard --logdir {workdir}', flush=True)
  return best


def sweep(config: ml_collections.ConfigDict, workdir: str,
          learning_rates: Sequence[float] = (5e-5, 4e-5, 3e-5, 2e-5)) -> dict[str, Any] | None:
  """The paper's search: one fine-tuning run per learning rate in `workdir/lr_<lr>`; the best
  dev score and its rate (also written to `workdir/sweep.json`). None when a run stopped early:
  rerunning the sweep skips the finished runs and resumes that one."""
  if not learning_rates:
    raise UserError('sweep: no learning rates')
  if config.checkpoint.push_to_hub:
    # Every rate's run would push its steps to one repository, tags colliding.
    raise UserError(f'--sweep with checkpoint.push_to_hub={config.checkpoint.push_to_hub}: '
                    'the runs of every rate would push into one repository; sweep without it, '
                    'then push the best run: bert-jax convert --input=WORKDIR/lr_RATE '
                    f'--format=hf --push_to_hub={config.checkpoint.push_to_hub}')
  workdir = fileio.workdir_path(workdir)
  # Every check before the first run: a refusal at the second rate would leave the first run's
  # folder, and sweep.json, in a workdir that was never a sweep's.
  run_files.check_workdir_kind(workdir, fine_tuning=True)
  if run_files.read_run_config(workdir) is not None:
    raise UserError(f'--workdir={workdir} holds a single fine-tuning run (its config.json): '
                    'sweep into another --workdir, which gets one lr_<rate> run folder a rate')
  for lr in learning_rates:
    run_files.check_workdir_kind(os.path.join(workdir, f'lr_{lr:g}'), fine_tuning=True)
  runs = {}
  for lr in learning_rates:
    run_config = copy.deepcopy(config)
    with run_config.unlocked():
      run_config.train.learning_rate = float(lr)
    runs[f'{lr:g}'] = finetune(run_config, os.path.join(workdir, f'lr_{lr:g}'))
    if runs[f'{lr:g}'] is None:
      return None
  best_lr = max(runs, key=lambda k: runs[k]['score'])
  result = {
      'task': config.task.name, 'main_metric': runs[best_lr]['main_metric'],
      'best_learning_rate': float(best_lr), 'best_score': runs[best_lr]['score'],
      'best_workdir': os.path.join(workdir, f'lr_{best_lr}'),
      'runs': {lr: {'score': r['score'], 'epoch': r['epoch']} for lr, r in runs.items()},
  }
  if jax.process_index() == 0:
    fileio.write_json(os.path.join(workdir, 'sweep.json'), result)
  logging.info('Sweep: best %s %.4f at learning rate %s', result['main_metric'],
               result['best_score'], best_lr)
  return result
