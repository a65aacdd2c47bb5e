"""Tests for bert_jax.metrics: GLUE metrics against scipy and closed forms, the official SQuAD
scoring rules, and seqeval's documented entity semantics."""

import numpy as np
import pytest

from bert_jax import metrics


# ---- Classification / regression --------------------------------------------------------------


def test_accuracy_and_f1_by_hand():
  preds = np.array([1, 1, 0, 0, 1, 0])
  labels = np.array([1, 0, 0, 1, 1, 0])
  # tp=2, fp=1, fn=1, tn=2.
  assert metrics.accuracy(preds, labels) == pytest.approx(4 / 6)
  assert metrics.f1_binary(preds, labels) == pytest.approx(2 * 2 / (2 * 2 + 1 + 1))
  logits = np.eye(2)[preds] * 3.0 - 1.0
  assert metrics.accuracy(logits, labels) == metrics.accuracy(preds, labels)
  assert metrics.f1_binary(np.zeros(4, int), np.zeros(4, int)) == 0.0  # No positives at all.


def test_mcc_equals_phi_coefficient_on_binary_data():
  # For 0/1 variables Matthews' coefficient is the Pearson correlation (phi).
  rng = np.random.default_rng(0)
  for _ in range(5):
    labels = rng.integers(0, 2, 200)
    preds = np.where(rng.random(200) < 0.7, labels, 1 - labels)
    assert metrics.matthews_corrcoef(preds, labels) == pytest.approx(
        np.corrcoef(preds, labels)[0, 1], abs=1e-12)


def test_mcc_known_values():
  # scikit-learn's documented example: [+1, +1, +1, -1] vs [+1, -1, +1, +1] -> -0.333...
  assert metrics.matthews_corrcoef([1, -1, 1, 1], [1, 1, 1, -1]) == pytest.approx(-1 / 3)
  assert metrics.matthews_corrcoef([0, 1, 2, 2], [0, 1, 2, 2]) == pytest.approx(1.0)
  assert metrics.matthews_corrcoef([1, 1, 1], [0, 1, 0]) == 0.0  # Constant predictions.


def test_pearson_spearman_match_scipy_with_ties():
  stats = pytest.importorskip('scipy.stats')
  rng = np.random.default_rng(1)
  x = rng.integers(0, 6, 300).astype(float)  # Many ties, as STS-B's 0-5 scores have.
  y = x + rng.normal(0, 1.5, 300)
  y[:50] = np.round(y[:50])
  assert metrics.pearson(x, y) == pytest.approx(stats.pearsonr(x, y)[0], abs=1e-12)
  assert metrics.spearman(x, y) == pytest.approx(stats.spearmanr(x, y)[0], abs=1e-12)
  np.testing.assert_allclose(metrics.rank_average([3, 1, 3, 2, 3]), [4, 1, 4, 2, 4])


def test_glue_metrics_per_task():
  preds, labels = np.array([1, 0, 1, 1]), np.array([1, 0, 0, 1])
  m = metrics.glue_metrics('MRPC', preds, labels)
  assert set(m) == {'f1', 'accuracy', 'acc_and_f1'}
  assert m['acc_and_f1'] == pytest.approx((m['f1'] + m['accuracy']) / 2)
  assert set(metrics.glue_metrics('cola', preds, labels)) == {'mcc'}
  for task in ('SST-2', 'qnli', 'rte', 'wnli', 'mnli', 'MNLI-mm'):
    assert set(metrics.glue_metrics(task, preds, labels)) == {'accuracy'}
  s = metrics.glue_metrics('sts-b', [0.1, 2.0, 3.5, 4.0], [0.0, 2.5, 3.0, 5.0])
  assert s['spearman'] == pytest.approx(1.0)
  assert s['pearson_and_spearman'] == pytest.approx((s['pearson'] + 1.0) / 2)
  with pytest.raises(ValueError, match='unknown GLUE task'):
    metrics.glue_metrics('squad', preds, labels)
  with pytest.raises(ValueError, match='differ in length'):
    metrics.accuracy([1, 0], [1])


# ---- SQuAD --------------------------------------------------------------------------------------


def test_normalize_answer_official_rules():
  assert metrics.normalize_answer('The  Cat\'s (1990)!') == 'cats 1990'
  assert metrics.normalize_answer('An apple, a theater') == 'apple theater'  # Whole words only.
  assert metrics.normalize_answer('U.S.') == 'us'
  assert metrics.normalize_answer('  ') == ''


def test_squad_f1_and_exact():
  assert metrics.squad_f1('the cat sat', 'cat sat on') == pytest.approx(0.8)
  assert metrics.squad_exact('The Cat', 'cat.') == 1
  assert metrics.squad_f1('', '') == 1.0  # v2.0: both empty is a match.
  assert metrics.squad_f1('a', 'cat') == 0.0  # Gold normalises to empty, prediction does not.
  assert metrics.squad_f1('cat cat dog', 'cat dog dog') == pytest.approx(2 / 3)


def test_squad_evaluate_v1_takes_max_over_gold_answers():
  gold = {'q1': ['Denver Broncos', 'The Denver Broncos'], 'q2': ['1990', 'in 1990'],
          'q3': ['Paris']}
  preds = {'q1': 'the denver broncos', 'q2': '1990 season'}
  result = metrics.squad_evaluate(gold, preds)
  assert result['exact'] == pytest.approx(100 / 3)  # q1 only; q3 missing scores 0.
  # q2: best gold '1990' vs '1990 season' -> p=1/2, r=1 -> 2/3.
  assert result['f1'] == pytest.approx(100 * (1 + 2 / 3 + 0) / 3)
  assert result['total'] == 3 and 'HasAns_exact' not in result


def test_squad_evaluate_official_json_and_v2_threshold_search():
  data = [{'paragraphs': [{'context': 'x', 'qas': [
      {'id': 'a', 'answers': [{'text': 'red', 'answer_start': 0}]},
      {'id': 'b', 'answers': [{'text': 'blue sky', 'answer_start': 0}]},
      {'id': 'c', 'answers': [], 'is_impossible': True},
      {'id': 'd', 'answers': [], 'is_impossible': True}]}]}]
  preds = {'a': 'red', 'b': 'sky', 'c': 'green', 'd': ''}
  odds = {'a': -2.0, 'b': 0.5, 'c': 1.0, 'd': 3.0}
  result = metrics.squad_evaluate(data, preds, odds, null_odds_threshold=0.8)
  # Threshold 0.8: c becomes '' (correct); a, b, d keep their predictions.
  assert result['exact'] == pytest.approx(100 * (1 + 0 + 1 + 1) / 4)
  assert result['HasAns_total'] == 2 and result['NoAns_total'] == 2
  assert result['HasAns_f1'] == pytest.approx(100 * (1 + 2 / 3) / 2)
  assert result['NoAns_exact'] == 100.0
  # Sweep over raw scores: start 2 (all null); a +1 -> 3 (t=-2); b +0 (exact); c -1; d 0.
  assert result['best_exact'] == pytest.approx(75.0)
  assert result['best_exact_thresh'] == -2.0
  # F1: a +1 -> 3 at -2; b +2/3 -> 3.667 at 0.5; c -1.
  assert result['best_f1'] == pytest.approx(100 * (2 + 1 + 2 / 3) / 4)
  assert result['best_f1_thresh'] == 0.5


# ---- NER ----------------------------------------------------------------------------------------


def test_seqeval_readme_example():
  y_true = [['O', 'O', 'O', 'B-MISC', 'I-MISC', 'I-MISC', 'O'], ['B-PER', 'I-PER', 'O']]
  y_pred = [['O', 'O', 'B-MISC', 'I-MISC', 'I-MISC', 'I-MISC', 'O'], ['B-PER', 'I-PER', 'O']]
  m = metrics.ner_metrics(y_true, y_pred)
  assert m['f1'] == pytest.approx(0.5)
  assert m['precision'] == pytest.approx(0.5) and m['recall'] == pytest.approx(0.5)
  assert m['accuracy'] == pytest.approx(0.8)
  assert m['per_type']['PER']['f1'] == 1.0 and m['per_type']['MISC']['f1'] == 0.0


def test_get_entities_lenient_iob1_iob2():
  assert metrics.get_entities(['B-PER', 'I-PER', 'O', 'B-LOC']) == [('PER', 0, 1),
                                                                   ('LOC', 3, 3)]
  # IOB1: chunks open with I-; B- only separates adjacent chunks of one type.
  assert metrics.get_entities(['I-PER', 'I-PER', 'B-PER', 'O', 'I-LOC']) == [
      ('PER', 0, 1), ('PER', 2, 2), ('LOC', 4, 4)]
  # An I- of another type opens a new chunk (seqeval default mode, not strict).
  assert metrics.get_entities(['B-PER', 'I-LOC', 'I-LOC']) == [('PER', 0, 0), ('LOC', 1, 2)]
  assert metrics.get_entities(['O', 'I-MISC']) == [('MISC', 1, 1)]
  assert metrics.get_entities(['S-PER', 'B-LOC', 'E-LOC']) == [('PER', 0, 0), ('LOC', 1, 2)]


def test_ner_entities_do_not_cross_sentences_and_shapes_checked():
  m = metrics.ner_metrics([['B-PER'], ['I-PER']], [['B-PER'], ['I-PER']])
  assert m['per_type']['PER']['support'] == 2
  with pytest.raises(ValueError, match='sentence 0'):
    metrics.ner_metrics([['O', 'O']], [['O']])
