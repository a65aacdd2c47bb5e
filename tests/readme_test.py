"""The README is a contract: every command it shows runs here as a user types it, or is listed
with the reason why not (and then checked as far as it can be without running it).

What counts as a command (`readme_commands`), in README.md and launch/README.md: each logical
line of a shell block (a ```sh block or an indented block; a trailing `\\` continues the line,
`#` starts a comment, `&&` separates commands), and each inline `code` span whose first word,
after any `NAME=value` assignments, is a program (PROGRAMS) followed by at least one more word.
Not commands, but checked: a span that names a subcommand (`bert-jax eval`:
test_named_subcommands_exist) and a pattern (`bert-jax data --stats=N`, `<command>`, `...`,
`PATH`: test_patterns_name_real_subcommands_and_flags). Quoted output (`bert-jax pretrain:
error: ...`) is neither.

Every command matches one entry of COMMANDS, the one table to look at: the command itself, or a
prefix of it that ends at a word (the longest wins), so one entry serves a family
(`python3 benchmarks/gpu.py`). To add a README command, add its line there:

  Run(group, append, says)  runs it in the group's scratch folder (the checkout's files linked,
                      a small corpus, sentences.txt and GLUE's MRPC files there) as a user's
                      shell would: `bash -c`, the `bert-jax` entry point installed for this
                      interpreter first on PATH (running this checkout: PYTHONPATH), and none of
                      the variables tests/conftest.py sets (CONFTEST_VARIABLES), unless the
                      command sets them. A group's first `bert-jax` command starts the entry
                      point's interpreter; the later ones run the entry point in a fork of a
                      server that has imported what it imports (tests/forkserver.py). `append`
                      is added at the end: absl and argparse keep a flag's last value, so
                      appended flags make sizes tiny and move inputs and outputs into the folder
                      ({tmp}); the command itself is never edited. It must exit 0 with no
                      traceback and print each string of `says` (what the README says it
                      prints); bert-jax and this checkout's scripts also with no line at error
                      level and none of the start-up lines bert-jax holds back
                      (`processes.check_console`). A group's commands run in README order, in
                      one test, so later ones use what earlier ones wrote (one pre-training
                      workdir serves every command that reads a checkpoint).
  NotHere(reason)     cannot run on a CPU machine without accounts (a TPU, a GPU, a cloud
                      project, a cluster), installs packages, takes minutes to hours (a
                      benchmark, a compile of BERT-large), or runs the test suite or CI itself;
                      the reason says which, and which test covers the same code where one
                      does. test_commands_not_run_here_are_checked_statically then checks what
                      it can: the files it names exist; a bert-jax command parses (subcommand,
                      flags, config file and overrides, through cli's own parser); a script's
                      flags are defined in it; a pytest command's files exist and its `-k`
                      selects a test.

A command matching no entry fails test_every_command_is_run_or_listed with the line to add; an
entry matching no command fails it too. The notebooks' install cells are run by
tests/notebooks_test.py (with pip and git faked).
"""

import ast
import dataclasses
import importlib.util
import json
import os
import random
import re
import resource
import shlex
import shutil
import subprocess
import sys
import time

import pytest

import processes

READMES = ('README.md', 'launch/README.md')
# First words of a command (after NAME=value assignments).
PROGRAMS = ('bert-jax', 'python', 'python3', 'pip', 'pytest', 'bash', 'sh', 'sbatch', 'nice',
            'kubectl', 'gcloud', 'scontrol', 'du', 'tr', 'tensorboard', 'git',
            'launch/gpu_node.sh')
# The default workdir of `bert-jax pretrain` (bert_jax.fileio.default_workdir('smoke')): the
# commands that read it name it as written; the test moves it into its folder.
SMOKE = '/tmp/bert-jax/smoke'


# The groups of Run entries, one test each (below); 'hub' talks to a Hub on loopback.
GROUPS = ('pretrain', 'vocab', 'quick', 'hub')


@dataclasses.dataclass(frozen=True)
class Run:
  group: str
  append: str = ''
  says: tuple[str, ...] = ()
  # A package the README says the command needs beside the install line's (torch, which CI's
  # current stack does not install: setup.cfg): without it, the command is skipped, said so.
  needs: str = ''


@dataclasses.dataclass(frozen=True)
class NotHere:
  reason: str


# Tiny settings for a pre-training run of the smoke config: 4 steps in all, each run stopping
# at its own step (train.stop_at_step keeps the schedule, hence the compiled step, the same:
# reruns load their steps from the workdir's compilation cache).
_TINY_PRETRAIN = ('--config.train.steps=4 --config.train.warmup_steps=0 '
                  '--config.train.batch_size=8 --config.eval.batch_size=8 --config.eval.steps=1 '
                  '--config.log.progress=false')
# What `bert-jax pretrain` prints at its end (README, "The two commands").
_PRETRAIN_SAYS = ('checkpoints:', 'metrics:', 'TensorBoard:', 'last eval:')
# The guide's runs at tiny sizes (one phase of 32 tokens), the tiny model the test's Hub holds.
_TINY_HUB = ('--config.model.size=tiny --config.train.phases= --config.data.max_seq_length=32 '
             '--config.data.max_predictions_per_seq=5 --config.data.shuffle_buffer=50 '
             f'{_TINY_PRETRAIN} --config.train.steps=2')
_INSTALLS = 'installs packages; .ci/run installs the checkout first (pip install -e ".[test]")'
_TPU = 'needs a Cloud TPU and a Google Cloud project'
_GPU = 'needs NVIDIA GPUs'
_CLUSTER = 'needs a Google Cloud project'
_COMPILE = ('compiles BERT-large/base ahead of time: minutes of 2 cores per command; '
            'tests/aot_test.py and tests/aot_gpu_test.py compile the same command at tiny sizes')
_GPU_COMPILE = _COMPILE + ' (with the gpuaot extra)'
_BENCHMARK = ('a benchmark (the figure\'s own command, minutes to hours); '
              'tests/benchmarks_test.py runs the script at tiny sizes')
_SUITE = ('runs the test suite, which this test is part of; what it names is checked here '
          '(files, and the tests `-k` selects)')

_RECIPES = ('the benchmark itself (an hour or more of this loaded 2-core machine); '
            'tests/benchmarks_test.py checks its task, configs and FLOPs budget')

COMMANDS: dict[str, Run | NotHere] = {
    # ---- README.md: the two commands, quickstart --------------------------------------------
    'python3 -m pip install *': NotHere(_INSTALLS),
    'bert-jax pretrain': Run('pretrain', f'--workdir={{tmp}}/smoke {_TINY_PRETRAIN} '
                             '--config.train.stop_at_step=2',
                             _PRETRAIN_SAYS),
    'python3 -m pytest -q -n 2 --dist worksteal --durations=20 tests': NotHere(
        _SUITE + '; .ci/run runs exactly this on the floor stack'),
    # "Run the same command again and it resumes": on the run above, one step further.
    'bert-jax pretrain --workdir=/tmp/run --config.train.steps=1000 --config.model.size=mini':
        Run('pretrain', f'--workdir={{tmp}}/smoke {_TINY_PRETRAIN} --config.train.stop_at_step=3 '
            '--config.model.size=tiny', ('Resumed from step 2',) + _PRETRAIN_SAYS),
    'du -sb': NotHere('measures the size of the installed gpuaot packages (how the figure '
                      'beside it was measured)'),
    'CI_STACKS=current bash .ci/run': NotHere(_SUITE + ' (CI\'s current stack)'),
    'CI=true bash .ci/run': NotHere(_SUITE + ' (CI, both stacks)'),
    # ---- README.md: TPU pods and GPU clusters ----------------------------------------------
    'python launch/tpu.py *': Run('quick', '--dry_run'),
    'bert-jax compile *': NotHere(_COMPILE),
    'bert-jax compile --topology=h100': NotHere(_GPU_COMPILE),
    'bert-jax compile --config=configs/bert_base.py --topology=h100 *': NotHere(_GPU_COMPILE),
    'sbatch --nodes=4 launch/gpu_slurm.sbatch': NotHere(
        'submits a job to a SLURM cluster; launch/README.md\'s DRY_RUN=1 line runs the script'),
    # ---- README.md: experiment trackers ------------------------------------------------------
    # A run of its own beside the smoke run, compiled steps loaded from that run's cache.
    'pip install -e ".[wandb]"': NotHere(_INSTALLS),
    'WANDB_MODE=offline bert-jax pretrain --config.log.writers=tensorboard,wandb': Run(
        'pretrain', f'--workdir={{tmp}}/wandb_run {_TINY_PRETRAIN} --config.train.stop_at_step=2 '
        '--config.checkpoint.compilation_cache_dir={tmp}/smoke/compilation_cache',
        _PRETRAIN_SAYS),
    # ---- README.md: your own corpus, continuing a Hub checkpoint (a Hub on loopback) -------
    'pip install -e ".[parquet]"': NotHere(_INSTALLS),
    "bert-jax vocab --input='corpus/*.txt' --output=vocab.txt --vocab_size=30522": Run(
        'hub', '--vocab_size=600', ('Wrote vocab.txt',)),
    "bert-jax pretrain --config=bert_base --workdir=/tmp/my_bert "
    "--config.data.input='corpus/*.txt' --config.data.vocab_file=vocab.txt": Run(
        'hub', f'--workdir={{tmp}}/my_bert {_TINY_HUB}', _PRETRAIN_SAYS),
    "bert-jax pretrain --config=continue_pretraining --workdir=/tmp/domain_bert "
    "--config.data.input='domain/*.parquet' --config.checkpoint.push_to_hub=ORG/domain-bert":
        Run('hub', f'--workdir={{tmp}}/domain_bert {_TINY_HUB} --config.checkpoint.every_steps=1',
            _PRETRAIN_SAYS),
    "bert-jax eval --checkpoint=/tmp/domain_bert --config=continue_pretraining "
    "--config.data.input='domain/*.parquet'": Run(
        'hub', f'--checkpoint={{tmp}}/domain_bert {_TINY_HUB}', ('"mlm_accuracy"',)),
    'bert-jax convert --input=/tmp/domain_bert --format=hf --push_to_hub=ORG/domain-bert': Run(
        'hub', '--input={tmp}/domain_bert'),
    'python3 -c "from transformers import pipeline; print(pipeline(\'fill-mask\', '
    'model=\'ORG/domain-bert\')(\'the model reads [MASK] text.\'))"': Run(
        'hub', '', ("'token_str'",), needs='torch'),
    'bert-jax fill-mask --checkpoint=hf://ORG/domain-bert@main "the model reads [MASK] text."':
        Run('hub'),
    'pip install -e ".[hub]"': NotHere(_INSTALLS),
    'bert-jax convert --input=/tmp/bert-jax/smoke --format=hf --push_to_hub=ORG/NAME': Run(
        'hub', '--input={tmp}/my_bert'),
    # ---- README.md: attention, LayerNorm ----------------------------------------------------
    'bert-jax pretrain --config=configs/bert_base_tpu_speed.py ...': NotHere(
        _TPU + ' (splash attention trains on TPUs only); tests/aot_test.py compiles it'),
    'bert-jax pretrain --config=configs/bert_base.py ... --config.model.attention_impl=cudnn '
    '--config.model.attention_probs_dropout_prob=0': NotHere(
        _GPU + ' (cuDNN attention); tests/aot_gpu_test.py compiles it for an H100'),
    'python3 benchmarks/gelu.py': NotHere(
        _GPU + ' (times the Pallas kernels); tests/benchmarks_test.py runs it in interpret mode'),
    'python3 benchmarks/layernorm.py': NotHere(
        _GPU + ' (times the Pallas kernel); tests/layer_norm_test.py runs it in interpret mode'),
    # ---- README.md: Cloud Storage -------------------------------------------------------------
    'gcloud auth application-default login': NotHere(
        _CLUSTER + ' and a browser; tests/gcs_test.py runs gs:// paths against a local server'),
    # ---- README.md: vocabularies, weights, fine-tuning ---------------------------------------
    "bert-jax vocab --input='corpus/*.txt' --output=vocab.txt --vocab_size=30522 "
    '--num_unused=100': Run('vocab', '', ('Wrote vocab.txt',)),
    "bert-jax vocab --input='corpus/*.txt' --output=spm --kind=sentencepiece "
    '--vocab_size=32000': Run('vocab', '', ('Wrote spm.model',)),
    'bert-jax vocab --input=tfds:wikipedia/20230601.en --tfds_text_key=text --output=vocab.txt':
        NotHere('needs TFDS\'s Wikipedia prepared (tens of GB; bert_jax never downloads); '
                'tests/vocab_test.py trains from a TFDS dataset'),
    'bert-jax pretrain --config=configs/modern.py:tiny --workdir=/tmp/bert-jax/modern': Run(
        'pretrain', f'--workdir={{tmp}}/modern --config.data.vocab_file={{tmp}}/smoke/vocab.txt '
        f'{_TINY_PRETRAIN}'),
    'bert-jax convert --input=/tmp/bert-jax/modern --output=/tmp/modern_hf --format=modernbert':
        Run('pretrain', '--input={tmp}/modern --output={tmp}/modern_hf'),
    'bert-jax compile --config=configs/modern.py --topology=v5e:2x2 --config.train.batch_size=4 '
    '--config.train.phases=1:8192:2464 --config.model.attention_impl=splash': NotHere(
        _COMPILE + '; tests/aot_test.py compiles the modern options at tiny sizes'),
    'bert-jax compile --config=configs/modern.py --topology=h100 --config.train.batch_size=1 '
    '--config.train.phases=1:8192:2464 --config.model.attention_impl=cudnn '
    '--config.model.layer_norm_impl=pallas': NotHere(_GPU_COMPILE),
    'nice python benchmarks/recipes.py --paper_steps=600 --seeds=0,1': NotHere(_RECIPES),
    'nice python benchmarks/recipes.py --paper_steps=200 --seeds=0,1 --finetune_epochs=2 '
    '--finetune_lr=1e-4': NotHere(_RECIPES),
    'nice python benchmarks/recipes.py --paper_steps=600 --seeds=0,1 --task=replaced_word '
    '--finetune_epochs=5 --finetune_lr=1e-4': NotHere(_RECIPES),
    'bert-jax convert --input=path/to/hf_dir --output=out/ --format=bert_jax':
        Run('pretrain', '--input={tmp}/smoke', ('Wrote bert_jax checkpoint to out/',)),
    'bert-jax finetune --config=configs/finetune_glue.py:mrpc '
    '--config.train.init_checkpoint=/ckpt/uncased_L-12_H-768_A-12 '
    '--config.task.data_dir=/data/glue --workdir=/tmp/mrpc': Run(
        'pretrain', '--config.train.init_checkpoint={tmp}/smoke '
        '--config.task.data_dir={tmp}/glue --workdir={tmp}/mrpc --config.train.epochs=1 '
        '--config.data.max_seq_length=32 --config.train.batch_size=8 '
        '--config.eval.batch_size=8 --config.log.progress=false'),
    'python benchmarks/finetune_vs_transformers.py *': NotHere(
        'a benchmark of 45 minutes that needs the packages above (not in the [test] extra)'),
    'launch/gpu_node.sh --coordinator=node0:12345 --num_nodes=2 --node_rank=0 '
    '--config=configs/bert_large.py --workdir=/shared/runs/bert_large '
    '--config.train.batch_size=1024': Run('quick', '--dry_run'),
    'launch/gpu_node.sh --mode=finetune': Run(
        'quick', '--config=finetune_glue:mrpc --workdir={tmp}/ft --dry_run', ('finetune',)),
    # ---- README.md: using a model ----------------------------------------------------------
    f'bert-jax eval --checkpoint={SMOKE} --config=smoke': Run(
        'pretrain', '--checkpoint={tmp}/smoke --config.eval.batch_size=8 '
        '--config.eval.steps=1', ('"mlm_accuracy"',)),
    'bert-jax eval --checkpoint=path/to/bert-base-uncased *': NotHere(
        'needs a downloaded bert-base-uncased (no internet here); the line above runs the same '
        'command on the smoke run'),
    'bert-jax fill-mask --checkpoint=path/to/bert-base-uncased --top_k=5 '
    '"The capital of France is [MASK]." "Paris is the [MASK] of France."':
        Run('pretrain', '--checkpoint={tmp}/smoke'),
    f'bert-jax features --init_checkpoint={SMOKE} --input=sentences.txt --output=features.jsonl':
        Run('pretrain', '--init_checkpoint={tmp}/smoke', ('Wrote features of 2 texts',)),
    'bert-jax predict --workdir=/tmp/mrpc --input=/data/glue/MRPC/dev.tsv '
    '--output=/tmp/mrpc_dev.jsonl': Run(
        'pretrain', '--workdir={tmp}/mrpc --input={tmp}/glue/MRPC/dev.tsv '
        '--output={tmp}/mrpc_dev.jsonl'),
    'bert-jax predict --workdir=/tmp/squad *': NotHere(
        'needs a SQuAD fine-tuning run (minutes); tests/finetune_test.py fine-tunes SQuAD and '
        'runs predict on it'),
    'bert-jax predict --workdir=/tmp/ner *': NotHere(
        'needs a NER fine-tuning run (minutes); tests/finetune_test.py fine-tunes NER and runs '
        'predict on it'),
    'bert-jax predict --workdir=/tmp/swag *': NotHere(
        'needs a SWAG fine-tuning run (minutes); tests/swag_test.py fine-tunes SWAG and runs '
        'predict on its CSV and JSONL layouts'),
    # ---- README.md: serving ----------------------------------------------------------------
    'bert-jax export --workdir=/tmp/mrpc --output=mrpc_export --format=savedmodel': Run(
        'pretrain', '--workdir={tmp}/mrpc'),
    'saved_model_cli show --dir mrpc_export --tag_set serve --signature_def serving_default':
        Run('pretrain'),
    'python3 -c \'import tensorflow as tf, tensorflow_text; model = '
    'tf.saved_model.load("mrpc_export"); print(model.signatures["serving_default"]('
    'text_a=tf.constant(["The cat sat."]), text_b=tf.constant(["A cat was sitting."])))\'':
        Run('pretrain'),
    'pip install -e ".[onnx]"': NotHere(_INSTALLS),
    'python benchmarks/serving.py --size=base --examples=64': NotHere(
        _BENCHMARK.replace('tests/benchmarks_test.py', 'tests/export_test.py')),
    'bert-jax convert --input=/tmp/mrpc --output=mrpc_hf --format=hf': Run(
        'pretrain', '--input={tmp}/mrpc'),
    'python3 -c \'import torch, transformers; model = '
    'transformers.AutoModelForSequenceClassification.from_pretrained("mrpc_hf").eval(); ids = '
    'torch.ones(1, 8, dtype=torch.long); names = ["input_ids", "attention_mask", '
    '"token_type_ids"]; torch.onnx.export(model, (ids, ids, ids), "mrpc.onnx", dynamo=False, '
    'input_names=names, output_names=["logits"], dynamic_axes={n: {0: "batch", 1: "length"} '
    'for n in names})\'': Run('pretrain', needs='torch'),
    # ---- README.md: performance ------------------------------------------------------------
    'pytest tests/parity_test.py *': NotHere(_SUITE),
    'pytest tests/train_test.py -k sigterm_waits -s': NotHere(_SUITE),
    'python benchmarks/input_pipeline.py': NotHere(_BENCHMARK),
    'python benchmarks/train_step.py *': NotHere(_BENCHMARK),
    'python benchmarks/corpus.py *': NotHere(_BENCHMARK),
    'python benchmarks/finetune_buckets.py *': NotHere(_BENCHMARK),
    'python benchmarks/packing.py *': NotHere(_BENCHMARK),
    'nice -n 10 python benchmarks/packing.py *': NotHere(_BENCHMARK),
    'python3 benchmarks/gpu.py *': NotHere(_GPU),
    'JAX_PLATFORMS=cpu python3 benchmarks/gpu.py *': NotHere(
        'the FP8 emulation on the CPU: 200 steps, 13 minutes of 2 cores; '
        'tests/benchmarks_test.py runs the script at tiny sizes'),
    # ---- README.md: troubleshooting ----------------------------------------------------------
    'bert-jax --help': Run('quick', '', ('exit status:', '143')),
    # The same workdir again: it resumes, one step further.
    'bert-jax pretrain --config=configs/smoke.py': Run(
        'pretrain', f'--workdir={{tmp}}/smoke {_TINY_PRETRAIN}',
        ('Resumed from step 3',) + _PRETRAIN_SAYS),
    # ---- launch/README.md --------------------------------------------------------------------
    'F="--name=bert-large --zone=us-central2-b --accelerator_type=v4-32 --capacity=spot"':
        Run('quick'),
    'kubectl apply *': NotHere(
        'needs a Kubernetes cluster: kubectl asks its API server even for --dry-run=client; '
        'tests/launch_test.py checks the manifest as data'),
    'gcloud compute tpus queued-resources': NotHere(
        _CLUSTER + '; the dry runs of launch/tpu.py above print the gcloud commands it runs'),
    'gcloud alpha': NotHere(_CLUSTER + '; as above'),
    'CONFIG=configs/bert_large.py WORKDIR=/shared/runs/bert_large sbatch --nodes=4 '
    'launch/gpu_slurm.sbatch --config.train.batch_size=1024': NotHere(
        'submits a job to a SLURM cluster; the DRY_RUN=1 line below runs the script'),
    "DRY_RUN=1 CONFIG=configs/bert_large.py WORKDIR=/shared/runs/bert_large "
    "SLURM_JOB_NODELIST='node[01-02]' SLURM_NNODES=2 bash launch/gpu_slurm.sbatch": Run(
        'quick', '', ('# task 1 on node02:',)),
    'scontrol requeue': NotHere('requeues a SLURM job from inside it; tests/launch_test.py runs '
                                'the sbatch script with a fake scontrol'),
}


def entry(command: str) -> tuple[str, Run | NotHere] | None:
  """(key, entry) of COMMANDS for `command`: the key equal to it, or the longest key `PREFIX *`
  whose PREFIX starts it; None if none."""
  if command in COMMANDS:
    return command, COMMANDS[command]
  prefixes = [key for key in COMMANDS
              if key.endswith(' *') and (command + ' ').startswith(key[:-1])]
  if not prefixes:
    return None
  key = max(prefixes, key=len)
  return key, COMMANDS[key]


# ---- Reading the commands ------------------------------------------------------------------


_ASSIGNMENT = re.compile(r'^[A-Za-z_]\w*=')
# Placeholders: the span shows the shape of a command, not one to type.
_PATTERN = re.compile(r'<\w|\.\.\.|=N\b|\bPATH\b|\bDIR\b')


def program(command: str) -> str:
  """The first word of a command that is not a NAME=value assignment ('' if none)."""
  return next((w for w in command.split(' ') if not _ASSIGNMENT.match(w)), '')


def _strip_comment(line: str) -> str:
  """The line without a trailing `# comment` (a # outside quotes, after a space)."""
  quote = None
  for i, c in enumerate(line):
    if quote:
      quote = None if c == quote else quote
    elif c in '\'"':
      quote = c
    elif c == '#' and (i == 0 or line[i - 1].isspace()):
      return line[:i].rstrip()
  return line.rstrip()


def _logical_lines(block: list[tuple[int, str]]) -> list[tuple[int, str]]:
  out, current, first = [], '', None
  for number, line in block:
    line = _strip_comment(line.strip())
    if not current and not line:
      continue
    first = first or number
    if line.endswith('\\'):
      current += line[:-1].rstrip() + ' '
      continue
    current += line
    out.extend((first, ' '.join(part.split())) for part in current.split(' && '))
    current, first = '', None
  return out


def readme_spans(path: str) -> list[tuple[int, str, str]]:
  """(line number, text, kind) of every command `path` shows (kind 'command'), every span that
  names a subcommand ('name') and every pattern ('pattern'); see the module docstring."""
  with open(path, encoding='utf-8') as f:
    lines = f.read().split('\n')
  found, prose, i = [], [], 0
  while i < len(lines):
    fence = re.match(r'^```(\w*)\s*$', lines[i])
    if fence:
      end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith('```'))
      if fence.group(1) in ('sh', 'bash', 'shell', 'console'):
        found += [(n, c, 'command') for n, c in
                  _logical_lines([(j + 1, lines[j]) for j in range(i + 1, end)])]
      prose.append((i + 1, ''))
      i = end + 1
    elif lines[i].startswith('    ') and (not prose or not prose[-1][1].strip()) and (
        program(lines[i].strip()) in PROGRAMS):
      block = []
      while i < len(lines) and lines[i].startswith('    '):
        block.append((i + 1, lines[i][4:]))
        i += 1
      found += [(n, c, 'command') for n, c in _logical_lines(block)]
    else:
      prose.append((i + 1, lines[i]))
      i += 1
  text, starts = '', []
  for number, line in prose:
    starts.append((len(text), number))
    text += line + '\n'
  for span in re.finditer(r'`([^`]+)`', text):
    command = ' '.join(span.group(1).split())
    words = command.split(' ')
    first = program(command)
    rest = words[words.index(first) + 1:] if first in PROGRAMS else []
    # A program and a word after it; `bert-jax pretrain: error: ...` is output.
    if not rest or rest[0].endswith(':'):
      continue
    number = max(n for s, n in starts if s <= span.start())
    if first == 'bert-jax' and len(words) == 2 and re.fullmatch(r'[a-z][\w|-]*', rest[0]):
      found.append((number, command, 'name'))
    elif _PATTERN.search(command):
      found.append((number, command, 'pattern'))
    else:
      found.append((number, command, 'command'))
  return sorted(found, key=lambda item: item[0])  # README order: blocks and spans interleaved.


def readme_commands(path: str) -> list[tuple[int, str]]:
  """(line number, command) of every command `path` shows."""
  return [(n, c) for n, c, kind in readme_spans(path) if kind == 'command']


def _all(kind: str = 'command') -> list[tuple[str, int, str]]:
  return [(path, number, text) for path in READMES
          for number, text, k in readme_spans(os.path.join(processes.ROOT, path)) if k == kind]


def test_every_command_is_run_or_listed():
  shown = _all()
  missing = [f'{path}:{number}: {command}' for path, number, command in shown
             if entry(command) is None]
  assert not missing, (
      'README commands that no test runs. Add each to COMMANDS in tests/readme_test.py, as '
      'Run(group, append, says) (run here, tiny sizes by appended flags) or NotHere(reason):'
      '\n  ' + '\n  '.join(missing))
  # A group no test runs would skip its commands silently.
  assert {e.group for e in COMMANDS.values() if isinstance(e, Run)} <= set(GROUPS)
  used = {entry(command)[0] for _, _, command in shown}
  gone = sorted(set(COMMANDS) - used)
  assert not gone, ('COMMANDS in tests/readme_test.py has entries that match no command a '
                    'README shows; remove or update them:\n  ' + '\n  '.join(gone))


def test_the_command_reader(tmp_path):
  block = [(1, '# a comment'), (2, 'bert-jax x --a=1 \\'), (3, '    --b="# not a comment"  # one'),
           (4, 'pip install -e . && bert-jax y')]
  assert _logical_lines(block) == [(2, 'bert-jax x --a=1 --b="# not a comment"'),
                                   (4, 'pip install -e .'), (4, 'bert-jax y')]
  readme = tmp_path / 'README.md'
  readme.write_text(
      'Run `CI_STACKS=current bash .ci/run`, `bert-jax --help`, `pytest tests/a_test.py -k b`\n'
      'or `kubectl apply -f x.yaml` and `gcloud auth login`. `bert-jax eval` and\n'
      '`bert-jax pretrain|finetune` name commands; `bert-jax data --stats=N` is a pattern,\n'
      '`bert-jax x: error: y` output, `bert-jax` a program, `--flag=1` a flag.\n\n'
      '    python3 x.py \\\n        --a=1\n')
  assert readme_spans(str(readme)) == [
      (1, 'CI_STACKS=current bash .ci/run', 'command'), (1, 'bert-jax --help', 'command'),
      (1, 'pytest tests/a_test.py -k b', 'command'), (2, 'kubectl apply -f x.yaml', 'command'),
      (2, 'gcloud auth login', 'command'), (2, 'bert-jax eval', 'name'),
      (3, 'bert-jax pretrain|finetune', 'name'), (3, 'bert-jax data --stats=N', 'pattern'),
      (6, 'python3 x.py --a=1', 'command')]
  assert entry('python launch/tpu.py delete $F') == (
      'python launch/tpu.py *', COMMANDS['python launch/tpu.py *'])
  assert entry('python launch/tpu.pyc') is None
  # The longest key wins: the exact command over a prefix of it.
  assert entry('bert-jax compile --topology=h100')[0] == 'bert-jax compile --topology=h100'


def test_the_commands_that_read_pretrainings_default_workdir_name_it():
  from bert_jax import fileio  # pylint: disable=g-import-not-at-top
  assert fileio.default_workdir('smoke') == SMOKE  # Issue 34: eval named /tmp/bert_smoke.


def test_every_config_is_in_the_config_table():
  with open(os.path.join(processes.ROOT, 'README.md'), encoding='utf-8') as f:
    table = f.read().split('| Config | What |', 1)[1].split('\n\n', 1)[0]
  shipped = sorted(f for f in os.listdir(os.path.join(processes.ROOT, 'configs'))
                   if f.endswith('.py') and not f.startswith('_'))
  assert [f for f in shipped if f'`{f}' not in table] == []


# ---- Checking what is not run --------------------------------------------------------------


# Parses each bert-jax command given on stdin (JSON: [subcommand, args, parse]) with the
# command's own flag definitions and parser (cli._parse_flags: flags, the config file, its
# overrides and their checks), each in a forked child (flags are defined once per process);
# prints one JSON line each: the flags defined and the error, if any.
_PARSER = r'''
import json, os, sys
from bert_jax import cli
for name, args, parse in json.loads(sys.stdin.read()):
  read, write = os.pipe()
  pid = os.fork()
  if pid == 0:
    os.close(read)
    out = {'error': None, 'flags': []}
    try:
      cli._ARGV[:] = [f'bert-jax {name}'] + args
      cli._COMMANDS[name][1]()
      out['flags'] = sorted(cli.FLAGS)
      if parse:
        cli._parse_flags([f'bert-jax {name}'] + args)
    except BaseException as e:
      out['error'] = f'{type(e).__name__}: {e}'
    os.write(write, json.dumps(out).encode())
    os._exit(0)
  os.close(write)
  data = b''
  while chunk := os.read(read, 1 << 16):
    data += chunk
  os.close(read)
  os.waitpid(pid, 0)
  print(data.decode(), flush=True)
'''


def _parse_bert_jax(commands: list[tuple[str, list[str], bool]]) -> list[dict]:
  env = {k: v for k, v in os.environ.items() if k != 'JAX_PLATFORMS'}
  env['PYTHONPATH'] = processes.ROOT
  proc = subprocess.run([sys.executable, '-c', _PARSER], input=json.dumps(commands), env=env,
                        cwd=processes.ROOT, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return [json.loads(line) for line in proc.stdout.splitlines()]


def _repo_paths(words: list[str]) -> list[str]:
  """The checkout's files a command names (as a word or a flag's value; a config's `:arg`
  dropped)."""
  tops = ('bert_jax/', 'configs/', 'launch/', 'benchmarks/', 'tests/', 'notebooks/', '.ci/')
  values = [w.split('=', 1)[-1].split(':')[0] for w in words]
  return [v for v in values if v.startswith(tops) or v == 'tests']


def _test_names(path: str) -> list[str]:
  with open(path, encoding='utf-8') as f:
    tree = ast.parse(f.read())
  return [node.name for node in ast.walk(tree)
          if isinstance(node, ast.FunctionDef) and node.name.startswith('test')]


def _static_problems(command: str) -> list[str]:
  """What is wrong in a command not run here, as far as reading it and the checkout tells."""
  words = shlex.split(command)
  words = words[[i for i, w in enumerate(words) if not _ASSIGNMENT.match(w)][0]:]
  problems = [f'{path}: no such file in the checkout' for path in _repo_paths(words)
              if not os.path.exists(os.path.join(processes.ROOT, path))]
  while words and words[0] in ('nice', '-n', '10'):
    words = words[1:]
  script = next((w for w in words[1:2] if w.endswith('.py')), None)
  if words[0] in ('python', 'python3') and script and not problems:
    with open(os.path.join(processes.ROOT, script), encoding='utf-8') as f:
      source = f.read()
    for flag in (w.split('=')[0][2:] for w in words[2:] if w.startswith('--')):
      name = flag[3:] if flag.startswith('no-') else flag
      if f"'--{name}'" not in source and f"'{name}'" not in source:
        problems.append(f'{script} defines no flag --{name}')
  if 'pytest' in words[:3]:
    files = [w for w in words if w.startswith('tests/') and w.endswith('.py')]
    if '-k' in words and not problems:
      keyword = words[words.index('-k') + 1]
      names = [n for f in files for n in _test_names(os.path.join(processes.ROOT, f))]
      if not any(keyword.lower() in n.lower() for n in names):
        problems.append(f'-k {keyword} selects no test of {files}')
  return problems


def test_commands_not_run_here_are_checked_statically():
  not_run = sorted({c for _, _, c in _all() if isinstance(entry(c)[1], NotHere)})
  problems = {c: p for c in not_run if (p := _static_problems(c))}
  # bert-jax commands: parsed as the command would parse them ("..." stands for flags).
  cli_commands = [c for c in not_run if program(c) == 'bert-jax']
  parsed = _parse_bert_jax([(shlex.split(c)[1], [w for w in shlex.split(c)[2:] if w != '...'],
                             True) for c in cli_commands])
  problems.update({c: [p['error']] for c, p in zip(cli_commands, parsed) if p['error']})
  assert not problems, '\n'.join(f'{c}\n  {p}' for c, p in problems.items())
  # Checks that can fail: a file, a script flag, a -k that selects nothing, a config key.
  assert _static_problems('python benchmarks/gpu.py --no-such_flag') == [
      'benchmarks/gpu.py defines no flag --such_flag']
  assert _static_problems('pytest tests/train_test.py -k no_such_test') == [
      "-k no_such_test selects no test of ['tests/train_test.py']"]
  assert _static_problems('kubectl apply -f launch/gone.yaml') == [
      'launch/gone.yaml: no such file in the checkout']
  (bad_key,) = _parse_bert_jax([('compile', ['--config.train.no_such_key=1'], True)])
  assert 'no_such_key' in bad_key['error']


def test_recorded_benchmark_runs_are_quoted_as_they_ran():
  """Each run in benchmarks/results/ records its command: the README quotes it with every flag
  it ran with (where it wrote aside)."""
  words = lambda command: sorted(re.sub(r'^--output=.*', '--output=', w)
                                 for w in command.split(' '))
  quoted = [words(command) for _, _, command in _all()]
  results = os.path.join(processes.ROOT, 'benchmarks', 'results')
  unquoted = []
  for name in sorted(os.listdir(results)):
    if not name.endswith('.json'):  # .jsonl: a microbenchmark's rows, which record no command.
      continue
    with open(os.path.join(results, name), encoding='utf-8') as f:
      command = json.load(f).get('command')
    if command and words(command) not in quoted:
      unquoted.append(f'{name}: {command}')
  assert not unquoted, '\n'.join(unquoted)


def test_named_subcommands_exist():
  from bert_jax import cli  # pylint: disable=g-import-not-at-top
  subcommands = set(cli._COMMANDS)  # pylint: disable=protected-access
  names = {(path, number, text): text.split(' ')[1].split('|') for path, number, text in
           _all('name')}
  assert names and {k: v for k, v in names.items() if not set(v) <= subcommands} == {}


def test_patterns_name_real_subcommands_and_flags():
  patterns = [text for _, _, text in _all('pattern') if program(text) == 'bert-jax'
              and not text.split(' ')[1].startswith('<')]
  assert patterns  # `bert-jax data --stats=N` among them.
  parsed = _parse_bert_jax([(p.split(' ')[1], [], False) for p in patterns])
  for pattern, result in zip(patterns, parsed):
    assert result['error'] is None, (pattern, result['error'])
    flags = [w.split('=')[0][2:] for w in pattern.split(' ')[2:] if w.startswith('--')]
    assert set(flags) <= set(result['flags']), (pattern, result['flags'])


# ---- Running them --------------------------------------------------------------------------


def test_the_entry_point_runs_this_checkout(tmp_path):
  """`bert-jax` in the commands below is the installed console script, and it imports this
  checkout's bert_jax (in a clone on CI, the install is this checkout)."""
  with open(processes.entry_point(), encoding='utf-8') as f:
    script = f.read()
  interpreter = script.splitlines()[0][2:].strip()
  # pip's trampoline for an interpreter path too long for a #! line: '''exec' "PYTHON" "$0" ...
  trampoline = re.search(r"""^'''exec' "?([^" ]+)"?""", script, re.M)
  interpreter = trampoline.group(1) if interpreter == '/bin/sh' and trampoline else interpreter
  assert 'bert_jax.cli' in script
  env = processes.user_env(str(tmp_path))
  found = subprocess.run(
      [interpreter, '-c', 'import bert_jax.cli; print(bert_jax.cli.__file__)'],
      env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120, check=True).stdout
  assert found.strip() == os.path.join(processes.ROOT, 'bert_jax', 'cli.py')
  assert shutil.which('bert-jax', path=env['PATH']) == processes.entry_point()


def _scratch(tmp_path) -> str:
  """A folder that looks like the checkout to a command (its files linked), with
  the inputs the commands name: corpus/*.txt, sentences.txt and GLUE's MRPC files."""
  for name in ('bert_jax', 'configs', 'launch', 'benchmarks', 'setup.cfg', 'pyproject.toml'):
    os.symlink(os.path.join(processes.ROOT, name), tmp_path / name)
  rng = random.Random(0)
  words = ('the model reads text and learns which word fills a masked position in each '
           'sentence of a document').split()
  sentence = lambda: ' '.join(rng.choice(words) for _ in range(rng.randint(5, 12))) + '.'
  (tmp_path / 'corpus').mkdir()
  for part in range(2):
    docs = ['\n'.join(sentence() for _ in range(rng.randint(2, 6))) for _ in range(40)]
    (tmp_path / 'corpus' / f'part-{part}.txt').write_text('\n\n'.join(docs) + '\n')
  (tmp_path / 'sentences.txt').write_text('The model reads text.\nA pair ||| of texts.\n')
  (tmp_path / 'glue' / 'MRPC').mkdir(parents=True)
  for split, n in (('train', 24), ('dev', 8)):
    rows = ['Quality\t#1 ID\t#2 ID\t#1 String\t#2 String']
    for i in range(n):
      a = sentence()
      rows.append(f'{i % 2}\t{1000 + i}\t{2000 + i}\t{a}\t{a if i % 2 else sentence()}')
    (tmp_path / 'glue' / 'MRPC' / f'{split}.tsv').write_text('\n'.join(rows) + '\n')
  return str(tmp_path)


def _children_cpu() -> float:
  usage = resource.getrusage(resource.RUSAGE_CHILDREN)
  return usage.ru_utime + usage.ru_stime


def _run_group(group: str, tmp_path, extra_env: dict[str, str] | None = None,
               prepare=None) -> dict[str, subprocess.CompletedProcess]:
  """Runs the group's commands in README order, each as written plus its appended flags, in
  one shell (so `F=...` carries to the next line), checks each (`check_console`) and returns
  each command's result. Prints each command's time (and CPU time). `prepare(folder)` adds
  inputs to the scratch folder first; `extra_env` goes to every command."""
  folder = _scratch(tmp_path)
  if prepare:
    prepare(folder)
  env = processes.user_env(folder)
  env.update(extra_env or {})
  # After the group's first `bert-jax` command (an interpreter started by the installed entry
  # point, as a user's is), `bert-jax` on PATH is a fork of a server that imported what the
  # entry point imports (tests/forkserver.py), given the entry point as its program: the same
  # arguments, environment, directory and streams, without the 8 s of imports each.
  forking = os.path.join(folder, 'forked')
  forked_env = dict(env, PATH=os.pathsep.join([forking, env['PATH']]))
  results, shell_vars, first = {}, '', True
  for path, number, command in _all():
    found = entry(command)
    if not found or not isinstance(found[1], Run) or found[1].group != group or (
        command in results):
      continue
    run = found[1]
    if len(shlex.split(command)) == 1 and '=' in command:
      shell_vars += command + '\n'  # An assignment (launch/README.md's F=...).
      continue
    if run.needs and importlib.util.find_spec(run.needs) is None:
      print(f'skipped (no {run.needs} in this Python)  {path}:{number}: {command}')
      continue
    line = f'{command} {run.append.format(tmp=folder)}'.strip()
    bert_jax = program(command) == 'bert-jax'
    forked = bert_jax and not first
    first = first and not bert_jax
    if forked and not os.path.exists(forking):  # Its server starts with the first fork.
      os.makedirs(forking)
      with open(os.path.join(forking, 'bert-jax'), 'w') as f:
        f.write('#!/bin/sh\nexec ' + shlex.join(processes.python(forked_env) +
                                                 [processes.entry_point()]) + ' "$@"\n')
      os.chmod(os.path.join(forking, 'bert-jax'), 0o755)
    start, cpu = time.monotonic(), _children_cpu()
    proc = subprocess.run(['bash', '-c', shell_vars + line], cwd=folder,
                          env=forked_env if forked else env, capture_output=True, text=True,
                          timeout=900)
    # A fork's CPU is its server's child's, not counted here.
    print(f'{time.monotonic() - start:6.1f} s '
          f'({"forked" if forked else f"{_children_cpu() - cpu:5.1f} s of CPU"})  '
          f'{path}:{number}: {command}')
    # Ours: bert-jax, or a script of this checkout (launch/, benchmarks/).
    ours = bert_jax or any(w.startswith(('launch/', 'benchmarks/'))
                           for w in command.split(' ')[:4])
    processes.check_console(f'{path}:{number}: {line}', proc, run.says, ours)
    results[command] = proc
  return results


def _output(results, start: str) -> str:
  return next(proc.stdout for command, proc in results.items() if command.startswith(start))


def test_pretraining_run_and_the_commands_that_use_it(tmp_path):
  """`bert-jax pretrain`, its reruns one step further, then eval, fill-mask, features,
  convert, and GLUE fine-tuning with predict, all on that one run; beside it, the trackers
  section's W&B offline run."""
  results = _run_group('pretrain', tmp_path)
  smoke = tmp_path / 'smoke'
  with open(smoke / 'metrics.jsonl') as f:
    rows = [json.loads(line) for line in f]
  # Each rerun resumed where the one before stopped and trained one step.
  assert [row['step'] for row in rows if 'loss' in row][-2:] == [3, 4]
  # eval (after the second run): "with that run's config: the numbers of its last evaluation".
  evaluation = json.loads(_output(results, 'bert-jax eval --checkpoint=/tmp').splitlines()[-1])
  (last,) = [row for row in rows if row['step'] == 3 and row.get('eval')]
  metrics = {k: evaluation[k] for k in ('mlm_accuracy', 'mlm_loss', 'nsp_accuracy', 'nsp_loss')}
  assert evaluation['step'] == 3
  assert metrics == pytest.approx({k: last[k] for k in metrics}, rel=1e-5)
  masks = [json.loads(line) for line in _output(results, 'bert-jax fill-mask').splitlines()
           if line.startswith('{')]
  assert [len(m['masks'][0]['predictions']) for m in masks] == [5, 5]
  with open(tmp_path / 'features.jsonl') as f:
    features = [json.loads(line) for line in f]
  # The 2-layer smoke model: the default layers are its two encoder layers.
  assert [layer['index'] for layer in features[0]['features'][0]['layers']] == [-1, -2]
  assert (tmp_path / 'out' / 'bert_config.json').exists()  # convert's --output=out/
  with open(tmp_path / 'modern_hf' / 'config.json') as f:  # The modern run, as ModernBERT.
    assert json.load(f)['architectures'] == ['ModernBertForMaskedLM']
  # Fine-tuning's workdir ends with predictions/ (the README says so), and predict reads it.
  assert (tmp_path / 'mrpc' / 'predictions' / 'dev.tsv').exists()
  with open(tmp_path / 'mrpc_dev.jsonl') as f:
    assert len(f.readlines()) == 8
  # The W&B offline run of the trackers section, beside its TensorBoard events.
  assert list((tmp_path / 'wandb_run' / 'wandb').glob('offline-run-*/run-*.wandb'))
  assert list((tmp_path / 'wandb_run').glob('events.out.tfevents.*'))


def test_vocabulary_commands(tmp_path):
  results = _run_group('vocab', tmp_path)
  assert len(results) == 2
  vocab = (tmp_path / 'vocab.txt').read_text().splitlines()
  assert vocab[:2] == ['[PAD]', '[unused0]'] and '[unused99]' in vocab
  assert (tmp_path / 'spm.model').exists()


def test_help_and_launcher_dry_runs(tmp_path):
  results = _run_group('quick', tmp_path)
  assert len(results) == 11
  assert 'gcloud compute tpus' in _output(results, 'python launch/tpu.py create')
  assert '# task 1 on node02:' in _output(results, 'DRY_RUN=1')


def _hub_inputs(folder: str) -> None:
  """The guide's inputs: domain/*.parquet (the corpus's documents, a row each, in two files) and
  a tiny BERT with a vocabulary of that corpus, for the test's Hub to hold as
  google-bert/bert-base-uncased (in folder/hub_model)."""
  import jax  # pylint: disable=g-import-not-at-top
  import pyarrow as pa  # pylint: disable=g-import-not-at-top
  import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top
  from bert_jax import convert  # pylint: disable=g-import-not-at-top
  from bert_jax import model as model_lib  # pylint: disable=g-import-not-at-top
  from bert_jax import vocab as vocab_lib  # pylint: disable=g-import-not-at-top
  texts = []
  for name in sorted(os.listdir(os.path.join(folder, 'corpus'))):
    with open(os.path.join(folder, 'corpus', name)) as f:
      texts += [doc for doc in f.read().split('\n\n') if doc.strip()]
  texts = [f'{t} {i}.' for i, t in enumerate(texts * 5)]  # Enough documents to hold some out.
  os.makedirs(os.path.join(folder, 'domain'))
  half = len(texts) // 2
  for i, rows in enumerate((texts[:half], texts[half:])):
    pq.write_table(pa.table({'text': rows}), os.path.join(folder, 'domain', f'part-{i}.parquet'))
  vocab = vocab_lib.train_wordpiece([line for t in texts for line in t.split('\n')],
                                    os.path.join(folder, 'hub_vocab.txt'), 200)
  with open(vocab) as f:
    size = len(f.read().splitlines())
  config = model_lib.config_for_size('tiny', vocab_size=size)
  params = model_lib.init_params(config, jax.random.key(0))
  convert.export_hf(config, params, os.path.join(folder, 'hub_model'), vocab, lower_case=True)


def test_the_guide_from_a_corpus_to_a_pushed_model(tmp_path):
  """The guide's commands, as written, against a Hub on loopback (HF_ENDPOINT) that holds a tiny
  BERT as google-bert/bert-base-uncased: pre-training from scratch, continued pre-training of
  the Hub model on Parquet with pushes every checkpoint, eval, the final push, and the pushed
  model in transformers' fill-mask pipeline and bert-jax fill-mask by name."""
  import hub_server  # pylint: disable=g-import-not-at-top
  with hub_server.HubServer() as hub:

    def prepare(folder):
      _hub_inputs(folder)
      files = {}
      for name in os.listdir(os.path.join(folder, 'hub_model')):
        with open(os.path.join(folder, 'hub_model', name), 'rb') as f:
          files[name] = f.read()
      hub.add_repo('google-bert/bert-base-uncased', files)

    results = _run_group('hub', tmp_path, {'HF_ENDPOINT': hub.url, 'HF_TOKEN': hub_server.TOKEN,
                                           'HF_HOME': str(tmp_path / 'hf_home')}, prepare)
  assert len(results) == (8 if importlib.util.find_spec('torch') else 7)
  pushed = hub.repos[('model', 'ORG/domain-bert')]
  assert {'step-1', 'step-2'} <= set(pushed.tags)  # Every checkpoint of the run, tagged.
  card = pushed.commits[pushed.branches['main']]['README.md'].decode()
  assert 'bert-jax pretrain --config=continue_pretraining' in card
  assert '"init_checkpoint": "hf://google-bert/bert-base-uncased"' in card
  assert ('model', 'ORG/NAME') in hub.repos
  evaluation = json.loads(_output(results, 'bert-jax eval').splitlines()[-1])
  assert {'mlm_accuracy', 'nsp_accuracy'} <= set(evaluation)
  if importlib.util.find_spec('torch'):
    assert "'token_str'" in _output(results, 'python3 -c')  # transformers' fill-mask answers.
  masks = [json.loads(line) for line in _output(results, 'bert-jax fill-mask --checkpoint=hf://')
           .splitlines() if line.startswith('{')]
  assert len(masks[0]['masks'][0]['predictions']) == 5
