"""Peak memory and speed of `bert-jax data --stats` on corpora of the shapes users have.

Writes four corpora from the sample corpus's sentences (or CJK-like characters) and runs the
pre-training input pipeline on each, padded and packed, at each sequence length, in a
subprocess of its own; prints one JSON line per run and a summary line against the targets
(peak RSS of the smoke config <= 2 GB on every shape; tokens/s per core on the book shape >= 80%
of the Wikipedia shape's):

  wiki   many short documents (1-10 KB), one sentence a line
  books  few book-length documents (200 KB - 2 MB each), one sentence a line
  line   one enormous line: no newline at all (one document: objective 'none')
  cjk    CJK-like text: lines of 100 B - 100 KB without '. ', documents of a few lines

Peak RSS is the subprocess's maximum resident set (wait4); with --rss_limit_mb a run that goes
over is killed (sampled every 50 ms) and reported as such. Tokens per second are the
statistics' own (non-padding tokens after the first batch) divided by the cores this process may
use; that rate counts the batches the pipeline ran ahead while the first one filled the shuffle
buffers as free, so with --speed_seconds=T each setting also runs the same pipeline in a process
of its own for --warmup seconds and is then timed for T (steady_tokens_per_second_per_core,
which the summary compares when present).

With --formats=text,parquet each corpus is also written as Parquet (a row per document, in
the column 'text'; pyarrow) and read as data.input=*.parquet: the same documents through
`tables.py`'s chunks of rows.

  python benchmarks/corpus.py --speed_seconds=20                # the full matrix
  python benchmarks/corpus.py --scale=0.02 --seq_lens=128 --batches=3 --rss_limit_mb=2048
"""

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _ROOT)
os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')

SHAPES = ('wiki', 'books', 'line', 'cjk')
MB = 1 << 20


def _sentences() -> list[str]:
  from bert_jax import sample_corpus  # pylint: disable=g-import-not-at-top
  with open(sample_corpus.sample_corpus_path(), encoding='utf-8') as f:
    return [line.strip() for line in f if len(line.strip()) > 20]


def _write_documents(path: str, total: int, doc_bytes, make_line, min_docs: int = 2) -> None:
  """Documents of doc_bytes() bytes of make_line() lines, until `total` bytes (and at least
  `min_docs` documents: NotNext needs two)."""
  written = docs = 0
  with open(path, 'w', encoding='utf-8') as f:
    while written < total or docs < min_docs:
      docs += 1
      size, lines = doc_bytes(), []
      while size > 0:
        lines.append(make_line())
        size -= len(lines[-1].encode()) + 1
      text = '\n'.join(lines) + '\n\n'
      f.write(text)
      written += len(text.encode())


def make_corpora(directory: str, scale: float, seed: int = 0) -> dict[str, str]:
  """The four corpora under `directory` (sizes times `scale`): {shape: path}."""
  rng = random.Random(seed)
  sentences = _sentences()
  sentence = lambda: rng.choice(sentences)
  cjk_chars = [chr(c) for c in range(0x4E00, 0x4E00 + 3000)] + ['，', '。', '「', '」']

  def cjk_line():
    size = int(rng.choice([100, 300, 1000, 3000, 100_000]) * rng.uniform(0.5, 1.5) / 3)
    return ''.join(rng.choice(cjk_chars) for _ in range(max(1, size)))

  paths = {shape: os.path.join(directory, f'{shape}.txt') for shape in SHAPES}
  _write_documents(paths['wiki'], int(20 * MB * scale), lambda: rng.randint(1_000, 10_000),
                   sentence)
  _write_documents(paths['books'], int(6 * MB * scale),
                   # Smaller corpora keep longer books: 20 KB - 200 KB at the smallest.
                   lambda: int(rng.randint(200_000, 2_000_000) * max(scale, 0.1)), sentence)
  with open(paths['line'], 'w', encoding='utf-8') as f:
    words = ' '.join(sentences).split()
    target, written = int(30 * MB * scale), 0
    while written < target:
      chunk = ' '.join(rng.choice(words) for _ in range(10_000)) + ' '
      f.write(chunk)
      written += len(chunk.encode())
  _write_documents(paths['cjk'], int(10 * MB * scale), lambda: rng.randint(1_000, 300_000),
                   cjk_line)
  return paths


def to_parquet(path: str) -> str:
  """The text corpus at `path` as Parquet beside it: a row per blank-line separated document
  (the whole file for the one-line shape), written a few MB at a time."""
  import pyarrow as pa  # pylint: disable=g-import-not-at-top
  import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top
  out = path[:-len('.txt')] + '.parquet'
  schema = pa.schema([('text', pa.large_string())])
  with open(path, encoding='utf-8') as f, pq.ParquetWriter(out, schema) as writer:
    rows, size, lines = [], 0, []
    for line in f:
      if line.strip():
        lines.append(line.rstrip('\n'))
        continue
      if lines:
        rows.append('\n'.join(lines))
        size += len(rows[-1])
        lines = []
      if size > 4 * MB:
        writer.write_table(pa.table({'text': rows}, schema=schema))
        rows, size = [], 0
    if lines:
      rows.append('\n'.join(lines))
    if rows:
      writer.write_table(pa.table({'text': rows}, schema=schema))
  return out


def _cores() -> int:
  return len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else os.cpu_count()


def run_stats(input_path: str, vocab_file: str, seq_len: int, packing: bool, batches: int,
              batch_size: int, objective: str, rss_limit_mb: int,
              speed: tuple[float, float] | None = None) -> dict:
  """`bert-jax data --config=smoke --stats=N` on one corpus: its JSON, peak RSS, wall time;
  with speed=(warmup, seconds), `measure_speed` in a child process instead."""
  max_predictions = max(1, round(seq_len * 0.15 + 0.5))
  flags = {'data.input': input_path, 'data.vocab_file': vocab_file,
           'data.max_seq_length': seq_len, 'data.max_predictions_per_seq': max_predictions,
           'data.packing': packing, 'data.objective': objective,
           'train.batch_size': batch_size}
  command = ([sys.executable, '-m', 'bert_jax.cli', 'data', '--config=smoke',
              f'--stats={batches}'] +
             [f'--config.{k}={v}' for k, v in flags.items()])
  if speed:
    command = [sys.executable, os.path.abspath(__file__),
               '--child=' + json.dumps([flags, *speed])]
  env = dict(os.environ, PYTHONPATH=_ROOT, JAX_PLATFORMS='cpu', TF_CPP_MIN_LOG_LEVEL='2')
  start = time.perf_counter()
  with tempfile.TemporaryFile('w+') as out, tempfile.TemporaryFile('w+') as err:
    proc = subprocess.Popen(command, cwd=_ROOT, env=env, stdout=out, stderr=err, text=True)
    killed = threading.Event()

    def watch():  # Over the limit: killed, as a cgroup would.
      while not done.is_set():
        try:
          with open(f'/proc/{proc.pid}/status') as f:
            rss = next(int(l.split()[1]) for l in f if l.startswith('VmRSS:')) // 1024
        except (OSError, StopIteration, ValueError):
          return
        if rss_limit_mb and rss > rss_limit_mb:
          killed.set()
          proc.kill()
          return
        time.sleep(0.05)

    done = threading.Event()
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    # wait4 rather than Popen.wait: it gives this child's own peak RSS.
    _, status, usage = os.wait4(proc.pid, 0)
    done.set()
    watcher.join()
    out.seek(0)
    err.seek(0)
    stdout, stderr = out.read(), err.read()
  row = dict(seq_len=seq_len, packed=packing, objective=objective,
             seconds=round(time.perf_counter() - start, 1),
             peak_rss_mb=round(usage.ru_maxrss / 1024))
  if killed.is_set():
    return dict(row, killed_over_mb=rss_limit_mb)
  if os.waitstatus_to_exitcode(status) != 0:
    return dict(row, error=stderr.strip().splitlines()[-1] if stderr.strip() else status)
  stats = json.loads(next(l for l in stdout.splitlines() if l.startswith('{')))
  if speed:
    return dict(row, **stats)
  return dict(row, tokens_per_second_per_core=round(stats['tokens_per_second'] / _cores()),
              examples=stats['examples'], padding_fraction=round(stats['padding_fraction'], 3),
              mean_length=round(stats['mean_length'], 1), input=stats.get('input'))


def measure_speed(settings: dict, warmup: float, seconds: float) -> dict:
  """In a child process: the pipeline `data --stats` runs (smoke config with `settings`),
  iterated for `warmup` seconds (start-up, the buffers' first fill and the batches run ahead
  of the first one), then non-padding tokens counted for `seconds`."""
  from bert_jax import config_files  # pylint: disable=g-import-not-at-top
  from bert_jax import input_pipeline  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  config = config_files.load_config('smoke', settings)
  data = config.data
  ds = input_pipeline.make_pretraining_dataset(
      data, batch_size=config.train.batch_size, seq_len=data.max_seq_length,
      max_predictions=data.max_predictions_per_seq, train=True)
  it = iter(ds.map(lambda b: tf.reduce_sum(b['input_mask'])))
  start = time.perf_counter()
  while time.perf_counter() - start < warmup:
    next(it)
  tokens, start = 0, time.perf_counter()
  while (elapsed := time.perf_counter() - start) < seconds:
    tokens += int(next(it))
  return {'steady_tokens_per_second_per_core': round(tokens / elapsed / _cores())}


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
  parser.add_argument('--shapes', default=','.join(SHAPES))
  parser.add_argument('--formats', default='text', help="'text', 'parquet' or both")
  parser.add_argument('--scale', type=float, default=1.0, help='corpus sizes times this')
  parser.add_argument('--seq_lens', default='128,512')
  parser.add_argument('--packing', default='false,true')
  parser.add_argument('--objective', default='nsp', help="'nsp', 'sop' or 'none'")
  parser.add_argument('--batches', type=int, default=40, help='--stats=N of each run')
  parser.add_argument('--speed_seconds', type=float, default=0,
                      help='also time each setting for this long after --warmup seconds, in a '
                           'process of its own (steady_tokens_per_second_per_core)')
  parser.add_argument('--warmup', type=float, default=20.0)
  parser.add_argument('--child', default='', help=argparse.SUPPRESS)
  parser.add_argument('--batch_size', type=int, default=32)
  parser.add_argument('--vocab_file', default='', help="'' trains one on the sample corpus")
  parser.add_argument('--rss_limit_mb', type=int, default=0, help='kill a run above it')
  parser.add_argument('--dir', default='', help='where the corpora go (default: a temp dir)')
  args = parser.parse_args()
  if args.child:
    settings, warmup, seconds = json.loads(args.child)
    print(json.dumps(measure_speed(settings, warmup, seconds)), flush=True)
    return

  directory = args.dir or tempfile.mkdtemp(prefix='bert_jax_corpora_')
  os.makedirs(directory, exist_ok=True)
  vocab_file = args.vocab_file
  if not vocab_file:
    from bert_jax import defaults  # pylint: disable=g-import-not-at-top
    from bert_jax import input_pipeline  # pylint: disable=g-import-not-at-top
    data = defaults.pretrain().data
    data.input = 'sample'
    vocab_file = input_pipeline.resolve_vocab(data, None)
  paths = make_corpora(directory, args.scale)
  peak = {}
  speed = {}
  formats = args.formats.split(',')
  for shape_format in [(s, f) for s in args.shapes.split(',') for f in formats]:
    shape, fmt = shape_format
    path = paths[shape] if fmt == 'text' else to_parquet(paths[shape])
    size = os.path.getsize(paths[shape])
    for seq_len in (int(s) for s in args.seq_lens.split(',')):
      for packing in (p.strip() == 'true' for p in args.packing.split(',')):
        # One line is one document: NotNext needs two, so it runs MLM alone.
        objective = 'none' if shape == 'line' else args.objective
        row = run_stats(path, vocab_file, seq_len, packing, args.batches,
                        args.batch_size, objective, args.rss_limit_mb)
        rate = row.get('tokens_per_second_per_core')
        if args.speed_seconds:
          timed = run_stats(path, vocab_file, seq_len, packing, args.batches,
                            args.batch_size, objective, args.rss_limit_mb,
                            speed=(args.warmup, args.speed_seconds))
          rate = row['steady_tokens_per_second_per_core'] = timed.get(
              'steady_tokens_per_second_per_core')
          row['peak_rss_mb'] = max(row['peak_rss_mb'], timed['peak_rss_mb'])
        row = dict(shape=shape, format=fmt, corpus_mb=round(size / MB, 2), **row)
        print(json.dumps(row), flush=True)
        key = shape if fmt == 'text' else f'{shape}_{fmt}'
        peak[key] = max(peak.get(key, 0), row.get('peak_rss_mb', float('inf')))
        if fmt == 'text':
          speed[(shape, seq_len, packing)] = rate
  ratios = {f'{seq_len}{"_packed" if packed else ""}': round(v / speed[('wiki', seq_len,
                                                                           packed)], 2)
            for (shape, seq_len, packed), v in speed.items()
            if shape == 'books' and v and speed.get(('wiki', seq_len, packed))}
  print(json.dumps({'summary': True, 'peak_rss_mb': peak, 'cores': _cores(),
                    'books_over_wiki_tokens_per_core': ratios,
                    'rss_target_met': all(v <= 2048 for v in peak.values()),
                    'speed_target_met': bool(ratios) and min(ratios.values()) >= 0.8}),
        flush=True)


if __name__ == '__main__':
  main()
