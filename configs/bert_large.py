"""BERT-large as the paper trains it (same schedule as BERT-base).

  bert-jax pretrain --config=configs/bert_large.py --workdir=gs://BUCKET/bert_large \
      --config.data.input='gs://BUCKET/corpus/*.txt' --config.data.vocab_file=gs://BUCKET/vocab.txt

Ahead-of-time check that the step fits a pod slice (on any machine):

  bert-jax compile --config=configs/bert_large.py --topology=v5e:4x4
"""

from configs import bert_base


def get_config():
  config = bert_base.get_config()
  config.model.size = 'large'
  return config
