"""Tests of bert_jax.packing: every sequence lands whole, once, within the row's caps."""

import numpy as np
import pytest
import tensorflow as tf
from tolerance import assert_close

from bert_jax import packing

CLS, SEP, PAD = 2, 3, 0


def _sequences(rng, n, seq_len, max_predictions):
  """n unpacked sequences of random lengths with unique token ids and masked-LM targets."""
  lengths = np.where(rng.rand(n) < 0.3, rng.randint(4, seq_len + 1, n),
                     rng.randint(4, max(5, seq_len // 4), n))
  ids = np.full((n, seq_len), PAD, np.int32)
  mask = np.zeros((n, seq_len), np.int32)
  segments = np.zeros((n, seq_len), np.int32)
  positions = np.zeros((n, max_predictions), np.int32)
  targets = np.zeros((n, max_predictions), np.int32)
  weights = np.zeros((n, max_predictions), np.float32)
  next_id = 10
  for i, length in enumerate(lengths):
    ids[i, :length] = np.arange(next_id, next_id + length)
    next_id += length
    ids[i, 0] = CLS
    mask[i, :length] = 1
    segments[i, rng.randint(1, length):length] = 1
    count = min(max_predictions, max(1, round(0.15 * (length - 1))))
    chosen = np.sort(rng.choice(np.arange(1, length), count, replace=False))
    positions[i, :count] = chosen
    targets[i, :count] = ids[i, chosen] + 100_000
    weights[i, :count] = 1.0
  return dict(input_ids=ids, input_mask=mask, segment_ids=segments,
              masked_lm_positions=positions, masked_lm_ids=targets,
              masked_lm_weights=weights,
              next_sentence_labels=rng.randint(0, 2, n).astype(np.int32))


def _pack(features, seed=(1, 2), **kw):
  out = packing.pack({k: tf.constant(v) for k, v in features.items()},
                     tf.constant(seed, tf.int64), pad_id=PAD, **kw)
  return {k: v.numpy() for k, v in out.items()}


@pytest.mark.parametrize('seq_len,max_sequences,slack', [(64, 4, 1.3), (128, 16, 1.05)])
def test_every_sequence_lands_whole_once_within_the_caps(seq_len, max_sequences, slack):
  rng = np.random.RandomState(seq_len)
  max_predictions = seq_len // 6
  features = _sequences(rng, 300, seq_len, max_predictions)
  row_predictions = packing.predictions_per_row(max_predictions, max_sequences, seq_len)
  rows = _pack(features, seq_len=seq_len, max_sequences=max_sequences,
               max_predictions=row_predictions)
  num_rows = len(rows['input_ids'])
  assert rows['input_ids'].shape == (num_rows, seq_len)
  assert rows['masked_lm_ids'].shape == (num_rows, row_predictions)
  assert rows['next_sentence_labels'].shape == (num_rows, max_sequences)
  assert (rows['input_mask'] == (rows['sequence_ids'] > 0)).all()
  assert (rows['input_ids'][rows['input_mask'] == 0] == PAD).all()

  # Each input sequence is found by its [CLS]-free, unique token ids.
  where = {}
  for r in range(num_rows):
    for slot in range(int(rows['sequence_ids'][r].max())):
      cols = np.nonzero(rows['sequence_ids'][r] == slot + 1)[0]
      assert cols.size and np.all(np.diff(cols) == 1), 'a sequence is not contiguous'
      assert rows['next_sentence_weights'][r, slot] == 1.0
      assert rows['next_sentence_positions'][r, slot] == cols[0]
      where[int(rows['input_ids'][r, cols[1]]) - 1] = (r, slot, cols[0])
    assert (rows['next_sentence_weights'][r, rows['sequence_ids'][r].max():] == 0).all()
  assert len(where) == 300, 'a sequence was lost or duplicated'
  lengths = features['input_mask'].sum(1)
  predictions = []
  for i, length in enumerate(lengths):
    r, slot, start = where[int(features['input_ids'][i, 1]) - 1]
    span = slice(start, start + length)
    np.testing.assert_array_equal(rows['input_ids'][r, span], features['input_ids'][i, :length])
    np.testing.assert_array_equal(rows['segment_ids'][r, span],
                                  features['segment_ids'][i, :length])
    np.testing.assert_array_equal(rows['position_ids'][r, span], np.arange(length))
    assert rows['next_sentence_labels'][r, slot] == features['next_sentence_labels'][i]
    real = features['masked_lm_weights'][i] > 0
    predictions.append(set(zip([r] * real.sum(), features['masked_lm_positions'][i, real] + start,
                               features['masked_lm_ids'][i, real])))
  got = rows['masked_lm_weights'] > 0
  packed_predictions = set(zip(np.nonzero(got)[0], rows['masked_lm_positions'][got],
                               rows['masked_lm_ids'][got]))
  assert packed_predictions == set().union(*predictions)
  assert got.sum() == sum(len(p) for p in predictions)
  assert rows['masked_lm_weights'][got].min() == 1.0
  # Masked positions ascend in every row, as unpacked ones do.
  for r in range(num_rows):
    assert np.all(np.diff(rows['masked_lm_positions'][r, got[r]]) > 0)
  # Caps hold, and first-fit decreasing packs well: close to the least number of rows (with
  # a cap of 4 sequences, long ones leave gaps that short ones may not fill).
  assert (rows['sequence_ids'].max(1) <= max_sequences).all()
  assert got.sum(1).max() <= row_predictions
  lower_bound = max(np.ceil(lengths.sum() / seq_len), np.ceil(len(lengths) / max_sequences))
  assert num_rows <= lower_bound * slack + 1, (num_rows, lower_bound)


def test_caps_on_sequences_and_predictions_open_new_rows():
  rng = np.random.RandomState(0)
  features = _sequences(rng, 40, 32, 8)
  features['input_mask'][:] = 0
  features['input_mask'][:, :4] = 1  # 40 sequences of 4 tokens: 8 would fit a row.
  features['masked_lm_weights'][:] = 0.0
  rows = _pack(features, seq_len=32, max_sequences=3, max_predictions=8)
  assert sorted(rows['sequence_ids'].max(1).tolist()) == [1] + [3] * 13
  features['masked_lm_positions'][:, :3] = [1, 2, 3]
  features['masked_lm_weights'][:, :3] = 1.0  # 3 predictions each: 2 sequences per row.
  rows = _pack(features, seq_len=32, max_sequences=8, max_predictions=8)
  assert len(rows['input_ids']) == 20
  assert (rows['masked_lm_weights'].sum(1) == 6).all()


def test_deterministic_for_a_seed_and_rows_shuffled():
  rng = np.random.RandomState(3)
  features = _sequences(rng, 200, 64, 10)
  kw = dict(seq_len=64, max_sequences=8, max_predictions=14)
  a, b, c = _pack(features, **kw), _pack(features, **kw), _pack(features, seed=(5, 6), **kw)
  assert all(np.array_equal(a[k], b[k]) for k in a)
  assert not np.array_equal(a['input_ids'], c['input_ids'])
  # The same rows, in another order.
  assert sorted(map(tuple, a['input_ids'])) == sorted(map(tuple, c['input_ids']))
  # First-fit decreasing would put the longest sequences in the first rows; shuffled, the
  # row fill does not decrease along the window.
  fill = a['input_mask'].sum(1)
  assert not np.all(np.diff(fill) <= 0)


def test_padding_row_is_empty():
  row = packing.padding_row(16, 4, 6, PAD)
  assert {k: tuple(v.shape) for k, v in row.items()} == {
      'input_ids': (16,), 'input_mask': (16,), 'segment_ids': (16,), 'position_ids': (16,),
      'sequence_ids': (16,), 'masked_lm_positions': (6,), 'masked_lm_ids': (6,),
      'masked_lm_weights': (6,), 'next_sentence_positions': (4,),
      'next_sentence_labels': (4,), 'next_sentence_weights': (4,)}
  assert set(row) == set(packing.PACKED_FEATURES)
  assert all(float(tf.reduce_sum(tf.cast(v, tf.float32))) == 0 for v in row.values())


# ---------------------------------------------------------------------------------------------
# Exactness: the same sequences, packed or one per row, train the same
# ---------------------------------------------------------------------------------------------

# Dropout off: the comparison is of the arithmetic, which dropout masks would not share.
MODEL = dict(vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=8,
             intermediate_size=128, max_position_embeddings=32, hidden_dropout_prob=0.0,
             attention_probs_dropout_prob=0.0)


def _unpacked_and_packed(num=16, seq_len=32, max_predictions=5, max_sequences=6):
  """`num` random sequences one per row, and the same packed (padded to a multiple of 4)."""
  rng = np.random.RandomState(7)
  features = _sequences(rng, num, seq_len, max_predictions)
  features['input_ids'] = np.where(features['input_ids'] >= 10,
                                   rng.randint(5, 96, features['input_ids'].shape),
                                   features['input_ids']).astype(np.int32)
  features['masked_lm_ids'] = np.where(features['masked_lm_weights'] > 0,
                                       rng.randint(5, 96, features['masked_lm_ids'].shape),
                                       0).astype(np.int32)
  rows = _pack(features, seq_len=seq_len, max_sequences=max_sequences,
               max_predictions=packing.predictions_per_row(max_predictions, max_sequences,
                                                           seq_len))
  assert len(rows['input_ids']) < num * 0.7  # Really packed.
  extra = -len(rows['input_ids']) % 4
  rows = {k: np.concatenate([v, np.zeros((extra,) + v.shape[1:], v.dtype)])
          for k, v in rows.items()}
  return features, rows


def _where_packed(features, rows):
  """(row, slot, start) in `rows` of each sequence of `features`, found by its tokens."""
  found = {}
  for r in range(len(rows['input_ids'])):
    for slot in range(int(rows['sequence_ids'][r].max())):
      cols = np.nonzero(rows['sequence_ids'][r] == slot + 1)[0]
      found.setdefault(tuple(rows['input_ids'][r, cols]), []).append((r, slot, cols[0]))
  where = []
  for ids, length in zip(features['input_ids'], features['input_mask'].sum(1)):
    (place,) = found[tuple(ids[:length])]
    where.append(place)
  return where


def test_packed_sequences_give_the_same_losses_per_sequence():
  import jax  # pylint: disable=g-import-not-at-top
  from bert_jax import model as model_lib  # pylint: disable=g-import-not-at-top
  from bert_jax import pretraining  # pylint: disable=g-import-not-at-top

  features, rows = _unpacked_and_packed()
  config = model_lib.BertConfig(**MODEL)
  model = model_lib.BertForPreTraining(config)
  params = model_lib.init_params(config, jax.random.key(0))
  mlm_u, nsp_u = pretraining.apply_model(model, {'params': params}, features,
                                          deterministic=True)
  mlm_p, nsp_p = pretraining.apply_model(model, {'params': params}, rows,
                                          deterministic=True)
  assert nsp_p.shape == rows['next_sentence_weights'].shape + (2,)
  logp_u = np.asarray(jax.nn.log_softmax(mlm_u))
  logp_p = np.asarray(jax.nn.log_softmax(mlm_p))
  nsp_u, nsp_p = np.asarray(jax.nn.log_softmax(nsp_u)), np.asarray(jax.nn.log_softmax(nsp_p))
  scale = np.abs(logp_u).max()
  for i, (r, slot, start) in enumerate(_where_packed(features, rows)):
    assert_close(nsp_p[r, slot], nsp_u[i], 2e-5, scale=np.abs(nsp_u).max(), what='nsp')
    for j in np.nonzero(features['masked_lm_weights'][i])[0]:
      (k,) = np.nonzero((rows['masked_lm_positions'][r] == features['masked_lm_positions'][i, j]
                         + start) & (rows['masked_lm_weights'][r] > 0))[0]
      label = features['masked_lm_ids'][i, j]
      assert rows['masked_lm_ids'][r, k] == label
      # The whole distribution over the vocabulary, not only the loss at the label.
      assert_close(logp_p[r, k], logp_u[i, j], 2e-5, scale=scale, what='mlm')


@pytest.mark.parametrize('mesh_shape', [(1, 1, 1), (2, 2, 2)])
def test_packed_sequences_give_the_same_gradient(mesh_shape):
  import jax  # pylint: disable=g-import-not-at-top
  import ml_collections  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top
  from bert_jax import model as model_lib  # pylint: disable=g-import-not-at-top
  from bert_jax import sharding as sharding_lib  # pylint: disable=g-import-not-at-top
  from bert_jax import pretraining  # pylint: disable=g-import-not-at-top
  from configs import default  # pylint: disable=g-import-not-at-top

  features, rows = _unpacked_and_packed()
  model = model_lib.BertForPreTraining(model_lib.BertConfig(**MODEL))
  rules = sharding_lib.rules_from_config(default.get_config().mesh)
  # new params = params - lr * gradient; a large lr puts the rounding of that sum (an ulp of
  # the parameter) far below the gradient read back from it.
  lr = 1e3
  tx = optax.sgd(lr)

  def gradient_and_loss(batch, shape):
    mesh = sharding_lib.make_mesh(ml_collections.ConfigDict(
        dict(data=shape[0], fsdp=shape[1], tensor=shape[2])), jax.devices()[:np.prod(shape)])
    _, shardings, init = pretraining.abstract_state_and_shardings(model, tx, mesh, rules)
    state = jax.jit(init, out_shardings=shardings)(jax.random.key(0))
    before = jax.device_get(state.params)
    step = pretraining.build_train_step(model, tx, mesh, rules, shardings, jax.random.key(1), 1,
                                      objective='nsp')
    state, metrics = step(state, sharding_lib.make_global_batch(
        batch, sharding_lib.batch_sharding(mesh)))
    after = jax.device_get(state.params)
    return jax.tree.map(lambda b, a: (b - a) / lr, before, after), jax.device_get(metrics)

  grad_u, metrics_u = gradient_and_loss(features, (1, 1, 1))
  grad_p, metrics_p = gradient_and_loss(rows, mesh_shape)
  assert_close(metrics_p['loss'], metrics_u['loss'], 1e-5, what='loss')
  for key in ('mlm_loss', 'nsp_loss'):
    assert metrics_p[key][1] == metrics_u[key][1]  # Same counts: predictions, sequences.
    assert_close(metrics_p[key][0], metrics_u[key][0], 1e-5, what=key)
  assert metrics_p['sequences_per_row'][0] == metrics_u['sequences_per_row'][0] == 16
  assert metrics_p['real_tokens_per_row'][0] == metrics_u['real_tokens_per_row'][0] == (
      features['input_mask'].sum())
  flat_u = jax.tree_util.tree_leaves_with_path(grad_u)
  overall = max(np.abs(u).max() for _, u in flat_u)
  for (path, u), p in zip(flat_u, jax.tree.leaves(grad_p)):
    # Relative to the leaf's scale, as summation orders differ (rows, shards, CPUs); the key
    # biases' gradient is zero up to rounding (softmax ignores a shift), hence the floor.
    assert_close(p, u, 1e-4, scale=max(np.abs(u).max(), 1e-5 * overall),
                 what=jax.tree_util.keystr(path))
