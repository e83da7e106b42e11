"""A compressed file decoded onto a CUDA device: ``load_file(path, device="cuda")``.

What it is: the host plan of every field's way to the output tensors (``fileplan``), the
staging layout of a group of them (``_staging``), and the loader that stages, copies and
decodes the groups overlapped (``load``, which needs torch and CuPy).
What it is not: the rANS kernel itself (``rans.cuda``) or the CPU reader (``reader.py``).
"""
