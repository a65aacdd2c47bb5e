"""BERT-base for speed on TPUs: the paper's recipe with fused splash attention.

  bert-jax pretrain --config=configs/bert_base_tpu_speed.py --workdir=gs://BUCKET/bert_base \
      --config.data.input='gs://BUCKET/corpus/*.txt' --config.data.vocab_file=gs://BUCKET/vocab.txt

Ahead-of-time check of the compiled step for a slice (on any machine):

  bert-jax compile --config=configs/bert_base_tpu_speed.py --topology=v5e:4x4

bert_base.py (the file beside this one) with two choices changed: rows packed with whole
sequences instead of padding (data.packing), and no attention dropout
(model.attention_probs_dropout_prob=0, as RoBERTa-era recipes and MosaicBERT train), because the
fused kernel has none; hidden dropout stays 0.1. Attention then runs as Pallas splash attention
(model.attention_impl='splash'), each packed sequence its own segment, never materializing the
[batch, heads, T, T] scores.
"""

import os

from bert_jax import config_files


def get_config():
  # The schedule and model of bert_base.py: 1M steps of 256 sequences, 90% at 128 tokens.
  config = config_files.load_config(
      os.path.join(os.path.dirname(os.path.abspath(__file__)), 'bert_base.py'))
  # Several whole sequences per row instead of padding (README, "Packing").
  config.data.packing = True
  # The fused kernel has no attention dropout (README, "Attention").
  config.model.attention_probs_dropout_prob = 0.0
  config.model.attention_impl = 'splash'
  return config
