"""The train state (train_state.py) and its extras (state_extras.py): one declared extra alone
is initialized, stepped, saved, restored and never exported; the compute copy of the
parameters (which parameters it holds, a step with it bit-identical to one without, a restore
that derives it); the FP8 scales (model.matmul_precision='fp8'), which the values the backward
pass returns replace, outside the optimizer, one batch or micro-batches in turn. (The step's
other properties are tested through the drivers: exact resume and training parity in
train_test, finetune_test and parity_test.)"""

import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util

from bert_jax import checkpoint
from bert_jax import config_files
from bert_jax import objectives
from bert_jax import pretraining
from bert_jax import run_files
from bert_jax import sharding as sharding_lib
from bert_jax import state_extras
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


COPY, FP8 = state_extras.COMPUTE_COPY.name, state_extras.FP8_SCALES.name


def test_the_copy_holds_what_the_model_reads_by_one_cast():
  """bfloat16: the weights of the matmuls and the biases they cast, the sub-layers' output
  biases among them (the LayerNorm's sum adds them in the compute dtype at init, where the copy
  is chosen); not LayerNorm, not the dense GELU's biases (activations.bias_gelu reads them in
  float32), not the tied word embeddings (read twice, by the lookup and the MLM decoder).
  float32: no copy."""
  _, _, _, built = _built()
  copy = _paths(built.abstract.extras[COPY])
  params = _paths(built.abstract.params)
  layer = ('bert', 'encoder', 'layer_0')
  for name in ('query', 'key', 'value'):
    assert {layer + ('attention', name, 'kernel'), layer + ('attention', name, 'bias')} <= copy
  assert {layer + ('attention', 'output', 'kernel'), layer + ('attention', 'output', 'bias'),
          layer + ('mlp', 'output', 'bias'), ('mlm', 'transform', 'kernel'),
          ('nsp', 'kernel')} <= copy
  kept = {('bert', 'embeddings', 'word_embeddings', 'embedding'), ('mlm', 'output_bias'),
          layer + ('mlp', 'intermediate', 'bias'), ('mlm', 'transform', 'bias')}
  kept |= {p for p in params if 'layer_norm' in p[-2]}
  assert kept <= params and not kept & copy
  for path, leaf in traverse_util.flatten_dict(built.abstract.extras[COPY]).items():
    assert leaf.dtype == jnp.bfloat16 and leaf.shape == dict(
        traverse_util.flatten_dict(built.abstract.params))[path].shape
  assert COPY not in _built('float32')[3].abstract.extras


REMAT_SCAN = [{}, dict(remat_policy='dots'), dict(scan_layers=True),
              dict(scan_layers=True, remat_policy='dots')]


@pytest.mark.parametrize('model', REMAT_SCAN)
def test_the_training_forward_reads_every_copied_parameter_by_one_cast(model):
  """The copy is chosen from the forward that init traces (deterministic, a dummy batch); the
  training forward (dropout on, the real batch) must read those parameters the same way, or
  the copy would change its numerics. Rematerialized and scanned layers have theirs too."""
  _, mesh, rules, built = _built(model=model)
  assert {('bert', 'pooler', 'kernel'), ('mlm', 'transform', 'kernel')} <= _paths(
      built.abstract.extras[COPY])
  assert len(_paths(built.abstract.extras[COPY])) == (17 if model.get('scan_layers') else 28)
  apply = pretraining.pretraining_apply(built.model)
  batch = _batch(0)
  with sharding_lib.activate(mesh, rules):
    traced = jax.make_jaxpr(lambda p: apply({'params': p}, batch, jax.random.key(1)))(
        built.abstract.params)
  read_by_one_cast = state_extras.cast_only_params(traced.jaxpr, built.abstract.params,
                                                   traced.jaxpr.invars[:len(jax.tree.leaves(
                                                       built.abstract.params))])
  assert _paths(built.abstract.extras[COPY]) <= _paths(read_by_one_cast)


@pytest.mark.parametrize('accum_steps,mesh,model', [
    (2, dict(data=2, fsdp=2, tensor=2), {}), (1, {}, dict(scan_layers=True)),
    (1, {}, dict(scan_layers=True, remat_policy='dots'))])
def test_a_step_with_the_copy_is_bit_identical_to_one_without(accum_steps, mesh, model):
  """Parameters, optimizer state and metrics after two steps are the same bits with the copy
  as with the float32 parameters cast in the forward; the copy is the parameters cast, sharded
  as they are (fsdp and tensor axes too). Rematerialized layers recompute the forward in
  another program, where XLA (allowed excess precision) may skip a bfloat16 rounding that the
  other keeps: a few elements of two gradients differ in their last bits, which Adam's update
  can scale up where an element's second moment is tiny (after two steps on 8 devices: 1 of
  32,768 elements of a parameter off by 3.8e-6 with threefry2x32's masks, 1.2e-7 with rbg's),
  nothing more."""
  config, mesh, rules, built = _built(model=model, **mesh)
  with sharding_lib.activate(mesh, rules):
    state = jax.jit(built.init, out_shardings=built.shardings)(jax.random.key(0))
    step = jax.jit(lambda s, b: state_lib.step(
        s, b, apply=pretraining.pretraining_apply(built.model),
        loss=pretraining.pretraining_loss(objectives.get(config.data.objective)), tx=built.tx,
        base_rng=state_lib.dropout_rng(config.train, mesh), accum_steps=accum_steps))
    states = {'copy': state, 'none': state.replace(extras={})}
    metrics = {}
    for name in states:
      for i in range(2):
        states[name], metrics[name] = step(states[name], _batch(i))
  assert traverse_util.flatten_dict(states['copy'].extras[COPY])
  assert states['none'].extras == {}
  for a, b in zip(jax.tree.leaves((states['copy'].params, states['copy'].opt_state,
                                   metrics['copy'])),
                  jax.tree.leaves((states['none'].params, states['none'].opt_state,
                                   metrics['none'])), strict=True):
    if model.get('remat_policy'):
      np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)
    else:
      np.testing.assert_array_equal(a, b)
  expected = state_extras.compute_copy(states['copy'].params, built.abstract.extras[COPY])
  for a, b in zip(jax.tree.leaves(states['copy'].extras[COPY]), jax.tree.leaves(expected),
                  strict=True):
    assert a.dtype == jnp.bfloat16
    np.testing.assert_array_equal(a, b)
  params = traverse_util.flatten_dict(built.shardings.params)
  for path, s in traverse_util.flatten_dict(built.shardings.extras[COPY]).items():
    assert s == params[path]
  assert any(s.spec != jax.sharding.PartitionSpec() for s in params.values())


def test_a_restored_state_derives_its_copy_and_the_checkpoint_has_none(tmp_path):
  _, mesh, rules, built = _built()
  with sharding_lib.activate(mesh, rules):
    state = jax.jit(built.init, out_shardings=built.shardings)(jax.random.key(0))
  workdir = str(tmp_path)
  manager = checkpoint.make_manager(workdir, keep=None, async_save=False,
                                    replica_parallel=False, extras=state_extras.saved_names())
  checkpoint.save(manager, workdir, 3, state, {})
  restored, _ = checkpoint.restore(manager, 3, built.abstract)
  manager.close()
  assert sorted(p.name for p in (tmp_path / 'checkpoints' / '3').iterdir()
                if p.is_dir()) == ['meta', 'opt_state', 'params']
  parts = lambda s: (s.params, s.opt_state, s.extras[COPY])
  assert traverse_util.flatten_dict(restored.extras[COPY])
  for a, b in zip(jax.tree.leaves(parts(restored)), jax.tree.leaves(parts(state)), strict=True):
    assert a.sharding == b.sharding
    np.testing.assert_array_equal(a, b)
  fresh = state_lib.state_from_params(state.params, built.tx, built.abstract)
  for a, b in zip(jax.tree.leaves(fresh.extras[COPY]), jax.tree.leaves(state.extras[COPY]),
                  strict=True):
    assert a.sharding == b.sharding
    np.testing.assert_array_equal(a, b)


def test_an_extra_needs_nothing_but_its_declaration(tmp_path, monkeypatch, caplog):
  """An extra added to state_extras.EXTRAS and nowhere else (here a moving average of the
  parameters, saved, beside the derived compute copy) is initialized with its shardings,
  updated by every step, saved as its own checkpoint item and restored exactly (afresh, with a
  warning, from a checkpoint without it), and never exported: init, the step, save, restore and
  export loop over the declarations."""
  from bert_jax import convert  # pylint: disable=g-import-not-at-top
  from bert_jax import pretrained  # pylint: disable=g-import-not-at-top
  average = state_extras.Extra(
      name='average', shapes=lambda traced: traced.variables['params'],
      init=lambda params, shapes: jax.tree.map(jnp.zeros_like, params),
      specs=lambda shapes, param_specs: param_specs, saved=True, collection=None,
      update=lambda average, params, _: jax.tree.map(lambda a, p: a * 0.5 + p * 0.5, average,
                                                     params))
  monkeypatch.setattr(state_extras, 'EXTRAS', state_extras.EXTRAS + (average,))
  _, mesh, rules, built = _built(data=4, fsdp=2)
  assert set(built.abstract.extras) == {COPY, 'average'}
  assert built.shardings.extras['average'] == built.shardings.params
  with sharding_lib.activate(mesh, rules):
    state = jax.jit(built.init, out_shardings=built.shardings)(jax.random.key(0))
  assert not any(np.any(np.asarray(a)) for a in jax.tree.leaves(state.extras['average']))
  expected = jax.tree.map(np.zeros_like, jax.device_get(state.params))
  for i in range(2):
    state, _ = built.train_step(state, sharding_lib.make_global_batch(
        _batch(i), sharding_lib.batch_sharding(mesh)))
    expected = jax.tree.map(lambda a, p: a * np.float32(0.5) + p * np.float32(0.5), expected,
                            jax.device_get(state.params))
  for a, b in zip(jax.tree.leaves(state.extras['average']), jax.tree.leaves(expected),
                  strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=0)
  assert any(np.any(np.asarray(a)) for a in jax.tree.leaves(state.extras['average']))

  workdir = str(tmp_path / 'run')
  manager = checkpoint.make_manager(workdir, keep=None, async_save=False,
                                    replica_parallel=False, extras=state_extras.saved_names())
  checkpoint.save(manager, workdir, 2, state, {})
  step_dir = tmp_path / 'run' / 'checkpoints' / '2'
  assert sorted(p.name for p in step_dir.iterdir() if p.is_dir()) == [
      'average', 'meta', 'opt_state', 'params']
  restored, _ = checkpoint.restore(manager, 2, built.abstract)
  assert restored.step == 2 and set(restored.extras) == {COPY, 'average'}
  parts = lambda s: (s.params, s.opt_state, s.extras)
  for a, b in zip(jax.tree.leaves(parts(restored)), jax.tree.leaves(parts(state)), strict=True):
    assert a.sharding == b.sharding
    np.testing.assert_array_equal(a, b)
  # A checkpoint without it (saved before it was declared): it starts afresh.
  checkpoint.save(manager, workdir, 3, state, {})
  manager.close()
  shutil.rmtree(tmp_path / 'run' / 'checkpoints' / '3' / 'average')
  manager = checkpoint.make_manager(workdir, keep=None, async_save=False,
                                    replica_parallel=False, extras=state_extras.saved_names())
  with caplog.at_level('WARNING'):
    restored, _ = checkpoint.restore(manager, 3, built.abstract)
  manager.close()
  assert 'Checkpoint 3 has no average: it starts afresh' in caplog.text
  assert not any(np.any(np.asarray(a)) for a in jax.tree.leaves(restored.extras['average']))
  np.testing.assert_array_equal(restored.params['nsp']['kernel'], state.params['nsp']['kernel'])

  # What loads a workdir's weights, and so every export, holds the parameters alone.
  run_files.write_run_files(workdir, '{}', built.bert_config, None)
  out = str(tmp_path / 'export')
  convert.convert(workdir, out, 'bert_jax')
  _, exported = pretrained.load_pretrained(out)
  assert set(exported) == set(state.params) == {'bert', 'mlm', 'nsp'}
  for head in ('mlm', 'nsp'):
    for a, b in zip(jax.tree.leaves(exported[head]), jax.tree.leaves(state.params[head]),
                    strict=True):
      np.testing.assert_array_equal(a, b)
  assert not [f for _, _, files in os.walk(out) for f in files if 'average' in f]


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
  """{(layer, matmul) of one FP8 matmul: its scales [1] and histories [FP8_AMAX_HISTORY] by
  tensor, as flax's op names them}, from the encoder's stacked variables."""
  encoder = fp8_meta['bert']['encoder']
  scale, history = np.asarray(encoder['fp8_scale']), np.asarray(encoder['fp8_amax_history'])
  ops = {}
  for layer, matmul in np.ndindex(scale.shape[:2]):
    op = ops[layer, matmul] = {}
    for i, kind in enumerate(('input', 'kernel', 'output_grad')):
      op[f'{kind}_scale'] = scale[layer, matmul, i:i + 1]
      op[f'{kind}_amax_history'] = history[layer, matmul, i]
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
  assert FP8 not in default.extras and FP8 in fp8[0].extras
  assert jax.tree.structure(fp8[0].opt_state) == jax.tree.structure(default.opt_state)
  assert jax.tree.structure(fp8[0].params) == jax.tree.structure(default.params)
  start, first, second = (_ops(s.extras[FP8]) for s in fp8)
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
  ops = _ops(state.extras[FP8])
  assert len(ops) == 4 * 2  # Each layer's own.
  for name, op in ops.items():
    for kind in ('input', 'kernel', 'output_grad'):
      history = op[f'{kind}_amax_history']
      assert history.shape == (1024,)
      first, second = history[..., -1], history[..., 0]
      assert (first > 0).all() and (second > 0).all(), (name, kind)
      assert not history[..., 1:-1].any()
      np.testing.assert_allclose(op[f'{kind}_scale'][..., 0],
                                 np.float32(1) / (np.float32(_max(kind)) / first), rtol=1e-6)


@pytest.mark.parametrize('impl', ['threefry2x32', 'rbg', 'unsafe_rbg'])
def test_every_micro_batch_of_every_step_gets_its_own_dropout_key(impl):
  """train_state.micro_rng: 6 steps of 3 micro-batches, 18 different keys and hidden-dropout
  seeds, for every train.rng_impl. (The step folded, then the micro-batch: with unsafe_rbg,
  whose fold_in is an xor, step 0's micro-batch 1 had step 1's micro-batch 0's key.)"""
  from bert_jax import layer_norm  # pylint: disable=g-import-not-at-top
  base = jax.random.fold_in(jax.random.key(0, impl=impl), 1)
  keys = [state_lib.micro_rng(base, jnp.int32(step), jnp.int32(i), 3)
          for step in range(6) for i in range(3)]
  words = {tuple(np.asarray(jax.random.key_data(k)).tolist()) for k in keys}
  seeds = {tuple(np.asarray(layer_norm.dropout_seed(k)).tolist()) for k in keys}
  assert len(words) == len(seeds) == len(keys), (words, seeds)
