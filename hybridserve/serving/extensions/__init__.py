"""Serving extensions: model-specific request handling, chosen by the checkpoint's model_type."""

from hybridserve.serving.extensions import kimi_k3  # noqa: F401  (registers its extension)
from hybridserve.serving.extensions.base import EXTENSIONS, ServingExtension, extension_for

__all__ = ["EXTENSIONS", "ServingExtension", "extension_for"]
