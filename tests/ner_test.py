"""Tests for bert_jax.ner: CoNLL reading, tag schemes, windows over long sentences, reassembly."""

import logging
import string

import numpy as np
import pytest

from bert_jax import metrics
from bert_jax import ner
from bert_jax import tokenization

_CONLL = """-DOCSTART- -X- -X- O

EU NNP B-NP I-ORG
rejects VBZ B-VP O
German JJ B-NP I-MISC
call NN I-NP O
. . O O

Peter NNP B-NP I-PER
Blackburn NNP I-NP I-PER

-DOCSTART- -X- -X- O

Jan NNP B-NP I-PER
Mar NNP I-NP B-PER
"""


@pytest.fixture(scope='module')
def tok(tmp_path_factory):
  vocab = (['[PAD]', '[UNK]', '[CLS]', '[SEP]', '[MASK]'] + list(string.punctuation) +
           list(string.ascii_lowercase) + ['##' + c for c in string.ascii_lowercase] +
           ['eu', 'call', 'peter'])
  path = tmp_path_factory.mktemp('vocab') / 'vocab.txt'
  path.write_text('\n'.join(vocab) + '\n')
  return tokenization.load_tokenizer(str(path), lower_case=True)


@pytest.fixture
def conll_file(tmp_path):
  path = tmp_path / 'eng.train'
  path.write_text(_CONLL)
  return str(path)


def test_read_conll_documents_sentences_and_lines(conll_file):
  sentences = ner.read_conll(conll_file)
  assert [s.words for s in sentences] == [['EU', 'rejects', 'German', 'call', '.'],
                                          ['Peter', 'Blackburn'], ['Jan', 'Mar']]
  assert sentences[0].tags == ['I-ORG', 'O', 'I-MISC', 'O', 'O']
  assert [s.line for s in sentences] == [3, 9, 14]
  # IOB1: some chunk opens with I- (in IOB2 every chunk opens with B-).
  is_iob1 = lambda ss: any(s.tags and ner.iob1_to_iob2(s.tags) != list(s.tags) for s in ss)
  assert is_iob1(sentences)
  iob2 = ner.read_conll(conll_file, to_iob2=True)
  assert iob2[0].tags == ['B-ORG', 'O', 'B-MISC', 'O', 'O']
  assert iob2[1].tags == ['B-PER', 'I-PER'] and iob2[2].tags == ['B-PER', 'B-PER']
  assert not is_iob1(iob2)
  # The conversion keeps the entities (seqeval reads both schemes the same way).
  for a, b in zip(sentences, iob2):
    assert metrics.get_entities(a.tags) == metrics.get_entities(b.tags)
  assert ner.label_list_from_data(sentences) == ['O', 'I-MISC', 'I-ORG', 'B-PER', 'I-PER']
  words_only = ner.read_conll(conll_file, has_tags=False)
  assert words_only[0].tags is None and words_only[0].words[0] == 'EU'


def test_iob1_to_iob2_rules():
  assert ner.iob1_to_iob2(['I-PER', 'I-PER', 'B-PER', 'I-LOC', 'O', 'I-LOC']) == [
      'B-PER', 'I-PER', 'B-PER', 'B-LOC', 'O', 'B-LOC']


def test_read_conll_errors(tmp_path):
  bad = tmp_path / 'bad.txt'
  bad.write_text('EU NNP B-NP I-ORG\nrejects VBZ B-VP X-ORG\n')
  with pytest.raises(ValueError, match=r"bad.txt:2: tag 'X-ORG'"):
    ner.read_conll(str(bad))
  bad.write_text('EU NNP B-NP I-ORG\nrejects O\n')
  with pytest.raises(ValueError, match=r'bad.txt:2: 2 columns where earlier lines have 4'):
    ner.read_conll(str(bad))
  bad.write_text('-DOCSTART- -X- -X- O\n\n\n')
  with pytest.raises(ValueError, match='no sentences'):
    ner.read_conll(str(bad))
  bad.write_text('EU\n')
  with pytest.raises(ValueError, match='expected a word and a tag'):
    ner.read_conll(str(bad))


def test_labels_on_first_pieces_only(tok, conll_file):
  sentences = ner.read_conll(conll_file)
  f = ner.convert_sentences(sentences, tok, 24, ner.CONLL_LABELS)
  row = tok.decode(f['input_ids'][0])
  assert row[:8] == ['[CLS]', 'eu', 'r', '##e', '##j', '##e', '##c', '##t']
  labels = f['labels'][0]
  first_pieces = [i for i, t in enumerate(row) if t not in ('[CLS]', '[SEP]', '[PAD]')
                  and not t.startswith('##')]
  assert list(np.flatnonzero(labels >= 0)) == first_pieces
  assert [ner.CONLL_LABELS[labels[i]] for i in first_pieces] == sentences[0].tags
  np.testing.assert_array_equal(f['word_index'][0][first_pieces], np.arange(5))
  assert np.all(f['word_index'][0][labels < 0] == -1)
  np.testing.assert_array_equal(f['sentence_index'], [0, 1, 2])
  assert f['labels'].dtype == np.int32 and np.all(f['segment_ids'] == 0)
  with pytest.raises(ValueError, match=r"line 3: tags \['I-ORG'"):
    ner.convert_sentences(sentences, tok, 24, ['O', 'I-MISC'])


def test_long_sentences_split_into_windows_and_reassemble(tok, caplog):
  rng = np.random.default_rng(0)
  sentences = []
  for s in range(6):
    n = int(rng.integers(3, 40))
    words = [''.join(rng.choice(list('abcdef'), int(rng.integers(1, 5)))) for _ in range(n)]
    tags = list(rng.choice(ner.CONLL_LABELS, n))
    sentences.append(ner.Sentence(words, tags, line=s))
  sentences.append(ner.Sentence(['x', '\u200b', 'y'], ['O', 'B-PER', 'O'], line=99))
  with caplog.at_level(logging.INFO):
    f = ner.convert_sentences(sentences, tok, 16, ner.CONLL_LABELS)
  assert len(f['input_ids']) > len(sentences)  # Some sentences needed several windows.
  assert 'sentences longer than 16 tokens were split' in caplog.text
  assert '1 words had no WordPiece' in caplog.text  # The zero-width space: fed as [UNK].
  # Each window is [CLS] whole words [SEP]: a word is never cut across windows.
  for row in range(len(f['input_ids'])):
    ids = f['input_ids'][row][f['input_mask'][row] == 1]
    assert ids[0] == tok.cls_id and ids[-1] == tok.sep_id and len(ids) <= 16
  # Predicting the gold labels gives back every sentence's tags exactly.
  pred_tags = ner.reassemble(sentences, f, np.maximum(f['labels'], 0), ner.CONLL_LABELS)
  assert pred_tags == [s.tags for s in sentences]
  logits = np.eye(len(ner.CONLL_LABELS))[np.maximum(f['labels'], 0)]
  assert ner.reassemble(sentences, f, logits, ner.CONLL_LABELS) == pred_tags
  assert metrics.ner_metrics([s.tags for s in sentences], pred_tags)['f1'] == 1.0
  # Bucketed (shorter) rows work as long as they hold every word's first piece.
  lengths = f['input_mask'].sum(1)
  rows = [np.maximum(f['labels'][i, :lengths[i]], 0) for i in range(len(lengths))]
  assert ner.reassemble(sentences, f, rows, ner.CONLL_LABELS) == pred_tags
  with pytest.raises(ValueError, match='prediction row 0 has 2 positions'):
    ner.reassemble(sentences, f, [r[:2] for r in rows], ner.CONLL_LABELS)
  with pytest.raises(ValueError, match='features but'):
    ner.reassemble(sentences, f, rows[:-1], ner.CONLL_LABELS)


def test_unlabelled_sentences_get_word_positions(tok):
  sentences = [ner.Sentence(['peter', 'call'], None, 1)]
  f = ner.convert_sentences(sentences, tok, 8, ner.CONLL_LABELS)
  assert np.all(f['labels'] == -1)
  np.testing.assert_array_equal(f['word_index'][0][:4], [-1, 0, 1, -1])
  assert ner.reassemble(sentences, f, np.full((1, 8), 2), ner.CONLL_LABELS) == [['I-PER'] * 2]
  with pytest.raises(ValueError, match='leaves no room'):
    ner.convert_sentences(sentences, tok, 2, ner.CONLL_LABELS)


@pytest.mark.parametrize('text, conll', [
    (_CONLL, True),
    ('EU I-ORG\nrejects O\n\nPeter B-PER\n', True),  # Word and tag, no -DOCSTART-.
    ('EU\nrejects\n\nPeter\nBlackburn\n', True),  # Words only, sentences between blank lines.
    ('EU rejects German call.\nPeter Blackburn\n', False),  # A sentence per line.
    ('EU rejects O\nPeter saw B-PER\n', True),  # Ambiguous (--input_format decides): tags.
    ('EU\r\nrejects\r\nPeter\r\n', False),  # One word a line, no blank line (CRLF): text.
    ('EU\r\nrejects\r\n\r\nPeter\r\n', True),
])
def test_the_input_format_is_sniffed(tmp_path, text, conll):
  path = tmp_path / 'input.txt'
  path.write_bytes(text.encode())
  assert ner.read_sentences(str(path))[1] == ('conll' if conll else 'text')


def test_sniff_format_of_nothing_and_of_one_bad_line():
  assert ner.sniff_format(['', '']) == 'text'
  # One malformed line in 10 still reads as CoNLL, so that read_conll names it.
  assert ner.sniff_format([f'w{i} O' for i in range(9)] + ['w9 x y O']) == 'conll'


def test_plain_text_splits_words_like_bert_and_keeps_case(tmp_path):
  path = tmp_path / 'input.txt'
  path.write_text('EU rejects German call, says (Peter) Blackburn.\n\n  \nJan Mar 12.5\n')
  sentences, read_as = ner.read_sentences(str(path))
  assert read_as == 'text'
  assert [s.words for s in sentences] == [
      ['EU', 'rejects', 'German', 'call', ',', 'says', '(', 'Peter', ')', 'Blackburn', '.'],
      ['Jan', 'Mar', '12', '.', '5']]
  assert [s.line for s in sentences] == [1, 4] and all(s.tags is None for s in sentences)
  out = tmp_path / 'out.conll'
  ner.write_conll(str(out), sentences, [['O'] * len(s.words) for s in sentences])
  assert out.read_text().endswith('\n\nJan O\nMar O\n12 O\n. O\n5 O\n\n')
  path.write_text(' \n')
  with pytest.raises(ValueError, match='input.txt: no sentences'):
    ner.read_sentences(str(path), 'text')


def test_conll_input_with_and_without_tags(tmp_path):
  path = tmp_path / 'input.conll'
  path.write_text('EU NNP B-ORG\nrejects VBZ O\n\nPeter NNP B-PER\n')
  sentences, read_as = ner.read_sentences(str(path))
  assert read_as == 'conll' and [s.tags for s in sentences] == [['B-ORG', 'O'], ['B-PER']]
  path.write_text('EU\nrejects\n\nPeter\n')
  sentences, read_as = ner.read_sentences(str(path), 'conll')
  assert [s.words for s in sentences] == [['EU', 'rejects'], ['Peter']]
  assert all(s.tags is None for s in sentences)
  path.write_text(''.join(f'w{i} O\n' for i in range(9)) + 'w9 x y O\n')
  with pytest.raises(ValueError, match=r'input.conll:10: 4 columns where earlier lines have 2'):
    ner.read_sentences(str(path))
