"""Fine-tuning on SWAG (multiple choice), the paper's recipe (section 4.4).

  bert-jax finetune --config=configs/finetune_swag.py \
      --config.train.init_checkpoint=/ckpt/uncased_L-24_H-1024_A-16 \
      --config.task.data_dir=/data/swag --workdir=/tmp/swag

task.data_dir holds SWAG's train.csv, val.csv and, for --config.eval.predict_test, test.csv (columns
sent1, sent2, ending0..ending3, label), or any n-way choice set as train.jsonl, dev.jsonl,
test.jsonl ({"context", "start", "endings", "label"} per line; --config.task.name=multiple_choice
names it so).
Each choice is '[CLS] sent1 [SEP] sent2 ending [SEP]', scored from the pooled output; a softmax
over the choices is trained with cross-entropy. Dev accuracy after each epoch; predictions
(the chosen ending and every choice's probability) in predictions/dev.jsonl and test.jsonl.

The paper: 3 epochs, learning rate 2e-5, batch size 16 (examples of four sequences each);
BERT-large reached 86.6 dev, 86.3 test accuracy.
"""

from bert_jax import defaults


def get_config():
  config = defaults.finetune('swag')
  config.train.epochs = 3
  config.train.learning_rate = 2e-5
  # Examples per batch (each of four sequences).
  config.train.batch_size = 16
  config.eval.batch_size = 16
  config.data.max_seq_length = 128
  return config
