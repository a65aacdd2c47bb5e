"""Bias + exact GELU as one differentiable function that keeps only its input for backward.

The MLP's `gelu(x @ W + b)` written with `jax.nn.gelu(approximate=False)` keeps three
[tokens, intermediate] tensors for the backward pass (x @ W + b, and erfc's pieces), and XLA
expands `erfc` into a long polynomial: on an H200 the GELU forward of BERT-base/128 was
compute-bound (333 us per layer; issue 30). `bias_gelu` is the paper's exact GELU,
0.5 y (1 + erf(y / sqrt(2))) with y = x + b, under a `custom_vjp` whose residuals are only the
matmul output x and the bias: the backward recomputes y and gelu'(y) = Phi(y) + y phi(y) from
them. Both directions compute in float32 (as the LayerNorm statistics do) and return the
input's dtype.

Implementations (`model.gelu_impl`):
  xla     `lax.erf` in jnp (every backend; the reference in tests). On a GPU, XLA's float32
          erf is a clamped rational polynomial with a divide, ~45 instructions per element:
          the forward ran instruction-bound at 2.1x its memory floor on an H200 (issue 45's
          profile, 2026-11-27).
  pallas  one Pallas kernel each way (lowered through Triton on NVIDIA GPUs; interpreted
          elsewhere, which is for tests only): the forward reads x and writes gelu(x + b), the
          backward reads x and dy, writes dx and the bias gradient's partial sums per block of
          rows (as layer_norm.py's backward does), which one small reduction adds up: 3
          kernels per layer at the memory floor (2 + 3 [tokens, intermediate] passes). Phi is
          Abramowitz & Stegun 7.1.26, erfc(z) = t P(t) exp(-z^2) with t = 1 / (1 + p z),
          |error| <= 1.5e-7 (below float32 rounding of erf near 1), evaluated on |y| so the
          negative tail keeps its relative accuracy; phi shares its exp. About 16 instructions
          and 2 special-function ops per element, no IEEE divide.
With FP8 matmuls (`fp8.fp8_gelu_mlp`) the Pallas kernels also quantize: `bias_gelu_fp8` writes
gelu(x + b) only in FP8 (the next matmul's input) and `bias_gelu_fp8_grad` the input gradient
only in FP8 (the previous matmul's output gradient), each with the largest magnitudes of what
it quantized by blocks: flax's `fp8_ops.quantize` of the compute-dtype result, bit for bit,
without the pass of its own that reads that result again.
`portable_erf` is `lax.erf` written with StableHLO's core operations (export.py): the served
model computes xla's GELU.

A config's 'auto' is xla on every platform (`model.resolve`), from the one measurement there
is (one H100 80GB HBM3, jax 0.11.2 for CUDA 13, 2026-11-28; benchmarks/results/
h100_2026-11-28_gelu*.json): alone, at [32768, 3072] bf16, jitted, median of 20 calls with
their launch, xla's forward took 0.284 ms and pallas' 0.288, the backward (dx and the bias
gradient) 0.384 and 0.406. A sweep of the pallas tiles ran every tiling at 1.2-1.44 TB/s (its
best backward 0.419 ms, the default 0.491 in that run: within the runs' spread). The
BERT-base/128 step compiled to 39 GELU kernels either way; inside it the pallas kernels ran
144 us (forward) and 230 us (backward) per layer, 1.2x and 1.3x their floors at 3.35 TB/s (2
and 3 passes of [32768, 3072] bf16: 120 and 180 us). The step's 2.6% gain over main (50.9 ->
49.6 ms) is issue 45's changes together, the LayerNorm and dropout ones included; xla's GELU
in the step was not profiled, so no share of it is known to be pallas'. pallas stays an option
(and the GPU step budget's setting, tests/aot_gpu_test.py), its numerics xla's: in bf16 at
most one bf16 step apart (0.031 forward, 0.016 dx), dbias 7e-8 relative; in float32 within
5e-7 of jax.nn.gelu (xla 1e-6).
"""

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from bert_jax import attention
from bert_jax import config_checks

Array = jax.Array

# model.gelu_impl's values but 'auto', which `model.resolve` turns into one of them.
IMPLEMENTATIONS = tuple(i for i in config_checks.CHOICES['model.gelu_impl'] if i != 'auto')

_SQRT_HALF = 1.0 / math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
# Abramowitz & Stegun 7.1.26: erfc(z) ~ t (a1 + t (a2 + t (a3 + t (a4 + t a5)))) exp(-z^2),
# t = 1 / (1 + p z), z >= 0.
_AS_P = 0.3275911
_AS_A = (0.254829592, -0.284496736, 1.421413741, -1.453152027, 1.061405429)
_LOG2_E = math.log2(math.e)

# Tiles of the Pallas kernels: [_TILE_ROWS, _TILE_COLS] elements per load (4,096: 8 KiB of
# bf16 per operand, 32 per thread at 4 warps), columns masked past the width and rows past
# the count, so any shape works. The backward walks _BWD_ROWS rows per program and writes one
# float32 partial sum of the bias gradient per program and column: with 64 rows, 1/32 of dy's
# bytes (4 B per 64 x 2 B).
_TILE_ROWS = 4
_TILE_COLS = 1024
_BWD_ROWS = 64


# ---------------------------------------------------------------------------------------------
# The reference in jnp
# ---------------------------------------------------------------------------------------------


def _gelu(y: Array) -> Array:
  return 0.5 * y * (1.0 + jax.lax.erf(y * _SQRT_HALF))


@jax.custom_vjp
def _xla_bias_gelu(x: Array, bias: Array) -> Array:
  with jax.named_scope('bias_gelu'):
    return _gelu(x.astype(jnp.float32) + bias.astype(jnp.float32)).astype(x.dtype)


def _xla_fwd(x: Array, bias: Array):
  return _xla_bias_gelu(x, bias), (x, bias)


def _xla_bwd(residuals, g: Array):
  x, bias = residuals
  with jax.named_scope('bias_gelu_bwd'):
    y = x.astype(jnp.float32) + bias.astype(jnp.float32)
    cdf = 0.5 * (1.0 + jax.lax.erf(y * _SQRT_HALF))
    pdf = _INV_SQRT_2PI * jnp.exp(-0.5 * jnp.square(y))
    dy = g.astype(jnp.float32) * (cdf + y * pdf)
    # The bias broadcast over every leading axis of x: its gradient sums them, in float32.
    dbias = jnp.sum(dy, axis=tuple(range(dy.ndim - bias.ndim)))
    return dy.astype(x.dtype), dbias.astype(bias.dtype)


_xla_bias_gelu.defvjp(_xla_fwd, _xla_bwd)


# XLA's float32 erf, the decomposition of CHLO's erf: x P(x^2) / Q(x^2) on x clamped to [-4, 4],
# clamped to [-1, 1]; P and Q's coefficients from the highest power down.
_ERF_P = (-2.72614237e-10, 2.77068146e-08, -2.10102394e-06, -5.69250624e-05, -7.34990637e-04,
          -2.95460000e-03, -1.60960332e-02)
_ERF_Q = (-1.45660715e-05, -2.13374049e-04, -1.68282702e-03, -7.37332925e-03, -1.42647391e-02)


def portable_erf(x: Array) -> Array:
  """`lax.erf` of float32 as XLA computes it, in StableHLO's core operations only.

  jax lowers `lax.erf` and `lax.erfc` to CHLO composites (jax 0.12 every CHLO operation),
  which TensorFlow 2.21's XlaCallModule cannot read or cannot refine to a batch's shape: a
  SavedModel's GELU (export.py) is this.
  """
  x = jax.lax.clamp(-4.0, x.astype(jnp.float32), 4.0)
  t = x * x
  p = functools.reduce(lambda acc, c: acc * t + c, _ERF_P[2:], _ERF_P[0] * t + _ERF_P[1])
  q = functools.reduce(lambda acc, c: acc * t + c, _ERF_Q[2:], _ERF_Q[0] * t + _ERF_Q[1])
  return jax.lax.clamp(-1.0, x * p / q, 1.0)


def portable_bias_gelu(x: Array, bias: Array) -> Array:
  """`bias_gelu` with `portable_erf`, for inference (no custom gradient)."""
  y = x.astype(jnp.float32) + bias.astype(jnp.float32)
  return (0.5 * y * (1.0 + portable_erf(y * _SQRT_HALF))).astype(x.dtype)


# ---------------------------------------------------------------------------------------------
# The kernels' body (float32; jnp, so tests evaluate the same formula on the CPU)
# ---------------------------------------------------------------------------------------------


def phi_and_density(y: Array) -> tuple[Array, Array]:
  """(Phi(y), phi(y)): the standard normal CDF by Abramowitz & Stegun 7.1.26 (|error| <=
  7.5e-8) and the density, from one exp2 and one division."""
  z = jnp.abs(y) * _SQRT_HALF
  t = 1.0 / (1.0 + _AS_P * z)
  poly = _AS_A[4]
  for a in _AS_A[3::-1]:
    poly = poly * t + a
  gauss = jnp.exp2(-(z * z) * _LOG2_E)         # exp(-y^2 / 2)
  tail = 0.5 * t * poly * gauss                # Phi(-|y|), accurate relative to itself.
  return jnp.where(y < 0, tail, 1.0 - tail), _INV_SQRT_2PI * gauss


def gelu_fast(y: Array) -> Array:
  """y Phi(y) with phi_and_density's Phi: the Pallas kernels' forward body."""
  return y * phi_and_density(y)[0]


def gelu_fast_grad(y: Array) -> Array:
  """gelu'(y) = Phi(y) + y phi(y) with phi_and_density's: the kernels' backward body."""
  cdf, pdf = phi_and_density(y)
  return cdf + y * pdf


# ---------------------------------------------------------------------------------------------
# The Pallas kernels (Triton lowering): [N, C] problems flattened to 1-D refs
# ---------------------------------------------------------------------------------------------


def _tile(n_rows, n_cols, first_row, cols):
  rows = first_row + jnp.arange(_TILE_ROWS)
  mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
  return rows[:, None] * n_cols + cols[None, :], mask


def _load(ref, idx, mask):
  from jax.experimental.pallas import triton as plgpu  # pylint: disable=g-import-not-at-top
  if mask is None:
    return plgpu.load(ref.at[idx]).astype(jnp.float32)
  return plgpu.load(ref.at[idx], mask=mask, other=0).astype(jnp.float32)


def _store(ref, idx, value, mask):
  from jax.experimental.pallas import triton as plgpu  # pylint: disable=g-import-not-at-top
  plgpu.store(ref.at[idx], value.astype(ref.dtype), mask=mask)


def quantize_rounded(v: Array, s: Array, dtype, fp8_max: float) -> tuple[Array, Array]:
  """flax's `fp8_ops.quantize(v.astype(dtype), ..., s, dtype)` (the quantizing of the tensor
  as an unfused step stores it) on float32 values: v and the scale rounded to `dtype`, their
  quotient rounded to it, clipped to the FP8 format's largest magnitude. The caller's store
  casts to the format."""
  v = v.astype(dtype).astype(jnp.float32)
  q = (v / s.astype(dtype).astype(jnp.float32)).astype(dtype).astype(jnp.float32)
  # Selects, not min/max: Triton's drop a NaN, XLA's clip (and FP8's NaN) keep it.
  return v, jnp.where(q > fp8_max, fp8_max, jnp.where(q < -fp8_max, -fp8_max, q))


def abs_and_nans(v: Array, mask: Array) -> tuple[Array, Array]:
  """|v| (0 where masked) and 1 where v is NaN: the amax is NaN if any value is (as XLA's
  reduction gives it), which Triton's max alone would drop."""
  return (jnp.where(mask, jnp.abs(v), 0.0),
          jnp.where(mask & (v != v), 1.0, 0.0))  # pylint: disable=comparison-with-itself


def amax_of(largest: Array, nans: Array) -> Array:
  """The amax of a tile from `abs_and_nans`' two arrays: NaN if any value was."""
  return jnp.where(jnp.max(nans) > 0, jnp.nan, jnp.max(largest))


def _fwd_kernel(x_ref, b_ref, *refs, n_rows, n_cols, dtype=None, fp8_max=None, q_index=0):
  """refs: the output (y_ref), or with `fp8_max` (an FP8 format's largest magnitude) the table
  of scales whose element `q_index` it quantizes by, the quantized output and one amax per
  program (s_ref, q_ref, amax_ref)."""
  cols = pl.program_id(1) * _TILE_COLS + jnp.arange(_TILE_COLS)
  bias = _load(b_ref, cols, cols < n_cols)
  idx, mask = _tile(n_rows, n_cols, pl.program_id(0) * _TILE_ROWS, cols)
  y = gelu_fast(_load(x_ref, idx, mask) + bias[None, :])
  if fp8_max is None:
    (y_ref,) = refs
    _store(y_ref, idx, y, mask)
    return
  s_ref, q_ref, amax_ref = refs
  scale = _load(s_ref, jnp.full_like(cols, q_index), None)
  h, q = quantize_rounded(y, scale[None, :], dtype, fp8_max)
  _store(q_ref, idx, q, mask)
  program = pl.program_id(0) * pl.num_programs(1) + pl.program_id(1)
  _store(amax_ref, program, amax_of(*abs_and_nans(h, mask)), None)


def _bwd_kernel(x_ref, b_ref, g_ref, *refs, n_rows, n_cols, dtype=None, fp8_max=None,
                q_index=0):
  """refs: dx_ref, part_ref; or with `fp8_max` s_ref (the table of scales whose element
  `q_index` dx is quantized by), q_ref (the quantized dx), part_ref and amax_ref (one amax
  per program)."""
  quantize = fp8_max is not None
  s_ref, dx_ref, part_ref, amax_ref = refs if quantize else (None, *refs, None)
  cols = pl.program_id(1) * _TILE_COLS + jnp.arange(_TILE_COLS)
  cmask = cols < n_cols
  bias = _load(b_ref, cols, cmask)
  scale = _load(s_ref, jnp.full_like(cols, q_index), None)[None, :] if quantize else None
  first = pl.program_id(0) * _BWD_ROWS

  def body(i, carry):
    idx, mask = _tile(n_rows, n_cols, first + i * _TILE_ROWS, cols)
    dx = _load(g_ref, idx, mask) * gelu_fast_grad(_load(x_ref, idx, mask) + bias[None, :])
    dx = jnp.where(mask, dx, 0.0)
    if not quantize:
      _store(dx_ref, idx, dx, mask)
      return (carry[0] + dx,)
    acc, largest, nans = carry
    rounded, q = quantize_rounded(dx, scale, dtype, fp8_max)
    _store(dx_ref, idx, q, mask)
    magnitude, nan = abs_and_nans(rounded, mask)
    return acc + dx, jnp.maximum(largest, magnitude), jnp.maximum(nans, nan)

  zeros = jnp.zeros((_TILE_ROWS, _TILE_COLS), jnp.float32)
  carry = jax.lax.fori_loop(0, _BWD_ROWS // _TILE_ROWS, body,
                            (zeros,) * (3 if quantize else 1))
  # Partials laid out [programs along the rows, C].
  _store(part_ref, pl.program_id(0) * n_cols + cols, jnp.sum(carry[0], axis=0), cmask)
  if quantize:
    program = pl.program_id(0) * pl.num_programs(1) + pl.program_id(1)
    _store(amax_ref, program, amax_of(*carry[1:]), None)


def _call(kernel, inputs, out_shape, grid, interpret, name, stages):
  from jax.experimental.pallas import triton as plgpu  # pylint: disable=g-import-not-at-top
  return pl.pallas_call(
      kernel, out_shape=out_shape, grid=grid, interpret=interpret, name=name,
      compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=stages))(*inputs)


def _check_index_range(x):
  # Flat int32 indices (Triton's default): a device's share of one step's tokens x
  # intermediate stays far below 2^31 (BERT-large/512 x 64 rows: 2^27).
  if x.size >= 2**31:
    raise ValueError(f'bias_gelu: {x.shape} has 2^31 elements or more per device; use '
                     "model.gelu_impl='xla' or a smaller per-device batch")


def kernel_fp8_params(dtype: jax.typing.DTypeLike, q_dtype: jax.typing.DTypeLike | None,
                      q_index: int) -> dict:
  """The quantizing kernels' (GELU's, LayerNorm's) static arguments: the dtype a value is
  rounded to first, the FP8 format's largest magnitude and the scale's index in its table
  (none without `q_dtype`)."""
  return {} if q_dtype is None else dict(dtype=dtype, fp8_max=float(jnp.finfo(q_dtype).max),
                                         q_index=q_index)


def _pallas_forward(x, bias, scale=None, *, interpret, q_dtype=None, q_index=0):
  """gelu(x + bias); with `q_dtype` (and `scale`) quantized to it, and one amax per program."""
  _check_index_range(x)
  n_cols = x.shape[-1]
  n_rows = x.size // n_cols
  grid = (pl.cdiv(n_rows, _TILE_ROWS), pl.cdiv(n_cols, _TILE_COLS))
  kernel = functools.partial(_fwd_kernel, n_rows=n_rows, n_cols=n_cols,
                             **kernel_fp8_params(x.dtype, q_dtype, q_index))
  if q_dtype is None:
    y = _call(kernel, [x.reshape(-1), bias], jax.ShapeDtypeStruct((x.size,), x.dtype), grid,
              interpret, 'bias_gelu_fwd', 1)
    return y.reshape(x.shape)
  q, amax = _call(kernel, [x.reshape(-1), bias, scale],
                  (jax.ShapeDtypeStruct((x.size,), q_dtype),
                   jax.ShapeDtypeStruct((grid[0] * grid[1],), jnp.float32)),
                  grid, interpret, 'bias_gelu_fp8_fwd', 1)
  return q.reshape(x.shape), amax


def _pallas_backward(x, bias, g, scale=None, *, interpret, q_dtype=None, q_index=0):
  """(dx, the bias gradient); with `q_dtype` (and `scale`) dx quantized to it, and one amax
  per program after them."""
  n_cols = x.shape[-1]
  n_rows = x.size // n_cols
  grid = (pl.cdiv(n_rows, _BWD_ROWS), pl.cdiv(n_cols, _TILE_COLS))
  kernel = functools.partial(_bwd_kernel, n_rows=n_rows, n_cols=n_cols,
                             **kernel_fp8_params(x.dtype, q_dtype, q_index))
  parts = jax.ShapeDtypeStruct((grid[0] * n_cols,), jnp.float32)
  if q_dtype is None:
    dx, parts = _call(kernel, [x.reshape(-1), bias, g.reshape(-1)],
                      (jax.ShapeDtypeStruct((x.size,), x.dtype), parts), grid, interpret,
                      'bias_gelu_bwd', 2)
    return dx.reshape(x.shape), parts.reshape(grid[0], n_cols).sum(axis=0)
  q, parts, amax = _call(kernel, [x.reshape(-1), bias, g.reshape(-1), scale],
                         (jax.ShapeDtypeStruct((x.size,), q_dtype), parts,
                          jax.ShapeDtypeStruct((grid[0] * grid[1],), jnp.float32)),
                         grid, interpret, 'bias_gelu_fp8_bwd', 2)
  return q.reshape(x.shape), parts.reshape(grid[0], n_cols).sum(axis=0), amax


def bias_gelu_fp8(x: Array, bias: Array, scale: Array, q_dtype, *,
                  axes: tuple[str | None, ...], interpret: bool,
                  scale_index: int = 0) -> tuple[Array, Array]:
  """The Pallas forward of `bias_gelu` with its output quantized for an FP8 matmul: (gelu(x +
  bias) quantized to `q_dtype` by `scale` as flax's `fp8_ops.quantize` quantizes the
  x.dtype result, the largest magnitudes of that result by blocks (1-D, any length: their
  max is the amax)). Not differentiable: `fp8.fp8_gelu_mlp`'s backward calls
  `bias_gelu_fp8_grad`. bias: [C] float32; scale: a 1-D float32 table whose element
  `scale_index` is the scale (read in place: a slice given to a kernel is a copy of its own);
  axes: x's logical axes."""
  with jax.named_scope('bias_gelu'):
    return _run(functools.partial(_pallas_forward, q_dtype=q_dtype, interpret=interpret,
                                  q_index=scale_index),
                axes, ('x', 'parts'), x, bias, scale)


def bias_gelu_fp8_grad(x: Array, bias: Array, g: Array, scale: Array, q_dtype, *,
                       axes: tuple[str | None, ...], interpret: bool,
                       scale_index: int = 0) -> tuple[Array, Array, Array]:
  """The Pallas backward of `bias_gelu` with its input gradient quantized for an FP8 matmul:
  (dx = g gelu'(x + bias), rounded to x.dtype, quantized to `q_dtype` by `scale`; the bias
  gradient [C], summed in float32; the largest magnitudes of the rounded dx by blocks).
  scale, scale_index: as `bias_gelu_fp8` has them."""
  with jax.named_scope('bias_gelu_bwd'):
    q, dbias, amax = _run(
        functools.partial(_pallas_backward, q_dtype=q_dtype, interpret=interpret,
                          q_index=scale_index), axes,
        ('x', 'sum', 'parts'), x, bias, g, scale)
  return q, dbias, amax


def _sharded(fn, axes: tuple[str | None, ...], outs: tuple[str, ...]):
  """`fn` per device under the mesh's rules for x's logical `axes` (rows split as the leading
  axes say, columns as the last). `fn`'s results, as `outs` names them: 'x', an x-shaped
  array; 'sum', a [C] sum over the rows, whose per-device parts are added with a psum;
  'parts', a 1-D array of per-device partial results (amaxes), the devices' arrays side by
  side. Its arguments: x-shaped ones, the bias (the second: split as the columns are) and
  others (scale tables, replicated). Without this, a sharded step would gather every row to
  every device (a Pallas call has no partitioning rule)."""
  import flax.linen as nn  # pylint: disable=g-import-not-at-top
  mesh = jax.sharding.get_abstract_mesh()
  spec = nn.logical_to_mesh_axes(axes)
  flat = lambda parts: tuple(a for part in parts if part is not None
                             for a in ((part,) if isinstance(part, str) else part))
  rows = flat(spec[:-1])
  P = jax.sharding.PartitionSpec  # pylint: disable=invalid-name
  x_spec, col_spec, parts_spec = P(*spec), P(spec[-1]), P(flat(spec) or None)
  out_specs = tuple({'x': x_spec, 'sum': col_spec, 'parts': parts_spec}[o] for o in outs)

  def local(*args):
    out = fn(*args)
    out = out if isinstance(out, tuple) else (out,)
    return tuple(jax.lax.psum(o, rows) if kind == 'sum' and rows else o
                 for o, kind in zip(out, outs))

  def wrapped(*args):
    x_ndim = args[0].ndim
    in_specs = tuple(x_spec if a.ndim == x_ndim else col_spec if i == 1 else P()
                     for i, a in enumerate(args))
    out = jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                        check_vma=False)(*args)
    return out if len(outs) > 1 else out[0]
  return wrapped


def _run(fn, axes, outs, *args):
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return fn(*args)
  return _sharded(fn, axes, outs)(*args)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _pallas_bias_gelu(x, bias, axes, interpret):
  return _pallas_fwd(x, bias, axes, interpret)[0]


def _pallas_fwd(x, bias, axes, interpret):
  with jax.named_scope('bias_gelu'):
    y = _run(functools.partial(_pallas_forward, interpret=interpret), axes, ('x',), x, bias)
  return y, (x, bias)


def _pallas_bwd(axes, interpret, saved, g):
  x, bias = saved
  with jax.named_scope('bias_gelu_bwd'):
    dx, dbias = _run(functools.partial(_pallas_backward, interpret=interpret), axes,
                     ('x', 'sum'), x, bias, g)
  return dx, dbias.astype(bias.dtype)


_pallas_bias_gelu.defvjp(_pallas_fwd, _pallas_bwd)


def bias_gelu(x: Array, bias: Array, *, impl: str = 'xla',
              axes: tuple[str | None, ...] | None = None) -> Array:
  """gelu(x + bias), exact (erf); bias [C] broadcasts over x's leading axes.

  impl: 'xla' or 'pallas' (module docstring; a config's 'auto' is resolved before this, in
  `model.resolve`). axes: x's logical axis names (e.g. ('batch', 'length', 'act_mlp')), which
  place the Pallas kernels under a mesh; without them a mesh runs the xla implementation.
  """
  assert impl in IMPLEMENTATIONS, impl
  gpu = attention.target_platform() == 'gpu'
  if (impl == 'xla' or bias.ndim != 1 or
      (axes is None and not jax.sharding.get_abstract_mesh().empty)):
    return _xla_bias_gelu(x, bias)
  if axes is not None and len(axes) != x.ndim:
    raise ValueError(f'axes {axes} do not name the {x.ndim} axes of x {x.shape}')
  return _pallas_bias_gelu(x, bias.astype(jnp.float32), tuple(axes or ()), not gpu)
