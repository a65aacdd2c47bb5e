"""Serving exports: `bert-jax export --workdir=RUN --output=DIR --format=savedmodel`.

A TensorFlow SavedModel that takes strings and answers as `bert-jax predict` does: the
tokenizer (tokenization.py, in-graph), each task's packing of the inputs and its decoding
(serving.py) and the model, exported with `jax.export` (StableHLO in TensorFlow's XlaCallModule
op, as jax2tf places it, for CPU, CUDA and TPU; `_tf_model` says why not jax2tf itself), with
the run's weights as variables. It needs TensorFlow and tensorflow_text
(`import tensorflow_text` registers the tokenizer's ops), not JAX or bert_jax. Batch size and
sequence length are dynamic: a batch is padded to a power of two rows and to the smallest of the
run's length buckets that holds it (its max_seq_length at most), so a server compiles a few
programs. The model computes in the dtype the run evaluated in (task.json), as `predict`.

Signatures (inputs are string vectors [B]; README "Serving" shows them called):

  GLUE     serving_default(text_a[, text_b]) -> label [B] string, label_id [B],
           probabilities [B, C], logits [B, C]; STS-B: score [B]
  SWAG     serving_default(context, start, endings [B, C]) -> label [B] (the chosen ending's
           position), ending [B], probabilities [B, C]
  NER      serving_default(text) -> words [B, W], tags [B, W] ('' past each sentence's words),
           num_words [B]: a sentence per string, split into words as `predict` splits text;
           tag_words(words [B, W], '' past the words) -> the same for words given (CoNLL)
  SQuAD    serving_default(question, context) -> answer [B], answer_start, answer_end [B]
           (characters of the context; -1 for no answer), nbest_text, nbest_probability,
           nbest_start_logit, nbest_end_logit [B, n_best_size] ('' past the n-best);
           v2.0 also null_odds [B]
  pre-training run   serving_default = features(text_a) and features_pair(text_a, text_b)
           -> features [B, T, layers, H] (the last four encoder layers, zeros past each
           length), cls [B, H], mean [B, layers, H], tokens [B, T], lengths [B], truncated
           [B]; fill_mask(text) -> tokens, token_ids, probabilities [B, masks, top_k],
           positions [B, masks], num_masks [B]
  every export  tokenize(text) -> token_ids [B, T] (-1 past each text), tokens, lengths;
           encode(the serving inputs) -> the model's inputs, as the task's features (the
           training pipeline's token ids)

The export folder also holds bert_jax_export.json (task, label names, lengths, signatures).
"""

from __future__ import annotations

import os
from typing import Any, Callable

from absl import logging
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from bert_jax import batching
from bert_jax import defaults
from bert_jax import fileio
from bert_jax import model as model_lib
from bert_jax import pretrained
from bert_jax import run_files
from bert_jax import tasks
from bert_jax.errors import UserError

FORMATS = ('savedmodel',)
MARKER = 'bert_jax_export.json'
FEATURES_MAX_SEQ_LENGTH = 128  # `bert-jax features`' default --max_seq_length.
FILL_MASK_TOP_K = 5  # `bert-jax fill-mask`'s default --top_k.
# The platforms the model is lowered for: the SavedModel serves on each.
PLATFORMS = ('cpu', 'cuda', 'tpu')


def export(workdir: str, output: str, fmt: str = 'savedmodel') -> dict[str, Any]:
  """Writes the serving export of a finished run in `workdir` to the folder `output`.

  Args:
    workdir: a finished `bert-jax finetune` workdir (GLUE, SQuAD, NER, SWAG) or `pretrain`
      workdir (features and fill-mask).
    output: a new or empty folder, or an earlier export (replaced).
    fmt: 'savedmodel'.

  Returns:
    {'task', 'format', 'output', 'signatures'}.
  """
  if fmt not in FORMATS:
    raise UserError(f'--format={fmt}: expected {" or ".join(FORMATS)} (ONNX: README "Serving" '
                    'exports the model from `bert-jax convert --format=hf`)')
  fileio.hide_accelerators_from_tf()
  run = _read_run(workdir)
  builder = _BUILDERS.get(run['kind'])
  if builder is None:
    raise UserError(f'--workdir={workdir} holds a {run["kind"]} model ({run["task"]}): '
                    f'--format={fmt} serves {", ".join(sorted(_BUILDERS))} runs')
  _check_output(output, workdir)
  bert_config, params, tok, _, lower_case = pretrained.load_checkpoint(workdir, flag='--workdir')
  # XLA attention and LayerNorm run anywhere; the GELU that TensorFlow's XlaCallModule reads
  # (model.BertConfig.portable_gelu).
  bert_config = bert_config.replace(scan_layers=False, attention_impl='xla',
                                    layer_norm_impl='xla', portable_gelu=True)
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from bert_jax import serving  # pylint: disable=g-import-not-at-top  (TensorFlow)
  module = tf.Module()
  module.tokenizers = tok.tf_modules()
  meta = builder(module, serving, tok, bert_config, params, run, lower_case)
  signatures = dict(meta.pop('signatures'))
  signatures['tokenize'] = _tokenize_signature(tf, tok)
  # Each traced once, here: handed a tf.function, tf.saved_model.save traces it again (half of
  # an export's time).
  signatures = {name: f.get_concrete_function() if hasattr(f, 'get_concrete_function') else f
                for name, f in signatures.items()}
  meta.update(task=run['task'], kind=run['kind'], workdir=workdir, format=fmt,
              lower_case=lower_case,
              signatures={name: _describe(f) for name, f in signatures.items()})
  # Written beside `output`, then moved there: an export cut short leaves an earlier one whole.
  # (Cloud Storage renames no folder: there it is written in place, its marker last.)
  remote = fileio.is_remote(output)
  partial = output if remote else output.rstrip('/') + '.partial'
  if fileio.exists(partial):
    fileio.gfile().rmtree(partial)  # One cut short (on Cloud Storage: the earlier export).
  tf.saved_model.save(module, partial, signatures=signatures)
  fileio.write_json(os.path.join(partial, MARKER), meta)
  if not remote:
    if fileio.exists(output):
      fileio.gfile().rmtree(output)  # An earlier export (`_check_output`).
    fileio.gfile().rename(partial, output)
  logging.info('Exported %s to %s', run['task'], output)
  return {'task': run['task'], 'format': fmt, 'output': output,
          'signatures': sorted(signatures)}


# ---------------------------------------------------------------------------------------------
# Checks
# ---------------------------------------------------------------------------------------------


def _read_run(workdir: str) -> dict[str, Any]:
  """What the workdir's finished run is: {'kind', 'task', 'info', 'config'}."""
  if not fileio.exists(workdir):
    raise UserError(f'--workdir={workdir}: {fileio.missing(workdir)}')
  if not fileio.isdir(workdir):
    raise UserError(f'--workdir={workdir} is a file: name a run\'s workdir')
  fileio.check_readable_dir(workdir, '--workdir')
  record = run_files.read_run_config(workdir)
  if record is None:
    raise UserError(f'--workdir={workdir} has no config.json: not a bert_jax training workdir')
  config = ml_collections.ConfigDict(defaults.saved_config(record))
  if config.kind == 'finetune':
    if not fileio.exists(os.path.join(workdir, 'metrics.json')):
      raise UserError(f'--workdir={workdir} has no metrics.json: its fine-tuning run has not '
                      'finished (rerun its `bert-jax finetune` command to finish it)')
    info = fileio.read_json(os.path.join(workdir, 'task.json'))
    return {'kind': info['kind'], 'task': info['task'], 'info': info, 'config': config}
  steps = run_files.checkpoint_steps(workdir)
  if not steps or steps[-1] < int(config.train.steps):
    at = f'its last checkpoint is step {steps[-1]}' if steps else 'it has no checkpoint'
    raise UserError(f'--workdir={workdir}: its pre-training run has not finished ({at} of '
                    f'train.steps={config.train.steps}; rerun its `bert-jax pretrain` command '
                    'to finish it)')
  return {'kind': 'pretraining', 'task': 'pretraining', 'info': {}, 'config': config}


def _check_output(output: str, workdir: str) -> None:
  """The output must be new, an empty folder, or an earlier export (which is replaced)."""
  if not output:
    raise UserError('--output is empty: name the folder the SavedModel goes to')
  if fileio.same_path(output, workdir):
    raise UserError(f'--output={output} is the --workdir: name another folder')
  if not fileio.exists(output):
    fileio.make_dirs(os.path.dirname(output.rstrip('/')) or '.', '--output')
    return
  if not fileio.isdir(output):
    raise UserError(f'--output={output} is a file, not an export: name a new folder')
  if fileio.gfile().listdir(output) and not fileio.exists(os.path.join(output, MARKER)):
    raise UserError(f'--output={output} exists and is not a bert_jax export (no {MARKER}): '
                    'name a new or empty folder')


# ---------------------------------------------------------------------------------------------
# The model, as a TensorFlow function
# ---------------------------------------------------------------------------------------------


def _tf_model(module, apply: Callable, params: Any, shapes: list[str],
              max_length: int) -> Callable:
  """`apply(params, *inputs)` as a TensorFlow function of the inputs, the weights held as
  variables of `module`; `shapes`: each input's polymorphic shape ('(b, l)': any batch and
  length), length `l` at most `max_length` (the model's positions).

  The function is exported with `jax.export` for CPU, CUDA and TPU and called through
  TensorFlow's XlaCallModule op, as jax2tf does, but serialized for the StableHLO version that
  this TensorFlow reads: jax writes a version about a month old (WEEK_4), newer than
  TensorFlow 2.21's (1.13.7) for jax 0.10 (CHLO composites) and 0.12 (shape assertions), so a
  jax2tf SavedModel fails to load there. The model's GELU is `activations.portable_erf`'s, for
  the same reason."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from jax import export as jax_export  # pylint: disable=g-import-not-at-top
  # StableHLO's Python API: jaxlib's writes the artifact, TensorFlow's says what it reads.
  from jaxlib.mlir.dialects import stablehlo  # pylint: disable=g-import-not-at-top
  # pylint: disable-next=g-import-not-at-top
  from tensorflow.compiler.mlir.stablehlo import stablehlo as tf_stablehlo
  from tensorflow.compiler.tf2xla.python import xla as tfxla  # pylint: disable=g-import-not-at-top
  param_specs = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype),
                             params)
  examples = [np.zeros((1,) * (shape.count(',') + 1), np.int32) for shape in shapes]
  input_specs = jax_export.symbolic_args_specs(examples, shapes,
                                               constraints=(f'l <= {max_length}',))
  exported = jax_export.export(jax.jit(apply), platforms=PLATFORMS)(param_specs, *input_specs)
  artifact = stablehlo.serialize_portable_artifact_str(exported.mlir_module(),
                                                       tf_stablehlo.get_current_version())
  if not hasattr(module, 'params'):  # Two functions of one model share its weights.
    module.params = tf.nest.map_structure(
        lambda x: tf.Variable(np.asarray(x), trainable=False), params)
  out_shapes = [[None if jax_export.is_symbolic_dim(d) else d for d in aval.shape]
                for aval in exported.out_avals]
  out_types = [tf.as_dtype(aval.dtype) for aval in exported.out_avals]

  def call(*inputs):
    # jax and tf.nest flatten a dict alike, by sorted keys.
    args = tf.nest.flatten(module.params) + list(inputs)
    outputs = tfxla.call_module(
        [args[i] for i in exported.module_kept_var_idx],
        version=exported.calling_convention_version, module=artifact, Tout=out_types,
        Sout=out_shapes, platforms=[p.upper() for p in exported.platforms],
        disabled_checks=[str(c) for c in exported.disabled_safety_checks], function_list=[],
        has_token_input_output=False,
        use_shardy_partitioner=bool(jax.config.jax_use_shardy_partitioner))
    return jax.tree_util.tree_unflatten(exported.out_tree, outputs)
  return call


def _task_model(module, task_model, head: str, params: Any, max_length: int,
                dims: str = '(b, l)') -> Callable:
  """A task's model as `predict` runs it (`tasks.predict_step`): inputs dict -> outputs.
  `dims`: the inputs' polymorphic shape (SWAG: '(b, c, l)', c choices)."""
  def apply(p, input_ids, input_mask, segment_ids):
    zeros = jnp.zeros(input_ids.shape[:1], jnp.int32)
    batch = dict(input_ids=input_ids, input_mask=input_mask, segment_ids=segment_ids,
                 index=zeros, weight=zeros)
    return tasks.predict_step(p, batch, model=task_model, head=head)['outputs']
  fn = _tf_model(module, apply, params, [dims] * 3, max_length)
  return lambda inputs: fn(*(inputs[k] for k in tasks.INPUTS))


def _lengths(run: dict[str, Any], max_length: int) -> list[int]:
  """The lengths a batch is padded to: the run's buckets below its max_seq_length, and that."""
  buckets = batching.parse_buckets(run['config'].data.buckets)
  return sorted({b for b in buckets if b < max_length} | {max_length})


# ---------------------------------------------------------------------------------------------
# Signatures of each kind of run
# ---------------------------------------------------------------------------------------------


def _strings(*names: str):
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  return [tf.TensorSpec([None], tf.string, name=n) for n in names]


def _tokenize_signature(tf, tok):
  @tf.function(input_signature=_strings('text'), autograph=False)
  def tokenize(text):
    ids = tok.tokenize(text)
    vocab = tf.constant(tok.vocab)
    return {'token_ids': ids.to_tensor(-1), 'tokens': tf.gather(vocab, ids).to_tensor(''),
            'lengths': ids.row_lengths()}
  return tokenize


def _describe(concrete) -> dict[str, Any]:
  inputs = {spec.name: spec.shape.as_list() for spec in concrete.structured_input_signature[0]}
  return {'inputs': inputs, 'outputs': sorted(concrete.structured_outputs)}


def _glue(module, serving, tok, bert_config, params, run, lower_case) -> dict[str, Any]:
  """GLUE: a sentence or a pair (as the task has) -> label and probabilities (STS-B: score)."""
  del lower_case
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from bert_jax import task_table  # pylint: disable=g-import-not-at-top
  glue = task_table.module('glue')
  info = run['info']
  labels = info['labels']
  max_length = int(info['max_seq_length'])
  bert_config = bert_config.replace(dtype=_dtype(run))
  task_model = model_lib.BertForSequenceClassification(
      bert_config, num_labels=1 if labels is None else len(labels))
  model = _task_model(module, task_model, 'sequence', params, bert_config.max_position_embeddings)
  lengths = _lengths(run, max_length)
  pair = glue.has_pairs(info['task'])
  names = ('text_a', 'text_b') if pair else ('text_a',)

  def encode(texts):
    ids_b = tok.tokenize(texts[1]) if pair else None
    ids, segments, truncated = serving.pack_pair(tok.tokenize(texts[0]), ids_b, tok.cls_id,
                                                 tok.sep_id, max_length)
    return serving.model_inputs(ids, segments, tok.pad_id, lengths), truncated

  @tf.function(input_signature=_strings(*names), autograph=False)
  def encode_signature(*texts):
    inputs, truncated = encode(texts)
    return dict(inputs, truncated=truncated)

  @tf.function(input_signature=_strings(*names), autograph=False)
  def predict(*texts):
    inputs, _ = encode(texts)
    rows = tf.shape(inputs['input_ids'])[0]
    logits = model(serving.pad_batch(inputs))[:rows]
    if labels is None:
      return {'score': logits[:, 0]}
    label_id = tf.argmax(logits, axis=-1, output_type=tf.int32)
    return {'label': tf.gather(tf.constant(labels), label_id), 'label_id': label_id,
            'probabilities': tf.nn.softmax(logits, axis=-1), 'logits': logits}

  return {'signatures': {'serving_default': predict, 'encode': encode_signature},
          'compute_dtype': bert_config.dtype, 'labels': labels, 'max_seq_length': max_length,
          'lengths': lengths}


def _swag(module, serving, tok, bert_config, params, run, lower_case) -> dict[str, Any]:
  """SWAG: a context, the second sentence's start and the endings -> the chosen ending."""
  del lower_case
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from bert_jax import task_table  # pylint: disable=g-import-not-at-top
  swag = task_table.module('swag')
  info = run['info']
  max_length = int(info['max_seq_length'])
  bert_config = bert_config.replace(dtype=_dtype(run))
  model = _task_model(module, swag.BertForMultipleChoice(bert_config), 'sequence', params,
                      bert_config.max_position_embeddings, dims='(b, c, l)')
  lengths = _lengths(run, max_length)
  specs = _strings('context', 'start') + [tf.TensorSpec([None, None], tf.string, name='endings')]

  def encode(context, start, endings):
    rows, choices = tf.shape(endings)[0], tf.shape(endings)[1]
    # `swag.convert_examples`' second text, f'{start} {ending}'.strip(): stripping the spaces
    # changes no token.
    seconds = tf.strings.join([tf.repeat(start[:, tf.newaxis], choices, axis=1), endings], ' ')
    ids_a = tf.gather(tok.tokenize(context), tf.repeat(tf.range(rows), choices))
    ids, segments, truncated = serving.pack_pair(
        ids_a, tok.tokenize(tf.reshape(seconds, [-1])), tok.cls_id, tok.sep_id, max_length)
    inputs = serving.model_inputs(ids, segments, tok.pad_id, lengths)
    length = tf.shape(inputs['input_ids'])[1]
    inputs = {k: tf.reshape(v, tf.stack([rows, choices, length])) for k, v in inputs.items()}
    return inputs, tf.reshape(truncated, tf.stack([rows, choices]))

  @tf.function(input_signature=specs, autograph=False)
  def encode_signature(context, start, endings):
    inputs, truncated = encode(context, start, endings)
    return dict(inputs, truncated=truncated)

  @tf.function(input_signature=specs, autograph=False)
  def predict(context, start, endings):
    inputs, _ = encode(context, start, endings)
    scores = model(serving.pad_batch(inputs))[:tf.shape(endings)[0]]
    label = tf.argmax(scores, axis=-1, output_type=tf.int32)
    return {'label': label, 'ending': tf.gather(endings, label, batch_dims=1),
            'probabilities': tf.nn.softmax(scores, axis=-1), 'scores': scores}

  return {'signatures': {'serving_default': predict, 'encode': encode_signature},
          'compute_dtype': bert_config.dtype, 'choices': info.get('choices'),
          'max_seq_length': max_length, 'lengths': lengths}


def _ner(module, serving, tok, bert_config, params, run, lower_case) -> dict[str, Any]:
  """NER: a sentence per string (or its words) -> a tag per word."""
  del lower_case  # Words are tagged as the tokenizer splits them, cased or not.
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from bert_jax import tokenization  # pylint: disable=g-import-not-at-top
  info = run['info']
  labels = info['labels']
  max_length = int(info['max_seq_length'])
  bert_config = bert_config.replace(dtype=_dtype(run))
  model = _task_model(module, model_lib.BertForTokenClassification(
      bert_config, num_labels=len(labels)), 'token', params, bert_config.max_position_embeddings)
  lengths = _lengths(run, max_length)

  def encode(words):
    pieces = tok.tokenize(words.flat_values)
    ids, window, position = serving.ner_windows(words, pieces, max_length - 2, tok.unk_id)
    count = ids.nrows(out_type=tf.int32)
    ids = tf.concat([serving.column(tok.cls_id, count), ids, serving.column(tok.sep_id, count)],
                    axis=1)
    return serving.model_inputs(ids, tf.zeros_like(ids), tok.pad_id, lengths), window, position

  def tag(words):
    inputs, window, position = encode(words)
    tags = model(serving.pad_batch(inputs))
    ids = tf.gather_nd(tags, tf.stack([window, position], axis=1))
    tagged = words.with_flat_values(tf.gather(tf.constant(labels), ids))
    return {'words': words.to_tensor(''), 'tags': tagged.to_tensor(''),
            'num_words': words.row_lengths()}

  def split(text):
    # `ner.read_sentences`' text: BERT's basic tokenizer, case kept (squad.basic_tokenize).
    return tokenization.split_words(text, lower_case=False)

  def given(words):
    words = tf.RaggedTensor.from_tensor(words, padding='')
    return words

  @tf.function(input_signature=_strings('text'), autograph=False)
  def predict(text):
    return tag(split(text))

  words_spec = [tf.TensorSpec([None, None], tf.string, name='words')]

  @tf.function(input_signature=words_spec, autograph=False)
  def tag_words(words):
    return tag(given(words))

  @tf.function(input_signature=_strings('text'), autograph=False)
  def encode_signature(text):
    inputs, window, position = encode(split(text))
    return dict(inputs, word_window=window, word_position=position)

  return {'signatures': {'serving_default': predict, 'tag_words': tag_words,
                         'encode': encode_signature},
          'compute_dtype': bert_config.dtype, 'labels': labels, 'max_seq_length': max_length,
          'lengths': lengths}


def _squad(module, serving, tok, bert_config, params, run, lower_case) -> dict[str, Any]:
  """SQuAD: a question and a context -> the answer, its span and the n-best answers."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  info, settings = run['info'], run['config'].task
  max_length = int(info['max_seq_length'])
  bert_config = bert_config.replace(dtype=_dtype(run))
  model = _task_model(module, model_lib.BertForQuestionAnswering(bert_config), 'span', params,
                      bert_config.max_position_embeddings)
  lengths = _lengths(run, max_length)
  vocab = tf.constant(tok.vocab)
  version_2 = bool(info['version_2'])

  def encode(question, context):
    words, starts = serving.squad_words(context)
    windows = serving.squad_windows(
        tok.tokenize(question), words, tok.tokenize(words.flat_values), max_length,
        int(settings.doc_stride), int(settings.max_query_length), tok.cls_id, tok.sep_id)
    inputs = serving.model_inputs(windows['ids'], windows['segments'], tok.pad_id, lengths)
    return inputs, windows, words, starts

  @tf.function(input_signature=_strings('question', 'context'), autograph=False)
  def predict(question, context):
    inputs, windows, words, starts = encode(question, context)
    logits = model(serving.pad_batch(inputs))[:tf.shape(inputs['input_ids'])[0]]
    return serving.squad_decode(
        logits, windows, words, starts, vocab, n_best_size=int(settings.n_best_size),
        max_answer_length=int(settings.max_answer_length), version_2=version_2,
        null_score_diff_threshold=float(settings.null_score_diff_threshold),
        lower_case=lower_case)

  @tf.function(input_signature=_strings('question', 'context'), autograph=False)
  def encode_signature(question, context):
    inputs, windows, _, _ = encode(question, context)
    rows = tf.shape(inputs['input_ids'])
    return dict(inputs, example=windows['example'],
                token_to_orig=windows['token_to_orig'].to_tensor(-1, shape=rows),
                token_is_max_context=windows['token_is_max_context'].to_tensor(0, shape=rows))

  return {'signatures': {'serving_default': predict, 'encode': encode_signature},
          'compute_dtype': bert_config.dtype, 'version_2': version_2,
          'max_seq_length': max_length, 'lengths': lengths,
          'doc_stride': int(settings.doc_stride),
          'max_query_length': int(settings.max_query_length),
          'n_best_size': int(settings.n_best_size)}


def _pretraining(module, serving, tok, bert_config, params, run, lower_case
                 ) -> dict[str, Any]:
  """A pre-training run: `bert-jax features` (default layers, cls and mean) and fill-mask."""
  del lower_case
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from bert_jax import features as features_lib  # pylint: disable=g-import-not-at-top
  if 'mlm' not in params:
    raise UserError('--workdir: its checkpoint has no MLM head (cls.predictions): fill-mask '
                    'cannot be served')
  # As the commands run: float32, `features`' default layers and length.
  bert_config = bert_config.replace(dtype='float32')
  positions = bert_config.max_position_embeddings
  max_length = min(FEATURES_MAX_SEQ_LENGTH, positions)
  layers = features_lib.default_layers(bert_config.num_hidden_layers)
  chosen = features_lib.resolve_layers(layers, bert_config.num_hidden_layers)
  bert = model_lib.BertModel(bert_config)

  def features_fn(p, input_ids, input_mask, segment_ids):
    _, pooled, hidden = bert.apply({'params': p['bert']}, input_ids, input_mask, segment_ids,
                                   deterministic=True, return_hidden_states=True)
    feats = jnp.stack([hidden[i] for i in chosen], axis=2).astype(jnp.float32)
    mask = input_mask.astype(jnp.float32)[:, :, None, None]
    feats = feats * mask
    return feats, pooled.astype(jnp.float32), feats.sum(1) / jnp.maximum(mask.sum(1), 1.0)

  pretraining = model_lib.BertForPreTraining(bert_config)

  def mlm_fn(p, input_ids, input_mask, segment_ids, masked_positions):
    logits, _ = pretraining.apply({'params': p}, input_ids, input_mask, segment_ids,
                                  masked_positions)
    return logits

  params = model_lib.with_nsp_head(params, bert_config.hidden_size)
  run_features = _tf_model(module, features_fn, params, ['(b, l)'] * 3, positions)
  run_mlm = _tf_model(module, mlm_fn, params, ['(b, l)'] * 3 + ['(b, m)'], positions)
  sizes = (16, 32, 64, 128, 256, 512)  # `bert-jax features`' length buckets.
  lengths = sorted({b for b in sizes if b < max_length} | {max_length})
  mask_lengths = sorted({b for b in sizes if b < positions} | {positions})
  vocab = tf.constant(tok.vocab)

  def encode(text_a, text_b):
    ids_b = None if text_b is None else tok.tokenize(text_b)
    ids, segments, truncated = serving.pack_pair(tok.tokenize(text_a), ids_b, tok.cls_id,
                                                 tok.sep_id, max_length)
    return ids, serving.model_inputs(ids, segments, tok.pad_id, lengths), truncated

  def features(text_a, text_b):
    ids, inputs, truncated = encode(text_a, text_b)
    rows = tf.shape(text_a)[0]
    feats, cls, mean = run_features(*(serving.pad_batch(inputs)[k] for k in tasks.INPUTS))
    return {'features': feats[:rows], 'cls': cls[:rows], 'mean': mean[:rows],
            'tokens': tf.gather(vocab, ids).to_tensor(''), 'lengths': ids.row_lengths(),
            'truncated': truncated}

  @tf.function(input_signature=_strings('text_a'), autograph=False)
  def features_single(text_a):
    return features(text_a, None)

  @tf.function(input_signature=_strings('text_a', 'text_b'), autograph=False)
  def features_pair(text_a, text_b):
    return features(text_a, text_b)

  @tf.function(input_signature=_strings('text'), autograph=False)
  def fill_mask(text):
    # `fill_mask.encode_masked`: the text around each [MASK] tokenized on its own, the mask
    # token put between.
    parts = tf.strings.split(text, '[MASK]')
    pieces = tok.tokenize(parts.flat_values)
    last = (tf.ragged.range(parts.row_lengths())
            == (parts.row_lengths() - 1)[:, tf.newaxis]).flat_values
    masks = tf.ragged.boolean_mask(serving.column(tok.mask_id, tf.size(last)),
                                   (~last)[:, tf.newaxis])
    pieces = tf.RaggedTensor.from_value_rowids(tf.concat([pieces, masks], axis=1),
                                               parts.value_rowids(), nrows=parts.nrows())
    rows = tf.shape(text)[0]
    ids = tf.concat([serving.column(tok.cls_id, rows), pieces.merge_dims(1, 2),
                     serving.column(tok.sep_id, rows)], axis=1)
    tf.debugging.assert_less_equal(
        ids.row_lengths(), tf.constant(positions, tf.int64),
        message=f'fill_mask: a text is longer than {positions} tokens with [CLS] and [SEP] '
                '(max_position_embeddings)')
    inputs = serving.model_inputs(ids, tf.zeros_like(ids), tok.pad_id, mask_lengths)
    where = tf.ragged.boolean_mask(tf.ragged.range(ids.row_lengths()), ids == tok.mask_id)
    num_masks = where.row_lengths()
    slots = tf.maximum(tf.reduce_max(tf.concat([num_masks, [1]], 0)), 1)
    masked = where.to_tensor(0, shape=tf.stack([tf.cast(rows, tf.int64), slots]))
    padded = serving.pad_batch(dict(inputs, masked=tf.cast(masked, tf.int32)))
    logits = run_mlm(*(padded[k] for k in tasks.INPUTS), padded['masked'])[:rows]
    probs, ids_top = tf.math.top_k(tf.nn.softmax(logits, axis=-1), k=min(
        FILL_MASK_TOP_K, bert_config.vocab_size))
    real = tf.range(slots)[tf.newaxis, :] < num_masks[:, tf.newaxis]
    return {'tokens': tf.where(real[..., tf.newaxis], tf.gather(vocab, ids_top), ''),
            'token_ids': tf.where(real[..., tf.newaxis], ids_top, -1),
            'probabilities': tf.where(real[..., tf.newaxis], probs, 0.0),
            'positions': tf.where(real, tf.cast(masked, tf.int32), -1),
            'num_masks': num_masks}

  @tf.function(input_signature=_strings('text_a'), autograph=False)
  def encode_signature(text_a):
    _, inputs, truncated = encode(text_a, None)
    return dict(inputs, truncated=truncated)

  return {'signatures': {'serving_default': features_single, 'features': features_single,
                         'features_pair': features_pair, 'fill_mask': fill_mask,
                         'encode': encode_signature},
          'compute_dtype': bert_config.dtype, 'layers': layers, 'max_seq_length': max_length,
          'top_k': FILL_MASK_TOP_K}


def _dtype(run: dict[str, Any]) -> str:
  """The dtype the run evaluated in (`predict`'s)."""
  info = run['info']
  return (info['compute_dtype'] if 'compute_dtype' in info
          else model_lib.resolve_dtype(run['config'].model.dtype))


_BUILDERS: dict[str, Callable[..., dict[str, Any]]] = {
    'glue': _glue, 'squad': _squad, 'ner': _ner, 'swag': _swag, 'pretraining': _pretraining,
}
