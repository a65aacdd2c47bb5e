"""Batches of tokenized examples held in memory: what fine-tuning, `predict` and `features` share.

- `encode_in_chunks`: a tokenizer over many texts, in few calls of bounded size.
- `bucket_batches`: batches whose sequence axis is cut to the smallest length bucket that holds
  them (most GLUE sentences are far shorter than 128 tokens); `padding_savings` measures it.
- `batches`: global batches of a fixed number of rows, partial ones padded with rows of weight 0,
  so every example counts exactly once and shapes stay fixed; `local_rows` is one process's
  share of a global batch.
- `predict_rows`: every example's output of a prediction step, in example order.

Features are dicts of numpy arrays: `input_ids`, `input_mask`, `segment_ids` [N, L] and per-row
arrays such as labels and `example_index` / `feature_index` [N]. A multiple-choice example is
several sequences, [N, C, L]: its choices stay together, and its longest one picks the bucket.
"""

import math
from typing import Any, Callable, Iterator, Sequence

import jax
import numpy as np

from bert_jax.errors import UserError


def encode_in_chunks(tok, texts: Sequence[str], chunk_size: int = 50_000) -> list[list[int]]:
  """`tok.encode` over many texts: few calls (each has a fixed cost of milliseconds) of bounded
  size (peak memory)."""
  ids = []
  for start in range(0, len(texts), chunk_size):
    ids.extend(tok.encode(list(texts[start:start + chunk_size])))
  return ids


def parse_buckets(values: Sequence[Any]) -> tuple[int, ...]:
  """config.data.buckets as ints (`--config.data.buckets=` arrives as ('',): an error, not
  'none')."""
  try:
    buckets = tuple(int(b) for b in values)
  except (TypeError, ValueError):
    buckets = None
  if buckets is None or any(b < 1 for b in buckets):
    raise UserError(f'config.data.buckets={tuple(values)!r}: expected positive sequence lengths, '
                    "e.g. --config.data.buckets=32,64,128, or --config.data.buckets='()' for none")
  return buckets


# ---------------------------------------------------------------------------------------------
# Length buckets
# ---------------------------------------------------------------------------------------------


def _batchable(features: dict[str, Any]) -> tuple[dict[str, np.ndarray], int, int]:
  """The numeric arrays among `features` (bookkeeping such as lists is left out); N and L."""
  arrays = {k: v for k, v in features.items()
            if isinstance(v, np.ndarray) and v.dtype != object}
  if 'input_mask' not in arrays:
    raise ValueError('features need an input_mask array to be bucketed')
  n, length = len(arrays['input_mask']), arrays['input_mask'].shape[-1]
  for k, v in arrays.items():
    if v.shape[0] != n:
      raise ValueError(f'feature {k!r} has {v.shape[0]} rows, input_mask has {n}')
  return arrays, n, length


def _sequence_shape(arrays: dict[str, np.ndarray]) -> tuple[int, ...]:
  """What follows N in a token array: (L,), or (C, L) for C choices per example."""
  return arrays['input_mask'].shape[1:]


def _is_tokens(v: np.ndarray, shape: tuple[int, ...]) -> bool:
  """Whether `v` holds a value per token ([N, *shape, ...]): cut to the bucket."""
  return v.shape[1:1 + len(shape)] == shape


def _cut(v: np.ndarray, idx: np.ndarray, shape: tuple[int, ...], size: int) -> np.ndarray:
  """Rows `idx` of `v`, its token axis cut to `size` when it has one."""
  if not _is_tokens(v, shape):
    return v[idx]
  return v[idx][(slice(None),) * len(shape) + (slice(0, size),)]


def _bucket_plan(features, batch_size, buckets, shuffle, seed, window_batches, drop_remainder
                 ) -> tuple[dict[str, np.ndarray], list[tuple[np.ndarray, int]]]:
  arrays, n, length = _batchable(features)
  if batch_size < 1:
    raise UserError(f'batch_size must be positive, got {batch_size}')
  sizes = sorted({min(int(b), length) for b in buckets} | {length})
  # An example's length is that of its longest sequence (choice).
  lengths = arrays['input_mask'].reshape(n, -1, length).sum(-1).max(-1)
  rng = np.random.default_rng(seed)
  order = rng.permutation(n) if shuffle else np.arange(n)
  window = batch_size * window_batches
  planned = []
  for start in range(0, n, window):
    chunk = order[start:start + window]
    # Sorting only inside a window keeps batches random across the epoch (when shuffled) while
    # grouping similar lengths together.
    chunk = chunk[np.argsort(lengths[chunk], kind='stable')]
    for b in range(0, len(chunk), batch_size):
      idx = chunk[b:b + batch_size]
      if len(idx) < batch_size and drop_remainder:
        continue
      longest = int(lengths[idx].max())
      planned.append((idx, next(s for s in sizes if s >= longest)))
  if shuffle:
    planned = [planned[i] for i in rng.permutation(len(planned))]
  return arrays, planned


def bucket_batches(features: dict[str, Any], batch_size: int,
                   buckets: Sequence[int] = (32, 64, 128), shuffle: bool = False,
                   seed: int = 0, window_batches: int = 50,
                   drop_remainder: bool = False) -> Iterator[dict[str, np.ndarray]]:
  """Batches whose sequence axis is cut to the smallest bucket that holds their longest example.

  Examples are (optionally) shuffled, sorted by length within windows of `window_batches`
  batches, cut into batches, and the batch order is shuffled. Every example appears exactly
  once per epoch (the last batch may be smaller unless `drop_remainder`). Arrays of shape
  [N, L, ...] ([N, C, L, ...]: C choices) are cut to the bucket; [N] arrays (labels, indices)
  are gathered; non-array entries are left out. Use `example_index`/`feature_index` to map
  results back.
  """
  arrays, planned = _bucket_plan(features, batch_size, buckets, shuffle, seed, window_batches,
                                 drop_remainder)
  shape = _sequence_shape(arrays)
  for idx, size in planned:
    yield {k: _cut(v, idx, shape, size) for k, v in arrays.items()}


def padding_savings(features: dict[str, Any], batch_size: int,
                    buckets: Sequence[int] = (32, 64, 128), seed: int = 0,
                    window_batches: int = 50) -> dict[str, float]:
  """Share of padded tokens with fixed-length batches vs bucketed ones (one shuffled epoch)."""
  arrays, planned = _bucket_plan(features, batch_size, buckets, True, seed, window_batches,
                                 False)
  shape = _sequence_shape(arrays)
  sequences = math.prod(shape[:-1])  # Per example: 1, or its choices.
  fixed = len(arrays['input_mask']) * math.prod(shape)
  real = int(arrays['input_mask'].sum())
  bucketed = sum(len(idx) * sequences * size for idx, size in planned)
  return {'real_tokens': real, 'fixed_tokens': fixed, 'bucketed_tokens': bucketed,
          'fixed_pad_share': 1 - real / fixed,
          'bucketed_pad_share': 1 - real / bucketed,
          'tokens_saved_share': 1 - bucketed / fixed}


# ---------------------------------------------------------------------------------------------
# Fixed-size global batches
# ---------------------------------------------------------------------------------------------


def _pad_rows(batch: dict[str, np.ndarray], batch_size: int) -> dict[str, np.ndarray]:
  """Pads a partial batch to `batch_size` rows of weight 0 (a lone [CLS]-sized sequence each,
  every choice too, so attention never sees an all-masked row)."""
  n = len(batch['weight'])
  if n == batch_size:
    return batch
  out = {}
  for k, v in batch.items():
    fill = -1 if k == 'labels' else 0
    out[k] = np.concatenate([v, np.full((batch_size - n,) + v.shape[1:], fill, v.dtype)])
  out['input_mask'][n:, ..., 0] = 1
  return out


def batches(features: dict[str, np.ndarray], batch_size: int, buckets: Sequence[int],
            shuffle: bool = False, seed: int = 0,
            window_batches: int = 50) -> Iterator[dict[str, np.ndarray]]:
  """Global batches of `batch_size` rows, cut to length buckets, with a `weight` per row.

  Rows are sorted by length within windows of `window_batches` batches; 1 keeps each batch a
  uniform random draw (see config.train.length_sort_window).
  """
  features = dict(features, weight=np.ones(len(features['input_ids']), np.float32))
  for batch in bucket_batches(features, batch_size, tuple(buckets), shuffle=shuffle,
                              seed=seed, window_batches=window_batches):
    yield _pad_rows(batch, batch_size)


def batch_shapes(features: dict[str, np.ndarray], batch_size: int, buckets: Sequence[int],
                 seeds: Sequence[int | None] = (None,),
                 window_batches: int = 50) -> list[dict[str, jax.ShapeDtypeStruct]]:
  """The shapes of the global batches `batches` yields, one dict per length bucket used: over
  the shuffled epochs of `seeds` (None: unshuffled, as evaluation reads). What a run compiles
  before its first step."""
  if not seeds:
    return []
  features = dict(features, weight=np.ones(len(features['input_ids']), np.float32))
  sizes = set()
  for seed in seeds:
    arrays, planned = _bucket_plan(features, batch_size, tuple(buckets), seed is not None,
                                   seed or 0, window_batches, False)
    sizes.update(size for _, size in planned)
  shape = _sequence_shape(arrays)
  return [{k: jax.ShapeDtypeStruct((batch_size, *shape[:-1], size, *v.shape[1 + len(shape):])
                                   if _is_tokens(v, shape) else (batch_size, *v.shape[1:]),
                                   v.dtype)
           for k, v in arrays.items()} for size in sorted(sizes)]


def local_rows(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  """This process's share of a global batch (every process plans the same global batches)."""
  count, index = jax.process_count(), jax.process_index()
  if count == 1:
    return batch
  rows = len(batch['weight']) // count
  return {k: v[index * rows:(index + 1) * rows] for k, v in batch.items()}


def predict_rows(step: Callable[[dict[str, np.ndarray]], dict[str, Any]],
                 features: dict[str, np.ndarray], batch_size: int,
                 buckets: Sequence[int]) -> list[np.ndarray]:
  """Every row's output of `step` (batch -> `tasks.predict_step`'s dict) in `features['index']`
  order, over the batches fine-tuning evaluates with (padded rows dropped)."""
  rows: list[Any] = [None] * len(features['index'])
  for batch in batches(features, batch_size, buckets):
    out = jax.device_get(step(batch))
    for o, i, w in zip(out['outputs'], out['index'], out['weight']):
      if w:
        rows[i] = o
  return rows
