"""Pre-training's library: its config decoding, pure steps and the setup of its train step.

`train.py` (the driver), `aot.py` (the same step compiled for a TPU slice or GPUs) and the
benchmarks build the step one way, `build_step(config, mesh, vocab_size)`: the model config,
the model, the optimizer, the abstract state with its shardings (nothing allocated), and the
jitted train and eval steps. The steps are pure and module-level (`train_step`, `eval_step`);
`train_state.py` holds the one optimizer step they share with fine-tuning.
"""

import dataclasses
import functools
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import optax

from bert_jax import attention
from bert_jax import config_checks
from bert_jax import model as model_lib
from bert_jax import objectives
from bert_jax import optim
from bert_jax import sharding as sharding_lib
from bert_jax import train_state as state_lib


@dataclasses.dataclass(frozen=True)
class Phase:
  """Steps [start, end) run at one sequence length and number of predictions, on `data`."""
  index: int
  start: int
  end: int
  seq_len: int
  max_predictions: int
  # config.data with the phase's own inputs, where data.phase_inputs / phase_eval_inputs name
  # them (TFRecords of create_pretraining_data.py hold one sequence length each).
  data: ml_collections.ConfigDict = dataclasses.field(compare=False, hash=False, repr=False,
                                                      default=None)


# ---------------------------------------------------------------------------------------------
# Config decoding
# ---------------------------------------------------------------------------------------------


def parse_phases(config: ml_collections.ConfigDict) -> list[Phase]:
  """`train.phases` ('0.9:128:20,0.1:512:80') -> Phases covering [0, train.steps), each with
  its data block."""
  steps = int(config.train.steps)
  parts = config_checks.phase_specs(config)  # Checked where the config was loaded, too.
  if not parts:
    # train.phases is empty: the run uses data.max_seq_length (checked against the model's
    # positions with the config, config_checks._lengths).
    parts = [(1.0, config.data.max_seq_length, config.data.max_predictions_per_seq)]
  inputs = _per_phase(config.data.phase_inputs, len(parts))
  eval_inputs = _per_phase(config.data.phase_eval_inputs, len(parts))
  phases, start, cumulative = [], 0, 0.0
  for i, (frac, seq_len, preds) in enumerate(parts):
    cumulative += frac
    # Rounded where each phase ends, not by length, so that no phase overshoots the schedule.
    end = steps if i == len(parts) - 1 else max(start, int(round(cumulative * steps)))
    data = config.data.copy_and_resolve_references()
    if inputs[i]:
      data.input = inputs[i]
    if eval_inputs[i]:
      data.eval_input = eval_inputs[i]
    phases.append(Phase(i, start, end, seq_len, preds, data))
    start = end
  return [p for p in phases if p.end > p.start]


def _per_phase(spec: str, phases: int) -> list[str]:
  """data.phase_inputs or phase_eval_inputs ('a;b', one entry per train.phases entry; ''
  entries = the default input) as one entry per phase."""
  spec = spec.strip()
  if not spec:
    return [''] * phases
  # One entry per phase: checked with the config (config_checks._phases).
  return [e.strip() for e in spec.split(';')]


def phase_at(phases: list[Phase], step: int) -> Phase:
  for p in phases:
    if p.start <= step < p.end:
      return p
  return phases[-1]


# ---------------------------------------------------------------------------------------------
# Pure steps
# ---------------------------------------------------------------------------------------------


# Inputs of packed rows (data.packing, `packing.py`) that the model takes besides the usual.
PACKED_INPUTS = ('position_ids', 'sequence_ids', 'next_sentence_positions')


def apply_model(model: nn.Module, variables: dict[str, Any], batch: dict[str, jax.Array],
                **kwargs):
  """BertForPreTraining on a batch of rows, packed or not: applied to `variables` (a training
  step's `train_state.model_variables`, or {'params': params})."""
  packed = {k: batch[k] for k in PACKED_INPUTS if k in batch}
  return model.apply(variables, batch['input_ids'], batch['input_mask'], batch['segment_ids'],
                     batch['masked_lm_positions'], **packed, **kwargs)


def pretraining_apply(model: nn.Module) -> state_lib.Apply:
  """BertForPreTraining in training mode (dropout on): (MLM logits, sentence logits)."""
  return lambda variables, batch, rng: apply_model(model, variables, batch,
                                                   deterministic=False, rngs={'dropout': rng})


def pretraining_loss(objective: objectives.Objective) -> state_lib.Loss:
  """The objective's loss (`objectives.loss`), with the counts of the rates in metrics.jsonl
  (`train_state.with_rate_counts`)."""
  return state_lib.with_rate_counts(functools.partial(objectives.loss, objective), rate_counts)


def rate_counts(batch: dict[str, jax.Array]) -> tuple[jax.Array, jax.Array]:
  """(sequences, real tokens) of a batch: its rows, or with packed rows their sequences (at
  least 1), and its non-padding tokens."""
  real_tokens = jnp.sum(batch['input_mask'].astype(jnp.float32))
  if 'next_sentence_weights' in batch:
    return (jnp.maximum(jnp.sum(batch['next_sentence_weights'].astype(jnp.float32)), 1.0),
            real_tokens)
  return jnp.asarray(batch['input_ids'].shape[0], jnp.float32), real_tokens


def train_step(state: state_lib.TrainState, batch: dict[str, jax.Array], *, model: nn.Module,
               tx: optax.GradientTransformation, base_rng: jax.Array, accum_steps: int,
               objective: str) -> tuple[state_lib.TrainState, dict[str, Any]]:
  """One pre-training optimizer step over the global batch (`train_state.step` with the
  objective's loss)."""
  return state_lib.step(state, batch, apply=pretraining_apply(model),
                        loss=pretraining_loss(objectives.get(objective)), tx=tx,
                        base_rng=base_rng, accum_steps=accum_steps)


def build_train_step(model, tx, mesh, rules, state_shardings, base_rng, accum_steps,
                     objective: str):
  """The jitted, sharded, state-donating pre-training step (`train_state.jit_step`)."""
  return state_lib.jit_step(pretraining_apply(model),
                            pretraining_loss(objectives.get(objective)), tx, mesh, rules,
                            state_shardings, base_rng, accum_steps)


def eval_step(params: Any, batch: dict[str, jax.Array], *, model: nn.Module,
              objective: str) -> dict[str, Any]:
  """The objective's metrics ((sum, count) pairs) of a held-out batch, dropout off."""
  outputs = apply_model(model, {'params': params}, batch, deterministic=True)
  _, _, metrics = objectives.loss(objectives.get(objective), outputs, batch)
  return metrics


# ---------------------------------------------------------------------------------------------
# The train step, set up
# ---------------------------------------------------------------------------------------------


def abstract_state_and_shardings(model: nn.Module, tx: optax.GradientTransformation,
                                 mesh: jax.sharding.Mesh, rules, seq_len: int = 8):
  """(abstract TrainState, its NamedShardings, init function) without allocating anything."""
  ids = jnp.zeros((1, seq_len), jnp.int32)
  return state_lib.abstract_state(
      lambda rng: model.init({'params': rng}, ids, ids, ids, jnp.zeros((1, 1), jnp.int32),
                             deterministic=True), tx, mesh, rules)


def check_attention(config: ml_collections.ConfigDict, platform: str) -> None:
  """Clear errors for a model.attention_impl that cannot train on `platform` as configured."""
  attention.check_config(config.model.attention_impl,
                         config.model.attention_probs_dropout_prob, platform,
                         [p.seq_len for p in parse_phases(config)])


def check_batch(config: ml_collections.ConfigDict, mesh: jax.sharding.Mesh) -> None:
  """Clear errors for a global batch or micro-batch that does not split over the mesh."""
  sharding_lib.check_batch_size(config.train.batch_size, mesh)
  state_lib.check_accumulation(config.train.batch_size, config.train.grad_accum_steps, mesh)


@dataclasses.dataclass(frozen=True)
class Step:
  """Everything `build_step` sets up for pre-training steps on a mesh; nothing is allocated."""
  bert_config: model_lib.BertConfig
  model: model_lib.BertForPreTraining
  tx: optax.GradientTransformation
  schedule: optax.Schedule
  abstract: state_lib.TrainState  # ShapeDtypeStructs with their shardings.
  shardings: state_lib.TrainState  # NamedShardings of every leaf of the state.
  init: Callable[[jax.Array], state_lib.TrainState]  # rng -> fresh state (jit it with them).
  train_step: Any  # `build_train_step`'s: (state, batch) -> (state, metrics), state donated.
  eval_step: Callable  # Jitted (params, batch) -> the objective's metrics, dropout off.


def build_step(config: ml_collections.ConfigDict, mesh: jax.sharding.Mesh,
               vocab_size: int) -> Step:
  """The model, optimizer, abstract state, shardings and jitted steps that `config` describes
  on `mesh`, for a vocabulary of `vocab_size` tokens (`model.vocab_size`, when set, wins)."""
  rules = sharding_lib.rules_from_config(config.mesh)
  objective = objectives.get(config.data.objective).name
  bert_config = model_lib.config_from(config.model, vocab_size=vocab_size)
  # The loss reads the MLM logits over the decoder's padded vocabulary (model.MlmHead).
  model = model_lib.BertForPreTraining(bert_config, padded_vocab=True)
  tx, schedule = optim.make_optimizer(config.train)
  abstract, shardings, init = abstract_state_and_shardings(model, tx, mesh, rules)
  train_step_ = build_train_step(model, tx, mesh, rules, shardings,
                                 state_lib.dropout_rng(config.train, mesh),
                                 config.train.grad_accum_steps, objective)
  eval_step_ = jax.jit(functools.partial(eval_step, model=model, objective=objective),
                       in_shardings=(shardings.params, sharding_lib.batch_sharding(mesh)))
  return Step(bert_config, model, tx, schedule, abstract, shardings, init, train_step_,
              eval_step_)
