"""Pre-training objectives: MLM and the sentence objectives' losses and metrics, one convention."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bert_jax import objectives
from bert_jax import train_state
from bert_jax.errors import UserError


def test_pretraining_loss_is_weighted_cross_entropy():
  rng = np.random.RandomState(0)
  mlm = rng.randn(2, 3, 7).astype(np.float32)
  nsp = rng.randn(2, 2).astype(np.float32)
  batch = dict(masked_lm_ids=np.array([[1, 2, 0], [3, 0, 0]]),
               masked_lm_weights=np.array([[1, 1, 0], [1, 0, 0]], np.float32),
               next_sentence_labels=np.array([0, 1]))
  sums, counts, metrics = objectives.loss(objectives.get('nsp'), (mlm, nsp), batch)
  loss = train_state.normalize(sums, counts)
  logp = jax.nn.log_softmax(mlm)
  mlm_ref = -(logp[0, 0, 1] + logp[0, 1, 2] + logp[1, 0, 3]) / 3
  nsp_ref = -(jax.nn.log_softmax(nsp)[0, 0] + jax.nn.log_softmax(nsp)[1, 1]) / 2
  np.testing.assert_allclose(loss, mlm_ref + nsp_ref, rtol=1e-6)
  assert float(metrics['mlm_loss'][1]) == 3.0


def test_padding_rows_do_not_count_for_nsp():
  rng = np.random.RandomState(1)
  mlm = rng.randn(3, 2, 7).astype(np.float32)
  nsp = rng.randn(3, 2).astype(np.float32)
  batch = dict(masked_lm_ids=np.array([[1, 2], [3, 0], [0, 0]]),
               masked_lm_weights=np.array([[1, 1], [1, 0], [0, 0]], np.float32),
               next_sentence_labels=np.array([0, 1, 0]),
               input_mask=np.array([[1, 1, 0], [1, 1, 1], [0, 0, 0]]))  # Row 3: padding.
  _, _, metrics = objectives.loss(objectives.get('nsp'), (mlm, nsp), batch)
  logp = jax.nn.log_softmax(nsp)
  assert float(metrics['nsp_loss'][1]) == 2.0 and float(metrics['nsp_accuracy'][1]) == 2.0
  np.testing.assert_allclose(metrics['nsp_loss'][0], -(logp[0, 0] + logp[1, 1]), rtol=1e-6)
  correct = (np.argmax(nsp[:2], -1) == [0, 1]).sum()
  assert float(metrics['nsp_accuracy'][0]) == correct


def test_each_objective_logs_under_its_own_name():
  rng = np.random.RandomState(2)
  mlm = rng.randn(2, 3, 7).astype(np.float32)
  sentence = rng.randn(2, 2).astype(np.float32)
  batch = dict(masked_lm_ids=np.array([[1, 2, 0], [3, 0, 0]]),
               masked_lm_weights=np.array([[1, 1, 0], [1, 0, 0]], np.float32),
               next_sentence_labels=np.array([1, 0]))
  names = {}
  for name in objectives.OBJECTIVES:
    sums, counts, metrics = objectives.loss(objectives.get(name), (mlm, sentence), batch)
    assert sums.keys() == counts.keys()
    names[name] = set(metrics)
  assert names['nsp'] == {'mlm_loss', 'mlm_accuracy', 'nsp_loss', 'nsp_accuracy'}
  assert names['sop'] == {'mlm_loss', 'mlm_accuracy', 'sop_loss', 'sop_accuracy'}
  assert names['none'] == {'mlm_loss', 'mlm_accuracy'}
  # SOP and NSP train the same head on the same labels: the same numbers, under their names.
  _, _, nsp = objectives.loss(objectives.get('nsp'), (mlm, sentence), batch)
  _, _, sop = objectives.loss(objectives.get('sop'), (mlm, sentence), batch)
  assert all(np.array_equal(nsp[f'nsp_{k}'], sop[f'sop_{k}']) for k in ('loss', 'accuracy'))
  with pytest.raises(UserError, match=r"data.objective='mlm': expected one of nsp, sop, none"):
    objectives.get('mlm')


def test_cross_entropy_gradient_is_elementwise_not_a_scatter():
  """The loss picks the label's log-probability with a one-hot mask: the values and gradients
  of log_softmax + take_along_axis, without that gather's backward, a scatter into an
  all-zeros f32 [B, P, vocab] tensor (875 MB at BERT-base/128 on an H100)."""
  rng = np.random.RandomState(3)
  logits = jnp.asarray(rng.randn(2, 5, 70).astype(np.float32) * 4)
  labels = jnp.asarray(rng.randint(0, 70, size=(2, 5)))
  weights = jnp.asarray(rng.rand(2, 5).astype(np.float32))
  batch = dict(masked_lm_ids=labels, masked_lm_weights=weights)
  loss = lambda x: objectives.mlm_loss(x, batch)[0]['mlm']
  ref = lambda x: -jnp.sum(jnp.take_along_axis(jax.nn.log_softmax(x), labels[..., None],
                                               axis=-1)[..., 0] * weights)
  np.testing.assert_allclose(loss(logits), ref(logits), rtol=1e-6)
  np.testing.assert_allclose(jax.grad(loss)(logits), jax.grad(ref)(logits), rtol=1e-5,
                             atol=1e-7)
  for f in (loss, ref):
    hlo = jax.jit(jax.grad(f)).lower(logits).as_text()
    assert ('scatter' in hlo) == (f is ref)
