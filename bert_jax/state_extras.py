"""The extras of the train state: what a run keeps besides its step, parameters and optimizer
state, each declared once, here.

An `Extra` says all that the rest of the code needs of it: its name (its key in
`TrainState.extras` and, if saved, its checkpoint item), whether a model has it and its shapes
(`shapes`, from the model's traced init), its first value (`init`), its sharding (`specs`),
whether checkpoints hold it (`saved`; else it is derived: rebuilt from the parameters after a
restore, never saved, never exported), how the model reads it (`collection`) and what each step
makes of it (`update`). `train_state.py` (the state, the step), `checkpoint.py` (save, restore)
and the drivers loop over the extras and never name one: adding an extra is adding its
declaration to `EXTRAS`.

- `COMPUTE_COPY` ('compute_params', derived): the parameters the model reads only cast to its
  compute dtype (bfloat16), kept in that dtype and written by the optimizer's update.
- `FP8_SCALES` ('fp8_scales', saved): the scales and amax histories of
  model.matmul_precision='fp8' (the model's `FP8_COLLECTION`), the scales computed from the
  histories before each step and this step's amaxes, which the backward pass returns, rolled
  into the histories after it.
"""

import dataclasses
from typing import Any, Callable

import jax
import jax.extend.core as jax_core
import jax.numpy as jnp
from flax import traverse_util
from jax.sharding import PartitionSpec as P

from bert_jax import model as model_lib


@dataclasses.dataclass(frozen=True)
class Traced:
  """A model's init, traced (nothing allocated): what an extra's shapes are found from."""
  # The init's variables, unboxed ShapeDtypeStructs: {'params': ..., other collections}.
  variables: dict[str, Any]
  jaxpr: Any  # The init's jaxpr (`jax.make_jaxpr`).
  param_vars: list[Any]  # Its variables of the parameters' leaves, in their order.


@dataclasses.dataclass(frozen=True)
class Extra:
  """One extra of the train state, declared."""
  name: str
  # Its ShapeDtypeStructs for the model whose init is traced; None: that model has none.
  shapes: Callable[[Traced], Any]
  # (parameters, its shapes) -> its first value: at init, after a restore when derived, and
  # when saved but missing from the checkpoint (traced under jit).
  init: Callable[[Any, Any], Any]
  # (its shapes, the parameters' logical PartitionSpecs) -> its logical PartitionSpecs.
  specs: Callable[[Any, Any], Any]
  # True: its own checkpoint item (absent from a checkpoint: `init`, and a warning that the
  # checkpoint `when_absent`). False: derived, computed by `init` after a restore.
  saved: bool
  # How the model is applied to it (`train_state.model_variables`): 'params', its leaves read
  # instead of the parameters' at their paths (their gradients are the parameters'); another
  # name, a variable collection of the model (as `read` makes it), whose "gradient" the backward
  # pass returns to `advance`; None, the model never reads it.
  collection: str | None
  # (its value, the updated parameters, its value after the backward pass(es) (`advance`) or
  # None) -> its value after the step; traced inside the optimizer's update.
  update: Callable[[Any, Any, Any], Any]
  # What the warning says of a checkpoint without it (a saved extra): 'Checkpoint <step> ...'.
  when_absent: str = ''
  # For an extra read as a collection of its own: its value -> what the model is applied to
  # (the FP8 scales a step quantizes with, from their histories).
  read: Callable[[Any], Any] = lambda value: value
  # (what the model was applied to (`read`'s), what the backward pass returned for the
  # collection) -> its value after that pass: what the next micro-batch reads and `update`
  # receives. By default what was returned (flax's overwrite-with-gradient collections).
  advance: Callable[[Any, Any], Any] = lambda read, returned: returned

  def absent(self) -> str:
    return self.when_absent or f'has no {self.name}: it starts afresh'


# ---------------------------------------------------------------------------------------------
# The compute copy of the parameters
# ---------------------------------------------------------------------------------------------
# In bfloat16 the model reads most weights as `promote_dtype(x, kernel)`: a float32 -> bfloat16
# convert of every weight at the start of every step, one small kernel each on a GPU (66 for
# BERT-base), reading 4 bytes a parameter and writing 2, and the bfloat16 copies live through
# the backward anyway. The state keeps those copies instead, written by the optimizer's update
# in the kernels that write the float32 master. Only a parameter whose single use is that one
# cast qualifies: its forward reads the same values and its gradient is the same bfloat16
# cotangent cast to float32, so the step is bit-identical (with rematerialized layers, up to a
# bfloat16 rounding of a gradient that XLA's excess precision may skip in one program and keep
# in the other; tests/train_state_test.py). A parameter read twice (the tied word embeddings:
# the lookup and the MLM decoder) keeps its float32 read, so that its two cotangents still add
# up in float32; one read in float32 (LayerNorm, the biases the fused LayerNorm adds, the
# position embeddings) or in a loop's carry is left as it is.
#
# Which parameters qualify is read from the init's jaxpr, not listed by name: it is a property
# of how model.py reads each one (the token-type embeddings qualify, the position embeddings do
# not), which a list would restate and let go stale with every model option, and a wrong entry
# would not fail but change the numerics.

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
  one cast to a narrower float each, as ShapeDtypeStructs of that dtype: what the compute copy
  holds. `variables`: the jaxpr's variables of params' leaves, in order (by default its
  outputs: the jaxpr of an init that returns them)."""
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


def like(tree: Any, shapes: Any) -> Any:
  """The leaves of `tree` (nested dicts) at the paths of `shapes`'."""
  flat = traverse_util.flatten_dict(tree)
  return traverse_util.unflatten_dict({k: flat[k] for k in traverse_util.flatten_dict(shapes)})


def compute_copy(params: Any, shapes: Any) -> Any:
  """The compute copy of `params`: the leaves at the paths of `shapes` (a compute copy of
  arrays or ShapeDtypeStructs) cast to their dtypes."""
  flat = traverse_util.flatten_dict(params)
  return traverse_util.unflatten_dict({k: flat[k].astype(v.dtype) for k, v in
                                       traverse_util.flatten_dict(shapes).items()})


def _compute_copy_shapes(traced: Traced) -> Any:
  shapes = cast_only_params(traced.jaxpr, traced.variables['params'], traced.param_vars)
  return shapes if traverse_util.flatten_dict(shapes) else None  # None: a float32 model.


COMPUTE_COPY = Extra(
    name='compute_params', shapes=_compute_copy_shapes, init=compute_copy,
    specs=lambda shapes, param_specs: like(param_specs, shapes), saved=False,
    collection='params', update=lambda copy, params, _: compute_copy(params, copy))

# ---------------------------------------------------------------------------------------------
# FP8 scales and amax histories
# ---------------------------------------------------------------------------------------------
# Run state like the optimizer's (a resumed run continues them exactly), never weights: the
# model reads the scales `fp8.fp8_step_scales` computes from the histories, and the backward
# pass returns this step's amaxes, which `fp8.fp8_advance` rolls into the histories (with
# micro-batches, each one's state feeding the next). Two stacked arrays for all the matmuls of
# the encoder, so that these are a few kernels, not a few per matmul. Small: replicated, and
# every device updates them alike (the amax of a sharded tensor is a global max). A checkpoint
# without them (saved with FP8 off) resumes with fresh ones; a run with FP8 off leaves a
# checkpoint's unread. Checkpoints saved before 2026-12-01 hold them per matmul in flax's
# layout, as the item 'fp8_meta', which is not read: their FP8 scales start afresh.

FP8_SCALES = Extra(
    name='fp8_scales', shapes=lambda traced: traced.variables.get(model_lib.FP8_COLLECTION),
    init=lambda params, shapes: model_lib.initial_fp8_meta(shapes),
    specs=lambda shapes, param_specs: jax.tree.map(lambda _: P(), shapes), saved=True,
    collection=model_lib.FP8_COLLECTION, update=lambda meta, params, advanced: advanced,
    when_absent="has no FP8 scales (saved without model.matmul_precision='fp8', or before "
                "2026-12-01 as the item 'fp8_meta', which is not read): they start afresh",
    read=model_lib.fp8_step_scales, advance=model_lib.fp8_advance)

# Every declared extra; a model has those whose `shapes` it gives.
EXTRAS: tuple[Extra, ...] = (COMPUTE_COPY, FP8_SCALES)


def get(name: str) -> Extra:
  """The declared extra `name` (a key of `TrainState.extras`)."""
  for extra in EXTRAS:
    if extra.name == name:
      return extra
  raise KeyError(f'no extra of the train state is named {name!r}: {[e.name for e in EXTRAS]}')


def saved_names() -> tuple[str, ...]:
  """The checkpoint items of the saved extras (every declared one, whether a model has it or
  not: a checkpoint may hold one this run does not read)."""
  return tuple(e.name for e in EXTRAS if e.saved)
