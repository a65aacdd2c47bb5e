"""Fine-tuning: GLUE, SQuAD v1.1/v2.0 and CoNLL-2003 NER with the paper's recipe.

`finetune(config, workdir)` runs, in order: setup -> mesh -> pre-trained encoder and tokenizer ->
task data -> model & optimizer -> abstract init & shardings -> init (pre-trained encoder, fresh
head) -> steps -> loop over epochs (train, evaluate on dev, keep the best) -> test predictions.
`sweep` repeats it over the paper's learning rates.

Batches are cut to length buckets (`glue.bucket_batches`): short GLUE sentences do not pay for
128 tokens, and the jitted step compiles once per bucket. Every global batch is planned the same
way on every process; each process feeds its own rows of it. Partial batches are padded with
rows of weight 0, so every example counts exactly once per epoch and shapes stay fixed.

Workdir:
  config.json, bert_config.json, vocab.txt, tokenizer_config.json, task.json
  checkpoints/<step>/  the best epoch's parameters (Orbax, params + meta); the workdir loads
                       with `convert.load_pretrained` like a pre-training workdir, head included
  metrics.jsonl + TensorBoard events   training metrics and each epoch's dev metrics
  metrics.json         the best epoch's dev metrics (what `finetune` returns)
  predictions/         SQuAD predictions.json (+ null_odds.json), NER CoNLL files (dev, test),
                       GLUE test TSVs in the leaderboard's format (with config.predict_test)
Fine-tuning does not resume: a workdir that already holds a checkpoint is refused.
"""

import copy
import dataclasses
import functools
import json
import math
import os
import shutil
import time
from typing import Any, Callable, Iterator, Sequence

from absl import logging
import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding, PartitionSpec as P

from bert_jax import convert
from bert_jax import glue
from bert_jax import metrics
from bert_jax import model as model_lib
from bert_jax import ner
from bert_jax import optim
from bert_jax import sharding as sharding_lib
from bert_jax import squad
from bert_jax import train as train_lib

TrainState = train_lib.TrainState
CHECKPOINT_DIR = 'checkpoints'
PREDICTIONS_DIR = 'predictions'
_INPUTS = ('input_ids', 'input_mask', 'segment_ids')
# The headline metric of each GLUE task in the paper (others: accuracy).
_GLUE_MAIN = {'cola': 'mcc', 'stsb': 'spearman', 'mrpc': 'f1', 'qqp': 'f1'}

# ---------------------------------------------------------------------------------------------
# Pre-trained encoder and tokenizer
# ---------------------------------------------------------------------------------------------


def load_checkpoint(path: str, vocab_file: str = '', lower_case: bool | None = None,
                    scan_layers: bool = False, flag: str = 'init_checkpoint'):
  """(BertConfig, params, tokenizer, vocab file, lower_case) of any checkpoint format.

  The vocabulary is `vocab_file` or the checkpoint's vocab.txt; casing is `lower_case` or what
  the checkpoint records. A vocabulary with more tokens than the embedding matrix has rows is
  an error: the tokenizer would produce ids the model cannot embed.
  """
  from bert_jax import tokenization  # pylint: disable=g-import-not-at-top  (TensorFlow)
  if not path:
    raise ValueError(f'{flag} is empty: name a pre-trained checkpoint (bert_jax, Hugging Face, '
                     'Google TF, or a training workdir)')
  bert_config, params = convert.load_pretrained(path, scan_layers=scan_layers)
  vocab = vocab_file or convert.find_vocab(path)
  if not vocab:
    raise ValueError(f'{flag}={path} has no vocab.txt next to it; set the vocab_file')
  if lower_case is None:
    lower_case = convert.read_metadata(path).get('lower_case')
    if lower_case is None:
      raise ValueError(f'{flag}={path} does not say whether it is cased; set lower_case')
  tok = tokenization.load_tokenizer(vocab, lower_case=lower_case)
  if tok.vocab_size > bert_config.vocab_size:
    raise ValueError(
        f'{vocab} has {tok.vocab_size} tokens but {flag}={path} has vocab_size '
        f'{bert_config.vocab_size} (bert/embeddings/word_embeddings/embedding is '
        f'[{bert_config.vocab_size}, {bert_config.hidden_size}]): use the vocabulary the '
        'checkpoint was trained with')
  logging.info('Checkpoint %s: %d layers, hidden %d, vocab %s (%d tokens, %s)', path,
               bert_config.num_hidden_layers, bert_config.hidden_size, vocab, tok.vocab_size,
               'uncased' if lower_case else 'cased')
  return bert_config, params, tok, vocab, bool(lower_case)


# ---------------------------------------------------------------------------------------------
# Losses (sums and counts, so padded rows and uneven batches average exactly)
# ---------------------------------------------------------------------------------------------


def _nll(logits: jax.Array, labels: jax.Array) -> jax.Array:
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  return -jnp.take_along_axis(logp, jnp.maximum(labels, 0)[..., None], axis=-1)[..., 0]


def classification_loss(logits, batch):
  w = batch['weight']
  n = jnp.sum(w)
  nll = jnp.sum(_nll(logits, batch['label']) * w)
  correct = jnp.sum((jnp.argmax(logits, -1) == batch['label']) * w)
  return nll, n, {'loss': (nll, n), 'accuracy': (correct, n)}


def regression_loss(logits, batch):
  w = batch['weight']
  n = jnp.sum(w)
  se = jnp.sum(jnp.square(logits[:, 0] - batch['label']) * w)
  return se, n, {'loss': (se, n)}


def token_loss(logits, batch):
  """Cross-entropy on labelled positions (first word pieces); -1 labels are ignored."""
  w = (batch['labels'] >= 0) * batch['weight'][:, None]
  n = jnp.sum(w)
  nll = jnp.sum(_nll(logits, batch['labels']) * w)
  correct = jnp.sum((jnp.argmax(logits, -1) == batch['labels']) * w)
  return nll, n, {'loss': (nll, n), 'accuracy': (correct, n)}


def span_loss(outputs, batch):
  """Mean of the start and end cross-entropies over the window's real tokens.

  Padding positions are masked out of the softmax, so a window's loss does not depend on the
  bucket it was batched in.
  """
  start, end = outputs
  valid = batch['input_mask'].astype(bool)
  very_negative = jnp.finfo(jnp.float32).min
  start = jnp.where(valid, start.astype(jnp.float32), very_negative)
  end = jnp.where(valid, end.astype(jnp.float32), very_negative)
  w = batch['weight']
  n = jnp.sum(w)
  total = jnp.sum((_nll(start, batch['start_positions']) +
                   _nll(end, batch['end_positions'])) * w) / 2
  return total, n, {'loss': (total, n)}


# ---------------------------------------------------------------------------------------------
# Tasks: data, head, loss and scoring of each kind
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class EvalSet:
  """A dev or test set: model inputs (+ `index`), and what to do with per-row outputs."""
  name: str
  features: dict[str, np.ndarray]
  # Outputs of every row in `index` order -> (metrics or None, writer(out_dir) or None).
  evaluate: Callable[[list[np.ndarray]], tuple[dict | None, Callable[[str], None] | None]]


@dataclasses.dataclass
class Task:
  kind: str  # 'glue', 'squad', 'ner'
  head: str  # 'sequence', 'token', 'span': what the prediction step returns per row.
  model: nn.Module
  loss_fn: Callable
  label_keys: tuple[str, ...]
  train: dict[str, np.ndarray]
  dev: list[EvalSet]
  test: list[EvalSet]
  main_metric: str
  metric_names: tuple[str, ...]
  info: dict


def task_kind(task: str) -> str:
  """'glue', 'squad' or 'ner' of a config.task (unknown names are an error)."""
  name = task.lower().replace('-', '_').replace('.', '')
  if name in ('squad_v1', 'squad_v11', 'squad_v2', 'squad_v20'):
    return 'squad'
  if name in ('ner', 'conll2003'):
    return 'ner'
  try:
    metrics.canonical_task(task)
  except ValueError:
    raise ValueError(f'config.task={task!r}: expected a GLUE task, squad_v1, squad_v2 or '
                     'ner') from None
  return 'glue'


def _subset(features: dict, keys: Sequence[str], index_key: str | None = None) -> dict:
  out = {k: features[k] for k in keys}
  n = len(features['input_ids'])
  out['index'] = (np.asarray(features[index_key], np.int32) if index_key
                  else np.arange(n, dtype=np.int32))
  return out


def _glue_task(config, tok, bert_config) -> Task:
  name = metrics.canonical_task(config.task)
  if name in ('mnli_matched', 'mnli_mismatched'):
    name = 'mnli'
  if name == 'ax':
    raise ValueError("config.task='ax' is test-only: fine-tune 'mnli' with "
                     'config.predict_test=True, which also writes AX.tsv')
  label_list, metric_names = glue.task_info(name)
  if config.data_source == 'tsv':
    if not config.data_dir:
      raise ValueError('config.data_dir is empty: the GLUE root (holding CoLA/, MRPC/, ...)')
    read = lambda task, split: glue.read_task(task, config.data_dir, split)
  elif config.data_source == 'tfds':
    read = lambda task, split: glue.read_tfds(task, split, config.tfds_data_dir or None)
  else:
    raise ValueError(f"config.data_source={config.data_source!r}: expected 'tsv' or 'tfds'")

  def convert_split(task, split):
    return glue.convert_examples(read(task, split), tok, config.max_seq_length, label_list)

  regression = label_list is None

  def dev_set(split, metric_task):
    feats = convert_split(name, split)
    labels = feats['label']

    def evaluate(rows):
      out = np.stack(rows)
      return metrics.glue_metrics(metric_task, out[:, 0] if regression else out, labels), None
    return EvalSet(split, _subset(feats, _INPUTS), evaluate)

  def test_set(task, split):
    examples = read(task, split)
    feats = glue.convert_examples(examples, tok, config.max_seq_length, label_list)
    ids = [e.guid.split('-', 1)[1] for e in examples]
    indices = [int(i) for i in ids] if all(i.isdigit() for i in ids) else None

    def evaluate(rows):
      out = np.stack(rows)
      preds = out[:, 0] if regression else out
      return None, lambda d: glue.write_predictions(task, preds, d, split, indices)
    return EvalSet(f'{task}_{split}' if task == 'ax' else split, _subset(feats, _INPUTS),
                   evaluate)

  if name == 'mnli':
    dev = [dev_set('dev_matched', 'mnli'), dev_set('dev_mismatched', 'mnli_mismatched')]
  else:
    dev = [dev_set('dev', name)]
  test = []
  if config.predict_test:
    splits = ['test_matched', 'test_mismatched'] if name == 'mnli' else ['test']
    test = [test_set(name, s) for s in splits]
    diagnostic = os.path.join(config.data_dir, 'diagnostic', 'diagnostic.tsv')
    if name == 'mnli' and (config.data_source == 'tfds' or os.path.exists(diagnostic)):
      test.append(test_set('ax', 'test'))
  num_labels = 1 if regression else len(label_list)
  train = convert_split(name, 'train')
  return Task(
      kind='glue', head='sequence',
      model=model_lib.BertForSequenceClassification(bert_config, num_labels=num_labels),
      loss_fn=regression_loss if regression else classification_loss, label_keys=('label',),
      train=_subset(train, _INPUTS + ('label',)), dev=dev, test=test,
      main_metric=_GLUE_MAIN.get(name, 'accuracy'), metric_names=metric_names,
      info={'task': name, 'labels': label_list})


def _read_squad(path: str, is_training: bool, flag: str) -> list[squad.SquadExample]:
  if not os.path.isfile(path):
    raise FileNotFoundError(f'{flag}: no SQuAD file {path}')
  # Errors name the file and the line (invalid JSON) or the question (missing fields).
  return squad.read_squad(path, is_training)


def _squad_task(config, tok, bert_config, lower_case: bool) -> Task:
  version_2 = config.task.lower().replace('.', '').replace('-', '_') in ('squad_v2', 'squad_v20')
  suffix = 'v2.0' if version_2 else 'v1.1'
  train_file = config.train_file or os.path.join(config.data_dir, f'train-{suffix}.json')
  predict_file = config.predict_file or os.path.join(config.data_dir, f'dev-{suffix}.json')
  convert_args = dict(max_seq_length=config.max_seq_length, doc_stride=config.doc_stride,
                      max_query_length=config.max_query_length)
  train_examples = _read_squad(train_file, True, 'config.train_file')
  train = squad.convert_examples(train_examples, tok, is_training=True, **convert_args)
  dev_examples = _read_squad(predict_file, False, 'config.predict_file')
  dev_features = squad.convert_examples(dev_examples, tok, is_training=False, **convert_args)
  gold = squad.gold_answers(dev_examples)

  def evaluate(rows):
    predictions, null_odds, nbest = squad.decode_predictions(
        dev_examples, dev_features, [r[0] for r in rows], [r[1] for r in rows],
        n_best_size=config.n_best_size, max_answer_length=config.max_answer_length,
        version_2=version_2, null_score_diff_threshold=config.null_score_diff_threshold,
        do_lower_case=lower_case)
    scores = metrics.squad_evaluate(gold, predictions, null_odds if version_2 else None)
    return scores, lambda d: squad.write_predictions(d, predictions,
                                                     null_odds if version_2 else None, nbest)

  names = ('exact', 'f1', 'best_exact', 'best_f1') if version_2 else ('exact', 'f1')
  return Task(
      kind='squad', head='span', model=model_lib.BertForQuestionAnswering(bert_config),
      loss_fn=span_loss, label_keys=('start_positions', 'end_positions'),
      train=_subset(train, _INPUTS + ('start_positions', 'end_positions')),
      dev=[EvalSet('dev', _subset(dev_features, _INPUTS, 'feature_index'), evaluate)], test=[],
      main_metric='f1', metric_names=names,
      info={'task': f'squad_{suffix}', 'version_2': version_2})


def _conll_file(data_dir: str, names: Sequence[str], what: str, required: bool = True):
  for n in names:
    path = os.path.join(data_dir, n)
    if os.path.isfile(path):
      return path
  if required:
    raise FileNotFoundError(f'config.data_dir={data_dir}: no {what} file ({" or ".join(names)})')
  return None


def _write_conll(path: str, sentences, predicted) -> None:
  """'word gold predicted' per line (conlleval's input), a blank line after each sentence."""
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, 'w', encoding='utf-8') as f:
    for sentence, tags in zip(sentences, predicted):
      gold = sentence.tags or ['O'] * len(tags)
      f.writelines(f'{w} {g} {p}\n' for w, g, p in zip(sentence.words, gold, tags))
      f.write('\n')


def _ner_task(config, tok, bert_config) -> Task:
  if not config.data_dir:
    raise ValueError('config.data_dir is empty: the folder of train.txt, valid.txt, test.txt')
  train_sentences = ner.read_conll(_conll_file(config.data_dir, ['train.txt'], 'training'))
  label_list = list(config.label_list)
  if not label_list:
    tags = {t for s in train_sentences for t in s.tags}
    label_list = (list(ner.CONLL_LABELS) if tags <= set(ner.CONLL_LABELS)
                  else ner.label_list_from_data(train_sentences))
  logging.info('NER labels: %s', label_list)

  def eval_set(name, path):
    sentences = ner.read_conll(path)
    feats = ner.convert_sentences(sentences, tok, config.max_seq_length, label_list)

    def evaluate(rows):
      predicted = ner.reassemble(sentences, feats, rows, label_list)
      scores = metrics.ner_metrics([s.tags for s in sentences], predicted)
      return scores, lambda d: _write_conll(os.path.join(d, f'{name}.conll'), sentences,
                                            predicted)
    return EvalSet(name, _subset(feats, _INPUTS, 'feature_index'), evaluate)

  dev = [eval_set('dev', _conll_file(config.data_dir, ['valid.txt', 'dev.txt'], 'dev'))]
  test = []
  if config.predict_test:
    test = [eval_set('test', _conll_file(config.data_dir, ['test.txt'], 'test'))]
  train = ner.convert_sentences(train_sentences, tok, config.max_seq_length, label_list)
  return Task(
      kind='ner', head='token',
      model=model_lib.BertForTokenClassification(bert_config, num_labels=len(label_list)),
      loss_fn=token_loss, label_keys=('labels',), train=_subset(train, _INPUTS + ('labels',)),
      dev=dev, test=test, main_metric='f1', metric_names=('precision', 'recall', 'f1',
                                                          'accuracy'),
      info={'task': 'ner', 'labels': label_list})


def build_task(config: ml_collections.ConfigDict, tok, bert_config: model_lib.BertConfig,
               lower_case: bool) -> Task:
  """The task's data (tokenized), model, loss and scoring from `config`."""
  kind = task_kind(config.task)
  if kind == 'glue':
    task = _glue_task(config, tok, bert_config)
  elif kind == 'squad':
    task = _squad_task(config, tok, bert_config, lower_case)
  else:
    task = _ner_task(config, tok, bert_config)
  if config.eval.main_metric:
    if config.eval.main_metric not in task.metric_names:
      raise ValueError(f'config.eval.main_metric={config.eval.main_metric!r} is not a metric of '
                       f'{config.task}: {list(task.metric_names)}')
    task.main_metric = config.eval.main_metric
  return task


# ---------------------------------------------------------------------------------------------
# Batches
# ---------------------------------------------------------------------------------------------


def _pad_rows(batch: dict[str, np.ndarray], batch_size: int) -> dict[str, np.ndarray]:
  """Pads a partial batch to `batch_size` rows of weight 0 (a lone [CLS]-sized row each, so
  attention never sees an all-masked row)."""
  n = len(batch['weight'])
  if n == batch_size:
    return batch
  out = {}
  for k, v in batch.items():
    fill = -1 if k == 'labels' else 0
    out[k] = np.concatenate([v, np.full((batch_size - n,) + v.shape[1:], fill, v.dtype)])
  out['input_mask'][n:, 0] = 1
  return out


def batches(features: dict[str, np.ndarray], batch_size: int, buckets: Sequence[int],
            shuffle: bool = False, seed: int = 0) -> Iterator[dict[str, np.ndarray]]:
  """Global batches of `batch_size` rows, cut to length buckets, with a `weight` per row."""
  features = dict(features, weight=np.ones(len(features['input_ids']), np.float32))
  for batch in glue.bucket_batches(features, batch_size, tuple(buckets), shuffle=shuffle,
                                   seed=seed):
    yield _pad_rows(batch, batch_size)


def _local_rows(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  """This process's share of a global batch (every process plans the same global batches)."""
  count, index = jax.process_count(), jax.process_index()
  if count == 1:
    return batch
  rows = len(batch['weight']) // count
  return {k: v[index * rows:(index + 1) * rows] for k, v in batch.items()}


# ---------------------------------------------------------------------------------------------
# Pure steps
# ---------------------------------------------------------------------------------------------


def _apply(model, params, batch, deterministic, rngs=None):
  return model.apply({'params': params}, *(batch[k] for k in _INPUTS),
                     deterministic=deterministic, rngs=rngs)


def train_step(state: TrainState, batch: dict[str, jax.Array], *, model: nn.Module,
               tx: optax.GradientTransformation, loss_fn: Callable, base_rng: jax.Array
               ) -> tuple[TrainState, dict[str, Any]]:
  """One AdamW step on the mean loss over the batch's real rows (dropout on)."""
  rng = jax.random.fold_in(base_rng, state.step)

  def loss(params):
    outputs = _apply(model, params, batch, False, {'dropout': rng})
    total, count, step_metrics = loss_fn(outputs, batch)
    return total / jnp.maximum(count, 1.0), step_metrics

  (_, step_metrics), grads = jax.value_and_grad(loss, has_aux=True)(state.params)
  updates, opt_state = tx.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state)
  return new_state, dict(step_metrics, grad_norm=optax.tree.norm(grads))


def predict_step(params: Any, batch: dict[str, jax.Array], *, model: nn.Module,
                 head: str) -> dict[str, jax.Array]:
  """Outputs per row: logits [B, C] ('sequence'), tag ids [B, L] ('token'), or start and end
  logits [B, 2, L] ('span'); with the row's index and weight."""
  outputs = _apply(model, params, batch, True)
  if head == 'span':
    outputs = jnp.stack(outputs, axis=1)
  elif head == 'token':
    outputs = jnp.argmax(outputs, axis=-1).astype(jnp.int32)
  return {'outputs': outputs, 'index': batch['index'], 'weight': batch['weight']}


def abstract_state_and_shardings(model: nn.Module, tx: optax.GradientTransformation,
                                 mesh: jax.sharding.Mesh, rules):
  """(abstract TrainState, its NamedShardings) of a fine-tuning model, allocating nothing.

  As `train.abstract_state_and_shardings`, for models called with (ids, mask, segments).
  """
  ids = jnp.zeros((1, 8), jnp.int32)
  abstract, shardings, _ = train_lib.state_shardings(
      lambda rng: model.init({'params': rng}, ids, ids, ids, deterministic=True)['params'],
      tx, mesh, rules)
  return abstract, shardings


def init_head(abstract_params: dict, shardings: dict, initializer_range: float,
              seed: int) -> dict:
  """Fresh task-head parameters (everything but 'bert'), sharded: kernels truncated normal
  with stddev `initializer_range`, biases zero, as the model's dense layers initialize.

  Only the head is built: initializing the whole model just to discard its encoder would
  compile and run BERT's initializers for nothing.
  """
  heads = {k: v for k, v in abstract_params.items() if k != 'bert'}
  kernel_init = nn.initializers.truncated_normal(initializer_range)

  def make(rng):
    leaves, treedef = jax.tree_util.tree_flatten_with_path(heads)
    out = []
    for i, (path, leaf) in enumerate(leaves):
      name = getattr(path[-1], 'key', None)
      if name == 'kernel':
        out.append(kernel_init(jax.random.fold_in(rng, i), leaf.shape, leaf.dtype))
      elif name == 'bias':
        out.append(jnp.zeros(leaf.shape, leaf.dtype))
      else:
        raise ValueError(f'no initializer for head parameter {jax.tree_util.keystr(path)}')
    return jax.tree_util.tree_unflatten(treedef, out)

  return jax.jit(make, out_shardings={k: shardings[k] for k in heads})(jax.random.key(seed))


def _check_same_tree(loaded: Any, abstract: Any, path: str) -> None:
  want = {jax.tree_util.keystr(k): v.shape for k, v in jax.tree_util.tree_leaves_with_path(abstract)}
  have = {jax.tree_util.keystr(k): np.shape(v)
          for k, v in jax.tree_util.tree_leaves_with_path(loaded)}
  if want != have:
    diff = sorted(set(want.items()) ^ set(have.items()))[:6]
    raise ValueError(f'init_checkpoint={path}: its encoder does not match the model; '
                     f'differing (name, shape): {diff}')


# ---------------------------------------------------------------------------------------------
# Files
# ---------------------------------------------------------------------------------------------


def _registry():
  """Orbax type handlers without replica-parallel saving, which compiles a slicing program
  per distinct parameter shape on the first save (tens of seconds on CPU) and gains nothing
  for one save per epoch. The files are Orbax's standard PyTree layout."""
  scalar = ocp.type_handlers.ScalarHandler()
  return ocp.type_handlers.create_type_handler_registry(
      (jax.Array, ocp.type_handlers.ArrayHandler(use_replica_parallel=False)),
      (np.ndarray, ocp.type_handlers.NumpyHandler()),
      (int, scalar), (float, scalar), (np.number, scalar))


def _write_json(path: str, value: Any) -> None:
  tmp = path + '.tmp'
  with open(tmp, 'w') as f:
    json.dump(value, f, indent=2, sort_keys=False)
    f.write('\n')
  os.replace(tmp, path)


def _scalars(d: dict) -> dict[str, float]:
  return {k: float(v) for k, v in d.items()
          if isinstance(v, (int, float, np.number)) and not isinstance(v, bool)}


def _json_safe(d: Any) -> Any:
  if isinstance(d, dict):
    return {k: _json_safe(v) for k, v in d.items()}
  if isinstance(d, (np.integer, np.floating)):
    return d.item()
  return d


def _write_run_files(workdir, config, bert_config, vocab_file, lower_case, task) -> None:
  """Makes the workdir a loadable checkpoint folder (with its vocab and casing) + the config."""
  with open(os.path.join(workdir, 'config.json'), 'w') as f:
    f.write(config.to_json_best_effort(indent=2))
  bert_config.write_json(os.path.join(workdir, 'bert_config.json'))
  if os.path.abspath(vocab_file) != os.path.abspath(os.path.join(workdir, 'vocab.txt')):
    shutil.copyfile(vocab_file, os.path.join(workdir, 'vocab.txt'))
  _write_json(os.path.join(workdir, 'tokenizer_config.json'),
              {'do_lower_case': lower_case, 'tokenizer_class': 'BertTokenizer'})
  _write_json(os.path.join(workdir, 'task.json'),
              dict(task.info, kind=task.kind, main_metric=task.main_metric,
                   max_seq_length=config.max_seq_length, init_checkpoint=config.init_checkpoint))


# ---------------------------------------------------------------------------------------------
# The driver
# ---------------------------------------------------------------------------------------------


def finetune(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
  """Fine-tunes `config.init_checkpoint` on `config.task`; returns the best epoch's metrics.

  The result (also in <workdir>/metrics.json): task, main_metric, score (the main metric on
  the first dev set), epoch, step, learning_rate, and one dict of metrics per dev set ('dev';
  MNLI: 'dev_matched' and 'dev_mismatched'), plus 'test' for NER with predict_test.
  """
  # ---- Setup ---------------------------------------------------------------------------------
  train_lib.hide_accelerators_from_tf()
  workdir = os.path.abspath(os.path.expanduser(workdir))
  is_main = jax.process_index() == 0
  if ckpt_steps := sorted(_checkpoint_steps(workdir)):
    raise ValueError(f'{workdir} already holds a fine-tuned checkpoint (step {ckpt_steps[-1]}); '
                     'fine-tuning does not resume: use a new --workdir')
  os.makedirs(workdir, exist_ok=True)
  if config.train.epochs < 1:
    raise ValueError(f'config.train.epochs={config.train.epochs} must be at least 1')

  # ---- Mesh ----------------------------------------------------------------------------------
  mesh = sharding_lib.make_mesh(config.mesh)
  rules = sharding_lib.rules_from_config(config.mesh)
  batch_size, eval_batch_size = int(config.train.batch_size), int(config.eval.batch_size)
  sharding_lib.check_batch_size(batch_size, mesh)
  sharding_lib.check_batch_size(eval_batch_size, mesh, 'eval.batch_size')

  # ---- Pre-trained encoder, tokenizer and task data ------------------------------------------
  pre_config, pretrained, tok, vocab_file, lower_case = load_checkpoint(
      config.init_checkpoint, config.vocab_file, config.lower_case, config.model.scan_layers,
      flag='config.init_checkpoint')
  if config.max_seq_length > pre_config.max_position_embeddings:
    raise ValueError(f'config.max_seq_length={config.max_seq_length} exceeds the checkpoint\'s '
                     f'max_position_embeddings={pre_config.max_position_embeddings}')
  bert_config = pre_config.replace(
      dtype=train_lib.compute_dtype(config.model.dtype),
      hidden_dropout_prob=config.model.hidden_dropout_prob,
      attention_probs_dropout_prob=config.model.attention_probs_dropout_prob,
      scan_layers=config.model.scan_layers, remat_policy=config.model.remat_policy,
      attention_impl=config.model.attention_impl)
  task = build_task(config, tok, bert_config, lower_case)
  num_train = len(task.train['input_ids'])
  buckets = _buckets(config.buckets)
  savings = glue.padding_savings(task.train, batch_size, buckets or (config.max_seq_length,))
  logging.info('%s: %d training sequences; length buckets %s process %.0f%% of the tokens of '
               'fixed %d-token batches', config.task, num_train, buckets,
               100 * (1 - savings['tokens_saved_share']), config.max_seq_length)

  # ---- Model and optimizer -------------------------------------------------------------------
  steps_per_epoch = math.ceil(num_train / batch_size)
  total_steps = steps_per_epoch * int(config.train.epochs)
  train_cfg = ml_collections.ConfigDict(dict(
      optimizer=config.train.optimizer, learning_rate=config.train.learning_rate,
      warmup_steps=int(config.train.warmup_proportion * total_steps), decay=config.train.decay,
      beta1=config.train.beta1, beta2=config.train.beta2, eps=config.train.eps,
      weight_decay=config.train.weight_decay, max_grad_norm=config.train.max_grad_norm))
  tx, schedule = optim.make_optimizer(train_cfg, total_steps)
  if is_main:
    _write_run_files(workdir, config, pre_config, vocab_file, lower_case, task)

  # ---- Abstract init, shardings, and init: pre-trained encoder, fresh head --------------------
  abstract, shardings = abstract_state_and_shardings(task.model, tx, mesh, rules)
  _check_same_tree(pretrained['bert'], abstract.params['bert'], config.init_checkpoint)
  params = init_head(abstract.params, shardings.params, bert_config.initializer_range,
                     config.train.seed)
  params['bert'] = train_lib._put_sharded(pretrained['bert'], shardings.params['bert'])  # pylint: disable=protected-access
  ignored = sorted(set(pretrained) - {'bert'})
  logging.info('Encoder from %s; fresh head %s%s', config.init_checkpoint,
               sorted(set(params) - {'bert'}),
               f'; the checkpoint\'s heads {ignored} are not used' if ignored else '')
  del pretrained
  with sharding_lib.activate(mesh, rules):
    state = jax.jit(lambda p: TrainState(jnp.zeros((), jnp.int32), p, tx.init(p)),
                    out_shardings=shardings)(params)
  del params

  # ---- Steps ---------------------------------------------------------------------------------
  batch_sharding = sharding_lib.batch_sharding(mesh)
  replicated = NamedSharding(mesh, P())
  base_rng = train_lib.dropout_rng(config.train)
  jit_train = jax.jit(
      functools.partial(train_step, model=task.model, tx=tx, loss_fn=task.loss_fn,
                        base_rng=base_rng),
      in_shardings=(shardings, batch_sharding), out_shardings=(shardings, replicated),
      donate_argnums=0)
  jit_predict = jax.jit(functools.partial(predict_step, model=task.model, head=task.head),
                        in_shardings=(shardings.params, batch_sharding),
                        out_shardings=replicated)

  def to_device(batch):
    return sharding_lib.make_global_batch(_local_rows(batch), batch_sharding)

  def predict(params, eval_set: EvalSet) -> list[np.ndarray]:
    n = len(eval_set.features['index'])
    rows: list[Any] = [None] * n
    with sharding_lib.activate(mesh, rules):
      for batch in batches(eval_set.features, eval_batch_size, buckets):
        out = jax.device_get(jit_predict(params, to_device(batch)))
        for o, i, w in zip(out['outputs'], out['index'], out['weight']):
          if w:
            rows[i] = o
    return rows

  # ---- Checkpoints and logs ------------------------------------------------------------------
  manager = ocp.CheckpointManager(
      os.path.join(workdir, CHECKPOINT_DIR),
      item_handlers={'params': ocp.PyTreeCheckpointHandler(type_handler_registry=_registry()),
                     'meta': ocp.JsonCheckpointHandler()},
      # Saved only when the dev score improves, so the one kept is the best epoch's.
      options=ocp.CheckpointManagerOptions(max_to_keep=1, create=True,
                                           enable_async_checkpointing=False))
  log_path = os.path.join(workdir, 'metrics.jsonl')
  if is_main and os.path.exists(log_path):
    os.remove(log_path)  # From an earlier attempt that saved no checkpoint.
  log = train_lib._MetricsLog(workdir)  # pylint: disable=protected-access
  predictions_dir = os.path.join(workdir, PREDICTIONS_DIR)

  # ---- Loop ----------------------------------------------------------------------------------
  logging.info('%s: %d epochs x %d steps of %d sequences, peak lr %g, %d warmup steps',
               config.task, config.train.epochs, steps_per_epoch, batch_size,
               config.train.learning_rate, train_cfg.warmup_steps)
  bar = train_lib._progress(total_steps, 0, is_main and config.log.progress)  # pylint: disable=protected-access
  best: dict[str, Any] | None = None
  step = 0
  try:
    for epoch in range(1, int(config.train.epochs) + 1):
      history, sequences, tokens, t0 = [], 0.0, 0, time.time()
      with sharding_lib.activate(mesh, rules):
        for batch in batches(task.train, batch_size, buckets, shuffle=True,
                             seed=config.train.seed * 1_000_003 + epoch):
          state, step_metrics = jit_train(state, to_device(batch))
          step += 1
          history.append(step_metrics)
          sequences += float(batch['weight'].sum())
          tokens += batch['input_ids'].size
          bar.update(1)
          if step % config.log.every_steps == 0 or step % steps_per_epoch == 0:
            summary = train_lib.summarize(jax.device_get(history), use_nsp=True)
            if not math.isfinite(summary['loss']):
              raise FloatingPointError(f'loss is {summary["loss"]} at step {step}: lower '
                                       'config.train.learning_rate')
            elapsed = max(time.time() - t0, 1e-9)
            summary.update(epoch=epoch, learning_rate=float(schedule(step - 1)),
                           sequences_per_second=sequences / elapsed,
                           tokens_per_second=tokens / elapsed)
            log.write(step, summary, prefix='train/')
            bar.set_postfix(loss=f'{summary["loss"]:.4f}')
            history, sequences, tokens, t0 = [], 0.0, 0, time.time()

      results, writers = {}, {}
      for eval_set in task.dev:
        scores, writers[eval_set.name] = eval_set.evaluate(predict(state.params, eval_set))
        results[eval_set.name] = _json_safe(scores)
        log.write(step, _scalars(scores), prefix=f'{eval_set.name}/', split=eval_set.name,
                  epoch=epoch)
      score = float(results[task.dev[0].name][task.main_metric])
      logging.info('Epoch %d (step %d): %s', epoch, step,
                   {n: _scalars(r) for n, r in results.items()})
      bar.set_postfix(**{task.main_metric: f'{score:.4f}'})
      # A NaN score (e.g. the correlation of constant predictions) never counts as best.
      if best is None or score > best['score'] or math.isnan(best['score']):
        best = dict(task=config.task, main_metric=task.main_metric, score=score, epoch=epoch,
                    step=step, learning_rate=float(config.train.learning_rate), **results)
        manager.save(step, args=ocp.args.Composite(
            params=ocp.args.PyTreeSave(state.params), meta=ocp.args.JsonSave(best)))
        if is_main:
          for write in writers.values():
            if write:
              write(predictions_dir)
    manager.wait_until_finished()

    # ---- Test predictions with the best epoch's weights ----------------------------------------
    if task.test:
      params = state.params
      if best['step'] != step:
        params = manager.restore(best['step'], args=ocp.args.Composite(
            params=ocp.args.PyTreeRestore(abstract.params, restore_args=(
                ocp.checkpoint_utils.construct_restore_args(abstract.params)))))['params']
      for eval_set in task.test:
        scores, write = eval_set.evaluate(predict(params, eval_set))
        if scores is not None:
          best[eval_set.name] = _json_safe(scores)
          log.write(best['step'], _scalars(scores), prefix=f'{eval_set.name}/',
                    split=eval_set.name, epoch=best['epoch'])
        if write and is_main:
          write(predictions_dir)
      logging.info('Test predictions in %s', predictions_dir)
  finally:
    bar.close()
    manager.close()
    log.close()

  if is_main:
    _write_json(os.path.join(workdir, 'metrics.json'), best)
    print(f'\nbert_jax finetune {config.task}: best epoch {best["epoch"]} of '
          f'{config.train.epochs}, {task.main_metric} {best["score"]:.4f}\n'
          f'  workdir:      {workdir}\n'
          f'  metrics:      {os.path.join(workdir, "metrics.json")}\n'
          f'  TensorBoard:  tensorboard --logdir {workdir}', flush=True)
  return best


def _buckets(values) -> tuple[int, ...]:
  """config.buckets as ints (`--config.buckets=` arrives as ('',): an error, not 'none')."""
  try:
    buckets = tuple(int(b) for b in values)
  except (TypeError, ValueError):
    buckets = None
  if buckets is None or any(b < 1 for b in buckets):
    raise ValueError(f'config.buckets={tuple(values)!r}: expected positive sequence lengths, '
                     "e.g. --config.buckets=32,64,128, or --config.buckets='()' for none")
  return buckets


def _checkpoint_steps(workdir: str) -> list[int]:
  d = os.path.join(workdir, CHECKPOINT_DIR)
  if not os.path.isdir(d):
    return []
  return [int(n) for n in os.listdir(d) if n.isdigit()]


def sweep(config: ml_collections.ConfigDict, workdir: str,
          learning_rates: Sequence[float] = (5e-5, 4e-5, 3e-5, 2e-5)) -> dict[str, Any]:
  """The paper's search: one fine-tuning run per learning rate in `workdir/lr_<lr>`; the best
  dev score and its rate (also written to `workdir/sweep.json`)."""
  if not learning_rates:
    raise ValueError('sweep: no learning rates')
  runs = {}
  for lr in learning_rates:
    run_config = copy.deepcopy(config)
    with run_config.unlocked():
      run_config.train.learning_rate = float(lr)
    runs[f'{lr:g}'] = finetune(run_config, os.path.join(workdir, f'lr_{lr:g}'))
  best_lr = max(runs, key=lambda k: runs[k]['score'])
  result = {
      'task': config.task, 'main_metric': runs[best_lr]['main_metric'],
      'best_learning_rate': float(best_lr), 'best_score': runs[best_lr]['score'],
      'best_workdir': os.path.join(os.path.abspath(workdir), f'lr_{best_lr}'),
      'runs': {lr: {'score': r['score'], 'epoch': r['epoch']} for lr, r in runs.items()},
  }
  if jax.process_index() == 0:
    _write_json(os.path.join(workdir, 'sweep.json'), result)
  logging.info('Sweep: best %s %.4f at learning rate %s', result['main_metric'],
               result['best_score'], best_lr)
  return result
