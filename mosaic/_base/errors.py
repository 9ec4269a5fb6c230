"""One error family for everything mosaic refuses.

The command line maps :class:`MosaicError` to one ``mosaic: error: ...`` line and exit status 2, and
:class:`VerificationError` to exit status 1; nothing else reaches a user as a traceback. Each message
names the file, key, tensor or recipe field at fault and, where it helps, what to do next.
"""

from __future__ import annotations


class MosaicError(Exception):
    """Bad input or a refused command: exit status 2."""

    exit_code = 2


class FormatError(MosaicError):
    """A file does not follow its format (safetensors, JSON index, config)."""


class SafetensorsError(FormatError):
    """A safetensors file breaks one rule of the format; ``rule`` names which."""

    def __init__(self, path: object, rule: str, detail: str, key: str | None = None) -> None:
        self.path = str(path)
        self.rule = rule
        self.key = key
        where = f"{self.path}" + (f": tensor {key!r}" if key is not None else "")
        super().__init__(f"{where}: {rule}: {detail}")


class CheckpointError(MosaicError):
    """A folder is not a usable checkpoint (missing shards, index and headers disagree, unsafe names)."""


class RecipeError(MosaicError):
    """The recipe is invalid; the message names the recipe field."""


class SourceError(MosaicError):
    """A source named by the recipe cannot be found or is incompatible with the others."""


class OutputError(MosaicError):
    """The output folder cannot be written (exists without --force, no space, unwritable parent)."""


class SigningError(MosaicError):
    """A key, a passphrase or the signing options are wrong, or the signer failed: exit 2."""


class VerificationError(MosaicError):
    """What was written is not what was planned: exit status 1."""

    exit_code = 1


class HostError(MosaicError):
    """The machine refused an operation (a full disk, a permission, a file gone): exit status 2.

    The public functions raise it in place of the :class:`OSError`, chained as its ``__cause__``, so that a
    release script catches every failure with one ``except MosaicError``; the message is the command line's."""

    @classmethod
    def wrap(cls, e: OSError) -> HostError:
        where = f"{e.filename}: " if e.filename else ""
        return cls(f"{where}{e.strerror or e}")
