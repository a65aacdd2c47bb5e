"""ModernBERT's layout (modernbert.py): our modern model exported and run by transformers'
ModernBertForMaskedLM gives our logits; a ModernBERT that transformers saved loads and runs as
it does there; export and load back are exact.

The transformers side runs where torch is installed, else comes from a recording
(tests/torch_reference.py).
"""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bert_jax import convert
from bert_jax import model as model_lib
from bert_jax import modernbert
from bert_jax import pretrained
from bert_jax.errors import UserError
from tolerance import assert_close
import torch_reference

VOCAB = (['[PAD]', '[UNK]', '[CLS]', '[SEP]', '[MASK]'] + [f'tok{i}' for i in range(90)])
# ModernBERT's architecture, tiny: layers 0 and 3 global, 1 and 2 local (window 4).
CONFIG = model_lib.BertConfig(
    vocab_size=len(VOCAB), hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
    intermediate_size=40, max_position_embeddings=64, type_vocab_size=0, layer_norm_eps=1e-5,
    position_embedding_type='rotary', rope_theta=160_000.0, local_rope_theta=10_000.0,
    mlp_type='gated', pre_layer_norm=True, use_bias=False, local_attention_window=4,
    global_attention_every=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


def _inputs():
  rng = np.random.RandomState(0)
  ids = rng.randint(5, len(VOCAB), (2, 12)).astype(np.int32)
  ids[:, 0], ids[0, -1] = 2, 3
  mask = np.ones_like(ids)
  mask[1, 8:] = 0
  ids[1, 8:] = 0
  return ids, mask


def _params(config, seed=0):
  """Random parameters, LayerNorm scales and biases off their 1 and 0 so that a swap shows."""
  params = model_lib.init_params(config, jax.random.key(seed))
  rng = np.random.RandomState(seed)
  def noisy(path, x):
    name = jax.tree_util.keystr(path)
    x = np.asarray(x)
    if 'scale' in name:
      return (1 + 0.2 * rng.randn(*x.shape)).astype(np.float32)
    if 'bias' in name:
      return (0.1 * rng.randn(*x.shape)).astype(np.float32)
    return x
  return jax.tree_util.tree_map_with_path(noisy, params)


def _our_logits(config, params, ids, mask):
  """MLM logits at every position (all T positions 'masked'), float32."""
  positions = jnp.broadcast_to(jnp.arange(ids.shape[1]), ids.shape)
  params = model_lib.with_nsp_head(params, config.hidden_size)
  logits, _ = model_lib.BertForPreTraining(config).apply(
      {'params': params}, ids, mask, np.zeros_like(ids), positions)
  return np.asarray(logits)


def _write_vocab(folder):
  path = os.path.join(folder, 'vocab.txt')
  with open(path, 'w') as f:
    f.write(''.join(t + '\n' for t in VOCAB))
  return path


def _torch_logits(folder):
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  hf = transformers.ModernBertForMaskedLM.from_pretrained(
      folder, attn_implementation='eager').eval()
  ids, mask = _inputs()
  with torch.no_grad():
    out = hf(input_ids=torch.tensor(ids, dtype=torch.long), attention_mask=torch.tensor(mask))
  return out.logits.numpy()


@pytest.mark.parametrize('use_bias', [False, True])
def test_export_runs_in_transformers_as_here(tmp_path, use_bias):
  config = CONFIG.replace(use_bias=use_bias)
  params = _params(config)
  out = str(tmp_path / 'export')
  convert.export_modernbert(config, params, out, _write_vocab(str(tmp_path)), lower_case=True)
  hf_config = json.load(open(os.path.join(out, 'config.json')))
  assert hf_config['layer_types'] == ['full_attention', 'sliding_attention',
                                      'sliding_attention', 'full_attention']
  assert (hf_config['pad_token_id'], hf_config['cls_token_id'],
          hf_config['sep_token_id']) == (0, 2, 3)

  def make(folder):
    del folder  # Reads the export; writes nothing.
    return {'logits': _torch_logits(out)}

  theirs = torch_reference.reference(f'modernbert_export_bias{int(use_bias)}', tmp_path / 'ref',
                                     make)['logits']
  ids, mask = _inputs()
  ours = _our_logits(config, params, ids, mask)
  real = mask.astype(bool)
  assert_close(ours[real], theirs[real], 2e-5, what='MLM logits, ours vs ModernBertForMaskedLM')

  # Load back: the same parameters, bit for bit (the pooler and NSP head have no place there).
  loaded_config, loaded = pretrained.load_pretrained(out)
  assert loaded_config == config.replace(dtype='float32')
  flat_a = pretrained.flatten({k: v for k, v in params.items() if k != 'nsp'})
  flat_b = pretrained.flatten(loaded)
  assert sorted(flat_a) == sorted(flat_b) and 'nsp' not in loaded
  for path, x in flat_a.items():
    if not path.startswith('bert/pooler'):  # Fresh: ModernBERT has none.
      np.testing.assert_array_equal(np.asarray(x), flat_b[path], err_msg=path)


def test_a_modernbert_saved_by_transformers_loads_and_runs_the_same(tmp_path):
  """transformers' own random ModernBertForMaskedLM (its defaults: GeGLU, no biases, every
  third layer global, bases 160,000 and 10,000) in bert_jax."""

  def make(folder):
    import torch  # pylint: disable=g-import-not-at-top
    import transformers  # pylint: disable=g-import-not-at-top
    torch.manual_seed(0)
    hf_config = transformers.ModernBertConfig(
        vocab_size=len(VOCAB), hidden_size=32, intermediate_size=40, num_hidden_layers=4,
        num_attention_heads=4, max_position_embeddings=64, local_attention=4, pad_token_id=0,
        cls_token_id=2, sep_token_id=3, bos_token_id=2, eos_token_id=3)
    hf = transformers.ModernBertForMaskedLM(hf_config).eval()
    with torch.no_grad():
      for name, p in hf.named_parameters():
        if name.endswith('norm.weight'):
          p.copy_(1.0 + 0.2 * torch.randn(p.shape))
        elif name.endswith('bias'):
          p.copy_(0.1 * torch.randn(p.shape))
    hf.save_pretrained(os.path.join(folder, 'hf'))
    return {'logits': _torch_logits(os.path.join(folder, 'hf'))}

  folder = tmp_path / 'saved'
  theirs = torch_reference.reference('modernbert_saved', folder, make)['logits']
  path = str(folder / 'hf')
  _write_vocab(path)
  config, params = pretrained.load_pretrained(path)
  assert (config.rotary, config.mlp_type, config.pre_layer_norm, config.use_bias,
          config.local_attention_window, config.global_attention_every) == (
              True, 'gated', True, False, 4, 3)
  ids, mask = _inputs()
  real = mask.astype(bool)
  assert_close(_our_logits(config, params, ids, mask)[real], theirs[real], 2e-5,
               what='MLM logits of a transformers-saved ModernBERT')


def test_what_has_no_modernbert_layout_is_refused(tmp_path):
  paper = model_lib.BertConfig(vocab_size=len(VOCAB), hidden_size=32, num_hidden_layers=2,
                               num_attention_heads=4, intermediate_size=40)
  with pytest.raises(UserError, match="position_embedding_type='rotary'.*export it as"):
    convert.export_modernbert(paper, _params(paper), str(tmp_path / 'a'))
  assert modernbert.mismatches(CONFIG) == []
  with pytest.raises(UserError, match='--format=modernbert or bert_jax'):
    convert.export_hf(CONFIG, _params(CONFIG), str(tmp_path / 'b'))
  # Our own format holds every option (bert_config.json), and loads back exactly.
  params = _params(CONFIG.replace(mlp_type='dense', type_vocab_size=2))
  out = str(tmp_path / 'c')
  convert.export_bert_jax(CONFIG.replace(mlp_type='dense', type_vocab_size=2), params, out)
  config, loaded = pretrained.load_pretrained(out)
  assert config.pre_layer_norm and config.mlp_type == 'dense' and config.rotary
  jax.tree.map(np.testing.assert_array_equal, loaded, jax.tree.map(np.asarray, params))
