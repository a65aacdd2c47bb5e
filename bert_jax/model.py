"""BERT in Flax linen: embeddings, post-LN encoder, pooler, pre-training and fine-tuning heads.

Parameters are float32 and carry logical axis names (vocab, embed, mlp, heads, kv, layers) that
`sharding.py` maps onto a device mesh; activations are constrained with names (batch, length,
act_embed, act_mlp, act_heads). Compute runs in `BertConfig.dtype` (bfloat16 on accelerators);
softmax, LayerNorm statistics and losses stay in float32.

Parameter layout (unscanned; with `scan_layers` the per-layer trees are stacked under
`encoder/layers` with a leading `layers` axis):

  bert/embeddings/{word_embeddings,position_embeddings,token_type_embeddings}/embedding
  bert/embeddings/layer_norm/{scale,bias}
  bert/encoder/layer_{i}/attention/{query,key,value}/{kernel [embed,heads,kv], bias [heads,kv]}
  bert/encoder/layer_{i}/attention/output/{kernel [heads,kv,embed], bias}
  bert/encoder/layer_{i}/attention_layer_norm/{scale,bias}
  bert/encoder/layer_{i}/mlp/{intermediate,output}/{kernel,bias}
  bert/encoder/layer_{i}/output_layer_norm/{scale,bias}
  bert/pooler/{kernel,bias}
  mlm/transform/{kernel,bias}, mlm/layer_norm/{scale,bias}, mlm/output_bias   (tied decoder)
  nsp/{kernel,bias}
  classifier/{kernel,bias}  (sequence / token classification), qa_outputs/{kernel,bias}

With matmul_precision='fp8' the encoder's matmuls also keep FP8 scales and amax histories, in
the FP8_COLLECTION variable collection (not parameters): .../attention/qkv_fp8/*,
.../attention/output/fp8/*, .../mlp/{intermediate,output}/fp8/*.
"""

import dataclasses
import json
import re
from typing import Any, Callable

import flax.linen as nn
from flax.linen import fp8_ops
from flax.linen.dtypes import promote_dtype
import jax
import jax.numpy as jnp
import numpy as np

from bert_jax import activations
from bert_jax import attention
from bert_jax import config_checks
from bert_jax import layer_norm
from bert_jax.errors import UserError

Array = jax.Array

# ---------------------------------------------------------------------------------------------
# Configuration
# ---------------------------------------------------------------------------------------------

# The fields of the original bert_config.json, in its order.
_ORIGINAL_FIELDS = (
    'vocab_size', 'hidden_size', 'num_hidden_layers', 'num_attention_heads',
    'intermediate_size', 'hidden_act', 'hidden_dropout_prob', 'attention_probs_dropout_prob',
    'max_position_embeddings', 'type_vocab_size', 'initializer_range')


@dataclasses.dataclass(frozen=True)
class BertConfig:
  """Architecture (the original fields) plus how to run it (dtype, scan, remat, attention)."""
  vocab_size: int = 30522
  hidden_size: int = 768
  num_hidden_layers: int = 12
  num_attention_heads: int = 12
  intermediate_size: int = 3072
  hidden_act: str = 'gelu'
  hidden_dropout_prob: float = 0.1
  attention_probs_dropout_prob: float = 0.1
  max_position_embeddings: int = 512
  type_vocab_size: int = 2
  initializer_range: float = 0.02
  layer_norm_eps: float = 1e-12
  # How to run, not what the model is: not written to bert_config.json.
  dtype: str = 'float32'
  scan_layers: bool = False
  remat_policy: str = 'none'
  attention_impl: str = 'xla'   # 'xla', 'cudnn', 'cudnn_varlen' or 'splash': see attention.py.
  # The most sequences in one row (data.packing_max_sequences): cudnn_varlen's segment tables.
  max_packed_sequences: int = attention.DEFAULT_MAX_SEQUENCES
  layer_norm_impl: str = 'xla'  # 'xla', 'pallas' or 'auto' (`resolve`): see layer_norm.py.
  gelu_impl: str = 'xla'  # 'xla', 'pallas' or 'auto' (`resolve`): see activations.py.
  # 'default' (matmuls in `dtype`) or 'fp8': see MATMUL_PRECISIONS.
  matmul_precision: str = 'default'
  # The exact GELU's erf in StableHLO's core operations (`activations.portable_bias_gelu`),
  # which TensorFlow's XlaCallModule reads: the SavedModel export (export.py). Training runs
  # `activations.bias_gelu`.
  portable_gelu: bool = False

  def __post_init__(self):
    if self.hidden_size % self.num_attention_heads:
      raise UserError(f'hidden_size {self.hidden_size} is not a multiple of '
                      f'num_attention_heads {self.num_attention_heads}')
    if self.hidden_act not in _ACTIVATIONS:
      raise UserError(f'hidden_act {self.hidden_act!r} is not one of {sorted(_ACTIVATIONS)}')
    # The run fields, for a BertConfig built in code (config_from's are checked where the
    # config loads): config_checks' own check and line.
    for key in ('remat_policy', 'attention_impl', 'layer_norm_impl', 'gelu_impl',
                'matmul_precision'):
      config_checks.check_choice(f'model.{key}', getattr(self, key))
    if self.max_packed_sequences < 1:
      raise UserError(f'max_packed_sequences={self.max_packed_sequences}: a row holds at least '
                      'one sequence (data.packing_max_sequences)')
    jnp.dtype(self.dtype)  # Raises on an unknown dtype name.

  @property
  def head_dim(self) -> int:
    return self.hidden_size // self.num_attention_heads

  @property
  def compute_dtype(self) -> jnp.dtype:
    return jnp.dtype(self.dtype)

  def replace(self, **kwargs) -> 'BertConfig':
    return dataclasses.replace(self, **kwargs)

  # ---- JSON in the original and the Hugging Face formats ----

  @classmethod
  def from_dict(cls, d: dict[str, Any], source: str = 'config') -> 'BertConfig':
    """Reads a bert_config.json or a Hugging Face config.json dict (extra keys ignored)."""
    model_type = d.get('model_type', 'bert')
    if model_type != 'bert':
      raise UserError(f'{source}: model_type is {model_type!r}, only BERT is supported')
    missing = [k for k in _ORIGINAL_FIELDS if k not in d and k != 'initializer_range']
    if missing:
      raise UserError(f'{source}: missing BERT config fields {missing}')
    if d.get('position_embedding_type', 'absolute') != 'absolute':
      raise UserError(f'{source}: position_embedding_type '
                      f'{d["position_embedding_type"]!r} is not supported (absolute only)')
    # Only the architecture: a file's `dtype` (HF writes one) says how it was saved, not how
    # to compute, and must not switch the compute dtype.
    kwargs = {k: d[k] for k in _ORIGINAL_FIELDS + ('layer_norm_eps',) if k in d}
    return cls(**kwargs)

  def to_original_dict(self) -> dict[str, Any]:
    """The fields of the original bert_config.json (plus layer_norm_eps if not default)."""
    d = {k: getattr(self, k) for k in _ORIGINAL_FIELDS}
    if self.layer_norm_eps != 1e-12:
      d['layer_norm_eps'] = self.layer_norm_eps
    return d

  def to_hf_dict(self) -> dict[str, Any]:
    """A Hugging Face `config.json` for BertForPreTraining."""
    d = {k: getattr(self, k) for k in _ORIGINAL_FIELDS}
    d.update(architectures=['BertForPreTraining'], model_type='bert',
             layer_norm_eps=self.layer_norm_eps, pad_token_id=0,
             position_embedding_type='absolute', torch_dtype='float32')
    return d

  def to_json_string(self, hf: bool = False) -> str:
    d = self.to_hf_dict() if hf else self.to_original_dict()
    return json.dumps(d, indent=2, sort_keys=not hf) + '\n'

  def write_json(self, path: str, hf: bool = False) -> None:
    with open(path, 'w') as f:
      f.write(self.to_json_string(hf))


# How the encoder's dense matmuls (the one QKV projection, the attention output and the two MLP
# projections) run in training steps (`deterministic=False`):
# - 'default': in the compute dtype (`BertConfig.dtype`).
# - 'fp8': FP8 with delayed scaling (flax's `Fp8DirectDotGeneralOp`, Transformer Engine's
#   recipe): inputs and kernels in float8_e4m3fn, output gradients in float8_e5m2, each scaled
#   by the largest magnitude of the last FP8_AMAX_HISTORY steps. The scales and amax histories
#   live in the FP8_COLLECTION variable collection: the "gradient" a step computes for them is
#   their new value, which replaces them (`state_extras.FP8_SCALES`), never an
#   optimizer update. Hopper GPUs and later run these as FP8 GEMMs; elsewhere XLA emulates them
#   (correct, slower).
# The embeddings (exact one-hot lookups), the pooler, the MLM transform and the tied decoder,
# and the task heads stay in the compute dtype: a few percent of the FLOPs, and the decoder's
# logits feed the loss directly, where FP8's 3-bit mantissa would cost the most accuracy.
# Evaluation and prediction (`deterministic=True`) run every matmul in the compute dtype,
# with the parameters alone: the numbers a user of the exported weights gets.
MATMUL_PRECISIONS = config_checks.CHOICES['model.matmul_precision']
FP8_COLLECTION = fp8_ops.OVERWRITE_WITH_GRADIENT
FP8_AMAX_HISTORY = 1024  # Transformer Engine's default history length.

# Named sizes: (layers, hidden, heads), defined where a config's model.size is checked.
SIZES = config_checks.MODEL_SIZES


def config_for_size(size: str, **overrides) -> BertConfig:
  """`BertConfig` of a named size (see `SIZES`), with any field overridden."""
  config_checks.check_choice('model.size', size)
  layers, hidden, heads = SIZES[size]
  return BertConfig(num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                    intermediate_size=4 * hidden, **overrides)


def config_from(model: Any, *, vocab_size: int = 0, checkpoint: BertConfig | None = None,
                max_packed_sequences: int | None = None,
                platform: str | None = None) -> BertConfig:
  """The BertConfig of a config's `model` block: the one place that decodes it.

  The architecture is `checkpoint`'s when given (fine-tuning or evaluating a checkpoint: its
  shape wins), else model.size's with model.vocab_size (0 = `vocab_size`, the tokenizer's),
  model.max_position_embeddings and model.type_vocab_size (pre-training from scratch). Either
  way the block says how to run it: dtype, dropout, layer stacking, rematerialization, the
  attention and LayerNorm kernels, the encoder matmuls' precision; 'auto' resolved for
  `platform` (`resolve`: None is the platform being lowered for, else this process's
  backend). `max_packed_sequences` is the most sequences one row holds
  (data.packing_max_sequences); None keeps BertConfig's.
  """
  run = dict(dtype=resolve('dtype', model.dtype, platform),
             hidden_dropout_prob=model.hidden_dropout_prob,
             attention_probs_dropout_prob=model.attention_probs_dropout_prob,
             scan_layers=model.scan_layers, remat_policy=model.remat_policy,
             attention_impl=model.attention_impl,
             layer_norm_impl=resolve('layer_norm_impl', model.layer_norm_impl, platform),
             gelu_impl=resolve('gelu_impl', model.gelu_impl, platform),
             matmul_precision=model.matmul_precision)
  if max_packed_sequences is not None:
    run['max_packed_sequences'] = max_packed_sequences
  if checkpoint is not None:
    return checkpoint.replace(**run)
  if model.vocab_size and model.vocab_size < vocab_size:
    raise UserError(f'model.vocab_size={model.vocab_size} is smaller than the vocabulary '
                    f'({vocab_size} tokens in data.vocab_file)')
  return config_for_size(model.size, vocab_size=model.vocab_size or vocab_size,
                         max_position_embeddings=model.max_position_embeddings,
                         type_vocab_size=model.type_vocab_size, **run)


# What 'auto' means for each model key that takes it, by platform: the one place that says.
_AUTO: dict[str, Callable[[str], str]] = {
    # Accelerators compute in bfloat16 (parameters stay float32); CPUs in float32.
    'dtype': lambda platform: 'bfloat16' if platform in ('gpu', 'tpu') else 'float32',
    # The fused Pallas kernel where it lowers through Triton (NVIDIA GPUs); elsewhere it would
    # run in interpret mode, for tests only.
    'layer_norm_impl': lambda platform: 'pallas' if platform == 'gpu' else 'xla',
    # XLA's GELU everywhere: on an H100 (jax 0.11.2, 2026-11-28) the Pallas pair was no faster
    # in isolation (forward 0.288 vs 0.284 ms, backward 0.406 vs 0.384 at [32768, 3072]
    # bf16) and the step compiled to as many GELU kernels either way (activations.py).
    'gelu_impl': lambda platform: 'xla',
}


def resolve(key: str, value: str, platform: str | None = None) -> str:
  """`value` of model.`key` ('dtype', 'layer_norm_impl', 'gelu_impl'), with 'auto' resolved
  for `platform` ('cpu', 'gpu', 'tpu': what the model runs on or is compiled for; None: the
  platform being lowered for, `attention.target_platform`: `attention.lowering_for`'s, else
  this process's backend)."""
  if value != 'auto':
    return value
  return _AUTO[key](platform or attention.target_platform())


def resolve_dtype(name: str, platform: str | None = None) -> str:
  """A config's `model.dtype` (`resolve`): 'auto' is bfloat16 on GPUs and TPUs, float32 on
  CPUs."""
  return resolve('dtype', name, platform)


# ---------------------------------------------------------------------------------------------
# Building blocks
# ---------------------------------------------------------------------------------------------

_ACTIVATIONS: dict[str, Callable[[Array], Array]] = {
    'gelu': lambda x: jax.nn.gelu(x, approximate=False),   # The paper's exact erf GELU.
    'gelu_new': lambda x: jax.nn.gelu(x, approximate=True),
    'gelu_pytorch_tanh': lambda x: jax.nn.gelu(x, approximate=True),
    'relu': jax.nn.relu,
    'silu': jax.nn.silu,
    'swish': jax.nn.silu,
}

_REMAT_POLICIES = {
    'none': None,
    'full': jax.checkpoint_policies.nothing_saveable,
    'dots': jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}
assert tuple(_REMAT_POLICIES) == config_checks.CHOICES['model.remat_policy']


def _init(config: BertConfig, axes: tuple[str | None, ...]):
  """Truncated-normal init (the original's) with logical axis names attached."""
  return nn.with_logical_partitioning(
      nn.initializers.truncated_normal(config.initializer_range), axes)


def _zeros(axes):
  return nn.with_logical_partitioning(nn.initializers.zeros_init(), axes)


def _ones(axes):
  return nn.with_logical_partitioning(nn.initializers.ones_init(), axes)


def _layer_norm(config: BertConfig, name: str) -> nn.Module:
  return LayerNorm(config, name=name)


class LayerNorm(nn.Module):
  """LayerNorm with float32 statistics and affine; output in the compute dtype."""
  config: BertConfig

  @nn.compact
  def __call__(self, x: Array) -> Array:
    h = x.shape[-1]
    scale = self.param('scale', _ones(('embed',)), (h,), jnp.float32)
    bias = self.param('bias', _zeros(('embed',)), (h,), jnp.float32)
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
  Returns the output twice, (y, y): the first for the next sub-layer, the second for the
  LayerNorm after it as its residual, so that the fused backward takes the two gradients as
  two inputs instead of their sum (layer_norm.residual_layer_norm's residual_copy).
  """
  config: BertConfig

  @nn.compact
  def __call__(self, x: Array, residual: Array, x_bias: Array | None,
               seed: Array | None) -> Array:
    c = self.config
    h = x.shape[-1]
    scale = self.param('scale', _ones(('embed',)), (h,), jnp.float32)
    bias = self.param('bias', _zeros(('embed',)), (h,), jnp.float32)
    rate = c.hidden_dropout_prob if seed is not None else 0.0
    # Initialization traces a dummy batch for the parameters' shapes only: plain jnp. A
    # BertConfig built in code may say 'auto': for the platform being lowered for.
    impl = 'xla' if self.is_initializing() else resolve('layer_norm_impl', c.layer_norm_impl)
    return layer_norm.residual_layer_norm(
        x, residual, x_bias, scale, bias, seed, rate=rate, eps=c.layer_norm_eps, impl=impl,
        out_dtype=c.compute_dtype, residual_copy=True)


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
  activation: str | None = None  # A key of _ACTIVATIONS applied to the output, or none.
  # False: return (x @ kernel, bias) for a consumer that adds the float32 bias itself.
  add_bias: bool = True
  fp8: bool = False  # The matmul through `fp8_dot_general` (matmul_precision='fp8').
  # The output's logical axes, which place the fused GELU kernels under a mesh.
  activation_axes: tuple[str | None, ...] | None = None

  @nn.compact
  def __call__(self, x: Array) -> Array:
    c, n = self.config, self.num_in
    kernel = self.param('kernel', _init(c, self.axes), x.shape[-n:] + self.features,
                        jnp.float32)
    bias = self.param('bias', _zeros(self.axes[n:]), self.features, jnp.float32)
    f32_bias = bias
    x, kernel, bias = promote_dtype(x, kernel, bias, dtype=c.compute_dtype)
    dims = ((tuple(range(x.ndim - n, x.ndim)), tuple(range(n))), ((), ()))
    y = (fp8_dot_general(x, kernel, dims) if self.fp8
         else jax.lax.dot_general(x, kernel, dims))
    if not self.add_bias:
      return y, f32_bias
    if self.activation == 'gelu' and c.portable_gelu:
      return activations.portable_bias_gelu(y, bias)
    if self.activation == 'gelu':
      # Bias add and exact GELU in one function that keeps only y for its backward; the
      # float32 bias as it is stored (no cast kernel; its gradient summed in float32).
      impl = 'xla' if self.is_initializing() else resolve('gelu_impl', c.gelu_impl)
      return activations.bias_gelu(y, f32_bias, impl=impl, axes=self.activation_axes)
    y = y + bias
    return _ACTIVATIONS[self.activation](y) if self.activation else y


def fp8_dot_general(x: Array, kernel: Array, dims, name: str = 'fp8') -> Array:
  """`lax.dot_general(x, kernel, dims)` in FP8 with delayed scaling, its scales and amax
  histories in the calling module's FP8_COLLECTION (see MATMUL_PRECISIONS). Call it inside
  a compact module."""
  return fp8_ops.Fp8DirectDotGeneralOp(amax_history_length=FP8_AMAX_HISTORY, name=name)(
      x, kernel, dims)


def use_fp8(module: nn.Module, config: BertConfig, deterministic: bool) -> bool:
  """Whether `module`'s encoder matmuls run in FP8: with matmul_precision='fp8', in training
  (and at init, which creates their scales), never in evaluation or prediction."""
  return config.matmul_precision == 'fp8' and (not deterministic or module.is_initializing())


def _dense(config: BertConfig, features, axes, name: str, in_axes=-1,
           activation: str | None = None, add_bias: bool = True,
           fp8: bool = False, activation_axes=None) -> nn.Module:
  features = features if isinstance(features, tuple) else (features,)
  in_axes = in_axes if isinstance(in_axes, tuple) else (in_axes,)
  if in_axes != tuple(range(-len(in_axes), 0)):
    raise ValueError(f'in_axes {in_axes} are not the trailing axes')
  return DenseGeneral(config, features, tuple(axes), num_in=len(in_axes),
                      activation=activation, add_bias=add_bias, fp8=fp8,
                      activation_axes=activation_axes, name=name)


def _constrain(x: Array, axes: tuple[str | None, ...]) -> Array:
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
  seed: `layer_norm.dropout_seed`)."""
  config: BertConfig

  def setup(self):
    c = self.config
    self.word_embeddings = nn.Embed(c.vocab_size, c.hidden_size, dtype=c.compute_dtype,
                                    param_dtype=jnp.float32,
                                    embedding_init=_init(c, ('vocab', 'embed')))
    self.position_embeddings = nn.Embed(c.max_position_embeddings, c.hidden_size,
                                        dtype=c.compute_dtype, param_dtype=jnp.float32,
                                        embedding_init=_init(c, (None, 'embed')))
    self.token_type_embeddings = nn.Embed(c.type_vocab_size, c.hidden_size,
                                          dtype=c.compute_dtype, param_dtype=jnp.float32,
                                          embedding_init=_init(c, (None, 'embed')))
    self.layer_norm = _layer_norm(c, 'layer_norm')

  def __call__(self, input_ids: Array, segment_ids: Array, deterministic: bool,
               position_ids: Array | None = None) -> Array:
    seq_len = input_ids.shape[1]
    if seq_len > self.config.max_position_embeddings:
      raise UserError(f'sequence length {seq_len} exceeds max_position_embeddings '
                      f'{self.config.max_position_embeddings}')
    # Small tables are read by one-hot matmuls rather than gathers (the original BERT does the
    # same for token types): the same values, but the gradient of a gather is a scatter-add,
    # and on GPUs 256 x 128 tokens adding into 2 token-type rows took 31 ms of a 154 ms
    # BERT-base step (atomics on a few addresses; README "Performance"). Unpacked rows read the
    # first seq_len positions, whose gradient is a sum over the batch.
    dtype = self.config.compute_dtype
    if position_ids is None:
      positions = self.position_embeddings.embedding[None, :seq_len].astype(dtype)
    else:  # Packed rows give each sequence positions from 0.
      positions = _one_hot_lookup(self.position_embeddings.embedding, position_ids, dtype)
    token_types = _one_hot_lookup(self.token_type_embeddings.embedding, segment_ids, dtype)
    x = self.word_embeddings(input_ids) + positions + token_types
    x = _constrain(x, ('batch', 'length', 'act_embed'))
    x = self.layer_norm(x)
    seed = hidden_dropout_seed(self, self.config, deterministic)
    return layer_norm.dropout(x, seed, self.config.hidden_dropout_prob)

  def attend(self, x: Array, padded: bool = False) -> Array:
    """Logits over the vocabulary with the (tied) word embedding matrix.

    The matmul runs over the vocabulary padded with zero rows to a multiple of
    `VOCAB_MULTIPLE`: 30522 rows ran a misaligned cuBLAS kernel (2-element alignment,
    247 TFLOP/s on an H100) in both directions. The padding exists only inside this matmul:
    parameters and checkpoints keep `vocab_size`, and so do the logits unless `padded`
    (then [..., padded vocabulary], the pad columns 0: see MlmHead)."""
    table = self.word_embeddings.embedding
    x, table = promote_dtype(x, table, dtype=self.config.compute_dtype)
    vocab = table.shape[0]
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
  def __call__(self) -> tuple[Array, Array]:
    c, n = self.config, len(self.in_features)
    kernel = self.param('kernel', _init(c, self.axes), self.in_features + self.features,
                        jnp.float32)
    bias = self.param('bias', _zeros(self.axes[n:]), self.features, jnp.float32)
    return kernel, bias


class SelfAttention(nn.Module):
  """Multi-head self-attention within each packed sequence (see `attention.py`)."""
  config: BertConfig
  deterministic: bool = True

  @nn.compact
  def __call__(self, x: Array, sequence_ids: Array) -> Array:
    c = self.config
    heads, head_dim = c.num_attention_heads, c.head_dim
    # Q, K and V are one matmul against the three kernels stacked as [embed, 3, heads, kv]:
    # its backward is one K=3*hidden matmul for the input gradient (three K=hidden ones and
    # two adds before) and one for the kernels'. The parameters stay three (query, key, value),
    # as checkpoints, the original BERT and transformers have them; stacking 3 x hidden^2
    # weights per step costs next to nothing. Heads stay the sharded axis.
    params = [DenseParams(c, (x.shape[-1],), (heads, head_dim), ('embed', 'heads', 'kv'),
                          name=name)() for name in ('query', 'key', 'value')]
    kernel = jnp.stack([k.astype(c.compute_dtype) for k, _ in params], axis=1)
    bias = jnp.stack([b.astype(c.compute_dtype) for _, b in params], axis=0)
    x = x.astype(c.compute_dtype)
    fp8 = use_fp8(self, c, self.deterministic)
    dims = (((x.ndim - 1,), (0,)), ((), ()))
    with jax.named_scope('qkv'):  # Named so that the GPU step budget test finds it as one.
      qkv = (fp8_dot_general(x, kernel, dims, name='qkv_fp8') if fp8
             else jax.lax.dot_general(x, kernel, dims)) + bias
    qkv = _constrain(qkv, ('batch', 'length', None, 'act_heads', 'kv'))
    q, k, v = (_constrain(qkv[:, :, i], ('batch', 'length', 'act_heads', 'kv'))
               for i in range(3))
    rate = 0.0 if self.deterministic else c.attention_probs_dropout_prob
    probs_dropout = nn.Dropout(rate, deterministic=False) if rate > 0.0 else None
    # Parameters do not depend on the kernel, and init traces a short dummy batch that a fused
    # kernel's tiles may not fit: initialization always takes the xla path.
    impl = 'xla' if self.is_initializing() else c.attention_impl
    out = attention.dot_product_attention(q, k, v, sequence_ids, impl=impl,
                                          probs_dropout=probs_dropout,
                                          max_sequences=c.max_packed_sequences)
    out = _constrain(out, ('batch', 'length', 'act_heads', 'kv'))
    # (projection, its bias): the bias is added in the layer's ResidualLayerNorm.
    return _dense(c, c.hidden_size, ('heads', 'kv', 'embed'), 'output', in_axes=(-2, -1),
                  add_bias=False, fp8=fp8)(out)


class Mlp(nn.Module):
  config: BertConfig
  deterministic: bool = True

  @nn.compact
  def __call__(self, x: Array) -> Array:
    c = self.config
    fp8 = use_fp8(self, c, self.deterministic)
    h = _dense(c, c.intermediate_size, ('embed', 'mlp'), 'intermediate',
               activation=c.hidden_act, fp8=fp8,
               activation_axes=('batch', 'length', 'act_mlp'))(x)
    h = _constrain(h, ('batch', 'length', 'act_mlp'))
    # (projection, its bias): the bias is added in the layer's ResidualLayerNorm.
    return _dense(c, c.hidden_size, ('mlp', 'embed'), 'output', add_bias=False, fp8=fp8)(h)


class EncoderLayer(nn.Module):
  """The paper's post-LN Transformer layer: x = LN(x + Attn(x)); x = LN(x + MLP(x))."""
  config: BertConfig
  deterministic: bool = True
  # Return the output a second time (a scan's per-layer outputs: the hidden states); without,
  # a scan would still stack [layers, B, T, H] of them.
  hidden_states: bool = True

  @nn.compact
  def __call__(self, carry: tuple[Array, Array],
               sequence_ids: Array) -> tuple[tuple[Array, Array], Array | None]:
    """carry: (x, residual), the layer input twice (ResidualLayerNorm's two outputs): x for
    the attention, residual for its LayerNorm."""
    c = self.config
    x, residual = carry
    act = lambda a: _constrain(a, ('batch', 'length', 'act_embed'))
    # Each sub-layer ends in LayerNorm(x + dropout(projection + bias)), one fused op.
    drop = lambda: hidden_dropout_seed(self, c, self.deterministic)
    attn, attn_bias = SelfAttention(c, self.deterministic, name='attention')(x, sequence_ids)
    x, residual = map(act, ResidualLayerNorm(c, name='attention_layer_norm')(
        attn, residual, attn_bias, drop()))
    y, y_bias = Mlp(c, self.deterministic, name='mlp')(x)
    x, residual = map(act, ResidualLayerNorm(c, name='output_layer_norm')(
        y, residual, y_bias, drop()))
    # The carry for the next layer, and the per-layer output (hidden states).
    return (x, residual), (x if self.hidden_states else None)


class Encoder(nn.Module):
  """A stack of encoder layers, looped or `nn.scan`-ed, optionally rematerialized."""
  config: BertConfig

  @nn.compact
  def __call__(self, x: Array, sequence_ids: Array, deterministic: bool = True,
               return_hidden_states: bool = False) -> tuple[Array, list[Array]]:
    c = self.config
    layer_cls = EncoderLayer
    policy = _REMAT_POLICIES[c.remat_policy]
    if c.remat_policy != 'none':
      layer_cls = nn.remat(layer_cls, policy=policy, prevent_cse=not c.scan_layers)
    if c.scan_layers:
      # FP8 scales and histories are per layer, stacked like the parameters.
      axes = {'params': 0, **({FP8_COLLECTION: 0} if c.matmul_precision == 'fp8' else {})}
      scanned = nn.scan(layer_cls, variable_axes=axes,
                        split_rngs={'params': True, 'dropout': True},
                        in_axes=(nn.broadcast,), length=c.num_hidden_layers,
                        metadata_params={nn.PARTITION_NAME: 'layers'})
      (x, _), stacked = scanned(c, deterministic, return_hidden_states, name='layers')(
          (x, x), sequence_ids)
      hidden = [stacked[i] for i in range(c.num_hidden_layers)] if return_hidden_states else []
    else:
      hidden, carry = [], (x, x)
      for i in range(c.num_hidden_layers):
        carry, _ = layer_cls(c, deterministic, name=f'layer_{i}')(carry, sequence_ids)
        hidden.append(carry[0])
      x = carry[0]
      if not return_hidden_states:
        hidden = []
    return x, hidden


class BertModel(nn.Module):
  """Embeddings + encoder + pooler. Returns (sequence_output, pooled_output[, hidden_states])."""
  config: BertConfig

  def setup(self):
    self.embeddings = Embeddings(self.config)
    self.encoder = Encoder(self.config)
    # Hidden -> hidden, read by heads that contract over 'embed': laid out like the MLM
    # transform (see MlmHead), so its input gradient is never the dot XLA miscompiles.
    self.pooler = _dense(self.config, self.config.hidden_size, ('mlp', 'embed'), 'pooler')

  def __call__(self, input_ids: Array, input_mask: Array, segment_ids: Array,
               deterministic: bool = True, return_hidden_states: bool = False,
               sequence_ids: Array | None = None, position_ids: Array | None = None,
               cls_positions: Array | None = None):
    """`sequence_ids` [B, T]: 0 = padding, k = the k-th packed sequence of the row;
    attention stays within a sequence. None: one sequence per row (`input_mask`).
    `position_ids` [B, T] (packed rows: from 0 in each sequence; None: 0..T-1) and
    `cls_positions` [B, S] (packed rows: each sequence's [CLS]; the pooled output is then
    [B, S, H]; None: the row's first token, [B, H])."""
    if sequence_ids is None:
      sequence_ids = input_mask
    sequence_ids = sequence_ids.astype(jnp.int32)
    x = self.embeddings(input_ids, segment_ids, deterministic, position_ids)
    seq, hidden = self.encoder(x, sequence_ids, deterministic, return_hidden_states)
    first = seq[:, 0] if cls_positions is None else gather_positions(seq, cls_positions)
    pooled = jnp.tanh(self.pooler(first))
    if return_hidden_states:
      return seq, pooled, [x] + hidden
    return seq, pooled

  def attend(self, x: Array, padded: bool = False) -> Array:
    return self.embeddings.attend(x, padded)


# ---------------------------------------------------------------------------------------------
# Heads
# ---------------------------------------------------------------------------------------------


# The logit of a padded vocabulary column (MlmHead(padded_vocab=True)): exp() of it is 0 in
# float32 next to any real logit, so softmax, logsumexp and argmax ignore the column, and its
# gradient is exactly 0. Finite, so that no inf - inf can make a NaN.
PAD_LOGIT = -1e9


class MlmHead(nn.Module):
  """Transform (dense + activation + LayerNorm), then logits tied to the word embeddings.

  padded_vocab: return the logits over the decoder's padded vocabulary (a multiple of
  VOCAB_MULTIPLE), the pad columns at PAD_LOGIT: the same loss, predictions and gradients,
  but the decoder's matmul output is used as it is, so the backward feeds the loss's gradient
  straight into the matmul where the sliced logits made XLA pad it back with a copy of
  [predictions, vocabulary] (0.37 ms of BERT-base's step on an H200, issue 45)."""
  config: BertConfig
  padded_vocab: bool = False

  @nn.compact
  def __call__(self, x: Array, attend: Callable[..., Array]) -> Array:
    c = self.config
    x = _constrain(x, ('batch', None, 'act_embed'))
    # The transform maps back into the hidden ('embed') dimension that the LayerNorm and the
    # tied decoder read, like the attention and MLP output projections. Laid out as
    # ('embed', 'mlp'), its output (and so the decoder's input gradient, dlogits @ E) was
    # hidden-split over 'tensor', and XLA's SPMD partitioner (jax 0.10) miscompiles exactly
    # that dot: [batch/(data, fsdp), k/tensor] x [k/tensor, n/fsdp] -> [batch/(data, fsdp),
    # n/tensor] comes out with the rows of two batch shards swapped (a collective-permute it
    # never undoes) when data, fsdp and tensor are all > 1: the loss was right, the gradients
    # of the MLM head and everything below it were not.
    x = _dense(c, c.hidden_size, ('mlp', 'embed'), 'transform', activation=c.hidden_act,
               activation_axes=('batch', None, 'act_embed'))(x)
    x = _layer_norm(c, 'layer_norm')(x)
    x = _constrain(x, ('batch', None, 'act_embed'))
    bias = self.param('output_bias', _zeros(('vocab',)), (c.vocab_size,), jnp.float32)
    logits = attend(x, padded=self.padded_vocab)
    logits = _constrain(logits.astype(jnp.float32), ('batch', None, 'act_vocab'))
    if logits.shape[-1] > c.vocab_size:
      bias = jnp.concatenate([bias, jnp.full((logits.shape[-1] - c.vocab_size,), PAD_LOGIT,
                                             bias.dtype)])
    return logits + bias


def gather_positions(sequence: Array, positions: Array) -> Array:
  """[B, T, H] gathered at [B, P] positions -> [B, P, H], as a batched one-hot matmul: exactly
  the rows (one nonzero term each), and a matmul for a gradient. A gather's gradient is a
  scatter-add into an all-zeros [B, T, H] tensor, with the padding slots (position 0) adding
  into one row; as a matmul the BERT-base/128 step moves 2.5 GB less (deviceless H100
  compile, README "Performance")."""
  one_hot = jax.nn.one_hot(positions, sequence.shape[1], dtype=sequence.dtype)
  return jnp.einsum('bpt,bth->bph', one_hot, sequence, precision=jax.lax.Precision.HIGHEST)


class BertForPreTraining(nn.Module):
  """BERT with the MLM head (only at `masked_lm_positions`) and the NSP head.

  padded_vocab: MLM logits over the padded vocabulary, pad columns masked (MlmHead); for a
  loss, which they leave unchanged (the pre-training steps), not for a user of the logits."""
  config: BertConfig
  padded_vocab: bool = False

  @nn.compact
  def __call__(self, input_ids, input_mask, segment_ids, masked_lm_positions,
               deterministic: bool = True, sequence_ids: Array | None = None,
               position_ids: Array | None = None,
               next_sentence_positions: Array | None = None) -> tuple[Array, Array]:
    """Packed rows (`packing.py`) also give sequence_ids and position_ids [B, T] and
    next_sentence_positions [B, S]; the NSP logits are then [B, S, 2], one per sequence."""
    bert = BertModel(self.config, name='bert')
    seq, pooled = bert(input_ids, input_mask, segment_ids, deterministic,
                       sequence_ids=sequence_ids, position_ids=position_ids,
                       cls_positions=next_sentence_positions)
    # Only the P masked positions reach the vocabulary projection: [B, P, V], not [B, T, V].
    masked = gather_positions(seq, masked_lm_positions)
    mlm_logits = MlmHead(self.config, self.padded_vocab, name='mlm')(masked, bert.attend)
    nsp_logits = _dense(self.config, 2, ('embed', None), 'nsp')(pooled).astype(jnp.float32)
    return mlm_logits, nsp_logits


class BertForSequenceClassification(nn.Module):
  """Pooled [CLS] -> dropout -> dense. `num_labels=1` is regression (STS-B)."""
  config: BertConfig
  num_labels: int

  @nn.compact
  def __call__(self, input_ids, input_mask, segment_ids, deterministic: bool = True) -> Array:
    _, pooled = BertModel(self.config, name='bert')(input_ids, input_mask, segment_ids,
                                                    deterministic)
    pooled = nn.Dropout(self.config.hidden_dropout_prob)(pooled, deterministic=deterministic)
    return _dense(self.config, self.num_labels, ('embed', None), 'classifier')(
        pooled).astype(jnp.float32)


class BertForTokenClassification(nn.Module):
  """Every token -> dropout -> dense (NER tagging)."""
  config: BertConfig
  num_labels: int

  @nn.compact
  def __call__(self, input_ids, input_mask, segment_ids, deterministic: bool = True) -> Array:
    seq, _ = BertModel(self.config, name='bert')(input_ids, input_mask, segment_ids,
                                                 deterministic)
    seq = nn.Dropout(self.config.hidden_dropout_prob)(seq, deterministic=deterministic)
    return _dense(self.config, self.num_labels, ('embed', None), 'classifier')(
        seq).astype(jnp.float32)


class BertForQuestionAnswering(nn.Module):
  """Span QA: start and end logits per token, [B, T] each."""
  config: BertConfig

  @nn.compact
  def __call__(self, input_ids, input_mask, segment_ids,
               deterministic: bool = True) -> tuple[Array, Array]:
    seq, _ = BertModel(self.config, name='bert')(input_ids, input_mask, segment_ids,
                                                 deterministic)
    logits = _dense(self.config, 2, ('embed', None), 'qa_outputs')(seq).astype(jnp.float32)
    return logits[..., 0], logits[..., 1]


# ---------------------------------------------------------------------------------------------
# Parameter layout helpers and the public encode function
# ---------------------------------------------------------------------------------------------


def unstack_layers(params: dict, num_layers: int) -> dict:
  """Scanned layout (encoder/layers with a leading axis) -> encoder/layer_{i}. Idempotent."""
  def walk(tree):
    if not isinstance(tree, dict):
      return tree
    out = {}
    for k, v in tree.items():
      if k == 'encoder' and isinstance(v, dict) and 'layers' in v:
        enc = {kk: vv for kk, vv in v.items() if kk != 'layers'}
        for i in range(num_layers):
          enc[f'layer_{i}'] = jax.tree.map(lambda a, i=i: a[i], v['layers'])
        out[k] = enc
      else:
        out[k] = walk(v)
    return out
  return walk(params)


def stack_layers(params: dict) -> dict:
  """encoder/layer_{i} -> scanned layout (encoder/layers, leading axis). Idempotent."""
  def walk(tree):
    if not isinstance(tree, dict):
      return tree
    out = {}
    for k, v in tree.items():
      if k == 'encoder' and isinstance(v, dict) and 'layer_0' in v:
        names = sorted((n for n in v if re.fullmatch(r'layer_\d+', n)),
                       key=lambda n: int(n.split('_')[1]))
        if names != [f'layer_{i}' for i in range(len(names))]:
          raise ValueError(f'encoder layers are not numbered 0..{len(names) - 1}: {names}')
        layers = [v[n] for n in names]
        enc = {kk: vv for kk, vv in v.items() if kk not in names}
        stack = np.stack if isinstance(jax.tree.leaves(layers[0])[0], np.ndarray) else jnp.stack
        enc['layers'] = jax.tree.map(lambda *a: stack(a), *layers)
        out[k] = enc
      else:
        out[k] = walk(v)
    return out
  return walk(params)


def match_layout(config: BertConfig, params: dict) -> dict:
  """Puts `params` in the layout `config.scan_layers` expects."""
  if config.scan_layers:
    return stack_layers(params)
  return unstack_layers(params, config.num_hidden_layers)


def with_nsp_head(params: dict, hidden_size: int) -> dict:
  """`params` with an all-zero NSP head if it has none (a BertForMaskedLM checkpoint), so that
  BertForPreTraining applies to it; the NSP outputs are then meaningless and must not be used."""
  if 'nsp' in params:
    return params
  return dict(params, nsp={'kernel': np.zeros((hidden_size, 2), np.float32),
                           'bias': np.zeros(2, np.float32)})


def initial_fp8_meta(abstract: Any) -> Any:
  """The FP8 scales and amax histories a model starts with (flax's: scales 1, histories 0),
  shaped as the abstract tree `abstract` (ShapeDtypeStructs or arrays); None for None."""
  def initial(path, leaf):
    name = str(getattr(path[-1], 'key', path[-1]))
    if name.endswith('_scale'):
      return jnp.ones(leaf.shape, leaf.dtype)
    if name.endswith('_amax_history'):
      return jnp.zeros(leaf.shape, leaf.dtype)
    raise ValueError(f'unknown FP8 variable {jax.tree_util.keystr(path)}')
  return None if abstract is None else jax.tree_util.tree_map_with_path(initial, abstract)


def count_params(params) -> int:
  return int(sum(np.prod(np.shape(x)) for x in jax.tree.leaves(params)))


def init_params(config: BertConfig, rng: Array, model_cls=BertForPreTraining, seq_len: int = 8,
                **model_kwargs) -> dict:
  """Unboxed float32 parameters of `model_cls` (small example input; shapes don't depend on it)."""
  model = model_cls(config, **model_kwargs)
  ids = jnp.zeros((1, seq_len), jnp.int32)
  args = (ids, jnp.ones_like(ids), ids)
  if model_cls is BertForPreTraining:
    args += (jnp.zeros((1, 2), jnp.int32),)
  variables = model.init(rng, *args, deterministic=True)
  return nn.unbox(variables['params'])


def encode(config: BertConfig, params: dict, input_ids, input_mask, segment_ids,
           deterministic: bool = True, rngs=None) -> tuple[Array, Array]:
  """(sequence_output [B, T, H], pooled_output [B, H]) of BERT for a batch of ids.

  `params` is the tree of any model here (or `load_pretrained`'s): the `bert` subtree is used.
  """
  bert_params = params['bert'] if 'bert' in params else params
  bert_params = match_layout(config, bert_params)
  input_ids = jnp.asarray(input_ids, jnp.int32)
  if input_ids.ndim != 2:
    raise ValueError(f'input_ids must be [batch, length], got shape {input_ids.shape}')
  input_mask = jnp.asarray(input_mask, jnp.int32)
  segment_ids = jnp.asarray(segment_ids, jnp.int32)
  for name, x in (('input_mask', input_mask), ('segment_ids', segment_ids)):
    if x.shape != input_ids.shape:
      raise ValueError(f'{name} has shape {x.shape}, input_ids {input_ids.shape}')
  return BertModel(config).apply({'params': bert_params}, input_ids, input_mask, segment_ids,
                                 deterministic, rngs=rngs)
