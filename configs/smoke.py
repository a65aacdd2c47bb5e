"""Smoke configuration: a tiny BERT pre-trained on the built-in sample corpus, on a CPU.

  bert-jax pretrain --config=configs/smoke.py --workdir=/tmp/bert_smoke

Trains an 8k WordPiece vocabulary from the sample corpus (the running Python's documentation)
if `data.vocab_file` is empty, then a few hundred steps of a 2-layer, 128-wide BERT.
"""

from bert_jax import defaults


def get_config():
  config = defaults.pretrain()
  config.model.size = 'tiny'
  config.model.scan_layers = False
  config.data.max_seq_length = 64
  config.data.max_predictions_per_seq = 10
  config.data.shuffle_buffer = 1000
  config.train.phases = ''
  config.train.steps = 300
  config.train.batch_size = 32
  config.train.learning_rate = 1e-3
  config.train.warmup_steps = 30
  config.checkpoint.every_steps = 100
  config.eval.every_steps = 100
  config.eval.steps = 10
  config.eval.batch_size = 32
  config.log.every_steps = 20
  return config
