"""bert_jax: BERT pre-training and fine-tuning in JAX and Flax, from a laptop CPU to a TPU pod.

  config, params = bert_jax.load_pretrained(path)   # Hugging Face, Google TF or bert_jax
  sequence_output, pooled_output = bert_jax.encode(config, params, input_ids, input_mask,
                                                   segment_ids)

Modules are flat, one per concern, in layers that import downwards only (README, "How the code
is organised"; tests/imports_test.py): `cli.py` and `aot.py`; the drivers `train.py` and
`finetune.py`; the commands that use a model; the fine-tuning tasks (`task_table.py`); training
(`train_state.py`); weights and checkpoints; the model; the data; what is trained
(`objectives.py`, `tasks.py`); and the foundations (`config_files`, `defaults`, `fileio`).
"""

import os

# TensorFlow's Cloud Storage file system trusts what it stat-ed for 5 s, but bert_jax also writes
# objects through google-cloud-storage (metrics.jsonl rows, the workdir lock) and other hosts
# write the same workdir: a stale size silently cuts a read short. Read when TensorFlow is
# imported, hence here, before any module of the package can import it.
os.environ.setdefault('GCS_STAT_CACHE_MAX_AGE', '0')

__version__ = '0.1.0'
__all__ = ['BertConfig', 'config_for_size', 'encode', 'load_pretrained']

# The public names load on first use: `import bert_jax.cli` (the `bert-jax` command) imports
# this package first, and JAX and Flax, which they need, take seconds to import; the command
# listens for SIGTERM and Ctrl-C before it imports them, and `bert-jax --help` answers at once.
_LAZY = {'load_pretrained': 'bert_jax.pretrained', 'BertConfig': 'bert_jax.model',
         'config_for_size': 'bert_jax.model', 'encode': 'bert_jax.model'}


def __getattr__(name: str):
  if name not in _LAZY:
    raise AttributeError(f'module {__name__!r} has no attribute {name!r}')
  import importlib  # pylint: disable=g-import-not-at-top
  value = getattr(importlib.import_module(_LAZY[name]), name)
  globals()[name] = value
  return value


def __dir__() -> list[str]:
  return sorted(set(globals()) | set(__all__))
