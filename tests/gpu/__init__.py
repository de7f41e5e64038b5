"""Multi-rank checks at 2 ranks sharing one GPU ("cuda:gloo"); see conftest.py.

A package (unlike tests/), so its conftest and test modules import as `gpu.*` and never
shadow tests/conftest.py or tests/test_*.py.
"""
