"""Sharded training on 8 fake CPU devices: rules -> PartitionSpecs, mesh-independent steps,
gradient accumulation, batch checks."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from bert_jax import model as model_lib
from bert_jax import optim
from bert_jax import pretraining
from bert_jax import sharding as sharding_lib
from tolerance import assert_close, assert_trees_moved_close
from bert_jax import defaults

# Every sharded dimension divides by 8, so that any mesh of 8 devices (tensor=8 included) fits.
CONFIG = model_lib.BertConfig(vocab_size=96, hidden_size=64, num_hidden_layers=2,
                              num_attention_heads=8, intermediate_size=128,
                              max_position_embeddings=32, hidden_dropout_prob=0.1,
                              attention_probs_dropout_prob=0.1)


def _mesh(data, fsdp, tensor):
  cfg = ml_collections.ConfigDict(dict(data=data, fsdp=fsdp, tensor=tensor))
  return sharding_lib.make_mesh(cfg, jax.devices()[:data * fsdp * tensor])


def _rules():
  return sharding_lib.rules_from_config(defaults.pretrain().mesh)


def _batch(batch_size=8, seq=16, preds=4, seed=0):
  rng = np.random.RandomState(seed)
  lengths = rng.randint(seq // 2, seq + 1, size=batch_size)
  mask = (np.arange(seq)[None] < lengths[:, None]).astype(np.int32)
  ids = rng.randint(5, 96, size=(batch_size, seq)).astype(np.int32) * mask
  seg = ((np.arange(seq)[None] >= lengths[:, None] // 2) * mask).astype(np.int32)
  pos = np.stack([np.sort(rng.choice(np.arange(1, l), preds, replace=False)) for l in lengths])
  weights = (rng.rand(batch_size, preds) < 0.8).astype(np.float32)
  return dict(input_ids=ids, input_mask=mask, segment_ids=seg,
              masked_lm_positions=pos.astype(np.int32),
              masked_lm_ids=rng.randint(5, 96, size=(batch_size, preds)).astype(np.int32),
              masked_lm_weights=weights,
              next_sentence_labels=rng.randint(0, 2, size=batch_size).astype(np.int32))


def _train_config():
  train = defaults.pretrain().train
  train.unlock()
  train.update(steps=10, warmup_steps=2, learning_rate=1e-3)
  return train


def _one_step(mesh, config=CONFIG, accum=1, batch=None, steps=1, rng_impl='threefry2x32'):
  rules = _rules()
  model = model_lib.BertForPreTraining(config)
  tx, _ = optim.make_optimizer(_train_config())
  _, shardings, init = pretraining.abstract_state_and_shardings(model, tx, mesh, rules)
  state = jax.jit(init, out_shardings=shardings)(jax.random.key(0))
  start = jax.device_get(state.params)  # Before the step donates the state.
  step = pretraining.build_train_step(model, tx, mesh, rules, shardings,
                                    jax.random.key(1, impl=rng_impl), accum, objective='nsp')
  batch = _batch() if batch is None else batch
  losses = []
  for _ in range(steps):
    gb = sharding_lib.make_global_batch(batch, sharding_lib.batch_sharding(mesh))
    state, metrics = step(state, gb)
    losses.append(float(metrics['loss']))
  return state, losses, start


def test_partition_specs_follow_the_rules():
  mesh = _mesh(2, 2, 2)
  model = model_lib.BertForPreTraining(CONFIG.replace(scan_layers=True))
  tx, _ = optim.make_optimizer(_train_config())
  abstract, shardings, _ = pretraining.abstract_state_and_shardings(model, tx, mesh, _rules())
  p = shardings.params
  assert p['bert']['embeddings']['word_embeddings']['embedding'].spec == P('tensor', 'fsdp')
  assert p['bert']['embeddings']['position_embeddings']['embedding'].spec == P(None, 'fsdp')
  layers = p['bert']['encoder']['layers']
  assert layers['attention']['query']['kernel'].spec == P(None, 'fsdp', 'tensor', None)
  assert layers['attention']['output']['kernel'].spec == P(None, 'tensor', None, 'fsdp')
  assert layers['mlp']['intermediate']['kernel'].spec == P(None, 'fsdp', 'tensor')
  assert layers['mlp']['output']['kernel'].spec == P(None, 'tensor', 'fsdp')
  assert p['mlm']['output_bias'].spec == P('tensor')
  # Adam's moments are sharded exactly like the parameters; its step counter is replicated.
  adam = [s for s in jax.tree.leaves(shardings.opt_state,
                                     is_leaf=lambda x: hasattr(x, 'mu'))
          if hasattr(s, 'mu')][0]
  assert adam.mu['bert']['encoder']['layers']['mlp']['intermediate']['kernel'].spec == \
      P(None, 'fsdp', 'tensor')
  assert adam.count.spec == P()
  assert abstract.params['bert']['encoder']['layers']['mlp']['intermediate']['kernel'].shape == \
      (2, 64, 128)


def test_parameters_that_do_not_divide_over_the_mesh_are_named():
  # 4 heads cannot split over tensor=8; neither can a vocabulary of 100.
  config = CONFIG.replace(vocab_size=100, hidden_size=32, num_attention_heads=4)
  model = model_lib.BertForPreTraining(config)
  tx, _ = optim.make_optimizer(_train_config())
  with pytest.raises(ValueError) as e:
    pretraining.abstract_state_and_shardings(model, tx, _mesh(1, 1, 8), _rules())
  msg = str(e.value)
  assert ("bert/encoder/layer_0/attention/query/kernel (32, 4, 8): dimension 1 ('heads', "
          'size 4) is split over mesh.tensor=8') in msg
  assert "bert/embeddings/word_embeddings/embedding (100, 32): dimension 0 ('vocab'" in msg
  assert 'num_attention_heads (model.size)' in msg and 'model.vocab_size may pad' in msg
  # The same model fits a mesh whose axes divide it.
  pretraining.abstract_state_and_shardings(model, tx, _mesh(2, 2, 2), _rules())


# Dropout is on: both PRNGs of train.rng_impl must draw the same masks on every mesh.
@pytest.mark.parametrize('shape,rng_impl', [((8, 1, 1), 'threefry2x32'), ((2, 2, 2), 'rbg'),
                                            ((1, 1, 8), 'rbg')])
def test_step_is_mesh_independent(shape, rng_impl):
  ref_state, ref_loss, start = _one_step(_mesh(1, 1, 1), steps=2, rng_impl=rng_impl)
  state, loss, _ = _one_step(_mesh(*shape), steps=2, rng_impl=rng_impl)
  np.testing.assert_allclose(loss, ref_loss, rtol=2e-5)
  flat_ref = jax.tree.leaves(jax.device_get(ref_state.params))
  flat = jax.tree.leaves(jax.device_get(state.params))
  flat_init = jax.tree.leaves(start)
  # Sharding changes only the order of summation: compared on the scale of the update
  # (measured up to 7.5e-6 of it).
  assert_trees_moved_close(flat, flat_ref, flat_init, 1e-4)
  kernel = state.params['bert']['encoder']['layer_0']['mlp']['intermediate']['kernel']
  assert len(kernel.sharding.device_set) == 8


class _TiedMlm(nn.Module):
  config: model_lib.BertConfig

  @nn.compact
  def __call__(self, x):
    embeddings = model_lib.Embeddings(self.config, name='embeddings')
    return model_lib.MlmHead(self.config, name='mlm')(x, embeddings.attend)


@pytest.mark.parametrize('constrained', [False, True])
def test_mlm_head_gradients_on_a_three_axis_mesh(constrained):
  # Regression: with the transform laid out ('embed', 'mlp'), XLA's SPMD partitioner swapped
  # batch shards in dlogits @ E on (2, 2, 2) and these gradients came out wrong (the loss did
  # not). The layout alone must avoid it: without a mesh context the activation constraints
  # are inert and only the parameter shardings lay the program out.
  config = CONFIG.replace(hidden_size=32, num_attention_heads=4, intermediate_size=64)
  model, rules, mesh = _TiedMlm(config), _rules(), _mesh(2, 2, 2)
  rng = np.random.RandomState(0)
  x = rng.randn(8, 4, 32).astype(np.float32)
  labels = rng.randint(0, config.vocab_size, (8, 4))
  boxed = model.init(jax.random.key(0), x)['params']
  params = nn.unbox(boxed)

  def loss(p, x):
    logp = jax.nn.log_softmax(model.apply({'params': p}, x))
    return -jnp.take_along_axis(logp, labels[..., None], -1).sum()

  ref = jax.grad(loss)(params, x)
  shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(boxed), mesh, rules)
  grad = jax.jit(jax.grad(loss), in_shardings=(shardings, sharding_lib.batch_sharding(mesh)))
  if constrained:
    with sharding_lib.activate(mesh, rules):
      got = grad(params, x)
  else:
    with nn.logical_axis_rules(rules):
      got = grad(params, x)
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(ref), jax.tree.leaves(got)):
    assert_close(b, a, 2e-6, what=jax.tree_util.keystr(path))


def test_accumulated_micro_batches_equal_one_big_batch():
  no_dropout = CONFIG.replace(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
  mesh = _mesh(2, 2, 1)
  big, big_loss, start = _one_step(mesh, no_dropout, accum=1, steps=2)
  acc, acc_loss, _ = _one_step(mesh, no_dropout, accum=4, steps=2)
  np.testing.assert_allclose(acc_loss, big_loss, rtol=1e-5)
  # Summing micro-batch gradients reorders the sums, and Adam's g / (sqrt(v) + eps) amplifies
  # the rounding of components near eps (measured 2.8e-4 of the step on a bias); dropping or
  # mis-weighting a micro-batch changes updates by a sizeable fraction of the step.
  assert_trees_moved_close(jax.tree.leaves(jax.device_get(acc.params)),
                           jax.tree.leaves(jax.device_get(big.params)), jax.tree.leaves(start),
                           2e-3)


def test_mesh_and_batch_errors():
  with pytest.raises(ValueError, match='needs 12 devices'):
    sharding_lib.mesh_shape(ml_collections.ConfigDict(dict(data=3, fsdp=2, tensor=2)), 8)
  with pytest.raises(ValueError, match='only one of'):
    sharding_lib.mesh_shape(ml_collections.ConfigDict(dict(data=-1, fsdp=-1, tensor=2)), 8)
  assert sharding_lib.mesh_shape(ml_collections.ConfigDict(dict(data=-1, fsdp=2, tensor=2)),
                                 8) == (2, 2, 2)
  with pytest.raises(ValueError, match='train.batch_size=12'):
    sharding_lib.check_batch_size(12, _mesh(8, 1, 1))
  cfg = defaults.pretrain().mesh
  cfg.rules = (('batch', 'model'),)
  with pytest.raises(ValueError, match="unknown mesh axis 'model'"):
    sharding_lib.rules_from_config(cfg)
