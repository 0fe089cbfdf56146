"""Thin train / inference engines implementing the seed engine API on top of awex_fast.

``python_engines.api`` holds the abstract engines and structs; ``python_engines.train`` the
FSDP2 (+TP) training engine. Sub-packages are imported explicitly, so that importing the API does
not pull in transformers.
"""
