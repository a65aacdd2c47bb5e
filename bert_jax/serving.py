"""What `bert-jax predict` does around the model, as TensorFlow ops: the graph of an export.

A served model (export.py) takes strings and returns answers, so everything between the two
runs in the graph: the in-graph tokenizer (tokenization.py), each task's packing of token ids
into model inputs, and each task's decoding. Each function here is the graph form of the Python
it names, to the token and (SQuAD's answer text) to the character; tests/export_test.py checks
them against it.

Shapes: a batch of B strings; token ids are RaggedTensors [B, None] until `model_inputs` pads
them into the dense [B, L] int32 `input_ids`, `input_mask`, `segment_ids` the model takes.
"""

from __future__ import annotations

import math
from typing import Sequence

import tensorflow as tf

from bert_jax import tokenization

# Python's whitespace (`str.split()` with no argument), as an RE2 class.
_PYTHON_SPACE = tokenization.regex_class(
    [cp for cp in range(0x110000) if not 0xD800 <= cp <= 0xDFFF and chr(cp).isspace()])
# SQuAD's word separators (squad.split_context).
_SQUAD_SPACE = r'[ \t\r\n\x{202F}]'


def column(value: int, rows: tf.Tensor) -> tf.RaggedTensor:
  """[rows, 1] of `value`, ragged (to concatenate with ragged token ids)."""
  return tf.RaggedTensor.from_tensor(tf.fill(tf.stack([rows, 1]), tf.constant(value, tf.int32)))


def prefix(ids: tf.RaggedTensor, lengths: tf.Tensor) -> tf.RaggedTensor:
  """Each row's first `lengths` [B] ids."""
  starts = ids.row_starts()
  index = tf.ragged.range(starts, starts + tf.minimum(tf.cast(lengths, tf.int64),
                                                      ids.row_lengths()))
  return index.with_flat_values(tf.gather(ids.values, index.flat_values))


def truncated_pair_lengths(len_a: tf.Tensor, len_b: tf.Tensor, room: int | tf.Tensor
                           ) -> tuple[tf.Tensor, tf.Tensor]:
  """The lengths `glue.truncate_seq_pair` leaves, in closed form.

  It pops from the longer list (from `b` on ties) until both fit in `room`: while the shorter
  one fits in half the room only the longer one is cut, to `room - shorter`; otherwise both end
  halved, `a` keeping the odd token.
  """
  fits = len_a + len_b <= room
  a_shorter = len_a <= len_b
  cut_b_only = a_shorter & (2 * len_a <= room)
  cut_a_only = ~a_shorter & (2 * len_b <= room)
  new_a = tf.where(fits | cut_b_only, len_a, tf.where(cut_a_only, room - len_b, (room + 1) // 2))
  new_b = tf.where(fits | cut_a_only, len_b, tf.where(cut_b_only, room - len_a, room // 2))
  return new_a, new_b


def pack_pair(ids_a: tf.RaggedTensor, ids_b: tf.RaggedTensor | None, cls_id: int, sep_id: int,
              max_seq_length: int) -> tuple[tf.RaggedTensor, tf.RaggedTensor, tf.Tensor]:
  """`glue.pack_pair` of a batch: ('[CLS] A [SEP] (B [SEP])' ids, segment ids, truncated [B])."""
  rows = ids_a.nrows(out_type=tf.int32)
  len_a = ids_a.row_lengths()
  if ids_b is None:
    keep_a = tf.minimum(len_a, max_seq_length - 2)
    ids = tf.concat([column(cls_id, rows), prefix(ids_a, keep_a), column(sep_id, rows)], axis=1)
    return ids, tf.zeros_like(ids), keep_a < len_a
  len_b = ids_b.row_lengths()
  keep_a, keep_b = truncated_pair_lengths(len_a, len_b, max_seq_length - 3)
  first = tf.concat([column(cls_id, rows), prefix(ids_a, keep_a), column(sep_id, rows)], axis=1)
  second = tf.concat([prefix(ids_b, keep_b), column(sep_id, rows)], axis=1)
  ids = tf.concat([first, second], axis=1)
  segments = tf.concat([tf.zeros_like(first), tf.ones_like(second)], axis=1)
  return ids, segments, (keep_a < len_a) | (keep_b < len_b)


def _round_up(value: tf.Tensor, sizes: Sequence[int]) -> tf.Tensor:
  """The smallest of `sizes` (ascending) that is >= value; the last one when none is."""
  last = len(sizes) - 1
  sizes = tf.constant(sizes, value.dtype)
  return tf.gather(sizes, tf.minimum(tf.searchsorted(sizes, value[tf.newaxis])[0], last))


def model_inputs(ids: tf.RaggedTensor, segments: tf.RaggedTensor, pad_id: int,
                 lengths: Sequence[int]) -> dict[str, tf.Tensor]:
  """Dense model inputs [N, L] of ragged ids, L the smallest of `lengths` (the run's buckets
  and its max_seq_length) that holds the longest row: as `batching` cuts a batch to a bucket,
  so that a server compiles a few programs, not one per length."""
  longest = tf.reduce_max(tf.concat([tf.cast(ids.row_lengths(), tf.int32), [1]], 0))
  shape = tf.stack([ids.nrows(out_type=tf.int32), _round_up(longest, lengths)])
  return {'input_ids': ids.to_tensor(pad_id, shape=shape),
          'input_mask': tf.ones_like(ids).to_tensor(0, shape=shape),
          'segment_ids': segments.to_tensor(0, shape=shape)}


def pad_batch(inputs: dict[str, tf.Tensor]) -> dict[str, tf.Tensor]:
  """Model inputs [B, ...] padded to B' rows, the power of two that holds B (at least 1):
  a server meeting every batch size compiles a handful of programs. Padding rows are a lone
  unmasked token (every choice of one), as `batching` pads, so that attention always has a
  key."""
  rows = tf.shape(inputs['input_ids'])[0]
  padded = _round_up(tf.maximum(rows, 1), [1 << i for i in range(25)])
  out = {}
  for key, value in inputs.items():
    extra = tf.concat([[padded - rows], tf.shape(value)[1:]], 0)
    fill = tf.zeros(extra, value.dtype)
    if key == 'input_mask':
      first = tf.cast(tf.range(tf.shape(value)[-1]) == 0, value.dtype)
      fill = fill + first
    out[key] = tf.concat([value, fill], 0)
  return out


def collapse_spaces(text: tf.Tensor) -> tf.Tensor:
  """`' '.join(text.split())`: runs of Python whitespace as one space, none at either end."""
  text = tf.strings.regex_replace(text, _PYTHON_SPACE + '+', ' ')
  return tf.strings.regex_replace(text, '^ | $', '')


def squad_words(context: tf.Tensor) -> tuple[tf.RaggedTensor, tf.RaggedTensor]:
  """`squad.split_context` of a batch: the whitespace words [B, W] and each one's start in its
  context, in characters [B, W]."""
  import tensorflow_text as tf_text  # pylint: disable=g-import-not-at-top
  words, starts, _ = tf_text.regex_split_with_offsets(context, _SQUAD_SPACE + '+', '')
  # Byte offsets -> character offsets: the characters of the context before each word.
  before = tf.strings.substr(tf.gather(context, words.value_rowids()),
                            tf.zeros_like(starts.flat_values), starts.flat_values)
  chars = tf.strings.length(before, unit='UTF8_CHAR')
  return words, words.with_flat_values(tf.cast(chars, tf.int64))



# ---------------------------------------------------------------------------------------------
# NER: words -> windows, and a tag per word back
# ---------------------------------------------------------------------------------------------


def ner_windows(words: tf.RaggedTensor, pieces: tf.RaggedTensor, room: int, unk_id: int
                ) -> tuple[tf.RaggedTensor, tf.Tensor, tf.Tensor]:
  """`ner.convert_sentences` of sentences of `words` [B, W], their word pieces [B*W, P]: the
  windows' pieces [R, T] (each sentence cut at word boundaries into windows of at most `room`
  pieces, a word without pieces as [UNK], a longer one cut to `room`), and each word's window
  [B*W] and the position of its first piece in that window (after [CLS]) [B*W]."""
  count = tf.shape(pieces.row_lengths())[0]
  empty = pieces.row_lengths() == 0
  pieces = tf.concat([pieces, tf.ragged.boolean_mask(column(unk_id, count), empty[:, None])],
                     axis=1)
  pieces = prefix(pieces, tf.fill([count], tf.constant(room, tf.int64)))
  lengths = pieces.row_lengths()
  opens_sentence = tf.ragged.range(words.row_lengths()).flat_values == 0

  def place(state, word):
    used, window = state
    length, first = word
    new = first | (used + length > room)
    return (tf.where(new, length, used + length), tf.where(new, window + 1, window))

  _, window = tf.scan(place, (lengths, opens_sentence),
                      initializer=(tf.constant(0, tf.int64), tf.constant(-1, tf.int64)))
  windows = tf.reduce_max(tf.concat([window, [-1]], 0)) + 1
  by_window = tf.RaggedTensor.from_value_rowids(pieces, window, nrows=windows)
  before = tf.cumsum(lengths, exclusive=True)
  position = 1 + before - tf.gather(tf.gather(before, by_window.row_starts()), window)
  return by_window.merge_dims(1, 2), window, position


# ---------------------------------------------------------------------------------------------
# SQuAD: windows over the document, and the answer spans decoded to text
# ---------------------------------------------------------------------------------------------


def squad_windows(query: tf.RaggedTensor, words: tf.RaggedTensor, pieces: tf.RaggedTensor,
                  max_seq_length: int, doc_stride: int, max_query_length: int, cls_id: int,
                  sep_id: int) -> dict[str, tf.Tensor | tf.RaggedTensor]:
  """`squad.convert_examples` of a batch: the questions' ids [B, Q], the contexts' words
  [B, W] and their pieces [B*W, P] -> windows '[CLS] query [SEP] doc-window [SEP]', each a row:
  ids and segment ids [R, T], token_to_orig (the word of each document token, -1 elsewhere)
  and token_is_max_context [R, T], and each row's example [R]."""
  query = prefix(query, tf.fill(tf.shape(query.row_lengths()),
                                tf.constant(max_query_length, tf.int64)))
  rows = query.nrows()
  doc = tf.RaggedTensor.from_row_splits(pieces, words.row_splits).merge_dims(1, 2)
  word_of_piece = tf.cast(pieces.value_rowids() - tf.gather(words.row_starts(), doc.value_rowids()),
                          tf.int32)
  num_tokens = doc.row_lengths()
  # `squad._doc_spans`: windows `step` apart, the last one ending at the document's end.
  room = tf.maximum(max_seq_length - query.row_lengths() - 3, 1)
  step = tf.minimum(tf.constant(doc_stride, tf.int64), room)
  windows = 1 + tf.maximum(num_tokens - room + step - 1, 0) // step
  example = tf.repeat(tf.range(rows), windows)
  span = tf.ragged.range(windows).flat_values
  start = span * tf.gather(step, example)
  length = tf.minimum(tf.gather(num_tokens, example) - start, tf.gather(room, example))
  # `squad._max_context_windows`: a token's best window, min(left, right context) + 0.01 *
  # window length, the first on ties; among the few windows that hold it.
  token_example = doc.value_rowids()
  position = tf.ragged.range(num_tokens).flat_values
  token_step, token_room = tf.gather(step, token_example), tf.gather(room, token_example)
  first = tf.maximum(tf.math.floordiv(position - token_room, token_step) + 1, 0)
  last = tf.minimum(position // token_step, tf.gather(windows, token_example) - 1)
  holding = max(1, -(-(max_seq_length - 3) // doc_stride)) + 1
  best_score = tf.fill(tf.shape(position), tf.constant(-math.inf, tf.float64))
  best = tf.zeros_like(position)
  for r in range(holding):
    k = first + r
    k_start = k * token_step
    k_length = tf.minimum(tf.gather(num_tokens, token_example) - k_start, token_room)
    score = (tf.cast(tf.minimum(position - k_start, k_start + k_length - 1 - position),
                     tf.float64) + 0.01 * tf.cast(k_length, tf.float64))
    better = (k <= last) & (score > best_score)
    best_score = tf.where(better, score, best_score)
    best = tf.where(better, k, best)
  # The windows' document tokens, gathered from the flat document.
  doc_start = tf.gather(doc.row_starts(), example) + start
  index = tf.ragged.range(doc_start, doc_start + length)
  window_ids = index.with_flat_values(tf.gather(doc.values, index.flat_values))
  to_orig = index.with_flat_values(tf.gather(word_of_piece, index.flat_values))
  max_context = index.with_flat_values(tf.cast(
      tf.gather(best, index.flat_values) == tf.repeat(span, length), tf.int32))
  window_query = tf.gather(query, example)
  count = tf.shape(example)[0]
  head = tf.concat([column(cls_id, count), window_query, column(sep_id, count)], axis=1)
  tail = tf.concat([window_ids, column(sep_id, count)], axis=1)
  minus_one = lambda x: tf.fill(tf.shape(x.flat_values), -1)
  return {
      'ids': tf.concat([head, tail], axis=1),
      'segments': tf.concat([tf.zeros_like(head), tf.ones_like(tail)], axis=1),
      'token_to_orig': tf.concat([head.with_flat_values(minus_one(head)), to_orig,
                                  column(-1, count)], axis=1),
      'token_is_max_context': tf.concat([tf.zeros_like(head), max_context,
                                         tf.zeros_like(column(0, count))], axis=1),
      'example': tf.cast(example, tf.int32),
  }


def project_to_original(pred_text: tf.Tensor, orig_text: tf.Tensor, lower_case: bool
                        ) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
  """`squad.project_to_original` of one answer (scalars): the text, and its first and last
  characters' positions in `orig_text`."""
  orig = tf.strings.unicode_decode(orig_text, 'UTF-8')
  whole = (orig_text, tf.constant(0, tf.int64), tf.cast(tf.size(orig), tf.int64) - 1)

  def find():
    normalised = tf.strings.reduce_join(
        tokenization.split_words(orig_text[tf.newaxis], lower_case)[0], separator=' ')
    parts = tf.strings.split(normalised, sep=pred_text, maxsplit=1)
    norm = tf.strings.unicode_decode(normalised, 'UTF-8')
    kept = tf.where(orig != 32)[:, 0]
    norm_spaces = tf.cumsum(tf.cast(norm == 32, tf.int64))  # Spaces up to each position.
    aligned = (tf.size(parts) == 2) & (
        tf.size(kept, out_type=tf.int64) == tf.reduce_sum(tf.cast(norm != 32, tf.int64)))

    def project():
      chars = lambda x: tf.cast(tf.strings.length(x, unit='UTF8_CHAR'), tf.int64)
      start = chars(parts[0])
      end = start + chars(pred_text) - 1
      first = tf.gather(kept, start - tf.gather(norm_spaces, start))
      last = tf.gather(kept, end - tf.gather(norm_spaces, end))
      return tf.strings.unicode_encode(orig[first:last + 1], 'UTF-8'), first, last
    return tf.cond(aligned, project, lambda: whole)
  return tf.cond(tf.strings.length(pred_text) > 0, find, lambda: whole)


def squad_decode(logits: tf.Tensor, windows: dict[str, tf.Tensor | tf.RaggedTensor],
                 words: tf.RaggedTensor, word_starts: tf.RaggedTensor, vocab: tf.Tensor, *,
                 n_best_size: int, max_answer_length: int, version_2: bool,
                 null_score_diff_threshold: float, lower_case: bool) -> dict[str, tf.Tensor]:
  """`squad.decode_predictions` of a batch: the windows' start and end logits [R, 2, L]
  (`squad_windows`' rows) -> each question's answer, its characters [start, end) in the
  context (-1 for no answer), the n-best answers with their probabilities and logits (n_best
  + 1 slots: v2.0 adds the empty answer after a full list) and v2.0's no-answer odds.

  Scores are float64 sums of the logits, as there; candidates are ranked by a stable sort in
  the order they are made (window, start rank, end rank; the empty answer last)."""
  rows = words.nrows(out_type=tf.int32)
  logits = tf.cast(logits, tf.float64)
  num_tokens = tf.cast(windows['ids'].row_lengths(), tf.int32)
  count, length = tf.shape(logits)[0], tf.shape(logits)[2]
  real = tf.range(length)[tf.newaxis] < num_tokens[:, tf.newaxis]
  very_negative = tf.constant(-math.inf, tf.float64)
  k = tf.minimum(n_best_size, length)
  start_logit, start = tf.math.top_k(tf.where(real, logits[:, 0], very_negative), k)
  end_logit, end = tf.math.top_k(tf.where(real, logits[:, 1], very_negative), k)
  shape = tf.stack([count, length])
  to_orig = windows['token_to_orig'].to_tensor(-1, shape=shape)
  max_context = windows['token_is_max_context'].to_tensor(0, shape=shape)
  start_ok = ((start < num_tokens[:, tf.newaxis]) & (tf.gather(to_orig, start, batch_dims=1) >= 0)
              & (tf.gather(max_context, start, batch_dims=1) == 1))
  end_ok = (end < num_tokens[:, tf.newaxis]) & (tf.gather(to_orig, end, batch_dims=1) >= 0)
  span = end[:, tf.newaxis, :] - start[:, :, tf.newaxis]
  ok = (start_ok[:, :, tf.newaxis] & end_ok[:, tf.newaxis, :] & (span >= 0)
        & (span + 1 <= max_answer_length))
  grid = lambda x, axis: tf.reshape(tf.repeat(tf.expand_dims(x, axis), k, axis=axis),
                                    tf.stack([count, k * k]))
  by_example = lambda x: tf.RaggedTensor.from_value_rowids(x, windows['example'], nrows=rows
                                                           ).merge_dims(1, 2)
  row = tf.repeat(tf.range(count)[:, tf.newaxis], k * k, axis=1)
  candidates = {'ok': by_example(tf.reshape(ok, tf.stack([count, k * k]))),
                'row': by_example(row), 'start': by_example(grid(start, 2)),
                'end': by_example(grid(end, 1)),
                'start_logit': by_example(grid(start_logit, 2)),
                'end_logit': by_example(grid(end_logit, 1))}
  cls = logits[:, 0, 0] + logits[:, 1, 0]
  null = tf.math.unsorted_segment_min(cls, windows['example'], rows)
  # The first window with the lowest [CLS] score.
  null_row = tf.math.unsorted_segment_min(
      tf.where(cls == tf.gather(null, windows['example']), tf.range(count), count),
      windows['example'], rows)
  null_row = tf.minimum(null_row, count - 1)
  dense = {key: value.to_tensor(False if key == 'ok' else 0) for key, value in candidates.items()}
  if version_2:  # The empty answer, a candidate after all the spans.
    append = {'ok': tf.ones([rows], tf.bool), 'row': -tf.ones([rows], tf.int32),
              'start': tf.zeros([rows], tf.int32), 'end': tf.zeros([rows], tf.int32),
              'start_logit': tf.gather(logits[:, 0, 0], null_row),
              'end_logit': tf.gather(logits[:, 1, 0], null_row)}
    dense = {key: tf.concat([value, append[key][:, tf.newaxis]], 1)
             for key, value in dense.items()}
  score = tf.where(dense['ok'], dense['start_logit'] + dense['end_logit'], very_negative)
  order = tf.argsort(score, direction='DESCENDING', stable=True)
  dense = {key: tf.gather(value, order, batch_dims=1) for key, value in dense.items()}
  ids = windows['ids'].to_tensor(0, shape=shape)
  slots = n_best_size + 1

  def decode(example):
    cand = {key: value[example] for key, value in dense.items()}
    example_words = tf.gather(words, [example]).flat_values
    example_starts = tf.gather(word_starts, [example]).flat_values

    def answer(i):
      """The i-th candidate's text and characters in the context ('', -1, -1: no answer)."""
      r, s, e = cand['row'][i], cand['start'][i], cand['end'][i]

      def text():
        pieces = tf.strings.reduce_join(tf.gather(vocab, ids[r, s:e + 1]), separator=' ')
        pred = collapse_spaces(tf.strings.regex_replace(
            tf.strings.regex_replace(pieces, ' ##', ''), '##', ''))
        first, last = to_orig[r, s], to_orig[r, e]
        chosen = example_words[first:last + 1]
        orig = tf.strings.reduce_join(chosen, separator=' ')
        out, a, b = project_to_original(pred, orig, lower_case)
        # Characters of `orig` -> of the context: each word starts after the one before and
        # a space.
        sizes = tf.cast(tf.strings.length(chosen, unit='UTF8_CHAR'), tf.int64) + 1
        opens = tf.cumsum(sizes, exclusive=True)
        at = lambda c: tf.searchsorted(opens, c[tf.newaxis], side='right')[0] - 1
        char = lambda c: example_starts[first + tf.cast(at(c), tf.int32)] + c - opens[at(c)]
        return out, char(a), char(b) + 1
      return tf.cond(r < 0, lambda: (tf.constant(''), tf.constant(-1, tf.int64),
                                     tf.constant(-1, tf.int64)), text)

    def more(i, n, *_):
      return (i < tf.size(cand['ok'])) & (n < n_best_size) & cand['ok'][tf.minimum(
          i, tf.size(cand['ok']) - 1)]

    def add(i, n, texts, starts, ends, start_logits, end_logits):
      text, a, b = answer(i)
      new = ~tf.reduce_any((texts == text) & (tf.range(slots) < n))
      put = lambda values, value: tf.where(new, tf.tensor_scatter_nd_update(
          values, [[n]], [value]), values)
      return (i + 1, n + tf.cast(new, tf.int32), put(texts, text), put(starts, a), put(ends, b),
              put(start_logits, cand['start_logit'][i]), put(end_logits, cand['end_logit'][i]))

    _, n, texts, starts, ends, start_logits, end_logits = tf.while_loop(more, add, (
        tf.constant(0), tf.constant(0), tf.fill([slots], ''), -tf.ones([slots], tf.int64),
        -tf.ones([slots], tf.int64), tf.zeros([slots], tf.float64),
        tf.zeros([slots], tf.float64)))
    listed = tf.range(slots) < n
    add_null = (version_2 & ~tf.reduce_any(listed & (texts == ''))) | (n == 0)
    at_n = tf.range(slots) == n
    null_logits = ((logits[null_row[example], 0, 0], logits[null_row[example], 1, 0])
                   if version_2 else (tf.constant(0.0, tf.float64),) * 2)
    start_logits = tf.where(add_null & at_n, null_logits[0], start_logits)
    end_logits = tf.where(add_null & at_n, null_logits[1], end_logits)
    texts = tf.where(add_null & at_n, '', texts)
    n = n + tf.cast(add_null, tf.int32)
    listed = tf.range(slots) < n
    total = tf.where(listed, start_logits + end_logits, very_negative)
    probability = tf.where(listed, tf.nn.softmax(total), 0.0)
    if not version_2:
      return (texts[0], starts[0], ends[0], texts, probability, start_logits, end_logits,
              tf.constant(0.0, tf.float64))
    spans = listed & (texts != '')
    best = tf.argmax(tf.cast(spans, tf.int32), output_type=tf.int32)
    diff = null[example] - start_logits[best] - end_logits[best]
    empty = ~tf.reduce_any(spans) | (diff > null_score_diff_threshold)
    odds = tf.where(tf.reduce_any(spans), diff, tf.constant(1e6, tf.float64))
    none = tf.constant(-1, tf.int64)
    return (tf.where(empty, '', texts[best]), tf.where(empty, none, starts[best]),
            tf.where(empty, none, ends[best]), texts, probability, start_logits, end_logits, odds)

  out = tf.map_fn(decode, tf.range(rows), fn_output_signature=(
      tf.string, tf.int64, tf.int64, tf.TensorSpec([slots], tf.string),
      tf.TensorSpec([slots], tf.float64), tf.TensorSpec([slots], tf.float64),
      tf.TensorSpec([slots], tf.float64), tf.float64))
  names = ('answer', 'answer_start', 'answer_end', 'nbest_text', 'nbest_probability',
           'nbest_start_logit', 'nbest_end_logit', 'null_odds')
  result = dict(zip(names, out))
  if not version_2:
    del result['null_odds']
  return result
