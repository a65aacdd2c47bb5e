"""In-graph BERT tokenizers: WordPiece exact to the original, and SentencePiece.

Both tokenizers are pure TensorFlow ops, so they run inside `tf.data` map
functions and checkpointable input pipelines (no `tf.py_function`).

`WordPieceTokenizer` reproduces the original BERT `FullTokenizer` token for
token: clean-up, spaces around CJK ideographs, Python `str.lower()`, NFD and
dropping of Mn marks (uncased only), splitting on whitespace and punctuation,
then greedy longest-match-first WordPiece. Character classes are generated
from Python's `unicodedata` (the reference the original code uses) rather than
taken from the regex engine's Unicode tables, whose version differs.

Usage:
  tok = load_tokenizer('vocab.txt', lower_case=True)
  ids = tok.tokenize(tf.constant(['Hello world!']))   # RaggedTensor [1, None]
"""

from __future__ import annotations

import dataclasses
import functools
import unicodedata
from typing import Sequence

import numpy as np
import tensorflow as tf
import tensorflow_text as tf_text

from bert_jax import fileio
from bert_jax.errors import UserError

PAD, UNK, CLS, SEP, MASK = '[PAD]', '[UNK]', '[CLS]', '[SEP]', '[MASK]'
SPECIAL_TOKENS = (PAD, UNK, CLS, SEP, MASK)
SUFFIX = '##'
SP_WORD_START = '\u2581'  # SentencePiece's '▁': the piece starts a word.

# Code point ranges the original BERT treats as CJK ideographs (its
# `_is_chinese_char`); each such character becomes a word of its own.
CJK_RANGES = (
    (0x4E00, 0x9FFF), (0x3400, 0x4DBF), (0x20000, 0x2A6DF),
    (0x2A700, 0x2B73F), (0x2B740, 0x2B81F), (0x2B820, 0x2CEAF),
    (0xF900, 0xFAFF), (0x2F800, 0x2FA1F),
)


def is_cjk(cp: int) -> bool:
  return any(lo <= cp <= hi for lo, hi in CJK_RANGES)


def is_punctuation(ch: str) -> bool:
  """BERT's punctuation: non-alphanumeric printable ASCII, and Unicode P*."""
  cp = ord(ch)
  if 33 <= cp <= 47 or 58 <= cp <= 64 or 91 <= cp <= 96 or 123 <= cp <= 126:
    return True
  return unicodedata.category(ch).startswith('P')


def is_dropped(ch: str) -> bool:
  """What the original clean-up deletes: NUL, U+FFFD, C* but tab, CR, LF."""
  if ch in '\t\n\r':
    return False
  return ch in '\x00\ufffd' or unicodedata.category(ch).startswith('C')


def is_space(ch: str) -> bool:
  """Separators after clean-up: BERT's whitespace plus what `str.split` uses."""
  return (ch in ' \t\n\r' or unicodedata.category(ch) == 'Zs' or ch.isspace())


def regex_class(cps: Sequence[int]) -> str:
  """An RE2 character class of explicit code point ranges."""
  parts, start, prev = [], None, None
  for cp in sorted(cps):
    if start is None:
      start = prev = cp
    elif cp == prev + 1:
      prev = cp
    else:
      parts.append((start, prev))
      start = prev = cp
  if start is not None:
    parts.append((start, prev))
  body = ''.join(f'\\x{{{a:X}}}' if a == b else f'\\x{{{a:X}}}-\\x{{{b:X}}}'
                 for a, b in parts)
  return f'[{body}]'


@dataclasses.dataclass(frozen=True)
class _Classes:
  drop: str  # Deleted by clean-up.
  split: str  # Punctuation and CJK: words of one character.
  wide_space: str  # Separators beyond ASCII whitespace.
  mark: str  # Mn marks, stripped after NFD when lower-casing.


@functools.lru_cache(maxsize=None)
def _classes() -> _Classes:
  drop, split, wide_space, mark = [], [], [], []
  for cp in range(0x110000):
    if 0xD800 <= cp <= 0xDFFF:  # Surrogates never occur in valid UTF-8.
      continue
    ch = chr(cp)
    if is_dropped(ch):
      drop.append(cp)
    elif is_space(ch):
      if cp > 0x7F:
        wide_space.append(cp)
    elif is_punctuation(ch) or is_cjk(cp):
      split.append(cp)
    elif unicodedata.category(ch) == 'Mn':
      mark.append(cp)
  # tf.strings.lower turns invalid UTF-8 into U+FFFD; the original decodes
  # with errors='ignore', so those go as well.
  mark.append(0xFFFD)
  return _Classes(*(regex_class(c) for c in (drop, split, wide_space, mark)))


@functools.lru_cache(maxsize=None)
def _cased_characters() -> list[str]:
  """The characters (surrogates and dropped ones aside) that `str.lower` changes: pure Python
  over every code point, cached apart from the ops that use them (tests/forkserver.py makes
  them once for every command it forks)."""
  return [chr(cp) for cp in range(0x110000)
          if not 0xD800 <= cp <= 0xDFFF and chr(cp).lower() != chr(cp)
          and not is_dropped(chr(cp))]


@functools.lru_cache(maxsize=None)
def lower_case_mismatches() -> dict[str, str]:
  """Characters whose `tf.strings.lower` differs from Python's `str.lower`.

  TensorFlow's ICU lags Python's Unicode version by a little (e.g. the
  Vithkuqi letters of Unicode 14 are not lower-cased), so these few characters
  are mapped in-graph before `tf.strings.lower` where they matter.
  """
  cased = _cased_characters()
  with tf.init_scope():
    lowered = tf.strings.lower([c.encode() for c in cased],
                               encoding='utf-8').numpy()
  return {c: c.lower() for c, low in zip(cased, lowered)
          if low.decode() != c.lower()}


def _fix_lower_case(text: tf.Tensor, fixes: dict[str, str]) -> tf.Tensor:
  """Applies Python's lower-casing to `fixes` characters, only when present."""
  pattern = '(?s).*' + regex_class([ord(c) for c in fixes]) + '.*'

  def fix():
    out = text
    for upper, lower in sorted(fixes.items()):
      out = tf.strings.regex_replace(out, f'\\x{{{ord(upper):X}}}', lower)
    return out

  present = tf.reduce_any(tf.strings.regex_full_match(text, pattern))
  return tf.cond(present, fix, lambda: text)


def normalize(strings: tf.Tensor, lower_case: bool = True,
              exact_case: bool = True) -> tf.Tensor:
  """BERT's clean-up and (uncased) lower-casing, NFD and Mn stripping.

  Args:
    strings: tf.string tensor of UTF-8 text.
    lower_case: lower-case, NFD and strip Mn marks (uncased vocabularies).
    exact_case: also lower-case the few characters TensorFlow's ICU does not
      know (one more pass over the text); see `WordPieceTokenizer`.

  Returns:
    The normalized text; separators and punctuation are still in place.
  """
  c = _classes()
  text = tf.strings.regex_replace(strings, c.drop + '+', '')
  if lower_case:
    fixes = lower_case_mismatches() if exact_case else None
    if fixes:
      text = _fix_lower_case(text, fixes)
    text = tf.strings.lower(text, encoding='utf-8')
    text = tf_text.normalize_utf8(text, 'NFD')
    text = tf.strings.regex_replace(text, c.mark + '+', '')
  return text


def split_normalized(text: tf.Tensor) -> tf.RaggedTensor:
  """Splits normalized text into words: [...] -> [..., None]."""
  c = _classes()
  # Punctuation and CJK get spaces around them, other separators become
  # spaces (the empty group), then one split on ASCII whitespace.
  text = tf.strings.regex_replace(text, f'({c.split})|{c.wide_space}',
                                  r' \1 ')
  return tf.strings.split(text)


def split_words(strings: tf.Tensor, lower_case: bool = True,
                exact_case: bool = True) -> tf.RaggedTensor:
  """BERT's basic tokenizer in-graph: strings [...] -> words [..., None]."""
  return split_normalized(normalize(strings, lower_case, exact_case))


def _read_lines(path: str) -> list[str]:
  if not tf.io.gfile.exists(path):
    reason = fileio.missing(path).removeprefix('no such file').strip()
    raise UserError(f'Vocabulary file not found: {path}{" " + reason if reason else ""} (check '
                    'data.vocab_file / vocab_file / --vocab_file, or train one with `bert-jax '
                    'vocab`)')
  if tf.io.gfile.isdir(path):
    raise UserError(f'Vocabulary {path} is a directory: name the vocab.txt file in it')
  try:
    # A byte-order mark (Windows editors) is dropped; CRLF line ends are line ends.
    return fileio.read_user_text(path).splitlines()
  except UserError as e:
    if 'not UTF-8 text' not in str(e):
      raise
    raise UserError(f'{e} (a vocab.txt is one UTF-8 token a line; a SentencePiece model '
                    'file must end in .model)') from None


def load_vocab(path: str) -> list[str]:
  """Reads a BERT vocab.txt (one token per line) and checks it."""
  tokens = [line.strip() for line in _read_lines(path)]
  while tokens and not tokens[-1]:
    tokens.pop()
  if not tokens:
    raise UserError(f'Vocabulary {path} is empty: a BERT vocab.txt has one token a line, '
                    f'{", ".join(SPECIAL_TOKENS)} among them (or train a vocabulary with '
                    '`bert-jax vocab`).')
  seen = {}
  for i, tok in enumerate(tokens):
    if not tok:
      raise UserError(f'{path}:{i + 1}: empty token in vocabulary (one token a line, no blank '
                      'lines).')
    if tok in seen:
      raise UserError(f'{path}:{i + 1}: duplicate token {tok!r} '
                      f'(first on line {seen[tok] + 1}).')
    seen[tok] = i
  missing = [t for t in SPECIAL_TOKENS if t not in seen]
  if missing:
    raise UserError(f'Vocabulary {path} lacks special tokens {missing}: a BERT vocab.txt has '
                    f'{", ".join(SPECIAL_TOKENS)} each on a line of its own (add them, or train '
                    'a vocabulary with `bert-jax vocab`).')
  return tokens


def _scalar_or_vector(strings) -> tf.Tensor:
  strings = tf.convert_to_tensor(strings, tf.string)
  if strings.shape.rank is None or strings.shape.rank > 1:
    raise ValueError('Tokenizers take a scalar or a vector of strings, got '
                     f'shape {strings.shape}.')
  return strings


def _group_words(ids: tf.RaggedTensor,
                 continues: tf.Tensor) -> tf.RaggedTensor:
  """Groups ids [N, None] into words [N, words, pieces].

  A word opens at each id that does not continue the one before, and at the
  first id of each row.
  """
  flat, splits = ids.flat_values, ids.row_splits
  row_starts = splits[:-1][splits[1:] > splits[:-1]]
  opens = tf.tensor_scatter_nd_update(
      ~tf.gather(continues, flat), row_starts[:, tf.newaxis],
      tf.ones_like(row_starts, tf.bool))
  word_starts = tf.where(opens)[:, 0]
  words = tf.RaggedTensor.from_row_starts(flat, word_starts, validate=False)
  return tf.RaggedTensor.from_row_splits(
      words, tf.searchsorted(word_starts, splits, out_type=tf.int64),
      validate=False)


class _TokenizerBase:
  """Shared Python conveniences; subclasses define `tokenize` and `_vocab`."""

  _vocab: list[str]
  _ids: dict[str, int]

  def _set_specials(self, path: str):
    missing = [t for t in SPECIAL_TOKENS if t not in self._ids]
    if missing:
      raise UserError(
          f'Tokenizer model {path} lacks special tokens {missing}: train it with '
          '`bert-jax vocab --kind=sentencepiece`, which adds them.')
    self.pad_id, self.unk_id, self.cls_id, self.sep_id, self.mask_id = (
        self._ids[t] for t in SPECIAL_TOKENS)
    self.special_ids = [self._ids[t] for t in SPECIAL_TOKENS]

  @property
  def vocab(self) -> list[str]:
    return list(self._vocab)

  @property
  def vocab_size(self) -> int:
    return len(self._vocab)

  def token_to_id(self, token: str) -> int:
    return self._ids.get(token, self.unk_id)

  def convert_tokens_to_ids(self, tokens: Sequence[str]) -> list[int]:
    return [self.token_to_id(t) for t in tokens]

  def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
    return [self._vocab[int(i)] for i in ids]

  def decode(self, ids: Sequence[int]) -> list[str]:
    """Token strings of `ids` (same as `convert_ids_to_tokens`)."""
    return self.convert_ids_to_tokens(ids)

  def encode(self, texts: Sequence[str]) -> list[list[int]]:
    """Python convenience: token ids of each text, via `tokenize`."""
    if isinstance(texts, str):
      raise TypeError('encode() takes a list of texts, not a str.')
    ids = self.tokenize(tf.constant(list(texts), tf.string))
    return ids.to_list()

  def tokenize(self, strings: tf.Tensor) -> tf.RaggedTensor:
    raise NotImplementedError

  def tf_modules(self) -> list[tf.Module]:
    """The tensorflow_text tokenizers `tokenize` runs: what a SavedModel that calls it must
    hold (export.py), so that their resources are saved with it."""
    raise NotImplementedError


class WordPieceTokenizer(_TokenizerBase):
  """Original-BERT WordPiece tokenizer as TensorFlow ops.

  Token-exact with google-research/bert `FullTokenizer` (and Hugging Face's
  slow `BertTokenizer` on NFC text; that port adds an NFC step the original
  does not have).

  The fast path normalizes, then lets `FastWordpieceTokenizer` split words and
  match pieces in one pass: its splitting rule (whitespace, ASCII symbols,
  Unicode punctuation, CJK ideographs) is BERT's, checked exhaustively in the
  tests. Its word limit counts bytes, not characters, so a batch holding an
  [UNK] word longer than `max_chars_per_word` bytes is redone word by word;
  so is one holding invalid UTF-8, whose bad bytes the original drops. (When
  lower-casing, bad bytes are dropped after `tf.strings.lower`; that differs
  only for a capital sigma next to one.)
  """

  def __init__(self, vocab_file: str, lower_case: bool = True,
               max_chars_per_word: int = 100):
    if max_chars_per_word < 1:
      raise UserError(f'max_chars_per_word must be >= 1, got '
                      f'{max_chars_per_word}.')
    self.vocab_file = vocab_file
    self.lower_case = lower_case
    self.max_chars_per_word = max_chars_per_word
    self._vocab = load_vocab(vocab_file)
    self._ids = {t: i for i, t in enumerate(self._vocab)}
    self._set_specials(vocab_file)
    self.is_continuation = np.array(
        [t.startswith(SUFFIX) and len(t) > len(SUFFIX) for t in self._vocab])
    self._continues = tf.constant(self.is_continuation)
    # The few characters TF lower-cases differently from Python only matter
    # if the vocabulary contains them: otherwise a word holding either form
    # has no matching piece and becomes [UNK] in both, so the extra pass is
    # skipped. This needs both forms to be one letter that NFD leaves alone.
    fixes = lower_case_mismatches() if lower_case else {}
    vocab_chars = set(''.join(self._vocab))
    self._exact_case = any(
        len(low) != 1 or up in vocab_chars or low in vocab_chars
        or unicodedata.normalize('NFD', low) != low
        or unicodedata.category(low) == 'Mn' for up, low in fixes.items())
    # FastWordpieceTokenizer holds no piece over 256 bytes. No real
    # vocabulary has one; such a piece is kept unreachable (its id stays).
    pieces = [t if len(t.encode()) <= 256 else f'[unreachable {i}]'
              for i, t in enumerate(self._vocab)]
    self._fast = tf_text.FastWordpieceTokenizer(
        vocab=pieces, suffix_indicator=SUFFIX,
        max_bytes_per_word=max_chars_per_word, token_out_type=tf.int32,
        unknown_token=UNK, no_pretokenization=False)
    # Words are measured in characters on the slow path; its byte limit only
    # has to be loose enough never to bite first.
    self._by_word = tf_text.FastWordpieceTokenizer(
        vocab=pieces, suffix_indicator=SUFFIX,
        max_bytes_per_word=4 * max_chars_per_word + 4,
        token_out_type=tf.int32, unknown_token=UNK, no_pretokenization=True)

  def normalize(self, strings: tf.Tensor) -> tf.Tensor:
    return normalize(strings, self.lower_case, self._exact_case)

  def tf_modules(self) -> list[tf.Module]:
    return [self._fast, self._by_word]

  def split_words(self, strings: tf.Tensor) -> tf.RaggedTensor:
    """Normalized words before WordPiece: strings [...] -> [..., None]."""
    return split_normalized(self.normalize(strings))

  def _pieces_by_word(self, strings: tf.Tensor) -> tf.RaggedTensor:
    """The slow path: ids [N, words, pieces], words split by regex."""
    # The original decodes with errors='ignore'.
    strings = tf.strings.unicode_transcode(strings, 'UTF-8', 'UTF-8',
                                           errors='ignore')
    words = self.split_words(strings)
    flat = words.flat_values
    limit = self.max_chars_per_word

    def unk_long_words():
      chars = tf.strings.length(flat, unit='UTF8_CHAR')
      return tf.where(chars > limit, tf.constant(UNK), flat)

    # A word of more than `limit` characters is [UNK], as in the original. Only
    # byte lengths over the limit can be that long, which is cheap to check.
    flat = tf.cond(tf.reduce_any(tf.strings.length(flat) > limit),
                   unk_long_words, lambda: flat)
    return self._by_word.tokenize(words.with_flat_values(flat))

  def tokenize(self, strings: tf.Tensor) -> tf.RaggedTensor | tf.Tensor:
    """Token ids: [N] -> RaggedTensor [N, None] int32 (scalar -> [None])."""
    strings = _scalar_or_vector(strings)
    if strings.shape.rank == 0:
      return self.tokenize(strings[tf.newaxis])[0]
    text = self.normalize(strings)
    ids, starts, ends = self._fast.tokenize_with_offsets(text)
    # Two things make the fused path say [UNK] where the original may not: a
    # word over the byte limit, and invalid UTF-8 (the original drops the
    # bad bytes). Both show as [UNK] words, which are rare, so only those
    # are looked at.
    at = tf.where(ids.flat_values == self.unk_id)[:, 0]
    start = tf.gather(starts.flat_values, at)
    length = tf.gather(ends.flat_values, at) - start
    row = tf.searchsorted(ids.row_splits, at, side='right') - 1
    unk_words = tf.strings.substr(tf.gather(text, row), start, length)
    redo = tf.reduce_any(
        (length > self.max_chars_per_word) |
        ~tf.strings.regex_full_match(unk_words, '(?s).*'))
    return tf.cond(redo,
                   lambda: self._pieces_by_word(strings).merge_dims(1, 2),
                   lambda: ids)

  def tokenize_words(self, strings: tf.Tensor) -> tf.RaggedTensor:
    """Ids grouped by word: [N] -> [N, words, pieces] (scalar: [words, pieces]).

    Every word starts with a piece that is not a '##' continuation (an [UNK]
    word is one piece), so the grouping follows from the ids.
    """
    strings = _scalar_or_vector(strings)
    if strings.shape.rank == 0:
      return self.tokenize_words(strings[tf.newaxis])[0]
    return _group_words(self.tokenize(strings), self._continues)


class SentencePieceTokenizer(_TokenizerBase):
  """SentencePiece model as TensorFlow ops, with BERT's special tokens.

  The model carries its own normalization (lower-casing included, see
  `vocab.train_sentencepiece`), so there is no `lower_case` here.
  """

  def __init__(self, model_file: str):
    if not tf.io.gfile.exists(model_file):
      raise UserError(f'SentencePiece model not found: {model_file}')
    with tf.io.gfile.GFile(model_file, 'rb') as f:
      model = f.read()
    import sentencepiece as spm  # pylint: disable=g-import-not-at-top
    try:
      proc = spm.SentencePieceProcessor(model_proto=model)
    except RuntimeError as e:
      raise UserError(f'Not a SentencePiece model: {model_file}: {e}') from e
    self.model_file = model_file
    self._vocab = [proc.id_to_piece(i) for i in range(proc.get_piece_size())]
    self._ids = {t: i for i, t in enumerate(self._vocab)}
    self._set_specials(model_file)
    # A continuation attaches to the piece before it: a piece that does not
    # start with '▁' ([UNK] included: a word-initial unknown follows a lone
    # '▁'). Control pieces and the specials stand alone.
    self.is_continuation = np.array([
        not (t.startswith(SP_WORD_START) or proc.is_control(i)
             or proc.is_unused(i) or t in (PAD, CLS, SEP, MASK))
        for i, t in enumerate(self._vocab)])
    self._continues = tf.constant(self.is_continuation)
    self._sp = tf_text.SentencepieceTokenizer(model=model, out_type=tf.int32)

  def tokenize(self, strings: tf.Tensor) -> tf.RaggedTensor | tf.Tensor:
    """Token ids: [N] -> RaggedTensor [N, None] int32 (scalar -> [None])."""
    return self._sp.tokenize(_scalar_or_vector(strings))

  def tf_modules(self) -> list[tf.Module]:
    return [self._sp]

  def tokenize_words(self, strings: tf.Tensor) -> tf.RaggedTensor:
    """Ids grouped by word (a piece starting with '▁' opens one): [N, W, P]."""
    strings = _scalar_or_vector(strings)
    if strings.shape.rank == 0:
      return self.tokenize_words(strings[tf.newaxis])[0]
    return _group_words(self._sp.tokenize(strings), self._continues)


def load_tokenizer(path: str, lower_case: bool = True) -> _TokenizerBase:
  """A `.model` file gives a SentencePieceTokenizer, anything else WordPiece."""
  if path.endswith('.model'):
    return SentencePieceTokenizer(path)
  return WordPieceTokenizer(path, lower_case=lower_case)
