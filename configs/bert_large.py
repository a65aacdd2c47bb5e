"""BERT-large as the paper trains it (same schedule as BERT-base).

  bert-jax pretrain --config=configs/bert_large.py --workdir=gs://BUCKET/bert_large \
      --config.data.input='gs://BUCKET/corpus/*.txt' --config.data.vocab_file=gs://BUCKET/vocab.txt

Ahead-of-time check that the step fits a pod slice (on any machine):

  bert-jax compile --config=configs/bert_large.py --topology=v5e:4x4
"""

from bert_jax import defaults


def get_config():
  config = defaults.pretrain()  # BERT-base's recipe (see bert_base.py).
  config.model.size = 'large'
  config.data.input = ''  # Required: the pre-training corpus (see the docstring).
  # Keep the matmul outputs, recompute the rest in the backward pass: without it the step of
  # the paper's batch (16 sequences per chip on v5e:4x4) needs ~30 GiB of temporaries per
  # 16 GiB chip; with it 5.95 GiB per chip at 128 tokens (XLA FLOPs 1.03x the analytic count)
  # and 15.6 GiB at 512 (1.19x: attention is recomputed). On chips with room (v5p, H100) set
  # model.remat_policy=none.
  config.model.remat_policy = 'dots'
  return config
