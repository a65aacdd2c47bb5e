"""Publishing to the Hugging Face Hub: an exported folder with its model card, pushed once or
every N steps of a run.

- `bert-jax convert --format=hf --push_to_hub=ORG/NAME` (`push_export`): the Hugging Face
  export (model.safetensors, config.json, vocab.txt and tokenizer_config.json: what
  transformers' AutoModel and AutoTokenizer read), a model card (README.md: the run's config,
  its last metrics, the command that trained it) and one commit of all of it (`hub.push_folder`).
- `checkpoint.push_to_hub=ORG/NAME` during pre-training or fine-tuning (`Pusher`): every
  `checkpoint.push_every_steps` (0 = every checkpoint), once the checkpoint of that step is
  committed, a background thread exports what the save wrote (the Orbax step folder) and pushes
  it as one commit tagged `step-N`; `hf://ORG/NAME@step-N` then loads that step. The training
  loop never waits for it. A step counts as pushed only once its commit and tag are on the Hub
  (WORKDIR/hub_pushes.json); a failed push is a warning naming the step and the run goes on.
  The run's end waits for the pushes in flight, except in a preemption notice.
"""

import datetime
import json
import os
import queue
import tempfile
import threading
import time

from absl import logging

from bert_jax import convert
from bert_jax import fileio
from bert_jax import hub
from bert_jax import run_files
from bert_jax.errors import UserError

# The steps pushed by a run, written only after each push succeeded.
PUSHES_FILE = 'hub_pushes.json'
# What a run records of how it was started (bert-jax's command line, one line per start).
COMMAND_FILE = 'command.txt'


def step_tag(step: int) -> str:
  return f'step-{step}'


def _last_metrics(workdir: str, step: int | None = None) -> tuple[dict, dict]:
  """(last training row, last evaluation row) of a workdir's metrics.jsonl ({} if none), up to
  `step` (a push of step N while the run goes on: not the rows of later steps)."""
  path = os.path.join(workdir, 'metrics.jsonl')
  last_train, last_eval = {}, {}
  if fileio.isfile(path):
    for line in fileio.read_text(path).splitlines():
      if line.strip():
        row = json.loads(line)
        if step is not None and row.get('step', 0) > step:
          continue
        if row.get('eval') or 'split' in row:
          last_eval = row
        else:
          last_train = row
  return last_train, last_eval


# transformers' class of an export (its config.json) -> the Hub's pipeline tag.
_PIPELINES = {'BertForPreTraining': 'fill-mask', 'BertForMaskedLM': 'fill-mask',
              'BertForSequenceClassification': 'text-classification',
              'BertForTokenClassification': 'token-classification',
              'BertForQuestionAnswering': 'question-answering',
              'BertModel': 'feature-extraction'}


def model_card(repo_id: str, source: str, step: int | None = None,
               architecture: str = 'BertForPreTraining') -> str:
  """README.md of a pushed export of `source` (a training workdir, or another checkpoint): the
  Hub metadata (library, tags, the pipeline of `architecture`), how to load it, the step, the
  last metrics, the command that trained it and the run's config."""
  run_config = run_files.read_run_config(source) if fileio.isdir(source) else None
  task = ((run_config or {}).get('task') or {}).get('name', '')
  pipeline = _PIPELINES.get(architecture)
  last_train, last_eval = _last_metrics(source, step) if run_config else ({}, {})
  command_path = os.path.join(source, COMMAND_FILE)
  commands = (fileio.read_text(command_path).strip() if fileio.isfile(command_path) else '')
  what = f'fine-tuned on {task}' if task else 'pre-trained'
  at = f' at step {step}' if step is not None else ''
  lines = ['---', 'library_name: transformers']
  lines += [f'pipeline_tag: {pipeline}'] if pipeline else []
  lines += ['tags:', '- bert', '- bert_jax', '- jax', '---', '',
            f'# {repo_id.split("/")[-1]}', '',
            f'A BERT {what} with bert_jax (BERT pre-training and fine-tuning in JAX and Flax), '
            f'exported to the Hugging Face layout{at}.', '',
            '```python', 'from transformers import AutoModel, AutoTokenizer', '',
            f'tokenizer = AutoTokenizer.from_pretrained("{repo_id}")',
            f'model = AutoModel.from_pretrained("{repo_id}")', '```', '',
            f'In bert_jax: `bert_jax.load_pretrained("hf://{repo_id}")`.', '']
  if last_train or last_eval:
    lines += ['## Metrics', '']
    for title, row in (('Last training row', last_train), ('Last evaluation', last_eval)):
      if row:
        lines += [f'{title} (step {row.get("step")}):', '', '| metric | value |', '|---|---|']
        lines += [f'| {k} | {v:.6g} |' if isinstance(v, float) else f'| {k} | {v} |'
                  for k, v in row.items() if k not in ('step', 'eval')]
        lines.append('')
  if commands:
    lines += ['## How it was trained', '', '```sh', commands, '```', '']
  if run_config:
    lines += ['## Config', '', '```json', json.dumps(run_config, indent=2, sort_keys=True),
              '```', '']
  lines += [f'Exported from `{source}` by `bert-jax convert --format=hf` on '
            f'{datetime.date.today().isoformat()}.', '']
  return '\n'.join(lines)


def export_for_hub(source: str, out_dir: str, repo_id: str, step: int | None = None) -> None:
  """The Hugging Face export of `source` (step `step` of a workdir) and its model card."""
  convert.convert(source, out_dir, 'hf', step=step)
  architecture = fileio.read_json(os.path.join(out_dir, 'config.json'))['architectures'][0]
  fileio.write_text(os.path.join(out_dir, 'README.md'),
                    model_card(repo_id, source, step, architecture))


def push_export(source: str, repo_id: str, output: str = '') -> str:
  """`bert-jax convert --format=hf --push_to_hub=ORG/NAME`: exports `source` (into `output`, or
  a temporary folder) with a model card and pushes it; returns the commit id."""
  if output:
    export_for_hub(source, output, repo_id)
    return hub.push_folder(output, repo_id, f'Upload {os.path.basename(source.rstrip("/"))}')
  with tempfile.TemporaryDirectory() as tmp:
    folder = os.path.join(tmp, 'export')
    export_for_hub(source, folder, repo_id)
    return hub.push_folder(folder, repo_id, f'Upload {os.path.basename(source.rstrip("/"))}')


# The command line of this process when `bert-jax` started it (cli sets it; None otherwise):
# run_frame.closing records it in the workdir as the run's loop starts.
COMMAND_LINE: list[str] | None = None


def record_command(workdir: str, argv: list[str]) -> None:
  """Appends the command line that (re)started a run to WORKDIR/command.txt (the model card's
  'How it was trained'). Best effort: a workdir that cannot take it is the driver's to refuse,
  with its own message."""
  import shlex  # pylint: disable=g-import-not-at-top
  path = os.path.join(workdir, COMMAND_FILE)
  try:
    if fileio.exists(workdir) and not fileio.isdir(workdir):
      return
    before = fileio.read_text(path) if fileio.isfile(path) else ''
    fileio.write_text(path, before + 'bert-jax ' + shlex.join(argv) + '\n')
  except Exception as e:  # pylint: disable=broad-except  (OSError, TensorFlow's errors)
    logging.debug('Could not record the command in %s: %s', path, e)


def make_pusher(config, workdir: str) -> 'Pusher | None':
  """The run's Pusher for config.checkpoint.push_to_hub, on process 0; None without one."""
  import jax  # pylint: disable=g-import-not-at-top
  repo = config.checkpoint.push_to_hub
  if not repo or jax.process_index() != 0:
    return None
  return Pusher(workdir, repo, config.checkpoint.push_every_steps)


class Pusher:
  """checkpoint.push_to_hub of a run: `saved(step)` after each checkpoint save is issued; pushes
  run on one background thread, in step order; `close()` waits for them (the run's end)."""

  def __init__(self, workdir: str, repo_id: str, every_steps: int,
               commit_timeout_s: float = 3600.0):
    hub.require()  # A missing extra is one line at the start, not a warning per push.
    self.workdir, self.repo_id, self.every = workdir, repo_id, int(every_steps)
    self._commit_timeout_s = commit_timeout_s
    self._record = os.path.join(workdir, PUSHES_FILE)
    self.pushed: dict[int, str] = {}
    if fileio.exists(self._record):  # A rerun: the steps pushed before (to this repository).
      saved = fileio.read_json(self._record)
      if saved.get('repo') == repo_id:
        self.pushed = {int(k): v for k, v in saved['steps'].items()}
    self.failed: list[int] = []
    self._pending: list[int] = []  # Queued or being pushed.
    self._lock = threading.Lock()
    self._queue: queue.Queue = queue.Queue()
    self._closing = threading.Event()
    self._abandon = threading.Event()
    self._thread = threading.Thread(target=self._work, name='hub-push', daemon=True)
    self._thread.start()

  def saved(self, step: int, last: bool = False) -> None:
    """The checkpoint of `step` is being saved: push it if it is a push step (or `last`)."""
    if step in self.pushed or not (last or not self.every or step % self.every == 0):
      return
    with self._lock:
      self._pending.append(step)
    self._queue.put(step)

  def close(self, wait: bool = True) -> None:
    """Waits for the pushes in flight; call it after the run waited for its saves. Without
    `wait` (a preemption notice is seconds, an upload may be minutes) it returns at once: the
    push in flight counts only if it lands before the process ends, the queued ones are
    dropped, and the rerun pushes its own later steps."""
    self._closing.set()
    if not wait:
      self._abandon.set()
      self._queue.put(None)
      with self._lock:
        left = sorted(self._pending)
      if left:
        logging.warning('Not waiting for the pushes to %s of steps %s (the run is stopping): a '
                        'step not on the Hub before the process ends does not count as pushed',
                        self.repo_id, left)
      return
    self._queue.put(None)
    self._thread.join()
    if self.pushed:
      logging.info('Pushed to %s: steps %s (hf://%s@%s ...)', self.repo_id, sorted(self.pushed),
                   self.repo_id, step_tag(max(self.pushed)))
    if self.failed:
      logging.warning('Pushes to %s that failed: steps %s', self.repo_id, self.failed)

  def _work(self) -> None:
    while True:
      step = self._queue.get()
      if step is None or self._abandon.is_set():
        return
      try:
        self._push(step)
      except Exception as e:  # pylint: disable=broad-except  (a push never stops the run)
        self.failed.append(step)
        logging.warning('Pushing step %d to the Hub (%s) failed: %s; the run goes on, and step '
                        '%d does not count as pushed', step, self.repo_id,
                        str(e).strip().split('\n')[0], step)
      finally:
        with self._lock:
          self._pending.remove(step)

  def _wait_committed(self, step: int) -> None:
    """Until the checkpoint of `step` is committed (Orbax's async save is done). Once the run
    is closing (its saves were waited for), a step not committed never will be."""
    deadline = time.monotonic() + self._commit_timeout_s
    while step not in run_files.checkpoint_steps(self.workdir):
      if self._closing.is_set() or time.monotonic() > deadline:
        raise UserError(f'the checkpoint of step {step} was not committed (a failed or '
                        'interrupted save)')
      time.sleep(1.0)

  def _push(self, step: int) -> None:
    self._wait_committed(step)
    with tempfile.TemporaryDirectory() as tmp:
      folder = os.path.join(tmp, 'export')
      export_for_hub(self.workdir, folder, self.repo_id, step=step)
      commit = hub.push_folder(folder, self.repo_id, f'Step {step}', tag=step_tag(step),
                               flag='checkpoint.push_to_hub')
    self.pushed[step] = commit
    fileio.write_json(self._record, {'repo': self.repo_id,
                                     'steps': {str(k): v for k, v in sorted(self.pushed.items())}})
    logging.info('Pushed step %d to %s (tag %s, commit %s)', step, self.repo_id, step_tag(step),
                 commit)
