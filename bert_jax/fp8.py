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
#   The amaxes come back as each tensor's largest magnitude per row of FP8_AMAX_ROWS rows (the
#   "gradient" of zeros, the amax slots, that `fp8_step_scales` adds), and `fp8_advance`
#   reduces them all in one kernel: XLA reduces a large tensor to one value in two kernels,
#   the second a tiny one, 144 of them a BERT-base step.
#   The collection is bert_jax's own: its "gradient" is amaxes, not a new value, so flax's and
#   optax's helpers for overwrite-with-gradient collections must not take it.
#   With gelu_impl='pallas' the paper's MLP is one function (`fp8_gelu_mlp`) whose GELU kernels
#   write its [tokens, intermediate] tensors only in FP8, with their amaxes.
#   Hopper GPUs and later run these as FP8 GEMMs; elsewhere XLA emulates them (correct, slower).
MATMUL_PRECISIONS = config_checks.CHOICES['model.matmul_precision']
FP8_COLLECTION = 'fp8'
FP8_AMAX_HISTORY = 1024  # Transformer Engine's default history length.
# Rows of a tensor's amax slot: BERT-base/128's largest FP8 tensors (the MLP's [256 x 128,
# 3072] activation and its gradient) reduce in rows of 12,288, which XLA does in one kernel
# with the tensor's quantizing; and 4 bytes x 3 x 8,192 a matmul is small beside its kernels.
FP8_AMAX_ROWS = 8192
# The FP8 formats of a matmul's three tensors, in the order of the stacked variables' last axis.
FP8_TENSORS = (('input', jnp.float8_e4m3fn), ('kernel', jnp.float8_e4m3fn),
               ('output_grad', jnp.float8_e5m2))


def fp8_dot_general(x: Array, kernel: Array, dims, scales: Array,
                    amax_slots: Array | None = None) -> Array:
  """`lax.dot_general(x, kernel, dims)` in FP8 with delayed scaling (see MATMUL_PRECISIONS),
  in the kernel's dtype: x and kernel quantized to e4m3 by `scales`[0] and [1], the output
  gradient to e5m2 by [2]. This step's amaxes of x, kernel and output gradient (what
  `fp8_advance` puts in the histories) are the "gradient" of `amax_slots` [3,
  FP8_AMAX_ROWS] (zeros: `fp8_step_scales`), each tensor's largest magnitude per row
  (`fp8_amaxes` reduces them); without slots, the "gradient" of `scales` [3], one value each.
  The numerics of flax's `Fp8DirectDotGeneralOp` given the scales it computes
  (`fp8_step_scales`)."""
  # Each scale and slot apart, [1] and [1, rows] (flax's variables are [1]). Without slots the
  # scales stand in for them: their gradient as scales is zero, as slots the amaxes.
  split = lambda a: jax.lax.split(a, [1] * len(FP8_TENSORS))
  return _fp8_dot(jnp.asarray(x, kernel.dtype), kernel, *split(scales),
                  *split(scales if amax_slots is None else amax_slots), dims)


def _amax_as(t: Array, slot: Array) -> Array:
  """The largest magnitude of `t`, in `slot`'s shape and dtype: [1], one value; [1, rows],
  one per row of `rows` equal rows (fewer where `rows` does not divide t's size: zeros after
  them, which no amax is below)."""
  a = jnp.abs(t)
  if slot.ndim == 1:
    return jnp.max(a).astype(slot.dtype).reshape(slot.shape)
  rows = math.gcd(t.size, slot.shape[-1])
  partial = jnp.max(a.reshape(rows, t.size // rows), axis=1).astype(slot.dtype)
  if rows < slot.shape[-1]:
    partial = jnp.pad(partial, (0, slot.shape[-1] - rows))
  return partial.reshape(slot.shape)


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


@functools.partial(jax.custom_vjp, nondiff_argnums=(8,))
def _fp8_dot(x: Array, kernel: Array, x_scale: Array, kernel_scale: Array, grad_scale: Array,
             x_slot: Array, kernel_slot: Array, grad_slot: Array, dims) -> Array:
  return _fp8_dot_fwd(x, kernel, x_scale, kernel_scale, grad_scale, x_slot, kernel_slot,
                      grad_slot, dims)[0]


def _fp8_dot_fwd(x, kernel, x_scale, kernel_scale, grad_scale, x_slot, kernel_slot, grad_slot,
                 dims):
  dtype = kernel.dtype
  (_, e4m3), _, _ = FP8_TENSORS
  qx = fp8_ops.quantize(x, e4m3, x_scale, dtype)
  qk = fp8_ops.quantize(kernel, e4m3, kernel_scale, dtype)
  y = _fp8_matmul(qx, qk, dims, x_scale * kernel_scale, dtype)
  # (The slots' values are never read: the output gradient's slot comes along for its shape.)
  return y, (qx, qk, x_scale, kernel_scale, grad_scale, _amax_as(x, x_slot),
             _amax_as(kernel, kernel_slot), grad_slot)


def _fp8_dot_bwd(dims, res, g):
  qx, qk, x_scale, kernel_scale, grad_scale, x_amax, kernel_amax, grad_slot = res
  dtype = g.dtype  # The output's, the kernel's dtype.
  qg = fp8_ops.quantize(g, FP8_TENSORS[2][1], grad_scale, dtype)
  dx, dk = _fp8_matmul_grads(qg, qx, qk, dims, x_scale, kernel_scale, grad_scale, dtype)
  zero = jnp.zeros_like(x_scale)
  # The scales' "gradients": none; the slots': this step's amaxes.
  return dx, dk, zero, zero, zero, x_amax, kernel_amax, _amax_as(g, grad_slot)


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
                 interpret: bool) -> Array:
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
  them); interpret: Pallas' interpreter (not a GPU)."""
  (s1, slots1), (s2, slots2) = fp8_in, fp8_out
  return _gelu_mlp(jnp.asarray(x, kernel_in.dtype), kernel_in, bias_in.astype(jnp.float32),
                   kernel_out, s1, s2, s1 if slots1 is None else slots1,
                   s2 if slots2 is None else slots2, tuple(axes), interpret)


@functools.partial(jax.custom_vjp, nondiff_argnums=(8, 9))
def _gelu_mlp(x, k1, b1, k2, s1, s2, slots1, slots2, axes, interpret):
  return _gelu_mlp_fwd(x, k1, b1, k2, s1, s2, slots1, slots2, axes, interpret)[0]


def _mlp_dims(x: Array):
  return (((x.ndim - 1,), (0,)), ((), ()))


def _gelu_mlp_fwd(x, k1, b1, k2, s1, s2, slots1, slots2, axes, interpret):
  dtype = k1.dtype
  (_, e4m3), _, _ = FP8_TENSORS
  with jax.named_scope('intermediate'):  # The scopes of the unfused layers' kernels.
    qx = fp8_ops.quantize(x, e4m3, s1[0], dtype)
    qk1 = fp8_ops.quantize(k1, e4m3, s1[1], dtype)
    y1 = _fp8_matmul(qx, qk1, _mlp_dims(x), s1[0] * s1[1], dtype)
    qh, h_amax = activations.bias_gelu_fp8(y1, b1, s2[:1], e4m3, axes=axes,
                                           interpret=interpret)
  with jax.named_scope('output'):
    qk2 = fp8_ops.quantize(k2, e4m3, s2[1], dtype)
    y2 = _fp8_matmul(qh, qk2, _mlp_dims(qh), s2[0] * s2[1], dtype)
  amaxes = (_amax_like(x, slots1[0]), _amax_like(k1, slots1[1]),
            _amax_like(h_amax, slots2[0]), _amax_like(k2, slots2[1]))
  return y2, (qx, qk1, y1, b1, qh, qk2, s1, s2, amaxes, slots1[2], slots2[2])


def _gelu_mlp_bwd(axes, interpret, res, g):
  qx, qk1, y1, b1, qh, qk2, s1, s2, amaxes, grad_slot1, grad_slot2 = res
  dtype = y1.dtype
  e5m2 = FP8_TENSORS[2][1]
  with jax.named_scope('output'):
    qg2 = fp8_ops.quantize(g, e5m2, s2[2], dtype)
    dh, dk2 = _fp8_matmul_grads(qg2, qh, qk2, _mlp_dims(qh), s2[0], s2[1], s2[2], dtype)
  with jax.named_scope('intermediate'):
    qg1, db1, g1_amax = activations.bias_gelu_fp8_grad(y1, b1, dh, s1[2:], e5m2, axes=axes,
                                                       interpret=interpret)
    dx, dk1 = _fp8_matmul_grads(qg1, qx, qk1, _mlp_dims(qx), s1[0], s1[1], s1[2], dtype)
  x_amax, k1_amax, h_amax, k2_amax = amaxes
  # The scales' "gradients": none; the slots': this step's amaxes (as `fp8_dot_general`'s).
  return (dx, dk1, db1, dk2, jnp.zeros_like(s1), jnp.zeros_like(s2),
          jnp.stack([x_amax, k1_amax, _amax_like(g1_amax, grad_slot1)]),
          jnp.stack([h_amax, k2_amax, _amax_like(g, grad_slot2)]))


_gelu_mlp.defvjp(_gelu_mlp_fwd, _gelu_mlp_bwd)
