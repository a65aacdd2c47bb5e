"""The layers BERT is made of: LayerNorms, dense layers (in FP8 too), the embeddings,
self-attention, the feed-forward block, the encoder layer and the stack of them.

`model.py` assembles them into BERT and its heads and holds `BertConfig`, whose fields every
layer here reads (`config`). Parameters are float32 and carry logical axis names (vocab, embed,
mlp, heads, kv, layers); activations are constrained with names (batch, length, act_embed,
act_mlp, act_heads); compute runs in the config's dtype.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import flax.linen as nn
from flax.linen.dtypes import promote_dtype
import jax
import jax.numpy as jnp

from bert_jax import activations
from bert_jax import attention
from bert_jax import config_checks
from bert_jax import fp8
from bert_jax import layer_norm
from bert_jax import rotary
from bert_jax.errors import UserError
from bert_jax.fp8 import (
    FP8_AMAX_HISTORY, FP8_AMAX_SLOTS, FP8_COLLECTION, FP8_HISTORY, FP8_SCALE, FP8_TENSORS,
    fp8_dot_general, fp8_gelu_mlp, fp8_matmuls_per_layer, fp8_rows, use_fp8)

if TYPE_CHECKING:
  from bert_jax.model import BertConfig  # pylint: disable=g-bad-import-order

Array = jax.Array


# ---------------------------------------------------------------------------------------------
# Building blocks
# ---------------------------------------------------------------------------------------------

ACTIVATIONS: dict[str, Callable[[Array], Array]] = {
    'gelu': lambda x: jax.nn.gelu(x, approximate=False),   # The paper's exact erf GELU.
    'gelu_new': lambda x: jax.nn.gelu(x, approximate=True),
    'gelu_pytorch_tanh': lambda x: jax.nn.gelu(x, approximate=True),
    'relu': jax.nn.relu,
    'silu': jax.nn.silu,
    'swish': jax.nn.silu,
}

REMAT_POLICIES = {
    'none': None,
    'full': jax.checkpoint_policies.nothing_saveable,
    'dots': jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}
assert tuple(REMAT_POLICIES) == config_checks.CHOICES['model.remat_policy']


def normal_init(config: BertConfig, axes: tuple[str | None, ...]):
  """Truncated-normal init (the original's) with logical axis names attached."""
  return nn.with_logical_partitioning(
      nn.initializers.truncated_normal(config.initializer_range), axes)


def zeros_init(axes):
  return nn.with_logical_partitioning(nn.initializers.zeros_init(), axes)


def ones_init(axes):
  return nn.with_logical_partitioning(nn.initializers.ones_init(), axes)


def _norm_params(module: nn.Module, config: BertConfig, h: int) -> tuple[Array, Array]:
  """A LayerNorm's (scale, bias) parameters; the bias a constant 0 when config.use_bias is off."""
  scale = module.param('scale', ones_init(('embed',)), (h,), jnp.float32)
  if not config.use_bias:
    return scale, jnp.zeros((h,), jnp.float32)
  return scale, module.param('bias', zeros_init(('embed',)), (h,), jnp.float32)


class LayerNorm(nn.Module):
  """LayerNorm with float32 statistics and affine; output in the compute dtype."""
  config: BertConfig

  @nn.compact
  def __call__(self, x: Array) -> Array:
    scale, bias = _norm_params(self, self.config, x.shape[-1])
    x = x.astype(jnp.float32)
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
    y = (x - mean) * jax.lax.rsqrt(var + self.config.layer_norm_eps) * scale + bias
    return y.astype(self.config.compute_dtype)


def hidden_dropout_seed(module: nn.Module, config: BertConfig,
                        deterministic: bool) -> Array | None:
  """The seed of a hidden-dropout mask (`layer_norm.dropout_seed`) from `module`'s 'dropout'
  rng, or None when no dropout applies. Drawn by the caller, outside the LayerNorm's scope, so
  that profiles name the rng's kernels dropout, not LayerNorm."""
  if deterministic or not layer_norm.keep_threshold(config.hidden_dropout_prob):
    return None
  return layer_norm.dropout_seed(module.make_rng('dropout'))


class ResidualLayerNorm(nn.Module):
  """LayerNorm(residual + dropout(x + bias)): a post-LN sub-layer's end (`layer_norm.py`).

  The parameters are LayerNorm's (scale, bias). `x` is the sub-layer's projection without its
  bias, which is passed as `x_bias` (float32) so that the fused kernel adds it, and returns its
  gradient, in the same pass. `seed`: `hidden_dropout_seed`'s, or None (no dropout).
  With residual_copy (post-LN) it returns the output twice, (y, y): the first for the next
  sub-layer, the second for the LayerNorm after it as its residual, so that the fused backward
  takes the two gradients as two inputs instead of their sum (layer_norm.residual_layer_norm's
  residual_copy). Pre-LN layers keep the residual stream apart (`layer_norm.residual_add`):
  one output.
  """
  config: BertConfig
  residual_copy: bool = True

  @nn.compact
  def __call__(self, x: Array, residual: Array, x_bias: Array | None, seed: Array | None,
               fp8_grad: tuple | None = None, fp8_out: tuple | None = None) -> Array | tuple:
    """`fp8_grad`: (scale table, index, *channel) of the FP8 matmul that computed x, if it
    has a channel; `fp8_out`: (scale table, index) of the input scale of the FP8 matmul the
    output goes to, whose quantized input and amaxes are then returned after the output(s)
    (`layer_norm.residual_layer_norm`)."""
    c = self.config
    scale, bias = _norm_params(self, c, x.shape[-1])
    rate = c.hidden_dropout_prob if seed is not None else 0.0
    # Initialization traces a dummy batch for the parameters' shapes only: plain jnp. A
    # BertConfig built in code may say 'auto': for the platform being lowered for.
    impl = 'xla' if self.is_initializing() else c.resolved('layer_norm_impl')
    return layer_norm.residual_layer_norm(
        x, residual, x_bias, scale, bias, seed, rate=rate, eps=c.layer_norm_eps, impl=impl,
        out_dtype=c.compute_dtype, residual_copy=self.residual_copy, fp8_grad=fp8_grad,
        fp8_out=None if fp8_out is None else (*fp8_out, FP8_TENSORS[0][1]))


class DenseGeneral(nn.Module):
  """`nn.DenseGeneral` over the trailing `num_in` input axes: same parameters, init and math.

  Flax's own creates the kernel flattened to 2-D and, whenever a mesh is set (`jax.set_mesh`,
  which activation constraints need), constrains that flat value with the kernel's logical
  names: for [embed, heads, kv] and [heads, kv, embed] kernels it fails on a rank mismatch,
  even in `apply` (Flax re-runs the initializer abstractly to check shapes). Here the kernel
  is created at its full shape.
  """
  config: BertConfig
  features: tuple[int, ...]
  axes: tuple[str | None, ...]   # The kernel's logical axes: input axes, then features.
  num_in: int = 1
  activation: str | None = None  # A key of ACTIVATIONS applied to the output, or none.
  # False: return (x @ kernel, bias) for a consumer that adds the float32 bias itself.
  add_bias: bool = True
  use_bias: bool = True  # False: no bias parameter (the returned bias is then None).
  # The output's logical axes, which place the fused GELU kernels under a mesh.
  activation_axes: tuple[str | None, ...] | None = None

  @nn.compact
  def __call__(self, x: Array, fp8_scales: tuple | None = None,
               grad_channel: bool = False, x_quantized: tuple | None = None) -> Array:
    """`fp8_scales`: the matmul's FP8 scales [3] and amax slots [3, FP8_AMAX_ROWS] or None
    (`fp8_dot_general`), or None (no FP8). grad_channel (FP8, add_bias=False): return the
    matmul's gradient channel third, for the ResidualLayerNorm that the output goes to;
    x_quantized: x in FP8 and its amaxes, from the ResidualLayerNorm that computed x."""
    c, n = self.config, self.num_in
    kernel = self.param('kernel', normal_init(c, self.axes), x.shape[-n:] + self.features,
                        jnp.float32)
    bias = (self.param('bias', zeros_init(self.axes[n:]), self.features, jnp.float32)
            if self.use_bias else None)
    f32_bias = bias
    x, kernel = promote_dtype(x, kernel, dtype=c.compute_dtype)
    dims = ((tuple(range(x.ndim - n, x.ndim)), tuple(range(n))), ((), ()))
    y = (jax.lax.dot_general(x, kernel, dims) if fp8_scales is None
         else fp8_dot_general(x, kernel, dims, *fp8_scales, grad_channel=grad_channel,
                              x_quantized=x_quantized))
    if grad_channel:
      assert not self.add_bias, 'a gradient channel is for the LayerNorm that adds the bias'
      y, channel = y
      return y, f32_bias, channel
    if not self.add_bias:
      return y, f32_bias
    # The paper's dense GELU takes model.gelu_impl's kernel: the float32 bias as it is stored
    # (no cast kernel; its gradient summed in float32).
    impl = ('xla' if self.is_initializing() or self.activation != 'gelu'
            else c.resolved('gelu_impl'))
    return activate(c, y, f32_bias, self.activation, impl=impl, axes=self.activation_axes)


def activate(config: BertConfig, y: Array, bias: Array | None, activation: str | None, *,
             impl: str = 'xla', axes: tuple[str | None, ...] | None = None) -> Array:
  """activation(y + bias) (bias may be None, activation a key of ACTIVATIONS or None). The
  exact GELU is `activations.bias_gelu` (kernel `impl`, output axes `axes`), or with
  config.portable_gelu `activations.portable_bias_gelu` (the SavedModel export)."""
  if activation == 'gelu':
    bias = jnp.zeros(y.shape[-1:], jnp.float32) if bias is None else bias
    if config.portable_gelu:
      return activations.portable_bias_gelu(y, bias)
    # Bias add and exact GELU in one function that keeps only y for its backward.
    return activations.bias_gelu(y, bias, impl=impl, axes=axes)
  y = y if bias is None else y + bias.astype(y.dtype)
  return ACTIVATIONS[activation](y) if activation else y


def dense(config: BertConfig, features, axes, name: str, in_axes=-1,
           activation: str | None = None, add_bias: bool = True,
           use_bias: bool = True, activation_axes=None) -> nn.Module:
  features = features if isinstance(features, tuple) else (features,)
  in_axes = in_axes if isinstance(in_axes, tuple) else (in_axes,)
  if in_axes != tuple(range(-len(in_axes), 0)):
    raise ValueError(f'in_axes {in_axes} are not the trailing axes')
  return DenseGeneral(config, features, tuple(axes), num_in=len(in_axes),
                      activation=activation, add_bias=add_bias, use_bias=use_bias,
                      activation_axes=activation_axes, name=name)


def constrain(x: Array, axes: tuple[str | None, ...]) -> Array:
  return nn.with_logical_constraint(x, axes)


# The decoder's vocabulary is padded to a multiple of this inside its matmul (see
# `Embeddings.attend`), as NVIDIA's and MosaicBERT's BERTs pad it (30522 -> 30528).
VOCAB_MULTIPLE = 64


def _one_hot_lookup(table: Array, ids: Array, dtype) -> Array:
  """table[ids] as one_hot(ids) @ table: exactly the rows (HIGHEST precision: no TF32), with a
  matmul for a gradient. Out-of-range ids give zeros, never another row."""
  one_hot = jax.nn.one_hot(ids, table.shape[0], dtype=dtype)
  return jnp.dot(one_hot, table.astype(dtype), precision=jax.lax.Precision.HIGHEST)


class Embeddings(nn.Module):
  """Word + learned position + token type embeddings, LayerNorm, dropout (masks hashed from a
  seed: `layer_norm.dropout_seed`). Rotary models have no position table (positions rotate the
  queries and keys instead), models with type_vocab_size 0 no token types."""
  config: BertConfig

  def setup(self):
    c = self.config
    self.word_embeddings = nn.Embed(c.vocab_size, c.hidden_size, dtype=c.compute_dtype,
                                    param_dtype=jnp.float32,
                                    embedding_init=normal_init(c, ('vocab', 'embed')))
    if not c.rotary:
      self.position_embeddings = nn.Embed(c.max_position_embeddings, c.hidden_size,
                                          dtype=c.compute_dtype, param_dtype=jnp.float32,
                                          embedding_init=normal_init(c, (None, 'embed')))
    if c.type_vocab_size:
      self.token_type_embeddings = nn.Embed(c.type_vocab_size, c.hidden_size,
                                            dtype=c.compute_dtype, param_dtype=jnp.float32,
                                            embedding_init=normal_init(c, (None, 'embed')))
    self.layer_norm = LayerNorm(c, name='layer_norm')

  def __call__(self, input_ids: Array, segment_ids: Array, deterministic: bool,
               position_ids: Array | None = None) -> Array:
    seq_len = input_ids.shape[1]
    if self.config.max_length and seq_len > self.config.max_length:
      raise UserError(f'sequence length {seq_len} exceeds max_position_embeddings '
                      f'{self.config.max_position_embeddings}')
    # Small tables are read by one-hot matmuls rather than gathers (the original BERT does the
    # same for token types): the same values, but the gradient of a gather is a scatter-add,
    # and on GPUs 256 x 128 tokens adding into 2 token-type rows took 31 ms of a 154 ms
    # BERT-base step (atomics on a few addresses; README "Performance"). Unpacked rows read the
    # first seq_len positions, whose gradient is a sum over the batch.
    dtype = self.config.compute_dtype
    x = self.word_embeddings(input_ids)
    if self.config.rotary:
      pass  # Positions rotate each layer's queries and keys (SelfAttention).
    elif position_ids is None:
      x = x + self.position_embeddings.embedding[None, :seq_len].astype(dtype)
    else:  # Packed rows give each sequence positions from 0.
      x = x + _one_hot_lookup(self.position_embeddings.embedding, position_ids, dtype)
    if self.config.type_vocab_size:
      x = x + _one_hot_lookup(self.token_type_embeddings.embedding, segment_ids, dtype)
    x = constrain(x, ('batch', 'length', 'act_embed'))
    x = self.layer_norm(x)
    seed = hidden_dropout_seed(self, self.config, deterministic)
    return layer_norm.dropout(x, seed, self.config.hidden_dropout_prob)

  def attend(self, x: Array, padded: bool = False) -> Array:
    """Logits over the vocabulary with the (tied) word embedding matrix.

    Except on TPUs, the matmul runs over the vocabulary padded with zero rows to a multiple of
    `VOCAB_MULTIPLE`: 30522 rows ran a misaligned cuBLAS kernel (2-element alignment,
    247 TFLOP/s on an H100) in both directions. The padding exists only inside this matmul:
    parameters and checkpoints keep `vocab_size`, and so do the logits unless `padded`
    (then [..., padded vocabulary], the pad columns 0: see model.MlmHead)."""
    table = self.word_embeddings.embedding
    x, table = promote_dtype(x, table, dtype=self.config.compute_dtype)
    vocab = table.shape[0]
    # Not on TPUs: their compiler tiles the vocabulary itself, and its SPMD partitioner fails
    # (an XLA RET_CHECK with libtpu 0.0.42 and 0.0.50) on the slice of the padded table's gradient when the
    # batch is split over both mesh.data and mesh.fsdp and the vocabulary is not split.
    if attention.target_platform() != 'tpu':
      table = jnp.pad(table, ((0, -vocab % VOCAB_MULTIPLE), (0, 0)))
    logits = jnp.dot(x, table.T)
    return logits if padded else logits[..., :vocab]


class DenseParams(nn.Module):
  """A dense layer's kernel and bias, created as `DenseGeneral` creates them, but not applied:
  for layers whose matmul is shared with others (`SelfAttention`'s one QKV projection)."""
  config: BertConfig
  in_features: tuple[int, ...]
  features: tuple[int, ...]
  axes: tuple[str | None, ...]   # The kernel's logical axes: input axes, then features.

  @nn.compact
  def __call__(self) -> tuple[Array, Array | None]:
    c, n = self.config, len(self.in_features)
    kernel = self.param('kernel', normal_init(c, self.axes), self.in_features + self.features,
                        jnp.float32)
    if not c.use_bias:  # Only the encoder's layers are made of these.
      return kernel, None
    bias = self.param('bias', zeros_init(self.axes[n:]), self.features, jnp.float32)
    return kernel, bias


def _stacked_matmul(module: nn.Module, x: Array, params: list, fp8_scales: tuple | None,
                    scope: str, x_quantized: tuple | None = None) -> Array:
  """x @ the kernels of `params` (DenseParams' (kernel, bias) pairs) stacked on a new axis 1,
  as one matmul (named `scope`; in FP8 with `fp8_scales`, its scales and amax slots), plus
  their biases (if any):
  [..., len(params), *features]."""
  c = module.config
  kernel = jnp.stack([k.astype(c.compute_dtype) for k, _ in params], axis=1)
  bias = (None if params[0][1] is None else
          jnp.stack([b.astype(c.compute_dtype) for _, b in params], axis=0))
  x = x.astype(c.compute_dtype)
  dims = (((x.ndim - 1,), (0,)), ((), ()))
  with jax.named_scope(scope):  # Named so that the GPU step budget test finds it as one.
    y = (jax.lax.dot_general(x, kernel, dims) if fp8_scales is None
         else fp8_dot_general(x, kernel, dims, *fp8_scales, x_quantized=x_quantized))
    return y if bias is None else y + bias


class SelfAttention(nn.Module):
  """Multi-head self-attention within each packed sequence (see `attention.py`)."""
  config: BertConfig
  deterministic: bool = True

  @nn.compact
  def __call__(self, x: Array, sequence_ids: Array, positions: Array | None = None,
               local: bool | Array = False, fp8_scales: list[tuple] | None = None,
               grad_channel: bool = False, x_quantized: tuple | None = None) -> Array:
    """`positions` [B, T]: rotary models' token positions; `local`: whether this layer
    attends locally (a traced bool in scanned layers of both kinds); `fp8_scales`: the FP8
    scales and amax slots of its matmuls, input projection(s) first
    (`fp8_matmuls_per_layer`), or None; grad_channel: the output projection's, x_quantized:
    the stacked QKV projection's (`DenseGeneral`)."""
    c = self.config
    heads, head_dim = c.num_attention_heads, c.head_dim
    # Q, K and V are one matmul against the three kernels stacked as [embed, 3, heads, kv]:
    # its backward is one K=3*hidden matmul for the input gradient (three K=hidden ones and
    # two adds before) and one for the kernels'. The parameters stay three (query, key, value),
    # as checkpoints, the original BERT and transformers have them; stacking 3 x hidden^2
    # weights per step costs next to nothing. Heads stay the sharded axis.
    params = [DenseParams(c, (x.shape[-1],), (heads, head_dim), ('embed', 'heads', 'kv'),
                          name=name)() for name in ('query', 'key', 'value')]
    fp8 = fp8_scales or [None] * 4
    if c.qkv_projection == 'separate':
      # Three matmuls, each writing its own dense [batch, length, heads, kv] buffer: the
      # attention kernel reads q, k and v in place and writes dq, dk and dv where the three
      # backward matmuls read them (no slice of a fused output, no concatenate of its
      # gradient), at the price of three K=hidden input-gradient matmuls summed.
      q, k, v = (constrain(_stacked_matmul(self, x, [p], s, name)[:, :, 0],
                           ('batch', 'length', 'act_heads', 'kv'))
                 for p, s, name in zip(params, fp8, ('query', 'key', 'value')))
      fp8 = fp8[3:]
    else:
      qkv = _stacked_matmul(self, x, params, fp8[0], 'qkv', x_quantized)
      fp8 = fp8[1:]
      qkv = constrain(qkv, ('batch', 'length', None, 'act_heads', 'kv'))
      q, k, v = (constrain(qkv[:, :, i], ('batch', 'length', 'act_heads', 'kv'))
                 for i in range(3))
    if c.rotary:
      theta = (c.local_rope_theta if local is True else c.rope_theta if local is False
               else jnp.where(local, c.local_rope_theta, c.rope_theta))
      cos, sin = rotary.angles(positions, head_dim, theta)
      q, k = (constrain(rotary.apply(t, cos, sin), ('batch', 'length', 'act_heads', 'kv'))
              for t in (q, k))
    rate = 0.0 if self.deterministic else c.attention_probs_dropout_prob
    probs_dropout = nn.Dropout(rate, deterministic=False) if rate > 0.0 else None
    # Parameters do not depend on the kernel, and init traces a short dummy batch that a fused
    # kernel's tiles may not fit: initialization always takes the xla path.
    impl = 'xla' if self.is_initializing() else c.attention_impl
    out = attention.dot_product_attention(q, k, v, sequence_ids, impl=impl,
                                          probs_dropout=probs_dropout,
                                          local_window=c.local_attention_window, local=local)
    out = constrain(out, ('batch', 'length', 'act_heads', 'kv'))
    # (projection, its bias): the bias is added in the layer's ResidualLayerNorm.
    return dense(c, c.hidden_size, ('heads', 'kv', 'embed'), 'output', in_axes=(-2, -1),
                  add_bias=False, use_bias=c.use_bias)(out, fp8[0], grad_channel)


class Mlp(nn.Module):
  """The feed-forward block: act(x W + b) (the paper's), or with mlp_type='gated'
  act(x W + b) * (x V + c) (GeGLU/SwiGLU), W and V one stacked matmul as Q, K and V are."""
  config: BertConfig
  deterministic: bool = True

  @nn.compact
  def __call__(self, x: Array, fp8_scales: list[tuple] | None = None,
               grad_channel: bool = False, x_quantized: tuple | None = None,
               kernel_scales: tuple | None = None) -> Array:
    """`fp8_scales`: the FP8 scales and amax slots of its input and output matmuls, or
    None; grad_channel: the output projection's, x_quantized: the input projection's
    (`DenseGeneral`); kernel_scales: the GELU kernels' (`fp8.fp8_gelu_mlp`)."""
    c = self.config
    fp8 = fp8_scales or [None, None]
    if c.mlp_type == 'gated':
      params = [DenseParams(c, (x.shape[-1],), (c.intermediate_size,), ('embed', 'mlp'),
                            name=name)() for name in ('intermediate', 'gate')]
      y = constrain(_stacked_matmul(self, x, params, fp8[0], 'gated', x_quantized),
                     ('batch', 'length', None, 'act_mlp'))
      # The biases are in y already: the activation's own is none. XLA's GELU (gelu_impl's
      # kernel fuses a dense layer's bias add and GELU: config_checks refuses it here).
      h = activate(c, y[:, :, 0], None, c.hidden_act) * y[:, :, 1]
    elif fp8[0] is not None and _fused_fp8_gelu(self, c):
      return _fp8_gelu_mlp(c, x, fp8, grad_channel, x_quantized, kernel_scales)
    else:
      h = dense(c, c.intermediate_size, ('embed', 'mlp'), 'intermediate',
                activation=c.hidden_act, use_bias=c.use_bias,
                activation_axes=('batch', 'length', 'act_mlp'))(x, fp8[0],
                                                               x_quantized=x_quantized)
    h = constrain(h, ('batch', 'length', 'act_mlp'))
    # (projection, its bias): the bias is added in the layer's ResidualLayerNorm.
    return dense(c, c.hidden_size, ('mlp', 'embed'), 'output', add_bias=False,
                  use_bias=c.use_bias)(h, fp8[1], grad_channel)


def _fused_fp8_gelu(module: nn.Module, c: BertConfig) -> bool:
  """Whether the FP8 MLP runs as `fp8.fp8_gelu_mlp`: the paper's MLP with gelu_impl's Pallas
  kernels, which then write the quantized tensors themselves, where they can (Hopper on)."""
  return (c.hidden_act == 'gelu' and not c.portable_gelu and not module.is_initializing() and
          c.resolved('gelu_impl') == 'pallas' and fp8.gelu_kernels_can_quantize())


def _fp8_gelu_mlp(c: BertConfig, x: Array, fp8_scales: list[tuple], grad_channel: bool,
                  x_quantized: tuple | None, kernel_scales: tuple | None) -> tuple:
  """The paper's MLP in FP8 with the GELU's kernels quantizing (`fp8.fp8_gelu_mlp`), on the
  parameters `dense` would create; returns (projection, its bias[, gradient channel]) as
  `Mlp` does."""
  shapes = ((x.shape[-1], c.intermediate_size, ('embed', 'mlp'), 'intermediate'),
            (c.intermediate_size, c.hidden_size, ('mlp', 'embed'), 'output'))
  (k1, b1), (k2, b2) = [DenseParams(c, (n_in,), (n_out,), axes, name=name)()
                        for n_in, n_out, axes, name in shapes]
  b1 = jnp.zeros((c.intermediate_size,), jnp.float32) if b1 is None else b1
  k1, k2 = (k.astype(c.compute_dtype) for k in (k1, k2))
  y = fp8_gelu_mlp(x, k1, b1, k2, fp8_scales[0], fp8_scales[1],
                   axes=('batch', 'length', 'act_mlp'),
                   interpret=attention.target_platform() != 'gpu', grad_channel=grad_channel,
                   x_quantized=x_quantized, kernel_scales=kernel_scales)
  return (y[0], b2, y[1]) if grad_channel else (y, b2)


def _grad_channels(module: nn.Module, c: BertConfig, fp8_scales: tuple | None) -> bool:
  """Whether a post-LN layer's LayerNorm kernels quantize for its FP8 matmuls: each
  backward kernel the output gradient of the projection before it (`fp8.fp8_dot_general`'s
  grad_channel), each forward kernel the input of the matmul after it (x_quantized): with the
  Pallas LayerNorm, where Triton can write FP8 (as the GELU kernels, Hopper on)."""
  return (fp8_scales is not None and not module.is_initializing() and
          c.resolved('layer_norm_impl') == 'pallas' and fp8.gelu_kernels_can_quantize())


class EncoderLayer(nn.Module):
  """The paper's post-LN Transformer layer: x = LN(x + Attn(x)); x = LN(x + MLP(x)).

  The carry is (x, residual), the layer input twice (ResidualLayerNorm's two outputs): x for
  the attention, residual for its LayerNorm; in unrolled FP8 layers with the Pallas
  LayerNorm also (x in FP8, its amaxes) for the QKV projection (`__call__`'s fp8_table).
  With pre_layer_norm it is (h, LN(h)), the
  residual stream and its normalization: h += Attn(LN(h)); h += MLP(LN(h)). Each LN is of
  the sum the sub-layer before ends in, so it is still one fused LayerNorm(residual +
  dropout(projection + bias)) (`layer_norm.py`), and the stream the same sum
  (`layer_norm.residual_add`); the embeddings' LayerNorm is layer 0's input norm (ModernBERT's
  layout), and the last layer's output_norm is the final norm.
  """
  config: BertConfig
  deterministic: bool = True
  # Return the output a second time (a scan's per-layer outputs: the hidden states); without,
  # a scan would still stack [layers, B, T, H] of them.
  hidden_states: bool = True
  # Whether the layer attends locally; None: the `local` argument says (a traced bool, in
  # scanned layers of both kinds).
  local: bool | None = False
  # The layer's index in unrolled layers (None: scanned), where its FP8 scales sit in
  # `fp8_table`.
  layer_index: int | None = None

  @nn.compact
  def __call__(self, carry, sequence_ids: Array, positions: Array | None,
               local: Array | None = None, fp8_scales: tuple | None = None,
               fp8_table: Array | None = None):
    """`fp8_scales`: this layer's FP8 scales [matmuls, 3] and amax slots [matmuls, 3,
    FP8_AMAX_ROWS] or None (`Encoder`), or None; `fp8_table`: every layer's scales flattened
    (unrolled FP8 layers), from which its Pallas kernels read the scales they quantize by in
    place (else they read this layer's own, flattened), and with a next layer (not
    rematerialized: a carry is saved whole) whose QKV is one stacked matmul, the output
    LayerNorm quantizes its output for that projection: the carry's third element (its
    x_quantized)."""
    c = self.config
    local = self.local if self.local is not None else local
    fp8 = ([None] * fp8_matmuls_per_layer(c) if fp8_scales is None else
           fp8_rows(fp8_scales, fp8_scales[0].shape[0]))
    attention_fp8, mlp_fp8 = fp8[:-2], fp8[-2:]
    drop = lambda: hidden_dropout_seed(self, c, self.deterministic)
    embed = lambda x: constrain(x, ('batch', 'length', 'act_embed'))
    attention_ = SelfAttention(c, self.deterministic, name='attention')
    if not c.pre_layer_norm:
      x, residual, *x_quantized = carry
      # Each sub-layer ends in LayerNorm(x + dropout(projection + bias)), one fused op. In
      # FP8 its kernels quantize the projection's output gradient and the next matmul's
      # input (_grad_channels).
      channel = _grad_channels(self, c, fp8_scales)
      in_place = channel and c.qkv_projection == 'stacked'  # One QKV input scale.
      if channel:
        table, first, has_next = (fp8_scales[0].reshape(-1), 0, False)
        if fp8_table is not None:
          table, first = fp8_table, self.layer_index * fp8_scales[0].size
          # Rematerialized layers keep their inputs for the backward pass: the FP8 copy in the
          # carry would be one more [tokens, hidden] tensor a layer.
          has_next = (self.layer_index + 1 < c.num_hidden_layers and
                      c.remat_policy == 'none')
        # The flat index of the scale of matmul m's tensor t (FP8_TENSORS) in `table`.
        at = lambda m, t: first + m * len(FP8_TENSORS) + t
        out_m, in_m = len(attention_fp8) - 1, len(attention_fp8)  # Attention output, MLP.
      attn, attn_bias, *attn_channel = attention_(
          x, sequence_ids, positions, local, attention_fp8, channel,
          x_quantized[0] if x_quantized and in_place else None)
      x, residual, *x_quantized = ResidualLayerNorm(c, name='attention_layer_norm')(
          attn, residual, attn_bias, drop(),
          (table, at(out_m, 2), *attn_channel[0]) if channel else None,
          fp8_out=(table, at(in_m, 0)) if channel else None)
      y, y_bias, *y_channel = Mlp(c, self.deterministic, name='mlp')(
          embed(x), mlp_fp8, channel, tuple(x_quantized) or None,
          (table, at(in_m + 1, 0), at(in_m, 2)) if channel else None)
      # The next layer's QKV input scale: its row follows this layer's in the table.
      out_scale = (table, at(len(fp8), 0)) if in_place and has_next else None
      x, residual, *x_quantized = ResidualLayerNorm(c, name='output_layer_norm')(
          y, embed(residual), y_bias, drop(),
          (table, at(in_m + 1, 2), *y_channel[0]) if channel else None, fp8_out=out_scale)
      x, residual = embed(x), embed(residual)
      # The carry for the next layer, and the per-layer output (hidden states).
      carry = (x, residual) + ((tuple(x_quantized),) if x_quantized else ())
      return carry, (x if self.hidden_states else None)
    h, normed = carry
    rate = 0.0 if self.deterministic else c.hidden_dropout_prob
    mlp = Mlp(c, self.deterministic, name='mlp')
    for name, sublayer in (
        ('mlp_norm', lambda n: attention_(n, sequence_ids, positions, local, attention_fp8)),
        ('output_norm', lambda n: mlp(n, mlp_fp8))):
      y, y_bias = sublayer(normed)
      seed = drop()
      # One mask (one seed) for the LayerNorm's sum and the stream's: the same sum.
      normed = embed(ResidualLayerNorm(c, residual_copy=False, name=name)(y, h, y_bias, seed))
      h = embed(layer_norm.residual_add(y, h, y_bias, seed, rate))
    return (h, normed), (h if self.hidden_states else None)


class Encoder(nn.Module):
  """A stack of encoder layers, looped or `nn.scan`-ed, optionally rematerialized."""
  config: BertConfig

  @nn.compact
  def __call__(self, x: Array, sequence_ids: Array, deterministic: bool = True,
               return_hidden_states: bool = False,
               positions: Array | None = None) -> tuple[Array, list[Array]]:
    c = self.config
    layer_cls = EncoderLayer
    policy = REMAT_POLICIES[c.remat_policy]
    if c.remat_policy != 'none':
      layer_cls = nn.remat(layer_cls, policy=policy, prevent_cse=not c.scan_layers)
    kinds = [c.is_local_layer(i) for i in range(c.num_hidden_layers)]
    # Post-LN: (x, residual), the input twice; pre-LN: (h, LN(h)), the embeddings' LayerNorm
    # being layer 0's input norm.
    carry = (x, x)
    fp8 = None
    if use_fp8(self, c, deterministic):
      # Every FP8 matmul's scales (and histories, which only the step reads: fp8_advance) in
      # one variable: a step updates them in a few kernels (see MATMUL_PRECISIONS).
      shape = (c.num_hidden_layers, fp8_matmuls_per_layer(c), len(FP8_TENSORS))
      fp8 = self.variable(FP8_COLLECTION, FP8_SCALE, jnp.ones, shape, jnp.float32).value
      self.variable(FP8_COLLECTION, FP8_HISTORY, jnp.zeros, shape + (FP8_AMAX_HISTORY,),
                    jnp.float32)
      # A training step's amax slots (fp8_step_scales), read where given (not at init).
      fp8 = (fp8, self.get_variable(FP8_COLLECTION, FP8_AMAX_SLOTS)
             if self.has_variable(FP8_COLLECTION, FP8_AMAX_SLOTS) else None)
    if c.scan_layers:
      # Layers of two kinds share one trace: each gets its kind as a scanned input; each its
      # FP8 scales likewise.
      mixed = len(set(kinds)) > 1
      scanned = nn.scan(layer_cls, variable_axes={'params': 0},
                        split_rngs={'params': True, 'dropout': True},
                        in_axes=(nn.broadcast, nn.broadcast, 0 if mixed else nn.broadcast,
                                 nn.broadcast if fp8 is None else 0),
                        length=c.num_hidden_layers,
                        metadata_params={nn.PARTITION_NAME: 'layers'})
      carry, stacked = scanned(c, deterministic, return_hidden_states,
                               None if mixed else kinds[0], name='layers')(
                                   carry, sequence_ids, positions,
                                   jnp.asarray(kinds) if mixed else None, fp8)
      hidden = [stacked[i] for i in range(c.num_hidden_layers)] if return_hidden_states else []
    else:
      hidden = []
      per_layer = None if fp8 is None else fp8_rows(fp8, c.num_hidden_layers)
      for i in range(c.num_hidden_layers):
        # Every scale flattened, which the layers' Pallas kernels read in place.
        carry, h = layer_cls(c, deterministic, True, kinds[i], i, name=f'layer_{i}')(
            carry, sequence_ids, positions, None, None if fp8 is None else per_layer[i],
            None if fp8 is None else fp8[0].reshape(-1))
        hidden.append(h)
      if not return_hidden_states:
        hidden = []
    # Pre-LN: the sequence output is the last layer's output_norm (the final norm).
    return (carry[1] if c.pre_layer_norm else carry[0]), hidden
