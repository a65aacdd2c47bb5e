"""Sentence pairs (NSP, SOP) and packed MLM sequences from a batch of tokenized documents.

Everything is TensorFlow graph ops vectorized over a batch of N documents, so it runs inside
tf.data (checkpointable, no Python). A document batch is a RaggedTensor [N, sentences, tokens]
plus an int64 id per document (equal ids = the same document); randomness is stateless from
the given seed, so a (batch, seed) pair always gives the same examples.

Sentence pairs follow `create_instances_from_document` of the original create_pretraining_data.py:
per document, target = seq_len - 3, or with probability short_seq_prob a uniform int in
[2, seq_len - 3]; sentences accumulate into a chunk until it reaches the target or the document
ends; A = the chunk's first a_end sentences (a_end uniform in [1, len(chunk) - 1]); B is either
the rest of the chunk (IsNext, label 0) or, for NotNext (label 1), sentences of another
document from a random start until B reaches target - len(A), and then the unused sentences of
the chunk are put back. The pair is truncated to seq_len - 3 tokens by removing tokens from the
longer side (B on ties), each from its front or back with probability 1/2 (the closed form of the
original's loop: the per-side counts are exact, the front/back split is Binomial(n, 1/2)).

The 50/50 label contract. The original forces NotNext whenever a chunk holds a single sentence
(long sentences, short documents), which drives the NotNext share well above 1/2 on corpora of
short documents. Here the label is drawn first, 50/50, for every chunk; an IsNext draw on a
one-sentence chunk splits that sentence's tokens at a uniform point into A and B (consecutive
text, as IsNext promises). A chunk of a single one-token sentence cannot be split and is dropped
whatever its label, which keeps the expected share exactly 1/2.

The other document of a NotNext pair is drawn uniformly from the other documents of the same
batch (documents come out of a shuffle buffer, so that is a random document of the corpus).
If no other document is in the batch: a batch of one document (only the tail of a one-pass
evaluation stream) drops its NotNext draws; a batch whose documents are all the same one (a
repeated one-document corpus) fails with an error, since NotNext is then impossible.

SOP (ALBERT): A and B are consecutive as for IsNext; with probability 1/2 they are swapped
(label 1). 'none' (RoBERTa FULL-SENTENCES): whole sentences are packed greedily into
`[CLS] ... [SEP]` of up to seq_len tokens, across document boundaries with an extra [SEP]
between documents; a sentence longer than seq_len - 2 is cut into pieces.

Outputs of both functions: input_ids [E, seq_len] int32 (padded with pad_id), num_a [E]
(tokens with segment id 0: [CLS] A [SEP]), length [E] and next_sentence_labels [E].
"""

import tensorflow as tf

from bert_jax import errors

NOT_ENOUGH_DOCUMENTS = errors.in_graph(
    "objective 'nsp' needs at least two different documents for NotNext pairs, but every "
    'document in a batch was the same one: data.input (or data.eval_input; of this process) '
    'holds a single document. Add documents (blank lines separate them), or set '
    'data.objective to sop or none.')


def make_pairs(doc_tokens: tf.RaggedTensor, doc_ids: tf.Tensor, seed: tf.Tensor, *,
               seq_len: int, short_seq_prob: float, objective: str, cls_id: int, sep_id: int,
               pad_id: int, check_documents: bool = True) -> dict[str, tf.Tensor]:
  """Sentence pairs from a batch of documents (see the module docstring).

  Args:
    doc_tokens: int32 RaggedTensor [N, sentences, tokens]; sentences must be non-empty.
    doc_ids: int64 [N]; equal ids mark the same document.
    seed: [2] stateless seed.
    seq_len: output length; pairs hold at most seq_len - 3 tokens.
    short_seq_prob: probability of a shorter target length for a document.
    objective: 'nsp' or 'sop'.
    cls_id, sep_id, pad_id: special token ids.
    check_documents: fail (tf.debugging.Assert) on a batch holding a single document repeated;
      False leaves that to the caller (`single_document`), e.g. to keep a tf.function
      stateless.

  Returns:
    dict of input_ids [E, seq_len], num_a [E], length [E], next_sentence_labels [E].
  """
  if objective not in ('nsp', 'sop'):
    raise ValueError(f"objective {objective!r} is not 'nsp' or 'sop'")
  max_tokens = seq_len - 3
  flat_tokens = doc_tokens.flat_values
  sentence_length = tf.cast(doc_tokens.values.row_lengths(), tf.int32)
  sentence_doc = tf.cast(doc_tokens.value_rowids(), tf.int32)
  doc_first = tf.cast(doc_tokens.row_starts(), tf.int32)  # First sentence of each document.
  num_sentences = tf.cast(doc_tokens.row_lengths(), tf.int32)
  doc_end = doc_first + num_sentences
  # Token offset of each sentence; sentences [i, j) hold offset[j] - offset[i] tokens.
  offset = tf.concat([[0], tf.cumsum(sentence_length)], 0)
  total_sentences = tf.shape(sentence_length)[0]
  num_docs = tf.shape(doc_ids)[0]
  doc_seed, chunk_seed, pair_seed, cut_seed = (
      tf.random.experimental.stateless_fold_in(seed, i) for i in range(4))

  draws = tf.random.stateless_uniform([2, num_docs], doc_seed)
  short_target = 2 + tf.cast(draws[1] * tf.cast(max_tokens - 1, tf.float32), tf.int32)
  target = tf.where(draws[0] < short_seq_prob, tf.minimum(short_target, max_tokens), max_tokens)

  # What a chunk would be if it started at sentence s, for every s at once. The random draws
  # are keyed by the chunk's first sentence; a document's chunks start at increasing sentences,
  # so each draw is used at most once: as good as fresh draws per chunk.
  index = tf.range(total_sentences)
  end_of_doc = tf.gather(doc_end, sentence_doc)
  chunk_end = tf.searchsorted(offset, offset[:-1] + tf.gather(target, sentence_doc),
                              side='left')
  chunk_end = tf.maximum(tf.minimum(chunk_end, end_of_doc), index + 1)
  num_chunk = chunk_end - index
  u = tf.random.stateless_uniform([2, total_sentences], chunk_seed)
  a_sentences = tf.where(
      num_chunk >= 2, 1 + tf.cast(u[0] * tf.cast(num_chunk - 1, tf.float32), tf.int32), 1)
  a_sentences = tf.minimum(a_sentences, tf.maximum(num_chunk - 1, 1))
  is_random = u[1] < 0.5
  if objective == 'nsp':
    # NotNext puts the chunk's unused sentences back: the next chunk starts after A.
    following = tf.where(is_random, index + a_sentences, chunk_end)
  else:
    following = chunk_end
  # Every chunk start of the batch: the path 0 -> following[0] -> ... (it runs through each
  # document in turn, since a document's last chunk ends where the next document begins).
  start = _path_from_zero(tf.concat([following, [total_sentences]], 0))

  base = tf.gather(offset, start)
  end = tf.gather(chunk_end, start)
  a_count = tf.gather(a_sentences, start)
  chunk_tokens = tf.gather(offset, end) - base
  a_len_chunk = tf.gather(offset, start + a_count) - base
  single = tf.equal(end - start, 1)
  num_examples = tf.shape(start)[0]
  v = tf.random.stateless_uniform([4, num_examples], pair_seed)
  # IsNext and SOP: B is the rest of the chunk, or the tail of its only sentence.
  split = 1 + tf.cast(v[0] * tf.cast(chunk_tokens - 1, tf.float32), tf.int32)
  split = tf.clip_by_value(split, 1, tf.maximum(chunk_tokens - 1, 1))
  a_start = base
  a_len = tf.where(single, split, a_len_chunk)
  b_start = base + a_len
  b_len = chunk_tokens - a_len
  # A chunk of one single-token sentence makes no pair, whatever its label would be.
  valid = chunk_tokens >= 2
  if objective == 'nsp':
    random_next = tf.gather(is_random, start)
    doc = tf.gather(sentence_doc, start)
    others, num_others = _other_documents(doc_ids, num_sentences)
    if check_documents:
      check = tf.debugging.Assert(~single_document(doc_tokens, doc_ids), [NOT_ENOUGH_DOCUMENTS])
      with tf.control_dependencies([check]):
        num_others = tf.identity(num_others)
    num_others = tf.gather(num_others, doc)
    rank = tf.minimum(tf.cast(v[1] * tf.cast(num_others, tf.float32), tf.int32),
                      tf.maximum(num_others - 1, 0))
    other = tf.searchsorted(tf.gather(others, doc), rank[:, None] + 1, side='left')[:, 0]
    other = tf.minimum(other, num_docs - 1)
    other_first = tf.gather(doc_first, other)
    other_count = tf.gather(num_sentences, other)
    b_first = other_first + tf.minimum(
        tf.cast(v[2] * tf.cast(other_count, tf.float32), tf.int32),
        tf.maximum(other_count - 1, 0))
    random_base = tf.gather(offset, b_first)
    # B takes sentences until it reaches target - len(A), or its document ends.
    target_b = tf.maximum(tf.gather(target, doc) - a_len_chunk, 1)
    b_end = tf.searchsorted(offset, random_base + target_b, side='left')
    b_end = tf.maximum(tf.minimum(b_end, other_first + other_count), b_first + 1)
    a_len = tf.where(random_next, a_len_chunk, a_len)
    b_start = tf.where(random_next, random_base, b_start)
    b_len = tf.where(random_next, tf.gather(offset, b_end) - random_base, b_len)
    valid &= ~random_next | (num_others > 0)
    label = tf.cast(random_next, tf.int32)
  else:
    swap = v[1] < 0.5
    a_start, a_len, b_start, b_len = (tf.where(swap, b_start, a_start),
                                      tf.where(swap, b_len, a_len),
                                      tf.where(swap, a_start, b_start),
                                      tf.where(swap, a_len, b_len))
    label = tf.cast(swap, tf.int32)

  a_start, a_len, b_start, b_len, label = (
      tf.boolean_mask(t, valid) for t in (a_start, a_len, b_start, b_len, label))
  a_start, a_len, b_start, b_len = _truncate_pair(a_start, a_len, b_start, b_len, max_tokens,
                                                  cut_seed)
  return _assemble_pairs(flat_tokens, a_start, a_len, b_start, b_len, label, seq_len=seq_len,
                         cls_id=cls_id, sep_id=sep_id, pad_id=pad_id)


def _path_from_zero(following: tf.Tensor) -> tf.Tensor:
  """[0, f(0), f(f(0)), ...] up to the sink len(f) - 1, for an increasing map f with f(sink) =
  sink; by pointer doubling: log2(path length) rounds of gathers instead of a loop per step."""
  sink = tf.shape(following)[0] - 1

  def body(points, jump):
    return tf.concat([points, tf.gather(jump, points)], 0), tf.gather(jump, jump)

  # After round r, `points` holds f^k(0) for k < 2^r and `jump` is f^(2^r).
  points, _ = tf.while_loop(
      lambda points, jump: points[-1] < sink, body, (tf.zeros([1], tf.int32), following),
      shape_invariants=(tf.TensorShape([None]), following.shape))
  return tf.boolean_mask(points, points < sink)


def _other_documents(doc_ids, num_sentences):
  """Row i: running count of the documents other than i (another id, some sentence); and
  that count."""
  differs = (tf.not_equal(doc_ids[None, :], doc_ids[:, None]) & (num_sentences > 0)[None, :])
  differs = tf.cast(differs, tf.int32)
  return tf.cumsum(differs, axis=1), tf.reduce_sum(differs, 1)


def single_document(doc_tokens: tf.RaggedTensor, doc_ids: tf.Tensor) -> tf.Tensor:
  """True when several documents with sentences are all the same one (NotNext impossible)."""
  has_sentences = doc_tokens.row_lengths() > 0
  ids = tf.boolean_mask(doc_ids, has_sentences)
  return (tf.size(ids) > 1) & tf.reduce_all(tf.equal(ids, ids[:1]))


def truncation_counts(a_len: tf.Tensor, b_len: tf.Tensor,
                      max_tokens: int) -> tuple[tf.Tensor, tf.Tensor]:
  """Tokens the original's truncate_seq_pair removes from A and from B (longer side, B on ties)."""
  excess = tf.maximum(a_len + b_len - max_tokens, 0)
  gap = tf.abs(a_len - b_len)
  a_longer = a_len > b_len
  uneven = tf.minimum(excess, gap)  # Taken from the longer side until both are equal.
  rest = excess - uneven  # Then alternately, B first.
  remove_a = tf.where(a_longer, uneven, 0) + rest // 2
  remove_b = tf.where(a_longer, 0, uneven) + rest - rest // 2
  return remove_a, remove_b


def _truncate_pair(a_start, a_len, b_start, b_len, max_tokens, seed):
  remove_a, remove_b = truncation_counts(a_len, b_len, max_tokens)
  counts = tf.cast(tf.stack([remove_a, remove_b]), tf.float32)
  front = tf.random.stateless_binomial(tf.shape(counts), seed, counts, 0.5, tf.int32)
  return a_start + front[0], a_len - remove_a, b_start + front[1], b_len - remove_b


def _assemble_pairs(flat_tokens, a_start, a_len, b_start, b_len, label, *, seq_len, cls_id,
                    sep_id, pad_id):
  """[CLS] A [SEP] B [SEP] padded to seq_len, by index arithmetic over [E, seq_len]."""
  p = tf.range(seq_len)[None, :]
  la, lb = a_len[:, None], b_len[:, None]
  in_a = (p >= 1) & (p <= la)
  in_b = (p >= la + 2) & (p <= la + lb + 1)
  source = tf.where(in_a, a_start[:, None] + p - 1,
                    tf.where(in_b, b_start[:, None] + p - la - 2, 0))
  tokens = tf.gather(flat_tokens, source)
  ids = tf.where(in_a | in_b, tokens, pad_id)
  ids = tf.where(p == 0, cls_id, ids)
  ids = tf.where((p == la + 1) | (p == la + lb + 2), sep_id, ids)
  return {
      'input_ids': ids,
      'num_a': a_len + 2,
      'length': a_len + b_len + 3,
      'next_sentence_labels': label,
  }


def pack_sequences(doc_tokens: tf.RaggedTensor, *, seq_len: int, cls_id: int, sep_id: int,
                   pad_id: int, cross_documents: bool = True) -> dict[str, tf.Tensor]:
  """MLM-only sequences: whole sentences packed greedily into `[CLS] ... [SEP]`.

  Documents of the batch follow each other with a [SEP] between them; a sentence longer
  than seq_len - 2 tokens is cut into pieces. Segment ids are all 0 (num_a = length) and the
  labels 0. With cross_documents=False a sequence ends where its document does (RoBERTa's
  DOC-SENTENCES): for packed rows (`packing.py`), where documents must not see each other.
  """
  capacity = seq_len - 2
  sentences = doc_tokens.values  # [S, tokens]
  num_sentences = tf.shape(sentences.row_lengths())[0]
  last = tf.maximum(tf.cast(doc_tokens.row_limits(), tf.int32) - 1, 0)
  is_last = tf.scatter_nd(last[:, None],
                          tf.cast(doc_tokens.row_lengths() > 0, tf.int32), [num_sentences])
  is_last = tf.minimum(is_last, 1)
  separators = tf.RaggedTensor.from_row_lengths(
      tf.fill([tf.reduce_sum(is_last)], tf.constant(sep_id, sentences.dtype)),
      tf.cast(is_last, sentences.row_splits.dtype))
  sentences = tf.concat([sentences, separators], axis=1)
  flat_tokens = sentences.flat_values
  # Pieces of at most `capacity` tokens (plus a document's final [SEP], which then stands in
  # for the closing one); they are contiguous in flat_tokens.
  content = tf.cast(sentences.row_lengths(), tf.int32) - is_last
  num_pieces = tf.maximum((content + capacity - 1) // capacity, 1)
  piece_index = tf.ragged.range(num_pieces).flat_values
  piece_length = tf.minimum(capacity, tf.repeat(content, num_pieces) - piece_index * capacity)
  piece_length += tf.repeat(is_last, num_pieces) * tf.cast(
      piece_index == tf.repeat(num_pieces, num_pieces) - 1, tf.int32)
  offset = tf.concat([[0], tf.cumsum(piece_length)], 0)
  num_units = tf.shape(piece_length)[0]

  # Where a sequence starting at each unit would end (capacity + 1 tokens fit only when the
  # last one is a document's [SEP]); the sequence starts are the path from unit 0.
  limit = tf.searchsorted(offset, offset[:-1] + capacity + 1, side='right') - 1
  last_token = tf.gather(flat_tokens, tf.maximum(tf.gather(offset, limit) - 1, 0))
  fits = (tf.gather(offset, limit) - offset[:-1] <= capacity) | tf.equal(last_token, sep_id)
  following = tf.where(fits, limit, limit - 1)
  if not cross_documents:
    # A document's last unit ends with its [SEP]: no sequence runs past it.
    last_piece = tf.equal(piece_index, tf.repeat(num_pieces, num_pieces) - 1)
    ends_document = tf.where(last_piece & (tf.repeat(is_last, num_pieces) > 0))[:, 0]
    ends_document = tf.cast(ends_document, tf.int32)
    document_end = tf.gather(ends_document,
                             tf.searchsorted(ends_document, tf.range(num_units), side='left'))
    following = tf.minimum(following, document_end + 1)
  first_unit = _path_from_zero(tf.concat([following, [num_units]], 0))
  start = tf.gather(offset, first_unit)
  size = tf.gather(offset, tf.gather(following, first_unit)) - start
  p = tf.range(seq_len)[None, :]
  content = (p >= 1) & (p <= size[:, None])
  tokens = tf.gather(flat_tokens, tf.where(content, start[:, None] + p - 1, 0))
  ends_with_sep = tf.gather(flat_tokens, start + size - 1) == sep_id
  final_sep = tf.where(ends_with_sep, -1, size + 1)
  ids = tf.where(content, tokens, pad_id)
  ids = tf.where(p == 0, cls_id, tf.where(p == final_sep[:, None], sep_id, ids))
  total = size + 1 + tf.where(ends_with_sep, 0, 1)
  return {
      'input_ids': ids,
      'num_a': total,
      'length': total,
      'next_sentence_labels': tf.zeros_like(total),
  }
