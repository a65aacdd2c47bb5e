"""`pytest --nbmake notebooks/` runs the notebooks with their tiny settings, in a temporary
directory (tests/notebooks_test.py does the same from the test suite). Run without -n: notebooks
2 and 3 look for the model that notebook 1 trains."""

import os
import tempfile

os.environ.setdefault('BERT_JAX_NOTEBOOK_SMOKE', '1')
os.environ.setdefault('BERT_JAX_NOTEBOOKS_DIR', tempfile.mkdtemp(prefix='bert_jax_notebooks_'))
