"""autoplan: automatic parallelization plans for PyTorch training."""
