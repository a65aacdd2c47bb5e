"""A built-in sample corpus: the running Python's own documentation, in BERT's text format.

`sample_corpus_path()` writes it once and returns its path. The text is the help topics of
`pydoc_data.topics` and the docstrings of the standard-library modules (module, class and
function docstrings), one document each, one sentence a line, a blank line between documents.
It needs no download, is a few MB and is the same on every run of the same Python, which is
what smoke runs, tests and benchmarks need. Modules are imported in a child interpreter so
that their import-time side effects never reach the caller.
"""

import importlib
import importlib.util
import inspect
import os
import pkgutil
import re
import subprocess
import sys
import tempfile
import warnings

# Bump when the format or the selection changes, so cached files are rebuilt.
_VERSION = 1
# Imported for their side effects (a browser, a printed poem, a GUI), or test suites.
_SKIP_MODULES = frozenset({'__main__', 'antigravity', 'this', 'idlelib', 'turtledemo', 'test',
                           'pydoc_data'})
# Stop collecting past this many characters; the corpus is meant for smoke runs.
_MAX_CHARS = 6_000_000
_SENTENCE_END = re.compile(r'(?<=[.!?])\s+(?=[A-Z0-9"\'(\[`])')


def default_cache_dir() -> str:
  """$BERT_JAX_CACHE, else ~/.cache/bert-jax (a name no `import` can mistake for the
  package)."""
  return os.environ.get('BERT_JAX_CACHE') or os.path.join(
      os.path.expanduser('~'), '.cache', 'bert-jax')


def make_cache_dir(cache_dir: str | None = None) -> str:
  """`cache_dir` (default: `default_cache_dir()`), made if missing; a folder that cannot be made
  or written (a read-only home, BERT_JAX_CACHE naming a file) is a UserError naming it and
  BERT_JAX_CACHE, the way to move it."""
  # Not at the top: this file also runs as a script, under `python -I`, without the package.
  from bert_jax.errors import UserError  # pylint: disable=g-import-not-at-top
  cache_dir = cache_dir or default_cache_dir()
  how = (f'BERT_JAX_CACHE={cache_dir}' if os.environ.get('BERT_JAX_CACHE') == cache_dir
         else f'the cache folder {cache_dir}')
  try:
    os.makedirs(cache_dir, exist_ok=True)
  except OSError as e:
    reason = 'a file is in the way' if isinstance(e, (FileExistsError, NotADirectoryError)) else (
        e.strerror or str(e))
    raise UserError(f'{how}: cannot make this folder ({reason}); set '
                    'BERT_JAX_CACHE to a folder this user can write') from None
  if not os.access(cache_dir, os.W_OK | os.X_OK):
    raise UserError(f'{how}: this folder is not writable by this user; set '
                    'BERT_JAX_CACHE to a folder this user can write')
  return cache_dir


def sample_corpus_path(cache_dir: str | None = None) -> str:
  """Path of the sample corpus, written on first use (atomically) under `cache_dir`."""
  cache_dir = cache_dir or default_cache_dir()
  version = f'{sys.version_info.major}.{sys.version_info.minor}.{sys.version_info.micro}'
  path = os.path.join(cache_dir, f'sample_corpus_python{version}_v{_VERSION}.txt')
  if os.path.exists(path):
    return path
  make_cache_dir(cache_dir)
  fd, tmp = tempfile.mkstemp(dir=cache_dir, prefix='.sample_corpus.', suffix='.tmp')
  os.close(fd)
  try:
    # -I: no user site-packages or PYTHON* variables, so the content is the stdlib's alone.
    subprocess.run([sys.executable, '-I', os.path.abspath(__file__), tmp], check=True,
                   stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                   stderr=subprocess.PIPE, timeout=600)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)  # Atomic: readers never see a partial file.
  except subprocess.CalledProcessError as e:
    raise RuntimeError(f'writing the sample corpus to {path} failed:\n'
                       f'{e.stderr.decode(errors="replace")[-2000:]}') from e
  finally:
    if os.path.exists(tmp):
      os.remove(tmp)
  return path


def split_sentences(text: str) -> list[str]:
  """One entry per sentence: paragraphs split on blank lines, then on '. ' + capital etc."""
  sentences = []
  for paragraph in re.split(r'\n\s*\n', text):
    paragraph = ' '.join(paragraph.split())
    if paragraph:
      sentences.extend(s for s in _SENTENCE_END.split(paragraph) if s)
  return sentences


def _documents():
  """Yields (text) documents in a fixed order: help topics, then module docstrings."""
  import pydoc_data.topics  # pylint: disable=g-import-not-at-top
  topics = pydoc_data.topics.topics
  for name in sorted(topics):
    yield topics[name]
  yield from _module_documents()


def _own_doc(obj) -> str:
  """The object's own docstring, cleaned (inspect.getdoc would inherit a parent's)."""
  doc = getattr(obj, '__doc__', None)
  return inspect.cleandoc(doc) if isinstance(doc, str) else ''


def _module_names():
  """Public standard-library modules and their public submodules, sorted."""
  names = set()
  for name in sys.stdlib_module_names:
    if name.startswith('_') or name in _SKIP_MODULES:
      continue
    names.add(name)
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
      continue
    for info in pkgutil.walk_packages(spec.submodule_search_locations, prefix=name + '.',
                                      onerror=lambda _: None):
      parts = info.name.split('.')
      if any(p.startswith('_') or p in ('test', 'tests', 'idle_test') for p in parts):
        continue
      names.add(info.name)
  return sorted(names)


def _module_documents():
  warnings.simplefilter('ignore')
  for name in _module_names():
    try:
      module = importlib.import_module(name)
    except BaseException:  # pylint: disable=broad-except
      continue  # Platform-specific or broken modules: skip.
    doc = _own_doc(module)
    if doc:
      yield f'{name}. {doc}'
    for attr in sorted(vars(module)):
      obj = vars(module)[attr]
      if attr.startswith('_') or getattr(obj, '__module__', None) != name:
        continue
      if not (inspect.isclass(obj) or inspect.isroutine(obj)):
        continue
      parts = [_own_doc(obj)]
      if inspect.isclass(obj):
        for member in sorted(vars(obj)):
          value = vars(obj)[member]
          if not member.startswith('_') and inspect.isroutine(value):
            parts.append(_own_doc(value))
      text = '\n\n'.join(p for p in parts if p)
      if text:
        yield text


def _write(path: str) -> None:
  total = 0
  with open(path, 'w', encoding='utf-8') as f:
    for doc in _documents():
      sentences = split_sentences(doc)
      if not sentences:
        continue
      text = '\n'.join(sentences) + '\n\n'
      f.write(text)
      total += len(text)
      if total >= _MAX_CHARS:
        break


if __name__ == '__main__':
  _write(sys.argv[1])
