"""PageKV wire contract and its generated Python code."""
