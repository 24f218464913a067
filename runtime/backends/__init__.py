"""Backends behind one small interface (see :mod:`kvforge.runtime.backends.base`).

``ort`` on the CPU is :class:`kvforge.runtime.ort_backend.OrtBackend` (numpy buffers);
``ort`` on CUDA is :mod:`.ort_cuda`, ``tensorrt`` is :mod:`.tensorrt`. The GPU backends import
their libraries lazily, so this package imports on any machine.
"""
