"""Post-training objectives that need more than one forward per row: preference
optimization on chosen/rejected pairs (preference.py, pairs.py)."""
