"""Fine-tuning on SQuAD v1.1 (`:v1`) or v2.0 (`:v2`) with the paper's settings.

  bert-jax finetune --config=configs/finetune_squad.py:v1 \
      --config.train.init_checkpoint=/ckpt/uncased_L-12_H-768_A-12 \
      --config.task.data_dir=/data/squad --workdir=/tmp/squad_v1

task.data_dir holds the official files train-v1.1.json and dev-v1.1.json (v2: train-v2.0.json
and dev-v2.0.json), or name them with --config.task.train_file / --config.task.predict_file.
Windows of 384 tokens, 128 apart, questions cut to 64 tokens; the loss is the mean of the start
and end cross-entropies. After each epoch the dev set is decoded (20-best, answers up to 30
tokens) and scored with the official EM/F1; predictions.json (v2 also null_odds.json) of the best
epoch are written to <workdir>/predictions/.
"""

from bert_jax import defaults
from bert_jax import errors

# version: (task, epochs, learning rate, batch size), from the paper (sections 4.2 and 4.3).
_VERSIONS = {
    'v1': ('squad_v1', 3, 5e-5, 32),  # "3 epochs with a learning rate of 5e-5 and batch 32".
    'v2': ('squad_v2', 2, 5e-5, 48),  # "2 epochs with a learning rate of 5e-5 and batch 48".
}


def get_config(version: str = 'v1'):
  if version not in _VERSIONS:
    raise errors.UserError(f'--config=finetune_squad:{version}: no such version; expected one '
                           f'of {", ".join(sorted(_VERSIONS))}')
  task, epochs, lr, batch = _VERSIONS[version]
  config = defaults.finetune(task)
  config.train.epochs = epochs
  config.train.learning_rate = lr
  config.train.batch_size = batch
  config.eval.batch_size = 64
  config.data.max_seq_length = 384
  config.data.buckets = (128, 256, 384)
  with config.unlocked():  # SQuAD's own keys.
    # Official JSON files; '' = <data_dir>/train-v1.1.json, dev-v1.1.json (v2: -v2.0).
    config.task.train_file = ''
    config.task.predict_file = ''
    # Distance between the starts of neighbouring windows over a long context, in tokens.
    config.task.doc_stride = 128
    config.task.max_query_length = 64
    config.task.n_best_size = 20
    config.task.max_answer_length = 30
    # v2.0: answer '' when the null score beats the best span by more than this (tune on dev:
    # metrics report best_f1_thresh).
    config.task.null_score_diff_threshold = 0.0
  return config
