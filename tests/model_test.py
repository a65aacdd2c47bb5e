"""Model properties: sizes, layouts, heads, mixed precision, dropout, config files."""

import dataclasses
import json

import flax.linen as nn
from flax.linen import fp8_ops
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bert_jax import attention
from bert_jax import model as model_lib
from tolerance import assert_close

TINY = model_lib.BertConfig(vocab_size=99, hidden_size=32, num_hidden_layers=2,
                            num_attention_heads=4, intermediate_size=37,
                            max_position_embeddings=40)


def _batch(batch=3, seq=12, vocab=99, seed=0):
  rng = np.random.RandomState(seed)
  ids = rng.randint(5, vocab, size=(batch, seq)).astype(np.int32)
  lengths = np.array([seq, seq - 4, 5])[:batch]
  mask = (np.arange(seq)[None, :] < lengths[:, None]).astype(np.int32)
  segments = (np.arange(seq)[None, :] >= (lengths[:, None] // 2)).astype(np.int32) * mask
  ids = ids * mask
  positions = np.stack([np.sort(rng.choice(l, 3, replace=False)) for l in lengths]).astype(np.int32)
  return ids, mask, segments, positions


def _abstract_count(config, cls=model_lib.BertModel):
  ids = jnp.zeros((1, 8), jnp.int32)
  shapes = jax.eval_shape(lambda: cls(config).init(jax.random.key(0), ids, ids, ids))
  return model_lib.count_params(nn.unbox(shapes))


def test_bert_base_and_large_parameter_counts():
  assert _abstract_count(model_lib.config_for_size('base', vocab_size=30522)) == 109_482_240
  # The published BERT-large: 335M (BertModel, uncased vocab, with the pooler).
  assert _abstract_count(model_lib.config_for_size('large', vocab_size=30522)) == 335_141_888


def test_named_sizes():
  assert model_lib.SIZES['mini'] == (4, 256, 4)
  assert model_lib.SIZES['medium'] == (8, 512, 8)
  assert model_lib.SIZES['L12_H768'] == model_lib.SIZES['base']
  assert len([k for k in model_lib.SIZES if k.startswith('L')]) == 24
  c = model_lib.config_for_size('L6_H512')
  assert (c.num_hidden_layers, c.hidden_size, c.num_attention_heads,
          c.intermediate_size) == (6, 512, 8, 2048)
  with pytest.raises(model_lib.UserError, match=r"--config\.model\.size='huge': expected one of "
                     r'tiny, mini, small, medium, base, large or L\{2\.\.12\}'):
    model_lib.config_for_size('huge')


def test_scan_and_remat_match_the_loop():
  params = model_lib.init_params(TINY, jax.random.key(1))
  ids, mask, seg, pos = _batch()
  ref = model_lib.BertForPreTraining(TINY).apply({'params': params}, ids, mask, seg, pos)
  for scan, remat in ((True, 'none'), (True, 'full'), (False, 'dots')):
    cfg = TINY.replace(scan_layers=scan, remat_policy=remat)
    out = model_lib.BertForPreTraining(cfg).apply(
        {'params': model_lib.match_layout(cfg, params)}, ids, mask, seg, pos)
    for a, b in zip(ref, out):
      # Scan and remat change only the order of summation (tests/tolerance.py).
      assert_close(b, a, 2e-6, what=f'scan={scan}, remat={remat}')
  stacked = model_lib.stack_layers(params)
  assert stacked['bert']['encoder']['layers']['mlp']['intermediate']['kernel'].shape == (2, 32, 37)
  back = model_lib.unstack_layers(stacked, 2)
  jax.tree.map(np.testing.assert_array_equal, back, params)


def test_mlm_head_is_tied_and_only_at_masked_positions():
  params = model_lib.init_params(TINY, jax.random.key(2))
  ids, mask, seg, pos = _batch()
  mlm, nsp = model_lib.BertForPreTraining(TINY).apply({'params': params}, ids, mask, seg, pos)
  assert mlm.shape == (3, 3, 99) and nsp.shape == (3, 2)
  assert mlm.dtype == jnp.float32
  # No separate decoder matrix: logits come from the word embeddings plus an output bias.
  assert set(params['mlm']) == {'transform', 'layer_norm', 'output_bias'}
  seq, _ = model_lib.encode(TINY, params, ids, mask, seg)
  gathered = np.take_along_axis(np.asarray(seq), pos[..., None], axis=1)
  p = params['mlm']
  h = gathered @ p['transform']['kernel'] + p['transform']['bias']
  h = jax.nn.gelu(h, approximate=False)
  h = (h - h.mean(-1, keepdims=True)) / np.sqrt(h.var(-1, keepdims=True) + 1e-12)
  h = h * p['layer_norm']['scale'] + p['layer_norm']['bias']
  ref = h @ params['bert']['embeddings']['word_embeddings']['embedding'].T + p['output_bias']
  assert_close(mlm, ref, 5e-6, what='MLM logits vs NumPy')


def test_padding_does_not_change_real_positions():
  params = model_lib.init_params(TINY, jax.random.key(3))
  ids, mask, seg, _ = _batch(batch=1)
  seq, pooled = model_lib.encode(TINY, params, ids, mask, seg)
  longer = lambda x: np.pad(x, ((0, 0), (0, 6)))
  seq2, pooled2 = model_lib.encode(TINY, params, longer(ids), longer(mask), longer(seg))
  assert_close(seq2[:, :12], seq, 2e-6, what='sequence output')
  assert_close(pooled2, pooled, 2e-6, what='pooled output')


def test_bfloat16_compute_stays_close_to_float32():
  params = model_lib.init_params(TINY, jax.random.key(4))
  ids, mask, seg, pos = _batch()
  ref = model_lib.BertForPreTraining(TINY).apply({'params': params}, ids, mask, seg, pos)
  bf = TINY.replace(dtype='bfloat16')
  out = model_lib.BertForPreTraining(bf).apply({'params': params}, ids, mask, seg, pos)
  seq, _ = model_lib.encode(bf, params, ids, mask, seg)
  assert seq.dtype == jnp.bfloat16
  assert out[0].dtype == jnp.float32  # Logits (and hence losses) are float32.
  scale = np.abs(np.asarray(ref[0])).max()
  assert np.abs(np.asarray(out[0]) - np.asarray(ref[0])).max() < 0.05 * scale
  # Parameters stay float32 whatever the compute dtype.
  params = model_lib.init_params(bf, jax.random.key(0))
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(params))


def test_dropout_only_when_not_deterministic():
  params = model_lib.init_params(TINY, jax.random.key(5))
  ids, mask, seg, pos = _batch()
  m = model_lib.BertForPreTraining(TINY)
  a = m.apply({'params': params}, ids, mask, seg, pos, deterministic=True)
  b = m.apply({'params': params}, ids, mask, seg, pos, deterministic=True)
  np.testing.assert_array_equal(a[0], b[0])
  c = m.apply({'params': params}, ids, mask, seg, pos, deterministic=False,
              rngs={'dropout': jax.random.key(0)})
  d = m.apply({'params': params}, ids, mask, seg, pos, deterministic=False,
              rngs={'dropout': jax.random.key(1)})
  assert np.abs(np.asarray(c[0]) - np.asarray(a[0])).max() > 1e-3
  assert np.abs(np.asarray(c[0]) - np.asarray(d[0])).max() > 1e-3
  no_drop = TINY.replace(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
  e = model_lib.BertForPreTraining(no_drop).apply({'params': params}, ids, mask, seg, pos,
                                                  deterministic=False,
                                                  rngs={'dropout': jax.random.key(0)})
  assert_close(e[0], a[0], 2e-6, what='dropout 0')


def test_every_parameter_has_logical_axes():
  ids = jnp.zeros((1, 8), jnp.int32)
  for cfg in (TINY, TINY.replace(scan_layers=True)):
    boxed = jax.eval_shape(lambda: model_lib.BertForPreTraining(cfg).init(
        jax.random.key(0), ids, ids, ids, jnp.zeros((1, 2), jnp.int32)))['params']
    leaves = jax.tree.leaves(boxed, is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned))
    assert all(isinstance(x, nn.LogicallyPartitioned) for x in leaves)
    names = {tuple(x.names) for x in leaves}
    assert ('vocab', 'embed') in names
    assert (('layers', 'embed', 'heads', 'kv') in names) == cfg.scan_layers


def test_finetuning_heads_shapes():
  params_rng = jax.random.key(6)
  ids, mask, seg, _ = _batch()
  heads = ((model_lib.BertForSequenceClassification, dict(num_labels=3), (3, 3)),
           (model_lib.BertForSequenceClassification, dict(num_labels=1), (3, 1)),
           (model_lib.BertForTokenClassification, dict(num_labels=5), (3, 12, 5)))
  for cls, kwargs, shape in heads:
    m = cls(TINY, **kwargs)
    variables = m.init(params_rng, ids, mask, seg)
    assert m.apply(variables, ids, mask, seg).shape == shape
  qa = model_lib.BertForQuestionAnswering(TINY)
  start, end = qa.apply(qa.init(params_rng, ids, mask, seg), ids, mask, seg)
  assert start.shape == end.shape == (3, 12)


def test_config_json_round_trips(tmp_path):
  c = model_lib.config_for_size('mini', vocab_size=1000)
  c.write_json(tmp_path / 'bert_config.json')
  c.write_json(tmp_path / 'config.json', hf=True)
  original = json.loads((tmp_path / 'bert_config.json').read_text())
  assert 'layer_norm_eps' not in original and original['hidden_act'] == 'gelu'
  read = lambda name: model_lib.BertConfig.from_dict(
      json.loads((tmp_path / name).read_text()), source=name)
  assert read('bert_config.json') == c
  hf = json.loads((tmp_path / 'config.json').read_text())
  assert hf['model_type'] == 'bert' and hf['architectures'] == ['BertForPreTraining']
  assert read('config.json') == c
  with pytest.raises(ValueError, match='missing BERT config fields'):
    model_lib.BertConfig.from_dict({'vocab_size': 3}, source='x.json')
  with pytest.raises(ValueError, match='not a multiple'):
    model_lib.BertConfig(hidden_size=30, num_attention_heads=4)


def test_sequence_longer_than_positions_is_a_clear_error():
  params = model_lib.init_params(TINY, jax.random.key(0))
  ids = np.ones((1, 41), np.int32)
  with pytest.raises(ValueError, match='max_position_embeddings'):
    model_lib.encode(TINY, params, ids, ids, 0 * ids)


def _embeddings_by_gather(params, ids, segments, position_ids=None):
  """The embeddings as gathers (the straightforward way), before LayerNorm."""
  e = params['bert']['embeddings']
  positions = (np.arange(ids.shape[1])[None] if position_ids is None else position_ids)
  return (e['word_embeddings']['embedding'][ids] + e['position_embeddings']['embedding'][positions]
          + e['token_type_embeddings']['embedding'][segments])


@pytest.mark.parametrize('packed', [False, True])
def test_embedding_lookups_match_gathers_and_scatter_only_words(packed):
  """Token types and packed positions are read as one-hot matmuls and unpacked positions as a
  slice: the same values and gradients as gathers, and the backward pass scatters into the
  word embeddings only (a scatter-add into a table of 2 token types took 31 ms of a 154 ms
  BERT-base step on an H100)."""
  params = model_lib.init_params(TINY, jax.random.key(3))
  ids, mask, seg, _ = _batch(seed=4)
  position_ids = None
  if packed:  # Two sequences in each row, positions restarting at the second.
    position_ids = np.concatenate([np.arange(7), np.arange(5)])[None].repeat(3, 0)

  def emb(p):
    return model_lib.Embeddings(TINY).apply({'params': p['bert']['embeddings']}, ids, seg, True,
                                            position_ids)

  cot = jax.random.normal(jax.random.key(5), (3, 12, TINY.hidden_size))
  grads = jax.grad(lambda p: jnp.sum(emb(p) * cot))(params)
  ref_fn = lambda p: model_lib.Embeddings(TINY).apply(
      {'params': p['bert']['embeddings']}, _embeddings_by_gather(p, ids, seg, position_ids),
      method=lambda m, x: m.layer_norm(x))
  ref_grads = jax.grad(lambda p: jnp.sum(ref_fn(p) * cot))(params)
  np.testing.assert_allclose(emb(params), ref_fn(params), rtol=0, atol=1e-6)
  for table in ('word_embeddings', 'position_embeddings', 'token_type_embeddings'):
    np.testing.assert_allclose(grads['bert']['embeddings'][table]['embedding'],
                               ref_grads['bert']['embeddings'][table]['embedding'],
                               rtol=1e-5, atol=1e-6, err_msg=table)
  hlo = jax.jit(jax.grad(lambda p: jnp.sum(emb(p) * cot))).lower(params).as_text()
  assert hlo.count('scatter(') + hlo.count('"stablehlo.scatter"') == 1, 'one scatter: words'


def _attention_by_three_projections(p, x, sequence_ids):
  """Self-attention as three separate Q, K, V projections (the layout of the parameters)."""
  hi = jax.lax.Precision.HIGHEST
  q, k, v = (jnp.einsum('bte,ehd->bthd', x, p[n]['kernel'], precision=hi) + p[n]['bias']
             for n in ('query', 'key', 'value'))
  out = attention.dot_product_attention(q, k, v, sequence_ids, impl='xla')
  return jnp.einsum('bthd,hde->bte', out, p['output']['kernel'], precision=hi) + \
      p['output']['bias']


@pytest.mark.parametrize('projection, matmuls', [('stacked', 1), ('separate', 3)])
def test_qkv_projection_matches_three_projections(projection, matmuls):
  """Q, K and V from one matmul over the stacked kernels ('stacked') or from three whose
  outputs the attention reads in place ('separate'): the same outputs and gradients
  (parameters and input) as three projections, with the parameters three either way."""
  config = dataclasses.replace(TINY, qkv_projection=projection)
  params = model_lib.init_params(config, jax.random.key(7))
  p = params['bert']['encoder']['layer_0']['attention']
  assert {n: p[n]['kernel'].shape for n in ('query', 'key', 'value')} == {
      n: (32, 4, 8) for n in ('query', 'key', 'value')}
  x = jax.random.normal(jax.random.key(8), (3, 12, TINY.hidden_size))
  sequence_ids = jnp.asarray(_batch()[1])
  cot = jax.random.normal(jax.random.key(9), x.shape)
  def attend(p, x):
    # The output projection's bias comes back beside it (the layer's LayerNorm adds it).
    y, bias = model_lib.SelfAttention(config).apply({'params': p}, x, sequence_ids)
    return y + bias

  with jax.default_matmul_precision('highest'):
    fused = lambda p, x: jnp.sum(attend(p, x) * cot)
    ref = lambda p, x: jnp.sum(_attention_by_three_projections(p, x, sequence_ids) * cot)
    out, ref_out = attend(p, x), _attention_by_three_projections(p, x, sequence_ids)
    grads, ref_grads = (jax.grad(f, argnums=(0, 1))(p, x) for f in (fused, ref))
  assert_close(out, ref_out, 1e-6, what='attention output')
  for path, g in jax.tree_util.tree_leaves_with_path(grads):
    r = ref_grads
    for key in path:
      r = r[key.key if hasattr(key, 'key') else key.idx]
    assert_close(g, r, 1e-5, what=f'gradient {jax.tree_util.keystr(path)}')
  # The projection matmuls, then q k^T, probs v, and the output projection.
  jaxpr = jax.make_jaxpr(attend)(p, x)
  assert str(jaxpr).count('dot_general') == matmuls + 3


def test_decoder_matmul_runs_over_a_padded_vocabulary():
  """The tied decoder multiplies by the vocabulary padded to a multiple of 64 (99 -> 128; not
  for TPUs) and returns logits over the real vocabulary only: the values and gradients of x @ E^T."""
  params = model_lib.init_params(TINY, jax.random.key(10))
  emb = params['bert']['embeddings']
  x = jax.random.normal(jax.random.key(11), (3, 5, TINY.hidden_size))
  cot = jax.random.normal(jax.random.key(12), (3, 5, TINY.vocab_size))
  attend = lambda e, x: model_lib.Embeddings(TINY).apply({'params': e}, x,
                                                         method=model_lib.Embeddings.attend)
  with jax.default_matmul_precision('highest'):
    logits = attend(emb, x)
    ref = jnp.einsum('bph,vh->bpv', x, emb['word_embeddings']['embedding'])
    grads = jax.grad(lambda e, x: jnp.sum(attend(e, x) * cot), argnums=(0, 1))(emb, x)
    ref_grads = jax.grad(lambda t, x: jnp.sum(jnp.einsum('bph,vh->bpv', x, t) * cot),
                         argnums=(0, 1))(emb['word_embeddings']['embedding'], x)
  assert logits.shape == (3, 5, 99)
  assert_close(logits, ref, 1e-6, what='logits')
  assert_close(grads[0]['word_embeddings']['embedding'], ref_grads[0], 1e-6, what='dE')
  assert_close(grads[1], ref_grads[1], 1e-6, what='dx')
  jaxpr = jax.make_jaxpr(attend)(emb, x)
  (dot,) = [e for e in jaxpr.eqns if e.primitive.name == 'dot_general']
  assert dot.outvars[0].aval.shape == (3, 5, 128)
  with attention.lowering_for('tpu'):  # Not padded for TPUs (see Embeddings.attend).
    jaxpr = jax.make_jaxpr(lambda e, x: attend(e, x))(emb, x)  # A new function: a new trace.
  (dot,) = [e for e in jaxpr.eqns if e.primitive.name == 'dot_general']
  assert dot.outvars[0].aval.shape == (3, 5, 99)


def test_masked_positions_are_gathered_without_a_scatter_in_the_gradient():
  """The MLM head's masked positions and packed rows' [CLS] positions are read as one-hot
  matmuls: the rows of a gather and its gradient (repeated positions add up), and the
  pre-training gradient's only scatter is the word embeddings'."""
  seq = jax.random.normal(jax.random.key(13), (3, 12, 32))
  positions = jnp.array([[1, 4, 4, 0], [11, 0, 0, 0], [2, 3, 5, 7]])
  cot = jax.random.normal(jax.random.key(14), (3, 4, 32))
  got = model_lib.gather_positions(seq, positions)
  ref = jnp.take_along_axis(seq, positions[..., None], axis=1)
  np.testing.assert_array_equal(got, ref)
  grad, ref_grad = (jax.grad(lambda s: jnp.sum(f(s) * cot))(seq) for f in (
      lambda s: model_lib.gather_positions(s, positions),
      lambda s: jnp.take_along_axis(s, positions[..., None], axis=1)))
  assert_close(grad, ref_grad, 1e-6, what='gradient')
  params = model_lib.init_params(TINY, jax.random.key(15))
  ids, mask, seg, pos = _batch()
  loss = lambda p: jnp.sum(model_lib.BertForPreTraining(TINY).apply(
      {'params': p}, ids, mask, seg, pos)[0])
  hlo = jax.jit(jax.grad(loss)).lower(params).as_text()
  assert hlo.count('scatter(') + hlo.count('"stablehlo.scatter"') == 1, 'one scatter: words'


def test_pallas_kernels_match_xla_in_training_with_dropout():
  """model.layer_norm_impl='pallas' and model.gelu_impl='pallas' (interpreted here) against
  'xla': the same dropout masks from the same rng, the same outputs and parameter gradients
  (the LayerNorms' residual copies carried across the layers; scanned layers: one kernel
  trace; interpreting Pallas compiles slowly)."""
  params = model_lib.init_params(TINY, jax.random.key(4))
  ids, mask, seg, pos = _batch()
  rngs = {'dropout': jax.random.key(5)}

  def loss_and_grads(cfg):
    def loss(p):
      mlm, nsp = model_lib.BertForPreTraining(cfg).apply(
          {'params': model_lib.match_layout(cfg, p)}, ids, mask, seg, pos, deterministic=False,
          rngs=rngs)
      return jnp.sum(mlm * jnp.linspace(-1, 1, mlm.size).reshape(mlm.shape)) + jnp.sum(nsp)
    return jax.value_and_grad(loss)(params)

  ref = loss_and_grads(TINY.replace(layer_norm_impl='xla', scan_layers=True))
  out = loss_and_grads(TINY.replace(layer_norm_impl='pallas', gelu_impl='pallas',
                                    scan_layers=True))
  # Float32 both ways; leaves near zero (a few biases) are held to the largest's scale.
  top = max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(ref))
  jax.tree.map(lambda a, b: assert_close(b, a, 2e-5, scale=top), ref, out)
  # Dropout is on: the loss differs from the deterministic one.
  det = model_lib.BertForPreTraining(TINY).apply({'params': params}, ids, mask, seg, pos)
  assert not np.allclose(det[0], model_lib.BertForPreTraining(TINY).apply(
      {'params': params}, ids, mask, seg, pos, deterministic=False, rngs=rngs)[0])


def test_auto_resolves_for_the_platform_in_one_place():
  """model.dtype, model.layer_norm_impl and model.gelu_impl 'auto' mean what the platform a
  step runs on, or is compiled for, takes (`model.resolve`): config_from resolves them for the
  platform it is given (`bert-jax compile --topology=h100` gives the GPU's), else for the one
  being lowered for, else for this process's backend. A BertConfig built in code with 'auto'
  gets XLA's LayerNorm here and the fused kernel when lowered for a GPU; GELU 'auto' is XLA's
  everywhere (activations.py: the Pallas pair measured no faster on an H100)."""
  from bert_jax import defaults  # pylint: disable=g-import-not-at-top
  block = defaults.pretrain().model
  block.update(dict(size='tiny', dtype='auto', layer_norm_impl='auto', gelu_impl='auto'))
  wanted = {'cpu': ('float32', 'xla', 'xla'), 'gpu': ('bfloat16', 'pallas', 'xla'),
            'tpu': ('bfloat16', 'xla', 'xla')}
  got = lambda c: (c.dtype, c.layer_norm_impl, c.gelu_impl)
  for platform, values in wanted.items():
    config = model_lib.config_from(block, vocab_size=99, platform=platform)
    assert got(config) == values, platform
    with attention.lowering_for(platform):
      config = model_lib.config_from(block, vocab_size=99)
    assert got(config) == values, platform
  config = model_lib.config_from(block, vocab_size=99)
  assert got(config) == wanted[jax.default_backend()]
  # Not 'auto': as given.
  block.update(dict(dtype='bfloat16', layer_norm_impl='xla', gelu_impl='pallas'))
  config = model_lib.config_from(block, vocab_size=99, platform='gpu')
  assert got(config) == ('bfloat16', 'xla', 'pallas')

  model = model_lib.BertForPreTraining(TINY.replace(layer_norm_impl='auto', gelu_impl='auto'))
  ids = jnp.ones((2, 8), jnp.int32)
  params = model.init(jax.random.key(0), ids, ids, ids, ids)['params']
  traced = lambda: str(jax.make_jaxpr(lambda p: model.apply(
      {'params': p}, ids, ids, ids, ids))(params))
  assert 'pallas_call' not in traced()
  with attention.lowering_for('gpu'):
    jaxpr = traced()
  assert 'pallas_call' in jaxpr and 'layer_norm' in jaxpr and 'bias_gelu_fwd' not in jaxpr
  with attention.lowering_for('gpu'):
    assert 'bias_gelu_fwd' in str(jax.make_jaxpr(lambda p: model_lib.BertForPreTraining(
        TINY.replace(gelu_impl='pallas')).apply({'params': p}, ids, ids, ids, ids))(params))


def test_bad_layer_norm_impl_is_one_line():
  with pytest.raises(model_lib.UserError,
                     match=r"model\.layer_norm_impl='triton': expected one of auto, pallas"):
    TINY.replace(layer_norm_impl='triton')
  with pytest.raises(model_lib.UserError,
                     match=r"model\.gelu_impl='triton': expected one of auto, pallas"):
    TINY.replace(gelu_impl='triton')


def test_one_mapping_from_the_model_block_for_both_drivers():
  """Pre-training (from model.size) and fine-tuning (from a checkpoint of that size) decode
  the same `model` block into the same BertConfig; every run key reaches it."""
  from bert_jax import defaults  # pylint: disable=g-import-not-at-top
  pretrain, finetune = defaults.pretrain(), defaults.finetune('mrpc')
  run_keys = set(finetune.model)
  assert run_keys < set(pretrain.model)  # The model defaults are one block, less the shape.
  pretrain.model.size = 'tiny'
  for config in (pretrain, finetune):
    config.model.update(dict(dtype='bfloat16', hidden_dropout_prob=0.2,
                             attention_probs_dropout_prob=0.0, scan_layers=True,
                             remat_policy='dots', attention_impl='cudnn',
                             layer_norm_impl='auto', matmul_precision='fp8'))
  scratch = model_lib.config_from(pretrain.model, vocab_size=99)
  checkpoint = model_lib.config_for_size('tiny', vocab_size=99)  # As a checkpoint records it.
  assert model_lib.config_from(finetune.model, checkpoint=checkpoint) == scratch
  for key in run_keys:
    # 'auto' arrives resolved for this platform (`model.resolve`).
    wanted = (model_lib.resolve(key, finetune.model[key]) if key in ('dtype', 'layer_norm_impl')
              else finetune.model[key])
    assert getattr(scratch, key) == wanted, key
  with pytest.raises(model_lib.UserError, match=r'model\.vocab_size=50 is smaller'):
    pretrain.model.vocab_size = 50
    model_lib.config_from(pretrain.model, vocab_size=99)
def test_bad_matmul_precision_is_one_line():
  with pytest.raises(model_lib.UserError,
                     match=r"model\.matmul_precision='fp4': expected one of default, fp8"):
    TINY.replace(matmul_precision='fp4')


def _fp8_variables(config, seed=4, abstract=False):
  """(parameters, FP8 scales and histories) of BertForPreTraining under `config` (shapes only
  with `abstract`)."""
  ids, mask, seg, pos = _batch()
  def init():
    variables = nn.unbox(model_lib.BertForPreTraining(config).init(jax.random.key(seed), ids,
                                                                  mask, seg, pos))
    return variables['params'], variables.get(model_lib.FP8_COLLECTION)
  shapes = jax.eval_shape(init)
  if abstract:
    return shapes
  # The parameters do not depend on matmul_precision; the scales start at flax's values.
  params = model_lib.init_params(config.replace(matmul_precision='default'),
                                 jax.random.key(seed))
  return params, model_lib.initial_fp8_meta(shapes[1])


def _fp8_loss(config, params, scales):
  """A training forward's logits against fixed random weights, applied to FP8 `scales`."""
  ids, mask, seg, pos = _batch()
  logits = model_lib.BertForPreTraining(config).apply(
      {'params': params, model_lib.FP8_COLLECTION: scales}, ids, mask, seg, pos,
      deterministic=False, rngs={'dropout': jax.random.key(0)})[0]
  return jnp.sum(logits * jax.random.normal(jax.random.key(1), logits.shape))


def _fp8_dots(config, params, meta):
  """The dot_generals on FP8 operands of one training step's forward and backward (jaxpr)."""
  loss = lambda p: _fp8_loss(config, p, model_lib.fp8_step_scales(meta))

  def dots(jaxpr):
    for eqn in jaxpr.eqns:
      if eqn.primitive.name == 'dot_general' and all(
          jnp.dtype(v.aval.dtype).itemsize == 1 for v in eqn.invars):
        yield eqn
      for value in eqn.params.values():
        for sub in value if isinstance(value, (list, tuple)) else (value,):
          sub = getattr(sub, 'jaxpr', sub)  # A ClosedJaxpr's Jaxpr.
          if hasattr(sub, 'eqns'):
            yield from dots(sub)
  return len(list(dots(jax.make_jaxpr(jax.grad(loss))(params).jaxpr)))


def test_fp8_keeps_the_parameters_and_adds_scales_only_to_encoder_matmuls():
  """matmul_precision='fp8': the same parameter tree; the scales and amax histories of the four
  encoder matmuls of each layer (QKV, attention output, the two MLP projections; six with three
  separate Q, K, V projections) as two variables of the encoder, stacked [layers, matmuls, 3
  tensors] (scanned or not); FP8 dots for those matmuls only (forward, input and kernel
  gradients), none for the embeddings, pooler or heads; no FP8 collection at all by default."""
  fp8 = TINY.replace(matmul_precision='fp8')
  params, meta = _fp8_variables(fp8, abstract=True)
  default_params, default_meta = _fp8_variables(TINY, abstract=True)
  assert jax.tree.structure(params) == jax.tree.structure(default_params)
  assert default_meta is None
  layers = TINY.num_hidden_layers
  for config, matmuls in ((fp8, 4), (fp8.replace(scan_layers=True), 4),
                          (fp8.replace(qkv_projection='separate'), 6)):
    _, meta = _fp8_variables(config, abstract=True)
    assert jax.tree.map(lambda a: a.shape, meta) == {'bert': {'encoder': {
        'fp8_scale': (layers, matmuls, 3),
        'fp8_amax_history': (layers, matmuls, 3, model_lib.FP8_AMAX_HISTORY)}}}, config
  params, meta = _fp8_variables(fp8)
  assert _fp8_dots(fp8, params, meta) == 3 * 4 * layers
  # Each row is its matmul's, in the order fp8_matmuls_per_layer gives: the kernel amax a
  # step returns for it is that matmul's weights' own (each scaled by its own factor here).
  for config, names in ((fp8, ['attention/qkv', 'attention/output', 'mlp/intermediate',
                               'mlp/output']),
                        (fp8.replace(qkv_projection='separate'),
                         ['attention/query', 'attention/key', 'attention/value',
                          'attention/output', 'mlp/intermediate', 'mlp/output'])):
    params, meta = _fp8_variables(config)
    encoder, want = params['bert']['encoder'], np.zeros((layers, len(names)), np.float32)
    for i, j in np.ndindex(want.shape):
      parts = (['query', 'key', 'value'] if names[j] == 'attention/qkv' else
               [names[j].split('/')[1]])
      block = encoder[f'layer_{i}'][names[j].split('/')[0]]
      for part in parts:
        block[part]['kernel'] = block[part]['kernel'] * (1 + 0.5 * (i * len(names) + j))
      want[i, j] = max(float(jnp.max(jnp.abs(block[p]['kernel'].astype(config.compute_dtype))))
                       for p in parts)
    grads = jax.jit(jax.grad(lambda s: _fp8_loss(config, params, s)))(
        model_lib.fp8_step_scales(meta))
    # They come back per row of the amax slots (an output gradient's per feature), which
    # fp8_amaxes reduces.
    assert grads['bert']['encoder']['fp8_amax_slots'].shape == (
        layers, len(names), 3, model_lib.FP8_AMAX_ROWS)
    assert not np.any(grads['bert']['encoder']['fp8_scale'])
    np.testing.assert_array_equal(
        model_lib.fp8_amaxes(grads)['bert']['encoder']['fp8_scale'][..., 1], want)


@pytest.mark.parametrize('slots', [True, False])
def test_fp8_matmul_is_flax_delayed_scaling_bit_for_bit(slots):
  """fp8_dot_general with fp8_step_scales before and fp8_advance after each step: the same
  output, input and kernel gradients, scales and amax histories as flax's
  Fp8DirectDotGeneralOp, bit for bit, over steps whose magnitudes grow and shrink (the scales
  follow the largest amax of each history); the amaxes returned per row of the amax slots (as
  the encoder's matmuls return them) or, without slots, as the scales' gradient. FP8_AMAX_ROWS
  rows divide the kernel's size, not the input's or the output gradient's."""
  history = model_lib.FP8_AMAX_HISTORY
  dims = (((1,), (0,)), ((), ()))

  class Flax(nn.Module):
    @nn.compact
    def __call__(self, x, k):
      return fp8_ops.Fp8DirectDotGeneralOp(amax_history_length=history, name='op')(x, k, dims)

  k = jax.random.normal(jax.random.key(2), (256, 128), jnp.bfloat16) * 0.02
  theirs = Flax().init(jax.random.key(0), jnp.zeros((48, 256), jnp.bfloat16), k)[
      fp8_ops.OVERWRITE_WITH_GRADIENT]
  ours = {'fp8_scale': jnp.ones((3,)), 'fp8_amax_history': jnp.zeros((3, history))}

  @jax.jit
  def flax_step(meta, x, k, w):
    apply = lambda m, x, k: Flax().apply({fp8_ops.OVERWRITE_WITH_GRADIENT: m}, x, k)
    f = lambda x, k, m: jnp.sum(apply(m, x, k) * w)
    return apply(meta, x, k), jax.grad(
        f, argnums=(0, 1, 2))(x, k, meta)

  @jax.jit
  def our_step(meta, x, k, w):
    scales = model_lib.fp8_step_scales(meta)
    dot = lambda x, k, s: model_lib.fp8_dot_general(
        x, k, dims, s['fp8_scale'], s['fp8_amax_slots'] if slots else None)
    dx, dk, amaxes = jax.grad(lambda x, k, s: jnp.sum(dot(x, k, s) * w), argnums=(0, 1, 2))(
        x, k, scales)
    return dot(x, k, scales), (dx, dk, model_lib.fp8_advance(scales, amaxes))

  for step, size in enumerate((1.0, 30.0, 0.01, 5.0)):
    x = jax.random.normal(jax.random.key(10 + step), (48, 256), jnp.bfloat16) * size
    w = jax.random.normal(jax.random.key(20 + step), (48, 128), jnp.bfloat16) * size
    y, (dx, dk, theirs) = flax_step(theirs, x, k, w)
    got_y, (got_dx, got_dk, ours) = our_step(ours, x, k, w)
    for a, b in ((y, got_y), (dx, got_dx), (dk, got_dk)):
      np.testing.assert_array_equal(np.asarray(b), np.asarray(a), err_msg=f'step {step}')
    for i, t in enumerate(('input', 'kernel', 'output_grad')):
      np.testing.assert_array_equal(ours['fp8_scale'][i:i + 1], theirs['op'][f'{t}_scale'])
      np.testing.assert_array_equal(ours['fp8_amax_history'][i],
                                    theirs['op'][f'{t}_amax_history'])
  # The scales moved off 1 with the magnitudes.
  assert len(set(np.asarray(ours['fp8_scale']).tolist())) == 3


def test_fp8_training_forward_stays_close_and_evaluation_runs_in_the_compute_dtype():
  """The FP8 training forward (bf16 compute, scales calibrated by one backward pass) stays
  within the same 5% of the float32 logits as the bf16 one; evaluation (deterministic) of an
  FP8 model is the bf16 model's, bit for bit; and an FP8 matmul alone errs by FP8's rounding,
  more than bf16's."""
  config = TINY.replace(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
  fp8 = config.replace(matmul_precision='fp8', dtype='bfloat16')
  params, meta = _fp8_variables(fp8)
  ids, mask, seg, pos = _batch()
  evaluate = lambda c: jax.jit(lambda p: model_lib.BertForPreTraining(c).apply(
      {'params': p}, ids, mask, seg, pos)[0])(params)
  ref, bf16 = evaluate(config), evaluate(config.replace(dtype='bfloat16'))

  @jax.jit
  def train_forward(p, stepped):
    return model_lib.BertForPreTraining(fp8).apply(
        {'params': p, model_lib.FP8_COLLECTION: stepped}, ids, mask, seg, pos,
        deterministic=False, rngs={'dropout': jax.random.key(0)})[0]

  # The "gradient" of the step's collection is this step's amaxes, which enter the histories
  # (delayed scaling: the next step's scales follow the histories).
  stepped = model_lib.fp8_step_scales(meta)
  _, grads = jax.jit(jax.grad(lambda p, s: jnp.sum(train_forward(p, s)), argnums=(0, 1)))(
      params, stepped)
  calibrated = model_lib.fp8_advance(stepped, grads)
  assert np.all(np.asarray(calibrated['bert']['encoder']['fp8_amax_history'][..., 0]) > 0)
  out = train_forward(params, model_lib.fp8_step_scales(calibrated))
  assert_close(out, ref, 0.05, what='FP8 logits vs float32')
  assert_close(bf16, ref, 0.05, what='bf16 logits vs float32')
  assert not np.array_equal(np.asarray(out), np.asarray(bf16))  # FP8 did run.
  np.testing.assert_array_equal(np.asarray(evaluate(fp8)), np.asarray(bf16))

  # One matmul: FP8 (e4m3 has 3 mantissa bits) errs by a few percent, more than bf16.
  x = jax.random.normal(jax.random.key(1), (64, 256), jnp.bfloat16)
  k = jax.random.normal(jax.random.key(2), (256, 128), jnp.bfloat16) * 0.02
  dims = (((1,), (0,)), ((), ()))

  meta = {'fp8_scale': jnp.ones((3,)),
          'fp8_amax_history': jnp.zeros((3, model_lib.FP8_AMAX_HISTORY))}
  dot = lambda m: model_lib.fp8_dot_general(x, k, dims, model_lib.fp8_step_scales(m)['fp8_scale'])
  exact = np.asarray(x, np.float64) @ np.asarray(k, np.float64)
  amaxes = jax.jit(jax.grad(lambda s: jnp.sum(model_lib.fp8_dot_general(
      x, k, dims, s['fp8_scale']))))(model_lib.fp8_step_scales(meta))
  y = jax.jit(dot)(model_lib.fp8_advance(model_lib.fp8_step_scales(meta), amaxes))
  fp8_err = assert_close(y, exact, 0.1, what='FP8 matmul')
  bf16_err = assert_close(jnp.dot(x, k), exact, 0.02, what='bf16 matmul')
  assert fp8_err > 2 * bf16_err, (fp8_err, bf16_err)


def test_padded_vocab_logits_give_the_same_loss_predictions_and_gradients():
  """BertForPreTraining(padded_vocab=True) (the pre-training steps'): MLM logits over the
  decoder's padded vocabulary (99 -> 128), the pad columns at PAD_LOGIT, so that the loss's
  gradient enters the decoder's matmul as it is (no pad of it back to 128 columns): the same
  loss, accuracy and parameter gradients as the sliced logits, and no gradient through a pad
  column."""
  from bert_jax import objectives  # pylint: disable=g-import-not-at-top
  params = model_lib.init_params(TINY, jax.random.key(6))
  ids, mask, seg, pos = _batch()
  labels = jnp.asarray(np.random.RandomState(1).randint(0, 99, pos.shape), jnp.int32)
  batch = {'masked_lm_ids': labels, 'masked_lm_weights': jnp.ones(pos.shape, jnp.float32)}

  def loss(p, padded):
    logits, _ = model_lib.BertForPreTraining(TINY, padded_vocab=padded).apply(
        {'params': p}, ids, mask, seg, pos)
    sums, _, metrics = objectives.mlm_loss(logits, batch)
    return sums['mlm'], (logits, metrics)

  (ref, (ref_logits, ref_metrics)), ref_grads = jax.value_and_grad(loss, has_aux=True)(
      params, False)
  (got, (logits, metrics)), grads = jax.value_and_grad(loss, has_aux=True)(params, True)
  assert ref_logits.shape[-1] == 99 and logits.shape[-1] == 128
  np.testing.assert_array_equal(np.asarray(logits[..., :99]), np.asarray(ref_logits))
  assert np.all(np.asarray(logits[..., 99:]) < model_lib.PAD_LOGIT / 2)
  assert_close(got, ref, 1e-6, what='loss')
  assert jax.tree.map(float, metrics) == jax.tree.map(float, ref_metrics)
  top = max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(ref_grads))
  jax.tree.map(lambda a, b: assert_close(b, a, 1e-6, scale=top), ref_grads, grads)
