"""The error every capture collector and the draft registry raise for input that does not fit."""

__all__ = ["AuxCaptureError"]


class AuxCaptureError(ValueError, RuntimeError):
    """A capture does not fit: wrong count, shape, dtype, device or buffer.

    Subclasses both ValueError (bad input) and RuntimeError (what SGLang's packer raises
    from ``finalize``), so callers written against either keep working.
    """
