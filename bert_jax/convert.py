"""Pre-trained weights out, and `bert-jax convert`: any checkpoint `pretrained.py` reads,
written as a Hugging Face folder (BERT's layout or ModernBERT's), the original Google TF
checkpoint or ours.

  hf          model.safetensors + config.json (+ vocab.txt, tokenizer_config.json): `export_hf`
  modernbert  transformers' ModernBertForMaskedLM layout (`modernbert.py`): `export_modernbert`
  google      bert_model.ckpt.{index,data-*} + bert_config.json: `export_google`
  bert_jax    bert_jax.json + bert_config.json + vocab.txt + params/ (Orbax, unscanned,
              float32): `export_bert_jax`

Names and shapes come from `pretrained.py`'s table, and every export is checked against the
config as a load is. Each exporter also writes to gs:// (`_to_any_folder`); `convert` fills its
output folder only once complete (`_staged`).
"""

import contextlib
import functools
import json
import os
import shutil
import tempfile
from typing import Callable, Iterator

from absl import logging
import jax
import numpy as np
import orbax.checkpoint as ocp
import safetensors.numpy

from bert_jax import fileio
from bert_jax import hub
from bert_jax import model
from bert_jax import modernbert
from bert_jax import pretrained
from bert_jax.errors import UserError

FORMAT_VERSION = 1
FORMATS = ('bert_jax', 'hf', 'google', 'modernbert')

# ---------------------------------------------------------------------------------------------
# Export
# ---------------------------------------------------------------------------------------------


def _export_tree(config: model.BertConfig, params: dict) -> tuple[dict, list[str]]:
  """Flat unscanned float32 numpy parameters, checked against the config, and their heads."""
  params = model.unstack_layers(params, config.num_hidden_layers)
  flat = {p: np.asarray(jax.device_get(x), np.float32)
          for p, x in pretrained.flatten(params).items()}
  tree, heads = pretrained.assemble(flat, config, 'bert_jax', 'params', init_missing_pooler=False)
  return pretrained.flatten(tree), heads


def _empty_dir(out_dir: str) -> str:
  if os.path.exists(out_dir) and (not os.path.isdir(out_dir) or os.listdir(out_dir)):
    raise UserError(f'{out_dir}: output directory exists and is not empty')
  os.makedirs(out_dir, exist_ok=True)
  return out_dir


def _to_any_folder(export: Callable[..., None]) -> Callable[..., None]:
  """An exporter that also writes to gs:// (any tf.io.gfile folder): its writers (safetensors,
  Orbax, json, TensorFlow's SaveV2) fill a local temporary folder, copied to `out_dir` whole."""

  @functools.wraps(export)
  def to_folder(config: model.BertConfig, params: dict, out_dir: str, *args, **kwargs) -> None:
    if not fileio.is_remote(out_dir):
      return export(config, params, out_dir, *args, **kwargs)
    out_dir = out_dir.rstrip('/')
    if fileio.exists(out_dir) and (not fileio.isdir(out_dir) or
                                   fileio.glob(fileio.escape_glob(out_dir) + '/*')):
      raise UserError(f'{out_dir}: output directory exists and is not empty')
    with tempfile.TemporaryDirectory() as tmp:
      export(config, params, tmp, *args, **kwargs)
      for root, _, files in os.walk(tmp):
        target = os.path.join(out_dir, os.path.relpath(root, tmp)).rstrip('.').rstrip('/')
        fileio.gfile().makedirs(target)
        for name in files:
          fileio.gfile().copy(os.path.join(root, name), os.path.join(target, name),
                              overwrite=True)

  return to_folder


def _copy_vocab(config: model.BertConfig, vocab_file: str | None, out_dir: str) -> None:
  if vocab_file:
    pretrained.check_vocab_size(config, vocab_file)
    if fileio.is_remote(vocab_file):
      fileio.gfile().copy(vocab_file, os.path.join(out_dir, 'vocab.txt'), overwrite=True)
    else:
      shutil.copyfile(vocab_file, os.path.join(out_dir, 'vocab.txt'))


def _to_source(flat: dict, fmt: str) -> dict[str, np.ndarray]:
  tensors = {}
  for path, x in flat.items():
    name, shape, transposed = pretrained.source_spec(path, x.shape, fmt)
    x = x.reshape(shape[::-1]).T if transposed else x.reshape(shape)
    tensors[name] = np.ascontiguousarray(x, np.float32)
  return tensors


@_to_any_folder
def export_hf(config: model.BertConfig, params: dict, out_dir: str,
              vocab_file: str | None = None, lower_case: bool | None = None,
              architecture: str | None = None) -> None:
  """A Hugging Face directory: model.safetensors + config.json (+ vocab.txt).

  Names are BertForPreTraining's (`bert.` and `cls.` prefixes, plus `classifier.` and
  `qa_outputs.` heads); the tied MLM decoder is left out, as `save_pretrained` does. A known
  `lower_case` also writes tokenizer_config.json. `architecture` (config.json's, for
  transformers' Auto classes) is a fine-tuning run's (its task.json says it: a classifier may be
  a sequence, token or multiple-choice one); None = the one the heads imply.
  """
  _check_paper_bert(config, 'hf')
  flat, heads = _export_tree(config, params)
  _empty_dir(out_dir)
  safetensors.numpy.save_file(_to_source(flat, 'hf'), os.path.join(out_dir, 'model.safetensors'),
                              metadata={'format': 'pt'})
  hf_config = config.to_hf_dict()
  if 'classifier' in heads:  # HF sizes its classifier from the labels.
    labels = flat['classifier/kernel'].shape[1]
    hf_config['id2label'] = {str(i): f'LABEL_{i}' for i in range(labels)}
    hf_config['label2id'] = {f'LABEL_{i}': i for i in range(labels)}
  if architecture:
    pass
  elif 'mlm' in heads:
    architecture = 'BertForPreTraining' if 'nsp' in heads else 'BertForMaskedLM'
  elif 'classifier' in heads:
    architecture = 'BertForSequenceClassification'
  elif 'qa_outputs' in heads:
    architecture = 'BertForQuestionAnswering'
  else:
    architecture = 'BertModel'
  hf_config['architectures'] = [architecture]
  with open(os.path.join(out_dir, 'config.json'), 'w') as f:
    json.dump(hf_config, f, indent=2)
    f.write('\n')
  _write_tokenizer_files(config, vocab_file, lower_case, out_dir)


def _write_tokenizer_files(config: model.BertConfig, vocab_file: str | None,
                           lower_case: bool | None, out_dir: str) -> None:
  """vocab.txt and (when the casing is known) tokenizer_config.json of a Hugging Face folder,
  BERT's layout or ModernBERT's alike."""
  _copy_vocab(config, vocab_file, out_dir)
  if lower_case is not None:
    with open(os.path.join(out_dir, 'tokenizer_config.json'), 'w') as f:
      json.dump({'do_lower_case': lower_case, 'tokenizer_class': 'BertTokenizer',
                 'model_max_length': config.max_position_embeddings}, f, indent=2)
      f.write('\n')


def _check_paper_bert(config: model.BertConfig, fmt: str) -> None:
  """The BERT formats hold the paper's architecture only."""
  if not config.is_paper_bert():
    other = ('modernbert or bert_jax' if not modernbert.mismatches(config) else 'bert_jax')
    raise UserError(f'--format={fmt} holds the paper\'s BERT, and this model has options after '
                    'it (rotary positions, a gated MLP, pre-LayerNorm, no biases, local '
                    f'attention or no token types): use --format={other}')


@_to_any_folder
def export_modernbert(config: model.BertConfig, params: dict, out_dir: str,
                      vocab_file: str | None = None, lower_case: bool | None = None) -> None:
  """transformers' ModernBertForMaskedLM layout (`modernbert.py`): model.safetensors +
  config.json (+ vocab.txt and a BertTokenizer's tokenizer_config.json). Only a model with
  ModernBERT's architecture (`modernbert.mismatches`) has one; the pooler and NSP head are
  left out."""
  modernbert.check_exportable(config)
  flat, _ = _export_tree(config, params)
  ids = {t: i for i, t in enumerate(pretrained.read_vocab(vocab_file))} if vocab_file else {}
  special = {k: ids.get(f'[{k.upper()}]', d) for k, d in (('pad', 0), ('cls', 101),
                                                          ('sep', 102))}
  _empty_dir(out_dir)
  safetensors.numpy.save_file(modernbert.to_hf(config, flat),
                              os.path.join(out_dir, 'model.safetensors'),
                              metadata={'format': 'pt'})
  with open(os.path.join(out_dir, 'config.json'), 'w') as f:
    json.dump(modernbert.hf_config(config, special), f, indent=2)
    f.write('\n')
  _write_tokenizer_files(config, vocab_file, lower_case, out_dir)


@_to_any_folder
def export_google(config: model.BertConfig, params: dict, out_dir: str,
                  vocab_file: str | None = None) -> None:
  """The original release's layout: bert_model.ckpt.{index,data-*} + bert_config.json."""
  _check_paper_bert(config, 'google')
  flat, _ = _export_tree(config, params)
  _empty_dir(out_dir)
  tensors = _to_source(flat, 'google')
  tf = fileio.tensorflow()
  names = sorted(tensors)
  with tf.device('/cpu:0'):
    tf.raw_ops.SaveV2(prefix=os.path.join(out_dir, 'bert_model.ckpt'), tensor_names=names,
                      shape_and_slices=[''] * len(names),
                      tensors=[tf.constant(tensors[n]) for n in names])
  config.write_json(os.path.join(out_dir, 'bert_config.json'))
  _copy_vocab(config, vocab_file, out_dir)


@_to_any_folder
def export_bert_jax(config: model.BertConfig, params: dict, out_dir: str,
                    vocab_file: str | None = None, lower_case: bool | None = True,
                    source: str = '') -> None:
  """Our layout: bert_jax.json + bert_config.json + vocab.txt + params/ (Orbax, unscanned)."""
  flat, heads = _export_tree(config, params)
  _empty_dir(out_dir)
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(os.path.abspath(os.path.join(out_dir, 'params')), pretrained.unflatten(flat))
  config.write_json(os.path.join(out_dir, 'bert_config.json'))
  _copy_vocab(config, vocab_file, out_dir)
  meta = {'format': 'bert_jax', 'format_version': FORMAT_VERSION, 'lower_case': lower_case,
          'heads': heads, 'source': source}
  with open(os.path.join(out_dir, 'bert_jax.json'), 'w') as f:
    json.dump(meta, f, indent=2)
    f.write('\n')


def convert(input_path: str, output_dir: str, fmt: str = 'bert_jax',
            step: int | None = None) -> None:
  """`bert-jax convert`: any readable checkpoint (`step`: that step of a training workdir) ->
  `fmt` ('bert_jax', 'hf', 'google' or
  'modernbert')."""
  if fmt not in FORMATS:
    raise UserError(f'--format={fmt!r} is not one of {FORMATS}')
  # Before reading the weights (minutes for a large model), not after.
  input_path = hub.checkpoint_folder(input_path, '--input')
  fileio.check_bucket(input_path, '--input')
  fileio.check_bucket(output_dir, '--output', write=True)
  fileio.check_output_dir(output_dir, '--output')
  if os.path.isdir(output_dir) and os.listdir(output_dir):
    raise UserError(f'--output={output_dir}: output directory exists and is not empty')
  config, params = pretrained.load_pretrained(input_path, step=step)
  vocab = pretrained.find_vocab(input_path)
  lower_case = pretrained.read_metadata(input_path).get('lower_case')
  with _staged(output_dir) as staging:
    if fmt == 'bert_jax':
      export_bert_jax(config, params, staging, vocab, lower_case=lower_case, source=input_path)
    elif fmt == 'hf':
      # A fine-tuning workdir's task.json names the transformers class of its head.
      task_json = os.path.join(input_path, 'task.json')
      architecture = (fileio.read_json(task_json).get('hf_architecture')
                      if fileio.isfile(task_json) else None)
      export_hf(config, params, staging, vocab, lower_case=lower_case,
                architecture=architecture)
    elif fmt == 'modernbert':
      export_modernbert(config, params, staging, vocab, lower_case=lower_case)
    else:
      export_google(config, params, staging, vocab)
  logging.info('Wrote %s (%s format)', output_dir, fmt)


@contextlib.contextmanager
def _staged(output_dir: str) -> Iterator[str]:
  """A folder to export into that becomes `output_dir` only once complete.

  Locally a hidden folder beside `output_dir`, renamed to it at the end: a conversion stopped
  part-way (Ctrl-C, a full disk) leaves `output_dir` as it was, so its rerun is not refused for
  a half-written folder; what a stopped one left in the hidden folder is removed by the next.
  A storage failure (a full disk) is one line naming the folder and the cause. Remote folders
  are filled from a local copy (`_to_any_folder`) and staged as they are.
  """
  if fileio.is_remote(output_dir):
    staging = output_dir
  else:
    output_dir = os.path.abspath(output_dir)
    staging = os.path.join(os.path.dirname(output_dir),
                           f'.{os.path.basename(output_dir)}.bert-jax-partial')
    shutil.rmtree(staging, ignore_errors=True)
  try:
    yield staging
    if staging != output_dir:
      if os.path.isdir(output_dir):
        os.rmdir(output_dir)  # Empty (checked before): replaced by the complete one.
      os.rename(staging, output_dir)
  except BaseException as e:
    if staging != output_dir:
      shutil.rmtree(staging, ignore_errors=True)
    cause = fileio.disk_error(e) if isinstance(e, Exception) else None
    if cause is None:
      raise
    raise UserError(f'--output={output_dir}: cannot be written ({cause}); nothing was left '
                    'there: free space (or fix its permissions) and rerun') from e
