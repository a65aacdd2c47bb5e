"""The train state of every run (pre-training and fine-tuning) and its one jitted step.

- `TrainState`: the step, the parameters, the optimizer state and the extras the model has,
  which `state_extras.py` declares (the bfloat16 compute copy, FP8 scales, ...); this module,
  `checkpoint.py` and the drivers loop over them and never name one.
- `abstract_state`: the sharded abstract `TrainState` of a model, built with `jax.eval_shape`,
  so nothing is ever allocated whole on one device.
- `put_sharded` / `state_from_params`: a state from host parameters (pre-trained weights).
- `model_variables`: the one variables mapping the step applies the model to.
- `step` / `jit_step`: one optimizer step over the global batch, optionally as micro-batches
  whose gradients are accumulated, jitted with explicit shardings and the state donated. The
  model and the loss come from the caller (a pre-training objective's, a fine-tuning task's),
  and every loss is normalized the same way (`Loss`, `normalize`).
- `compile_ahead`: every shape a run will use, compiled before its first step.
"""

import functools
import itertools
import re
import time
from typing import Any, Callable, Iterable

from absl import logging
import flax
import flax.linen as nn
from flax import traverse_util
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from bert_jax import config_checks
from bert_jax import errors
from bert_jax import sharding as sharding_lib
from bert_jax import state_extras


@flax.struct.dataclass
class TrainState:
  step: jax.Array
  params: Any
  opt_state: Any
  # The declared extras (`state_extras.EXTRAS`) this model has, by name; each step updates
  # them (`Extra.update`), checkpoints hold the saved ones.
  extras: dict[str, Any] = flax.struct.field(default_factory=dict)

  def saved_extras(self) -> dict[str, Any]:
    """The extras a checkpoint holds, each its own item (by name)."""
    return {name: value for name, value in self.extras.items()
            if state_extras.get(name).saved}

  def restored(self, step: int, params: Any, opt_state: Any,
               saved: dict[str, Any]) -> 'TrainState':
    """This abstract state (ShapeDtypeStructs with shardings) with what checkpoint `step`
    holds: parameters, optimizer state and `saved` (the saved extras it has); the other extras
    computed on the devices by their `init`: the derived ones from the parameters, a saved one
    that the checkpoint lacks afresh (with a warning)."""
    to_compute = {}
    for name in self.extras:
      extra = state_extras.get(name)
      if extra.saved and name in saved:
        continue
      if extra.saved:
        logging.warning('Checkpoint %d %s', step, extra.absent())
      to_compute[name] = extra
    computed = jax.jit(
        lambda p: {name: e.init(p, self.extras[name]) for name, e in to_compute.items()},
        out_shardings={name: jax.tree.map(lambda a: a.sharding, self.extras[name])
                       for name in to_compute})(params) if to_compute else {}
    return self.replace(step=step, params=params, opt_state=opt_state,
                        extras={name: saved[name] if name in saved else computed[name]
                                for name in self.extras})


# ---------------------------------------------------------------------------------------------
# Abstract state, shardings, and a state from parameters
# ---------------------------------------------------------------------------------------------


def abstract_state(init_variables: Callable[[jax.Array], dict[str, Any]],
                   tx: optax.GradientTransformation, mesh: jax.sharding.Mesh, rules):
  """(abstract TrainState, its NamedShardings, init function) of the model whose variables
  `init_variables(rng)` makes (its `init`'s: boxed parameters, and any other collections),
  without allocating anything. Its extras are the declared ones (`state_extras.EXTRAS`) whose
  shapes the traced init gives."""

  def boxed_variables(rng):
    # Traced without rules, so without any constraint, whatever the caller's context: the
    # `out_shardings` of the jitted init place the parameters.
    with nn.logical_axis_rules(()):
      return init_variables(rng)

  rng = jax.random.key(0)
  traced, boxed = jax.make_jaxpr(boxed_variables, return_shape=True)(rng)
  # A clear error here instead of XLA's about an output sharding that does not divide.
  sharding_lib.check_divisible(boxed['params'], mesh, rules)
  variables = nn.unbox(boxed)
  paths = [path for path, _ in jax.tree_util.tree_flatten_with_path(variables)[0]]
  init_trace = state_extras.Traced(
      variables, traced.jaxpr, [var for path, var in zip(paths, traced.jaxpr.outvars,
                                                          strict=True)
                                if path[0].key == 'params'])
  shapes = {}
  for extra in state_extras.EXTRAS:
    if (extra_shapes := extra.shapes(init_trace)) is not None:
      shapes[extra.name] = extra_shapes

  def init(rng):
    params = nn.unbox(boxed_variables(rng)['params'])
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params),
                      extras=_fresh_extras(params, shapes))

  param_specs = sharding_lib.logical_specs(boxed['params'])
  abstract = jax.eval_shape(init, rng)
  opt_specs = sharding_lib.opt_state_specs(tx, abstract.opt_state, param_specs)
  specs = TrainState(step=P(), params=param_specs, opt_state=opt_specs,
                     extras={name: state_extras.get(name).specs(s, param_specs)
                             for name, s in shapes.items()})
  shardings = sharding_lib.to_mesh_shardings(specs, mesh, rules)
  abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                          abstract, shardings)
  return abstract, shardings, init


def _fresh_extras(params: Any, shapes: dict[str, Any]) -> dict[str, Any]:
  """Every extra of `shapes` ({name: its shapes}) as its `init` makes it from `params`."""
  return {name: state_extras.get(name).init(params, s) for name, s in shapes.items()}


def model_variables(state: TrainState) -> dict[str, Any]:
  """The variables the step applies the model to, built here alone: 'params', with the leaves
  of the extras applied as 'params' (the compute copy) instead of theirs, and each extra applied
  as a collection of its own (the FP8 scales) under that collection's name, as it `read`s."""
  flat = traverse_util.flatten_dict(state.params)
  collections = {}
  for name, value in state.extras.items():
    extra = state_extras.get(name)
    if extra.collection == 'params':
      flat.update(traverse_util.flatten_dict(value))
    elif extra.collection is not None:
      collections[extra.collection] = extra.read(value)
  return {'params': traverse_util.unflatten_dict(flat), **collections}


def put_sharded(tree: Any, shardings: Any) -> Any:
  """Host arrays (every process holds them whole) as global arrays: each device takes its own
  slice."""
  return jax.tree.map(
      lambda x, s: jax.make_array_from_callback(np.shape(x), s, lambda idx: np.asarray(x)[idx]),
      tree, shardings)


def state_from_params(params: Any, tx: optax.GradientTransformation,
                      abstract: TrainState) -> TrainState:
  """Step 0, a fresh optimizer state and fresh extras (their `init`: the compute copy of
  `params`, initial FP8 scales, ...) around (sharded) `params`, placed as `abstract`
  (`abstract_state`'s) says."""
  shapes = abstract.extras
  return jax.jit(lambda p: TrainState(jnp.zeros((), jnp.int32), p, tx.init(p),
                                      _fresh_extras(p, shapes)),
                 out_shardings=jax.tree.map(lambda a: a.sharding, abstract))(params)


# ---------------------------------------------------------------------------------------------
# The step
# ---------------------------------------------------------------------------------------------

RNG_IMPLS = config_checks.CHOICES['train.rng_impl']


def dropout_rng(train_config: ml_collections.ConfigDict, mesh: jax.sharding.Mesh) -> jax.Array:
  """The key that every step on `mesh` folds its step number into, for dropout.

  `train.rng_impl='auto'` is 'rbg' on a mesh of one device and 'threefry2x32' on more. XLA
  cannot partition the RngBitGenerator of 'rbg': every device generates the bits of the whole
  global batch and slices out its own (BERT-large/512 on v5e:4x4, 16 rows a chip: 568.72 GB of
  HBM traffic a step, 425 of them those bits; 91.36 GB with 'threefry2x32', whose bits jax
  partitions, `jax_threefry_partitionable`). Either gives the same bits on any mesh of several
  devices.
  """
  impl = train_config.rng_impl
  config_checks.check_choice('train.rng_impl', impl)  # For a config changed after loading.
  if impl == 'auto':
    impl = 'rbg' if mesh.size == 1 else 'threefry2x32'
  return jax.random.fold_in(jax.random.key(train_config.seed, impl=impl), 1)


def micro_rng(base_rng: jax.Array, step: jax.Array, micro: jax.Array,
              accum_steps: int) -> jax.Array:
  """The dropout key of micro-batch `micro` of `step`: `base_rng` folded once with their index
  in the run (step x accum_steps + micro). Folding the step, then the micro-batch, gave equal
  keys to step 0's micro-batch 1 and step 1's micro-batch 0 with 'unsafe_rbg', whose fold_in
  is an xor (jax.random's documented trade-off)."""
  return jax.random.fold_in(base_rng, step * accum_steps + micro)


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
# apply(variables, batch, rng) -> the outputs a Loss takes: the model in training mode (dropout)
# applied to `model_variables`.
Apply = Callable[[dict[str, Any], dict, jax.Array], Any]


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


def _counts(apply: Apply, loss: Loss, variables: dict[str, Any], batch: dict,
            rng: jax.Array) -> dict:
  """The counts of `loss` over `batch`. Counts do not depend on the outputs: the loss runs on
  zeros of the outputs' shapes, and all but the counts is dead code to XLA."""
  shapes = jax.eval_shape(apply, variables, batch, rng)
  _, counts, _ = loss(jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes), batch)
  return counts


def step(state: TrainState, batch: dict[str, jax.Array], *, apply: Apply, loss: Loss,
         tx: optax.GradientTransformation, base_rng: jax.Array, accum_steps: int = 1
         ) -> tuple[TrainState, dict[str, Any]]:
  """One optimizer step over the global batch (optionally as `accum_steps` micro-batches).

  Metrics: the loss's, 'loss' (the normalized training loss, what the gradient is of) and
  'grad_norm'. The model is applied to `model_variables(state)`; each extra is then updated
  by its `Extra.update`, in the optimizer's update, from the new parameters and, for one the
  model reads as a collection of its own (FP8 scales), its `Extra.advance` by what the backward
  pass returns for that collection (micro-batches: in turn, each one's feeding the next), not
  an optimizer update.
  """
  rng = jax.random.fold_in(base_rng, state.step)
  variables = model_variables(state)
  # The extras the model reads as collections of their own, by collection: their "gradient"
  # says what they become (`Extra.advance`), never an optimizer update.
  own = {state_extras.get(name).collection: state_extras.get(name)
         for name in state.extras if state_extras.get(name).collection not in (None, 'params')}
  returned = {c: state.extras[extra.name] for c, extra in own.items()}

  # One batch: the counts come with its loss. Micro-batches: each is normalized by the whole
  # batch's counts, so their gradients add up to the batch's.
  counts = _counts(apply, loss, variables, batch, rng) if accum_steps > 1 else None

  def micro_loss(micro_variables, micro, micro_rng):
    sums, micro_counts, metrics = loss(apply(micro_variables, micro, micro_rng), micro)
    total = normalize(sums, micro_counts if counts is None else counts)
    return total, dict({'loss': total}, **metrics)

  def grad_fn(collections, micro, micro_rng):
    read = {c: own[c].read(value) for c, value in collections.items()}
    (_, metrics), grads = jax.value_and_grad(micro_loss, has_aux=True)(
        dict(variables, **read), micro, micro_rng)
    # The compute copy's gradients (bfloat16) in the master's dtype: what the gradient of the
    # master's cast is, and what micro-batches add up in.
    params_grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads.pop('params'),
                                state.params)
    return metrics, params_grads, {c: own[c].advance(value, grads[c])
                                   for c, value in read.items()}

  if accum_steps == 1:
    metrics, grads, returned = grad_fn(returned, batch, rng)
  else:
    micro = jax.tree.map(lambda x: split_micro(x, accum_steps), batch)

    def body(carry, xs):
      i, mb = xs
      summed, collections = carry
      m, g, new_collections = grad_fn(collections, mb,
                                      micro_rng(base_rng, state.step, i, accum_steps))
      return (jax.tree.map(jnp.add, summed, (g, m)), new_collections), None

    m_shape, g_shape, _ = jax.eval_shape(grad_fn, returned,
                                         jax.tree.map(lambda x: x[0], micro), rng)
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), (g_shape, m_shape))
    ((grads, metrics), returned), _ = jax.lax.scan(body, (zeros, returned),
                                                   (jnp.arange(accum_steps), micro))
  # The scope names the optimizer's operations in the compiled program's metadata, where
  # profiles and the kernel budget (hlo_kernels.py) find them.
  with jax.named_scope('optimizer'):
    grad_norm = global_norm(grads)
    # Computed once: the logged metric is the norm that optim.clip_by_global_norm clips with.
    extra_args = (dict(global_grad_norm=grad_norm)
                  if isinstance(tx, optax.GradientTransformationExtraArgs) else {})
    updates, opt_state = tx.update(grads, state.opt_state, state.params, **extra_args)
    params = optax.apply_updates(state.params, updates)
    extras = {}
    for name, value in state.extras.items():
      extra = state_extras.get(name)
      extras[name] = extra.update(value, params, returned.get(extra.collection))
  new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state,
                            extras=extras)
  return new_state, dict(metrics, grad_norm=grad_norm)


def global_norm(tree: Any) -> jax.Array:
  """The global L2 norm of `tree`'s leaves (optax.tree.norm's), summed by groups: leaves of one
  shape and dtype whose paths differ only in their numbers (the same parameter of every encoder
  layer, so laid out and sharded alike) are stacked into one reduction. On a GPU each reduction
  is a kernel or two: BERT-base's 206 gradients took 259 of them."""
  groups = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    key = (re.sub(r'\d+', '#', jax.tree_util.keystr(path)), leaf.shape, leaf.dtype)
    groups.setdefault(key, []).append(leaf)
  sums = [jnp.sum(jnp.square(jnp.stack(leaves) if len(leaves) > 1 else leaves[0]))
          for leaves in groups.values()]
  return jnp.sqrt(functools.reduce(jnp.add, sums)) if sums else jnp.zeros((), jnp.float32)


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
