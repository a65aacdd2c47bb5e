"""Fine-tuning on a GLUE task with the paper's recipe. The keys every task shares are defined and
commented in `bert_jax.defaults.finetune`; the GLUE-only ones here.

  bert-jax finetune --config=configs/finetune_glue.py:mrpc \
      --config.train.init_checkpoint=/ckpt/uncased_L-12_H-768_A-12 \
      --config.task.data_dir=/data/glue --workdir=/tmp/mrpc

  # The paper's learning-rate search (5e-5, 4e-5, 3e-5, 2e-5; --learning_rates=... for
  # others), one workdir per rate; prints the best dev score and its rate (also sweep.json):
  bert-jax finetune --config=configs/finetune_glue.py:rte ... --sweep

Tasks: cola, sst2, mrpc, stsb (regression), qqp, mnli (dev: matched and mismatched), qnli, rte,
wnli. The recipe (Devlin et al. 2018, section 4.1): batch 32, 3 epochs, AdamW with 10% linear
warmup then linear decay to 0, weight decay 0.01, dropout 0.1, max_seq_length 128, the best of
{5e-5, 4e-5, 3e-5, 2e-5} on dev. The paper leaves WNLI out (always predicts the majority class).
"""

import ml_collections

from bert_jax import defaults


def get_config(task: str = 'mrpc') -> ml_collections.ConfigDict:
  config = defaults.finetune(task)
  with config.unlocked():  # GLUE's own keys.
    # 'tsv': the files of download_glue_data.py under task.data_dir (<data_dir>/MRPC/train.tsv,
    # ...); 'tfds': the prepared TFDS datasets glue/<task> (never downloaded here).
    config.task.data_source = 'tsv'
    # TFDS data directory; '' = TFDS's default.
    config.data.tfds_data_dir = ''
  return config
