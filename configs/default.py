"""Default pre-training configuration: BERT-base with the paper's recipe. Every key is defined
and commented in `bert_jax.defaults.pretrain`.

Variants (`smoke.py`, `bert_base.py`, `bert_large.py`, `lamb_large_batch.py`) start from
`defaults.pretrain()` too and override; so can a config file of your own, anywhere on disk. Run:

  bert-jax pretrain --config=configs/default.py --workdir=/tmp/bert_default

Any key can be overridden on the command line, e.g. `--config.train.learning_rate=5e-5`; the
config is locked, so a misspelt key is an error.
"""

import ml_collections

from bert_jax import defaults


def get_config() -> ml_collections.ConfigDict:
  """Returns the base configuration (BERT-base, the paper's recipe)."""
  return defaults.pretrain()
