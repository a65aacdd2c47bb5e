"""Runs the notebooks in notebooks/ top to bottom, each in a fresh kernel, with their tiny
settings (BERT_JAX_NOTEBOOK_SMOKE=1), and fails on any cell error.

They run in two tests that cover both ways notebooks 2 and 3 find a model, each with a
temporary BERT_JAX_NOTEBOOKS_DIR of its own: 03 on its own (it makes a tiny random checkpoint);
and 01 (pre-training), then 02, which fine-tunes 01's workdir. Two tests, so that `pytest -n 2`
runs them side by side. (`pytest --nbmake notebooks/` also runs them with tiny settings, through
notebooks/conftest.py.)
"""

from importlib import metadata
import os
import subprocess
import sys
import time
import types

import jax  # pylint: disable=unused-import  (before the test's fake Colab: jax looks on import)
import pytest

nbformat = pytest.importorskip('nbformat')
nbclient = pytest.importorskip('nbclient')

_NOTEBOOKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                          'notebooks')
ORDER = ('03_weights_fill_mask_features', '01_pretrain', '02_finetune_glue')
CELL_TIMEOUT_S = 600


def _kernel_env(root: str) -> dict[str, str]:
  env = dict(os.environ, BERT_JAX_NOTEBOOK_SMOKE='1', BERT_JAX_NOTEBOOKS_DIR=root,
             JAX_PLATFORMS='cpu')
  # The notebooks run on the one real CPU device, as on a laptop, not on conftest's 8 fakes.
  flags = [f for f in env.get('XLA_FLAGS', '').split()
           if not f.startswith('--xla_force_host_platform_device_count')]
  env['XLA_FLAGS'] = ' '.join(flags)
  return env


def _run(name: str, root: str, cwd: str) -> tuple[float, int]:
  """Executes notebooks/<name>.ipynb; (seconds, images it displayed). Raises on a cell error."""
  notebook = nbformat.read(os.path.join(_NOTEBOOKS, f'{name}.ipynb'), as_version=4)
  client = nbclient.NotebookClient(notebook, timeout=CELL_TIMEOUT_S, kernel_name='python3',
                                   resources={'metadata': {'path': cwd}})
  start = time.time()
  client.execute(env=_kernel_env(root))
  images = sum('image/png' in output.get('data', {})
               for cell in notebook.cells if cell.cell_type == 'code'
               for output in cell.outputs)
  return time.time() - start, images


def test_notebooks_have_no_outputs_and_the_smoke_switch():
  # Committed clean: outputs would go stale and bloat diffs.
  for name in ORDER:
    notebook = nbformat.read(os.path.join(_NOTEBOOKS, f'{name}.ipynb'), as_version=4)
    nbformat.validate(notebook)
    code = [c for c in notebook.cells if c.cell_type == 'code']
    assert all(not c.outputs and c.execution_count is None for c in code), name
    assert "'google.colab' in sys.modules" in code[0].source, name
    assert 'jax.default_backend()' in code[0].source, name
    assert any('BERT_JAX_NOTEBOOK_SMOKE' in c.source for c in code[:3]), name


def test_colab_install_cell_keeps_the_images_jax(monkeypatch):
  """On Colab the first cell installs bert_jax beside the image's jax and jaxlib (pinned to the
  installed versions, without the [gpu]/[tpu] extra that would replace them), and a failed
  install says what to do."""
  commands, pip_returncode = [], [0]

  def run(args, **unused_kwargs):
    commands.append(list(args))
    return subprocess.CompletedProcess(args, pip_returncode[0] if 'pip' in args else 0)

  monkeypatch.setattr(subprocess, 'run', run)
  monkeypatch.setitem(sys.modules, 'google.colab', types.ModuleType('google.colab'))
  monkeypatch.setattr(sys, 'path', list(sys.path))  # The cell adds the clone to it.
  keep = [f'jax=={metadata.version("jax")}', f'jaxlib=={metadata.version("jaxlib")}']
  url = 'https://example.com/someone/bert_jax.git'
  for name in ORDER:
    notebook = nbformat.read(os.path.join(_NOTEBOOKS, f'{name}.ipynb'), as_version=4)
    install_cell = next(c for c in notebook.cells if c.cell_type == 'code').source
    # No repository named: the cell says where to name it, and clones nothing (it once cloned
    # a placeholder URL).
    monkeypatch.delenv('BERT_JAX_REPO_URL', raising=False)
    commands.clear()
    with pytest.raises(RuntimeError, match='^Set REPO_URL in this cell'):
      exec(install_cell, {})  # pylint: disable=exec-used
    assert not commands, name
    monkeypatch.setenv('BERT_JAX_REPO_URL', url)
    exec(install_cell, {})  # pylint: disable=exec-used
    assert commands[0] == ['git', 'clone', '--depth=1', url, '/content/bert_jax'], name
    pip = [c for c in commands if c[1:4] == ['-m', 'pip', 'install']]
    assert pip == [[sys.executable, '-m', 'pip', 'install', '-q', '-e', '/content/bert_jax',
                    *keep]], name
  pip_returncode[0] = 1
  with pytest.raises(RuntimeError, match='REPLACE_JAX = True'):
    exec(install_cell, {})  # pylint: disable=exec-used


@pytest.mark.parametrize('names', [ORDER[:1], ORDER[1:]], ids=['03', '01_then_02'])
def test_notebooks_run(tmp_path, names):
  root, cwd = tmp_path / 'root', tmp_path / 'cwd'
  cwd.mkdir()
  failures, timings = [], []
  for name in names:
    try:
      seconds, images = _run(name, str(root), str(cwd))
    except Exception as e:  # pylint: disable=broad-except  (a cell error, timeout, dead kernel)
      failures.append(f'{name}: {type(e).__name__}: {e}')
      continue
    timings.append(f'{name} {seconds:.0f} s')
    if not images:
      failures.append(f'{name}: displayed no plot')
  print('notebook run times: ' + ', '.join(timings))
  assert not failures, '\n\n'.join(failures)
