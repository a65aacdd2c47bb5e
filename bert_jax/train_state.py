"""The train state of every run (pre-training and fine-tuning) and its one jitted step.

- `abstract_state`: the sharded abstract `TrainState` of a model, built with `jax.eval_shape`,
  so nothing is ever allocated whole on one device.
- `put_sharded` / `state_from_params`: a state from host parameters (pre-trained weights).
- `step` / `jit_step`: one optimizer step over the global batch, optionally as micro-batches
  whose gradients are accumulated, jitted with explicit shardings and the state donated (FP8
  scales, `TrainState.fp8_meta`, replaced by the values the backward pass returns). The
  model and the loss come from the caller (a pre-training objective's, a fine-tuning task's),
  and every loss is normalized the same way (`Loss`, `normalize`).
- `compile_ahead`: every shape a run will use, compiled before its first step.
"""

import functools
import itertools
import time
from typing import Any, Callable, Iterable

from absl import logging
import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from bert_jax import errors
from bert_jax import sharding as sharding_lib


@flax.struct.dataclass
class TrainState:
  step: jax.Array
  params: Any
  opt_state: Any
  # model.matmul_precision='fp8': the FP8 scales and amax histories (the model's
  # `model.FP8_COLLECTION` variables), which each step replaces with the values its backward
  # pass returns for them, outside the optimizer; None otherwise.
  fp8_meta: Any = None


# ---------------------------------------------------------------------------------------------
# Abstract state, shardings, and a state from parameters
# ---------------------------------------------------------------------------------------------


def abstract_state(init_params: Callable[[jax.Array], Any], tx: optax.GradientTransformation,
                   mesh: jax.sharding.Mesh, rules):
  """(abstract TrainState, its NamedShardings, init function) of the model whose (boxed)
  parameters `init_params(rng)` makes, without allocating anything. `init_params` may instead
  return (params, fp8_meta), the model's FP8 scales and histories (`TrainState.fp8_meta`)."""

  def boxed_variables(rng):
    # Traced without rules, so without any constraint, whatever the caller's context: the
    # `out_shardings` of the jitted init place the parameters.
    with nn.logical_axis_rules(()):
      out = init_params(rng)
    return out if isinstance(out, tuple) else (out, None)

  def init(rng):
    boxed, fp8_meta = boxed_variables(rng)
    params = nn.unbox(boxed)
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params),
                      fp8_meta=fp8_meta)

  rng = jax.random.key(0)
  abstract_boxed, _ = jax.eval_shape(boxed_variables, rng)
  # A clear error here instead of XLA's about an output sharding that does not divide.
  sharding_lib.check_divisible(abstract_boxed, mesh, rules)
  param_specs = sharding_lib.logical_specs(abstract_boxed)
  abstract = jax.eval_shape(init, rng)
  opt_specs = sharding_lib.opt_state_specs(tx, abstract.opt_state, param_specs)
  # Scalars and short histories: replicated, and every device updates them alike (the amax of
  # a sharded tensor is a global max).
  specs = TrainState(step=P(), params=param_specs, opt_state=opt_specs,
                     fp8_meta=jax.tree.map(lambda _: P(), abstract.fp8_meta))
  shardings = sharding_lib.to_mesh_shardings(specs, mesh, rules)
  abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                          abstract, shardings)
  return abstract, shardings, init


def put_sharded(tree: Any, shardings: Any) -> Any:
  """Host arrays (every process holds them whole) as global arrays: each device takes its own
  slice."""
  return jax.tree.map(
      lambda x, s: jax.make_array_from_callback(np.shape(x), s, lambda idx: np.asarray(x)[idx]),
      tree, shardings)


def state_from_params(params: Any, tx: optax.GradientTransformation, shardings: TrainState,
                      fp8_meta: Any = None) -> TrainState:
  """Step 0 and a fresh optimizer state around (sharded) `params` (and `fp8_meta`, FP8 scales
  and histories, e.g. `model.initial_fp8_meta`'s, when the model has them)."""
  return jax.jit(lambda p, m: TrainState(jnp.zeros((), jnp.int32), p, tx.init(p), m),
                 out_shardings=shardings)(params, fp8_meta)


# ---------------------------------------------------------------------------------------------
# The step
# ---------------------------------------------------------------------------------------------

RNG_IMPLS = ('threefry2x32', 'rbg', 'unsafe_rbg')


def dropout_rng(train_config: ml_collections.ConfigDict) -> jax.Array:
  """The key that every step folds its step number into, for dropout."""
  impl = train_config.rng_impl
  if impl not in RNG_IMPLS:
    raise errors.UserError(f'config.train.rng_impl={impl!r}: expected one of {RNG_IMPLS}')
  return jax.random.fold_in(jax.random.key(train_config.seed, impl=impl), 1)


def split_micro(x: jax.Array, k: int) -> jax.Array:
  """[B, ...] -> [k, B/k, ...] taking every k-th example, so each micro-batch stays spread over
  all data-parallel shards instead of living on B/k of them."""
  y = x.reshape((x.shape[0] // k, k) + x.shape[1:])
  y = jnp.swapaxes(y, 0, 1)
  return nn.with_logical_constraint(y, (None, 'batch') + (None,) * (x.ndim - 1))


# The loss of a pre-training objective or a fine-tuning task: loss(outputs, batch) -> (sums,
# counts, metrics).
# - sums: {term: the term's loss summed over the batch's labelled items (masked tokens, pairs,
#   examples)};
# - counts: {term: what that sum averages over}, from the batch alone (its labels and weights,
#   never the outputs); 0 for a batch with nothing to count (`normalize` floors it);
# - metrics: {name: (sum, count)} pairs, which add up over micro-batches, devices and batches
#   (`monitor.summarize` divides them). 'loss' is not among them: the step logs the normalized
#   loss under that name, in pre-training and fine-tuning alike.
# Every loss is normalized here, in one way (`normalize`), with the counts of the whole global
# batch: k accumulated micro-batches give exactly the gradient of one big batch, and padded
# rows (weight 0) count for nothing.
Loss = Callable[[Any, dict], tuple[dict, dict, dict]]
# apply(params, batch, rng) -> the outputs a Loss takes (the model in training mode: dropout);
# a state with FP8 scales calls apply(params, batch, rng, fp8_meta).
Apply = Callable[..., Any]


def normalize(sums: dict[str, jax.Array], counts: dict[str, jax.Array]) -> jax.Array:
  """The training loss: the sum over terms of each term's mean, sums[t] / max(counts[t], 1)
  (the one floor of every count: a term with nothing to count adds 0)."""
  total = None
  for term, value in sums.items():
    mean = value / jnp.maximum(counts[term], 1.0)
    total = mean if total is None else total + mean
  return total


def with_rate_counts(loss: Loss, rate_counts: Callable[[dict], tuple[jax.Array, jax.Array]]
                     ) -> Loss:
  """`loss` with what the rates of metrics.jsonl count (`monitor.with_rates`), per row, as
  (amount, rows) pairs that add up over micro-batches: `rate_counts(batch)`'s (sequences, real
  tokens) and the token slots. Counted on the device, so packed rows and every process's rows
  count exactly."""

  def counted(outputs, batch):
    sums, counts, metrics = loss(outputs, batch)
    sequences, real_tokens = rate_counts(batch)
    rows = jnp.float32(batch['input_ids'].shape[0])
    metrics.update(sequences_per_row=(sequences, rows), real_tokens_per_row=(real_tokens, rows),
                   tokens_per_row=(jnp.float32(batch['input_ids'].size), rows))
    return sums, counts, metrics
  return counted


def _counts(apply: Apply, loss: Loss, params: Any, batch: dict, rng: jax.Array) -> dict:
  """The counts of `loss` over `batch`. Counts do not depend on the outputs: the loss runs on
  zeros of the outputs' shapes, and all but the counts is dead code to XLA."""
  shapes = jax.eval_shape(apply, params, batch, rng)
  _, counts, _ = loss(jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes), batch)
  return counts


def step(state: TrainState, batch: dict[str, jax.Array], *, apply: Apply, loss: Loss,
         tx: optax.GradientTransformation, base_rng: jax.Array, accum_steps: int = 1
         ) -> tuple[TrainState, dict[str, Any]]:
  """One optimizer step over the global batch (optionally as `accum_steps` micro-batches).

  Metrics: the loss's, 'loss' (the normalized training loss, what the gradient is of) and
  'grad_norm'. A state with `fp8_meta` gets the values its backward pass returns for them
  (micro-batches: in turn, each one's feeding the next), not an optimizer update.
  """
  rng = jax.random.fold_in(base_rng, state.step)

  def apply_with(params, micro, micro_rng, fp8_meta):
    # Without FP8 scales (None), the model's apply takes three arguments, as ever.
    return (apply(params, micro, micro_rng) if fp8_meta is None
            else apply(params, micro, micro_rng, fp8_meta))

  # One batch: the counts come with its loss. Micro-batches: each is normalized by the whole
  # batch's counts, so their gradients add up to the batch's.
  counts = (_counts(functools.partial(apply_with, fp8_meta=state.fp8_meta), loss, state.params,
                    batch, rng) if accum_steps > 1 else None)

  def micro_loss(params, fp8_meta, micro, micro_rng):
    sums, micro_counts, metrics = loss(apply_with(params, micro, micro_rng, fp8_meta), micro)
    total = normalize(sums, micro_counts if counts is None else counts)
    return total, dict({'loss': total}, **metrics)

  # The "gradient" of the FP8 scales and histories is their new value (flax's fp8_ops).
  grad_fn = jax.value_and_grad(micro_loss, argnums=(0, 1), has_aux=True)
  if accum_steps == 1:
    (_, metrics), (grads, fp8_meta) = grad_fn(state.params, state.fp8_meta, batch, rng)
  else:
    micro = jax.tree.map(lambda x: split_micro(x, accum_steps), batch)

    def body(carry, xs):
      i, mb = xs
      summed, meta = carry
      (_, m), (g, new_meta) = grad_fn(state.params, meta, mb, jax.random.fold_in(rng, i))
      return (jax.tree.map(jnp.add, summed, (g, m)), new_meta), None

    (_, m_shape), (g_shape, _) = jax.eval_shape(grad_fn, state.params, state.fp8_meta,
                                                jax.tree.map(lambda x: x[0], micro), rng)
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), (g_shape, m_shape))
    ((grads, metrics), fp8_meta), _ = jax.lax.scan(body, (zeros, state.fp8_meta),
                                                   (jnp.arange(accum_steps), micro))
  # The scope names the optimizer's operations in the compiled program's metadata, where
  # profiles and the kernel budget (hlo_kernels.py) find them.
  with jax.named_scope('optimizer'):
    grad_norm = optax.tree.norm(grads)
    # Computed once: the logged metric is the norm that optim.clip_by_global_norm clips with.
    extra = (dict(global_grad_norm=grad_norm)
             if isinstance(tx, optax.GradientTransformationExtraArgs) else {})
    updates, opt_state = tx.update(grads, state.opt_state, state.params, **extra)
    params = optax.apply_updates(state.params, updates)
  new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state,
                            fp8_meta=fp8_meta)
  return new_state, dict(metrics, grad_norm=grad_norm)


def jit_step(apply: Apply, loss: Loss, tx: optax.GradientTransformation,
             mesh: jax.sharding.Mesh, rules, state_shardings: TrainState, base_rng: jax.Array,
             accum_steps: int = 1) -> Callable:
  """`step` jitted over the mesh: sharded state (donated) and batch in, state and replicated
  metrics out. `.jitted` is the jitted function (for AOT lowering)."""
  step_fn = functools.partial(step, apply=apply, loss=loss, tx=tx, base_rng=base_rng,
                              accum_steps=accum_steps)
  jitted = jax.jit(step_fn, in_shardings=(state_shardings, sharding_lib.batch_sharding(mesh)),
                   out_shardings=(state_shardings, NamedSharding(mesh, P())), donate_argnums=0)

  def run(state, batch):
    # Activation constraints resolve their logical names while tracing, under the rules; with
    # `with mesh:` instead they would all be dropped (see `sharding_lib.activate`).
    with sharding_lib.activate(mesh, rules):
      return jitted(state, batch)
  run.jitted = jitted
  return run


def compile_ahead(calls: Iterable[tuple[Any, tuple]], mesh: jax.sharding.Mesh, rules,
                  what: str) -> None:
  """Compiles each jitted function for its abstract arguments (`calls`: (jitted, args) pairs,
  possibly lazy), logging `what` and the time taken. A run compiles every shape it will use
  this way before its first step: a compile mid-run would not stop for SIGTERM, whose notice
  is about 30 s."""
  logging.info('Compiling %s', what)
  started = time.time()
  with sharding_lib.activate(mesh, rules):
    for jitted, args in calls:
      jitted.lower(*args).compile()
  logging.info('Compiled in %.1f s', time.time() - started)


# How long processes wait for each other before the first step (start-up may differ by minutes:
# a compile served from the cache on one host, a shuffle buffer filling on another).
START_BARRIER_SECONDS = 1800
_barriers = itertools.count()


def wait_for_processes(what: str) -> None:
  """Every process waits here for the others (the coordination service's barrier, up to
  START_BARRIER_SECONDS); nothing with one process.

  A run's first collective builds the CPU collectives' (gloo's) context, whose key-value
  lookups give up after 30 s: a process that got there half a minute before the other failed
  (DEADLINE_EXCEEDED) on a loaded machine. On a pod the first step's collectives likewise wait
  only as long as the runtime's own deadline."""
  if jax.process_count() == 1:
    return
  from orbax.checkpoint import multihost  # pylint: disable=g-import-not-at-top
  started = time.time()
  # `processes` given: the coordination service's barrier, not a collective.
  multihost.sync_global_processes(f'bert_jax_{what}_{next(_barriers)}'.replace(' ', '_'),
                                  timeout=START_BARRIER_SECONDS,
                                  processes=set(range(jax.process_count())))
  logging.info('Waited %.1f s for the other processes before %s', time.time() - started, what)


def check_accumulation(batch_size: int, accum_steps: int, mesh: jax.sharding.Mesh,
                       prefix: str = 'train.') -> None:
  """Clear errors for a micro-batch that does not split the batch or over the mesh."""
  if accum_steps < 1 or batch_size % accum_steps:
    raise errors.UserError(f'{prefix}batch_size={batch_size} does not divide by '
                           f'{prefix}grad_accum_steps={accum_steps}')
  micro = batch_size // accum_steps
  if micro % sharding_lib.data_parallel_size(mesh):
    raise errors.UserError(
        f'micro-batch {micro} ({prefix}batch_size / {prefix}grad_accum_steps) does not divide '
        f'over {sharding_lib.data_parallel_size(mesh)} data-parallel shards')
