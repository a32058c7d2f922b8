"""PyTorch side: tensor ops backend, Horovod torch collectives, DistributedOptimizer."""
