"""Session setup shared by the test files.

Without a GPU the Triton kernels run under Triton's interpreter, on CPU tensors. Triton
decides between interpreted and compiled when each ``@triton.jit`` function is defined
(its own standard library included, at ``import triton``), so the switch has to be set
here, before any test module imports triton. The rest of the library only launches kernels
on CUDA tensors, so the setting changes nothing for other tests. With a GPU the kernels
stay compiled and the kernel tests run them on CUDA tensors instead.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
