"""Train-step throughput: the training loop stripped to what is timed. Prints one JSON line.

  python benchmarks/train_step.py --size=base --batch_size=32 --seq_len=128 --steps=20
  python benchmarks/train_step.py --size=mini --batch_size=32 --seq_len=128 --compare_torch
  python benchmarks/train_step.py --size=tiny --batch_size=32 --seq_len=128 --real_data
  python benchmarks/train_step.py --size=mini --batch_size=32 --seq_len=128 --compare_in_flight

Synthetic batches by default; --real_data feeds the real input pipeline (sample corpus) and
reports the share of wall time spent waiting for input. --compare_torch also times Hugging Face
transformers' PyTorch BertForPreTraining (same config, batch, sequence length, AdamW) in the
same process, on the CPU, in rounds alternating with bert_jax's; the speedup printed is the
median of the per-round ratios. The loop keeps at most --max_in_flight steps dispatched and not
computed, as the drivers do (`monitor.InFlight`; 0 = no bound); --compare_in_flight times one
step in flight against no bound, in alternating rounds, for what the bound costs.
"""

import argparse
import importlib.util
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # pylint: disable=g-import-not-at-top
import numpy as np

from bert_jax import config_files  # pylint: disable=g-import-not-at-top
from bert_jax import fileio
from bert_jax import flops as flops_lib
from bert_jax import monitor
from bert_jax import pretraining
from bert_jax import sharding as sharding_lib


def synthetic_batch(batch_size, seq_len, preds, vocab_size, seed=0):
  rng = np.random.RandomState(seed)
  ids = rng.randint(5, vocab_size, size=(batch_size, seq_len)).astype(np.int32)
  pos = np.sort(np.stack([rng.choice(np.arange(1, seq_len), preds, replace=False)
                          for _ in range(batch_size)]), axis=1).astype(np.int32)
  return dict(input_ids=ids, input_mask=np.ones_like(ids),
              segment_ids=(np.arange(seq_len)[None] >= seq_len // 2).astype(np.int32)
              * np.ones_like(ids),
              masked_lm_positions=pos, masked_lm_ids=np.take_along_axis(ids, pos, 1),
              masked_lm_weights=np.ones(pos.shape, np.float32),
              next_sentence_labels=rng.randint(0, 2, size=batch_size).astype(np.int32))


def setup_jax(args, config):
  """(run(n) -> seconds waiting for input over n steps, finish() -> result dict)."""
  pretraining.check_attention(config, jax.default_backend())
  mesh = sharding_lib.make_mesh(config.mesh)
  rules = sharding_lib.rules_from_config(config.mesh)
  built = pretraining.build_step(config, mesh, args.vocab_size)  # The driver's step.
  bert_config, step = built.bert_config, built.train_step
  with sharding_lib.activate(mesh, rules):
    state = jax.jit(built.init, out_shardings=built.shardings)(jax.random.key(0))
  bsh = sharding_lib.batch_sharding(mesh)
  if args.real_data:
    from bert_jax import input_pipeline  # pylint: disable=g-import-not-at-top
    fileio.hide_accelerators_from_tf()
    vocab = input_pipeline.resolve_vocab(config.data, fileio.default_workdir('bench'))
    ds = input_pipeline.make_pretraining_dataset(
        config.data, batch_size=args.batch_size, seq_len=args.seq_len,
        max_predictions=args.max_predictions, train=True, vocab_file=vocab)
    it = ds.as_numpy_iterator()
    next_batch = lambda: next(it)
  else:
    fixed = synthetic_batch(args.batch_size, args.seq_len, args.max_predictions,
                            bert_config.vocab_size)
    next_batch = lambda: fixed
  box = dict(state=state, metrics=None)

  def run(n, max_in_flight=args.max_in_flight):
    wait = 0.0
    in_flight = monitor.InFlight(max_in_flight or n)
    for _ in range(n):
      t = time.perf_counter()
      local = next_batch()
      wait += time.perf_counter() - t
      box['state'], box['metrics'] = step(box['state'], sharding_lib.make_global_batch(local, bsh))
      in_flight.add(box['metrics'])
    in_flight.drain()
    return wait

  def result(steps, elapsed, wait):
    sps = steps * args.batch_size / elapsed
    flops = flops_lib.train_flops_per_sequence(bert_config, args.seq_len, args.max_predictions)
    peak = flops_lib.peak_flops_per_device()
    out = dict(framework='bert_jax', size=args.size, batch_size=args.batch_size,
               seq_len=args.seq_len, devices=jax.device_count(),
               device_kind=jax.devices()[0].device_kind, dtype=bert_config.dtype,
               attention_impl=bert_config.attention_impl, remat=bert_config.remat_policy,
               rng_impl=args.rng_impl,
               sequences_per_second=sps, step_seconds=elapsed / steps,
               model_tflops_per_second=sps * flops / 1e12,
               mfu=(sps * flops / (peak * jax.device_count())) if peak else None,
               loss=float(box['metrics']['loss']))
    if args.real_data:
      out['input_wait_fraction'] = wait / elapsed
    return out

  return run, result, bert_config


def setup_torch(args, bert_config, train_config):
  """Hugging Face's PyTorch BertForPreTraining on the same config and batch, with the same
  AdamW (learning rate, betas, eps, weight decay except on biases and LayerNorm, clipping)."""
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  hf_config = transformers.BertConfig(**bert_config.to_original_dict(),
                                      attn_implementation='sdpa')
  model = transformers.BertForPreTraining(hf_config).train()
  no_decay = lambda n: n.endswith('bias') or 'LayerNorm' in n
  groups = [
      {'params': [p for n, p in model.named_parameters() if not no_decay(n)],
       'weight_decay': train_config.weight_decay},
      {'params': [p for n, p in model.named_parameters() if no_decay(n)], 'weight_decay': 0.0}]
  opt = torch.optim.AdamW(groups, lr=train_config.learning_rate, eps=train_config.eps,
                          betas=(train_config.beta1, train_config.beta2))
  b = synthetic_batch(args.batch_size, args.seq_len, args.max_predictions,
                      bert_config.vocab_size)
  labels = np.full(b['input_ids'].shape, -100, np.int64)
  np.put_along_axis(labels, b['masked_lm_positions'], b['masked_lm_ids'], 1)
  inputs = dict(input_ids=torch.tensor(b['input_ids'], dtype=torch.long),
                attention_mask=torch.tensor(b['input_mask'], dtype=torch.long),
                token_type_ids=torch.tensor(b['segment_ids'], dtype=torch.long),
                labels=torch.tensor(labels),
                next_sentence_label=torch.tensor(b['next_sentence_labels'], dtype=torch.long))
  box = dict(loss=None)

  def run(n):
    for _ in range(n):
      opt.zero_grad(set_to_none=True)
      loss = model(**inputs).loss
      loss.backward()
      torch.nn.utils.clip_grad_norm_(model.parameters(), train_config.max_grad_norm)
      opt.step()
      box['loss'] = loss.item()
    return 0.0

  def result(steps, elapsed, wait):
    del wait
    return dict(framework='transformers+torch', torch=torch.__version__,
                threads=torch.get_num_threads(), size=args.size, batch_size=args.batch_size,
                seq_len=args.seq_len, sequences_per_second=steps * args.batch_size / elapsed,
                step_seconds=elapsed / steps, loss=box['loss'])

  return run, result


def timed(run, steps):
  t = time.perf_counter()
  wait = run(steps)
  return time.perf_counter() - t, wait


def compare_in_flight(args, run_jax, result_jax):
  """One step in flight (the drivers' loop) against no bound, in alternating rounds."""
  per_round = max(1, args.steps // args.rounds)
  totals = {1: [0.0, 0.0], 0: [0.0, 0.0]}
  ratios = []
  for r in range(args.rounds):
    times = {}
    for limit in ((1, 0) if r % 2 == 0 else (0, 1)):
      elapsed, wait = timed(lambda n, limit=limit: run_jax(n, limit), per_round)
      times[limit] = elapsed
      totals[limit][0] += elapsed
      totals[limit][1] += wait
    ratios.append(times[1] / times[0])
  steps = per_round * args.rounds
  for limit in (1, 0):
    print(json.dumps(dict(result_jax(steps, *totals[limit]), max_in_flight=limit)), flush=True)
  print(json.dumps(dict(step_time_ratio_bounded_vs_unbounded=float(np.median(ratios)),
                        ratio_per_round=[round(x, 3) for x in ratios],
                        rounds=args.rounds, steps_per_round=per_round)), flush=True)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0], allow_abbrev=False)
  parser.add_argument('--size', default='base')
  parser.add_argument('--batch_size', type=int, default=32)
  parser.add_argument('--seq_len', type=int, default=128)
  parser.add_argument('--max_predictions', type=int, default=0,
                      help='0 = 20 at 128 tokens, scaled with the length (80 at 512)')
  parser.add_argument('--steps', type=int, default=20)
  parser.add_argument('--rounds', type=int, default=5,
                      help='with --compare_torch: alternating timed rounds of steps/rounds each')
  parser.add_argument('--warmup', type=int, default=3)
  parser.add_argument('--vocab_size', type=int, default=30522)
  parser.add_argument('--dtype', default='auto')
  parser.add_argument('--attention_impl', default='xla', choices=['xla', 'cudnn', 'splash'],
                      help='fused kernels need --dropout 0 (no attention dropout in them)')
  parser.add_argument('--remat', default='none', choices=['none', 'full', 'dots'])
  parser.add_argument('--scan_layers', action='store_true')
  parser.add_argument('--dropout', type=float, default=0.1)
  parser.add_argument('--rng_impl', default='rbg', choices=['threefry2x32', 'rbg', 'unsafe_rbg'],
                      help='train.rng_impl: the PRNG of dropout')
  parser.add_argument('--real_data', action='store_true')
  parser.add_argument('--compare_torch', action='store_true')
  parser.add_argument('--max_in_flight', type=int, default=1,
                      help='steps dispatched and not yet computed, at most (0 = no bound)')
  parser.add_argument('--compare_in_flight', action='store_true',
                      help='time --max_in_flight=1 against 0 in alternating --rounds')
  args = parser.parse_args()
  args.max_predictions = args.max_predictions or max(1, round(args.seq_len * 20 / 128))
  config = config_files.load_config('configs/smoke.py', {
      'model.size': args.size, 'model.dtype': args.dtype, 'model.attention_impl':
      args.attention_impl, 'model.remat_policy': args.remat, 'model.scan_layers':
      args.scan_layers, 'model.hidden_dropout_prob': args.dropout,
      'model.attention_probs_dropout_prob': args.dropout, 'train.batch_size': args.batch_size,
      'data.max_seq_length': args.seq_len, 'data.max_predictions_per_seq': args.max_predictions,
      'train.steps': 1000, 'train.warmup_steps': 0, 'train.decay': 'constant',
      'train.rng_impl': args.rng_impl})
  if args.compare_torch:  # Before the (slow) bert_jax set-up.
    missing = [m for m in ('torch', 'transformers') if importlib.util.find_spec(m) is None]
    if missing:
      parser.error(f'--compare_torch needs {" and ".join(missing)}: pip install torch==2.13.0 '
                   "'transformers>=4.46,<6' (the [test] extra has them on Python 3.11)")
  run_jax, result_jax, bert_config = setup_jax(args, config)
  run_jax(args.warmup)
  if args.compare_in_flight:
    compare_in_flight(args, run_jax, result_jax)
    return
  if not args.compare_torch:
    elapsed, wait = timed(run_jax, args.steps)
    print(json.dumps(result_jax(args.steps, elapsed, wait)), flush=True)
    return
  # Both frameworks in one process, timed in alternating rounds (the order flipping each
  # round), so that a shared machine's drifting load hits both alike; the speedup is the
  # median over rounds of the per-round ratio.
  run_torch, result_torch = setup_torch(args, bert_config, config.train)
  run_torch(args.warmup)
  per_round = max(1, args.steps // args.rounds)
  totals = dict(jax=[0.0, 0.0], torch=[0.0, 0.0])
  ratios = []
  for r in range(args.rounds):
    order = [('jax', run_jax), ('torch', run_torch)]
    times = {}
    for name, run in (order if r % 2 == 0 else order[::-1]):
      elapsed, wait = timed(run, per_round)
      times[name] = elapsed
      totals[name][0] += elapsed
      totals[name][1] += wait
    ratios.append(times['torch'] / times['jax'])
  steps = per_round * args.rounds
  print(json.dumps(result_jax(steps, *totals['jax'])), flush=True)
  print(json.dumps(result_torch(steps, *totals['torch'])), flush=True)
  print(json.dumps(dict(speedup_vs_torch=float(np.median(ratios)),
                        speedup_per_round=[round(x, 3) for x in ratios],
                        speedup_overall=totals['torch'][0] / totals['jax'][0],
                        rounds=args.rounds, steps_per_round=per_round)), flush=True)

if __name__ == '__main__':
  main()
