"""BERT pre-training steps on one NVIDIA GPU: bert_jax vs transformers, one JSON file.

  python benchmarks/gpu.py --output=/tmp/gpu_bench      # the whole matrix, < 9 min on an H100

The matrix: BERT-base and BERT-large, 128 and 512 tokens, bf16, padded and packed rows, `xla`
and `cudnn` attention (bert_jax), and transformers' PyTorch `BertForPreTraining` (bf16
autocast, SDPA attention, fused AdamW) on the same padded batches. Every case reports
sequences/s, real (non-padding) tokens/s, MFU, step time, memory, the top ops of one
profiled step and all its kernels' time by group (matmul, attention, LayerNorm, GELU, dropout,
optimizer, embeddings and MLM/NSP heads, other); the attention kernels are also checked
against each other on packed rows.

Kernel groups: XLA names a kernel after the fusion it runs, so each bert_jax kernel is looked
up in the optimized HLO of the compiled step (`hlo_kernels.kernel_info`: the operations the
fusion computes and their name scopes, `.../attention_layer_norm/...`, `.../optimizer/...`);
kernels the program does not name (cuBLAS's `nvjet_*`, cuDNN's) and PyTorch's are grouped by
their names. On jax 0.11+ the GPU trace runs as CUDA-graph command buffers and names no XLA op
(`ops_from` says where the op table came from): the op table is then XLA's kernels by fusion,
each with its group and name scope from the program, library kernels summed by group.
`program` holds the compiled step's own kernel count and non-matmul bytes
(`hlo_kernels.step_budget`, as `bert-jax compile --topology=h100` reports them).

Runs on a stock GPU image without TensorFlow, ml_collections' flag parsing or clu: batches are
synthetic (numpy), and nothing on this path imports TensorFlow. Besides jax (CUDA), flax,
optax, orbax-checkpoint, numpy, torch and transformers it needs the pure-Python ml_collections
(and absl-py, PyYAML), which can be carried as wheels.

How the numbers are made:
- Rows: padded rows hold one sequence each; packed rows several (first-fit decreasing, at most
  16 sequences and max_predictions + 8 masked-LM slots per row, as `data.packing` packs).
  Sequence lengths are drawn so that padded rows are --padded_fill real tokens on average
  (default: the sample corpus's, 65% at 128 tokens and 23% at 512; README "Packing"). Packed,
  first-fit decreasing fills 88% of a row of 128 tokens with those lengths and 99.9% of 512;
  the rows are then brought to --packed_fill (default: the real pipeline's on the sample
  corpus, 99.7% and 96.2%) by a sequence filling a row's gap or the shortest one taken out.
  Real tokens/s counts the non-padding tokens of the batches actually fed. Step times do not
  depend on the data (the shapes are fixed), so `at_first_fit_fill` gives the same step's
  real tokens/s and MFU over the rows before that adjustment.
- LayerNorm: --layernorm=xla,pallas runs every bert_jax case with each `model.layer_norm_impl`
  (and the same `model.gelu_impl`: the fused Pallas kernels or XLA's)
  (README "LayerNorm and dropout"), before and after the fused kernel in one run.
- QKV: --qkv_projection=stacked,separate runs every bert_jax case with each
  `model.qkv_projection`: one QKV matmul whose output the attention slices, or three whose
  outputs it reads in place.
- FP8: --matmul_precision=default,fp8 runs every bert_jax case with each
  `model.matmul_precision` (README "FP8"): the encoder's matmuls in bf16, then in FP8 with
  delayed scaling (Hopper and later). `program.fp8_matmuls` counts the FP8 GEMMs compiled.
  --loss_steps=N then also trains each case N steps from the same initial state on the same
  cycle of --loss_batches synthetic batches and records every step's loss (`losses`), so that
  bf16's and FP8's curves compare in one file; --loss_seeds=2 also trains each bf16 case from
  another seed, and `loss_comparison` says whether FP8's mean loss over each third of the
  steps stays within bf16's seed-to-seed difference (+ LOSS_TOLERANCE). The curves count
  against --time_budget_s too: one it stops is dropped and `losses_skipped` says where.
- Dropout: hidden 0.1 (the paper's); attention dropout 0 for every case, since the fused
  kernels have none (README "Attention"); --attention_dropout_case adds the paper's exact
  recipe (xla, attention dropout 0.1) at base/128 to show what it costs.
- MFU: useful model FLOPs (each real sequence at its own length, the MLM decoder at the
  masked positions only; `flops.py`) per second over the GPU's dense bf16 peak, the same count
  for both frameworks; `hardware_mfu` counts the FLOPs of whole rows as bert_jax computes them.
- Timing: each case is compiled first (all of them, a few at a time), then warmed up and timed
  in --rounds rounds of --steps steps; the step time is the median round's. The batches live on
  the device already: this is the step, not the input pipeline.
- Memory: bert_jax's from XLA's memory analysis of the compiled step (arguments + outputs +
  temporaries - donated), PyTorch's from its allocator's peak.
"""

import argparse
import concurrent.futures
import datetime
import json
import os
import re
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # pylint: disable=g-import-not-at-top

PACK_MAX_SEQUENCES = 16


# ---------------------------------------------------------------------------------------------
# Synthetic batches (numpy only)
# ---------------------------------------------------------------------------------------------


def _lengths(rng, n: int, seq_len: int, fill: float) -> np.ndarray:
  """n sequence lengths in [8, seq_len] with mean about fill * seq_len (a scaled Beta(2, b))."""
  b = 2.0 * (1.0 - fill) / fill
  return np.clip(np.round(seq_len * rng.beta(2.0, b, size=n)), 8, seq_len).astype(np.int32)


def _predictions(length: int, max_predictions: int) -> int:
  return int(min(max_predictions, max(1, round(0.15 * (length - 3)))))


def _fill_sequence(rng, row: dict, r: int, start: int, length: int, slot: int, pred_start: int,
                   max_predictions: int, vocab_size: int) -> int:
  """Writes one [CLS] A [SEP] B [SEP]-shaped sequence into row r; returns its predictions."""
  end = start + length
  row['input_ids'][r, start:end] = rng.randint(5, vocab_size, size=length)
  row['input_mask'][r, start:end] = 1
  row['segment_ids'][r, start + length // 2:end] = 1
  n = _predictions(length, max_predictions)
  pos = np.sort(rng.choice(np.arange(start + 1, end), n, replace=False))
  row['masked_lm_positions'][r, pred_start:pred_start + n] = pos
  row['masked_lm_ids'][r, pred_start:pred_start + n] = row['input_ids'][r, pos]
  row['masked_lm_weights'][r, pred_start:pred_start + n] = 1.0
  if 'sequence_ids' in row:
    row['sequence_ids'][r, start:end] = slot + 1
    row['position_ids'][r, start:end] = np.arange(length)
    row['next_sentence_positions'][r, slot] = start
    row['next_sentence_labels'][r, slot] = rng.randint(2)
    row['next_sentence_weights'][r, slot] = 1.0
  return n


def padded_batch(rows: int, seq_len: int, max_predictions: int, vocab_size: int, fill: float,
                 seed: int = 0) -> dict[str, np.ndarray]:
  """Rows of one sequence each, padded to seq_len: the paper's batches."""
  rng = np.random.RandomState(seed)
  z = lambda shape, dtype=np.int32: np.zeros(shape, dtype)
  b = dict(input_ids=z((rows, seq_len)), input_mask=z((rows, seq_len)),
           segment_ids=z((rows, seq_len)), masked_lm_positions=z((rows, max_predictions)),
           masked_lm_ids=z((rows, max_predictions)),
           masked_lm_weights=z((rows, max_predictions), np.float32),
           next_sentence_labels=rng.randint(0, 2, size=rows).astype(np.int32))
  for r, length in enumerate(_lengths(rng, rows, seq_len, fill)):
    _fill_sequence(rng, b, r, 0, int(length), 0, 0, max_predictions, vocab_size)
  return b


def packed_batch(rows: int, seq_len: int, max_predictions: int, vocab_size: int, fill: float,
                 seed: int = 0, row_fill: float | None = None) -> dict[str, np.ndarray]:
  """Rows of several sequences (first-fit decreasing), the features `packing.py` makes.

  row_fill: the real-token share the rows should have (the real pipeline's), reached by
  topping rows up with a sequence the length of their gap, or by taking their shortest
  sequence out; None keeps what first-fit decreasing packs of these lengths."""
  rng = np.random.RandomState(seed)
  slots = min(seq_len, max_predictions + PACK_MAX_SEQUENCES // 2)
  s = PACK_MAX_SEQUENCES
  # Enough sequences for the rows (each row ~ all but a few tokens full), then a margin: the
  # last rows of a window are part-full, so they are not used.
  lengths = _lengths(rng, int(rows * seq_len / (fill * seq_len) * 1.3) + 8, seq_len, fill)
  lengths = np.sort(lengths)[::-1]
  used = []  # Per open row: [tokens, sequences, predictions, [lengths]].
  for length in lengths:
    p = _predictions(int(length), max_predictions)
    for row in used:
      if row[0] + length <= seq_len and row[1] < s and row[2] + p <= slots:
        row[0] += length; row[1] += 1; row[2] += p; row[3].append(int(length))
        break
    else:
      used.append([int(length), 1, p, [int(length)]])
  if len(used) < rows + 2:
    raise ValueError(f'packed_batch: {len(used)} rows packed, {rows} needed')
  chosen = [used[i] for i in rng.permutation(len(used) - 2)[:rows]]
  if row_fill is not None:
    _match_fill(chosen, seq_len, slots, row_fill, max_predictions)
  z = lambda shape, dtype=np.int32: np.zeros(shape, dtype)
  b = dict(input_ids=z((rows, seq_len)), input_mask=z((rows, seq_len)),
           segment_ids=z((rows, seq_len)), position_ids=z((rows, seq_len)),
           sequence_ids=z((rows, seq_len)), masked_lm_positions=z((rows, slots)),
           masked_lm_ids=z((rows, slots)), masked_lm_weights=z((rows, slots), np.float32),
           next_sentence_positions=z((rows, s)), next_sentence_labels=z((rows, s)),
           next_sentence_weights=z((rows, s), np.float32))
  for r, (_, _, _, seq_lengths) in enumerate(chosen):
    start = pred = 0
    for slot, length in enumerate(seq_lengths):
      pred += _fill_sequence(rng, b, r, start, length, slot, pred, max_predictions, vocab_size)
      start += length
  return b


def _match_fill(chosen: list, seq_len: int, slots: int, row_fill: float,
                max_predictions: int):
  """Brings packed rows ([tokens, sequences, predictions, [lengths]]) to row_fill real tokens
  on average: gaps of 5 tokens or more filled by one more sequence while the rows have fewer
  tokens than that (a sequence of 5 tokens is [CLS] a [SEP] b [SEP]), shortest sequences taken
  out while they have more."""
  target = round(row_fill * len(chosen) * seq_len)
  total = sum(row[0] for row in chosen)
  for row in chosen:
    gap = min(seq_len - row[0], target - total)
    p = _predictions(gap, max_predictions)
    if gap >= 5 and row[1] < PACK_MAX_SEQUENCES and row[2] + p <= slots:
      row[0] += gap; row[1] += 1; row[2] += p; row[3].append(gap)
      total += gap
  for row in chosen:
    if total <= target:
      break
    if row[1] > 1 and total - min(row[3]) >= target:
      length = min(row[3])
      row[3].remove(length)
      row[0] -= length; row[1] -= 1; row[2] -= _predictions(length, max_predictions)
      total -= length


def sequence_lengths(batch: dict[str, np.ndarray]) -> list[int]:
  """Lengths of every real sequence in a padded or packed batch."""
  if 'sequence_ids' not in batch:
    return [int(n) for n in batch['input_mask'].sum(1)]
  ids = batch['sequence_ids']
  return [int(n) for r in range(ids.shape[0]) for n in np.bincount(ids[r])[1:] if n]


def useful_flops(bert_config, batch: dict[str, np.ndarray]) -> float:
  """Train FLOPs of the real sequences, each at its own length (`flops.py`)."""
  from bert_jax import flops as flops_lib  # pylint: disable=g-import-not-at-top
  total = 0.0
  weights = batch['masked_lm_weights']
  predictions = float(weights.sum())
  lengths = sequence_lengths(batch)
  for length in lengths:
    total += flops_lib.train_flops_per_sequence(bert_config, length, 0)
  # The MLM transform and decoder at each real prediction (the per-sequence count above had 0).
  per_prediction = (flops_lib.train_flops_per_sequence(bert_config, 1, 1) -
                    flops_lib.train_flops_per_sequence(bert_config, 1, 0))
  return total + predictions * per_prediction


# ---------------------------------------------------------------------------------------------
# Profile summary
# ---------------------------------------------------------------------------------------------


# Kernel groups by name alone, matched in this order (the first match wins, so each kernel
# counts once): the fallback for kernels that the compiled program does not name (cuBLAS, cuDNN,
# PyTorch's). Attention first: cuDNN's fused attention kernels (`cudnn_generated_fort_native_
# sdpa_sm90_flash_fprop_wgmma_...`) carry matmul-like words. Matmuls by the kernel's own name only
# (cuBLAS, its Hopper `nvjet_*` kernels, cutlass, XLA's Triton GEMM fusions): an op's metadata
# names the layer it belongs to, which would call every dense projection "attention". The other
# groups also read what the kernel computes (its XLA op's name scope and source line; PyTorch's
# names).
KERNEL_GROUPS = (
    ('attention', r'fmha|flash|sdpa|attention|attn', False),
    ('matmul', r'gemm|gemv|nvjet|cutlass|cublas|xmma|matmul', False),
    ('layernorm', r'layer_?norm|gammabeta|normalization\.py', True),
    ('gelu', r'gelu|(?<![a-z])erfc?(?![a-z])', True),
    ('dropout', r'dropout|random_bits|rng_bit_generator|threefry|philox|bernoulli|'
                r'stochastic\.py', True),
    ('optimizer', r'optax|adam|clip_grad|multi_tensor|optimizer|(?<![a-z])optim\.py', True),
)
# The groups of hlo_kernels.GROUPS (the same names), in the order the report lists them.
GROUP_NAMES = ('matmul', 'attention', 'layernorm', 'gelu', 'dropout', 'optimizer',
               'embedding_mlm', 'other')


def classify_kernel(name: str, context: str = '') -> str:
  """The group of a GPU kernel from its name and (for all but attention and matmul) what its
  XLA op says it computes: one of GROUP_NAMES (never embedding_mlm, which needs the program)."""
  name, context = name.lower(), context.lower()
  for group, pattern, with_context in KERNEL_GROUPS:
    if re.search(pattern, name + ' ' + context if with_context else name):
      return group
  return 'other'


def group_kernels(kernels: dict[str, tuple[float, int]],
                  contexts: dict[str, str] | None = None,
                  program: dict[str, tuple[str, str]] | None = None) -> dict:
  """Time (ms), share and count of every kernel group, over all kernels (not a top list).

  program: kernel name -> (group, op_name) from the compiled step's optimized HLO
  (`hlo_kernels.kernel_info`), which says what XLA's fusions compute; kernels it does not name
  (cuBLAS, cuDNN) are grouped by `classify_kernel`."""
  contexts, program = contexts or {}, program or {}
  groups = {g: [0.0, 0] for g in GROUP_NAMES}
  for name, (t, n) in kernels.items():
    g = program[name][0] if name in program else classify_kernel(name, contexts.get(name, ''))
    groups[g][0] += t
    groups[g][1] += n
  total = sum(t for t, _ in kernels.values()) or 1.0
  return {g: dict(ms=t / 1e6, share=t / total, count=n) for g, (t, n) in groups.items()}


def ops_from_kernels(kernels: dict[str, tuple[float, int]],
                     program: dict[str, tuple[str, str]]) -> tuple[dict, dict]:
  """The op table of a trace that names no XLA op (jax 0.11+ runs the step as CUDA-graph
  command buffers): XLA's kernels are named after their fusion, an HLO op, so each is a row with
  its group and name scope from the program; library kernels (cuBLAS, cuDNN), which name no op
  there, are summed by group. Returns (op -> (ns, count), op -> detail)."""
  ops, detail = {}, {}
  for k, (t, n) in kernels.items():
    op = k if k in program else f'(library) {classify_kernel(k)}'
    t0, n0 = ops.get(op, (0.0, 0))
    ops[op] = (t0 + t, n0 + n)
    if k in program:
      detail[op] = dict(group=program[k][0], op_name=program[k][1][:240])
  return ops, detail


# What an XLA op computes: its HLO text, category, name scope and source line.
_OP_STATS = ('long_name', 'hlo_category', 'tf_op', 'source', 'source_info')


def summarize_trace(trace_dir: str, top: int = 12,
                    program: dict[str, tuple[str, str]] | None = None) -> dict:
  """Top device ops and kernels by total time in a jax.profiler trace, and every kernel's time
  by group; program: the compiled step's kernels (`hlo_kernels.kernel_info`), which name what
  XLA's kernels compute when the trace does not."""
  import glob  # pylint: disable=g-import-not-at-top
  from jax._src.profiler import ProfileData  # pylint: disable=g-import-not-at-top
  files = sorted(glob.glob(os.path.join(trace_dir, '**', '*.xplane.pb'), recursive=True))
  if not files:
    return dict(error=f'no trace written under {trace_dir}')
  data = ProfileData.from_file(files[-1])
  ops, kernels, detail = {}, {}, {}
  kernel_ops = {}   # Kernel name -> the HLO op that launched it (the `hlo_op` stat).
  by_hlo_op = {}    # HLO op -> (time, count) of its kernels.
  device_planes = [p for p in data.planes if p.name.startswith('/device:GPU')]
  for plane in device_planes:
    for line in plane.lines:
      into = ops if line.name == 'XLA Ops' else kernels if line.name.startswith('Stream') \
          else None
      if into is None:
        continue
      for e in line.events:
        t, n = into.get(e.name, (0.0, 0))
        into[e.name] = (t + e.duration_ns, n + 1)
        stats = {k: str(v) for k, v in e.stats}
        if into is ops and e.name not in detail:
          # What the op is (its HLO text, category): op names alone say little.
          detail[e.name] = {k: v[:240] for k, v in stats.items() if k in _OP_STATS}
        elif into is kernels:
          op = stats.get('hlo_op')
          if op:
            kernel_ops.setdefault(e.name, op)
            t, n = by_hlo_op.get(op, (0.0, 0))
            by_hlo_op[op] = (t + e.duration_ns, n + 1)
          if e.name not in detail:
            detail[e.name] = {k: v[:240] for k, v in stats.items() if k in _OP_STATS}
  program = program or {}
  ops_from = 'trace'
  if not ops and by_hlo_op:
    # Newer jax (0.11+) traces may carry no "XLA Ops" line on the GPU plane; the kernels still
    # name their HLO op, so the op table is their sum per op.
    ops, ops_from = by_hlo_op, 'kernels_hlo_op'
  if program and kernels and all(k.startswith('command_buffer') for k in ops):
    # The op line holds only the command buffers (jax 0.11+).
    ops, op_detail = ops_from_kernels(kernels, program)
    detail.update(op_detail)
    ops_from = 'kernels_named_in_program'
  if not device_planes:  # CPU (tests): the XLA threads' events.
    for plane in data.planes:
      for line in plane.lines:
        if 'XLA' not in line.name or 'Compiler' in line.name:
          continue
        for e in line.events:
          if 'ThreadpoolListener' in e.name:
            continue
          t, n = ops.get(e.name, (0.0, 0))
          ops[e.name] = (t + e.duration_ns, n + 1)

  def table(d):
    total = sum(t for t, _ in d.values()) or 1.0
    rows = sorted(d.items(), key=lambda kv: -kv[1][0])[:top]
    return dict(total_ms=total / 1e6, total_count=sum(n for _, n in d.values()),
                top=[dict(name=k[:160], ms=t / 1e6, share=t / total, count=n,
                          **detail.get(k, {})) for k, (t, n) in rows])
  out = dict(ops=table(ops), ops_from=ops_from)
  if kernels:
    out['kernels'] = table(kernels)
    contexts = {}
    for k in kernels:
      info = dict(detail.get(kernel_ops.get(k, ''), {}), **detail.get(k, {}))
      contexts[k] = ' '.join([kernel_ops.get(k, '')] + list(info.values()))
    out['kernel_groups'] = group_kernels(kernels, contexts, program)
    # How many kernels the compiled program grouped; the rest went by their names.
    out['kernels_grouped_by_program'] = sum(n for k, (_, n) in kernels.items() if k in program)
  return out


# ---------------------------------------------------------------------------------------------
# bert_jax
# ---------------------------------------------------------------------------------------------


def _bert_jax_config(args, size: str, seq_len: int, rows: int, preds: int, packing: bool,
                     impl: str, attention_dropout: float, scan_layers: bool,
                     layer_norm_impl: str = 'auto', matmul_precision: str = 'default',
                     qkv_projection: str = 'stacked'):
  from bert_jax import defaults  # pylint: disable=g-import-not-at-top
  config = defaults.pretrain()
  config.model.size = size
  config.model.vocab_size = args.vocab_size
  config.model.dtype = args.dtype
  config.model.remat_policy = args.remat
  config.model.scan_layers = scan_layers
  config.model.attention_impl = impl
  config.model.attention_probs_dropout_prob = attention_dropout
  config.model.layer_norm_impl = layer_norm_impl
  # The fused Pallas kernels go together: the GELU follows the LayerNorm's choice.
  config.model.gelu_impl = layer_norm_impl
  config.model.matmul_precision = matmul_precision
  config.model.qkv_projection = qkv_projection
  config.data.max_seq_length = seq_len
  config.data.max_predictions_per_seq = preds
  config.data.packing = packing
  config.train.batch_size = rows
  config.train.phases = ''
  config.train.warmup_steps = 0
  config.train.steps = 1000
  config.train.decay = 'constant'
  return config


class JaxCase:
  """One bert_jax case: its config, batches, and (after `lower`/`compile`) its step."""

  def __init__(self, args, spec: dict):
    self.args, self.spec = args, dict(spec)
    self.result = dict(framework='bert_jax', **spec, case=self.name())

  def build(self, rows: int):
    import jax  # pylint: disable=g-import-not-at-top
    from bert_jax import pretraining  # pylint: disable=g-import-not-at-top
    from bert_jax import sharding as sharding_lib  # pylint: disable=g-import-not-at-top
    s, a = self.spec, self.args
    self.rows = rows
    self.config = _bert_jax_config(a, s['size'], s['seq_len'], rows, s['max_predictions'],
                                   s['packing'], s['attention_impl'], s['attention_dropout'],
                                   s['scan_layers'], s.get('layer_norm_impl', 'auto'),
                                   s.get('matmul_precision', 'default'),
                                   s.get('qkv_projection', 'stacked'))
    if 'seed' in s:  # `losses`' other seeds (the dropout masks); the rest keep the default's.
      self.config.train.seed = s['seed']
    pretraining.check_attention(self.config, jax.default_backend())
    self.mesh = sharding_lib.make_mesh(self.config.mesh)
    self.rules = sharding_lib.rules_from_config(self.config.mesh)
    built = pretraining.build_step(self.config, self.mesh, a.vocab_size)  # The driver's step.
    self.bert_config, self.step = built.bert_config, built.train_step
    self.abstract, self.shardings, self.init = built.abstract, built.shardings, built.init
    if s['packing']:
      make = lambda seed, row_fill=s.get('row_fill'): packed_batch(
          rows, s['seq_len'], s['max_predictions'], a.vocab_size, s['fill'], seed, row_fill)
      # The rows first-fit decreasing packs of the same lengths, for the MFU at their fill.
      self.first_fit_batches = ([make(i, None) for i in range(2)]
                                if s.get('row_fill') is not None else None)
    else:
      make = lambda seed: padded_batch(rows, s['seq_len'], s['max_predictions'], a.vocab_size,
                                       s['fill'], seed)
      self.first_fit_batches = None
    self.make_batch = make
    self.host_batches = [make(i) for i in range(2)]
    bsh = sharding_lib.batch_sharding(self.mesh)
    spec = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=bsh)
            for k, v in self.host_batches[0].items()}
    with sharding_lib.activate(self.mesh, self.rules):
      self.lowered = self.step.jitted.lower(self.abstract, spec)

  def compile(self):
    t = time.perf_counter()
    self.compiled = self.lowered.compile()
    self.result['compile_seconds'] = time.perf_counter() - t
    mem = self.compiled.memory_analysis()
    self.bytes = (mem.argument_size_in_bytes + mem.output_size_in_bytes +
                  mem.temp_size_in_bytes - mem.alias_size_in_bytes)
    text = self.compiled.as_text()
    if self.name() in self.args.dump_hlo:
      with open(os.path.join(self.args.output, self.name() + '.hlo.txt'), 'w') as f:
        f.write(text)
    # What each kernel computes, for the profile (a trace of jax 0.11+ names none of it); the
    # program's own counts beside it (`bert-jax compile` reports the same for a deviceless one).
    from bert_jax import hlo_kernels  # pylint: disable=g-import-not-at-top
    try:
      self.program = hlo_kernels.kernel_info(text)
      budget = hlo_kernels.step_budget(text)
      self.result['program'] = {k: budget[k] for k in ('kernels', 'kernels_by_group',
                                                      'non_matmul_bytes', 'fp8_matmuls')}
    except Exception as e:  # pylint: disable=broad-except
      # HLO text another XLA prints differently: the kernels go by their names, the case runs.
      self.program, self.result['program'] = {}, dict(error=_error(e))
    self.result['memory'] = dict(
        total_gib=self.bytes / 2**30, temporaries_gib=mem.temp_size_in_bytes / 2**30,
        arguments_gib=mem.argument_size_in_bytes / 2**30)
    return self

  def run(self, state):
    """Times the compiled step from `state`; returns the state it ends with."""
    import jax  # pylint: disable=g-import-not-at-top
    from bert_jax import flops as flops_lib, sharding as sharding_lib
    a = self.args
    bsh = sharding_lib.batch_sharding(self.mesh)
    batches = [sharding_lib.make_global_batch(b, bsh) for b in self.host_batches]
    metrics = None
    for i in range(a.warmup):
      state, metrics = self.compiled(state, batches[i % 2])
    jax.block_until_ready(metrics)
    round_times = []
    for _ in range(a.rounds):
      t = time.perf_counter()
      for i in range(a.steps):
        state, metrics = self.compiled(state, batches[i % 2])
      jax.block_until_ready(metrics)
      round_times.append((time.perf_counter() - t) / a.steps)
    step = float(np.median(round_times))
    if a.profile:
      trace_dir = os.path.join(a.trace_dir or os.path.join(a.output, 'traces'), self.name())
      jax.profiler.start_trace(trace_dir)
      state, metrics = self.compiled(state, batches[0])
      jax.block_until_ready(metrics)
      jax.profiler.stop_trace()
      self.result['profile'] = summarize_trace(trace_dir, program=self.program)
    peak = flops_lib.peak_flops_per_device()
    self.result.update(_rates(self.bert_config, self.host_batches, self.rows, step,
                              round_times, peak))
    if self.first_fit_batches:
      # The same step (its shapes, so its time, do not depend on the data) over rows that
      # first-fit decreasing left at their own fill: the benchmark's figures before --packed_fill.
      other = _rates(self.bert_config, self.first_fit_batches, self.rows, step, round_times,
                     peak)
      self.result['at_first_fit_fill'] = {
          k: other[k] for k in ('real_token_fraction', 'sequences_per_row',
                                'real_tokens_per_second', 'useful_tflops_per_second', 'mfu')}
    self.result.update(rows=self.rows, loss=float(metrics['loss']),
                       device=jax.devices()[0].device_kind)
    return state

  def losses(self, deadline: float):
    """Every step's loss over --loss_steps steps from a fresh state (key 0: the same initial
    parameters for every case of a model size), cycling through --loss_batches batches.
    With --loss_seeds=N a case at the default precision also trains from N - 1 other seeds
    (`train.seed` and the initial key: other weights and dropout masks), one compile each:
    `losses_other_seeds`, the spread that `loss_comparison` holds FP8's curve to. Past
    `deadline` (--time_budget_s) a curve stops: `losses_skipped` says where, and only whole
    curves are kept."""
    try:
      self._check_budget(deadline, 0, 0)
      self.result['losses'] = self._train_losses(0, deadline)
      self.result['loss_batches'] = self.args.loss_batches
      if self.args.loss_seeds > 1 and self.spec.get('matmul_precision', 'default') == 'default':
        others = []
        for seed in range(1, self.args.loss_seeds):
          self._check_budget(deadline, 0, seed)  # Before the seed's compile.
          case = JaxCase(self.args, dict(self.spec, seed=seed))
          case.build(self.rows)
          case.compile()
          others.append(case._train_losses(seed, deadline))  # pylint: disable=protected-access
        self.result['losses_other_seeds'] = others
    except _BudgetSpent as e:
      self.result['losses_skipped'] = str(e)

  def _check_budget(self, deadline: float, step: int, seed: int):
    if time.time() > deadline:
      raise _BudgetSpent(f'time budget (--time_budget_s) spent after {step} of '
                         f'{self.args.loss_steps} steps of seed {seed}')

  def _train_losses(self, seed: int, deadline: float) -> list[float]:
    import jax  # pylint: disable=g-import-not-at-top
    from bert_jax import sharding as sharding_lib  # pylint: disable=g-import-not-at-top
    a = self.args
    bsh = sharding_lib.batch_sharding(self.mesh)
    batches = [sharding_lib.make_global_batch(self.make_batch(100 + i), bsh)
               for i in range(a.loss_batches)]
    with sharding_lib.activate(self.mesh, self.rules):
      state = jax.jit(self.init, out_shardings=self.shardings)(jax.random.key(seed))
    losses = []
    for i in range(a.loss_steps):
      if i and i % LOSS_CHECK_STEPS == 0:
        # The device's progress, not the host's dispatch, which runs ahead of it.
        jax.block_until_ready(losses[-1])
        self._check_budget(deadline, i, seed)
      state, metrics = self.compiled(state, batches[i % len(batches)])
      losses.append(metrics['loss'])  # Read at the end: the host does not wait each step.
    return [float(x) for x in jax.device_get(losses)]

  def name(self) -> str:
    s = self.spec
    return (f"{s['size']}_{s['seq_len']}_{'packed' if s['packing'] else 'padded'}_"
            f"{s['attention_impl']}" + ('_attndrop' if s['attention_dropout'] else '') +
            ('' if s['scan_layers'] else '_unscanned') +
            (f"_ln{s['layer_norm_impl']}" if s.get('layer_norm_impl', 'auto') != 'auto' else '') +
            (f"_{s['matmul_precision']}" if s.get('matmul_precision', 'default') != 'default'
             else '') +
            (f"_qkv{s['qkv_projection']}" if s.get('qkv_projection', 'stacked') != 'stacked'
             else '') + (f"_seed{s['seed']}" if s.get('seed') else ''))


# How often (in steps) a loss curve waits for the device and checks --time_budget_s: a wait
# every step would hold the host's dispatch to the device's pace.
LOSS_CHECK_STEPS = 50


class _BudgetSpent(Exception):
  """--time_budget_s ran out during a loss curve."""


def _rates(bert_config, host_batches, rows, step, round_times, peak) -> dict:
  from bert_jax import flops as flops_lib  # pylint: disable=g-import-not-at-top
  b = host_batches[0]
  seq_len = b['input_ids'].shape[1]
  real = float(np.mean([hb['input_mask'].sum() for hb in host_batches]))
  sequences = float(np.mean([len(sequence_lengths(hb)) for hb in host_batches]))
  useful = float(np.mean([useful_flops(bert_config, hb) for hb in host_batches]))
  hardware = rows * flops_lib.train_flops_per_sequence(bert_config, seq_len,
                                                       b['masked_lm_positions'].shape[1])
  return dict(step_seconds=step, step_seconds_rounds=round_times,
              rows_per_second=rows / step, sequences_per_second=sequences / step,
              real_tokens_per_second=real / step, real_token_fraction=real / (rows * seq_len),
              sequences_per_row=sequences / rows,
              useful_tflops_per_second=useful / step / 1e12,
              mfu=useful / step / peak if peak else None,
              hardware_mfu=hardware / step / peak if peak else None)


def run_bert_jax(args, specs: list[dict], deadline: float, log, save) -> list[dict]:
  import jax  # pylint: disable=g-import-not-at-top
  from bert_jax import sharding as sharding_lib  # pylint: disable=g-import-not-at-top
  limit = _device_bytes(jax)
  cases = [JaxCase(args, s) for s in specs]
  results = []
  # Lower in this thread (tracing holds the GIL), compile a few at a time (XLA releases it).
  with concurrent.futures.ThreadPoolExecutor(args.compile_workers) as pool:
    futures = []
    for c in cases:
      try:
        c.build(c.spec['rows'])
        futures.append(pool.submit(c.compile))
      except Exception as e:  # pylint: disable=broad-except
        c.result['error'] = _error(e)
        futures.append(None)
    for c, f in zip(cases, futures):
      if f is None:
        continue
      try:
        f.result(timeout=max(1.0, deadline - time.time()))
      except concurrent.futures.TimeoutError:
        c.result['skipped'] = 'time budget (--time_budget_s) spent while compiling'
        f.cancel()
      except Exception as e:  # pylint: disable=broad-except
        c.result['error'] = _error(e)
  log(f'compiled {len(cases)} bert_jax cases')
  state, state_size = None, None  # One state per model layout, reused by its cases.
  for c in cases:
    if 'error' in c.result or 'skipped' in c.result:
      results.append(c.result)
      continue
    if time.time() > deadline:
      results.append(dict(c.result, skipped='time budget (--time_budget_s) spent'))
      continue
    try:
      # Too big for the GPU: halve the rows until it fits (recompiling), as a user would.
      while limit and c.bytes > 0.95 * limit and c.rows > 8:
        c.result.setdefault('halved_from_rows', c.rows)
        c.build(c.rows // 2)
        c.compile()
      # FP8 cases' states also hold the scales (one per QKV matmul): another layout.
      fp8 = c.spec.get('matmul_precision') == 'fp8'
      layout = (c.spec['size'], c.spec['scan_layers'], fp8,
                c.spec.get('qkv_projection') if fp8 else None)
      if state_size != layout:
        state = None
        with sharding_lib.activate(c.mesh, c.rules):
          state = jax.jit(c.init, out_shardings=c.shardings)(jax.random.key(0))
        state_size = layout
      state = c.run(state)
    except Exception as e:  # pylint: disable=broad-except
      c.result['error'] = _error(e)
      state, state_size = None, None
    if args.loss_steps and 'error' not in c.result:
      # A fresh state of its own: the timed one is let go first (the cases are sized to fill
      # the GPU with one), and a failure here leaves the case's timings as they are.
      state, state_size = None, None
      try:
        c.losses(deadline)
      except Exception as e:  # pylint: disable=broad-except
        c.result['losses_error'] = _error(e)
    results.append(c.result)
    log(_line(c.result))
    save(results)
    c.lowered = c.compiled = None
  return results


# What FP8's mean loss over a third of the curve may differ from bf16's beyond bf16's own
# seed-to-seed difference there (as the smoke run's check against its recording, train_test).
LOSS_TOLERANCE = 0.02


def loss_comparison(results: list[dict]) -> list[dict]:
  """Each FP8 case with `losses` against the same case (name and rows) at the default
  precision: over each third of the steps, the two mean losses and their gap, beside the
  default's own gap between seeds (the largest over `losses_other_seeds`; none without
  --loss_seeds). `within_noise`: every gap at most the seeds' gap + LOSS_TOLERANCE; False
  where FP8's curve is not finite, None where the default's curves cannot say."""
  default = {r['case']: r for r in results
             if r.get('losses') and r.get('matmul_precision', 'default') == 'default'}
  out = []
  for r in results:
    if not r.get('losses') or r.get('matmul_precision') != 'fp8':
      continue
    base = default.get(r['case'].replace('_fp8', '', 1))
    n = len(r['losses'])
    if base is None or len(base['losses']) != n or base.get('rows') != r.get('rows'):
      out.append(dict(case=r['case'], within_noise=None,
                      error='no default-precision case with as many losses of as many rows'))
      continue
    if n < 3:
      out.append(dict(case=r['case'], within_noise=None,
                      error=f'{n} losses: fewer than the 3 that make thirds'))
      continue
    others = base.get('losses_other_seeds') or []
    if not np.all(np.isfinite(r['losses'])):
      out.append(dict(case=r['case'], within_noise=False, error='non-finite FP8 losses'))
      continue
    if not all(np.all(np.isfinite(c)) for c in [base['losses']] + others):
      out.append(dict(case=r['case'], within_noise=None,
                      error='non-finite losses at the default precision'))
      continue
    mean = lambda losses, a, b: float(np.mean(losses[a:b]))
    windows = []
    for a, b in [(i * n // 3, (i + 1) * n // 3) for i in range(3)]:
      w = dict(steps=[a + 1, b], fp8=mean(r['losses'], a, b), default=mean(base['losses'], a, b))
      w['gap'] = abs(w['fp8'] - w['default'])
      w['seed_gap'] = max((abs(mean(o, a, b) - w['default']) for o in others), default=None)
      windows.append(w)
    within = (None if not others else
              all(w['gap'] <= w['seed_gap'] + LOSS_TOLERANCE for w in windows))
    out.append(dict(case=r['case'], windows=windows, within_noise=within,
                    max_step_gap=float(np.max(np.abs(np.subtract(r['losses'],
                                                                 base['losses']))))))
  return out


def _device_bytes(jax) -> int | None:
  stats = jax.devices()[0].memory_stats() or {}
  return stats.get('bytes_limit')


def _error(e: Exception) -> str:
  return f'{type(e).__name__}: ' + (str(e).strip().splitlines() or [''])[0][:400]


# ---------------------------------------------------------------------------------------------
# transformers (PyTorch), in a child process so that neither framework holds the other's memory
# ---------------------------------------------------------------------------------------------


def run_torch_cases(args, specs: list[dict]) -> list[dict]:
  """transformers' BertForPreTraining on the padded batches: bf16 autocast, SDPA, fused AdamW."""
  try:
    import torch  # pylint: disable=g-import-not-at-top
    import transformers  # pylint: disable=g-import-not-at-top
  except ImportError as e:  # Reported per case, as any failed case is: the others still run.
    results = [dict(framework='transformers', **s, error=f'not run: {_error(e)}')
               for s in specs]
    for r in results:
      print(json.dumps(r), flush=True)
    return results
  from bert_jax import model as model_lib  # pylint: disable=g-import-not-at-top
  device = 'cuda' if torch.cuda.is_available() else 'cpu'
  results = []
  for s in specs:
    r = dict(framework='transformers', torch=torch.__version__,
             transformers=transformers.__version__, **s)
    try:
      bert_config = model_lib.config_for_size(s['size'], vocab_size=args.vocab_size,
                                              attention_probs_dropout_prob=0.0)
      hf = transformers.BertConfig(**bert_config.to_original_dict(), attn_implementation='sdpa')
      model = transformers.BertForPreTraining(hf).to(device).train()
      no_decay = lambda n: n.endswith('bias') or 'LayerNorm' in n
      groups = [{'params': [p for n, p in model.named_parameters() if not no_decay(n)],
                 'weight_decay': 0.01},
                {'params': [p for n, p in model.named_parameters() if no_decay(n)],
                 'weight_decay': 0.0}]
      opt = torch.optim.AdamW(groups, lr=1e-4, betas=(0.9, 0.999), eps=1e-6,
                              fused=device == 'cuda')
      host = [padded_batch(s['rows'], s['seq_len'], s['max_predictions'], args.vocab_size,
                           s['fill'], seed=i) for i in range(2)]
      inputs = [_torch_inputs(torch, b, device) for b in host]

      def step(i):
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device, dtype=torch.bfloat16, enabled=args.dtype != 'float32'):
          loss = model(**inputs[i % 2]).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return loss

      sync = torch.cuda.synchronize if device == 'cuda' else (lambda: None)
      for i in range(args.warmup):
        loss = step(i)
      sync()
      if device == 'cuda':
        torch.cuda.reset_peak_memory_stats()
      round_times = []
      for _ in range(args.rounds):
        t = time.perf_counter()
        for i in range(args.steps):
          loss = step(i)
        sync()
        round_times.append((time.perf_counter() - t) / args.steps)
      step_s = float(np.median(round_times))
      if args.profile:
        r['profile'] = _torch_profile(torch, step, device)
      peak = _peak_flops_torch(torch, device)
      r.update(_rates(bert_config, host, s['rows'], step_s, round_times, peak))
      r.update(rows=s['rows'], loss=float(loss), device=torch.cuda.get_device_name()
               if device == 'cuda' else 'cpu')
      if device == 'cuda':
        r['memory'] = dict(total_gib=torch.cuda.max_memory_allocated() / 2**30)
      # Hardware FLOPs of HF's model: the MLM decoder runs at every position, not the masked.
      model = opt = None
      if device == 'cuda':
        torch.cuda.empty_cache()
    except Exception as e:  # pylint: disable=broad-except
      r['error'] = _error(e)
    results.append(r)
    print(json.dumps(r), flush=True)
  return results


def _torch_inputs(torch, b, device):
  labels = np.full(b['input_ids'].shape, -100, np.int64)
  for r in range(labels.shape[0]):
    w = b['masked_lm_weights'][r] > 0
    labels[r, b['masked_lm_positions'][r][w]] = b['masked_lm_ids'][r][w]
  t = lambda x, dtype=torch.long: torch.tensor(x, dtype=dtype, device=device)
  return dict(input_ids=t(b['input_ids']), attention_mask=t(b['input_mask']),
              token_type_ids=t(b['segment_ids']), labels=t(labels),
              next_sentence_label=t(b['next_sentence_labels']))


def _torch_profile(torch, step, device, top: int = 12) -> dict:
  activities = [torch.profiler.ProfilerActivity.CPU]
  if device == 'cuda':
    activities.append(torch.profiler.ProfilerActivity.CUDA)
  with torch.profiler.profile(activities=activities) as prof:
    step(0)
    if device == 'cuda':
      torch.cuda.synchronize()
  key = 'device_time_total' if device == 'cuda' else 'cpu_time_total'
  events = [e for e in prof.key_averages() if getattr(e, key, 0) > 0]
  if device == 'cuda':  # Kernels only: operators' device time double-counts their kernels.
    events = [e for e in events if getattr(e, 'device_type', None) ==
              torch.autograd.DeviceType.CUDA] or events
  total = sum(getattr(e, key) for e in events) or 1.0
  events.sort(key=lambda e: -getattr(e, key))
  out = dict(kernels=dict(total_ms=total / 1e3, total_count=sum(e.count for e in events), top=[
      dict(name=e.key[:160], ms=getattr(e, key) / 1e3, share=getattr(e, key) / total,
           count=e.count) for e in events[:top]]))
  if device == 'cuda':   # Microseconds to the nanoseconds that group_kernels takes.
    out['kernel_groups'] = group_kernels({e.key: (getattr(e, key) * 1e3, e.count)
                                          for e in events})
  return out


def _peak_flops_torch(torch, device) -> float | None:
  from bert_jax import flops as flops_lib  # pylint: disable=g-import-not-at-top
  if device != 'cuda':
    return None
  kind = torch.cuda.get_device_name().lower()
  return next((p for k, p in flops_lib.PEAK_FLOPS if k in kind), None)


# ---------------------------------------------------------------------------------------------
# The attention kernels against each other
# ---------------------------------------------------------------------------------------------


def check_attention(args) -> dict:
  """cudnn vs xla (bf16) on packed rows ('{impl}_{seq_len}') and on padded rows of one sequence
  each ('..._padded'): outputs and q/k/v gradients at real tokens, relative to a float32 xla
  reference, and whether every output (padding too) is finite. A kernel this GPU or JAX
  cannot run is reported as an error of its own."""
  import jax  # pylint: disable=g-import-not-at-top
  impls = ['xla'] + (['cudnn'] if jax.default_backend() == 'gpu' else [])
  out = {}
  for seq_len in args.seq_lens:
    rows = {'': packed_batch(8, seq_len, 20, 100, args.fill[seq_len], seed=7)['sequence_ids'],
            '_padded': padded_batch(8, seq_len, 20, 100, args.fill[seq_len],
                                    seed=7)['input_mask']}
    for layout, ids in rows.items():
      out.update(_check_attention_rows(impls, ids, f'_{seq_len}{layout}'))
  return out


def _check_attention_rows(impls: list[str], ids: np.ndarray, suffix: str) -> dict:
  """check_attention on one batch of [8, T] sequence ids."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from bert_jax import attention  # pylint: disable=g-import-not-at-top
  from bert_jax.errors import UserError  # pylint: disable=g-import-not-at-top
  out = {}
  ids = jnp.asarray(ids)
  real = (ids > 0)[:, :, None, None]
  rng = np.random.RandomState(ids.shape[1])
  q, k, v, g = (jnp.asarray(rng.randn(*ids.shape, 12, 64).astype(np.float32))
                for _ in range(4))

  def f(q, k, v, impl, dtype):
    o = attention.dot_product_attention(q.astype(dtype), k.astype(dtype), v.astype(dtype),
                                        ids, impl=impl)
    return jnp.sum(jnp.where(real, o.astype(jnp.float32) * g, 0.0)), o

  ref_grad, ref_out = jax.grad(f, argnums=(0, 1, 2), has_aux=True)(q, k, v, 'xla',
                                                                   jnp.float32)
  rel = lambda x, y: float(jnp.linalg.norm(jnp.where(real, x - y, 0)) /
                           jnp.linalg.norm(jnp.where(real, y, 0)))
  for impl in impls:
    try:
      grads, o = jax.jit(jax.grad(f, argnums=(0, 1, 2), has_aux=True),
                         static_argnums=(3, 4))(q, k, v, impl, jnp.bfloat16)
    except UserError as e:
      out[impl + suffix] = dict(error=str(e))
      continue
    out[impl + suffix] = dict(
        output_rel_error=rel(o.astype(jnp.float32), ref_out),
        grad_rel_error=max(rel(a.astype(jnp.float32), r) for a, r in zip(grads, ref_grad)),
        finite=bool(jnp.all(jnp.isfinite(o.astype(jnp.float32)))))
  return out


# ---------------------------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------------------------


def _line(r: dict) -> str:
  if 'error' in r or 'skipped' in r:
    return f"{_case(r)}: {r.get('error') or r.get('skipped')}"
  mem = r.get('memory', {}).get('total_gib')
  other = r.get('at_first_fit_fill')
  return (f"{_case(r)}: {r['step_seconds'] * 1e3:7.1f} ms/step  {r['rows']:4d} rows  "
          f"{r['sequences_per_second']:8.0f} seq/s  {r['real_tokens_per_second']:9.0f} real "
          f"tok/s  MFU {(r['mfu'] or 0):.1%} at {r['real_token_fraction']:.1%} fill  "
          + (f"({(other['mfu'] or 0):.1%} at {other['real_token_fraction']:.1%})  "
             if other else '') + (f'{mem:.1f} GiB' if mem else ''))


def _case(r: dict) -> str:
  if 'size' not in r:   # A framework that failed before its cases (e.g. no torch).
    return f"{r['framework']:12s} (all cases)"
  return (f"{r['framework']:12s} {r['size']:5s} {r['seq_len']:4d} "
          f"{'packed' if r['packing'] else 'padded'} {r['attention_impl']:6s}"
          + (' attn-dropout' if r.get('attention_dropout') else '')
          + (' unscanned' if r.get('scan_layers') is False else '')
          + (f" ln-{r['layer_norm_impl']}" if r.get('layer_norm_impl', 'auto') != 'auto'
             else '')
          + (f" {r['matmul_precision']}" if r.get('matmul_precision', 'default') != 'default'
             else '')
          + (f" qkv-{r['qkv_projection']}" if r.get('qkv_projection', 'stacked') != 'stacked'
             else ''))


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0], allow_abbrev=False)
  p.add_argument('--output', required=True, help='folder for gpu_benchmark.json (and traces)')
  p.add_argument('--sizes', default='base,large')
  p.add_argument('--seq_lens', default='128,512')
  p.add_argument('--rows', default='128:256,512:64',
                 help='batch rows per sequence length (halved while a step does not fit)')
  p.add_argument('--predictions', default='128:20,512:80', help='max_predictions_per_seq')
  p.add_argument('--padded_fill', default='128:0.65,512:0.23',
                 help='mean real-token share of a padded row (sample corpus: README Packing)')
  p.add_argument('--packed_fill', default='128:0.997,512:0.962',
                 help="real-token share of a packed row, the real pipeline's on the sample "
                      "corpus (README Packing); '' keeps what first-fit decreasing packs of "
                      'the padded lengths (88%% at 128, 99.9%% at 512)')
  p.add_argument('--attention', default='xla,cudnn',
                 help='model.attention_impl values: xla, cudnn')
  p.add_argument('--packing', default='false,true')
  p.add_argument('--layernorm', default='auto',
                 help="model.layer_norm_impl values, each its own bert_jax case: 'auto', "
                      "'pallas', 'xla' (e.g. xla,pallas: before/after the fused kernel)")
  p.add_argument('--qkv_projection', default='stacked',
                 help="model.qkv_projection values, each its own bert_jax case: 'stacked' "
                      "(one QKV matmul), 'separate' (three), e.g. stacked,separate")
  p.add_argument('--matmul_precision', default='default',
                 help="model.matmul_precision values, each its own bert_jax case: 'default' "
                      "(bf16 here) and 'fp8' (Hopper+), e.g. default,fp8")
  p.add_argument('--loss_steps', type=int, default=0,
                 help='also train each bert_jax case this many steps from the same initial '
                      'state and record every loss (0: none)')
  p.add_argument('--loss_batches', type=int, default=8,
                 help='synthetic batches that --loss_steps cycles through')
  p.add_argument('--loss_seeds', type=int, default=1,
                 help='with --loss_steps, train each default-precision case from this many '
                      'seeds (other weights and dropout): the noise FP8 is held to '
                      '(`loss_comparison`)')
  p.add_argument('--frameworks', default='bert_jax,transformers')
  p.add_argument('--attention_dropout_case', action=argparse.BooleanOptionalAction,
                 default=True)
  p.add_argument('--vocab_size', type=int, default=30522)
  p.add_argument('--dtype', default='bfloat16')
  p.add_argument('--remat', default='none', choices=['none', 'full', 'dots'])
  p.add_argument('--scan_layers', default='false',
                 help='model.scan_layers: true, false or both (true,false)')
  p.add_argument('--dump_hlo', default='',
                 help="write the optimized HLO of these cases (names as in the traces, "
                      "comma separated) to OUTPUT/NAME.hlo.txt")
  p.add_argument('--warmup', type=int, default=3)
  p.add_argument('--steps', type=int, default=10)
  p.add_argument('--rounds', type=int, default=3)
  p.add_argument('--attention_check', action=argparse.BooleanOptionalAction, default=True,
                 help='cudnn against xla on packed and padded rows before the cases')
  p.add_argument('--profile', action=argparse.BooleanOptionalAction, default=True)
  p.add_argument('--trace_dir', default='', help='where profiles go; default OUTPUT/traces')
  p.add_argument('--compile_workers', type=int, default=8)
  p.add_argument('--time_budget_s', type=float, default=500,
                 help='cases not started by then are skipped (and listed as such), and loss '
                 'curves not finished (--loss_steps) stop (`losses_skipped`)')
  p.add_argument('--torch_worker', default='', help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  pairs = lambda s, cast: {int(k): cast(v) for k, v in (x.split(':') for x in s.split(','))}
  args.sizes = [x for x in args.sizes.split(',') if x]
  args.seq_lens = [int(x) for x in args.seq_lens.split(',')]
  args.rows, args.predictions = pairs(args.rows, int), pairs(args.predictions, int)
  args.fill = pairs(args.padded_fill, float)
  args.packed_fill = pairs(args.packed_fill, float) if args.packed_fill else {}
  args.attention = args.attention.split(',')
  if args.loss_seeds < 1:
    p.error(f'--loss_seeds: {args.loss_seeds} is not a count of seeds (1 or more)')
  from bert_jax import config_checks  # pylint: disable=g-import-not-at-top  (no JAX)
  from bert_jax.errors import UserError  # pylint: disable=g-import-not-at-top
  for impl in args.attention:
    try:
      config_checks.check_choice('model.attention_impl', impl)
    except UserError as e:
      p.error(f'--attention: {e}')
  args.packing = [x.lower() == 'true' for x in args.packing.split(',')]
  args.layernorm = args.layernorm.split(',')
  bad = [x for x in args.layernorm if x not in ('auto', 'pallas', 'xla')]
  if bad:
    p.error(f'--layernorm: {bad} not among auto, pallas, xla')
  args.matmul_precision = args.matmul_precision.split(',')
  bad = [x for x in args.matmul_precision if x not in ('default', 'fp8')]
  if bad:
    p.error(f'--matmul_precision: {bad} not among default, fp8')
  args.qkv_projection = args.qkv_projection.split(',')
  bad = [x for x in args.qkv_projection if x not in ('stacked', 'separate')]
  if bad:
    p.error(f'--qkv_projection: {bad} not among stacked, separate')
  args.scan_layers = [x.lower() == 'true' for x in args.scan_layers.split(',')]
  args.dump_hlo = [x for x in args.dump_hlo.split(',') if x]
  args.frameworks = args.frameworks.split(',')
  return args


def case_specs(args) -> tuple[list[dict], list[dict]]:
  jax_specs, torch_specs = [], []
  for size in args.sizes:
    for seq_len in args.seq_lens:
      base = dict(size=size, seq_len=seq_len, rows=args.rows[seq_len],
                  max_predictions=args.predictions[seq_len], fill=args.fill[seq_len],
                  attention_dropout=0.0)
      for scan in args.scan_layers:
        for packing in args.packing:
          for impl in args.attention:
            fill = dict(row_fill=args.packed_fill.get(seq_len)) if packing else {}
            for ln in args.layernorm:
              for precision in args.matmul_precision:
                for qkv in args.qkv_projection:
                  jax_specs.append(dict(base, packing=packing, attention_impl=impl,
                                        scan_layers=scan, layer_norm_impl=ln,
                                        matmul_precision=precision, qkv_projection=qkv,
                                        **fill))
      if args.attention_dropout_case and size == args.sizes[0] and seq_len == args.seq_lens[0]:
        jax_specs.append(dict(base, packing=False, attention_impl='xla', attention_dropout=0.1,
                              scan_layers=args.scan_layers[0]))
      torch_specs.append(dict(base, packing=False, attention_impl='sdpa'))
  return jax_specs, torch_specs


def main(argv=None):
  args = parse_args(argv)
  if args.torch_worker:
    run_torch_cases(args, json.loads(args.torch_worker))
    return
  # JAX takes 75% of the GPU's memory by default; a benchmark that fills the GPU wants more.
  os.environ.setdefault('XLA_PYTHON_CLIENT_MEM_FRACTION', '0.92')
  start = time.time()
  deadline = start + args.time_budget_s
  os.makedirs(args.output, exist_ok=True)
  log = lambda msg: print(f'[{time.time() - start:6.1f} s] {msg}', flush=True)
  jax_specs, torch_specs = case_specs(args)
  report = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds'),
                command=' '.join([os.path.basename(sys.executable)] + sys.argv),
                settings={k: v for k, v in vars(args).items() if k != 'torch_worker'},
                results=[])
  results = report['results']

  def save(rep):
    path = os.path.join(args.output, 'gpu_benchmark.json')
    with open(path + '.tmp', 'w') as f:
      json.dump(rep, f, indent=1)
    os.replace(path + '.tmp', path)
    return path
  if 'transformers' in args.frameworks:
    # First, before this process's JAX takes the GPU's memory.
    cmd = [sys.executable, os.path.abspath(__file__), *(argv or sys.argv[1:]),
           '--torch_worker', json.dumps(torch_specs)]
    try:
      proc = subprocess.run(cmd, capture_output=True, text=True, check=False,
                            timeout=args.time_budget_s * 0.35)
      stdout, stderr, code = proc.stdout, proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as e:
      stdout, stderr, code = e.stdout or '', e.stderr or '', 'timeout'
      stdout, stderr = [x.decode() if isinstance(x, bytes) else x for x in (stdout, stderr)]
    lines = [json.loads(x) for x in stdout.splitlines() if x.startswith('{')]
    if code or len(lines) != len(torch_specs):
      # The worker died (a crash, out of memory, the time limit): the cases it did not report
      # are errors carrying its exit and the end of its stderr, so the report names them.
      why = f'worker exit {code}: ' + (stderr.strip().splitlines() or [''])[-1][-400:]
      lines += [dict(framework='transformers', **s, error=why)
                for s in torch_specs[len(lines):]]
      if stderr.strip():
        report['transformers_stderr'] = stderr.strip()[-2000:]
    results.extend(lines)
    for r in lines:
      log(_line(r))
  if 'bert_jax' in args.frameworks:
    import jax  # pylint: disable=g-import-not-at-top
    report.update(jax=jax.__version__, backend=jax.default_backend(),
                  device=jax.devices()[0].device_kind)
    try:
      if args.attention_check:
        report['attention_check'] = check_attention(args)
        log(f"attention check: {json.dumps(report['attention_check'])}")
    except Exception as e:  # pylint: disable=broad-except
      report['attention_check'] = dict(error=_error(e))
    done = list(results)
    # Written after every case, so that a run stopped from outside keeps what it measured.
    results.extend(run_bert_jax(args, jax_specs, deadline, log,
                                lambda rs: save(dict(report, results=done + rs))))
    if args.loss_steps:
      report['loss_comparison'] = loss_comparison(results)
      for c in report['loss_comparison']:
        log(f'loss: {json.dumps(c)}')
  report['seconds'] = time.time() - start
  path = save(report)
  print('\n'.join(['', f'{path} ({report["seconds"]:.0f} s):'] + [_line(r) for r in results]))


if __name__ == '__main__':
  main()
