"""Engines: one small interface (``Engine``) and its implementations.

Import an implementation through ``load_engine`` so that heavy libraries (llama.cpp,
exllamav2 and its CUDA build) are imported only by the worker that uses them.
"""
