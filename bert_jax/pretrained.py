"""Pre-trained weights in: Hugging Face, the original Google TF checkpoints, and ours.

`load_pretrained(path)` tells the formats apart by their files:

  Hugging Face  config.json + model.safetensors or pytorch_model.bin (or the *.index.json of a
                sharded one): BertModel, BertForPreTraining, BertForMaskedLM and the fine-tuning
                classes. The files are read by `tensor_files.py` (PyTorch's without torch, by an
                unpickler that rebuilds tensors and refuses everything else).
  Google        bert_config.json + a name-based TF checkpoint (bert_model.ckpt.{index,data-*}),
                given as its directory or its prefix. Optimizer slots are skipped.
  bert_jax      bert_jax.json + bert_config.json + vocab.txt + params/ (Orbax, unscanned,
                float32), written by `convert.export_bert_jax`.
  workdir       a training directory with checkpoints/: `run_files.load_pretrained_from_workdir`.

Every function here that takes a checkpoint's path also takes a Hub name,
hf://ORG/NAME[@REVISION] (`hub.checkpoint_folder`: fetched into the Hugging Face cache).

Loading is strict. The config fixes every shape (`jax.eval_shape` of the model) and a missing,
unexpected or misshapen tensor is an error naming it and its file. Heads (`mlm`, `nsp`,
`classifier`, `qa_outputs`) are optional, each as a whole. A checkpoint without a pooler (HF's
token-classification and QA models drop it) gets a freshly initialized one, with a warning.

A checkpoint's vocabulary and casing are read here too (`find_vocab`, `read_metadata`,
`check_vocab`, `check_casing`), and `load_checkpoint` gives a command that feeds text to a
checkpoint all it needs. Writing the formats is `convert.py`'s, which shares the name table.

The three layouts' names come from one table (`_names`); kernels are [in, out] here and in TF,
[out, in] in PyTorch and in the original's `output_weights`.
"""

import functools
import json
import math
import os
import re
from typing import Any

from absl import logging
import jax
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp

from bert_jax import fileio
from bert_jax import hub
from bert_jax import model
from bert_jax import modernbert
from bert_jax import objectives
from bert_jax import tasks
from bert_jax import tensor_files
from bert_jax.errors import UserError

# ---------------------------------------------------------------------------------------------
# Names: our parameter paths -> Hugging Face and Google names
# ---------------------------------------------------------------------------------------------

# Module of each encoder layer: ours -> (Hugging Face, Google).
_LAYER_MODULES = {
    'attention/query': ('attention.self.query', 'attention/self/query'),
    'attention/key': ('attention.self.key', 'attention/self/key'),
    'attention/value': ('attention.self.value', 'attention/self/value'),
    'attention/output': ('attention.output.dense', 'attention/output/dense'),
    'attention_layer_norm': ('attention.output.LayerNorm', 'attention/output/LayerNorm'),
    'mlp/intermediate': ('intermediate.dense', 'intermediate/dense'),
    'mlp/output': ('output.dense', 'output/dense'),
    'output_layer_norm': ('output.LayerNorm', 'output/LayerNorm'),
}
_MODULES = {
    'bert/embeddings/word_embeddings': ('bert.embeddings.word_embeddings',
                                        'bert/embeddings/word_embeddings'),
    'bert/embeddings/position_embeddings': ('bert.embeddings.position_embeddings',
                                            'bert/embeddings/position_embeddings'),
    'bert/embeddings/token_type_embeddings': ('bert.embeddings.token_type_embeddings',
                                              'bert/embeddings/token_type_embeddings'),
    'bert/embeddings/layer_norm': ('bert.embeddings.LayerNorm', 'bert/embeddings/LayerNorm'),
    'bert/pooler': ('bert.pooler.dense', 'bert/pooler/dense'),
    # The heads: pre-training's (objectives.py) and fine-tuning's (tasks.py) say their names.
    **objectives.HEAD_NAMES,
    **tasks.HEAD_NAMES,
}
# The heads a checkpoint may hold, each as a whole.
HEADS = tuple(name for name in {**objectives.HEAD_NAMES, **tasks.HEAD_NAMES} if '/' not in name)
# Output layers the original stores as `output_weights` [out, in] and `output_bias`.
_TF_OUTPUT_LAYERS = ('nsp', 'classifier', 'qa_outputs')

# Google checkpoint variables that are not weights: optimizer slots and bookkeeping.
_TF_IGNORED = re.compile(r'.*/(adam_m|adam_v|Adam|Adam_1|Momentum)|global_step|beta[12]_power|'
                         r'.*loss_scale.*|good_steps')


def _names(path: str) -> tuple[str, str, bool]:
  """(Hugging Face name, Google name, Google stores it [out, in]) of our parameter `path`."""
  module, leaf = path.rsplit('/', 1)
  layer = re.fullmatch(r'bert/encoder/layer_(\d+)/(.+)', module)
  if layer:
    hf, tf = _LAYER_MODULES[layer[2]]
    hf, tf = f'bert.encoder.layer.{layer[1]}.{hf}', f'bert/encoder/layer_{layer[1]}/{tf}'
  else:
    hf, tf = _MODULES[module]
  hf_name = f'{hf}.{"bias" if leaf in ("bias", "output_bias") else "weight"}'
  if leaf == 'embedding':
    tf_name = tf
  elif module in _TF_OUTPUT_LAYERS or leaf == 'output_bias':
    tf_name = f'{tf}/output_weights' if leaf == 'kernel' else f'{tf}/output_bias'
  elif tf.endswith('LayerNorm'):
    tf_name = f'{tf}/gamma' if leaf == 'scale' else f'{tf}/beta'
  else:
    tf_name = f'{tf}/{leaf}'
  return hf_name, tf_name.lstrip('/'), module in _TF_OUTPUT_LAYERS and leaf == 'kernel'


def source_spec(path: str, shape: tuple[int, ...], fmt: str) -> tuple[str, tuple, bool]:
  """(name, shape, stored [out, in]) of our `path` of `shape` in a 'hf'|'google'|'bert_jax' file."""
  if fmt == 'bert_jax':
    return path, tuple(shape), False
  hf_name, tf_name, tf_transposed = _names(path)
  is_kernel = path.endswith('/kernel')
  name, transposed = (hf_name, is_kernel) if fmt == 'hf' else (tf_name, tf_transposed)
  if is_kernel:
    # Attention output kernels take two input axes [heads, kv]; all others one.
    n_in = 2 if path.endswith('attention/output/kernel') else 1
    fan_in, fan_out = math.prod(shape[:n_in]), math.prod(shape[n_in:])
    return name, (fan_out, fan_in) if transposed else (fan_in, fan_out), transposed
  # Embeddings are [rows, hidden] everywhere; biases and LayerNorm vectors are flat.
  return name, tuple(shape) if path.endswith('/embedding') else (math.prod(shape),), False


def _group(path: str) -> str:
  """What a parameter belongs to: 'bert', 'bert/pooler' or a head."""
  return 'bert/pooler' if path.startswith('bert/pooler/') else path.split('/', 1)[0]


def flatten(tree: dict, prefix: str = '') -> dict[str, object]:
  """{'a/b/c': leaf} of a nested dict (our parameter paths)."""
  out = {}
  for k, v in tree.items():
    if isinstance(v, dict):
      out.update(flatten(v, f'{prefix}{k}/'))
    else:
      out[f'{prefix}{k}'] = v
  return out


def unflatten(flat: dict[str, object]) -> dict:
  """The nested dict of `flatten`'s {'a/b/c': leaf}."""
  tree = {}
  for path, v in flat.items():
    *parents, leaf = path.split('/')
    node = tree
    for p in parents:
      node = node.setdefault(p, {})
    node[leaf] = v
  return tree


# ---------------------------------------------------------------------------------------------
# Matching tensors against the parameter tree the config implies
# ---------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=8)
def expected_shapes(config: model.BertConfig, num_labels: int | None = None) -> dict:
  """{path: shape} of every parameter BERT with all heads has under `config` (unscanned)."""
  config = config.replace(scan_layers=False, remat_policy='none', dtype='float32',
                          attention_impl='xla', layer_norm_impl='xla', gelu_impl='xla',
                          matmul_precision='default')

  def shapes(model_cls, **kwargs):
    tree = jax.eval_shape(
        lambda: model.init_params(config, jax.random.key(0), model_cls, **kwargs))
    return {p: tuple(x.shape) for p, x in flatten(tree).items()}

  out = shapes(model.BertForPreTraining)
  out.update((p, s) for p, s in shapes(model.BertForQuestionAnswering).items()
             if _group(p) == 'qa_outputs')
  if num_labels:
    out.update((p, s) for p, s in shapes(model.BertForSequenceClassification,
                                         num_labels=num_labels).items()
               if _group(p) == 'classifier')
  return out


def assemble(tensors: dict, config: model.BertConfig, fmt: str, source: str,
              init_missing_pooler: bool = True) -> tuple[dict, list[str]]:
  """Our (unscanned, float32) parameter tree and the heads found, from a `fmt` checkpoint."""
  num_labels = None
  name, _, transposed = source_spec('classifier/kernel', (config.hidden_size, 1), fmt)
  if name in tensors and np.ndim(tensors[name]) == 2:
    num_labels = int(np.shape(tensors[name])[0 if transposed else 1])
  shapes = expected_shapes(config, num_labels)
  specs = {p: source_spec(p, s, fmt) for p, s in shapes.items()}
  present = {_group(p) for p, (name, _, _) in specs.items() if name in tensors}
  if 'bert' not in present:
    raise UserError(f'{source}: no BERT encoder tensors (such as '
                    f'{specs["bert/embeddings/word_embeddings/embedding"][0]!r}); it holds '
                    f'{tensor_files.preview(tensors) or "nothing"}')
  wanted = {p: spec for p, spec in specs.items() if _group(p) in present}
  missing = [name for name, _, _ in wanted.values() if name not in tensors]
  if missing:
    raise UserError(f'{source}: missing {len(missing)} tensor(s) that the config needs: '
                    f'{tensor_files.preview(missing)}')
  unexpected = set(tensors) - {name for name, _, _ in wanted.values()}
  if unexpected:
    raise UserError(f'{source}: unexpected tensor(s) {tensor_files.preview(unexpected)}; not '
                    f'part of BERT or of its heads {HEADS}')
  flat = {}
  for path, (name, shape, transposed) in wanted.items():
    x = np.asarray(tensors[name])
    if x.shape != shape:
      hint = ''
      if path in ('bert/embeddings/word_embeddings/embedding', 'mlm/output_bias'):
        hint = f' (vocab_size in the config is {config.vocab_size}, the weights have {x.shape[0]})'
      raise UserError(f'{source}: tensor {name!r} has shape {x.shape}, the config needs '
                      f'{shape}{hint}')
    if x.dtype.kind != 'f' and x.dtype != ml_dtypes.bfloat16:
      raise UserError(f'{source}: tensor {name!r} has dtype {x.dtype}, not floating point')
    x = x.astype(np.float32)
    flat[path] = np.ascontiguousarray((x.T if transposed else x).reshape(shapes[path]))
  if 'bert/pooler' not in present:
    if not init_missing_pooler:
      raise UserError(f'{source}: no pooler ({specs["bert/pooler/kernel"][0]!r})')
    logging.warning('%s has no pooler; initializing it randomly (HF token-classification and '
                    'QA models save none)', source)
    shape = shapes['bert/pooler/kernel']
    init = jax.nn.initializers.truncated_normal(config.initializer_range)
    flat['bert/pooler/kernel'] = np.asarray(init(jax.random.key(0), shape), np.float32)
    flat['bert/pooler/bias'] = np.zeros(shape[-1:], np.float32)
  heads = [h for h in HEADS if h in present]
  return unflatten(flat), heads


# ---------------------------------------------------------------------------------------------
# Readers
# ---------------------------------------------------------------------------------------------

# Hugging Face weight files, by preference.
_HF_WEIGHTS = (('model.safetensors', tensor_files.read_safetensors, False),
               ('model.safetensors.index.json', tensor_files.read_safetensors, True),
               ('pytorch_model.bin', tensor_files.read_torch, False),
               ('pytorch_model.bin.index.json', tensor_files.read_torch, True))


def _hf_weights_file(path: str) -> str | None:
  for name, _, _ in _HF_WEIGHTS:
    if os.path.exists(os.path.join(path, name)):
      return os.path.join(path, name)
  return None


def _read_hf_files(path: str) -> tuple[dict[str, np.ndarray], str]:
  """(tensors as a Hugging Face directory names them, the file they came from)."""
  for name, read, sharded in _HF_WEIGHTS:
    file = os.path.join(path, name)
    if os.path.exists(file):
      return (tensor_files.read_sharded(file, read) if sharded else read(file)), file
  raise UserError(f'{path}: no {" or ".join(n for n, _, _ in _HF_WEIGHTS)}')


def _read_hf(path: str) -> tuple[dict[str, np.ndarray], str]:
  """(tensors under canonical BertForPreTraining names, the file they came from)."""
  raw, file = _read_hf_files(path)
  tensors = {}
  for name, x in raw.items():
    if name.endswith('embeddings.position_ids'):  # A buffer (arange), not a weight.
      continue
    canonical = name
    if canonical.startswith(('embeddings.', 'encoder.', 'pooler.')):
      canonical = 'bert.' + canonical  # BertModel saves without the prefix.
    canonical = re.sub(r'LayerNorm\.gamma$', 'LayerNorm.weight', canonical)
    canonical = re.sub(r'LayerNorm\.beta$', 'LayerNorm.bias', canonical)
    if canonical in tensors:
      raise UserError(f'{file}: {name!r} appears twice (with and without a prefix or as '
                      'gamma/beta and weight/bias)')
    tensors[canonical] = x
  # The MLM decoder is tied to the word embeddings (and its bias to cls.predictions.bias):
  # HF usually leaves it out; when present it must be a copy.
  decoder = tensors.pop('cls.predictions.decoder.weight', None)
  embeddings = tensors.get('bert.embeddings.word_embeddings.weight')
  if decoder is not None and (embeddings is None or decoder.shape != embeddings.shape or
                              not np.array_equal(decoder, embeddings)):
    raise UserError(f'{file}: cls.predictions.decoder.weight differs from '
                    'bert.embeddings.word_embeddings.weight; this BERT ties them')
  decoder_bias = tensors.pop('cls.predictions.decoder.bias', None)
  if decoder_bias is not None:
    bias = tensors.setdefault('cls.predictions.bias', decoder_bias)
    if bias.shape != decoder_bias.shape or not np.array_equal(bias, decoder_bias):
      raise UserError(f'{file}: cls.predictions.decoder.bias differs from '
                      'cls.predictions.bias; HF ties them')
  return tensors, file


def _read_google(prefix: str) -> dict[str, np.ndarray]:
  tf = fileio.tensorflow()
  try:
    reader = tf.train.load_checkpoint(prefix)
  except Exception as e:  # TF raises several types for a bad or missing checkpoint.
    raise UserError(f'{prefix}: cannot read TF checkpoint: {e}') from e
  names = sorted(reader.get_variable_to_shape_map())
  if any('.ATTRIBUTES' in n for n in names):
    raise UserError(f'{prefix}: an object-based (TF2 / Model Garden) checkpoint; only the '
                    "original name-based BERT checkpoints ('bert/encoder/...') are supported")
  ignored = [n for n in names if _TF_IGNORED.fullmatch(n)]
  logging.debug('%s: ignoring %d non-weight variables: %s', prefix, len(ignored), ignored)
  return {n: np.asarray(reader.get_tensor(n)) for n in names if not _TF_IGNORED.fullmatch(n)}


def _google_prefix(path: str) -> str | None:
  """The checkpoint prefix in directory `path`, None if it holds no TF checkpoint."""
  if fileio.exists(os.path.join(path, 'bert_model.ckpt.index')):
    return os.path.join(path, 'bert_model.ckpt')
  state = os.path.join(path, 'checkpoint')
  if fileio.exists(state):
    latest = re.search(r'^model_checkpoint_path:\s*"(.+)"', fileio.read_user_text(state), re.M)
    if latest:
      return os.path.join(path, latest[1])
  indexes = fileio.glob(os.path.join(fileio.escape_glob(path), '*.index'))
  if len(indexes) > 1:
    names = tensor_files.preview(map(os.path.basename, indexes))
    raise UserError(f'{path}: several TF checkpoints ({names}); pass the prefix of one')
  return indexes[0][:-len('.index')] if indexes else None


def _read_json(path: str) -> Any:
  """A JSON file of a checkpoint; damage (not UTF-8, not JSON) is a UserError naming it."""
  try:
    return json.loads(fileio.read_user_text(path))
  except json.JSONDecodeError as e:
    raise UserError(f'{path}: not valid JSON: {e}') from e


def _read_config(path: str) -> model.BertConfig:
  if not fileio.exists(path):
    raise UserError(f'{path}: no such config file')
  d = _read_json(path)
  if not isinstance(d, dict):
    raise UserError(f'{path}: expected a JSON object of BERT config fields')
  # HF configs carry their own `dtype` (and could carry others): how to run is ours to say.
  run_fields = ('dtype', 'scan_layers', 'remat_policy', 'attention_impl', 'layer_norm_impl',
                'gelu_impl', 'matmul_precision')
  return model.BertConfig.from_dict({k: v for k, v in d.items() if k not in run_fields},
                                    source=path)


def _read_bert_jax(path: str) -> dict[str, np.ndarray]:
  params_dir = fileio.workdir_path(os.path.join(path, 'params'))
  if not fileio.isdir(params_dir):
    raise UserError(f'{path}: no params/ directory')
  with ocp.StandardCheckpointer() as checkpointer:
    try:
      tree = checkpointer.restore(params_dir)
    except (KeyError, FileNotFoundError, ValueError) as e:
      raise UserError(f'{params_dir}: damaged or incomplete checkpoint ({e})') from e
  return {p: np.asarray(x) for p, x in flatten(tree).items()}


# ---------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------


def _detect(path: str) -> tuple[str, str]:
  """(format, where): 'workdir' | 'bert_jax' | 'hf' | 'modernbert' (directories) or 'google'
  (a prefix).

  Training workdirs, Google checkpoints and bert_jax exports may be remote (gs://...); Hugging
  Face directories must be local.
  """
  path = path.rstrip('/') if fileio.is_remote(path) else path
  if fileio.isdir(path):
    fileio.check_readable_dir(path)
    if fileio.isdir(os.path.join(path, 'checkpoints')):
      return 'workdir', path
    if fileio.is_remote(path):
      if fileio.exists(os.path.join(path, 'bert_jax.json')):
        return 'bert_jax', path
      prefix = _google_prefix(path)
      if prefix:
        return 'google', prefix
      raise UserError(f'{path}: neither a training workdir (checkpoints/) nor a Google TF '
                      'checkpoint; copy other checkpoints to a local directory first '
                      '(gsutil -m cp -r)')
    if os.path.exists(os.path.join(path, 'bert_jax.json')):
      return 'bert_jax', path
    if os.path.exists(os.path.join(path, 'config.json')) and _hf_weights_file(path):
      hf = _read_json(os.path.join(path, 'config.json'))
      modern = isinstance(hf, dict) and hf.get('model_type') == modernbert.MODEL_TYPE
      return ('modernbert' if modern else 'hf'), path
    prefix = _google_prefix(path)
    if prefix:
      return 'google', prefix
    raise UserError(
        f'{path}: not a checkpoint directory; expected bert_jax.json + params/ (bert_jax), '
        'config.json + model.safetensors or pytorch_model.bin (Hugging Face), bert_config.json + '
        f'bert_model.ckpt.index (Google) or checkpoints/ (a training workdir); it holds '
        f'{tensor_files.preview(os.listdir(path)) or "nothing"}')
  prefix = path[:-len('.index')] if path.endswith('.index') else path
  if fileio.exists(prefix + '.index'):
    return 'google', prefix
  if fileio.exists(path):
    raise UserError(f'{path} is a file, not a checkpoint: name a checkpoint directory, a '
                    'training workdir or a TF checkpoint prefix (bert_model.ckpt)')
  raise UserError(f'{path}: no such directory or TF checkpoint ({prefix}.index)')


def find_vocab(path: str) -> str | None:
  """The vocab.txt belonging to a checkpoint directory or TF checkpoint prefix, if any."""
  path = hub.checkpoint_folder(path, 'checkpoint')
  folder = path if fileio.isdir(path) else os.path.dirname(path)
  vocab = os.path.join(folder, 'vocab.txt')
  return vocab if fileio.exists(vocab) and not fileio.isdir(vocab) else None


def read_vocab(vocab_file: str) -> list[str]:
  """The tokens of a vocab.txt, one a line."""
  # One token per '\n'-terminated line; str.splitlines would also split on \x85 and \u2028.
  lines = fileio.read_user_text(vocab_file).split('\n')
  if lines and not lines[-1]:
    lines.pop()
  return [line.strip() for line in lines]


def check_vocab_size(config: model.BertConfig, vocab_file: str) -> None:
  """Refuses a vocabulary with more tokens than the embedding has rows."""
  size = len(read_vocab(vocab_file))
  if size > config.vocab_size:
    raise UserError(f'{vocab_file} has {size} tokens but vocab_size is {config.vocab_size}: '
                    'the tokenizer would produce ids the embeddings do not have')
  if size < config.vocab_size:
    # Not an error: vocabularies padded to a multiple of 8 (NVIDIA's BERT) look like this.
    logging.warning('%s has %d tokens, fewer than vocab_size %d', vocab_file, size,
                    config.vocab_size)


# A vocabulary is called cased when at least this share of its word pieces with letters hold a
# letter that lower-casing changes. Uncased vocabularies were built from lower-cased text, yet
# Google's holds a few pieces like 'ℝ' and '##ℝ' (upper-case letters without a lower-case form);
# cased ones have thousands of capitalised words (about a fifth of their pieces).
CASED_SHARE = 0.01


def guess_lower_case(vocab_file: str) -> bool:
  """True when the word pieces of `vocab_file` say it is uncased: fewer than CASED_SHARE of
  those with letters (special tokens like [CLS] and <s> aside) change under lower-casing."""
  lettered = cased = 0
  for token in read_vocab(vocab_file):
    if token[:1] + token[-1:] in ('[]', '<>'):
      continue
    piece = token[2:] if token.startswith('##') else token
    if any(c.isalpha() for c in piece):
      lettered += 1
      cased += piece.lower() != piece
  return cased < CASED_SHARE * max(lettered, 1)


def _recorded_lower_case(fmt: str, folder: str) -> tuple[bool | None, str]:
  """(lower_case, the file and key that say it) from a checkpoint's own record, if any: a
  tokenizer_config.json's do_lower_case (Hugging Face, fine-tuning workdirs), else a training
  workdir's config.json data.lower_case (what its vocabulary was used with)."""
  tokenizer_config = os.path.join(folder, 'tokenizer_config.json')
  if fileio.exists(tokenizer_config):
    value = _read_json(tokenizer_config)
    value = value.get('do_lower_case') if isinstance(value, dict) else None
    if value is not None:
      return bool(value), f'{tokenizer_config} do_lower_case'
  run_config = os.path.join(folder, 'config.json')
  if fmt == 'workdir' and fileio.exists(run_config):
    data = _read_json(run_config)
    data = data.get('data') if isinstance(data, dict) else None
    value = data.get('lower_case') if isinstance(data, dict) else None
    if value is not None:
      return bool(value), f'{run_config} data.lower_case'
  return None, ''


def read_metadata(path: str) -> dict:
  """What a checkpoint says about itself: format, source, lower_case (+ heads for bert_jax).

  `source` is `path`, or for bert_jax where the weights were converted from.

  `lower_case` comes from the checkpoint's own record: bert_jax.json, a tokenizer_config.json
  (`do_lower_case`; Hugging Face and fine-tuning workdirs) or a training workdir's config.json
  (`data.lower_case`); only without one is it guessed from vocab.txt (`guess_lower_case`);
  None when there is no vocabulary at all. `lower_case_from` says which.
  """
  path = hub.checkpoint_folder(path, 'checkpoint')
  fmt, where = _detect(path)
  folder = path if fileio.isdir(path) else os.path.dirname(where)
  meta = {'format': fmt, 'source': path}
  if fmt == 'bert_jax':
    meta.update(_read_json(os.path.join(path, 'bert_jax.json')))
    meta['lower_case_from'] = os.path.join(path, 'bert_jax.json')
    return meta
  lower_case, source = _recorded_lower_case(fmt, folder)
  if lower_case is None:
    vocab = find_vocab(path)
    lower_case = guess_lower_case(vocab) if vocab else None
    source = f'guessed from the word pieces of {vocab}' if vocab else ''
  meta['lower_case'] = lower_case
  meta['lower_case_from'] = source
  return meta


def check_casing(path: str, lower_case: bool, flag: str) -> None:
  """Refuses to feed the checkpoint `path` text cased otherwise than its record says it was
  trained on (data.lower_case of pre-training and `bert-jax eval`, which default to uncased):
  every capitalised word piece would be out of reach, without a word. A guess from its
  vocabulary that disagrees is a warning."""
  path = hub.checkpoint_folder(path, flag)
  meta = read_metadata(path)
  recorded = meta.get('lower_case')
  if recorded is None or bool(recorded) == bool(lower_case):
    return
  said = f'{"uncased" if recorded else "cased"} ({meta.get("lower_case_from")})'
  if str(meta.get('lower_case_from', '')).startswith('guessed'):
    logging.warning('%s=%s looks %s, but data.lower_case=%s', flag, path, said, lower_case)
    return
  raise UserError(f'{flag}={path} is {said}, but data.lower_case={lower_case}: set '
                  f'--config.data.lower_case={bool(recorded)}')


def load_pretrained(path: str, *, dtype: str = 'float32', scan_layers: bool = False,
                    step: int | None = None) -> tuple[model.BertConfig, dict]:
  """(config, params) of any checkpoint format above; params are numpy float32.

  `params` holds 'bert' and whichever of 'mlm', 'nsp', 'classifier', 'qa_outputs' the
  checkpoint has, in the layout `scan_layers` asks for; `dtype` is the compute dtype set in the
  returned config (parameters stay float32). `step`: that step of a training workdir (default:
  its latest).
  """
  path = hub.checkpoint_folder(path, 'checkpoint')
  fmt, where = _detect(path)
  if step is not None and fmt != 'workdir':
    raise UserError(f'{path}: a step ({step}) names a checkpoint of a training workdir; this is '
                    f'a {fmt} checkpoint')
  if fmt == 'workdir':
    # Lazy: reading a workdir brings in Orbax.
    from bert_jax import run_files  # pylint: disable=g-import-not-at-top
    config, params = run_files.load_pretrained_from_workdir(path, step)
  elif fmt == 'modernbert':
    config = modernbert.config_from_hf(_read_json(os.path.join(where, 'config.json')),
                                       os.path.join(where, 'config.json'))
    raw, source = _read_hf_files(where)
    params, heads = assemble(modernbert.from_hf(config, raw, source), config, 'bert_jax',
                              source)
    logging.info('Loaded %s (ModernBERT layout): heads %s', path, ', '.join(heads) or 'none')
  else:
    folder = os.path.dirname(where) if fmt == 'google' else where
    config = _read_config(
        os.path.join(folder, 'config.json' if fmt == 'hf' else 'bert_config.json'))
    if fmt == 'hf':
      tensors, source = _read_hf(folder)
    elif fmt == 'google':
      tensors, source = _read_google(where), where
    else:
      tensors, source = _read_bert_jax(folder), os.path.join(folder, 'params')
    params, heads = assemble(tensors, config, fmt, source)
    vocab = find_vocab(path)
    if vocab:
      check_vocab_size(config, vocab)
    logging.info('Loaded %s (%s format): heads %s', path, fmt, ', '.join(heads) or 'none')
  config = config.replace(dtype=dtype, scan_layers=scan_layers)
  return config, model.match_layout(config, params)


def check_vocab(path: str, vocab_file: str, tokens: list[str], config: model.BertConfig,
                flag: str, vocab_flag: str) -> None:
  """Refuses a vocabulary `vocab_file` (its `tokens`, as the tokenizer reads them) that does not
  belong to the checkpoint `path`: one with more tokens than the word embedding has rows (ids
  the model cannot embed), or other tokens than the checkpoint's own vocab.txt (each id would
  fetch another word's vector: wrong features, scores of garbage, without a word). A vocabulary
  smaller than the embedding, for a checkpoint with no vocab.txt to compare with, is a warning
  (an embedding padded to a round size is one too)."""
  if len(tokens) > config.vocab_size:
    raise UserError(
        f'{vocab_file} has {len(tokens)} tokens but {flag}={path} has vocab_size '
        f'{config.vocab_size} (bert/embeddings/word_embeddings/embedding is '
        f'[{config.vocab_size}, {config.hidden_size}]): use the vocabulary the '
        'checkpoint was trained with')
  own = find_vocab(path)
  if own is None:
    if len(tokens) < config.vocab_size:
      logging.warning('%s has %d tokens, %s=%s has vocab_size %d and no vocab.txt to compare '
                      'with: make sure it is the vocabulary the checkpoint was trained with',
                      vocab_file, len(tokens), flag, path, config.vocab_size)
    return
  differs = vocab_differs(own, vocab_file, tokens)
  if differs is not None:
    raise UserError(f'{vocab_flag}={vocab_file} is not the vocabulary of {flag}={path} '
                    f'({differs}): each id would look up another word\'s vector; leave '
                    f'{vocab_flag} empty to use the checkpoint\'s')


def vocab_differs(own: str, vocab_file: str, tokens: list[str]) -> str | None:
  """None if `vocab_file` (its `tokens` as the tokenizer reads them) is the vocabulary `own` (a
  checkpoint's or a workdir's vocab.txt): the same file, a copy, or the same tokens in the same
  order; else where they differ, for a message."""
  if fileio.same_path(own, vocab_file):
    return None
  read = lambda p: (fileio.gfile().GFile(p, 'rb') if fileio.is_remote(p) else open(p, 'rb'))
  with read(own) as a, read(vocab_file) as b:
    if a.read() == b.read():
      return None  # A copy (of a SentencePiece model too, which a run copies as vocab.txt).
  try:
    own_tokens = read_vocab(own)
  except UserError:
    own_tokens = []  # Not text: not a WordPiece vocabulary, so not the one given either.
  while own_tokens and not own_tokens[-1]:
    own_tokens.pop()
  if tokens == own_tokens:
    return None
  for i, (x, y) in enumerate(zip(tokens, own_tokens)):
    if x != y:
      return f'its token {i} is {x!r}, {own}\'s is {y!r}'
  return f'{len(tokens):,} tokens, {own} has {len(own_tokens):,}'


def load_checkpoint(path: str, vocab_file: str = '', lower_case: bool | None = None,
                    scan_layers: bool = False, flag: str = 'init_checkpoint'):
  """(BertConfig, params, tokenizer, vocab file, lower_case) of any checkpoint format: what a
  command that feeds text to a checkpoint needs.

  The vocabulary is `vocab_file` or the checkpoint's vocab.txt; casing is `lower_case` or what
  the checkpoint records. A vocabulary that does not belong to the checkpoint is an error
  (`check_vocab`). `flag` is how the user named `path` (the key or flag errors mention).
  """
  from bert_jax import tokenization  # pylint: disable=g-import-not-at-top  (TensorFlow)
  if not path:
    raise UserError(f'{flag} is empty: name a pre-trained checkpoint (bert_jax, Hugging Face, '
                    'Google TF, a training workdir, or hf://ORG/NAME on the Hub)')
  path = hub.checkpoint_folder(path, flag)
  fileio.check_bucket(path, flag)
  if vocab_file:
    fileio.check_bucket(vocab_file, 'vocab_file')
  bert_config, params = load_pretrained(path, scan_layers=scan_layers)
  vocab = vocab_file or find_vocab(path)
  if not vocab:
    raise UserError(f'{flag}={path} has no vocab.txt next to it; set the vocab_file')
  casing_from = 'lower_case as given'
  if lower_case is None:
    meta = read_metadata(path)
    lower_case, casing_from = meta.get('lower_case'), meta.get('lower_case_from')
    if lower_case is None:
      raise UserError(f'{flag}={path} does not say whether it is cased; set lower_case')
  tok = tokenization.load_tokenizer(vocab, lower_case=lower_case)
  check_vocab(path, vocab, tok.vocab, bert_config, flag,
              '--vocab_file' if flag.startswith('--') else 'data.vocab_file')
  logging.info('Checkpoint %s: %d layers, hidden %d, vocab %s (%d tokens, %s: %s)', path,
               bert_config.num_hidden_layers, bert_config.hidden_size, vocab, tok.vocab_size,
               'uncased' if lower_case else 'cased', casing_from)
  return bert_config, params, tok, vocab, bool(lower_case)
