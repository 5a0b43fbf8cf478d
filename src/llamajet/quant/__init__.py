"""Quantization: named weight formats, packing, and (later) PTQ/QAT methods."""
