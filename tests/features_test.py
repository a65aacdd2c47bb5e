"""bert-jax features: token features equal the encoder's hidden states, layers come out in the
order asked for, and the .npz / .npy / .jsonl layouts agree."""

import functools
import json
import os
import subprocess

import jax
import numpy as np
import pytest

from bert_jax import convert
from bert_jax import features
from bert_jax import model as model_lib
from bert_jax.errors import UserError
import processes
from tolerance import assert_close

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORDS = ['the', 'movie', 'was', 'good', 'bad', 'plot', 'an', 'awful', 'story', 'and', 'it', '.']
VOCAB = ['[PAD]', '[UNK]', '[CLS]', '[SEP]', '[MASK]'] + WORDS
# Four encoder layers, so -1..-4 are all layers and -5 is the embedding output.
CONFIG = model_lib.BertConfig(vocab_size=len(VOCAB), hidden_size=32, num_hidden_layers=4,
                              num_attention_heads=4, intermediate_size=64,
                              max_position_embeddings=64)
MAX_LEN = 12
LINES = ['the movie was good .',
         '',  # Skipped; line numbers still count it.
         'an awful plot ||| the story was bad',
         'it was good and it was good and the plot was good and the story was good']  # Cut.


@pytest.fixture(scope='module')
def setup(tmp_path_factory):
  root = tmp_path_factory.mktemp('features')
  with open(root / 'vocab.txt', 'w') as f:
    f.write('\n'.join(VOCAB) + '\n')
  params = model_lib.init_params(CONFIG, jax.random.key(0))
  # Perturbed (layer norms away from 1 and 0 too), so that neighbouring layers differ clearly.
  rng = np.random.RandomState(0)
  params = jax.tree.map(lambda x: np.asarray(x) + np.float32(0.05) * rng.randn(*x.shape).astype(
      np.float32), params)
  ckpt = str(root / 'ckpt')
  convert.export_bert_jax(CONFIG, params, ckpt, vocab_file=str(root / 'vocab.txt'),
                          lower_case=True)
  text = root / 'input.txt'
  text.write_text('\n'.join(LINES) + '\n')
  npz = str(root / 'all.npz')
  result = features.extract_features(ckpt, str(text), npz, layers=(-1, -2, -3, -4, 0),
                                     max_seq_length=MAX_LEN, batch_size=2)
  return {'ckpt': ckpt, 'input': str(text), 'root': root, 'params': params, 'result': result,
          'npz': dict(np.load(npz))}


def test_npz_tokens_shapes_and_truncation(setup):
  out, result = setup['npz'], setup['result']
  assert result['lines'] == 3 and result['truncated'] == 1
  n, t, h = 3, MAX_LEN, CONFIG.hidden_size
  assert out['features'].shape == (n, t, 5, h) and out['features'].dtype == np.float32
  assert out['cls'].shape == (n, h) and out['mean'].shape == (n, 5, h)
  assert list(out['layers']) == [-1, -2, -3, -4, 0]
  assert list(out['line_numbers']) == [1, 3, 4] and list(out['truncated']) == [0, 0, 1]
  assert list(out['lengths']) == [7, 10, MAX_LEN]
  assert list(out['tokens'][0][:7]) == ['[CLS]', 'the', 'movie', 'was', 'good', '.', '[SEP]']
  assert list(out['tokens'][0][7:]) == [''] * 5
  assert list(out['segment_ids'][1][:10]) == [0] * 5 + [1] * 5  # [CLS] a a a [SEP] b b b b [SEP]
  assert out['tokens'][2][-1] == '[SEP]'
  assert not np.any(out['features'][0, 7:])  # Zeros past each length.


def test_layers_are_the_encoders_hidden_states(setup):
  out = setup['npz']
  apply = jax.jit(functools.partial(model_lib.BertModel(CONFIG).apply, deterministic=True,
                                    return_hidden_states=True))
  _, pooled, hidden = apply({'params': setup['params']['bert']}, out['input_ids'],
                            out['input_mask'], out['segment_ids'])
  assert len(hidden) == CONFIG.num_hidden_layers + 1  # Embeddings, then layers 1..4.
  mask = out['input_mask'][:, :, None].astype(bool)
  for k, layer in enumerate([-1, -2, -3, -4, 0]):
    expected = np.where(mask, np.asarray(hidden[layer]), 0)
    # Other batch shapes than the reference's: only the order of summation differs.
    assert_close(out['features'][:, :, k], expected, 2e-6, what=f'layer {layer}')
    lengths = out['lengths'][:, None]
    assert_close(out['mean'][:, k], expected.sum(1) / lengths, 2e-6, what=f'mean {layer}')
  assert_close(out['cls'], pooled, 2e-6, what='cls')
  # Neighbouring layers really differ (the comparison above could not pass by accident).
  assert np.abs(out['features'][:, :, 0] - out['features'][:, :, 1]).max() > 0.1
  # -5 is the embedding output, as hidden_states[-5] in Python; -6 does not exist.
  assert features.resolve_layers([-5, -1, 0, 4], 4) == [0, 4, 0, 4]
  with pytest.raises(ValueError, match='-6 is out of range for a 4-layer model'):
    features.resolve_layers([-6], 4)
  # The default: the top four encoder layers, or all of a shallower model (the 2-layer smoke
  # model has no layer -4 but its embeddings).
  assert features.default_layers(12) == [-1, -2, -3, -4]
  assert features.default_layers(2) == [-1, -2]
  assert features.resolve_layers(features.default_layers(2), 2) == [2, 1]


def test_concat_order_npy_and_jsonl(setup):
  ref, root = setup['npz'], setup['root']
  npy = str(root / 'concat.npy')
  # No layers given: the last four encoder layers, as the original's default.
  result = features.extract_features(setup['ckpt'], setup['input'], npy,
                                     max_seq_length=MAX_LEN, concat=True)
  assert result['layers'] == [-1, -2, -3, -4]
  concat = np.load(npy)
  h = CONFIG.hidden_size
  assert concat.shape == (3, MAX_LEN, 4 * h)
  for k in range(4):  # [layer -1 | layer -2 | layer -3 | layer -4].
    assert_close(concat[..., k * h:(k + 1) * h], ref['features'][:, :, k], 2e-6)

  jsonl = str(root / 'per_layer.jsonl')
  features.extract_features(setup['ckpt'], setup['input'], jsonl, layers=(-2, 0),
                            max_seq_length=MAX_LEN, pooling=('mean',), decimals=5)
  with open(jsonl) as f:
    rows = [json.loads(line) for line in f]
  assert [r['line'] for r in rows] == [1, 3, 4] and [r['linex_index'] for r in rows] == [0, 1, 2]
  assert [r['truncated'] for r in rows] == [False, False, True]
  scale = np.abs(ref['features']).max()
  for i, row in enumerate(rows):
    assert 'cls' not in row
    assert [t['token'] for t in row['features']] == list(ref['tokens'][i][:ref['lengths'][i]])
    for t, token in enumerate(row['features']):
      assert [l['index'] for l in token['layers']] == [-2, 0]
      # Written with 5 decimals: rounding adds up to 5e-6.
      assert_close(token['layers'][0]['values'], ref['features'][i, t, 1], 2e-6, scale=scale,
                   plus=5e-6)
      assert_close(token['layers'][1]['values'], ref['features'][i, t, 4], 2e-6, scale=scale,
                   plus=5e-6)
    assert_close(row['mean'][1]['values'], ref['mean'][i, 4], 2e-6, scale=scale, plus=5e-6)


def test_cli_writes_concatenated_jsonl(setup):
  out = str(setup['root'] / 'cli.jsonl')
  env = processes.env(str(setup['root'] / 'jax_cache'))
  proc = subprocess.run(  # Forked (tests/forkserver.py): the command as a fresh one runs it.
      processes.python(env) + [
          '-m', 'bert_jax.cli', 'features', f'--init_checkpoint={setup["ckpt"]}',
          f'--input={setup["input"]}', f'--output={out}', '--layers=-1,-2,-3,-4', '--concat',
          f'--max_seq_length={MAX_LEN}', '--batch_size=4'],
      cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert f'Wrote features of 3 texts (layers [-1, -2, -3, -4]) to {out}; 1 truncated' in proc.stdout
  ref = setup['npz']
  with open(out) as f:
    rows = [json.loads(line) for line in f]
  assert len(rows) == 3
  first = rows[0]['features'][0]
  assert first['token'] == '[CLS]'
  # Default 6 decimals: rounding adds up to 5e-7.
  scale = np.abs(ref['features']).max()
  assert_close(first['values'], ref['features'][0, 0, :4].reshape(-1), 2e-6, scale=scale,
               plus=5e-7)
  assert_close(rows[1]['mean'], ref['mean'][1, :4].reshape(-1), 2e-6, scale=scale, plus=5e-7)
  assert_close(rows[2]['cls'], ref['cls'][2], 2e-6, scale=scale, plus=5e-7)


def test_bad_arguments(setup, tmp_path):
  ckpt, text = setup['ckpt'], setup['input']
  with pytest.raises(ValueError, match=r'must end in .jsonl, .npz or .npy'):
    features.extract_features(ckpt, text, str(tmp_path / 'out.txt'))
  with pytest.raises(ValueError, match=r'pooling \[.max.\]'):
    features.extract_features(ckpt, text, str(tmp_path / 'o.npy'), pooling=('max',),
                              max_seq_length=MAX_LEN)
  with pytest.raises(ValueError, match='-6 is out of range'):
    features.extract_features(ckpt, text, str(tmp_path / 'o.npy'), layers=(-6,),
                              max_seq_length=MAX_LEN)
  with pytest.raises(ValueError, match=r"max_seq_length=100 must be in \[3, 64\]"):
    features.extract_features(ckpt, text, str(tmp_path / 'o.npy'), max_seq_length=100)
  empty = tmp_path / 'empty.txt'
  empty.write_text('\n\n')
  with pytest.raises(ValueError, match='empty.txt: no text'):
    features.extract_features(ckpt, str(empty), str(tmp_path / 'o.npy'))
  with pytest.raises(UserError, match='--input: .*missing.txt: no such file'):
    features.extract_features(ckpt, str(tmp_path / 'missing.txt'), str(tmp_path / 'o.npy'))
