"""Parity with Hugging Face transformers' PyTorch BERT, through `convert.load_pretrained`.

Small random float32 models (every weight random, LayerNorm included), a batch with padding
inside it and both segments. Run with -s to see the measured differences.
"""

import os

import numpy as np
import pytest
import torch
import transformers

from bert_jax import convert
from bert_jax import model

TOLERANCE = 1e-5
HF_CONFIG = dict(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                 intermediate_size=37, max_position_embeddings=40, type_vocab_size=2,
                 hidden_act='gelu')
LENGTHS = (16, 11, 5)  # One row per length: padding inside the batch.


def _hf_model(cls, seed: int, **kwargs):
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
  return dict(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
              token_type_ids=torch.tensor(segments))


def _report(name: str, ours, theirs, valid=None) -> None:
  ours, theirs = np.asarray(ours), np.asarray(theirs)
  assert ours.shape == theirs.shape, name
  diff = np.abs(ours - theirs)
  if valid is not None:
    diff = diff[valid]
  print(f'\nparity {name}: max abs diff {diff.max():.3g} (|values| up to '
        f'{np.abs(theirs).max():.3g})')
  assert diff.max() <= TOLERANCE, name


@pytest.fixture(scope='module')
def pretraining(tmp_path_factory):
  """The HF model and its checkpoint as model.safetensors and as pytorch_model.bin."""
  hf = _hf_model(transformers.BertForPreTraining, seed=0)
  safetensors_dir = str(tmp_path_factory.mktemp('safetensors'))
  hf.save_pretrained(safetensors_dir)
  # transformers 5 writes safetensors even with safe_serialization=False: write the .bin.
  bin_dir = str(tmp_path_factory.mktemp('bin'))
  hf.config.to_json_file(os.path.join(bin_dir, 'config.json'))
  torch.save(hf.state_dict(), os.path.join(bin_dir, 'pytorch_model.bin'))
  return hf, {'safetensors': safetensors_dir, 'bin': bin_dir}


@pytest.mark.parametrize('scan_layers', [False, True], ids=['unscanned', 'scanned'])
@pytest.mark.parametrize('weights', ['safetensors', 'bin'])
def test_pretraining_parity(pretraining, weights, scan_layers):
  hf, dirs = pretraining
  config, params = convert.load_pretrained(dirs[weights], scan_layers=scan_layers)
  assert config.scan_layers == scan_layers
  assert ('layers' in params['bert']['encoder']) == scan_layers
  ids, mask, segments, positions = _batch()
  with torch.no_grad():
    out = hf(**_torch_inputs(ids, mask, segments), output_hidden_states=True)
    base = hf.bert(**_torch_inputs(ids, mask, segments))
  sequence, pooled = model.encode(config, params, ids, mask, segments)
  mlm, nsp = model.BertForPreTraining(config).apply(
      {'params': params}, ids, mask, segments, positions)
  tag = f'{weights},{"scanned" if scan_layers else "unscanned"}'
  # Padded positions are don't-care: compare the real tokens.
  _report(f'sequence_output[{tag}]', sequence, out.hidden_states[-1].numpy(), mask.astype(bool))
  np.testing.assert_array_equal(out.hidden_states[-1].numpy(), base.last_hidden_state.numpy())
  _report(f'pooled_output[{tag}]', pooled, base.pooler_output.numpy())
  mlm_ref = np.take_along_axis(out.prediction_logits.numpy(), positions[..., None], axis=1)
  _report(f'mlm_logits[{tag}]', mlm, mlm_ref)
  _report(f'nsp_logits[{tag}]', nsp, out.seq_relationship_logits.numpy())


@pytest.mark.parametrize('scan_layers', [False, True], ids=['unscanned', 'scanned'])
@pytest.mark.parametrize('head', ['sequence_classification', 'token_classification',
                                  'question_answering'])
def test_finetuning_head_parity(tmp_path, head, scan_layers):
  ids, mask, segments, _ = _batch()
  if head == 'question_answering':
    hf = _hf_model(transformers.BertForQuestionAnswering, seed=3)
    ours_cls, kwargs = model.BertForQuestionAnswering, {}
  else:
    labels = 3 if head == 'sequence_classification' else 5
    hf_cls = (transformers.BertForSequenceClassification if labels == 3 else
              transformers.BertForTokenClassification)
    hf = _hf_model(hf_cls, seed=labels, num_labels=labels)
    ours_cls = (model.BertForSequenceClassification if labels == 3 else
                model.BertForTokenClassification)
    kwargs = {'num_labels': labels}
  hf.save_pretrained(str(tmp_path))
  config, params = convert.load_pretrained(str(tmp_path), scan_layers=scan_layers)
  expected_head = 'qa_outputs' if head == 'question_answering' else 'classifier'
  assert set(params) == {'bert', expected_head}
  with torch.no_grad():
    out = hf(**_torch_inputs(ids, mask, segments))
  ours = ours_cls(config, **kwargs).apply({'params': params}, ids, mask, segments)
  tag = f'{head},{"scanned" if scan_layers else "unscanned"}'
  if head == 'question_answering':
    _report(f'start_logits[{tag}]', ours[0], out.start_logits.numpy())
    _report(f'end_logits[{tag}]', ours[1], out.end_logits.numpy())
  else:
    _report(f'logits[{tag}]', ours, out.logits.numpy())
