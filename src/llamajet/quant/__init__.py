"""Quantization above the model: the `llamajet quantize` command (quantize.py)
and, later, the PTQ / QAT algorithms. Weight formats, packing and the saved
format are the formats layer's (formats/)."""
