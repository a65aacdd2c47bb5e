"""User mistakes versus bugs, and the exit statuses of the `bert-jax` command.

A `UserError` is a mistake the person running bert_jax can fix (a flag, a config key, a file,
a checkpoint that does not match): the `bert-jax` command prints its message alone and exits
with status 2. Anything else is a bug and keeps its traceback (status 1). `Preempted` is
neither: a run stopped by SIGTERM or Ctrl-C (status 143), after saving what it had trained.
"""

# The exit statuses of `bert-jax`, the same in every command and every phase of a run, for
# schedulers' retry rules (launch/: a Kubernetes Job's podFailurePolicy, SLURM's requeue).
EXIT_FINISHED = 0
EXIT_BUG = 1
EXIT_USER_ERROR = 2
# Stopped by SIGTERM (a preemption notice, `kill`, a pod's deletion) or Ctrl-C; rerun the same
# command to resume. 128 + 15, what a process killed by SIGTERM reports in a shell, a
# container's status and SLURM's epilogue: a notice that lands before bert_jax listens
# (interpreter start-up) reads the same as one it handled, so a scheduler needs one rule.
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
