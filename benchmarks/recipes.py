"""Quality for the same compute: the paper's pre-training recipe against the modern one
(configs/modern.py), both at one size, on one corpus, for the same training FLOPs; then each
model's held-out MLM accuracy and its fine-tuning score on a task built from held-out text.
Prints one JSON object (per seed and recipe, and the mean and spread per recipe).

  nice python benchmarks/recipes.py --paper_steps=600 --seeds=0,1
  nice python benchmarks/recipes.py --paper_steps=200 --seeds=0,1 --finetune_epochs=2 \
      --finetune_lr=1e-4

The corpus is the built-in sample corpus (the running Python's documentation), split by
document: every 10th document is held out. Both recipes train on the rest with one WordPiece
vocabulary (trained on it first), rows of --seq_len tokens and a batch of --batch_size rows:

  paper   the paper's architecture (learned positions, post-LN, GELU MLP, biases), NSP, 15%
          masking, dropout 0.1, rows of one sequence pair each (padded)
  modern  configs/modern.py at this size: rotary, GeGLU (8/3 x hidden: the paper's MLP
          parameters), pre-LN, no biases, local attention (window --seq_len / 2) in two layers
          of three, no token types, MLM only, 30% masking, packed rows, no dropout

The paper recipe runs --paper_steps steps; the modern one as many as fit in the same training
FLOPs (flops.train_flops_per_sequence, per row: a packed row and a padded one cost the same;
30% masking costs more in the MLM decoder, local layers less in attention). Each keeps its own
schedule shape (warmup 10%, linear decay) and peak learning rate (--paper_lr, --modern_lr).

Evaluation is the same for both: `bert-jax eval` (train.evaluate_checkpoint) of the last
checkpoint on the held-out documents, 15% masking, rows of one sequence, MLM only
(mlm_accuracy). Fine-tuning: a task in SST-2's layout (`finetune_glue.py:sst2`) made from the
held-out documents' sentences: label 1 the sentence as written, label 0 the same sentence with
two of its words swapped (--task=word_order, a word-order judgment, CoLA-like) or one of its
words replaced by a word of another held-out sentence (--task=replaced_word, ELECTRA's
replaced-token detection at the sentence level); train on 80% of the sentences,
accuracy on the other 20%, the paper's GLUE recipe (batch 32, AdamW 10% warmup) for
--finetune_epochs at --finetune_lr, one seed per pre-training seed.
"""

import argparse
import json
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np

from bert_jax import config_files
from bert_jax import flops as flops_lib
from bert_jax import model as model_lib
from bert_jax import pretraining
from bert_jax import sample_corpus

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPES = ('paper', 'modern')


def split_corpus(out_dir: str, hold_out_every: int = 10) -> tuple[str, str]:
  """The sample corpus as (train.txt, heldout.txt): every `hold_out_every`-th document held out."""
  with open(sample_corpus.sample_corpus_path(), encoding='utf-8') as f:
    docs = [d for d in f.read().split('\n\n') if d.strip()]
  paths = (os.path.join(out_dir, 'train.txt'), os.path.join(out_dir, 'heldout.txt'))
  for path, keep in zip(paths, (lambda i: i % hold_out_every, lambda i: not i % hold_out_every)):
    with open(path, 'w', encoding='utf-8') as f:
      f.write('\n\n'.join(d.strip('\n') for i, d in enumerate(docs) if keep(i)) + '\n')
  return paths


TASKS = ('word_order', 'replaced_word')


def sentence_task(heldout: str, out_dir: str, max_examples: int, task: str = 'word_order',
                  seed: int = 0) -> str:
  """SST-2-layout train.tsv / dev.tsv under out_dir/SST-2 (see the module docstring): label 1
  a held-out sentence as written, 0 the sentence with two of its words swapped (word_order)
  or one word replaced by a word of another held-out sentence (replaced_word)."""
  rng = random.Random(seed)
  with open(heldout, encoding='utf-8') as f:
    sentences = [s.strip() for s in f if 6 <= len(s.split()) <= 30 and '\t' not in s]
  rng.shuffle(sentences)
  words_elsewhere = [w for s in sentences[max_examples:] for w in s.split()] or ['the']
  rows = []
  for s in sentences[:max_examples]:
    words = s.split()
    if rng.random() < 0.5:
      i, j = rng.sample(range(len(words)), 2)
      if task == 'word_order':
        words[i], words[j] = words[j], words[i]
      else:
        words[i] = rng.choice(words_elsewhere)
      if ' '.join(words) == s:
        continue
      rows.append((' '.join(words), 0))
    else:
      rows.append((s, 1))
  cut = int(0.8 * len(rows))
  folder = os.path.join(out_dir, 'SST-2')
  os.makedirs(folder, exist_ok=True)
  for name, part in (('train.tsv', rows[:cut]), ('dev.tsv', rows[cut:])):
    with open(os.path.join(folder, name), 'w', encoding='utf-8') as f:
      f.write('sentence\tlabel\n')
      f.writelines(f'{s}\t{label}\n' for s, label in part)
  return out_dir


def pretrain_config(recipe: str, args, data: dict, steps: int, seed: int):
  """The recipe's pre-training config at the benchmark's size, data and budget."""
  seq, batch = args.seq_len, args.batch_size
  common = {
      'model.size': args.size, 'data.input': data['train'], 'data.eval_input': data['heldout'],
      'data.vocab_file': data['vocab'], 'data.max_seq_length': seq, 'data.shuffle_buffer': 1000,
      'train.phases': '', 'train.steps': steps, 'train.batch_size': batch,
      'train.warmup_steps': max(1, steps // 10), 'train.seed': seed, 'data.seed': seed,
      'checkpoint.every_steps': steps, 'eval.every_steps': steps, 'eval.steps': args.eval_steps,
      'eval.batch_size': batch, 'log.every_steps': max(1, steps // 10), 'log.progress': False,
      # One cache for every run: later seeds load the steps the first one compiled.
      'checkpoint.compilation_cache_dir': data['cache'],
  }
  if recipe == 'paper':
    return config_files.load_config('smoke', {
        **common, 'train.learning_rate': args.paper_lr,
        'data.max_predictions_per_seq': max(1, round(0.15 * seq))})
  hidden = model_lib.SIZES[args.size][1]
  return config_files.load_config(os.path.join(_ROOT, 'configs', 'modern.py'), {
      **common, 'train.learning_rate': args.modern_lr,
      'model.max_position_embeddings': seq, 'model.local_attention_window': seq // 2,
      'model.intermediate_size': int(-(-8 * hidden // 3) // 8 * 8),
      'data.max_predictions_per_seq': max(1, round(0.3 * seq)),
      'data.packing_max_sequences': 16, 'train.beta2': 0.98, 'train.weight_decay': 1e-5})


def step_flops(config) -> float:
  """Training FLOPs of one step (forward and backward) per flops.py, every row full length."""
  bert = model_lib.config_from(config.model, vocab_size=config.model.vocab_size or 8000)
  phase = pretraining.parse_phases(config)[0]
  preds = phase.max_predictions
  if config.data.packing:
    from bert_jax import packing  # pylint: disable=g-import-not-at-top  (TensorFlow)
    preds = packing.predictions_per_row(preds, int(config.data.packing_max_sequences),
                                        phase.seq_len)
  return flops_lib.train_flops_per_sequence(bert, phase.seq_len, preds) * config.train.batch_size


def eval_config(args, data: dict):
  """One held-out evaluation for both recipes: 15% masking, one sequence a row, MLM only."""
  return config_files.load_config('smoke', {
      'data.input': data['train'], 'data.eval_input': data['heldout'],
      'data.vocab_file': data['vocab'], 'data.max_seq_length': args.seq_len,
      'data.max_predictions_per_seq': max(1, round(0.15 * args.seq_len)),
      'data.objective': 'none', 'train.phases': '', 'eval.steps': args.eval_steps,
      'eval.batch_size': args.batch_size, 'model.hidden_dropout_prob': 0.0,
      'model.attention_probs_dropout_prob': 0.0})


def finetune_config(args, data: dict, checkpoint: str, seed: int):
  return config_files.load_config('finetune_glue:sst2', {
      'task.data_dir': data['task'], 'train.init_checkpoint': checkpoint,
      'data.vocab_file': data['vocab'], 'data.lower_case': True,
      'data.max_seq_length': args.seq_len, 'data.buckets': (args.seq_len,),
      'train.epochs': args.finetune_epochs, 'train.learning_rate': args.finetune_lr,
      'train.seed': seed, 'checkpoint.every_steps': 0, 'log.progress': False,
      'checkpoint.compilation_cache_dir': data['cache']})


def run(args) -> dict:
  # Lazy: the drivers bring in TensorFlow and the training stack.
  from bert_jax import finetune  # pylint: disable=g-import-not-at-top
  from bert_jax import train  # pylint: disable=g-import-not-at-top
  from bert_jax import vocab as vocab_lib  # pylint: disable=g-import-not-at-top
  os.makedirs(args.workdir, exist_ok=True)
  train_txt, heldout_txt = split_corpus(args.workdir)
  vocab = os.path.join(args.workdir, 'vocab.txt')
  if not os.path.exists(vocab):
    vocab_lib.train_wordpiece(vocab_lib.read_files([train_txt]), vocab, args.vocab_size)
  data = dict(train=train_txt, heldout=heldout_txt, vocab=vocab,
              cache=os.path.join(args.workdir, 'compilation_cache'),
              task=sentence_task(heldout_txt, os.path.join(args.workdir, f'task_{args.task}'),
                                 args.task_examples, args.task))
  flops = {r: step_flops(pretrain_config(r, args, data, 100, 0)) for r in RECIPES}
  budget = flops['paper'] * args.paper_steps
  steps = {'paper': args.paper_steps, 'modern': int(budget // flops['modern'])}
  runs = []
  for seed in args.seeds:
    for recipe in RECIPES:
      workdir = os.path.join(args.workdir, f'{recipe}_seed{seed}')
      start = time.time()
      summary = train.train_and_evaluate(
          pretrain_config(recipe, args, data, steps[recipe], seed), workdir)
      pretrain_seconds = time.time() - start
      held_out = train.evaluate_checkpoint(eval_config(args, data), workdir)
      start = time.time()
      tuned = finetune.finetune(finetune_config(args, data, workdir, seed),
                                os.path.join(args.workdir, f'{recipe}_seed{seed}_{args.task}'))
      runs.append(dict(
          recipe=recipe, seed=seed, steps=steps[recipe], task=args.task,
          train_flops=steps[recipe] * flops[recipe], pretrain_seconds=pretrain_seconds,
          finetune_seconds=time.time() - start,
          own_eval=summary,
          heldout_mlm_accuracy=held_out['mlm_accuracy'],
          heldout_mlm_loss=held_out['mlm_loss'],
          finetune_accuracy=tuned['dev']['accuracy']))
      print(json.dumps(runs[-1]), file=sys.stderr, flush=True)
  table = {}
  for recipe in RECIPES:
    mine = [r for r in runs if r['recipe'] == recipe]
    table[recipe] = {k: dict(mean=float(np.mean([r[k] for r in mine])),
                             std=float(np.std([r[k] for r in mine])))
                     for k in ('heldout_mlm_accuracy', 'finetune_accuracy')}
    table[recipe].update(steps=steps[recipe], train_flops=steps[recipe] * flops[recipe])
  return dict(size=args.size, seq_len=args.seq_len, batch_size=args.batch_size, task=args.task,
              finetune_epochs=args.finetune_epochs, finetune_lr=args.finetune_lr,
              paper_steps=args.paper_steps, seeds=args.seeds, step_flops=flops,
              budget_flops=budget, table=table, runs=runs)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
  parser.add_argument('--size', default='tiny')
  parser.add_argument('--seq_len', type=int, default=64)
  parser.add_argument('--batch_size', type=int, default=16)
  parser.add_argument('--paper_steps', type=int, default=600)
  parser.add_argument('--paper_lr', type=float, default=1e-3)
  parser.add_argument('--modern_lr', type=float, default=2e-3)
  parser.add_argument('--seeds', type=lambda s: [int(x) for x in s.split(',')], default=[0, 1])
  parser.add_argument('--vocab_size', type=int, default=8000)
  parser.add_argument('--eval_steps', type=int, default=20)
  parser.add_argument('--task_examples', type=int, default=2000)
  parser.add_argument('--task', choices=TASKS, default='word_order')
  parser.add_argument('--finetune_epochs', type=int, default=3)
  parser.add_argument('--finetune_lr', type=float, default=2e-4)
  parser.add_argument('--workdir', default='/tmp/bert_jax_recipes')
  args = parser.parse_args(argv)
  print(json.dumps(run(args)))


if __name__ == '__main__':
  main()
