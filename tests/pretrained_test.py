"""Weights in: every format's reader, the strictness of loading, a checkpoint's vocabulary and
casing (bert_jax.pretrained). The round trips through the writers are convert_test.py's, on the
checkpoints made here.

The Hugging Face checkpoints are written by transformers on torch, or where torch is not
installed come from a recording (tests/torch_reference.py).
"""

import json
import os
import re
import shutil
import sys

import numpy as np
import pytest
import safetensors.numpy

from bert_jax import pretrained
from bert_jax.errors import UserError
import torch_reference

HF_CONFIG = dict(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                 intermediate_size=37, max_position_embeddings=40, type_vocab_size=2)
VOCAB = (['[PAD]'] + [f'[unused{i}]' for i in range(10)] + ['[UNK]', '[CLS]', '[SEP]', '[MASK]'] +
         [f'tok{i}' for i in range(79)] + ['##s', '##ed', '.', ',', 'the'])


def hf_model(cls_name: str, seed: int, **kwargs):
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  cls = getattr(transformers, cls_name)
  torch.manual_seed(seed)
  hf = cls(transformers.BertConfig(**HF_CONFIG, **kwargs)).eval()
  with torch.no_grad():
    for name, p in hf.named_parameters():
      noise = 0.2 * torch.randn(p.shape)
      p.copy_(1.0 + noise if name.endswith('LayerNorm.weight') else noise)
  return hf


def write_vocab(folder, tokens=VOCAB) -> str:
  path = os.path.join(folder, 'vocab.txt')
  with open(path, 'w') as f:
    f.write(''.join(t + '\n' for t in tokens))
  return path


def assert_same(a: dict, b: dict) -> None:
  """Same tree, bitwise-equal float32 arrays."""
  flat_a, flat_b = pretrained.flatten(a), pretrained.flatten(b)
  assert sorted(flat_a) == sorted(flat_b)
  for path, x in flat_a.items():
    assert x.dtype == np.float32 and flat_b[path].dtype == np.float32, path
    np.testing.assert_array_equal(x, flat_b[path], err_msg=path)


def torch_outputs(hf, seed=0) -> list[np.ndarray]:
  import torch  # pylint: disable=g-import-not-at-top
  rng = np.random.RandomState(seed)
  ids = torch.tensor(rng.randint(0, HF_CONFIG['vocab_size'], (2, 9)))
  mask = torch.tensor([[1] * 9, [1] * 6 + [0] * 3])
  segments = torch.tensor([[0] * 4 + [1] * 5, [0] * 3 + [1] * 3 + [0] * 3])
  with torch.no_grad():
    out = hf(input_ids=ids, attention_mask=mask, token_type_ids=segments)
  return [v.numpy() for v in out.values()]


@pytest.fixture(scope='module')
def hf_dir(tmp_path_factory):
  """A random BertForPreTraining saved by transformers in hf/, with a vocab.txt, and its
  state_dict saved by torch in bin/ and (the legacy format) legacy/; its outputs
  (`torch_outputs`)."""

  def make(folder):
    import torch  # pylint: disable=g-import-not-at-top
    hf = hf_model('BertForPreTraining', seed=0)
    hf.save_pretrained(os.path.join(folder, 'hf'))
    for sub, new_zipfile in (('bin', True), ('legacy', False)):
      os.makedirs(os.path.join(folder, sub))
      torch.save(hf.state_dict(), os.path.join(folder, sub, 'pytorch_model.bin'),
                 _use_new_zipfile_serialization=new_zipfile)
    return {f'output{i}': x for i, x in enumerate(torch_outputs(hf))}

  folder = tmp_path_factory.mktemp('hf')
  recorded = torch_reference.reference('convert_pretraining', folder, make)
  write_vocab(str(folder / 'hf'))
  outputs = [recorded[f'output{i}'] for i in range(len(recorded))]
  return str(folder / 'hf'), {'outputs': outputs, 'bin': str(folder / 'bin'),
                              'legacy': str(folder / 'legacy')}


@pytest.fixture(scope='module')
def reference(hf_dir):
  config, params = pretrained.load_pretrained(hf_dir[0])
  return config, params


def copy_hf(src: str, dst, tensors=None, vocab=VOCAB) -> str:
  """An HF directory with src's config and `tensors` (default: src's) as model.safetensors."""
  dst = str(dst)
  os.makedirs(dst, exist_ok=True)
  shutil.copy(os.path.join(src, 'config.json'), dst)
  if tensors is None:
    tensors = safetensors.numpy.load_file(os.path.join(src, 'model.safetensors'))
  safetensors.numpy.save_file(tensors, os.path.join(dst, 'model.safetensors'))
  if vocab is not None:
    write_vocab(dst, vocab)
  return dst


# ---- Hugging Face ----


def test_hf_import_finds_heads_and_layout(reference):
  config, params = reference
  assert config.vocab_size == 99 and config.intermediate_size == 37
  assert set(params) == {'bert', 'mlm', 'nsp'}
  expected = pretrained.expected_shapes(config)
  flat = pretrained.flatten(params)
  assert {p: x.shape for p, x in flat.items()} == {
      p: s for p, s in expected.items() if pretrained._group(p) in ('bert', 'bert/pooler', 'mlm',
                                                                 'nsp')}
  assert flat['bert/encoder/layer_1/attention/output/kernel'].shape == (4, 8, 32)


def test_hf_bert_model_without_prefix_or_heads(tmp_path):

  def make(folder):
    hf = hf_model('BertModel', seed=1)
    hf.save_pretrained(folder)
    return {'word_embeddings': hf.embeddings.word_embeddings.weight.detach().numpy(),
            'pooler': hf.pooler.dense.weight.detach().numpy()}

  theirs = torch_reference.reference('convert_bert_model', tmp_path, make)
  names = safetensors.numpy.load_file(str(tmp_path / 'model.safetensors'))
  assert 'embeddings.word_embeddings.weight' in names  # No 'bert.' prefix.
  config, loaded = pretrained.load_pretrained(str(tmp_path))
  assert set(loaded) == {'bert'}
  np.testing.assert_array_equal(loaded['bert']['embeddings']['word_embeddings']['embedding'],
                                theirs['word_embeddings'])
  np.testing.assert_array_equal(loaded['bert']['pooler']['kernel'], theirs['pooler'].T)


def test_hf_old_names_tied_decoder_and_buffers(hf_dir, reference, tmp_path):
  src, _ = hf_dir
  tensors = safetensors.numpy.load_file(os.path.join(src, 'model.safetensors'))
  old = {re.sub(r'LayerNorm\.weight$', 'LayerNorm.gamma',
                re.sub(r'LayerNorm\.bias$', 'LayerNorm.beta', k)): v for k, v in tensors.items()}
  old['bert.embeddings.position_ids'] = np.arange(40, dtype=np.int64)[None]
  old['cls.predictions.decoder.weight'] = tensors['bert.embeddings.word_embeddings.weight']
  old['cls.predictions.decoder.bias'] = tensors['cls.predictions.bias']
  _, params = pretrained.load_pretrained(copy_hf(src, tmp_path / 'old', old))
  assert_same(reference[1], params)
  old['cls.predictions.decoder.weight'] = old['cls.predictions.decoder.weight'] + 1.0
  with pytest.raises(ValueError, match=r'cls\.predictions\.decoder\.weight differs'):
    pretrained.load_pretrained(copy_hf(src, tmp_path / 'untied', old))


def test_hf_sharded_safetensors(hf_dir, reference, tmp_path):
  src, _ = hf_dir
  tensors = safetensors.numpy.load_file(os.path.join(src, 'model.safetensors'))
  shutil.copy(os.path.join(src, 'config.json'), tmp_path)
  weight_map = {}
  for i, shard in enumerate(('model-00001-of-00002.safetensors',
                             'model-00002-of-00002.safetensors')):
    part = {k: v for k, v in tensors.items() if k.startswith('cls.') == bool(i)}
    safetensors.numpy.save_file(part, str(tmp_path / shard))
    weight_map.update(dict.fromkeys(part, shard))
  with open(tmp_path / 'model.safetensors.index.json', 'w') as f:
    json.dump({'metadata': {}, 'weight_map': weight_map}, f)
  _, params = pretrained.load_pretrained(str(tmp_path))
  assert_same(reference[1], params)
  # An index cut short (a download stopped part-way): one line naming it.
  index = tmp_path / 'model.safetensors.index.json'
  index.write_text(index.read_text()[:40])
  with pytest.raises(UserError, match=rf'^{index}: not valid JSON \(.*\); download it again'):
    pretrained.load_pretrained(str(tmp_path))


def test_hf_qa_model_without_pooler(tmp_path):

  def make(folder):
    hf_model('BertForQuestionAnswering', seed=3).save_pretrained(folder)
    return {}

  torch_reference.reference('convert_qa', tmp_path, make)
  _, params = pretrained.load_pretrained(str(tmp_path))
  assert set(params) == {'bert', 'qa_outputs'}
  # HF's QA model has no pooler; ours gets a fresh (random, non-zero) one.
  assert params['bert']['pooler']['kernel'].shape == (32, 32)
  assert np.std(params['bert']['pooler']['kernel']) > 0


# ---- PyTorch files without torch ----


def test_pytorch_bin_reads_without_torch(hf_dir, reference, tmp_path, monkeypatch):
  src, recorded = hf_dir
  shutil.copy(os.path.join(src, 'config.json'), tmp_path)
  # torch.save of the state_dict: the tied decoder included.
  shutil.copy(os.path.join(recorded['bin'], 'pytorch_model.bin'), tmp_path)
  monkeypatch.setitem(sys.modules, 'torch', None)
  with pytest.raises(ImportError):
    import torch as _  # pylint: disable=g-import-not-at-top,reimported
  _, params = pretrained.load_pretrained(str(tmp_path))
  assert_same(reference[1], params)


def test_legacy_pytorch_file_needs_torch(hf_dir, reference, tmp_path, monkeypatch):
  src, recorded = hf_dir
  shutil.copy(os.path.join(src, 'config.json'), tmp_path)
  shutil.copy(os.path.join(recorded['legacy'], 'pytorch_model.bin'), tmp_path)
  if torch_reference.HAVE_TORCH:
    assert_same(reference[1], pretrained.load_pretrained(str(tmp_path))[1])
  monkeypatch.setitem(sys.modules, 'torch', None)
  with pytest.raises(ValueError, match=r'pytorch_model\.bin is a legacy.*safetensors'):
    pretrained.load_pretrained(str(tmp_path))


# ---- Casing ----


def test_lower_case_from_vocab_and_tokenizer_config(hf_dir, tmp_path):
  src = hf_dir[0]
  assert pretrained.read_metadata(src)['lower_case'] is True  # [CLS] etc. do not count.
  cased = copy_hf(src, tmp_path / 'cased', vocab=VOCAB[:-1] + ['The'])
  assert pretrained.read_metadata(cased)['lower_case'] is False
  with open(os.path.join(cased, 'tokenizer_config.json'), 'w') as f:
    json.dump({'do_lower_case': True}, f)
  assert pretrained.read_metadata(cased)['lower_case'] is True
  assert pretrained.read_metadata(copy_hf(src, tmp_path / 'novocab', vocab=None))[
      'lower_case'] is None


# ---- Errors name what to fix ----


def _broken(src: str, dst, change) -> str:
  tensors = safetensors.numpy.load_file(os.path.join(src, 'model.safetensors'))
  change(tensors)
  return copy_hf(src, dst, tensors)


@pytest.mark.parametrize('change,message', [
    (lambda t: t.pop('bert.encoder.layer.1.output.dense.bias'),
     r"model\.safetensors: missing 1 tensor.*bert\.encoder\.layer\.1\.output\.dense\.bias"),
    (lambda t: t.update({'bert.encoder.layer.2.output.dense.bias': np.zeros(32, np.float32)}),
     r"model\.safetensors: unexpected tensor.*bert\.encoder\.layer\.2\.output\.dense\.bias"),
    (lambda t: t.update({'bert.embeddings.position_embeddings.weight': np.zeros((30, 32),
                                                                               np.float32)}),
     r"model\.safetensors: tensor 'bert\.embeddings\.position_embeddings\.weight' has shape "
     r"\(30, 32\), the config needs \(40, 32\)"),
    (lambda t: t.update({'bert.embeddings.word_embeddings.weight': np.zeros((98, 32),
                                                                           np.float32)}),
     r"'bert\.embeddings\.word_embeddings\.weight' has shape \(98, 32\).*vocab_size in the "
     r"config is 99"),
    (lambda t: t.pop('cls.predictions.transform.dense.weight'),
     r"missing 1 tensor.*cls\.predictions\.transform\.dense\.weight"),
    (lambda t: t.update({'bert.pooler.dense.bias': np.zeros(32, np.int32)}),
     r"'bert\.pooler\.dense\.bias' has dtype int32"),
], ids=['missing', 'unexpected', 'shape', 'vocab_weights', 'partial_head', 'dtype'])
def test_load_errors_name_the_tensor(hf_dir, tmp_path, change, message):
  with pytest.raises(ValueError, match=message):
    pretrained.load_pretrained(_broken(hf_dir[0], tmp_path, change))


def test_vocab_file_larger_than_vocab_size(hf_dir, tmp_path):
  folder = copy_hf(hf_dir[0], tmp_path, vocab=VOCAB + ['extra'])
  with pytest.raises(ValueError, match=r'vocab\.txt has 100 tokens but vocab_size is 99'):
    pretrained.load_pretrained(folder)


def test_unknown_path_and_directory(tmp_path):
  with pytest.raises(ValueError, match='no such directory or TF checkpoint'):
    pretrained.load_pretrained(str(tmp_path / 'nope'))
  (tmp_path / 'notes.txt').write_text('hi')
  with pytest.raises(ValueError, match=r'not a checkpoint directory.*notes\.txt'):
    pretrained.load_pretrained(str(tmp_path))


def test_a_vocabulary_that_is_not_the_checkpoints_is_refused(hf_dir, tmp_path, caplog):
  """Each id of another vocabulary would look up another word's vector: features, scores and
  filled masks of garbage with exit status 0. Refused: another WordPiece vocabulary of the
  same size or smaller, a SentencePiece model; accepted: the checkpoint's own or a copy of it,
  and (a warning) a smaller one for a checkpoint with no vocab.txt to compare with."""
  from bert_jax import vocab as vocab_lib  # pylint: disable=g-import-not-at-top
  src = hf_dir[0]
  own = os.path.join(src, 'vocab.txt')
  shuffled = write_vocab(str(tmp_path), VOCAB[:15] + VOCAB[16:] + VOCAB[15:16])
  smaller = str(tmp_path / 'small' / 'vocab.txt')
  os.makedirs(os.path.dirname(smaller))
  write_vocab(os.path.dirname(smaller), VOCAB[:-5])
  spm = vocab_lib.train_sentencepiece(
      [f'tok{i} tok{i + 1} tok{i + 2} the.' for i in range(60)] * 3, str(tmp_path / 'sp'),
      vocab_size=60)
  for vocab, differs in ((shuffled, r"its token 15 is 'tok1', \S+vocab.txt's is 'tok0'"),
                         (smaller, rf'{len(VOCAB) - 5} tokens, \S+vocab.txt has {len(VOCAB)}'),
                         (spm, r"its token 1 is '\[UNK\]', \S+vocab.txt's is '\[unused0\]'")):
    with pytest.raises(UserError, match=rf'^--vocab_file={vocab} is not the vocabulary of '
                       rf'--init_checkpoint={src} \(({differs})\): each id would look up '
                       "another word's vector; leave --vocab_file empty"):
      pretrained.load_checkpoint(src, vocab, flag='--init_checkpoint')
  copy = str(tmp_path / 'copy.txt')
  shutil.copy(own, copy)
  assert pretrained.load_checkpoint(src, copy, flag='--init_checkpoint')[3] == copy
  no_vocab = copy_hf(src, tmp_path / 'no_vocab', vocab=None)
  with caplog.at_level('WARNING'):
    pretrained.load_checkpoint(no_vocab, smaller, lower_case=True, flag='--init_checkpoint')
  assert any(f'{smaller} has {len(VOCAB) - 5} tokens, --init_checkpoint={no_vocab} has '
             'vocab_size 99 and no vocab.txt' in r.getMessage() for r in caplog.records)
