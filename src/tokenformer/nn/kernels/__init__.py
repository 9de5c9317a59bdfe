"""The implementations of a Pattention and the one function that picks among them:
:func:`tokenformer.nn.kernels.dispatch.select_impl` says which backend of
:data:`tokenformer.nn.kernels.backends.BACKENDS` (one shape for all: ``ThetaBackend``) runs for
an (impl, device, dtype, Θ, training or not). What they run: ``fused`` (PyTorch, analytic
backward), ``cpu_theta`` (the C++ CPU kernel), ``triton_theta`` (Triton Θ on CUDA); the
reference formulas are ``nn/theta.py``'s."""
