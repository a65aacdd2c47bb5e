"""Attention over packed rows: the mask, the fused kernels against the XLA path, the errors.

Splash attention runs here in Pallas interpret mode (the same kernel, interpreted on CPU).
cuDNN cannot run or even lower without an NVIDIA GPU: what is checked is the call the cudnn
branch makes (its mask and arguments) and its errors.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bert_jax import attention
from bert_jax import config_files
from bert_jax import model as model_lib
from bert_jax import sharding as sharding_lib
from bert_jax import train
from bert_jax.errors import UserError
import tolerance

T = 128  # Splash tiles are multiples of 128 tokens.


def _packed_ids(batch: int = 4) -> np.ndarray:
  """Rows of several packed sequences, one unpacked, one all padding (eval filler)."""
  layouts = [[50, 40], [T], [30, 30, 31, 7], []]
  ids = np.zeros((batch, T), np.int32)
  for row, lengths in enumerate(layouts[:batch]):
    start = 0
    for k, n in enumerate(lengths, 1):
      ids[row, start:start + n] = k
      start += n
  return ids


def test_block_diagonal_mask_keeps_attention_within_each_sequence():
  ids = _packed_ids()
  mask = np.asarray(attention.block_diagonal_mask(jnp.asarray(ids)))[:, 0]
  for b in range(ids.shape[0]):
    for t in range(T):
      expected = ids[b] == ids[b, t] if ids[b, t] else ids[b] > 0
      np.testing.assert_array_equal(mask[b, t], expected & (ids[b] > 0))
  # Unpacked (ids = input_mask): the original's key mask, for every query.
  input_mask = (np.arange(T)[None] < np.array([[100], [T]])).astype(np.int32)
  mask = np.asarray(attention.block_diagonal_mask(jnp.asarray(input_mask)))[:, 0]
  np.testing.assert_array_equal(mask, np.broadcast_to(input_mask[:, None, :] > 0, mask.shape))


def _qkv(batch=4, heads=2, head_dim=32, seed=0):
  r = np.random.RandomState(seed)
  return [jnp.asarray(r.randn(batch, T, heads, head_dim), jnp.float32) for _ in range(3)]


def test_splash_matches_xla_forward_and_gradients():
  q, k, v = _qkv()
  ids = jnp.asarray(_packed_ids())
  real = jnp.asarray(_packed_ids() > 0)[..., None, None]
  weights = jnp.asarray(np.random.RandomState(1).randn(*q.shape), jnp.float32)

  def loss(impl, q, k, v):
    out = attention.dot_product_attention(q, k, v, ids, impl=impl)
    return jnp.sum(jnp.where(real, out, 0.0) * weights), out

  grads = {}
  for impl in ('xla', 'splash'):
    (_, out), g = jax.jit(jax.value_and_grad(functools.partial(loss, impl), argnums=(0, 1, 2),
                                             has_aux=True))(q, k, v)
    assert np.isfinite(np.asarray(out)).all(), impl  # Padding rows included.
    grads[impl] = (np.where(np.asarray(real), np.asarray(out), 0.0), *map(np.asarray, g))
  for name, a, b in zip(('output', 'dq', 'dk', 'dv'), grads['splash'], grads['xla']):
    tolerance.assert_close(a, b, rel=2e-5, what=name)


def _tiny(impl: str, **overrides) -> model_lib.BertConfig:
  return model_lib.config_for_size('tiny', vocab_size=64, max_position_embeddings=T,
                                   attention_impl=impl, **overrides)


def _pretraining_batch():
  ids = _packed_ids()
  r = np.random.RandomState(2)
  input_ids = r.randint(1, 64, ids.shape) * (ids > 0)
  segments = (r.rand(*ids.shape) < 0.5).astype(np.int32) * (ids > 0)
  positions = np.array([[1, 60, 80], [5, 6, 100], [0, 40, 95], [0, 0, 0]])
  return input_ids, (ids > 0).astype(np.int32), segments, positions, ids


def _loss_and_grads(config, params, batch, deterministic=True):
  input_ids, input_mask, segments, positions, ids = batch
  model = model_lib.BertForPreTraining(config)
  r = np.random.RandomState(3)
  w_mlm, w_nsp = r.randn(4, 3, 64), r.randn(4, 2)
  w_mlm[3], w_nsp[3] = 0, 0  # Row 4 is padding: nothing reads it.

  def loss(params):
    mlm, nsp = model.apply({'params': params}, input_ids, input_mask, segments, positions,
                           deterministic=deterministic, sequence_ids=ids,
                           rngs={'dropout': jax.random.key(0)})
    return jnp.sum(mlm * w_mlm) + jnp.sum(nsp * w_nsp), (mlm, nsp)

  return jax.jit(jax.value_and_grad(loss, has_aux=True))(params)


def _assert_same(a, b, rel=2e-5):
  (loss_a, (mlm_a, nsp_a)), grads_a = a
  (loss_b, (mlm_b, nsp_b)), grads_b = b
  tolerance.assert_close(mlm_a[:3], mlm_b[:3], rel=rel, what='mlm logits')
  tolerance.assert_close(nsp_a[:3], nsp_b[:3], rel=rel, what='nsp logits')
  for (path, ga), gb in zip(jax.tree_util.tree_flatten_with_path(grads_a)[0],
                            jax.tree.leaves(grads_b)):
    scale = max(float(np.abs(gb).max()), 1e-3)
    tolerance.assert_close(ga, gb, rel=rel, scale=scale, what=jax.tree_util.keystr(path))


def test_bert_with_splash_matches_xla_on_packed_rows_on_a_mesh():
  """The whole model, packed rows, in training mode (hidden dropout on, attention dropout 0),
  with the kernel under shard_map over a data x fsdp x tensor mesh of fake devices."""
  xla = _tiny('xla', attention_probs_dropout_prob=0.0)
  params = model_lib.init_params(xla, jax.random.key(0), seq_len=T)
  batch = _pretraining_batch()
  reference = _loss_and_grads(xla, params, batch, deterministic=False)
  config = config_files.load_config('configs/smoke.py', {'mesh.data': 2, 'mesh.fsdp': 2,
                                                'mesh.tensor': 2})
  mesh = sharding_lib.make_mesh(config.mesh, jax.devices()[:8])
  with sharding_lib.activate(mesh, sharding_lib.rules_from_config(config.mesh)):
    splash = _loss_and_grads(xla.replace(attention_impl='splash'), params, batch,
                             deterministic=False)
  _assert_same(splash, reference)


def test_cudnn_branch_passes_the_block_diagonal_mask(monkeypatch):
  """What the cudnn branch hands JAX's cuDNN attention (which cannot lower without a GPU):
  the block-diagonal mask, no lengths, the standard scale; replaced here by the XLA math on
  exactly those arguments, it gives the XLA path's result."""
  from jax._src.nn import functions as jax_nn  # pylint: disable=g-import-not-at-top
  calls = []

  def fake_cudnn(query, key, value, bias, mask, q_seqlen, kv_seqlen, *, scale, mask_type,
                 **unused):
    calls.append(dict(bias=bias, mask=mask, q_seqlen=q_seqlen, kv_seqlen=kv_seqlen,
                      scale=scale, mask_type=mask_type.name))
    return jax.nn.dot_product_attention(query, key, value, mask=mask, scale=scale,
                                        implementation='xla')

  monkeypatch.setattr(jax_nn, 'cudnn_dot_product_attention', fake_cudnn)
  q, k, v = (x.astype(jnp.bfloat16) for x in _qkv(seed=4))
  ids = jnp.asarray(_packed_ids())
  with attention.lowering_for('gpu'):  # As `bert-jax compile --topology=h100` lowers it.
    out = attention.dot_product_attention(q, k, v, ids, impl='cudnn')
    # cuDNN takes 16-bit inputs only: float32 compute is the user's setting to change.
    with pytest.raises(UserError, match='model.dtype'):
      attention.dot_product_attention(*_qkv(seed=4), ids, impl='cudnn')
  (call,) = calls
  assert call['bias'] is None and call['q_seqlen'] is None and call['kv_seqlen'] is None
  assert call['mask_type'] == 'NO_MASK' and call['scale'] == pytest.approx(1 / np.sqrt(32))
  np.testing.assert_array_equal(call['mask'], attention.block_diagonal_mask(ids))
  expected = attention.dot_product_attention(q, k, v, ids, impl='xla')
  np.testing.assert_array_equal(out, expected)


BACKENDS = {'cudnn': 'gpu', 'splash': 'tpu'}


def test_fused_kernels_refuse_attention_dropout_and_the_wrong_backend():
  batch = _pretraining_batch()
  for impl in ('cudnn', 'splash'):
    config = _tiny(impl)  # attention_probs_dropout_prob = 0.1: never a silent fall back.
    params = model_lib.init_params(config, jax.random.key(0), seq_len=T)
    with pytest.raises(UserError, match='attention_probs_dropout_prob=0'):
      _loss_and_grads(config, params, batch, deterministic=False)
    with pytest.raises(UserError, match='attention_probs_dropout_prob=0.1'):
      attention.check_config(impl, 0.1, BACKENDS[impl])
    # Evaluation applies no dropout: allowed.
    attention.check_config(impl, 0.1, BACKENDS[impl], training=False)
    with pytest.raises(UserError, match=f"model.attention_impl='{impl}' runs on"):
      attention.check_config(impl, 0.0, 'cpu')
  with pytest.raises(UserError, match="needs an NVIDIA GPU"):
    attention.dot_product_attention(*_qkv(), jnp.asarray(_packed_ids()), impl='cudnn')
  with pytest.raises(UserError, match=r'multiple of 128; got \[64, 200\]'):
    attention.check_config('splash', 0.0, 'tpu', [128, 64, 200, 512])
  with pytest.raises(UserError, match=r"model\.attention_impl='flash': expected one of xla, "):
    attention.check_config('flash', 0.0, 'gpu')
  attention.check_config('xla', 0.1, 'cpu', [7])


def test_pretraining_checks_the_attention_config_before_reading_data(tmp_path):
  config = config_files.load_config('configs/smoke.py', {'model.attention_impl': 'splash',
                                                'model.attention_probs_dropout_prob': 0.0,
                                                'data.max_seq_length': 128})
  with pytest.raises(UserError, match="model.attention_impl='splash' runs on TPUs only"):
    train.train_and_evaluate(config, str(tmp_path))


def test_the_removed_cudnn_varlen_is_one_line_naming_its_replacement():
  """model.attention_impl='cudnn_varlen' (cuDNN's packed layout) was removed, slower than
  'cudnn' on an H200: a config that still sets it, a checkpoint's BertConfig built with it, or
  a direct caller gets one UserError that says so and names 'cudnn', not "expected one of"."""
  assert 'cudnn_varlen' not in attention.IMPLEMENTATIONS
  removed = (r"--config\.model\.attention_impl='cudnn_varlen' was removed: cuDNN's packed "
             r"layout was slower than 'cudnn' at 128 and at 512 tokens on an H200 .*; use "
             r"--config\.model\.attention_impl=cudnn$")
  with pytest.raises(UserError, match=removed) as raised:
    config_files.load_config('configs/smoke.py', {'model.attention_impl': 'cudnn_varlen'})
  assert '\n' not in str(raised.value)
  with pytest.raises(UserError, match=removed):
    model_lib.BertConfig(attention_impl='cudnn_varlen')
  with pytest.raises(UserError, match=removed):
    attention.check_config('cudnn_varlen', 0.0, 'gpu')
  q, k, v = (x.astype(jnp.bfloat16) for x in _qkv())
  with attention.lowering_for('gpu'), pytest.raises(UserError, match=removed):
    attention.dot_product_attention(q, k, v, jnp.asarray(_packed_ids()), impl='cudnn_varlen')
