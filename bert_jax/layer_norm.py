"""The post-LN sub-layer end, LayerNorm(residual + dropout(x + bias)), and cheap dropout masks.

Every encoder layer ends its attention and its MLP block with this expression. Written out in
jnp, XLA on a GPU runs it as several kernels each way (issue 30 measured ~8.7 ms of BERT-base's
58 ms step in LayerNorm forward and backward, residual adds, dropout selects and bias
gradients), the backward writing a float32 [tokens, hidden] tensor between them. Here it is one
function with one forward and one backward pass:

  forward    z = (x + bias) * keep / (1 - rate);  h = z + residual;
             y = (h - mean(h)) * rsqrt(var(h) + eps) * scale + beta
  backward   from dy: d residual = dh, dx = dh * keep / (1 - rate), and the partial sums of
             dbias, dscale, dbeta per block of rows (summed over the blocks afterwards);
             h and its statistics are recomputed from x, residual and the mask, so nothing
             float32 of [tokens, hidden] is kept.

With `residual_copy=True` the function returns y twice: once for the next sub-layer, once
as the residual of the LayerNorm after it. Each copy then gets its own gradient, and the
backward kernel reads both and adds them in registers, where autodiff would otherwise sum the
two in a separate [tokens, hidden] kernel between every two LayerNorm backward kernels (0.8 ms
of BERT-base's step on an H200, issue 45).

For FP8 matmuls (`fp8.py`) the Pallas kernels also quantize: the forward writes y in FP8 too
(the next matmul's input, `fp8_out`), the backward dx only in FP8 (the output gradient of the
projection that computed x, `fp8_grad`), each with its amax by blocks of rows: the values
flax's `fp8_ops.quantize` gives the rounded tensor, without a pass of their own.

Implementations (`model.layer_norm_impl`):
  xla     the formula in jnp (every backend, the reference in tests);
  pallas  one Pallas kernel each way, lowered through Triton on NVIDIA GPUs (in interpret mode
          elsewhere, which is for tests only: slow).
A config's 'auto' is pallas for GPUs, xla elsewhere: `model.resolve` decides, for the platform a
step runs on or is compiled for.
Both compute in float32 (statistics, affine and the dropout scale) and return the compute
dtype, so they agree to float32 rounding.

Dropout masks come from a seed, not from a tensor of random bits: `dropout_seed` takes two
32-bit words from the model's 'dropout' rng (which the train step folds with the step number,
so a resumed run draws exactly the masks of an uninterrupted one), and each element's byte is
a hash of (seed, row, column) (`mask_bytes`: murmur3's 32-bit finalizer, twice; rows are the
flattened leading axes, counted over the whole array also when a mesh splits it). The Pallas
kernels compute it in registers, forward and backward; the jnp path computes the same bytes,
which XLA fuses into its LayerNorm. No random-bits kernels, no 1-byte mask written, kept or read
(issue 45: ~10 kernels per encoder layer before). An element is kept iff its byte is >=
round(256 * rate), so the rate applied is that threshold / 256: 0.1 becomes 26/256 = 0.1015625
(never off by more than 1/512), and kept values are scaled by 256 / (256 - threshold), the exact
inverse of the keep probability, so the expectation is unchanged. Masks are multiplied in, never
selected against a tensor of zeros.
"""

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from bert_jax import activations
from bert_jax import attention
from bert_jax import config_checks
from bert_jax import fp8

Array = jax.Array

# model.layer_norm_impl's values but 'auto', which `model.resolve` turns into one of them.
IMPLEMENTATIONS = tuple(i for i in config_checks.CHOICES['model.layer_norm_impl'] if i != 'auto')
# Tiling (benchmarks/layernorm.py --rows_per_program sweeps it on a GPU). The forward handles
# _FWD_ROWS rows per program as one [rows, next_power_of_2(H)] tile: every load of a program
# issued at once, no loop. The backward walks _BWD_ROWS rows per program in tiles of _BWD_TILE
# rows, loads of the next tile in flight while one computes (num_stages=2), and writes one
# partial sum of dbias, dscale and dbeta per program: more rows per program, fewer partials.
# Measured (one H100, jax 0.11.2, 2026-11-28, `benchmarks/layernorm.py --iters=10
# --rows_per_program=1:16:1,4:64:4,8:128:8,16:128:8`, benchmarks/results/
# h100_2026-11-28_layernorm.jsonl), forward + backward of [32768, H] bf16 at dropout 0.1 in ms:
#   H = 768:  1:16:1 0.453, 4:64:4 0.553, 8:128:8 0.417, 16:128:8 0.450 (xla 0.590);
#   H = 1024: 1:16:1 0.516, 4:64:4 0.518, 8:128:8 0.464, 16:128:8 0.451 (xla 0.753).
# 8:128:8 is the best at 768 and 3% off the best at 1024: the default for both (4:64:4,
# chosen from bytes in flight before any GPU ran it, is what the step of that day ran).
_FWD_ROWS = 8
_BWD_ROWS = 128
_BWD_TILE = 8


# ---------------------------------------------------------------------------------------------
# Dropout masks
# ---------------------------------------------------------------------------------------------


def keep_threshold(rate: float) -> int:
  """The byte value below which an element is dropped: round(256 * rate), within [0, 255]."""
  if not 0.0 <= rate < 1.0:
    raise ValueError(f'dropout rate {rate} is not in [0, 1)')
  return min(int(round(256 * rate)), 255)


def dropout_seed(rng: Array) -> Array:
  """uint32[2]: the words of a dropout mask's seed, from a JAX PRNG key (typed or raw). A
  threefry key's seed is its two words. Longer keys are folded into two: the first pair of
  words xor the murmur3-mixed later pairs. A plain xor of the pairs, as before, cancelled out
  for 'rbg' keys, whose two halves are equal (jax.random derives both with threefry from the
  same words, through every fold_in): every key gave 0, and every step and layer of a
  one-device run (train.rng_impl='auto' picks rbg there) drew the same hidden-dropout masks."""
  data = jax.random.key_data(rng) if jnp.issubdtype(rng.dtype, jax.dtypes.prng_key) else rng
  data = data.reshape(-1).astype(jnp.uint32)
  if data.size < 2 or data.size % 2:
    raise ValueError(f'a PRNG key of {data.size} words cannot seed dropout')
  pairs = data.reshape(-1, 2)
  seed = pairs[0]
  for i in range(1, pairs.shape[0]):
    seed = seed ^ _fmix32(pairs[i] + jnp.uint32(i * 0x9E3779B9 % 2**32))
  return seed


def _fmix32(h: Array) -> Array:
  """murmur3's 32-bit finalizer: every input bit flips each output bit with probability ~1/2."""
  h = h ^ (h >> 16)
  h = h * jnp.uint32(0x85EBCA6B)
  h = h ^ (h >> 13)
  h = h * jnp.uint32(0xC2B2AE35)
  return h ^ (h >> 16)


def mask_bytes(seed0: Array, seed1: Array, rows: Array, cols: Array) -> Array:
  """The dropout byte (uint32 in [0, 256)) of each element at (rows, cols) (broadcasting
  uint32 arrays; rows counted over the whole array): the Pallas kernels and the jnp path
  evaluate this same function."""
  per_row = _fmix32(rows ^ seed0)
  return _fmix32((per_row + cols * jnp.uint32(0x9E3779B9)) ^ seed1) >> 24


def _multiplier(byte: Array, t: int) -> Array:
  """float32 keep / (1 - effective rate) (0 where dropped) for threshold t > 0."""
  return jnp.where(byte >= t, 256.0 / (256 - t), 0.0).astype(jnp.float32)


def _keep_multiplier(seed: Array, shape: tuple[int, ...], rate: float) -> Array:
  """float32 [*shape] keep / (1 - effective rate) of the whole array's mask from `seed`."""
  n_rows = 1
  for d in shape[:-1]:
    n_rows *= d
  rows = jax.lax.broadcasted_iota(jnp.uint32, (n_rows, shape[-1]), 0)
  cols = jax.lax.broadcasted_iota(jnp.uint32, (n_rows, shape[-1]), 1)
  byte = mask_bytes(seed[0], seed[1], rows, cols)
  return _multiplier(byte, keep_threshold(rate)).reshape(shape)


def dropout(x: Array, seed: Array | None, rate: float) -> Array:
  """x * keep / (1 - rate) with the mask of `seed` (`dropout_seed`), in float32, returned in
  x.dtype."""
  if seed is None or keep_threshold(rate) == 0:
    return x
  return (x.astype(jnp.float32) * _keep_multiplier(seed, x.shape, rate)).astype(x.dtype)


# ---------------------------------------------------------------------------------------------
# The reference in jnp
# ---------------------------------------------------------------------------------------------


def _pre_norm(x, residual, bias, seed, rate, dtype):
  """residual + dropout(x + bias), summed in `dtype`."""
  z = x.astype(dtype)
  if bias is not None:
    z = z + bias.astype(dtype)
  if seed is not None and keep_threshold(rate):
    z = z * _keep_multiplier(seed, x.shape, rate).astype(dtype)
  return z + residual.astype(dtype)


def residual_add(x: Array, residual: Array, bias: Array | None, seed: Array | None,
                 rate: float) -> Array:
  """residual + dropout(x + bias), the sum `residual_layer_norm` normalizes (the same mask for
  the same `seed`), in x's dtype: a pre-LN layer's residual stream (its LayerNorm of the same
  sum is the fused op)."""
  return _pre_norm(x, residual, bias, seed, rate, x.dtype)


def _xla(x, residual, bias, scale, beta, seed, *, rate, eps, out_dtype):
  # The sum in the compute dtype (bf16), statistics in float32, as flax's Dense, Dropout and
  # LayerNorm did: a float32 sum here makes XLA keep and move float32 [tokens, hidden]
  # tensors (BERT-base/128 on an H100, deviceless: 65.1 GB moved by non-matmul kernels and
  # 13.15 GiB, against 58.4 GB and 12.02 GiB this way). The Pallas kernel sums in float32
  # in registers, where it costs nothing.
  dtype = x.dtype if residual.dtype == x.dtype else jnp.float32
  h = _pre_norm(x, residual, bias, seed, rate, dtype).astype(jnp.float32)
  mean = jnp.mean(h, axis=-1, keepdims=True)
  var = jnp.mean(jnp.square(h - mean), axis=-1, keepdims=True)
  y = (h - mean) * jax.lax.rsqrt(var + eps) * scale.astype(jnp.float32) + beta.astype(
      jnp.float32)
  return y.astype(out_dtype)


# ---------------------------------------------------------------------------------------------
# The Pallas kernels (Triton lowering): rows of a [N, H] problem, flattened to 1-D refs
# ---------------------------------------------------------------------------------------------
# Triton tiles are powers of two: a row is loaded as a block of next_power_of_2(H) lanes, the
# lanes past H masked (loaded as 0, never stored), and rows past N likewise, so any hidden size
# and any number of rows works (tests run H = 24, 64 with odd N).


def _load(ref, idx, mask):
  from jax.experimental.pallas import triton as plgpu  # pylint: disable=g-import-not-at-top
  return plgpu.load(ref.at[idx], mask=mask, other=0).astype(jnp.float32)


def _store(ref, idx, value, mask):
  from jax.experimental.pallas import triton as plgpu  # pylint: disable=g-import-not-at-top
  plgpu.store(ref.at[idx], value.astype(ref.dtype), mask=mask)


def _tile(first_row, rows, n_rows, n_cols, cols, cmask):
  """Flat indices, mask and row numbers ([rows, 1]) of a [rows, block] tile from
  `first_row`."""
  r = first_row + jnp.arange(rows)
  return (r[:, None] * n_cols + cols[None, :], (r[:, None] < n_rows) & cmask[None, :],
          r[:, None])


def _row_stats(h, cmask, n_cols, eps):
  """Per row of a [rows, block] tile: (x hat, rsqrt(var + eps) as [rows, 1])."""
  mean = jnp.sum(h, axis=1, keepdims=True) / n_cols
  centered = jnp.where(cmask[None, :], h - mean, 0.0)
  rstd = jax.lax.rsqrt(jnp.sum(centered * centered, axis=1, keepdims=True) / n_cols + eps)
  return centered * rstd, rstd


def _global_rows(seed_ref, local_rows, rows_per_shard_batch):
  """The tile's rows as numbered over the whole (unsharded) array: seed_ref holds (seed0,
  seed1, first batch row, first position, positions per batch row) of this shard, and each
  local batch row holds rows_per_shard_batch positions (_run_rows)."""
  batch_row = local_rows // rows_per_shard_batch
  position = local_rows % rows_per_shard_batch
  first_batch, first_position, positions = seed_ref[2], seed_ref[3], seed_ref[4]
  return ((first_batch + batch_row.astype(jnp.uint32)) * positions + first_position +
          position.astype(jnp.uint32))


def _tile_sum(x_ref, r_ref, seed_ref, idx, mask, rows, cols, bias, t, rows_per_shard_batch):
  """A tile's residual + dropout(x + bias) in float32 (0 outside the mask), and the dropout
  multiplier (None without dropout): what both kernels start from."""
  z = _load(x_ref, idx, mask)
  if bias is not None:
    z = z + bias[None, :]
  mult = None
  if seed_ref is not None:
    byte = mask_bytes(seed_ref[0], seed_ref[1],
                      _global_rows(seed_ref, rows, rows_per_shard_batch),
                      cols[None, :].astype(jnp.uint32))
    mult = _multiplier(byte, t)
    z = z * mult
  return jnp.where(mask, z + _load(r_ref, idx, mask), 0.0), mult


def _fwd_kernel(*refs, n_rows, n_cols, block, rows, rate, eps, has_bias, has_seed,
                rows_per_shard_batch, dtype=None, fp8_max=None, q_index=0):
  """With `fp8_max` (an FP8 format's largest magnitude) y is also written quantized by the
  scale at `q_index` of the table after beta's ref, as flax's `fp8_ops.quantize` quantizes
  the rounded y, with one amax per program (the last ref)."""
  refs = list(refs)
  x_ref, r_ref = refs.pop(0), refs.pop(0)
  bias_ref = refs.pop(0) if has_bias else None
  seed_ref = refs.pop(0) if has_seed else None
  scale_ref, beta_ref = refs.pop(0), refs.pop(0)
  qs_ref = refs.pop(0) if fp8_max is not None else None
  y_ref = refs.pop(0)
  cols = jnp.arange(block)
  cmask = cols < n_cols
  scale, beta = _load(scale_ref, cols, cmask), _load(beta_ref, cols, cmask)
  bias = _load(bias_ref, cols, cmask) if has_bias else None
  idx, mask, tile_rows = _tile(pl.program_id(0) * rows, rows, n_rows, n_cols, cols, cmask)
  h, _ = _tile_sum(x_ref, r_ref, seed_ref, idx, mask, tile_rows, cols, bias,
                   keep_threshold(rate) if has_seed else 0, rows_per_shard_batch)
  xhat, _ = _row_stats(h, cmask, n_cols, eps)
  y = xhat * scale[None, :] + beta[None, :]
  _store(y_ref, idx, y, mask)
  if fp8_max is not None:
    q_ref, amax_ref = refs
    q_scale = _load(qs_ref, jnp.full_like(cols, q_index), cols >= 0)[None, :]
    rounded, q = activations.quantize_rounded(y, q_scale, dtype, fp8_max)
    _store(q_ref, idx, q, mask)
    _store(amax_ref, pl.program_id(0), activations.amax_of(
        *activations.abs_and_nans(rounded, mask)), None)


def _bwd_kernel(*refs, n_rows, n_cols, block, rows, tile, rate, eps, has_bias, has_seed,
                has_dy2, rows_per_shard_batch, dtype=None, fp8_max=None, q_index=0):
  """With `fp8_max` (an FP8 format's largest magnitude) dx is written quantized by the scale
  at `q_index` of the table after the gradients' refs, as `activations.bias_gelu_fp8_grad`
  writes its dx, with one amax per program (the last ref)."""
  refs = list(refs)
  x_ref, r_ref = refs.pop(0), refs.pop(0)
  bias_ref = refs.pop(0) if has_bias else None
  seed_ref = refs.pop(0) if has_seed else None
  scale_ref, dy_ref = refs.pop(0), refs.pop(0)
  dy2_ref = refs.pop(0) if has_dy2 else None
  quantize = fp8_max is not None
  qs_ref = refs.pop(0) if quantize else None
  dx_ref, dr_ref, dpart_ref = refs[:3]
  amax_ref = refs[3] if quantize else None
  cols = jnp.arange(block)
  cmask = cols < n_cols
  scale = _load(scale_ref, cols, cmask)
  bias = _load(bias_ref, cols, cmask) if has_bias else None
  # The scale, broadcast: every lane loads the same element.
  q_scale = (_load(qs_ref, jnp.full_like(cols, q_index), cols >= 0)[None, :] if quantize
             else None)
  t = keep_threshold(rate) if has_seed else 0
  program = pl.program_id(0)

  def body(i, acc):
    dbias, dscale, dbeta = acc[:3]
    idx, mask, tile_rows = _tile(program * rows + i * tile, tile, n_rows, n_cols, cols, cmask)
    h, mult = _tile_sum(x_ref, r_ref, seed_ref, idx, mask, tile_rows, cols, bias, t,
                        rows_per_shard_batch)
    xhat, rstd = _row_stats(h, cmask, n_cols, eps)
    dy = _load(dy_ref, idx, mask)
    if dy2_ref is not None:  # The residual copy's gradient (residual_copy=True).
      dy = dy + _load(dy2_ref, idx, mask)
    g = dy * scale[None, :]
    c1 = jnp.sum(g * xhat, axis=1, keepdims=True) / n_cols
    c2 = jnp.sum(g, axis=1, keepdims=True) / n_cols
    dh = jnp.where(mask, (g - xhat * c1 - c2) * rstd, 0.0)
    _store(dr_ref, idx, dh, mask)
    dz = dh if mult is None else dh * mult
    sums = (dbias + jnp.sum(dz, axis=0), dscale + jnp.sum(dy * xhat, axis=0),
            dbeta + jnp.sum(dy, axis=0))
    if not quantize:
      _store(dx_ref, idx, dz, mask)
      return sums
    rounded, q = activations.quantize_rounded(dz, q_scale, dtype, fp8_max)
    _store(dx_ref, idx, q, mask)
    magnitude, nan = activations.abs_and_nans(rounded, mask)
    return sums + (jnp.maximum(acc[3], magnitude), jnp.maximum(acc[4], nan))

  zeros = jnp.zeros((block,), jnp.float32)
  tile_zeros = jnp.zeros((tile, block), jnp.float32)
  acc = jax.lax.fori_loop(0, rows // tile, body,
                          (zeros,) * 3 + ((tile_zeros,) * 2 if quantize else ()))
  # Partials laid out [programs, 3, H]: dbias, dscale, dbeta of this program's rows.
  base = program * 3 * n_cols + cols
  for i in range(3):
    _store(dpart_ref, base + i * n_cols, acc[i], cmask)
  if quantize:
    _store(amax_ref, program, activations.amax_of(*acc[3:]), None)


def _warps(elements: int) -> int:
  """Warps for a tile of `elements`: 16 per thread or more, 1 to 8 warps."""
  return min(max(elements // 512, 1), 8)


def _call(kernel, inputs, out_shape, grid, warps, stages, interpret, name):
  from jax.experimental.pallas import triton as plgpu  # pylint: disable=g-import-not-at-top
  return pl.pallas_call(
      kernel, out_shape=out_shape, grid=grid, interpret=interpret, name=name,
      compiler_params=plgpu.CompilerParams(num_warps=warps, num_stages=stages))(*inputs)


def _flat_inputs(x, residual, bias, seed, shard):
  """The kernels' leading inputs. `shard`: (first batch row, first position, positions per
  batch row) of this shard in the whole array, for the dropout mask's row numbers."""
  ins = [x.reshape(-1), residual.reshape(-1)]
  if bias is not None:
    ins.append(bias.reshape(-1))
  if seed is not None:
    ins.append(jnp.concatenate([seed.astype(jnp.uint32),
                                jnp.asarray(shard, jnp.uint32).reshape(3)]))
  return ins


def _check_index_range(x):
  # The kernels index the flattened arrays with int32 (Triton's default): a device's share of
  # one step's tokens x hidden stays far below 2^31 (BERT-large/512 x 64 rows: 2^25).
  if x.size >= 2**31:
    raise ValueError(f'residual_layer_norm: {x.shape} has 2^31 elements or more per device; '
                     "use model.layer_norm_impl='xla' or a smaller per-device batch")


def _rows_per_batch_row(x) -> int:
  """Rows (positions) per batch row of x [..., T, H], for the dropout mask's row numbers."""
  return x.shape[-2] if x.ndim >= 3 else 1


def _pallas_forward(x, residual, bias, scale, beta, seed, q_scale=None, *, rate, eps,
                    out_dtype, interpret, q_dtype=None, q_index=0, shard=None):
  """y; with `q_dtype` (and `q_scale`, a 1-D table of scales, and the index of the one to
  quantize by) (y, y quantized to it, one amax per program)."""
  _check_index_range(x)
  n_cols = x.shape[-1]
  n_rows = x.size // n_cols
  block = pl.next_power_of_2(n_cols)
  kernel = functools.partial(_fwd_kernel, n_rows=n_rows, n_cols=n_cols, block=block,
                             rows=_FWD_ROWS, rate=rate, eps=eps, has_bias=bias is not None,
                             has_seed=seed is not None,
                             rows_per_shard_batch=_rows_per_batch_row(x),
                             **activations.kernel_fp8_params(out_dtype, q_dtype, q_index))
  shard = shard or (0, 0, _rows_per_batch_row(x))
  ins = _flat_inputs(x, residual, bias, seed, shard) + [scale, beta]
  programs = pl.cdiv(n_rows, _FWD_ROWS)
  out_shape = jax.ShapeDtypeStruct((x.size,), out_dtype)
  if q_dtype is not None:
    ins.append(q_scale)
    out_shape = (out_shape, jax.ShapeDtypeStruct((x.size,), q_dtype),
                 jax.ShapeDtypeStruct((programs,), jnp.float32))
  out = _call(kernel, ins, out_shape, (programs,), _warps(_FWD_ROWS * block), 1, interpret,
              'residual_layer_norm_fwd')
  if q_dtype is None:
    return out.reshape(x.shape)
  y, q, amax = out
  return y.reshape(x.shape), q.reshape(x.shape), amax


def _pallas_backward(x, residual, bias, scale, seed, dy, dy2, q_scale=None, *, rate, eps,
                     interpret, q_dtype=None, q_index=0, shard=None):
  """(dx, d residual, dbias, dscale, dbeta); with `q_dtype` (and `q_scale`, `q_index` as
  `_pallas_forward` has them) dx quantized to it, and one amax per program after them."""
  n_cols = x.shape[-1]
  n_rows = x.size // n_cols
  block = pl.next_power_of_2(n_cols)
  tile = min(_BWD_TILE, _BWD_ROWS)
  rows = _BWD_ROWS // tile * tile
  programs = pl.cdiv(n_rows, rows)
  kernel = functools.partial(_bwd_kernel, n_rows=n_rows, n_cols=n_cols, block=block,
                             rows=rows, tile=tile, rate=rate, eps=eps,
                             has_bias=bias is not None, has_seed=seed is not None,
                             has_dy2=dy2 is not None,
                             rows_per_shard_batch=_rows_per_batch_row(x),
                             **activations.kernel_fp8_params(x.dtype, q_dtype, q_index))
  shard = shard or (0, 0, _rows_per_batch_row(x))
  ins = _flat_inputs(x, residual, bias, seed, shard) + [scale, dy.reshape(-1)]
  if dy2 is not None:
    ins.append(dy2.reshape(-1))
  out_shape = (jax.ShapeDtypeStruct((x.size,), q_dtype or x.dtype),
               jax.ShapeDtypeStruct((x.size,), residual.dtype),
               jax.ShapeDtypeStruct((programs * 3 * n_cols,), jnp.float32))
  if q_dtype is not None:
    ins.append(q_scale)
    out_shape += (jax.ShapeDtypeStruct((programs,), jnp.float32),)
  dx, dr, parts, *amax = _call(kernel, ins, out_shape, (programs,), _warps(tile * block), 2,
                               interpret, 'residual_layer_norm_bwd')
  dbias, dscale, dbeta = parts.reshape(programs, 3, n_cols).sum(axis=0)
  return (dx.reshape(x.shape), dr.reshape(residual.shape), dbias, dscale, dbeta, *amax)


def _sharded(fn, outs: tuple[str, ...]):
  """`fn` per device under the mesh's 'batch' and 'length' rules (rows split, hidden whole).

  The kernels have no partitioning rules of their own: without this, a sharded step would
  gather every row to every device. `fn`'s results, as `outs` names them: 'rows', a
  row-shaped array; 'sum', an [H] sum over rows, whose per-device parts are added with a
  psum; 'parts', a 1-D array of per-device partial results (amaxes), the devices' arrays side
  by side. One result is returned as it is, several as a tuple.
  """
  import flax.linen as nn  # pylint: disable=g-import-not-at-top
  mesh = jax.sharding.get_abstract_mesh()
  batch, length, _ = nn.logical_to_mesh_axes(('batch', 'length', 'act_embed'))
  P = jax.sharding.PartitionSpec  # pylint: disable=invalid-name
  axes = tuple(a for part in (batch, length) if part is not None
               for a in ((part,) if isinstance(part, str) else part))
  specs = {'rows': P(batch, length, None), 'sum': P(), 'parts': P(axes or None)}

  def local(*args):
    # Where this shard's rows sit in the whole array: the dropout mask numbers them so.
    b, t = args[0].shape[:2]
    index = lambda part: (jax.lax.axis_index(part) if part is not None else 0)
    length_parts = 1 if length is None else jax.lax.psum(1, length)
    shard = (index(batch) * b, index(length) * t, t * length_parts)
    got = fn(*args, shard=shard)
    got = tuple(jax.lax.psum(o, axes) if kind == 'sum' and axes else o
                for o, kind in zip(got if len(outs) > 1 else (got,), outs))
    return got if len(outs) > 1 else got[0]

  def wrapped(*args):
    in_specs = tuple(specs['rows'] if a.ndim == 3 else P() for a in args)
    out_specs = tuple(specs[o] for o in outs)
    return jax.shard_map(local, mesh=mesh, in_specs=in_specs,
                         out_specs=out_specs if len(outs) > 1 else out_specs[0],
                         check_vma=False)(*args)
  return wrapped


# ---------------------------------------------------------------------------------------------
# The differentiable function
# ---------------------------------------------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9, 10, 11))
def _fused(x, residual, bias, scale, beta, seed, fp8_io, rate, eps, out_dtype, interpret,
           fp8_spec):
  return _fused_fwd(x, residual, bias, scale, beta, seed, fp8_io, rate, eps, out_dtype,
                    interpret, fp8_spec)[0]


def _fused_fwd(x, residual, bias, scale, beta, seed, fp8_io, rate, eps, out_dtype, interpret,
               fp8_spec):
  """fp8_io: ((scale table, carrier, slot carrier) of the FP8 gradient channel or None, the
  output's scale table or None); fp8_spec: their static parts ((format, slot shape, index)
  or None, (format, index) or None)."""
  fp8_grad, out_table = fp8_io
  q_dtype, q_index = fp8_spec[1] or (None, 0)
  fwd = functools.partial(_pallas_forward, rate=rate, eps=eps, out_dtype=out_dtype,
                          interpret=interpret, q_dtype=q_dtype, q_index=q_index)
  outs = ('rows',) if q_dtype is None else ('rows', 'rows', 'parts')
  y = _run_rows(fwd, outs, x, residual, bias, scale, beta, seed, out_table)
  # Of the FP8 channel only the scales are kept: the carriers are zeros nothing reads.
  return y, (x, residual, bias, scale, seed, None if fp8_grad is None else fp8_grad[0],
             out_table)


def _fused_bwd(rate, eps, out_dtype, interpret, fp8_spec, saved, dy, dy2=None):
  del out_dtype
  x, residual, bias, scale, seed, grad_table, out_table = saved
  grad_spec = fp8_spec[0]
  q_dtype, slot_shape, q_index = grad_spec or (None, None, 0)
  bwd = functools.partial(_pallas_backward, rate=rate, eps=eps, interpret=interpret,
                          q_dtype=q_dtype, q_index=q_index)
  outs = ('rows', 'rows', 'sum', 'sum', 'sum') + (() if q_dtype is None else ('parts',))
  dx, dr, dbias, dscale, dbeta, *amax = _run_rows(bwd, outs, x, residual, bias, scale, seed,
                                                  dy, dy2, grad_table)
  dbias = None if bias is None else dbias.astype(bias.dtype)
  dseed = None if seed is None else jnp.zeros(seed.shape, jax.dtypes.float0)
  fp8_grad = None
  if q_dtype is not None:
    # The quantized dx and its amax go to the FP8 matmul through the channel's carriers; x
    # itself gets none (the matmul reads the channel only).
    fp8_grad = (jnp.zeros_like(grad_table), dx, fp8.amax_in(amax[0], slot_shape))
    dx = jnp.zeros(x.shape, x.dtype)
  out_table = None if out_table is None else jnp.zeros_like(out_table)
  return (dx, dr, dbias, dscale.astype(scale.dtype), dbeta.astype(scale.dtype), dseed,
          (fp8_grad, out_table))


def _fused_single_bwd(rate, eps, out_dtype, interpret, fp8_spec, saved, cotangent):
  # With a quantized output, the cotangents of (y, its FP8 copy, amaxes): the copy's consumer
  # took a stop_gradient of it.
  dy = cotangent if fp8_spec[1] is None else cotangent[0]
  return _fused_bwd(rate, eps, out_dtype, interpret, fp8_spec, saved, dy)


_fused.defvjp(_fused_fwd, _fused_single_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9, 10, 11))
def _fused_pair(x, residual, bias, scale, beta, seed, fp8_io, rate, eps, out_dtype, interpret,
                fp8_spec):
  """_fused's output twice (residual_copy=True): each copy's gradient reaches the backward
  kernel as an input of its own."""
  y = _fused(x, residual, bias, scale, beta, seed, fp8_io, rate, eps, out_dtype, interpret,
             fp8_spec)
  return (y, y) if fp8_spec[1] is None else (y[0],) + y


def _fused_pair_fwd(x, residual, bias, scale, beta, seed, fp8_io, rate, eps, out_dtype,
                    interpret, fp8_spec):
  # symbolic_zeros=True: the primals come as CustomVJPPrimal(value, perturbed).
  primal = jax.custom_derivatives.CustomVJPPrimal
  values = jax.tree.map(lambda a: a.value, (x, residual, bias, scale, beta, seed, fp8_io),
                        is_leaf=lambda a: isinstance(a, primal))
  y, saved = _fused_fwd(*values, rate, eps, out_dtype, interpret, fp8_spec)
  return ((y, y) if fp8_spec[1] is None else (y[0],) + y), saved


def _fused_pair_bwd(rate, eps, out_dtype, interpret, fp8_spec, saved, cotangents):
  # A copy nothing reads (the last layer's residual copy) has a symbolic zero gradient: the
  # kernel then reads one dy, not a tensor of zeros. (The FP8 copy's and its amaxes': never
  # read, as in _fused_single_bwd.)
  given = [c for c in cotangents[:2]
           if not isinstance(c, jax.custom_derivatives.SymbolicZero)]
  if not given:
    given = [jnp.zeros(saved[0].shape, out_dtype)]
  return _fused_bwd(rate, eps, out_dtype, interpret, fp8_spec, saved, *given)


_fused_pair.defvjp(_fused_pair_fwd, _fused_pair_bwd, symbolic_zeros=True)


def _run_rows(fn, outs: tuple[str, ...], *args):
  """Calls `fn` on the arguments (None ones passed through), per device under a mesh
  (`_sharded`, whose `outs` name fn's results)."""
  present = [i for i, a in enumerate(args) if a is not None]

  def call(*given, **kwargs):
    full = [None] * len(args)
    for i, a in zip(present, given):
      full[i] = a
    return fn(*full, **kwargs)

  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or args[0].ndim != 3:
    return call(*(args[i] for i in present))
  return _sharded(call, outs)(*(args[i] for i in present))


def residual_layer_norm(x: Array, residual: Array, bias: Array | None, scale: Array,
                        beta: Array, seed: Array | None = None, *, rate: float = 0.0,
                        eps: float = 1e-12, impl: str = 'xla', out_dtype=None,
                        residual_copy: bool = False,
                        fp8_grad: tuple[Array, int, Array, Array] | None = None,
                        fp8_out: tuple[Array, int, Any] | None = None) -> Array | tuple:
  """LayerNorm(residual + dropout(x + bias)) over the last axis, statistics in float32.

  x, residual: [..., H] (the same shape); bias, scale, beta: [H] (bias may be None); seed: the
  uint32[2] `dropout_seed` of the dropout mask, or None for no dropout (evaluation, rate 0).
  impl: 'xla' or 'pallas' (module docstring). Returns out_dtype (default: x's dtype); with
  residual_copy, the output twice (y, y): give the second to the next LayerNorm as its
  residual, and the backward kernel adds the two gradients (module docstring).
  fp8_grad: (scales, index, *channel) for the FP8 matmul that computed x (`fp8.
  fp8_dot_general`'s `grad_channel`; pallas only): the backward kernel writes dx quantized by
  scales[index] (scales: a 1-D float32 table, which the kernel reads in place: a slice given
  to a kernel is a copy of its own), with its amax, and gives both to the matmul through the
  channel's carriers instead of writing dx in x's dtype for the matmul to quantize in a pass
  of its own.
  fp8_out: (scales, index, FP8 format) of the FP8 matmul that the output goes to (pallas
  only): the forward kernel also writes the output quantized by scales[index], with one amax
  per block of rows, and both are returned after the output(s): give them to the matmul
  (`fp8.fp8_dot_general`'s x_quantized), which then quantizes nothing of its own.
  """
  assert impl in IMPLEMENTATIONS, impl
  out_dtype = jnp.dtype(out_dtype or x.dtype)
  if x.shape != residual.shape:
    raise ValueError(f'x {x.shape} and residual {residual.shape} must have one shape')
  if seed is not None and (seed.shape != (2,) or seed.dtype != jnp.uint32):
    raise ValueError(f'the dropout seed is {seed.dtype}{list(seed.shape)}, not uint32[2] '
                     '(dropout_seed)')
  if seed is not None and keep_threshold(rate) == 0:
    seed = None
  gpu = attention.target_platform() == 'gpu'
  if impl == 'xla':
    if fp8_grad is not None or fp8_out is not None:
      # A raise, not an assert: a channel here would leave its matmul zero gradients.
      raise ValueError("residual_layer_norm quantizes for FP8 only with impl='pallas'")
    y = _xla(x, residual, bias, scale, beta, seed, rate=rate, eps=eps, out_dtype=out_dtype)
    return (y, y) if residual_copy else y
  grad_spec = out_spec = grad_io = out_table = None
  if fp8_grad is not None:
    grad_table, grad_index, carrier, slot = fp8_grad
    if carrier.shape != x.shape:
      raise ValueError(f'the FP8 gradient carrier {carrier.shape} is not shaped as x {x.shape}')
    grad_spec = (jnp.dtype(carrier.dtype), tuple(slot.shape), int(grad_index))
    grad_io = (grad_table, carrier, slot)
  if fp8_out is not None:
    out_table, out_index, out_q_dtype = fp8_out
    out_spec = (jnp.dtype(out_q_dtype), int(out_index))
  for table, index in ((grad_io and grad_io[0], grad_spec and grad_spec[2]),
                       (out_table, out_spec and out_spec[1])):
    if table is not None and not (table.ndim == 1 and 0 <= index < table.shape[0]):
      raise ValueError(f'FP8 scale {index} of a table {table.shape}: not a 1-D table holding it')
  fused = _fused_pair if residual_copy else _fused
  return fused(x, residual, bias, scale, beta, seed, (grad_io, out_table), float(rate),
               float(eps), out_dtype, not gpu, (grad_spec, out_spec))
