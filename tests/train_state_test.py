"""The train state (train_state.py): its compute copy of the parameters (which parameters it
holds, a step with it bit-identical to one without, a restore that derives it), and its FP8
scales (model.matmul_precision='fp8'), which the values the backward pass returns replace,
outside the optimizer, one batch or micro-batches in turn. (The step's other properties are
tested through the drivers: exact resume and training parity in train_test, finetune_test and
parity_test.)"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util

from bert_jax import checkpoint
from bert_jax import config_files
from bert_jax import objectives
from bert_jax import pretraining
from bert_jax import sharding as sharding_lib
from bert_jax import train_state as state_lib

VOCAB, SEQ, PREDS, BATCH = 512, 16, 4, 8
E4M3_MAX, E5M2_MAX = 448.0, 57344.0


def _built(dtype='bfloat16', model=None, **mesh):
  config = config_files.load_config('configs/bert_base.py', dict({
      'model.size': 'tiny', 'model.vocab_size': VOCAB, 'model.dtype': dtype,
      'train.phases': '', 'train.batch_size': BATCH, 'data.max_seq_length': SEQ,
      'data.max_predictions_per_seq': PREDS, 'mesh.data': -1, 'train.warmup_steps': 0},
      **{f'mesh.{k}': v for k, v in mesh.items()},
      **{f'model.{k}': v for k, v in (model or {}).items()}))
  mesh = sharding_lib.make_mesh(config.mesh, jax.devices())
  rules = sharding_lib.rules_from_config(config.mesh)
  return config, mesh, rules, pretraining.build_step(config, mesh, VOCAB)


def _batch(seed):
  rng = np.random.default_rng(seed)
  lengths = rng.integers(SEQ // 2, SEQ + 1, BATCH)
  mask = (np.arange(SEQ)[None] < lengths[:, None]).astype(np.int32)
  return dict(input_ids=rng.integers(5, VOCAB, (BATCH, SEQ), dtype=np.int32) * mask,
              input_mask=mask, segment_ids=(np.arange(SEQ)[None] >= lengths[:, None] // 2
                                            ).astype(np.int32) * mask,
              masked_lm_positions=rng.integers(1, SEQ // 2, (BATCH, PREDS), dtype=np.int32),
              masked_lm_ids=rng.integers(5, VOCAB, (BATCH, PREDS), dtype=np.int32),
              masked_lm_weights=np.ones((BATCH, PREDS), np.float32),
              next_sentence_labels=rng.integers(0, 2, BATCH, dtype=np.int32))


def _paths(tree):
  return set(traverse_util.flatten_dict(tree))


def test_the_copy_holds_what_the_model_reads_by_one_cast():
  """bfloat16: the weights of the matmuls and the biases they cast; not LayerNorm, not the
  biases the fused LayerNorm adds in float32, not the tied word embeddings (read twice, by the
  lookup and the MLM decoder). float32: no copy."""
  _, _, _, built = _built()
  copy = _paths(built.abstract.compute_params)
  params = _paths(built.abstract.params)
  layer = ('bert', 'encoder', 'layer_0')
  for name in ('query', 'key', 'value'):
    assert {layer + ('attention', name, 'kernel'), layer + ('attention', name, 'bias')} <= copy
  assert {layer + ('attention', 'output', 'kernel'), layer + ('mlp', 'intermediate', 'bias'),
          ('mlm', 'transform', 'kernel'), ('nsp', 'kernel')} <= copy
  kept = {('bert', 'embeddings', 'word_embeddings', 'embedding'), ('mlm', 'output_bias'),
          layer + ('attention', 'output', 'bias'), layer + ('mlp', 'output', 'bias')}
  kept |= {p for p in params if 'layer_norm' in p[-2]}
  assert kept <= params and not kept & copy
  for path, leaf in traverse_util.flatten_dict(built.abstract.compute_params).items():
    assert leaf.dtype == jnp.bfloat16 and leaf.shape == dict(
        traverse_util.flatten_dict(built.abstract.params))[path].shape
  assert _built('float32')[3].abstract.compute_params == {}


REMAT_SCAN = [{}, dict(remat_policy='dots'), dict(scan_layers=True),
              dict(scan_layers=True, remat_policy='dots')]


@pytest.mark.parametrize('model', REMAT_SCAN)
def test_the_training_forward_reads_every_copied_parameter_by_one_cast(model):
  """The copy is chosen from the forward that init traces (deterministic, a dummy batch); the
  training forward (dropout on, the real batch) must read those parameters the same way, or
  the copy would change its numerics. Rematerialized and scanned layers have theirs too."""
  _, mesh, rules, built = _built(model=model)
  assert {('bert', 'pooler', 'kernel'), ('mlm', 'transform', 'kernel')} <= _paths(
      built.abstract.compute_params)
  assert len(_paths(built.abstract.compute_params)) == (17 if model.get('scan_layers') else 27)
  apply = pretraining.pretraining_apply(built.model)
  batch = _batch(0)
  with sharding_lib.activate(mesh, rules):
    traced = jax.make_jaxpr(lambda p: apply(p, batch, jax.random.key(1)))(
        built.abstract.params)
  read_by_one_cast = state_lib.cast_only_params(traced.jaxpr, built.abstract.params,
                                                traced.jaxpr.invars[:len(jax.tree.leaves(
                                                    built.abstract.params))])
  assert _paths(built.abstract.compute_params) <= _paths(read_by_one_cast)


@pytest.mark.parametrize('accum_steps,mesh,model', [
    (2, dict(data=2, fsdp=2, tensor=2), {}), (1, {}, dict(scan_layers=True)),
    (1, {}, dict(scan_layers=True, remat_policy='dots'))])
def test_a_step_with_the_copy_is_bit_identical_to_one_without(accum_steps, mesh, model):
  """Parameters, optimizer state and metrics after two steps are the same bits with the copy
  as with the float32 parameters cast in the forward; the copy is the parameters cast, sharded
  as they are (fsdp and tensor axes too). Rematerialized layers recompute the forward in
  another program, where XLA (allowed excess precision) may skip a bfloat16 rounding that the
  other keeps: a few elements of two gradients differ in their last bits (measured 1.2e-7 in a
  parameter after one step, about 0.1% of the step), nothing more."""
  config, mesh, rules, built = _built(model=model, **mesh)
  with sharding_lib.activate(mesh, rules):
    state = jax.jit(built.init, out_shardings=built.shardings)(jax.random.key(0))
    step = jax.jit(lambda s, b: state_lib.step(
        s, b, apply=pretraining.pretraining_apply(built.model),
        loss=pretraining.pretraining_loss(objectives.get(config.data.objective)), tx=built.tx,
        base_rng=state_lib.dropout_rng(config.train), accum_steps=accum_steps))
    states = {'copy': state, 'none': state.replace(compute_params={})}
    metrics = {}
    for name in states:
      for i in range(2):
        states[name], metrics[name] = step(states[name], _batch(i))
  assert traverse_util.flatten_dict(states['copy'].compute_params)
  assert states['none'].compute_params == {}
  for a, b in zip(jax.tree.leaves((states['copy'].params, states['copy'].opt_state,
                                   metrics['copy'])),
                  jax.tree.leaves((states['none'].params, states['none'].opt_state,
                                   metrics['none'])), strict=True):
    if model.get('remat_policy'):
      np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)
    else:
      np.testing.assert_array_equal(a, b)
  expected = state_lib.compute_copy(states['copy'].params, built.abstract.compute_params)
  for a, b in zip(jax.tree.leaves(states['copy'].compute_params), jax.tree.leaves(expected),
                  strict=True):
    assert a.dtype == jnp.bfloat16
    np.testing.assert_array_equal(a, b)
  params = traverse_util.flatten_dict(built.shardings.params)
  for path, s in traverse_util.flatten_dict(built.shardings.compute_params).items():
    assert s == params[path]
  assert any(s.spec != jax.sharding.PartitionSpec() for s in params.values())


def test_a_restored_state_derives_its_copy_and_the_checkpoint_has_none(tmp_path):
  _, mesh, rules, built = _built()
  with sharding_lib.activate(mesh, rules):
    state = jax.jit(built.init, out_shardings=built.shardings)(jax.random.key(0))
  workdir = str(tmp_path)
  manager = checkpoint.make_manager(workdir, keep=None, async_save=False,
                                    replica_parallel=False)
  checkpoint.save(manager, workdir, 3, state, {})
  restored, _ = checkpoint.restore(manager, 3, built.abstract)
  manager.close()
  assert sorted(p.name for p in (tmp_path / 'checkpoints' / '3').iterdir()
                if p.is_dir()) == ['meta', 'opt_state', 'params']
  parts = lambda s: (s.params, s.opt_state, s.compute_params)
  assert traverse_util.flatten_dict(restored.compute_params)
  for a, b in zip(jax.tree.leaves(parts(restored)), jax.tree.leaves(parts(state)), strict=True):
    assert a.sharding == b.sharding
    np.testing.assert_array_equal(a, b)
  fresh = state_lib.state_from_params(state.params, built.tx, built.shardings, built.abstract)
  for a, b in zip(jax.tree.leaves(fresh.compute_params), jax.tree.leaves(state.compute_params),
                  strict=True):
    np.testing.assert_array_equal(a, b)
  with pytest.raises(ValueError, match='compute copy'):
    state_lib.state_from_params(state.params, built.tx, built.shardings)


def test_the_global_norm_is_optaxs_with_one_reduction_per_group():
  """Leaves of one shape whose paths differ in their numbers (every layer's same parameter)
  are summed by one reduction; the norm is optax.tree.norm's but for the order of the sums."""
  import optax  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(0)
  tree = {'layer_0': {'w': rng.normal(size=(8, 4)), 'b': rng.normal(size=(4,))},
          'layer_1': {'w': rng.normal(size=(8, 4)), 'b': rng.normal(size=(4,))},
          'layer_10': {'w': rng.normal(size=(8, 4)), 'b': rng.normal(size=(4,))},
          'head': {'w': rng.normal(size=(8, 4))}, 'other': {'w': rng.normal(size=(4, 8))}}
  tree = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), tree)
  np.testing.assert_allclose(state_lib.global_norm(tree), optax.tree.norm(tree), rtol=1e-6)
  reductions = [e for e in jax.make_jaxpr(state_lib.global_norm)(tree).jaxpr.eqns
                if e.primitive.name == 'reduce_sum']
  # layer_#/w, layer_#/b, head/w, other/w.
  assert len(reductions) == 4


def _run(steps, **overrides):
  """The tiny pre-training step (8 CPU devices, AdamW with weight decay) run `steps` times on
  one batch: (its abstract state, the states after each step)."""
  config = config_files.load_config('configs/bert_base.py', dict({
      'model.size': 'tiny', 'model.vocab_size': VOCAB, 'model.dtype': 'float32',
      'train.batch_size': BATCH, 'train.phases': '', 'data.max_seq_length': SEQ,
      'data.max_predictions_per_seq': PREDS, 'mesh.data': -1}, **overrides))
  mesh = sharding_lib.make_mesh(config.mesh)
  built = pretraining.build_step(config, mesh, VOCAB)
  if not steps:
    return built.abstract, []
  with sharding_lib.activate(mesh, sharding_lib.rules_from_config(config.mesh)):
    state = jax.jit(built.init, out_shardings=built.shardings)(jax.random.key(0))
  rng = np.random.default_rng(0)
  batch = dict(
      input_ids=rng.integers(5, VOCAB, (BATCH, SEQ)).astype(np.int32),
      input_mask=np.ones((BATCH, SEQ), np.int32), segment_ids=np.zeros((BATCH, SEQ), np.int32),
      masked_lm_positions=rng.integers(1, SEQ, (BATCH, PREDS)).astype(np.int32),
      masked_lm_ids=rng.integers(5, VOCAB, (BATCH, PREDS)).astype(np.int32),
      masked_lm_weights=np.ones((BATCH, PREDS), np.float32),
      next_sentence_labels=rng.integers(0, 2, (BATCH,)).astype(np.int32))
  states = [jax.device_get(state)]
  for _ in range(steps):
    state, metrics = built.train_step(state, batch)
    assert np.isfinite(float(metrics['loss']))
    states.append(jax.device_get(state))
  return built.abstract, states


def _ops(fp8_meta):
  """{path of one FP8 matmul: its scales and histories}."""
  ops = {}
  for path, leaf in jax.tree_util.tree_leaves_with_path(fp8_meta):
    ops.setdefault(jax.tree_util.keystr(path[:-1]), {})[path[-1].key] = np.asarray(leaf)
  return ops


def _max(kind):
  return E5M2_MAX if kind == 'output_grad' else E4M3_MAX


def test_fp8_scales_are_replaced_by_the_step_not_optimized():
  """Step 1 puts each matmul's amax in its history (the scales, computed from the all-zero
  history, stay 1); step 2's scales are the history's amax over the FP8 maximum, exactly what
  delayed scaling computes, where AdamW (learning rate, weight decay) would have moved them
  elsewhere; the optimizer state holds no FP8 leaf."""
  _, fp8 = _run(2, **{'model.matmul_precision': 'fp8'})
  default, _ = _run(0)
  assert default.fp8_meta is None
  assert jax.tree.structure(fp8[0].opt_state) == jax.tree.structure(default.opt_state)
  assert jax.tree.structure(fp8[0].params) == jax.tree.structure(default.params)
  start, first, second = (_ops(s.fp8_meta) for s in fp8)
  assert len(first) == 4 * 2  # Four matmuls in each of BERT-tiny's two layers.
  for name, op in first.items():
    for kind in ('input', 'kernel', 'output_grad'):
      history = op[f'{kind}_amax_history']
      assert not start[name][f'{kind}_amax_history'].any()
      assert op[f'{kind}_scale'].tolist() == [1.0], (name, kind)
      assert history[0] > 0 and not history[1:].any(), (name, kind)
      amax = np.float32(history[0])
      # The next step scales by the largest amax of the history (flax's compute_scale).
      np.testing.assert_allclose(second[name][f'{kind}_scale'],
                                 [np.float32(1) / (np.float32(_max(kind)) / amax)], rtol=1e-6)
      later = second[name][f'{kind}_amax_history']
      assert later[-1] == history[0] and later[0] > 0, (name, kind)  # Rolled, then this step's.
  # The step counter and the parameters moved as usual.
  assert int(fp8[2].step) == 2
  assert not np.array_equal(fp8[2].params['bert']['pooler']['kernel'],
                            fp8[0].params['bert']['pooler']['kernel'])


def test_fp8_micro_batches_update_the_scales_in_turn():
  """train.grad_accum_steps=2: the second micro-batch runs with the scales the first one left
  (two amaxes in each history after one step, and scales already off 1), never their sum;
  here with model.scan_layers (the scales stacked per layer, like the parameters) and
  rematerialized layers (the backward pass recomputes the forward's FP8 casts)."""
  _, (_, state) = _run(1, **{'model.matmul_precision': 'fp8', 'train.grad_accum_steps': 2,
                             'model.scan_layers': True, 'model.remat_policy': 'full'})
  ops = _ops(state.fp8_meta)
  assert len(ops) == 4
  for name, op in ops.items():
    for kind in ('input', 'kernel', 'output_grad'):
      history = op[f'{kind}_amax_history']
      assert history.shape == (2, 1024)  # [layers, history]: each layer's own.
      first, second = history[..., -1], history[..., 0]
      assert (first > 0).all() and (second > 0).all(), (name, kind)
      assert not history[..., 1:-1].any()
      np.testing.assert_allclose(op[f'{kind}_scale'][..., 0],
                                 np.float32(1) / (np.float32(_max(kind)) / first), rtol=1e-6)
