"""Imported by exllamav2 as the sign of flash-attn's compiled kernels; the stand-in's
kernels are ``flash_attn``'s pure-torch functions (see flash_attn/__init__.py)."""
