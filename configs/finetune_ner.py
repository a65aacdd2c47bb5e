"""Fine-tuning for named-entity recognition on CoNLL-2003 (token classification).

  bert-jax finetune --config=configs/finetune_ner.py \
      --config.train.init_checkpoint=/ckpt/cased_L-12_H-768_A-12 \
      --config.task.data_dir=/data/conll2003 --workdir=/tmp/ner

task.data_dir holds train.txt, valid.txt (or dev.txt) and, for --config.eval.predict_test, test.txt:
one word per line with its NER tag in the last column, blank lines between sentences. Each word is
labelled on its first WordPiece; the paper uses a cased model for NER. Entity-level precision,
recall and F1 (seqeval's rules, IOB1 or IOB2) are computed on dev after each epoch, and on
test.txt with the best epoch's weights.

The paper does not list its NER hyperparameters; these are the GLUE recipe with the upper
learning rate of its search range.
"""

from bert_jax import defaults


def get_config():
  config = defaults.finetune('ner')
  config.train.epochs = 3
  config.train.learning_rate = 5e-5
  config.train.batch_size = 32
  config.data.max_seq_length = 128
  with config.unlocked():  # NER's own key.
    # Tags in id order; () = the CoNLL-2003 tags when the data uses only those, else the tags
    # found in train.txt ('O' first, then by type).
    config.task.label_list = ()
  return config
