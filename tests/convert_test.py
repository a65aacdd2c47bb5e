"""Weights out (bert_jax.convert): round trips through every format, on pretrained_test.py's
checkpoints (its fixtures, made again for this module).

The Hugging Face checkpoints are written by transformers on torch, or where torch is not
installed come from a recording (tests/torch_reference.py).
"""

import json
import os
import re

import jax
import numpy as np
import pytest
import safetensors.numpy
import tensorflow as tf

from bert_jax import convert
from bert_jax import model
from bert_jax import pretrained
from bert_jax.errors import UserError
import pretrained_test
import torch_reference
from pretrained_test import hf_dir, reference  # pylint: disable=unused-import  (fixtures)


# ---- Hugging Face ----


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
                    vocab_file=pretrained.find_vocab(src), lower_case=True)
  config2, params2 = pretrained.load_pretrained(out)
  assert config2 == config
  pretrained_test.assert_same(params, params2)
  # As save_pretrained: the tied decoder (weight and bias) is not stored.
  _assert_same_tensors(out, src)
  if torch_reference.HAVE_TORCH:
    import transformers  # pylint: disable=g-import-not-at-top
    reloaded, info = transformers.BertForPreTraining.from_pretrained(out,
                                                                     output_loading_info=True)
    assert not any(info.values()), info
    for ours, theirs in zip(pretrained_test.torch_outputs(reloaded.eval()), recorded['outputs']):
      np.testing.assert_array_equal(ours, theirs)
  assert open(os.path.join(out, 'vocab.txt')).read() == open(os.path.join(src, 'vocab.txt')).read()
  assert pretrained.read_metadata(out)['lower_case'] is True


def test_hf_finetuned_heads_export_and_reload(tmp_path):

  def make(folder):
    hf = pretrained_test.hf_model('BertForSequenceClassification', seed=2, num_labels=3)
    hf.save_pretrained(folder)
    return {'logits': pretrained_test.torch_outputs(hf)[0]}

  theirs = torch_reference.reference('convert_classifier', tmp_path / 'src', make)
  config, params = pretrained.load_pretrained(str(tmp_path / 'src'))
  assert set(params) == {'bert', 'classifier'}
  assert params['classifier']['kernel'].shape == (32, 3)
  convert.export_hf(config, params, str(tmp_path / 'hf'))
  _assert_same_tensors(str(tmp_path / 'hf'), str(tmp_path / 'src'))
  if torch_reference.HAVE_TORCH:
    import transformers  # pylint: disable=g-import-not-at-top
    reloaded, info = transformers.BertForSequenceClassification.from_pretrained(
        str(tmp_path / 'hf'), output_loading_info=True)
    assert not any(info.values()), info
    np.testing.assert_array_equal(pretrained_test.torch_outputs(reloaded.eval())[0],
                                  theirs['logits'])
  convert.export_google(config, params, str(tmp_path / 'google'))
  names = dict(tf.train.list_variables(str(tmp_path / 'google' / 'bert_model.ckpt')))
  assert names['output_weights'] == [3, 32]  # The original run_classifier.py's [labels, hidden].
  pretrained_test.assert_same(params, pretrained.load_pretrained(str(tmp_path / 'google'))[1])


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
  config = {k: v for k, v in pretrained_test.HF_CONFIG.items()}
  config.update(hidden_act='gelu', hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1,
                initializer_range=0.02)
  with open(tmp_path / 'bert_config.json', 'w') as f:
    json.dump(config, f)
  pretrained_test.write_vocab(str(tmp_path))
  for path in (str(tmp_path), str(tmp_path / 'bert_model.ckpt')):
    loaded_config, params = pretrained.load_pretrained(path)
    assert loaded_config == reference[0]
    pretrained_test.assert_same(reference[1], params)
  assert pretrained.find_vocab(str(tmp_path / 'bert_model.ckpt')) == str(tmp_path / 'vocab.txt')

  # Found on a remote filesystem (TF's ram:// stands in for gs://; TF's checkpoint reader
  # itself cannot read ram://, and reads gs:// on its own).
  remote = 'ram://convert_test/google'
  tf.io.gfile.makedirs(remote)
  for name in os.listdir(tmp_path):
    if os.path.isfile(tmp_path / name):
      tf.io.gfile.copy(str(tmp_path / name), f'{remote}/{name}', overwrite=True)
  assert pretrained._detect(remote + '/') == ('google', remote + '/bert_model.ckpt')
  assert pretrained._read_config(remote + '/bert_config.json') == reference[0]
  vocab = pretrained.find_vocab(remote)
  assert vocab == remote + '/vocab.txt'
  out = tmp_path / 'converted'
  out.mkdir()
  convert._copy_vocab(reference[0], vocab, str(out))
  assert (out / 'vocab.txt').read_text() == (tmp_path / 'vocab.txt').read_text()


def test_google_export_roundtrip(hf_dir, reference, tmp_path):
  config, params = reference
  out = str(tmp_path / 'google')
  convert.export_google(config, params, out, vocab_file=pretrained.find_vocab(hf_dir[0]))
  names = dict(tf.train.list_variables(os.path.join(out, 'bert_model.ckpt')))
  assert names['cls/seq_relationship/output_weights'] == [2, 32]
  assert names['bert/encoder/layer_0/attention/self/query/kernel'] == [32, 32]
  assert names['bert/encoder/layer_1/intermediate/dense/kernel'] == [32, 37]
  assert names['cls/predictions/transform/LayerNorm/gamma'] == [32]
  assert not any('decoder' in n or 'seq_relationship/kernel' in n for n in names)
  with open(os.path.join(out, 'bert_config.json')) as f:
    assert json.load(f)['intermediate_size'] == 37
  loaded_config, loaded = pretrained.load_pretrained(out)
  assert loaded_config == config
  pretrained_test.assert_same(params, loaded)


# ---- Ours, and convert() ----


def test_bert_jax_roundtrip_and_metadata(hf_dir, reference, tmp_path):
  config, params = reference
  out = str(tmp_path / 'ours')
  cased = pretrained_test.VOCAB[:-1] + ['The']
  vocab = pretrained_test.write_vocab(str(tmp_path), cased)
  convert.export_bert_jax(config, params, out, vocab_file=vocab, lower_case=False, source='test')
  meta = pretrained.read_metadata(out)
  assert meta['lower_case'] is False and meta['heads'] == ['mlm', 'nsp']
  assert meta['format'] == 'bert_jax' and meta['format_version'] == convert.FORMAT_VERSION
  scanned_config, scanned = pretrained.load_pretrained(out, scan_layers=True, dtype='bfloat16')
  assert scanned_config.scan_layers and scanned_config.dtype == 'bfloat16'
  assert scanned['bert']['encoder']['layers']['mlp']['intermediate']['kernel'].shape == (2, 32, 37)
  pretrained_test.assert_same(params, model.unstack_layers(scanned, config.num_hidden_layers))
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
  config, params = pretrained.load_pretrained(out)
  assert config == reference[0]
  pretrained_test.assert_same(reference[1], params)
  assert pretrained.find_vocab(out) and pretrained.read_metadata(out)['lower_case'] is True


def test_convert_rejects_unknown_format(hf_dir, tmp_path):
  with pytest.raises(ValueError, match='--format'):
    convert.convert(hf_dir[0], str(tmp_path / 'x'), 'onnx')


def test_export_scanned_and_jax_arrays(reference, tmp_path):
  config, params = reference
  jax_params = jax.tree.map(jax.numpy.asarray, model.stack_layers(params))
  convert.export_bert_jax(config.replace(scan_layers=True), jax_params, str(tmp_path))
  pretrained_test.assert_same(params, pretrained.load_pretrained(str(tmp_path))[1])


# ---- Errors name what to fix ----


def test_export_rejects_unknown_parameters(reference, tmp_path):
  config, params = reference
  bad = dict(params, extra={'kernel': np.zeros((2, 2), np.float32)})
  with pytest.raises(ValueError, match=r'unexpected tensor.*extra/kernel'):
    convert.export_hf(config, bad, str(tmp_path))


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
