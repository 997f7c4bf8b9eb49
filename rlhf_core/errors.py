"""The errors the command line reports in one line (exit code 2) instead of a traceback.

Defined here, away from the modules that raise them, so that ``rlhf --help`` and the argument
checks load without torch, transformers or datasets; each is re-exported by its module
(``rlhf_core.data.DataError`` is this ``DataError``).
"""

from __future__ import annotations


class DataError(ValueError):
    """Data that cannot be processed; the message names the file (or dataset) and row."""


class ModelSourceError(ValueError):
    """A model or tokenizer source that cannot be resolved (missing package, file or directory)."""


class TrainingError(RuntimeError):
    """Training cannot continue (non-finite loss, incompatible checkpoint)."""
