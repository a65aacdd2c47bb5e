"""FP8 matmuls with delayed scaling: the encoder's dense layers in float8 (MATMUL_PRECISIONS).

The scales and amax histories, how a training step reads and advances them, the FP8 matmul
(`fp8_dot_general`) and the feed-forward block with its GELU and both quantizings in the GELU
kernels (`fp8_gelu_mlp`). `layers.py` applies them; `state_extras.FP8_SCALES` keeps the state.
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING, Any

from flax import traverse_util
import flax.linen as nn
from flax.linen import fp8_ops
import jax
import jax.numpy as jnp

from bert_jax import activations
from bert_jax import attention
from bert_jax import config_checks

if TYPE_CHECKING:
  from bert_jax.model import BertConfig  # pylint: disable=g-bad-import-order

Array = jax.Array

# How the encoder's dense matmuls (the one QKV projection, the attention output and the two MLP
# projections) run in training steps (`deterministic=False`):
# - 'default': in the compute dtype (`BertConfig.dtype`).
# - 'fp8': FP8 with delayed scaling (Transformer Engine's recipe, with the numerics of flax's
#   `Fp8DirectDotGeneralOp`): inputs and kernels in float8_e4m3fn, output gradients in
#   float8_e5m2, each scaled by the largest magnitude of the last FP8_AMAX_HISTORY steps. The
#   scales and amax histories of every FP8 matmul of the encoder are two stacked variables of
#   the FP8_COLLECTION collection at the encoder's scope, [layers, matmuls, 3] and [layers,
#   matmuls, 3, FP8_AMAX_HISTORY] (3: input, kernel, output gradient), so that a step updates
#   them all in a few kernels: `fp8_step_scales` before the model is applied, `fp8_advance`
#   after its backward pass, whose "gradient" of the collection is this step's amaxes
#   (`state_extras.FP8_SCALES`), never an optimizer update. flax's op keeps six variables per
#   matmul and updates each with kernels of its own (~640 tiny kernels a BERT-base step).
#   The amaxes come back as each tensor's largest magnitude per row of FP8_AMAX_ROWS rows, an
#   output gradient's per output feature (`amax_in`; the "gradient" of zeros, the amax slots,
#   that `fp8_step_scales` adds), and `fp8_advance`
#   reduces them all in one kernel: XLA reduces a large tensor to one value in two kernels,
#   the second a tiny one, 144 of them a BERT-base step.
#   The collection is bert_jax's own: its "gradient" is amaxes, not a new value, so flax's and
#   optax's helpers for overwrite-with-gradient collections must not take it.
#   With gelu_impl='pallas' the paper's MLP is one function (`fp8_gelu_mlp`) whose GELU kernels
#   write its [tokens, intermediate] tensors only in FP8, with their amaxes. With
#   layer_norm_impl='pallas' the post-LN layer's LayerNorm kernels likewise write the input of
#   the matmul after them in FP8 (`fp8_dot_general`'s x_quantized) and the output gradient of
#   the projection before them (its grad_channel), reading the scales in place from the table.
#   Hopper GPUs and later run these as FP8 GEMMs; elsewhere XLA emulates them (correct, slower).
MATMUL_PRECISIONS = config_checks.CHOICES['model.matmul_precision']
FP8_COLLECTION = 'fp8'
FP8_AMAX_HISTORY = 1024  # Transformer Engine's default history length.
# Rows of a tensor's amax slot: BERT-base/128's largest FP8 tensors (the MLP's [256 x 128,
# 3072] activation) reduce in rows of 12,288, which XLA does in one kernel with the tensor's
# quantizing (an output gradient per output feature, with its bias gradient: `amax_in`); and
# 4 bytes x 3 x 8,192 a matmul is small beside its kernels.
FP8_AMAX_ROWS = 8192
# The FP8 formats of a matmul's three tensors, in the order of the stacked variables' last axis.
FP8_TENSORS = (('input', jnp.float8_e4m3fn), ('kernel', jnp.float8_e4m3fn),
               ('output_grad', jnp.float8_e5m2))


def fp8_dot_general(x: Array, kernel: Array, dims, scales: Array,
                    amax_slots: Array | None = None, grad_channel: bool = False,
                    x_quantized: tuple[Array, Array] | None = None
                    ) -> Array | tuple[Array, tuple]:
  """`lax.dot_general(x, kernel, dims)` in FP8 with delayed scaling (see MATMUL_PRECISIONS),
  in the kernel's dtype: x and kernel quantized to e4m3 by `scales`[0] and [1], the output
  gradient to e5m2 by [2]. This step's amaxes of x, kernel and output gradient (what
  `fp8_advance` puts in the histories) are the "gradient" of `amax_slots` [3,
  FP8_AMAX_ROWS] (zeros: `fp8_step_scales`), each tensor's largest magnitude per row, the
  output gradient's per output feature (`amax_in`; `fp8_amaxes` reduces them); without slots,
  the "gradient" of `scales` [3], one value each.
  The numerics of flax's `Fp8DirectDotGeneralOp` given the scales it computes
  (`fp8_step_scales`).

  grad_channel: return (y, channel), the channel (a carrier [y.shape] of the output
  gradient's FP8 format, a carrier of its amax slot's shape) for the fused LayerNorm that y
  goes to (`layer_norm.residual_layer_norm`'s fp8_grad, with scales[2]): its backward kernel
  writes the output gradient quantized, and the carriers' cotangents bring it and its amax
  here, so that no pass of its own quantizes it. y's own cotangent is then not read.
  x_quantized: (x quantized by scales[0], amaxes of x by blocks) as the fused LayerNorm that
  computed x wrote them (`layer_norm.residual_layer_norm`'s fp8_out): used instead of
  quantizing x here. Not differentiated: x's gradient is returned to x.
  """
  # Each scale and slot apart, [1] and [1, rows] (flax's variables are [1]). Without slots the
  # scales stand in for them: their gradient as scales is zero, as slots the amaxes.
  split = lambda a: jax.lax.split(a, [1] * len(FP8_TENSORS))
  given = None if x_quantized is None else jax.lax.stop_gradient(tuple(x_quantized))
  return _fp8_dot(jnp.asarray(x, kernel.dtype), kernel, *split(scales),
                  *split(scales if amax_slots is None else amax_slots), given, dims,
                  grad_channel)


def _amax_as(t: Array, slot: Array) -> Array:
  """The largest magnitude of `t`, in `slot`'s shape and dtype (`amax_in`)."""
  return amax_in(t, slot.shape).astype(slot.dtype)


def amax_in(t: Array, shape: tuple[int, ...], feature_axes: int = 0) -> Array:
  """The largest magnitude of `t` as an amax slot of `shape` holds it, float32: [1], one
  value; [1, rows], one per row of `rows` equal rows (fewer where `rows` does not divide t's
  size: zeros after them, which no amax is below). feature_axes=k: [1, rows] holds instead
  one per element of t's last k axes, the max over the others (where `rows` holds them;
  else by rows): a dense layer's bias gradient reduces its output gradient over the same
  axes, and XLA then computes both, and the quantizing, in one pass over it (by rows, the
  amax is a pass of its own). Reduced over t's own axes, not a reshape of them, so that a
  feature axis sharded over the mesh stays sharded."""
  a = jnp.abs(t).astype(jnp.float32)
  if len(shape) == 1:
    return jnp.max(a).reshape(shape)
  rows = math.prod(t.shape[t.ndim - feature_axes:])
  if 0 < feature_axes < t.ndim and rows <= shape[-1]:
    partial = jnp.max(a, axis=tuple(range(t.ndim - feature_axes))).reshape(rows)
  else:
    rows = math.gcd(t.size, shape[-1])
    partial = jnp.max(a.reshape(rows, t.size // rows), axis=1)
  if rows < shape[-1]:
    partial = jnp.pad(partial, (0, shape[-1] - rows))
  return partial.reshape(shape)


def _fp8_matmul(qa: Array, qb: Array, dims, scale: Array, dtype) -> Array:
  """The FP8 GEMM of quantized operands, dequantized by the product of their scales."""
  y = jax.lax.dot_general(qa, qb, dims, preferred_element_type=dtype,
                          precision=jax.lax.Precision.DEFAULT)
  return fp8_ops.dequantize(y, dtype, scale)


def _fp8_matmul_grads(qg: Array, qx: Array, qk: Array, dims, x_scale: Array,
                      kernel_scale: Array, grad_scale: Array, dtype) -> tuple[Array, Array]:
  """The input and kernel gradients of `_fp8_matmul(qx, qk, dims, ...)` from its quantized
  output gradient `qg`, as FP8 GEMMs dequantized in `dtype` (flax's transposes)."""
  kw = dict(dimension_numbers=dims, precision=jax.lax.Precision.HIGHEST,
            preferred_element_type=dtype)
  dx = fp8_ops.dot_general_transpose_lhs(qg, qx, qk, **kw)
  dk = fp8_ops.dot_general_transpose_rhs(qg, qx, qk, **kw)
  return (fp8_ops.dequantize(dx, dtype, kernel_scale * grad_scale),
          fp8_ops.dequantize(dk, dtype, x_scale * grad_scale))


@functools.partial(jax.custom_vjp, nondiff_argnums=(9, 10))
def _fp8_dot(x: Array, kernel: Array, x_scale: Array, kernel_scale: Array, grad_scale: Array,
             x_slot: Array, kernel_slot: Array, grad_slot: Array, given, dims, channel: bool):
  return _fp8_dot_fwd(x, kernel, x_scale, kernel_scale, grad_scale, x_slot, kernel_slot,
                      grad_slot, given, dims, channel)[0]


def _quantized_grad(g: Array, scale: Array, slot: Array, feature_axes: int
                    ) -> tuple[Array, Array]:
  """(An output gradient quantized to e5m2 by `scale`, its amax as `slot` holds it): the
  amax per element of g's last `feature_axes` axes, the output features, over which the bias
  gradient reduces g too (`amax_in`), so that XLA reads g once for all three."""
  amax = amax_in(g, (1,) + slot.shape[-1:], feature_axes).reshape(slot.shape)
  return fp8_ops.quantize(g, FP8_TENSORS[2][1], scale, g.dtype), amax.astype(slot.dtype)


def _grad_channel(y: Array, grad_slot: Array) -> tuple:
  """fp8_dot_general's grad_channel: a zeros carrier of the quantized gradient and the slot
  itself as its amax's carrier (their values are never read)."""
  return jnp.zeros(y.shape, FP8_TENSORS[2][1]), grad_slot


def _quantized_input(x: Array, scale: Array, slot: Array, given) -> tuple[Array, Array]:
  """(x quantized to e4m3 by `scale`, its amax as `slot` holds it): quantized here, or as the
  kernel that wrote x gave them (`given`: (quantized x, amaxes by blocks))."""
  if given is not None:
    qx, parts = given
    return qx, amax_in(parts, slot.shape).astype(slot.dtype)
  return fp8_ops.quantize(x, FP8_TENSORS[0][1], scale, x.dtype), _amax_as(x, slot)


def _fp8_dot_fwd(x, kernel, x_scale, kernel_scale, grad_scale, x_slot, kernel_slot, grad_slot,
                 given, dims, channel):
  dtype = kernel.dtype
  (_, e4m3), _, _ = FP8_TENSORS
  qx, x_amax = _quantized_input(x, x_scale, x_slot, given)
  qk = fp8_ops.quantize(kernel, e4m3, kernel_scale, dtype)
  y = _fp8_matmul(qx, qk, dims, x_scale * kernel_scale, dtype)
  # (The slots' values are never read: the output gradient's slot comes along for its shape.)
  out = (y, _grad_channel(y, grad_slot)) if channel else y
  return out, (qx, qk, x_scale, kernel_scale, grad_scale, x_amax,
               _amax_as(kernel, kernel_slot), grad_slot, given)


def _fp8_dot_bwd(dims, channel, res, g):
  qx, qk, x_scale, kernel_scale, grad_scale, x_amax, kernel_amax, grad_slot, given = res
  if channel:  # The LayerNorm's backward kernel quantized the gradient (fp8_dot_general).
    g, (qg, g_amax) = g
  else:
    # Per output feature: the kernel's free axes, g's last.
    qg, g_amax = _quantized_grad(g, grad_scale, grad_slot,
                                 qk.ndim - len(dims[0][1]) - len(dims[1][1]))
  dtype = g.dtype  # The output's, the kernel's dtype.
  dx, dk = _fp8_matmul_grads(qg, qx, qk, dims, x_scale, kernel_scale, grad_scale, dtype)
  zero = jnp.zeros_like(x_scale)
  # The scales' "gradients": none; the slots': this step's amaxes.
  return (dx, dk, zero, zero, zero, x_amax, kernel_amax, g_amax,
          jax.tree.map(jnp.zeros_like, given))


_fp8_dot.defvjp(_fp8_dot_fwd, _fp8_dot_bwd)

# The encoder's FP8 variables (FP8_COLLECTION): [layers, matmuls, 3] scales and, beside them,
# [layers, matmuls, 3, FP8_AMAX_HISTORY] amax histories, newest first; in a training step also
# [layers, matmuls, 3, FP8_AMAX_ROWS] amax slots (`fp8_step_scales`), never part of the state.
FP8_SCALE, FP8_HISTORY, FP8_AMAX_SLOTS = 'fp8_scale', 'fp8_amax_history', 'fp8_amax_slots'
_FP8_MAX = tuple(float(jnp.finfo(t).max) for _, t in FP8_TENSORS)


def _next_scales(scale: Array, history: Array) -> Array:
  """flax's `compute_scale` of each history's largest amax (the previous scale where that is 0
  or not finite), for every matmul and tensor at once."""
  return fp8_ops.compute_scale(jnp.max(history, axis=-1), scale,
                               jnp.asarray(_FP8_MAX, jnp.float32))


def fp8_step_scales(meta: Any) -> Any:
  """The FP8 collection a training step applies the model to: `meta` (the state's, as
  `model.initial_fp8_meta` makes it and `fp8_advance` continues it) with each scale computed
  from its amax history, as flax's op computes it at the start of its forward pass, and the
  amax slots (zeros) whose "gradient" is this step's amaxes (`fp8_dot_general`)."""
  flat = traverse_util.flatten_dict(meta)
  out = {}
  for k, v in flat.items():
    if k[-1] == FP8_SCALE:
      out[k] = _next_scales(v, flat[k[:-1] + (FP8_HISTORY,)])
      out[k[:-1] + (FP8_AMAX_SLOTS,)] = jnp.zeros(v.shape + (FP8_AMAX_ROWS,), jnp.float32)
    else:
      out[k] = v
  return traverse_util.unflatten_dict(out)


def fp8_amaxes(grads: Any) -> Any:
  """This step's amax of every FP8 tensor, [layers, matmuls, 3] under each scale's key, from
  the backward pass's "gradient" of the collection (`fp8_dot_general`): the largest of its
  amax slots' rows, or where a matmul was given no slots the scales' own (the other is
  zero)."""
  flat = traverse_util.flatten_dict(grads)
  amax = lambda k: (flat[k] if k[:-1] + (FP8_AMAX_SLOTS,) not in flat else jnp.maximum(
      flat[k], jnp.max(flat[k[:-1] + (FP8_AMAX_SLOTS,)], axis=-1)))
  return traverse_util.unflatten_dict({k: amax(k) for k in flat if k[-1] == FP8_SCALE})


def fp8_advance(stepped: Any, grads: Any) -> Any:
  """The FP8 state after a step (or micro-batch) applied to `stepped` (`fp8_step_scales`'
  result): its scales, and each history rolled with this step's amax in front (flax's
  `update_fp8_meta`); the slots are not state. `grads`: what the backward pass returned for
  the collection (`fp8_amaxes`)."""
  flat = traverse_util.flatten_dict(stepped)
  got = traverse_util.flatten_dict(fp8_amaxes(grads))
  return traverse_util.unflatten_dict({
      k: jnp.roll(v, -1, axis=-1).at[..., 0].set(got[k[:-1] + (FP8_SCALE,)])
      if k[-1] == FP8_HISTORY else v
      for k, v in flat.items() if k[-1] != FP8_AMAX_SLOTS})


def fp8_rows(fp8: tuple, n: int) -> list[tuple]:
  """(scales, amax slots or None), each split along its first axis into `n` rows."""
  scales, slots = fp8
  rows = lambda a: [r[0] for r in jax.lax.split(a, [1] * n)]
  return list(zip(rows(scales), [None] * n if slots is None else rows(slots)))


def fp8_matmuls_per_layer(config: BertConfig) -> int:
  """The encoder layer's FP8 matmuls: the attention's input projection(s) (one stacked QKV
  or three), its output, the MLP's input (one, gated or not) and output."""
  return (3 if config.qkv_projection == 'separate' else 1) + 3


def use_fp8(module: nn.Module, config: BertConfig, deterministic: bool) -> bool:
  """Whether `module`'s encoder matmuls run in FP8: with matmul_precision='fp8', in training
  (and at init, which creates their scales), never in evaluation or prediction."""
  return config.matmul_precision == 'fp8' and (not deterministic or module.is_initializing())


# jax's Pallas lowering through Triton converts to float8_e4m3fn only from compute capability
# 8.9 on, and XLA runs FP8 GEMMs from Hopper (9.0) on; before that XLA emulates the FP8 dots
# and the unfused layers quantize.
GELU_FP8_MIN_CAPABILITY = (9, 0)


def gelu_kernels_can_quantize() -> bool:
  """Whether `fp8_gelu_mlp`'s GELU kernels can write FP8 where the model is lowered for: a GPU
  of GELU_FP8_MIN_CAPABILITY or later (or one that names none: a compile for a GPU not named),
  or elsewhere, where Pallas interprets them (tests)."""
  if attention.target_platform() != 'gpu':
    return True
  capability = attention.target_compute_capability()
  return capability is None or capability >= GELU_FP8_MIN_CAPABILITY


def _amax_like(t: Array, slot: Array) -> Array:
  """`_amax_as` for one tensor's slot without its leading [1]: [] one value, [rows] per row."""
  return _amax_as(t, slot.reshape((1,) + slot.shape)).reshape(slot.shape)


def fp8_gelu_mlp(x: Array, kernel_in: Array, bias_in: Array, kernel_out: Array,
                 fp8_in: tuple, fp8_out: tuple, *, axes: tuple[str | None, ...],
                 interpret: bool, grad_channel: bool = False,
                 x_quantized: tuple[Array, Array] | None = None,
                 kernel_scales: tuple[Array, int, int] | None = None
                 ) -> Array | tuple[Array, tuple]:
  """gelu(x @ kernel_in + bias_in) @ kernel_out, both matmuls in FP8 as `fp8_dot_general`
  computes them, with the GELU's Pallas kernels (`activations.bias_gelu_fp8`) writing the
  quantized tensors: the forward writes gelu's output only in FP8 (the second matmul's
  input) and its amax, the backward the first matmul's output gradient only in FP8 and its
  amax. Unfused, each of those [tokens, intermediate] tensors is written in the compute dtype,
  read again and written in FP8 by a quantizing kernel of its own: two passes of the MLP's
  largest tensors fewer per layer each way. Numerics: `fp8_dot_general` + `bias_gelu`'s Pallas
  kernels.

  fp8_in, fp8_out: each matmul's (scales [3], amax slots [3, FP8_AMAX_ROWS] or None), as
  `fp8_dot_general` takes them. kernel_in/out in the compute dtype; bias_in float32; axes: the
  logical axes of the intermediate activation (the GELU kernels run under the mesh with
  them); interpret: Pallas' interpreter (not a GPU); grad_channel: the second matmul's,
  x_quantized: the first's, as `fp8_dot_general` has them; kernel_scales: (a 1-D table of
  scales, the index of the second matmul's input scale in it, that of the first's output
  gradient scale), which the GELU kernels read in place (a slice of a scale given to a kernel
  is a copy kernel of its own), or None (they read fp8_out's and fp8_in's)."""
  (s1, slots1), (s2, slots2) = fp8_in, fp8_out
  if kernel_scales is None:
    kernel_scales = (jnp.stack([s2[0], s1[2]]), 0, 1)
  table, fwd_index, bwd_index = kernel_scales
  return _gelu_mlp(jnp.asarray(x, kernel_in.dtype), kernel_in, bias_in.astype(jnp.float32),
                   kernel_out, s1, s2, s1 if slots1 is None else slots1,
                   s2 if slots2 is None else slots2,
                   None if x_quantized is None else jax.lax.stop_gradient(tuple(x_quantized)),
                   jax.lax.stop_gradient(table), tuple(axes), interpret, grad_channel,
                   (int(fwd_index), int(bwd_index)))


@functools.partial(jax.custom_vjp, nondiff_argnums=(10, 11, 12, 13))
def _gelu_mlp(x, k1, b1, k2, s1, s2, slots1, slots2, given, table, axes, interpret, channel,
              indices):
  return _gelu_mlp_fwd(x, k1, b1, k2, s1, s2, slots1, slots2, given, table, axes, interpret,
                       channel, indices)[0]


def _mlp_dims(x: Array):
  return (((x.ndim - 1,), (0,)), ((), ()))


def _gelu_mlp_fwd(x, k1, b1, k2, s1, s2, slots1, slots2, given, table, axes, interpret,
                  channel, indices):
  dtype = k1.dtype
  (_, e4m3), _, _ = FP8_TENSORS
  with jax.named_scope('intermediate'):  # The scopes of the unfused layers' kernels.
    qx, x_amax = _quantized_input(x, s1[:1], slots1[:1], given)
    qk1 = fp8_ops.quantize(k1, e4m3, s1[1], dtype)
    y1 = _fp8_matmul(qx, qk1, _mlp_dims(x), s1[0] * s1[1], dtype)
    qh, h_amax = activations.bias_gelu_fp8(y1, b1, table, e4m3, axes=axes,
                                           interpret=interpret, scale_index=indices[0])
  with jax.named_scope('output'):
    qk2 = fp8_ops.quantize(k2, e4m3, s2[1], dtype)
    y2 = _fp8_matmul(qh, qk2, _mlp_dims(qh), s2[0] * s2[1], dtype)
  amaxes = (x_amax.reshape(slots1[0].shape), _amax_like(k1, slots1[1]),
            _amax_like(h_amax, slots2[0]), _amax_like(k2, slots2[1]))
  out = (y2, _grad_channel(y2, slots2[2:])) if channel else y2
  return out, (qx, qk1, y1, b1, qh, qk2, s1, s2, amaxes, slots1[2], slots2[2], given, table)


def _gelu_mlp_bwd(axes, interpret, channel, indices, res, g):
  qx, qk1, y1, b1, qh, qk2, s1, s2, amaxes, grad_slot1, grad_slot2, given, table = res
  dtype = y1.dtype
  e5m2 = FP8_TENSORS[2][1]
  with jax.named_scope('output'):
    if channel:  # The LayerNorm's backward kernel quantized the gradient (fp8_dot_general).
      _, (qg2, g2_amax) = g
    else:
      qg2, g2_amax = _quantized_grad(g, s2[2], grad_slot2, 1)
    dh, dk2 = _fp8_matmul_grads(qg2, qh, qk2, _mlp_dims(qh), s2[0], s2[1], s2[2], dtype)
  with jax.named_scope('intermediate'):
    qg1, db1, g1_amax = activations.bias_gelu_fp8_grad(y1, b1, dh, table, e5m2, axes=axes,
                                                       interpret=interpret,
                                                       scale_index=indices[1])
    dx, dk1 = _fp8_matmul_grads(qg1, qx, qk1, _mlp_dims(qx), s1[0], s1[1], s1[2], dtype)
  x_amax, k1_amax, h_amax, k2_amax = amaxes
  # The scales' "gradients": none; the slots': this step's amaxes (as `fp8_dot_general`'s).
  return (dx, dk1, db1, dk2, jnp.zeros_like(s1), jnp.zeros_like(s2),
          jnp.stack([x_amax, k1_amax, _amax_like(g1_amax, grad_slot1)]),
          jnp.stack([h_amax, k2_amax, g2_amax.reshape(grad_slot2.shape).astype(
              grad_slot2.dtype)]), jax.tree.map(jnp.zeros_like, given), jnp.zeros_like(table))


_gelu_mlp.defvjp(_gelu_mlp_fwd, _gelu_mlp_bwd)
