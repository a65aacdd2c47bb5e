"""Tests of bert_jax.sample_corpus: the built-in corpus of Python's own documentation."""

import os

from bert_jax import sample_corpus


def test_sample_corpus_is_written_once_and_deterministic(tmp_path, monkeypatch):
  monkeypatch.setenv('BERT_JAX_CACHE', str(tmp_path / 'env_cache'))
  path = sample_corpus.sample_corpus_path()
  assert path.startswith(str(tmp_path / 'env_cache'))
  assert sample_corpus.sample_corpus_path() == path  # Cached.
  assert os.listdir(tmp_path / 'env_cache') == [os.path.basename(path)]  # No temporary left.
  other = sample_corpus.sample_corpus_path(str(tmp_path / 'other'))
  with open(path, 'rb') as f, open(other, 'rb') as g:
    content = f.read()
    assert content == g.read()  # The same text on every run.
  text = content.decode('utf-8')
  assert len(text) > 1_000_000
  docs = [d for d in text.split('\n\n') if d.strip()]
  assert len(docs) > 2000
  assert text.endswith('\n\n') and '\n\n\n' not in text
  assert all(line == line.strip() and line for d in docs for line in d.split('\n'))
  assert 'The "assert" statement' in text  # pydoc topics...
  assert any(d.startswith('json.') for d in docs)  # ...and module docstrings.


def test_split_sentences():
  text = 'First sentence. Second one!  Third?\n\nNew paragraph\ncontinues here. e.g. this'
  assert sample_corpus.split_sentences(text) == [
      'First sentence.', 'Second one!', 'Third?',
      'New paragraph continues here. e.g. this']  # No break before a lower-case word.
