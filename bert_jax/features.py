"""Contextual features from a pre-trained BERT (the paper's feature-based approach, section 5.3).

  bert-jax features --init_checkpoint=/ckpt/cased_L-12_H-768_A-12 --input=sentences.txt \
      --layers=-1,-2,-3,-4 --output=features.jsonl

Without --layers: the last four encoder layers (-1,-2,-3,-4, as the original's default), or every
encoder layer of a model with fewer.

The input has one text per line, or a pair as `text_a ||| text_b` (as the original
extract_features.py reads it); blank lines are skipped and counted. Each text is packed as
'[CLS] a [SEP] (b [SEP])'; a text longer than `max_seq_length` is truncated, and the number of
truncated lines is logged (raise `max_seq_length`, up to the model's 512, to keep them whole).

Layers: index i >= 0 is hidden state i (0 = the embedding output, i = encoder layer i);
negative indices count from the top as Python indexes that list (-1 = the last encoder layer,
the original's convention; -(L+1) = the embeddings). Sentence vectors: 'cls' = the pooler
output ([CLS] -> dense -> tanh), 'mean' = the mean of the chosen layers' token features over the
real tokens.

Output, by the suffix of `output`:
  .jsonl  one JSON object per input line, in input order, floats rounded to `decimals`:
          {"linex_index": i, "line": input line number, "truncated": bool,
           "features": [{"token": "[CLS]", "layers": [{"index": -1, "values": [H floats]},
                         ...]}, ...],                      (concat: {"token", "values": [n*H]})
           "cls": [H], "mean": [{"index": -1, "values": [H]}, ...]   (concat: "mean": [n*H])}
  .npz    arrays, T = the longest packed sequence: tokens [N, T] (str, '' past the end),
          input_ids, input_mask, segment_ids [N, T] int32, lengths [N], line_numbers [N],
          truncated [N] bool, layers [n] (the indices asked for), features [N, T, n, H] float32
          ([N, T, n*H] with concat; zeros past each length), cls [N, H], mean [N, n, H]
          ([N, n*H] with concat). All of it is held in memory: use .jsonl for large inputs.
  .npy    only the `features` array of the .npz.
"""

import json
import os
from typing import Any, Iterator, Sequence

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np

from bert_jax import batching
from bert_jax import fileio
from bert_jax import glue
from bert_jax import model as model_lib
from bert_jax import pretrained
from bert_jax.errors import UserError

POOLINGS = ('cls', 'mean')
_CHUNK_BATCHES = 50  # Lines are processed (and JSONL written) in chunks of this many batches.


def read_input(path: str) -> list[tuple[int, str, str | None]]:
  """(line number, text_a, text_b or None) of every non-blank line; ' ||| ' splits a pair."""
  lines, blank = [], 0
  # Universal newlines, as open() reads text (str.splitlines would also split on U+0085).
  rows = fileio.read_user_text(path, '--input').replace('\r\n', '\n').replace('\r', '\n')
  rows = rows.split('\n')
  if not rows[-1]:
    rows.pop()  # What follows the last line's newline is no line.
  for number, line in enumerate(rows, 1):
    line = line.strip()
    if not line:
      blank += 1
      continue
    a, sep, b = line.rpartition(' ||| ')
    lines.append((number, a, b) if sep else (number, line, None))
  if blank:
    logging.warning('%s: skipped %d blank lines', path, blank)
  if not lines:
    raise UserError(f'--input: {path}: no text (the file is empty{" or blank" if blank else ""})')
  return lines


# Without --layers: the top encoder layers, at most this many.
DEFAULT_TOP_LAYERS = 4


def default_layers(num_layers: int) -> list[int]:
  """-1, -2, ... down to the 4th layer from the top or the first encoder layer, whichever comes
  first (a 2-layer model has no layer -4 that is not its embeddings)."""
  return list(range(-1, -min(DEFAULT_TOP_LAYERS, num_layers) - 1, -1))


def resolve_layers(layers: Sequence[int], num_layers: int) -> list[int]:
  """Indices into the hidden states [embeddings, layer 1, ..., layer L] of the requested
  layers, which index that list as Python does (-1 = layer L, -(L + 1) = the embeddings)."""
  out = []
  for layer in layers:
    layer = int(layer)
    if not -num_layers - 1 <= layer <= num_layers:
      raise UserError(f'--layers: {layer} is out of range for a {num_layers}-layer model (0 = '
                      f'embeddings, 1..{num_layers}, or -1..-{num_layers + 1} from the top)')
    out.append(layer if layer >= 0 else num_layers + 1 + layer)
  if not out:
    raise UserError('--layers: no layers')
  return out


def _encode(tok, lines, max_seq_length: int) -> dict[str, Any]:
  """Packed, padded features of the lines, and which were truncated."""
  ids_a = batching.encode_in_chunks(tok, [a for _, a, _ in lines])
  pairs = [i for i, (_, _, b) in enumerate(lines) if b is not None]
  ids_b = dict(zip(pairs, batching.encode_in_chunks(tok, [lines[i][2] for i in pairs])))
  packed = [glue.pack_pair(ids_a[i], ids_b.get(i), tok, max_seq_length)
            for i in range(len(lines))]
  longest = max(len(ids) for ids, _, _ in packed)
  n = len(lines)
  out = {'input_ids': np.full((n, longest), tok.pad_id, np.int32),
         'input_mask': np.zeros((n, longest), np.int32),
         'segment_ids': np.zeros((n, longest), np.int32),
         'truncated': np.array([cut for _, _, cut in packed], bool)}
  for i, (ids, segs, _) in enumerate(packed):
    out['input_ids'][i, :len(ids)] = ids
    out['segment_ids'][i, :len(ids)] = segs
    out['input_mask'][i, :len(ids)] = 1
  return out


def _buckets(max_len: int) -> tuple[int, ...]:
  return tuple(b for b in (16, 32, 64, 128, 256, 512) if b < max_len) + (max_len,)


def _chunks(n: int, size: int) -> Iterator[slice]:
  for start in range(0, n, size):
    yield slice(start, min(start + size, n))


def extract_features(init_checkpoint: str, input_file: str, output: str,
                     layers: Sequence[int] | None = None, max_seq_length: int = 128,
                     batch_size: int = 32, pooling: Sequence[str] = POOLINGS,
                     concat: bool = False, vocab_file: str = '', lower_case: bool | None = None,
                     dtype: str = 'float32', decimals: int = 6) -> dict[str, Any]:
  """Writes token features of `layers` and sentence vectors for each line of `input_file`.

  Args:
    init_checkpoint: any checkpoint `pretrained.load_pretrained` reads (with its vocab.txt, or
      pass `vocab_file`; casing from the checkpoint unless `lower_case` is given).
    input_file: one text per line, or `text_a ||| text_b`.
    output: a .jsonl, .npz or .npy path (layouts in the module docstring).
    layers: hidden states to output (-1 = last encoder layer, 0 = embeddings); None = the
      last four encoder layers, or all of a model with fewer (`default_layers`).
    max_seq_length: longer texts are truncated (counted and logged).
    pooling: sentence vectors to add, of 'cls' (pooler output) and 'mean'.
    concat: concatenate the layers' features per token (the paper's best feature-based
      variant concatenates the last four layers) instead of listing them per layer.
    dtype: compute dtype ('auto' = bfloat16 on accelerators).

  Returns: {'lines', 'truncated', 'output', 'layers'} (the layers written).
  """
  suffix = os.path.splitext(output)[1]
  if suffix not in ('.jsonl', '.npz', '.npy'):
    raise UserError(f'--output={output}: the name must end in .jsonl, .npz or .npy')
  fileio.check_output_file(output, '--output')
  unknown = sorted(set(pooling) - set(POOLINGS))
  if unknown:
    raise UserError(f'pooling {unknown} not in {POOLINGS}')
  if batch_size < 1:
    raise UserError(f'batch_size must be positive, got {batch_size}')
  lines = read_input(input_file)  # Before the (slow) checkpoint: a wrong path fails at once.
  fileio.check_not_an_input(output, '--output', {'--input': input_file,
                                                 '--vocab_file': vocab_file})
  fileio.hide_accelerators_from_tf()
  config, params, tok, _, _ = pretrained.load_checkpoint(init_checkpoint, vocab_file,
                                                         lower_case, flag='--init_checkpoint')
  if not 2 < max_seq_length <= (config.max_length or max_seq_length):  # Rotary: no ceiling.
    raise UserError(f'--max_seq_length={max_seq_length} must be in [3, '
                    f'{config.max_position_embeddings}] (the model\'s max_position_embeddings)')
  config = config.replace(dtype=model_lib.resolve_dtype(dtype), scan_layers=False)
  if layers is None:
    layers = default_layers(config.num_hidden_layers)
  layers = [int(l) for l in layers]
  chosen = resolve_layers(layers, config.num_hidden_layers)
  encoded = _encode(tok, lines, max_seq_length)
  num_truncated = int(encoded['truncated'].sum())
  if num_truncated:
    logging.warning('%s: %d of %d lines are longer than max_seq_length=%d tokens and were '
                    'truncated; raise --max_seq_length to keep them whole', input_file,
                    num_truncated, len(lines), max_seq_length)

  bert = model_lib.BertModel(config)
  bert_params = jax.device_put(params['bert'])

  @jax.jit
  def run(p, input_ids, input_mask, segment_ids):
    _, pooled, hidden = bert.apply({'params': p}, input_ids, input_mask, segment_ids,
                                   deterministic=True, return_hidden_states=True)
    feats = jnp.stack([hidden[i] for i in chosen], axis=2).astype(jnp.float32)  # [B, T, n, H]
    mask = input_mask.astype(jnp.float32)[:, :, None, None]
    feats = feats * mask
    mean = feats.sum(1) / jnp.maximum(mask.sum(1), 1.0)
    return feats, pooled.astype(jnp.float32), mean

  n, longest = encoded['input_ids'].shape
  lengths = encoded['input_mask'].sum(1)
  width = len(chosen) * config.hidden_size
  keep = {'features': np.zeros((n, longest, len(chosen), config.hidden_size), np.float32)
          if suffix != '.jsonl' else None}
  cls = np.zeros((n, config.hidden_size), np.float32)
  mean = np.zeros((n, len(chosen), config.hidden_size), np.float32)
  if os.path.dirname(output):
    os.makedirs(os.path.dirname(output), exist_ok=True)  # As predict makes its output's folder.
  # pylint: disable-next=consider-using-with  (closed in the finally below)
  out_file = open(output, 'w', encoding='utf-8') if suffix == '.jsonl' else None
  try:
    for part in _chunks(n, batch_size * _CHUNK_BATCHES):
      arrays = {k: encoded[k][part] for k in ('input_ids', 'input_mask', 'segment_ids')}
      arrays['index'] = np.arange(part.start, part.stop, dtype=np.int32)
      chunk_feats: dict[int, np.ndarray] = {}
      for batch in batching.bucket_batches(arrays, batch_size, _buckets(longest)):
        rows = len(batch['index'])
        padded = {k: np.concatenate([v, np.zeros((batch_size - rows,) + v.shape[1:], v.dtype)])
                  for k, v in batch.items()}
        padded['input_mask'][rows:, 0] = 1  # Filler rows: no all-masked attention rows.
        feats, pooled, avg = jax.device_get(
            run(bert_params, padded['input_ids'], padded['input_mask'], padded['segment_ids']))
        for r, i in enumerate(batch['index']):
          cls[i], mean[i] = pooled[r], avg[r]
          if keep['features'] is not None:
            keep['features'][i, :feats.shape[1]] = feats[r]
          else:
            chunk_feats[int(i)] = feats[r, :lengths[i]]
      if out_file is not None:
        for i in range(part.start, part.stop):
          out_file.write(json.dumps(_json_line(
              i, lines[i][0], bool(encoded['truncated'][i]),
              tok.decode(encoded['input_ids'][i, :lengths[i]]), chunk_feats[i], cls[i],
              mean[i], layers, pooling, concat, decimals)) + '\n')
  finally:
    if out_file is not None:
      out_file.close()

  if suffix != '.jsonl':
    feats = keep['features']
    if concat:
      feats, mean = feats.reshape(n, longest, width), mean.reshape(n, width)
    if suffix == '.npy':
      np.save(output, feats)
    else:
      tokens = np.full((n, longest), '', dtype=object)
      for i in range(n):
        tokens[i, :lengths[i]] = tok.decode(encoded['input_ids'][i, :lengths[i]])
      arrays = dict(tokens=tokens.astype(str), input_ids=encoded['input_ids'],
                    input_mask=encoded['input_mask'], segment_ids=encoded['segment_ids'],
                    lengths=lengths.astype(np.int32),
                    line_numbers=np.array([l[0] for l in lines], np.int32),
                    truncated=encoded['truncated'], layers=np.asarray(layers, np.int32),
                    features=feats)
      if 'cls' in pooling:
        arrays['cls'] = cls
      if 'mean' in pooling:
        arrays['mean'] = mean
      np.savez(output, **arrays)
  logging.info('Wrote features of %d lines (layers %s) to %s', n, list(layers), output)
  return {'lines': n, 'truncated': num_truncated, 'output': output, 'layers': layers}


def _json_line(i: int, line: int, truncated: bool, tokens: list[str], feats: np.ndarray,
               cls: np.ndarray, mean: np.ndarray, layers: Sequence[int], pooling, concat: bool,
               decimals: int) -> dict[str, Any]:
  feats = np.round(feats.astype(np.float64), decimals)  # [T, n, H]
  mean = np.round(mean.astype(np.float64), decimals)  # [n, H]
  if concat:
    features = [{'token': t, 'values': f.reshape(-1).tolist()} for t, f in zip(tokens, feats)]
  else:
    features = [{'token': t, 'layers': [{'index': int(l), 'values': v.tolist()}
                                        for l, v in zip(layers, f)]}
                for t, f in zip(tokens, feats)]
  out = {'linex_index': i, 'line': line, 'truncated': truncated, 'features': features}
  if 'cls' in pooling:
    out['cls'] = np.round(cls.astype(np.float64), decimals).tolist()
  if 'mean' in pooling:
    out['mean'] = (mean.reshape(-1).tolist() if concat else
                   [{'index': int(l), 'values': v.tolist()} for l, v in zip(layers, mean)])
  return out
