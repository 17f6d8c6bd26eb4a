"""Backends of the codec ops, one module per device type: ``cpu`` (the compiled CPU codec of
``native`` where it serves, else the reference) and ``triton`` (the Triton kernels,
``cuda``, imported lazily).

Each module names its ``DEVICE_TYPE`` and the ops it serves in ``BACKEND``;
:mod:`tw_triton.ops` registers them.
"""
