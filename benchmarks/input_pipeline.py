"""Throughput of the pre-training input pipeline: one JSON line per setting.

Measures, for each sequence length and tf.data thread count, the full pipeline (read, tokenize,
pair, mask, batch) and tokenization alone. Tokens are the non-padding input tokens produced
(full) or the WordPiece ids produced (tokenize); "per core" divides by the thread count.

  python benchmarks/input_pipeline.py                      # sample corpus, trained vocab
  python benchmarks/input_pipeline.py --input='wiki/*.txt' --vocab_file=vocab.txt --threads=1,2
"""

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')

import tensorflow as tf  # pylint: disable=g-import-not-at-top

from bert_jax import documents  # pylint: disable=g-import-not-at-top
from bert_jax import fileio
from bert_jax import input_pipeline  # pylint: disable=g-import-not-at-top
from bert_jax import tokenization  # pylint: disable=g-import-not-at-top
from bert_jax import defaults  # pylint: disable=g-import-not-at-top


def _options(threads: int) -> tf.data.Options:
  options = tf.data.Options()
  options.threading.private_threadpool_size = threads
  options.threading.max_intra_op_parallelism = 1
  options.autotune.cpu_budget = threads
  return options


def _measure(ds: tf.data.Dataset, count, seconds: float, warmup: float) -> dict:
  """Runs `ds` for `warmup` then `seconds`; count(element) -> (tokens, sequences)."""
  it = iter(ds)
  start = time.perf_counter()
  while time.perf_counter() - start < warmup:
    next(it)
  tokens = sequences = 0
  start = time.perf_counter()
  while (elapsed := time.perf_counter() - start) < seconds:
    t, s = count(next(it))
    tokens += t
    sequences += s
  return dict(tokens_per_second=tokens / elapsed, sequences_per_second=sequences / elapsed,
              seconds=round(elapsed, 2))


def full_pipeline(data, seq_len: int, max_predictions: int, batch_size: int, threads: int,
                  seconds: float, warmup: float, vocab_file: str) -> dict:
  ds = input_pipeline.make_pretraining_dataset(
      data, batch_size=batch_size, seq_len=seq_len, max_predictions=max_predictions,
      train=True, vocab_file=vocab_file)
  ds = ds.map(lambda b: (tf.reduce_sum(b['input_mask']), tf.shape(b['input_mask'])[0]))
  return _measure(ds.with_options(_options(threads)),
                  lambda e: (int(e[0]), int(e[1])), seconds, warmup)


def tokenize_only(files: list[str], vocab_file: str, lower_case: bool, threads: int,
                  seconds: float, warmup: float) -> dict:
  tokenizer = tokenization.load_tokenizer(vocab_file, lower_case=lower_case)
  # Batches of lines, blank ones dropped in-batch (a per-line filter would cost more than
  # tokenizing).
  lines = tf.data.TextLineDataset(files).batch(1024).map(
      lambda s: tf.boolean_mask(s, tf.strings.length(s) > 0))
  ds = lines.map(lambda s: (tokenizer.tokenize(s).row_splits[-1], tf.shape(s)[0]),
                 num_parallel_calls=tf.data.AUTOTUNE).repeat().prefetch(4)
  return _measure(ds.with_options(_options(threads)),
                  lambda e: (int(e[0]), int(e[1])), seconds, warmup)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
  parser.add_argument('--input', default='sample', help='data.input: files, globs or sample.')
  parser.add_argument('--vocab_file', default='', help="'' trains one (cached).")
  parser.add_argument('--vocab_size', type=int, default=30522)
  parser.add_argument('--seq_lens', default='128,512')
  parser.add_argument('--threads', default='1,2')
  parser.add_argument('--batch_size', type=int, default=64)
  parser.add_argument('--objective', default='nsp')
  parser.add_argument('--whole_word_masking', action='store_true')
  parser.add_argument('--seconds', type=float, default=20.0)
  parser.add_argument('--warmup', type=float, default=10.0)
  parser.add_argument('--what', default='full,tokenize')
  args = parser.parse_args()

  fileio.hide_accelerators_from_tf()
  data = defaults.pretrain().data
  data.input = args.input
  data.vocab_file = args.vocab_file
  data.vocab_size = args.vocab_size
  data.objective = args.objective
  data.whole_word_masking = args.whole_word_masking
  vocab_file = input_pipeline.resolve_vocab(data, None)
  vocab_size = tokenization.load_tokenizer(vocab_file).vocab_size
  common = dict(input=args.input, vocab_size=vocab_size, cpu_count=os.cpu_count())
  threads = [int(t) for t in args.threads.split(',')]
  whats = args.what.split(',')
  for n in threads:
    if 'tokenize' in whats:
      files = documents.resolve_files(args.input, '--input')
      result = tokenize_only(files, vocab_file, data.lower_case, n, args.seconds, args.warmup)
      print(json.dumps(dict(what='tokenize', threads=n, **common, **_per_core(result, n))),
            flush=True)
    if 'full' in whats:
      for seq_len in (int(s) for s in args.seq_lens.split(',')):
        max_predictions = max(1, round(seq_len * 0.15 + 0.5))
        result = full_pipeline(data, seq_len, max_predictions, args.batch_size, n,
                               args.seconds, args.warmup, vocab_file)
        print(json.dumps(dict(what='full', objective=args.objective, seq_len=seq_len,
                              threads=n, batch_size=args.batch_size, **common,
                              **_per_core(result, n))), flush=True)


def _per_core(result: dict, threads: int) -> dict:
  out = {k: round(v) if k.endswith('second') else v for k, v in result.items()}
  out['tokens_per_second_per_core'] = round(result['tokens_per_second'] / threads)
  out['sequences_per_second_per_core'] = round(result['sequences_per_second'] / threads, 1)
  return out


if __name__ == '__main__':
  main()
