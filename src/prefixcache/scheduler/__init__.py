"""The record loop: records become batches over one prefix, and results come back in input order."""
