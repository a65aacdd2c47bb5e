"""User mistakes versus bugs, and the exit statuses of the `bert-jax` command.

A `UserError` is a mistake the person running bert_jax can fix (a flag, a config key, a file,
a checkpoint that does not match): the `bert-jax` command prints its message alone and exits
with status 2. Anything else is a bug and keeps its traceback (status 1). `Preempted` is
neither: a run stopped by SIGTERM or Ctrl-C (status 143), after saving what it had trained.
`Outage`, Cloud Storage failing past its clients' retries (429s, 503s, resets), is not a
mistake nor a bug either: one line and status 143 too, since a rerun resumes.
"""

import os
import re

# The exit statuses of `bert-jax`, the same in every command and every phase of a run, for
# schedulers' retry rules (launch/: a Kubernetes Job's podFailurePolicy, SLURM's requeue).
EXIT_FINISHED = 0
EXIT_BUG = 1
EXIT_USER_ERROR = 2
# Stopped by SIGTERM (a preemption notice, `kill`, a pod's deletion) or Ctrl-C, or by Cloud
# Storage failing past the retries (`Outage`); rerun the same command to resume. 128 + 15, what
# a process killed by SIGTERM reports in a shell, a container's status and SLURM's epilogue: a
# notice that lands before bert_jax listens (interpreter start-up) reads the same as one it
# handled, so a scheduler needs one rule.
EXIT_PREEMPTED = 143


class UserError(ValueError):
  """A mistake the user can fix; the message names the flag, key, file or tensor and the fix.

  It is a ValueError so that code catching bad values (and older tests) keeps working.
  """


class Preempted(Exception):
  """SIGTERM or Ctrl-C stopped the run (`monitor.Preemption`): after saving the step it had
  reached or, before its first step (nothing new to save), at once. Rerunning the same command
  resumes it. Not a mistake: the `bert-jax` command prints the message and exits with
  EXIT_PREEMPTED."""


class Outage(Exception):
  """Storage kept failing past the retries of the client that met it (`gcs.outage`): not a
  mistake to fix nor a bug, but the infrastructure, for now. Nothing committed is lost, so the
  `bert-jax` command prints the message alone and exits with EXIT_PREEMPTED: the status on which
  a scheduler already reruns a run (launch/), and the rerun resumes from the last committed
  checkpoint. EXIT_USER_ERROR would end a Kubernetes Job or a SLURM allocation for a fault that
  is gone minutes later."""


# Marks a user's mistake found inside a tf.data graph (a `tf.debugging.Assert` message): TF
# raises it as an InvalidArgumentError (a bug's class) from whichever `next()` reached it;
# `from_tensorflow` turns it back into the UserError it is.
IN_GRAPH_MARK = 'bert_jax user error: '


def in_graph(message: str) -> str:
  """The text of a tf.debugging.Assert that reports a user's mistake."""
  return IN_GRAPH_MARK + message


def from_tensorflow(error: BaseException) -> UserError | None:
  """The UserError carried by a TensorFlow error raised at an `in_graph` assertion, else None."""
  seen = []
  while error is not None and error not in seen and IN_GRAPH_MARK not in str(error):
    seen.append(error)  # A wrapper (an iterator's prefetch thread) may hold it as its cause.
    error = error.__cause__ or error.__context__
  if error is None or error in seen:
    return None
  text = getattr(error, 'message', None) or str(error)
  message = text.split(IN_GRAPH_MARK, 1)[1]
  # TF prints the Assert's data as "[message]" followed by the failing node's name.
  message = message.split(']', 1)[0].split('\n', 1)[0].strip()
  return UserError(message.replace("\\'", "'"))  # TF escapes the quotes of the Assert data.


def excerpt(text: str, limit: int = 60) -> str:
  """`text` quoted for a message: at most `limit` characters of it, and how long it is."""
  if len(text) <= limit:
    return repr(text)
  return f'{text[:limit]!r}... ({len(text):,} characters)'


# Skipping a few broken rows is right (QQP's released files have some; the original SQuAD code
# skips questions whose answer is not at its answer_start); skipping more than this share of a
# file means the file (or its format) is wrong, and training on the rest would hide it.
MAX_SKIPPED_SHARE = 0.01


def check_skipped(path: str, skipped: list, total: int, what: str, fix: str) -> None:
  """Refuses a file of which more than MAX_SKIPPED_SHARE of `total` items (and more than one)
  were skipped: `skipped` names them (line numbers, question ids), `what` says what an item is
  and why it was skipped, `fix` what to do."""
  if len(skipped) <= 1 or len(skipped) <= MAX_SKIPPED_SHARE * total:
    return
  shown = ', '.join(str(s) for s in skipped[:5]) + (', ...' if len(skipped) > 5 else '')
  raise UserError(f'{path}: {len(skipped):,} of {total:,} {what} '
                  f'({len(skipped) / total:.0%}, more than the {MAX_SKIPPED_SHARE:.0%} skipped '
                  f'as broken): {shown}; {fix}')


def out_of_memory(error: BaseException) -> str | None:
  """'out of memory: ... could not allocate 8.0 TiB (N bytes)' when `error` (or one it came
  from) is XLA's RESOURCE_EXHAUSTED, else None: a setting to lower, not a bug."""
  seen = []
  while error is not None and error not in seen:
    text = str(error)
    if 'RESOURCE_EXHAUSTED' in text and type(error).__name__.endswith('RuntimeError'):
      found = re.search(r'(\d+) bytes', text)
      if not found:
        return 'out of memory (RESOURCE_EXHAUSTED)'
      size, unit = float(found.group(1)), 'bytes'
      for unit in ('bytes', 'KiB', 'MiB', 'GiB', 'TiB', 'PiB'):
        if size < 1024 or unit == 'PiB':
          break
        size /= 1024
      return (f'out of memory: the device could not allocate {size:.1f} {unit} '
              f'({int(found.group(1)):,} bytes)')
    seen.append(error)
    error = error.__cause__ or error.__context__
  return None


def no_backend(error: BaseException) -> str | None:
  """The one line for JAX failing to start the backend JAX_PLATFORMS names (`gpu` or `tpu` on a
  machine without one: JAX's RuntimeError "Unable to initialize backend ...", whose cause may
  be libtpu's advice to delete a lock file), else None: a setting to change, not a bug."""
  seen = []
  while error is not None and error not in seen:
    found = re.match(r"Unable to initialize backend '(\w+)'", str(error))
    if found and isinstance(error, RuntimeError):
      platforms = os.environ.get('JAX_PLATFORMS', '')
      setting = f'JAX_PLATFORMS={platforms}' if platforms else 'jax_platforms'
      # JAX_PLATFORMS=gpu tries CUDA, then ROCm: the one it names last is not the user's word.
      kind = {'cuda': 'GPU', 'rocm': 'GPU', 'gpu': 'GPU'}.get(found.group(1),
                                                              found.group(1).upper())
      return (f'{setting}: JAX could not start a {kind} backend: this machine has no usable '
              f'{kind} (or another process holds it); unset JAX_PLATFORMS to run on what this '
              'machine has, or set JAX_PLATFORMS=cpu')
    seen.append(error)
    error = error.__cause__ or error.__context__
  return None
