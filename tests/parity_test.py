"""Parity with Hugging Face transformers' PyTorch BERT, through `pretrained.load_pretrained`.

Small random float32 models (every weight random, LayerNorm included), a batch with padding
inside it and both segments. Run with -s to see the measured differences. Where torch is not
installed, the references come from a recording (tests/torch_reference.py).
"""

import os

import numpy as np
import pytest

from bert_jax import model
from bert_jax import pretrained
from tolerance import assert_close, assert_moved_close
import torch_reference

# Errors are bounded relative to the largest value compared (see tests/tolerance.py): the two
# frameworks sum in different orders, so they differ by a few ulps of the activations' scale
# (measured at most 8e-7 of it). A wrong GELU, LayerNorm epsilon or mask is 1e-4 or more.
RELATIVE_TOLERANCE = 5e-6
HF_CONFIG = dict(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                 intermediate_size=37, max_position_embeddings=40, type_vocab_size=2,
                 hidden_act='gelu')
LENGTHS = (16, 11, 5)  # One row per length: padding inside the batch.


def _hf_model(cls_name: str, seed: int, **kwargs):
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  cls = getattr(transformers, cls_name)
  config = transformers.BertConfig(**HF_CONFIG, attn_implementation='eager', **kwargs)
  torch.manual_seed(seed)
  hf = cls(config).eval()
  with torch.no_grad():
    # Default init leaves LayerNorms at 1/0 and biases at 0: randomize every term.
    for name, p in hf.named_parameters():
      noise = 0.2 * torch.randn(p.shape)
      p.copy_(1.0 + noise if name.endswith('LayerNorm.weight') else noise)
  return hf


def _batch():
  rng = np.random.RandomState(0)
  batch, length = len(LENGTHS), max(LENGTHS)
  ids = rng.randint(1, HF_CONFIG['vocab_size'], (batch, length))
  mask = (np.arange(length)[None] < np.array(LENGTHS)[:, None]).astype(np.int64)
  segments = ((np.arange(length)[None] >= np.array(LENGTHS)[:, None] // 2) * mask)
  ids = ids * mask
  positions = np.array([[1, 7, 15], [0, 5, 10], [1, 2, 4]])
  return ids, mask, segments.astype(np.int64), positions


def _torch_inputs(ids, mask, segments):
  import torch  # pylint: disable=g-import-not-at-top
  return dict(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
              token_type_ids=torch.tensor(segments))


def _report(name: str, ours, theirs, valid=None) -> None:
  ours, theirs = np.asarray(ours), np.asarray(theirs)
  assert ours.shape == theirs.shape, name
  if valid is not None:
    ours, theirs = ours[valid], theirs[valid]
  ratio = assert_close(ours, theirs, RELATIVE_TOLERANCE, what=name)
  print(f'\nparity {name}: max abs diff {ratio:.3g} of the largest |value| '
        f'{np.abs(theirs).max():.3g}')


@pytest.fixture(scope='module')
def pretraining(tmp_path_factory):
  """HF's outputs on `_batch()` and its checkpoint as model.safetensors and pytorch_model.bin."""

  def make(folder):
    import torch  # pylint: disable=g-import-not-at-top
    hf = _hf_model('BertForPreTraining', seed=0)
    hf.save_pretrained(os.path.join(folder, 'safetensors'))
    # transformers 5 writes safetensors even with safe_serialization=False: write the .bin.
    os.makedirs(os.path.join(folder, 'bin'))
    hf.config.to_json_file(os.path.join(folder, 'bin', 'config.json'))
    torch.save(hf.state_dict(), os.path.join(folder, 'bin', 'pytorch_model.bin'))
    ids, mask, segments, positions = _batch()
    with torch.no_grad():
      out = hf(**_torch_inputs(ids, mask, segments), output_hidden_states=True)
      base = hf.bert(**_torch_inputs(ids, mask, segments))
    np.testing.assert_array_equal(out.hidden_states[-1].numpy(), base.last_hidden_state.numpy())
    return dict(sequence_output=base.last_hidden_state.numpy(),
                pooled_output=base.pooler_output.numpy(),
                mlm_logits=np.take_along_axis(out.prediction_logits.numpy(),
                                              positions[..., None], axis=1),
                nsp_logits=out.seq_relationship_logits.numpy())

  folder = tmp_path_factory.mktemp('pretraining')
  outputs = torch_reference.reference('parity_pretraining', folder, make)
  return outputs, {'safetensors': str(folder / 'safetensors'), 'bin': str(folder / 'bin')}


@pytest.mark.parametrize('scan_layers', [False, True], ids=['unscanned', 'scanned'])
@pytest.mark.parametrize('weights', ['safetensors', 'bin'])
def test_pretraining_parity(pretraining, weights, scan_layers):
  theirs, dirs = pretraining
  config, params = pretrained.load_pretrained(dirs[weights], scan_layers=scan_layers)
  assert config.scan_layers == scan_layers
  assert ('layers' in params['bert']['encoder']) == scan_layers
  ids, mask, segments, positions = _batch()
  sequence, pooled = model.encode(config, params, ids, mask, segments)
  mlm, nsp = model.BertForPreTraining(config).apply(
      {'params': params}, ids, mask, segments, positions)
  tag = f'{weights},{"scanned" if scan_layers else "unscanned"}'
  # Padded positions are don't-care: compare the real tokens.
  _report(f'sequence_output[{tag}]', sequence, theirs['sequence_output'], mask.astype(bool))
  _report(f'pooled_output[{tag}]', pooled, theirs['pooled_output'])
  _report(f'mlm_logits[{tag}]', mlm, theirs['mlm_logits'])
  _report(f'nsp_logits[{tag}]', nsp, theirs['nsp_logits'])


_HEADS = {  # head: (HF class, seed, HF kwargs, our class, our kwargs)
    'sequence_classification': ('BertForSequenceClassification', 3, {'num_labels': 3},
                                model.BertForSequenceClassification, {'num_labels': 3}),
    'token_classification': ('BertForTokenClassification', 5, {'num_labels': 5},
                             model.BertForTokenClassification, {'num_labels': 5}),
    'question_answering': ('BertForQuestionAnswering', 3, {}, model.BertForQuestionAnswering,
                           {}),
}


@pytest.fixture(scope='module')
def finetuned(tmp_path_factory):
  """head -> (HF's outputs on `_batch()`, the folder of its checkpoint)."""

  def make_head(head):
    def make(folder):
      import torch  # pylint: disable=g-import-not-at-top
      hf_cls, seed, hf_kwargs, _, _ = _HEADS[head]
      hf = _hf_model(hf_cls, seed=seed, **hf_kwargs)
      hf.save_pretrained(folder)
      ids, mask, segments, _ = _batch()
      with torch.no_grad():
        out = hf(**_torch_inputs(ids, mask, segments))
      if head == 'question_answering':
        return dict(start_logits=out.start_logits.numpy(), end_logits=out.end_logits.numpy())
      return dict(logits=out.logits.numpy())
    return make

  found = {}
  for head in _HEADS:
    folder = tmp_path_factory.mktemp(head)
    found[head] = (torch_reference.reference(f'parity_{head}', folder, make_head(head)),
                   str(folder))
  return found


@pytest.mark.parametrize('scan_layers', [False, True], ids=['unscanned', 'scanned'])
@pytest.mark.parametrize('head', list(_HEADS))
def test_finetuning_head_parity(finetuned, head, scan_layers):
  theirs, folder = finetuned[head]
  ids, mask, segments, _ = _batch()
  config, params = pretrained.load_pretrained(folder, scan_layers=scan_layers)
  expected_head = 'qa_outputs' if head == 'question_answering' else 'classifier'
  assert set(params) == {'bert', expected_head}
  _, _, _, ours_cls, kwargs = _HEADS[head]
  ours = ours_cls(config, **kwargs).apply({'params': params}, ids, mask, segments)
  tag = f'{head},{"scanned" if scan_layers else "unscanned"}'
  if head == 'question_answering':
    _report(f'start_logits[{tag}]', ours[0], theirs['start_logits'])
    _report(f'end_logits[{tag}]', ours[1], theirs['end_logits'])
  else:
    _report(f'logits[{tag}]', ours, theirs['logits'])


def test_train_step_parity(tmp_path):
  """Two optimizer steps from the same weights: the paper's AdamW (decay not on LayerNorm and
  biases, global-norm clipping) in `pretraining.train_step` against HF's model trained with
  torch.optim.AdamW; losses, gradient norms and every updated parameter agree."""
  import functools  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  from bert_jax import optim  # pylint: disable=g-import-not-at-top
  from bert_jax import pretraining  # pylint: disable=g-import-not-at-top
  from bert_jax import train_state  # pylint: disable=g-import-not-at-top
  from bert_jax import defaults  # pylint: disable=g-import-not-at-top

  lr, steps = 1e-3, 2
  train_config = defaults.pretrain().train
  train_config.unlock()
  train_config.update(warmup_steps=0, decay='constant', learning_rate=lr, steps=steps)
  ids, mask, segments, positions = _batch()
  masked_ids = np.take_along_axis(ids, positions, axis=1)
  nsp_labels = np.array([0, 1, 1])

  def make(folder):
    """HF's model trained `steps` steps: init/ and stepped/ checkpoints, (loss, norm) rows."""
    import torch  # pylint: disable=g-import-not-at-top
    hf = _hf_model('BertForPreTraining', seed=5, hidden_dropout_prob=0.0,
                   attention_probs_dropout_prob=0.0).train()
    hf.save_pretrained(os.path.join(folder, 'init'))
    named = list(hf.named_parameters())
    no_decay = [p for n, p in named if n.endswith('bias') or 'LayerNorm' in n]
    decay = [p for n, p in named if not (n.endswith('bias') or 'LayerNorm' in n)]
    opt = torch.optim.AdamW([{'params': decay, 'weight_decay': train_config.weight_decay},
                             {'params': no_decay, 'weight_decay': 0.0}], lr=lr,
                            betas=(train_config.beta1, train_config.beta2), eps=train_config.eps)
    labels = np.full(ids.shape, -100)
    np.put_along_axis(labels, positions, masked_ids, axis=1)
    rows = []
    for _ in range(steps):
      opt.zero_grad()
      loss = hf(**_torch_inputs(ids, mask, segments), labels=torch.tensor(labels),
                next_sentence_label=torch.tensor(nsp_labels)).loss
      loss.backward()
      norm = torch.nn.utils.clip_grad_norm_(hf.parameters(), train_config.max_grad_norm)
      opt.step()
      rows.append((loss.item(), norm.item()))
    hf.save_pretrained(os.path.join(folder, 'stepped'))
    return {'loss_and_grad_norm': np.array(rows)}

  theirs = torch_reference.reference('parity_train_step', tmp_path / 'hf',
                                     make)['loss_and_grad_norm'].tolist()
  config, params = pretrained.load_pretrained(str(tmp_path / 'hf' / 'init'))
  batch = dict(input_ids=ids, input_mask=mask, segment_ids=segments,
               masked_lm_positions=positions, masked_lm_ids=masked_ids,
               masked_lm_weights=np.ones(positions.shape, np.float32),
               next_sentence_labels=nsp_labels)
  batch = {k: np.asarray(v, np.float32 if k == 'masked_lm_weights' else np.int32)
           for k, v in batch.items()}
  tx, _ = optim.make_optimizer(train_config)
  step_fn = jax.jit(functools.partial(
      pretraining.train_step, model=model.BertForPreTraining(config), tx=tx,
      base_rng=jax.random.key(0), accum_steps=1, objective='nsp'))
  state = train_state.TrainState(step=np.int32(0), params=params, opt_state=tx.init(params))
  ours = []
  for _ in range(steps):
    state, metrics = step_fn(state, batch)
    ours.append((float(metrics['loss']), float(metrics['grad_norm'])))
  print(f'\nparity train step (loss, grad_norm): ours {ours}, HF+torch {theirs}')
  assert theirs[-1][1] > train_config.max_grad_norm  # Clipping was exercised.
  # Relative: the loss and the norm are sums over the batch and every weight (measured 2e-6).
  np.testing.assert_allclose(ours, theirs, rtol=1e-5)

  _, expected = pretrained.load_pretrained(str(tmp_path / 'hf' / 'stepped'))
  flat = lambda tree: {jax.tree_util.keystr(k): np.asarray(v)
                       for k, v in jax.tree_util.tree_flatten_with_path(tree)[0]}
  flat_ours, flat_theirs, flat_init = flat(state.params), flat(expected), flat(params)
  assert flat_ours.keys() == flat_theirs.keys()
  # The key bias adds q.b to every logit of a query: softmax cancels it, so its exact gradient
  # is 0 and both frameworks move it only by rounding noise that Adam's normalization scales
  # up to ~lr * |noise| / eps: under 1% of the lr-sized step a real gradient makes.
  noise_only = {k for k in flat_ours if "['key']['bias']" in k}
  assert len(noise_only) == config.num_hidden_layers
  for k in noise_only:
    assert np.abs(flat_ours[k] - flat_init[k]).max() < 0.01 * lr * steps
    assert np.abs(flat_theirs[k] - flat_init[k]).max() < 0.01 * lr * steps
  checked = sorted(set(flat_ours) - noise_only)
  # Adam moves every weight by about lr per step whatever its size, so each tensor's update is
  # compared on the scale of its movement (2e-3 here). Rounding differs by 5.5e-4 of it at most
  # (1.1e-6, on an AVX-512 CPU); applying weight decay to LayerNorm or biases, the classic
  # mask bug, shifts them by lr * 0.01 * |w| * steps, 5e-3 to 1.5e-2 of it.
  worst = max(assert_moved_close(flat_ours[k], flat_theirs[k], flat_init[k], 3e-3, what=k)
              for k in checked)
  print(f'parity train step: parameters differ by at most {worst:.3g} of their movement after '
        f'{steps} steps of lr {lr} ({len(checked)} tensors)')
