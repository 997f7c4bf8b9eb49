"""Measurements: the statistics of win rates, intervals and agreement, and measurements of the
summaries' text.
"""
