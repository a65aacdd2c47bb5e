"""What a `bert-jax` command shows on the console besides its own output.

- `native_stderr_held_back`: TensorFlow's and libtpu's native start-up notes, held back while
  they start and shown only if starting fails (`start_up.start`).
- `ours_or_a_warning`: the log filter: warnings and errors from anywhere, info lines from
  bert_jax only, and not the CUDA plugin's failed start on a machine without NVIDIA's driver.
- `stop_at_once_on_signals`: SIGTERM and Ctrl-C where no training run listens for them: one
  line and EXIT_PREEMPTED.
"""

import contextlib
import logging as std_logging
import os
import signal
import sys
import tempfile
import threading

from absl import logging

from bert_jax import errors


@contextlib.contextmanager
def native_stderr_held_back():
  """Holds back what native code writes to stderr (file descriptor 2) inside the block, and
  writes it out only if the block fails. Python's own writes (logging, warnings) go to the
  console meanwhile, through the log filter as always (ours_or_a_warning).

  TensorFlow's and libtpu's start-up notes come from C++ before any log level applies; they
  would stand above every message of the command, a user's one-line error too. A native crash
  inside the block (an illegal instruction, an abort) loses what it wrote: --traceback runs
  without holding anything back.
  """
  sys.stderr.flush()
  try:
    saved = os.dup(2)
  except OSError:  # No stderr to hold back (closed by a daemonizing parent).
    yield
    return
  # Python's stderr, on a copy of the console's file descriptor: sys.stderr and the log
  # handlers that write to it (absl's, and any on the root logger) are pointed at it for the
  # block. Left open if a handler made inside the block writes to it (JAX makes its own as it
  # is imported, and adds it to its logger with JAX_LOGGING_LEVEL set).
  console = open(os.dup(saved), 'w', buffering=1, encoding=getattr(sys.stderr, 'encoding', None),
                 errors='backslashreplace')
  python_stderr = sys.stderr
  handlers = [h for h in [logging.get_absl_handler().python_handler, *std_logging.root.handlers]
              if isinstance(h, std_logging.StreamHandler) and h.stream is python_stderr]
  with tempfile.TemporaryFile() as held:
    os.dup2(held.fileno(), 2)
    sys.stderr = console
    for handler in handlers:
      handler.setStream(console)
    try:
      yield
    except BaseException:
      console.flush()
      os.dup2(saved, 2)
      held.seek(0)
      python_stderr.write(held.read().decode('utf-8', 'replace'))
      raise
    finally:
      for handler in handlers:
        handler.setStream(python_stderr)
      sys.stderr = python_stderr
      console.flush()
      if console not in _handler_streams():
        console.close()
      os.dup2(saved, 2)
      os.close(saved)


def _handler_streams() -> list:
  """The streams the log handlers of every logger write to."""
  loggers = [std_logging.root] + [logger for logger in
                                  std_logging.Logger.manager.loggerDict.values()
                                  if isinstance(logger, std_logging.Logger)]
  return [getattr(h, 'stream', None) for logger in loggers for h in logger.handlers]


_PACKAGE_DIR = os.path.dirname(os.path.realpath(__file__))


def ours_or_a_warning(record: std_logging.LogRecord) -> bool:
  """Log filter: warnings and errors from anywhere, info lines only from bert_jax (Orbax, for
  one, logs every handler it creates and closes at info level), and not the CUDA plugin's
  failure on a machine without NVIDIA's driver. --verbosity=1 keeps all."""
  if logging.get_verbosity() > 0:
    return True
  if _unused_cuda_plugin(record):
    return False
  return (record.levelno >= std_logging.WARNING or
          os.path.realpath(record.pathname).startswith(_PACKAGE_DIR + os.sep))


def _unused_cuda_plugin(record: std_logging.LogRecord) -> bool:
  """JAX's report that its CUDA plugin did not start, on a machine with no NVIDIA driver.

  With the gpuaot extra installed (for `bert-jax compile`), JAX's CUDA plugin checks the CUDA
  libraries as JAX starts, finds no cuFFT, and JAX logs it with two tracebacks ("Unable to load
  cuFFT") before every command, which then runs on the CPU as it would without the plugin.
  Where a driver is (/dev/nvidiactl), a plugin that fails to start matters and is shown.
  """
  return (record.name.startswith('jax') and record.levelno >= std_logging.ERROR and
          record.getMessage().startswith('Jax plugin configuration error') and
          'cuda' in record.getMessage() and not os.path.exists('/dev/nvidiactl'))


def stop_at_once_on_signals(name: str) -> dict[int, object]:
  """SIGTERM and Ctrl-C where no run listens for them (start-up, imports, the commands that do
  not train): one line and EXIT_PREEMPTED, not a KeyboardInterrupt traceback from each thread,
  nor, for SIGTERM, a status that depends on the moment. A training run replaces these handlers
  with its own, which save first (`monitor.Preemption`), and puts them back when it ends.
  Returns the handlers replaced."""
  if threading.current_thread() is not threading.main_thread():
    return {}

  def stop(signum, frame):
    del frame
    cause = 'Ctrl-C' if signum == signal.SIGINT else signal.Signals(signum).name
    # stdout: while TensorFlow loads, stderr (fd 2) is held back.
    print(f'\nbert-jax {name}: stopped by {cause}: rerun the same command (a training run '
          'resumes from its last checkpoint)', flush=True)
    os._exit(errors.EXIT_PREEMPTED)  # pylint: disable=protected-access

  return {signum: signal.signal(signum, stop) for signum in (signal.SIGTERM, signal.SIGINT)}
