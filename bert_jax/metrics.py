"""Task metrics in pure numpy: GLUE, SQuAD v1.1/v2.0 (official normalisation) and entity-level NER.

Semantics follow the reference scorers: GLUE's (scikit-learn / scipy definitions), the official
SQuAD evaluation scripts (v2.0 adds no-answer handling and the best-threshold search) and
seqeval's default (non-strict) chunking for IOB1/IOB2 tags.
"""

import collections
import re
import string
from typing import Iterable, Mapping, Sequence

from absl import logging
import numpy as np

# ---------------------------------------------------------------------------------------------
# Classification and regression
# ---------------------------------------------------------------------------------------------


def _as_class_ids(preds) -> np.ndarray:
  """Class ids from ids [N] or logits [N, C]."""
  preds = np.asarray(preds)
  return preds.argmax(-1) if preds.ndim == 2 else preds.astype(np.int64)


def _check_same_length(preds: np.ndarray, labels: np.ndarray) -> None:
  if preds.shape[0] != labels.shape[0]:
    raise ValueError(f'predictions ({preds.shape[0]}) and labels ({labels.shape[0]}) differ in '
                     'length')
  if preds.shape[0] == 0:
    raise ValueError('metrics of an empty set of predictions are undefined')


def accuracy(preds, labels) -> float:
  """Share of exact matches; `preds` may be class ids [N] or logits [N, C]."""
  preds, labels = _as_class_ids(preds), np.asarray(labels)
  _check_same_length(preds, labels)
  return float(np.mean(preds == labels))


def f1_binary(preds, labels, positive: int = 1) -> float:
  """F1 of the positive class (0 when there are no true or predicted positives)."""
  preds, labels = _as_class_ids(preds), np.asarray(labels)
  _check_same_length(preds, labels)
  tp = np.sum((preds == positive) & (labels == positive))
  fp = np.sum((preds == positive) & (labels != positive))
  fn = np.sum((preds != positive) & (labels == positive))
  denom = 2 * tp + fp + fn
  return float(2 * tp / denom) if denom else 0.0


def matthews_corrcoef(preds, labels) -> float:
  """Matthews correlation (multiclass form of Gorodkin 2004; 0 when undefined, as sklearn)."""
  preds, labels = _as_class_ids(preds), np.asarray(labels)
  _check_same_length(preds, labels)
  classes = np.union1d(preds, labels)
  p = np.searchsorted(classes, preds)
  t = np.searchsorted(classes, labels)
  k = len(classes)
  confusion = np.zeros((k, k), np.float64)
  np.add.at(confusion, (t, p), 1)
  t_sum, p_sum = confusion.sum(1), confusion.sum(0)
  n, correct = confusion.sum(), np.trace(confusion)
  cov_tp = correct * n - t_sum @ p_sum
  cov_pp = n * n - p_sum @ p_sum
  cov_tt = n * n - t_sum @ t_sum
  if cov_pp * cov_tt == 0:
    return 0.0
  return float(cov_tp / np.sqrt(cov_pp * cov_tt))


def pearson(x, y) -> float:
  """Pearson correlation of two 1-D float arrays."""
  x = np.asarray(x, np.float64).reshape(-1)
  y = np.asarray(y, np.float64).reshape(-1)
  _check_same_length(x, y)
  xc, yc = x - x.mean(), y - y.mean()
  denom = np.sqrt((xc @ xc) * (yc @ yc))
  return float(xc @ yc / denom) if denom else float('nan')


def rank_average(x) -> np.ndarray:
  """Ranks starting at 1, tied values sharing the average of their ranks (scipy's 'average')."""
  x = np.asarray(x).reshape(-1)
  order = np.argsort(x, kind='stable')
  sorted_x = x[order]
  # Each run of equal values [start, end) gets rank (start + 1 + end) / 2.
  boundaries = np.flatnonzero(np.concatenate([[True], sorted_x[1:] != sorted_x[:-1], [True]]))
  run_ranks = (boundaries[:-1] + 1 + boundaries[1:]) / 2.0
  ranks = np.empty(len(x), np.float64)
  ranks[order] = np.repeat(run_ranks, np.diff(boundaries))
  return ranks


def spearman(x, y) -> float:
  """Spearman rank correlation: Pearson of average ranks (handles ties)."""
  return pearson(rank_average(x), rank_average(y))


_GLUE_METRICS = {
    'cola': ('mcc',),
    'sst2': ('accuracy',),
    'mrpc': ('f1', 'accuracy', 'acc_and_f1'),
    'qqp': ('f1', 'accuracy', 'acc_and_f1'),
    'stsb': ('pearson', 'spearman', 'pearson_and_spearman'),
    'mnli': ('accuracy',),
    'mnli_matched': ('accuracy',),
    'mnli_mismatched': ('accuracy',),
    'qnli': ('accuracy',),
    'rte': ('accuracy',),
    'wnli': ('accuracy',),
    'ax': ('mcc',),
}


def canonical_task(task: str) -> str:
  """'SST-2', 'sst_2', 'MNLI-mm' ... -> 'sst2', 'mnli_mismatched'; unknown names are an error."""
  name = task.lower().replace('-', '').replace('_', '')
  name = {'mnlim': 'mnli_matched', 'mnlimm': 'mnli_mismatched', 'mnlimatched': 'mnli_matched',
          'mnlimismatched': 'mnli_mismatched', 'diagnostic': 'ax'}.get(name, name)
  if name not in _GLUE_METRICS:
    raise ValueError(f'unknown GLUE task {task!r}; known: {sorted(_GLUE_METRICS)}')
  return name


def glue_metric_names(task: str) -> tuple[str, ...]:
  return _GLUE_METRICS[canonical_task(task)]


def glue_metrics(task: str, preds, labels) -> dict[str, float]:
  """The GLUE leaderboard metrics of `task` (preds: class ids, logits, or scores for STS-B)."""
  name = canonical_task(task)
  if name == 'stsb':
    p, s = pearson(preds, labels), spearman(preds, labels)
    return {'pearson': p, 'spearman': s, 'pearson_and_spearman': (p + s) / 2}
  if name in ('cola', 'ax'):
    return {'mcc': matthews_corrcoef(preds, labels)}
  acc = accuracy(preds, labels)
  if name in ('mrpc', 'qqp'):
    f1 = f1_binary(preds, labels)
    return {'f1': f1, 'accuracy': acc, 'acc_and_f1': (acc + f1) / 2}
  return {'accuracy': acc}


# ---------------------------------------------------------------------------------------------
# SQuAD (official v1.1 / v2.0 evaluation)
# ---------------------------------------------------------------------------------------------

_ARTICLES = re.compile(r'\b(a|an|the)\b', re.UNICODE)
_PUNCTUATION = frozenset(string.punctuation)


def normalize_answer(text: str) -> str:
  """Lower-case, drop punctuation, drop the articles a/an/the, collapse whitespace."""
  text = text.lower()
  text = ''.join(c for c in text if c not in _PUNCTUATION)
  text = _ARTICLES.sub(' ', text)
  return ' '.join(text.split())


def squad_exact(gold: str, pred: str) -> int:
  return int(normalize_answer(gold) == normalize_answer(pred))


def squad_f1(gold: str, pred: str) -> float:
  """Token-overlap F1 of the normalised answers (v2.0: empty vs empty counts as a match)."""
  gold_toks, pred_toks = normalize_answer(gold).split(), normalize_answer(pred).split()
  if not gold_toks or not pred_toks:
    return float(gold_toks == pred_toks)
  common = collections.Counter(gold_toks) & collections.Counter(pred_toks)
  num_same = sum(common.values())
  if num_same == 0:
    return 0.0
  precision, recall = num_same / len(pred_toks), num_same / len(gold_toks)
  return 2 * precision * recall / (precision + recall)


def squad_gold_answers(dataset: Sequence[Mapping]) -> dict[str, list[str]]:
  """qid -> gold answer texts from the official JSON's `data` list; [''] for no-answer."""
  gold = {}
  for article in dataset:
    for paragraph in article['paragraphs']:
      for qa in paragraph['qas']:
        answers = [a['text'] for a in qa.get('answers', []) if normalize_answer(a['text'])]
        gold[qa['id']] = answers or ['']
  return gold


def _best_threshold(preds, scores, null_odds, has_ans) -> tuple[float, float]:
  """The official v2.0 sweep: answer only when null odds <= threshold; best score and threshold."""
  score = best_score = float(sum(not has_ans[q] for q in scores))
  best_thresh = 0.0
  for qid in sorted(scores, key=lambda q: null_odds[q]):
    if has_ans[qid]:
      score += scores[qid]
    else:
      score += -1.0 if preds[qid] else 0.0
    if score > best_score:
      best_score, best_thresh = score, null_odds[qid]
  return 100.0 * best_score / len(scores), best_thresh


def squad_evaluate(gold: Mapping[str, Sequence[str]] | Sequence[Mapping],
                   predictions: Mapping[str, str],
                   null_odds: Mapping[str, float] | None = None,
                   null_odds_threshold: float = 1.0) -> dict[str, float]:
  """EM/F1 (in %) as the official scripts, v2.0 extras when there are no-answer questions.

  Args:
    gold: qid -> gold texts (empty list or only empty texts: no answer), or the official
      JSON's `data` list (see `squad_gold_answers`).
    predictions: qid -> predicted text ('' = no answer). Missing questions score 0 (logged).
    null_odds: qid -> null score minus best span score; with it, an answer is replaced by ''
      when its odds exceed `null_odds_threshold`, and best_exact/best_f1 and their thresholds
      are searched.
    null_odds_threshold: as the official script's --na-prob-thresh.
  """
  if isinstance(gold, Mapping):
    gold = {q: [a for a in answers if normalize_answer(a)] or [''] for q, answers in gold.items()}
  else:
    gold = squad_gold_answers(gold)
  if not gold:
    raise ValueError('no gold questions to evaluate')
  missing = [q for q in gold if q not in predictions]
  if missing:
    logging.warning('SQuAD eval: %d of %d questions have no prediction (scored 0), e.g. %s',
                    len(missing), len(gold), missing[:3])
  preds = {q: predictions.get(q, None) for q in gold}
  exact, f1 = {}, {}
  for qid, answers in gold.items():
    if preds[qid] is None:
      exact[qid] = f1[qid] = 0.0
    else:
      exact[qid] = float(max(squad_exact(a, preds[qid]) for a in answers))
      f1[qid] = max(squad_f1(a, preds[qid]) for a in answers)
  has_ans = {q: bool(a[0]) for q, a in gold.items()}
  preds = {q: p or '' for q, p in preds.items()}
  raw_exact, raw_f1 = dict(exact), dict(f1)
  if null_odds is not None:
    odds = {q: float(null_odds.get(q, 0.0)) for q in gold}
    for qid in gold:
      if odds[qid] > null_odds_threshold:
        exact[qid] = f1[qid] = float(not has_ans[qid])

  def summary(qids: list[str], prefix: str) -> dict[str, float]:
    return {f'{prefix}exact': 100.0 * sum(exact[q] for q in qids) / len(qids),
            f'{prefix}f1': 100.0 * sum(f1[q] for q in qids) / len(qids),
            f'{prefix}total': len(qids)}

  result = summary(list(gold), '')
  has_ans_qids = [q for q in gold if has_ans[q]]
  no_ans_qids = [q for q in gold if not has_ans[q]]
  if no_ans_qids:  # SQuAD v2.0.
    if has_ans_qids:
      result.update(summary(has_ans_qids, 'HasAns_'))
    result.update(summary(no_ans_qids, 'NoAns_'))
  if null_odds is not None:
    # The sweep starts from the raw (unthresholded) scores, as the official script does.
    result['best_exact'], result['best_exact_thresh'] = _best_threshold(
        preds, raw_exact, odds, has_ans)
    result['best_f1'], result['best_f1_thresh'] = _best_threshold(preds, raw_f1, odds, has_ans)
  return result


# ---------------------------------------------------------------------------------------------
# Entity-level NER (seqeval default mode)
# ---------------------------------------------------------------------------------------------


def _split_tag(tag: str) -> tuple[str, str]:
  """'B-PER' -> ('B', 'PER'); 'O' -> ('O', '_'), as seqeval splits prefix and type."""
  return tag[:1], tag[1:].split('-', 1)[-1] or '_'


def _ends_chunk(prev_tag, tag, prev_type, type_) -> bool:
  if prev_tag in ('E', 'S'):
    return True
  if prev_tag in ('B', 'I') and tag in ('B', 'S', 'O'):
    return True
  return prev_tag not in ('O', '.') and prev_type != type_


def _starts_chunk(prev_tag, tag, prev_type, type_) -> bool:
  if tag in ('B', 'S'):
    return True
  if prev_tag in ('E', 'S', 'O') and tag in ('E', 'I'):
    return True
  return tag not in ('O', '.') and prev_type != type_


def get_entities(tags: Sequence[str]) -> list[tuple[str, int, int]]:
  """Chunks (type, first, last) of one tag sequence, by seqeval's default (lenient) rules.

  An I- tag after O or after a different type opens a new chunk, so the same function serves
  IOB1 and IOB2 (and IOBES).
  """
  chunks = []
  prev_tag, prev_type, begin = 'O', '', 0
  for i, chunk in enumerate(list(tags) + ['O']):
    tag, type_ = _split_tag(chunk)
    if _ends_chunk(prev_tag, tag, prev_type, type_):
      chunks.append((prev_type, begin, i - 1))
    if _starts_chunk(prev_tag, tag, prev_type, type_):
      begin = i
    prev_tag, prev_type = tag, type_
  return chunks


def _prf(correct: int, n_pred: int, n_true: int) -> tuple[float, float, float]:
  p = correct / n_pred if n_pred else 0.0
  r = correct / n_true if n_true else 0.0
  return p, r, (2 * p * r / (p + r) if p + r else 0.0)


def ner_metrics(y_true: Iterable[Sequence[str]],
                y_pred: Iterable[Sequence[str]]) -> dict[str, object]:
  """Micro precision/recall/F1 over exact entity matches, per-type scores, token accuracy."""
  y_true, y_pred = list(y_true), list(y_pred)
  if len(y_true) != len(y_pred):
    raise ValueError(f'{len(y_true)} gold sentences but {len(y_pred)} predicted')
  true_set, pred_set = set(), set()
  tokens = correct_tokens = 0
  for i, (t, p) in enumerate(zip(y_true, y_pred)):
    if len(t) != len(p):
      raise ValueError(f'sentence {i}: {len(t)} gold tags but {len(p)} predicted')
    true_set.update((i,) + e for e in get_entities(t))
    pred_set.update((i,) + e for e in get_entities(p))
    tokens += len(t)
    correct_tokens += sum(a == b for a, b in zip(t, p))
  correct = true_set & pred_set
  precision, recall, f1 = _prf(len(correct), len(pred_set), len(true_set))
  per_type = {}
  for type_ in sorted({e[1] for e in true_set | pred_set}):
    n_c = sum(e[1] == type_ for e in correct)
    n_p = sum(e[1] == type_ for e in pred_set)
    n_t = sum(e[1] == type_ for e in true_set)
    p, r, f = _prf(n_c, n_p, n_t)
    per_type[type_] = {'precision': p, 'recall': r, 'f1': f, 'support': n_t}
  return {'precision': precision, 'recall': recall, 'f1': f1,
          'accuracy': correct_tokens / tokens if tokens else 0.0, 'per_type': per_type}
