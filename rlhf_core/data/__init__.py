"""The data: raw TL;DR or TRL rows read from files or the hub and checked, the data stage's
tokenised and padded datasets (Details 1-6), and that output read back by the stages after it.
"""
