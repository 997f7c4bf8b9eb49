"""The errors the command line reports in one line (exit code 2) instead of a traceback.

Defined here, away from the modules that raise them, so that ``rlhf --help`` and the argument
checks load without torch, transformers or datasets; each is re-exported by its module
(``rlhf_core.data.prepare.DataError`` is this ``DataError``, ``rlhf_core.config.settings.ConfigError`` this
``ConfigError``). :class:`BadRow`, one data row that fails validation, lives here too, so that
the hub reader and the row checks share it without importing each other.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration that cannot be loaded: unknown key, wrong type, missing preset."""


class DataError(ValueError):
    """Data that cannot be processed; the message names the file (or dataset) and row."""


class HubUnreachable(DataError):
    """The Hugging Face hub cannot be reached (no network, or ``HF_HUB_OFFLINE``) and its local
    cache lacks what was asked for; the message names the dataset and the revision."""


class ModelSourceError(ValueError):
    """A model or tokenizer source that cannot be resolved (missing package, file or directory)."""


class TrainingError(RuntimeError):
    """Training cannot continue (non-finite loss, incompatible checkpoint)."""


class ForeignFilesError(FileExistsError):
    """An output directory holds what the command did not write: replacing it, or writing into
    it, could lose the user's files, so the command stops before changing anything. The message
    names the directory, the entries that are not the command's own, and what to do."""


class BadRow(Exception):
    """One row that fails validation. ``reason`` is a short key such as ``empty_field:post``."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}{': ' + detail if detail else ''}")
        self.reason = reason
        self.detail = detail
