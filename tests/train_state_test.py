"""Tests of bert_jax.train_state's step with FP8 scales (model.matmul_precision='fp8'): the
values the backward pass returns for them replace them, outside the optimizer, one batch or
micro-batches in turn. (The step's other properties are tested through the drivers: exact
resume and training parity in train_test, finetune_test and parity_test.)"""

import jax
import numpy as np

from bert_jax import config_files
from bert_jax import pretraining
from bert_jax import sharding as sharding_lib

VOCAB, ROWS, SEQ, PREDS = 128, 8, 16, 3
E4M3_MAX, E5M2_MAX = 448.0, 57344.0


def _run(steps, **overrides):
  """The tiny pre-training step (8 CPU devices, AdamW with weight decay) run `steps` times on
  one batch: (its abstract state, the states after each step)."""
  config = config_files.load_config('configs/bert_base.py', dict({
      'model.size': 'tiny', 'model.vocab_size': VOCAB, 'model.dtype': 'float32',
      'train.batch_size': ROWS, 'train.phases': '', 'data.max_seq_length': SEQ,
      'data.max_predictions_per_seq': PREDS, 'mesh.data': -1}, **overrides))
  mesh = sharding_lib.make_mesh(config.mesh)
  built = pretraining.build_step(config, mesh, VOCAB)
  if not steps:
    return built.abstract, []
  with sharding_lib.activate(mesh, sharding_lib.rules_from_config(config.mesh)):
    state = jax.jit(built.init, out_shardings=built.shardings)(jax.random.key(0))
  rng = np.random.default_rng(0)
  batch = dict(
      input_ids=rng.integers(5, VOCAB, (ROWS, SEQ)).astype(np.int32),
      input_mask=np.ones((ROWS, SEQ), np.int32), segment_ids=np.zeros((ROWS, SEQ), np.int32),
      masked_lm_positions=rng.integers(1, SEQ, (ROWS, PREDS)).astype(np.int32),
      masked_lm_ids=rng.integers(5, VOCAB, (ROWS, PREDS)).astype(np.int32),
      masked_lm_weights=np.ones((ROWS, PREDS), np.float32),
      next_sentence_labels=rng.integers(0, 2, (ROWS,)).astype(np.int32))
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
