"""The settings: typed sections and the checks on them, the data settings and the subset files they
name, preset files and ``key=value`` overrides, credentials kept out of settings.
"""
