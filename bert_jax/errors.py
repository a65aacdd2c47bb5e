"""User mistakes versus bugs.

A `UserError` is a mistake the person running bert_jax can fix (a flag, a config key, a file,
a checkpoint that does not match): the `bert-jax` command prints its message alone and exits
with status 2. Anything else is a bug and keeps its traceback (status 1).
"""


class UserError(ValueError):
  """A mistake the user can fix; the message names the flag, key, file or tensor and the fix.

  It is a ValueError so that code catching bad values (and older tests) keeps working.
  """
