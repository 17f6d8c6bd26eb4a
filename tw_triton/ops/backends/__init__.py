"""Backends of the codec ops, one module per implementation: ``native`` (the compiled CPU
codec, device type ``cpu``) and ``triton`` (the Triton kernels, ``cuda``, imported lazily).

Each module names its ``DEVICE_TYPE`` and the ops it serves in ``BACKEND``;
:mod:`tw_triton.ops` registers them.
"""
