"""The pagekv proto package."""
