"""Coder-independent machinery shared by the rANS and tANS coders.

``tables``: symbol histograms, frequency quantization and the compact table encoding.
``frame``: the self-describing frame (header, table, chunk directory, payloads) and the
chunk-parallel encode/decode driver. Neither module knows how a chunk's payload is coded.
"""
