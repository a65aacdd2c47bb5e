"""`bert-jax fill-mask` against transformers' BertForMaskedLM on the same random weights (where
torch is not installed, as recorded where it is: tests/torch_reference.py)."""

import json
import os
import subprocess

import numpy as np
import pytest

from bert_jax import fill_mask
import processes
from tolerance import assert_close
import torch_reference

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB = ['[PAD]', '[UNK]', '[CLS]', '[SEP]', '[MASK]', 'the', 'capital', 'of', 'france', 'is',
         'paris', '.', 'a', 'dog', 'cat', 'sat', 'on', 'mat', 'red', '##s', 'big', 'small']
TEXTS = ['The capital of France is [MASK].', '[MASK] dog sat on a [MASK] mat.']


@pytest.fixture(scope='module')
def hf_dir(tmp_path_factory):
  """A tiny random BertForMaskedLM saved as Hugging Face does, with an uncased vocab, and
  transformers' token ids and probabilities for each of TEXTS."""

  def make(path):
    import torch  # pylint: disable=g-import-not-at-top
    import transformers  # pylint: disable=g-import-not-at-top
    config = transformers.BertConfig(vocab_size=len(VOCAB), hidden_size=32, num_hidden_layers=2,
                                     num_attention_heads=4, intermediate_size=37,
                                     max_position_embeddings=40, attn_implementation='eager')
    torch.manual_seed(0)
    model = transformers.BertForMaskedLM(config).eval()
    with torch.no_grad():
      for name, p in model.named_parameters():  # Spread the logits: no near-ties in the top k.
        noise = 0.3 * torch.randn(p.shape)
        p.copy_(1.0 + noise if name.endswith('LayerNorm.weight') else noise)
    model.save_pretrained(path)
    with open(os.path.join(path, 'vocab.txt'), 'w') as f:
      f.write('\n'.join(VOCAB) + '\n')
    with open(os.path.join(path, 'tokenizer_config.json'), 'w') as f:
      json.dump({'do_lower_case': True}, f)
    tokenizer = transformers.BertTokenizer(os.path.join(path, 'vocab.txt'), do_lower_case=True)
    outputs = {}
    for i, text in enumerate(TEXTS):
      encoded = tokenizer(text, return_tensors='pt')
      with torch.no_grad():
        outputs[f'probs{i}'] = torch.softmax(model(**encoded).logits[0], -1).numpy()
      outputs[f'ids{i}'] = encoded['input_ids'][0].numpy()
    return outputs

  path = tmp_path_factory.mktemp('hf_mlm')
  return str(path), torch_reference.reference('fill_mask', path, make)


def test_top_k_equals_transformers(hf_dir):
  path, theirs = hf_dir
  ours = fill_mask.fill_mask(path, TEXTS, top_k=5)
  for i, (text, result) in enumerate(zip(TEXTS, ours)):
    probs, ids = theirs[f'probs{i}'], theirs[f'ids{i}']
    positions = list(np.flatnonzero(ids == VOCAB.index('[MASK]')))
    assert result['text'] == text
    assert [m['position'] for m in result['masks']] == positions
    for mask, position in zip(result['masks'], positions):
      expected_ids = list(np.argsort(-probs[position])[:5])
      assert [p['token_id'] for p in mask['predictions']] == expected_ids
      assert [p['token'] for p in mask['predictions']] == [VOCAB[j] for j in expected_ids]
      assert_close([p['probability'] for p in mask['predictions']],
                   probs[position][expected_ids], 1e-5, what=text)


def test_command_prints_one_json_object_per_text_and_a_table(hf_dir):
  path, _ = hf_dir
  env = dict(os.environ, PYTHONPATH=_ROOT)
  # Forked (tests/forkserver.py): the command as a fresh one runs it.
  cmd = processes.python(env) + ['-m', 'bert_jax.cli', 'fill-mask', f'--checkpoint={path}',
                                 '--top_k=3']
  proc = subprocess.run(cmd + TEXTS, cwd=_ROOT, env=env, capture_output=True, text=True,
                        timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  lines = [json.loads(line) for line in proc.stdout.strip().splitlines()]
  expected = fill_mask.fill_mask(path, TEXTS, top_k=3)
  assert [l['text'] for l in lines] == TEXTS
  for got, want in zip(lines, expected):
    assert [[p['token'] for p in m['predictions']] for m in got['masks']] == [
        [p['token'] for p in m['predictions']] for m in want['masks']]
  table = fill_mask.format_table(expected)
  assert table.splitlines()[0] == TEXTS[0]
  assert table.splitlines()[1].startswith('  [MASK] 1: ' + expected[0]['masks'][0][
      'predictions'][0]['token'])


def test_mistakes_are_named(hf_dir, tmp_path):
  path, _ = hf_dir
  with pytest.raises(ValueError, match='has no \\[MASK\\]'):
    fill_mask.fill_mask(path, ['no mask here'])
  with pytest.raises(ValueError, match='at most 40'):
    fill_mask.fill_mask(path, [' '.join(['dog'] * 50) + ' [MASK]'])


def test_an_embedding_padded_past_the_vocabulary_shows_tokens_only(hf_dir, tmp_path):
  """A checkpoint whose embedding has rows past its vocab.txt (padded to a round size, as
  model.vocab_size allows) predicts tokens only: the rows no token has are never shown."""
  import shutil  # pylint: disable=g-import-not-at-top
  padded = str(tmp_path / 'padded')
  shutil.copytree(hf_dir[0], padded)
  with open(os.path.join(padded, 'vocab.txt'), 'w') as f:
    f.write('\n'.join(VOCAB[:-2]) + '\n')
  (result,) = fill_mask.fill_mask(padded, TEXTS[:1], top_k=len(VOCAB))
  ids = [p['token_id'] for p in result['masks'][0]['predictions']]
  assert sorted(ids) == list(range(len(VOCAB) - 2))
