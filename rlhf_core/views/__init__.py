"""How results are shown: the report's page layout, HTML views of measurements and plots. No
training stage imports this package, so that an edit here re-runs none of them.
"""
