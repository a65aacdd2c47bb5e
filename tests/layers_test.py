"""The architecture options after the paper (layers.py, model.BertConfig): shapes, each option's
defining property, a plain-numpy reference of the whole modern encoder, the kernels with them,
and the config checks that refuse what a kernel cannot do."""

import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bert_jax import attention
from bert_jax import config_files
from bert_jax import layers
from bert_jax import model as model_lib
from bert_jax import rotary
from bert_jax.errors import UserError
from tolerance import assert_close

PAPER = model_lib.BertConfig(vocab_size=99, hidden_size=32, num_hidden_layers=3,
                             num_attention_heads=4, intermediate_size=40,
                             max_position_embeddings=16, hidden_dropout_prob=0.0,
                             attention_probs_dropout_prob=0.0)
# Every option on: ModernBERT's encoder, tiny. Layers 0 and 2 global, layer 1 local.
MODERN = PAPER.replace(position_embedding_type='rotary', rope_theta=160_000.0,
                       local_rope_theta=10_000.0, mlp_type='gated', pre_layer_norm=True,
                       use_bias=False, local_attention_window=4, global_attention_every=2,
                       type_vocab_size=0, layer_norm_eps=1e-5)


def _batch(batch=2, seq=12, seed=0):
  rng = np.random.RandomState(seed)
  ids = rng.randint(5, 99, size=(batch, seq)).astype(np.int32)
  mask = np.ones_like(ids)
  mask[-1, seq - 3:] = 0 if batch > 1 else 1
  return ids * mask, mask, np.zeros_like(ids)


def _params(config, seed=0):
  return model_lib.init_params(config, jax.random.key(seed), model_lib.BertModel)


def _encode(config, params, ids, mask, seg, **kwargs):
  return model_lib.BertModel(config).apply({'params': params}, ids, mask, seg, **kwargs)


@pytest.fixture(scope='module')
def modern_params():
  return _params(MODERN)


# ---- Shapes ----------------------------------------------------------------------------------


def test_each_option_changes_exactly_its_parameters():
  layer = lambda p: p['encoder']['layer_0']
  paper = _params(PAPER)
  shapes = lambda c: jax.tree.map(np.shape, _params(c))
  assert 'position_embeddings' not in shapes(PAPER.replace(
      position_embedding_type='rotary'))['embeddings']
  assert 'token_type_embeddings' not in shapes(PAPER.replace(type_vocab_size=0))['embeddings']
  gated = layer(shapes(PAPER.replace(mlp_type='gated')))['mlp']
  assert gated['gate'] == gated['intermediate'] == {'kernel': (32, 40), 'bias': (40,)}
  assert gated['output'] == layer(jax.tree.map(np.shape, paper))['mlp']['output']
  pre = layer(shapes(PAPER.replace(pre_layer_norm=True)))
  assert {'mlp_norm', 'output_norm'} <= set(pre) and 'attention_layer_norm' not in pre
  no_bias = _params(PAPER.replace(use_bias=False))
  paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(no_bias)]
  assert [p for p in paths if 'bias' in p] == ["['pooler']['bias']"]  # A task head's.
  mlm = model_lib.init_params(PAPER.replace(use_bias=False), jax.random.key(0))['mlm']
  assert set(mlm['transform']) == {'kernel'} and set(mlm['layer_norm']) == {'scale'}
  # Logical axis names on every new parameter (the sharding rules place them).
  boxed = model_lib.BertModel(MODERN).init(jax.random.key(0), *map(jnp.asarray, _batch()))
  for path, leaf in jax.tree_util.tree_leaves_with_path(
      boxed, is_leaf=lambda x: isinstance(x, nn.Partitioned)):
    assert isinstance(leaf, nn.Partitioned), jax.tree_util.keystr(path)


def test_options_round_trip_through_bert_config_json(tmp_path):
  path = str(tmp_path / 'bert_config.json')
  MODERN.write_json(path)
  with open(path) as f:
    back = model_lib.BertConfig.from_dict(json.load(f), source=path)
  assert back == MODERN.replace(dtype='float32')
  # The paper's BERT writes the original file, no new keys.
  assert set(PAPER.to_original_dict()) <= set(model_lib._ORIGINAL_FIELDS)  # pylint: disable=protected-access
  with pytest.raises(UserError, match='export it as ModernBERT'):
    MODERN.to_hf_dict()


# ---- The reference -----------------------------------------------------------------------------


def _ln(x, scale, eps):
  mean = x.mean(-1, keepdims=True)
  var = ((x - mean) ** 2).mean(-1, keepdims=True)
  return (x - mean) / np.sqrt(var + eps) * scale


def _gelu(x):
  from scipy.special import erf  # pylint: disable=g-import-not-at-top
  return 0.5 * x * (1 + erf(x / np.sqrt(2)))


def _reference(config, params, ids, mask):
  """ModernBERT's encoder as its paper writes it, in float64 numpy, for MODERN."""
  p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
  b, t = ids.shape
  heads, d = config.num_attention_heads, config.head_dim
  x = _ln(p['embeddings']['word_embeddings']['embedding'][ids],
          p['embeddings']['layer_norm']['scale'], config.layer_norm_eps)
  pos = np.arange(t, dtype=np.float64)
  normed = x
  for i in range(config.num_hidden_layers):
    lp = p['encoder'][f'layer_{i}']
    local = config.is_local_layer(i)
    theta = config.local_rope_theta if local else config.rope_theta
    inv = theta ** -(np.arange(0, d, 2) / d)
    ang = np.concatenate([pos[:, None] * inv] * 2, -1)[None, :, None, :]
    rot = lambda v: v * np.cos(ang) + np.concatenate([-v[..., d // 2:], v[..., :d // 2]],
                                                     -1) * np.sin(ang)
    q, k, v = (np.einsum('bth,hnd->btnd', normed, lp['attention'][n]['kernel'])
               for n in ('query', 'key', 'value'))
    q, k = rot(q), rot(k)
    scores = np.einsum('btnd,bsnd->bnts', q, k) / np.sqrt(d)
    allowed = np.broadcast_to(mask[:, None, None, :] > 0, scores.shape)
    if local:
      band = np.abs(np.arange(t)[:, None] - np.arange(t)[None, :]) <= (
          config.local_attention_window // 2)
      allowed = allowed & band
    scores = np.where(allowed, scores, -1e30)  # A padding query may have no key: finite.
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    attn = np.einsum('bnts,bsnd->btnd', probs, v)
    x = x + np.einsum('btnd,ndh->bth', attn, lp['attention']['output']['kernel'])
    h = _ln(x, lp['mlp_norm']['scale'], config.layer_norm_eps)
    act = _gelu(h @ lp['mlp']['intermediate']['kernel']) * (h @ lp['mlp']['gate']['kernel'])
    x = x + act @ lp['mlp']['output']['kernel']
    normed = _ln(x, lp['output_norm']['scale'], config.layer_norm_eps)
  return normed


def test_the_modern_encoder_is_modernberts(modern_params):
  """Rotary (per-kind bases), GeGLU, pre-LN with the embeddings' norm as layer 0's and a final
  norm, no biases, local attention in layer 1: as written out in numpy."""
  ids, mask, seg = _batch()
  seq, _ = _encode(MODERN, modern_params, ids, mask, seg)
  ref = _reference(MODERN, modern_params, ids, mask)
  real = mask.astype(bool)
  assert_close(np.asarray(seq)[real], ref[real], 2e-5, what='modern encoder vs numpy')


@pytest.mark.parametrize('scan, remat', [(True, 'none'), (False, 'full'), (True, 'dots')])
def test_scan_and_remat_match_the_loop_with_layers_of_two_kinds(modern_params, scan, remat):
  ids, mask, seg = _batch()
  ref, _ = _encode(MODERN, modern_params, ids, mask, seg)
  config = MODERN.replace(scan_layers=scan, remat_policy=remat)
  out, _ = _encode(config, model_lib.match_layout(config, modern_params), ids, mask, seg)
  assert_close(out, ref, 2e-6, what=f'scan={scan}, remat={remat}')


# ---- Each option's property ----------------------------------------------------------------------


def _peaky(params, factor=20.0):
  """Query and key kernels scaled up: attention far from uniform, so positions matter."""
  def scale(path, x):
    name = jax.tree_util.keystr(path)
    return x * factor if ("'query'" in name or "'key'" in name) and 'kernel' in name else x
  return jax.tree_util.tree_map_with_path(scale, params)


def test_rotary_attention_depends_only_on_relative_positions(modern_params):
  """Shifting every position by the same amount (packed rows' position_ids) changes nothing;
  with a learned table it does. No ceiling: rows longer than max_position_embeddings run."""
  modern_params = _peaky(modern_params)
  ids, mask, seg = _batch(seq=24)  # max_position_embeddings is 16.
  base = jnp.broadcast_to(jnp.arange(24), ids.shape)
  ref, _ = _encode(MODERN, modern_params, ids, mask, seg, position_ids=base)
  shifted, _ = _encode(MODERN, modern_params, ids, mask, seg, position_ids=base + 1000)
  assert_close(shifted, ref, 2e-4, what='rotary, positions shifted by 1000')
  # Not trivially: a different relative arrangement changes the output.
  reversed_, _ = _encode(MODERN, modern_params, ids, mask, seg, position_ids=base[:, ::-1])
  assert np.abs(np.asarray(reversed_) - np.asarray(ref)).max() > 1e-2
  paper = PAPER.replace(max_position_embeddings=40)
  params = _params(paper)
  a, _ = _encode(paper, params, ids, mask, seg, position_ids=base)
  b, _ = _encode(paper, params, ids, mask, seg, position_ids=base + 10)
  assert np.abs(np.asarray(a) - np.asarray(b)).max() > 1e-2
  with pytest.raises(UserError, match='exceeds max_position_embeddings'):
    _encode(PAPER, _params(PAPER), ids, mask, seg)


def test_rotary_rotation_keeps_norms_and_dot_products_are_relative():
  rng = np.random.RandomState(0)
  q, k = (jnp.asarray(rng.randn(1, 1, 1, 8), jnp.float32) for _ in range(2))
  def score(pq, pk):
    cq, sq = rotary.angles(jnp.array([[pq]]), 8, 10_000.0)
    ck, sk = rotary.angles(jnp.array([[pk]]), 8, 10_000.0)
    rq, rk = rotary.apply(q, cq, sq), rotary.apply(k, ck, sk)
    assert_close(jnp.linalg.norm(rq), jnp.linalg.norm(q), 1e-6, what='rotation keeps norms')
    return float(jnp.sum(rq * rk))
  assert score(3, 7) == pytest.approx(score(103, 107), rel=1e-5)
  assert score(3, 7) != pytest.approx(score(3, 8), rel=1e-3)


def test_local_attention_sees_only_its_window():
  """A token changed at position j moves a one-layer local model's outputs only within W / 2
  of j; with a global layer every output moves."""
  config = MODERN.replace(num_hidden_layers=1, global_attention_every=0)  # Local only.
  params = _params(config)
  ids, mask, seg = _batch(batch=1, seq=16)
  ref, _ = _encode(config, params, ids, mask, seg)
  changed = ids.copy()
  changed[0, 8] = 7 if ids[0, 8] != 7 else 8
  out, _ = _encode(config, params, changed, mask, seg)
  moved = np.abs(np.asarray(out) - np.asarray(ref)).max(-1)[0] > 1e-6
  assert np.flatnonzero(moved).tolist() == [6, 7, 8, 9, 10]  # W = 4: 8 +- 2.
  glob = config.replace(local_attention_window=0)
  ref, _ = _encode(glob, params, ids, mask, seg)
  out, _ = _encode(glob, params, changed, mask, seg)
  assert (np.abs(np.asarray(out) - np.asarray(ref)).max(-1) > 1e-6).all()


def test_an_8192_token_packed_row_trains_on_the_cpu():
  """The long-context case at the model level (the one long test here): one packed row of
  8,192 tokens (four sequences, no learned positions: max_position_embeddings is 16) through a
  one-layer local-attention model, forward and gradient. Attention stays inside each sequence
  and inside the window; the gradient is finite."""
  config = MODERN.replace(num_hidden_layers=1, num_attention_heads=1, global_attention_every=0,
                          local_attention_window=256)
  params = _params(config)
  t = 8192
  rng = np.random.RandomState(0)
  ids = rng.randint(5, 99, (1, t)).astype(np.int32)
  starts = [0, 3000, 5000, 8000]
  sequence_ids = np.zeros((1, t), np.int32)
  position_ids = np.zeros((1, t), np.int32)
  for k, (a, b) in enumerate(zip(starts, starts[1:] + [t])):
    sequence_ids[0, a:b] = k + 1
    position_ids[0, a:b] = np.arange(b - a)
  run = jax.jit(lambda p, ids: _encode(config, p, ids, jnp.ones_like(ids), jnp.zeros_like(ids),
                                       sequence_ids=sequence_ids, position_ids=position_ids)[0])
  ref = np.asarray(run(params, ids))
  changed = ids.copy()
  changed[0, 3001] = 7 if ids[0, 3001] != 7 else 8  # Inside sequence 2, near its start.
  moved = np.abs(np.asarray(run(params, changed)) - ref).max(-1)[0] > 1e-6
  # Sequence 1 (0-2999) never sees it, nor does anything past the window (3001 + 128).
  assert np.flatnonzero(moved).tolist() == list(range(3000, 3001 + 128 + 1))
  grads = jax.jit(jax.grad(lambda p: jnp.sum(run(p, ids) ** 2)))(params)
  assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(grads))


def test_which_layers_are_local():
  kinds = lambda **kw: [MODERN.replace(num_hidden_layers=7, **kw).is_local_layer(i)
                        for i in range(7)]
  assert kinds(global_attention_every=3) == [False, True, True, False, True, True, False]
  assert kinds(global_attention_every=0) == [True] * 7
  assert kinds(local_attention_window=0) == [False] * 7


def test_gated_mlp_is_act_of_one_half_times_the_other():
  config = PAPER.replace(mlp_type='gated', hidden_act='silu', num_hidden_layers=1)
  x = jnp.asarray(np.random.RandomState(1).randn(2, 5, 32), jnp.float32)
  mlp = layers.Mlp(config)
  params = mlp.init(jax.random.key(0), x)['params']
  y, bias = mlp.apply({'params': params}, x)
  p = jax.tree.map(np.asarray, nn.unbox(params))
  h = (jax.nn.silu(x @ p['intermediate']['kernel'] + p['intermediate']['bias']) *
       (x @ p['gate']['kernel'] + p['gate']['bias']))
  assert_close(y + bias, h @ p['output']['kernel'] + p['output']['bias'], 2e-6, what='SwiGLU')


def test_pre_layer_norm_training_with_dropout_keeps_the_stream_and_its_norm_together():
  """In training (dropout on) the stream and the normalized input of the next sub-layer come
  from the same dropout mask: the fused LayerNorm and residual_add agree."""
  config = MODERN.replace(hidden_dropout_prob=0.1)
  params = _params(config)
  ids, mask, seg = _batch()
  rngs = {'dropout': jax.random.key(3)}
  seq, _, hidden = model_lib.BertModel(config).apply(
      {'params': params}, ids, mask, seg, deterministic=False, rngs=rngs,
      return_hidden_states=True)
  last = params['encoder'][f'layer_{config.num_hidden_layers - 1}']['output_norm']['scale']
  assert_close(seq, _ln(np.asarray(hidden[-1], np.float64), np.asarray(last), 1e-5), 2e-5,
               what='final norm of the last stream')


@pytest.mark.parametrize('devices, impl', [(1, 'rbg'), (8, 'threefry2x32')])
def test_every_hidden_dropout_of_a_step_and_of_the_next_draws_its_own_mask(devices, impl,
                                                                          monkeypatch):
  """The seeds of a training step's hidden-dropout masks (the embeddings' and two per layer)
  all differ, and the next step's differ from them, with the key train.rng_impl='auto' gives
  on a mesh of one device (rbg) and of eight (threefry). Before, an rbg key gave every mask the
  seed 0."""
  import ml_collections  # pylint: disable=g-import-not-at-top
  from bert_jax import train_state  # pylint: disable=g-import-not-at-top
  seeds = []
  dropout_seed = layers.layer_norm.dropout_seed
  monkeypatch.setattr(layers.layer_norm, 'dropout_seed',
                      lambda key: seeds.append(dropout_seed(key)) or seeds[-1])
  config = PAPER.replace(hidden_dropout_prob=0.1)
  params = _params(config)
  ids, mask, seg = _batch()
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:devices]), ('data',))
  base = train_state.dropout_rng(ml_collections.ConfigDict({'rng_impl': 'auto', 'seed': 0}),
                                 mesh)
  assert str(jax.random.key_impl(base)) == impl
  for step in range(2):
    model_lib.BertModel(config).apply({'params': params}, ids, mask, seg, deterministic=False,
                                      rngs={'dropout': jax.random.fold_in(base, step)})
  drawn = [tuple(np.asarray(s).tolist()) for s in seeds]
  assert len(drawn) == 2 * (1 + 2 * config.num_hidden_layers), drawn
  assert len(set(drawn)) == len(drawn), drawn


# ---- Kernels -----------------------------------------------------------------------------------


def test_pallas_layer_norm_runs_the_pre_ln_layers(modern_params):
  """layer_norm_impl='pallas' (interpreted here) computes every pre-LN norm as xla does."""
  ids, mask, seg = _batch()
  config = MODERN.replace(hidden_dropout_prob=0.1)
  rngs = {'dropout': jax.random.key(5)}
  ref, _ = _encode(config, modern_params, ids, mask, seg, deterministic=False, rngs=rngs)
  out, _ = _encode(config.replace(layer_norm_impl='pallas'), modern_params, ids, mask, seg,
                   deterministic=False, rngs=rngs)
  assert_close(out, ref, 2e-5, what='pallas vs xla LayerNorm, modern encoder')


def test_pallas_gelu_runs_the_dense_mlp_of_a_pre_ln_model():
  """gelu_impl='pallas' (interpreted here) in the dense MLP beside the other options (pre-LN,
  rotary, no biases, local windows): as xla, in training."""
  config = MODERN.replace(mlp_type='dense', hidden_act='gelu', hidden_dropout_prob=0.1)
  params = _params(config)
  ids, mask, seg = _batch()
  rngs = {'dropout': jax.random.key(5)}
  ref, _ = _encode(config, params, ids, mask, seg, deterministic=False, rngs=rngs)
  out, _ = _encode(config.replace(gelu_impl='pallas'), params, ids, mask, seg,
                   deterministic=False, rngs=rngs)
  assert_close(out, ref, 2e-5, what='pallas vs xla GELU, pre-LN dense MLP')


def test_portable_gelu_runs_the_geglu_mlp_without_a_chlo_erf(modern_params):
  """portable_gelu (the SavedModel export) reaches the gated MLP's GELU too: the same outputs,
  and no CHLO composite (erf) that TensorFlow's XlaCallModule cannot read."""
  from jax import export  # pylint: disable=g-import-not-at-top
  config = MODERN.replace(hidden_act='gelu')
  ids, mask, seg = map(jnp.asarray, _batch())
  run = lambda c: jax.jit(lambda p: _encode(c, p, ids, mask, seg)[0])
  portable = config.replace(portable_gelu=True)
  assert_close(run(portable)(modern_params), run(config)(modern_params), 2e-6,
               what='portable vs exact GELU, GeGLU')
  assert 'composite' in export.export(run(config))(modern_params).mlir_module()
  assert 'composite' not in export.export(run(portable))(modern_params).mlir_module()


def test_splash_attention_with_a_local_window_matches_xla():
  rng = np.random.RandomState(0)
  q, k, v = (jnp.asarray(rng.randn(2, 256, 2, 64), jnp.float32) for _ in range(3))
  ids = np.ones((2, 256), np.int32)
  ids[0, 100:] = 2
  ids[1, 200:] = 0
  ids = jnp.asarray(ids)
  ref = attention.dot_product_attention(q, k, v, ids, impl='xla', local_window=64)
  out = attention.splash_attention(q, k, v, ids, interpret=True, local_window=64)
  real = np.asarray(ids) > 0
  assert_close(np.asarray(out)[real], np.asarray(ref)[real], 2e-5, what='splash local')
  glob = attention.dot_product_attention(q, k, v, ids, impl='xla')
  assert np.abs(np.asarray(glob) - np.asarray(ref))[real].max() > 1e-3


def test_fp8_covers_the_gated_mlp():
  config = MODERN.replace(matmul_precision='fp8')
  ids, mask, seg = map(jnp.asarray, _batch())
  variables = model_lib.BertModel(config).init(jax.random.key(0), ids, mask, seg)
  # Four FP8 matmuls a layer: QKV, attention output, the gated MLP's stacked input, its output.
  scale = variables[model_lib.FP8_COLLECTION]['encoder']['fp8_scale']
  assert scale.shape == (config.num_hidden_layers, 4, 3)
  variables[model_lib.FP8_COLLECTION] = model_lib.fp8_step_scales(
      variables[model_lib.FP8_COLLECTION])

  def out(variables):
    return model_lib.BertModel(config).apply(variables, ids, mask, seg, deterministic=False)[0]
  assert np.isfinite(np.asarray(out(variables))).all()
  # Every one of them reads its scales: the "gradient" of each is an amax, > 0.
  # (Against random weights: the sum of a LayerNorm's outputs has no gradient.)
  w = jax.random.normal(jax.random.key(1), out(variables).shape)
  grads = jax.grad(lambda v: jnp.sum(out(v) * w))(variables)[model_lib.FP8_COLLECTION]
  assert (np.asarray(model_lib.fp8_amaxes(grads)['encoder']['fp8_scale']) > 0).all()


# ---- Config -------------------------------------------------------------------------------------


@pytest.mark.parametrize('overrides, message', [
    ({'model.local_attention_window': 5}, 'must be even'),
    # The kernel that could not take a window is gone; its value is refused as removed.
    ({'model.local_attention_window': 4, 'model.attention_impl': 'cudnn_varlen',
      'model.attention_probs_dropout_prob': 0.0}, "'cudnn_varlen' was removed"),
    ({'model.local_attention_window': 4, 'model.attention_impl': 'splash',
      'model.scan_layers': True, 'model.attention_probs_dropout_prob': 0.0,
      'data.max_seq_length': 128}, 'scanned layers share one trace'),
    ({'model.mlp': 'geglu', 'model.gelu_impl': 'pallas'}, "a gated MLP's GELU runs in XLA"),
])
def test_config_refuses_what_a_kernel_cannot_do(overrides, message):
  with pytest.raises(UserError, match=message):
    config_files.load_config('smoke', overrides)


def test_a_gated_checkpoint_refuses_the_pallas_gelu_too():
  """A fine-tuning run takes the architecture from the checkpoint, the kernel from its config:
  the BertConfig they make refuses the pair as the config check does."""
  with pytest.raises(UserError, match=r"model.mlp='geglu'"):
    MODERN.replace(hidden_act='gelu', gelu_impl='pallas')
  PAPER.replace(gelu_impl='pallas', pre_layer_norm=True)  # The dense MLP takes it.


def test_rotary_lifts_the_length_ceiling_of_the_config():
  long = {'data.max_seq_length': 1024, 'model.max_position_embeddings': 512}
  with pytest.raises(UserError, match='max_position_embeddings'):
    config_files.load_config('smoke', long)
  config = config_files.load_config('smoke', {**long, 'model.position_embedding_type': 'rotary'})
  bert = model_lib.config_from(config.model, vocab_size=100)
  assert bert.rotary and bert.max_length is None


def test_the_model_block_decodes_every_option():
  config = config_files.load_config('smoke', {
      'model.position_embedding_type': 'rotary', 'model.mlp': 'swiglu',
      'model.intermediate_size': 300, 'model.pre_layer_norm': True, 'model.use_bias': False,
      'model.local_attention_window': 8, 'model.global_attention_every': 2,
      'model.type_vocab_size': 0, 'model.rope_theta': 5e4})
  bert = model_lib.config_from(config.model, vocab_size=100)
  assert (bert.rotary, bert.mlp_type, bert.hidden_act, bert.intermediate_size,
          bert.pre_layer_norm, bert.use_bias, bert.local_attention_window,
          bert.global_attention_every, bert.type_vocab_size, bert.rope_theta) == (
              True, 'gated', 'silu', 300, True, False, 8, 2, 0, 5e4)
  paper = model_lib.config_from(config_files.load_config('smoke').model, vocab_size=100)
  assert paper.is_paper_bert() and paper.intermediate_size == 4 * paper.hidden_size
