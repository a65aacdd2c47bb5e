"""Schedules and optimizers: the paper's numbers, weight-decay mask, clipping."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from bert_jax import model as model_lib
from bert_jax import optim
from bert_jax import defaults
import torch_reference


def test_paper_schedule_values():
  train = defaults.pretrain().train
  schedule = optim.make_schedule(train)
  assert float(schedule(0)) == 0.0
  np.testing.assert_allclose(float(schedule(5_000)), 0.5e-4, rtol=1e-6)
  np.testing.assert_allclose(float(schedule(10_000)), 1e-4, rtol=1e-6)
  np.testing.assert_allclose(float(schedule(505_000)), 0.5e-4, rtol=1e-5)
  assert float(schedule(1_000_000)) == 0.0
  assert float(schedule(999_999)) > 0.0


def test_fine_tuning_schedule_is_transformers_linear_warmup_step_for_step(tmp_path):
  """The rate each update uses, as transformers' get_linear_schedule_with_warmup steps it in a
  torch loop (the first update at rate 0, the peak at `warmup`, 0 after the last)."""
  total, warmup, peak = 114, 11, 5e-5

  def make(_):
    import torch  # pylint: disable=g-import-not-at-top
    import transformers  # pylint: disable=g-import-not-at-top
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=peak)
    sched = transformers.get_linear_schedule_with_warmup(opt, warmup, total)
    rates = []
    for _ in range(total):
      rates.append(opt.param_groups[0]['lr'])  # The rate of this update.
      opt.step()
      sched.step()
    return {'rates': np.array(rates)}

  theirs = torch_reference.reference('linear_warmup_schedule', tmp_path, make)['rates']
  train = defaults.finetune('sst2').train
  train.unlock()
  train.update(warmup_steps=warmup, learning_rate=peak)
  ours = optim.make_schedule(train, total)
  np.testing.assert_allclose([float(ours(i)) for i in range(total)], theirs, rtol=1e-6,
                             atol=1e-12)
  assert theirs[0] == 0.0 and theirs[warmup] == peak


def test_paper_optimizer_hyperparameters():
  train = defaults.pretrain().train
  assert (train.optimizer, train.beta1, train.beta2, train.eps, train.weight_decay,
          train.max_grad_norm, train.batch_size) == ('adamw', 0.9, 0.999, 1e-6, 0.01, 1.0, 256)


def test_no_weight_decay_on_layer_norm_and_bias():
  config = model_lib.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1,
                                num_attention_heads=2, intermediate_size=32)
  params = model_lib.init_params(config, jax.random.key(0))
  train = defaults.pretrain().train
  train.unlock()
  train.update(warmup_steps=0, decay='constant', learning_rate=1.0, max_grad_norm=0.0)
  tx, _ = optim.make_optimizer(train, total_steps=10)
  zeros = jax.tree.map(jnp.zeros_like, params)
  updates, _ = tx.update(zeros, tx.init(params), params)
  flat = jax.tree_util.tree_flatten_with_path(updates)[0]
  decayed = {jax.tree_util.keystr(p) for p, u in flat if np.abs(np.asarray(u)).max() > 0}
  not_decayed = {jax.tree_util.keystr(p) for p, u in flat} - decayed
  assert all(("'bias'" in k or "'scale'" in k or 'output_bias' in k) for k in not_decayed)
  assert any('layer_norm' in k for k in not_decayed)
  assert any("'kernel'" in k for k in decayed) and any('embedding' in k for k in decayed)
  assert not any("'bias'" in k or "'scale'" in k for k in decayed)
  # With zero gradients the decoupled decay is exactly lr * wd * param.
  k = params['bert']['pooler']['kernel']
  np.testing.assert_allclose(updates['bert']['pooler']['kernel'], -0.01 * k, rtol=1e-6)


def test_clipping_and_lamb():
  train = defaults.pretrain().train
  train.unlock()
  train.update(warmup_steps=0, decay='constant', learning_rate=0.1)
  tx, _ = optim.make_optimizer(train, total_steps=10)
  params = {'w': jnp.ones((3,))}
  huge = {'w': jnp.full((3,), 1e6)}
  state = tx.init(params)
  u1, _ = tx.update(huge, state, params)
  u2, _ = tx.update({'w': huge['w'] * 10}, state, params)
  np.testing.assert_allclose(u1['w'], u2['w'], rtol=1e-5)  # Clipped to norm 1 both times.
  train.optimizer = 'lamb'
  tx, _ = optim.make_optimizer(train, total_steps=10)
  u, _ = tx.update(huge, tx.init(params), params)
  assert np.all(np.isfinite(u['w']))
  train.optimizer = 'sgd'
  with pytest.raises(ValueError, match='train.optimizer'):
    optim.make_optimizer(train)


def test_lamb_layer_adaptation_skips_bias_and_layer_norm():
  train = defaults.pretrain().train
  train.unlock()
  train.update(optimizer='lamb', warmup_steps=0, decay='constant', learning_rate=0.1,
               max_grad_norm=0.0)
  tx, _ = optim.make_optimizer(train, total_steps=10)
  params = {'dense': {'kernel': jnp.full((4,), 2.0), 'bias': jnp.full((2,), 3.0)},
            'layer_norm': {'scale': jnp.full((2,), 1.5)}}
  grads = {'dense': {'kernel': jnp.array([0.5, -0.5, 0.5, -0.5]), 'bias': jnp.array([0.5, -0.5])},
           'layer_norm': {'scale': jnp.array([0.25, -0.25])}}
  updates, _ = tx.update(grads, tx.init(params), params)
  adam = lambda g: np.asarray(g) / (np.abs(np.asarray(g)) + train.eps)  # First step of Adam.
  u = adam(grads['dense']['kernel']) + train.weight_decay * 2.0
  trust = np.linalg.norm(np.full(4, 2.0)) / np.linalg.norm(u)
  np.testing.assert_allclose(updates['dense']['kernel'], -0.1 * trust * u, rtol=1e-5)
  # No weight decay and no trust ratio: the plain Adam direction.
  np.testing.assert_allclose(updates['dense']['bias'], -0.1 * adam(grads['dense']['bias']),
                             rtol=1e-5)
  np.testing.assert_allclose(updates['layer_norm']['scale'],
                             -0.1 * adam(grads['layer_norm']['scale']), rtol=1e-5)


def test_lamb_state_is_optax_lamb_state():
  """Optimizer states saved by runs that used optax.lamb keep restoring."""
  config = model_lib.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1,
                                num_attention_heads=2, intermediate_size=32)
  params = model_lib.init_params(config, jax.random.key(0))
  train = defaults.pretrain().train
  train.unlock()
  train.optimizer = 'lamb'
  tx, schedule = optim.make_optimizer(train)
  reference = optax.chain(optax.clip_by_global_norm(train.max_grad_norm), optax.lamb(
      schedule, b1=train.beta1, b2=train.beta2, eps=train.eps, weight_decay=train.weight_decay,
      mask=optim.decay_mask))
  assert jax.tree.structure(tx.init(params)) == jax.tree.structure(reference.init(params))


@pytest.mark.parametrize('optimizer', ['adamw', 'lamb'])
@pytest.mark.parametrize('scale', [1e-3, 1e3])   # Under and over max_grad_norm.
def test_grad_norm_computed_once_same_updates_and_metrics_as_optax_clipping(
    monkeypatch, optimizer, scale):
  """train_state.step hands its logged grad_norm to the clipping: the same updates, state
  structure and metrics as with optax.clip_by_global_norm, with one global norm per step."""
  from bert_jax import train_state as state_lib  # pylint: disable=g-import-not-at-top
  train = defaults.pretrain().train
  train.unlock()
  train.update(warmup_steps=0, decay='constant', learning_rate=0.1, optimizer=optimizer)
  tx, _ = optim.make_optimizer(train, total_steps=10)
  with monkeypatch.context() as m:   # The chain as it was: optax's clipping.
    m.setattr(optim, 'clip_by_global_norm', optax.clip_by_global_norm)
    reference_tx, _ = optim.make_optimizer(train, total_steps=10)
  rng = np.random.RandomState(0)
  params = {'dense': {'kernel': jnp.asarray(rng.randn(4, 3), jnp.float32),
                      'bias': jnp.asarray(rng.randn(3), jnp.float32)}}
  batch = {'x': jnp.asarray(rng.randn(8, 4), jnp.float32),
           'y': jnp.asarray(rng.randn(8, 3), jnp.float32)}
  # The step applies the model to its variables ({'params': ...}: state_extras' contract).
  apply = lambda v, b, _: b['x'] @ v['params']['dense']['kernel'] + v['params']['dense']['bias']
  loss = lambda out, b: ({'mse': scale * jnp.sum((out - b['y']) ** 2)},
                         {'mse': jnp.float32(b['y'].size)}, {})

  def run(tx):
    state = state_lib.TrainState(step=jnp.zeros((), jnp.int32), params=params,
                                 opt_state=tx.init(params))
    f = lambda s: state_lib.step(s, batch, apply=apply, loss=loss, tx=tx,
                                 base_rng=jax.random.key(0))
    return jax.jit(f)(state), jax.make_jaxpr(f)(state)

  (state, metrics), jaxpr = run(tx)
  (ref_state, ref_metrics), ref_jaxpr = run(reference_tx)
  assert jax.tree.structure(state.opt_state) == jax.tree.structure(ref_state.opt_state)
  for a, b in zip(jax.tree.leaves((state, metrics)), jax.tree.leaves((ref_state, ref_metrics))):
    np.testing.assert_array_equal(a, b)
  assert (float(metrics['grad_norm']) > train.max_grad_norm) == (scale > 1)

  def global_norms(jaxpr):   # sqrt of a scalar: a norm (Adam's sqrt is per element; LAMB
    n = 0                    # takes one per leaf for its trust ratios).
    for eqn in jaxpr.eqns:
      n += eqn.primitive.name == 'sqrt' and eqn.outvars[0].aval.shape == ()
      for sub in jax.extend.core.jaxprs_in_params(eqn.params):
        n += global_norms(sub)
    return n
  assert global_norms(ref_jaxpr.jaxpr) == global_norms(jaxpr.jaxpr) + 1
  assert global_norms(jaxpr.jaxpr) == (1 if optimizer == 'adamw' else 1 + 2 * 2)


def test_clipping_uses_the_norm_it_is_given():
  clip = optim.clip_by_global_norm(1.0)
  g = {'w': jnp.full((4,), 3.0)}   # Norm 6.
  state = clip.init(g)
  np.testing.assert_allclose(clip.update(g, state)[0]['w'], 0.5, rtol=1e-6)
  np.testing.assert_allclose(
      clip.update(g, state, global_grad_norm=jnp.float32(12.0))[0]['w'], 0.25, rtol=1e-6)
  np.testing.assert_array_equal(
      clip.update(g, state, global_grad_norm=jnp.float32(0.5))[0]['w'], g['w'])
