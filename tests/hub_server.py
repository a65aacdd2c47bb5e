"""A Hugging Face Hub on loopback for the hf:// tests: the endpoints huggingface_hub calls.

huggingface_hub takes its server from HF_ENDPOINT, so `snapshot_download`, `upload_folder`,
`create_repo`, `create_tag` ... run their real HTTP code against this server: downloads fill a
real Hub cache (blobs, snapshots, refs, the tree listing), which a later run then reads with
HF_HUB_OFFLINE=1. It keeps repositories in memory as git does in spirit: each commit is a whole
tree {path: bytes} with a sha, branches and tags point at commits. Every file is a "regular"
(inline base64) upload, so no LFS or Xet storage is involved.

Answers follow the Hub's: a missing or private repository (without the token) is a 404 with
`X-Error-Code: RepoNotFound`, a missing revision `RevisionNotFound`, a missing file
`EntryNotFound`. `fail_commits` makes the next N commits fail with `fail_status` (an upload
that fails), counted, never by chance.

Run in-process by the tests (`HubServer` is a context manager), or alone:
`python3 tests/hub_server.py PORT`.
"""

import base64
import hashlib
import http.server
import json
import re
import sys
import threading
import urllib.parse

import yaml

TOKEN = 'hf_bert_jax_test_token'


def _blob_id(data: bytes) -> str:
  """git's blob id (what the Hub calls a file's oid)."""
  return hashlib.sha1(b'blob %d\0' % len(data) + data).hexdigest()


class Repo:
  """One repository: commits (sha -> {path: bytes}), branches and tags (name -> sha)."""

  def __init__(self, private: bool = False):
    self.private = private
    self.commits: dict[str, dict[str, bytes]] = {}
    self.branches: dict[str, str] = {}
    self.tags: dict[str, str] = {}
    self.log: list[tuple[str, str]] = []  # (sha, message), oldest first.
    self.commit('main', {}, 'initial commit')

  def resolve(self, revision: str) -> str | None:
    if revision in self.commits:
      return revision
    return self.branches.get(revision) or self.tags.get(revision)

  def commit(self, branch: str, files: dict[str, bytes | None], message: str) -> str:
    parent = self.commits.get(self.branches.get(branch, ''), {})
    tree = dict(parent)
    for path, data in files.items():
      if data is None:  # Deleted: a file, or everything under a folder.
        for name in [n for n in tree if n == path or n.startswith(path.rstrip('/') + '/')]:
          del tree[name]
      else:
        tree[path] = data
    sha = hashlib.sha1(f'{len(self.log)}{message}{sorted(tree)}'.encode()).hexdigest()
    self.commits[sha] = tree
    self.branches[branch] = sha
    self.log.append((sha, message))
    return sha


class HubServer:
  """The fake Hub, on 127.0.0.1 at a free port, for the duration of a `with` block.

  `url` is its HF_ENDPOINT; `repos[(kind, repo_id)]` (kind: 'model' or 'dataset') holds what
  was uploaded; `requests` logs (method, path) of every request.
  """

  def __init__(self, port: int = 0):
    self.repos: dict[tuple[str, str], Repo] = {}
    self.requests: list[tuple[str, str]] = []
    self.fail_commits = 0
    self.failed_commits = 0
    # 5xx answers are retried by huggingface_hub (5 times, backing off); 403 is not.
    self.fail_status = 500
    self._lock = threading.Lock()
    self._httpd = http.server.ThreadingHTTPServer(('127.0.0.1', port), _handler(self))
    self.url = f'http://127.0.0.1:{self._httpd.server_address[1]}'
    self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)

  def __enter__(self) -> 'HubServer':
    self._thread.start()
    return self

  def __exit__(self, *exc) -> None:
    self._httpd.shutdown()
    self._httpd.server_close()

  def add_repo(self, repo_id: str, files: dict[str, bytes], kind: str = 'model',
               private: bool = False, message: str = 'add files') -> str:
    """A repository holding `files` on main; returns the commit's sha."""
    repo = self.repos.setdefault((kind, repo_id), Repo(private))
    return repo.commit('main', files, message)


def _handler(hub: HubServer):

  class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = 'HTTP/1.1'

    def log_message(self, *args):  # Quiet: pytest shows failures, not every request.
      pass

    # ---- plumbing ----
    def _send(self, status: int, body: bytes = b'', headers: dict | None = None,
              content_type: str = 'application/json') -> None:
      self.send_response(status)
      for key, value in (headers or {}).items():
        self.send_header(key, value)
      self.send_header('Content-Type', content_type)
      self.send_header('Content-Length', str(len(body)))
      self.end_headers()
      if self.command != 'HEAD':
        self.wfile.write(body)

    def _json(self, value, status: int = 200, headers: dict | None = None) -> None:
      self._send(status, json.dumps(value).encode(), headers)

    def _error(self, status: int, code: str, message: str = '') -> None:
      self._json({'error': message or code}, status,
                 {'X-Error-Code': code, 'X-Error-Message': message or code})

    def _body(self) -> bytes:
      return self.rfile.read(int(self.headers.get('Content-Length') or 0))

    def _repo(self, kind: str, repo_id: str) -> Repo | None:
      repo = hub.repos.get((kind, repo_id))
      if repo is None or (repo.private and
                          self.headers.get('Authorization') != f'Bearer {TOKEN}'):
        self._error(404, 'RepoNotFound', 'Repository not found')
        return None
      return repo

    def _sha(self, repo: Repo, revision: str) -> str | None:
      sha = repo.resolve(urllib.parse.unquote(revision))
      if sha is None:
        self._error(404, 'RevisionNotFound', f'Invalid rev id: {revision}')
      return sha

    # ---- routes ----
    def do_HEAD(self):  # pylint: disable=invalid-name
      self.do_GET()

    def do_GET(self):  # pylint: disable=invalid-name
      url = urllib.parse.urlsplit(self.path)
      path = url.path
      hub.requests.append((self.command, path))
      with hub._lock:  # pylint: disable=protected-access
        m = re.fullmatch(r'/api/(models|datasets)/([^/]+/[^/]+)(?:/revision/(.+))?', path)
        if m:
          return self._info(m[1][:-1], m[2], m[3] or 'main')
        m = re.fullmatch(r'/api/(models|datasets)/([^/]+/[^/]+)/tree/([^/]+)(/.*)?', path)
        if m:
          return self._tree(m[1][:-1], m[2], m[3], (m[4] or '').strip('/'))
        m = re.fullmatch(r'/api/(models|datasets)/([^/]+/[^/]+)/refs', path)
        if m:
          return self._refs(m[1][:-1], m[2])
        m = re.fullmatch(r'(/datasets)?/([^/]+/[^/]+)/resolve/([^/]+)/(.+)', path)
        if m:
          return self._resolve('dataset' if m[1] else 'model', m[2], m[3],
                               urllib.parse.unquote(m[4]))
      self._error(404, 'NotFound', f'no route {path}')

    def do_POST(self):  # pylint: disable=invalid-name
      path = urllib.parse.urlsplit(self.path).path
      hub.requests.append((self.command, path))
      body = self._body()
      with hub._lock:  # pylint: disable=protected-access
        if path == '/api/repos/create':
          return self._create(json.loads(body))
        if path == '/api/validate-yaml':  # A README.md's metadata, checked before a commit.
          return self._validate_yaml(json.loads(body)['content'])
        m = re.fullmatch(r'/api/(models|datasets)/([^/]+/[^/]+)/preupload/(.+)', path)
        if m:
          files = json.loads(body)['files']
          return self._json({'files': [{'path': f['path'], 'uploadMode': 'regular',
                                        'shouldIgnore': False, 'oid': None} for f in files]})
        m = re.fullmatch(r'/api/(models|datasets)/([^/]+/[^/]+)/commit/(.+)', path)
        if m:
          return self._commit(m[1][:-1], m[2], urllib.parse.unquote(m[3]), body)
        m = re.fullmatch(r'/api/(models|datasets)/([^/]+/[^/]+)/tag/(.+)', path)
        if m:
          return self._tag(m[1][:-1], m[2], m[3], json.loads(body or b'{}'))
        m = re.fullmatch(r'/api/(models|datasets)/([^/]+/[^/]+)/branch/(.+)', path)
        if m:
          return self._branch(m[1][:-1], m[2], urllib.parse.unquote(m[3]),
                              json.loads(body or b'{}'))
      self._error(404, 'NotFound', f'no route {path}')

    def _validate_yaml(self, content):
      m = re.match(r'---\n(.*?)\n---\n', content, re.S)
      try:
        metadata = yaml.safe_load(m[1]) if m else {}
      except yaml.YAMLError as e:
        metadata = str(e)
      if not isinstance(metadata, dict):
        return self._json({'errors': [{'message': f'metadata is not a mapping: {metadata}'}]},
                          400, {'X-Error-Message': 'invalid metadata'})
      self._json({'errors': [], 'warnings': []})

    def _info(self, kind, repo_id, revision):
      repo = self._repo(kind, repo_id)
      sha = repo and self._sha(repo, revision)
      if sha:
        self._json({'id': repo_id, 'sha': sha, 'private': repo.private,
                    'siblings': [{'rfilename': p} for p in sorted(repo.commits[sha])]})

    def _tree(self, kind, repo_id, revision, folder):
      repo = self._repo(kind, repo_id)
      sha = repo and self._sha(repo, revision)
      if sha:
        prefix = folder + '/' if folder else ''
        self._json([{'type': 'file', 'path': p, 'size': len(d), 'oid': _blob_id(d)}
                    for p, d in sorted(repo.commits[sha].items()) if p.startswith(prefix)])

    def _refs(self, kind, repo_id):
      repo = self._repo(kind, repo_id)
      if repo:
        ref = lambda kind, refs: [{'name': n, 'ref': f'refs/{kind}/{n}', 'targetCommit': s}
                                  for n, s in sorted(refs.items())]
        self._json({'branches': ref('heads', repo.branches), 'tags': ref('tags', repo.tags),
                    'converts': []})

    def _resolve(self, kind, repo_id, revision, name):
      repo = self._repo(kind, repo_id)
      sha = repo and self._sha(repo, revision)
      if not sha:
        return
      data = repo.commits[sha].get(name)
      if data is None:
        return self._error(404, 'EntryNotFound', f'{name} does not exist on {revision}')
      self._send(200, data, {'X-Repo-Commit': sha, 'ETag': f'"{_blob_id(data)}"'},
                 'application/octet-stream')

    def _create(self, request):
      kind = request.get('type') or 'model'
      repo_id = f'{request["organization"]}/{request["name"]}'
      prefix = '' if kind == 'model' else f'{kind}s/'
      if (kind, repo_id) in hub.repos:  # As the Hub: the repository's url in the 409 too.
        return self._json({'error': 'You already created this repo',
                           'url': f'{hub.url}/{prefix}{repo_id}'}, 409,
                          {'X-Error-Message': 'You already created this repo'})
      hub.repos[(kind, repo_id)] = Repo(request.get('visibility') == 'private' or
                                        bool(request.get('private')))
      self._json({'url': f'{hub.url}/{prefix}{repo_id}', 'name': repo_id})

    def _commit(self, kind, repo_id, revision, body):
      repo = self._repo(kind, repo_id)
      if not repo:
        return
      if hub.fail_commits:
        hub.fail_commits -= 1
        hub.failed_commits += 1
        return self._error(hub.fail_status, 'Refused', 'the fake Hub fails this commit')
      if revision not in repo.branches:
        return self._error(404, 'RevisionNotFound', f'Invalid rev id: {revision}')
      files, message = {}, ''
      for line in body.splitlines():
        item = json.loads(line)
        value = item['value']
        if item['key'] == 'header':
          message = value['summary']
        elif item['key'] == 'file':
          files[value['path']] = base64.b64decode(value['content'])
        elif item['key'] in ('deletedFile', 'deletedFolder'):
          files[value['path']] = None
        else:
          return self._error(400, 'BadRequest', f'unsupported operation {item["key"]}')
      sha = repo.commit(revision, files, message)
      prefix = '' if kind == 'model' else f'{kind}s/'
      self._json({'commitUrl': f'{hub.url}/{prefix}{repo_id}/commit/{sha}', 'commitOid': sha,
                  'pullRequestUrl': None})

    def _tag(self, kind, repo_id, revision, request):
      repo = self._repo(kind, repo_id)
      sha = repo and self._sha(repo, revision)
      if not sha:
        return
      if request['tag'] in repo.tags:
        return self._error(409, 'TagExists', f'tag {request["tag"]} already exists')
      repo.tags[request['tag']] = sha
      self._json({})

    def _branch(self, kind, repo_id, branch, request):
      repo = self._repo(kind, repo_id)
      sha = repo and self._sha(repo, request.get('startingPoint') or 'main')
      if not sha:
        return
      if branch in repo.branches:
        return self._error(409, 'BranchExists', f'branch {branch} already exists')
      repo.branches[branch] = sha
      self._json({})

  return Handler


if __name__ == '__main__':
  with HubServer(int(sys.argv[1])) as server:
    print(server.url, flush=True)
    threading.Event().wait()
