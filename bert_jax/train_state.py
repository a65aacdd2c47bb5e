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
import re
import time
from typing import Any, Callable, Iterable

from absl import logging
import flax
import flax.linen as nn
from flax import traverse_util
import jax
import jax.extend.core as jax_core
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from bert_jax import config_checks
from bert_jax import errors
from bert_jax import sharding as sharding_lib


@flax.struct.dataclass
class TrainState:
  step: jax.Array
  params: Any
  opt_state: Any
  # The parameters the model reads only cast to its compute dtype (bfloat16 on accelerators),
  # kept in that dtype: a subset of `params` (`compute_copy`), {} for a float32 model. The
  # step's update writes it with the float32 master, in the same kernels, so that the forward
  # converts nothing. Derived from `params`: never saved, never exported.
  compute_params: Any = flax.struct.field(default_factory=dict)
  # model.matmul_precision='fp8': the FP8 scales and amax histories (the model's
  # `model.FP8_COLLECTION` variables), which each step replaces with the values its backward
  # pass returns for them, outside the optimizer; None otherwise.
  fp8_meta: Any = None

  def restored(self, step: Any, params: Any, opt_state: Any) -> 'TrainState':
    """This abstract state (ShapeDtypeStructs with shardings) with the parts a checkpoint
    holds, restored, and the compute copy derived from them."""
    return self.replace(step=step, params=params, opt_state=opt_state,
                        compute_params=placed_compute_copy(params, self.compute_params))


# ---------------------------------------------------------------------------------------------
# Abstract state, shardings, and a state from parameters
# ---------------------------------------------------------------------------------------------


def abstract_state(init_params: Callable[[jax.Array], Any], tx: optax.GradientTransformation,
                   mesh: jax.sharding.Mesh, rules):
  """(abstract TrainState, its NamedShardings, init function) of the model whose (boxed)
  parameters `init_params(rng)` makes, without allocating anything. Its `compute_params` are
  the parameters that the model's forward (traced by `init_params`) reads only cast to a
  narrower dtype (`cast_only_params`). `init_params` may instead return (params, fp8_meta),
  the model's FP8 scales and histories (`TrainState.fp8_meta`)."""

  def boxed_variables(rng):
    # Traced without rules, so without any constraint, whatever the caller's context: the
    # `out_shardings` of the jitted init place the parameters.
    with nn.logical_axis_rules(()):
      out = init_params(rng)
    return out if isinstance(out, tuple) else (out, None)

  rng = jax.random.key(0)
  traced, (abstract_boxed, _) = jax.make_jaxpr(boxed_variables, return_shape=True)(rng)
  # A clear error here instead of XLA's about an output sharding that does not divide.
  sharding_lib.check_divisible(abstract_boxed, mesh, rules)
  # The jaxpr's outputs: the parameters' leaves first, then the FP8 variables'.
  param_leaves = len(jax.tree.leaves(nn.unbox(abstract_boxed)))
  compute_like = cast_only_params(traced.jaxpr, nn.unbox(abstract_boxed),
                                  traced.jaxpr.outvars[:param_leaves])

  def init(rng):
    boxed, fp8_meta = boxed_variables(rng)
    params = nn.unbox(boxed)
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params),
                      compute_params=compute_copy(params, compute_like), fp8_meta=fp8_meta)

  param_specs = sharding_lib.logical_specs(abstract_boxed)
  abstract = jax.eval_shape(init, rng)
  opt_specs = sharding_lib.opt_state_specs(tx, abstract.opt_state, param_specs)
  # FP8 scalars and short histories: replicated, and every device updates them alike (the amax
  # of a sharded tensor is a global max).
  specs = TrainState(step=P(), params=param_specs, opt_state=opt_specs,
                     compute_params=_like(param_specs, compute_like),
                     fp8_meta=jax.tree.map(lambda _: P(), abstract.fp8_meta))
  shardings = sharding_lib.to_mesh_shardings(specs, mesh, rules)
  abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                          abstract, shardings)
  return abstract, shardings, init


# ---------------------------------------------------------------------------------------------
# The compute copy of the parameters
# ---------------------------------------------------------------------------------------------
# In bfloat16 the model reads most weights as `promote_dtype(x, kernel)`: a float32 -> bfloat16
# convert of every weight at the start of every step, one small kernel each on a GPU (66 for
# BERT-base), reading 4 bytes a parameter and writing 2, and the bfloat16 copies live through
# the backward anyway. The state keeps those copies instead (`TrainState.compute_params`),
# written by the optimizer's update in the kernels that write the float32 master. Only a
# parameter whose single use is that one cast qualifies: its forward reads the same values and
# its gradient is the same bfloat16 cotangent cast to float32, so the step is bit-identical
# (with rematerialized layers, up to a bfloat16 rounding of a gradient that XLA's excess
# precision may skip in one program and keep in the other; tests/train_state_test.py). A
# parameter read twice (the tied word embeddings: the lookup and the MLM decoder) keeps its
# float32 read, so that its two cotangents still add up in float32; one read in float32
# (LayerNorm, the biases the fused LayerNorm adds) or in a loop's carry is left as it is.

# Primitives whose operands map one to one onto the inputs of their `jaxpr` parameter.
_CALLS = frozenset({'pjit', 'jit', 'closed_call', 'core_call', 'checkpoint', 'remat', 'remat2',
                    'scan'})


def _narrowing_casts(jaxpr: Any, var: Any) -> list[Any] | None:
  """The dtypes of the casts to a narrower float that read `var` in `jaxpr` (calls followed),
  or None if anything else reads it."""
  casts = []
  for eqn in jaxpr.eqns:
    for i, v in enumerate(eqn.invars):
      if v is not var:
        continue
      name = eqn.primitive.name
      if name == 'convert_element_type':
        new = jnp.dtype(eqn.params['new_dtype'])
        if not (jnp.issubdtype(new, jnp.floating) and new.itemsize < var.aval.dtype.itemsize):
          return None
        casts.append(new)
        continue
      sub = eqn.params.get('jaxpr') if name in _CALLS else None
      sub = getattr(sub, 'jaxpr', sub)
      if sub is None or len(sub.invars) != len(eqn.invars):
        return None
      inner = _narrowing_casts(sub, sub.invars[i])
      if inner is None or any(v is sub.invars[i] for v in sub.outvars):
        return None
      casts.extend(inner)
  return casts


def _param_casts(jaxpr: Any, var: Any) -> list[Any] | None:
  """`_narrowing_casts` of `var` in `jaxpr` and, where a call made it (an initializer run
  inside a rematerialized or scanned layer), of the call's own output inside it."""
  casts = _narrowing_casts(jaxpr, var)
  for eqn in jaxpr.eqns:
    if casts is None:
      break
    for j, out in enumerate(eqn.outvars):
      if out is not var:
        continue
      sub = eqn.params.get('jaxpr') if eqn.primitive.name in _CALLS else None
      sub = getattr(sub, 'jaxpr', sub)
      if sub is None or len(sub.outvars) != len(eqn.outvars):
        return casts
      inner = _param_casts(sub, sub.outvars[j])
      casts = None if inner is None else casts + inner
  return casts


def cast_only_params(jaxpr: Any, params: Any, variables: list[Any] | None = None) -> Any:
  """The subtree of `params` (ShapeDtypeStructs or arrays) that `jaxpr` reads through exactly
  one cast to a narrower float each, as ShapeDtypeStructs of that dtype: what
  `TrainState.compute_params` holds. `variables`: the jaxpr's variables of params' leaves, in
  order (by default its outputs: the jaxpr of an init that returns them)."""
  leaves = jax.tree_util.tree_flatten_with_path(params)[0]
  picked = {}
  for (path, leaf), var in zip(leaves, jaxpr.outvars if variables is None else variables,
                               strict=True):
    if isinstance(var, jax_core.Literal) or not jnp.issubdtype(leaf.dtype, jnp.floating):
      continue
    casts = _param_casts(jaxpr, var)
    if casts is not None and len(casts) == 1:
      picked[tuple(k.key for k in path)] = jax.ShapeDtypeStruct(leaf.shape, casts[0])
  return traverse_util.unflatten_dict(picked)


def _like(tree: Any, like: Any) -> Any:
  """The leaves of `tree` (nested dicts) at the paths of `like`'s."""
  flat = traverse_util.flatten_dict(tree)
  return traverse_util.unflatten_dict({k: flat[k] for k in traverse_util.flatten_dict(like)})


def compute_copy(params: Any, like: Any) -> Any:
  """The compute copy of `params`: the leaves at the paths of `like` (a `compute_params` tree
  of arrays or ShapeDtypeStructs) cast to their dtypes; {} when `like` is empty."""
  flat_like = traverse_util.flatten_dict(like)
  flat = traverse_util.flatten_dict(params)
  return traverse_util.unflatten_dict({k: flat[k].astype(v.dtype) for k, v in flat_like.items()})


def placed_compute_copy(params: Any, abstract: Any) -> Any:
  """`compute_copy` of (sharded) `params`, placed as the abstract `compute_params` say (the
  copy of a restored or given state)."""
  if not traverse_util.flatten_dict(abstract):
    return {}
  return jax.jit(lambda p: compute_copy(p, abstract),
                 out_shardings=jax.tree.map(lambda a: a.sharding, abstract))(params)


def model_inputs(state: TrainState) -> Any:
  """The parameters the step applies the model to: `params`, with those of the compute copy
  replaced by it."""
  flat = traverse_util.flatten_dict(state.params)
  flat.update(traverse_util.flatten_dict(state.compute_params))
  return traverse_util.unflatten_dict(flat)


def put_sharded(tree: Any, shardings: Any) -> Any:
  """Host arrays (every process holds them whole) as global arrays: each device takes its own
  slice."""
  return jax.tree.map(
      lambda x, s: jax.make_array_from_callback(np.shape(x), s, lambda idx: np.asarray(x)[idx]),
      tree, shardings)


def state_from_params(params: Any, tx: optax.GradientTransformation, shardings: TrainState,
                      abstract: TrainState | None = None, fp8_meta: Any = None) -> TrainState:
  """Step 0 and a fresh optimizer state around (sharded) `params`; with the compute copy that
  `abstract` (`abstract_state`'s) describes, which a model with one needs, and `fp8_meta` (FP8
  scales and histories, e.g. `model.initial_fp8_meta`'s) when the model has them."""
  like = {} if abstract is None else abstract.compute_params
  if traverse_util.flatten_dict(shardings.compute_params) and abstract is None:
    raise ValueError('the state has a compute copy of its parameters: pass `abstract`')
  return jax.jit(lambda p, m: TrainState(jnp.zeros((), jnp.int32), p, tx.init(p),
                                         compute_copy(p, like), m),
                 out_shardings=shardings)(params, fp8_meta)


# ---------------------------------------------------------------------------------------------
# The step
# ---------------------------------------------------------------------------------------------

RNG_IMPLS = config_checks.CHOICES['train.rng_impl']


def dropout_rng(train_config: ml_collections.ConfigDict) -> jax.Array:
  """The key that every step folds its step number into, for dropout."""
  impl = train_config.rng_impl
  config_checks.check_choice('train.rng_impl', impl)  # For a config changed after loading.
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
  inputs = model_inputs(state)

  def apply_with(params, micro, micro_rng, fp8_meta):
    # Without FP8 scales (None), the model's apply takes three arguments, as ever.
    return (apply(params, micro, micro_rng) if fp8_meta is None
            else apply(params, micro, micro_rng, fp8_meta))

  # One batch: the counts come with its loss. Micro-batches: each is normalized by the whole
  # batch's counts, so their gradients add up to the batch's.
  counts = (_counts(functools.partial(apply_with, fp8_meta=state.fp8_meta), loss, inputs,
                    batch, rng) if accum_steps > 1 else None)

  def micro_loss(params, fp8_meta, micro, micro_rng):
    sums, micro_counts, metrics = loss(apply_with(params, micro, micro_rng, fp8_meta), micro)
    total = normalize(sums, micro_counts if counts is None else counts)
    return total, dict({'loss': total}, **metrics)

  def grad_fn(fp8_meta, micro, micro_rng):
    # The "gradient" of the FP8 scales and histories is their new value (flax's fp8_ops).
    (_, metrics), (grads, new_meta) = jax.value_and_grad(
        micro_loss, argnums=(0, 1), has_aux=True)(inputs, fp8_meta, micro, micro_rng)
    # The compute copy's gradients (bfloat16) in the master's dtype: what the gradient of the
    # master's cast is, and what micro-batches add up in.
    grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, state.params)
    return metrics, grads, new_meta

  if accum_steps == 1:
    metrics, grads, fp8_meta = grad_fn(state.fp8_meta, batch, rng)
  else:
    micro = jax.tree.map(lambda x: split_micro(x, accum_steps), batch)

    def body(carry, xs):
      i, mb = xs
      summed, meta = carry
      m, g, new_meta = grad_fn(meta, mb, jax.random.fold_in(rng, i))
      return (jax.tree.map(jnp.add, summed, (g, m)), new_meta), None

    m_shape, g_shape, _ = jax.eval_shape(grad_fn, state.fp8_meta,
                                         jax.tree.map(lambda x: x[0], micro), rng)
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), (g_shape, m_shape))
    ((grads, metrics), fp8_meta), _ = jax.lax.scan(body, (zeros, state.fp8_meta),
                                                   (jnp.arange(accum_steps), micro))
  # The scope names the optimizer's operations in the compiled program's metadata, where
  # profiles and the kernel budget (hlo_kernels.py) find them.
  with jax.named_scope('optimizer'):
    grad_norm = global_norm(grads)
    # Computed once: the logged metric is the norm that optim.clip_by_global_norm clips with.
    extra = (dict(global_grad_norm=grad_norm)
             if isinstance(tx, optax.GradientTransformationExtraArgs) else {})
    updates, opt_state = tx.update(grads, state.opt_state, state.params, **extra)
    params = optax.apply_updates(state.params, updates)
    compute_params = compute_copy(params, state.compute_params)
  new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state,
                            compute_params=compute_params, fp8_meta=fp8_meta)
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
