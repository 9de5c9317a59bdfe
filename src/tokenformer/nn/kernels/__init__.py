"""The implementations of a Pattention and the one function that picks among them:
:func:`tokenformer.nn.kernels.dispatch.select_impl` says what runs for a (device, dtype, Θ,
training or not). Backends: ``fused`` (PyTorch, analytic backward), ``cpu_theta`` (the C++ CPU
kernel), ``triton_theta`` (Triton Θ on CUDA); the reference formulas are ``nn/theta.py``'s."""
