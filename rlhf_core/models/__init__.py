"""Models and tokenizers: where they are read from, base models and tokenizers imported from their
sources, and saved models loaded and saved with dropout off.
"""
