"""Python processes for tests, forked from a server that imported TensorFlow, JAX and bert_jax
once, instead of fresh interpreters that each spend about 8 s of CPU on the same imports (a
third of the suite's CPU went to them: over a hundred `bert-jax` processes).

`processes.python(env)` is the argv prefix a test puts where it would put `sys.executable`:
`processes.python(env) + ['-m', 'bert_jax.cli', 'pretrain', ...]`. That starts this file as a
client, a bare interpreter that imports nothing heavy. It hands its arguments, working
directory, environment and stdin/stdout/stderr to the server (over a Unix socket); the server
forks, and the fork runs the program as `python` would: `runpy` for `-m` and a script, `exec` for
`-c`, at the top of this file's frames, so that its exit, exit status and traceback are a fresh
interpreter's. The client stays the test's process: it passes on the signals it gets, and ends
with the fork's exit status, or killed by the fork's signal. Killed itself (SIGKILL), the server
kills the fork before it serves anything else.

What a fork cannot take from its request the server started with: variables read as TensorFlow
and JAX are imported. So there is one server per environment, less the variables read later
(`_LATE`: JAX's compilation cache and optimization settings, applied to `jax.config` in the fork
as JAX would read them, XLA_FLAGS, bert_jax's own, the shell's PWD, OLDPWD, SHLVL and _).
Anything else the client runs itself with os.execv (another interpreter option): the same
program, only slower. Tests about the process itself (its pid in a lock, its signal handlers,
the modules a command loads, its console at start-up) start real interpreters. A fork keeps
TensorFlow's Grappler on, as a fresh interpreter does (`conftest.without_grappler`: the
tests' own processes run it off).
"""

import ctypes
import gc
import json
import os
import select
import signal
import socket
import sys
import time
import warnings

# Read after the imports (by JAX at its first compile or backend, by bert_jax when it runs): a
# fork takes them from its request. JAX's are applied to jax.config as JAX reads its variables.
_LATE_JAX = {'JAX_COMPILATION_CACHE_DIR': str, 'JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS': float,
             'JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES': int,
             'JAX_DISABLE_MOST_OPTIMIZATIONS': bool, 'JAX_LOG_COMPILES': bool}
# The shell's bookkeeping (`bash -c` sets SHLVL and `_`, the command's path) is read by nothing
# that imports.
_LATE = set(_LATE_JAX) | {'XLA_FLAGS', 'PYTEST_CURRENT_TEST', 'PWD', 'OLDPWD', 'SHLVL', '_'}
_LATE_PREFIX = 'BERT_JAX_'
_PR_SET_PDEATHSIG = 1  # prctl(2)
# The cyclic collector's thresholds in the forks, as in the test workers (tests/conftest.py).
GC_THRESHOLD = (20_000, 20, 20)
# Signals a test may send; the client passes them on to the fork.
_PASSED_ON = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
              signal.SIGUSR2)


def import_environment(env: dict[str, str]) -> dict[str, str]:
  """`env` less the variables a fork takes from its request: the server's environment."""
  return {k: v for k, v in env.items() if k not in _LATE and not k.startswith(_LATE_PREFIX)}


# ---- The client ---------------------------------------------------------------------------


def _run_fresh(args: list[str]) -> None:
  os.execv(sys.executable, [sys.executable] + args)


def _read_line(conn: socket.socket, pending: bytearray) -> dict | None:
  while b'\n' not in pending:
    chunk = conn.recv(4096)
    if not chunk:
      return None
    pending += chunk
  line, _, rest = bytes(pending).partition(b'\n')
  pending[:] = rest
  return json.loads(line)


def client(path: str, args: list[str]) -> None:
  """Runs `python args` in a fork of the server at `path` (or fresh, see the module's doc)."""
  if not args or not (args[0] in ('-m', '-c') and len(args) > 1 or not args[0].startswith('-')):
    _run_fresh(args)
  # The signals this process ignores (a background job of a script ignores SIGINT and SIGQUIT)
  # start ignored in the fork too, as in a fresh interpreter started here; every one is still
  # passed on, for a program that handles it anyway.
  dispositions = {s: signal.getsignal(s) for s in _PASSED_ON}
  ignored = [int(s) for s, d in dispositions.items() if d == signal.SIG_IGN]
  child, signals, ended = [], [], []

  def pass_on(signum, frame):  # pylint: disable=unused-argument
    if ended:
      return
    if not child:
      signals.append(signum)
      return
    try:
      os.kill(child[0], signum)
    except ProcessLookupError:  # It has just ended: its status is on the way.
      pass

  def fresh():
    conn.close()
    for signum, disposition in dispositions.items():
      signal.signal(signum, disposition)
    for signum in signals:  # What a fresh interpreter would have got meanwhile.
      os.kill(os.getpid(), signum)
    _run_fresh(args)

  for signum in _PASSED_ON:
    signal.signal(signum, pass_on)
  conn = socket.socket(socket.AF_UNIX)
  deadline = time.time() + 60  # The server binds its socket as it starts, before its imports.
  while True:
    try:
      conn.connect(path)
      break
    except FileNotFoundError:  # Not bound yet.
      if time.time() > deadline:
        fresh()
      time.sleep(0.02)
    except OSError:  # Bound, but no longer listening (ended, or ending).
      fresh()
  request = json.dumps({'args': args, 'cwd': os.getcwd(), 'env': dict(os.environ),
                        'ignored': ignored}).encode()
  pending = bytearray()
  try:
    socket.send_fds(conn, [len(request).to_bytes(8, 'big')], [0, 1, 2])
    conn.sendall(request)
    answer = _read_line(conn, pending)
  except OSError:  # The server ended before it forked.
    answer = None
  if answer is None or 'fresh' in answer:
    fresh()
  child.append(answer['pid'])
  for signum in signals:
    pass_on(signum, None)
  try:
    status = (_read_line(conn, pending) or {}).get('status')
  except OSError:
    status = None
  ended.append(True)
  if status is None:
    sys.stderr.write(f'tests/forkserver.py: the server at {path} ended before pid '
                     f'{child[0]}\n')
    os._exit(1)  # pylint: disable=protected-access
  if os.WIFSIGNALED(status):
    signum = os.WTERMSIG(status)
    if signum not in (signal.SIGKILL, signal.SIGSTOP):
      signal.signal(signum, signal.SIG_DFL)
      signal.pthread_sigmask(signal.SIG_UNBLOCK, [signum])
    os.kill(os.getpid(), signum)
  os._exit(os.waitstatus_to_exitcode(status))  # pylint: disable=protected-access


# ---- The server ---------------------------------------------------------------------------


def _import_everything() -> None:
  """What `bert-jax` commands import, in their order (cli.py, then start_up.start)."""
  os.environ.setdefault('TF_ENABLE_ONEDNN_OPTS', '0')  # cli.py, before TensorFlow loads.
  from bert_jax import start_up  # pylint: disable=g-import-not-at-top
  # As start_up.start imports TensorFlow: without what Keras would import and no command uses.
  with start_up.without_unused_imports():
    from bert_jax import input_pipeline  # pylint: disable=g-import-not-at-top,unused-import
  import jax  # pylint: disable=g-import-not-at-top,unused-import
  # The drivers and what they load (not `cli` itself: `-m bert_jax.cli` runs it as __main__).
  from bert_jax import checkpoint, finetune, pretrained, train  # pylint: disable=g-import-not-at-top,unused-import,g-multiple-import
  # Imported before absl's app.run, as here, TensorFlow queues a call for app.run to make
  # (tf.distribute's combinations list the GPUs, which starts the device platforms and prints
  # their notes); a fresh command imports it inside app.run, where absl makes the call at once,
  # inside the start-up that holds back those notes. Dropped (absl has no public way): the
  # command's start-up starts the platforms, its notes held back. A console test fails if absl
  # renames the queue (the notes would show).
  from absl import app  # pylint: disable=g-import-not-at-top
  app._init_callbacks.clear()  # pylint: disable=protected-access
  # The tokenizer's character classes and the characters lower-casing changes: pure Python
  # over every code point (about 0.5 s and 0.2 s of a CPU, the same in every process, cached in
  # each), made once here for every fork. Nothing of TensorFlow's runtime may start here (its
  # threads would not survive a fork): the lower-casing check runs ops, and stays with each fork.
  from bert_jax import tokenization  # pylint: disable=g-import-not-at-top
  tokenization._classes()  # pylint: disable=protected-access
  tokenization._cased_characters()  # pylint: disable=protected-access


def _receive(conn: socket.socket) -> tuple[dict, list[int]]:
  conn.settimeout(30)  # A client sends its request as it connects.
  head, fds, _, _ = socket.recv_fds(conn, 8, 3)
  try:
    size, body = int.from_bytes(head, 'big'), bytearray()
    while len(body) < size:
      chunk = conn.recv(size - len(body))
      if not chunk:
        raise ConnectionError('the client left mid-request')
      body += chunk
    request = json.loads(body)
    if len(fds) != 3:
      raise ConnectionError(f'{len(fds)} file descriptors, not 3')
  except (OSError, ValueError):
    for fd in fds:  # Held here, they would keep the test's pipes open.
      os.close(fd)
    raise
  conn.settimeout(None)
  return request, fds


def _send(conn: socket.socket, message: dict) -> None:
  try:
    conn.sendall(json.dumps(message).encode() + b'\n')
  except OSError:  # The client is gone: its fork was killed for it.
    pass


def _bool_env(name: str, value: str) -> bool:
  """As JAX reads a boolean variable."""
  if value.lower() in ('y', 'yes', 't', 'true', 'on', '1'):
    return True
  if value.lower() in ('n', 'no', 'f', 'false', 'off', '0'):
    return False
  raise ValueError(f'invalid truth value {value!r} for environment {name!r}')


def serve(path: str) -> tuple[dict, dict[str, str | None], list[int]]:
  """Serves requests until the parent (the test worker) is gone, or after SIGTERM, once its
  running forks have ended; in a fork, returns its request, what the imports changed in the
  environment (None: removed), and its stdin/stdout/stderr."""
  listener = socket.socket(socket.AF_UNIX)
  # Bound and listening under another name, then renamed: a client that finds the path can
  # connect. (A connect between bind and listen is refused, which a client takes for a server
  # that ended: it ran fresh, once in CI on 2026-12-01.)
  listener.bind(path + '.binding')
  listener.listen(64)
  os.rename(path + '.binding', path)
  parent = os.getppid()
  draining = []  # SIGTERM: no new requests; the running forks end as they would.
  signal.signal(signal.SIGTERM, lambda signum, frame: draining.append(True))
  started_with = dict(os.environ)
  _import_everything()
  # What the imports set in the environment (TensorFlow's TF2_BEHAVIOR, ...): a fresh process
  # of the same environment has them too.
  imported = {k: os.environ.get(k) for k in set(os.environ) | set(started_with)
              if os.environ.get(k) != started_with.get(k)}
  # The half a million objects of the imports live as long as each fork: frozen here, before
  # any fork (as the gc module's documentation advises for a pre-forking server), a fork's
  # collections (start_up.start's full one among them) skip them, instead of walking them all
  # and copying each memory page they touch.
  gc.collect()
  gc.freeze()
  gc.set_threshold(*GC_THRESHOLD)
  wake_r, wake_w = os.pipe()
  os.set_blocking(wake_w, False)
  signal.set_wakeup_fd(wake_w)
  signal.signal(signal.SIGCHLD, lambda signum, frame: None)
  forks: dict[socket.socket, int] = {}
  server = os.getpid()
  try:
    while os.getppid() == parent and not (draining and not forks):
      if draining and listener.fileno() >= 0:
        listener.close()
      ready = select.select([wake_r] + [listener] * (not draining) + list(forks), [], [],
                            1.0)[0]
      if wake_r in ready:
        os.read(wake_r, 4096)
      for conn, pid in list(forks.items()):
        try:
          gone = conn in ready and not conn.recv(1)
        except OSError:
          gone = True
        if gone:  # The client was killed: its fork goes before anything else is served.
          os.kill(pid, signal.SIGKILL)
        done, status = os.waitpid(pid, 0 if gone else os.WNOHANG)
        if done:
          _send(conn, {'status': status})
          conn.close()
          del forks[conn]
      if draining or listener not in ready:
        continue
      conn = listener.accept()[0]
      try:
        request, fds = _receive(conn)
      except (OSError, ValueError):
        conn.close()
        continue
      if import_environment(request['env']) != import_environment(started_with):
        for fd in fds:
          os.close(fd)
        _send(conn, {'fresh': 'another environment at import'})
        conn.close()
        continue
      sys.stdout.flush()
      sys.stderr.flush()
      # Signals wait until the fork has a fresh interpreter's dispositions, not the server's.
      mask = signal.pthread_sigmask(signal.SIG_BLOCK, _PASSED_ON + (signal.SIGCHLD,))
      with warnings.catch_warnings():
        # Python 3.12+ warns at each fork of a process with threads (OpenBLAS's, jemalloc's
        # here, which both prepare for forks); a fork starts no thread of the server's.
        warnings.filterwarnings('ignore', message='.*use of fork\\(\\) may lead to deadlocks')
        pid = os.fork()
      if pid == 0:
        for sock in [listener, conn] + list(forks):
          sock.close()
        signal.set_wakeup_fd(-1)
        os.close(wake_r)
        os.close(wake_w)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for signum in _PASSED_ON:  # As a fresh interpreter started by the client sets them.
          signal.signal(signum, signal.SIG_IGN if signum in request['ignored'] else
                        signal.default_int_handler if signum == signal.SIGINT else
                        signal.SIG_DFL)
        # Killed with the server (the test worker's exit kills it), not left running.
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != server:
          os._exit(1)  # pylint: disable=protected-access
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        return request, imported, fds
      signal.pthread_sigmask(signal.SIG_SETMASK, mask)
      for fd in fds:
        os.close(fd)
      forks[conn] = pid
      _send(conn, {'pid': pid})
  finally:
    if os.getpid() == server:
      for pid in forks.values():
        os.kill(pid, signal.SIGKILL)
  sys.exit(0)


def run_fork(request: dict, imported: dict[str, str | None], fds: list[int]) -> None:
  """In the fork: becomes the requested `python` process and runs its program."""
  for target, fd in enumerate(fds):
    os.dup2(fd, target)
    os.close(fd)
  os.chdir(request['cwd'])
  os.environ.clear()
  os.environ.update(request['env'])
  for name, value in imported.items():
    if value is None:
      os.environ.pop(name, None)
    else:
      os.environ[name] = value
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  for name, kind in _LATE_JAX.items():
    if name in os.environ:
      value = os.environ[name]
      jax.config.update(name.lower(), _bool_env(name, value) if kind is bool else kind(value))
  np.random.seed()  # A fresh process's global state, not the server's (random reseeds itself).
  import runpy  # pylint: disable=g-import-not-at-top
  import types  # pylint: disable=g-import-not-at-top
  args = request['args']
  if args[0] == '-m':
    sys.argv = [args[1]] + args[2:]  # runpy sets argv[0] to the module's file.
    sys.path[0] = os.getcwd()
    runpy.run_module(args[1], run_name='__main__', alter_sys=True)
  elif args[0] == '-c':
    sys.argv = ['-c'] + args[2:]
    sys.path[0] = ''
    main = types.ModuleType('__main__')
    sys.modules['__main__'] = main
    exec(compile(args[1], '<string>', 'exec'), main.__dict__)  # pylint: disable=exec-used
  else:
    sys.argv = list(args)
    sys.path[0] = os.path.dirname(os.path.realpath(args[0]))
    runpy.run_path(args[0], run_name='__main__')


if __name__ == '__main__':
  if sys.argv[1] == 'serve':
    run_fork(*serve(sys.argv[2]))
  else:
    client(sys.argv[2], sys.argv[3:])
