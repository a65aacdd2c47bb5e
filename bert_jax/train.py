"""BERT pre-training: one straight path from a config to a trained, checkpointed model.

`train_and_evaluate` is setup, then loop, inside the frame both drivers share (`run_frame`:
checks, lock, preemption, compilation cache; the loop's close). `_setup` runs, in order: mesh ->
data (each phase with its data block) -> model, optimizer, abstract init, shardings and steps
(`pretraining.build_step`, which `aot.py` and the benchmarks use too) -> init or restore ->
compiles, and returns one `_Run`, which holds what the loop reads of the config; `_train` is
the loop (log, checkpoint, evaluate on `run_frame.itstime`, stop for preemption), which
`monitor.Preemption` decides. The step functions are pure and live in `pretraining.py`.
"""

import dataclasses
import functools
import itertools
import json
import os
from typing import Any, Callable, Iterator

import jax
import ml_collections
import numpy as np
import optax
from absl import logging
from jax.experimental import multihost_utils

from bert_jax import checkpoint as ckpt_lib
from bert_jax import fileio
from bert_jax import flops as flops_lib
from bert_jax import hub
from bert_jax import model as model_lib
from bert_jax import monitor
from bert_jax import objectives
from bert_jax import pretraining
from bert_jax import publish
from bert_jax import run_files
from bert_jax import run_frame
from bert_jax import sharding as sharding_lib
from bert_jax import state_extras
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


def held_out_batches(ds, steps: int, started=None) -> list[dict[str, Any]]:
  """The first `steps` batches of `ds`, this process's share of the held-out data, as numpy
  (`eval_batches`: the same number on every process); a UserError when there is none.

  `started`: a numpy iterator of `ds` already begun (the input check's, `_check_phase_data`),
  its batches read so far chained before it: read on from there instead of from a new one.
  Evaluation's pass is deterministic, so it holds the batches a new iterator would."""
  batches = eval_batches(ds.as_numpy_iterator() if started is None else started, steps,
                         _empty_batch(ds.element_spec))
  if not batches:
    raise UserError('the evaluation data gave no batch: data.eval_input (or the held-out '
                    'share of data.input) is smaller than eval.batch_size')
  return batches


def evaluate_params(phase: pretraining.Phase, params: Any, p_eval_step: Callable,
                    mesh: jax.sharding.Mesh, rules, vocab_file: str, *, batch_size: int,
                    steps: int, check_nsp_share: bool = False,
                    stop: Callable[[], bool] = lambda: False,
                    batches: list[dict[str, Any]] | None = None) -> dict[str, float] | None:
  """MLM (and NSP) metrics of `params` on `steps` batches of `batch_size` (eval.*) of the
  phase's held-out data; None when `stop()` turns true between batches (SIGTERM: the notice is
  too short to finish).

  `batches`: those batches (this process's share, `held_out_batches`) as the caller read them
  already: a run's evaluations of a phase read the same batches, so it reads them once (each
  read made an iterator and ran the pipeline again: about 0.4 s of a CPU for the smoke
  config's). With check_nsp_share, NSP/SOP metrics of labels far from half NotNext are refused
  (`check_label_share`)."""
  from bert_jax import input_pipeline  # pylint: disable=g-import-not-at-top  (TensorFlow)
  sharding_lib.check_batch_size(batch_size, mesh, 'eval.batch_size')
  if batches is None:
    batches = held_out_batches(input_pipeline.make_pretraining_dataset(
        phase.data, batch_size=batch_size // jax.process_count(), seq_len=phase.seq_len,
        max_predictions=phase.max_predictions, train=False, process_index=jax.process_index(),
        process_count=jax.process_count(), vocab_file=vocab_file), steps)
  if check_nsp_share:
    check_label_share(batches, phase.data)
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
  """MLM and NSP metrics of any checkpoint `pretrained.load_pretrained` reads, on the held-out
  data of `config` (eval.steps batches of eval.batch_size), without training.

  The vocabulary is data.vocab_file or else the checkpoint's vocab.txt. Given a pre-training
  workdir and that run's config, the numbers are those of the run's last evaluation (the same
  data, phase and batches). A checkpoint without an NSP head (BertForMaskedLM) gets MLM only.
  """
  from bert_jax import input_pipeline  # pylint: disable=g-import-not-at-top  (TensorFlow)
  from bert_jax import pretrained  # pylint: disable=g-import-not-at-top
  fileio.hide_accelerators_from_tf()
  mesh = sharding_lib.make_mesh(config.mesh)
  rules = sharding_lib.rules_from_config(config.mesh)
  local = hub.checkpoint_folder(checkpoint, '--checkpoint')  # hf://ORG/NAME: from the Hub.
  pretrained.check_casing(local, config.data.lower_case, '--checkpoint')
  loaded_config, params = pretrained.load_pretrained(local, scan_layers=config.model.scan_layers)
  vocab_file = config.data.vocab_file or pretrained.find_vocab(local)
  if not vocab_file:
    raise UserError(f'--checkpoint={checkpoint} has no vocab.txt next to it: set '
                    '--config.data.vocab_file')
  from bert_jax import tokenization  # pylint: disable=g-import-not-at-top  (TensorFlow)
  pretrained.check_vocab(checkpoint, vocab_file,
                         tokenization.load_tokenizer(vocab_file, config.data.lower_case).vocab,
                         loaded_config, '--checkpoint', 'data.vocab_file')
  if 'mlm' not in params:
    raise UserError(f'--checkpoint={checkpoint} has no MLM head (cls.predictions): a '
                    'fine-tuned model has no pre-training metrics')
  bert_config = model_lib.config_from(config.model, checkpoint=loaded_config)
  # A checkpoint without the sentence head (BertForMaskedLM) is scored on MLM alone.
  objective = config.data.objective if 'nsp' in params else 'none'
  params = model_lib.with_nsp_head(params, bert_config.hidden_size)  # Not reported without.
  # The phase of the last step: a workdir's latest checkpoint, else where the run would end.
  phases = pretraining.parse_phases(config)
  steps = run_files.checkpoint_steps(local) if fileio.isdir(local) else []
  last = steps[-1] if steps else (int(config.train.stop_at_step) or int(config.train.steps))
  phase = pretraining.phase_at(phases, last - 1)
  model = model_lib.BertForPreTraining(bert_config, padded_vocab=True)
  _, shardings, _ = pretraining.abstract_state_and_shardings(model, optax.identity(), mesh,
                                                             rules)
  params = state_lib.put_sharded({k: params[k] for k in shardings.params},
                                 shardings.params)
  p_eval_step = jax.jit(functools.partial(pretraining.eval_step, model=model,
                                          objective=objective),
                        in_shardings=(shardings.params, sharding_lib.batch_sharding(mesh)))
  metrics = evaluate_params(phase, params, p_eval_step, mesh, rules, vocab_file,
                            batch_size=config.eval.batch_size, steps=config.eval.steps,
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
  from bert_jax import pretrained  # Pulls in TF checkpoint reading only when needed.
  cfg, loaded = pretrained.load_pretrained(path, scan_layers=bert_config.scan_layers)
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
  with run_frame.entered(config, workdir, 'pretrain') as (workdir, preemption):
    return _train(_setup(config, workdir, preemption), preemption)


@dataclasses.dataclass(kw_only=True)
class _Run:
  """One pre-training run as `_setup` makes it, ready for its first step, with what the loop
  reads of the config decoded; the loop advances `state`, `step` and `last_saved`."""
  workdir: str
  phases: list[pretraining.Phase]
  mesh: jax.sharding.Mesh
  rules: Any
  batch_sharding: jax.sharding.NamedSharding
  vocab_file: str
  # (phase, train, batch_size=local batch, seed=None) -> this process's tf.data dataset, each
  # built once.
  dataset_for: Callable[..., Any]
  # The phase the run starts in -> the input check's iterator of its held-out batches (the first
  # batch chained back before it), for the phase's first read of them: taken (popped) by it,
  # or dropped when the phase ends without one.
  held_out_started: dict[int, Iterator[dict[str, Any]]]
  fingerprints: dict[int, dict[str, Any]]  # Phase index -> its training input's fingerprint.
  built: pretraining.Step  # Model, optimizer, schedule, abstract state, jitted steps.
  manager: Any  # Orbax's CheckpointManager.
  log: monitor.MetricsLog
  pusher: publish.Pusher | None  # checkpoint.push_to_hub's (process 0).
  batch_size: int  # train.batch_size, the global batch.
  seed: int  # train.seed, kept in every checkpoint's meta.
  steps: int  # train.steps, where the schedule ends.
  stop_at: int  # train.stop_at_step, else train.steps.
  log_every: int  # log.every_steps
  checkpoint_every: int  # checkpoint.every_steps
  eval_every: int  # eval.every_steps
  eval_batch_size: int  # eval.batch_size
  eval_steps: int  # eval.steps
  progress: bool  # log.progress: a progress bar (process 0).
  start: int | None  # The step restored from; None for a fresh run.
  meta: dict[str, Any]  # The restored checkpoint's.
  state: state_lib.TrainState
  step: int
  last_saved: int | None

  @property
  def is_main(self) -> bool:
    return jax.process_index() == 0


def _dataset(vocab_file: str, train_batch_size: int, phase: pretraining.Phase, train: bool,
             batch_size: int | None = None, seed: int | None = None):
  """This process's share of the phase's training or held-out data, in batches of
  `batch_size` (default: its share of `train_batch_size`, train.batch_size)."""
  from bert_jax import input_pipeline  # pylint: disable=g-import-not-at-top  (TensorFlow)
  return input_pipeline.make_pretraining_dataset(
      phase.data, batch_size=batch_size or train_batch_size // jax.process_count(),
      seq_len=phase.seq_len, max_predictions=phase.max_predictions, train=train,
      process_index=jax.process_index(), process_count=jax.process_count(), seed=seed,
      vocab_file=vocab_file)


def _check_resumed_vocab(workdir: str, vocab_file: str, tokens: list[str]) -> None:
  """Refuses to resume a workdir's checkpoints with another vocabulary than its vocab.txt, the
  one they were trained with: of the same size it would train on silently, each embedding row
  now another token's, and replace the record of what made the checkpoints."""
  recorded = os.path.join(workdir, 'vocab.txt')
  if not (fileio.exists(recorded) and run_files.checkpoint_steps(workdir)):
    return
  from bert_jax import pretrained  # pylint: disable=g-import-not-at-top
  differs = pretrained.vocab_differs(recorded, vocab_file, tokens)
  if differs is not None:
    raise UserError(f'data.vocab_file={vocab_file} is not the vocabulary the checkpoints of '
                    f'--workdir={workdir} were trained with ({differs}): resume with '
                    f'--config.data.vocab_file={recorded}, or pre-train into another --workdir')


def _setup(config: ml_collections.ConfigDict, workdir: str,
           preemption: monitor.Preemption) -> _Run:
  """Mesh, data (checked for every phase), model and steps, state (restored or initialized),
  every phase's steps compiled, run files and metrics log."""
  from bert_jax import documents  # pylint: disable=g-import-not-at-top  (TensorFlow)
  from bert_jax import input_pipeline  # pylint: disable=g-import-not-at-top
  from bert_jax import tokenization  # pylint: disable=g-import-not-at-top
  stop_at = int(config.train.stop_at_step) or int(config.train.steps)  # In range (config_checks).
  batch_size, eval_batch_size = int(config.train.batch_size), int(config.eval.batch_size)
  seed, init_checkpoint = int(config.train.seed), config.train.init_checkpoint

  # ---- Mesh ----------------------------------------------------------------------------------
  mesh = sharding_lib.make_mesh(config.mesh)
  rules = sharding_lib.rules_from_config(config.mesh)
  pretraining.check_batch(config, mesh)
  # Evaluation runs thousands of steps in: its settings are checked now.
  sharding_lib.check_batch_size(eval_batch_size, mesh, 'eval.batch_size')
  logging.info('Mesh %s on %d devices, %d processes', dict(mesh.shape), jax.device_count(),
               jax.process_count())

  # ---- Data ----------------------------------------------------------------------------------
  phases = pretraining.parse_phases(config)
  pretraining.check_attention(config, jax.default_backend())
  for phase in phases:
    input_pipeline.check_vocab_given(phase.data, f'phase {phase.index + 1} reads ')
  written = [os.path.join(workdir, name) for name in run_files.RUN_FILES]
  for phase in phases:
    for key in ('input', 'eval_input'):
      if phase.data[key]:
        documents.check_not_matched(phase.data[key], f'data.{key}', written)
  # A vocab trained here comes from the first phase's input.
  fileio.check_bucket(init_checkpoint, 'train.init_checkpoint')  # Not at init.
  if init_checkpoint:
    from bert_jax import pretrained  # pylint: disable=g-import-not-at-top
    if fileio.same_path(init_checkpoint, workdir):
      raise UserError(f'train.init_checkpoint={init_checkpoint} is the --workdir itself: a run '
                      'resumes from its own workdir anyway; start from it in another --workdir')
    pretrained.check_casing(init_checkpoint, config.data.lower_case, 'train.init_checkpoint')
  if init_checkpoint and not config.data.vocab_file:
    # The checkpoint's embeddings are its vocabulary's: one trained here would not fit them.
    vocab_file = pretrained.find_vocab(init_checkpoint)
    if not vocab_file:
      raise UserError(f'train.init_checkpoint={init_checkpoint} has no vocab.txt beside it: set '
                      'data.vocab_file to the vocabulary it was trained with')
  else:
    vocab_file = input_pipeline.resolve_vocab(phases[0].data, workdir)
  tokenizer = tokenization.load_tokenizer(vocab_file, lower_case=config.data.lower_case)
  _check_resumed_vocab(workdir, vocab_file, tokenizer.vocab)
  # A build traces the pipeline's TensorFlow functions (seconds on a CPU, in every run), so each
  # dataset is built once: the check's give the compiles their shapes, each phase's training
  # input its first stream (iterated once: its shuffles draw anew with each iteration) and the
  # phase's evaluations their batches (the same each time, read once: `_train`).
  built_datasets = functools.cache(functools.partial(_dataset, vocab_file, batch_size))
  # Positional, so that a call with seed=None and one without find the same build.
  dataset_for = lambda phase, train, batch_size=None, seed=None: built_datasets(
      phase, train, batch_size, seed)
  logging.info('Checking the input of %d phase(s)', len(phases))
  held_out_started = _check_phase_data(phases, dataset_for,
                                       eval_batch_size // jax.process_count())
  # What a saved input position is valid for, taken as the training streams were built: their
  # files as listed then, not at a phase's start thousands of steps on.
  fingerprints = {
      phase.index: input_pipeline.input_fingerprint(
          phase.data, batch_size=batch_size // jax.process_count(), seq_len=phase.seq_len,
          max_predictions=phase.max_predictions, process_count=jax.process_count())
      for phase in phases}
  preemption.check()

  # ---- Model, optimizer, abstract init and shardings, steps (nothing allocated yet) ----------
  built = pretraining.build_step(config, mesh, tokenizer.vocab_size)
  n_params = model_lib.count_params(built.abstract.params)
  logging.info('Model %s: %s parameters, dtype %s', config.model.size, f'{n_params:,}',
               built.bert_config.dtype)

  # ---- Init or restore -----------------------------------------------------------------------
  manager = ckpt_lib.make_manager(workdir, config.checkpoint.keep,
                                  extras=state_extras.saved_names())
  # A fresh init compiles (minutes for a large model on a pod): SIGTERM does not wait for it.
  start, state, meta = ckpt_lib.restore_or_init(
      manager, workdir, built.abstract,
      lambda: preemption.wait(lambda: _init(built, seed, init_checkpoint)))
  preemption.check()
  # Only now, with the checkpoint found to match: a refused resume (another model size) leaves
  # the record of the run it refused to touch as it was.
  run_files.write_run_files(workdir, config.to_json_best_effort(indent=2), built.bert_config,
                            vocab_file)
  # Rows past the checkpoint are from a run that died after it: they are logged again.
  monitor.truncate_metrics(workdir, start)
  if start is not None and meta.get('seed') != seed:
    logging.warning('Resuming with train.seed=%s, the checkpoint used %s', seed,
                    meta.get('seed'))
  step = int(state.step)

  # ---- Every phase this run trains, compiled before its first step ---------------------------
  # A compile of the next phase thousands of steps in would not stop for SIGTERM (the notice
  # is about 30 s).
  batch_sharding = sharding_lib.batch_sharding(mesh)
  eval_local = eval_batch_size // jax.process_count()
  remaining = [p for p in phases if p.end > step and p.start < stop_at]
  # Only the phase the run starts in keeps its check's held-out iterator open (its prefetch
  # buffers and threads): a later phase's evaluations may be days away; one behind the restored
  # step has none left in this run.
  first_phase = pretraining.phase_at(phases, step).index
  held_out_started = {i: it for i, it in held_out_started.items()
                      if i == first_phase and step < stop_at}

  def steps_to_compile():  # Lazy: a phase's shapes are read on the compiling thread.
    for phase in remaining:
      yield built.train_step.jitted, (built.abstract, _global_batch_spec(
          dataset_for(phase, True).element_spec, batch_sharding))
      yield built.eval_step, (built.abstract.params, _global_batch_spec(
          dataset_for(phase, False, eval_local).element_spec, batch_sharding))

  preemption.wait(lambda: state_lib.compile_ahead(
      steps_to_compile(), mesh, rules, f'the train and eval steps of {len(remaining)} phase(s)'))
  return _Run(workdir=workdir, phases=phases, mesh=mesh, rules=rules,
              batch_sharding=batch_sharding, vocab_file=vocab_file, dataset_for=dataset_for,
              held_out_started=held_out_started, fingerprints=fingerprints,
              built=built, manager=manager, log=monitor.MetricsLog(workdir, config),
              pusher=publish.make_pusher(config, workdir),
              batch_size=batch_size, seed=seed, steps=int(config.train.steps), stop_at=stop_at,
              log_every=int(config.log.every_steps),
              checkpoint_every=int(config.checkpoint.every_steps),
              eval_every=int(config.eval.every_steps), eval_batch_size=eval_batch_size,
              eval_steps=int(config.eval.steps), progress=bool(config.log.progress),
              start=start, meta=meta, state=state, step=step, last_saved=start)


def _init(built: pretraining.Step, seed: int, init_checkpoint: str) -> state_lib.TrainState:
  """A fresh state; with `init_checkpoint` (train.init_checkpoint), its weights (and fresh
  heads it lacks)."""
  state = jax.jit(built.init, out_shardings=built.shardings)(jax.random.key(seed))
  if not init_checkpoint:
    return state
  # Host copies of the fresh parameters (heads the checkpoint lacks come from them); with
  # fsdp or tensor axes across hosts no process holds every shard, so gather them.
  fresh = (multihost_utils.process_allgather(state.params, tiled=True)
           if jax.process_count() > 1 else jax.tree.map(np.asarray, state.params))
  params = _init_from_checkpoint(init_checkpoint, built.bert_config, fresh)
  logging.info('Initialized from %s', init_checkpoint)
  return state_lib.state_from_params(state_lib.put_sharded(params, built.shardings.params),
                                     built.tx, built.abstract)


# ---------------------------------------------------------------------------------------------
# The loop
# ---------------------------------------------------------------------------------------------


def _train(run: _Run, preemption: monitor.Preemption) -> dict[str, float]:
  """Phases of steps; log, checkpoint, evaluate, stop for preemption. The last evaluation's
  metrics."""
  steps = monitor.Steps(run.step, run.stop_at, run.is_main and run.progress)
  eval_metrics: dict[str, float] = {}
  first_step = run.step
  with run_frame.closing(steps, run.manager, run.workdir, run.log, run.pusher, preemption):
    while run.step < run.stop_at and not preemption.stopping:
      phase = pretraining.phase_at(run.phases, run.step)
      # Every evaluation of the phase reads the same batches: read at its first, kept until the
      # phase ends (eval.steps batches of this process's share, as an evaluation held them
      # before: 100 x 256 rows of 512 tokens are about 180 MB).
      held_out = functools.cache(lambda phase=phase: held_out_batches(
          run.dataset_for(phase, False, run.eval_batch_size // jax.process_count()),
          run.eval_steps, run.held_out_started.pop(phase.index, None)))
      data_it = _training_input(run, phase)
      if (run.step > 0 and run.meta.get('data_phase') == phase.index
          and run.start == run.step):
        if not ckpt_lib.restore_data_state(run.workdir, run.step, data_it):
          logging.warning('No input position saved for step %d: the data restarts', run.step)
      # Model FLOPs per real (non-padding) token: MFU counts only the tokens trained on, so
      # packed and padded runs compare honestly.
      flops_per_token = flops_lib.train_flops_per_sequence(
          run.built.bert_config, phase.seq_len, phase.max_predictions) / phase.seq_len
      first_in_segment = True
      while run.step < min(phase.end, run.stop_at) and not preemption.stopping:
        with steps.chrono.waiting():
          # The run's first batch fills the shuffle buffer; nothing is trained yet, so SIGTERM
          # does not wait for it.
          local = (preemption.wait(lambda: next(data_it)) if run.step == first_step
                   else next(data_it))
        batch = sharding_lib.make_global_batch(local, run.batch_sharding)
        if run.step == first_step:
          with steps.chrono.excluded():
            state_lib.wait_for_processes('the first step')
        if first_in_segment:  # It compiles: its time and the step are not throughput.
          jax.block_until_ready(run.state)  # Earlier steps are training time, not compile time.
          with steps.chrono.excluded(steps=1):
            run.state, metrics = run.built.train_step(run.state, batch)
            jax.block_until_ready(metrics['loss'])
          first_in_segment = False
        else:
          run.state, metrics = run.built.train_step(run.state, batch)
        run.step += 1
        steps.add(metrics)

        if run_frame.itstime(run.step, run.log_every, run.stop_at):
          summary = _with_rates(steps.summary(run.step, _divergence_advice(run)),
                                steps.chrono.report(run.step), run.batch_size, flops_per_token,
                                learning_rate=float(run.built.schedule(run.step - 1)))
          run.log.train(run.step, summary)
          steps.bar.set_postfix(loss=f'{summary["loss"]:.3f}',
                                mlm_acc=f'{summary["mlm_accuracy"]:.3f}')
          # A save that failed meanwhile (Cloud Storage past the retries) ends the run now,
          # not at the next save.
          ckpt_lib.check_saves(run.manager, run.workdir)
        preemption.stop_now(run.step, run.manager)
        if run_frame.itstime(run.step, run.checkpoint_every, run.stop_at) or preemption.stopping:
          steps.drain()
          jax.block_until_ready(run.state)
          with steps.chrono.excluded():
            _save(run, steps, phase, data_it)
        # After the save: a failing or killed evaluation never costs the steps before it.
        if run_frame.itstime(run.step, run.eval_every, run.stop_at) and not preemption.stopping:
          eval_metrics = _evaluate(run, steps, preemption, phase, data_it,
                                   held_out) or eval_metrics
      run.held_out_started.pop(phase.index, None)  # Closed, if the phase ended unevaluated.
    if preemption.stopping:
      logging.warning('Stopped for preemption at step %d; rerun to resume.', run.step)

  if run.is_main:
    _print_summary(run, eval_metrics)
  if preemption.stopping:
    raise preemption.stopped(run.step)
  return eval_metrics


def _training_input(run: _Run, phase: pretraining.Phase):
  """The phase's training input (`input_pipeline.TrainingInput`) from `run.step`; a saved
  position is restored only where it fits."""
  from bert_jax import input_pipeline  # pylint: disable=g-import-not-at-top  (TensorFlow)
  return input_pipeline.TrainingInput(lambda seed: run.dataset_for(phase, True, seed=seed),
                                      run.fingerprints[phase.index], run.step,
                                      int(phase.data.seed))


def _save(run: _Run, steps: monitor.Steps, phase: pretraining.Phase, data_it) -> None:
  """Saves the state at `run.step` with the input's position."""
  # The steps since the last log were not checked yet (the log checks its own): a diverged
  # step's weights never become the last good checkpoint.
  steps.check(run.step, _divergence_advice(run), saving=True)
  ckpt_lib.save(run.manager, run.workdir, run.step, run.state,
                dict(seed=run.seed, data_phase=phase.index), data_it)
  run.last_saved = run.step
  if run.pusher:  # In the background, once the save is committed.
    run.pusher.saved(run.step, last=run.step == run.stop_at)


def _evaluate(run: _Run, steps: monitor.Steps, preemption: monitor.Preemption,
              phase: pretraining.Phase, data_it,
              held_out: Callable[[], list[dict[str, Any]]]) -> dict[str, float] | None:
  """Evaluates the state at `run.step` on the phase's `held_out()` batches and logs it; None
  when SIGTERM cut the evaluation short (`cut_short`): it is dropped, the step saved, and the
  loop stops."""
  steps.drain()
  jax.block_until_ready(run.state)
  with steps.chrono.excluded():
    ckpt_lib.wait_for_saves(run.manager, run.workdir)
    evaluated = evaluate_params(phase, run.state.params, run.built.eval_step, run.mesh,
                                run.rules, run.vocab_file, batch_size=run.eval_batch_size,
                                steps=run.eval_steps, stop=preemption.cut_short,
                                batches=held_out())
  if evaluated is None:
    if run.last_saved != run.step:
      _save(run, steps, phase, data_it)
    return None
  run.log.eval(run.step, evaluated, eval=True)
  logging.info('Step %d eval: %s', run.step, evaluated)
  return evaluated


def _divergence_advice(run: _Run) -> str:
  """What a diverged step's error says about the checkpoints and the fix."""
  if run.last_saved is None:
    kept = f'no checkpoint was saved yet in {run.workdir}'
  else:
    kept = f'the last good checkpoint (step {run.last_saved}) is kept in {run.workdir}'
  return f'{kept}. Lower train.learning_rate or raise train.warmup_steps.'


def _print_summary(run: _Run, eval_metrics: dict[str, float]) -> None:
  """Where the run's files are, and its last evaluation."""
  if eval_metrics:
    last_eval = json.dumps({k: round(v, 4) for k, v in eval_metrics.items()})
  elif run.start is not None and run.start >= run.stop_at:  # Resumed a finished run.
    last_eval = (f'none in this run: the workdir was already at step {run.step} (see '
                 'metrics.jsonl; use another --workdir or raise train.steps to go on)')
  else:
    last_eval = f'none: stopped at step {run.step} before the first evaluation'
  print(f'\nbert_jax: step {run.step}/{run.steps} in {run.workdir}\n'
        f'  checkpoints:  {os.path.join(run.workdir, ckpt_lib.CHECKPOINT_DIR)}\n'
        f'  metrics:      {os.path.join(run.workdir, "metrics.jsonl")}\n'
        f'  TensorBoard:  tensorboard --logdir {run.workdir}\n'
        f'  last eval:    {last_eval}', flush=True)


def _check_phase_data(phases: list[pretraining.Phase], dataset_for: Callable,
                      eval_local: int) -> dict[int, Iterator[dict[str, Any]]]:
  """Every phase's training and held-out data (in batches of `eval_local`, this process's
  share of eval.batch_size), checked before the first step: not when phase 2 starts 900,000
  steps in (TFRecords fix the sequence length) or at the first evaluation (the held-out set
  must give a batch).

  Returns each phase's held-out iterator as the check left it (its first batch chained back
  before it), for the first read of that phase's evaluation batches (`_setup` keeps the one of
  the phase the run starts in): a new iterator instantiates the pipeline's functions again,
  about a second of a CPU for a tiny run's."""
  from bert_jax import documents  # pylint: disable=g-import-not-at-top  (TensorFlow)
  started = {}
  for phase in phases:
    for train in (True, False):
      try:
        ds = dataset_for(phase, train) if train else dataset_for(phase, train, eval_local)
        if train:
          continue
        it = ds.as_numpy_iterator()
        first = next(it, None)
        if first is None:
          source = ('data.eval_input' if phase.data.eval_input
                    else 'the held-out share of data.input')
          raise UserError(f'{source} gives no evaluation batch')
        started[phase.index] = itertools.chain([first], it)
      except ValueError as e:
        raise UserError(
            f'train.phases phase {phase.index + 1} ({phase.seq_len} tokens, '
            f'{phase.max_predictions} predictions) cannot read its {"" if train else "eval "}'
            f'data: {e}' + ('. Give each phase records of its length with data.phase_inputs '
                            '(and data.phase_eval_inputs), separated by ";".'
                            if documents.input_kind(phase.data.input) == 'tfrecord' else '')
        ) from e
  return started


def _with_rates(summary: dict[str, float], timing: dict[str, float], batch_size: int,
                flops_per_token: float, learning_rate: float) -> dict[str, float]:
  """A log row: the steps' metrics, the learning rate, the rates of every run
  (`monitor.with_rates`, of global batches of `batch_size`), the input wait and MFU."""
  summary['learning_rate'] = learning_rate
  summary = monitor.with_rates(summary, timing['steps_per_second'], batch_size)
  peak = flops_lib.peak_flops_per_device()
  summary.update(
      input_wait_fraction=timing['input_wait_fraction'],
      mfu=(flops_per_token * summary['real_tokens_per_second'] / (peak * jax.device_count())
           if peak else None))
  return summary
