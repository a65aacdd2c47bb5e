"""BERT pre-training: one straight function from a config to a trained, checkpointed model.

Sections of `train_and_evaluate`, in order: setup -> mesh -> data -> model, optimizer, abstract
init, shardings and steps (`pretraining.build_step`, which `aot.py` and the benchmarks use too)
-> init or restore -> loop (log, eval, checkpoint, preemption). The step functions are pure and
live in `pretraining.py`.
"""

import functools
import itertools
import json
import os
from typing import Any, Callable

import jax
import ml_collections
import numpy as np
import optax
from absl import logging
from jax.experimental import multihost_utils

from bert_jax import checkpoint as ckpt_lib
from bert_jax import fileio
from bert_jax import flops as flops_lib
from bert_jax import model as model_lib
from bert_jax import monitor
from bert_jax import objectives
from bert_jax import pretraining
from bert_jax import run_lock
from bert_jax import sharding as sharding_lib
from bert_jax import train_state as state_lib
from bert_jax.errors import UserError


def eval_batches(it, steps: int, padding: dict[str, Any],
                 max_over_processes: Callable[[int], int] | None = None) -> list[dict[str, Any]]:
  """Up to `steps` batches of `it`, the same number on every process.

  Processes' held-out shares can run out at different batches; one that stopped early would
  leave the others waiting in the evaluation step's collectives forever. The count is agreed
  on (the largest), and a process that has fewer batches adds `padding` batches, which count
  for nothing (no tokens, zero weights).
  """
  batches = list(itertools.islice(it, steps))
  if max_over_processes is None:
    max_over_processes = _max_over_processes
  count = max_over_processes(len(batches))
  padding = jax.tree.map(np.asarray, padding)
  return batches + [padding] * (count - len(batches))


def _max_over_processes(n: int) -> int:
  if jax.process_count() == 1:
    return n
  return int(np.max(multihost_utils.process_allgather(np.asarray(n, np.int32))))


def evaluate_params(config: ml_collections.ConfigDict, phase: pretraining.Phase, params: Any,
                    p_eval_step: Callable, mesh: jax.sharding.Mesh, rules, vocab_file: str,
                    check_nsp_share: bool = False,
                    stop: Callable[[], bool] = lambda: False) -> dict[str, float] | None:
  """MLM (and NSP) metrics of `params` on eval.steps batches of the phase's held-out data;
  None when `stop()` turns true between batches (SIGTERM: the notice is too short to finish).

  With check_nsp_share, NSP/SOP metrics of labels far from half NotNext are refused
  (`check_label_share`)."""
  from bert_jax import input_pipeline  # pylint: disable=g-import-not-at-top  (TensorFlow)
  eval_local = config.eval.batch_size // jax.process_count()
  sharding_lib.check_batch_size(config.eval.batch_size, mesh, 'eval.batch_size')
  ds = input_pipeline.make_pretraining_dataset(
      pretraining.phase_data(config, phase), batch_size=eval_local, seq_len=phase.seq_len,
      max_predictions=phase.max_predictions, train=False, process_index=jax.process_index(),
      process_count=jax.process_count(), vocab_file=vocab_file)
  batches = eval_batches(ds.as_numpy_iterator(), config.eval.steps,
                         _empty_batch(ds.element_spec))
  if not batches:
    raise UserError('the evaluation data gave no batch: data.eval_input (or the held-out '
                    'share of data.input) is smaller than eval.batch_size')
  if check_nsp_share:
    check_label_share(batches, config.data)
  batch_sharding = sharding_lib.batch_sharding(mesh)
  results, in_flight = [], monitor.InFlight()  # So that `stop()` is not answered batches late.
  with sharding_lib.activate(mesh, rules):
    for local in batches:
      if stop():
        return None
      results.append(p_eval_step(params, sharding_lib.make_global_batch(local, batch_sharding)))
      in_flight.add(results[-1])
  return monitor.summarize(jax.device_get(results))


def check_label_share(batches: list[dict[str, Any]], data: ml_collections.ConfigDict) -> None:
  """Raises a UserError when the NotNext (SOP: swapped) share of the evaluation examples is not
  about one half: a held-out set of (nearly) one document has no NotNext pairs, and its
  nsp_accuracy of 1.0 would say nothing. The tolerance is 4 standard deviations (at least
  0.15), so an honest draw is almost never refused."""
  labels = examples = 0
  for batch in batches:
    real = (batch['next_sentence_weights'] > 0 if 'next_sentence_weights' in batch
            else batch['input_mask'][:, 0] > 0)
    examples += int(real.sum())
    labels += int(np.asarray(batch['next_sentence_labels'])[real].sum())
  if not examples:
    return
  share = labels / examples
  if abs(share - 0.5) >= max(0.15, 2 / np.sqrt(examples)):
    where = (f'data.eval_input={data.eval_input!r}' if data.eval_input
             else f'the held-out share of data.input={data.input!r}')
    raise UserError(f'{where}: {share:.0%} of its {examples} evaluation pairs are '
                    f'{objectives.get(data.objective).label_names[1]} instead of about half '
                    f'(too few documents), so {data.objective}_accuracy would mean nothing; '
                    'give more documents, or --config.data.objective=none for MLM metrics only')


def evaluate_checkpoint(config: ml_collections.ConfigDict, checkpoint: str) -> dict[str, Any]:
  """MLM and NSP metrics of any checkpoint `convert.load_pretrained` reads, on the held-out
  data of `config` (eval.steps batches of eval.batch_size), without training.

  The vocabulary is data.vocab_file or else the checkpoint's vocab.txt. Given a pre-training
  workdir and that run's config, the numbers are those of the run's last evaluation (the same
  data, phase and batches). A checkpoint without an NSP head (BertForMaskedLM) gets MLM only.
  """
  from bert_jax import convert  # pylint: disable=g-import-not-at-top
  from bert_jax import input_pipeline  # pylint: disable=g-import-not-at-top  (TensorFlow)
  input_pipeline.hide_accelerators_from_tf()
  mesh = sharding_lib.make_mesh(config.mesh)
  rules = sharding_lib.rules_from_config(config.mesh)
  convert.check_casing(checkpoint, config.data.lower_case, '--checkpoint')
  loaded_config, params = convert.load_pretrained(checkpoint,
                                                  scan_layers=config.model.scan_layers)
  vocab_file = config.data.vocab_file or convert.find_vocab(checkpoint)
  if not vocab_file:
    raise UserError(f'--checkpoint={checkpoint} has no vocab.txt next to it: set '
                    '--config.data.vocab_file')
  if 'mlm' not in params:
    raise UserError(f'--checkpoint={checkpoint} has no MLM head (cls.predictions): a '
                    'fine-tuned model has no pre-training metrics')
  m = config.model
  bert_config = loaded_config.replace(
      dtype=model_lib.resolve_dtype(m.dtype), scan_layers=m.scan_layers,
      remat_policy=m.remat_policy, attention_impl=m.attention_impl,
      max_packed_sequences=pretraining.packed_sequences(config))
  # A checkpoint without the sentence head (BertForMaskedLM) is scored on MLM alone.
  objective = config.data.objective if 'nsp' in params else 'none'
  params = model_lib.with_nsp_head(params, bert_config.hidden_size)  # Not reported without.
  # The phase of the last step: a workdir's latest checkpoint, else where the run would end.
  phases = pretraining.parse_phases(config)
  steps = ckpt_lib.checkpoint_steps(checkpoint) if fileio.isdir(checkpoint) else []
  last = steps[-1] if steps else (int(config.train.stop_at_step) or int(config.train.steps))
  phase = pretraining.phase_at(phases, last - 1)
  model = model_lib.BertForPreTraining(bert_config)
  _, shardings, _ = pretraining.abstract_state_and_shardings(model, optax.identity(), mesh,
                                                             rules)
  params = state_lib.put_sharded({k: params[k] for k in shardings.params},
                                 shardings.params)
  p_eval_step = jax.jit(functools.partial(pretraining.eval_step, model=model,
                                          objective=objective),
                        in_shardings=(shardings.params, sharding_lib.batch_sharding(mesh)))
  metrics = evaluate_params(config, phase, params, p_eval_step, mesh, rules, vocab_file,
                            check_nsp_share=objective != 'none')
  return dict(metrics, checkpoint=checkpoint, step=steps[-1] if steps else None,
              seq_len=phase.seq_len)


def _global_batch_spec(element_spec, sharding: jax.sharding.NamedSharding
                       ) -> dict[str, jax.ShapeDtypeStruct]:
  """The global batch `make_global_batch` builds from every process's batches of this spec."""
  return {k: jax.ShapeDtypeStruct((spec.shape[0] * jax.process_count(), *spec.shape[1:]),
                                  spec.dtype.as_numpy_dtype, sharding=sharding)
          for k, spec in element_spec.items()}


def _empty_batch(element_spec) -> dict[str, np.ndarray]:
  """A batch of the dataset's shapes with no tokens and zero weights: it counts for nothing."""
  return {k: np.zeros(spec.shape, spec.dtype.as_numpy_dtype)
          for k, spec in element_spec.items()}


def _init_from_checkpoint(path: str, bert_config: model_lib.BertConfig, fresh: dict) -> dict:
  """Host-side params from a converted checkpoint, with fresh heads where it has none."""
  from bert_jax import convert  # Pulls in TF checkpoint reading only when needed.
  cfg, loaded = convert.load_pretrained(path, scan_layers=bert_config.scan_layers)
  for field in ('hidden_size', 'num_hidden_layers', 'num_attention_heads', 'intermediate_size',
                'max_position_embeddings', 'type_vocab_size'):
    if getattr(cfg, field) != getattr(bert_config, field):
      raise UserError(f'train.init_checkpoint={path}: {field}={getattr(cfg, field)} but the '
                      f'model config has {getattr(bert_config, field)}')
  if cfg.vocab_size != bert_config.vocab_size:
    raise UserError(f'train.init_checkpoint={path}: vocab_size={cfg.vocab_size} but '
                    f'data.vocab_file gives {bert_config.vocab_size}; use the checkpoint\'s vocab')
  merged = {}
  for head, value in fresh.items():
    if head in loaded:
      merged[head] = loaded[head]
    else:
      logging.info('init_checkpoint %s has no %r: freshly initialized', path, head)
      merged[head] = value
  return merged


# ---------------------------------------------------------------------------------------------
# The driver
# ---------------------------------------------------------------------------------------------


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict[str, float]:
  """Pre-trains BERT as `config` says, in `workdir`; returns the last evaluation's metrics.

  One run at a time per workdir: a second one is refused while this one holds its lock.
  SIGTERM or Ctrl-C stops the run with `errors.Preempted`: after the first step, once it has
  saved where it is; before it (nothing new to save), at once.
  """
  workdir = fileio.workdir_path(workdir)
  # From the start, before the lock: SIGTERM during start-up is heard too.
  with monitor.Preemption() as preemption, run_lock.hold(workdir):
    preemption.check()
    return _train_and_evaluate(config, workdir, preemption)


def _train_and_evaluate(config: ml_collections.ConfigDict, workdir: str,
                        preemption: monitor.Preemption) -> dict[str, float]:
  # TensorFlow is imported only when data is needed.
  from bert_jax import input_pipeline  # pylint: disable=g-import-not-at-top
  from bert_jax import tokenization  # pylint: disable=g-import-not-at-top

  # ---- Setup ---------------------------------------------------------------------------------
  input_pipeline.hide_accelerators_from_tf()
  ckpt_lib.check_workdir_kind(workdir, fine_tuning=False)
  ckpt_lib.use_compilation_cache(workdir, config.checkpoint.compilation_cache_dir)
  is_main = jax.process_index() == 0
  stop_at = int(config.train.stop_at_step) or int(config.train.steps)
  if not 0 < stop_at <= config.train.steps:
    raise UserError(f'train.stop_at_step={config.train.stop_at_step} must lie in '
                    f'[1, train.steps={config.train.steps}] (0 = run to train.steps)')

  # ---- Mesh ----------------------------------------------------------------------------------
  mesh = sharding_lib.make_mesh(config.mesh)
  rules = sharding_lib.rules_from_config(config.mesh)
  pretraining.check_batch(config, mesh)
  # Evaluation runs thousands of steps in: its settings are checked now.
  sharding_lib.check_batch_size(config.eval.batch_size, mesh, 'eval.batch_size')
  if config.eval.steps < 1 or config.eval.every_steps < 1:
    raise UserError(f'eval.steps={config.eval.steps} and eval.every_steps='
                    f'{config.eval.every_steps} must be at least 1')
  logging.info('Mesh %s on %d devices, %d processes', dict(mesh.shape), jax.device_count(),
               jax.process_count())

  # ---- Data ----------------------------------------------------------------------------------
  phases = pretraining.parse_phases(config)
  pretraining.check_attention(config, jax.default_backend())
  for phase in phases:
    input_pipeline.check_vocab_given(pretraining.phase_data(config, phase),
                                     f'phase {phase.index + 1} reads ')
  from bert_jax import documents  # pylint: disable=g-import-not-at-top  (TensorFlow)
  written = [os.path.join(workdir, name) for name in ckpt_lib.RUN_FILES]
  for phase in phases:
    data = pretraining.phase_data(config, phase)
    for key in ('input', 'eval_input'):
      if data[key]:
        documents.check_not_matched(data[key], f'data.{key}', written)
  # A vocab trained here comes from the first phase's input.
  fileio.check_bucket(config.train.init_checkpoint, 'train.init_checkpoint')  # Not at init.
  if config.train.init_checkpoint:
    from bert_jax import convert  # pylint: disable=g-import-not-at-top
    if fileio.same_path(config.train.init_checkpoint, workdir):
      raise UserError(f'train.init_checkpoint={config.train.init_checkpoint} is the --workdir '
                      'itself: a run resumes from its own workdir anyway; start from it in '
                      'another --workdir')
    convert.check_casing(config.train.init_checkpoint, config.data.lower_case,
                         'train.init_checkpoint')
  vocab_file = input_pipeline.resolve_vocab(pretraining.phase_data(config, phases[0]), workdir)
  tokenizer = tokenization.load_tokenizer(vocab_file, lower_case=config.data.lower_case)
  local_batch = config.train.batch_size // jax.process_count()

  def dataset_for(phase: pretraining.Phase, train: bool, batch_size: int = local_batch,
                  seed: int | None = None):
    return input_pipeline.make_pretraining_dataset(
        pretraining.phase_data(config, phase), batch_size=batch_size, seq_len=phase.seq_len,
        max_predictions=phase.max_predictions, train=train,
        process_index=jax.process_index(), process_count=jax.process_count(), seed=seed,
        vocab_file=vocab_file)

  def training_input(phase: pretraining.Phase, step: int) -> input_pipeline.TrainingInput:
    """The phase's training input; a saved position is restored only where it fits."""
    data = pretraining.phase_data(config, phase)
    fingerprint = input_pipeline.input_fingerprint(
        data, batch_size=local_batch, seq_len=phase.seq_len,
        max_predictions=phase.max_predictions, process_count=jax.process_count())
    return input_pipeline.TrainingInput(lambda seed: dataset_for(phase, True, seed=seed),
                                        fingerprint, step, int(data.seed))

  logging.info('Checking the input of %d phase(s)', len(phases))
  _check_phase_data(config, phases, dataset_for)
  preemption.check()

  # ---- Model, optimizer, abstract init and shardings, steps (nothing allocated yet) ----------
  built = pretraining.build_step(config, mesh, tokenizer.vocab_size)
  bert_config, tx, schedule = built.bert_config, built.tx, built.schedule
  abstract, state_shardings, init_fn = built.abstract, built.shardings, built.init
  n_params = model_lib.count_params(abstract.params)
  logging.info('Model %s: %s parameters, dtype %s', config.model.size, f'{n_params:,}',
               bert_config.dtype)

  # ---- Init or restore -----------------------------------------------------------------------
  manager = ckpt_lib.make_manager(workdir, config.checkpoint.keep)

  def init() -> state_lib.TrainState:
    state = jax.jit(init_fn, out_shardings=state_shardings)(jax.random.key(config.train.seed))
    if not config.train.init_checkpoint:
      return state
    # Host copies of the fresh parameters (heads the checkpoint lacks come from them); with
    # fsdp or tensor axes across hosts no process holds every shard, so gather them.
    fresh = (multihost_utils.process_allgather(state.params, tiled=True)
             if jax.process_count() > 1 else jax.tree.map(np.asarray, state.params))
    params = _init_from_checkpoint(config.train.init_checkpoint, bert_config, fresh)
    logging.info('Initialized from %s', config.train.init_checkpoint)
    return state_lib.state_from_params(state_lib.put_sharded(params, state_shardings.params),
                                       tx, state_shardings)

  # A fresh init compiles (minutes for a large model on a pod): SIGTERM does not wait for it.
  start, state, meta = ckpt_lib.restore_or_init(manager, workdir, abstract,
                                                lambda: preemption.wait(init))
  preemption.check()
  # Only now, with the checkpoint found to match: a refused resume (another model size) leaves
  # the record of the run it refused to touch as it was.
  ckpt_lib.write_run_files(workdir, config.to_json_best_effort(indent=2), bert_config,
                           vocab_file)
  # Rows past the checkpoint are from a run that died after it: they are logged again.
  monitor.truncate_metrics(workdir, start)
  if start is not None and meta.get('seed') != config.train.seed:
    logging.warning('Resuming with train.seed=%s, the checkpoint used %s', config.train.seed,
                    meta.get('seed'))
  step = int(state.step)

  # ---- Steps ---------------------------------------------------------------------------------
  p_train_step, p_eval_step = built.train_step, built.eval_step
  batch_sharding = sharding_lib.batch_sharding(mesh)
  eval_local = config.eval.batch_size // jax.process_count()
  # Every phase this run trains, compiled before its first step: a compile of the next phase
  # thousands of steps in would not stop for SIGTERM (the notice is about 30 s).
  remaining = [p for p in phases if p.end > step and p.start < stop_at]

  def steps_to_compile():  # Lazy: the datasets are made on the compiling thread too.
    for phase in remaining:
      yield p_train_step.jitted, (abstract, _global_batch_spec(
          dataset_for(phase, True).element_spec, batch_sharding))
      yield p_eval_step, (abstract.params, _global_batch_spec(
          dataset_for(phase, False, eval_local).element_spec, batch_sharding))

  preemption.wait(lambda: state_lib.compile_ahead(
      steps_to_compile(), mesh, rules, f'the train and eval steps of {len(remaining)} phase(s)'))
  log = monitor.MetricsLog(workdir)

  def save(phase: pretraining.Phase, data_it) -> None:
    # The steps since the last log were not checked yet (the log checks its own): a diverged
    # step's weights never become the last good checkpoint.
    unchecked = jax.device_get(history) if history else []
    diverged = monitor.divergence(unchecked, step - len(unchecked) + 1)
    if diverged:
      raise UserError(f'{diverged}: stopping without saving it; {last_good()}. Lower '
                      'train.learning_rate or raise train.warmup_steps.')
    ckpt_lib.save(manager, workdir, step, state,
                  dict(seed=config.train.seed, data_phase=phase.index), data_it)

  def last_good() -> str:
    if last_saved is None:
      return f'no checkpoint was saved yet in {workdir}'
    return f'the last good checkpoint (step {last_saved}) is kept in {workdir}'

  # ---- Loop: phases of steps; log, checkpoint, evaluate, stop for preemption -----------------
  eval_metrics: dict[str, float] = {}
  bar = monitor.progress(stop_at, step, is_main and config.log.progress)
  chrono = monitor.Chrono(step)
  # The host stays one step ahead of the device: a stop (SIGTERM) waits for a step, not for
  # every step dispatched since the last log line; the bar and the rates count computed steps.
  in_flight = monitor.InFlight()
  history, last_saved, preempted = [], start, False
  first_step = step
  try:
    while step < stop_at and not preempted:
      phase = pretraining.phase_at(phases, step)
      data_it = training_input(phase, step)
      if step > 0 and meta.get('data_phase') == phase.index and start == step:
        if not ckpt_lib.restore_data_state(workdir, step, data_it):
          logging.warning('No input position saved for step %d: the data restarts', step)
      # Model FLOPs per real (non-padding) token: MFU counts only the tokens trained on, so
      # packed and padded runs compare honestly.
      flops_per_token = flops_lib.train_flops_per_sequence(
          bert_config, phase.seq_len, phase.max_predictions) / phase.seq_len
      first_in_segment = True
      while step < min(phase.end, stop_at) and not preempted:
        with chrono.waiting():
          # The run's first batch fills the shuffle buffer; nothing is trained yet, so SIGTERM
          # does not wait for it.
          local = (preemption.wait(lambda: next(data_it)) if step == first_step
                   else next(data_it))
        batch = sharding_lib.make_global_batch(local, batch_sharding)
        if step == first_step:
          with chrono.excluded():
            state_lib.wait_for_processes('the first step')
        if first_in_segment:  # It compiles: its time and the step are not throughput.
          jax.block_until_ready(state)  # Earlier steps are training time, not compile time.
          with chrono.excluded(steps=1):
            state, metrics = p_train_step(state, batch)
            jax.block_until_ready(metrics['loss'])
          first_in_segment = False
        else:
          state, metrics = p_train_step(state, batch)
        step += 1
        history.append(metrics)
        bar.update(in_flight.add(metrics))

        if step % config.log.every_steps == 0 or step == stop_at:
          bar.update(in_flight.drain())
          host_history = jax.device_get(history)
          diverged = monitor.divergence(host_history, step - len(history) + 1)
          if diverged:
            raise UserError(f'{diverged}: stopping; {last_good()}. Lower '
                            'train.learning_rate or raise train.warmup_steps.')
          summary = monitor.summarize(host_history)
          summary = _with_rates(summary, chrono.report(step), config, phase, flops_per_token,
                                learning_rate=float(schedule(step - 1)))
          log.train(step, summary)
          bar.set_postfix(loss=f'{summary["loss"]:.3f}',
                          mlm_acc=f'{summary["mlm_accuracy"]:.3f}')
          history = []

        preempted = preemption.stop_now(step, manager)
        if step % config.checkpoint.every_steps == 0 or step == stop_at or preempted:
          bar.update(in_flight.drain())
          jax.block_until_ready(state)
          with chrono.excluded():
            save(phase, data_it)
          last_saved = step
        # After the save: a failing or killed evaluation never costs the steps before it.
        if (step % config.eval.every_steps == 0 or step == stop_at) and not preempted:
          bar.update(in_flight.drain())
          jax.block_until_ready(state)
          with chrono.excluded():
            ckpt_lib.wait_for_saves(manager, workdir)
            evaluated = evaluate_params(config, phase, state.params, p_eval_step, mesh,
                                        rules, vocab_file, stop=lambda: preemption.requested)
          if evaluated is None:  # SIGTERM: the evaluation is dropped, the step is saved.
            preempted = True
            if last_saved != step:
              save(phase, data_it)
              last_saved = step
          else:
            eval_metrics = evaluated
            log.eval(step, eval_metrics, eval=True)
            logging.info('Step %d eval: %s', step, eval_metrics)
    if preempted:
      logging.warning('Stopped for preemption at step %d; rerun to resume.', step)
  finally:
    bar.close()
    ckpt_lib.wait_for_saves(manager, workdir)
    manager.close()
    log.close()

  if is_main:
    _print_summary(config, workdir, step, stop_at, start, eval_metrics)
  if preempted:
    raise preemption.stopped(step)
  return eval_metrics


def _print_summary(config: ml_collections.ConfigDict, workdir: str, step: int, stop_at: int,
                   start: int | None, eval_metrics: dict[str, float]) -> None:
  """Where the run's files are, and its last evaluation."""
  if eval_metrics:
    last_eval = json.dumps({k: round(v, 4) for k, v in eval_metrics.items()})
  elif start is not None and start >= stop_at:  # Resumed a run that had already finished.
    last_eval = (f'none in this run: the workdir was already at step {step} (see '
                 'metrics.jsonl; use another --workdir or raise train.steps to go on)')
  else:
    last_eval = f'none: stopped at step {step} before the first evaluation'
  print(f'\nbert_jax: step {step}/{config.train.steps} in {workdir}\n'
        f'  checkpoints:  {os.path.join(workdir, ckpt_lib.CHECKPOINT_DIR)}\n'
        f'  metrics:      {os.path.join(workdir, "metrics.jsonl")}\n'
        f'  TensorBoard:  tensorboard --logdir {workdir}\n'
        f'  last eval:    {last_eval}', flush=True)


def _check_phase_data(config: ml_collections.ConfigDict, phases: list[pretraining.Phase],
                      dataset_for: Callable) -> None:
  """Every phase's training and held-out data, checked before the first step: not when phase
  2 starts 900,000 steps in (TFRecords fix the sequence length) or at the first evaluation (the
  held-out set must give a batch)."""
  from bert_jax import documents  # pylint: disable=g-import-not-at-top  (TensorFlow)
  eval_local = config.eval.batch_size // jax.process_count()
  for phase in phases:
    data = pretraining.phase_data(config, phase)
    for train in (True, False):
      try:
        ds = dataset_for(phase, train) if train else dataset_for(phase, train, eval_local)
        if not train and not any(True for _ in ds.take(1)):
          source = 'data.eval_input' if data.eval_input else 'the held-out share of data.input'
          raise UserError(f'{source} gives no evaluation batch')
      except ValueError as e:
        raise UserError(
            f'train.phases phase {phase.index + 1} ({phase.seq_len} tokens, '
            f'{phase.max_predictions} predictions) cannot read its {"" if train else "eval "}'
            f'data: {e}' + ('. Give each phase records of its length with data.phase_inputs '
                            '(and data.phase_eval_inputs), separated by ";".'
                            if documents.input_kind(data.input) == 'tfrecord' else '')) from e


def _with_rates(summary: dict[str, float], timing: dict[str, float],
                config: ml_collections.ConfigDict, phase: pretraining.Phase, flops_per_token: float,
                learning_rate: float) -> dict[str, float]:
  """A log row: the steps' metrics, the learning rate and the rates of metrics.jsonl (rows,
  sequences, row slots and real tokens per second, input wait, MFU) from the Chrono's."""
  sps = timing['steps_per_second']
  rows_per_second = sps * config.train.batch_size
  real_tokens_per_second = summary.pop('real_tokens_per_row') * rows_per_second
  peak = flops_lib.peak_flops_per_device()
  summary.update(
      learning_rate=learning_rate, steps_per_second=sps,
      sequences_per_second=summary.pop('sequences_per_row') * rows_per_second,
      tokens_per_second=sps * config.train.batch_size * phase.seq_len,
      real_tokens_per_second=real_tokens_per_second,
      input_wait_fraction=timing['input_wait_fraction'],
      mfu=(flops_per_token * real_tokens_per_second / (peak * jax.device_count())
           if peak else None))
  return summary
