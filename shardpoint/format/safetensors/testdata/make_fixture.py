"""Writes python_written.safetensors with the reference `safetensors` package.

The C++ tests parse the committed output and check that shardpoint encodes the same header
byte for byte. Regenerate with: python make_fixture.py (needs safetensors and numpy).
Only one __metadata__ pair is used because the reference writer orders metadata keys by hash.

With a path argument it instead loads that file with the reference reader and prints its
tensors, to check that files written by shardpoint open there.
"""
import os
import sys

import numpy as np
from safetensors.numpy import load_file, save_file


def write_fixture(path):
    tensors = {
        "weight": (np.arange(6, dtype=np.float32) * 0.5).reshape(2, 3),
        "bias": np.array([1.0, -2.0, 0.25], dtype=np.float16),
        "ids": np.array([7, 2**40], dtype=np.int64),
        "step": np.array(5, dtype=np.int64),
        "empty": np.zeros((0, 4), dtype=np.uint8),
        "flags": np.array([True, False, True]),
        'name\u00e9"q': np.array([-3], dtype=np.int8),
    }
    save_file(tensors, path, metadata={"note": 'h\u00e9llo "quoted"\n\t\x01'})


def show(path):
    for name, value in sorted(load_file(path).items()):
        print(name, value.dtype, list(value.shape), value.reshape(-1)[:4].tolist())


if __name__ == "__main__":
    if len(sys.argv) > 1:
        show(sys.argv[1])
    else:
        write_fixture(os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                   "python_written.safetensors"))
