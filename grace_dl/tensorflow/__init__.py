"""TensorFlow side: tensor ops backend, Horovod TF collectives, tape and Keras glue."""
