"""Fine-tuning on the tasks of task_table.py (GLUE, SQuAD v1.1/v2.0, NER, ...), the paper's recipe.

`finetune(config, workdir)` runs, in order: setup -> mesh -> pre-trained encoder and tokenizer ->
task data -> model & optimizer -> abstract init & shardings -> init (pre-trained encoder, fresh
head) -> steps -> loop over epochs (train, evaluate on dev, keep the best) -> test predictions.
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
                       `convert.load_pretrained` like a pre-training workdir, head included
  metrics.jsonl + TensorBoard events   training metrics and each epoch's dev metrics
  metrics.json         the best epoch's dev metrics (what `finetune` returns); marks the run
                       finished
  predictions/         the best epoch's dev predictions: SQuAD predictions.json (+ null_odds.json),
                       NER CoNLL files, SWAG dev.jsonl, GLUE dev.tsv (MNLI: dev_matched.tsv,
                       dev_mismatched.tsv) in the leaderboard's layout; with config.predict_test,
                       the test sets' (GLUE: the leaderboard's CoLA.tsv, ...)
Resume: rerunning the same call continues from the latest checkpoint that reads back whole
(saved every checkpoint.every_steps, after each epoch's evaluation and on SIGTERM;
`checkpoint.restore_or_init`, pre-training's resume order) at its step inside its epoch, and
ends as an uninterrupted run would; a finished workdir returns its metrics.json.
Every path goes through tf.io.gfile (local or gs://).
"""

import copy
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
from bert_jax import convert
from bert_jax import defaults
from bert_jax import fileio
from bert_jax import input_pipeline
from bert_jax import model as model_lib
from bert_jax import monitor
from bert_jax import optim
from bert_jax import run_lock
from bert_jax import sharding as sharding_lib
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


def _run_files(workdir, config, bert_config, vocab_file, lower_case, task) -> None:
  """Makes the workdir a loadable checkpoint folder (with its vocab and casing) + the config."""
  ckpt_lib.write_run_files(
      workdir, config.to_json_best_effort(indent=2), bert_config, vocab_file, extra={
          'tokenizer_config.json': {'do_lower_case': lower_case,
                                    'tokenizer_class': 'BertTokenizer'},
          'task.json': dict(task.info, kind=task.kind, main_metric=task.main_metric,
                            max_seq_length=config.data.max_seq_length,
                            init_checkpoint=config.train.init_checkpoint,
                            # What dev was evaluated in: `predict` reproduces it.
                            compute_dtype=model_lib.resolve_dtype(config.model.dtype))})


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
  defaults.check_moved_keys(config)
  task_table.kind_of(config.task)  # A misspelt task fails before the workdir and the checkpoint.
  workdir = fileio.workdir_path(workdir)
  if fileio.exists(os.path.join(workdir, 'sweep.json')):
    raise UserError(f'--workdir={workdir} holds a --sweep (its sweep.json): fine-tune into '
                    'another --workdir, or rerun the sweep with --sweep')
  # From the start, before the lock: SIGTERM during start-up is heard too.
  with monitor.Preemption() as preemption, run_lock.hold(workdir):
    preemption.check()
    return _finetune(config, workdir, preemption)


class _EvalStopped(Exception):
  """SIGTERM between two evaluation batches: the evaluation is dropped (redone on resume)."""


def _finetune(config: ml_collections.ConfigDict, workdir: str,
              preemption: monitor.Preemption) -> dict[str, Any] | None:
  # ---- Setup ---------------------------------------------------------------------------------
  input_pipeline.hide_accelerators_from_tf()
  ckpt_lib.check_workdir_kind(workdir, fine_tuning=True)
  ckpt_lib.use_compilation_cache(workdir, config.checkpoint.compilation_cache_dir)
  is_main = jax.process_index() == 0
  if config.train.epochs < 1:
    raise UserError(f'config.train.epochs={config.train.epochs} must be at least 1')
  metrics_path = os.path.join(workdir, 'metrics.json')
  if fileio.exists(metrics_path):
    return _finished(workdir, metrics_path)
  fileio.gfile().makedirs(workdir)

  # ---- Mesh ----------------------------------------------------------------------------------
  mesh = sharding_lib.make_mesh(config.mesh)
  rules = sharding_lib.rules_from_config(config.mesh)
  batch_size, eval_batch_size = int(config.train.batch_size), int(config.eval.batch_size)
  sharding_lib.check_batch_size(batch_size, mesh)
  sharding_lib.check_batch_size(eval_batch_size, mesh, 'eval.batch_size')
  state_lib.check_accumulation(batch_size, config.train.grad_accum_steps, mesh)

  # ---- Pre-trained encoder, tokenizer and task data ------------------------------------------
  pre_config, pretrained, tok, vocab_file, lower_case = convert.load_checkpoint(
      config.train.init_checkpoint, config.data.vocab_file, config.data.lower_case,
      config.model.scan_layers, flag='config.train.init_checkpoint')
  bert_config = _model_config(config, pre_config)
  task = task_table.make_task(config, tok, bert_config, lower_case)
  buckets, sort_window = _batch_settings(config, task.train, batch_size)
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
  _check_same_tree(pretrained['bert'], abstract.params['bert'],
                   config.train.init_checkpoint)

  # ---- Restore, or init: pre-trained encoder, fresh head --------------------------------------
  # Every save keeps the train state (for resume) and, in `meta`, the best epoch so far, whose
  # step is kept too; once the run ends only the best epoch's checkpoint stays.
  manager = ckpt_lib.make_manager(workdir, keep=None, async_save=False, replica_parallel=False)

  def init() -> state_lib.TrainState:
    params = init_head(abstract.params, shardings.params, bert_config.initializer_range,
                       config.train.seed)
    params['bert'] = state_lib.put_sharded(pretrained['bert'], shardings.params['bert'])
    ignored = sorted(set(pretrained) - {'bert'})
    logging.info('Encoder from %s; fresh head %s%s', config.train.init_checkpoint,
                 sorted(set(params) - {'bert'}),
                 f'; the checkpoint\'s heads {ignored} are not used' if ignored else '')
    with sharding_lib.activate(mesh, rules):
      return state_lib.state_from_params(params, tx, shardings)

  # A fresh head compiles its initializers: SIGTERM does not wait for them.
  start, state, meta = ckpt_lib.restore_or_init(manager, workdir, abstract,
                                                lambda: preemption.wait(init))
  preemption.check()
  # Only now, with the checkpoint found to match: a refused run leaves the workdir's record as
  # it was.
  _run_files(workdir, config, pre_config, vocab_file, lower_case, task)
  best: dict[str, Any] | None = meta.get('best')
  pretrained = None  # The host copy of the checkpoint is not needed any more.
  step = int(state.step)

  # ---- Steps ---------------------------------------------------------------------------------
  batch_sharding = sharding_lib.batch_sharding(mesh)
  train_step = state_lib.jit_step(
      tasks.train_apply(task.model), task.loss_fn, tx, mesh, rules, shardings,
      state_lib.dropout_rng(config.train), config.train.grad_accum_steps)
  jit_predict = jax.jit(functools.partial(tasks.predict_step, model=task.model, head=task.head),
                        in_shardings=(shardings.params, batch_sharding),
                        out_shardings=NamedSharding(mesh, P()))

  def to_device(batch):
    return sharding_lib.make_global_batch(batching.local_rows(batch), batch_sharding)

  def predict(params, eval_set: tasks.EvalSet) -> list[np.ndarray]:
    """Every row's prediction; `_EvalStopped` at SIGTERM (the notice is too short to finish)."""

    def predict_batch(batch):
      if preemption.requested:
        raise _EvalStopped()
      return jit_predict(params, to_device(batch))

    with sharding_lib.activate(mesh, rules):
      return batching.predict_rows(predict_batch, eval_set.features, eval_batch_size, buckets)

  # ---- Every shape the run trains and predicts, compiled before its first step ---------------
  train_shapes, predict_shapes = _batch_shapes(
      task, config, range(step // steps_per_epoch + 1, math.ceil(stop_at / steps_per_epoch) + 1),
      buckets, sort_window, with_test=stop_at == total_steps)
  spec = lambda shape: {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=batch_sharding)
                        for k, v in shape.items()}
  preemption.wait(lambda: state_lib.compile_ahead(
      [(train_step.jitted, (abstract, spec(s))) for s in train_shapes] +
      [(jit_predict, (abstract.params, spec(s))) for s in predict_shapes], mesh, rules,
      f'the train step for {len(train_shapes)} length bucket(s) and the prediction step for '
      f'{len(predict_shapes)}'))

  def save(eval_pending: bool = False) -> None:
    bar.update(in_flight.drain())
    # The steps since the last log were not checked yet (the log checks its own): a diverged
    # step's weights are never kept.
    unchecked = jax.device_get(history) if history else []
    diverged = monitor.divergence(unchecked, step - len(unchecked) + 1)
    if diverged:
      raise UserError(f'{diverged}: stopping without saving it; lower '
                      'config.train.learning_rate')
    ckpt_lib.save(manager, workdir, step, state, dict(best=best, seed=config.train.seed,
                                                      eval_pending=eval_pending))
    # Kept: this step (to resume from), the best epoch's (its weights are the result) and,
    # until this step's asynchronous save is committed (the next save waits for it), the
    # latest committed one: a save that fails (Cloud Storage down) leaves a step to resume from.
    steps = manager.all_steps()
    committed = max((old for old in steps if old != step), default=None)
    for old in steps:
      if old not in (step, committed) and (best is None or old != best['step']):
        manager.delete(old)

  # ---- Logs ----------------------------------------------------------------------------------
  # Rows past the checkpoint are from an attempt that did not save them: written again below.
  monitor.truncate_metrics(workdir, start)
  log = monitor.MetricsLog(workdir)
  predictions_dir = os.path.join(workdir, PREDICTIONS_DIR)

  # ---- Loop: epochs of steps, each epoch evaluated on dev; the best epoch is kept -------------
  logging.info('%s: %d epochs x %d steps of %d sequences, peak lr %g, %d warmup steps',
               config.task, config.train.epochs, steps_per_epoch, batch_size,
               config.train.learning_rate, warmup_steps)
  bar = monitor.progress(total_steps, step, is_main and config.log.progress)
  chrono = monitor.Chrono(step)
  # The host stays one step ahead of the device: a stop (SIGTERM) waits for a step, not for
  # every step dispatched since the last log line; the bar and the rates count computed steps.
  in_flight = monitor.InFlight()
  every = int(config.checkpoint.every_steps)
  # pending: SIGTERM cut an epoch's evaluation short; its rerun evaluates first.
  history, stopped, pending = [], False, False

  def end_epoch(epoch: int, saved: bool = False) -> bool:
    """Evaluates on every dev set, keeps the epoch if it is the best, saves (unless `saved`:
    this step's checkpoint is there); False when SIGTERM cut the evaluation short (then the
    state is saved with the evaluation still to do)."""
    nonlocal best
    with chrono.excluded():
      try:
        evaluated = [(s, *s.evaluate(predict(state.params, s))) for s in task.dev]
      except _EvalStopped:
        logging.warning('Evaluation of epoch %d stopped by SIGTERM: saving step %d, the rerun '
                        'evaluates it', epoch, step)
        if not saved:
          save(eval_pending=True)
        return False
      results, writers = {}, {}
      for eval_set, scores, writers[eval_set.name] in evaluated:
        results[eval_set.name] = fileio.json_safe(scores)
        log.eval(step, _scalars(scores), eval_set.name, split=eval_set.name, epoch=epoch)
      score = float(results[task.dev[0].name][task.main_metric])
      logging.info('Epoch %d (step %d): %s', epoch, step,
                   {n: _scalars(r) for n, r in results.items()})
      bar.set_postfix(**{task.main_metric: f'{score:.4f}'})
      # A NaN score (e.g. the correlation of constant predictions) never counts as best.
      if best is None or score > best['score'] or math.isnan(best['score']):
        best = dict(task=config.task, main_metric=task.main_metric, score=score,
                    epoch=epoch, step=step, learning_rate=float(config.train.learning_rate),
                    **results)
        if is_main:
          for write in writers.values():
            if write:
              write(predictions_dir)
      if not saved:
        save()
    return True

  state_lib.wait_for_processes('the first step')
  try:
    if meta.get('eval_pending'):  # Stopped inside the evaluation of the epoch that ends here.
      # Its checkpoint stays as it is: later saves carry the new best.
      pending = stopped = not end_epoch(step // steps_per_epoch, saved=True)
    while step < stop_at and not stopped:
      epoch = step // steps_per_epoch + 1
      epoch_end = epoch * steps_per_epoch
      # The epoch's batches are planned from its seed alone, so a resumed run skips exactly
      # the ones it had trained on.
      plan = batching.batches(task.train, batch_size, buckets, shuffle=True,
                              seed=_epoch_seed(config, epoch),
                              window_batches=sort_window)
      for batch in itertools.islice(plan, step - (epoch - 1) * steps_per_epoch, None):
        state, step_metrics = train_step(state, to_device(batch))
        step += 1
        history.append(step_metrics)
        chrono.count(sequences=float(batch['weight'].sum()), tokens=batch['input_ids'].size)
        bar.update(in_flight.add(step_metrics))
        if step % config.log.every_steps == 0 or step == epoch_end or step == stop_at:
          bar.update(in_flight.drain())
          host_history = jax.device_get(history)
          diverged = monitor.divergence(host_history, step - len(history) + 1)
          if diverged:
            raise UserError(f'{diverged}: stopping; lower config.train.learning_rate')
          summary = monitor.summarize(host_history)
          rates = chrono.report(step)
          summary.update(epoch=epoch, learning_rate=float(schedule(step - 1)),
                         sequences_per_second=rates['sequences_per_second'],
                         tokens_per_second=rates['tokens_per_second'])
          log.train(step, summary)
          bar.set_postfix(loss=f'{summary["loss"]:.4f}')
          history = []
        stopped = preemption.stop_now(step, manager) or step == stop_at
        if step == epoch_end or stopped:
          break
        if every and step % every == 0:
          save()

      if step == epoch_end:
        pending = not end_epoch(epoch)
        stopped = pending or stopped or preemption.stop_now(step, manager)
      elif stopped:  # Inside an epoch: saved where it stopped, to resume there.
        save()

    if step < total_steps or pending:
      logging.warning('Stopped at step %d of %d; rerun the same command to resume.', step,
                      total_steps)
      if is_main:
        print(f'\nbert_jax finetune {config.task}: stopped at step {step} of {total_steps} '
              f'(epoch {step // steps_per_epoch + 1}); rerun the same command to resume from '
              f'{workdir}', flush=True)
      if preemption.requested:
        raise preemption.stopped(step)
      return None

    # ---- Test predictions with the best epoch's weights --------------------------------------
    if task.test:
      params = state.params
      if best['step'] != step:
        params = ckpt_lib.restore_params(manager, best['step'], abstract.params)
      if not _predict_test(task.test, predict, params, best, log, predictions_dir, is_main):
        raise preemption.stopped(step)
  finally:
    bar.close()
    ckpt_lib.wait_for_saves(manager, workdir)  # A failed save as one line (a disk, an outage).
    manager.close()
    log.close()

  # metrics.json marks the run finished; then only the best epoch's checkpoint is kept.
  if is_main:
    fileio.write_json(metrics_path, best)
  return _finished(workdir, metrics_path, fresh=True)


def _epoch_seed(config: ml_collections.ConfigDict, epoch: int) -> int:
  """The seed of an epoch's batch plan: a resumed run plans the same batches."""
  return config.train.seed * 1_000_003 + epoch


def _batch_shapes(task: tasks.Task, config: ml_collections.ConfigDict, epochs: range,
                  buckets: tuple[int, ...], sort_window: int, with_test: bool
                  ) -> tuple[list[dict], list[dict]]:
  """Every batch shape the train step meets in `epochs`, and every one the prediction step
  meets on dev (and test, `with_test`): each compiles before the first step."""
  train_shapes = batching.batch_shapes(
      task.train, int(config.train.batch_size), buckets, window_batches=sort_window,
      seeds=[_epoch_seed(config, e) for e in epochs])
  predict_shapes = {}
  for eval_set in task.dev + (task.test if with_test else []):
    for shape in batching.batch_shapes(eval_set.features, int(config.eval.batch_size), buckets):
      predict_shapes[str(shape)] = shape
  return train_shapes, list(predict_shapes.values())


def _predict_test(test_sets: list[tasks.EvalSet], predict: Callable, params: Any,
                  best: dict[str, Any], log: monitor.MetricsLog, predictions_dir: str,
                  is_main: bool) -> bool:
  """Predicts each test set with the best epoch's `params`, writes the predictions and adds
  the scores of a labelled set to `best`; False when SIGTERM stopped it."""
  for eval_set in test_sets:
    try:
      rows = predict(params, eval_set)
    except _EvalStopped:
      logging.warning('Test predictions stopped by SIGTERM; rerun the same command to make them.')
      return False
    scores, write = eval_set.evaluate(rows)
    if scores is not None:
      best[eval_set.name] = fileio.json_safe(scores)
      log.eval(best['step'], _scalars(scores), eval_set.name, split=eval_set.name,
               epoch=best['epoch'])
    if write and is_main:
      write(predictions_dir)
  logging.info('Test predictions in %s', predictions_dir)
  return True


def _model_config(config: ml_collections.ConfigDict, pre_config: model_lib.BertConfig
                  ) -> model_lib.BertConfig:
  """The checkpoint's BertConfig, run as config.model says (dtype, dropout, layout, kernel)."""
  if config.data.max_seq_length > pre_config.max_position_embeddings:
    raise UserError(f'config.data.max_seq_length={config.data.max_seq_length} exceeds the '
                    'checkpoint\'s max_position_embeddings='
                    f'{pre_config.max_position_embeddings}')
  return pre_config.replace(
      dtype=model_lib.resolve_dtype(config.model.dtype),
      hidden_dropout_prob=config.model.hidden_dropout_prob,
      attention_probs_dropout_prob=config.model.attention_probs_dropout_prob,
      scan_layers=config.model.scan_layers, remat_policy=config.model.remat_policy,
      attention_impl=config.model.attention_impl,
      layer_norm_impl=config.model.layer_norm_impl)


def _batch_settings(config: ml_collections.ConfigDict, train_features: dict[str, np.ndarray],
                    batch_size: int) -> tuple[tuple[int, ...], int]:
  """(length buckets, length_sort_window), checked, with what the buckets save logged."""
  buckets = batching.parse_buckets(config.buckets)
  sort_window = int(config.train.length_sort_window)
  if sort_window < 1:
    raise UserError(f'config.train.length_sort_window={sort_window}: expected 1 (uniformly '
                    'random batches) or more batches to sort by length together')
  attention.check_config(config.model.attention_impl,
                         config.model.attention_probs_dropout_prob, jax.default_backend(),
                         tuple(buckets or ()) + (config.data.max_seq_length,))
  savings = batching.padding_savings(train_features, batch_size,
                                     buckets or (config.data.max_seq_length,),
                                     window_batches=sort_window)
  logging.info('%s: %d training sequences; length buckets %s process %.0f%% of the tokens of '
               'fixed %d-token batches', config.task, len(train_features['input_ids']),
               buckets, 100 * (1 - savings['tokens_saved_share']), config.data.max_seq_length)
  return buckets, sort_window


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
  workdir = fileio.workdir_path(workdir)
  # Every check before the first run: a refusal at the second rate would leave the first run's
  # folder, and sweep.json, in a workdir that was never a sweep's.
  ckpt_lib.check_workdir_kind(workdir, fine_tuning=True)
  if ckpt_lib.read_run_config(workdir) is not None:
    raise UserError(f'--workdir={workdir} holds a single fine-tuning run (its config.json): '
                    'sweep into another --workdir, which gets one lr_<rate> run folder a rate')
  for lr in learning_rates:
    ckpt_lib.check_workdir_kind(os.path.join(workdir, f'lr_{lr:g}'), fine_tuning=True)
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
      'task': config.task, 'main_metric': runs[best_lr]['main_metric'],
      'best_learning_rate': float(best_lr), 'best_score': runs[best_lr]['score'],
      'best_workdir': os.path.join(workdir, f'lr_{best_lr}'),
      'runs': {lr: {'score': r['score'], 'epoch': r['epoch']} for lr, r in runs.items()},
  }
  if jax.process_index() == 0:
    fileio.write_json(os.path.join(workdir, 'sweep.json'), result)
  logging.info('Sweep: best %s %.4f at learning rate %s', result['main_metric'],
               result['best_score'], best_lr)
  return result
