"""Tests for bert_jax.squad on crafted contexts (windows, max context, answer projection)."""

import json
import logging
import string

import ml_collections
import numpy as np
import pytest

from bert_jax import batching
from bert_jax import config_files
from bert_jax import metrics
from bert_jax import model as model_lib
from bert_jax import squad
from bert_jax import tokenization
from bert_jax.errors import UserError

# 40 distinct one-token words for window arithmetic.
_W = [f'w{i:02d}' for i in range(40)]
_CONTEXT = ('He was born in Paris (1990) and   moved to the U.S. later;\n'
            'a well-known Café Müller.')


@pytest.fixture(scope='module')
def tok(tmp_path_factory):
  vocab = (['[PAD]', '[UNK]', '[CLS]', '[SEP]', '[MASK]'] + list(string.punctuation) +
           list(string.ascii_lowercase) + ['##' + c for c in string.ascii_lowercase] +
           list(string.digits) + ['##' + c for c in string.digits] + _W +
           ['paris', 'born', 'who', 'when', 'where'])
  path = tmp_path_factory.mktemp('vocab') / 'vocab.txt'
  path.write_text('\n'.join(vocab) + '\n')
  return tokenization.load_tokenizer(str(path), lower_case=True)


def _qa(qid, question, answers, impossible=None):
  qa = {'id': qid, 'question': question,
        'answers': [{'text': t, 'answer_start': s} for t, s in answers]}
  if impossible is not None:
    qa['is_impossible'] = impossible
  return qa


def _dataset(context, qas):
  return {'version': 'test', 'data': [{'title': 't', 'paragraphs': [
      {'context': context, 'qas': qas}]}]}


def _answer(text, occurrence=0):
  start = -1
  for _ in range(occurrence + 1):
    start = _CONTEXT.index(text, start + 1)
  return text, start


def test_read_words_offsets_and_training_spans(caplog):
  data = _dataset(_CONTEXT, [
      _qa('year', 'when', [_answer('1990')]),
      _qa('us', 'where', [_answer('U.S.')]),
      _qa('span', 'who', [_answer('well-known Café')]),
      _qa('bad', 'who', [('Paris', 0)])])  # answer_start does not point at the text.
  with caplog.at_level(logging.WARNING):
    examples = squad.read_squad(data, is_training=True)
  assert examples[0].doc_tokens == ['He', 'was', 'born', 'in', 'Paris', '(1990)', 'and', 'moved',
                                    'to', 'the', 'U.S.', 'later;', 'a', 'well-known', 'Café',
                                    'Müller.']
  assert [(e.qas_id, e.start_position, e.end_position) for e in examples] == [
      ('year', 5, 5), ('us', 10, 10), ('span', 13, 14)]
  assert 'skipped 1 questions' in caplog.text
  words, char_to_word = squad.split_context('ab  c')
  assert words == ['ab', 'c'] and char_to_word == [0, 0, 0, 0, 1]


def test_training_positions_tighten_to_the_answer_tokens(tok):
  data = _dataset(_CONTEXT, [_qa('year', 'when', [_answer('1990')]),
                             _qa('name', 'who', [_answer('Müller')])])
  examples = squad.read_squad(data, is_training=True)
  f = squad.convert_examples(examples, tok, 64, 32, 16, is_training=True)
  assert 'tokens' not in f  # Token strings are only kept for decoding.
  spans = [tok.decode(f['input_ids'][i][f['start_positions'][i]:f['end_positions'][i] + 1])
           for i in range(2)]
  assert spans == [['1', '##9', '##9', '##0'], ['m', '##u', '##l', '##l', '##e', '##r']]
  assert tok.decode(f['input_ids'][0][:3]) == ['[CLS]', 'when', '[SEP]']
  np.testing.assert_array_equal(f['segment_ids'][0][:4], [0, 0, 0, 1])


def _long_examples(answer_word, is_training=True):
  context = ' '.join(_W)
  start = context.index(_W[answer_word])
  return squad.read_squad(_dataset(context, [_qa('q', 'who', [(_W[answer_word], start)])]),
                          is_training=is_training)


def test_windows_and_max_context(tok):
  # Query 'who' = 1 token: 20 - 1 - 3 = 16 document tokens a window, stride 8.
  examples = _long_examples(12)
  f = squad.convert_examples(examples, tok, 20, 8, 8, is_training=True)
  assert f['input_ids'].shape == (4, 20)
  np.testing.assert_array_equal(f['doc_span_index'], [0, 1, 2, 3])
  np.testing.assert_array_equal(f['example_index'], [0, 0, 0, 0])
  starts = [int(f['token_to_orig'][i][3]) for i in range(4)]
  assert starts == [0, 8, 16, 24]
  # Word 12 is in windows 0 and 1; in the overlap, training positions mark both.
  np.testing.assert_array_equal(f['start_positions'], [3 + 12, 3 + 4, 0, 0])
  np.testing.assert_array_equal(f['start_positions'], f['end_positions'])
  # Every word is the max-context token of exactly one window: the one where it is most
  # central (word 12: 3 left-or-right in window 0, 4 in window 1).
  owner = {}
  for i in range(4):
    for p in np.flatnonzero(f['token_is_max_context'][i]):
      word = int(f['token_to_orig'][i][p])
      assert word not in owner
      owner[word] = i
  assert sorted(owner) == list(range(40))
  assert (owner[4], owner[12], owner[14], owner[20], owner[39]) == (0, 1, 1, 2, 3)


def test_max_context_matches_the_scalar_rule_with_ties():
  def scalar_best(spans, position):  # The rule, one token at a time; ties: first window.
    best, best_index = None, None
    for i, (start, length) in enumerate(spans):
      if start <= position < start + length:
        score = min(position - start, start + length - 1 - position) + 0.01 * length
        if best is None or score > best:
          best, best_index = score, i
    return best_index

  for num_tokens, window, stride in ((40, 16, 7), (40, 16, 8), (100, 30, 13), (5, 16, 8),
                                     (61, 10, 1)):
    spans = squad._doc_spans(num_tokens, window, stride)
    assert spans[-1][0] + spans[-1][1] == num_tokens
    expected = [scalar_best(spans, p) for p in range(num_tokens)]
    np.testing.assert_array_equal(squad._max_context_windows(spans, num_tokens), expected)
  spans = squad._doc_spans(40, 16, 7)
  assert squad._max_context_windows(spans, 40)[11] == 0  # Tied 4 vs 4: the first window.


def test_decode_uses_the_max_context_window(tok):
  examples = _long_examples(12, is_training=False)
  f = squad.convert_examples(examples, tok, 20, 8, 8)
  start = np.full((4, 20), -100.0)
  end = np.full((4, 20), -100.0)
  # Window 0 strongly prefers word 12, but word 12 has more context in window 1, where the
  # best span is word 14: the decoder must answer word 14.
  start[0, 3 + 12] = end[0, 3 + 12] = 50.0
  start[1, 3 + 6] = end[1, 3 + 6] = 5.0
  preds, odds, nbest = squad.decode_predictions(examples, f, start, end)
  assert preds == {'q': 'w14'} and odds == {}
  assert nbest['q'][0]['text'] == 'w14'
  assert sum(n['probability'] for n in nbest['q']) == pytest.approx(1.0)
  assert len({n['text'] for n in nbest['q']}) == len(nbest['q'])
  # Shorter (bucketed) logit rows decode the same.
  preds, _, _ = squad.decode_predictions(examples, f, start[:, :19], end[:, :19])
  assert preds == {'q': 'w14'}


@pytest.mark.parametrize('tokens,expected', [
    (['1', '##9', '##9', '##0'], '1990'),
    (['(', '1', '##9', '##9', '##0', ')'], '(1990)'),
    (['u', '.', 's', '.'], 'U.S.'),
    (['w', '##e', '##l', '##l', '-', 'k', '##n', '##o', '##w', '##n'], 'well-known'),
    (['c', '##a', '##f', '##e', 'm', '##u', '##l', '##l', '##e', '##r'], 'Café Müller'),
    # A span ending inside a word ends inside it in the original text too (as the original).
    (['t', '##h', '##e', 'u', '.', 's', '.', 'l'], 'the U.S. l'),
])
def test_decode_projects_onto_original_text(tok, tokens, expected):
  examples = squad.read_squad(_dataset(_CONTEXT, [_qa('q', 'who', [])]), is_training=False)
  f = squad.convert_examples(examples, tok, 128, 64, 8)
  row = f['tokens'][0]
  first = next(i for i in range(len(row)) if row[i:i + len(tokens)] == tokens)
  start, end = np.zeros((1, 128)), np.zeros((1, 128))
  start[0, first], end[0, first + len(tokens) - 1] = 10.0, 10.0
  preds, _, _ = squad.decode_predictions(examples, f, start, end)
  assert preds['q'] == expected


def test_project_to_original_fallbacks():
  assert squad.project_to_original('1990', '(1990)', True) == '1990'
  assert squad.project_to_original('muller', 'Müller.', True) == 'Müller'
  assert squad.project_to_original('[UNK]', 'Müller.', True) == 'Müller.'  # Not found.
  # The clean-up drops the zero-width space: character counts differ, so alignment fails and
  # the whole original words come back.
  assert squad.project_to_original('b', 'a\u200bb', True) == 'a\u200bb'
  assert squad.project_to_original('b', 'aİb', True) == 'b'  # 'İ' lower-cases to i + U+0307.
  assert squad.basic_tokenize('Héllo, WORLD!', True) == ['hello', ',', 'world', '!']
  assert squad.basic_tokenize('Héllo,', False) == ['Héllo', ',']


def test_round_trip_from_training_positions_scores_100(tok):
  # A long context and several answers; logits put on the training positions decode back to
  # the gold answers, whichever window holds them.
  context = ' '.join(_W[:20]) + ' ' + _CONTEXT + ' ' + ' '.join(_W[20:])
  answers = ['1990', 'U.S.', 'well-known', 'Müller', _W[3], _W[30], 'Paris (1990)']
  qas = [_qa(f'q{i}', 'who', [(a, context.index(a))]) for i, a in enumerate(answers)]
  examples = squad.read_squad(_dataset(context, qas), is_training=True)
  # Windows of 32 - 1 - 3 = 28 document tokens, 6 apart: every answer (<= 10 tokens) fits in
  # the window where its first token has the most context.
  train = squad.convert_examples(examples, tok, 32, 6, 8, is_training=True)
  evals = squad.convert_examples(examples, tok, 32, 6, 8)
  assert len(train['input_ids']) > 3 * len(answers)  # Many windows per question.
  np.testing.assert_array_equal(train['input_ids'], evals['input_ids'])
  start, end = np.zeros((2,) + train['input_ids'].shape)
  rows = np.arange(len(start))
  start[rows, train['start_positions']] = 10.0
  end[rows, train['end_positions']] = 10.0
  preds, _, _ = squad.decode_predictions(examples, evals, start, end)
  assert preds == {f'q{i}': 'Müller' if a == 'Müller' else a for i, a in enumerate(answers)}
  result = metrics.squad_evaluate(squad.gold_answers(examples), preds)
  assert result['exact'] == 100.0 and result['f1'] == 100.0


def test_version_2_null_scores_and_threshold(tok):
  context = ' '.join(_W[:30])
  data = _dataset(context, [_qa('no', 'who', [], impossible=True),
                            _qa('yes', 'who', [(_W[2], context.index(_W[2]))], False)])
  train = squad.convert_examples(squad.read_squad(data, True), tok, 20, 8, 8, True)
  # Impossible questions train towards [CLS] in every window.
  assert np.all(train['start_positions'][train['example_index'] == 0] == 0)
  examples = squad.read_squad(data, is_training=False)
  f = squad.convert_examples(examples, tok, 20, 8, 8)
  n = len(f['input_ids'])
  start, end = np.zeros((n, 20)), np.zeros((n, 20))
  no = np.flatnonzero(f['example_index'] == 0)
  start[no, 0] = end[no, 0] = 5.0
  start[no[1], 0] = 1.0  # The null score is the minimum over windows: 1 + 5 = 6.
  start[no[0], 3 + 2] = end[no[0], 3 + 2] = 2.0  # Best span of 'no': 4.
  yes = np.flatnonzero(f['example_index'] == 1)
  start[yes[0], 3 + 2] = end[yes[0], 3 + 2] = 4.0  # Span 8 beats null 0 + 0.
  preds, odds, nbest = squad.decode_predictions(examples, f, start, end, version_2=True)
  assert preds == {'no': '', 'yes': _W[2]}
  assert odds['no'] == pytest.approx(6.0 - 4.0) and odds['yes'] == pytest.approx(0 - 8.0)
  assert '' in {n['text'] for n in nbest['yes']}
  preds, _, _ = squad.decode_predictions(examples, f, start, end, version_2=True,
                                         null_score_diff_threshold=2.5)
  assert preds['no'] == _W[2]
  result = metrics.squad_evaluate(squad.gold_answers(examples), {'no': '', 'yes': _W[2]}, odds)
  assert result['exact'] == 100.0 and result['NoAns_total'] == 1 and 'best_f1' in result


def test_multi_answer_gold_and_prediction_files(tmp_path):
  data = _dataset(_CONTEXT, [_qa('q', 'where', [_answer('Paris'), _answer('Paris (1990)'),
                                                 _answer('in Paris')])])
  path = tmp_path / 'dev.json'
  path.write_text(json.dumps(data))
  examples = squad.read_squad(str(path), is_training=False)
  assert examples[0].answers == ['Paris', 'Paris (1990)', 'in Paris']
  result = metrics.squad_evaluate(squad.gold_answers(examples), {'q': 'paris 1990'})
  assert result['exact'] == 100.0  # Matches the second gold answer after normalisation.
  paths = squad.write_predictions(str(tmp_path / 'out'), {'q': 'Paris'}, {'q': -1.5})
  assert json.loads(open(paths['predictions']).read()) == {'q': 'Paris'}
  assert json.loads(open(paths['null_odds']).read()) == {'q': -1.5}
  assert 'nbest_predictions' not in paths


def test_bad_input_and_bucketing(tok, caplog):
  with pytest.raises(ValueError, match='no "data" key'):
    squad.read_squad({'version': '1.1'}, is_training=False)
  with pytest.raises(ValueError, match='question q has no answer'):
    squad.read_squad(_dataset('a b', [_qa('q', 'who', [])]), is_training=True)
  examples = squad.read_squad(_dataset(_CONTEXT, [_qa('q', 'who ' * 20, [])]), False)
  with caplog.at_level(logging.WARNING):
    f = squad.convert_examples(examples, tok, 128, 32, 8)
  assert 'truncated 1 questions' in caplog.text
  assert tok.decode(f['input_ids'][0][:10])[-1] == '[SEP]'
  with pytest.raises(ValueError, match='1 features but 2 start'):
    squad.decode_predictions(examples, f, np.zeros((2, 128)), np.zeros((2, 128)))
  with pytest.raises(ValueError, match='need answer positions'):
    squad.convert_examples(examples, tok, 128, 32, 8, is_training=True)
  train_examples = squad.read_squad(
      _dataset(_CONTEXT, [_qa('q', 'who', [_answer('Paris')])]), is_training=True)
  train = squad.convert_examples(train_examples, tok, 128, 32, 8, is_training=True)
  with pytest.raises(ValueError, match="lack 'tokens'"):
    squad.decode_predictions(examples, train, np.zeros((1, 128)), np.zeros((1, 128)))
  with pytest.raises(ValueError, match='leaves no room'):
    squad.convert_examples(examples, tok, 10, 4, 8)
  batches = list(batching.bucket_batches(f, 4, buckets=(32, 64, 128)))  # Strings are left out.
  assert batches[0]['input_ids'].shape == (1, 128) and 'tokens' not in batches[0]
  f = squad.convert_examples(examples, tok, 128, 32, 64)
  batches = list(batching.bucket_batches(f, 4, buckets=(32, 64, 128)))
  assert batches[0]['input_ids'].shape == (1, 128) and 'tokens' not in batches[0]


def test_answers_and_scores_scores_only_answered_questions(tok):
  context = ' '.join(_W[:30])
  data = _dataset(context, [_qa('no', 'who', [], impossible=True),
                            _qa('yes', 'who', [(_W[2], context.index(_W[2]))], False)])
  examples = squad.read_squad(data, is_training=False)
  f = squad.convert_examples(examples, tok, 20, 8, 8)
  rows = np.zeros((len(f['input_ids']), 2, 20))
  rows[f['example_index'] == 0, :, 0] = 5.0  # [CLS]: no answer.
  rows[np.flatnonzero(f['example_index'] == 1)[0], :, 3 + 2] = 4.0
  settings = ml_collections.ConfigDict(dict(n_best_size=20, max_answer_length=30,
                                            null_score_diff_threshold=0.0))
  scores, answers, odds, nbest = squad.answers_and_scores(examples, f, list(rows), settings,
                                                          version_2=True, lower_case=True)
  assert answers == {'no': '', 'yes': _W[2]} and set(odds) == set(nbest) == {'no', 'yes'}
  assert scores['exact'] == 100.0 and 'best_f1' in scores
  # New questions (no answers, not marked impossible): answers, no scores; v1: no odds.
  data['data'][0]['paragraphs'][0]['qas'] = [
      {'id': q['id'], 'question': q['question']} for q in data['data'][0]['paragraphs'][0]['qas']]
  unanswered = squad.read_squad(data, is_training=False)
  scores, answers, odds, _ = squad.answers_and_scores(unanswered, f, list(rows), settings,
                                                      version_2=False, lower_case=True)
  assert scores is None and odds is None and answers['yes'] == _W[2]


def test_dev_file_without_answers_is_refused(tok, tmp_path):
  context = ' '.join(_W[:30])
  answered = _dataset(context, [_qa('q', 'who', [(_W[2], context.index(_W[2]))])])
  unanswered = _dataset(context, [{'id': 'q', 'question': 'who'}])
  for name, data in (('train-v1.1.json', answered), ('dev-v1.1.json', unanswered)):
    (tmp_path / name).write_text(json.dumps(data))
  config = config_files.load_config('finetune_squad.py:v1', {'task.data_dir': str(tmp_path),
                                                    'data.max_seq_length': 32})
  with pytest.raises(UserError, match=r'dev-v1.1.json: 1 questions have no answers .* dev set'):
    squad.make_task(config, tok, model_lib.BertConfig(vocab_size=tok.vocab_size),
                    lower_case=True)
