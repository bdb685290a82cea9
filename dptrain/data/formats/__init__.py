"""Dataset formats read from files, one module each, and what they share (``common.py``).

``imagefolder`` (your own images), ``mnist`` (IDX), ``cifar10`` (python or binary batches),
``fer2013`` (CSV) and ``packed`` (ours: raw ``.npy`` files and a JSON header, memory-mapped).
Each module's docstring says which files it reads; every error about a file is one line
naming the file.
"""
