"""The `bert-jax` command: `bert-jax <subcommand> [--flags]`.

Subcommands parse flags (absl + ml_collections: `--config=configs/x.py --config.a.b=value`)
and call one function of the package; no logic lives here.

A user's mistake (`errors.UserError`, a bad flag or config override) ends as one line on stderr,
`bert-jax <command>: error: ...`, with exit status 2; anything else is a bug and keeps its
traceback (status 1). `--traceback` or BERT_JAX_TRACEBACK=1 shows the traceback of a mistake too.
SIGTERM or Ctrl-C, in any phase of any command, ends with one line and status 143 (training
saves first), and so does Cloud Storage failing past the retries (`errors.Outage`): rerun to
resume (`EXIT_STATUSES`, also in `bert-jax --help`). What a command starts before it runs
(TensorFlow, jax.distributed, JAX) is `start_up.py`'s; what else shows on the console (native
start-up notes held back, the log filter, those signals before a run listens) is `console.py`'s.
"""

import difflib
import gc
import os
import re
import signal
import sys
import traceback
from typing import Callable

from absl import app
from absl import flags
from absl import logging

# TensorFlow runs only the input pipeline here (string and integer ops, no matmuls), where its
# oneDNN kernels gain nothing; with them on, a packed pipeline prints an error-level
# "oneDNN supports DT_INT64 only on platforms with AVX-512" mid-run on CPUs without AVX-512.
# Before anything imports TensorFlow, which reads this once; a user's own setting stays.
os.environ.setdefault('TF_ENABLE_ONEDNN_OPTS', '0')

from bert_jax import config_files  # pylint: disable=g-import-not-at-top,wrong-import-position
from bert_jax.config_files import configs_dir  # Where each command's default config is.
from bert_jax import config_checks
from bert_jax import console
from bert_jax import errors
from bert_jax import fileio
from bert_jax import gcs
from bert_jax import start_up
from bert_jax.errors import UserError

FLAGS = flags.FLAGS
_COMMANDS: dict[str, tuple[str, Callable[[], Callable[[list[str]], None]]]] = {}


def _command(name: str, help_text: str):
  def register(define_flags):
    _COMMANDS[name] = (help_text, define_flags)
    return define_flags
  return register


# ---- Config files ----------------------------------------------------------------------------


# The command line being parsed: config_flags reads the --config.a.b overrides from it (not from
# sys.argv, which differs when main() is called with an argv), and the default --config file.
_ARGV: list[str] = []
_DEFAULT_CONFIG: list[str] = []


def _define_config_flag(default: str) -> None:
  from ml_collections import config_flags  # pylint: disable=g-import-not-at-top
  _DEFAULT_CONFIG[:] = [default]
  config_flags.DEFINE_config_file('config', default, 'Config file (a Python file with '
                                  'get_config()) or a shipped config\'s name (smoke, '
                                  'finetune_glue:mrpc, ...); override keys with '
                                  '--config.a.b=value.', lock_config=True, sys_argv=_ARGV)
  # DEFINE_config_file takes no parser; the flag's own (public) parser is replaced so that
  # --config=smoke finds the shipped file. The default is a full path, parsed already.
  FLAGS['config'].parser = config_files.file_parser()


def _explain_config_overrides(args: list[str]) -> None:
  """Raises a UserError naming the first --config.a.b override that is not a key of the config.

  ml_collections reports a misspelt key as a KeyError deep in flag parsing; this names the flag,
  the closest key ("did you mean") and the keys that exist. Returns if every override is a key.
  """
  path = (_DEFAULT_CONFIG or [''])[0]
  for i, arg in enumerate(args):
    if arg.startswith('--config='):
      path = arg[len('--config='):]
    elif arg == '--config' and i + 1 < len(args):  # absl takes `--config PATH` too.
      path = args[i + 1]
  if not path:
    return
  config = config_files.load_config(path)
  for arg in args:
    flag = arg.split('=', 1)[0]
    key = flag[len('--noconfig.'):] if flag.startswith('--noconfig.') else (
        flag[len('--config.'):] if flag.startswith('--config.') else None)
    if key is not None:
      config_files.check_key(config, key, path, flag)


def _define_distributed_flags() -> None:
  flags.DEFINE_string('coordinator_address', '', 'host:port of process 0 (multi-host).')
  flags.DEFINE_integer('num_processes', 0, 'Number of processes (multi-host).')
  flags.DEFINE_integer('process_id', -1, 'This process\'s index (multi-host).')
  flags.DEFINE_enum('distributed', 'auto', ['auto', 'on', 'off'],
                    'jax.distributed: auto = on Cloud TPU VMs, SLURM jobs of several tasks, or '
                    'when --coordinator_address is given.')


# ---- Subcommands -------------------------------------------------------------------------------


@_command('pretrain', 'Pre-train BERT (MLM + NSP) from a config file.')
def _pretrain_flags():
  _define_config_flag(os.path.join(configs_dir(), 'smoke.py'))
  flags.DEFINE_string('workdir', '', 'Where checkpoints, metrics and logs go '
                      '(default: /tmp/bert-jax/<config name>).')
  _define_distributed_flags()

  def run(argv):
    del argv
    from bert_jax import train  # pylint: disable=g-import-not-at-top
    workdir = FLAGS.workdir or fileio.default_workdir(_config_name())
    _record_command()
    train.train_and_evaluate(FLAGS.config, workdir)
  return run


def _record_command() -> None:
  """The command line, for the driver to record in the workdir as its loop starts (process 0;
  run_frame.closing): a pushed model card says how it was made. Not here: a workdir is touched
  only after the driver's checks (a missing bucket is one line, a refused run leaves nothing)."""
  from bert_jax import publish  # pylint: disable=g-import-not-at-top
  publish.COMMAND_LINE = sys.argv[1:]


def _config_name() -> str:
  from ml_collections import config_flags  # pylint: disable=g-import-not-at-top
  path = config_flags.get_config_filename(FLAGS['config'])
  return os.path.splitext(os.path.basename(path.split(':')[0]))[0]


@_command('convert', 'Convert BERT weights between Hugging Face, Google TF and bert_jax.')
def _convert_flags():
  flags.DEFINE_string('input', None, 'A Hugging Face directory, a Google checkpoint '
                      '(directory or bert_model.ckpt prefix), a bert_jax checkpoint or workdir, or '
                      'hf://ORG/NAME[@REVISION] on the Hugging Face Hub.')
  flags.DEFINE_string('output', None, 'Output directory (with --push_to_hub: optional, the '
                      'pushed folder is kept there).')
  flags.DEFINE_enum('format', 'bert_jax', ['bert_jax', 'hf', 'google', 'modernbert'],
                    'Output format (modernbert: transformers\' ModernBertForMaskedLM, for a '
                    'model with its architecture).')
  flags.DEFINE_string('push_to_hub', '', 'ORG/NAME: push the Hugging Face export (with a model '
                      'card and the tokenizer files) to this model repository on the Hub; '
                      'needs --format=hf.')
  flags.mark_flags_as_required(['input'])

  def run(argv):
    del argv
    if FLAGS.push_to_hub:
      if FLAGS.format != 'hf':
        raise UserError(f'--push_to_hub={FLAGS.push_to_hub} pushes the Hugging Face layout: '
                        'add --format=hf')
      from bert_jax import publish  # pylint: disable=g-import-not-at-top
      commit = publish.push_export(FLAGS.input, FLAGS.push_to_hub, FLAGS.output or '')
      print(f'Pushed {FLAGS.input} to {FLAGS.push_to_hub} (commit {commit}); load it as '
            f'hf://{FLAGS.push_to_hub}')
      return
    if not FLAGS.output:
      raise UserError('--output is required (the folder to write), unless --push_to_hub')
    from bert_jax import convert  # pylint: disable=g-import-not-at-top
    convert.convert(FLAGS.input, FLAGS.output, FLAGS.format)
    print(f'Wrote {FLAGS.format} checkpoint to {FLAGS.output}')
  return run


@_command('data', 'Show decoded pre-training examples, or statistics with --stats=N.')
def _data_flags():
  _define_config_flag(os.path.join(configs_dir(), 'smoke.py'))
  flags.DEFINE_integer('stats', 0, 'Print one JSON object of statistics over N batches.',
                       lower_bound=0)
  flags.DEFINE_integer('num_examples', 3, 'Examples to show.', lower_bound=0)
  flags.DEFINE_string('workdir', '', 'Where a trained vocab is cached (empty data.vocab_file).')

  def run(argv):
    del argv
    import json  # pylint: disable=g-import-not-at-top
    config = FLAGS.config  # Checked with the flags (_parse_flags), its lengths included.
    from bert_jax import input_inspect  # pylint: disable=g-import-not-at-top  (TensorFlow)
    from bert_jax import input_pipeline  # pylint: disable=g-import-not-at-top  (TensorFlow)
    workdir = FLAGS.workdir or fileio.default_workdir(_config_name())
    vocab = input_pipeline.resolve_vocab(config.data, workdir)
    if FLAGS.stats:
      stats = input_inspect.compute_stats(config.data, num_batches=FLAGS.stats,
                                          batch_size=config.train.batch_size,
                                          vocab_file=vocab)
      print(json.dumps(stats))
    else:
      print(input_inspect.show_examples(config.data, num=FLAGS.num_examples, vocab_file=vocab))
  return run


@_command('vocab', 'Train a WordPiece vocab.txt or a SentencePiece model from text.')
def _vocab_flags():
  flags.DEFINE_list('input', None, 'Text files / globs (or tfds:NAME), comma separated.')
  flags.DEFINE_string('output', None, 'vocab.txt path, or the model prefix for SentencePiece.')
  flags.DEFINE_integer('vocab_size', 30522, 'Vocabulary size.')
  flags.DEFINE_enum('kind', 'wordpiece', ['wordpiece', 'sentencepiece'], 'Vocabulary type.')
  flags.DEFINE_bool('lower_case', True, 'Lower-case and strip accents (uncased).')
  flags.DEFINE_integer('num_unused', 0, 'Number of [unusedN] slots.')
  flags.DEFINE_string('tfds_text_key', 'text', 'The text feature of a tfds:NAME input.')
  flags.DEFINE_string('text_column', 'text', 'The text column of a Parquet / Hub dataset input.')
  flags.DEFINE_string('tfds_data_dir', '', 'TFDS data_dir of a tfds:NAME input (default: '
                      "TFDS's).")
  flags.mark_flags_as_required(['input', 'output'])

  def run(argv):
    del argv
    from bert_jax import vocab  # pylint: disable=g-import-not-at-top
    path = vocab.run(FLAGS.input, FLAGS.output, FLAGS.vocab_size, kind=FLAGS.kind,
                     lower_case=FLAGS.lower_case, num_unused=FLAGS.num_unused,
                     tfds_text_key=FLAGS.tfds_text_key, tfds_data_dir=FLAGS.tfds_data_dir,
                     text_column=FLAGS.text_column)
    print(f'Wrote {path}')
  return run


@_command('compile', 'Compile the train step ahead of time for a Cloud TPU slice or NVIDIA '
          'GPUs (no accelerator needed); report memory and a roofline bound.')
def _compile_flags():
  # Compiling runs nothing on an accelerator. JAX's CUDA plugin checks, as it starts, the CUDA
  # libraries it would run with (cuFFT, cuPTI, ...), which a compile-only machine (the gpuaot
  # extra) lacks, and without them it does not register: "topology not implemented for cuda".
  # JAX skips the check when JAX_PLATFORMS leaves cuda out; read as jax is imported (not yet).
  os.environ.setdefault('JAX_PLATFORMS', 'cpu')
  _define_config_flag(os.path.join(configs_dir(), 'bert_large.py'))
  flags.DEFINE_string('topology', 'v5e:16x16', 'TPU slice, e.g. v5e:16x16, v4:4x4x4, v5p:4x4x4, '
                      'or NVIDIA GPUs: h100, h100:8 (one host), h100:2x8 (2 hosts); h200, a100, '
                      "b200 (needs the gpuaot extra).")
  flags.DEFINE_integer('vocab_size', 30522, 'Vocabulary size when model.vocab_size is 0.')

  def run(argv):
    del argv
    from bert_jax import aot  # pylint: disable=g-import-not-at-top
    for report in aot.compile_for_topology(FLAGS.config, FLAGS.topology, FLAGS.vocab_size):
      print(aot.format_report(report), flush=True)
  return run


@_command('finetune', 'Fine-tune on a task (configs/finetune_*.py: GLUE, SQuAD, ...); --sweep '
          'runs the paper\'s learning-rate search.')
def _finetune_flags():
  _define_config_flag(os.path.join(configs_dir(), 'finetune_glue.py'))
  flags.DEFINE_string('workdir', '', 'Where the best checkpoint, metrics.json, predictions and '
                      'TensorBoard logs go (default: /tmp/bert-jax/finetune_<task>).')
  flags.DEFINE_bool('sweep', False, 'One run per --learning_rates in <workdir>/lr_<lr>; prints '
                    'the best dev score and its rate (also <workdir>/sweep.json).')
  flags.DEFINE_list('learning_rates', ['5e-5', '4e-5', '3e-5', '2e-5'],
                    'Peak learning rates of --sweep (the paper\'s search).')
  _define_distributed_flags()

  def run(argv):
    del argv
    import json  # pylint: disable=g-import-not-at-top
    from bert_jax import finetune  # pylint: disable=g-import-not-at-top
    workdir = FLAGS.workdir or fileio.default_workdir(f'finetune_{FLAGS.config.task.name}')
    if not FLAGS.sweep:
      _record_command()
      finetune.finetune(FLAGS.config, workdir)
      return
    try:
      rates = [float(r) for r in FLAGS.learning_rates]
    except ValueError:
      raise UserError(f'--learning_rates={",".join(FLAGS.learning_rates)}: not numbers; give '
                      'comma-separated rates such as 5e-5,3e-5') from None
    result = finetune.sweep(FLAGS.config, workdir, rates)
    if result is None:
      return  # Stopped early; the run said so.
    print(f'\nbert_jax finetune --sweep {result["task"]}: best {result["main_metric"]} '
          f'{result["best_score"]:.4f} at learning rate {result["best_learning_rate"]:g} '
          f'({result["best_workdir"]})\n{json.dumps(result)}', flush=True)
  return run


@_command('features', 'Contextual token embeddings of chosen layers and sentence vectors '
          '(.jsonl, .npz or .npy).')
def _features_flags():
  flags.DEFINE_string('init_checkpoint', None, 'Any checkpoint: bert_jax, Hugging Face, Google '
                      'TF, a (pre-)training workdir or hf://ORG/NAME[@REVISION]; its vocab.txt and '
                      'casing are used.')
  flags.DEFINE_string('input', None, 'Text file: one text per line, or "text_a ||| text_b".')
  flags.DEFINE_string('output', None, 'A .jsonl, .npz or .npy path.')
  flags.DEFINE_list('layers', [], 'Hidden states to output, in this order: -1 = last encoder '
                    'layer, 0 = embedding output (default: -1,-2,-3,-4, or every encoder layer '
                    'of a model with fewer).')
  flags.DEFINE_bool('concat', False, 'Concatenate the layers per token (and in the mean '
                    'vector), in --layers order.')
  flags.DEFINE_list('pooling', ['cls', 'mean'], 'Sentence vectors: cls (pooler output), mean '
                    '(of the chosen layers over the real tokens).')
  flags.DEFINE_integer('max_seq_length', 128, 'Longer texts are truncated (and counted).')
  flags.DEFINE_integer('batch_size', 32, 'Texts per batch.')
  flags.DEFINE_string('vocab_file', '', 'vocab.txt; default: the checkpoint\'s.')
  flags.DEFINE_bool('lower_case', None, 'Lower-case the text; default: what the checkpoint '
                    'says.')
  flags.DEFINE_string('dtype', 'float32', 'Compute dtype (auto = bfloat16 on GPU/TPU).')
  flags.DEFINE_integer('decimals', 6, 'Rounding of the .jsonl floats.')
  flags.mark_flags_as_required(['init_checkpoint', 'input', 'output'])

  def run(argv):
    del argv
    from bert_jax import features  # pylint: disable=g-import-not-at-top
    try:
      layers = [int(l) for l in FLAGS.layers] or None
    except ValueError:
      raise UserError(f'--layers={",".join(FLAGS.layers)}: not integers; give comma-separated '
                      'layer indices such as -1,-2 (-1 = last layer, 0 = embeddings)') from None
    result = features.extract_features(
        FLAGS.init_checkpoint, FLAGS.input, FLAGS.output, layers=layers,
        max_seq_length=FLAGS.max_seq_length, batch_size=FLAGS.batch_size, pooling=FLAGS.pooling,
        concat=FLAGS.concat, vocab_file=FLAGS.vocab_file, lower_case=FLAGS.lower_case,
        dtype=FLAGS.dtype, decimals=FLAGS.decimals)
    print(f'Wrote features of {result["lines"]} texts (layers {result["layers"]}) to '
          f'{result["output"]}'
          + (f'; {result["truncated"]} truncated' if result['truncated'] else ''))
  return run


@_command('eval', 'MLM and NSP metrics of a checkpoint on held-out text, without training '
          '(one JSON object).')
def _eval_flags():
  _define_config_flag(os.path.join(configs_dir(), 'smoke.py'))
  flags.DEFINE_string('checkpoint', None, 'A pre-training workdir, or a Hugging Face, Google TF '
                      'or bert_jax checkpoint with an MLM head, or hf://ORG/NAME[@REVISION].')
  flags.mark_flags_as_required(['checkpoint'])

  def run(argv):
    del argv
    import json  # pylint: disable=g-import-not-at-top
    from bert_jax import train  # pylint: disable=g-import-not-at-top
    print(json.dumps(train.evaluate_checkpoint(FLAGS.config, FLAGS.checkpoint)), flush=True)
  return run


@_command('predict', 'A fine-tuned model on new inputs, in the formats of its task (README, '
          '"Using a model from the command line"); inputs with labels are also scored.')
def _predict_flags():
  flags.DEFINE_string('workdir', None, 'A finished `bert-jax finetune` workdir.')
  flags.DEFINE_string('input', None, 'New inputs in a format of the run\'s task: its dev file\'s '
                      '(e.g. a GLUE TSV, SQuAD JSON, CoNLL) or another it reads (JSONL, text).')
  flags.DEFINE_string('output', None, 'Where the predictions go, in the task\'s output format '
                      '(GLUE: JSONL; SQuAD: JSON, with .nbest.json beside it; NER: CoNLL; ...).')
  from bert_jax import task_table  # pylint: disable=g-import-not-at-top  (the table, no task)
  flags.DEFINE_enum('input_format', 'auto', list(task_table.predict_formats()),
                    'What --input is (the task\'s formats: task_table.KINDS); auto: by the '
                    'task, the file name (.jsonl) and, for NER, whether it looks like CoNLL.')
  flags.DEFINE_integer('batch_size', 0, 'Examples (SQuAD: windows) per batch; 0 = the run\'s '
                       'eval.batch_size, the batches of its dev predictions.')
  flags.mark_flags_as_required(['workdir', 'input', 'output'])

  def run(argv):
    del argv
    import json  # pylint: disable=g-import-not-at-top
    from bert_jax import predict  # pylint: disable=g-import-not-at-top
    print(json.dumps(predict.predict(FLAGS.workdir, FLAGS.input, FLAGS.output,
                                     FLAGS.batch_size, FLAGS.input_format)), flush=True)
  return run


@_command('export', 'A finished run as a model a serving stack loads: a TensorFlow SavedModel '
          'that takes strings and answers as predict (README, "Serving").')
def _export_flags():
  flags.DEFINE_string('workdir', None, 'A finished `bert-jax finetune` workdir (GLUE, SQuAD, '
                      'NER, SWAG) or `pretrain` workdir (features and fill-mask).')
  flags.DEFINE_string('output', None, 'The export\'s folder: new, empty, or an earlier export '
                      '(replaced).')
  flags.DEFINE_string('format', 'savedmodel', 'savedmodel: a TensorFlow SavedModel.')
  flags.mark_flags_as_required(['workdir', 'output'])

  def run(argv):
    del argv
    import json  # pylint: disable=g-import-not-at-top
    from bert_jax import export  # pylint: disable=g-import-not-at-top
    print(json.dumps(export.export(FLAGS.workdir, FLAGS.output, FLAGS.format)), flush=True)
  return run


@_command('fill-mask', 'Top-k tokens and probabilities for each [MASK] of the texts given '
          '(one JSON object per text).')
def _fill_mask_flags():
  flags.DEFINE_string('checkpoint', None, 'A checkpoint with an MLM head: bert_jax, Hugging '
                      'Face, Google TF, a pre-training workdir, or hf://ORG/NAME[@REVISION].')
  flags.DEFINE_integer('top_k', 5, 'Tokens to show per [MASK].')
  flags.DEFINE_bool('table', False, 'A human-readable table instead of JSON lines.')
  flags.DEFINE_string('vocab_file', '', 'vocab.txt; default: the checkpoint\'s.')
  flags.DEFINE_bool('lower_case', None, 'Lower-case the text; default: what the checkpoint '
                    'says.')
  flags.mark_flags_as_required(['checkpoint'])

  def run(argv):
    import json  # pylint: disable=g-import-not-at-top
    from bert_jax import fill_mask  # pylint: disable=g-import-not-at-top
    texts = argv[1:]
    if not texts:
      raise UserError('give the texts as arguments: bert-jax fill-mask --checkpoint=PATH '
                      '"The capital of France is [MASK]."')
    results = fill_mask.fill_mask(FLAGS.checkpoint, texts, FLAGS.top_k,
                                  vocab_file=FLAGS.vocab_file, lower_case=FLAGS.lower_case)
    if FLAGS.table:
      print(fill_mask.format_table(results))
    else:
      for result in results:
        print(json.dumps(result, ensure_ascii=False))
  return run


# ---- Entry point -------------------------------------------------------------------------------


EXIT_STATUSES = f'''exit status:
  {errors.EXIT_FINISHED:<3d}  finished
  {errors.EXIT_USER_ERROR:<3d}  a mistake to fix: the message names the flag, config key or file
  {errors.EXIT_BUG:<3d}  a bug: the traceback is for a bug report
  {errors.EXIT_PREEMPTED:<3d}  stopped by SIGTERM (preemption) or Ctrl-C, training saved first, or
       by Cloud Storage failing past the retries (the last checkpoint intact): rerun the
       same command to resume (schedulers: retry on this status)'''


def _usage() -> str:
  lines = ['usage: bert-jax <command> [--flags]   (bert-jax <command> --help for flags)', '']
  lines += [f'  {name:10s} {text}' for name, (text, _) in _COMMANDS.items()]
  return '\n'.join(lines + ['', EXIT_STATUSES])


# absl's own --help/--helpshort list the flags of the module that is `__main__`: the console
# script's, which defines none. A command's flags are all defined in this module.
_HELP_FLAGS = ('-h', '--h', '-help', '--help', '-?', '--helpshort', '-helpshort')


def command_help(name: str) -> str:
  """`bert-jax NAME --help`: the command's line of the usage and its flags (defined already)."""
  module = FLAGS.find_module_defining_flag('traceback')
  # Less the line that names the module's file.
  listing = '\n'.join(line for line in FLAGS.module_help(module).splitlines()
                      if line.startswith(' '))
  overrides = (' --config.a.b=value overrides a key of\nthe config (each key is defined and '
               'commented in bert_jax/defaults.py).' if 'config' in FLAGS else '')
  return (f'usage: bert-jax {name} [--flags]\n\n{_COMMANDS[name][0]}\n\nflags:\n{listing}\n\n'
          f'--helpfull adds the flags of the libraries.{overrides}')


def _traceback_wanted(args: list[str]) -> bool:
  """--traceback on the command line or BERT_JAX_TRACEBACK=1 (read before flags are parsed)."""
  env = os.environ.get('BERT_JAX_TRACEBACK', '').lower() in ('1', 'true', 'yes')
  return env or any(a in ('--traceback', '--traceback=true', '--traceback=1') for a in args)


# What to lower when a command runs out of device memory (errors.out_of_memory).
_MEMORY_ADVICE = {
    'pretrain': 'lower train.batch_size (or raise train.grad_accum_steps: the same batch in '
                'parts), set model.remat_policy=dots or full, shorten data.max_seq_length / '
                'train.phases, or lower eval.batch_size if it was the evaluation',
    'finetune': 'lower train.batch_size (or raise train.grad_accum_steps), data.max_seq_length '
                'or eval.batch_size',
    'eval': 'lower eval.batch_size',
    'features': 'lower --batch_size or --max_seq_length',
    'predict': 'lower --batch_size',
    'fill-mask': 'give fewer or shorter texts',
    'compile': 'lower train.batch_size or raise train.grad_accum_steps',
}


def user_error_message(error: BaseException) -> str | None:
  """The message of a mistake the user can fix, or None for a bug (which keeps its traceback)."""
  if isinstance(error, UserError):
    return str(error)
  carried = errors.from_tensorflow(error)  # A mistake found inside tf.data (one document).
  if carried is not None:
    return str(carried)
  refused = gcs.denied(error)  # Cloud Storage refused a path no check named before.
  if refused is not None:
    return str(refused)
  failing = gcs.outage(error)  # Cloud Storage failed past the retries (429, 5xx, resets).
  if failing is not None:
    return str(failing)
  if isinstance(error, (flags.Error, app.UsageError)):
    return str(error)
  backend = errors.no_backend(error)  # JAX_PLATFORMS=gpu or tpu on a machine without one.
  if backend is not None:
    return backend
  if isinstance(error, SyntaxError) and error.filename and not os.path.realpath(
      error.filename).startswith(os.path.dirname(os.path.realpath(__file__))):
    # A config file that is not valid Python (ours are).
    return f'{error.filename}:{error.lineno}: {error.msg}: {(error.text or "").strip()}'
  return None


# The kind of config (config.kind) each command with a --config runs.
_CONFIG_KIND = {'pretrain': 'pretrain', 'data': 'pretrain', 'eval': 'pretrain',
                'compile': 'pretrain', 'finetune': 'finetune'}


def _parse_flags(argv: list[str]) -> list[str]:
  """FLAGS(argv), with a flag mistake raised as a UserError (absl would exit with status 1)."""
  try:
    remaining = FLAGS(argv)
  except flags.Error as e:
    # An exception in a config file's get_config() surfaces as a flag error whose message holds
    # a traceback (ml_collections re-raises it so); the original is further down the chain.
    chain, cause = [], e.__context__
    while cause is not None:
      chain.append(cause)
      cause = cause.__context__
    if chain and isinstance(chain[0], UserError) and not str(chain[0]).startswith(
        'Error whilst parsing config file'):
      raise UserError(str(chain[0])) from e  # Raised by a flag's parser: its own message.
    if chain and str(chain[0]).startswith('Error whilst parsing config file'):
      original = chain[-1]
      if isinstance(original, UserError):
        raise UserError(str(original)) from e
      raise original  # A bug in the config file: its traceback shows where.
    command = argv[0].split()[-1]
    missing = re.findall(r'Flag --(\w+) must have a value other than None', str(e))
    if missing:
      raise UserError(f'missing required flag(s): {", ".join("--" + m for m in missing)} '
                      f'(bert-jax {command} --helpshort describes them)') from e
    if str(e).startswith('flag --config.'):
      _explain_config_overrides(argv[1:])  # A value for a key now a group: its new place.
    raise UserError(f'{e} (bert-jax {command} --helpshort lists the flags)') from e
  except (KeyError, AttributeError):
    _explain_config_overrides(argv[1:])
    raise
  if 'config' in FLAGS and FLAGS['config'].value is not None:
    # Every numeric key's range and the config's kind (the other job's config is refused
    # here, before TensorFlow or JAX load), before any work.
    config_checks.check_config(FLAGS.config, kind=_CONFIG_KIND[argv[0].split()[-1]])
  return remaining


def _run_command(name: str, args: list[str]) -> None:
  # Before the flags are defined: defining --config loads its default file and its overrides.
  _ARGV[:] = [f'bert-jax {name}'] + args
  flags.DEFINE_bool('traceback', False, 'Show the full traceback of an error (also '
                    'BERT_JAX_TRACEBACK=1), for a bug report.')
  try:
    run = _COMMANDS[name][1]()
  except (KeyError, AttributeError):  # A --config.a.b override misspelt (default --config).
    _explain_config_overrides(args)
    raise
  if any(a in _HELP_FLAGS for a in args[:args.index('--') if '--' in args else None]):
    print(command_help(name))
    sys.exit(0)

  def run_after_start_up(argv):
    _check_before_imports(name)
    compiles = name == 'compile'
    distributed = dict(coordinator_address=FLAGS.coordinator_address,
                       num_processes=FLAGS.num_processes, process_id=FLAGS.process_id,
                       mode=FLAGS.distributed) if 'distributed' in FLAGS else None
    start_up.start(name, quiet=not _traceback_wanted(args) and logging.get_verbosity() <= 0,
                   packed_compile=compiles and FLAGS.config.data.packing,
                   topology=FLAGS.topology if compiles else '', distributed=distributed)
    run(argv)
  app.run(run_after_start_up, argv=list(_ARGV), flags_parser=_parse_flags)


def _check_before_imports(name: str) -> None:
  """The command's checks that need neither TensorFlow nor JAX, made before they load (about 5 s
  of CPU): such a mistake ends in a fraction of a second. The drivers make them again, for
  callers other than the command line, with the same message."""
  # A file where the run's folder should be (checked again where the run makes its workdir).
  trains_vocab_there = name == 'data' and not FLAGS.config.data.vocab_file
  # (A --sweep names the folder of its first rate, <workdir>/lr_<rate>, in its message.)
  if name == 'pretrain' or (name == 'finetune' and not FLAGS.sweep) or trains_vocab_there:
    workdir = FLAGS.workdir
    if workdir and not fileio.is_remote(workdir) and os.path.isfile(workdir):
      # As the driver names it: the drivers make it absolute, `data` keeps it as given.
      fileio.check_output_dir(workdir if trains_vocab_there else fileio.workdir_path(workdir),
                              '--workdir')


def main(argv: list[str] | None = None) -> None:
  """Runs `bert-jax <command> [--flags]`; a user's mistake exits with one message, status 2
  (Cloud Storage failing past the retries: one message, EXIT_PREEMPTED).

  `main()` is the program (the entry point, `python -m bert_jax.cli`): the process ends with
  it, and what the start-up froze stays frozen, so that the interpreter's exit does not walk it
  (its collections at exit took about 1 s of CPU more with it unfrozen). `main(argv)` returns
  it to the collector, for a caller that goes on."""
  program = argv is None
  argv = list(sys.argv if argv is None else argv)
  if len(argv) < 2 or argv[1] in ('-h', '--help', 'help'):
    print(_usage())
    sys.exit(0 if len(argv) >= 2 else 2)
  name = argv[1]
  if name not in _COMMANDS:
    close = difflib.get_close_matches(name, list(_COMMANDS), n=1)
    hint = f' (did you mean {close[0]!r}?)' if close else ''
    print(f'bert-jax: unknown command {name!r}{hint}\n\n{_usage()}', file=sys.stderr)
    sys.exit(2)
  logging.get_absl_handler().addFilter(console.ours_or_a_warning)
  previous_handlers = console.stop_at_once_on_signals(name)
  try:
    _run_command(name, argv[2:])
  except errors.Preempted as e:
    print(f'\nbert-jax {name}: {e}', flush=True)
    # Not sys.exit: the interpreter's exit would abort a compile SIGTERM left running.
    start_up.exit_now(errors.EXIT_PREEMPTED)
  except Exception as e:  # pylint: disable=broad-except
    message = user_error_message(e)
    memory = errors.out_of_memory(e)
    if message is None and memory:
      message = f'{memory}: {_MEMORY_ADVICE.get(name, "use smaller inputs")}'
    if message is None:
      raise
    if _traceback_wanted(argv[2:]):
      traceback.print_exc()
    sys.stderr.flush()
    print(f'bert-jax {name}: error: {message}', file=sys.stderr, flush=True)
    # Cloud Storage down past the retries: rerun (as after a preemption), not a mistake.
    sys.exit(errors.EXIT_PREEMPTED if gcs.outage(e) is not None else errors.EXIT_USER_ERROR)
  finally:
    for signum, handler in previous_handlers.items():  # main() called in a process that goes on
      signal.signal(signum, handler)
    if not program:
      gc.unfreeze()

if __name__ == '__main__':
  main()
