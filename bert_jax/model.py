"""BERT in Flax linen: `BertConfig`, the model (embeddings, encoder, pooler) and its pre-training
and fine-tuning heads; the layers it is made of are in `layers.py`.

The architecture options after the paper (all off by default: the paper's BERT is unchanged)
are fields of `BertConfig` (see ARCHITECTURE_OPTIONS): rotary position embeddings instead of a
learned table (`rotary.py`), a gated feed-forward (GeGLU, SwiGLU), pre-LayerNorm with a final
norm, linear layers and LayerNorms without biases, local (sliding-window) attention on all but
every N-th layer, and no token-type embeddings -- together, ModernBERT's encoder.

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
  (gated feed-forward: also mlp/gate/{kernel,bias}, the linear half of act(x W) * (x V);
  pre-LayerNorm: mlp_norm and output_norm instead of attention_layer_norm and output_layer_norm:
  layer i's output_norm normalizes what layer i + 1 attends (the last layer's is the final
  norm; the embeddings' LayerNorm is layer 0's); rotary: no position_embeddings;
  type_vocab_size 0: no token_type_embeddings; use_bias False: no bias in the encoder's
  linear layers, LayerNorms and MLM transform)
  bert/pooler/{kernel,bias}
  mlm/transform/{kernel,bias}, mlm/layer_norm/{scale,bias}, mlm/output_bias   (tied decoder)
  nsp/{kernel,bias}
  classifier/{kernel,bias}  (sequence / token classification), qa_outputs/{kernel,bias}

With matmul_precision='fp8' the encoder also keeps the FP8 scales and amax histories of its
matmuls in the FP8_COLLECTION variable collection (not parameters), each stacked over every
layer and matmul: bert/encoder/fp8_scale [layers, matmuls, 3] and
bert/encoder/fp8_amax_history [layers, matmuls, 3, FP8_AMAX_HISTORY] (see MATMUL_PRECISIONS);
a training step applies it with bert/encoder/fp8_amax_slots [layers, matmuls, 3,
FP8_AMAX_ROWS] beside them (`fp8_step_scales`), never kept.
"""

import dataclasses
import json
import re
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from bert_jax import attention
from bert_jax import config_checks
from bert_jax import layers
from bert_jax.errors import UserError
# The layers' names that users of the model reach for, here too (layers.py and fp8.py define
# them).
from bert_jax.fp8 import (  # pylint: disable=unused-import
    FP8_AMAX_HISTORY, FP8_AMAX_ROWS, FP8_COLLECTION, MATMUL_PRECISIONS, fp8_advance, fp8_amaxes,
    fp8_dot_general, fp8_step_scales)
from bert_jax.layers import Embeddings, Encoder, SelfAttention  # pylint: disable=unused-import

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
  attention_impl: str = 'xla'   # 'xla', 'cudnn' or 'splash': see attention.py.
  layer_norm_impl: str = 'xla'  # 'xla', 'pallas' or 'auto' (`resolve`): see layer_norm.py.
  gelu_impl: str = 'xla'  # 'xla', 'pallas' or 'auto' (`resolve`): see activations.py.
  # 'stacked' (one QKV matmul, q/k/v sliced from its output) or 'separate' (three matmuls
  # whose outputs the attention reads in place): see layers.SelfAttention.
  qkv_projection: str = 'stacked'
  # 'default' (matmuls in `dtype`) or 'fp8': see MATMUL_PRECISIONS.
  matmul_precision: str = 'default'
  # The exact GELU's erf in StableHLO's core operations (`activations.portable_bias_gelu`),
  # which TensorFlow's XlaCallModule reads: the SavedModel export (export.py). Training runs
  # `activations.bias_gelu`.
  portable_gelu: bool = False
  # Architecture after the paper (ARCHITECTURE_OPTIONS; written to bert_config.json when set).
  position_embedding_type: str = 'absolute'  # Or 'rotary' (rotary.py): no position table.
  rope_theta: float = 10_000.0        # Rotary base of global layers ...
  local_rope_theta: float = 10_000.0  # ... and of local ones.
  mlp_type: str = 'dense'  # Or 'gated': act(x W) * (x V), act = hidden_act (GeGLU, SwiGLU).
  pre_layer_norm: bool = False  # LayerNorm before each sub-layer, and a final one.
  use_bias: bool = True  # False: no bias in the encoder's linear layers and LayerNorms.
  # Local attention: keys at most W / 2 tokens away (0 = every layer global), in every layer
  # but those whose index divides by global_attention_every (0: every layer local).
  local_attention_window: int = 0
  global_attention_every: int = 3

  def __post_init__(self):
    if self.hidden_size % self.num_attention_heads:
      raise UserError(f'hidden_size {self.hidden_size} is not a multiple of '
                      f'num_attention_heads {self.num_attention_heads}')
    if self.hidden_act not in layers.ACTIVATIONS:
      raise UserError(f'hidden_act {self.hidden_act!r} is not one of {sorted(layers.ACTIVATIONS)}')
    # The run fields and the position type, for a BertConfig built in code (config_from's are
    # checked where the config loads): config_checks' own check and line.
    for key in ('remat_policy', 'attention_impl', 'layer_norm_impl', 'gelu_impl',
                'qkv_projection', 'matmul_precision', 'position_embedding_type'):
      config_checks.check_choice(f'model.{key}', getattr(self, key))
    if self.mlp_type not in MLP_TYPES:  # Not a config key: model.mlp decodes to it (MLPS).
      raise UserError(f'mlp_type {self.mlp_type!r} is not one of {MLP_TYPES}')
    if self.rotary and self.head_dim % 2:
      raise UserError(f'rotary position embeddings need an even head size, got {self.head_dim} '
                      '(hidden_size / num_attention_heads)')
    config_checks.check_local_attention('xla', self.local_attention_window)
    # model.mlp's name of this feed-forward ('gated' for a gated one of another activation).
    mlp = next((k for k, v in MLPS.items() if v == (self.mlp_type, self.hidden_act)),
               self.mlp_type)
    config_checks.check_gelu_impl(self.gelu_impl, mlp)
    if self.global_attention_every < 0 or self.type_vocab_size < 0:
      raise UserError('global_attention_every and type_vocab_size must be >= 0')
    jnp.dtype(self.dtype)  # Raises on an unknown dtype name.

  def resolved(self, key: str) -> str:
    """Field `key` ('dtype', 'layer_norm_impl', 'gelu_impl') with 'auto' resolved for the
    platform being lowered for (`resolve`): for a BertConfig built in code, which may say
    'auto'."""
    return resolve(key, getattr(self, key))

  @property
  def rotary(self) -> bool:
    return self.position_embedding_type == 'rotary'

  @property
  def max_length(self) -> int | None:
    """The longest row the model takes: max_position_embeddings with a learned table, else
    None (rotary: as long as memory allows)."""
    return None if self.rotary else self.max_position_embeddings

  def is_local_layer(self, index: int) -> bool:
    """Whether encoder layer `index` attends locally (local_attention_window)."""
    every = self.global_attention_every
    return bool(self.local_attention_window) and not (every and index % every == 0)

  def is_paper_bert(self) -> bool:
    """Whether the architecture is the paper's (learned positions, dense MLP, post-LN, biases,
    global attention, token types): what the BERT formats (Hugging Face, Google) can hold."""
    return (self.type_vocab_size > 0 and not self.rotary and self.mlp_type == 'dense' and
            not self.pre_layer_norm and self.use_bias and not self.local_attention_window)

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
    if d.get('position_embedding_type', 'absolute') not in POSITION_EMBEDDINGS:
      raise UserError(f'{source}: position_embedding_type '
                      f'{d["position_embedding_type"]!r} is not supported (absolute or '
                      'rotary only)')
    # Only the architecture: a file's `dtype` (HF writes one) says how it was saved, not how
    # to compute, and must not switch the compute dtype.
    kwargs = {k: d[k] for k in _ORIGINAL_FIELDS + ('layer_norm_eps',) + tuple(
        ARCHITECTURE_OPTIONS) if k in d}
    return cls(**kwargs)

  def to_original_dict(self) -> dict[str, Any]:
    """The fields of the original bert_config.json (plus layer_norm_eps if not default)."""
    d = {k: getattr(self, k) for k in _ORIGINAL_FIELDS}
    if self.layer_norm_eps != 1e-12:
      d['layer_norm_eps'] = self.layer_norm_eps
    # The options after the paper, when set: a file of the paper's BERT stays the original's.
    d.update({k: getattr(self, k) for k, v in ARCHITECTURE_OPTIONS.items()
              if getattr(self, k) != v})
    return d

  def to_hf_dict(self) -> dict[str, Any]:
    """A Hugging Face `config.json` for BertForPreTraining (the paper's architecture only)."""
    if not self.is_paper_bert():
      raise UserError('this model has architecture options that transformers\' BERT does not '
                      'have (rotary, gated MLP, pre-LayerNorm, no biases, local attention or '
                      'no token types): export it as ModernBERT (modernbert.py) or bert_jax')
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


POSITION_EMBEDDINGS = config_checks.CHOICES['model.position_embedding_type']
MLP_TYPES = ('dense', 'gated')
# The architecture options after the paper, with their defaults (the paper's BERT).
ARCHITECTURE_OPTIONS = {
    f.name: f.default for f in dataclasses.fields(BertConfig)
    if f.name in ('position_embedding_type', 'rope_theta', 'local_rope_theta', 'mlp_type',
                  'pre_layer_norm', 'use_bias', 'local_attention_window',
                  'global_attention_every')}

# Named sizes: (layers, hidden, heads), defined where a config's model.size is checked.
SIZES = config_checks.MODEL_SIZES


def config_for_size(size: str, **overrides) -> BertConfig:
  """`BertConfig` of a named size (see `SIZES`), with any field overridden."""
  config_checks.check_choice('model.size', size)
  layers, hidden, heads = SIZES[size]
  overrides.setdefault('intermediate_size', 4 * hidden)
  return BertConfig(num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                    **overrides)


# model.mlp -> (BertConfig.mlp_type, hidden_act): the paper's GELU MLP, or a gated one with
# GELU (GeGLU: Shazeer 2020; MosaicBERT, ModernBERT) or SiLU (SwiGLU).
MLPS = {'dense': ('dense', 'gelu'), 'geglu': ('gated', 'gelu'), 'swiglu': ('gated', 'silu')}
assert tuple(MLPS) == config_checks.CHOICES['model.mlp']


def _architecture(model: Any) -> dict[str, Any]:
  """The architecture options of a config's `model` block (pre-training from scratch)."""
  mlp_type, act = MLPS[model.mlp]
  arch = dict(position_embedding_type=model.position_embedding_type,
              rope_theta=float(model.rope_theta), local_rope_theta=float(model.local_rope_theta),
              mlp_type=mlp_type, hidden_act=act, pre_layer_norm=model.pre_layer_norm,
              use_bias=model.use_bias, local_attention_window=model.local_attention_window,
              global_attention_every=model.global_attention_every)
  if model.intermediate_size:
    arch['intermediate_size'] = model.intermediate_size
  return arch


def config_from(model: Any, *, vocab_size: int = 0, checkpoint: BertConfig | None = None,
                platform: str | None = None) -> BertConfig:
  """The BertConfig of a config's `model` block: the one place that decodes it.

  The architecture is `checkpoint`'s when given (fine-tuning or evaluating a checkpoint: its
  shape wins), else model.size's with model.vocab_size (0 = `vocab_size`, the tokenizer's),
  model.max_position_embeddings, model.type_vocab_size, model.intermediate_size and the
  options after the paper (position_embedding_type, rope thetas, mlp, pre_layer_norm,
  use_bias, local_attention_window, global_attention_every) (pre-training from scratch). Either
  way the block says how to run it: dtype, dropout, layer stacking, rematerialization, the
  attention and LayerNorm kernels, the encoder matmuls' precision; 'auto' resolved for
  `platform` (`resolve`: None is the platform being lowered for, else this process's
  backend).
  """
  run = dict(dtype=resolve('dtype', model.dtype, platform),
             hidden_dropout_prob=model.hidden_dropout_prob,
             attention_probs_dropout_prob=model.attention_probs_dropout_prob,
             scan_layers=model.scan_layers, remat_policy=model.remat_policy,
             attention_impl=model.attention_impl,
             layer_norm_impl=resolve('layer_norm_impl', model.layer_norm_impl, platform),
             gelu_impl=resolve('gelu_impl', model.gelu_impl, platform),
             qkv_projection=model.qkv_projection,
             matmul_precision=model.matmul_precision)
  if checkpoint is not None:
    return checkpoint.replace(**run)
  if model.vocab_size and model.vocab_size < vocab_size:
    raise UserError(f'model.vocab_size={model.vocab_size} is smaller than the vocabulary '
                    f'({vocab_size} tokens in data.vocab_file)')
  return config_for_size(model.size, vocab_size=model.vocab_size or vocab_size,
                         max_position_embeddings=model.max_position_embeddings,
                         type_vocab_size=model.type_vocab_size, **_architecture(model), **run)


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


class BertModel(nn.Module):
  """Embeddings + encoder + pooler. Returns (sequence_output, pooled_output[, hidden_states])."""
  config: BertConfig

  def setup(self):
    self.embeddings = layers.Embeddings(self.config)
    self.encoder = layers.Encoder(self.config)
    # Hidden -> hidden, read by heads that contract over 'embed': laid out like the MLM
    # transform (see MlmHead), so its input gradient is never the dot XLA miscompiles.
    self.pooler = layers.dense(self.config, self.config.hidden_size, ('mlp', 'embed'), 'pooler')

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
    positions = None
    if self.config.rotary:  # Rotary layers rotate by them: 0..T-1 unless packed.
      positions = (jnp.broadcast_to(jnp.arange(input_ids.shape[1]), input_ids.shape)
                   if position_ids is None else position_ids)
    seq, hidden = self.encoder(x, sequence_ids, deterministic, return_hidden_states,
                               positions)
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
  layers.VOCAB_MULTIPLE; the vocabulary itself on TPUs, `Embeddings.attend`), the pad columns at PAD_LOGIT: the same loss, predictions and
  gradients, but the decoder's matmul output is used as it is, so the backward feeds the loss's
  gradient straight into the matmul where the sliced logits made XLA pad it back with a copy
  of [predictions, vocabulary] (0.37 ms of BERT-base's step on an H200, issue 45)."""
  config: BertConfig
  padded_vocab: bool = False

  @nn.compact
  def __call__(self, x: Array, attend: Callable[..., Array]) -> Array:
    c = self.config
    x = layers.constrain(x, ('batch', None, 'act_embed'))
    # The transform maps back into the hidden ('embed') dimension that the LayerNorm and the
    # tied decoder read, like the attention and MLP output projections. Laid out as
    # ('embed', 'mlp'), its output (and so the decoder's input gradient, dlogits @ E) was
    # hidden-split over 'tensor', and XLA's SPMD partitioner (jax 0.10) miscompiles exactly
    # that dot: [batch/(data, fsdp), k/tensor] x [k/tensor, n/fsdp] -> [batch/(data, fsdp),
    # n/tensor] comes out with the rows of two batch shards swapped (a collective-permute it
    # never undoes) when data, fsdp and tensor are all > 1: the loss was right, the gradients
    # of the MLM head and everything below it were not.
    x = layers.dense(c, c.hidden_size, ('mlp', 'embed'), 'transform', activation=c.hidden_act,
                     use_bias=c.use_bias, activation_axes=('batch', None, 'act_embed'))(x)
    x = layers.LayerNorm(c, name='layer_norm')(x)
    x = layers.constrain(x, ('batch', None, 'act_embed'))
    bias = self.param('output_bias', layers.zeros_init(('vocab',)), (c.vocab_size,), jnp.float32)
    logits = attend(x, padded=self.padded_vocab)
    logits = layers.constrain(logits.astype(jnp.float32), ('batch', None, 'act_vocab'))
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
    nsp_logits = layers.dense(self.config, 2, ('embed', None), 'nsp')(pooled).astype(jnp.float32)
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
    return layers.dense(self.config, self.num_labels, ('embed', None), 'classifier')(
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
    return layers.dense(self.config, self.num_labels, ('embed', None), 'classifier')(
        seq).astype(jnp.float32)


class BertForQuestionAnswering(nn.Module):
  """Span QA: start and end logits per token, [B, T] each."""
  config: BertConfig

  @nn.compact
  def __call__(self, input_ids, input_mask, segment_ids,
               deterministic: bool = True) -> tuple[Array, Array]:
    seq, _ = BertModel(self.config, name='bert')(input_ids, input_mask, segment_ids,
                                                 deterministic)
    logits = layers.dense(self.config, 2, ('embed', None), 'qa_outputs')(seq).astype(jnp.float32)
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
