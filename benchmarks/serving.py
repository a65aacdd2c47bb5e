"""Serving speed on the CPU: examples/s of a GLUE classifier as the exported SavedModel, as
`bert-jax predict` and as transformers' text-classification pipeline, on the same weights, with
one and several threads and batches of 1 and 32. Prints one JSON line.

  python benchmarks/serving.py --size=base --examples=256
  python benchmarks/serving.py --workdir=RUN --export=DIR --hf=DIR   (a run of your own)

Without --workdir it makes its weights: a BERT of --size with random weights, fine-tuned for
one epoch of 16 SST-2-like sentences (the speed does not depend on what it learned), then
exported (`bert-jax export`) and converted (`bert-jax convert --format=hf`). The texts are
SST-2-like sentences of 3 to 40 words. Each (system, threads, batch) runs in a fresh process:

  savedmodel     tf.saved_model.load and serving_default on batches of texts (strings in,
                 labels and probabilities out), after one untimed pass that compiles every
                 shape; threads: TensorFlow's intra- and inter-op thread pools
  predict        `predict.predict` on a JSONL of the texts (--batch_size), end to end (reading,
                 tokenizing, compiling, writing), the time of its second call in the process;
                 threads: XLA's CPU thread pool (XLA_FLAGS)
  transformers   pipeline('text-classification') on the converted model with its own tokenizer
                 (batch_size), after one untimed pass; threads: torch.set_num_threads

Speeds are compared within one run of this script only (the machines of this project differ).
"""

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

WORDS = ('the a movie film plot was very quite and it actors story made by who good great fine '
         'nice bad awful dull boring lovely'.split())


def texts(count: int, seed: int = 0) -> list[str]:
  rng = random.Random(seed)
  return [' '.join(rng.choice(WORDS) for _ in range(rng.randint(3, 40))) for _ in range(count)]


def make_run(root: str, size: str) -> dict[str, str]:
  """A finished SST-2 run of a random BERT of `size`, its export and its HF conversion."""
  import jax  # pylint: disable=g-import-not-at-top
  # pylint: disable-next=g-import-not-at-top
  from bert_jax import config_files, convert, export, finetune
  from bert_jax import model as model_lib  # pylint: disable=g-import-not-at-top
  vocab = os.path.join(root, 'vocab.txt')
  with open(vocab, 'w') as f:
    f.write('\n'.join(['[PAD]', '[UNK]', '[CLS]', '[SEP]', '[MASK]'] + list(WORDS)) + '\n')
  config = model_lib.config_for_size(size, vocab_size=len(WORDS) + 5,
                                     max_position_embeddings=128)
  init = os.path.join(root, 'init')
  convert.export_bert_jax(config, model_lib.init_params(config, jax.random.key(0)), init,
                          vocab_file=vocab, lower_case=True)
  os.makedirs(os.path.join(root, 'glue', 'SST-2'))
  for split in ('train', 'dev'):
    with open(os.path.join(root, 'glue', 'SST-2', f'{split}.tsv'), 'w') as f:
      f.write('sentence\tlabel\n' + ''.join(f'{t}\t{i % 2}\n' for i, t in enumerate(texts(16))))
  workdir = os.path.join(root, 'run')
  finetune.finetune(config_files.load_config('finetune_glue.py:sst2', {
      'train.init_checkpoint': init, 'task.data_dir': os.path.join(root, 'glue'),
      'data.max_seq_length': 64, 'buckets': (16, 32, 64), 'train.epochs': 1,
      'train.batch_size': 8, 'eval.batch_size': 8, 'log.progress': False,
      'model.hidden_dropout_prob': 0.0, 'model.attention_probs_dropout_prob': 0.0}), workdir)
  paths = {'workdir': workdir, 'export': os.path.join(root, 'export'),
           'hf': os.path.join(root, 'hf')}
  export.export(workdir, paths['export'])
  convert.convert(workdir, paths['hf'], 'hf')
  return paths


def worker(args) -> dict:
  """One (system, threads, batch) measurement in this process."""
  examples = texts(args.examples, seed=1)
  batch = args.batch_size
  if args.system == 'savedmodel':
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    tf.config.threading.set_intra_op_parallelism_threads(args.threads)
    tf.config.threading.set_inter_op_parallelism_threads(args.threads)
    import tensorflow_text  # pylint: disable=g-import-not-at-top,unused-import
    serve = tf.saved_model.load(args.export).signatures['serving_default']

    def run():
      for start in range(0, len(examples), batch):
        serve(text_a=tf.constant(examples[start:start + batch]))['label'].numpy()
  elif args.system == 'predict':
    from bert_jax import predict  # pylint: disable=g-import-not-at-top
    folder = tempfile.mkdtemp()
    source = os.path.join(folder, 'input.jsonl')
    with open(source, 'w') as f:
      f.writelines(json.dumps({'text_a': t}) + '\n' for t in examples)
    calls = iter(range(2))

    def run():
      predict.predict(args.workdir, source, os.path.join(folder, f'out{next(calls)}.jsonl'),
                      batch_size=batch)
  else:
    import torch  # pylint: disable=g-import-not-at-top
    import transformers  # pylint: disable=g-import-not-at-top
    torch.set_num_threads(args.threads)
    classify = transformers.pipeline('text-classification', model=args.hf, tokenizer=args.hf,
                                     device='cpu')

    def run():
      classify(examples, batch_size=batch)
  run()  # Compiles (and loads) everything once.
  start = time.perf_counter()
  run()
  seconds = time.perf_counter() - start
  return {'examples_per_second': len(examples) / seconds, 'seconds': seconds}


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0], allow_abbrev=False)
  parser.add_argument('--size', default='tiny', help='Model size of the made run (model.SIZES).')
  parser.add_argument('--examples', type=int, default=256, help='Texts per timed pass.')
  parser.add_argument('--batch_sizes', default='1,32')
  parser.add_argument('--threads', default=f'1,{os.cpu_count()}')
  parser.add_argument('--systems', default='savedmodel,predict,transformers')
  parser.add_argument('--workdir', default='', help='A finished GLUE run (default: make one).')
  parser.add_argument('--export', default='', help='Its SavedModel (with --workdir).')
  parser.add_argument('--hf', default='', help='Its `convert --format=hf` (with --workdir).')
  parser.add_argument('--system', default='', help=argparse.SUPPRESS)  # A worker process.
  parser.add_argument('--batch_size', type=int, default=1, help=argparse.SUPPRESS)
  parser.add_argument('--thread_count', type=int, default=1, help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.system:
    args.threads = args.thread_count
    print(json.dumps(worker(args)), flush=True)
    return
  if args.workdir:
    paths = {'workdir': args.workdir, 'export': args.export, 'hf': args.hf}
  else:
    paths = make_run(tempfile.mkdtemp(prefix='serving_benchmark_'), args.size)
  results = []
  for system in args.systems.split(','):
    for threads in sorted({int(t) for t in args.threads.split(',')}):
      for batch in (int(b) for b in args.batch_sizes.split(',')):
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL='2', JAX_PLATFORMS='cpu')
        env['XLA_FLAGS'] = (env.get('XLA_FLAGS', '') + ' --xla_cpu_multi_thread_eigen='
                            f'{str(threads > 1).lower()} intra_op_parallelism_threads={threads}')
        proc = subprocess.run(
            [sys.executable, os.path.abspath(__file__), f'--system={system}',
             f'--thread_count={threads}', f'--batch_size={batch}',
             f'--examples={args.examples}', f'--workdir={paths["workdir"]}',
             f'--export={paths["export"]}', f'--hf={paths["hf"]}'],
            env=env, capture_output=True, text=True, check=False)
        if proc.returncode:
          raise SystemExit(f'{system} threads={threads} batch={batch} failed:\n'
                           f'{proc.stderr[-3000:]}')
        row = json.loads(proc.stdout.strip().splitlines()[-1])
        results.append({'system': system, 'threads': threads, 'batch_size': batch, **row})
  print(json.dumps({'size': args.size if not args.workdir else None,
                    'examples': args.examples, 'cpus': os.cpu_count(), 'results': results}))


if __name__ == '__main__':
  main()
