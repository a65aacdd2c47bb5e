"""Packed vs padded pre-training rows (data.packing): padding, speed, learning. JSON lines.

  python benchmarks/packing.py --what=padding            # sample corpus, 128 and 512 tokens
  python benchmarks/packing.py --what=speed --size=mini  # real tokens trained per second
  python benchmarks/packing.py --what=learning --steps=300

padding: `input_inspect.compute_stats` over --batches batches, packed and not: padding_fraction
  of the rows, sequences_per_row.
speed: the jitted train step of train.py on batches of the real pipeline (the same model, batch
  size in rows and sequence length; --batches distinct batches cycled), packed and padded timed
  in alternating rounds; real tokens per second = non-padding tokens / step time; the ratio is
  the median of the per-round ratios.
learning: `train.train_and_evaluate` for --steps steps, packed and padded, the same config and
  seed; both checkpoints are then evaluated on the same padded held-out batches (MLM accuracy
  and loss over the same masked tokens).
"""

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')

import jax  # pylint: disable=g-import-not-at-top
import numpy as np

from bert_jax import config_files  # pylint: disable=g-import-not-at-top
from bert_jax import fileio
from bert_jax import input_inspect
from bert_jax import input_pipeline
from bert_jax import model as model_lib
from bert_jax import monitor
from bert_jax import pretraining
from bert_jax import run_files
from bert_jax import sharding as sharding_lib
from bert_jax import train as train_lib

# (sequence length, max predictions per sequence, batch rows) of each setting.
SETTINGS = {128: (128, 20, 32), 512: (512, 80, 8)}


def _config(args, seq_len: int, preds: int, batch: int, packing: bool):
  return config_files.load_config('smoke', {
      'model.size': args.size, 'data.max_seq_length': seq_len,
      'data.max_predictions_per_seq': preds, 'train.batch_size': batch,
      'data.packing': packing, 'data.input': args.input, 'data.vocab_file': args.vocab_file})


def _vocab(args) -> str:
  # --vocab_file, or the smoke config's 8k vocabulary trained on --input, cached by the input and
  # the vocabulary's settings: the same for every run on the same corpus (not the vocab.txt of
  # whatever run last used the default smoke workdir).
  return input_pipeline.resolve_vocab(_config(args, 128, 20, 32, False).data, None)


def padding(args):
  vocab = _vocab(args)
  for seq_len in args.seq_lens:
    _, preds, batch = SETTINGS[seq_len]
    out = dict(what='padding', seq_len=seq_len, batch_size=batch, batches=args.batches)
    for packing in (False, True):
      stats = input_inspect.compute_stats(
          _config(args, seq_len, preds, batch, packing).data, num_batches=args.batches,
          batch_size=batch, vocab_file=vocab)
      name = 'packed' if packing else 'padded'
      out[f'{name}_padding_fraction'] = round(stats['padding_fraction'], 4)
      out[f'{name}_sequences_per_row'] = round(stats['sequences_per_row'], 3)
      out[f'{name}_mean_sequence_length'] = round(stats['mean_length'], 1)
    print(json.dumps(out), flush=True)


def _stepper(config, batches):
  """(run(n) -> (seconds, real tokens) of n train steps over `batches`, cycled)."""
  mesh = sharding_lib.make_mesh(config.mesh)
  rules = sharding_lib.rules_from_config(config.mesh)
  built = pretraining.build_step(config, mesh, config.model.vocab_size)  # The driver's step.
  step = built.train_step
  with sharding_lib.activate(mesh, rules):
    state = jax.jit(built.init, out_shardings=built.shardings)(jax.random.key(0))
  bsh = sharding_lib.batch_sharding(mesh)
  placed = [sharding_lib.make_global_batch(b, bsh) for b in batches]
  real = [int(b['input_mask'].sum()) for b in batches]
  box = dict(state=state, i=0)

  def run(n):
    tokens = 0
    start = time.perf_counter()
    for _ in range(n):
      i = box['i'] % len(placed)
      box['state'], metrics = step(box['state'], placed[i])
      tokens += real[i]
      box['i'] += 1
    jax.block_until_ready(metrics['loss'])
    return time.perf_counter() - start, tokens
  return run


def speed(args):
  vocab = _vocab(args)
  for seq_len in args.seq_lens:
    _, preds, batch = SETTINGS[seq_len]
    runs = {}
    for packing in (False, True):
      config = _config(args, seq_len, preds, batch, packing)
      config.data.vocab_file = vocab
      config.model.vocab_size = len(open(vocab).read().splitlines())
      ds = input_pipeline.make_pretraining_dataset(
          config.data, batch_size=batch, seq_len=seq_len, max_predictions=preds, train=True,
          vocab_file=vocab)
      it = ds.as_numpy_iterator()
      batches = [next(it) for _ in range(args.batches)]
      runs[packing] = _stepper(config, batches)
      runs[packing](1)  # Compile.
    rates = {False: [], True: []}
    for _ in range(args.rounds):
      for packing in (False, True):
        seconds, tokens = runs[packing](args.steps)
        rates[packing].append(tokens / seconds)
    ratios = [p / u for p, u in zip(rates[True], rates[False])]
    print(json.dumps(dict(
        what='speed', size=args.size, seq_len=seq_len, batch_size=batch, rounds=args.rounds,
        steps_per_round=args.steps, devices=jax.device_count(),
        padded_real_tokens_per_second=round(float(np.median(rates[False])), 1),
        packed_real_tokens_per_second=round(float(np.median(rates[True])), 1),
        speedup=round(float(np.median(ratios)), 3),
        speedup_range=[round(min(ratios), 3), round(max(ratios), 3)])), flush=True)


def learning(args):
  vocab = _vocab(args)
  seq_len, preds, batch = SETTINGS[args.seq_lens[0]]
  overrides = {'train.steps': args.steps, 'train.warmup_steps': max(1, args.steps // 10),
               'eval.every_steps': args.steps, 'checkpoint.every_steps': args.steps,
               'log.every_steps': max(1, args.steps // 5), 'log.progress': False,
               'eval.steps': args.eval_batches, 'eval.batch_size': batch}
  out = dict(what='learning', size=args.size, seq_len=seq_len, batch_size=batch,
             steps=args.steps)
  root = tempfile.mkdtemp(prefix='bert_jax_packing_')
  params = {}
  for packing in (False, True):
    config = _config(args, seq_len, preds, batch, packing)
    config.data.vocab_file = vocab
    for key, value in overrides.items():
      section, name = key.split('.')
      config[section][name] = value
    workdir = os.path.join(root, 'packed' if packing else 'padded')
    start = time.perf_counter()
    own_eval = train_lib.train_and_evaluate(config, workdir)
    name = 'packed' if packing else 'padded'
    out[f'{name}_train_seconds'] = round(time.perf_counter() - start, 1)
    out[f'{name}_own_eval_mlm_accuracy'] = round(own_eval['mlm_accuracy'], 4)
    with open(os.path.join(workdir, 'metrics.jsonl')) as f:
      rows = [json.loads(line) for line in f if '"eval"' not in line]
    out[f'{name}_sequences_seen'] = round(sum(
        r['sequences_per_second'] / r['steps_per_second'] * config.log.every_steps
        for r in rows))
    params[packing] = run_files.load_pretrained_from_workdir(workdir)[1]
  # The same held-out, padded batches for both models.
  config = _config(args, seq_len, preds, batch, False)
  bert_config = model_lib.config_from(
      config.model, vocab_size=len(open(vocab).read().splitlines()))
  model = model_lib.BertForPreTraining(bert_config)
  step = jax.jit(lambda p, b: pretraining.eval_step(p, b, model=model, objective='nsp'))
  ds = input_pipeline.make_pretraining_dataset(config.data, batch_size=batch, seq_len=seq_len,
                                               max_predictions=preds, train=False,
                                               vocab_file=vocab)
  batches = list(ds.take(args.eval_batches).as_numpy_iterator())
  for packing in (False, True):
    metrics = monitor.summarize([jax.device_get(step(params[packing], b)) for b in batches])
    name = 'packed' if packing else 'padded'
    out[f'{name}_eval_mlm_accuracy'] = round(metrics['mlm_accuracy'], 4)
    out[f'{name}_eval_mlm_loss'] = round(metrics['mlm_loss'], 4)
    out[f'{name}_eval_nsp_accuracy'] = round(metrics['nsp_accuracy'], 4)
  out['eval_masked_tokens'] = int(sum(b['masked_lm_weights'].sum() for b in batches))
  print(json.dumps(out), flush=True)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
  parser.add_argument('--what', choices=('padding', 'speed', 'learning'), required=True)
  parser.add_argument('--seq_lens', default='128,512',
                      help='comma-separated, of 128 and 512 (learning: the first)')
  parser.add_argument('--size', default='mini')
  parser.add_argument('--input', default='sample')
  parser.add_argument('--vocab_file', default='', help="'' = train one on --input (cached)")
  parser.add_argument('--batches', type=int, default=20,
                      help='padding: batches of statistics; speed: distinct batches cycled')
  parser.add_argument('--rounds', type=int, default=3)
  parser.add_argument('--steps', type=int, default=3,
                      help='speed: steps per round; learning: training steps')
  parser.add_argument('--eval_batches', type=int, default=20)
  args = parser.parse_args()
  args.seq_lens = [int(s) for s in args.seq_lens.split(',')]
  unknown = sorted(set(args.seq_lens) - set(SETTINGS))
  if unknown:
    parser.error(f'--seq_lens: {unknown} not in {sorted(SETTINGS)}')
  fileio.hide_accelerators_from_tf()
  dict(padding=padding, speed=speed, learning=learning)[args.what](args)


if __name__ == '__main__':
  main()
