"""Learning-rate schedules and optimizers: AdamW (the paper) and LAMB (large batches)."""

import jax
import jax.numpy as jnp
import ml_collections
import optax

from bert_jax import config_checks

# Parameters that are never weight-decayed: LayerNorm scale/bias and every bias, as in BERT.
_NO_DECAY = ('bias', 'scale', 'output_bias')


def make_schedule(train: ml_collections.ConfigDict, total_steps: int | None = None,
                  warmup_steps: int | None = None) -> optax.Schedule:
  """Linear warmup from 0 to the peak over `warmup_steps`, then linear decay to 0 at the end.

  As the paper states it: the peak is reached exactly at `warmup_steps` (1e-4 at step 10,000 of
  BERT-base) and the rate is 0 at `total_steps` (1,000,000). `total_steps` and `warmup_steps`
  default to train.steps and train.warmup_steps (fine-tuning counts them from its epochs).
  """
  total = int(total_steps or train.steps)
  warmup = int(train.warmup_steps if warmup_steps is None else warmup_steps)
  peak = float(train.learning_rate)
  assert 0 <= warmup <= total, (warmup, total)  # config_checks: train.warmup_steps.
  config_checks.check_choice('train.decay', train.decay)  # For a direct caller.
  if train.decay == 'linear':
    after = optax.linear_schedule(peak, 0.0, max(total - warmup, 1))
  else:  # 'constant'
    after = optax.constant_schedule(peak)
  if warmup == 0:
    return after
  return optax.join_schedules([optax.linear_schedule(0.0, peak, warmup), after], [warmup])


def decay_mask(params):
  """True for parameters that get weight decay (not LayerNorm, not biases)."""
  return jax.tree_util.tree_map_with_path(
      lambda path, _: getattr(path[-1], 'key', None) not in _NO_DECAY, params)


def _trust_ratio_where(mask) -> optax.GradientTransformation:
  """optax.scale_by_trust_ratio on the leaves where `mask(params)` is True.

  Not optax.masked: its state has another structure, and optimizer states saved by runs that
  used optax.lamb must keep restoring (this chain's states are optax.lamb's, leaf for leaf).
  """
  inner = optax.scale_by_trust_ratio()

  def update(updates, state, params=None):
    scaled, state = inner.update(updates, state, params)
    return jax.tree.map(lambda keep, s, u: s if keep else u, mask(params), scaled,
                        updates), state

  return optax.GradientTransformation(inner.init, update)


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformationExtraArgs:
  """optax.clip_by_global_norm (the same math, the same empty state), reading the norm from
  the `global_grad_norm` extra argument when the step passes it.

  The step logs the gradients' global norm; computed again here it is a second reduction over
  every gradient (issue 30 counted it on the GPU profile). Given, it must be the norm of
  exactly the `updates` this transformation receives: the chain's first.
  """

  def update(updates, state, params=None, *, global_grad_norm=None, **extra_args):
    del params, extra_args
    norm = optax.tree.norm(updates) if global_grad_norm is None else global_grad_norm
    trigger = jnp.squeeze(norm < max_norm)
    clip = lambda t: jax.lax.select(trigger, t, (t / norm.astype(t.dtype)) * max_norm)
    return jax.tree.map(clip, updates), state

  return optax.GradientTransformationExtraArgs(optax.init_empty_state, update)


def make_optimizer(train: ml_collections.ConfigDict, total_steps: int | None = None,
                   warmup_steps: int | None = None
                   ) -> tuple[optax.GradientTransformation, optax.Schedule]:
  """Global-norm clipping, then AdamW or LAMB with decoupled weight decay and the schedule
  (`make_schedule`'s). Its `update` takes the gradients' norm as `global_grad_norm=` (as
  `train_state.step` passes it), else computes it."""
  schedule = make_schedule(train, total_steps, warmup_steps)
  config_checks.check_choice('train.optimizer', train.optimizer)  # For a direct caller.
  if train.optimizer == 'adamw':
    opt = optax.adamw(schedule, b1=train.beta1, b2=train.beta2, eps=train.eps,
                      weight_decay=train.weight_decay, mask=decay_mask)
  else:  # 'lamb'
    # optax.lamb, except that biases and LayerNorm parameters get no trust ratio either: as in
    # the LAMB BERT recipes (layer adaptation excluded where weight decay is).
    opt = optax.chain(
        optax.scale_by_adam(b1=train.beta1, b2=train.beta2, eps=train.eps),
        optax.add_decayed_weights(train.weight_decay, mask=decay_mask),
        _trust_ratio_where(decay_mask),
        optax.scale_by_learning_rate(schedule))
  parts = []
  if train.max_grad_norm and train.max_grad_norm > 0:
    parts.append(clip_by_global_norm(train.max_grad_norm))
  parts.append(opt)
  return optax.chain(*parts), schedule
