import os

# torch's thread count (one, unless a test is marked all_threads): the root conftest.py
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
