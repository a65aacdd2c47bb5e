"""Tests for bert_jax.tokenization: parity with the original BERT tokenizer."""

import os
import random
import unicodedata

import pytest
import tensorflow as tf

from bert_jax import tokenization
from bert_jax import vocab as vocab_lib
from bert_jax.errors import UserError

# A varied text: every line is a separate example.
VARIED = [
    'The quick brown fox jumps over the lazy dog.',
    'Hello, World!!! How are you... really?!? (fine)',
    'Café, naïve, résumé, Ångström, jalapeño, façade.',
    'Straße, STRASSE, Maß, groß, ẞ capital sharp s.',
    'İstanbul, ISTANBUL, ıi İI, DİYARBAKIR.',
    'ΣΑΣ ΟΔΥΣΣΕΥΣ, σοφός ΣΟΦΟΣ. ΑΣ\x07Α ΑΣ\u00adΑ Σ.',
    '中文字 and 日本語テキスト, ひらがな カタカナ.',
    '한국어 텍스트 입니다. 서울특별시',
    'Emoji: 😀👍🏽 🇩🇪 ❤️ done.',
    'Controls:\x00a\x07b\u200bc\ufffdd\u200de\u2028f\u3000g\xa0h.',
    'Tabs\tand\nnewlines\r\nand   spaces.',
    'x² + y³ = z⁴, ½ cup, Ⅻ o\'clock, Ⅰ Ⅱ ⅰ, ﬁne, ℌ.',
    'A' * 150 + ' short ' + 'b' * 100 + ' ' + 'é' * 101,
    'See https://www.example.com/path?q=1&r=2#frag or mail x@y.org.',
    'Numbers: 3.14159, 1,000,000, -42, 1e-9, 2024-01-31.',
    'MiXeD CaSe WoRdS like iPhone, eBay, McDonald\'s, NASA.',
    'ǅemal ǈ ǋ, Ǆ, ﬀ, ŉ, ΐ, İ̇.',
    'Arabic: مرحبا بالعالم، كيف حالك؟ Hebrew: שָׁלוֹם',
    'Devanagari: नमस्ते दुनिया। Thai: สวัสดีชาวโลก',
    'Combining: e\u0301 a\u0308 n\u0303 \u0301alone 中\u0301.',
    'Symbols: $5 + 3 = 8 < 9 > 7 ^ ` | ~ @ # % & * _ \\ / [x] {y}.',
    'Quotes: “curly” ‘single’ «guillemets» —dash– …ellipsis',
    'Fullwidth: ＡＢＣ１２３！ and halfwidth ｶﾀｶﾅ.',
    '𝐁𝐨𝐥𝐝 𝕯𝖔𝖚𝖇𝖑𝖊 ℕ ℤ ℚ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢',
    'Rare CJK: \U00020000\U0002A6DF\U0002B820\U0002CEAF\uF900\U0002F800.',
    'Vithkuqi: \U00010570\U00010597 Ⱟⱟ Ꟁꟁ.',
    '',
    '   ',
]

# English sentences for the vocabulary, written for this test.
ENGLISH = [
    'A tokenizer splits text into words and then into pieces of words.',
    'The model reads the pieces and learns which ones tend to go together.',
    'Training a vocabulary counts the words of a corpus and merges pairs.',
    'Frequent words become single pieces; rare words are split into parts.',
    'Researchers often measure how many pieces an average word needs.',
    'Cats and dogs played in the garden while the children were reading.',
    'Numbers such as 3.14 and 2024 appear in many documents and tables.',
    'Some people write in French, some in German, and some in Greek.',
    'The weather was cold, but the market was crowded and very noisy.',
    'Every sentence in this small corpus was written for the unit test.',
]


def _is_cjk(cp):
  return any(lo <= cp <= hi for lo, hi in (
      (0x4E00, 0x9FFF), (0x3400, 0x4DBF), (0x20000, 0x2A6DF),
      (0x2A700, 0x2B73F), (0x2B740, 0x2B81F), (0x2B820, 0x2CEAF),
      (0xF900, 0xFAFF), (0x2F800, 0x2FA1F)))


def _is_punct(ch):
  cp = ord(ch)
  if 33 <= cp <= 47 or 58 <= cp <= 64 or 91 <= cp <= 96 or 123 <= cp <= 126:
    return True
  return unicodedata.category(ch)[0] == 'P'


def ref_words(text, lower_case):
  """The original BERT BasicTokenizer, restated in plain Python."""
  chars = []
  for ch in text:
    if ch in '\t\n\r' or unicodedata.category(ch) == 'Zs':
      chars.append(' ')
    elif ch in '\x00\ufffd' or unicodedata.category(ch)[0] == 'C':
      pass
    elif _is_cjk(ord(ch)):
      chars.append(' ' + ch + ' ')
    else:
      chars.append(ch)
  words = []
  for token in ''.join(chars).split():
    if lower_case:
      token = unicodedata.normalize('NFD', token.lower())
      token = ''.join(c for c in token if unicodedata.category(c) != 'Mn')
    current = ''
    for ch in token:
      if _is_punct(ch):
        words += [current, ch]
        current = ''
      else:
        current += ch
    words.append(current)
  return ' '.join(words).split()


def ref_wordpiece(word, vocab, max_chars=100):
  """Greedy longest-match-first WordPiece of one word."""
  if len(word) > max_chars:
    return ['[UNK]']
  pieces, start = [], 0
  while start < len(word):
    for end in range(len(word), start, -1):
      piece = ('##' if start else '') + word[start:end]
      if piece in vocab:
        pieces.append(piece)
        start = end
        break
    else:
      return ['[UNK]']
  return pieces


def ref_tokens(text, vocab, lower_case):
  return [p for w in ref_words(text, lower_case)
          for p in ref_wordpiece(w, vocab)]


def _write(path, lines):
  with open(path, 'w', encoding='utf-8') as f:
    f.write(''.join(line + '\n' for line in lines))
  return str(path)


@pytest.fixture(scope='module', params=[True, False], ids=['uncased', 'cased'])
def tokenizer(request, tmp_path_factory):
  """A tokenizer whose vocabulary vocab.py learned from English + VARIED."""
  lower_case = request.param
  path = tmp_path_factory.mktemp('vocab') / 'vocab.txt'
  # Hold some characters out of training so that [UNK] words occur.
  held_out = {'😀', 'ℌ', '𝔡'}
  texts = ENGLISH * 3 + [''.join(c for c in t if c not in held_out)
                         for t in VARIED]
  vocab_lib.train_wordpiece(texts, str(path), vocab_size=700,
                            lower_case=lower_case, num_unused=3)
  return tokenization.WordPieceTokenizer(str(path), lower_case=lower_case)


def _ids_to_tokens(tok, ids):
  return [tok.vocab[i] for i in ids]


def test_matches_reference_on_varied_text(tokenizer):
  vocab = set(tokenizer.vocab)
  got = tokenizer.encode(VARIED)
  num_tokens = num_unk = 0
  for text, ids in zip(VARIED, got):
    expected = ref_tokens(text, vocab, tokenizer.lower_case)
    assert _ids_to_tokens(tokenizer, ids) == expected, repr(text)
    num_tokens += len(ids)
    num_unk += expected.count('[UNK]')
  # The vocabulary really splits words into pieces, and [UNK] is rare: the
  # 150-character word, held-out characters, the 101-character word.
  assert num_tokens > 400
  assert sum(tokenizer.is_continuation[i] for row in got for i in row) > 50
  assert 4 <= num_unk <= 0.03 * num_tokens


def test_matches_transformers_slow_bert_tokenizer(tokenizer):
  legacy = pytest.importorskip(
      'transformers.models.bert.tokenization_bert_legacy')
  hf = legacy.BertTokenizerLegacy(tokenizer.vocab_file,
                                  do_lower_case=tokenizer.lower_case,
                                  tokenize_chinese_chars=True)
  checked = 0
  for text, ids in zip(VARIED, tokenizer.encode(VARIED)):
    # The port normalizes to NFC after clean-up, which the original does not.
    cleaned = ''.join(ref_words(text, lower_case=False))
    if unicodedata.normalize('NFC', cleaned) != cleaned:
      continue
    expected = [p for w in hf.basic_tokenizer.tokenize(text)
                for p in hf.wordpiece_tokenizer.tokenize(w)]
    assert _ids_to_tokens(tokenizer, ids) == expected, repr(text)
    checked += 1
  assert checked >= len(VARIED) - 2


def test_random_strings_match_reference(tokenizer):
  """Random mixes of characters of every class, in one batch."""
  rng = random.Random(0)
  pool = (list('abcdefghijklmnopqrstuvwxyzAEIOU0123456789 .,;!?-\'"()') +
          [c for t in VARIED for c in t] +
          ['\u0301', '\u0308', '\u00ad', '\x07', '\u200b', '\u2028', 'Σ'])
  texts = [''.join(rng.choice(pool) for _ in range(rng.randrange(0, 60)))
           for _ in range(300)]
  vocab = set(tokenizer.vocab)
  for text, ids in zip(texts, tokenizer.encode(texts)):
    assert _ids_to_tokens(tokenizer, ids) == ref_tokens(
        text, vocab, tokenizer.lower_case), repr(text)


def _code_points():
  """Assigned code points, plus a sample of unassigned and private ones."""
  cps = []
  for cp in range(0x110000):
    if 0xD800 <= cp <= 0xDFFF:
      continue
    if unicodedata.category(chr(cp)) in ('Cn', 'Co') and cp % 97:
      continue
    cps.append(cp)
  return cps


@pytest.mark.parametrize('lower_case', [True, False])
def test_every_character_normalizes_and_splits_like_reference(lower_case):
  """Clean-up, lower-casing, NFD, Mn stripping, whitespace, punctuation, CJK."""
  cps = _code_points()
  texts = [f'x{chr(cp)}y' for cp in cps]
  words = tokenization.split_words(tf.constant(texts), lower_case).to_list()
  bad = [(hex(cp), ref_words(t, lower_case), w)
         for cp, t, w in zip(cps, texts, words)
         if [x.decode() for x in w] != ref_words(t, lower_case)]
  assert not bad, bad[:20]


@pytest.mark.parametrize('lower_case', [True, False])
def test_every_character_fast_path_splits_like_reference(lower_case, tmp_path):
  """The fused FastWordpiece path splits words as BERT does, for every char."""
  specials = list(tokenization.SPECIAL_TOKENS)
  path = _write(tmp_path / 'vocab.txt', specials + ['x', 'y', '##x', '##y'])
  tok = tokenization.WordPieceTokenizer(path, lower_case=lower_case)
  vocab = set(tok.vocab)
  cps = _code_points()
  texts = [f'x{chr(cp)}y' for cp in cps]
  got = tok.tokenize(tf.constant(texts)).to_list()
  bad = [(hex(cp), ref_tokens(t, vocab, lower_case))
         for cp, t, ids in zip(cps, texts, got)
         if _ids_to_tokens(tok, ids) != ref_tokens(t, vocab, lower_case)]
  assert not bad, bad[:20]


def test_lower_case_mismatches_are_few_single_letters():
  fixes = tokenization.lower_case_mismatches()
  assert len(fixes) < 100
  for upper, lower in fixes.items():
    assert upper.lower() == lower and len(lower) == 1


def test_vocab_with_mismatched_letters_takes_exact_path(tmp_path):
  fixes = tokenization.lower_case_mismatches()
  if not fixes:
    pytest.skip('TensorFlow lower-cases like Python here.')
  lowers = sorted(set(fixes.values()))
  path = _write(tmp_path / 'vocab.txt',
                list(tokenization.SPECIAL_TOKENS) + lowers +
                ['##' + c for c in lowers])
  tok = tokenization.WordPieceTokenizer(path)
  text = ' '.join(fixes) + ' ' + ''.join(fixes)
  assert _ids_to_tokens(tok, tok.encode([text])[0]) == ref_tokens(
      text, set(tok.vocab), True)
  assert '[UNK]' not in _ids_to_tokens(tok, tok.encode([text])[0])


def test_long_words_use_characters_not_bytes(tmp_path):
  specials = list(tokenization.SPECIAL_TOKENS)
  path = _write(tmp_path / 'vocab.txt', specials + ['a', '##a', 'é', '##é'])
  tok = tokenization.WordPieceTokenizer(path, lower_case=False)

  def tokens(texts):
    return [_ids_to_tokens(tok, r) for r in tok.encode(texts)]

  assert tokens(['a' * 100, 'a' * 101]) == [['a'] + ['##a'] * 99, ['[UNK]']]
  # 'é' is two bytes: 60 of them pass the fused path's byte limit.
  texts = ['é' * 60, 'a ' + 'é' * 100 + ' a', 'é' * 101, 'a' * 3]
  expected = [['é'] + ['##é'] * 59, ['a', 'é'] + ['##é'] * 99 + ['a'],
              ['[UNK]'], ['a', '##a', '##a']]
  assert tokens(texts) == expected
  assert tokens(texts[:1]) == expected[:1]
  uncased = tokenization.WordPieceTokenizer(path)
  assert _ids_to_tokens(uncased, uncased.encode(['É' * 60])[0]) == ['[UNK]']


def test_invalid_utf8_is_dropped_like_the_original(tokenizer):
  texts = [b'caf\xc3 na\xffive', b'\xe4\xb8 word\xf0\x9f\x98 end',
           b'ok \xed\xa0\x80 \xc0\xaf x', 'plain café'.encode()]
  vocab = set(tokenizer.vocab)
  got = tokenizer.tokenize(tf.constant(texts)).to_list()
  for raw, ids in zip(texts, got):
    expected = ref_tokens(raw.decode('utf-8', 'ignore'), vocab,
                          tokenizer.lower_case)
    assert _ids_to_tokens(tokenizer, ids) == expected, raw


def test_tokenize_words_groups_pieces(tokenizer):
  ragged = tokenizer.tokenize_words(tf.constant(VARIED))
  assert ragged.shape.rank == 3
  flat_ids = tokenizer.tokenize(tf.constant(VARIED)).to_list()
  assert ragged.merge_dims(1, 2).to_list() == flat_ids
  for text, words in zip(VARIED, ragged.to_list()):
    assert len(words) == len(ref_words(text, tokenizer.lower_case))
    for word in words:
      assert not tokenizer.is_continuation[word[0]]
      assert all(tokenizer.is_continuation[i] for i in word[1:])


def test_scalar_and_tf_data(tokenizer, tmp_path):
  text = VARIED[2]
  expected = tokenizer.encode([text])[0]
  assert tokenizer.tokenize(tf.constant(text)).numpy().tolist() == expected
  assert tokenizer.tokenize_words(text).merge_dims(0, 1).numpy().tolist() == (
      expected)
  ds = tf.data.Dataset.from_tensor_slices(VARIED[:6]).map(tokenizer.tokenize)
  iterator = iter(ds)
  first = next(iterator).numpy().tolist()
  # The pipeline is plain TF ops, so its iterator checkpoints.
  ckpt = tf.train.Checkpoint(iterator=iterator)
  saved = ckpt.write(os.path.join(tmp_path, 'iterator'))
  second = next(iterator).numpy().tolist()
  ckpt.read(saved).assert_consumed()
  assert next(iterator).numpy().tolist() == second
  assert first == tokenizer.encode(VARIED[:1])[0]
  with pytest.raises(ValueError, match='scalar or a vector'):
    tokenizer.tokenize(tf.constant([['a']]))


def test_python_conveniences(tokenizer):
  assert tokenizer.vocab_size == len(tokenizer.vocab)
  assert tokenizer.vocab[tokenizer.pad_id] == '[PAD]'
  assert tokenizer.vocab[tokenizer.mask_id] == '[MASK]'
  assert tokenizer.special_ids == [tokenizer.pad_id, tokenizer.unk_id,
                                   tokenizer.cls_id, tokenizer.sep_id,
                                   tokenizer.mask_id]
  ids = tokenizer.encode(['hello world'])[0]
  assert tokenizer.decode(ids) == tokenizer.convert_ids_to_tokens(ids)
  assert tokenizer.convert_tokens_to_ids(tokenizer.decode(ids)) == ids
  assert tokenizer.is_continuation.dtype == bool
  assert tokenizer.is_continuation.shape == (tokenizer.vocab_size,)
  with pytest.raises(TypeError):
    tokenizer.encode('not a list')


def test_vocab_errors(tmp_path):
  missing = str(tmp_path / 'nope.txt')
  with pytest.raises(UserError, match='nope.txt'):
    tokenization.WordPieceTokenizer(missing)
  path = _write(tmp_path / 'few.txt', ['[PAD]', '[UNK]', 'a'])
  with pytest.raises(ValueError, match=r'few\.txt.*\[CLS\].*\[SEP\].*\[MASK\]'):
    tokenization.WordPieceTokenizer(path)
  path = _write(tmp_path / 'dup.txt',
                list(tokenization.SPECIAL_TOKENS) + ['a', 'b', 'a'])
  with pytest.raises(ValueError, match=r"dup\.txt:8: duplicate token 'a'"):
    tokenization.WordPieceTokenizer(path)
  with pytest.raises(UserError, match='gone.model'):
    tokenization.load_tokenizer(str(tmp_path / 'gone.model'))


@pytest.fixture(scope='module')
def sp_model(tmp_path_factory):
  prefix = str(tmp_path_factory.mktemp('sp') / 'sp')
  texts = ENGLISH * 5 + VARIED
  return vocab_lib.train_sentencepiece(texts, prefix, vocab_size=300)


def test_sentencepiece_matches_processor(sp_model):
  spm = pytest.importorskip('sentencepiece')
  proc = spm.SentencePieceProcessor(model_file=sp_model)
  tok = tokenization.load_tokenizer(sp_model)
  assert isinstance(tok, tokenization.SentencePieceTokenizer)
  texts = VARIED + ENGLISH + ['[CLS] is text here', 'new unseen wording']
  assert tok.encode(texts) == [proc.encode(t) for t in texts]
  assert [tok.pad_id, tok.unk_id, tok.cls_id, tok.sep_id, tok.mask_id] == [
      0, 1, 2, 3, 4]
  assert tok.vocab_size == proc.get_piece_size()
  # Specials are control symbols: never produced from text.
  produced = {i for row in tok.encode(texts) for i in row}
  assert not set(tok.special_ids[2:]) & produced


def test_sentencepiece_words(sp_model):
  tok = tokenization.SentencePieceTokenizer(sp_model)
  texts = ENGLISH[:3] + ['', 'x']
  ragged = tok.tokenize_words(tf.constant(texts))
  assert ragged.merge_dims(1, 2).to_list() == tok.encode(texts)
  for text, words in zip(texts, ragged.to_list()):
    assert len(words) == len(text.split())
    for word in words:
      assert all(tok.is_continuation[i] for i in word[1:])
  assert tok.tokenize_words(tf.constant(texts[0])).to_list() == (
      ragged[0].to_list())


def test_sentencepiece_without_specials_is_an_error(tmp_path):
  spm = pytest.importorskip('sentencepiece')
  prefix = str(tmp_path / 'plain')
  spm.SentencePieceTrainer.train(sentence_iterator=iter(ENGLISH * 5),
                                 model_prefix=prefix, vocab_size=100,
                                 minloglevel=2)
  with pytest.raises(ValueError, match=r'plain\.model.*\[PAD\]'):
    tokenization.SentencePieceTokenizer(prefix + '.model')
