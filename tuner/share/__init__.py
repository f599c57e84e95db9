"""Sharing auto-tune results over a Hugging Face dataset repo: a record per result, look-ups, search seeds."""
