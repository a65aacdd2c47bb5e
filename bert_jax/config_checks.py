"""The valid range of every numeric config key, and the keys that must fit together, checked
once where a config is loaded.

`RANGES` is the table: key -> (test, what the value must be). A key that a config does not
have (pre-training versus fine-tuning, a task's own keys) is skipped, so one table serves every
job. A value out of range is a UserError naming the key as the user sets it
(`--config.train.learning_rate=-0.001: must be > 0`), before any data or model is built;
adding a key is one more row here and one more row in tests/inputs_test.py. `CHOICES` does the
same for every categorical key (`--config.model.dtype='fp16': expected one of auto, ...`; a
value that was removed, `REMOVED_CHOICES`, says so and names its replacement), and is where each
key's values are defined: the modules that branch on one import its values from here
(`attention.IMPLEMENTATIONS` is `CHOICES['model.attention_impl']`), and check a direct caller's
value with `check_choice`, the same one line.

Every check needs config.kind ('pretrain' or 'finetune', set by defaults.pretrain() and
defaults.finetune()): which job the config is for, never guessed from the keys it has.

`CROSS_CHECKS` are the rules between keys that are each in range (max_predictions_per_seq
within max_seq_length, warmup within the steps, batches that split over a fixed mesh, the
phases of train.phases); their messages name every key involved. What depends on the machine
(a mesh with -1, the devices present) is checked when the mesh is built, still before step 1.
"""

import difflib
import math
import re
from typing import Any, Callable

import ml_collections

from bert_jax import defaults
from bert_jax.errors import UserError

Check = tuple[Callable[[Any, ml_collections.ConfigDict], bool], str]


def _number(value) -> bool:
  return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _integer(value) -> bool:
  return _number(value) and float(value) == int(value)


def positive() -> Check:
  return (lambda v, c: _number(v) and v > 0), 'must be a number > 0'


def at_least(low: int) -> Check:
  return (lambda v, c: _integer(v) and v >= low), f'must be an integer >= {low}'


def fraction(*, open_low: bool = False, open_high: bool = False) -> Check:
  """A number in [0, 1], with either end excluded."""
  def test(v, c):
    return (_number(v) and (v > 0 if open_low else v >= 0) and
            (v < 1 if open_high else v <= 1))
  return test, f'must lie in {"(" if open_low else "["}0, 1{")" if open_high else "]"}'


def non_negative() -> Check:
  return (lambda v, c: _number(v) and v >= 0), 'must be a number >= 0'


def mesh_size() -> Check:
  return (lambda v, c: _integer(v) and (v >= 1 or v == -1)), \
      'must be a positive integer, or -1 for "all remaining devices"'


def _every_steps(v, c) -> bool:
  # Fine-tuning saves after each epoch anyway (0 = only then); pre-training needs a period.
  return _integer(v) and v >= (0 if defaults.kind(c) == 'finetune' else 1)


RANGES: dict[str, Check] = {
    # Model.
    'model.vocab_size': at_least(0),  # 0 = from the vocabulary file.
    'model.max_position_embeddings': at_least(1),
    'model.type_vocab_size': at_least(0),  # 0 = no token types.
    'model.intermediate_size': at_least(0),  # 0 = 4 x hidden.
    'model.rope_theta': positive(),
    'model.local_rope_theta': positive(),
    'model.local_attention_window': at_least(0),
    'model.global_attention_every': at_least(0),
    'model.hidden_dropout_prob': fraction(open_high=True),
    'model.attention_probs_dropout_prob': fraction(open_high=True),
    # Pre-training input.
    'data.vocab_size': at_least(8),
    'data.max_seq_length': at_least(8),  # [CLS] A [SEP] B [SEP] with room for words.
    'data.max_predictions_per_seq': at_least(1),
    'data.masked_lm_prob': fraction(open_low=True, open_high=True),
    'data.short_seq_prob': fraction(),
    'data.packing_max_sequences': at_least(1),
    'data.packing_window': at_least(1),
    'data.shuffle_buffer': at_least(1),
    'data.docs_per_batch': at_least(1),
    'data.seed': at_least(0),
    # Fine-tuning input (SQuAD's windows and decoding).
    'task.max_query_length': at_least(1),
    'task.doc_stride': at_least(1),
    'task.max_answer_length': at_least(1),
    'task.n_best_size': at_least(1),
    # Optimization.
    'train.steps': at_least(1),
    'train.epochs': at_least(1),
    'train.stop_at_step': at_least(0),
    'train.batch_size': at_least(1),
    'train.grad_accum_steps': at_least(1),
    'train.length_sort_window': at_least(1),
    'train.learning_rate': positive(),
    'train.warmup_steps': at_least(0),
    'train.warmup_proportion': fraction(open_high=True),
    'train.beta1': fraction(open_high=True),
    'train.beta2': fraction(open_high=True),
    'train.eps': positive(),
    'train.weight_decay': non_negative(),
    'train.max_grad_norm': non_negative(),  # 0 = no clipping.
    'train.seed': at_least(0),
    # Mesh.
    'mesh.data': mesh_size(),
    'mesh.fsdp': mesh_size(),
    'mesh.tensor': mesh_size(),
    # Checkpoints, evaluation, logging.
    'checkpoint.every_steps': (_every_steps, 'must be an integer >= 1 (fine-tuning: >= 0, '
                               '0 = only after each epoch)'),
    'checkpoint.keep': at_least(1),
    'checkpoint.push_every_steps': at_least(0),
    'eval.every_steps': at_least(1),
    'eval.steps': at_least(1),
    'eval.batch_size': at_least(1),
    'log.every_steps': at_least(1),
}


# The values of every categorical key, defined here once. The modules that branch on them import
# them from here: this module imports no JAX (seconds of start-up), so a misspelt value fails
# where the config loads, not 10-30 s in or after the workdir is written.

# Named model sizes (model.size): (layers, hidden, heads); the intermediate size is always
# 4 x hidden. `model.config_for_size` decodes them.
MODEL_SIZES: dict[str, tuple[int, int, int]] = {
    f'L{layers}_H{hidden}': (layers, hidden, hidden // 64)
    for layers in (2, 4, 6, 8, 10, 12) for hidden in (128, 256, 512, 768)}
MODEL_SIZES.update({
    'tiny': MODEL_SIZES['L2_H128'],     # Turc et al.'s BERT-Tiny; what the tests run.
    'mini': MODEL_SIZES['L4_H256'],
    'small': MODEL_SIZES['L4_H512'],
    'medium': MODEL_SIZES['L8_H512'],
    'base': (12, 768, 12),
    'large': (24, 1024, 16),
})
CHOICES: dict[str, tuple[str, ...]] = {
    'model.size': tuple(MODEL_SIZES),
    # 'auto' (this key, layer_norm_impl and gelu_impl): for the platform a step runs on, or is
    # compiled for (`model.resolve`, the one place that resolves it).
    'model.dtype': ('auto', 'float32', 'bfloat16', 'float16'),
    'model.remat_policy': ('none', 'full', 'dots'),
    'model.attention_impl': ('xla', 'cudnn', 'splash'),
    'model.layer_norm_impl': ('auto', 'pallas', 'xla'),
    'model.gelu_impl': ('auto', 'pallas', 'xla'),
    'model.qkv_projection': ('stacked', 'separate'),
    'model.matmul_precision': ('default', 'fp8'),
    'model.position_embedding_type': ('absolute', 'rotary'),
    'model.mlp': ('dense', 'geglu', 'swiglu'),
    'data.objective': ('nsp', 'sop', 'none'),
    'train.optimizer': ('adamw', 'lamb'),
    'train.decay': ('linear', 'constant'),
    'train.rng_impl': ('auto', 'threefry2x32', 'rbg', 'unsafe_rbg'),
    'task.data_source': ('tsv', 'tfds'),
}


# Values that a key of CHOICES took once and no longer does -> why, and what to set instead. A
# config written for an earlier bert_jax that still sets one gets this line rather than "expected
# one of", which would not say that the value was ever valid or which one replaces it.
REMOVED_CHOICES: dict[str, dict[str, str]] = {
    'model.attention_impl': {
        'cudnn_varlen': "was removed: cuDNN's packed layout was slower than 'cudnn' at 128 and "
                        'at 512 tokens on an H200 (README, "Attention"); use '
                        '--config.model.attention_impl=cudnn',
    },
}


def check_choice(key: str, value: Any) -> None:
  """The UserError of `key`'s check where a config loads, for a value `key` does not take: for
  the libraries that branch on `key`, on a direct caller's value."""
  if value not in CHOICES[key]:
    raise _choice_error(key, value)


def _choice_error(key: str, value: Any) -> UserError:
  removed = REMOVED_CHOICES.get(key, {})
  if isinstance(value, str) and value in removed:
    return UserError(f'--config.{key}={value!r} {removed[value]}')
  choices = CHOICES[key]
  close = difflib.get_close_matches(str(value), choices, n=1)
  hint = f' (did you mean {close[0]!r}?)' if close else ''
  shown = ('tiny, mini, small, medium, base, large or L{2..12}_H{128,256,512,768}'
           if key == 'model.size' else ', '.join(choices))
  return UserError(f'--config.{key}={value!r}: expected one of {shown}{hint}')


# log.writers' names (trackers.py writes to them): these, or MODULE:NAME of a clu MetricWriter.
WRITERS = ('tensorboard', 'wandb')


def writer_names(writers: str) -> list[str]:
  """log.writers -> its writer names; a name that is none (a typo) is a UserError."""
  names = [w.strip() for w in str(writers).split(',') if w.strip()]
  for name in names:
    if name not in WRITERS and not (':' in name and all(name.split(':', 1))):
      close = difflib.get_close_matches(name, WRITERS, n=1)
      raise UserError(f'--config.log.writers={writers!r}: {name!r} is not a writer'
                      + (f' (did you mean {close[0]!r}?)' if close else '')
                      + ': tensorboard, wandb, or MODULE:NAME of a clu MetricWriter')
  if len(set(names)) != len(names):
    raise UserError(f'--config.log.writers={writers!r} names a writer twice')
  return names


def _lookup(config: ml_collections.ConfigDict, key: str):
  node = config
  for part in key.split('.'):
    if not isinstance(node, ml_collections.ConfigDict) or part not in node:
      return False, None
    node = node[part]
  return True, node


def phase_specs(config: ml_collections.ConfigDict) -> list[tuple[float, int, int]]:
  """train.phases ('0.9:128:20,0.1:512:80') as (fraction, seq_len, max_predictions) per phase,
  checked; [] when it is empty (one phase at data.max_seq_length)."""
  spec = config.train.phases.strip()
  if not spec:
    return []
  parts = []
  for item in spec.split(','):
    try:
      frac, seq_len, preds = item.split(':')
      parts.append((float(frac), int(seq_len), int(preds)))
    except ValueError:
      raise UserError(f'train.phases: {item!r} is not fraction:seq_len:max_predictions') from None
  if abs(sum(p[0] for p in parts) - 1.0) > 1e-6:
    raise UserError(f'train.phases fractions sum to {sum(p[0] for p in parts)}, not 1: {spec}')
  for item, (frac, seq_len, preds) in zip(spec.split(','), parts):
    if frac < 0 or not 8 <= seq_len or not 1 <= preds <= seq_len:
      raise UserError(f'train.phases: {item!r} needs fraction >= 0, seq_len >= 8 and 1 <= '
                      'max_predictions <= seq_len')
    if seq_len > config.model.max_position_embeddings and not _rotary(config):
      raise UserError(f'train.phases: seq_len {seq_len} exceeds '
                      f'model.max_position_embeddings={config.model.max_position_embeddings}')
  return parts


def _rotary(config: ml_collections.ConfigDict) -> bool:
  """Whether the model has rotary positions (no learned table, so no length ceiling)."""
  found = _get(config, 'model.position_embedding_type')
  return bool(found) and found[0] == 'rotary'


def _get(config: ml_collections.ConfigDict, *keys: str) -> list | None:
  """The values of `keys`, or None if the config lacks one of them."""
  found = [_lookup(config, key) for key in keys]
  return None if not all(present for present, _ in found) else [v for _, v in found]


def _lengths(config):
  values = _get(config, 'data.max_seq_length', 'data.max_predictions_per_seq')
  if values and values[1] > values[0]:
    raise UserError(f'data.max_predictions_per_seq={values[1]} exceeds data.max_seq_length='
                    f'{values[0]}: at most one prediction per token')
  values = _get(config, 'data.max_seq_length', 'model.max_position_embeddings')
  if values and values[0] > values[1] and not _rotary(config):
    # Pre-training: the model's own limit (fine-tuning takes the checkpoint's, when loaded).
    raise UserError(f'data.max_seq_length={values[0]} exceeds model.max_position_embeddings='
                    f'{values[1]}: the model has no position embedding past its limit')


def _phases(config):
  if _get(config, 'train.phases', 'model.max_position_embeddings') is None:
    return
  count = max(1, len(phase_specs(config)))
  for key in ('phase_inputs', 'phase_eval_inputs'):
    spec = (_get(config, f'data.{key}') or [''])[0].strip()
    if spec and len(spec.split(';')) != count:
      raise UserError(f'data.{key} has {len(spec.split(";"))} entries separated by ";", '
                      f'train.phases has {count} phases: give one input per phase (an empty '
                      'entry keeps the default)')
  values = _get(config, 'model.attention_impl', 'data.max_seq_length')
  if values and values[0] == 'splash':
    lengths = {int(s) for _, s, _ in phase_specs(config)} or {int(values[1])}
    bad = sorted(t for t in lengths if t % 128)  # attention.SPLASH_BLOCK: the kernel's tiles.
    if bad:
      raise UserError(f"model.attention_impl='splash' needs sequence lengths that are "
                      f'multiples of 128; data.max_seq_length / train.phases give {bad}')


def check_local_attention(impl: str, window: int, scanned_kinds: bool = False) -> None:
  """The UserError for local attention (model.local_attention_window `window`) that attention
  kernel `impl` cannot compute; `scanned_kinds`: scanned layers mix local and global attention.
  Where a config loads (`_architecture`), and in `attention.check_config` and
  `dot_product_attention` for a checkpoint's architecture (fine-tuning) or a direct caller."""
  if window < 0 or window % 2:
    raise UserError(f'model.local_attention_window={window}: must be even (W / 2 keys on each '
                    'side of a query), or 0 for global attention everywhere')
  if not window:
    return
  if impl == 'splash' and scanned_kinds:
    raise UserError("model.attention_impl='splash' with model.scan_layers=True and layers of "
                    f'both kinds (model.local_attention_window={window}, '
                    'model.global_attention_every): a splash kernel is built for one mask when '
                    'traced, and scanned layers share one trace; use model.scan_layers=False')


def check_gelu_impl(impl: str, mlp: str) -> None:
  """The UserError for model.gelu_impl `impl` with feed-forward `mlp` (model.mlp's values):
  the Pallas kernel fuses a dense layer's bias add and GELU (the paper's MLP, the MLM
  transform), where a gated MLP multiplies the GELU by its gate after a stacked matmul that
  added the biases. Where a config loads (`_architecture`) and in `model.BertConfig` (a
  checkpoint's architecture)."""
  if impl == 'pallas' and mlp != 'dense':
    raise UserError(f"model.gelu_impl='pallas' with a gated MLP (model.mlp={mlp!r}): the "
                    "Pallas kernel fuses a dense layer's bias add and GELU, and a gated MLP's "
                    "GELU runs in XLA after its gate's stacked matmul; use "
                    "model.gelu_impl='xla' or 'auto'")


def _architecture(config):
  """The options after the paper against the kernels."""
  values = _get(config, 'model.local_attention_window', 'model.global_attention_every',
                'model.attention_impl', 'model.scan_layers')
  if values:
    window, every, impl, scan = values
    # Every named size has 2 layers or more: N >= 2 makes layer 0 global and layer 1 local.
    check_local_attention(impl, window, bool(scan) and every >= 2)
  values = _get(config, 'model.gelu_impl', 'model.mlp')
  if values:
    check_gelu_impl(*values)


def _schedule(config):
  values = _get(config, 'train.warmup_steps', 'train.steps')
  if values and values[0] > values[1]:
    raise UserError(f'train.warmup_steps={values[0]} must lie in [0, train.steps={values[1]}]')
  values = _get(config, 'train.stop_at_step', 'train.steps')
  if values and values[0] > values[1]:
    raise UserError(f'train.stop_at_step={values[0]} must lie in [1, train.steps={values[1]}] '
                    '(0 = run to train.steps)')


def _batches(config):
  values = _get(config, 'train.batch_size', 'train.grad_accum_steps')
  if values and values[0] % values[1]:
    raise UserError(f'train.batch_size={values[0]} does not divide by '
                    f'train.grad_accum_steps={values[1]}')
  sizes = _get(config, 'mesh.data', 'mesh.fsdp', 'mesh.tensor')
  if not sizes:
    return
  if sizes.count(-1) > 1:
    raise UserError('only one of mesh.data/fsdp/tensor may be -1, got '
                    f'{dict(zip(("data", "fsdp", "tensor"), sizes))}')
  if -1 in sizes[:2]:
    return  # The data-parallel size depends on the devices: checked with the mesh.
  shards = sizes[0] * sizes[1]
  if values and (values[0] // values[1]) % shards:
    raise UserError(f'micro-batch {values[0] // values[1]} (train.batch_size / '
                    f'train.grad_accum_steps) does not divide over {shards} data-parallel '
                    f'shards (mesh.data={sizes[0]} x mesh.fsdp={sizes[1]})')
  eval_batch = _get(config, 'eval.batch_size')
  if eval_batch and eval_batch[0] % shards:
    raise UserError(f'eval.batch_size={eval_batch[0]} must divide over the {shards} '
                    f'data-parallel shards (mesh.data={sizes[0]} x mesh.fsdp={sizes[1]})')


def _writers(config: ml_collections.ConfigDict) -> None:
  present, value = _lookup(config, 'log.writers')
  if present:
    writer_names(value)
  present, value = _lookup(config, 'checkpoint.push_to_hub')
  if present and value and not re.fullmatch(r'[\w.-]+/[\w.-]+', str(value)):
    raise UserError(f'--config.checkpoint.push_to_hub={value!r}: expected ORG/NAME, a model '
                    "repository on the Hugging Face Hub ('' = no pushes)")


# Rules between keys, in order; each raises a UserError naming the keys, or returns.
CROSS_CHECKS: tuple[Callable[[ml_collections.ConfigDict], None], ...] = (
    _lengths, _phases, _architecture, _schedule, _batches, _writers)


# config.kind -> (the job, the command that runs it).
_JOBS = {'pretrain': ('pre-training', 'bert-jax pretrain'),
         'finetune': ('fine-tuning', 'bert-jax finetune')}


def check_config(config: ml_collections.ConfigDict, kind: str | None = None) -> None:
  """Raises a UserError for a config without config.kind (or not of `kind`, when given: the
  job that runs it), a fine-tuning key set at its old place (defaults.MOVED_KEYS), the first key
  of RANGES whose value is out of its range, the first key of CHOICES whose value is not one of
  them, or the keys of the first CROSS_CHECKS rule they break.

  Called where a config is loaded (config_files, the command line), before any work, and by
  the drivers on entry for a config changed in Python after loading (a notebook, a sweep).
  """
  found = defaults.kind(config)
  if kind is not None and found != kind:
    raise UserError(f'--config is a {_JOBS[found][0]} config (run it with '
                    f'`{_JOBS[found][1]}`), not a {_JOBS[kind][0]} config '
                    f'(config.kind={found!r})')
  if found == 'finetune':
    defaults.check_moved_keys(config)
  for key, (test, wording) in RANGES.items():
    present, value = _lookup(config, key)
    if present and not test(value, config):
      raise UserError(f'--config.{key}={value!r}: {wording}')
  for key in CHOICES:
    present, value = _lookup(config, key)
    if present:
      check_choice(key, value)
  for check in CROSS_CHECKS:
    check(config)
