"""Self-attention over packed rows: the math behind `model.SelfAttention`, one entry point.

A row of `sequence_ids` [B, T] says which packed sequence each token belongs to: 0 is padding,
k >= 1 the k-th sequence of the row. A query attends a key iff both carry the same nonzero id,
so attention is block-diagonal and never crosses from one packed sequence to another. An
unpacked batch is the special case `sequence_ids = input_mask`.

Padding queries (id 0) attend every real key of their row, as in the original BERT (whose mask
is over keys only): their outputs stay finite and, unpacked, equal the original's everywhere.
No loss reads them; the fused kernels treat them differently (see below), also finitely.

Implementations (`model.attention_impl`):
  xla     einsums and a softmax (jax.nn.dot_product_attention), with attention dropout written
          out. Every backend; the default and the reference in tests.
  cudnn   cuDNN's fused flash attention on NVIDIA GPUs, through the public
          `jax.nn.dot_product_attention(implementation='cudnn')`, the block-diagonal mask passed
          as a mask (cuDNN adds it as a bias inside the kernel). Padding queries as in xla.
          Every tile of the [T, T] square is computed, also those between two packed
          sequences (about 70% of them in a full 512-token row of BERT-length sequences).
          A 'cudnn_varlen' (cuDNN's packed layout, only the tiles inside each sequence) was
          removed: slower than this on an H200 at 128 and at 512 tokens (README, "Attention").
  splash  Pallas splash attention on TPUs, packing given as segment ids, under `shard_map`
          over the mesh (batch over data/fsdp, heads over tensor). Padding queries attend the
          padding keys. Sequence lengths must be multiples of 128 (the kernel's tiles).

Local (sliding-window) attention (`local_window` W > 0, ModernBERT's `local_attention`): a
query also attends only the keys at most W / 2 tokens away in its row, on top of the packing
mask (a packed sequence is contiguous, so that is W / 2 within its sequence). xla and cudnn take
it as part of the mask; splash as its `LocalMask` (tiles outside the band are skipped). With
scanned layers of two kinds (`local` traced per layer) only the mask-based
implementations apply: splash builds one kernel per mask, fixed when traced.

Neither fused kernel applies attention dropout: JAX's public cuDNN call has none (its private
one takes its dropout seed as a static Python int: the same mask every step unless
recompiled), and splash has none. Training with one of them therefore needs
`model.attention_probs_dropout_prob=0` (as RoBERTa-era recipes and MosaicBERT train); asking
for a fused kernel with attention dropout is an error, never a silent fall back to xla.
"""

import contextlib
import contextvars
import functools
from typing import Callable, Iterator, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas.ops.tpu import splash_attention as splash
from jax.sharding import PartitionSpec as P

from bert_jax import config_checks
from bert_jax.errors import UserError

Array = jax.Array

IMPLEMENTATIONS = config_checks.CHOICES['model.attention_impl']
# The backend each fused kernel runs on (jax.default_backend() names).
_BACKENDS = {'cudnn': 'gpu', 'splash': 'tpu'}
# Splash attention tiles sequences in blocks of multiples of 128 (the TPU lane width).
SPLASH_BLOCK = 128
_NO_DROPOUT = ("the fused {impl} kernel applies no attention dropout in JAX (the public cuDNN "
               "call and splash attention have none; JAX's private cuDNN call fixes its "
               "dropout seed at compile time, so the same mask would repeat every step). Train "
               "with --config.model.attention_probs_dropout_prob=0 (as RoBERTa-era recipes and "
               "MosaicBERT do) to use it, or keep model.attention_impl='xla'")


# The platform a program is being lowered for when that is not this process's backend: an
# ahead-of-time compile for GPUs from a CPU host (`aot.py`). The fused kernel follows the
# target.
_TARGET: contextvars.ContextVar[tuple[str, tuple[int, int] | None] | None] = (
    contextvars.ContextVar('bert_jax_attention_target', default=None))


@contextlib.contextmanager
def lowering_for(platform: str,
                 compute_capability: tuple[int, int] | None = None) -> Iterator[None]:
  """Within it, attention is traced for `platform` ('gpu', 'tpu') whatever the backend; for
  a GPU, of `compute_capability` (major, minor) if given."""
  token = _TARGET.set((platform, compute_capability))
  try:
    yield
  finally:
    _TARGET.reset(token)


def target_platform() -> str:
  """The platform being lowered for: `lowering_for`'s, else this process's backend."""
  target = _TARGET.get()
  return target[0] if target else jax.default_backend()


def target_compute_capability() -> tuple[int, int] | None:
  """The compute capability of the GPU being lowered for: `lowering_for`'s, else this
  process's first GPU's; None when neither says (not a GPU, or a GPU compile that named none)."""
  target = _TARGET.get()
  if target:
    return target[1]
  return compute_capability(jax.devices()[0]) if jax.default_backend() == 'gpu' else None


def compute_capability(device) -> tuple[int, int] | None:
  """A GPU device's compute capability (its '9.0' as (9, 0)); None for other devices."""
  capability = getattr(device, 'compute_capability', None)
  return tuple(int(v) for v in str(capability).split('.')[:2]) if capability else None


def check_config(impl: str, attention_dropout: float, platform: str,
                 seq_lens: Sequence[int] = (), training: bool = True, local_window: int = 0,
                 scanned_kinds: bool = False) -> None:
  """UserErrors for an attention implementation that cannot run as configured.

  `platform` is the backend the step will run on ('cpu', 'gpu', 'tpu'); `seq_lens` the
  sequence lengths it will see (every phase or bucket); `local_window` the local layers'
  window (0: none); `scanned_kinds` whether scanned layers mix local and global attention.
  """
  config_checks.check_choice('model.attention_impl', impl)  # For a direct caller.
  config_checks.check_local_attention(impl, local_window, scanned_kinds)
  if impl == 'xla':
    return
  if platform != _BACKENDS[impl]:
    raise UserError(f"model.attention_impl={impl!r} runs on {_BACKENDS[impl].upper()}s only, "
                    f"but this run's backend is {platform!r}: use model.attention_impl='xla'")
  if training and attention_dropout > 0:
    raise UserError(f'model.attention_impl={impl!r} with model.attention_probs_dropout_prob='
                    f'{attention_dropout}: ' + _NO_DROPOUT.format(impl=impl))
  if impl == 'splash':
    bad = sorted({int(t) for t in seq_lens if int(t) % SPLASH_BLOCK})
    if bad:
      raise UserError(f"model.attention_impl='splash' tiles sequences in blocks of "
                      f'{SPLASH_BLOCK} tokens, so every sequence length must be a multiple of '
                      f'{SPLASH_BLOCK}; got {bad} (data.max_seq_length, train.phases or '
                      'buckets)')


def block_diagonal_mask(sequence_ids: Array, local_window: int = 0,
                        local: bool | Array = True) -> Array:
  """[B, T] sequence ids -> [B, 1, T, T] bool: query t may attend key s. With `local_window`
  W > 0 and `local` (a bool, or a traced one), also only |t - s| <= W / 2."""
  q = sequence_ids[:, None, :, None]
  k = sequence_ids[:, None, None, :]
  mask = (k > 0) & ((q == k) | (q == 0))
  if local_window and local is not False:
    t = sequence_ids.shape[1]
    band = jnp.abs(jnp.arange(t)[:, None] - jnp.arange(t)[None, :]) <= local_window // 2
    mask = mask & (band | jnp.logical_not(local))
  return mask


def dot_product_attention(q: Array, k: Array, v: Array, sequence_ids: Array, *, impl: str,
                          probs_dropout: Callable[[Array], Array] | None = None,
                          local_window: int = 0, local: bool | Array = True) -> Array:
  """Softmax(q k^T / sqrt(d)) v within each packed sequence; q, k, v are [B, T, heads, d].

  `probs_dropout` (training with attention dropout) is applied to the attention
  probabilities; only the xla implementation can. `local_window` W > 0: where `local` (a
  bool, or traced in scanned layers), keys at most W / 2 tokens from the query only.
  """
  config_checks.check_choice('model.attention_impl', impl)  # For a direct caller.
  if probs_dropout is not None and impl != 'xla':
    raise UserError(f'model.attention_impl={impl!r} in training with '
                    'model.attention_probs_dropout_prob > 0: ' + _NO_DROPOUT.format(impl=impl))
  if local is False:
    local_window = 0
  config_checks.check_local_attention(impl, local_window, not isinstance(local, bool))
  if impl == 'splash':
    return splash_attention(q, k, v, sequence_ids, local_window=local_window)
  mask = block_diagonal_mask(sequence_ids, local_window, local)
  if impl == 'cudnn':
    _check_cudnn_inputs(q)
    return jax.nn.dot_product_attention(q, k, v, mask=mask, implementation='cudnn')
  assert impl == 'xla', impl
  if probs_dropout is not None:
    # jax.nn.dot_product_attention has no dropout: the same numerics, written out.
    logits = jnp.einsum('btnh,bsnh->bnts', q, k, preferred_element_type=jnp.float32)
    logits = logits / np.sqrt(q.shape[-1]).astype(np.float32)
    logits = jnp.where(mask, logits, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(logits, axis=-1)
    probs = probs_dropout(probs).astype(v.dtype)
    return jnp.einsum('bnts,bsnh->btnh', probs, v)
  return jax.nn.dot_product_attention(q, k, v, mask=mask, implementation='xla')


def _check_cudnn_inputs(q: Array) -> None:
  """UserErrors for what cuDNN's fused attention cannot take, said before cuDNN does."""
  if target_platform() != 'gpu':
    raise UserError("model.attention_impl='cudnn' needs an NVIDIA GPU; this backend is "
                    f"{target_platform()!r}: use model.attention_impl='xla'")
  if q.dtype not in (jnp.bfloat16, jnp.float16) or q.shape[-1] % 8 or q.shape[-1] > 128:
    # cuDNN's fused attention takes 16-bit inputs and heads of at most 128 in steps of 8;
    # said here rather than by cuDNN on the cluster.
    raise UserError("model.attention_impl='cudnn' needs bfloat16 or float16 compute and a "
                    f'head size that is a multiple of 8 up to 128; got {q.dtype} and '
                    f'{q.shape[-1]} (model.dtype, hidden_size / num_attention_heads): use '
                    "model.dtype=bfloat16 or model.attention_impl='xla'")


# ---------------------------------------------------------------------------------------------
# Splash attention (TPU)
# ---------------------------------------------------------------------------------------------


def splash_block_sizes(seq_len: int) -> splash.BlockSizes:
  """The largest tile of 512, 256 or 128 tokens that divides the sequence, everywhere."""
  if seq_len % SPLASH_BLOCK:
    raise UserError(f"model.attention_impl='splash' needs a sequence length that is a multiple "
                    f'of {SPLASH_BLOCK}, got {seq_len} (data.max_seq_length, train.phases or '
                    'buckets)')
  b = next(b for b in (512, 256, 128) if seq_len % b == 0)
  return splash.BlockSizes(block_q=b, block_kv=b, block_kv_compute=b, block_q_dkv=b,
                           block_kv_dkv=b, block_kv_dkv_compute=b, block_q_dq=b, block_kv_dq=b)


def _splash_local(q: Array, k: Array, v: Array, sequence_ids: Array, interpret: bool,
                  local_window: int = 0) -> Array:
  """Splash attention on one device's shard: [b, T, n, d] with [b, T] segment ids."""
  _, seq_len, heads, head_dim = q.shape
  shape = (seq_len, seq_len)
  one = (splash.LocalMask(shape, (local_window // 2, local_window // 2), offset=0)
         if local_window else splash.FullMask(shape))
  mask = splash.MultiHeadMask([one] * heads)
  kernel = splash.make_splash_mha(mask, head_shards=1, q_seq_shards=1,
                                  block_sizes=splash_block_sizes(seq_len), interpret=interpret)
  # The kernel takes pre-scaled queries, one example at a time, heads first.
  q = q * jnp.asarray(1.0 / np.sqrt(head_dim), q.dtype)

  def one(q, k, v, ids):
    t = lambda x: jnp.transpose(x, (1, 0, 2))
    out = kernel(t(q), t(k), t(v), segment_ids=splash.SegmentIds(q=ids, kv=ids))
    return t(out)

  return jax.vmap(one)(q, k, v, sequence_ids)


def splash_attention(q: Array, k: Array, v: Array, sequence_ids: Array,
                     interpret: bool | None = None, local_window: int = 0) -> Array:
  """Block-diagonal attention with Pallas splash attention; q, k, v are [B, T, heads, d].

  On a TPU the Mosaic kernel runs; elsewhere (tests on CPU) Pallas interprets the same kernel,
  chosen when the program is lowered, so an AOT compile for a TPU gets the real kernel. Under
  a mesh the kernel runs per device through `shard_map`: the batch split as the activations'
  'batch' rule says, heads as 'act_heads', the sequence whole (splash cannot split keys).
  `local_window` W > 0: a `LocalMask` of W / 2 keys each side.
  """
  local = functools.partial(_splash_local, local_window=local_window)
  if interpret is not None:
    fn = functools.partial(local, interpret=interpret)
  else:
    fn = lambda *a: jax.lax.platform_dependent(
        *a, tpu=functools.partial(local, interpret=False),
        default=functools.partial(local, interpret=True))
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return fn(q, k, v, sequence_ids)
  batch, _, heads, _ = nn.logical_to_mesh_axes(('batch', 'length', 'act_heads', 'kv'))
  qkv_spec, ids_spec = P(batch, None, heads, None), P(batch, None)
  return jax.shard_map(fn, mesh=mesh, in_specs=(qkv_spec, qkv_spec, qkv_spec, ids_spec),
                       out_specs=qkv_spec, check_vma=False)(q, k, v, sequence_ids)
