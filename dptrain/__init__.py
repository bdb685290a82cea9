"""dptrain: data-parallel training of convolutional networks on our own CUDA kernels."""
__version__ = "0.1.0"
