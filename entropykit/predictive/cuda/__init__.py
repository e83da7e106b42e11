"""The predictor's arithmetic on a CUDA device, bit for bit its CPU reference.

What it is: ``affine`` (the conditional model's matrix product, twin of ``_linear``) and
``groupparams`` (a Gaussian / mixture group's (mu, sigma), twin of
``codec.group_distribution``), each one small NVRTC kernel. Importing them needs neither
torch nor CuPy; calling them does.
What it is not: the distribution coder on the device (``rans.cuda.dist``).
"""
