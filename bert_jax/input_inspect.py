"""Looking at the pre-training input (`bert-jax data`): decoded examples and statistics.

`show_examples` prints a batch as the model sees it, masks and segments marked; `compute_stats`
measures what the masking, pairing and packing settings give (masked shares, padding,
sequences per row) and how fast the pipeline runs. Both read `input_pipeline.py`'s batches, as
training does.
"""

import time
from typing import Any

import ml_collections
import numpy as np

from bert_jax import documents
from bert_jax import input_pipeline
from bert_jax import objectives


def _settings(data, seq_len, max_predictions):
  """(seq_len, max_predictions): as given, else data's."""
  return (int(seq_len or data.max_seq_length),
          int(max_predictions or data.max_predictions_per_seq))


def show_examples(data: ml_collections.ConfigDict, num: int = 3, *,
                  vocab_file: str | None = None, seq_len: int | None = None,
                  max_predictions: int | None = None, train: bool = True,
                  seed: int | None = None) -> str:
  """Decoded examples: [MASK→orig] for a masked token, [rand→orig] for a replaced one and
  {orig} for one kept as is, the two segments and the next-sentence label. With data.packing,
  `num` rows and each of their sequences."""
  seq_len, max_predictions = _settings(data, seq_len, max_predictions)
  vocab_file = vocab_file or input_pipeline.resolve_vocab(data, None)
  tokenizer = input_pipeline.load_tokenizer(vocab_file, data.lower_case)
  ds = input_pipeline.make_pretraining_dataset(data, batch_size=num, seq_len=seq_len,
                                               max_predictions=max_predictions, train=train,
                                               seed=seed, vocab_file=vocab_file)
  batch = next(ds.as_numpy_iterator())
  vocab = tokenizer.vocab
  label_names = objectives.get(data.objective).label_names
  lines = []
  for i in range(num):
    ids = batch['input_ids'][i]
    marked = {int(p): int(t) for p, t, w in zip(batch['masked_lm_positions'][i],
                                                 batch['masked_lm_ids'][i],
                                                 batch['masked_lm_weights'][i]) if w > 0}
    if data.packing:
      count = int(batch['sequence_ids'][i].max())
      lines.append(f'row {i}: {count} sequence{"s" * (count != 1)}, '
                   f'{int(batch["input_mask"][i].sum())} of {seq_len} tokens')
      sequences = [(f'  sequence {k + 1}', np.nonzero(batch['sequence_ids'][i] == k + 1)[0],
                    batch['next_sentence_labels'][i, k]) for k in range(count)]
    else:
      sequences = [(f'example {i}', np.arange(int(batch['input_mask'][i].sum())),
                    batch['next_sentence_labels'][i])]
    for title, positions, label in sequences:
      words = {0: [], 1: []}
      for pos in positions:
        token = vocab[ids[pos]]
        if pos in marked:
          original = vocab[marked[pos]]
          if ids[pos] == tokenizer.mask_id:
            token = f'[MASK→{original}]'
          elif ids[pos] == marked[pos]:
            token = f'{{{original}}}'
          else:
            token = f'[{token}→{original}]'
        words[int(batch['segment_ids'][i][pos])].append(token)
      header = f'{title}: {sum(int(p) in marked for p in positions)} masked'
      if data.objective != 'none':
        header += f', {label_names[int(label)]}'
      indent = title[:len(title) - len(title.lstrip())]
      lines.append(header)
      lines.append(f'{indent}  A: ' + ' '.join(words[0]))
      if words[1]:
        lines.append(f'{indent}  B: ' + ' '.join(words[1]))
  return '\n'.join(lines)


def compute_stats(data: ml_collections.ConfigDict, num_batches: int, batch_size: int, *,
                  vocab_file: str | None = None, seq_len: int | None = None,
                  max_predictions: int | None = None, train: bool = True,
                  seed: int | None = None) -> dict[str, Any]:
  """Statistics over `num_batches` batches (see the keys) and the pipeline's speed.

  Examples are sequences, packed or not (with data.packing a row holds several).
  masked_fraction is masked / eligible tokens (not [CLS], [SEP], [PAD], [MASK] before
  masking); mask_token_fraction, random_token_fraction and kept_fraction split the masked
  positions; padding_fraction is the share of the rows' slots that hold no token;
  sequences_per_row counts rows with any token; rows_at_sequence_cap (packing only) is the
  share of rows holding data.packing_max_sequences sequences (the packer never drops a
  sequence: a row at a cap is closed and the next sequence opens another); tokens_per_second
  counts non-padding tokens after the first batch (which pays for building the pipeline).
  For text and TFDS inputs, `input` counts over the first 16 MB of text (documents.LOOK_BYTES)
  of the input in file order: pieces, documents, documents_in_pieces (longer than
  documents.PIECE_BYTES, streamed in several), lines_cut (longer than documents.LINE_BYTES,
  cut into several lines before pairing) and bytes.
  """
  seq_len, max_predictions = _settings(data, seq_len, max_predictions)
  if documents.input_kind(data.input) != 'tfrecord':
    vocab_file = vocab_file or input_pipeline.resolve_vocab(data, None)
  vocab_file = vocab_file or data.vocab_file
  if vocab_file:
    tokenizer = input_pipeline.load_tokenizer(vocab_file, data.lower_case)
    mask_id = tokenizer.mask_id
    specials = [tokenizer.pad_id, tokenizer.cls_id, tokenizer.sep_id, tokenizer.mask_id]
  else:  # TFRecords without a vocabulary: assume the original BERT vocabularies' ids.
    mask_id = 103
    specials = [0, 101, 102, 103]
  ds = input_pipeline.make_pretraining_dataset(data, batch_size=batch_size, seq_len=seq_len,
                                               max_predictions=max_predictions, train=train,
                                               seed=seed, vocab_file=vocab_file)
  totals = dict(examples=0, not_next=0, tokens=0, slots=0, masked=0, eligible=0, as_mask=0,
                kept=0, segment_b=0, rows=0, rows_at_cap=0)
  start = None
  timed_tokens = 0
  for i, batch in enumerate(ds.take(num_batches).as_numpy_iterator()):
    if i == 0:
      start = time.perf_counter()
    weights = batch['masked_lm_weights'] > 0
    rows = np.nonzero(weights)[0]
    positions = batch['masked_lm_positions'][weights]
    originals = batch['masked_lm_ids'][weights]
    now = batch['input_ids'][rows, positions]
    restored = batch['input_ids'].copy()
    restored[rows, positions] = originals
    real = batch['input_mask'] > 0
    eligible = real & ~np.isin(restored, specials)
    tokens = int(real.sum())
    if data.packing:
      sequences = batch['next_sentence_weights'] > 0
      totals['rows_at_cap'] += int((sequences.sum(1) == sequences.shape[1]).sum())
    else:
      sequences = real[:, 0]
    totals['examples'] += int(sequences.sum())
    totals['not_next'] += int(batch['next_sentence_labels'][sequences].sum())
    totals['rows'] += int(real.any(1).sum())
    totals['tokens'] += tokens
    totals['slots'] += real.size
    totals['masked'] += int(weights.sum())
    totals['eligible'] += int(eligible.sum())
    totals['as_mask'] += int((now == mask_id).sum())
    totals['kept'] += int((now == originals).sum())
    totals['segment_b'] += int((batch['segment_ids'] > 0).sum())
    if i > 0:
      timed_tokens += tokens
  elapsed = time.perf_counter() - start if start is not None else 0.0
  summary = {}
  if documents.input_kind(data.input) != 'tfrecord':
    spec, flag, holdout = data.input, 'data.input', (None if data.eval_input else False)
    if not train:
      spec, flag, holdout = ((data.eval_input, 'data.eval_input', None) if data.eval_input
                             else (data.input, 'data.input', True))
    summary = {'input': documents.summarize(documents.documents(spec, flag, data,
                                                                holdout=holdout)[0])}
  masked = max(totals['masked'], 1)
  packed = {'rows_at_sequence_cap': totals['rows_at_cap'] / max(totals['rows'], 1)}
  return {
      'examples': totals['examples'],
      'next_sentence_fraction': totals['not_next'] / max(totals['examples'], 1),
      'masked_fraction': totals['masked'] / max(totals['eligible'], 1),
      'mask_token_fraction': totals['as_mask'] / masked,
      'random_token_fraction': (totals['masked'] - totals['as_mask'] - totals['kept']) / masked,
      'kept_fraction': totals['kept'] / masked,
      'padding_fraction': 1.0 - totals['tokens'] / max(totals['slots'], 1),
      'sequences_per_row': totals['examples'] / max(totals['rows'], 1),
      **(packed if data.packing else {}),
      'mean_length': totals['tokens'] / max(totals['examples'], 1),
      'segment_b_fraction': totals['segment_b'] / max(totals['tokens'], 1),
      'masked_per_example': totals['masked'] / max(totals['examples'], 1),
      'tokens_per_second': timed_tokens / elapsed if elapsed > 0 else float('nan'),
      **summary,
  }
