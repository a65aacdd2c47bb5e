"""Training WordPiece and SentencePiece vocabularies (`bert-jax vocab`).

Input text is one sentence per line with blank lines between documents, in
plain or .gz files (read with tf.io.gfile, so gs:// works), or any iterable of
lines.

WordPiece vocabularies are learned on the words of the in-graph tokenizer's own
basic tokenization (`tokenization.split_words`), so the vocabulary fits exactly
what the tokenizer will feed it. The learner is BPE over word counts in
WordPiece spelling ('##' marks a piece that continues a word): it starts from
every character seen and merges the most frequent adjacent pair, ties broken by
the pieces' text, so the result depends only on the input.

Usage:
  vocab.run(['corpus/*.txt.gz'], 'vocab.txt', vocab_size=30522)
"""

from __future__ import annotations

import collections
import gzip
import heapq
import io
import itertools
from typing import Iterable, Iterator, Sequence

from absl import logging
import ml_collections
import tensorflow as tf
import tqdm

from bert_jax import documents
from bert_jax import fileio
from bert_jax import tokenization
from bert_jax.errors import UserError

_CHUNK_BYTES = 1 << 23


class EmptyInputError(UserError):
  """The input text has no words."""


def reserved_tokens(num_unused: int = 0) -> list[str]:
  """BERT's layout: [PAD], [unused0..N-1], [UNK], [CLS], [SEP], [MASK]."""
  return ([tokenization.PAD] + [f'[unused{i}]' for i in range(num_unused)] +
          [tokenization.UNK, tokenization.CLS, tokenization.SEP,
           tokenization.MASK])


def expand_patterns(patterns: Sequence[str]) -> list[str]:
  """Files matching each glob pattern, sorted; a pattern with none raises (naming --input)."""
  if isinstance(patterns, str):
    patterns = [patterns]
  if not patterns:
    raise UserError('--input is empty')
  return [f for p in patterns for f in documents.expand_files(p, flag='--input')]


def read_files(paths: Sequence[str]) -> Iterator[str]:
  """Lines (without line ends) of the text files `paths` (gzip for *.gz)."""
  for path in paths:
    with tf.io.gfile.GFile(path, 'rb') as raw:
      f = gzip.GzipFile(fileobj=raw) if path.endswith('.gz') else raw
      rest = b''
      while True:
        chunk = f.read(_CHUNK_BYTES)
        if not chunk:
          break
        # Cut at a line end so no UTF-8 character is split between chunks.
        chunk = rest + chunk
        cut = chunk.rfind(b'\n') + 1
        rest = chunk[cut:]
        yield from chunk[:cut].decode('utf-8', 'ignore').splitlines()
      if rest:
        yield from rest.decode('utf-8', 'ignore').splitlines()


def _batches(texts: Iterable[str], size: int) -> Iterator[list[str]]:
  batch = []
  for text in texts:
    if text.strip():
      batch.append(text)
      if len(batch) == size:
        yield batch
        batch = []
  if batch:
    yield batch


def count_words(texts: Iterable[str], lower_case: bool = True,
                batch_size: int = 4096) -> dict[str, int]:
  """Counts of the words BERT's basic tokenization makes of `texts`."""
  # A graph as written: AutoGraph's rewrite of it (and of the tokenization it calls) cost
  # about 0.6 s of the 2 s of counting the sample corpus's words.
  @tf.function(input_signature=[tf.TensorSpec([None], tf.string)], autograph=False)
  def split_and_count(lines):
    words = tokenization.split_words(lines, lower_case).flat_values
    unique, _, counts = tf.unique_with_counts(words, out_idx=tf.int64)
    return unique, counts

  counts = collections.Counter()
  num_lines = 0
  for batch in tqdm.tqdm(_batches(texts, batch_size), desc='counting words',
                         unit=' batches', mininterval=5, leave=False):
    num_lines += len(batch)
    words, n = split_and_count(tf.constant(batch))
    counts.update(dict(zip(words.numpy().tolist(), n.numpy().tolist())))
  logging.info('Counted %d distinct words in %d lines.', len(counts), num_lines)
  return {w.decode('utf-8'): n for w, n in counts.items()}


def _join(a: str, b: str) -> str:
  return a + b[len(tokenization.SUFFIX):]


def learn_wordpieces(word_counts: dict[str, int], num_pieces: int,
                     max_chars_per_word: int = 100,
                     max_piece_chars: int = 50) -> list[str]:
  """Learns up to `num_pieces` WordPiece tokens from word counts.

  All characters come first (a character starting a word as is, one inside a
  word as '##c'); if they alone exceed half of `num_pieces`, the rarest are
  left out (and become [UNK]). Then pieces, of at most `max_piece_chars`
  characters, are added in merge order.
  """
  suffix = tokenization.SUFFIX
  words = sorted((w, n) for w, n in word_counts.items()
                 if 0 < len(w) <= max_chars_per_word)
  char_counts = collections.Counter()
  for w, n in words:
    char_counts[w[0]] += n
    for c in w[1:]:
      char_counts[suffix + c] += n
  alphabet = sorted(char_counts, key=lambda t: (-char_counts[t], t))
  if len(alphabet) > num_pieces // 2:
    kept = alphabet[:num_pieces // 2]
    dropped = sum(char_counts[t] for t in alphabet[len(kept):])
    logging.warning('Vocabulary keeps the %d most frequent of %d characters; '
                    '%d occurrences of the others will be [UNK].', len(kept),
                    len(alphabet), dropped)
    alphabet = kept
  pieces = sorted(alphabet, key=lambda t: (t.startswith(suffix), t))
  ids = {t: i for i, t in enumerate(pieces)}

  # Words as lists of piece ids; words with a dropped character cannot merge
  # into anything the tokenizer would use, so they sit out.
  seqs, weights = [], []
  for w, n in words:
    seq = [ids.get(w[0])] + [ids.get(suffix + c) for c in w[1:]]
    if None not in seq and len(seq) > 1:
      seqs.append(seq)
      weights.append(n)

  pair_counts = collections.defaultdict(int)
  pair_words = collections.defaultdict(set)
  for i, (seq, n) in enumerate(zip(seqs, weights)):
    for pair in zip(seq, seq[1:]):
      pair_counts[pair] += n
      pair_words[pair].add(i)
  # Max-heap by count, then by the pieces' text: deterministic ties. Entries
  # go stale as counts fall; a stale entry is re-pushed with its true count.
  heap = [(-n, pieces[a], pieces[b], a, b) for (a, b), n in pair_counts.items()]
  heapq.heapify(heap)
  progress = tqdm.tqdm(total=num_pieces, initial=len(pieces), unit=' pieces',
                       desc='learning wordpieces', mininterval=5, leave=False)
  while len(pieces) < num_pieces and heap:
    neg, _, _, a, b = heapq.heappop(heap)
    n = pair_counts.get((a, b), 0)
    if n <= 0:
      continue
    if n != -neg:
      heapq.heappush(heap, (-n, pieces[a], pieces[b], a, b))
      continue
    new_piece = _join(pieces[a], pieces[b])
    if len(new_piece.removeprefix(suffix)) > max_piece_chars:
      continue  # Never merged; its stale heap entries pop and go the same way.
    z = ids.get(new_piece)
    if z is None:
      z = ids[new_piece] = len(pieces)
      pieces.append(new_piece)
      progress.update(1)
    changed = set()
    for i in pair_words.pop((a, b)):
      seq, weight = seqs[i], weights[i]
      merged, j = [], 0
      while j < len(seq):
        if j + 1 < len(seq) and seq[j] == a and seq[j + 1] == b:
          merged.append(z)
          j += 2
        else:
          merged.append(seq[j])
          j += 1
      if len(merged) == len(seq):
        continue  # A stale index: the pair left this word earlier.
      for pair in zip(seq, seq[1:]):
        pair_counts[pair] -= weight
      for pair in zip(merged, merged[1:]):
        pair_counts[pair] += weight
        pair_words[pair].add(i)
        if z in pair:
          changed.add(pair)
      seqs[i] = merged
    pair_counts.pop((a, b), None)
    for pair in sorted(changed):
      heapq.heappush(heap, (-pair_counts[pair], pieces[pair[0]],
                            pieces[pair[1]], *pair))
  progress.close()
  return pieces


def _write_lines(path: str, lines: Sequence[str]):
  # Whole or not at all: a truncated vocab.txt (a full disk) would be taken for a whole one.
  fileio.write_text(path, ''.join(line + '\n' for line in lines))


def train_wordpiece(texts: Iterable[str], output_path: str, vocab_size: int,
                    lower_case: bool = True, num_unused: int = 0,
                    max_chars_per_word: int = 100) -> str:
  """Learns a WordPiece vocab.txt of `vocab_size` tokens from lines of text.

  Args:
    texts: lines of text (`read_files` reads them from files).
    output_path: where vocab.txt goes.
    vocab_size: tokens in the file, the reserved ones included; a corpus with
      too few distinct pieces gives fewer (logged).
    lower_case: uncased vocabulary (must match the tokenizer's setting).
    num_unused: [unusedN] slots to reserve after [PAD] for later additions.
    max_chars_per_word: longer words are [UNK] for the tokenizer; skipped here.

  Returns:
    output_path.
  """
  reserved = reserved_tokens(num_unused)
  if vocab_size <= len(reserved):
    raise UserError(f'vocab_size={vocab_size} leaves no room after the '
                    f'{len(reserved)} reserved tokens.')
  counts = count_words(texts, lower_case)
  if not counts:
    raise EmptyInputError('No words in the input text: it is empty or blank.')
  pieces = learn_wordpieces(counts, vocab_size - len(reserved),
                            max_chars_per_word)
  # A piece equal to a reserved token (a corpus cannot produce one: '[' is
  # punctuation) would make a duplicate.
  pieces = [p for p in pieces if p not in set(reserved)]
  if len(reserved) + len(pieces) < vocab_size:
    logging.warning('The input has only enough pieces for a vocabulary of %d '
                    'tokens (asked for %d).', len(reserved) + len(pieces),
                    vocab_size)
  _write_lines(output_path, reserved + pieces)
  logging.info('Wrote %d tokens to %s.', len(reserved) + len(pieces),
               output_path)
  return output_path


def train_sentencepiece(texts: Iterable[str], model_prefix: str,
                        vocab_size: int, model_type: str = 'unigram',
                        lower_case: bool = True,
                        character_coverage: float = 0.9999,
                        max_sentences: int = 0) -> str:
  """Trains a SentencePiece model with BERT's special tokens; returns its path.

  [PAD]=0, [UNK]=1, [CLS]=2, [SEP]=3, [MASK]=4. The specials are control
  symbols, so the same strings inside the text stay ordinary text (as with
  WordPiece). Lower-casing is the model's own normalization (NFKC + case
  folding), so the tokenizer needs no flag. Training is single-threaded and,
  unless `max_sentences` > 0 asks for a sample (seeded), sees every line, so
  the model depends only on the input.
  """
  import sentencepiece as spm  # pylint: disable=g-import-not-at-top
  if model_type not in ('unigram', 'bpe'):
    raise UserError(f"model_type must be 'unigram' or 'bpe', got "
                    f'{model_type!r}.')
  lines = (t for t in texts if t.strip())
  first = next(lines, None)
  if first is None:
    raise EmptyInputError('No text to train a SentencePiece model on.')

  def all_lines():
    yield first
    yield from lines

  model = io.BytesIO()
  spm.set_random_generator_seed(0)
  spm.SentencePieceTrainer.train(
      sentence_iterator=all_lines(), model_writer=model,
      # A soft limit: a corpus with too few pieces gives a smaller vocabulary (logged, as
      # WordPiece's) instead of SentencePiece's RuntimeError; otherwise the same model.
      vocab_size=vocab_size, hard_vocab_limit=False, model_type=model_type,
      normalization_rule_name='nmt_nfkc_cf' if lower_case else 'nmt_nfkc',
      character_coverage=character_coverage,
      pad_id=0, pad_piece=tokenization.PAD, unk_id=1,
      unk_piece=tokenization.UNK, bos_id=-1, eos_id=-1,
      control_symbols=[tokenization.CLS, tokenization.SEP, tokenization.MASK],
      input_sentence_size=max_sentences,
      shuffle_input_sentence=max_sentences > 0, num_threads=1, minloglevel=2)
  size = spm.SentencePieceProcessor(model_proto=model.getvalue()).get_piece_size()
  if size < vocab_size:
    logging.warning('The input has only enough pieces for a vocabulary of %d tokens (asked '
                    'for %d).', size, vocab_size)
  path = model_prefix + '.model'
  fileio.write_bytes(path, model.getvalue())
  logging.info('Wrote SentencePiece model %s.', path)
  return path


def run(input_patterns: Sequence[str], output: str, vocab_size: int,
        kind: str = 'wordpiece', lower_case: bool = True,
        num_unused: int = 0, tfds_text_key: str = 'text',
        tfds_data_dir: str = '', text_column: str = 'text') -> str:
  """Entry point of `bert-jax vocab`: trains a vocabulary from text files, TFDS or tables.

  `input_patterns` are file paths / globs, 'tfds:NAME[/CONFIG][:SPLIT]' whose feature
  `tfds_text_key` holds the text, or tables (Parquet, hf://datasets/..., a saved dataset
  folder) whose column `text_column` does. `output` is the vocab.txt path for WordPiece, or the model
  path (with or without '.model') for SentencePiece. Returns the file written.
  """
  if kind not in ('wordpiece', 'sentencepiece'):
    raise UserError(f"kind must be 'wordpiece' or 'sentencepiece', got "
                    f'{kind!r}.')
  if kind == 'sentencepiece' and num_unused:
    raise UserError('num_unused is for WordPiece vocabularies only.')
  if isinstance(input_patterns, str):
    input_patterns = [input_patterns]
  fileio.check_output_file(output if kind == 'wordpiece'
                           else output.removesuffix('.model') + '.model', '--output')
  tfds_specs = [p for p in input_patterns if documents.input_kind(p) in ('tfds', 'table')]
  file_patterns = [p for p in input_patterns if p not in tfds_specs]
  # Expanded here, before any work, so that a pattern matching nothing fails at once.
  paths = expand_patterns(file_patterns) if file_patterns else []
  # SentencePiece writes <prefix>.model and <prefix>.vocab: neither may be an input.
  prefix = output.removesuffix('.model')
  for written in [output] if kind == 'wordpiece' else [prefix + '.model', prefix + '.vocab']:
    fileio.check_not_an_input(written, '--output', {'--input': paths})
  data = ml_collections.ConfigDict({'tfds_text_key': tfds_text_key,
                                    'tfds_data_dir': tfds_data_dir,
                                    'text_column': text_column})
  texts = itertools.chain(read_files(paths),
                          *(documents.text_lines(spec, data, setting='--') for spec in tfds_specs))
  try:
    if kind == 'wordpiece':
      return train_wordpiece(texts, output, vocab_size, lower_case, num_unused)
    return train_sentencepiece(texts, output.removesuffix('.model'),
                               vocab_size, lower_case=lower_case)
  except EmptyInputError as e:
    raise EmptyInputError(f'No text in {list(input_patterns)}.') from e
