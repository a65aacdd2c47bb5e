"""Tests for bert_jax.serving: each graph function against the Python it stands for, on inputs
made to meet its corner cases (truncation, windows, ties, text that normalises unevenly)."""

import itertools
import random

import numpy as np
import pytest
import tensorflow as tf

from bert_jax import glue
from bert_jax import ner
from bert_jax import serving
from bert_jax import squad
from bert_jax import tokenization

WORDS = ['the', 'movie', 'was', 'made', 'by', 'alice', 'bob', 'who', '?', '.', ',', 'un',
         '##real', '##s', 'café', '(', ')', '1895', 'naïve']
VOCAB = ['[PAD]', '[UNK]', '[CLS]', '[SEP]', '[MASK]'] + WORDS


@pytest.fixture(scope='module')
def tok(tmp_path_factory):
  path = tmp_path_factory.mktemp('vocab') / 'vocab.txt'
  path.write_text('\n'.join(VOCAB) + '\n')
  return tokenization.load_tokenizer(str(path), lower_case=True)


def test_truncated_pair_lengths_are_truncate_seq_pairs():
  la, lb, room = zip(*itertools.product(range(12), range(12), range(1, 14)))
  new_a, new_b = serving.truncated_pair_lengths(tf.constant(la), tf.constant(lb),
                                                tf.constant(room))
  for a, b, r, got_a, got_b in zip(la, lb, room, new_a.numpy(), new_b.numpy()):
    ids_a, ids_b = list(range(a)), list(range(b))
    glue.truncate_seq_pair(ids_a, ids_b, r)
    assert (got_a, got_b) == (len(ids_a), len(ids_b)), (a, b, r)


def test_pack_pair_is_glues(tok):
  rng = random.Random(0)
  texts = [' '.join(rng.choice(WORDS) for _ in range(rng.randint(0, 12))) for _ in range(40)]
  ids_a, ids_b = tok.tokenize(tf.constant(texts[:20])), tok.tokenize(tf.constant(texts[20:]))
  for pair in (False, True):
    ids, segments, cut = serving.pack_pair(ids_a, ids_b if pair else None, tok.cls_id,
                                           tok.sep_id, 10)
    for i in range(20):
      want = glue.pack_pair(ids_a[i].numpy().tolist(),
                            ids_b[i].numpy().tolist() if pair else None, tok, 10)
      assert (ids[i].numpy().tolist(), segments[i].numpy().tolist(), bool(cut[i])) == want


def test_model_inputs_pad_to_a_bucket_and_batches_to_a_power_of_two():
  ids = tf.ragged.constant([[2, 5, 3], [2, 3]])
  inputs = serving.model_inputs(ids, tf.zeros_like(ids), 0, [4, 8])
  assert inputs['input_ids'].numpy().tolist() == [[2, 5, 3, 0], [2, 3, 0, 0]]
  assert inputs['input_mask'].numpy().tolist() == [[1, 1, 1, 0], [1, 1, 0, 0]]
  three = {k: tf.concat([v, v[:1]], 0) for k, v in inputs.items()}
  padded = serving.pad_batch(three)
  assert padded['input_ids'].shape == (4, 4)
  assert padded['input_mask'].numpy()[3].tolist() == [1, 0, 0, 0]  # A lone unmasked token.


def test_collapse_spaces():
  text = tf.constant([' a \u3000b\n\tc  ', '', 'x\u00a0y'])
  assert serving.collapse_spaces(text).numpy().tolist() == [
      ' '.join(t.split()).encode() for t in [' a \u3000b\n\tc  ', '', 'x\u00a0y']]


def test_squad_words_are_split_context():
  contexts = ['a  b\tc\u202fd', ' lead and trail ', 'ünï çödé\u00a0x', '']
  words, starts = serving.squad_words(tf.constant(contexts))
  for i, context in enumerate(contexts):
    expected, char_to_word = squad.split_context(context)
    assert [w.decode() for w in words[i].numpy()] == expected
    assert starts[i].numpy().tolist() == [char_to_word.index(w) for w in range(len(expected))]


def _squad_examples():
  contexts = ['the movie was made by alice , unreal ( 1895 ) .',
              ' '.join(['the', 'movie', 'was'] * 9) + ' made by bob .', 'café naïve', '']
  questions = ['who made the movie ?', 'who ?', 'the movie was made by who who who', 'who']
  examples = []
  for i, (q, c) in enumerate(zip(questions, contexts)):
    words, _ = squad.split_context(c)
    examples.append(squad.SquadExample(f'q{i}', q, words, []))
  return questions, contexts, examples


@pytest.mark.parametrize('max_seq_length,doc_stride,max_query_length', [
    (16, 4, 6), (20, 32, 8), (12, 3, 3)])
def test_squad_windows_are_convert_examples(tok, max_seq_length, doc_stride, max_query_length):
  questions, contexts, examples = _squad_examples()
  words, _ = serving.squad_words(tf.constant(contexts))
  windows = serving.squad_windows(
      tok.tokenize(tf.constant(questions)), words, tok.tokenize(words.flat_values),
      max_seq_length, doc_stride, max_query_length, tok.cls_id, tok.sep_id)
  features = squad.convert_examples(examples, tok, max_seq_length, doc_stride, max_query_length)
  assert windows['example'].numpy().tolist() == features['example_index'].tolist()
  lengths = features['input_mask'].sum(1)
  for key, name in (('ids', 'input_ids'), ('segments', 'segment_ids'),
                    ('token_to_orig', 'token_to_orig'),
                    ('token_is_max_context', 'token_is_max_context')):
    assert windows[key].to_list() == [row[:n].tolist() for row, n in
                                      zip(features[name], lengths)], key


@pytest.mark.parametrize('version_2', [False, True])
def test_squad_decode_is_decode_predictions(tok, version_2):
  questions, contexts, examples = _squad_examples()
  words, starts = serving.squad_words(tf.constant(contexts))
  windows = serving.squad_windows(
      tok.tokenize(tf.constant(questions)), words, tok.tokenize(words.flat_values), 16, 4, 6,
      tok.cls_id, tok.sep_id)
  features = squad.convert_examples(examples, tok, 16, 4, 6)
  rng = np.random.RandomState(1)
  # Rounded logits: many tied scores, which both rank in the order candidates are made. A
  # batch padded past the longest window (as a bucket pads): padding takes no place.
  logits = np.round(rng.normal(size=(len(features['input_ids']), 2, 20)), 1).astype(np.float32)
  settings = dict(n_best_size=5, max_answer_length=4, version_2=version_2,
                  null_score_diff_threshold=0.3)
  answers, odds, nbest = squad.decode_predictions(
      examples, features, logits[:, 0], logits[:, 1], do_lower_case=True, **settings)
  out = serving.squad_decode(tf.constant(logits), windows, words, starts,
                             tf.constant(tok.vocab), lower_case=True, **settings)
  for i, (example, context) in enumerate(zip(examples, contexts)):
    qid = example.qas_id
    assert out['answer'][i].numpy().decode() == answers[qid]
    listed = [t.decode() for t, p in zip(out['nbest_text'][i].numpy(),
                                         out['nbest_probability'][i].numpy()) if p > 0]
    assert listed == [n['text'] for n in nbest[qid]]
    np.testing.assert_allclose(out['nbest_probability'][i].numpy()[:len(listed)],
                               [n['probability'] for n in nbest[qid]], rtol=1e-12)
    np.testing.assert_array_equal(out['nbest_end_logit'][i].numpy()[:len(listed)],
                                  [n['end_logit'] for n in nbest[qid]])
    start, end = out['answer_start'][i].numpy(), out['answer_end'][i].numpy()
    if answers[qid]:
      assert ' '.join(context[start:end].split()) == answers[qid]
    else:
      assert (start, end) == (-1, -1)
    if version_2:
      assert out['null_odds'][i].numpy() == pytest.approx(odds[qid], abs=1e-9)


@pytest.mark.parametrize('lower_case', [True, False])
def test_project_to_original_is_squads(lower_case):
  cases = [('alice', 'Alice,'), ('1895', '(1895)'), ('naive', 'Naïve'), ('un real', 'Unreal'),
           ('cafe', 'CAFÉ!'), ('b', 'a b c'), ('x', 'nothing here'), ('', 'empty'),
           ('한', '한국'), ('ß', 'Straße'), ('i', 'İi'), ('c', 'ab\u00a0c'), ('a b', 'a  b')]
  for pred, orig in cases:
    text, first, last = serving.project_to_original(tf.constant(pred), tf.constant(orig),
                                                     lower_case)
    want = squad.project_to_original(pred, orig, lower_case)
    assert text.numpy().decode() == want, (pred, orig)
    assert orig[first:last + 1] == want


def test_ner_windows_are_convert_sentences(tok):
  sentences = [['the', 'movie', 'was', 'made', 'by', 'alice'], ['unreal'] * 7, ['\x00', 'bob'],
               ['café', 'x' * 30, 'who', '?'], ['a']]
  words = tf.ragged.constant(sentences)
  ids, window, position = serving.ner_windows(words, tok.tokenize(words.flat_values), 4,
                                              tok.unk_id)
  features = ner.convert_sentences([ner.Sentence(s, None, 1) for s in sentences], tok, 6,
                                   ['O'])
  lengths = features['input_mask'].sum(1)
  assert ids.to_list() == [row[1:n - 1].tolist() for row, n in zip(features['input_ids'],
                                                                    lengths)]
  assert sorted(zip(window.numpy().tolist(), position.numpy().tolist())) == sorted(
      map(tuple, np.argwhere(features['word_index'] >= 0).tolist()))
