"""The run's report: the learning checks across stages and the report of a run (HTML and markdown)
with its notes.
"""
