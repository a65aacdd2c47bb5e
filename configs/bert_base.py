"""BERT-base as the paper trains it: 1M steps of 256 sequences, 90% at 128 tokens, 10% at 512.

  bert-jax pretrain --config=configs/bert_base.py --workdir=gs://BUCKET/bert_base \
      --config.data.input='gs://BUCKET/corpus/*.txt' --config.data.vocab_file=gs://BUCKET/vocab.txt

AdamW (0.9, 0.999, eps 1e-6), peak lr 1e-4 after 10,000 warmup steps, linear decay to 0,
weight decay 0.01 (not on LayerNorm and biases), clipping at global norm 1.0, dropout 0.1.
"""

from bert_jax import defaults


def get_config():
  config = defaults.pretrain()
  config.model.size = 'base'
  config.data.input = ''  # Required: the pre-training corpus (see the docstring).
  config.data.max_seq_length = 128
  config.data.max_predictions_per_seq = 20
  config.train.steps = 1_000_000
  config.train.batch_size = 256
  config.train.learning_rate = 1e-4
  config.train.warmup_steps = 10_000
  config.train.phases = '0.9:128:20,0.1:512:80'
  return config
