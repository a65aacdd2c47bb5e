"""ModernBERT's Hugging Face layout (transformers' `ModernBertForMaskedLM`) for our models with
its architecture: names, shapes and config.json, both ways.

ModernBERT (Warner et al., 2024) is the encoder that the options after the paper add up to
(`model.BertConfig`): rotary positions with one base for global and one for local layers,
GeGLU (or any gated MLP whose activation transformers has), pre-LayerNorm with the embeddings'
norm as layer 0's and a final norm, local attention with a window of `local_attention` tokens
in all but the `layer_types` marked full, no token types, and no biases in its linear layers and
norms (`attention_bias`, `mlp_bias`, `norm_bias`, `classifier_bias`; all follow our `use_bias`),
with the decoder's output bias kept. Our model maps onto it exactly:

  ours (bert/...)                                   ModernBERT (model....)
  embeddings/word_embeddings/embedding              embeddings.tok_embeddings.weight
  embeddings/layer_norm                             embeddings.norm
  encoder/layer_i/attention/{query,key,value}       layers.i.attn.Wqkv (stacked q, k, v)
  encoder/layer_i/attention/output                  layers.i.attn.Wo
  encoder/layer_i/mlp_norm                          layers.i.mlp_norm
  encoder/layer_i/mlp/{intermediate,gate}           layers.i.mlp.Wi (stacked: act(first) * second)
  encoder/layer_i/mlp/output                        layers.i.mlp.Wo
  encoder/layer_i/output_norm                       layers.{i+1}.attn_norm; the last: final_norm
  mlm/transform, mlm/layer_norm, mlm/output_bias    head.dense, head.norm, decoder.bias

The decoder's weight is tied to the word embeddings (left out, as `save_pretrained` does). Our
pooler and NSP head have no place there: an export drops them, and a model loaded from
ModernBERT's layout gets a fresh pooler (`pretrained.load_pretrained`, as for HF's QA models).
"""

from typing import Any

import numpy as np

from bert_jax import model
from bert_jax.errors import UserError

MODEL_TYPE = 'modernbert'
ARCHITECTURE = 'ModernBertForMaskedLM'
# transformers' ACT2FN names of the activations ours compute the same.
_ACTIVATIONS = {'gelu': 'gelu', 'silu': 'silu', 'relu': 'relu', 'gelu_new': 'gelu_new',
                'gelu_pytorch_tanh': 'gelu_pytorch_tanh'}


def mismatches(config: model.BertConfig) -> list[str]:
  """What keeps `config` from ModernBERT's architecture (empty: it maps exactly)."""
  need = []
  if not config.rotary:
    need.append("position_embedding_type='rotary'")
  if config.mlp_type != 'gated':
    need.append("a gated MLP (model.mlp='geglu' or 'swiglu')")
  if not config.pre_layer_norm:
    need.append('pre_layer_norm=True')
  if config.type_vocab_size:
    need.append('type_vocab_size=0')
  if config.hidden_act not in _ACTIVATIONS:
    need.append(f'an activation transformers has (not {config.hidden_act!r})')
  return need


def check_exportable(config: model.BertConfig) -> None:
  need = mismatches(config)
  if need:
    raise UserError("the model is not ModernBERT's architecture, which ModernBertForMaskedLM "
                    f'needs: it would take {", ".join(need)}; export it as bert_jax (or, for '
                    "the paper's architecture, hf)")


def hf_config(config: model.BertConfig, special_ids: dict[str, int]) -> dict[str, Any]:
  """config.json for ModernBertForMaskedLM. `special_ids`: pad, cls, sep (and mask) token ids."""
  check_exportable(config)
  layer_types = ['sliding_attention' if config.is_local_layer(i) else 'full_attention'
                 for i in range(config.num_hidden_layers)]
  every = config.global_attention_every if config.local_attention_window else 1
  return {
      'architectures': [ARCHITECTURE], 'model_type': MODEL_TYPE,
      'vocab_size': config.vocab_size, 'hidden_size': config.hidden_size,
      'intermediate_size': config.intermediate_size,
      'num_hidden_layers': config.num_hidden_layers,
      'num_attention_heads': config.num_attention_heads,
      'hidden_activation': _ACTIVATIONS[config.hidden_act],
      'classifier_activation': _ACTIVATIONS[config.hidden_act],
      'max_position_embeddings': config.max_position_embeddings,
      'initializer_range': config.initializer_range, 'norm_eps': config.layer_norm_eps,
      'norm_bias': config.use_bias, 'attention_bias': config.use_bias,
      'mlp_bias': config.use_bias, 'classifier_bias': config.use_bias, 'decoder_bias': True,
      'tie_word_embeddings': True,
      # transformers 5: a type per layer and a rotary base per type; transformers 4 read the
      # period and the two bases (it can say "every N-th layer global" only).
      'layer_types': layer_types,
      'rope_parameters': {
          'full_attention': {'rope_type': 'default', 'rope_theta': config.rope_theta},
          'sliding_attention': {'rope_type': 'default', 'rope_theta': config.local_rope_theta}},
      'global_attn_every_n_layers': every or config.num_hidden_layers + 1,
      'global_rope_theta': config.rope_theta, 'local_rope_theta': config.local_rope_theta,
      # A window that no row reaches when every layer is global.
      'local_attention': config.local_attention_window or 2 * config.max_position_embeddings,
      'embedding_dropout': 0.0, 'attention_dropout': 0.0, 'mlp_dropout': 0.0,
      'pad_token_id': special_ids['pad'], 'cls_token_id': special_ids['cls'],
      'sep_token_id': special_ids['sep'], 'bos_token_id': special_ids['cls'],
      'eos_token_id': special_ids['sep'], 'torch_dtype': 'float32',
  }


def config_from_hf(d: dict[str, Any], source: str) -> model.BertConfig:
  """Our BertConfig of a ModernBERT config.json (transformers 4's or 5's keys)."""
  if d.get('model_type') != MODEL_TYPE:
    raise UserError(f'{source}: model_type is {d.get("model_type")!r}, not {MODEL_TYPE!r}')
  layers = int(d['num_hidden_layers'])
  rope = d.get('rope_parameters') or {}
  theta = rope.get('full_attention', {}).get('rope_theta', d.get('global_rope_theta', 160_000.0))
  local_theta = rope.get('sliding_attention', {}).get('rope_theta',
                                                      d.get('local_rope_theta', 10_000.0))
  every = int(d.get('global_attn_every_n_layers', 3))
  types = d.get('layer_types') or ['sliding_attention' if i % every else 'full_attention'
                                   for i in range(layers)]
  window = int(d.get('local_attention', 128))
  act = d.get('hidden_activation', 'gelu')
  if act not in _ACTIVATIONS or d.get('classifier_activation', 'gelu') != act:
    raise UserError(f'{source}: hidden_activation {act!r} and classifier_activation '
                    f'{d.get("classifier_activation")!r} must be one activation of '
                    f'{sorted(_ACTIVATIONS)}')
  biases = {k: bool(d.get(k, False)) for k in ('norm_bias', 'attention_bias', 'mlp_bias',
                                               'classifier_bias')}
  if len(set(biases.values())) > 1 or not d.get('decoder_bias', True):
    raise UserError(f'{source}: biases {biases}, decoder_bias {d.get("decoder_bias")}: bert_jax '
                    'has biases in all of these or none, and always a decoder bias')
  local = [t == 'sliding_attention' for t in types]
  if any(local):
    # Which layer patterns our (window, every) pair can say.
    candidates = [n for n in range(0, layers + 1)
                  if [not (n and i % n == 0) for i in range(layers)] == local]
    if not candidates:
      raise UserError(f'{source}: layer_types {types} is not "every N-th layer global" '
                      '(global_attention_every), which bert_jax can say')
    every = candidates[0]
  else:
    window, every = 0, 3
  return model.BertConfig(
      vocab_size=int(d['vocab_size']), hidden_size=int(d['hidden_size']),
      num_hidden_layers=layers, num_attention_heads=int(d['num_attention_heads']),
      intermediate_size=int(d['intermediate_size']), hidden_act=act,
      max_position_embeddings=int(d.get('max_position_embeddings', 8192)), type_vocab_size=0,
      initializer_range=float(d.get('initializer_range', 0.02)),
      layer_norm_eps=float(d.get('norm_eps', 1e-5)), position_embedding_type='rotary',
      hidden_dropout_prob=float(max(d.get('embedding_dropout', 0.0), d.get('mlp_dropout', 0.0))),
      attention_probs_dropout_prob=float(d.get('attention_dropout', 0.0)),
      rope_theta=float(theta), local_rope_theta=float(local_theta), mlp_type='gated',
      pre_layer_norm=True, use_bias=biases['norm_bias'], local_attention_window=window,
      global_attention_every=every)


def _norm(flat: dict, ours: str, theirs: str, bias: bool, out: dict) -> None:
  out[f'{theirs}.weight'] = flat[f'{ours}/scale']
  if bias:
    out[f'{theirs}.bias'] = flat[f'{ours}/bias']


def to_hf(config: model.BertConfig, flat: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  """ModernBertForMaskedLM's tensors ([out, in] weights) of our flat unscanned parameters
  ('bert/...', 'mlm/...'); the pooler and NSP head are left out."""
  check_exportable(config)
  b, h, n = config.use_bias, config.hidden_size, config.num_hidden_layers
  out = {'model.embeddings.tok_embeddings.weight':
         flat['bert/embeddings/word_embeddings/embedding']}
  _norm(flat, 'bert/embeddings/layer_norm', 'model.embeddings.norm', b, out)
  for i in range(n):
    ours, theirs = f'bert/encoder/layer_{i}', f'model.layers.{i}'
    qkv = [flat[f'{ours}/attention/{m}/kernel'].reshape(h, h) for m in ('query', 'key', 'value')]
    out[f'{theirs}.attn.Wqkv.weight'] = np.concatenate(qkv, axis=1).T
    out[f'{theirs}.attn.Wo.weight'] = flat[f'{ours}/attention/output/kernel'].reshape(h, h).T
    wi = [flat[f'{ours}/mlp/{m}/kernel'] for m in ('intermediate', 'gate')]
    out[f'{theirs}.mlp.Wi.weight'] = np.concatenate(wi, axis=1).T
    out[f'{theirs}.mlp.Wo.weight'] = flat[f'{ours}/mlp/output/kernel'].T
    if b:
      out[f'{theirs}.attn.Wqkv.bias'] = np.concatenate(
          [flat[f'{ours}/attention/{m}/bias'].reshape(h) for m in ('query', 'key', 'value')])
      out[f'{theirs}.attn.Wo.bias'] = flat[f'{ours}/attention/output/bias']
      out[f'{theirs}.mlp.Wi.bias'] = np.concatenate(
          [flat[f'{ours}/mlp/{m}/bias'] for m in ('intermediate', 'gate')])
      out[f'{theirs}.mlp.Wo.bias'] = flat[f'{ours}/mlp/output/bias']
    _norm(flat, f'{ours}/mlp_norm', f'{theirs}.mlp_norm', b, out)
    _norm(flat, f'{ours}/output_norm',
          f'model.layers.{i + 1}.attn_norm' if i + 1 < n else 'model.final_norm', b, out)
  if 'mlm/output_bias' in flat:
    out['head.dense.weight'] = flat['mlm/transform/kernel'].T
    if b:
      out['head.dense.bias'] = flat['mlm/transform/bias']
    _norm(flat, 'mlm/layer_norm', 'head.norm', b, out)
    out['decoder.bias'] = flat['mlm/output_bias']
  return {k: np.ascontiguousarray(v, np.float32) for k, v in out.items()}


def from_hf(config: model.BertConfig, tensors: dict[str, np.ndarray],
            source: str) -> dict[str, np.ndarray]:
  """Our flat parameters ('bert/...', 'mlm/...'; no pooler or NSP head) of ModernBERT's
  tensors, every one of them used; a missing or left-over tensor is a UserError."""
  h, heads, n, b = (config.hidden_size, config.num_attention_heads, config.num_hidden_layers,
                    config.use_bias)
  if not any(k.startswith('model.') for k in tensors):  # ModernBertModel: no prefix.
    tensors = {(f'model.{k}' if k.startswith(('embeddings.', 'layers.', 'final_norm.')) else k): v
               for k, v in tensors.items()}
  used = set()

  def take(name):
    if name not in tensors:
      raise UserError(f'{source}: missing tensor {name!r} that the config needs')
    used.add(name)
    return np.asarray(tensors[name], np.float32)

  flat = {'bert/embeddings/word_embeddings/embedding':
          take('model.embeddings.tok_embeddings.weight')}

  def norm(theirs, ours):
    flat[f'{ours}/scale'] = take(f'{theirs}.weight')
    if b:
      flat[f'{ours}/bias'] = take(f'{theirs}.bias')

  norm('model.embeddings.norm', 'bert/embeddings/layer_norm')
  for i in range(n):
    ours, theirs = f'bert/encoder/layer_{i}', f'model.layers.{i}'
    qkv = take(f'{theirs}.attn.Wqkv.weight').T.reshape(h, 3, heads, h // heads)
    wi = take(f'{theirs}.mlp.Wi.weight').T
    for j, m in enumerate(('query', 'key', 'value')):
      flat[f'{ours}/attention/{m}/kernel'] = qkv[:, j]
    flat[f'{ours}/attention/output/kernel'] = take(f'{theirs}.attn.Wo.weight').T.reshape(
        heads, h // heads, h)
    flat[f'{ours}/mlp/intermediate/kernel'], flat[f'{ours}/mlp/gate/kernel'] = np.split(wi, 2, 1)
    flat[f'{ours}/mlp/output/kernel'] = take(f'{theirs}.mlp.Wo.weight').T
    if b:
      qkv_bias = take(f'{theirs}.attn.Wqkv.bias').reshape(3, heads, h // heads)
      for j, m in enumerate(('query', 'key', 'value')):
        flat[f'{ours}/attention/{m}/bias'] = qkv_bias[j]
      flat[f'{ours}/attention/output/bias'] = take(f'{theirs}.attn.Wo.bias')
      flat[f'{ours}/mlp/intermediate/bias'], flat[f'{ours}/mlp/gate/bias'] = np.split(
          take(f'{theirs}.mlp.Wi.bias'), 2)
      flat[f'{ours}/mlp/output/bias'] = take(f'{theirs}.mlp.Wo.bias')
    norm(f'{theirs}.mlp_norm', f'{ours}/mlp_norm')
    norm(f'model.layers.{i + 1}.attn_norm' if i + 1 < n else 'model.final_norm',
         f'{ours}/output_norm')
  if any(k.startswith('head.') or k.startswith('decoder.') for k in tensors):
    flat['mlm/transform/kernel'] = take('head.dense.weight').T
    if b:
      flat['mlm/transform/bias'] = take('head.dense.bias')
    norm('head.norm', 'mlm/layer_norm')
    flat['mlm/output_bias'] = take('decoder.bias')
    if 'decoder.weight' in tensors:  # Tied: the word embeddings, when saved at all.
      used.add('decoder.weight')
      if not np.array_equal(tensors['decoder.weight'],
                            flat['bert/embeddings/word_embeddings/embedding']):
        raise UserError(f'{source}: decoder.weight differs from the word embeddings; bert_jax '
                        'ties them')
  left = sorted(set(tensors) - used)
  if left:
    raise UserError(f'{source}: unexpected tensor(s) {left[:5]}: not part of '
                    f'{ARCHITECTURE} as bert_jax maps it')
  return {k: np.ascontiguousarray(v) for k, v in flat.items()}
