"""Weights in and out: round trips through every format, the strictness of loading, readers.

The Hugging Face checkpoints are written by transformers on torch, or where torch is not
installed come from a recording (tests/torch_reference.py).
"""

import json
import os
import re
import shutil
import sys

import jax
import numpy as np
import pytest
import safetensors.numpy
import tensorflow as tf

from bert_jax import convert
from bert_jax import model
from bert_jax.errors import UserError
import torch_reference

HF_CONFIG = dict(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                 intermediate_size=37, max_position_embeddings=40, type_vocab_size=2)
VOCAB = (['[PAD]'] + [f'[unused{i}]' for i in range(10)] + ['[UNK]', '[CLS]', '[SEP]', '[MASK]'] +
         [f'tok{i}' for i in range(79)] + ['##s', '##ed', '.', ',', 'the'])


def _hf_model(cls_name: str, seed: int, **kwargs):
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


def _write_vocab(folder, tokens=VOCAB) -> str:
  path = os.path.join(folder, 'vocab.txt')
  with open(path, 'w') as f:
    f.write(''.join(t + '\n' for t in tokens))
  return path


def _assert_same(a: dict, b: dict) -> None:
  """Same tree, bitwise-equal float32 arrays."""
  flat_a, flat_b = convert._flatten(a), convert._flatten(b)
  assert sorted(flat_a) == sorted(flat_b)
  for path, x in flat_a.items():
    assert x.dtype == np.float32 and flat_b[path].dtype == np.float32, path
    np.testing.assert_array_equal(x, flat_b[path], err_msg=path)


def _torch_outputs(hf, seed=0) -> list[np.ndarray]:
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
  (`_torch_outputs`)."""

  def make(folder):
    import torch  # pylint: disable=g-import-not-at-top
    hf = _hf_model('BertForPreTraining', seed=0)
    hf.save_pretrained(os.path.join(folder, 'hf'))
    for sub, new_zipfile in (('bin', True), ('legacy', False)):
      os.makedirs(os.path.join(folder, sub))
      torch.save(hf.state_dict(), os.path.join(folder, sub, 'pytorch_model.bin'),
                 _use_new_zipfile_serialization=new_zipfile)
    return {f'output{i}': x for i, x in enumerate(_torch_outputs(hf))}

  folder = tmp_path_factory.mktemp('hf')
  recorded = torch_reference.reference('convert_pretraining', folder, make)
  _write_vocab(str(folder / 'hf'))
  outputs = [recorded[f'output{i}'] for i in range(len(recorded))]
  return str(folder / 'hf'), {'outputs': outputs, 'bin': str(folder / 'bin'),
                              'legacy': str(folder / 'legacy')}


@pytest.fixture(scope='module')
def reference(hf_dir):
  config, params = convert.load_pretrained(hf_dir[0])
  return config, params


def _copy_hf(src: str, dst, tensors=None, vocab=VOCAB) -> str:
  """An HF directory with src's config and `tensors` (default: src's) as model.safetensors."""
  dst = str(dst)
  os.makedirs(dst, exist_ok=True)
  shutil.copy(os.path.join(src, 'config.json'), dst)
  if tensors is None:
    tensors = safetensors.numpy.load_file(os.path.join(src, 'model.safetensors'))
  safetensors.numpy.save_file(tensors, os.path.join(dst, 'model.safetensors'))
  if vocab is not None:
    _write_vocab(dst, vocab)
  return dst


# ---- Hugging Face ----


def test_hf_import_finds_heads_and_layout(reference):
  config, params = reference
  assert config.vocab_size == 99 and config.intermediate_size == 37
  assert set(params) == {'bert', 'mlm', 'nsp'}
  expected = convert.expected_shapes(config)
  flat = convert._flatten(params)
  assert {p: x.shape for p, x in flat.items()} == {
      p: s for p, s in expected.items() if convert._group(p) in ('bert', 'bert/pooler', 'mlm',
                                                                 'nsp')}
  assert flat['bert/encoder/layer_1/attention/output/kernel'].shape == (4, 8, 32)


def _assert_same_tensors(folder: str, reference_folder: str) -> None:
  """The same model.safetensors (names, dtypes, values) and model config as transformers
  wrote: what transformers reloads from the one it reloads from the other."""
  import transformers  # pylint: disable=g-import-not-at-top  # Its configs need no torch.
  ours = safetensors.numpy.load_file(os.path.join(folder, 'model.safetensors'))
  theirs = safetensors.numpy.load_file(os.path.join(reference_folder, 'model.safetensors'))
  assert sorted(ours) == sorted(theirs)
  for name, x in theirs.items():
    assert ours[name].dtype == x.dtype, name
    np.testing.assert_array_equal(ours[name], x, err_msg=name)
  keys = ('architectures', 'vocab_size', 'hidden_size', 'num_hidden_layers',
          'num_attention_heads', 'intermediate_size', 'hidden_act', 'max_position_embeddings',
          'type_vocab_size', 'layer_norm_eps', 'id2label')
  ours, theirs = (transformers.BertConfig.from_pretrained(f).to_dict()
                  for f in (folder, reference_folder))
  assert {k: ours.get(k) for k in keys} == {k: theirs.get(k) for k in keys}


def test_hf_roundtrip_is_bitwise_and_loads_in_transformers(hf_dir, reference, tmp_path):
  """Where torch is installed, transformers loads the export and computes the original's
  outputs; elsewhere the export is checked to hold what transformers wrote, bit for bit."""
  src, recorded = hf_dir
  config, params = reference
  out = str(tmp_path / 'export')
  convert.export_hf(config, model.stack_layers(params), out,
                    vocab_file=convert.find_vocab(src), lower_case=True)
  config2, params2 = convert.load_pretrained(out)
  assert config2 == config
  _assert_same(params, params2)
  # As save_pretrained: the tied decoder (weight and bias) is not stored.
  _assert_same_tensors(out, src)
  if torch_reference.HAVE_TORCH:
    import transformers  # pylint: disable=g-import-not-at-top
    reloaded, info = transformers.BertForPreTraining.from_pretrained(out,
                                                                     output_loading_info=True)
    assert not any(info.values()), info
    for ours, theirs in zip(_torch_outputs(reloaded.eval()), recorded['outputs']):
      np.testing.assert_array_equal(ours, theirs)
  assert open(os.path.join(out, 'vocab.txt')).read() == open(os.path.join(src, 'vocab.txt')).read()
  assert convert.read_metadata(out)['lower_case'] is True


def test_hf_bert_model_without_prefix_or_heads(tmp_path):

  def make(folder):
    hf = _hf_model('BertModel', seed=1)
    hf.save_pretrained(folder)
    return {'word_embeddings': hf.embeddings.word_embeddings.weight.detach().numpy(),
            'pooler': hf.pooler.dense.weight.detach().numpy()}

  theirs = torch_reference.reference('convert_bert_model', tmp_path, make)
  names = safetensors.numpy.load_file(str(tmp_path / 'model.safetensors'))
  assert 'embeddings.word_embeddings.weight' in names  # No 'bert.' prefix.
  config, loaded = convert.load_pretrained(str(tmp_path))
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
  _, params = convert.load_pretrained(_copy_hf(src, tmp_path / 'old', old))
  _assert_same(reference[1], params)
  old['cls.predictions.decoder.weight'] = old['cls.predictions.decoder.weight'] + 1.0
  with pytest.raises(ValueError, match=r'cls\.predictions\.decoder\.weight differs'):
    convert.load_pretrained(_copy_hf(src, tmp_path / 'untied', old))


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
  _, params = convert.load_pretrained(str(tmp_path))
  _assert_same(reference[1], params)
  # An index cut short (a download stopped part-way): one line naming it.
  index = tmp_path / 'model.safetensors.index.json'
  index.write_text(index.read_text()[:40])
  with pytest.raises(UserError, match=rf'^{index}: not valid JSON \(.*\); download it again'):
    convert.load_pretrained(str(tmp_path))


def test_hf_finetuned_heads_export_and_reload(tmp_path):

  def make(folder):
    hf = _hf_model('BertForSequenceClassification', seed=2, num_labels=3)
    hf.save_pretrained(folder)
    return {'logits': _torch_outputs(hf)[0]}

  theirs = torch_reference.reference('convert_classifier', tmp_path / 'src', make)
  config, params = convert.load_pretrained(str(tmp_path / 'src'))
  assert set(params) == {'bert', 'classifier'}
  assert params['classifier']['kernel'].shape == (32, 3)
  convert.export_hf(config, params, str(tmp_path / 'hf'))
  _assert_same_tensors(str(tmp_path / 'hf'), str(tmp_path / 'src'))
  if torch_reference.HAVE_TORCH:
    import transformers  # pylint: disable=g-import-not-at-top
    reloaded, info = transformers.BertForSequenceClassification.from_pretrained(
        str(tmp_path / 'hf'), output_loading_info=True)
    assert not any(info.values()), info
    np.testing.assert_array_equal(_torch_outputs(reloaded.eval())[0], theirs['logits'])
  convert.export_google(config, params, str(tmp_path / 'google'))
  names = dict(tf.train.list_variables(str(tmp_path / 'google' / 'bert_model.ckpt')))
  assert names['output_weights'] == [3, 32]  # The original run_classifier.py's [labels, hidden].
  _assert_same(params, convert.load_pretrained(str(tmp_path / 'google'))[1])


def test_hf_qa_model_without_pooler(tmp_path):

  def make(folder):
    _hf_model('BertForQuestionAnswering', seed=3).save_pretrained(folder)
    return {}

  torch_reference.reference('convert_qa', tmp_path, make)
  _, params = convert.load_pretrained(str(tmp_path))
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
  _, params = convert.load_pretrained(str(tmp_path))
  _assert_same(reference[1], params)


def test_legacy_pytorch_file_needs_torch(hf_dir, reference, tmp_path, monkeypatch):
  src, recorded = hf_dir
  shutil.copy(os.path.join(src, 'config.json'), tmp_path)
  shutil.copy(os.path.join(recorded['legacy'], 'pytorch_model.bin'), tmp_path)
  if torch_reference.HAVE_TORCH:
    _assert_same(reference[1], convert.load_pretrained(str(tmp_path))[1])
  monkeypatch.setitem(sys.modules, 'torch', None)
  with pytest.raises(ValueError, match=r'pytorch_model\.bin is a legacy.*safetensors'):
    convert.load_pretrained(str(tmp_path))


# ---- Google TF checkpoints ----


def _google_name(hf_name: str) -> tuple[str, bool]:
  """The original release's name of an HF BertForPreTraining tensor; True: transpose it."""
  name = re.sub(r'layer/(\d+)', r'layer_\1', hf_name.replace('.', '/'))
  name = name.replace('LayerNorm/weight', 'LayerNorm/gamma').replace('LayerNorm/bias',
                                                                     'LayerNorm/beta')
  if name.startswith('cls/seq_relationship/'):
    return name.replace('/weight', '/output_weights').replace('/bias', '/output_bias'), False
  if name == 'cls/predictions/bias':
    return 'cls/predictions/output_bias', False
  if name.endswith('_embeddings/weight'):
    return name[:-len('/weight')], False
  if name.endswith('/weight'):
    return name[:-len('weight')] + 'kernel', True
  return name, False


def test_google_checkpoint_imports(hf_dir, reference, tmp_path):
  src, _ = hf_dir
  tensors = {}
  for hf_name, x in safetensors.numpy.load_file(os.path.join(src, 'model.safetensors')).items():
    name, transpose = _google_name(hf_name)
    tensors[name] = x.T if transpose else x
    tensors[f'{name}/adam_m'] = np.zeros_like(tensors[name])  # Optimizer slots: skipped.
    tensors[f'{name}/adam_v'] = np.ones_like(tensors[name])
  assert 'bert/encoder/layer_1/attention/output/dense/kernel' in tensors
  tensors['global_step'] = np.array(1000, np.int64)
  names = sorted(tensors)
  tf.raw_ops.SaveV2(prefix=str(tmp_path / 'bert_model.ckpt'), tensor_names=names,
                    shape_and_slices=[''] * len(names),
                    tensors=[tf.constant(tensors[n]) for n in names])
  config = {k: v for k, v in HF_CONFIG.items()}
  config.update(hidden_act='gelu', hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1,
                initializer_range=0.02)
  with open(tmp_path / 'bert_config.json', 'w') as f:
    json.dump(config, f)
  _write_vocab(str(tmp_path))
  for path in (str(tmp_path), str(tmp_path / 'bert_model.ckpt')):
    loaded_config, params = convert.load_pretrained(path)
    assert loaded_config == reference[0]
    _assert_same(reference[1], params)
  assert convert.find_vocab(str(tmp_path / 'bert_model.ckpt')) == str(tmp_path / 'vocab.txt')

  # Found on a remote filesystem (TF's ram:// stands in for gs://; TF's checkpoint reader
  # itself cannot read ram://, and reads gs:// on its own).
  remote = 'ram://convert_test/google'
  tf.io.gfile.makedirs(remote)
  for name in os.listdir(tmp_path):
    if os.path.isfile(tmp_path / name):
      tf.io.gfile.copy(str(tmp_path / name), f'{remote}/{name}', overwrite=True)
  assert convert._detect(remote + '/') == ('google', remote + '/bert_model.ckpt')
  assert convert._read_config(remote + '/bert_config.json') == reference[0]
  vocab = convert.find_vocab(remote)
  assert vocab == remote + '/vocab.txt'
  out = tmp_path / 'converted'
  out.mkdir()
  convert._copy_vocab(reference[0], vocab, str(out))
  assert (out / 'vocab.txt').read_text() == (tmp_path / 'vocab.txt').read_text()


def test_google_export_roundtrip(hf_dir, reference, tmp_path):
  config, params = reference
  out = str(tmp_path / 'google')
  convert.export_google(config, params, out, vocab_file=convert.find_vocab(hf_dir[0]))
  names = dict(tf.train.list_variables(os.path.join(out, 'bert_model.ckpt')))
  assert names['cls/seq_relationship/output_weights'] == [2, 32]
  assert names['bert/encoder/layer_0/attention/self/query/kernel'] == [32, 32]
  assert names['bert/encoder/layer_1/intermediate/dense/kernel'] == [32, 37]
  assert names['cls/predictions/transform/LayerNorm/gamma'] == [32]
  assert not any('decoder' in n or 'seq_relationship/kernel' in n for n in names)
  with open(os.path.join(out, 'bert_config.json')) as f:
    assert json.load(f)['intermediate_size'] == 37
  loaded_config, loaded = convert.load_pretrained(out)
  assert loaded_config == config
  _assert_same(params, loaded)


# ---- Ours, and convert() ----


def test_bert_jax_roundtrip_and_metadata(hf_dir, reference, tmp_path):
  config, params = reference
  out = str(tmp_path / 'ours')
  cased = VOCAB[:-1] + ['The']
  vocab = _write_vocab(str(tmp_path), cased)
  convert.export_bert_jax(config, params, out, vocab_file=vocab, lower_case=False, source='test')
  meta = convert.read_metadata(out)
  assert meta['lower_case'] is False and meta['heads'] == ['mlm', 'nsp']
  assert meta['format'] == 'bert_jax' and meta['format_version'] == convert.FORMAT_VERSION
  scanned_config, scanned = convert.load_pretrained(out, scan_layers=True, dtype='bfloat16')
  assert scanned_config.scan_layers and scanned_config.dtype == 'bfloat16'
  assert scanned['bert']['encoder']['layers']['mlp']['intermediate']['kernel'].shape == (2, 32, 37)
  _assert_same(params, model.unstack_layers(scanned, config.num_hidden_layers))
  with pytest.raises(ValueError, match='not empty'):
    convert.export_bert_jax(config, params, out)


@pytest.mark.parametrize('fmt', convert.FORMATS)
def test_convert(hf_dir, reference, tmp_path, fmt):
  out = str(tmp_path / fmt)
  if fmt == 'modernbert':  # The paper's BERT has no ModernBERT layout (modernbert_test.py).
    with pytest.raises(UserError, match="not ModernBERT's architecture"):
      convert.convert(hf_dir[0], out, fmt)
    return
  convert.convert(hf_dir[0], out, fmt)
  config, params = convert.load_pretrained(out)
  assert config == reference[0]
  _assert_same(reference[1], params)
  assert convert.find_vocab(out) and convert.read_metadata(out)['lower_case'] is True


def test_convert_rejects_unknown_format(hf_dir, tmp_path):
  with pytest.raises(ValueError, match='--format'):
    convert.convert(hf_dir[0], str(tmp_path / 'x'), 'onnx')


def test_lower_case_from_vocab_and_tokenizer_config(hf_dir, tmp_path):
  src = hf_dir[0]
  assert convert.read_metadata(src)['lower_case'] is True  # [CLS] etc. do not count.
  cased = _copy_hf(src, tmp_path / 'cased', vocab=VOCAB[:-1] + ['The'])
  assert convert.read_metadata(cased)['lower_case'] is False
  with open(os.path.join(cased, 'tokenizer_config.json'), 'w') as f:
    json.dump({'do_lower_case': True}, f)
  assert convert.read_metadata(cased)['lower_case'] is True
  assert convert.read_metadata(_copy_hf(src, tmp_path / 'novocab', vocab=None))[
      'lower_case'] is None


def test_export_scanned_and_jax_arrays(reference, tmp_path):
  config, params = reference
  jax_params = jax.tree.map(jax.numpy.asarray, model.stack_layers(params))
  convert.export_bert_jax(config.replace(scan_layers=True), jax_params, str(tmp_path))
  _assert_same(params, convert.load_pretrained(str(tmp_path))[1])


# ---- Errors name what to fix ----


def _broken(src: str, dst, change) -> str:
  tensors = safetensors.numpy.load_file(os.path.join(src, 'model.safetensors'))
  change(tensors)
  return _copy_hf(src, dst, tensors)


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
    convert.load_pretrained(_broken(hf_dir[0], tmp_path, change))


def test_vocab_file_larger_than_vocab_size(hf_dir, tmp_path):
  folder = _copy_hf(hf_dir[0], tmp_path, vocab=VOCAB + ['extra'])
  with pytest.raises(ValueError, match=r'vocab\.txt has 100 tokens but vocab_size is 99'):
    convert.load_pretrained(folder)


def test_unknown_path_and_directory(tmp_path):
  with pytest.raises(ValueError, match='no such directory or TF checkpoint'):
    convert.load_pretrained(str(tmp_path / 'nope'))
  (tmp_path / 'notes.txt').write_text('hi')
  with pytest.raises(ValueError, match=r'not a checkpoint directory.*notes\.txt'):
    convert.load_pretrained(str(tmp_path))


def test_export_rejects_unknown_parameters(reference, tmp_path):
  config, params = reference
  bad = dict(params, extra={'kernel': np.zeros((2, 2), np.float32)})
  with pytest.raises(ValueError, match=r'unexpected tensor.*extra/kernel'):
    convert.export_hf(config, bad, str(tmp_path))


def test_a_vocabulary_that_is_not_the_checkpoints_is_refused(hf_dir, tmp_path, caplog):
  """Each id of another vocabulary would look up another word's vector: features, scores and
  filled masks of garbage with exit status 0. Refused: another WordPiece vocabulary of the
  same size or smaller, a SentencePiece model; accepted: the checkpoint's own or a copy of it,
  and (a warning) a smaller one for a checkpoint with no vocab.txt to compare with."""
  from bert_jax import vocab as vocab_lib  # pylint: disable=g-import-not-at-top
  src = hf_dir[0]
  own = os.path.join(src, 'vocab.txt')
  shuffled = _write_vocab(str(tmp_path), VOCAB[:15] + VOCAB[16:] + VOCAB[15:16])
  smaller = str(tmp_path / 'small' / 'vocab.txt')
  os.makedirs(os.path.dirname(smaller))
  _write_vocab(os.path.dirname(smaller), VOCAB[:-5])
  spm = vocab_lib.train_sentencepiece(
      [f'tok{i} tok{i + 1} tok{i + 2} the.' for i in range(60)] * 3, str(tmp_path / 'sp'),
      vocab_size=60)
  for vocab, differs in ((shuffled, r"its token 15 is 'tok1', \S+vocab.txt's is 'tok0'"),
                         (smaller, rf'{len(VOCAB) - 5} tokens, \S+vocab.txt has {len(VOCAB)}'),
                         (spm, r"its token 1 is '\[UNK\]', \S+vocab.txt's is '\[unused0\]'")):
    with pytest.raises(UserError, match=rf'^--vocab_file={vocab} is not the vocabulary of '
                       rf'--init_checkpoint={src} \(({differs})\): each id would look up '
                       "another word's vector; leave --vocab_file empty"):
      convert.load_checkpoint(src, vocab, flag='--init_checkpoint')
  copy = str(tmp_path / 'copy.txt')
  shutil.copy(own, copy)
  assert convert.load_checkpoint(src, copy, flag='--init_checkpoint')[3] == copy
  no_vocab = _copy_hf(src, tmp_path / 'no_vocab', vocab=None)
  with caplog.at_level('WARNING'):
    convert.load_checkpoint(no_vocab, smaller, lower_case=True, flag='--init_checkpoint')
  assert any(f'{smaller} has {len(VOCAB) - 5} tokens, --init_checkpoint={no_vocab} has '
             'vocab_size 99 and no vocab.txt' in r.getMessage() for r in caplog.records)


def test_a_stopped_or_failed_conversion_leaves_the_output_as_it_was(hf_dir, tmp_path,
                                                                    monkeypatch):
  """Ctrl-C in the middle of Orbax's save (its temporary folder half written) or a full disk:
  --output is left as it was (a full disk says so in one line), so the rerun is not refused;
  what a conversion killed outright left beside it is removed by the next."""
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  out = tmp_path / 'out'
  save = ocp.StandardCheckpointer.save

  def interrupted(self, directory, *args, **kwargs):
    os.makedirs(f'{directory}.orbax-checkpoint-tmp-1234')
    raise KeyboardInterrupt

  monkeypatch.setattr(ocp.StandardCheckpointer, 'save', interrupted)
  with pytest.raises(KeyboardInterrupt):
    convert.convert(hf_dir[0], str(out), 'bert_jax')
  assert os.listdir(tmp_path) == []

  def full(self, *args, **kwargs):
    raise OSError(28, 'No space left on device')

  monkeypatch.setattr(ocp.StandardCheckpointer, 'save', full)
  out.mkdir()  # An empty --output is taken (and stays if the conversion fails).
  with pytest.raises(UserError, match=rf'^--output={out}: cannot be written \(No space left on '
                     r'device\); nothing was left there'):
    convert.convert(hf_dir[0], str(out), 'bert_jax')
  assert os.listdir(tmp_path) == ['out'] and not os.listdir(out)

  monkeypatch.setattr(ocp.StandardCheckpointer, 'save', save)
  partial = tmp_path / '.out.bert-jax-partial'  # Left by a conversion killed outright.
  (partial / 'params').mkdir(parents=True)
  convert.convert(hf_dir[0], str(out), 'bert_jax')
  assert os.listdir(tmp_path) == ['out']
  assert sorted(os.listdir(out)) == ['bert_config.json', 'bert_jax.json', 'params', 'vocab.txt']
