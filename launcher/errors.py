"""The user-facing errors, under the name most of the package and its users import them by; they are defined in
:mod:`parastream.core.errors`, the layer that rewrite, pipeline and launcher share."""

from parastream.core.errors import BackendUnavailable, ParastreamError, VerificationError

__all__ = ["BackendUnavailable", "ParastreamError", "VerificationError"]
