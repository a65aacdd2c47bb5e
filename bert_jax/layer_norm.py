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

Implementations (`model.layer_norm_impl`):
  xla     the formula in jnp (every backend, the reference in tests);
  pallas  one Pallas kernel each way, lowered through Triton on NVIDIA GPUs (in interpret mode
          elsewhere, which is for tests only: slow).
A config's 'auto' is pallas for GPUs, xla elsewhere: `model.resolve` decides, for the platform a
step runs on or is compiled for.
Both compute in float32 (statistics, affine and the dropout scale) and return the compute
dtype, so they agree to float32 rounding.

Dropout masks (`dropout_bits`): 8 random bits per element, four elements from each 32-bit
word of `jax.random.bits` (a quarter of the generator's work and a 1-byte mask instead of a
32-bit draw and a bool per element). An element is kept iff its byte is >= round(256 * rate),
so the rate applied is that threshold / 256: 0.1 becomes 26/256 = 0.1015625 (never off by more
than 1/512), and kept values are scaled by 256 / (256 - threshold), the exact inverse of the
keep probability, so the expectation is unchanged. Masks are multiplied in, never selected
against a tensor of zeros. The bits come from the model's 'dropout' rng stream, which the train
step folds with the step number, so a resumed run draws exactly the masks of an uninterrupted
one.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from bert_jax import attention
from bert_jax import config_checks

Array = jax.Array

# model.layer_norm_impl's values but 'auto', which `model.resolve` turns into one of them.
IMPLEMENTATIONS = tuple(i for i in config_checks.CHOICES['model.layer_norm_impl'] if i != 'auto')
# Rows one kernel program handles (a loop over them). The backward writes one partial sum of
# dbias, dscale and dbeta per program: more rows per program, fewer partials to add up.
_FWD_ROWS = 4
_BWD_ROWS = 32


# ---------------------------------------------------------------------------------------------
# Dropout masks
# ---------------------------------------------------------------------------------------------


def keep_threshold(rate: float) -> int:
  """The byte value below which an element is dropped: round(256 * rate), within [0, 255]."""
  if not 0.0 <= rate < 1.0:
    raise ValueError(f'dropout rate {rate} is not in [0, 1)')
  return min(int(round(256 * rate)), 255)


def dropout_bits(rng: Array, shape: tuple[int, ...]) -> Array:
  """uint8 random bytes of `shape`, four per 32-bit word of `jax.random.bits`."""
  *lead, h = shape
  words = jax.random.bits(rng, (*lead, -(-h // 4)), jnp.uint32)
  return jax.lax.bitcast_convert_type(words, jnp.uint8).reshape(*lead, -1)[..., :h]


def _keep_multiplier(bits: Array, rate: float) -> Array:
  """float32 keep / (1 - effective rate) from the bytes (0 where dropped)."""
  t = keep_threshold(rate)
  return (bits >= t).astype(jnp.float32) * (256.0 / (256 - t))


def dropout(x: Array, bits: Array | None, rate: float) -> Array:
  """x * keep / (1 - rate) with the masks of `dropout_bits`, in float32, returned in x.dtype."""
  if bits is None or keep_threshold(rate) == 0:
    return x
  return (x.astype(jnp.float32) * _keep_multiplier(bits, rate)).astype(x.dtype)


# ---------------------------------------------------------------------------------------------
# The reference in jnp
# ---------------------------------------------------------------------------------------------


def _pre_norm(x, residual, bias, bits, rate, dtype):
  """residual + dropout(x + bias), summed in `dtype`."""
  z = x.astype(dtype)
  if bias is not None:
    z = z + bias.astype(dtype)
  if bits is not None and keep_threshold(rate):
    z = z * _keep_multiplier(bits, rate).astype(dtype)
  return z + residual.astype(dtype)


def residual_add(x: Array, residual: Array, bias: Array | None, bits: Array | None,
                 rate: float) -> Array:
  """residual + dropout(x + bias), the sum `residual_layer_norm` normalizes, in x's dtype: a
  pre-LN layer's residual stream (its LayerNorm of the same sum is the fused op)."""
  bits = bits if bits is not None and keep_threshold(rate) else None
  return _pre_norm(x, residual, bias, bits, rate, x.dtype)


def _xla(x, residual, bias, scale, beta, bits, *, rate, eps, out_dtype):
  # The sum in the compute dtype (bf16), statistics in float32, as flax's Dense, Dropout and
  # LayerNorm did: a float32 sum here makes XLA keep and move float32 [tokens, hidden]
  # tensors (BERT-base/128 on an H100, deviceless: 65.1 GB moved by non-matmul kernels and
  # 13.15 GiB, against 58.4 GB and 12.02 GiB this way). The Pallas kernel sums in float32
  # in registers, where it costs nothing.
  dtype = x.dtype if residual.dtype == x.dtype else jnp.float32
  h = _pre_norm(x, residual, bias, bits, rate, dtype).astype(jnp.float32)
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


def _row_stats(h, cmask, n_cols, eps):
  mean = jnp.sum(h) / n_cols
  centered = jnp.where(cmask, h - mean, 0.0)
  var = jnp.sum(centered * centered) / n_cols
  return centered * jax.lax.rsqrt(var + eps), jax.lax.rsqrt(var + eps)


def _row_sum(x_ref, r_ref, bits_ref, idx, mask, bias, t):
  """One row's residual + dropout(x + bias) in float32 (0 outside the mask), and the dropout
  multiplier (None without dropout): what both kernels start from."""
  z = _load(x_ref, idx, mask)
  if bias is not None:
    z = z + bias
  mult = None
  if bits_ref is not None:
    mult = jnp.where(_load(bits_ref, idx, mask) >= t, 256.0 / (256 - t), 0.0)
    z = z * mult
  return jnp.where(mask, z + _load(r_ref, idx, mask), 0.0), mult


def _fwd_kernel(*refs, n_rows, n_cols, block, rows, rate, eps, has_bias, has_bits):
  refs = list(refs)
  x_ref, r_ref = refs.pop(0), refs.pop(0)
  bias_ref = refs.pop(0) if has_bias else None
  bits_ref = refs.pop(0) if has_bits else None
  scale_ref, beta_ref, y_ref = refs
  cols = jnp.arange(block)
  cmask = cols < n_cols
  scale, beta = _load(scale_ref, cols, cmask), _load(beta_ref, cols, cmask)
  bias = _load(bias_ref, cols, cmask) if has_bias else None
  t = keep_threshold(rate)
  first = pl.program_id(0) * rows

  @pl.loop(0, rows)
  def _(i):
    row = first + i
    mask = cmask & (row < n_rows)
    idx = row * n_cols + cols
    h, _ = _row_sum(x_ref, r_ref, bits_ref, idx, mask, bias, t)
    xhat, _ = _row_stats(h, cmask, n_cols, eps)
    _store(y_ref, idx, xhat * scale + beta, mask)


def _bwd_kernel(*refs, n_rows, n_cols, block, rows, rate, eps, has_bias, has_bits):
  refs = list(refs)
  x_ref, r_ref = refs.pop(0), refs.pop(0)
  bias_ref = refs.pop(0) if has_bias else None
  bits_ref = refs.pop(0) if has_bits else None
  scale_ref, dy_ref, dx_ref, dr_ref, dpart_ref = refs
  cols = jnp.arange(block)
  cmask = cols < n_cols
  scale = _load(scale_ref, cols, cmask)
  bias = _load(bias_ref, cols, cmask) if has_bias else None
  t = keep_threshold(rate)
  program = pl.program_id(0)
  first = program * rows

  def body(i, acc):
    dbias, dscale, dbeta = acc
    row = first + i
    mask = cmask & (row < n_rows)
    idx = row * n_cols + cols
    h, mult = _row_sum(x_ref, r_ref, bits_ref, idx, mask, bias, t)
    xhat, rstd = _row_stats(h, cmask, n_cols, eps)
    dy = _load(dy_ref, idx, mask)
    g = dy * scale
    c1 = jnp.sum(g * xhat) / n_cols
    c2 = jnp.sum(g) / n_cols
    dh = jnp.where(mask, (g - xhat * c1 - c2) * rstd, 0.0)
    _store(dr_ref, idx, dh, mask)
    dz = dh if mult is None else dh * mult
    _store(dx_ref, idx, dz, mask)
    return dbias + dz, dscale + dy * xhat, dbeta + dy

  zeros = jnp.zeros((block,), jnp.float32)
  dbias, dscale, dbeta = jax.lax.fori_loop(0, rows, body, (zeros, zeros, zeros))
  # Partials laid out [programs, 3, H]: dbias, dscale, dbeta of this program's rows.
  base = program * 3 * n_cols + cols
  _store(dpart_ref, base, dbias, cmask)
  _store(dpart_ref, base + n_cols, dscale, cmask)
  _store(dpart_ref, base + 2 * n_cols, dbeta, cmask)


def _warps(block: int) -> int:
  return min(max(block // 256, 1), 8)


def _call(kernel, inputs, out_shape, grid, block, interpret, name):
  from jax.experimental.pallas import triton as plgpu  # pylint: disable=g-import-not-at-top
  return pl.pallas_call(
      kernel, out_shape=out_shape, grid=grid, interpret=interpret, name=name,
      compiler_params=plgpu.CompilerParams(num_warps=_warps(block), num_stages=1))(*inputs)


def _flat_inputs(x, residual, bias, bits):
  ins = [x.reshape(-1), residual.reshape(-1)]
  if bias is not None:
    ins.append(bias.reshape(-1))
  if bits is not None:
    ins.append(bits.reshape(-1))
  return ins


def _check_index_range(x):
  # The kernels index the flattened arrays with int32 (Triton's default): a device's share of
  # one step's tokens x hidden stays far below 2^31 (BERT-large/512 x 64 rows: 2^25).
  if x.size >= 2**31:
    raise ValueError(f'residual_layer_norm: {x.shape} has 2^31 elements or more per device; '
                     "use model.layer_norm_impl='xla' or a smaller per-device batch")


def _pallas_forward(x, residual, bias, scale, beta, bits, *, rate, eps, out_dtype, interpret):
  _check_index_range(x)
  n_cols = x.shape[-1]
  n_rows = x.size // n_cols
  block = pl.next_power_of_2(n_cols)
  kernel = functools.partial(_fwd_kernel, n_rows=n_rows, n_cols=n_cols, block=block,
                             rows=_FWD_ROWS, rate=rate, eps=eps, has_bias=bias is not None,
                             has_bits=bits is not None)
  ins = _flat_inputs(x, residual, bias, bits) + [scale, beta]
  y = _call(kernel, ins, jax.ShapeDtypeStruct((x.size,), out_dtype),
            (pl.cdiv(n_rows, _FWD_ROWS),), block, interpret, 'residual_layer_norm_fwd')
  return y.reshape(x.shape)


def _pallas_backward(x, residual, bias, scale, bits, dy, *, rate, eps, interpret):
  n_cols = x.shape[-1]
  n_rows = x.size // n_cols
  block = pl.next_power_of_2(n_cols)
  programs = pl.cdiv(n_rows, _BWD_ROWS)
  kernel = functools.partial(_bwd_kernel, n_rows=n_rows, n_cols=n_cols, block=block,
                             rows=_BWD_ROWS, rate=rate, eps=eps, has_bias=bias is not None,
                             has_bits=bits is not None)
  ins = _flat_inputs(x, residual, bias, bits) + [scale, dy.reshape(-1)]
  out_shape = (jax.ShapeDtypeStruct((x.size,), x.dtype),
               jax.ShapeDtypeStruct((x.size,), residual.dtype),
               jax.ShapeDtypeStruct((programs * 3 * n_cols,), jnp.float32))
  dx, dr, parts = _call(kernel, ins, out_shape, (programs,), block, interpret,
                        'residual_layer_norm_bwd')
  dbias, dscale, dbeta = parts.reshape(programs, 3, n_cols).sum(axis=0)
  return dx.reshape(x.shape), dr.reshape(residual.shape), dbias, dscale, dbeta


def _sharded(fn, n_out_rows: int):
  """`fn` per device under the mesh's 'batch' and 'length' rules (rows split, hidden whole).

  The kernels have no partitioning rules of their own: without this, a sharded step would
  gather every row to every device. `fn` returns one row-shaped array (n_out_rows=0: the
  forward) or two row-shaped arrays and three [H] sums over rows (n_out_rows=2: the backward),
  whose per-device parts are added with a psum.
  """
  import flax.linen as nn  # pylint: disable=g-import-not-at-top
  mesh = jax.sharding.get_abstract_mesh()
  batch, length, _ = nn.logical_to_mesh_axes(('batch', 'length', 'act_embed'))
  rows, vec = jax.sharding.PartitionSpec(batch, length, None), jax.sharding.PartitionSpec()
  axes = tuple(a for part in (batch, length) if part is not None
               for a in ((part,) if isinstance(part, str) else part))

  def local(*args):
    outs = fn(*args)
    if not n_out_rows:
      return outs
    return tuple(outs[:n_out_rows]) + tuple(
        jax.lax.psum(o, axes) if axes else o for o in outs[n_out_rows:])

  def wrapped(*args):
    in_specs = tuple(rows if a.ndim == 3 else vec for a in args)
    out_specs = (rows,) * n_out_rows + (vec,) * 3 if n_out_rows else rows
    return jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                         check_vma=False)(*args)
  return wrapped


# ---------------------------------------------------------------------------------------------
# The differentiable function
# ---------------------------------------------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9))
def _fused(x, residual, bias, scale, beta, bits, rate, eps, out_dtype, interpret):
  return _fused_fwd(x, residual, bias, scale, beta, bits, rate, eps, out_dtype, interpret)[0]


def _fused_fwd(x, residual, bias, scale, beta, bits, rate, eps, out_dtype, interpret):
  fwd = functools.partial(_pallas_forward, rate=rate, eps=eps, out_dtype=out_dtype,
                          interpret=interpret)
  y = _run_rows(fwd, 0, x, residual, bias, scale, beta, bits)
  return y, (x, residual, bias, scale, bits)


def _fused_bwd(rate, eps, out_dtype, interpret, saved, dy):
  del out_dtype
  x, residual, bias, scale, bits = saved
  bwd = functools.partial(_pallas_backward, rate=rate, eps=eps, interpret=interpret)
  dx, dr, dbias, dscale, dbeta = _run_rows(bwd, 2, x, residual, bias, scale, bits, dy)
  dbias = None if bias is None else dbias.astype(bias.dtype)
  dbits = None if bits is None else jnp.zeros(bits.shape, jax.dtypes.float0)
  return dx, dr, dbias, dscale.astype(scale.dtype), dbeta.astype(scale.dtype), dbits


_fused.defvjp(_fused_fwd, _fused_bwd)


def _run_rows(fn, n_out_rows, *args):
  """Calls `fn` on the arguments (None ones passed through) per device under a mesh."""
  present = [i for i, a in enumerate(args) if a is not None]

  def call(*given):
    full = [None] * len(args)
    for i, a in zip(present, given):
      full[i] = a
    return fn(*full)

  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or args[0].ndim != 3:
    return call(*(args[i] for i in present))
  return _sharded(call, n_out_rows)(*(args[i] for i in present))


def residual_layer_norm(x: Array, residual: Array, bias: Array | None, scale: Array,
                        beta: Array, bits: Array | None = None, *, rate: float = 0.0,
                        eps: float = 1e-12, impl: str = 'xla', out_dtype=None) -> Array:
  """LayerNorm(residual + dropout(x + bias)) over the last axis, statistics in float32.

  x, residual: [..., H] (the same shape); bias, scale, beta: [H] (bias may be None); bits: the
  uint8 `dropout_bits` of x's shape, or None for no dropout (evaluation, rate 0). impl: 'xla'
  or 'pallas' (module docstring). Returns out_dtype (default: x's dtype).
  """
  assert impl in IMPLEMENTATIONS, impl
  out_dtype = jnp.dtype(out_dtype or x.dtype)
  if x.shape != residual.shape or (bits is not None and bits.shape != x.shape):
    raise ValueError(f'x {x.shape}, residual {residual.shape} and bits '
                     f'{None if bits is None else bits.shape} must have one shape')
  if bits is not None and keep_threshold(rate) == 0:
    bits = None
  gpu = attention.target_platform() == 'gpu'
  if impl == 'xla':
    return _xla(x, residual, bias, scale, beta, bits, rate=rate, eps=eps, out_dtype=out_dtype)
  return _fused(x, residual, bias, scale, beta, bits, float(rate), float(eps), out_dtype,
                not gpu)
