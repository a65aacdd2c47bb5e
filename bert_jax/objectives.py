"""Pre-training objectives: masked language modelling, and what each second objective adds.

Every run trains the MLM head (`mlm`) on the masked positions of its rows (`masked_lm_*`).
`data.objective` names a second objective on a row's two segments; OBJECTIVES says what it adds:

  objective  pairs (pairing.py)                    head  labels 0 / 1        logged as
  nsp        B follows A, or is from another       nsp   IsNext / NotNext    nsp_loss, nsp_accuracy
             document (BERT)
  sop        A and B in their order, or swapped    nsp   in order / swapped  sop_loss, sop_accuracy
             (ALBERT)
  none       sentences fill whole rows             -     -                   -

The `nsp` head (pooled [CLS] -> 2 logits) is part of every `model.BertForPreTraining`, so
checkpoints have one layout whatever the objective (`none` leaves it untrained); HEAD_NAMES gives
its and the MLM head's names in Hugging Face and Google checkpoints. Batches carry the same
fields for every objective (`RECORD_FEATURES`; `next_sentence_labels` are 0 for `none`, and
packed rows add `next_sentence_positions` and `next_sentence_weights`, packing.py).

Losses follow the convention of every objective and fine-tuning task (`train_state.Loss`):
(sums, counts, metrics), normalized in one place (`train_state.normalize`).

Adding an objective: an entry in OBJECTIVES (a sentence-pair objective's loss and metrics come
with it; another kind of loss goes into `loss`), its pairs in `pairing.make_pairs` (which
input_pipeline calls with the objective's name; `other_documents` says whether they need more
than one document), and, for a head of its own, the head in BertForPreTraining and its names in
HEAD_NAMES.
"""

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from bert_jax import config_checks


@dataclasses.dataclass(frozen=True)
class Objective:
  """A second pre-training objective beside MLM."""
  name: str
  # The head its loss reads, a parameter group of BertForPreTraining; None: MLM alone.
  head: str | None
  # What labels 0 and 1 of a pair mean (`bert-jax data` shows them).
  label_names: tuple[str, str] | None
  # Whether its pairs draw B from another document: a batch of one document repeated then
  # cannot make them, and input_pipeline refuses a one-document input at start-up.
  other_documents: bool = False


OBJECTIVES = {
    'nsp': Objective('nsp', head='nsp', label_names=('IsNext', 'NotNext'), other_documents=True),
    'sop': Objective('sop', head='nsp', label_names=('in order', 'swapped')),
    'none': Objective('none', head=None, label_names=None),
}
# data.objective's values are defined where a config is checked; this table covers them all.
assert tuple(OBJECTIVES) == config_checks.CHOICES['data.objective']

# Heads of pre-training: our parameter group -> its (Hugging Face, Google) module names.
HEAD_NAMES = {
    'mlm/transform': ('cls.predictions.transform.dense', 'cls/predictions/transform/dense'),
    'mlm/layer_norm': ('cls.predictions.transform.LayerNorm',
                       'cls/predictions/transform/LayerNorm'),
    'mlm': ('cls.predictions', 'cls/predictions'),
    'nsp': ('cls.seq_relationship', 'cls/seq_relationship'),
}

# The features of a batch of one-sequence rows, and of a record of create_pretraining_data.py:
# name -> (length: 'seq_len', 'max_predictions' or 1, dtype).
RECORD_FEATURES = {
    'input_ids': ('seq_len', 'int64'), 'input_mask': ('seq_len', 'int64'),
    'segment_ids': ('seq_len', 'int64'),
    # MLM: the masked positions, their original tokens, and 1.0 for a real prediction.
    'masked_lm_positions': ('max_predictions', 'int64'),
    'masked_lm_ids': ('max_predictions', 'int64'),
    'masked_lm_weights': ('max_predictions', 'float32'),
    # The second objective's label (0 for `none`).
    'next_sentence_labels': (1, 'int64'),
}


def get(name: str) -> Objective:
  """The objective `data.objective` names."""
  config_checks.check_choice('data.objective', name)  # For a direct caller.
  return OBJECTIVES[name]


def nll(logits: jax.Array, labels: jax.Array) -> jax.Array:
  """-log softmax(logits)[label] in float32: every loss of pre-training and fine-tuning
  (`tasks.py`) is built from it. A negative label (an ignored position) picks nothing: weight
  it out.

  As logsumexp minus the label's logit picked by a one-hot mask: its gradient, softmax -
  one_hot, is elementwise. Picking with `take_along_axis` made the gradient a scatter into an
  all-zeros f32 [B, P, vocab] tensor (875 MB at BERT-base/128)."""
  logits = logits.astype(jnp.float32)
  picked = jnp.sum(jnp.where(jax.nn.one_hot(labels, logits.shape[-1], dtype=jnp.bool_),
                             logits, 0.0), axis=-1)
  return jax.nn.logsumexp(logits, axis=-1) - picked


def mlm_loss(logits: jax.Array, batch: dict[str, jax.Array]):
  """MLM cross-entropy of [B, P, V] logits, weighted by `masked_lm_weights`: (sums, counts,
  metrics) of the term 'mlm'."""
  weights = batch['masked_lm_weights'].astype(jnp.float32)
  labels = batch['masked_lm_ids']
  total, count = jnp.sum(nll(logits, labels) * weights), jnp.sum(weights)
  correct = jnp.sum((jnp.argmax(logits, -1) == labels) * weights)
  # A batch without predictions gives 0: `train_state.normalize` floors every count at 1 (the
  # original's sum(weights) + 1e-5, without its 1e-5 bias on the mean).
  return ({'mlm': total}, {'mlm': count},
          {'mlm_loss': (total, count), 'mlm_accuracy': (correct, count)})


def sentence_loss(logits: jax.Array, batch: dict[str, jax.Array], name: str):
  """Cross-entropy of the pair labels, per sequence: one per row ([B, 2] logits), or with
  packed rows ([B, S, 2]) one per entry of `next_sentence_weights` [B, S]. (sums, counts,
  metrics) of the term `name`, logged as `<name>_loss` and `<name>_accuracy`."""
  labels = batch['next_sentence_labels'].reshape(-1)
  logits = logits.reshape(-1, logits.shape[-1])
  if 'next_sentence_weights' in batch:  # Packed rows: their sequences, not their slots.
    real = batch['next_sentence_weights'].reshape(-1).astype(jnp.float32)
  elif 'input_mask' in batch:
    # Rows that fill up the last evaluation batch have no tokens ([CLS] is always unmasked in
    # a real example): they count for neither loss nor accuracy.
    real = batch['input_mask'][:, 0].astype(jnp.float32)
  else:
    real = jnp.ones(labels.shape, jnp.float32)
  count = jnp.sum(real)
  total = jnp.sum(nll(logits, labels) * real)
  correct = jnp.sum((jnp.argmax(logits, -1) == labels) * real)
  return ({name: total}, {name: count},
          {f'{name}_loss': (total, count), f'{name}_accuracy': (correct, count)})


def loss(objective: Objective, outputs: tuple[jax.Array, jax.Array],
         batch: dict[str, jax.Array]) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
  """MLM plus the objective's own term, from BertForPreTraining's (MLM, sentence) logits."""
  mlm_logits, sentence_logits = outputs
  sums, counts, metrics = mlm_loss(mlm_logits, batch)
  if objective.head is not None:
    more = sentence_loss(sentence_logits, batch, objective.name)
    for part, extra in zip((sums, counts, metrics), more):
      part.update(extra)
  return sums, counts, metrics
