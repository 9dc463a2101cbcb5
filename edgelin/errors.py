"""Typed errors. Torch-free: the runtime raises these too.

Every error raised at a public boundary is an ``EdgelinError``; its message is one line that says
what is wrong and what to do. The CLI prints it and exits with status 2.
"""


class EdgelinError(Exception):
    """Base class: bad input that the user can fix."""


class ConfigError(EdgelinError, ValueError):
    """A model configuration value is invalid."""


class CheckpointError(EdgelinError):
    """A checkpoint folder is missing, corrupt, or does not match its config."""


class UnsupportedCheckpoint(CheckpointError):
    """A well-formed checkpoint of a family, or with an option, that edgelin does not export; the message names
    the blocker and the next step."""


class ExportError(EdgelinError):
    """An export could not be produced or is not a valid edgelin export."""


class ManifestError(EdgelinError):
    """An export's manifest (edgelin.json) is missing, malformed, or disagrees with the graphs."""


class RuntimeInputError(EdgelinError, ValueError):
    """Bad input to the runtime: token ids, shapes, states, options."""


class ProviderError(EdgelinError):
    """An execution provider was requested but is not really active."""


class OutputError(EdgelinError, OSError):
    """An output path cannot be written, or writing it would replace something edgelin did not write.

    Also an ``OSError``, so code that caught the write failure before still catches it.
    """


class NonFiniteError(EdgelinError, ValueError):
    """A weight, state or logit is NaN or infinite where a finite number is needed."""
